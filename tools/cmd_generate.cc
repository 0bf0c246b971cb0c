#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "core/seconds_since.h"
#include "engine/request_json.h"
#include "engine_flags.h"

namespace r3::cli {

using json = nlohmann::json;

int cmd_generate(int argc, char** argv) {
  Args a(
      "generate",
      "Runs every prompt of a JSONL file through the engine and writes one JSON line per prompt,\n"
      "in input order. Input lines: {\"prompt_token_ids\":[...] or \"prompt\":\"text\", "
      "\"max_tokens\":N,\n"
      "\"temperature\":T, \"top_p\":P, \"top_k\":K, \"seed\":S, \"stop_token_ids\":[...], "
      "\"stop\":[...],\n"
      "\"ignore_eos\":B, \"return_routed_experts\":true, \"routed_experts_start\":N,\n"
      "\"return_routed_expert_weights\":true (routed_expert_weights beside the routes)}; a line "
      "without a\n"
      "seed gets a random one. Text needs a tokenizer (the checkpoint's tokenizer.json or "
      "--tokenizer).\n"
      "Route capture is on when a line asks for routes. Output lines: index, prompt_token_ids,\n"
      "token_ids, text, logprobs, finish_reason, stop_reason, weight_versions, routed_experts,\n"
      "num_cached_tokens, num_preemptions.");
  add_engine_flags(a);
  a.opt("input", "", "prompts, one JSON object per line (required)")
      .opt("output", "-", "output JSONL file (- = stdout)")
      .opt("routes-dir", "", "also write each request's routes as INDEX.npy here")
      .flag("progress", true, "progress bar on a terminal");
  if (!a.parse(argc, argv)) return 0;
  if (a.str("input").empty()) throw Error("r3 generate: --input FILE is required");

  // Parse everything first: a bad line is reported with its number before any work starts.
  std::ifstream in(a.str("input"));
  if (!in) throw Error(a.str("input") + ": cannot open");
  std::vector<ParsedRequest> reqs;
  std::string line;
  int lineno = 0;
  bool any_routes = false;
  std::mt19937_64 fresh_seeds{std::random_device{}()};
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const json j = json::parse(line);
      reqs.push_back(parse_request_json(j));
      // No seed: a fresh random one, so temperature > 0 lines differ (as vLLM and SGLang do).
      if (!j.contains("seed") || j["seed"].is_null()) reqs.back().params.seed = fresh_seeds();
    } catch (const json::exception& e) {
      throw Error(a.str("input") + ":" + std::to_string(lineno) + ": malformed JSON: " + e.what());
    } catch (const Error& e) {
      throw Error(a.str("input") + ":" + std::to_string(lineno) + ": " + e.what());
    }
    any_routes |= reqs.back().params.return_routed_experts;
  }
  EngineConfig cfg = engine_config_from(a);
  if (!a.given("enable-return-routed-experts")) cfg.enable_return_routed_experts = any_routes;
  Engine engine(cfg);
  std::fprintf(stderr, "r3 generate: %s\n", engine.startup().line().c_str());
  std::map<uint64_t, size_t> index_of;
  for (size_t i = 0; i < reqs.size(); ++i) {
    try {
      if (!reqs[i].prompt_text.empty()) {
        if (!engine.tokenizer())
          throw Error(
              "a text prompt needs a tokenizer (the checkpoint has no tokenizer.json; pass "
              "--tokenizer DIR)");
        const std::vector<int32_t> ids = engine.tokenizer()->encode(reqs[i].prompt_text, true);
        reqs[i].prompt.assign(ids.begin(), ids.end());
      }
      index_of[engine.add_request(reqs[i].prompt, reqs[i].params)] = i;
    } catch (const Error& e) {
      throw Error(a.str("input") + ": request " + std::to_string(i) + ": " + e.what());
    }
  }
  const bool bar = a.on("progress") && isatty(fileno(stderr));
  std::vector<std::optional<RequestOutput>> done(reqs.size());
  size_t finished = 0;
  auto t0 = std::chrono::steady_clock::now();
  while (finished < reqs.size()) {
    for (auto& o : engine.step()) {
      if (!o.finished) continue;
      done[index_of.at(o.request_id)] = std::move(o);
      ++finished;
    }
    if (bar) {
      double s = seconds_since(t0);
      auto st = engine.stats();
      std::fprintf(
          stderr, "\r[%-30s] %zu/%zu requests, %.1f tok/s generated",
          std::string(size_t(30 * finished / std::max<size_t>(1, reqs.size())), '#').c_str(),
          finished, reqs.size(), s > 0 ? double(st.generated_tokens) / s : 0.0);
    }
  }
  if (bar) std::fprintf(stderr, "\n");

  std::ofstream file;
  std::ostream* out = &std::cout;
  if (a.str("output") != "-") {
    file.open(a.str("output"));
    if (!file) throw Error(a.str("output") + ": cannot open for writing");
    out = &file;
  }
  const std::string routes_dir = a.str("routes-dir");
  if (!routes_dir.empty()) std::filesystem::create_directories(routes_dir);
  int errors = 0;
  for (size_t i = 0; i < done.size(); ++i) {
    *out << output_to_json(*done[i], int64_t(i)).dump() << "\n";
    if (!done[i]->error.empty()) {
      std::fprintf(stderr, "request %zu: %s\n", i, done[i]->error.c_str());
      ++errors;
    }
    if (!done[i]->routes_error.empty()) {
      std::fprintf(stderr, "request %zu: %s\n", i, done[i]->routes_error.c_str());
      ++errors;
    }
    if (!routes_dir.empty() && done[i]->routed_experts)
      write_npy(routes_dir + "/" + std::to_string(i) + ".npy", *done[i]->routed_experts);
  }
  return errors ? 1 : 0;
}

}  // namespace r3::cli
