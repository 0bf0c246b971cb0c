// The r3 command as a user runs it: make-model, generate (routes of shape [S-1, L_moe, K] with
// valid ids, bad input lines reported with their line number), --help on every verb.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "routes/route_array.h"
#include "test_models.h"

namespace r3::testing {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int code;
  std::string out;
};

CliRun run_prefixed(const std::string& prefix, const std::string& args) {
  std::string cmd = prefix + std::string(R3_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

CliRun run(const std::string& args) { return run_prefixed("", args); }

CliRun run_with_env(const std::string& env, const std::string& args) {
  return run_prefixed(env + " ", args);
}

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("r3_cli_" + std::to_string(getpid())) / name;
  fs::create_directories(d);
  return d;
}

TEST(Cli, GenerateReturnsRoutesOfShapeSMinusOne) {
  const std::string model = test_model("qwen3_moe");
  fs::path d = temp_dir("gen");
  std::ofstream(d / "in.jsonl")
      << R"({"prompt_token_ids":[1,5,9,33],"max_tokens":5,"temperature":0,"ignore_eos":true,"return_routed_experts":true,"return_routed_expert_weights":true})"
      << "\n\n"
      << R"({"prompt_token_ids":[7],"max_tokens":1,"temperature":1,"seed":3,"return_routed_experts":true})"
      << "\n";
  CliRun r =
      run("generate --model " + model + " --input " + (d / "in.jsonl").string() + " --output " +
          (d / "out.jsonl").string() + " --routes-dir " + (d / "routes").string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(d / "out.jsonl");
  std::string line;
  int index = 0;
  const int sizes[] = {4 + 5, 1 + 1};
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["index"], index);
    const int S = sizes[index];
    EXPECT_EQ(int(j["prompt_token_ids"].size() + j["token_ids"].size()), S);
    EXPECT_EQ(j["logprobs"].size(), j["token_ids"].size());
    RouteArray routes = routes_from_json(j["routed_experts"]);
    EXPECT_EQ(routes.rows, S - 1);
    EXPECT_EQ(routes.layers, 2);
    EXPECT_EQ(routes.k, 2);
    EXPECT_EQ(routes.moe_layers, (std::vector<int>{0, 1}));
    for (int16_t id : routes.data) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 8);
    }
    // Gate weights where the line asked (the first): one per id, top-2 renormalised (Qwen3-MoE).
    if (index == 0) {
      const std::vector<float> w = route_weights_from_json(j["routed_expert_weights"]);
      ASSERT_EQ(w.size(), routes.data.size());
      for (size_t i = 0; i < w.size(); i += 2) EXPECT_NEAR(w[i] + w[i + 1], 1.f, 1e-5f);
    } else {
      EXPECT_FALSE(j.contains("routed_expert_weights"));
    }
    // The .npy export holds the same array.
    RouteArray npy = read_npy((d / "routes" / (std::to_string(index) + ".npy")).string());
    EXPECT_EQ(npy.data, routes.data);
    ++index;
  }
  EXPECT_EQ(index, 2);
}

// A kernel set the CPU cannot run, or no set at all, stops the command before it reads weights.
TEST(Cli, BadKernelSetIsRefusedWithTheReason) {
  const std::string model = test_model("qwen3_moe");
  fs::path d = temp_dir("kernels");
  std::ofstream(d / "in.jsonl") << R"({"prompt_token_ids":[1,5],"max_tokens":1})"
                                << "\n";
  const std::string args = "generate --model " + model + " --input " + (d / "in.jsonl").string() +
                           " --output " + (d / "out.jsonl").string();
  CliRun r = run_with_env("R3_KERNELS=sse9", args);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("R3_KERNELS=sse9: unknown kernel set"), std::string::npos) << r.out;
  r = run_with_env("R3_KERNELS=portable", args);
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(Cli, GenerateLogprobsRoundTripExactly) {
  const std::string model = test_model("olmoe");
  fs::path d = temp_dir("lp");
  std::ofstream(d / "in.jsonl") << R"({"prompt_token_ids":[3,4,5],"max_tokens":4,"seed":11})"
                                << "\n";
  CliRun a = run("generate --model " + model + " --input " + (d / "in.jsonl").string() +
                 " --output " + (d / "a.jsonl").string());
  CliRun b =
      run("generate --model " + model + " --input " + (d / "in.jsonl").string() + " --output " +
          (d / "b.jsonl").string() + " --overlap-scheduler --max-num-batched-tokens 2");
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_EQ(b.code, 0) << b.out;
  std::ifstream fa(d / "a.jsonl"), fb(d / "b.jsonl");
  std::string la, lb;
  std::getline(fa, la);
  std::getline(fb, lb);
  EXPECT_EQ(la, lb);  // same bits printed, whatever the schedule
  auto j = nlohmann::json::parse(la);
  for (auto& v : j["logprobs"]) {
    const double x = v.get<double>();
    EXPECT_EQ(double(float(x)), x);  // printed floats parse back to the same float
  }
}

