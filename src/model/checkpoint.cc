#include "model/checkpoint.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.h"
#include "core/file_read.h"
#include "core/json_limits.h"
#include "core/panel_layout.h"
#include "core/resident_memory.h"
#include "core/seconds_since.h"
#include "core/thread_pool.h"
#include "kernels/matmul.h"
#include "model/tensor_names.h"

namespace r3 {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
// The unit a stored tensor belongs to: 1 + its decoder layer, or 0 (embedding, norm, lm_head).
// Unit 1 + l for decoder layer l's tensors (under either ModelConfig::tensor_prefix), else 0.
int unit_of(const std::string& name) {
  for (const std::string prefix : {"model.layers.", "model.language_model.layers."})
    if (name.rfind(prefix, 0) == 0) return 1 + std::atoi(name.c_str() + prefix.size());
  return 0;
}
}  // namespace

namespace {
void refuse_if_non_finite(const TensorView& t);
}  // namespace

std::string layer_prefix(int layer) { return "model.layers." + std::to_string(layer) + "."; }
std::string embed_name(const ModelConfig& c) { return c.tensor_prefix + "embed_tokens.weight"; }

bool unused_by_design(const ModelConfig& c, const std::string& name) {
  if (knowingly_unused(name)) return true;
  // MTP layers (num_nextn_predict_layers) stored as decoder layers after the last one (DeepSeek-V3,
  // GLM-4.5), or under mtp.* (Qwen3-Next, Qwen3.5): r3 runs them nowhere yet.
  for (int m = 0; m < c.num_nextn_predict_layers; ++m)
    if (name.rfind(layer_prefix(c.num_layers + m), 0) == 0) return true;
  if ((c.arch == Arch::Qwen3Next || c.arch == Arch::Qwen3_5Moe) && name.rfind("mtp.", 0) == 0)
    return true;
  // A vision-language release's vision tower: r3 serves the text decoder only.
  return c.vision_tower && name.rfind("model.visual.", 0) == 0;
}

namespace {
int which_index(const char* which) {
  const std::string w = which;
  return w == "gate" ? 0 : w == "up" ? 1 : 2;
}
}  // namespace

std::string router_name(const ModelConfig& c, int layer) {
  return layer_tensor(layer, layer_tensor_names(c.arch).router, -1, c.tensor_prefix);
}
std::string expert_name(const ModelConfig& c, int layer, int expert, const char* which) {
  return layer_tensor(layer, layer_tensor_names(c.arch).expert[size_t(which_index(which))], expert,
                      c.tensor_prefix);
}
std::string dense_name(const ModelConfig& c, int layer, const char* which) {
  return layer_tensor(layer, layer_tensor_names(c.arch).dense[size_t(which_index(which))], -1,
                      c.tensor_prefix);
}
std::string shared_expert_name(const ModelConfig& c, int layer, const char* which) {
  return layer_tensor(layer, layer_tensor_names(c.arch).shared[size_t(which_index(which))], -1,
                      c.tensor_prefix);
}
std::string shared_gate_name(const ModelConfig& c, int layer) {
  return layer_tensor(layer, layer_tensor_names(c.arch).shared_gate, -1, c.tensor_prefix);
}
std::string router_bias_name(const ModelConfig& c, int layer) {
  return layer_tensor(layer, layer_tensor_names(c.arch).router_bias, -1, c.tensor_prefix);
}

std::shared_ptr<Checkpoint> Checkpoint::open(const std::string& dir, const HeldExperts& held,
                                             ThreadPool* pool, bool refuse_non_finite) {
  std::shared_ptr<Checkpoint> ck = headers(dir, held);
  ck->refuse_non_finite_ = refuse_non_finite;
  ck->load_weights_on(pool);
  for (auto& f : ck->files_)
    f->close();  // nothing is read from the files again (reload reopens them)
  return ck;
}

std::shared_ptr<Checkpoint> Checkpoint::headers(const std::string& dir, const HeldExperts& held) {
  auto ck = std::shared_ptr<Checkpoint>(new Checkpoint());
  ck->dir_ = dir;
  if (!fs::is_directory(dir)) throw Error(dir + ": not a checkpoint directory");
  ck->weights_.config = load_config((fs::path(dir) / "config.json").string());
  if (held) {
    const ModelConfig& c = ck->weights_.config;
    const std::vector<std::vector<bool>> by_moe_layer = held(c);
    const std::vector<int> moe = c.moe_layers();
    if (by_moe_layer.size() != moe.size())
      throw Error("held experts: " + std::to_string(by_moe_layer.size()) +
                  " layers, the model has " + std::to_string(moe.size()));
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
      idx = parse_json_bounded(read_text_file(index_path.string(), 64u << 20, "index"),
                               index_path.string(), 8);
    } catch (const json::exception& e) {
      throw Error(index_path.string() + ": malformed JSON: " + e.what());
    }
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object())
      throw Error(index_path.string() + ": missing \"weight_map\" object");
    for (auto& [name, file] : idx["weight_map"].items()) {
      if (!file.is_string())
        throw Error(index_path.string() + ": weight_map[\"" + name + "\"] is not a file name");
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
      if (weight_map.empty())
        throw Error(dir + ": no model.safetensors and no model.safetensors.index.json");
      throw Error(p.string() + ": shard named in model.safetensors.index.json is missing");
    }
    ck->files_.push_back(
        std::make_unique<SafetensorsFile>(p.string(), ck->partial_ ? &skipped : nullptr));
  }
  // Each tensor lives in exactly one shard, the one the index names for it.
  for (auto& f : ck->files_)
    for (auto& [name, t] : f->tensors()) {
      const std::string shard = fs::path(f->path()).filename().string();
      if (!weight_map.empty()) {
        auto it = weight_map.find(name);
        if (it == weight_map.end())
          throw Error(f->path() + ": tensor \"" + name +
                      "\" is not listed in model.safetensors.index.json");
        if (it->second != shard)
          throw Error(f->path() + ": tensor \"" + name + "\" is listed in the index under " +
                      it->second);
      }
      if (ck->index_.count(name))
        throw Error(f->path() + ": tensor \"" + name + "\" appears twice");
      ck->index_[name] =
          const_cast<TensorView*>(&t);  // the reader's description; data is ours to point
      ck->file_of_[name] = f.get();
    }
  for (auto& [name, file] : weight_map)
    if (!ck->index_.count(name))
      throw Error((fs::path(dir) / file).string() + ": tensor \"" + name +
                  "\" is listed in the index but not in the shard");
  return ck;
}

