#include "engine/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "engine/router.h"
#include "engine/sampling.h"
#include "kernels/attention.h"
#include "kernels/attention_latent.h"
#include "kernels/exp.h"
#include "kernels/matmul.h"
#include "kernels/router.h"

namespace r3 {

using kernels::Activations;
using kernels::matmul;
using kernels::matmul_rows;
using kernels::rms_norm;
using kernels::round_to_bf16;

namespace {
// MLA caches the latent row only (no V); GQA the kv heads' keys and values.
AnyKvCache make_kv_cache(const ModelConfig& c, int blocks, int block_size, DType dtype) {
  const int64_t k = c.mla ? c.mla->latent_width() : int64_t(c.num_kv_heads) * c.head_dim;
  const int64_t v = c.mla ? 0 : k;
  if (dtype == DType::BF16) return KvCache<uint16_t>(c.num_layers, blocks, block_size, k, v);
  if (dtype == DType::F32) return KvCache<float>(c.num_layers, blocks, block_size, k, v);
  throw Error("the KV cache holds bf16 or fp32");
}
}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<Checkpoint> ckpt, int num_blocks, int block_size,
                         int max_step_tokens, int max_seqs, ThreadPool* pool, DType kv_dtype)
    : ckpt_(std::move(ckpt)),
      num_blocks_(num_blocks),
      block_size_(block_size),
      max_tokens_(max_step_tokens),
      max_seqs_(std::min(max_seqs, max_step_tokens)),
      pool_(pool),
      // Positions never reach past what the KV pool holds, so the RoPE table (and attention's
      // score scratch) stop there even when the model allows far longer contexts.
      rope_(rope_inv_freq(ckpt_->config()), float(ckpt_->config().rope_scaling.attention_factor),
            int(std::min<int64_t>(ckpt_->config().max_position_embeddings, int64_t(num_blocks) * block_size))),
      kv_(make_kv_cache(ckpt_->config(), num_blocks, block_size, kv_dtype)) {
  const ModelConfig& c = config();
  kv_dim_ = c.mla ? size_t(c.mla->latent_width()) : size_t(c.num_kv_heads) * size_t(c.head_dim);
  const size_t T = size_t(max_tokens_), H = size_t(c.hidden_size), K = size_t(c.top_k);
  const size_t qd = size_t(c.num_heads) * size_t(c.head_dim);
  size_t I = size_t(std::max(c.moe_intermediate_size, c.intermediate_size));
  for (const LayerConfig& l : c.layers) I = std::max(I, size_t(l.shared_intermediate));
  x_.resize(T * H);
  h_.resize(T * H);
  hb_.resize(T * H);
  attn_groups_.reserve(T);
  q_.resize(T * qd);
  k_.resize(T * kv_dim_);
  v_.resize(T * kv_dim_);
  const size_t od = c.mla ? size_t(c.num_heads) * size_t(c.mla->v_head_dim) : qd;
  attn_.resize(T * std::max(qd, od));
  attnb_.resize(T * std::max(qd, od));
  if (c.mla) {
    const size_t nh = size_t(c.num_heads), kvr = size_t(c.mla->kv_lora_rank);
    qa_.resize(T * size_t(std::max(c.mla->q_lora_rank, 1)));
    qab_.resize(qa_.size());
    q_nope_.resize(T * nh * size_t(c.mla->qk_nope_head_dim));
    q_nopeb_.resize(q_nope_.size());
    q_lat_.resize(T * nh * size_t(c.mla->latent_width()));
    o_lat_.resize(T * nh * kvr);
    o_latb_.resize(o_lat_.size());
  }
  tmp_.resize(T * H);
  ffn_.resize(T * H);
  logits_.resize(size_t(max_seqs_) * size_t(c.vocab_size));
  probs_.resize(T * size_t(std::max(c.num_experts, 1)));
  shared_gate_.resize(T);
  gate_.resize(T * K * I);
  up_.resize(T * K * I);
  act_.resize(T * K * I);
  actb_.resize(T * K * I);
  expert_out_.resize(T * K * H);
  route_w_.resize(T * K);
  route_ids_.resize(T * K);
  slot_token_.resize(T * K);
  slot_of_.resize(T * K);
  const int L = c.num_moe_layers();
  for (int l = 0; l < L; ++l) {
    load_.emplace_back(new std::atomic<uint64_t>[size_t(c.num_experts)]());
    phys_load_.emplace_back(new std::atomic<uint64_t>[size_t(2 * c.num_experts)]());
  }
  pack_weights();
}

