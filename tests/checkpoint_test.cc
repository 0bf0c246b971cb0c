// Checkpoint loading: make_model -> Checkpoint::open round trips for every architecture, preset
// layout and dtype, make_model determinism, F16 widening, dtype conversions, and one test per
// malformed input (each error must name the file and the tensor or key, and nothing may crash).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/config_json.h"
#include "model/families.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "model/tensor_names.h"
#include "test_models.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ------------------------------------------------------------------------------- helpers

std::string unique_tmp(const std::string& tag) {
  static std::atomic<int> counter{0};
  return (fs::temp_directory_path() / ("r3_checkpoint_test_" + std::to_string(::getpid()) + "_" +
                                       std::to_string(counter++) + "_" + tag))
      .string();
}

struct TmpDir {
  std::string path;
  explicit TmpDir(const std::string& tag) : path(unique_tmp(tag)) { fs::create_directories(path); }
  ~TmpDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& f) const { return (fs::path(path) / f).string(); }
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(bool(f)) << path;
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string u64le(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file from an arbitrary header text and data buffer (no validation at all).
std::string safetensors_bytes(const std::string& header, const std::string& buffer) {
  return u64le(header.size()) + header + buffer;
}

// An independent reader (no r3 code): header JSON and the data buffer.
struct RawFile {
  json header;
  std::string buffer;
};

RawFile raw_read(const std::string& path) {
  std::string s = read_bytes(path);
  EXPECT_GE(s.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(s[size_t(i)])) << (8 * i);
  RawFile r;
  r.header = json::parse(s.substr(8, n));
  r.buffer = s.substr(8 + n);
  return r;
}

void raw_write(const std::string& path, const RawFile& r) {
  write_bytes(path, safetensors_bytes(r.header.dump(), r.buffer));
}

// Removes a tensor's entry and its bytes, moving the later tensors down (a well-formed file
// without that tensor).
void drop_tensor(RawFile& r, const std::string& name) {
  ASSERT_TRUE(r.header.contains(name));
  const uint64_t b = r.header[name]["data_offsets"][0], e = r.header[name]["data_offsets"][1];
  r.header.erase(name);
  r.buffer.erase(size_t(b), size_t(e - b));
  for (auto& [n, entry] : r.header.items()) {
    if (n == "__metadata__") continue;
    auto& off = entry["data_offsets"];
    if (off[0].get<uint64_t>() >= e)
      off = {off[0].get<uint64_t>() - (e - b), off[1].get<uint64_t>() - (e - b)};
  }
}

struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::map<std::string, RawTensor> raw_tensors(const std::string& path) {
  RawFile f = raw_read(path);
  std::map<std::string, RawTensor> out;
  for (auto& [name, e] : f.header.items()) {
    if (name == "__metadata__") continue;
    uint64_t b = e["data_offsets"][0], en = e["data_offsets"][1];
    out[name] = {e["dtype"], e["shape"].get<std::vector<int64_t>>(), f.buffer.substr(b, en - b)};
  }
  return out;
}

// Every tensor view of a loaded model, with its role.
std::vector<std::pair<std::string, const TensorView*>> all_views(const ModelWeights& w) {
  std::vector<std::pair<std::string, const TensorView*>> v = {
      {"embed", &w.embed}, {"final_norm", &w.final_norm}, {"lm_head", &w.lm_head}};
  for (auto& L : w.layers) {
    for (const TensorView* t : {&L.input_norm, &L.post_norm, &L.q, &L.o}) v.push_back({t->name, t});
    if (!w.config.mla)
      for (const TensorView* t : {&L.k, &L.v}) v.push_back({t->name, t});
    for (const TensorView* t : {&L.q_a, &L.q_a_norm, &L.kv_a, &L.kv_a_norm, &L.kv_b})  // MLA
      if (!t->empty()) v.push_back({t->name, t});
    if (!L.q_norm.empty()) v.push_back({"q_norm", &L.q_norm});
    if (!L.k_norm.empty()) v.push_back({"k_norm", &L.k_norm});
    for (const TensorView* t :
         {&L.q_bias, &L.k_bias, &L.v_bias, &L.o_bias, &L.sinks, &L.router_bias, &L.shared.gate,
          &L.shared.up, &L.shared.down, &L.shared_gate})
      if (!t->empty()) v.push_back({t->name, t});
    if (L.moe) {
      v.push_back({"router", &L.router});
      // Fused experts (GPT-OSS) are split into copies: FusedExpertsSplitAsTransformersReadsThem.
      for (auto& e : L.experts)
        for (const TensorView* t : {&e.gate, &e.up, &e.down})
          if (!layer_tensor_names(w.config.arch).fused_experts) v.push_back({t->name, t});
    } else {
      for (const TensorView* t : {&L.dense.gate, &L.dense.up, &L.dense.down})
        v.push_back({t->name, t});
    }
  }
  return v;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected r3::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected r3::Error, nothing was thrown";
  return "";
}

#define EXPECT_ERROR_MENTIONS(stmt, ...)                                             \
  do {                                                                               \
    std::string msg_ = error_of([&] { stmt; });                                      \
    for (const std::string& part_ : std::initializer_list<std::string>{__VA_ARGS__}) \
      EXPECT_NE(msg_.find(part_), std::string::npos)                                 \
          << "message: " << msg_ << "\nmissing: " << part_;                          \
  } while (0)

std::string make(const TmpDir& d, const std::string& arch, const std::string& preset,
                 DType dt = DType::BF16, uint64_t seed = 0, const std::string& sub = "ck") {
  MakeModelOptions o;
  o.arch = arch;
  o.preset = preset;
  o.seed = seed;
  o.dtype = dt;
  o.out = d / sub;
  make_model(o);
  return o.out;
}

std::string file_in(const std::string& dir, const std::string& f) {
  return (fs::path(dir) / f).string();
}

// ------------------------------------------------------------------------------- round trips

struct RoundTripCase {
  std::string arch, preset;
  DType dtype;
};

class CheckpointRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(CheckpointRoundTrip, TensorsMatchFilesBytewise) {
  const auto& p = GetParam();
  TmpDir d("rt");
  std::string dir = make(d, p.arch, p.preset, p.dtype, 7);
  auto ck = Checkpoint::open(dir);
  const ModelConfig& c = ck->config();
  EXPECT_EQ(arch_short_name(c.arch), p.arch);
  EXPECT_EQ(ck->dir(), dir);
  const ModelWeights& w = ck->weights();
  ASSERT_EQ(int(w.layers.size()), c.num_layers);

  const bool sharded = p.preset != "tiny";
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> files;
  if (sharded) {
    ASSERT_FALSE(fs::exists(file_in(dir, "model.safetensors")));
    json idx = json::parse(read_bytes(file_in(dir, "model.safetensors.index.json")));
    for (auto& [n, f] : idx["weight_map"].items()) weight_map[n] = f.get<std::string>();
    std::set<std::string> fs_set;
    for (auto& [n, f] : weight_map) fs_set.insert(f);
    files.assign(fs_set.begin(), fs_set.end());
    EXPECT_EQ(files.size(), 2u);
  } else {
    ASSERT_FALSE(fs::exists(file_in(dir, "model.safetensors.index.json")));
    files = {"model.safetensors"};
  }
  std::map<std::string, std::map<std::string, RawTensor>> raw;  // file path -> tensors
  std::set<std::string> on_disk;
  uint64_t total = 0;
  for (auto& f : files) {
    raw[file_in(dir, f)] = raw_tensors(file_in(dir, f));
    for (auto& [n, t] : raw[file_in(dir, f)]) {
      EXPECT_TRUE(on_disk.insert(n).second) << n << " stored twice";
      total += t.bytes.size();
      if (sharded) {
        EXPECT_EQ(weight_map[n], f) << n;
      }
    }
  }
  if (sharded) {
    json idx = json::parse(read_bytes(file_in(dir, "model.safetensors.index.json")));
    EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
    EXPECT_EQ(weight_map.size(), on_disk.size());
  }

  std::set<std::string> loaded, files_used;
  const LayerTensorNames& N = layer_tensor_names(c.arch);
  for (int i = 0; i < c.num_layers && N.fused_experts; ++i)
    for (const std::string* n :
         {&N.fused_gate_up, &N.fused_gate_up_bias, &N.fused_down, &N.fused_down_bias})
      loaded.insert(layer_tensor(i, *n));
  for (auto& [role, v] : all_views(w)) {
    ASSERT_FALSE(v->empty()) << role;
    loaded.insert(v->name);
    files_used.insert(v->file);
    auto fit = raw.find(v->file);
    ASSERT_NE(fit, raw.end()) << v->name << " in " << v->file;
    auto tit = fit->second.find(v->name);
    ASSERT_NE(tit, fit->second.end()) << v->name;
    const RawTensor& r = tit->second;
    EXPECT_EQ(dtype_name(v->dtype), r.dtype) << v->name;
    EXPECT_EQ(v->shape, r.shape) << v->name;
    if (v->name.find("e_score_correction_bias") == std::string::npos) {
      EXPECT_EQ(v->dtype, p.dtype) << v->name;
    }
    ASSERT_EQ(v->nbytes(), r.bytes.size()) << v->name;
    if (v->data) {
      EXPECT_EQ(std::memcmp(v->data, r.bytes.data(), r.bytes.size()), 0) << v->name;
    } else {  // a matrix: its packed panels (the only copy) read back as stored
      ASSERT_NE(v->packed, nullptr) << v->name;
      TensorView stored = *v;
      stored.packed = nullptr;
      stored.data = r.bytes.data();
      EXPECT_EQ(v->to_f32(), stored.to_f32()) << v->name;
    }
  }
  // Every stored tensor is used, none is invented; MTP layers (after the decoder layers) are
  // stored and recognised, never loaded.
  std::set<std::string> decoder_tensors;
  for (const std::string& n : on_disk)
    if (n.rfind(layer_prefix(c.num_layers), 0) != 0) decoder_tensors.insert(n);
  EXPECT_EQ(decoder_tensors.size() + (c.num_nextn_predict_layers ? 4u : 0u), on_disk.size());
  EXPECT_EQ(loaded, decoder_tensors);
  EXPECT_EQ(files_used.size(), files.size());

  // Architecture-specific structure.
  const int64_t H = c.hidden_size;
  if (c.tie_word_embeddings) {
    // One copy: the embedding is lm_head (its panels when packed).
    EXPECT_EQ(w.lm_head.packed, w.embed.packed);
    EXPECT_EQ(w.lm_head.data, w.embed.data);
    EXPECT_FALSE(w.lm_head.empty());
    EXPECT_FALSE(on_disk.count("lm_head.weight"));
  } else {
    EXPECT_NE(w.embed.data, nullptr);  // kept as stored (rows are looked up, never multiplied)
    EXPECT_FALSE(w.lm_head.empty());
  }
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerWeights& L = w.layers[size_t(i)];
    EXPECT_EQ(L.moe, c.layers[size_t(i)].moe);
    if (L.moe) {
      EXPECT_EQ(L.router.name, router_name(c, i));
      EXPECT_EQ(L.router.shape, (std::vector<int64_t>{c.num_experts, H}));
      ASSERT_EQ(int(L.experts.size()), c.num_experts);
      if (!N.fused_experts) {
        EXPECT_EQ(L.experts.back().down.name, expert_name(c, i, c.num_experts - 1, "down"));
      }
    } else {
      EXPECT_TRUE(L.experts.empty());
      EXPECT_EQ(L.dense.gate.name, dense_name(c, i, "gate"));
    }
    if (c.arch == Arch::Mixtral) {
      EXPECT_TRUE(L.q_norm.empty());
      EXPECT_NE(L.router.name.find("block_sparse_moe.gate"), std::string::npos);
      EXPECT_NE(L.experts[0].gate.name.find("experts.0.w1"), std::string::npos);
      EXPECT_NE(L.experts[0].up.name.find("experts.0.w3"), std::string::npos);
      EXPECT_NE(L.experts[0].down.name.find("experts.0.w2"), std::string::npos);
    } else if (c.arch == Arch::Qwen3Moe ||
               (c.arch == Arch::Glm4Moe &&
                c.layers[size_t(i)].attention.qk_norm == QkNorm::PerHead)) {
      EXPECT_EQ(L.q_norm.shape, (std::vector<int64_t>{c.head_dim}));
      EXPECT_EQ(L.k_norm.shape, (std::vector<int64_t>{c.head_dim}));
    } else if (c.arch == Arch::Qwen2Moe || c.arch == Arch::Glm4Moe || c.arch == Arch::DeepseekV3 ||
               c.arch == Arch::GptOss) {
      EXPECT_TRUE(L.q_norm.empty());
    } else {
      EXPECT_EQ(L.q_norm.shape, (std::vector<int64_t>{int64_t(c.num_heads) * c.head_dim}));
      EXPECT_EQ(L.k_norm.shape, (std::vector<int64_t>{int64_t(c.num_kv_heads) * c.head_dim}));
    }
  }
  // Biases, shared experts, the router's selection bias (Qwen2-MoE, GLM-4.5).
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerWeights& L = w.layers[size_t(i)];
    const bool biased = c.arch == Arch::Qwen2Moe || c.arch == Arch::Glm4Moe;
    const bool deepseek_router = c.arch == Arch::Glm4Moe || c.arch == Arch::DeepseekV3;
    const bool gpt_oss = c.arch == Arch::GptOss;
    EXPECT_EQ(L.q_bias.empty(), !biased && !gpt_oss);
    EXPECT_EQ(L.o_bias.empty(), !gpt_oss);
    EXPECT_EQ(L.sinks.empty(), !gpt_oss);
    if (L.moe) {
      EXPECT_EQ(L.experts[0].down_bias.empty(), !gpt_oss);
    }
    if (biased) {
      EXPECT_EQ(L.v_bias.shape, (std::vector<int64_t>{int64_t(c.num_kv_heads) * c.head_dim}));
    }
    EXPECT_EQ(L.shared.gate.empty(), !((biased || deepseek_router) && L.moe));
    EXPECT_EQ(L.shared_gate.empty(), !(c.arch == Arch::Qwen2Moe && L.moe));
    EXPECT_EQ(L.router_bias.empty(), !((deepseek_router || gpt_oss) && L.moe));
    EXPECT_EQ(L.kv_b.empty(), !c.mla);
    EXPECT_EQ(c.layers[size_t(i)].attention.kind, c.mla ? AttentionKind::Mla : AttentionKind::Gqa);
    if (c.mla) {
      EXPECT_EQ(L.q_a.empty(), c.mla->q_lora_rank == 0);
    }
    if (deepseek_router && !L.router_bias.empty()) {
      EXPECT_EQ(L.router_bias.dtype, DType::F32);
    }
    // GPT-OSS: sliding and full attention alternate, sliding first (layer_types).
    if (gpt_oss) {
      EXPECT_EQ(c.layers[size_t(i)].attention.sliding_window > 0, i % 2 == 0);
    }
  }
  if (c.arch == Arch::Glm4Moe) {
    EXPECT_FALSE(w.layers[0].moe);  // first_k_dense_replace = 1
    EXPECT_EQ(c.layers[0].attention.rotary_dim, c.head_dim / 2);
    EXPECT_EQ(c.router.scoring, RouterScoring::Sigmoid);
    EXPECT_EQ(c.num_nextn_predict_layers, p.preset == "tiny" ? 0 : 1);  // its tensors load unused
  }
  if (p.arch == "qwen3_moe" && p.preset == "small") {
    EXPECT_FALSE(w.layers[0].moe);  // mlp_only_layers = [0]
    EXPECT_TRUE(w.layers[1].moe);
    EXPECT_EQ(w.layers[0].dense.gate.shape, (std::vector<int64_t>{c.intermediate_size, H}));
  }
}

