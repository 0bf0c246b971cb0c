// Seeded mutations of a tiny checkpoint (header bytes, length field, offsets, dtypes, shapes,
// missing and extra tensors, truncation, config keys and bytes): every load ends in a clear
// r3::Error or in a model whose outputs are bit-identical to the unmutated one's. Mutations of
// tensor values are left out (they make a different model, as do config values that are valid
// and change the description: those only have to run cleanly).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"
#include "engine/engine.h"
#include "model/checkpoint.h"
#include "test_models.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
}

struct Parts {
  json header;
  std::string header_text, data;
};

Parts split(const std::string& file) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(file[size_t(i)])) << (8 * i);
  Parts p;
  p.header_text = file.substr(8, n);
  p.header = json::parse(p.header_text);
  p.data = file.substr(8 + n);
  return p;
}

std::string join(const std::string& header_text, const std::string& data,
                 int64_t length_delta = 0) {
  std::string out(8, '\0');
  const uint64_t n = uint64_t(int64_t(header_text.size()) + length_delta);
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint8_t(n >> (8 * i)));
  return out + header_text + data;
}

std::vector<std::string> tensor_names(const json& h) {
  std::vector<std::string> v;
  for (auto& [k, e] : h.items())
    if (k != "__metadata__") v.push_back(k);
  return v;
}

struct Outcome {
  std::vector<int> tokens;
  std::vector<float> logprobs;
  std::vector<int16_t> routes;
};

Outcome run(const std::string& dir) {
  EngineConfig c;
  c.model = dir;
  c.num_kv_blocks = 16;
  c.threads = 1;
  c.enable_return_routed_experts = true;
  Engine e(c);
  SamplingParams p;
  p.max_tokens = 4;
  p.temperature = 0.f;
  p.ignore_eos = true;
  p.return_routed_experts = true;
  RequestOutput o = e.generate({{3, 4, 5, 6, 7}}, {p})[0];
  return {o.token_ids, o.logprobs, o.routed_experts->data};
}