void ModelRunner::set_weights(std::shared_ptr<Checkpoint> ckpt, const ByteRanges* changed) {
  ckpt_ = std::move(ckpt);
  pack_weights(!packed_released_, changed);
}

void ModelRunner::release_kv_cache() {
  std::visit([](auto& cache) { cache.release(); }, kv_);
}

void ModelRunner::restore_kv_cache() {
  std::visit([](auto& cache) { cache.restore(); }, kv_);
}

void ModelRunner::release_packed_weights() {
  std::vector<kernels::PackedBf16>().swap(packed_);
  weights_ = ModelWeights();
  packed_released_ = true;
}

namespace {
bool overlaps(const TensorView& t, const ModelRunner::ByteRanges& ranges) {
  const auto* b = static_cast<const uint8_t*>(t.data);
  const uint8_t* e = b + t.nbytes();
  for (const auto& r : ranges)
    if (r.data() < e && b < r.data() + r.size()) return true;
  return false;
}
}  // namespace

void ModelRunner::pack_weights(bool reuse, const ByteRanges* changed) {
  packed_released_ = false;
  weights_ = ckpt_->weights();
  std::vector<TensorView*> mats = {&weights_.lm_head};
  for (LayerWeights& L : weights_.layers) {
    for (TensorView* t : {&L.q, &L.k, &L.v, &L.o, &L.router, &L.dense.gate, &L.dense.up, &L.dense.down, &L.shared.gate,
                          &L.shared.up, &L.shared.down, &L.shared_gate})
      mats.push_back(t);
    for (ExpertWeights& e : L.experts)
      for (TensorView* t : {&e.gate, &e.up, &e.down}) mats.push_back(t);
  }
  for (LayerWeights& L : weights_.layers)
    for (TensorView* t : {&L.q_a, &L.kv_a}) mats.push_back(t);
  build_mla_heads();
  const size_t derived_from = mats.size();  // the absorbed key weights: copies, always repacked
  for (auto& layer : mla_heads_)
    for (MlaHead& h : layer) mats.push_back(&h.uk_t);
  for (auto& layer : mla_heads_)
    for (MlaHead& h : layer) mats.push_back(&h.uv);
  std::vector<TensorView*> bf16;
  std::vector<bool> always;  // repacked whatever changed
  for (size_t i = 0; i < mats.size(); ++i)
    if (!mats[i]->empty() && mats[i]->dtype == DType::BF16) {
      bf16.push_back(mats[i]);
      always.push_back(i >= derived_from && mats[i]->name.find("uk_t") != std::string::npos);
    }
  reuse = reuse && packed_.size() == bf16.size();
  for (size_t i = 0; reuse && i < bf16.size(); ++i) reuse = packed_[i].size() == kernels::packed_bf16_size(*bf16[i]);
  if (!reuse) {
    changed = nullptr;
    packed_.assign(bf16.size(), {});
    pool_->parallel_for_each(int64_t(bf16.size()), [&](int64_t i) {
      packed_[size_t(i)].assign(kernels::packed_bf16_size(*bf16[size_t(i)]), 0);  // zeroes the padding rows
    });
  }
  // Work items of about 1 MiB of panels, so one large tensor is spread over every thread.
  struct Item {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < bf16.size(); ++i) {
    bf16[i]->packed = packed_[i].data();
    if (changed && !always[i] && !overlaps(*bf16[i], *changed)) continue;
    const int64_t panels = (bf16[i]->shape[0] + kernels::kPanelRows - 1) / kernels::kPanelRows;
    const int64_t per_item = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, bf16[i]->shape[1] * 32));
    for (int64_t p = 0; p < panels; p += per_item) items.push_back({i, p, std::min(panels, p + per_item)});
  }
  pool_->parallel_for_each(int64_t(items.size()), [&](int64_t k) {
    const Item& it = items[size_t(k)];
    kernels::pack_bf16_panels(*bf16[it.tensor], packed_[it.tensor].data(), it.begin, it.end);
  });
}

std::vector<std::vector<uint64_t>> ModelRunner::expert_load() const {
  std::vector<std::vector<uint64_t>> out;
  for (auto& l : load_) {
    out.emplace_back();
    for (int e = 0; e < config().num_experts; ++e) out.back().push_back(l[size_t(e)].load());
  }
  return out;
}

