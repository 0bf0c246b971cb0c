#include "engine_flags.h"

#include <sstream>

#include "core/error.h"

namespace r3::cli {

void add_engine_flags(Args& a) {
  a.opt("model", "", "checkpoint directory (config.json + safetensors)")
      .opt("tokenizer", "",
           "directory with tokenizer.json (default: the checkpoint's own, when it has one)")
      .opt("max-num-seqs", "32", "requests in flight at once")
      .opt("max-num-batched-tokens", "512", "token budget of one step (prefill is chunked to fit)")
      .opt("block-size", "16", "tokens per KV block")
      .opt("num-kv-blocks", "0", "KV blocks in the pool (0 = as many as fit in --kv-cache-mb)")
      .opt("kv-cache-mb", "1024", "KV memory when --num-kv-blocks is 0")
      .opt("kv-cache-dtype", "auto",
           "KV cache element: auto (fp32 for an fp32 checkpoint, else bf16), bf16 or fp32")
      .flag("enable-prefix-caching", true, "reuse cached KV blocks of shared prompt prefixes")
      .opt("max-state-snapshots", "-1",
           "hybrids (Gated DeltaNet): recurrent-state snapshots kept for prefix hits, each the "
           "state of one request "
           "(-1 = 2 x --max-num-seqs, 0 = none: no prefix hits)")
      .flag("overlap-scheduler", false, "plan step N+1 while step N computes")
      .opt("decode-buckets", "", "pad pure-decode steps to these sizes, e.g. 1,2,4,8,16,32")
      .opt("threads", "0", "compute threads (0 = all cores)")
      .flag("enable-return-routed-experts", false,
            "capture routes so requests can ask for them (asking an engine without it is an error)")
      .opt("eplb-redundant-experts", "0", "physical replicas of the most loaded experts per layer")
      .opt("expert-parallel", "1",
           "ranks sharing the experts: run under mpirun -np N (docs/EXPERT_PARALLEL.md); 1 = one "
           "process")
      .opt("expert-timeout-s", "30",
           "expert parallelism: a rank silent this long fails the engine (requests end with "
           "errors)")
      .opt("speculative-algorithm", "",
           "speculative decoding: NGRAM drafts from each request's own prompt and output, "
           "verified in one forward; outputs and routes stay bit-identical to decoding without "
           "it (docs/ARCHITECTURE.md, Speculative decoding). Not with --overlap-scheduler")
      .opt("speculative-num-draft-tokens", "4", "drafted tokens verified with each decoding token")
      .opt("speculative-ngram-min-match-window-size", "1",
           "NGRAM: the shortest tail of a request matched against its earlier tokens")
      .opt("speculative-ngram-max-match-window-size", "12",
           "NGRAM: the longest tail tried first (the most recent match of the longest wins)")
      .opt("speculative-disable-by-batch-size", "8",
           "steps with more requests decoding than this draft nothing (verifying costs more "
           "than it saves there)");
}

std::vector<int> parse_int_list(const std::string& s, const std::string& flag) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      int v = std::stoi(item, &used);
      if (used != item.size() || v <= 0) throw 0;
      out.push_back(v);
    } catch (...) {
      throw Error("--" + flag + " expects positive integers separated by commas, got \"" + s +
                  "\"");
    }
  }
  return out;
}

EngineConfig engine_config_from(const Args& a) {
  EngineConfig c;
  c.model = a.str("model");
  c.tokenizer = a.str("tokenizer");
  if (c.model.empty()) throw Error("--model DIR is required");
  c.max_num_seqs = int(a.integer("max-num-seqs"));
  c.max_num_batched_tokens = int(a.integer("max-num-batched-tokens"));
  c.block_size = int(a.integer("block-size"));
  c.num_kv_blocks = int(a.integer("num-kv-blocks"));
  c.kv_cache_mb = int(a.integer("kv-cache-mb"));
  c.kv_cache_dtype = a.str("kv-cache-dtype");
  c.enable_prefix_caching = a.on("enable-prefix-caching");
  c.max_state_snapshots = int(a.integer("max-state-snapshots"));
  c.overlap_scheduler = a.on("overlap-scheduler");
  c.decode_buckets = parse_int_list(a.str("decode-buckets"), "decode-buckets");
  c.threads = int(a.integer("threads"));
  c.enable_return_routed_experts = a.on("enable-return-routed-experts");
  c.eplb_redundant_experts = int(a.integer("eplb-redundant-experts"));
  c.expert_parallel = int(a.integer("expert-parallel"));
  c.expert_timeout_s = a.number("expert-timeout-s");
  c.speculative_algorithm = a.str("speculative-algorithm");
  c.speculative_num_draft_tokens = int(a.integer("speculative-num-draft-tokens"));
  c.speculative_ngram_min_match_window_size =
      int(a.integer("speculative-ngram-min-match-window-size"));
  c.speculative_ngram_max_match_window_size =
      int(a.integer("speculative-ngram-max-match-window-size"));
  c.speculative_disable_by_batch_size = int(a.integer("speculative-disable-by-batch-size"));
  return c;
}

}  // namespace r3::cli