std::vector<RoundTripCase> round_trip_cases() {
  std::vector<RoundTripCase> v;
  // Hybrids' derived views (gathered DeltaNet projections, fused experts' rows) are checked by
  // HybridCheckpoint below.
  for (const std::string& a : r3::testing::kAllArchs)
    for (std::string p : {"tiny", "small"})
      for (DType t : {DType::BF16, DType::F32})
        if (!r3::testing::is_hybrid(a)) v.push_back({a, p, t});
  return v;
}

INSTANTIATE_TEST_SUITE_P(CheckpointArchs, CheckpointRoundTrip,
                         ::testing::ValuesIn(round_trip_cases()),
                         [](const ::testing::TestParamInfo<RoundTripCase>& i) {
                           return i.param.arch + "_" + i.param.preset + "_" +
                                  dtype_name(i.param.dtype);
                         });

// GPT-OSS stores the experts of a layer fused, inputs first: gate_up_proj [E, H, 2I] with gate
// and up interleaved (transformers' GptOssExperts reads gate_up[..., ::2] and [..., 1::2]),
// down_proj [E, I, H], and their biases. Each expert's split views are checked element by
// element against the file, indexed as transformers indexes them.
TEST(CheckpointFusedExperts, SplitAsTransformersReadsThem) {
  TmpDir d("fused");
  for (DType dt : {DType::BF16, DType::F32}) {
    const std::string dir =
        make(d, "gpt_oss", "tiny", dt, 5, std::string("gpt_oss_") + dtype_name(dt));
    auto raw = raw_tensors(file_in(dir, "model.safetensors"));
    auto ck = Checkpoint::open(dir);
    const ModelConfig& c = ck->config();
    const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
    const size_t es = dtype_size(dt);
    auto elem = [&](const std::string& bytes, int64_t i) {
      if (es == 4) {
        float f;
        std::memcpy(&f, bytes.data() + 4 * i, 4);
        return f;
      }
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      return bf16_to_f32(h);
    };
    for (int l = 0; l < c.num_layers; ++l) {
      const std::string& gu = raw.at(layer_prefix(l) + "mlp.experts.gate_up_proj").bytes;
      const std::string& gub = raw.at(layer_prefix(l) + "mlp.experts.gate_up_proj_bias").bytes;
      const std::string& dn = raw.at(layer_prefix(l) + "mlp.experts.down_proj").bytes;
      const std::string& dnb = raw.at(layer_prefix(l) + "mlp.experts.down_proj_bias").bytes;
      for (int64_t e = 0; e < E; ++e) {
        const ExpertWeights& w = ck->weights().layers[size_t(l)].experts[size_t(e)];
        ASSERT_EQ(w.gate.shape, (std::vector<int64_t>{I, H}));
        ASSERT_EQ(w.down.shape, (std::vector<int64_t>{H, I}));
        for (int64_t i = 0; i < I; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            ASSERT_EQ(w.gate.at(i * H + h), elem(gu, (e * H + h) * 2 * I + 2 * i))
                << e << " " << i << " " << h;
            ASSERT_EQ(w.up.at(i * H + h), elem(gu, (e * H + h) * 2 * I + 2 * i + 1));
            ASSERT_EQ(w.down.at(h * I + i), elem(dn, (e * I + i) * H + h));
          }
          ASSERT_EQ(w.gate_bias.at(i), elem(gub, e * 2 * I + 2 * i));
          ASSERT_EQ(w.up_bias.at(i), elem(gub, e * 2 * I + 2 * i + 1));
        }
        for (int64_t h = 0; h < H; ++h) ASSERT_EQ(w.down_bias.at(h), elem(dnb, e * H + h));
      }
    }
  }
}