std::vector<std::vector<uint64_t>> ModelRunner::physical_expert_load() const {
  std::vector<std::vector<uint64_t>> out;
  const int P = eplb_.enabled() ? eplb_.num_physical() : config().num_experts;
  for (auto& l : phys_load_) {
    out.emplace_back();
    for (int e = 0; e < P; ++e) out.back().push_back(l[size_t(e)].load());
  }
  return out;
}

namespace {
// x[i] += b[i], the bias widened to fp32.
void add_bias(float* x, const TensorView& b, int n) {
  if (b.dtype == DType::BF16) {
    const uint16_t* bb = static_cast<const uint16_t*>(b.data);
    for (int i = 0; i < n; ++i) x[i] += bf16_to_f32(bb[i]);
  } else if (b.dtype == DType::F32) {
    const float* bf = static_cast<const float*>(b.data);
    for (int i = 0; i < n; ++i) x[i] += bf[i];
  } else {
    for (int i = 0; i < n; ++i) x[i] += b.at(i);
  }
}
}  // namespace

// Attention of every real token over its request's keys 0..pos (kernels/attention.h), per
// (head, group); a group is up to kMaxGroup consecutive tokens of one request, which share each
// load of K and V.
template <typename KvT>
void ModelRunner::attention(const StepPlan& plan, int layer, const float* q, float* out, KvCache<KvT>& cache) {
  const ModelConfig& c = config();
  const int nh = c.num_heads, hd = c.head_dim, group = c.num_heads / c.num_kv_heads;
  const int qd = nh * hd;
  const float scale = 1.f / std::sqrt(float(hd));
  const int T = int(plan.tokens.size());
  const KvT* k = cache.k_layer(layer);
  const KvT* v = cache.v_layer(layer);
  attn_groups_.clear();
  bool single_tokens = true;
  for (int t = 0; t < T;) {
    const int seq = plan.tokens[size_t(t)].seq;
    int n = 1;
    while (seq >= 0 && n < kernels::kMaxGroup && t + n < T && plan.tokens[size_t(t + n)].seq == seq) ++n;
    attn_groups_.push_back({t, n});
    single_tokens = single_tokens && n == 1;
    t += n;
  }
  const int G = int(attn_groups_.size());
  const int stride = rope_.max_pos() + block_size_;
  auto attend_head = [&](int head, const AttentionGroup& g) {
    thread_local std::vector<float> scores;
    if (scores.size() < size_t(kernels::kMaxGroup) * size_t(stride))
      scores.resize(size_t(kernels::kMaxGroup) * size_t(stride));
    const PlannedToken& first = plan.tokens[size_t(g.first)];
    if (first.seq < 0) {  // padding
      float* o = out + size_t(g.first) * qd + size_t(head) * hd;
      std::fill(o, o + hd, 0.f);
      return;
    }
    const float* qs[kernels::kMaxGroup];
    float* os[kernels::kMaxGroup];
    int pos[kernels::kMaxGroup];
    for (int k = 0; k < g.count; ++k) {
      const size_t at = size_t(g.first + k) * qd + size_t(head) * hd;
      qs[k] = q + at;
      os[k] = out + at;
      pos[k] = plan.tokens[size_t(g.first + k)].position;
    }
    const kernels::PagedHead<KvT> kv{k, v, plan.block_table(plan.seqs[size_t(first.seq)]), block_size_,
                                     int64_t(kv_dim_), int64_t(head / group) * hd};
    kernels::attend_group(qs, pos, g.count, hd, scale, kv, scores.data(), stride, os);
  };
  // Items handed out dynamically (later positions have more keys). A decode step's tokens share
  // nothing, so an item is one token with all its heads: a block's heads are adjacent in the
  // cache, and one core walks each block as one run (~20% faster than interleaving heads across
  // cores, BM_AttentionDecode). Otherwise items are (head, group), head-major: consecutive items
  // on both cores read the same head's keys and values, which then stay in L2 across a chunk.
  if (single_tokens)
    pool_->parallel_for_each(G, [&](int64_t i) {
      for (int head = 0; head < nh; ++head) attend_head(head, attn_groups_[size_t(i)]);
    });
  else
    pool_->parallel_for_each(int64_t(G) * nh, [&](int64_t i) { attend_head(int(i / G), attn_groups_[size_t(i % G)]); });
}

