#include "model/checkpoint.h"

#include <array>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file_read.h"
#include "core/json_limits.h"
#include "core/thread_pool.h"
#include "core/u64_words.h"
#include "model/tensor_names.h"

namespace r3 {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string layer_prefix(int layer) { return "model.layers." + std::to_string(layer) + "."; }

namespace {
int which_index(const char* which) {
  const std::string w = which;
  return w == "gate" ? 0 : w == "up" ? 1 : 2;
}
}  // namespace

std::string router_name(const ModelConfig& c, int layer) {
  return layer_tensor(layer, layer_tensor_names(c.arch).router);
}
std::string expert_name(const ModelConfig& c, int layer, int expert, const char* which) {
  return layer_tensor(layer, layer_tensor_names(c.arch).expert[size_t(which_index(which))], expert);
}
std::string dense_name(const ModelConfig& c, int layer, const char* which) {
  return layer_tensor(layer, layer_tensor_names(c.arch).dense[size_t(which_index(which))]);
}
std::string shared_expert_name(const ModelConfig& c, int layer, const char* which) {
  return layer_tensor(layer, layer_tensor_names(c.arch).shared[size_t(which_index(which))]);
}
std::string shared_gate_name(const ModelConfig& c, int layer) {
  return layer_tensor(layer, layer_tensor_names(c.arch).shared_gate);
}
std::string router_bias_name(const ModelConfig& c, int layer) {
  return layer_tensor(layer, layer_tensor_names(c.arch).router_bias);
}

std::shared_ptr<Checkpoint> Checkpoint::open(const std::string& dir, const HeldExperts& held, ThreadPool* pool) {
  auto ck = std::shared_ptr<Checkpoint>(new Checkpoint());
  ck->dir_ = dir;
  if (!fs::is_directory(dir)) throw Error(dir + ": not a checkpoint directory");
  ck->weights_.config = load_config((fs::path(dir) / "config.json").string());
  if (held) {
    const ModelConfig& c = ck->weights_.config;
    const std::vector<std::vector<bool>> by_moe_layer = held(c);
    const std::vector<int> moe = c.moe_layers();
    if (by_moe_layer.size() != moe.size()) throw Error("held experts: " + std::to_string(by_moe_layer.size()) + " layers, the model has " + std::to_string(moe.size()));
    ck->held_.resize(size_t(c.num_layers));
    for (size_t m = 0; m < moe.size(); ++m) ck->held_[size_t(moe[m])] = by_moe_layer[m];
  }
  const SafetensorsFile::UnreadParts skipped = ck->unread_parts();
  ck->partial_ = !skipped.empty();
  fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> weight_map;
  if (fs::exists(index_path)) {
    json idx;
    try {
      idx = parse_json_bounded(read_text_file(index_path.string(), 64u << 20, "index"), index_path.string(), 8);
    } catch (const json::exception& e) {
      throw Error(index_path.string() + ": malformed JSON: " + e.what());
    }
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object())
      throw Error(index_path.string() + ": missing \"weight_map\" object");
    for (auto& [name, file] : idx["weight_map"].items()) {
      if (!file.is_string()) throw Error(index_path.string() + ": weight_map[\"" + name + "\"] is not a file name");
      std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        throw Error(index_path.string() + ": shard name \"" + f + "\" must be a plain file name");
      weight_map[name] = f;
      if (std::find(shard_names.begin(), shard_names.end(), f) == shard_names.end())
        shard_names.push_back(f);
    }
  } else {
    shard_names.push_back("model.safetensors");
  }
  for (auto& s : shard_names) {
    fs::path p = fs::path(dir) / s;
    if (!fs::exists(p)) {
      if (weight_map.empty()) throw Error(dir + ": no model.safetensors and no model.safetensors.index.json");
      throw Error(p.string() + ": shard named in model.safetensors.index.json is missing");
    }
    ck->files_.push_back(std::make_unique<SafetensorsFile>(p.string(), ck->partial_ ? &skipped : nullptr));
  }
  // Each tensor lives in exactly one shard, the one the index names for it.
  for (auto& f : ck->files_)
    for (auto& [name, t] : f->tensors()) {
      const std::string shard = fs::path(f->path()).filename().string();
      if (!weight_map.empty()) {
        auto it = weight_map.find(name);
        if (it == weight_map.end())
          throw Error(f->path() + ": tensor \"" + name + "\" is not listed in model.safetensors.index.json");
        if (it->second != shard)
          throw Error(f->path() + ": tensor \"" + name + "\" is listed in the index under " + it->second);
      }
      if (ck->index_.count(name)) throw Error(f->path() + ": tensor \"" + name + "\" appears twice");
      ck->index_[name] = &t;
    }
  for (auto& [name, file] : weight_map)
    if (!ck->index_.count(name))
      throw Error((fs::path(dir) / file).string() + ": tensor \"" + name +
                  "\" is listed in the index but not in the shard");
  ck->load_weights_on(pool);
  return ck;
}