// GptOssConfig's keys as r3 reads them: layer_types (or the alternating default), sliding_window,
// swiglu_limit, attention_bias; unknown layer types refused by name.
TEST(CheckpointConfig, GptOssLayerTypesWindowsAndLimits) {
  json j = json::parse(preset_config_json("gpt_oss", "small"));
  ModelConfig c = parse_config(j.dump(), "gpt_oss");
  EXPECT_EQ(c.router.scoring, RouterScoring::TopkSoftmax);
  EXPECT_TRUE(c.router.logit_bias);
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerConfig& l = c.layers[size_t(i)];
    EXPECT_EQ(l.attention.sliding_window, i % 2 == 0 ? 24 : 0);
    EXPECT_TRUE(l.attention.sinks && l.attention.o_bias && l.attention.qkv_bias);
    EXPECT_TRUE(l.expert_bias && l.activation.clamped);
    EXPECT_EQ(l.activation.limit, 7.f);
    EXPECT_EQ(l.activation.alpha, 1.702f);
  }
  EXPECT_FALSE(c.rope_scaling.truncate);
  j["layer_types"] = {"full_attention", "full_attention", "sliding_attention", "full_attention"};
  j["swiglu_limit"] = 3.5;
  j["sliding_window"] = 5;
  c = parse_config(j.dump(), "gpt_oss");
  EXPECT_EQ(c.layers[0].attention.sliding_window, 0);
  EXPECT_EQ(c.layers[2].attention.sliding_window, 5);
  EXPECT_EQ(c.layers[1].activation.limit, 3.5f);
  j.erase("layer_types");
  c = parse_config(j.dump(), "gpt_oss");
  EXPECT_EQ(c.layers[0].attention.sliding_window, 5);  // the default alternates, sliding first
  EXPECT_EQ(c.layers[1].attention.sliding_window, 0);
  j["layer_types"] = {"full_attention", "chunked_attention", "full_attention", "full_attention"};
  EXPECT_NE(error_of([&] { parse_config(j.dump(), "gpt_oss"); }).find("chunked_attention"),
            std::string::npos);
  j["layer_types"] = {"full_attention"};
  EXPECT_NE(error_of([&] { parse_config(j.dump(), "gpt_oss"); }).find("layer_types"),
            std::string::npos);
  j.erase("layer_types");
  j["quantization_config"] = {{"quant_method", "mxfp4"}};
  EXPECT_TRUE(parse_config(j.dump(), "gpt_oss").experts_mxfp4);
  j["quantization_config"] = {{"quant_method", "awq"}};
  EXPECT_NE(error_of([&] { parse_config(j.dump(), "gpt_oss"); }).find("quantization_config"),
            std::string::npos);
  j = json::parse(preset_config_json("olmoe", "tiny"));
  j["quantization_config"] = {{"quant_method", "mxfp4"}};
  EXPECT_NE(error_of([&] { parse_config(j.dump(), "olmoe"); }).find("quantization_config"),
            std::string::npos);
}

// quantization_config fp8 as DeepSeek-V3 and Qwen3 FP8 write it; what r3 cannot compute exactly
// so (static activation scales, another format, odd column blocks, another method) is refused.
TEST(CheckpointConfig, Fp8QuantizationConfig) {
  json j = json::parse(preset_config_json("deepseek_v3", "tiny"));
  j["quantization_config"] = {{"activation_scheme", "dynamic"},
                              {"fmt", "e4m3"},
                              {"quant_method", "fp8"},
                              {"weight_block_size", {128, 64}}};
  ModelConfig c = parse_config(j.dump(), "ds");
  EXPECT_EQ(c.fp8_block_rows, 128);
  EXPECT_EQ(c.fp8_block_cols, 64);
  j["quantization_config"].erase("weight_block_size");
  EXPECT_EQ(parse_config(j.dump(), "ds").fp8_block_cols, 128);  // FineGrainedFP8Config's default
  auto refused = [&](const char* key, json value, const char* needle) {
    json k = j;
    k["quantization_config"][key] = value;
    EXPECT_NE(error_of([&] { parse_config(k.dump(), "ds"); }).find(needle), std::string::npos)
        << key << value.dump();
  };
  refused("activation_scheme", "static", "dynamic");
  refused("fmt", "e5m2", "e4m3");
  refused("weight_block_size", {128, 63}, "even");
  refused("weight_block_size", {0, 128}, "weight_block_size");
  refused("weight_block_size", {128}, "weight_block_size");
  refused("quant_method", "gptq", "not implemented");
  j = json::parse(preset_config_json("gpt_oss", "tiny"));
  j["quantization_config"] = {{"quant_method", "fp8"}};
  EXPECT_NE(error_of([&] { parse_config(j.dump(), "gpt_oss"); }).find("mxfp4"), std::string::npos);
  ModelConfig a = parse_config(preset_config_json("qwen3_moe", "tiny"), "q"), b = a;
  b.fp8_block_rows = b.fp8_block_cols = 128;
  EXPECT_FALSE(config_differences(a, b).empty());
}

// One walk over the description (visit_fields) drives the refit comparison: on every family's
// description, any one field changed alone is exactly one difference, naming that field (but the
// MTP layer counts: weights r3 never runs, which a trainer's checkpoint may leave out); a
// different layer count is one line per field, cut after 16.
TEST(ModelDescription, EachFieldChangedAloneIsOneDifferenceNamingIt) {
  for (const std::string& arch : r3::testing::kAllArchs) {
    const ModelConfig a = parse_config(preset_config_json(arch, "tiny"), arch);
    size_t fields = 0, changed_fields = 0;
    visit_fields(a, [&](const std::string&, const auto&) { ++fields; });
    for (size_t k = 0; k < fields; ++k) {
      ModelConfig b = a;
      std::string changed;
      size_t i = 0;
      visit_fields(b, [&](const std::string& name, auto&& value) {
        using T = std::decay_t<decltype(value)>;
        if (i++ != k) return;
        if constexpr (!std::is_same_v<T, std::nullopt_t>) {  // an absent part: nothing to change
          changed = name;
          if constexpr (std::is_same_v<T, bool>)
            value = !value;
          else if constexpr (std::is_same_v<T, std::string>)
            value += "x";
          else if constexpr (std::is_enum_v<T>)
            value = T(int(value) + 1);
          else
            value = value + 1;
        }
      });
      if (changed.empty()) continue;
      ++changed_fields;
      const std::vector<std::string> diff = config_differences(a, b);
      if (changed == "num_mtp_layers" || changed == "num_nextn_predict_layers") {
        EXPECT_TRUE(diff.empty()) << arch << " " << diff[0];
        continue;
      }
      ASSERT_EQ(diff.size(), 1u) << arch << " " << changed;
      EXPECT_EQ(diff[0].rfind(changed + ": ", 0), 0u) << diff[0];
    }
    EXPECT_GT(changed_fields, 40u) << arch;
    ModelConfig deeper = a;
    deeper.layers.push_back(a.layers.back());
    const std::vector<std::string> diff = config_differences(a, deeper);
    ASSERT_EQ(diff.size(), 17u) << arch;
    EXPECT_EQ(diff.back().rfind("... and ", 0), 0u) << diff.back();
  }
}

// The family registry (model/families.h) is what the parser reads: each row's make-model preset
// parses to its Arch, and each of its HF classes is recognised; an unknown class is refused
// naming every class the registry lists.
TEST(ModelDescription, TheFamilyRegistryIsWhatTheParserReads) {
  for (const Family& f : families()) {
    const ModelConfig c = parse_config(preset_config_json(f.name, "tiny"), f.name);
    EXPECT_EQ(c.arch, f.arch) << f.name;
    EXPECT_EQ(arch_short_name(f.arch), f.name);
    for (const char* hf : f.hf_classes) EXPECT_EQ(family_of_hf_class(hf), &f) << hf;
  }
  json j = json::parse(preset_config_json("olmoe", "tiny"));
  j["architectures"] = {"JambaForCausalLM"};
  const std::string e = error_of([&] { parse_config(j.dump(), "cfg"); });
  for (const Family& f : families())
    for (const char* hf : f.hf_classes) EXPECT_NE(e.find(hf), std::string::npos) << e;
}

// The JSON description (/get_model_info's r3_model_config, Python's LLM.model_config) holds every
// visited field at the path its dotted name gives, with its value.
TEST(ModelDescription, TheJsonHoldsEveryFieldAtItsPath) {
  for (const std::string& arch : r3::testing::kAllArchs) {
    const ModelConfig c = parse_config(preset_config_json(arch, "tiny"), arch);
    const json j = model_config_json(c);
    size_t seen = 0;
    visit_fields(c, [&](const std::string& name, const auto& value) {
      using T = std::decay_t<decltype(value)>;
      std::string pointer = "/" + name;
      std::replace(pointer.begin(), pointer.end(), '.', '/');
      const json::json_pointer at(pointer);
      ASSERT_TRUE(j.contains(at)) << arch << " " << name;
      if constexpr (std::is_same_v<T, std::nullopt_t>)
        EXPECT_TRUE(j.at(at).is_null()) << name;
      else if constexpr (std::is_enum_v<T>)
        EXPECT_EQ(j.at(at).get<int>(), int(value)) << name;
      else
        EXPECT_EQ(j.at(at).get<T>(), value) << name;
      ++seen;
    });
    EXPECT_EQ(j["layers"].size(), c.layers.size());
    EXPECT_GT(seen, 40u);
  }
}

// The bf16 checkpoint is the f32 one of the same seed, rounded to nearest even: an independent
// recomputation of what make_model writes.
TEST(CheckpointMakeModel, Bf16IsRoundedF32) {
  TmpDir d("bf16f32");
  for (const std::string& arch : r3::testing::kAllArchs) {
    std::string a = make(d, arch, "tiny", DType::F32, 3, arch + "_f32");
    std::string b = make(d, arch, "tiny", DType::BF16, 3, arch + "_bf16");
    auto fa = raw_tensors(file_in(a, "model.safetensors"));
    auto fb = raw_tensors(file_in(b, "model.safetensors"));
    ASSERT_EQ(fa.size(), fb.size());
    for (auto& [name, ta] : fa) {
      const RawTensor& tb = fb.at(name);
      if (name.find("e_score_correction_bias") != std::string::npos ||
          (arch == "qwen3_5_moe" &&
           name.find("A_log") != std::string::npos)) {  // fp32 in every release
        EXPECT_EQ(tb.dtype, "F32");
        continue;
      }
      EXPECT_EQ(ta.dtype, "F32");
      EXPECT_EQ(tb.dtype, "BF16");
      ASSERT_EQ(ta.bytes.size(), 2 * tb.bytes.size()) << name;
      for (size_t i = 0; i < tb.bytes.size() / 2; ++i) {
        float f;
        uint16_t h;
        std::memcpy(&f, ta.bytes.data() + 4 * i, 4);
        std::memcpy(&h, tb.bytes.data() + 2 * i, 2);
        ASSERT_EQ(h, f32_to_bf16(f)) << name << "[" << i << "]";
      }
    }
  }
}

