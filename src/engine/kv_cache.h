// The KV cache memory of every layer, typed by its element (fp32, or bf16 bits that the kernels
// widen exactly) and laid out as the attention kernels read it:
// - GQA (kernels/attention.h): K blocks transposed, [block][kv_dim][slot], so a block's keys are
//   scored 16 at a time; V blocks [block][kv_head][slot][head_dim], one head's values of a block
//   one contiguous run.
// - MLA (kernels/attention_latent.h): one latent row per token, [block][slot][width]; no V.
// One block past the pool is scratch for the padding tokens' writes. The memory is line-aligned
// (no vector load splits) and can be handed back to the operating system while the engine idles.
#pragma once
#include <cstdint>
#include <memory>
#include <variant>

#include "core/big_alloc.h"
#include "core/dtype.h"

namespace r3 {

template <typename KvT>
class KvCache {
 public:
  // k_width / v_width: elements per token and layer (v_width 0: no V cache, as for MLA).
  KvCache(int layers, int blocks, int block_size, int64_t k_width, int64_t v_width)
      : layer_k_(size_t(blocks + 1) * size_t(block_size) * size_t(k_width)),
        layer_v_(size_t(blocks + 1) * size_t(block_size) * size_t(v_width)),
        layers_(layers),
        block_size_(block_size),
        k_width_(k_width),
        v_width_(v_width) {
    restore();
  }

  KvT* k_layer(int layer) { return k_->get() + size_t(layer) * layer_k_; }
  KvT* v_layer(int layer) { return v_->get() + size_t(layer) * layer_v_; }
  int block_size() const { return block_size_; }
  int64_t k_width() const { return k_width_; }

  // A token's K (transposed: elements block_size apart) and V (a run of head_dim per kv head)
  // into its block and slot.
  void write_gqa(int layer, int block, int slot, const float* k, const float* v, int head_dim) {
    const size_t bs = size_t(block_size_), at = size_t(block) * size_t(k_width_) * bs;
    KvT* kb = k_layer(layer) + at + size_t(slot);
    for (size_t e = 0; e < size_t(k_width_); ++e) store(k[e], kb + e * bs);
    for (size_t h = 0; h < size_t(v_width_) / size_t(head_dim); ++h) {
      KvT* vb = v_layer(layer) + at + h * size_t(head_dim) * bs + size_t(slot) * size_t(head_dim);
      for (size_t d = 0; d < size_t(head_dim); ++d) store(v[h * size_t(head_dim) + d], vb + d);
    }
  }
  // A token's latent row into its block and slot.
  void write_row(int layer, int block, int slot, const float* row) {
    KvT* r =
        k_layer(layer) + (size_t(block) * size_t(block_size_) + size_t(slot)) * size_t(k_width_);
    for (int64_t e = 0; e < k_width_; ++e) store(row[e], r + e);
  }

  void release() {
    k_.reset();
    v_.reset();
    released_ = true;
  }
  // Zeros, committed only as blocks are written (core/big_alloc.h): the cache's size costs no
  // start-up (or resume) time, and an idle engine's unused blocks hold no memory.
  void restore() {
    if (!released_) return;  // never released: its contents stay
    k_ = std::make_unique<BigArray<KvT>>(layer_k_ * size_t(layers_), ZeroFilled{});
    v_ = std::make_unique<BigArray<KvT>>(layer_v_ * size_t(layers_), ZeroFilled{});
    released_ = false;
  }
  bool released() const { return released_; }

 private:
  static void store(float x, float* dst) { *dst = x; }
  static void store(float x, uint16_t* dst) { *dst = f32_to_bf16(x); }  // round to nearest even

  bool released_ = true;      // until the constructor's restore
  size_t layer_k_, layer_v_;  // elements per layer
  int layers_, block_size_;
  int64_t k_width_, v_width_;
  std::unique_ptr<BigArray<KvT>> k_, v_;  // [layer][...] as above; null while released
};

// The engine's cache: fp32, or bf16 (uint16_t bits).
using AnyKvCache = std::variant<KvCache<float>, KvCache<uint16_t>>;

}  // namespace r3