void Checkpoint::load_weights_on(ThreadPool* pool) {
  struct PoolForTheLoad {
    Checkpoint* c;
    ~PoolForTheLoad() { c->pool_ = nullptr; }
  } scope{this};
  pool_ = pool;
  load_weights();
}

std::shared_ptr<Checkpoint> Checkpoint::from_memory(const std::string& config_json,
                                                    std::vector<TensorToWrite> tensors) {
  auto ck = std::shared_ptr<Checkpoint>(new Checkpoint());
  ck->dir_ = "<memory>";
  ck->weights_.config = parse_config(config_json, "<memory>/config.json");
  ck->memory_ = std::move(tensors);
  ck->memory_views_.reserve(ck->memory_.size());  // stable addresses for index_
  for (const TensorToWrite& t : ck->memory_) {
    TensorView v;
    v.name = t.name;
    v.file = "<memory>";
    v.dtype = t.dtype;
    v.shape = t.shape;
    v.data = t.bytes.data();
    if (v.nbytes() != t.bytes.size())
      throw Error("<memory>: tensor \"" + t.name + "\" has " + std::to_string(t.bytes.size()) +
                  " bytes, its shape needs " + std::to_string(v.nbytes()));
    if (ck->index_.count(t.name)) throw Error("<memory>: tensor \"" + t.name + "\" appears twice");
    ck->memory_views_.push_back(std::move(v));
    ck->index_[t.name] = &ck->memory_views_.back();
  }
  ck->load_weights();
  return ck;
}

SafetensorsFile::UnreadParts Checkpoint::unread_parts() const {
  const ModelConfig& c = weights_.config;
  const LayerTensorNames& N = layer_tensor_names(c.arch);
  SafetensorsFile::UnreadParts parts;
  for (int l = 0; l < int(held_.size()); ++l) {
    std::vector<bool> skip(size_t(c.num_experts), false);
    bool any = false;
    for (int e = 0; e < c.num_experts; ++e) any |= skip[size_t(e)] = !holds(l, e);
    if (!any) continue;
    if (N.fused_experts) {  // one tensor per layer, experts along its first dimension
      for (const std::string& fused : {N.fused_gate_up, N.fused_down}) {
        const std::string name = layer_tensor(l, fused);
        if (c.experts_mxfp4) parts[name + "_blocks"] = parts[name + "_scales"] = skip;
        else parts[name] = skip;
      }
      continue;
    }
    for (int e = 0; e < c.num_experts; ++e)
      if (skip[size_t(e)])
        for (const char* which : {"gate", "up", "down"}) {
          const std::string w = expert_name(c, l, e, which);
          parts[w] = {};
          parts[w + "_scale_inv"] = {};  // FP8 block scales
        }
  }
  return parts;
}

const TensorView& Checkpoint::require(const std::string& name, std::vector<int64_t> shape, bool bytes) {
  auto it = index_.find(name);
  if (it == index_.end()) throw Error(dir_ + ": missing tensor \"" + name + "\"");
  used_.insert(name);
  const TensorView& t = *it->second;
  if (t.shape != shape) {
    TensorView want;
    want.shape = shape;
    throw Error(t.file + ": tensor \"" + name + "\" has shape " + t.shape_str() + ", expected " +
                want.shape_str());
  }
  if (t.dtype == DType::F8_E4M3 && !bytes) return fp8_weight(t);
  if (bytes ? t.dtype != DType::U8 : !is_float_dtype(t.dtype))
    throw Error(t.file + ": tensor \"" + name + "\" is " + dtype_name(t.dtype) + ", expected " +
                (bytes ? "U8" : "F32, BF16 or F16"));
  if (t.dtype == DType::F16) {
    if (!t.data) {  // unread
      TensorView w = t;
      w.dtype = DType::F32;
      return widened_[name] = w;
    }
    owned_.push_back(t.to_f32());
    TensorView w = t;
    w.dtype = DType::F32;
    w.data = owned_.back().data();
    return widened_[name] = w;
  }
  return t;
}

namespace {
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
// "x.weight" -> "x.weight_scale_inv", the name its block scales are released under.
std::string scale_inv_name(const std::string& weight) { return weight + "_scale_inv"; }
}  // namespace