TEST(CheckpointMakeModel, ByteIdenticalForSameArguments) {
  TmpDir d("det");
  for (const std::string& arch : r3::testing::kAllArchs)
    for (std::string preset : {"tiny", "small"}) {
      std::string a = make(d, arch, preset, DType::BF16, 11, arch + preset + "_a");
      std::string b = make(d, arch, preset, DType::BF16, 11, arch + preset + "_b");
      std::set<std::string> names_a, names_b;
      for (auto& e : fs::directory_iterator(a)) names_a.insert(e.path().filename().string());
      for (auto& e : fs::directory_iterator(b)) names_b.insert(e.path().filename().string());
      ASSERT_EQ(names_a, names_b);
      EXPECT_EQ(names_a.size(),
                preset == "tiny" ? 2u : 4u);  // config + 1 file, or + index + 2 shards
      for (auto& n : names_a)
        EXPECT_TRUE(read_bytes(file_in(a, n)) == read_bytes(file_in(b, n)))
            << arch << "/" << preset << "/" << n;
    }
}

TEST(CheckpointMakeModel, DifferentSeedsGiveDifferentWeights) {
  TmpDir d("seed");
  for (const std::string& arch : r3::testing::kAllArchs) {
    std::string a = make(d, arch, "tiny", DType::BF16, 1, arch + "_s1");
    std::string b = make(d, arch, "tiny", DType::BF16, 2, arch + "_s2");
    EXPECT_EQ(read_bytes(file_in(a, "config.json")), read_bytes(file_in(b, "config.json")));
    auto ta = raw_tensors(file_in(a, "model.safetensors"));
    auto tb = raw_tensors(file_in(b, "model.safetensors"));
    ASSERT_EQ(ta.size(), tb.size());
    for (auto& [name, t] : ta) {
      EXPECT_EQ(t.shape, tb.at(name).shape) << name;
      EXPECT_NE(t.bytes, tb.at(name).bytes) << name;  // every tensor differs
    }
  }
}

TEST(CheckpointMakeModel, RejectsUnknownArchPresetAndF16) {
  TmpDir d("mkerr");
  EXPECT_ERROR_MENTIONS(make(d, "llama", "tiny"), "llama");
  EXPECT_ERROR_MENTIONS(make(d, "olmoe", "huge"), "huge");
  EXPECT_ERROR_MENTIONS(make(d, "olmoe", "tiny", DType::F16), "bf16");
}

// ------------------------------------------------------------------------------- F16

TEST(CheckpointF16, WidenedToF32WithCorrectValues) {
  TmpDir d("f16");
  std::string dir = make(d, "olmoe", "tiny", DType::F32, 5);
  const std::string path = file_in(dir, "model.safetensors");
  auto src = raw_tensors(path);
  // Mixed dtypes, as real checkpoints have: norms F32, routers BF16, everything else F16.
  std::vector<TensorToWrite> out;
  std::map<std::string, std::vector<float>> expected;
  std::map<std::string, std::string> stored_as;
  for (auto& [name, t] : src) {
    std::vector<float> f(t.bytes.size() / 4);
    std::memcpy(f.data(), t.bytes.data(), t.bytes.size());
    TensorToWrite w{name, DType::F16, t.shape, {}};
    if (name.find("norm") != std::string::npos)
      w.dtype = DType::F32;
    else if (name.find("mlp.gate.weight") != std::string::npos)
      w.dtype = DType::BF16;
    w.bytes.resize(f.size() * dtype_size(w.dtype));
    std::vector<float>& e = expected[name];
    for (size_t i = 0; i < f.size(); ++i) {
      if (w.dtype == DType::F32) {
        std::memcpy(w.bytes.data() + 4 * i, &f[i], 4);
        e.push_back(f[i]);
      } else {
        uint16_t h = w.dtype == DType::F16 ? f32_to_f16(f[i]) : f32_to_bf16(f[i]);
        std::memcpy(w.bytes.data() + 2 * i, &h, 2);
        e.push_back(w.dtype == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h));
      }
    }
    stored_as[name] = dtype_name(w.dtype);
    out.push_back(std::move(w));
  }
  write_safetensors(path, out);
  auto ck = Checkpoint::open(dir);
  size_t n_f16 = 0;
  for (auto& [role, v] : all_views(ck->weights())) {
    const std::string& s = stored_as.at(v->name);
    if (s == "F16") {
      ++n_f16;
      EXPECT_EQ(v->dtype, DType::F32) << v->name << " (F16 must be widened)";
    } else {
      EXPECT_EQ(dtype_name(v->dtype), s) << v->name;
    }
    std::vector<float> got = v->to_f32();
    const std::vector<float>& want = expected.at(v->name);
    ASSERT_EQ(got.size(), want.size()) << v->name;
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << v->name << "[" << i << "]";
    if (v->dtype == DType::F32) {
      EXPECT_EQ(std::memcmp(v->data, want.data(), want.size() * 4), 0) << v->name;
    }
  }
  EXPECT_GT(n_f16, 50u);
  // The widened F16 values are close to the f32 originals (they really went through F16).
  const TensorView& q = ck->weights().layers[0].q;
  std::vector<float> orig(src.at(q.name).bytes.size() / 4);
  std::memcpy(orig.data(), src.at(q.name).bytes.data(), orig.size() * 4);
  for (size_t i = 0; i < orig.size(); ++i)
    EXPECT_NEAR(q.at(int64_t(i)), orig[i], std::fabs(orig[i]) * 1e-3 + 1e-7);
}

// ------------------------------------------------------------------------------- errors

// A tiny olmoe checkpoint whose model.safetensors a test then corrupts.
struct Corrupt {
  TmpDir d{"err"};
  std::string dir, st;
  explicit Corrupt(const std::string& arch = "olmoe", DType dt = DType::BF16) {
    dir = make(d, arch, "tiny", dt);
    st = file_in(dir, "model.safetensors");
  }
  // A checkpoint of other make-model options (a quantized layout); `o.out` is set here.
  explicit Corrupt(MakeModelOptions o) {
    o.out = d / "ck";
    make_model(o);
    dir = o.out;
    st = file_in(dir, "model.safetensors");
  }
  // Rewrites the file after `edit` changes the independent parse of it.
  template <class F>
  void edit(F&& f) {
    RawFile r = raw_read(st);
    f(r);
    raw_write(st, r);
  }
};

TEST(CheckpointErrors, NotADirectory) {
  std::string p = unique_tmp("nothing_here");
  EXPECT_ERROR_MENTIONS(Checkpoint::open(p), p, "not a checkpoint directory");
}

TEST(CheckpointErrors, MissingConfig) {
  Corrupt c;
  fs::remove(file_in(c.dir, "config.json"));
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), file_in(c.dir, "config.json"), "cannot open");
}

TEST(CheckpointErrors, NoWeightsFile) {
  Corrupt c;
  fs::remove(c.st);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.dir, "no model.safetensors");
}

TEST(CheckpointErrors, UnknownArchitecture) {
  Corrupt c;
  const std::string cfg = file_in(c.dir, "config.json");
  json j = json::parse(read_bytes(cfg));
  j["architectures"] = {"LlamaForCausalLM"};
  write_bytes(cfg, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "unknown architecture", "LlamaForCausalLM");
  j["architectures"] = json::array();
  write_bytes(cfg, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "architectures");
  j.erase("architectures");
  write_bytes(cfg, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "architectures");
}

TEST(CheckpointErrors, MissingConfigKey) {
  Corrupt c;
  const std::string cfg = file_in(c.dir, "config.json");
  const json orig = json::parse(read_bytes(cfg));
  for (std::string key : {"hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                          "num_experts_per_tok", "num_experts", "intermediate_size"}) {
    json j = orig;
    j.erase(key);
    write_bytes(cfg, j.dump());
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "missing key", "\"" + key + "\"");
  }
  // Per-architecture keys.
  Corrupt m("mixtral");
  const std::string mcfg = file_in(m.dir, "config.json");
  json j = json::parse(read_bytes(mcfg));
  j.erase("num_local_experts");
  write_bytes(mcfg, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(m.dir), mcfg, "\"num_local_experts\"");
  Corrupt q("qwen3_moe");
  const std::string qcfg = file_in(q.dir, "config.json");
  j = json::parse(read_bytes(qcfg));
  j.erase("moe_intermediate_size");
  write_bytes(qcfg, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(q.dir), qcfg, "\"moe_intermediate_size\"");
}

TEST(CheckpointErrors, BadConfigValues) {
  Corrupt c;
  const std::string cfg = file_in(c.dir, "config.json");
  const json orig = json::parse(read_bytes(cfg));
  auto with = [&](const std::string& key, json v) {
    json j = orig;
    j[key] = v;
    write_bytes(cfg, j.dump());
  };
  with("hidden_size", "64");
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"hidden_size\"");
  with("hidden_size", -64);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"hidden_size\"");
  with("hidden_size", 64.5);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"hidden_size\"");
  // Values that do not fit an int must not wrap around (2^32 + 64 is not 64).
  with("hidden_size", 4294967360ull);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"hidden_size\"");
  with("num_hidden_layers", 2147483648ull);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"num_hidden_layers\"");
  with("num_attention_heads", 4294967296ull);  // wrapped to 0, this divided by zero (SIGFPE)
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"num_attention_heads\"");
  with("num_key_value_heads", 4294967298ull);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"num_key_value_heads\"");
  with("num_key_value_heads", 3);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "num_key_value_heads");
  with("num_experts_per_tok", 9);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "num_experts_per_tok");
  with("norm_topk_prob", "yes");
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "\"norm_topk_prob\"");
  with("rope_scaling", json{{"type", "yarn"}});
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "rope_scaling");
}