namespace {

struct WorkItem {
  int group, begin, end;
};

// Runs `rows` of an expert's weight for every group in [0, groups): items are (group, row block)
// pairs so both cores stay busy even when one expert has few rows.
template <typename Fn>
void for_group_rows(ThreadPool* pool, const std::vector<int>& offsets, int rows, Fn fn) {
  // thread_local names are not captured by lambdas: hand the workers a plain reference.
  thread_local std::vector<WorkItem> items_storage;
  std::vector<WorkItem>& items = items_storage;
  items.clear();
  const int groups = int(offsets.size()) - 1;
  const int block = 256;  // rows per item: long contiguous weight streams per core (64-row items measured ~5% slower)
  for (int g = 0; g < groups; ++g)
    if (offsets[size_t(g + 1)] > offsets[size_t(g)])
      for (int r = 0; r < rows; r += block) items.push_back({g, r, std::min(rows, r + block)});
  pool->parallel_for_each(int64_t(items.size()), [&](int64_t i) { fn(items[size_t(i)]); });
}

}  // namespace

// MoE by grouping tokens per expert (llama.cpp's mul_mat_id shape): router top-k and capture,
// remap to physical experts (EPLB), list each expert's tokens (read in place, no gathered
// copy), gate/up with SiLU, down, then each token sums its k expert outputs in router order.
void ModelRunner::moe(const LayerWeights& L, int moe_layer, int T, float* out, CaptureSlot* slot,
                      int num_real) {
  const ModelConfig& c = config();
  const int H = c.hidden_size, E = c.num_experts, K = c.top_k, I = c.moe_intermediate_size;
  matmul({h_.data(), hb_.data(), T}, L.router, probs_.data(), pool_);  // router logits [T, E]
  const float* bias = nullptr;
  if (!L.router_bias.empty()) {
    router_bias_.resize(size_t(E));
    for (int e = 0; e < E; ++e) router_bias_[size_t(e)] = L.router_bias.at(e);
    bias = router_bias_.data();
  }
  for (int t = 0; t < T; ++t) {
    route_token(c.router, probs_.data() + size_t(t) * E, bias, E, K, route_ids_.data() + size_t(t) * K,
                route_w_.data() + size_t(t) * K, route_scratch_);
    if (slot) slot->capture(moe_layer, t, route_ids_.data() + size_t(t) * K);  // before any remap
  }
  // Logical -> physical, counting sort by physical expert.
  const int P = eplb_.enabled() ? eplb_.num_physical() : E;
  group_offsets_.assign(size_t(P + 1), 0);
  std::vector<int>& nth_of_logical = nth_of_logical_;
  std::vector<int>& phys = phys_;
  nth_of_logical.assign(size_t(E), 0);
  phys.resize(size_t(T) * K);
  for (int a = 0; a < T * K; ++a) {
    const int e = route_ids_[size_t(a)];
    const int p = eplb_.physical(moe_layer, e, nth_of_logical[size_t(e)]++);
    phys[size_t(a)] = p;
    ++group_offsets_[size_t(p + 1)];
    if (a / K < num_real) {
      load_[size_t(moe_layer)][size_t(e)].fetch_add(1, std::memory_order_relaxed);
      phys_load_[size_t(moe_layer)][size_t(p)].fetch_add(1, std::memory_order_relaxed);
    }
  }
  for (int p = 0; p < P; ++p) group_offsets_[size_t(p + 1)] += group_offsets_[size_t(p)];
  std::vector<int>& fill = fill_;
  fill.assign(group_offsets_.begin(), group_offsets_.end() - 1);
  for (int a = 0; a < T * K; ++a) {
    const int s = fill[size_t(phys[size_t(a)])]++;
    slot_token_[size_t(s)] = a / K;
    slot_of_[size_t(a)] = s;
  }
  uint64_t bytes = 0;
  for (int p = 0; p < P; ++p)
    if (group_offsets_[size_t(p + 1)] > group_offsets_[size_t(p)]) {
      const ExpertWeights& w = L.experts[size_t(eplb_.logical_of(moe_layer, p))];
      bytes += w.gate.nbytes() + w.up.nbytes() + w.down.nbytes();
    }
  weight_bytes_ += bytes + L.router.nbytes();
  auto weights_of = [&](int p) -> const ExpertWeights& {
    return L.experts[size_t(eplb_.logical_of(moe_layer, p))];
  };
  for_group_rows(pool_, group_offsets_, I, [&](const WorkItem& it) {
    const int off = group_offsets_[size_t(it.group)], n = group_offsets_[size_t(it.group + 1)] - off;
    const ExpertWeights& w = weights_of(it.group);
    const Activations xg{h_.data(), hb_.data(), n, slot_token_.data() + off};  // the group's tokens in place
    matmul_rows(xg, w.gate, gate_.data() + size_t(off) * I, I, it.begin, it.end);
    matmul_rows(xg, w.up, up_.data() + size_t(off) * I, I, it.begin, it.end);
    // SiLU-gating of the rows just computed, while they are in cache.
    const int len = it.end - it.begin;
    for (int r = off; r < off + n; ++r) {
      const size_t at = size_t(r) * I + size_t(it.begin);
      kernels::silu_mul(gate_.data() + at, up_.data() + at, act_.data() + at, len);
      round_to_bf16(act_.data() + at, len, actb_.data() + at);
    }
  });
  for_group_rows(pool_, group_offsets_, H, [&](const WorkItem& it) {
    const int off = group_offsets_[size_t(it.group)], n = group_offsets_[size_t(it.group + 1)] - off;
    matmul_rows({act_.data() + size_t(off) * I, actb_.data() + size_t(off) * I, n}, weights_of(it.group).down,
                expert_out_.data() + size_t(off) * H, H, it.begin, it.end);
  });
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + size_t(t) * H;
      for (int j = 0; j < K; ++j) {
        const float w = route_w_[size_t(t) * K + j];
        const float* y = expert_out_.data() + size_t(slot_of_[size_t(t) * K + j]) * H;
        if (j == 0)
          for (int d = 0; d < H; ++d) o[d] = w * y[d];
        else
          for (int d = 0; d < H; ++d) o[d] += w * y[d];
      }
    }
  });
  if (L.shared.gate.empty()) return;
  // Shared experts: one MLP on every token, added after the routed sum (scaled by
  // sigmoid(gate . h) where the layer has a gate).
  dense_ffn(L.shared, T, tmp_.data());
  if (!L.shared_gate.empty()) {
    matmul({h_.data(), hb_.data(), T}, L.shared_gate, shared_gate_.data(), pool_);
    weight_bytes_ += L.shared_gate.nbytes();
    for (int t = 0; t < T; ++t) {
      const float g = shared_gate_[size_t(t)], e = kernels::exp_nonpositive(0.f - std::fabs(g));
      shared_gate_[size_t(t)] = (g >= 0.f ? 1.f : e) / (1.f + e);
    }
  }
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + size_t(t) * H;
      const float* y = tmp_.data() + size_t(t) * H;
      if (L.shared_gate.empty())
        for (int d = 0; d < H; ++d) o[d] += y[d];
      else
        for (int d = 0; d < H; ++d) o[d] += shared_gate_[size_t(t)] * y[d];
    }
  });
}