// Values that would make a quantized weight decode differently on different kernel paths, or to
// something that is not a number, are refused (whether they arrive from a file or an update).
void Checkpoint::check_quantized_values(const TensorView& t) const {
  const ModelConfig& c = config();
  auto refuse = [&](const std::string& what, int64_t i) {
    throw Error(t.file + ": tensor \"" + t.name + "\" holds " + what + " at element " + std::to_string(i));
  };
  const auto* b = static_cast<const uint8_t*>(t.data);
  if (!b) return;  // unread (another rank's expert)
  const int64_t n = t.numel();
  if (t.dtype == DType::F8_E4M3) {
    if (const int64_t i = first_e4m3_nan(b, n); i >= 0) refuse("an F8_E4M3 NaN", i);
  } else if (c.fp8_block_rows && ends_with(t.name, ".weight_scale_inv") && is_float_dtype(t.dtype)) {
    // Every nonzero product with an e4m3 value (2^-9 .. 448) stays a normal number whose bf16
    // rounding is finite: no path can flush it or overflow.
    for (int64_t i = 0; i < n; ++i) {
      const float v = t.at(i);
      if (!(v == 0.f || (v >= 0x1p-117f && v <= 0x1p118f)))
        refuse("block scale " + std::to_string(v) + " (must be 0 or within [2^-117, 2^118])", i);
    }
  } else if (c.experts_mxfp4 && ends_with(t.name, "_scales") && t.dtype == DType::U8) {
    for (int64_t i = 0; i < n; ++i)
      if (b[i] < 2 || b[i] > 252)
        refuse("scale byte " + std::to_string(b[i]) + ", outside [2, 252] (MXFP4 values would leave bf16's normal range)", i);
  }
}

namespace {

// True when some 16-bit lane of x is zero (any lane: the classic borrow test).
inline bool has_zero_u16(uint64_t x) { return ((x - 0x0001000100010001ull) & ~x & 0x8000800080008000ull) != 0; }
inline bool has_zero_u32(uint64_t x) { return ((x - 0x0000000100000001ull) & ~x & 0x8000000080000000ull) != 0; }

// The first element of a float tensor whose exponent bits are all ones (NaN or infinity), or -1.
// Eight bytes a step: the refit reads every byte anyway, and this keeps the check near the
// speed of that read.
int64_t first_non_finite(const TensorView& t) {
  const auto* b = static_cast<const uint8_t*>(t.data);
  if (!b || !is_float_dtype(t.dtype)) return -1;
  const int64_t n = t.numel();
  const size_t width = dtype_size(t.dtype);
  const uint64_t lane_mask = t.dtype == DType::F32 ? 0x7f800000ull : t.dtype == DType::BF16 ? 0x7f80ull : 0x7c00ull;
  const uint64_t mask = width == 4 ? lane_mask | lane_mask << 32 : lane_mask * 0x0001000100010001ull;
  auto bad = [&](int64_t i) {
    uint32_t bits = 0;
    std::memcpy(&bits, b + size_t(i) * width, width);
    return (bits & lane_mask) == lane_mask;
  };
  const int64_t per_word = int64_t(8 / width), words = n / per_word;
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t x = (load_u64(b + size_t(w) * 8) & mask) ^ mask;  // a zero lane: exponent all ones
    if (width == 4 ? has_zero_u32(x) : has_zero_u16(x))
      for (int64_t i = w * per_word; i < (w + 1) * per_word; ++i)
        if (bad(i)) return i;
  }
  for (int64_t i = words * per_word; i < n; ++i)
    if (bad(i)) return i;
  return -1;
}

void refuse_if_non_finite(const TensorView& t) {
  if (const int64_t i = first_non_finite(t); i >= 0)
    throw Error(t.file + ": tensor \"" + t.name + "\" holds a non-finite value (NaN or infinity) at element " +
                std::to_string(i) + "; refits must send finite weights");
}

}  // namespace

void Checkpoint::refuse_non_finite_values() const {
  for (const auto& [name, t] : index_) refuse_if_non_finite(*t);
}

// An F8_E4M3 matrix with its fp32 block scales (the sibling weight_scale_inv, F32 or BF16): a
// block-scaled view the kernels decode (TensorView::scale_inv).
const TensorView& Checkpoint::fp8_weight(const TensorView& t) {
  const ModelConfig& c = config();
  if (!c.fp8_block_rows)
    throw Error(t.file + ": tensor \"" + t.name + "\" is F8_E4M3 but config.json has no quantization_config "
                "{\"quant_method\": \"fp8\"} giving its block size");
  if (t.shape.size() != 2) throw Error(t.file + ": tensor \"" + t.name + "\" is F8_E4M3; r3 reads FP8 matrices only");
  const int64_t O = t.shape[0], I = t.shape[1], br = c.fp8_block_rows, bc = c.fp8_block_cols;
  const std::string sname = scale_inv_name(t.name);
  auto it = index_.find(sname);
  if (it == index_.end())
    throw Error(dir_ + ": missing tensor \"" + sname + "\" (the block scales of F8_E4M3 \"" + t.name + "\")");
  used_.insert(sname);
  const TensorView& s = *it->second;
  const std::vector<int64_t> want = {(O + br - 1) / br, (I + bc - 1) / bc};
  if (s.shape != want || !is_float_dtype(s.dtype)) {
    TensorView w;
    w.shape = want;
    throw Error(s.file + ": tensor \"" + sname + "\" is " + dtype_name(s.dtype) + " " + s.shape_str() +
                ", expected float " + w.shape_str() + " (weight_block_size " + std::to_string(br) + " x " +
                std::to_string(bc) + ")");
  }
  check_quantized_values(t);
  check_quantized_values(s);
  TensorView v = t;
  if (s.dtype == DType::F32 || !s.data) {
    v.scale_inv = static_cast<const float*>(s.data);
  } else {  // widened into derived_, which an update hands back as rewritten
    const std::vector<float> f = s.to_f32();
    uint8_t* d = derived_buffer(f.size() * 4);
    std::memcpy(d, f.data(), f.size() * 4);
    v.scale_inv = reinterpret_cast<const float*>(d);
  }
  v.block_rows = int(br);
  v.block_cols = int(bc);
  return widened_[t.name] = v;
}