std::shared_ptr<Checkpoint> Checkpoint::reload(ThreadPool* pool) const {
  if (updated_in_memory_)
    throw Error(
        dir_ +
        ": the served weights came from a refit in memory (update_weights_from_tensor) and are on "
        "no disk; send them again, or refit from a checkpoint (update_weights_from_disk)");
  for (const auto& f : files_)
    if (SafetensorsFile::identity_of(f->path()) != f->identity())
      throw Error(f->path() +
                  ": changed since it was read (r3 keeps the packed weights only); refit from a "
                  "checkpoint (update_weights_from_disk) to serve its new contents");
  std::vector<std::vector<bool>> held_by_moe;
  for (int l : config().moe_layers())
    held_by_moe.push_back(held_.empty() ? std::vector<bool>() : held_[size_t(l)]);
  HeldExperts held;
  if (partial_) held = [held_by_moe](const ModelConfig&) { return held_by_moe; };
  auto fresh = open(dir_, held, pool, refuse_non_finite_);
  for (size_t i = 0; i < files_.size() && i < fresh->files_.size(); ++i)
    if (fresh->files_[i]->identity() != files_[i]->identity())
      throw Error(files_[i]->path() +
                  ": changed while it was read again; refit from a checkpoint instead");
  return fresh;
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
  ck->updated_in_memory_ = true;
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
    ck->transient_.insert(t.bytes.data());
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
        const std::string name = layer_tensor(l, fused, -1, c.tensor_prefix);
        if (c.experts_mxfp4)
          parts[name + "_blocks"] = parts[name + "_scales"] = skip;
        else
          parts[name] = skip;
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

const TensorView& Checkpoint::require(const std::string& name, std::vector<int64_t> shape,
                                      bool bytes) {
  auto it = index_.find(name);
  if (it == index_.end()) throw Error(dir_ + ": missing tensor \"" + name + "\"");
  used_.insert(name);
  TensorView& t = *it->second;
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
  materialize(t);
  if (t.dtype == DType::F16) {
    if (!t.data) {  // unread, or dropped
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

uint8_t* Checkpoint::staging(size_t bytes) { return Staging::take(staging_, bytes); }

namespace {
constexpr size_t kStagingChunkBytes = size_t(256) << 20;
std::atomic<size_t> staging_chunk_bytes{kStagingChunkBytes};
}  // namespace

void Checkpoint::set_staging_chunk_bytes(size_t bytes) {
  staging_chunk_bytes = bytes ? bytes : kStagingChunkBytes;
}

std::unique_ptr<BigArray<uint8_t>> Checkpoint::Staging::adopt(Staging& s, const uint8_t* b,
                                                              size_t bytes) {
  for (size_t i = 0; i < s.chunks.size(); ++i)
    if (s.chunks[i]->get() == b && s.sizes[i] <= (bytes + 63) / 64 * 64) {
      std::unique_ptr<BigArray<uint8_t>> chunk = std::move(s.chunks[i]);
      s.chunks.erase(s.chunks.begin() + ptrdiff_t(i));
      s.sizes.erase(s.sizes.begin() + ptrdiff_t(i));
      if (i < s.chunk)
        --s.chunk;
      else if (i == s.chunk)
        s.used = 0;  // the next take starts the chunk after it
      return chunk;
    }
  return nullptr;
}

uint8_t* Checkpoint::Staging::take(Staging& s, size_t bytes, size_t align) {
  bytes = (bytes + 63) / 64 * 64;
  s.used = (s.used + align - 1) / align * align;
  while (s.chunk < s.chunks.size() && s.used + bytes > s.sizes[s.chunk]) {
    ++s.chunk;
    s.used = 0;
  }
  if (s.chunk == s.chunks.size()) {
    // Chunks of 256 MiB (or one tensor), kept for every later unit: their pages are cleared by
    // the kernel once, not once per layer.
    const size_t size = std::max<size_t>(bytes, staging_chunk_bytes);
    s.chunks.push_back(std::make_unique<BigArray<uint8_t>>(size));
    s.sizes.push_back(size);
    s.used = 0;
  }
  uint8_t* p = s.chunks[s.chunk]->get() + s.used;
  s.used += bytes;
  return p;
}

void Checkpoint::materialize(TensorView& t) {
  if (t.data) {  // in memory (from_memory, or sent by an update): dropped once packed; or kept
    if (transient_.count(t.data) && std::find(read_.begin(), read_.end(), &t) == read_.end())
      read_.push_back(&t);
    return;
  }
  auto f = file_of_.find(t.name);
  if (f == file_of_.end() || !f->second->lazy()) return;            // dropped after an earlier load
  if (f->second->never_read(t.name)) return;                        // another rank's
  if (auto r = read_ahead_.find(t.name); r != read_ahead_.end()) {  // load_weights' reader has it
    t.data = r->second;
    read_ahead_.erase(r);
    read_.push_back(&t);
    if (refuse_non_finite_) refuse_if_non_finite(t);
    return;
  }
  uint8_t* p = staging(t.nbytes());
  const auto started = std::chrono::steady_clock::now();
  f->second->read_tensor(t.name, p, pool_);
  load_figures_.read_seconds += seconds_since(started);
  t.data = p;
  read_.push_back(&t);
  if (refuse_non_finite_) refuse_if_non_finite(t);
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
    throw Error(t.file + ": tensor \"" + t.name + "\" holds " + what + " at element " +
                std::to_string(i));
  };
  const auto* b = static_cast<const uint8_t*>(t.data);
  if (!b) return;  // unread (another rank's expert)
  const int64_t n = t.numel();
  if (t.dtype == DType::F8_E4M3) {
    if (const int64_t i = first_e4m3_nan(b, n); i >= 0) refuse("an F8_E4M3 NaN", i);
  } else if (c.fp8_block_rows && ends_with(t.name, ".weight_scale_inv") &&
             is_float_dtype(t.dtype)) {
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
        refuse("scale byte " + std::to_string(b[i]) +
                   ", outside [2, 252] (MXFP4 values would leave bf16's normal range)",
               i);
  }
}

namespace {

void refuse_if_non_finite(const TensorView& t) {
  if (const int64_t i = first_non_finite(t); i >= 0)
    throw Error(t.file + ": tensor \"" + t.name +
                "\" holds a non-finite value (NaN or infinity) at element " + std::to_string(i) +
                "; refits must send finite weights");
}

}  // namespace

// An F8_E4M3 matrix with its fp32 block scales (the sibling weight_scale_inv, F32 or BF16): a
// block-scaled view the kernels decode (TensorView::scale_inv).
const TensorView& Checkpoint::fp8_weight(const TensorView& t) {
  const ModelConfig& c = config();
  if (!c.fp8_block_rows)
    throw Error(t.file + ": tensor \"" + t.name +
                "\" is F8_E4M3 but config.json has no quantization_config "
                "{\"quant_method\": \"fp8\"} giving its block size");
  if (t.shape.size() != 2)
    throw Error(t.file + ": tensor \"" + t.name + "\" is F8_E4M3; r3 reads FP8 matrices only");
  const int64_t O = t.shape[0], I = t.shape[1], br = c.fp8_block_rows, bc = c.fp8_block_cols;
  const std::string sname = scale_inv_name(t.name);
  auto it = index_.find(sname);
  if (it == index_.end())
    throw Error(dir_ + ": missing tensor \"" + sname + "\" (the block scales of F8_E4M3 \"" +
                t.name + "\")");
  used_.insert(sname);
  materialize(*it->second);
  materialize(const_cast<TensorView&>(t));
  const TensorView& s = *it->second;
  const std::vector<int64_t> want = {(O + br - 1) / br, (I + bc - 1) / bc};
  if (s.shape != want || !is_float_dtype(s.dtype)) {
    TensorView w;
    w.shape = want;
    throw Error(s.file + ": tensor \"" + sname + "\" is " + dtype_name(s.dtype) + " " +
                s.shape_str() + ", expected float " + w.shape_str() + " (weight_block_size " +
                std::to_string(br) + " x " + std::to_string(bc) + ")");
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
  if (!src.data) {  // not sent: keeps its copy
    TensorView v = src;
    v.dtype = DType::BF16;
    v.scale_inv = nullptr;
    return v;
  }
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

namespace {
ExpertWeights mlp(const TensorView& gate, const TensorView& up, const TensorView& down) {
  ExpertWeights w;
  w.gate = gate;
  w.up = up;
  w.down = down;
  return w;
}
}  // namespace

void Checkpoint::build_globals(ModelWeights& w) {
  const ModelConfig& c = weights_.config;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  w.embed = require(embed_name(c), {V, H});
  w.final_norm = require(c.tensor_prefix + "norm.weight", {H});
  if (c.tie_word_embeddings) {
    // Tied: the output projection is the embedding (transformers ties them whatever the file
    // holds). A stored lm_head is accepted only when it is that same matrix.
    w.lm_head = w.embed;
    if (index_.count("lm_head.weight")) {
      const TensorView& head = require("lm_head.weight", {V, H});
      if (head.data && w.embed.data &&
          (head.dtype != w.embed.dtype || std::memcmp(head.data, w.embed.data, head.nbytes()) != 0))
        throw Error(head.file +
                    ": tensor \"lm_head.weight\" differs from model.embed_tokens.weight but "
                    "tie_word_embeddings is true");
    }
  } else {
    w.lm_head = require("lm_head.weight", {V, H});
  }
}

LayerWeights Checkpoint::build_layer(int i) {
  const ModelConfig& c = weights_.config;
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const int64_t qd = int64_t(c.num_heads) * hd, kvd = int64_t(c.num_kv_heads) * hd;
  LayerWeights L;
  const LayerTensorNames& N = layer_tensor_names(c.arch);
  auto name = [&](const std::string& relative) {
    return layer_tensor(i, relative, -1, c.tensor_prefix);
  };
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
  } else if (c.layers[size_t(i)].attention.kind == AttentionKind::GatedDeltaNet) {
    build_deltanet(i, L);
  } else {
    // With an output gate, q_proj gives each head its query and its gate: [nh * 2 * hd, H].
    const int64_t q_rows = c.layers[size_t(i)].attention.output_gate ? 2 * qd : qd;
    L.q = require(name(N.q), {q_rows, H});
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
      L.shared = mlp(require(shared_expert_name(c, i, "gate"), {S, H}),
                     require(shared_expert_name(c, i, "up"), {S, H}),
                     require(shared_expert_name(c, i, "down"), {H, S}));
      if (lc.shared_gate) L.shared_gate = require(shared_gate_name(c, i), {1, H});
    }
    const bool fused =
        N.fused_experts || (N.fused_experts_linear &&
                            index_.count(layer_tensor(i, N.fused_gate_up, -1, c.tensor_prefix)));
    if (fused) L.experts = split_fused_experts(i);
    for (int e = 0; e < c.num_experts && !fused; ++e)
      L.experts.push_back(mlp(require(expert_name(c, i, e, "gate"), {I, H}),
                              require(expert_name(c, i, e, "up"), {I, H}),
                              require(expert_name(c, i, e, "down"), {H, I})));
  } else {
    const int64_t I = c.intermediate_size;
    L.dense =
        mlp(require(dense_name(c, i, "gate"), {I, H}), require(dense_name(c, i, "up"), {I, H}),
            require(dense_name(c, i, "down"), {H, I}));
  }
  return L;
}

// A Gated DeltaNet layer's tensors, with its input projections as the engine and the reference
// read them: qkv [conv_dim, H] (q, k, v channels head-major, the conv's channel order), z [vd, H],
// b and a [nv, H]. Qwen3.5 stores exactly these. Qwen3-Next stores in_proj_qkvz and in_proj_ba with
// their rows grouped per key head (group g: q_g, k_g, then v and z of value heads g*r .. g*r+r-1;
// b then a of those heads), which are copied here into that order, row by row (same values).
void Checkpoint::build_deltanet(int i, LayerWeights& L) {
  const ModelConfig& c = weights_.config;
  const DeltaNetSpec& d = *c.deltanet;
  const LayerTensorNames& N = layer_tensor_names(c.arch);
  auto name = [&](const std::string& relative) {
    return layer_tensor(i, relative, -1, c.tensor_prefix);
  };
  const int64_t H = c.hidden_size, kd = d.key_dim(), vd = d.value_dim(), nv = d.v_heads,
                C = d.conv_dim();
  if (d.combined_projections) {
    const int64_t nk = d.k_heads, r = nv / nk, dk = d.k_head_dim, rv = r * d.v_head_dim;
    const TensorView& qkvz = require(name(N.dn_qkvz), {2 * kd + 2 * vd, H});
    const TensorView& ba = require(name(N.dn_ba), {2 * nv, H});
    // Row runs (first source row, count) of each output, in order.
    std::vector<std::pair<int64_t, int64_t>> qkv_rows, z_rows, b_rows, a_rows;
    const int64_t G = 2 * dk + 2 * rv;  // rows per key-head group of qkvz
    for (int64_t g = 0; g < nk; ++g) qkv_rows.push_back({g * G, dk});
    for (int64_t g = 0; g < nk; ++g) qkv_rows.push_back({g * G + dk, dk});
    for (int64_t g = 0; g < nk; ++g) qkv_rows.push_back({g * G + 2 * dk, rv});
    for (int64_t g = 0; g < nk; ++g) z_rows.push_back({g * G + 2 * dk + rv, rv});
    for (int64_t g = 0; g < nk; ++g)
      b_rows.push_back({g * 2 * r, r}), a_rows.push_back({g * 2 * r + r, r});
    L.dn_qkv = gathered_rows(qkvz, ".qkv", qkv_rows);
    L.dn_z = gathered_rows(qkvz, ".z", z_rows);
    L.dn_b = gathered_rows(ba, ".b", b_rows);
    L.dn_a = gathered_rows(ba, ".a", a_rows);
  } else {
    L.dn_qkv = require(name(N.dn_qkv), {C, H});
    L.dn_z = require(name(N.dn_z), {vd, H});
    L.dn_b = require(name(N.dn_b), {nv, H});
    L.dn_a = require(name(N.dn_a), {nv, H});
  }
  L.dn_conv = require(name(N.dn_conv), {C, 1, d.conv_kernel});
  L.dn_dt_bias = require(name(N.dn_dt_bias), {nv});
  L.dn_a_log = require(name(N.dn_a_log), {nv});
  L.dn_norm = require(name(N.dn_norm), {d.v_head_dim});
  L.o = require(name(N.dn_out), {H, vd});
}

// Rows of src copied into derived_ in the order of `runs` (first row, count), in src's dtype.
TensorView Checkpoint::gathered_rows(const TensorView& src, const std::string& what,
                                     const std::vector<std::pair<int64_t, int64_t>>& runs) {
  int64_t rows = 0;
  for (const auto& run : runs) rows += run.second;
  const int64_t cols = src.shape[1];
  TensorView v = src;
  v.name = src.name + what;
  v.shape = {rows, cols};
  if (!src.data) {  // not sent (a refit): keeps its copy
    v.data = nullptr;
    return v;
  }
  const size_t row_bytes = size_t(cols) * dtype_size(src.dtype);
  uint8_t* out = derived_buffer(size_t(rows) * row_bytes);
  size_t at = 0;
  for (const auto& [first, count] : runs) {
    std::memcpy(out + at, static_cast<const uint8_t*>(src.data) + size_t(first) * row_bytes,
                size_t(count) * row_bytes);
    at += size_t(count) * row_bytes;
  }
  v.data = out;
  return v;
}

namespace {
// The matrices of a layer the engine multiplies as packed panels (the others' views are read as
// stored), in a fixed order: the order of their panels.
std::vector<TensorView*> layer_matrices(LayerWeights& L) {
  std::vector<TensorView*> out = {
      &L.q,        &L.k,          &L.v,           &L.o,         &L.router,      &L.dense.gate,
      &L.dense.up, &L.dense.down, &L.shared.gate, &L.shared.up, &L.shared.down, &L.shared_gate,
      &L.q_a,      &L.kv_a,       &L.dn_qkv,      &L.dn_z,      &L.dn_b,        &L.dn_a};
  for (ExpertWeights& e : L.experts)
    for (TensorView* t : {&e.gate, &e.up, &e.down}) out.push_back(t);
  return out;
}
// Every other view of a layer (read as stored).
std::vector<TensorView*> layer_small_views(LayerWeights& L) {
  std::vector<TensorView*> out = {
      &L.input_norm,  &L.post_norm, &L.q_bias,     &L.k_bias,   &L.v_bias, &L.q_a_norm,
      &L.kv_a_norm,   &L.kv_b,      &L.q_norm,     &L.k_norm,   &L.o_bias, &L.sinks,
      &L.router_bias, &L.dn_conv,   &L.dn_dt_bias, &L.dn_a_log, &L.dn_norm};
  for (ExpertWeights* e : {&L.shared, &L.dense})
    for (TensorView* t : {&e->gate_bias, &e->up_bias, &e->down_bias}) out.push_back(t);
  for (ExpertWeights& e : L.experts)
    for (TensorView* t : {&e.gate_bias, &e.up_bias, &e.down_bias}) out.push_back(t);
  return out;
}
bool packs(const TensorView& t) {
  return !t.shape.empty() && t.shape.size() == 2 && kernels::packable(t.dtype);
}
}  // namespace

Checkpoint::UnitViews Checkpoint::unit_views(int unit) {
  if (unit == 0) {
    // Tied: the embedding is lm_head's panels (read back by TensorView::at), not a second copy.
    if (weights_.config.tie_word_embeddings) return {{&weights_.lm_head}, {&weights_.final_norm}};
    return {{&weights_.lm_head}, {&weights_.embed, &weights_.final_norm}};
  }
  LayerWeights& L = weights_.layers[size_t(unit - 1)];
  return {layer_matrices(L), layer_small_views(L)};
}

// Packs the unit's matrices that have bytes (all of them at a load; the sent ones at an update,
// the others keeping old's panels), then moves the bytes the unit's views still point at (small
// tensors, FP8 block scales) out of the staging area and drops everything else read for it.
void Checkpoint::settle(int unit, const UnitViews& now, const UnitViews* old) {
  // Views an update did not send (no bytes) keep what the served ones had.
  auto keep_old = [](TensorView& v, const TensorView& was) {
    if (v.data || v.shape != was.shape || v.dtype != was.dtype) return;
    v.data = was.data;
    v.packed = was.packed;
    v.scales = was.scales;
    if (!v.scale_inv) v.scale_inv = was.scale_inv;
  };
  if (old) {
    for (size_t i = 0; i < now.matrices.size() && i < old->matrices.size(); ++i)
      keep_old(*now.matrices[i], *old->matrices[i]);
    for (size_t i = 0; i < now.small.size() && i < old->small.size(); ++i)
      keep_old(*now.small[i], *old->small[i]);
  }
  std::vector<TensorView*> mats;  // every matrix with bytes or panels, in the fixed order
  for (TensorView* v : now.matrices)
    if ((v->data || v->packed) && packs(*v)) mats.push_back(v);
  std::vector<TensorView*> views = now.matrices;
  views.insert(views.end(), now.small.begin(), now.small.end());
  std::vector<size_t> at = {0};
  for (const TensorView* t : mats)
    at.push_back(at.back() + (kernels::packed_bf16_size(*t) + 31) / 32 * 32);
  if (panels_.size() <= size_t(unit)) {
    panels_.resize(size_t(unit) + 1);
    panel_elements_.resize(size_t(unit) + 1);
  }
  const bool in_place = panels_[size_t(unit)] && panel_elements_[size_t(unit)] == at.back();
  if (!in_place) {
    for (const TensorView* t : mats)
      if (!t->data)
        throw Error(t->file + ": tensor \"" + t->name + "\" has no bytes to pack (internal error)");
    panels_[size_t(unit)] = std::make_unique<BigArray<uint16_t>>(
        std::max<size_t>(at.back(), 32));  // packing writes every byte
    panel_elements_[size_t(unit)] = at.back();
  }
  uint16_t* panels = panels_[size_t(unit)]->get();
  struct Item {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Item>
      items;  // about 1 MiB of panels each, so one large tensor spreads over every thread
  for (size_t i = 0; i < mats.size(); ++i) {
    TensorView& t = *mats[i];
    if (!t.data) continue;  // keeps its panels
    const int64_t panel_count = (t.shape[0] + kernels::kPanelRows - 1) / kernels::kPanelRows;
    const int64_t per_item =
        std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, t.shape[1] * 32));
    for (int64_t p = 0; p < panel_count; p += per_item)
      items.push_back({i, p, std::min(panel_count, p + per_item)});
  }
  auto pack = [&](int64_t k) {
    const Item& it = items[size_t(k)];
    kernels::pack_bf16_panels(*mats[it.tensor], panels + at[it.tensor], it.begin, it.end);
  };
  const auto started = std::chrono::steady_clock::now();
  if (pool_)
    pool_->parallel_for_each(int64_t(items.size()), pack);
  else
    for (size_t k = 0; k < items.size(); ++k) pack(int64_t(k));
  load_figures_.pack_seconds += seconds_since(started);
  for (size_t i = 0; i < mats.size(); ++i) {
    mats[i]->packed = panels + at[i];
    mats[i]->data = nullptr;    // the panels are the copy now
    mats[i]->scales = nullptr;  // MXFP4: in the panels
  }
  // Bytes still pointed at: kept. A stored tensor read for this unit moves to kept_ when a view
  // points into it, else is dropped; derived copies likewise.
  auto pointed_into = [&](const uint8_t* b, size_t n) {
    auto in = [&](const void* p) {
      return p && static_cast<const uint8_t*>(p) >= b && static_cast<const uint8_t*>(p) < b + n;
    };
    for (const TensorView* v : views)
      if (in(v->data) || in(v->scales) || in(v->scale_inv)) return true;
    return false;
  };
  auto relocate = [&](const uint8_t* b, size_t n, const uint8_t* to) {
    auto move = [&](auto& p) {
      using P = std::remove_reference_t<decltype(p)>;
      const auto* q = reinterpret_cast<const uint8_t*>(p);
      if (q && q >= b && q < b + n) p = reinterpret_cast<P>(to + (q - b));
    };
    for (TensorView* v : views) {
      move(v->data);
      move(v->scales);
      move(v->scale_inv);
    }
  };
  for (TensorView* t : read_) {
    if (drop_read_pages_)
      if (auto f = file_of_.find(t->name); f != file_of_.end()) f->second->drop_cached(t->name);
    const auto* b = static_cast<const uint8_t*>(t->data);
    const size_t n = t->nbytes() - size_t(t->num_block_scales()) * 4;
    if (b && pointed_into(b, n)) {
      // A sent tensor kept whole (an embedding) keeps the sent bytes themselves: a copy would
      // hold the largest tensor twice during the refit.
      TensorToWrite* whole = nullptr;
      if (sent_)
        for (TensorToWrite& s : *sent_)
          if (s.bytes.data() == b && s.bytes.size() == n) whole = &s;
      if (whole) {
        kept_.push_back({std::move(whole->bytes)});
        transient_.erase(b);
      } else if (auto chunk = Staging::adopt(staging_, b, n)) {
        // Read alone into a staging chunk of its own (an embedding of a large vocabulary): the
        // chunk is kept as it is, no copy (and no second first touch of as many fresh bytes).
        kept_.push_back({{}, std::move(chunk), n});
        load_figures_.adopted_bytes += n;
      } else {
        kept_.push_back({std::vector<uint8_t>(b, b + n)});
        relocate(b, n, kept_.back().data());
        t->data = kept_.back().data();
      }
      continue;
    }
    t->data = nullptr;
    // A from_memory or sent tensor's bytes go as soon as they are packed.
    for (TensorToWrite& m : memory_)
      if (m.bytes.data() == b) std::vector<uint8_t>().swap(m.bytes);
  }
  read_.clear();
  if (derived_.size() > size_t(unit))
    for (std::vector<uint8_t>& d : derived_[size_t(unit)])
      if (!d.empty() && !pointed_into(d.data(), d.size())) std::vector<uint8_t>().swap(d);
  staging_.chunk = staging_.used = 0;
  widened_.clear();
}

namespace {
std::atomic<bool> files_treated_as_large{false};
}  // namespace

void Checkpoint::treat_files_as_large(bool on) { files_treated_as_large = on; }

void Checkpoint::load_weights() {
  const ModelConfig& c = weights_.config;
  // A reader thread reads decoder layer l + 1's stored bytes into a second staging area while
  // layer l is packed: from a cold page cache the disk and the packing overlap (the kernel's
  // own read-ahead covers a few MiB, and posix_fadvise WILLNEED is cut to that window too). The
  // two areas take turns; the reader touches nothing else of the checkpoint, and a read error
  // reaches this thread when the layer is taken, so a load fails where it did before.
  struct Ahead {
    const SafetensorsFile* file;
    std::string name;
    size_t bytes;
  };
  std::vector<std::vector<Ahead>> by_unit(size_t(c.num_layers) + 1);
  for (const auto& [name, file] : file_of_) {
    const int u = unit_of(name);
    if (u < 1 || u >= int(by_unit.size()) || !file->lazy() || file->never_read(name) ||
        unused_by_design(weights_.config, name))
      continue;
    if (const TensorView& t = *index_.at(name); !t.data)
      by_unit[size_t(u)].push_back({file, name, t.nbytes()});
  }
  // Files and weights that cannot both stay in memory (more than half of it each): the page
  // cache would only be reclaimed page by page while the weights are packed, at a cost in system
  // time larger than the read, so the loader gives each tensor's file pages back itself.
  drop_read_pages_ =
      !files_.empty() && (files_treated_as_large.load() ||
                          double(stored_bytes()) > physical_memory_mb() * double(1 << 20) / 2);
  load_figures_ = LoadFigures();
  Staging ahead_area;
  std::map<std::string, uint8_t*> ahead_read;
  uint64_t ahead_direct = 0;
  std::future<void> ahead;
  struct WaitForTheReader {  // before ahead_area and ahead_read go, on every way out
    std::future<void>& f;
    ~WaitForTheReader() {
      if (f.valid()) f.wait();
    }
  } wait_at_exit{ahead};
  auto read_ahead = [&](int u) {
    if (u >= int(by_unit.size())) return;
    // A tensor the page cache does not hold is read past it: no page-cache pages to fill (a
    // first touch of as many bytes as the weights' own), copy from and give back. On the 7.1 GB
    // FP8 preset a cold start took 11.2-14.1 s buffered and 5.4-6.6 s so. A cached one is
    // copied from the cache; where the kernel cannot say which is which, only files too big to
    // stay cached are read past it.
    using When = SafetensorsFile::PastTheCache;
    const When when = files_treated_as_large.load() ? When::Always
                      : drop_read_pages_            ? When::IfUncachedOrUnknown
                                                    : When::IfUncached;
    ahead = std::async(std::launch::async, [&area = ahead_area, &out = ahead_read,
                                            &direct_bytes = ahead_direct,
                                            &list = by_unit[size_t(u)], when] {
      for (const Ahead& t : list) {
        uint8_t* p = Staging::take(area, t.file->direct_bytes(t.name), RegularFile::kDirectAlign);
        const uint8_t* q = t.file->read_tensor_direct(t.name, p, when);
        if (q)
          direct_bytes += t.bytes;
        else
          t.file->read_tensor(t.name, p);
        out[t.name] = const_cast<uint8_t*>(q ? q : p);
      }
    });
  };
  auto take_read_ahead = [&] {
    const auto started = std::chrono::steady_clock::now();
    ahead.get();  // rethrows the reader's error
    load_figures_.read_seconds += seconds_since(started);
    load_figures_.direct_bytes += std::exchange(ahead_direct, 0);
    std::swap(staging_, ahead_area);  // the area the last unit was packed from is the reader's next
    read_ahead_ = std::move(ahead_read);
    ahead_read.clear();
  };
  read_ahead(1);
  unit_ = 0;
  build_globals(weights_);
  settle(0, unit_views(0), nullptr);
  if (c.tie_word_embeddings) weights_.embed = weights_.lm_head;
  // Unit 0's staging is not kept for the layers: an embedding and lm_head of a large vocabulary
  // are several layers' worth (gpt-oss-20b: 2.3 GB against 0.55 GB a layer).
  staging_ = Staging();
  for (int i = 0; i < c.num_layers; ++i) {
    unit_ = i + 1;
    take_read_ahead();
    if (unit_ + 1 < int(by_unit.size()))
      read_ahead(unit_ + 1);
    else
      ahead_area = Staging();  // the last layer: one area is enough
    weights_.layers.push_back(build_layer(i));
    settle(unit_, unit_views(unit_), nullptr);
    read_ahead_.clear();  // read but not used: load_weights refuses them below
  }
  staging_ = Staging();  // the staging area goes back to the system
  // Every stored tensor must be one r3 computes with: anything else (biases, a shared expert,
  // extra layers) belongs to a model r3 would silently compute differently.
  // MTP layers and a vision tower are recognised and left unused (unused_by_design).
  for (auto& [name, t] : index_) {
    if (used_.count(name) || unused_by_design(c, name)) continue;
    throw Error(t->file + ": tensor \"" + name + "\" is not used by r3's " + c.architecture +
                " (a feature r3 does not implement, or a different architecture)");
  }
}

namespace {
// src's description for a derived copy of (part of) it: its dtype and file, this name and shape.
TensorView derived_view(const TensorView& src, std::string name, std::vector<int64_t> shape,
                        const uint8_t* data) {
  TensorView v = src;
  v.name = std::move(name);
  v.shape = std::move(shape);
  v.data = data;
  return v;
}
}  // namespace

uint8_t* Checkpoint::derived_buffer(size_t bytes) {
  if (derived_.size() <= size_t(unit_)) derived_.resize(size_t(unit_) + 1);
  derived_[size_t(unit_)].emplace_back(bytes);
  return derived_[size_t(unit_)].back().data();
}

// A strided copy of src into derived_: out[r, k] = src[base + r * row_stride + k * col_stride]
// (a vector when shape has one dimension), in src's dtype, named src.name + what.
TensorView Checkpoint::derived_copy(const TensorView& src, const std::string& what,
                                    std::vector<int64_t> shape, int64_t base, int64_t row_stride,
                                    int64_t col_stride) {
  if (!src.data)
    return derived_view(src, src.name + what, std::move(shape),
                        nullptr);  // not sent: keeps its copy
  const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
  uint8_t* out = derived_buffer(size_t(rows * cols) * dtype_size(src.dtype));
  auto copy = [&](auto element) {
    using T = decltype(element);
    T* d = reinterpret_cast<T*>(out);
    const T* f = static_cast<const T*>(src.data);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k)
        d[r * cols + k] = f[base + r * row_stride + k * col_stride];
  };
  if (dtype_size(src.dtype) == 2)
    copy(uint16_t());
  else
    copy(uint32_t());  // F32 (F16 was widened by require)
  return derived_view(src, src.name + what, std::move(shape), out);
}

namespace {
// Expert e's rows of GPT-OSS's bf16 (or float) fused experts, gate_up [E, H, 2I] and down
// [E, I, H] (inputs first), as [out, in] matrices: gate [I, H] from gate_up's even columns, up
// [I, H] from its odd ones (both in one pass over the block), down [H, I].
void split_expert(const TensorView& gate_up, const TensorView& down, int64_t e, uint8_t* gate,
                  uint8_t* up, uint8_t* dn) {
  const int64_t H = gate_up.shape[1], I = gate_up.shape[2] / 2;
  if (dtype_size(gate_up.dtype) == 2) {
    if (gate)
      transpose_u16_pairs(static_cast<const uint16_t*>(gate_up.data) + e * H * 2 * I, 2 * I, H, I,
                          reinterpret_cast<uint16_t*>(gate), reinterpret_cast<uint16_t*>(up), H);
    if (dn)
      transpose_u16(static_cast<const uint16_t*>(down.data) + e * I * H, H, I, H,
                    reinterpret_cast<uint16_t*>(dn), I);
    return;
  }
  // F32 (F16 was widened by require)
  const float* gu = gate ? static_cast<const float*>(gate_up.data) + e * H * 2 * I : nullptr;
  const float* d = dn ? static_cast<const float*>(down.data) + e * I * H : nullptr;
  auto* g = reinterpret_cast<float*>(gate);
  auto* u = reinterpret_cast<float*>(up);
  auto* o = reinterpret_cast<float*>(dn);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < I; ++i) {
      if (g) g[i * H + h] = gu[h * 2 * I + 2 * i], u[i * H + h] = gu[h * 2 * I + 2 * i + 1];
      if (o) o[h * I + i] = d[i * H + h];
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
  } else if (N.fused_experts_linear) {
    // [E, 2I, H] and [E, H, I] in nn.Linear's layout: each expert's gate, up and down are runs of
    // whole rows, so they are views into the stored bytes, no copy.
    const TensorView& gate_up =
        require(layer_tensor(layer, N.fused_gate_up, -1, c.tensor_prefix), {E, 2 * I, H});
    const TensorView& down =
        require(layer_tensor(layer, N.fused_down, -1, c.tensor_prefix), {E, H, I});
    const size_t es = dtype_size(gate_up.dtype);
    out.resize(static_cast<size_t>(E));
    auto at = [](const TensorView& t, size_t offset) {
      return t.data ? static_cast<const uint8_t*>(t.data) + offset : nullptr;
    };
    for (int64_t e = 0; e < E; ++e) {
      if (!holds(layer, e)) continue;  // another rank's: its rows were not read
      const std::string tag = "[" + std::to_string(e) + "]";
      out[size_t(e)].gate = derived_view(gate_up, gate_up.name + tag + ".gate", {I, H},
                                         at(gate_up, size_t(e * 2 * I * H) * es));
      out[size_t(e)].up = derived_view(gate_up, gate_up.name + tag + ".up", {I, H},
                                       at(gate_up, size_t((e * 2 + 1) * I * H) * es));
      out[size_t(e)].down = derived_view(down, down.name + tag, {H, I},
                                         at(down, size_t(e * H * I) * dtype_size(down.dtype)));
    }
  } else {
    const TensorView& gate_up =
        require(layer_tensor(layer, N.fused_gate_up, -1, c.tensor_prefix), {E, H, 2 * I});
    const TensorView& down =
        require(layer_tensor(layer, N.fused_down, -1, c.tensor_prefix), {E, I, H});
    out.resize(static_cast<size_t>(E));
    // The buffers first (derived_ grows on this thread only), then the copies, an expert at a
    // time on the update's threads when it has some.
    const size_t bytes = size_t(I * H) * dtype_size(gate_up.dtype);
    std::vector<std::array<uint8_t*, 3>> to(static_cast<size_t>(E), {nullptr, nullptr, nullptr});
    for (int64_t e = 0; e < E; ++e) {
      if (!holds(layer, e)) continue;  // another rank's: its rows were not read
      const std::string tag = "[" + std::to_string(e) + "]";
      // A refit that sends one of the two leaves the other's copies as they are (null here).
      if (gate_up.data)
        to[size_t(e)][0] = derived_buffer(bytes), to[size_t(e)][1] = derived_buffer(bytes);
      if (down.data) to[size_t(e)][2] = derived_buffer(bytes);
      out[size_t(e)].gate =
          derived_view(gate_up, gate_up.name + tag + ".gate", {I, H}, to[size_t(e)][0]);
      out[size_t(e)].up =
          derived_view(gate_up, gate_up.name + tag + ".up", {I, H}, to[size_t(e)][1]);
      out[size_t(e)].down = derived_view(down, down.name + tag, {H, I}, to[size_t(e)][2]);
    }
    auto split = [&](int64_t e) {
      split_expert(gate_up, down, e, to[size_t(e)][0], to[size_t(e)][1], to[size_t(e)][2]);
    };
    if (pool_)
      pool_->parallel_for_each(E, split);
    else
      for (int64_t e = 0; e < E; ++e) split(e);
  }
  // The biases, in both layouts: gate_up_proj_bias [E, 2I] interleaved, down_proj_bias [E, H].
  if (!c.layers[size_t(layer)].expert_bias) return out;
  const TensorView& gate_up_bias =
      require(layer_tensor(layer, N.fused_gate_up_bias, -1, c.tensor_prefix), {E, 2 * I});
  const TensorView& down_bias =
      require(layer_tensor(layer, N.fused_down_bias, -1, c.tensor_prefix), {E, H});
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
  const std::string gu = layer_tensor(layer, N.fused_gate_up, -1, c.tensor_prefix),
                    dn = layer_tensor(layer, N.fused_down, -1, c.tensor_prefix);
  const TensorView& gu_blocks = require(gu + "_blocks", {E, 2 * I, H / 32, 16}, true);
  const TensorView& gu_scales = require(gu + "_scales", {E, 2 * I, H / 32}, true);
  const TensorView& dn_blocks = require(dn + "_blocks", {E, H, I / 32, 16}, true);
  const TensorView& dn_scales = require(dn + "_scales", {E, H, I / 32}, true);
  for (const TensorView* s : {&gu_scales, &dn_scales})
    for (int64_t e = 0; e < E; ++e) {
      if (!holds(layer, e) || !s->data) continue;  // rows never read, or not sent
      TensorView one = *s;                         // expert e's scales
      one.shape = {s->shape[1], s->shape[2]};
      one.data = static_cast<const uint8_t*>(s->data) + size_t(e * s->shape[1] * s->shape[2]);
      check_quantized_values(one);
    }
  auto view = [](const std::string& name, const std::string& file, int64_t rows, int64_t in,
                 const uint8_t* blocks, const uint8_t* scales) {
    TensorView v;
    v.name = name;
    v.file = file;
    v.dtype = DType::MXFP4;
    v.shape = {rows, in};
    v.data = blocks;
    v.scales = scales;
    return v;
  };
  // Rows parity, parity + 2, ... of expert e's gate_up: blocks then scales in one buffer. They
  // live only until the unit is packed (the panels hold them then), so they come from the
  // staging area, whose pages every unit reuses, rather than fresh memory per layer; the
  // buffers are taken here and filled on the load's threads, an expert at a time.
  const int64_t rb = H / 2, rs = H / 32;  // bytes per row
  std::vector<std::array<uint8_t*, 2>> split(static_cast<size_t>(E), {nullptr, nullptr});
  auto every_other_row = [&](int64_t e, int parity) {
    const std::string name = gu + "[" + std::to_string(e) + (parity ? "].up" : "].gate");
    if (!gu_blocks.data) return view(name, gu_blocks.file, I, H, nullptr, nullptr);
    uint8_t* buf = split[size_t(e)][size_t(parity)] = staging(size_t(I * (rb + rs)));
    return view(name, gu_blocks.file, I, H, buf, buf + I * rb);
  };
  std::vector<ExpertWeights> out(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    if (!holds(layer, e)) continue;
    ExpertWeights& w = out[size_t(e)];
    w.gate = every_other_row(e, 0);
    w.up = every_other_row(e, 1);
    w.down =
        view(dn + "[" + std::to_string(e) + "]", dn_blocks.file, H, I,
             dn_blocks.data ? static_cast<const uint8_t*>(dn_blocks.data) + size_t(e * H * I / 2)
                            : nullptr,
             dn_scales.data ? static_cast<const uint8_t*>(dn_scales.data) + size_t(e * H * I / 32)
                            : nullptr);
  }
  auto fill = [&](int64_t e) {
    const auto* b = static_cast<const uint8_t*>(gu_blocks.data) + size_t(e * 2 * I * rb);
    const auto* sc = static_cast<const uint8_t*>(gu_scales.data) + size_t(e * 2 * I * rs);
    for (int parity = 0; parity < 2; ++parity) {
      uint8_t* to = split[size_t(e)][size_t(parity)];
      if (!to) continue;
      for (int64_t i = 0; i < I; ++i) {
        std::memcpy(to + i * rb, b + (2 * i + parity) * rb, size_t(rb));
        std::memcpy(to + I * rb + i * rs, sc + (2 * i + parity) * rs, size_t(rs));
      }
    }
  };
  if (pool_)
    pool_->parallel_for_each(E, fill);
  else
    for (int64_t e = 0; e < E; ++e) fill(e);
  return out;
}

// Tensors that carry nothing r3 needs: RoPE inverse frequencies that old exports stored
// (r3 computes them from rope_theta).
bool knowingly_unused(const std::string& name) {
  static const std::string inv_freq = ".self_attn.rotary_emb.inv_freq";
  return name.size() > inv_freq.size() &&
         name.compare(name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0;
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
    throw Error("weight update: tensor \"" + name + "\" is " + dtype_name(dtype) + " " +
                got.shape_str() + ", the served model's is " + dtype_name(have->dtype) + " " +
                have->shape_str());
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

uint64_t Checkpoint::packed_bytes() const {
  uint64_t n = 0;
  for (size_t e : panel_elements_) n += uint64_t(e) * 2;
  return released_ ? 0 : n;
}

uint64_t Checkpoint::kept_bytes() const {
  uint64_t n = 0;
  for (const auto& k : kept_) n += k.size();
  for (const auto& unit : derived_)
    for (const auto& d : unit) n += d.size();
  for (const auto& o : owned_) n += o.size() * 4;
  return n;
}

std::vector<TensorToWrite> Checkpoint::stored_tensors() const {
  if (partial_)
    throw Error(dir_ + ": opened without some tensors (one expert-parallel rank's view)");
  if (updated_in_memory_)
    throw Error(dir_ +
                ": updated in memory; r3 keeps the packed weights only, not the stored tensors");
  std::vector<TensorToWrite> out;
  for (const auto& f : files_) {
    if (SafetensorsFile::identity_of(f->path()) != f->identity())
      throw Error(f->path() +
                  ": changed since it was read; the stored tensors are read from the files");
    SafetensorsFile again(f->path());
    for (const auto& [name, t] : again.tensors()) {
      TensorToWrite w{name, t.dtype, t.shape, std::vector<uint8_t>(t.nbytes())};
      again.read_tensor(name, w.bytes.data());
      out.push_back(std::move(w));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const TensorToWrite& a, const TensorToWrite& b) { return a.name < b.name; });
  return out;
}

void Checkpoint::refuse_non_finite_values() const {
  auto check = [](const TensorView* v) {
    if (v->data) return refuse_if_non_finite(*v);
    if (!v->packed || v->dtype != DType::BF16)
      return;                // MXFP4 and FP8 codes hold no non-finite value
    TensorView panels = *v;  // the panels as one bf16 vector (their padding is zeros)
    panels.shape = {int64_t(kernels::packed_bf16_size(*v))};
    panels.data = v->packed;
    if (first_non_finite(panels) >= 0)
      throw Error(v->file + ": tensor \"" + v->name +
                  "\" holds a non-finite value (NaN or infinity); refits must send "
                  "finite weights");
  };
  auto& self = const_cast<Checkpoint&>(*this);
  for (int u = 0; u <= int(weights_.layers.size()); ++u) {
    const UnitViews v = self.unit_views(u);
    for (const TensorView* t : v.matrices) check(t);
    for (const TensorView* t : v.small) check(t);
  }
}

void Checkpoint::release_panels() {
  for (int u = 0; u <= int(weights_.layers.size()); ++u)
    for (TensorView* t : unit_views(u).matrices) t->packed = nullptr;
  if (weights_.config.tie_word_embeddings) weights_.embed = weights_.lm_head;
  panels_.clear();
  panel_elements_.clear();
  released_ = true;
}

Checkpoint::Update Checkpoint::apply_update(std::vector<TensorToWrite> tensors, ThreadPool* pool) {
  Update out = apply_update_of(tensors, pool);
  for (TensorToWrite& t : tensors)  // packed: the caller frees them where the time does not count
    if (!t.bytes.empty())           // (a kept tensor took its bytes)
      out.replaced.push_back(std::make_shared<std::vector<uint8_t>>(std::move(t.bytes)));
  return out;
}

Checkpoint::Update Checkpoint::apply_update_of(std::vector<TensorToWrite>& tensors,
                                               ThreadPool* pool) {
  check_update(tensors);
  std::map<std::string, TensorToWrite*> sent;
  for (TensorToWrite& t : tensors) sent[t.name] = &t;
  // What a refit cannot rebuild from the panels alone is sent together (checked before anything
  // changes, so a refused update leaves this checkpoint as it was).
  auto need = [&](const std::string& name, const std::string& with, const char* why) {
    if (index_.count(with) && !sent.count(with))
      throw Error("weight update: tensor \"" + name + "\" was sent without \"" + with + "\" (" +
                  why + ")");
  };
  // New block scales for codes not sent: the codes are read back from the native panels.
  std::vector<TensorToWrite> codes;
  for (const auto& [name, t] : sent) {
    const std::string weight = name.substr(0, name.size() - 10);
    if (!ends_with(name, "_scale_inv") || sent.count(weight) || !index_.count(weight)) continue;
    const int u = unit_of(weight);
    const TensorView* served = nullptr;
    if (u <= int(weights_.layers.size()))
      for (TensorView* v : unit_views(u).matrices)
        if (v->name == weight) served = v;
    if (!served || served->dtype != DType::F8_E4M3 || !served->packed ||
        !kernels::fp8_native(*served))
      continue;
    codes.push_back(
        {weight, DType::F8_E4M3, served->shape, std::vector<uint8_t>(size_t(served->numel()))});
    packed_fp8_codes(*served, codes.back().bytes.data());
  }
  for (TensorToWrite& t : codes) sent[t.name] = &t;
  for (const auto& [name, t] : sent) {
    if (ends_with(name, "_scale_inv"))
      need(name, name.substr(0, name.size() - 10),
           "an FP8 weight's codes and scales are packed together");
    if (ends_with(name, "_blocks"))
      need(name, name.substr(0, name.size() - 7) + "_scales",
           "MXFP4 blocks and scales are packed together");
    if (ends_with(name, "_scales"))
      need(name, name.substr(0, name.size() - 7) + "_blocks",
           "MXFP4 blocks and scales are packed together");
  }
  if (config().tie_word_embeddings && index_.count("lm_head.weight")) {
    // The rule load_weights checks that an update can break: a stored lm_head of a tied model
    // stays equal to the embedding.
    const std::string embed_tensor = embed_name(config());
    const bool head = sent.count("lm_head.weight"), embed = sent.count(embed_tensor);
    if (head != embed || (head && sent["lm_head.weight"]->bytes != sent[embed_tensor]->bytes))
      throw Error(
          "weight update: lm_head.weight would differ from model.embed_tokens.weight but "
          "tie_word_embeddings is true (send both, equal, or neither)");
  }
  if (released_)
    for (const std::string& name : used_)
      if (!sent.count(name))
        throw Error(
            "weight update: the weights were released (release_memory_occupation); send every "
            "tensor (\"" +
            name + "\" is missing) or refit from a checkpoint");
  Update out;
  std::set<int> units;
  for (auto& [name, t] : sent) {
    const int u = unit_of(name);
    if (u <= int(weights_.layers.size())) units.insert(u);
    index_.at(name)->data = t->bytes.data();
    transient_.insert(t->bytes.data());
  }
  struct PoolForTheUpdate {
    Checkpoint* c;
    ~PoolForTheUpdate() {
      c->pool_ = nullptr;
      c->sent_ = nullptr;
      c->transient_.clear();
    }
  } scope{this};
  pool_ = pool;
  sent_ = &tensors;
  updated_in_memory_ = true;
  for (int u : units) {
    unit_ = u;
    read_.clear();
    if (u == 0) {
      ModelWeights was;
      was.lm_head = weights_.lm_head;
      was.embed = weights_.embed;
      was.final_norm = weights_.final_norm;
      was.config.tie_word_embeddings = weights_.config.tie_word_embeddings;
      const UnitViews old = was.config.tie_word_embeddings
                                ? UnitViews{{&was.lm_head}, {&was.final_norm}}
                                : UnitViews{{&was.lm_head}, {&was.embed, &was.final_norm}};
      build_globals(weights_);
      settle(0, unit_views(0), &old);
      if (config().tie_word_embeddings) weights_.embed = weights_.lm_head;
    } else {
      LayerWeights was = weights_.layers[size_t(u - 1)];
      const UnitViews old{layer_matrices(was), layer_small_views(was)};
      weights_.layers[size_t(u - 1)] = build_layer(u - 1);
      settle(u, unit_views(u), &old);
    }
  }
  released_ = false;
  staging_ = Staging();
  // The kept bytes no view points at any more (the small tensors the update replaced) go.
  std::vector<const uint8_t*> pointed;
  for (int u = 0; u <= int(weights_.layers.size()); ++u) {
    const UnitViews v = unit_views(u);
    for (const auto* list : {&v.matrices, &v.small})
      for (const TensorView* t : *list)
        for (const void* p :
             {t->data, static_cast<const void*>(t->scale_inv), static_cast<const void*>(t->scales)})
          if (p) pointed.push_back(static_cast<const uint8_t*>(p));
  }
  std::sort(pointed.begin(), pointed.end());
  auto in_use = [&](const KeptBytes& b) {
    auto it = std::lower_bound(pointed.begin(), pointed.end(), b.data());
    return it != pointed.end() && *it < b.data() + b.size();
  };
  for (KeptBytes& k : kept_)
    if (!in_use(k)) out.replaced.push_back(std::make_shared<KeptBytes>(std::move(k)));
  std::erase_if(kept_, [](const KeptBytes& k) { return k.empty(); });
  for (auto& unit : derived_)
    std::erase_if(unit, [](const std::vector<uint8_t>& d) { return d.empty(); });
  for (TensorToWrite& t : codes)
    out.replaced.push_back(std::make_shared<std::vector<uint8_t>>(std::move(t.bytes)));
  for (auto& [name, t] : index_)
    if (transient_.count(t->data)) t->data = nullptr;
  return out;
}

std::vector<std::string> Checkpoint::sent_together(const std::string& name) const {
  std::vector<std::string> out;
  auto add = [&](const std::string& other) {
    if (index_.count(other)) out.push_back(other);
  };
  if (ends_with(name, "_scale_inv")) add(name.substr(0, name.size() - 10));
  add(name + "_scale_inv");
  if (ends_with(name, "_blocks")) add(name.substr(0, name.size() - 7) + "_scales");
  if (ends_with(name, "_scales")) add(name.substr(0, name.size() - 7) + "_blocks");
  if (config().tie_word_embeddings && index_.count("lm_head.weight")) {
    if (name == "lm_head.weight") add(embed_name(config()));
    if (name == embed_name(config())) add("lm_head.weight");
  }
  return out;
}

void Checkpoint::check_refit(const Checkpoint& next) const {
  if (partial_)
    throw Error(dir_ + ": opened without some tensors (one expert-parallel rank's view)");
  const ModelConfig& c = config();
  for (const std::string& name : used_)
    if (!next.index_.count(name)) throw Error(next.dir_ + ": missing tensor \"" + name + "\"");
  for (const auto& [name, t] : next.index_) {
    if (!used_.count(name)) {
      if (unused_by_design(c, name)) continue;
      throw Error(t->file + ": tensor \"" + name + "\" is not used by r3's " + c.architecture +
                  " (a feature r3 does not implement, or a different architecture)");
    }
    DType dtype = t->dtype;
    check_sent_tensor(index_.at(name), name, dtype, t->shape);
  }
  // Block scales decide every decoded value, and they are small: each is read and checked now,
  // one at a time, so a bad one is refused while the old weights still serve.
  for (const auto& [name, t] : next.index_) {
    const bool fp8_scale = c.fp8_block_rows && ends_with(name, ".weight_scale_inv");
    const bool mxfp4_scale = c.experts_mxfp4 && ends_with(name, "_scales");
    if (!used_.count(name) || !(fp8_scale || mxfp4_scale)) continue;
    std::vector<uint8_t> bytes(t->nbytes());
    next.file_of_.at(name)->read_tensor(name, bytes.data());
    TensorView v = *t;
    v.data = bytes.data();
    check_quantized_values(v);
    if (is_float_dtype(v.dtype)) refuse_if_non_finite(v);
  }
}

void Checkpoint::refit_from(Checkpoint& next, ThreadPool* pool) {
  // A unit at a time (the embedding, norm and lm_head; then each decoder layer): its tensors are
  // read from next's files and packed into the panels they replace, so the refit holds one
  // layer beyond the resident weights. apply_update checks each unit's values before it changes.
  std::vector<std::vector<std::string>> by_unit(weights_.layers.size() + 1);
  for (const std::string& name : used_) by_unit[size_t(unit_of(name))].push_back(name);
  // Unit 0 holds a model's largest tensors (the embedding and lm_head: 1.2 GB each in
  // gpt-oss-20b): they go one send-together group at a time, so the refit holds one of them, not
  // both, beyond the weights.
  std::vector<std::vector<std::string>> units;
  std::set<std::string> placed;
  for (const std::string& name : by_unit[0]) {
    if (!placed.insert(name).second) continue;  // in an earlier tensor's group
    units.push_back({name});
    for (const std::string& other : sent_together(name))
      if (placed.insert(other).second) units.back().push_back(other);
  }
  units.insert(units.end(), by_unit.begin() + 1, by_unit.end());
  // The unit's bytes go into buffers kept from unit to unit (a layer's tensors have the sizes of
  // the layer before): fresh buffers per unit cost a zero fill, a first touch of every page and,
  // from the heap, a growth the allocator does not give back (a gpt-oss-20b refit took 72 s and
  // 3.3 GB above its weights that way).
  std::vector<std::vector<uint8_t>> buffers;
  for (const std::vector<std::string>& names : units) {
    std::vector<TensorToWrite> unit;
    for (size_t i = 0; i < names.size(); ++i) {
      const TensorView& t = *next.index_.at(names[i]);
      if (buffers.size() <= i) buffers.emplace_back();
      buffers[i].resize(t.nbytes());  // no fill where the buffer held as many bytes before
      next.file_of_.at(names[i])->read_tensor(names[i], buffers[i].data());
      unit.push_back({names[i], t.dtype, t.shape, std::move(buffers[i])});
    }
    apply_update_of(unit, pool);  // what it replaced is freed here, a layer at a time
    for (size_t i = 0; i < unit.size(); ++i) buffers[i] = std::move(unit[i].bytes);
    // Unit 0's tensors are sized unlike any layer's: their buffers would stay as capacity.
    if (unit_of(names[0]) == 0) buffers.clear();
  }
  // The served weights are now the files' (their descriptions and identities: reload and
  // stored_tensors read them).
  for (auto& f : next.files_) f->close();
  files_ = std::move(next.files_);
  file_of_ = std::move(next.file_of_);
  index_ = std::move(next.index_);
  dir_ = next.dir_;
  updated_in_memory_ = false;
}

std::vector<std::string> Checkpoint::differences(const Checkpoint& other) const {
  std::vector<std::string> out = config_differences(config(), other.config());
  if (!out.empty()) return out;
  for (auto& [name, t] : index_) {
    auto it = other.index_.find(name);
    if (it == other.index_.end()) continue;  // tied lm_head stored or not: the config decides
    if (t->dtype != it->second->dtype)
      out.push_back("tensor " + name + ": " + dtype_name(t->dtype) + " -> " +
                    dtype_name(it->second->dtype));
  }
  return out;
}

}  // namespace r3