void ModelRunner::dense_ffn(const ExpertWeights& w, int T, float* out) {
  const int I = int(w.gate.shape[0]);
  const kernels::MatmulOut gate_up[] = {{&w.gate, gate_.data()}, {&w.up, up_.data()}};
  kernels::matmul_many({h_.data(), hb_.data(), T}, gate_up, pool_);
  kernels::silu_mul(gate_.data(), up_.data(), act_.data(), T * I);
  round_to_bf16(act_.data(), int64_t(T) * I, actb_.data());
  matmul({act_.data(), actb_.data(), T}, w.down, out, pool_);
  weight_bytes_ += w.gate.nbytes() + w.up.nbytes() + w.down.nbytes();
}

// x += add (when given), then h = rms_norm(x) and its bf16 bits, per token on both cores.
void ModelRunner::add_and_norm(const float* add, const TensorView& norm, int T) {
  const int H = config().hidden_size;
  const float eps = config().rms_norm_eps;
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* x = x_.data() + size_t(t) * H;
      float* h = h_.data() + size_t(t) * H;
      if (add)
        for (int d = 0; d < H; ++d) x[d] += add[size_t(t) * H + d];
      rms_norm(x, norm, 0, H, eps, h);
      round_to_bf16(h, H, hb_.data() + size_t(t) * H);
    }
  });
}