// Lines without a seed draw a fresh one each (a temperature-1 batch of one prompt differs);
// seeded lines repeat exactly.
TEST(Cli, GenerateUnseededLinesDiffer) {
  const std::string model = test_model("olmoe");
  fs::path d = temp_dir("seeds");
  {
    std::ofstream in(d / "in.jsonl");
    for (int i = 0; i < 6; ++i)
      in << R"({"prompt_token_ids":[3,4,5],"max_tokens":12,"ignore_eos":true})"
         << "\n";
  }
  CliRun a = run("generate --model " + model + " --input " + (d / "in.jsonl").string() +
                 " --output " + (d / "a.jsonl").string());
  ASSERT_EQ(a.code, 0) << a.out;
  std::ifstream fa(d / "a.jsonl");
  std::set<std::string> distinct;
  for (std::string line; std::getline(fa, line);)
    distinct.insert(nlohmann::json::parse(line)["token_ids"].dump());
  EXPECT_GT(distinct.size(), 1u);
}

TEST(Cli, BadInputLinesNameTheirLine) {
  const std::string model = test_model("mixtral");
  fs::path d = temp_dir("bad");
  auto expect_line_error = [&](const std::string& content, const std::string& needle) {
    std::ofstream(d / "in.jsonl") << content;
    CliRun r = run("generate --model " + model + " --input " + (d / "in.jsonl").string());
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
  };
  expect_line_error("{\"prompt_token_ids\":[1]}\n{not json\n", "in.jsonl:2: malformed JSON");
  expect_line_error("{\"prompt_token_ids\":[1]}\n{\"max_tokens\":3}\n",
                    "in.jsonl:2: missing \"prompt_token_ids\"");
  expect_line_error("{\"prompt_token_ids\":\"hello\"}\n",
                    "in.jsonl:1: \"prompt_token_ids\" must be a list");
  expect_line_error("{\"prompt_token_ids\":[1],\"temperature\":\"hot\"}\n",
                    "in.jsonl:1: \"temperature\" must be a number");
  expect_line_error("{\"prompt_token_ids\":[1, 99999]}\n",
                    "request 0: prompt token 1 is 99999, outside the vocabulary");
  CliRun r = run("generate --model " + model + " --input " + (d / "missing.jsonl").string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("cannot open"), std::string::npos);
  r = run("generate --model " + model + " --bogus 1");
  EXPECT_NE(r.out.find("unknown option --bogus"), std::string::npos);
  r = run("make-model --arch gpt2 --out " + (d / "m").string());
  EXPECT_NE(r.out.find("unknown arch"), std::string::npos);
  r = run("no-such-verb");
  EXPECT_EQ(r.code, 2);
}

TEST(Cli, EveryVerbHasHelp) {
  CliRun top = run("--help");
  EXPECT_EQ(top.code, 0);
  for (const char* verb : {"make-model", "generate", "bench", "align"}) {
    EXPECT_NE(top.out.find(verb), std::string::npos) << verb;
    CliRun r = run(std::string(verb) + " --help");
    EXPECT_EQ(r.code, 0) << verb;
    EXPECT_NE(r.out.find("usage: r3 " + std::string(verb)), std::string::npos) << r.out;
  }
}