TEST(CheckpointErrors, MalformedConfigJson) {
  Corrupt c;
  const std::string cfg = file_in(c.dir, "config.json");
  for (std::string text :
       {"{\"architectures\": [\"OlmoeForCausalLM\"], ", "", "not json", "[1, 2]", "\xff\xfe"}) {
    write_bytes(cfg, text);
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg);
  }
  write_bytes(cfg, "{\"architectures\": [\"OlmoeForCausalLM\"], ");
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "malformed JSON");
}

TEST(CheckpointErrors, MissingTensor) {
  Corrupt c;
  const std::string victim = "model.layers.1.mlp.experts.3.up_proj.weight";
  c.edit([&](RawFile& r) { drop_tensor(r, victim); });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.dir, "missing tensor", "\"" + victim + "\"");
  // Only the entry gone, its bytes left: the offsets no longer tile the data buffer.
  Corrupt c3;
  c3.edit([&](RawFile& r) { r.header.erase(victim); });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c3.dir), c3.st, "gap before it");
  // lm_head is required unless the embeddings are tied.
  Corrupt c2;
  c2.edit([&](RawFile& r) { drop_tensor(r, "lm_head.weight"); });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c2.dir), "missing tensor", "\"lm_head.weight\"");
}

TEST(CheckpointErrors, WrongShape) {
  Corrupt c;
  const std::string victim = "model.layers.0.self_attn.k_proj.weight";  // [32, 64]
  c.edit([&](RawFile& r) {
    auto& s = r.header[victim]["shape"];
    std::swap(s[0], s[1]);  // same byte count, transposed
  });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"", "has shape [64, 32]",
                        "expected [32, 64]");
  Corrupt c2;
  c2.edit([&](RawFile& r) {
    auto& e = r.header["model.norm.weight"];
    e["shape"] = json::array({8, 8});  // 64 elements either way
  });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c2.dir), c2.st, "\"model.norm.weight\"", "[8, 8]",
                        "expected [64]");
}

TEST(CheckpointErrors, UnsupportedDtypeEntry) {
  Corrupt c;
  c.edit([&](RawFile& r) {
    // An extra I64 tensor appended to the buffer.
    uint64_t at = r.buffer.size();
    r.buffer += std::string(16, '\0');
    r.header["model.step_counter"] = {
        {"dtype", "I64"}, {"shape", {2}}, {"data_offsets", {at, at + 16}}};
  });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"model.step_counter\"",
                        "unsupported dtype", "I64");
}

// MXFP4 experts: a scale that would leave bf16's normal range, missing scales, and blocks stored
// in a float dtype are refused by name.
TEST(CheckpointErrors, Mxfp4ScalesAndBlocks) {
  MakeModelOptions o;
  o.arch = "gpt_oss";
  o.quant = "mxfp4";
  const std::string scales = "model.layers.1.mlp.experts.down_proj_scales";
  {
    Corrupt c(o);
    c.edit([&](RawFile& r) {
      const uint64_t at = r.header[scales]["data_offsets"][0];
      r.buffer[size_t(at) + 5] = char(255);
    });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), "\"" + scales + "\"", "scale byte 255",
                          "outside [2, 252]");
  }
  {
    Corrupt c(o);
    c.edit([&](RawFile& r) { drop_tensor(r, scales); });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), "missing tensor", scales);
  }
  {
    Corrupt c(o);
    const std::string blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks";
    c.edit([&](RawFile& r) {
      auto& e = r.header[blocks];
      auto shape = e["shape"].get<std::vector<int64_t>>();
      shape.back() /= 2;  // the same bytes as BF16
      e["shape"] = shape;
      e["dtype"] = "BF16";
    });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), blocks);
  }
}

// FP8 weights: a NaN code, a block scale out of range, missing or misshapen scales, and F8_E4M3
// without quantization_config are refused by name.
TEST(CheckpointErrors, Fp8ValuesAndScales) {
  MakeModelOptions o;
  o.arch = "deepseek_v3";
  o.quant = "fp8";
  o.fp8_block[0] = 32;
  o.fp8_block[1] = 48;
  const std::string weight = "model.layers.1.mlp.experts.3.down_proj.weight",
                    scales = weight + "_scale_inv";
  EXPECT_NO_THROW(Checkpoint::open(Corrupt(o).dir));
  auto at = [](RawFile& r, const std::string& name) {
    return size_t(r.header[name]["data_offsets"][0].get<uint64_t>());
  };
  {
    Corrupt c(o);
    c.edit([&](RawFile& r) { r.buffer[at(r, weight) + 7] = char(0xff); });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), "\"" + weight + "\"", "NaN", "element 7");
  }
  for (float bad : {-1.f, INFINITY, 0x1p119f, 0x1p-118f}) {
    Corrupt c(o);
    c.edit([&](RawFile& r) { std::memcpy(&r.buffer[at(r, scales) + 4], &bad, 4); });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), "\"" + scales + "\"", "block scale",
                          "element 1");
  }
  {
    Corrupt c(o);
    c.edit([&](RawFile& r) { drop_tensor(r, scales); });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), "missing tensor", scales, weight);
  }
  {
    Corrupt c(o);
    c.edit([&](RawFile& r) {
      r.header[scales]["shape"] = {1, 2};  // down_proj [64, 32] in 32 x 48 blocks: [2, 1]
    });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), scales, "expected float");
  }
  {
    Corrupt c(o);
    json cfg = json::parse(std::ifstream(c.dir + "/config.json"));
    cfg.erase("quantization_config");
    std::ofstream(c.dir + "/config.json") << cfg.dump();
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), "F8_E4M3", "quantization_config");
  }
}

TEST(CheckpointErrors, RequiredTensorStoredAsI8) {
  Corrupt c;
  const std::string victim = "model.layers.0.self_attn.q_proj.weight";
  c.edit([&](RawFile& r) {
    auto& e = r.header[victim];
    uint64_t b = e["data_offsets"][0];
    auto shape = e["shape"].get<std::vector<int64_t>>();
    e["dtype"] = "I8";
    e["data_offsets"] = {b, b + uint64_t(shape[0] * shape[1])};
  });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"", "unsupported dtype",
                        "I8");
  for (json bad : {json("bf16"), json(""), json(16), json(nullptr)}) {
    Corrupt c2;
    c2.edit([&](RawFile& r) { r.header[victim]["dtype"] = bad; });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c2.dir), c2.st, "\"" + victim + "\"", "dtype");
  }
}

TEST(CheckpointErrors, DtypeDisagreesWithByteCount) {
  Corrupt c;  // bf16 on disk, header claims F32 for one tensor
  const std::string victim = "model.layers.1.self_attn.k_proj.weight";
  c.edit([&](RawFile& r) { r.header[victim]["dtype"] = "F32"; });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"", "of F32 needs");
}

TEST(CheckpointErrors, TruncatedFile) {
  Corrupt c;
  std::string s = read_bytes(c.st);
  write_bytes(c.st, s.substr(0, s.size() - 100));
  // The last tensor written runs past the end of the shortened buffer.
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"lm_head.weight\"", "out of range",
                        "truncated");
  for (size_t n : {0, 3, 7}) {
    write_bytes(c.st, s.substr(0, n));
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "truncated");
  }
}

TEST(CheckpointErrors, HeaderLengthPastEndOfFile) {
  Corrupt c;
  std::string s = read_bytes(c.st);
  for (uint64_t n : {uint64_t(s.size()), uint64_t(s.size() - 7), uint64_t(50u << 20)}) {
    write_bytes(c.st, u64le(n) + s.substr(8));
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "header length", std::to_string(n),
                          "past the end");
  }
  for (uint64_t n : {uint64_t(101u) << 20, ~uint64_t(0), uint64_t(1) << 63, ~uint64_t(0) - 7}) {
    write_bytes(c.st, u64le(n) + s.substr(8));
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "header length");
  }
}

TEST(CheckpointErrors, DataOffsetsOutOfRange) {
  const std::string victim = "model.layers.0.input_layernorm.weight";
  {
    Corrupt c;
    c.edit([&](RawFile& r) {
      uint64_t n = r.buffer.size();
      r.header[victim]["data_offsets"] = {n - 64, n + 64};
    });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"", "out of range");
  }
  {
    Corrupt c;  // begin after end
    c.edit([&](RawFile& r) { r.header[victim]["data_offsets"] = {200, 72}; });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"", "out of range");
  }
  {
    Corrupt c;  // offsets near 2^64 must not wrap around
    c.edit([&](RawFile& r) {
      r.header[victim]["data_offsets"] = {~uint64_t(0) - 63, ~uint64_t(0) + uint64_t(65)};
    });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"");
    c.edit([&](RawFile& r) {
      r.header[victim]["data_offsets"] = {~uint64_t(0) - 127, ~uint64_t(0)};
    });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"", "out of range");
  }
  for (json bad : {json::array({0}), json::array({0, 128, 256}), json::array({-128, 0}),
                   json("0-128"), json::array({0.0, 128.0})}) {
    Corrupt c;
    c.edit([&](RawFile& r) { r.header[victim]["data_offsets"] = bad; });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + victim + "\"", "data_offsets");
  }
}

TEST(CheckpointErrors, OverlappingDataOffsets) {
  Corrupt c;
  // Point the second norm at the first one's bytes (same size, so only the overlap is wrong).
  c.edit([&](RawFile& r) {
    r.header["model.layers.0.post_attention_layernorm.weight"]["data_offsets"] =
        r.header["model.layers.0.input_layernorm.weight"]["data_offsets"];
  });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "overlaps the tensor before it");
  // Partial overlap: shift a tensor by half its size into its neighbour.
  Corrupt c2;
  c2.edit([&](RawFile& r) {
    auto& e = r.header["model.layers.0.post_attention_layernorm.weight"]["data_offsets"];
    uint64_t b = e[0], en = e[1];
    e = {b - 64, en - 64};
  });
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c2.dir), c2.st, "overlaps the tensor before it");
}