// MLA's absorbed weights, per layer and head, from kv_b ([nh x (nope + v), kv_lora]): the key
// part transposed, uk_t [kv_lora, nope] (a copy, so the query can be taken into the latent space
// by one matmul), and the value part uv [v, kv_lora] (a view of kv_b's rows).
void ModelRunner::build_mla_heads() {
  const ModelConfig& c = config();
  mla_heads_.clear();
  mla_storage_.clear();
  if (!c.mla) return;
  const MlaSpec& m = *c.mla;
  const int nh = c.num_heads, nope = m.qk_nope_head_dim, vd = m.v_head_dim, kvr = m.kv_lora_rank;
  mla_heads_.resize(weights_.layers.size());
  for (size_t l = 0; l < weights_.layers.size(); ++l) {
    const TensorView& kv_b = weights_.layers[l].kv_b;
    const size_t es = dtype_size(kv_b.dtype);
    const auto* base = static_cast<const uint8_t*>(kv_b.data);
    for (int h = 0; h < nh; ++h) {
      MlaHead head;
      std::vector<uint8_t>& store = mla_storage_.emplace_back(size_t(kvr) * size_t(nope) * es);
      for (int n = 0; n < nope; ++n)
        for (int col = 0; col < kvr; ++col)
          std::memcpy(store.data() + (size_t(col) * nope + n) * es,
                      base + ((size_t(h) * (nope + vd) + n) * kvr + col) * es, es);
      head.uk_t.name = kv_b.name + "[uk_t " + std::to_string(h) + "]";
      head.uk_t.dtype = kv_b.dtype;
      head.uk_t.shape = {kvr, nope};
      head.uk_t.data = store.data();
      head.uv.name = kv_b.name + "[uv " + std::to_string(h) + "]";
      head.uv.dtype = kv_b.dtype;
      head.uv.shape = {vd, kvr};
      head.uv.data = base + (size_t(h) * (nope + vd) + nope) * kvr * es;
      mla_heads_[l].push_back(head);
    }
  }
}

// Per head h, y_h = W_h x_h for every token: x_h rows are [T][in] at xs + h * T * in, outputs
// land at y + h * out_stride with row stride ldy. Items are (head, 64-row block) on the pool.
void ModelRunner::per_head_matmul(const std::vector<MlaHead>& heads, bool key, const float* xs, const uint16_t* xb,
                                  int T, int in, float* y, int ldy, int out_stride) {
  const int nh = int(heads.size());
  const int rows = int((key ? heads[0].uk_t : heads[0].uv).shape[0]);
  const int blocks = (rows + 63) / 64;
  pool_->parallel_for_each(int64_t(nh) * blocks, [&](int64_t i) {
    const int h = int(i / blocks), b = int(i % blocks);
    const TensorView& W = key ? heads[size_t(h)].uk_t : heads[size_t(h)].uv;
    const Activations x{xs + size_t(h) * T * in, xb + size_t(h) * T * in, T};
    kernels::matmul_rows(x, W, y + size_t(h) * out_stride, ldy, b * 64, std::min(rows, b * 64 + 64));
  });
}