TEST(Cli, BenchRunsOnATinyModel) {
  const std::string model = test_model("olmoe");
  fs::path d = temp_dir("bench");
  // Two repetitions: one on each build of the engine pair.
  CliRun r =
      run("bench --model " + model + " --reps 2 --decode-tokens 4 --prefill-tokens 64 --json " +
          (d / "b.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(std::ifstream(d / "b.json"));
  ASSERT_EQ(j.size(), 6u);  // the default suite
  std::vector<std::string> names;
  for (auto& e : j) names.push_back(e["name"]);
  EXPECT_EQ(names, (std::vector<std::string>{"decode_b1", "decode_b8", "decode_b32", "prefill_2k",
                                             "mixed_rollout", "weight_sync"}));
  for (auto& e : j) {
    if (e["name"] == "weight_sync") {
      EXPECT_GT(e["memory_s"].get<double>(), 0);
      EXPECT_GT(e["disk_s"].get<double>(), 0);
      EXPECT_GT(e["weight_bytes"].get<double>(), 0);
      EXPECT_LT(e["rss_mb_released"].get<double>(), e["rss_mb_before_release"].get<double>());
      continue;
    }
    EXPECT_GT(e["tokens_per_s_routes_off"].get<double>(), 0);
    EXPECT_GT(e["tokens_per_s_routes_on"].get<double>(), 0);
    EXPECT_TRUE(e.contains("routes_ratio"));
    EXPECT_GT(e["tokens_per_s_engine_option_off"].get<double>(), 0);
  }
  EXPECT_TRUE(j[0].contains("weight_bandwidth_fraction"));
  EXPECT_TRUE(j[3].contains("flops_fraction"));
}

// One engine at a time (the long entries' KV pools need not fit twice): every mode still measured.
TEST(Cli, BenchSequentialEnginesMeasuresEveryMode) {
  const std::string model = test_model("olmoe");
  fs::path d = temp_dir("bench_sequential");
  CliRun r = run("bench --model " + model +
                 " --suite decode_b1,mixed_rollout --sequential-engines --reps 2 " +
                 "--decode-tokens 4 --json " + (d / "b.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(std::ifstream(d / "b.json"));
  ASSERT_EQ(j.size(), 2u);
  for (auto& e : j) {
    EXPECT_GT(e["tokens_per_s_engine_option_off"].get<double>(), 0) << e.dump();
    EXPECT_GT(e["tokens_per_s_routes_off_spread"]["min"].get<double>(), 0) << e.dump();
    EXPECT_GT(e["tokens_per_s_routes_on_spread"]["min"].get<double>(), 0) << e.dump();
  }
}

// Two routes-on engines stepped in turn, then the routes-off one: every mode measured. The KV pool
// holds mixed_rollout's 32 requests only because their 4 shared 128-token prefixes are counted
// once (144 blocks of 16: 4 x 128 + 32 x (32 + 8 + 16) tokens); the entry keeps its 160-token
// prompts and no run preempts.
TEST(Cli, BenchPairedStepsMeasuresEveryModeWithoutPreemption) {
  const std::string model = test_model("olmoe");
  fs::path d = temp_dir("bench_paired");
  CliRun r =
      run("bench --model " + model + " --suite mixed_rollout,decode_b1 --paired-steps --reps 2 " +
          "--decode-tokens 4 --num-kv-blocks 144 --json " + (d / "b.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("preemptions"), std::string::npos) << r.out;
  auto j = nlohmann::json::parse(std::ifstream(d / "b.json"));
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["prompt_len"], 160) << j[0].dump();
  for (auto& e : j) {
    EXPECT_EQ(e["preemptions"], 0) << e.dump();
    ASSERT_EQ(e["routes_ratio_per_pair"].size(), 2u) << e.dump();  // one per repetition
    EXPECT_GT(e["routes_ratio_per_pair"][1].get<double>(), 0) << e.dump();
    EXPECT_GT(e["tokens_per_s_engine_option_off"].get<double>(), 0) << e.dump();
    EXPECT_GT(e["tokens_per_s_routes_off_spread"]["min"].get<double>(), 0) << e.dump();
    EXPECT_GT(e["tokens_per_s_routes_on_spread"]["min"].get<double>(), 0) << e.dump();
  }
  // One block fewer: the prompts are fitted shorter instead of preempting.
  r = run("bench --model " + model +
          " --suite mixed_rollout --paired-steps --reps 1 --decode-tokens 4 " +
          "--num-kv-blocks 143 --json " + (d / "b.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("mixed_rollout runs 159-token prompts, not 160"), std::string::npos)
      << r.out;
  j = nlohmann::json::parse(std::ifstream(d / "b.json"));
  EXPECT_EQ(j[0]["preemptions"], 0) << j[0].dump();
}

TEST(Cli, BenchRefusesTwoEngineSchedules) {
  const std::string model = test_model("olmoe");
  CliRun r =
      run("bench --model " + model + " --suite decode_b1 --paired-steps --sequential-engines");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("pick one"), std::string::npos) << r.out;
  r = run("bench --model " + model + " --suite decode_b1 --reps 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--reps must be at least 1"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace r3::testing

namespace r3::testing {
namespace {

TEST(Cli, HugeIntegersAreOutOfRangeNotWrapped) {
  const std::string model = test_model("mixtral");
  fs::path d = temp_dir("huge");
  std::ofstream(d / "in.jsonl") << R"({"prompt_token_ids":[18446744073709551615]})"
                                << "\n";
  CliRun r = run("generate --model " + model + " --input " + (d / "in.jsonl").string());
  EXPECT_NE(r.out.find("element 0 is not a valid token id"), std::string::npos) << r.out;
  std::ofstream(d / "in.jsonl") << R"({"prompt_token_ids":[1],"max_tokens":18446744073709551615})"
                                << "\n";
  r = run("generate --model " + model + " --input " + (d / "in.jsonl").string());
  EXPECT_NE(r.out.find("\"max_tokens\" is out of range"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace r3::testing