TEST(CheckpointErrors, OverlapHiddenBehindEmptyTensor) {
  // A: [0, 256) F32 x64; E: empty at 16; C: [128, 192) lies inside A. An empty tensor sorted
  // between A and C must not hide the overlap.
  TmpDir d("ovl");
  const std::string p = d / "x.safetensors";
  json h = {{"a", {{"dtype", "F32"}, {"shape", {64}}, {"data_offsets", {0, 256}}}},
            {"e", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {16, 16}}}},
            {"c", {{"dtype", "F32"}, {"shape", {16}}, {"data_offsets", {128, 192}}}}};
  write_bytes(p, safetensors_bytes(h.dump(), std::string(256, '\0')));
  EXPECT_ERROR_MENTIONS(SafetensorsFile f(p), p, "overlaps the tensor before it");
  // An empty tensor sits where the tiling has reached (as the reference reader requires); one
  // inside another tensor's range is refused like any other overlap.
  json inside = {{"a", {{"dtype", "F32"}, {"shape", {64}}, {"data_offsets", {0, 256}}}},
                 {"e", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {16, 16}}}}};
  write_bytes(p, safetensors_bytes(inside.dump(), std::string(256, '\0')));
  EXPECT_ERROR_MENTIONS(SafetensorsFile f(p), p, "\"e\"", "overlaps");
  json ok = {{"a", {{"dtype", "F32"}, {"shape", {64}}, {"data_offsets", {0, 256}}}},
             {"e", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {256, 256}}}}};
  write_bytes(p, safetensors_bytes(ok.dump(), std::string(256, '\0')));
  SafetensorsFile f(p);
  EXPECT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors().at("e").numel(), 0);
}

TEST(CheckpointErrors, ShapeOverflow) {
  // 2^62 x 4 elements wraps to 0 in 64 bits: must be rejected, not read as an empty tensor.
  TmpDir d("ovf");
  const std::string p = d / "x.safetensors";
  for (json shape :
       {json::array({uint64_t(1) << 62, 4}), json::array({uint64_t(1) << 62}),
        json::array({uint64_t(1) << 32, uint64_t(1) << 32, 0}), json::array({~uint64_t(0)})}) {
    json h = {{"t", {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {0, 0}}}}};
    write_bytes(p, safetensors_bytes(h.dump(), ""));
    EXPECT_ERROR_MENTIONS(SafetensorsFile f(p), p, "\"t\"");
  }
  json neg = {{"t", {{"dtype", "F32"}, {"shape", {-1}}, {"data_offsets", {0, 0}}}}};
  write_bytes(p, safetensors_bytes(neg.dump(), ""));
  EXPECT_ERROR_MENTIONS(SafetensorsFile f(p), p, "\"t\"", "shape");
}

TEST(CheckpointErrors, MalformedSafetensorsHeader) {
  Corrupt c;
  std::string s = read_bytes(c.st);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(s[size_t(i)])) << (8 * i);
  const std::string buffer = s.substr(8 + n);
  for (std::string header :
       {std::string("{\"a\": {\"dtype\": "), std::string("{\"a\": 1,}"),
        std::string("{\"a\": 1}\0\0\0", 11), std::string("{}\t"), std::string("{}\n  ")}) {
    write_bytes(c.st, safetensors_bytes(header, buffer));
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "malformed JSON header");
  }
  // Anything but '{' first: other JSON values, a byte-order mark, leading spaces, nothing.
  for (std::string header :
       {std::string("[1, 2, 3]"), std::string("\"x\""), std::string("42"),
        std::string("not json at all"), std::string(""), std::string("\xff\xfe\xfd"),
        std::string("\xef\xbb\xbf{}"), std::string(" {}")}) {
    write_bytes(c.st, safetensors_bytes(header, buffer));
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "must begin with '{'");
  }
  for (json entry : {json(1), json::object(), json{{"dtype", "F32"}, {"shape", {4}}},
                     json{{"dtype", "F32"}, {"data_offsets", {0, 16}}}}) {
    json h = {{"t", entry}};
    write_bytes(c.st, safetensors_bytes(h.dump(), buffer));
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"t\"", "dtype, shape and data_offsets");
  }
  json h = {{"t", {{"dtype", "F32"}, {"shape", "4"}, {"data_offsets", {0, 16}}}}};
  write_bytes(c.st, safetensors_bytes(h.dump(), buffer));
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"t\"", "shape");
  h = {{"__metadata__", "x"}};
  write_bytes(c.st, safetensors_bytes(h.dump(), buffer));
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "__metadata__");
  // Header length larger than the header: the JSON then includes data bytes.
  write_bytes(c.st, u64le(n + 16) + s.substr(8));
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "malformed JSON header");
}

// A sharded (small preset) checkpoint for index tests.
struct Sharded {
  TmpDir d{"shard"};
  std::string dir, index;
  Sharded() {
    dir = make(d, "mixtral", "small");
    index = file_in(dir, "model.safetensors.index.json");
  }
  json read_index() const { return json::parse(read_bytes(index)); }
};

TEST(CheckpointErrors, MalformedIndexJson) {
  Sharded s;
  for (std::string text : {"{\"weight_map\": {", "", "garbage"}) {
    write_bytes(s.index, text);
    EXPECT_ERROR_MENTIONS(Checkpoint::open(s.dir), s.index, "malformed JSON");
  }
  for (std::string text : {"[]", "{}", "{\"weight_map\": [1]}", "{\"metadata\": {}}"}) {
    write_bytes(s.index, text);
    EXPECT_ERROR_MENTIONS(Checkpoint::open(s.dir), s.index, "weight_map");
  }
  write_bytes(s.index, "{\"weight_map\": {\"model.norm.weight\": 3}}");
  EXPECT_ERROR_MENTIONS(Checkpoint::open(s.dir), s.index, "\"model.norm.weight\"",
                        "not a file name");
  for (std::string f :
       {"../model-00001-of-00002.safetensors", "/etc/passwd", "sub/x.safetensors"}) {
    json j = {{"weight_map", {{"model.norm.weight", f}}}};
    write_bytes(s.index, j.dump());
    EXPECT_ERROR_MENTIONS(Checkpoint::open(s.dir), s.index, f, "plain file name");
  }
}

TEST(CheckpointErrors, ShardNamedInIndexButMissing) {
  Sharded s;
  const std::string shard = file_in(s.dir, "model-00002-of-00002.safetensors");
  ASSERT_TRUE(fs::exists(shard));
  fs::remove(shard);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(s.dir), shard, "missing");
  // A name the index invents.
  Sharded s2;
  json j = s2.read_index();
  j["weight_map"]["model.norm.weight"] = "model-00003-of-00002.safetensors";
  write_bytes(s2.index, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(s2.dir),
                        file_in(s2.dir, "model-00003-of-00002.safetensors"), "missing");
}

TEST(CheckpointErrors, IndexPointsAtWrongShard) {
  Sharded s;
  json j = s.read_index();
  std::string name = "model.embed_tokens.weight";
  std::string real = j["weight_map"][name];
  std::string other = real == "model-00001-of-00002.safetensors"
                          ? "model-00002-of-00002.safetensors"
                          : "model-00001-of-00002.safetensors";
  j["weight_map"][name] = other;
  write_bytes(s.index, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(s.dir), file_in(s.dir, real), "\"" + name + "\"",
                        "listed in the index under " + other);
  // A tensor the index lists that no shard holds.
  Sharded s2;
  j = s2.read_index();
  j["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors";
  write_bytes(s2.index, j.dump());
  EXPECT_ERROR_MENTIONS(Checkpoint::open(s2.dir), "\"model.extra.weight\"", "not in the shard");
}

TEST(CheckpointErrors, CorruptShard) {
  Sharded s;
  const std::string shard = file_in(s.dir, "model-00002-of-00002.safetensors");
  std::string b = read_bytes(shard);
  write_bytes(shard, b.substr(0, b.size() / 2));
  EXPECT_ERROR_MENTIONS(Checkpoint::open(s.dir), shard, "out of range");
}

// The loader must answer every corrupted input with r3::Error (or load it), never crash.
TEST(CheckpointErrors, NeverCrashesOnMutatedFiles) {
  Corrupt c;
  const std::string good = read_bytes(c.st);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(good[size_t(i)])) << (8 * i);
  auto try_open = [&] {
    try {
      Checkpoint::open(c.dir);
    } catch (const Error&) {
    }  // any other exception fails the test (uncaught)
  };
  // Truncation at many lengths, including inside the header.
  for (size_t len = 0; len < good.size(); len += (len < 64 ? 1 : len < 8 + n + 64 ? 13 : 4999)) {
    write_bytes(c.st, good.substr(0, len));
    ASSERT_NO_FATAL_FAILURE(try_open());
    if (len < 8 + n && len >= 8) {
      EXPECT_ANY_THROW(Checkpoint::open(c.dir));
    }
  }
  // Random byte mutations of the header and its length.
  for (uint64_t it = 0; it < 400; ++it) {
    std::string s = good;
    int flips = 1 + int(hash_pair(it, 99) % 4);
    for (int f = 0; f < flips; ++f) {
      uint64_t h = hash_pair(it, uint64_t(f));
      size_t pos = size_t(h % (8 + n));
      s[pos] = char(hash_pair(h, 1) & 0xff);
    }
    write_bytes(c.st, s);
    try_open();
  }
  // Random numbers in numeric header fields.
  write_bytes(c.st, good);
  RawFile base = raw_read(c.st);
  std::vector<std::string> names;
  for (auto& [k, v] : base.header.items())
    if (k != "__metadata__") names.push_back(k);
  const uint64_t specials[] = {0,
                               1,
                               63,
                               64,
                               65,
                               uint64_t(1) << 31,
                               uint64_t(1) << 32,
                               uint64_t(1) << 62,
                               uint64_t(1) << 63,
                               ~uint64_t(0),
                               ~uint64_t(0) - 1};
  for (uint64_t it = 0; it < 200; ++it) {
    RawFile r = base;
    const std::string& name = names[hash_pair(it, 7) % names.size()];
    uint64_t v = specials[hash_pair(it, 8) % std::size(specials)];
    switch (hash_pair(it, 9) % 3) {
      case 0:
        r.header[name]["data_offsets"][hash_pair(it, 10) % 2] = v;
        break;
      case 1:
        r.header[name]["shape"][0] = v;
        break;
      default:
        r.header[name]["shape"].push_back(v);
        break;
    }
    raw_write(c.st, r);
    try_open();
  }
}