// A bf16 copy of a block-scaled FP8 matrix: each element rounded from its fp32 product, as the
// kernels decode it (for weights the engine rearranges instead of multiplying as stored).
TensorView Checkpoint::decoded_bf16(const TensorView& src) {
  auto* d = reinterpret_cast<uint16_t*>(derived_buffer(size_t(src.numel()) * 2));
  for (int64_t i = 0, n = src.numel(); i < n; ++i) d[i] = f32_to_bf16(src.at(i));
  TensorView v;
  v.name = src.name;
  v.file = src.file;
  v.dtype = DType::BF16;
  v.shape = src.shape;
  v.data = d;
  return v;
}

void Checkpoint::load_weights() {
  const ModelConfig& c = weights_.config;
  auto mlp = [](const TensorView& gate, const TensorView& up, const TensorView& down) {
    ExpertWeights w;
    w.gate = gate;
    w.up = up;
    w.down = down;
    return w;
  };
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t qd = int64_t(c.num_heads) * hd, kvd = int64_t(c.num_kv_heads) * hd;
  weights_.embed = require("model.embed_tokens.weight", {V, H});
  weights_.final_norm = require("model.norm.weight", {H});
  if (c.tie_word_embeddings) {
    // Tied: the output projection is the embedding (transformers ties them whatever the file
    // holds). A stored lm_head is accepted only when it is that same matrix.
    weights_.lm_head = weights_.embed;
    if (index_.count("lm_head.weight")) {
      const TensorView& head = require("lm_head.weight", {V, H});
      if (head.dtype != weights_.embed.dtype ||
          std::memcmp(head.data, weights_.embed.data, head.nbytes()) != 0)
        throw Error(head.file + ": tensor \"lm_head.weight\" differs from model.embed_tokens.weight but "
                    "tie_word_embeddings is true");
    }
  } else {
    weights_.lm_head = require("lm_head.weight", {V, H});
  }
  for (int i = 0; i < c.num_layers; ++i) {
    LayerWeights L;
    const LayerTensorNames& N = layer_tensor_names(c.arch);
    auto name = [&](const std::string& relative) { return layer_tensor(i, relative); };
    L.input_norm = require(name(N.input_norm), {H});
    L.post_norm = require(name(N.post_norm), {H});
    if (c.mla) {
      const MlaSpec& m = *c.mla;
      const int64_t nh = c.num_heads;
      if (m.q_lora_rank > 0) {
        L.q_a = require(name(N.q_a), {m.q_lora_rank, H});
        L.q_a_norm = require(name(N.q_a_norm), {m.q_lora_rank});
        L.q = require(name(N.q_b), {nh * m.qk_head_dim(), m.q_lora_rank});
      } else {
        L.q = require(name(N.q), {nh * m.qk_head_dim(), H});
      }
      L.kv_a = require(name(N.kv_a), {m.latent_width(), H});
      L.kv_a_norm = require(name(N.kv_a_norm), {m.kv_lora_rank});
      L.kv_b = require(name(N.kv_b), {nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank});
      // The engine splits kv_b into per-head absorbed copies rather than multiplying it whole.
      if (L.kv_b.dtype == DType::F8_E4M3) L.kv_b = decoded_bf16(L.kv_b);
      L.o = require(name(N.o), {H, nh * m.v_head_dim});
    } else {
      L.q = require(name(N.q), {qd, H});
      L.k = require(name(N.k), {kvd, H});
      L.v = require(name(N.v), {kvd, H});
      L.o = require(name(N.o), {H, qd});
    }
    const AttentionSpec& attn = c.layers[size_t(i)].attention;
    if (attn.qkv_bias) {
      L.q_bias = require(name(N.q_bias), {qd});
      L.k_bias = require(name(N.k_bias), {kvd});
      L.v_bias = require(name(N.v_bias), {kvd});
    }
    if (attn.o_bias) L.o_bias = require(name(N.o_bias), {H});
    if (attn.sinks) L.sinks = require(name(N.sinks), {int64_t(c.num_heads)});
    if (attn.qk_norm == QkNorm::PerHead) {
      L.q_norm = require(name(N.q_norm), {hd});
      L.k_norm = require(name(N.k_norm), {hd});
    } else if (attn.qk_norm == QkNorm::Whole) {
      L.q_norm = require(name(N.q_norm), {qd});
      L.k_norm = require(name(N.k_norm), {kvd});
    }
    L.moe = c.layers[size_t(i)].moe;
    if (L.moe) {
      const int64_t I = c.moe_intermediate_size;
      L.router = require(router_name(c, i), {c.num_experts, H});
      if (c.router.selection_bias || c.router.logit_bias)
        L.router_bias = require(router_bias_name(c, i), {c.num_experts});
      const LayerConfig& lc = c.layers[size_t(i)];
      if (lc.shared_intermediate > 0) {
        const int64_t S = lc.shared_intermediate;
        L.shared = mlp(require(shared_expert_name(c, i, "gate"), {S, H}), require(shared_expert_name(c, i, "up"), {S, H}),
                       require(shared_expert_name(c, i, "down"), {H, S}));
        if (lc.shared_gate) L.shared_gate = require(shared_gate_name(c, i), {1, H});
      }
      if (N.fused_experts) L.experts = split_fused_experts(i);
      for (int e = 0; e < c.num_experts && !N.fused_experts; ++e)
        L.experts.push_back(mlp(require(expert_name(c, i, e, "gate"), {I, H}),
                                require(expert_name(c, i, e, "up"), {I, H}),
                                require(expert_name(c, i, e, "down"), {H, I})));
    } else {
      const int64_t I = c.intermediate_size;
      L.dense = mlp(require(dense_name(c, i, "gate"), {I, H}), require(dense_name(c, i, "up"), {I, H}),
                    require(dense_name(c, i, "down"), {H, I}));
    }
    weights_.layers.push_back(std::move(L));
  }
  // Every stored tensor must be one r3 computes with: anything else (biases, a shared expert,
  // extra layers) belongs to a model r3 would silently compute differently.
  // MTP layers (num_nextn_predict_layers) are stored as decoder layers after the last one; r3
  // runs no speculative decoding, so they are recognised and left unused.
  auto mtp_layer = [&](const std::string& name) {
    for (int m = 0; m < c.num_nextn_predict_layers; ++m)
      if (name.rfind(layer_prefix(c.num_layers + m), 0) == 0) return true;
    return false;
  };
  for (auto& [name, t] : index_) {
    if (used_.count(name) || knowingly_unused(name) || mtp_layer(name)) continue;
    throw Error(t->file + ": tensor \"" + name + "\" is not used by r3's " + c.architecture +
                " (a feature r3 does not implement, or a different architecture)");
  }
}

