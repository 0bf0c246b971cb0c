#include "engine/model_runner.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "engine/sampling.h"
#include "kernels/matmul.h"

namespace r3 {

using kernels::matmul;
using kernels::rms_norm;
using kernels::round_to_bf16;

namespace {
// MLA caches the latent row only (no V); GQA the kv heads' keys and values. `layers` of them.
AnyKvCache make_kv_cache(const ModelConfig& c, int layers, int blocks, int block_size,
                         DType dtype) {
  const int64_t k = c.mla ? c.mla->latent_width() : int64_t(c.num_kv_heads) * c.head_dim;
  const int64_t v = c.mla ? 0 : k;
  if (dtype == DType::BF16) return KvCache<uint16_t>(layers, blocks, block_size, k, v);
  if (dtype == DType::F32) return KvCache<float>(layers, blocks, block_size, k, v);
  throw Error("the KV cache holds bf16 or fp32");
}
int count_sliding(const ModelConfig& c, int window_blocks) {
  int n = 0;
  for (const LayerConfig& l : c.layers) n += window_blocks > 0 && l.attention.sliding_window > 0;
  return n;
}
// Layers whose KV lives in the main pool: all but the sliding ones and the Gated DeltaNet ones
// (which keep a recurrent state instead).
int count_full(const ModelConfig& c, int window_blocks) {
  return c.num_layers - count_sliding(c, window_blocks) - c.num_deltanet_layers();
}
}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<Checkpoint> ckpt, int num_blocks, int block_size,
                         int max_step_tokens, int max_seqs, ThreadPool* pool, DType kv_dtype,
                         int window_blocks, EplbMap eplb, ExpertExchange* exchange,
                         int state_snapshots)
    : ckpt_(std::move(ckpt)),
      num_blocks_(num_blocks),
      block_size_(block_size),
      max_tokens_(max_step_tokens),
      max_seqs_(std::min(max_seqs, max_step_tokens)),
      window_blocks_(window_blocks),
      pool_(pool),
      // Positions never reach past what the KV pool holds, so the RoPE table (and attention's
      // score scratch) stop there even when the model allows far longer contexts.
      // One RoPE table serves every layer (checked below: they share their rotary dimensions).
      rope_(rope_inv_freq(ckpt_->config(), ckpt_->config().layers[0].attention.rotary_dim),
            float(ckpt_->config().rope_scaling.attention_factor),
            int(std::min<int64_t>(ckpt_->config().max_position_embeddings,
                                  int64_t(num_blocks) * block_size))),
      kv_(make_kv_cache(ckpt_->config(), count_full(ckpt_->config(), window_blocks), num_blocks,
                        block_size, kv_dtype)),
      window_kv_(make_kv_cache(ckpt_->config(), count_sliding(ckpt_->config(), window_blocks),
                               window_blocks, block_size, kv_dtype)),
      eplb_(std::move(eplb)),
      exchange_(exchange) {
  const ModelConfig& c = config();
  int full = 0, windowed = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const bool recurrent = c.layers[size_t(l)].attention.kind == AttentionKind::GatedDeltaNet;
    cache_layer_.push_back(recurrent ? -1 : sliding(l) ? windowed++ : full++);
    dn_index_.push_back(recurrent ? int(dn_layers_.size()) : -1);
    if (recurrent) dn_layers_.push_back(l);
  }
  norm_offset_ = c.zero_centred_norms ? 1.f : 0.f;
  for (const LayerConfig& l : c.layers)
    if (l.attention.rotary_dim != c.layers[0].attention.rotary_dim)
      throw Error("layers with different rotary dimensions are not implemented by the engine");
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
  size_t od = c.mla ? size_t(c.num_heads) * size_t(c.mla->v_head_dim) : qd;
  if (c.deltanet) {
    const DeltaNetSpec& d = *c.deltanet;
    od = std::max(od, size_t(d.value_dim()));
    dn_state_floats_ = size_t(d.state_floats());
    // One state per running request: max_seqs of them (max_seqs_ bounds only a step's sampled
    // rows).
    dn_state_.assign(size_t(max_seqs) * dn_layers_.size() * dn_state_floats_, 0.f);
    if (state_snapshots > 0)
      dn_snapshots_ = std::make_unique<BigArray<float>>(size_t(state_snapshots) *
                                                        dn_layers_.size() * dn_state_floats_);
    dn_mixed_.resize(T * size_t(d.conv_dim()));
    dn_conv_.resize(T * size_t(d.conv_dim()));
    dn_z_.resize(T * size_t(d.value_dim()));
    dn_b_.resize(T * size_t(d.v_heads));
    dn_a_.resize(T * size_t(d.v_heads));
  }
  for (const LayerConfig& l : c.layers)
    if (l.attention.output_gate) {
      qg_.resize(T * 2 * qd);
      attn_gate_.resize(T * qd);
    }
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
  moe_layers_ = c.moe_layers();
  for (int l = 0; l < L; ++l) {
    load_.emplace_back(new std::atomic<uint64_t>[size_t(c.num_experts)]());
    phys_load_.emplace_back(new std::atomic<uint64_t>[size_t(2 * c.num_experts)]());
  }
  pack_weights();
}

void ModelRunner::set_eplb(EplbMap map) {
  if (exchange_)
    throw Error(
        "a new EPLB placement is not supported with expert parallelism (it would move experts "
        "between ranks)");
  eplb_ = std::move(map);
}

void ModelRunner::set_weights(std::shared_ptr<Checkpoint> ckpt) {
  ckpt_ = std::move(ckpt);
  pack_weights();
}