TEST(CheckpointMutation, ThousandsOfSeededCorruptionsEndInAClearErrorOrTheSameModel) {
  const std::string base = testing::test_model("olmoe", "tiny");
  const fs::path work = fs::temp_directory_path() / ("r3_mutation_" + std::to_string(getpid()));
  fs::remove_all(work);
  fs::create_directories(work);
  const std::string st_bytes = slurp(fs::path(base) / "model.safetensors");
  const std::string cfg_text = slurp(fs::path(base) / "config.json");
  const Parts parts = split(st_bytes);
  const json cfg = json::parse(cfg_text);
  const ModelConfig base_cfg = parse_config(cfg_text, "base");
  const Outcome want = run(base);

  std::mt19937_64 rng(20261201);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const std::vector<std::string> names = tensor_names(parts.header);
  auto any_key = [&](const json& c) {
    auto it = c.begin();
    std::advance(it, uni(0, int64_t(c.size()) - 1));
    return it.key();
  };
  const std::vector<json> odd_values = {json(-1),
                                        json(0),
                                        json(1),
                                        json(2147483647),
                                        json(4294967296ll),
                                        json(-9223372036854775807ll),
                                        json(1e308),
                                        json(-0.5),
                                        json("64"),
                                        json(nullptr),
                                        json::array(),
                                        json::object(),
                                        json(true),
                                        json::array({1, 2})};
  const std::vector<std::string> dtypes = {"F32", "BF16",    "F16",  "F64", "I8",
                                           "U8",  "F8_E4M3", "bf16", ""};
  std::map<std::string, int> errors, same, different_model;
  const int kMutations = 4000;
  for (int m = 0; m < kMutations; ++m) {
    std::string st = st_bytes, cf = cfg_text, kind;
    json h = parts.header;
    const std::string victim = names[size_t(uni(0, int64_t(names.size()) - 1))];
    switch (uni(0, 13)) {
      case 0: {  // one header byte set to anything
        kind = "header byte";
        st[size_t(8 + uni(0, int64_t(parts.header_text.size()) - 1))] = char(uni(0, 255));
        break;
      }
      case 1:
        kind = "length field";
        st = join(parts.header_text, parts.data,
                  uni(0, 1) ? uni(-16, 16) : uni(-int64_t(parts.header_text.size()), 1 << 20));
        break;
      case 2:
        kind = "truncation";
        st.resize(size_t(uni(0, int64_t(st.size()) - 1)));
        break;
      case 3:
        kind = "trailing bytes";
        st += std::string(size_t(uni(1, 64)), char(uni(0, 255)));
        break;
      case 4:
        kind = "entry dropped";
        h.erase(victim);
        st = join(h.dump(), parts.data);
        break;
      case 5: {
        kind = "extra tensor";
        const uint64_t end = parts.data.size();
        h[uni(0, 1) ? "model.layers.0.mlp.experts.0.gate_proj.bias" : "extra.weight"] = {
            {"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {end, end + 16}}};
        st = join(h.dump(), parts.data + std::string(16, '\0'));
        break;
      }
      case 6: {
        kind = "dtype";
        const std::string was = h[victim]["dtype"],
                          now = dtypes[size_t(uni(0, int64_t(dtypes.size()) - 1))];
        // BF16 <-> F16 keeps every size: the same bytes read as other values (a value mutation).
        if ((was == "BF16" && now == "F16") || (was == "F16" && now == "BF16"))
          kind = "dtype reinterpretation";
        h[victim]["dtype"] = now;
        st = join(h.dump(), parts.data);
        break;
      }
      case 7: {
        kind = "shape";
        json& s = h[victim]["shape"];
        switch (uni(0, 3)) {
          case 0:
            s.push_back(1);
            break;
          case 1:
            s[0] = s[0].get<int64_t>() + uni(-2, 2);
            break;
          case 2:
            s = json::array({s[0].get<int64_t>() * (s.size() > 1 ? s[1].get<int64_t>() : 1)});
            break;
          default:
            s = odd_values[size_t(uni(0, int64_t(odd_values.size()) - 1))];
        }
        st = join(h.dump(), parts.data);
        break;
      }
      case 8: {
        kind = "offsets";
        json& o = h[victim]["data_offsets"];
        const int64_t d = uni(1, 64) * (uni(0, 1) ? 1 : -1);
        if (uni(0, 1))
          o = {o[0].get<int64_t>() + d, o[1].get<int64_t>() + d};
        else
          o[size_t(uni(0, 1))] = o[0].get<int64_t>() + d;
        st = join(h.dump(), parts.data);
        break;
      }
      case 9: {
        kind = "rename";
        std::string renamed = victim;
        renamed[size_t(uni(0, int64_t(renamed.size()) - 1))] = char(uni(33, 126));
        json e = h[victim];
        h.erase(victim);
        h[renamed] = e;
        st = join(h.dump(), parts.data);
        break;
      }
      case 10: {
        kind = "config key removed";
        json c = cfg;
        c.erase(any_key(c));
        cf = c.dump();
        break;
      }
      case 11: {
        kind = "config value";
        json c = cfg;
        const std::string key = any_key(c);  // drawn first, as the seeded sequence expects
        c[key] = odd_values[size_t(uni(0, int64_t(odd_values.size()) - 1))];
        cf = c.dump();
        break;
      }
      case 12: {
        kind = "config key added";
        json c = cfg;
        const char* keys[] = {"attention_bias", "sliding_window", "quantization_config",
                              "rope_scaling",   "hidden_act",     "mlp_bias",
                              "layer_types",    "unrelated_key"};
        c[keys[uni(0, 7)]] = odd_values[size_t(uni(0, int64_t(odd_values.size()) - 1))];
        cf = c.dump();
        break;
      }
      default:
        kind = "config byte";
        cf[size_t(uni(0, int64_t(cf.size()) - 1))] = char(uni(0, 255));
        break;
    }
    spit(work / "model.safetensors", st);
    spit(work / "config.json", cf);
    SCOPED_TRACE("mutation " + std::to_string(m) + ": " + kind);
    std::shared_ptr<Checkpoint> ck;
    try {
      ck = Checkpoint::open(work.string());
    } catch (const Error& e) {
      EXPECT_GT(std::string(e.what()).size(), 10u);
      ++errors[kind];
      continue;
    }
    if (!config_differences(base_cfg, ck->config()).empty() || kind == "dtype reinterpretation") {
      // A valid but different description (a config value changed within range): it must run.
      Outcome got = run(work.string());
      EXPECT_EQ(got.tokens.size(), 4u);
      ++different_model[kind];
      continue;
    }
    Outcome got = run(work.string());
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logprobs, want.logprobs);
    EXPECT_EQ(got.routes, want.routes);
    ++same[kind];
  }
  int n_err = 0, n_same = 0, n_diff = 0;
  for (auto& [k, v] : errors) n_err += v;
  for (auto& [k, v] : same) n_same += v;
  for (auto& [k, v] : different_model) n_diff += v;
  std::printf(
      "[ mutations ] %d: %d clear errors, %d identical outputs, %d valid other descriptions\n",
      kMutations, n_err, n_same, n_diff);
  EXPECT_EQ(n_err + n_same + n_diff, kMutations);
  EXPECT_GT(n_err, kMutations / 2);
  fs::remove_all(work);
}

}  // namespace
}  // namespace r3