namespace {
// src's description for a derived copy of (part of) it: its dtype and file, this name and shape.
TensorView derived_view(const TensorView& src, std::string name, std::vector<int64_t> shape, const uint8_t* data) {
  TensorView v = src;
  v.name = std::move(name);
  v.shape = std::move(shape);
  v.data = data;
  return v;
}
}  // namespace

uint8_t* Checkpoint::derived_buffer(size_t bytes) {
  std::vector<uint8_t> buffer;
  auto spare = spare_derived_.find(bytes);
  if (spare != spare_derived_.end() && !spare->second.empty()) {
    buffer = std::move(spare->second.back());
    spare->second.pop_back();
  } else {
    buffer.resize(bytes);
  }
  derived_.push_back(std::move(buffer));
  return derived_.back().data();
}

// A strided copy of src into derived_: out[r, k] = src[base + r * row_stride + k * col_stride]
// (a vector when shape has one dimension), in src's dtype, named src.name + what.
TensorView Checkpoint::derived_copy(const TensorView& src, const std::string& what, std::vector<int64_t> shape,
                                    int64_t base, int64_t row_stride, int64_t col_stride) {
  const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
  uint8_t* out = derived_buffer(size_t(rows * cols) * dtype_size(src.dtype));
  auto copy = [&](auto element) {
    using T = decltype(element);
    T* d = reinterpret_cast<T*>(out);
    const T* f = static_cast<const T*>(src.data);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k) d[r * cols + k] = f[base + r * row_stride + k * col_stride];
  };
  if (dtype_size(src.dtype) == 2) copy(uint16_t());
  else copy(uint32_t());  // F32 (F16 was widened by require)
  return derived_view(src, src.name + what, std::move(shape), out);
}

