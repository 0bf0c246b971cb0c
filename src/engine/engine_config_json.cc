#include "engine/engine_config_json.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace r3 {

using json = nlohmann::json;

std::string engine_config_to_json(const EngineConfig& c) {
  return json{
      {"model", c.model},
      {"tokenizer", c.tokenizer},
      {"block_size", c.block_size},
      {"num_kv_blocks", c.num_kv_blocks},
      {"kv_cache_mb", c.kv_cache_mb},
      {"kv_cache_dtype", c.kv_cache_dtype},
      {"max_num_seqs", c.max_num_seqs},
      {"max_num_batched_tokens", c.max_num_batched_tokens},
      {"enable_prefix_caching", c.enable_prefix_caching},
      {"max_state_snapshots", c.max_state_snapshots},
      {"overlap_scheduler", c.overlap_scheduler},
      {"decode_buckets", c.decode_buckets},
      {"threads", c.threads},
      {"enable_return_routed_experts", c.enable_return_routed_experts},
      {"eplb_redundant_experts", c.eplb_redundant_experts},
      {"eplb_load", c.eplb_load},
      {"expert_parallel", c.expert_parallel},
      {"expert_timeout_s", c.expert_timeout_s},
      {"speculative_algorithm", c.speculative_algorithm},
      {"speculative_num_draft_tokens", c.speculative_num_draft_tokens},
      {"speculative_ngram_min_match_window_size", c.speculative_ngram_min_match_window_size},
      {"speculative_ngram_max_match_window_size", c.speculative_ngram_max_match_window_size},
      {"speculative_disable_by_batch_size", c.speculative_disable_by_batch_size}}
      .dump();
}

EngineConfig engine_config_from_json(const std::string& text) {
  try {
    const json j = json::parse(text);
    EngineConfig c;
    c.model = j.at("model").get<std::string>();
    c.tokenizer = j.at("tokenizer").get<std::string>();
    c.block_size = j.at("block_size").get<int>();
    c.num_kv_blocks = j.at("num_kv_blocks").get<int>();
    c.kv_cache_mb = j.at("kv_cache_mb").get<int>();
    c.kv_cache_dtype = j.at("kv_cache_dtype").get<std::string>();
    c.max_num_seqs = j.at("max_num_seqs").get<int>();
    c.max_num_batched_tokens = j.at("max_num_batched_tokens").get<int>();
    c.enable_prefix_caching = j.at("enable_prefix_caching").get<bool>();
    c.max_state_snapshots = j.at("max_state_snapshots").get<int>();
    c.overlap_scheduler = j.at("overlap_scheduler").get<bool>();
    c.decode_buckets = j.at("decode_buckets").get<std::vector<int>>();
    c.threads = j.at("threads").get<int>();
    c.enable_return_routed_experts = j.at("enable_return_routed_experts").get<bool>();
    c.eplb_redundant_experts = j.at("eplb_redundant_experts").get<int>();
    c.eplb_load = j.at("eplb_load").get<std::vector<std::vector<uint64_t>>>();
    c.expert_parallel = j.at("expert_parallel").get<int>();
    c.expert_timeout_s = j.at("expert_timeout_s").get<double>();
    c.speculative_algorithm = j.at("speculative_algorithm").get<std::string>();
    c.speculative_num_draft_tokens = j.at("speculative_num_draft_tokens").get<int>();
    c.speculative_ngram_min_match_window_size =
        j.at("speculative_ngram_min_match_window_size").get<int>();
    c.speculative_ngram_max_match_window_size =
        j.at("speculative_ngram_max_match_window_size").get<int>();
    c.speculative_disable_by_batch_size = j.at("speculative_disable_by_batch_size").get<int>();
    return c;
  } catch (const json::exception& e) {
    throw Error(std::string("engine config message: ") + e.what());
  }
}

}  // namespace r3