// Multi-head latent attention in the absorbed form, the same for every token whatever the step
// (so batch invariance holds): q through the low-rank path, the latent (normed) and its rotary
// key part cached per token; each head's query taken into the latent space (uk_t), attention over
// the cached rows (kernels/attention_latent.h), and the latent output taken to the head's value
// space (uv). attn_ gets [T, nh x v_head_dim].
template <typename KvT>
void ModelRunner::mla_attention(const StepPlan& plan, int layer, const LayerWeights& L, int T, KvCache<KvT>& cache) {
  const ModelConfig& c = config();
  const MlaSpec& m = *c.mla;
  const int nh = c.num_heads, qk = m.qk_head_dim(), nope = m.qk_nope_head_dim, kvr = m.kv_lora_rank,
            lw = m.latent_width(), vd = m.v_head_dim;
  const float eps = c.rms_norm_eps;
  const Activations hx{h_.data(), hb_.data(), T};
  if (!L.q_a.empty()) {
    const int qr = m.q_lora_rank;
    matmul(hx, L.q_a, qa_.data(), pool_);
    pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* a = qa_.data() + size_t(t) * qr;
        rms_norm(a, L.q_a_norm, 0, qr, eps, a);
        round_to_bf16(a, qr, qab_.data() + size_t(t) * qr);
      }
    });
    matmul({qa_.data(), qab_.data(), T}, L.q, q_.data(), pool_);
  } else {
    matmul(hx, L.q, q_.data(), pool_);
  }
  matmul(hx, L.kv_a, k_.data(), pool_);  // [T, latent + rope]
  weight_bytes_ += L.q_a.nbytes() + L.q.nbytes() + L.kv_a.nbytes() + L.kv_b.nbytes() + L.o.nbytes();
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const PlannedToken& tok = plan.tokens[size_t(t)];
      float* lat = &k_[size_t(t) * lw];
      rms_norm(lat, L.kv_a_norm, 0, kvr, eps, lat);
      rope_.apply_interleaved(lat + kvr, tok.position);
      float* q = &q_[size_t(t) * nh * qk];
      for (int h = 0; h < nh; ++h) {
        rope_.apply_interleaved(q + h * qk + nope, tok.position);
        // Head-major copies of q_nope (the per-head matmul's input rows) and q_pe (the tail of
        // the head's latent-space query).
        float* qn = &q_nope_[(size_t(h) * T + size_t(t)) * nope];
        std::copy(q + h * qk, q + h * qk + nope, qn);
        round_to_bf16(qn, nope, &q_nopeb_[(size_t(h) * T + size_t(t)) * nope]);
        std::copy(q + h * qk + nope, q + (h + 1) * qk, &q_lat_[(size_t(t) * nh + h) * lw + kvr]);
      }
      if (tok.seq < 0) continue;  // padding: never attended to
      cache.write_row(layer, tok.block, tok.slot, lat);
    }
  });
  // q_lat[t, h, 0:kvr] = uk_t_h q_nope[h, t]
  per_head_matmul(mla_heads_[size_t(layer)], true, q_nope_.data(), q_nopeb_.data(), T, nope, q_lat_.data(), nh * lw, lw);
  // DeepseekV3Attention: qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2.
  const float scale = float(1.0 / std::sqrt(double(qk)) * c.rope_scaling.softmax_mscale);
  const int stride = rope_.max_pos() + block_size_;
  pool_->parallel_for_each(int64_t(T) * nh, [&](int64_t i) {
    thread_local std::vector<float> scores;
    if (scores.size() < size_t(stride)) scores.resize(size_t(stride));
    const int t = int(i / nh), h = int(i % nh);
    float* o = &o_lat_[(size_t(h) * T + size_t(t)) * kvr];
    const PlannedToken& tok = plan.tokens[size_t(t)];
    if (tok.seq < 0) {
      std::fill(o, o + kvr, 0.f);
    } else {
      const kernels::PagedLatent<KvT> rows{cache.k_layer(layer), plan.block_table(plan.seqs[size_t(tok.seq)]),
                                           block_size_, lw};
      kernels::attend_latent(&q_lat_[(size_t(t) * nh + h) * lw], kvr, tok.position, scale, rows, scores.data(), o);
    }
    round_to_bf16(o, kvr, &o_latb_[(size_t(h) * T + size_t(t)) * kvr]);
  });
  // attn[t, h * vd : (h + 1) * vd] = uv_h o_lat[h, t]
  per_head_matmul(mla_heads_[size_t(layer)], false, o_lat_.data(), o_latb_.data(), T, kvr, attn_.data(), nh * vd, vd);
}