void ModelRunner::reserve_draft_states(int seqs, int drafts) {
  dn_max_drafts_ = drafts;
  dn_draft_.assign(size_t(seqs) * size_t(drafts) * dn_layers_.size() * dn_state_floats_, 0.f);
}

void ModelRunner::restore_draft_state(int state_slot, int draft_slot, int accepted) {
  // After `accepted` drafts the request's last computed token is the step's token `accepted`:
  // the state kept after it (token 0 is the one that was known before the step).
  for (int l : dn_layers_)
    std::copy_n(deltanet_draft(draft_slot, accepted, l), dn_state_floats_,
                deltanet_state(state_slot, l));
}

void ModelRunner::release_kv_cache() {
  std::visit([](auto& cache) { cache.release(); }, kv_);
  std::visit([](auto& cache) { cache.release(); }, window_kv_);
}

void ModelRunner::restore_kv_cache() {
  std::visit([](auto& cache) { cache.restore(); }, kv_);
  std::visit([](auto& cache) { cache.restore(); }, window_kv_);
}

void ModelRunner::release_packed_weights() {
  packed_.reset();
  packed_at_.clear();
  weights_ = ModelWeights();
  packed_released_ = true;
}

// The checkpoint's matrices are packed already (its panels are the only copy); what the runner
// packs itself is MLA's per-head absorbed weights, derived from kv_b (kept as stored).
void ModelRunner::pack_weights() {
  packed_released_ = false;
  weights_ = ckpt_->weights();
  build_mla_heads();
  std::vector<TensorView*> mats;
  for (auto& layer : mla_heads_)
    for (MlaHead& h : layer) mats.push_back(&h.uv), mats.push_back(&h.uk_t);
  std::vector<TensorView*> bf16;
  for (TensorView* t : mats)
    if (!t->empty() && kernels::packable(t->dtype)) bf16.push_back(t);
  std::vector<size_t> at = {0};
  for (const TensorView* t : bf16)
    at.push_back(at.back() + (kernels::packed_bf16_size(*t) + 31) / 32 * 32);
  if (!(packed_ && packed_at_ == at)) {
    packed_ = std::make_unique<BigArray<uint16_t>>(
        std::max<size_t>(at.back(), 32));  // packing writes every panel byte
    packed_at_ = std::move(at);
  }
  pool_->parallel_for_each(int64_t(bf16.size()), [&](int64_t i) {
    kernels::pack_bf16_panels(
        *bf16[size_t(i)], packed_->get() + packed_at_[size_t(i)], 0,
        (bf16[size_t(i)]->shape[0] + kernels::kPanelRows - 1) / kernels::kPanelRows);
    bf16[size_t(i)]->packed = packed_->get() + packed_at_[size_t(i)];
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
      rms_norm(x, norm, 0, H, eps, h, norm_offset_);
      round_to_bf16(h, H, hb_.data() + size_t(t) * H);
    }
  });
}

void ModelRunner::refuse_if_released() const {
  if (memory_released())
    throw Error(
        "the engine's memory is released: resume it before generating (weights released after a "
        "refit "
        "from tensors come back with the next refit)");
}

void ModelRunner::forward(const StepPlan& plan, const int* token_ids, CaptureSlot* slot) {
  refuse_if_released();
  const ModelConfig& c = config();
  const ModelWeights& W = weights_;
  const int T = int(plan.tokens.size());
  if (T > max_tokens_)
    throw Error("step of " + std::to_string(T) + " tokens exceeds the runner's " +
                std::to_string(max_tokens_));
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
    if (c.layers[size_t(l)].attention.kind == AttentionKind::GatedDeltaNet)
      deltanet(plan, l, L, T);
    else
      std::visit(
          [&](auto& cache) {
            if (c.mla)
              mla_attention(plan, l, L, T, cache);
            else
              gqa_attention(plan, l, L, T, cache);
          },
          sliding(l) ? window_kv_ : kv_);
    const int64_t od = L.o.shape[1];  // attention output width: heads x (head_dim or v_head_dim)
    pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
      round_to_bf16(attn_.data() + t0 * od, (t1 - t0) * od, attnb_.data() + t0 * od);
    });
    matmul({attn_.data(), attnb_.data(), T}, L.o, tmp_.data(), pool_);
    if (!L.o_bias.empty())
      for (int t = 0; t < T; ++t) kernels::add_bias(tmp_.data() + size_t(t) * H, L.o_bias, 0, H);
    add_and_norm(tmp_.data(), L.post_norm, T);
    if (L.moe)
      moe(L, moe_layer++, T, ffn_.data(), slot, num_real);
    else
      dense_ffn(L.dense, T, ffn_.data());
    pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
      for (int64_t i = t0 * H; i < t1 * H; ++i) x_[size_t(i)] += ffn_[size_t(i)];
    });
  }
}

const float* ModelRunner::logits(const int* token_indices, int n) {
  if (n > max_seqs_)
    throw Error("logits: " + std::to_string(n) + " rows exceed the buffer's " +
                std::to_string(max_seqs_));
  const ModelConfig& c = config();
  const int H = c.hidden_size;
  for (int i = 0; i < n; ++i)
    rms_norm(&x_[size_t(token_indices[i]) * H], weights_.final_norm, 0, H, c.rms_norm_eps,
             &h_[size_t(i) * H], norm_offset_);
  round_to_bf16(h_.data(), int64_t(n) * H, hb_.data());
  matmul({h_.data(), hb_.data(), n}, weights_.lm_head, logits_.data(), pool_);
  weight_bytes_ += weights_.lm_head.nbytes();
  return logits_.data();
}

}  // namespace r3