namespace {
// Expert e's rows of GPT-OSS's bf16 (or float) fused experts, gate_up [E, H, 2I] and down
// [E, I, H] (inputs first), as [out, in] matrices: gate [I, H] from gate_up's even columns, up
// [I, H] from its odd ones (both in one pass over the block), down [H, I].
void split_expert(const TensorView& gate_up, const TensorView& down, int64_t e, uint8_t* gate, uint8_t* up,
                  uint8_t* dn) {
  const int64_t H = gate_up.shape[1], I = gate_up.shape[2] / 2;
  if (dtype_size(gate_up.dtype) == 2) {
    transpose_u16_pairs(static_cast<const uint16_t*>(gate_up.data) + e * H * 2 * I, 2 * I, H, I,
                        reinterpret_cast<uint16_t*>(gate), reinterpret_cast<uint16_t*>(up), H);
    transpose_u16(static_cast<const uint16_t*>(down.data) + e * I * H, H, I, H, reinterpret_cast<uint16_t*>(dn), I);
    return;
  }
  // F32 (F16 was widened by require)
  const float* gu = static_cast<const float*>(gate_up.data) + e * H * 2 * I;
  const float* d = static_cast<const float*>(down.data) + e * I * H;
  auto* g = reinterpret_cast<float*>(gate);
  auto* u = reinterpret_cast<float*>(up);
  auto* o = reinterpret_cast<float*>(dn);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < I; ++i) {
      g[i * H + h] = gu[h * 2 * I + 2 * i];
      u[i * H + h] = gu[h * 2 * I + 2 * i + 1];
      o[h * I + i] = d[i * H + h];
    }
}
}  // namespace

std::vector<ExpertWeights> Checkpoint::split_fused_experts(int layer) {
  const ModelConfig& c = weights_.config;
  const LayerTensorNames& N = layer_tensor_names(c.arch);
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  std::vector<ExpertWeights> out;
  if (c.experts_mxfp4) {
    out = split_mxfp4_experts(layer);
  } else {
    const TensorView& gate_up = require(layer_tensor(layer, N.fused_gate_up), {E, H, 2 * I});
    const TensorView& down = require(layer_tensor(layer, N.fused_down), {E, I, H});
    out.resize(static_cast<size_t>(E));
    // The buffers first (derived_ grows on this thread only), then the copies, an expert at a
    // time on the update's threads when it has some.
    const size_t bytes = size_t(I * H) * dtype_size(gate_up.dtype);
    std::vector<std::array<uint8_t*, 3>> to(static_cast<size_t>(E), {nullptr, nullptr, nullptr});
    for (int64_t e = 0; e < E; ++e) {
      if (!holds(layer, e)) continue;  // another rank's: its rows were not read
      const std::string tag = "[" + std::to_string(e) + "]";
      to[size_t(e)] = {derived_buffer(bytes), derived_buffer(bytes), derived_buffer(bytes)};
      out[size_t(e)].gate = derived_view(gate_up, gate_up.name + tag + ".gate", {I, H}, to[size_t(e)][0]);
      out[size_t(e)].up = derived_view(gate_up, gate_up.name + tag + ".up", {I, H}, to[size_t(e)][1]);
      out[size_t(e)].down = derived_view(down, down.name + tag, {H, I}, to[size_t(e)][2]);
    }
    auto split = [&](int64_t e) {
      if (to[size_t(e)][0]) split_expert(gate_up, down, e, to[size_t(e)][0], to[size_t(e)][1], to[size_t(e)][2]);
    };
    if (pool_) pool_->parallel_for_each(E, split);
    else
      for (int64_t e = 0; e < E; ++e) split(e);
  }
  // The biases, in both layouts: gate_up_proj_bias [E, 2I] interleaved, down_proj_bias [E, H].
  if (!c.layers[size_t(layer)].expert_bias) return out;
  const TensorView& gate_up_bias = require(layer_tensor(layer, N.fused_gate_up_bias), {E, 2 * I});
  const TensorView& down_bias = require(layer_tensor(layer, N.fused_down_bias), {E, H});
  for (int64_t e = 0; e < E; ++e) {
    const std::string tag = "[" + std::to_string(e) + "]";
    out[size_t(e)].gate_bias = derived_copy(gate_up_bias, tag + ".gate", {I}, e * 2 * I, 2, 0);
    out[size_t(e)].up_bias = derived_copy(gate_up_bias, tag + ".up", {I}, e * 2 * I + 1, 2, 0);
    out[size_t(e)].down_bias = derived_copy(down_bias, tag, {H}, e * H, 1, 0);
  }
  return out;
}