// Grouped-query attention: q/k/v projections (with biases), q/k norms, clipping and RoPE per
// token, the token's K and V into its cache slot, then attention over the paged cache. attn_ gets
// [T, heads x head_dim].
template <typename KvT>
void ModelRunner::gqa_attention(const StepPlan& plan, int l, const LayerWeights& L, int T, KvCache<KvT>& cache) {
  const ModelConfig& c = config();
  const int nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim, qd = nh * hd, kvd = nkv * hd;
  const float eps = c.rms_norm_eps;
  const Activations hx{h_.data(), hb_.data(), T};
  const kernels::MatmulOut qkv[] = {{&L.q, q_.data()}, {&L.k, k_.data()}, {&L.v, v_.data()}};
  kernels::matmul_many(hx, qkv, pool_);
  weight_bytes_ += L.q.nbytes() + L.k.nbytes() + L.v.nbytes() + L.o.nbytes();
  // Per token (both cores): q/k norms, RoPE, and the token's K and V into its cache slot. The
  // transposed K write touches a cache line per one or two K elements, so it is worth splitting.
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* q = &q_[size_t(t) * qd];
      float* k = &k_[size_t(t) * kvd];
      float* v = &v_[size_t(t) * kvd];
      if (c.qkv_bias) {
        add_bias(q, L.q_bias, qd);
        add_bias(k, L.k_bias, kvd);
        add_bias(v, L.v_bias, kvd);
      }
      if (c.qk_norm == QkNorm::PerHead) {
        for (int hh = 0; hh < nh; ++hh) rms_norm(q + hh * hd, L.q_norm, 0, hd, eps, q + hh * hd);
        for (int hh = 0; hh < nkv; ++hh) rms_norm(k + hh * hd, L.k_norm, 0, hd, eps, k + hh * hd);
      } else if (c.qk_norm == QkNorm::Whole) {
        rms_norm(q, L.q_norm, 0, qd, eps, q);
        rms_norm(k, L.k_norm, 0, kvd, eps, k);
      }
      if (c.clip_qkv) {
        const float cl = *c.clip_qkv;
        for (int i = 0; i < qd; ++i) q[i] = std::clamp(q[i], -cl, cl);
        for (int i = 0; i < kvd; ++i) k[i] = std::clamp(k[i], -cl, cl);
        for (int i = 0; i < kvd; ++i) v[i] = std::clamp(v[i], -cl, cl);
      }
      const PlannedToken& tok = plan.tokens[size_t(t)];
      for (int hh = 0; hh < nh; ++hh) rope_.apply(q + hh * hd, tok.position);
      for (int hh = 0; hh < nkv; ++hh) rope_.apply(k + hh * hd, tok.position);
      if (tok.seq < 0) continue;  // padding: never attended to, and its scratch slots repeat
      cache.write_gqa(l, tok.block, tok.slot, k, v, hd);
    }
  });
  attention(plan, l, q_.data(), attn_.data(), cache);
}

void ModelRunner::forward(const StepPlan& plan, const int* token_ids, CaptureSlot* slot) {
  if (memory_released()) throw Error("the engine's memory is released: resume it before generating");
  const ModelConfig& c = config();
  const ModelWeights& W = weights_;
  const int T = int(plan.tokens.size());
  if (T > max_tokens_) throw Error("step of " + std::to_string(T) + " tokens exceeds the runner's " + std::to_string(max_tokens_));
  const int num_real = T - plan.num_padding;
  const int H = c.hidden_size;

  // Embed (token_ids: the plan's, with an overlapped step's placeholders resolved).
  for (int t = 0; t < T; ++t) {
    const int id = token_ids[t];
    const TensorView& e = W.embed;
    for (int d = 0; d < H; ++d) x_[size_t(t) * H + d] = e.at(int64_t(id) * H + d);
  }
  weight_bytes_ += uint64_t(T) * uint64_t(H) * dtype_size(W.embed.dtype);

  int moe_layer = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = W.layers[size_t(l)];
    add_and_norm(nullptr, L.input_norm, T);
    std::visit(
        [&](auto& cache) {
          if (c.mla) mla_attention(plan, l, L, T, cache);
          else gqa_attention(plan, l, L, T, cache);
        },
        kv_);
    const int64_t od = L.o.shape[1];  // attention output width: heads x (head_dim or v_head_dim)
    round_to_bf16(attn_.data(), int64_t(T) * od, attnb_.data());
    matmul({attn_.data(), attnb_.data(), T}, L.o, tmp_.data(), pool_);
    add_and_norm(tmp_.data(), L.post_norm, T);
    if (L.moe)
      moe(L, moe_layer++, T, ffn_.data(), slot, num_real);
    else
      dense_ffn(L.dense, T, ffn_.data());
    for (int64_t i = 0; i < int64_t(T) * H; ++i) x_[size_t(i)] += ffn_[size_t(i)];
  }

}

const float* ModelRunner::logits(const int* token_indices, int n) {
  if (n > max_seqs_) throw Error("logits: " + std::to_string(n) + " rows exceed the buffer's " + std::to_string(max_seqs_));
  const ModelConfig& c = config();
  const int H = c.hidden_size;
  for (int i = 0; i < n; ++i)
    rms_norm(&x_[size_t(token_indices[i]) * H], weights_.final_norm, 0, H, c.rms_norm_eps, &h_[size_t(i) * H]);
  round_to_bf16(h_.data(), int64_t(n) * H, hb_.data());
  matmul({h_.data(), hb_.data(), n}, weights_.lm_head, logits_.data(), pool_);
  weight_bytes_ += weights_.lm_head.nbytes();
  return logits_.data();
}

}  // namespace r3