TEST(CheckpointErrors, NeverCrashesOnMutatedConfig) {
  Corrupt c;
  const std::string cfg = file_in(c.dir, "config.json");
  const json orig = json::parse(read_bytes(cfg));
  const json values[] = {json(nullptr),      json(0),
                         json(-1),           json(1),
                         json(2147483647),   json(4294967296ull),
                         json(~uint64_t(0)), json(-9223372036854775807ll),
                         json(0.5),          json(1e308),
                         json("x"),          json::array(),
                         json::array({1}),   json::object(),
                         json(true)};
  for (auto& [key, v] : orig.items()) {
    for (const json& val : values) {
      json j = orig;
      j[key] = val;
      write_bytes(cfg, j.dump());
      try {
        Checkpoint::open(c.dir);
      } catch (const Error&) {
      }
    }
  }
}

// ------------------------------------------------------------------------------- dtype.h

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DTypeBf16, RoundToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-1.5f), 0xbfc0);
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  // Exactly halfway: ties go to the even mantissa.
  EXPECT_EQ(f32_to_bf16(float_of(0x3f808000)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(float_of(0x3f818000)), 0x3f82);
  EXPECT_EQ(f32_to_bf16(float_of(0xbf818000)), 0xbf82);
  // Just off halfway.
  EXPECT_EQ(f32_to_bf16(float_of(0x3f808001)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(float_of(0x3f807fff)), 0x3f80);
  // Carry into the exponent, and overflow to infinity.
  EXPECT_EQ(f32_to_bf16(float_of(0x3fffffff)), 0x4000);
  EXPECT_EQ(f32_to_bf16(float_of(0x7f7fffff)), 0x7f80);
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xff80);
  // Subnormals round like everything else.
  EXPECT_EQ(f32_to_bf16(float_of(0x00008000)), 0x0000);
  EXPECT_EQ(f32_to_bf16(float_of(0x00018000)), 0x0002);
  EXPECT_EQ(f32_to_bf16(float_of(0x00010001)), 0x0001);
  // NaN stays NaN, including signalling NaNs whose payload sits in the low bits.
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t h = f32_to_bf16(float_of(nan));
    EXPECT_TRUE(std::isnan(bf16_to_f32(h))) << std::hex << nan;
    EXPECT_EQ(h & 0x8000, (nan >> 16) & 0x8000);
  }
  EXPECT_EQ(round_bf16(1.00390625f), 1.0f);       // 1 + 2^-8: halfway, to even
  EXPECT_EQ(round_bf16(1.01171875f), 1.015625f);  // 1 + 3 * 2^-8: halfway, to even (up)
}

TEST(DTypeBf16, AllValuesRoundTripAndMatchReference) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_f32(uint16_t(h));
    EXPECT_EQ(bits_of(f), h << 16);
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16(f), h);
  }
  // Reference: the nearer of the two neighbouring bf16 values, ties to even (in double).
  for (uint64_t i = 0; i < 200000; ++i) {
    uint32_t u = uint32_t(hash_pair(42, i));
    float f = float_of(u);
    if (std::isnan(f) || std::isinf(f)) continue;
    uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);  // truncated, and one ulp further
    uint16_t want;
    if ((hi & 0x7fff) ==
        0x7f80) {  // lo is the largest finite: past halfway (ties: lo is odd) -> inf
      want = (u & 0xffff) >= 0x8000 ? hi : lo;
    } else {
      double dl = std::fabs(double(f) - double(bf16_to_f32(lo)));
      double dh = std::fabs(double(bf16_to_f32(hi)) - double(f));
      want = dl < dh ? lo : dh < dl ? hi : (lo & 1 ? hi : lo);
    }
    ASSERT_EQ(f32_to_bf16(f), want) << std::hex << u;
  }
}

TEST(DTypeF16, KnownValues) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(0.5f), 0x3800);
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);  // below halfway to 65536
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // halfway: ties to even = infinity
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(f32_to_f16(INFINITY), 0x7c00);
  EXPECT_EQ(f32_to_f16(2047.5f), 0x6800);              // halfway, carries into the exponent (2048)
  EXPECT_EQ(f32_to_f16(2046.5f), 0x67fe);              // halfway, to even (2046)
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3c00);      // halfway, to even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);  // halfway, to even (up)
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(NAN))));
  EXPECT_TRUE(
      std::isnan(f16_to_f32(f32_to_f16(float_of(0x7f800001)))));  // payload only in low bits
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x7c00), INFINITY);
  EXPECT_EQ(f16_to_f32(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_EQ(bits_of(f16_to_f32(0x8000)), 0x80000000u);
}

TEST(DTypeF16, Subnormals) {
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x0002), 0x1p-23f);
  EXPECT_EQ(f16_to_f32(0x03ff), 1023 * 0x1p-24f);  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x0400), 0x1p-14f);         // smallest normal
  EXPECT_EQ(f16_to_f32(0x8001), -0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x0155), 341 * 0x1p-24f);
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16(1023 * 0x1p-24f), 0x03ff);
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);
  EXPECT_EQ(f32_to_f16(-341 * 0x1p-24f), 0x8155);
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);            // halfway to 2^-24: to even (0)
  EXPECT_EQ(f32_to_f16(0x1.000002p-25f), 0x0001);     // just above halfway
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);        // 1.5 ulp: to even (2)
  EXPECT_EQ(f32_to_f16(5 * 0x1p-25f), 0x0002);        // 2.5 ulp: to even (2)
  EXPECT_EQ(f32_to_f16(1023.5f * 0x1p-24f), 0x0400);  // rounds up into the normals
  EXPECT_EQ(f32_to_f16(0x1p-26f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0x1p-26f), 0x8000);
  EXPECT_EQ(f32_to_f16(float_of(0x00000001)), 0x0000);  // f32 subnormal
}

TEST(DTypeF16, AllValuesRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(uint16_t(h));
    bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    EXPECT_EQ(std::isnan(f), nan) << std::hex << h;
    if (nan) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), h) << std::hex << h;
#ifdef __FLT16_MAX__
    _Float16 ref;
    std::memcpy(&ref, &h, 2);
    EXPECT_EQ(bits_of(f), bits_of(float(ref))) << std::hex << h;
#endif
  }
}

#ifdef __FLT16_MAX__
TEST(DTypeF16, MatchesCompilerConversion) {
  for (uint64_t i = 0; i < 500000; ++i) {
    uint32_t u = uint32_t(hash_pair(17, i));
    if (i % 2)
      u = (u & 0x807fffffu) | (uint32_t(103 + hash_pair(18, i) % 40) << 23);  // near f16 range
    float f = float_of(u);
    if (std::isnan(f)) continue;
    _Float16 ref = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &ref, 2);
    ASSERT_EQ(f32_to_f16(f), want) << std::hexfloat << f;
  }
}
#endif

// ------------------------------------------------------------------ fail closed (issue: refuse
// what r3 lacks)

// The tiny model's config.json with one key set (or erased, for a null value).
void set_config_key(const std::string& dir, const std::string& key, const json& value) {
  const std::string cfg = file_in(dir, "config.json");
  json j = json::parse(read_bytes(cfg));
  if (value.is_null())
    j.erase(key);
  else
    j[key] = value;
  write_bytes(cfg, j.dump());
}