// The MXFP4 layout (GPT-OSS as released): {gate_up,down}_proj_blocks [E, rows, in/32, 16] and
// _scales [E, rows, in/32], rows in the output order (gate_up's row 2i is gate i, 2i + 1 up i,
// as transformers' dequantization and its ::2 split give them). Each expert's gate and up rows
// are copied out (derived_); down is a view into the stored bytes. Scales must keep every value
// a normal bf16 number (the engine decodes to bf16 by moving the exponent): byte 2..252.
std::vector<ExpertWeights> Checkpoint::split_mxfp4_experts(int layer) {
  const ModelConfig& c = weights_.config;
  const LayerTensorNames& N = layer_tensor_names(c.arch);
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  const std::string gu = layer_tensor(layer, N.fused_gate_up), dn = layer_tensor(layer, N.fused_down);
  const TensorView& gu_blocks = require(gu + "_blocks", {E, 2 * I, H / 32, 16}, true);
  const TensorView& gu_scales = require(gu + "_scales", {E, 2 * I, H / 32}, true);
  const TensorView& dn_blocks = require(dn + "_blocks", {E, H, I / 32, 16}, true);
  const TensorView& dn_scales = require(dn + "_scales", {E, H, I / 32}, true);
  for (const TensorView* s : {&gu_scales, &dn_scales})
    for (int64_t e = 0; e < E; ++e) {
      if (!holds(layer, e)) continue;  // rows never read
      TensorView one = *s;  // expert e's scales
      one.shape = {s->shape[1], s->shape[2]};
      one.data = static_cast<const uint8_t*>(s->data) + size_t(e * s->shape[1] * s->shape[2]);
      check_quantized_values(one);
    }
  auto view = [](const std::string& name, const std::string& file, int64_t rows, int64_t in, const uint8_t* blocks,
                 const uint8_t* scales) {
    TensorView v;
    v.name = name;
    v.file = file;
    v.dtype = DType::MXFP4;
    v.shape = {rows, in};
    v.data = blocks;
    v.scales = scales;
    return v;
  };
  // Rows parity, parity + 2, ... of expert e's gate_up: blocks then scales in one derived buffer.
  auto every_other_row = [&](int64_t e, int parity) {
    const int64_t rb = H / 2, rs = H / 32;  // bytes per row
    uint8_t* out = derived_buffer(size_t(I * (rb + rs)));
    const auto* b = static_cast<const uint8_t*>(gu_blocks.data) + size_t(e * 2 * I * rb);
    const auto* s = static_cast<const uint8_t*>(gu_scales.data) + size_t(e * 2 * I * rs);
    for (int64_t i = 0; i < I; ++i) {
      std::memcpy(out + i * rb, b + (2 * i + parity) * rb, size_t(rb));
      std::memcpy(out + I * rb + i * rs, s + (2 * i + parity) * rs, size_t(rs));
    }
    return view(gu + "[" + std::to_string(e) + (parity ? "].up" : "].gate"), gu_blocks.file, I, H, out, out + I * rb);
  };
  std::vector<ExpertWeights> out(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    if (!holds(layer, e)) continue;
    ExpertWeights& w = out[size_t(e)];
    w.gate = every_other_row(e, 0);
    w.up = every_other_row(e, 1);
    w.down = view(dn + "[" + std::to_string(e) + "]", dn_blocks.file, H, I,
                  static_cast<const uint8_t*>(dn_blocks.data) + size_t(e * H * I / 2),
                  static_cast<const uint8_t*>(dn_scales.data) + size_t(e * H * I / 32));
  }
  return out;
}

// Tensors that carry nothing r3 needs: RoPE inverse frequencies that old exports stored
// (r3 computes them from rope_theta).
bool knowingly_unused(const std::string& name) {
  static const std::string inv_freq = ".self_attn.rotary_emb.inv_freq";
  return name.size() > inv_freq.size() && name.compare(name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0;
}

void Checkpoint::check_update(std::vector<TensorToWrite>& tensors) const {
  for (TensorToWrite& t : tensors) {
    auto it = index_.find(t.name);
    check_sent_tensor(it == index_.end() ? nullptr : it->second, t.name, t.dtype, t.shape);
    const TensorView& have = *it->second;
    if (t.bytes.size() != have.nbytes())
      throw Error("weight update: tensor \"" + t.name + "\" has " + std::to_string(t.bytes.size()) +
                  " bytes, its shape needs " + std::to_string(have.nbytes()));
    TensorView sent = have;
    sent.file = "weight update";
    sent.data = t.bytes.data();
    check_quantized_values(sent);
    refuse_if_non_finite(sent);
  }
}

void Checkpoint::check_sent_tensor(const TensorView* have, const std::string& name, DType& dtype,
                                   const std::vector<int64_t>& shape) {
  if (!have) throw Error("weight update: tensor \"" + name + "\" is not in the served model");
  // Bytes sent for an F8_E4M3 tensor are its codes (callers without a float8 type send bytes).
  if (dtype == DType::U8 && have->dtype == DType::F8_E4M3) dtype = DType::F8_E4M3;
  if (have->shape != shape || have->dtype != dtype) {
    TensorView got;
    got.shape = shape;
    throw Error("weight update: tensor \"" + name + "\" is " + dtype_name(dtype) + " " + got.shape_str() +
                ", the served model's is " + dtype_name(have->dtype) + " " + have->shape_str());
  }
}

std::map<std::string, TensorView> Checkpoint::catalog() const {
  std::map<std::string, TensorView> out;
  for (const auto& [name, t] : index_) {
    out[name] = *t;
    out[name].data = nullptr;  // the description only: the bytes stay the checkpoint's
  }
  return out;
}

uint64_t Checkpoint::stored_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, t] : index_) n += t->nbytes();
  return n;
}

std::vector<TensorToWrite> Checkpoint::stored_tensors() const {
  if (partial_) throw Error(dir_ + ": opened without some tensors (one expert-parallel rank's view)");
  std::vector<TensorToWrite> out;
  for (auto& [name, t] : index_) {
    out.push_back(copy_tensor(*t));
    out.back().name = name;
  }
  return out;
}

Checkpoint::Update Checkpoint::apply_update(std::vector<TensorToWrite> tensors, ThreadPool* pool) {
  check_update(tensors);
  // The one rule load_weights checks that an update can break: a stored lm_head of a tied model
  // must stay equal to the embedding. Checked on the bytes after the update, before anything is
  // written, so a refused update leaves this checkpoint as it was.
  if (config().tie_word_embeddings && index_.count("lm_head.weight")) {
    auto bytes_of = [&](const std::string& name) -> const void* {
      for (const TensorToWrite& t : tensors)
        if (t.name == name) return t.bytes.data();
      return index_.at(name)->data;
    };
    if (std::memcmp(bytes_of("lm_head.weight"), bytes_of("model.embed_tokens.weight"),
                    index_.at("lm_head.weight")->nbytes()) != 0)
      throw Error("weight update: lm_head.weight would differ from model.embed_tokens.weight but "
                  "tie_word_embeddings is true (send both, equal, or neither)");
  }
  Update out;
  for (TensorToWrite& t : tensors) {
    const TensorView* old = index_.at(t.name);
    // What held the old bytes: an earlier update's buffer, a from_memory tensor, or a shard
    // (freed below once none of its tensors is served from it).
    auto prev = adopted_.find(t.name);
    if (prev != adopted_.end()) {
      out.replaced.push_back(std::make_shared<std::vector<uint8_t>>(std::move(prev->second.bytes)));
    } else if (!memory_views_.empty() && old >= memory_views_.data() &&
               old < memory_views_.data() + memory_views_.size()) {
      const size_t i = size_t(old - memory_views_.data());
      out.replaced.push_back(std::make_shared<std::vector<uint8_t>>(std::move(memory_[i].bytes)));
    }
    Adopted& a = adopted_[t.name];
    a.view = *old;
    a.view.file = "<weight update>";
    a.bytes = std::move(t.bytes);
    a.view.data = a.bytes.data();
    index_[t.name] = &a.view;
    out.written.emplace_back(a.bytes.data(), a.bytes.size());
  }
  for (std::unique_ptr<SafetensorsFile>& f : files_) {
    if (!f) continue;
    bool serves = false;
    for (auto& [name, t] : f->tensors()) serves |= index_.at(name) == &t;
    if (!serves) out.replaced.push_back(std::shared_ptr<SafetensorsFile>(std::move(f)));
  }
  widened_.clear();
  owned_.clear();
  // The load rebuilds the derived copies into the buffers they had (derived_buffer).
  for (std::vector<uint8_t>& d : derived_) spare_derived_[d.size()].push_back(std::move(d));
  derived_.clear();
  used_.clear();
  weights_.layers.clear();
  load_weights_on(pool);
  spare_derived_.clear();
  // Derived copies (split fused experts) are all rewritten: whatever was packed from them is rebuilt.
  for (const std::vector<uint8_t>& d : derived_) out.written.emplace_back(d.data(), d.size());
  return out;
}

std::vector<std::string> Checkpoint::differences(const Checkpoint& other) const {
  std::vector<std::string> out = config_differences(config(), other.config());
  if (!out.empty()) return out;
  for (auto& [name, t] : index_) {
    auto it = other.index_.find(name);
    if (it == other.index_.end()) continue;  // tied lm_head stored or not: the config decides
    if (t->dtype != it->second->dtype)
      out.push_back("tensor " + name + ": " + dtype_name(t->dtype) + " -> " + dtype_name(it->second->dtype));
  }
  return out;
}

}  // namespace r3