// YaRN as transformers' _compute_yarn_parameters computes it (expected values from that formula in
// numpy float32 for dim 8, base 10000, factor 40, original 4096, beta 32/1: correction range
// [1, 3]), and DeepseekV3Attention's softmax factor mscale(40, mscale_all_dim)^2.
TEST(ConfigYarn, FrequenciesAndFactorsAsTransformersComputes) {
  json j = json::parse(preset_config_json("deepseek_v3", "tiny"));
  j["max_position_embeddings"] = 4096 * 40;
  j["rope_scaling"] = {
      {"rope_type", "yarn"},  {"factor", 40.0}, {"original_max_position_embeddings", 4096},
      {"beta_fast", 32},      {"beta_slow", 1}, {"mscale", 0.707},
      {"mscale_all_dim", 1.0}};
  const ModelConfig c = parse_config(j.dump(), "yarn");
  ASSERT_TRUE(c.rope_scaling.yarn);
  ASSERT_EQ(c.layers[0].attention.rotary_dim, 8);
  const std::vector<double> f = rope_inv_freq(c, c.layers[0].attention.rotary_dim);
  const double want[] = {1.0, 0.10000000149011612, 0.005124999675899744, 2.499999936844688e-05};
  ASSERT_EQ(f.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(f[i], want[i], 1e-7 * want[i]) << i;
  EXPECT_NEAR(c.rope_scaling.attention_factor, 0.9210423553163399, 1e-12);
  EXPECT_NEAR(c.rope_scaling.softmax_mscale, 1.8738542070926265, 1e-12);
  // Without mscale / mscale_all_dim: attention_factor = 0.1 ln(factor) + 1, no softmax factor.
  j["rope_scaling"].erase("mscale");
  j["rope_scaling"].erase("mscale_all_dim");
  const ModelConfig d = parse_config(j.dump(), "yarn");
  EXPECT_NEAR(d.rope_scaling.attention_factor, 0.1 * std::log(40.0) + 1.0, 1e-12);
  EXPECT_EQ(d.rope_scaling.softmax_mscale, 1.0);
  // A factor that disagrees with max_position_embeddings / original is refused (transformers
  // versions pick different ones), as is a factor below 1.
  j["rope_scaling"]["factor"] = 32.0;
  EXPECT_ERROR_MENTIONS(parse_config(j.dump(), "yarn"), "rope_scaling.factor", "differs");
  j["rope_scaling"]["factor"] = 0.5;
  j["rope_scaling"].erase("original_max_position_embeddings");
  EXPECT_ERROR_MENTIONS(parse_config(j.dump(), "yarn"), "rope_scaling.factor");
}

// Keys whose transformers default differs by family or version are required, not guessed;
// rope_scaling's type and rope_type must agree; a refit is refused on any digit of a float key.
TEST(ConfigFailClosed, NoGuessedDefaultsNoAmbiguityEveryDigitCounts) {
  for (const char* arch : {"deepseek_v3", "glm4_moe"})
    for (const char* key : {"n_group", "topk_group", "routed_scaling_factor"}) {
      json j = json::parse(preset_config_json(arch, "tiny"));
      j.erase(key);
      EXPECT_ERROR_MENTIONS(parse_config(j.dump(), "cfg"), "missing key",
                            std::string("\"") + key + "\"");
    }
  json g = json::parse(preset_config_json("glm4_moe", "tiny"));
  g.erase("partial_rotary_factor");  // Glm4MoeConfig's default, 0.5
  EXPECT_EQ(parse_config(g.dump(), "cfg").layers[0].attention.rotary_dim,
            g["head_dim"].get<int>() / 2);
  json d = json::parse(preset_config_json("deepseek_v3", "small"));
  d["rope_scaling"]["rope_type"] = "linear";
  EXPECT_ERROR_MENTIONS(parse_config(d.dump(), "cfg"), "rope_scaling", "type");
  json o = json::parse(preset_config_json("olmoe", "tiny"));
  const ModelConfig a = parse_config(o.dump(), "a");
  o["clip_qkv"] = 8.000001;
  const ModelConfig b = parse_config(o.dump(), "b");
  EXPECT_FALSE(config_differences(a, b).empty()) << "clip_qkv 8 -> 8.000001 passed as no change";
  o = json::parse(preset_config_json("olmoe", "tiny"));
  o["rope_theta"] = 100000.0;
  const ModelConfig c = parse_config(o.dump(), "c");
  o["rope_theta"] = 100000.5;  // a float apart; both printed "100000" at six digits
  EXPECT_FALSE(config_differences(c, parse_config(o.dump(), "d")).empty());
}

TEST(CheckpointFailClosed, UnimplementedConfigKeysAreRefusedByName) {
  struct Case {
    std::string arch, key;
    json value;
  };
  const Case cases[] = {
      {"qwen3_moe", "attention_bias", true},
      {"olmoe", "attention_bias", true},
      {"qwen3_moe", "use_sliding_window", true},  // with the config's sliding_window below
      {"mixtral", "sliding_window", 64},
      {"olmoe", "quantization_config", json{{"quant_method", "awq"}}},
      {"olmoe", "quantization_config",
       json{{"quant_method", "fp8"}, {"activation_scheme", "static"}}},
      {"olmoe", "hidden_act", "gelu"},
      {"mixtral", "rope_scaling", json{{"rope_type", "dynamic"}, {"factor", 4.0}}},
      {"deepseek_v3", "rope_scaling",
       json{{"rope_type", "yarn"}, {"factor", 4.0}, {"low_freq_factor", 1.0}}},
      {"olmoe", "partial_rotary_factor", 0.5},
      {"qwen3_moe", "layer_types", json::array({"sliding_attention"})},
      {"olmoe", "mlp_bias", true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.arch + " " + c.key);
    Corrupt k(c.arch);
    if (c.key == "use_sliding_window") set_config_key(k.dir, "sliding_window", 32);
    set_config_key(k.dir, c.key, c.value);
    const std::string named = c.key == "use_sliding_window" ? "sliding_window" : c.key;
    EXPECT_ERROR_MENTIONS(Checkpoint::open(k.dir), "config.json", "\"" + named + "\"",
                          "not implemented");
  }
  // Neutral values load: a window no shorter than the context, default rope scaling, silu,
  // attention_bias false, a rotary factor of 1.
  for (auto [arch, key, value] : std::vector<std::tuple<std::string, std::string, json>>{
           {"mixtral", "sliding_window", 1 << 20},
           {"mixtral", "sliding_window", nullptr},
           {"qwen3_moe", "sliding_window", 64},
           {"olmoe", "rope_scaling", json{{"rope_type", "default"}}},
           {"olmoe", "hidden_act", "silu"},
           {"olmoe", "attention_bias", false},
           {"olmoe", "partial_rotary_factor", 1.0}}) {
    SCOPED_TRACE(arch + " " + key);
    Corrupt k(arch);
    set_config_key(k.dir, key, value);
    EXPECT_NO_THROW(Checkpoint::open(k.dir));
  }
}

TEST(CheckpointFailClosed, ConfigValuesAreRangeChecked) {
  for (auto [key, value] :
       std::vector<std::pair<std::string, json>>{{"max_position_embeddings", -1},
                                                 {"max_position_embeddings", 1 << 28},
                                                 {"max_position_embeddings", 2147483647},
                                                 {"max_position_embeddings", 1 << 25},
                                                 {"rope_theta", 0},
                                                 {"rope_theta", -10000},
                                                 {"rope_theta", 1e300},
                                                 {"rms_norm_eps", -1e-6},
                                                 {"rms_norm_eps", 0},
                                                 {"vocab_size", 1 << 30},
                                                 {"num_hidden_layers", 100000},
                                                 {"head_dim", 1 << 20},
                                                 {"intermediate_size", 1 << 30},
                                                 {"eos_token_id", 1 << 20},
                                                 {"num_key_value_heads", 8},
                                                 {"clip_qkv", -1.0}}) {
    SCOPED_TRACE(key + " = " + value.dump());
    Corrupt k("olmoe");
    set_config_key(k.dir, key, value);
    EXPECT_ERROR_MENTIONS(Checkpoint::open(k.dir), "config.json", key);
  }
}

TEST(CheckpointFailClosed, EveryStoredTensorMustBeUsed) {
  // A bias r3 does not apply, and a tensor of an unknown layer, are refused by name.
  for (std::string extra : {"model.layers.0.self_attn.q_proj.bias",
                            "model.layers.9.mlp.gate.weight", "model.mtp.0.weight"}) {
    Corrupt c;
    c.edit([&](RawFile& r) {
      const uint64_t end = r.buffer.size();
      r.header[extra] = {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {end, end + 16}}};
      r.buffer += std::string(16, '\0');
    });
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st, "\"" + extra + "\"", "not used by r3");
  }
  // RoPE inverse frequencies of old exports are known and ignored.
  Corrupt ok;
  ok.edit([&](RawFile& r) {
    const uint64_t end = r.buffer.size();
    r.header["model.layers.0.self_attn.rotary_emb.inv_freq"] = {
        {"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {end, end + 16}}};
    r.buffer += std::string(16, '\0');
  });
  EXPECT_NO_THROW(Checkpoint::open(ok.dir));
}

TEST(CheckpointFailClosed, TiedEmbeddingsWithADifferentLmHeadAreRefused) {
  Corrupt c;
  set_config_key(c.dir, "tie_word_embeddings", true);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), "\"lm_head.weight\"", "tie_word_embeddings");
  // The same matrix stored twice is fine; without lm_head the embedding is used.
  c.edit([&](RawFile& r) {
    auto e = r.header["model.embed_tokens.weight"]["data_offsets"];
    auto h = r.header["lm_head.weight"]["data_offsets"];
    r.buffer.replace(size_t(h[0].get<uint64_t>()),
                     size_t(h[1].get<uint64_t>() - h[0].get<uint64_t>()),
                     r.buffer.substr(size_t(e[0].get<uint64_t>()),
                                     size_t(e[1].get<uint64_t>() - e[0].get<uint64_t>())));
  });
  auto ck = Checkpoint::open(c.dir);
  EXPECT_EQ(ck->weights().lm_head.packed, ck->weights().embed.packed);
  EXPECT_NE(ck->weights().lm_head.packed, nullptr);
}

TEST(CheckpointFailClosed, OnlyRegularFilesAreRead) {
  // A FIFO would block the loader forever and /dev/zero never ends: both are refused at once.
  Corrupt c;
  const std::string cfg = file_in(c.dir, "config.json");
  fs::remove(cfg);
  ASSERT_EQ(::mkfifo(cfg.c_str(), 0600), 0);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), cfg, "not a regular file");
  Corrupt z;
  fs::remove(z.st);
  fs::create_symlink("/dev/zero", z.st);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(z.dir), z.st, "not a regular file");
  Corrupt f;
  fs::remove(f.st);
  ASSERT_EQ(::mkfifo(f.st.c_str(), 0600), 0);
  EXPECT_ERROR_MENTIONS(Checkpoint::open(f.dir), f.st, "not a regular file");
}

TEST(CheckpointFailClosed, HeaderLengthOffByAFewBytesIsRefused) {
  for (int delta : {-3, -1, 1, 3}) {
    SCOPED_TRACE(delta);
    Corrupt c;
    std::string s = read_bytes(c.st);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(s[size_t(i)])) << (8 * i);
    n = uint64_t(int64_t(n) + delta);
    for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(n >> (8 * i)));
    write_bytes(c.st, s);
    EXPECT_ERROR_MENTIONS(Checkpoint::open(c.dir), c.st);
  }
}

TEST(CheckpointFailClosed, TensorsAtOddOffsetsAreReadAligned) {
  // A header of odd length puts the data at an odd file offset; r3's copies are aligned and
  // hold the same values.
  TmpDir d("odd");
  const std::string p = d / "x.safetensors";
  const float vals[4] = {1.5f, -2.f, 3.25f, 0.f};
  const std::string buf(reinterpret_cast<const char*>(vals), 16);
  std::string header =
      json{{"x", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}}}.dump();
  if (header.size() % 2 == 0) header += ' ';
  write_bytes(p, safetensors_bytes(header, buf));
  ASSERT_EQ(read_bytes(p).size() % 2, 1u);
  const std::vector<TensorToWrite> read = read_safetensors(p);
  ASSERT_EQ(read.size(), 1u);
  const TensorView x = view_of(read[0]);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(x.at(i), vals[i]);
}

}  // namespace
}  // namespace r3
