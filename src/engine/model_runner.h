// Runs one step's flattened tokens (prefill chunks, decodes and padding mixed) through the model
// with batch-invariant kernels, writes their KV into the paged cache (KvCache) and captures
// routes; logits on request (StepSampler samples and scores outside). The forward is a loop over
// the layers calling blocks, each in its own file: attention_block.cc (GQA), mla_block.cc (MLA),
// moe_block.cc (MoE), dense_block.cc (dense MLP); scratch is sized once from the model description.
// Numerics: weights as stored (bf16 or f32), activations rounded to bf16 at matmul inputs, fp32
// accumulation in the fixed order of kernels/dot.h; K and V rounded to the KV cache dtype (bf16
// by default for bf16 checkpoints) as they are written, attention in fp32.
#pragma once
#include <atomic>
#include <memory>
#include <span>
#include <utility>
#include <variant>
#include <vector>

#include "core/big_alloc.h"
#include "core/thread_pool.h"
#include "engine/expert_exchange.h"
#include "engine/kv_cache.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "model/checkpoint.h"
#include "routes/eplb.h"
#include "routes/route_capturer.h"
#include "step/step_plan.h"

namespace r3 {

class ModelRunner {
 public:
  // max_step_tokens bounds a step's tokens (incl. padding), max_seqs its sampled rows; kv_dtype
  // (BF16 or F32) is the KV cache element: K and V are rounded to it as they are written.
  // window_blocks: the sliding-window layers' own pool (their KV lives there, the other layers'
  // in the num_blocks pool); 0 when the model has no sliding layers. eplb: the physical experts
  // (EplbMap). exchange (expert parallelism): this rank packs and computes only its own physical
  // experts (first_physical) and gathers the other ranks' rows in every MoE layer.
  // state_snapshots: recurrent-state snapshots for prefix caching (hybrids; StateSnapshots says
  // which slot holds what), committed as written.
  ModelRunner(std::shared_ptr<Checkpoint> ckpt, int num_blocks, int block_size, int max_step_tokens,
              int max_seqs, ThreadPool* pool, DType kv_dtype, int window_blocks = 0,
              EplbMap eplb = {}, ExpertExchange* exchange = nullptr, int state_snapshots = 0);

  const ModelConfig& config() const { return ckpt_->config(); }
  int scratch_block() const { return num_blocks_; }  // one past the pool: padding writes here
  // r3::Error while the memory is released (release_memory_occupation): forward refuses to run.
  void refuse_if_released() const;
  int window_scratch_block() const { return window_blocks_; }
  // Computes a step's hidden states (every planned token, embedded from token_ids: the plan's
  // tokens with placeholders resolved, StepSampler) and captures its routes into slot (null: the
  // engine started without route capture).
  void forward(const StepPlan& plan, const int* token_ids, CaptureSlot* slot);
  // The logits of up to max_logit_rows() of the last step's tokens (final norm, lm_head):
  // [n, vocab], valid until the next call.
  const float* logits(const int* token_indices, int n);
  int max_logit_rows() const { return max_seqs_; }
  // New weights for the same model description (Engine checks that): the checkpoint's views
  // (its panels, packed as it loaded or was updated), and MLA's absorbed heads rebuilt from them.
  void set_weights(std::shared_ptr<Checkpoint> ckpt);
  // Memory given back to the operating system while the engine is idle (RL trainer and engine
  // on one machine): the KV cache, and the runner's views of the weights (the Engine frees the
  // checkpoint's panels and reloads them: Checkpoint::release_panels, reload). No forward may
  // run until the matching restore.
  void release_kv_cache();
  void restore_kv_cache();
  void release_packed_weights();
  bool memory_released() const {
    return std::visit([](const auto& cache) { return cache.released(); }, kv_) ||
           packed_released_;  // both caches go together
  }
  // A new placement (rebalance): refused under expert parallelism, where it would move experts
  // between ranks.
  void set_eplb(EplbMap map);
  const EplbMap& eplb() const { return eplb_; }
  // Tokens routed to each logical expert, per MoE layer (a by-product of the forward).
  std::vector<std::vector<uint64_t>> expert_load() const;
  std::vector<std::vector<uint64_t>> physical_expert_load() const;
  uint64_t weight_bytes_read() const { return weight_bytes_.load(); }
  uint64_t attention_ns() const { return attention_ns_.load(); }  // EngineStats::attention_seconds
  uint64_t deltanet_ns() const { return deltanet_ns_.load(); }    // EngineStats::deltanet_seconds
  // Bytes of the Gated DeltaNet layers' state: per request (one slot), and all slots.
  uint64_t recurrent_state_bytes_per_request() const {
    return dn_layers_.size() * dn_state_floats_ * sizeof(float);
  }
  uint64_t recurrent_state_bytes() const { return dn_state_.size() * sizeof(float); }
  // Speculative decoding on a hybrid: room for `seqs` drafting requests' states after each of up
  // to `drafts` tokens (PlannedSeq::draft_slot), and putting a request's state back to where
  // `accepted` drafts leave it (after the step that computed them, before the next one).
  void reserve_draft_states(int seqs, int drafts);
  void restore_draft_state(int state_slot, int draft_slot, int accepted);
  uint64_t draft_state_bytes() const { return dn_draft_.size() * sizeof(float); }

 private:
  template <typename KvT>
  void attention(const StepPlan& plan, int layer, const float* q, float* out, KvCache<KvT>& cache);
  // Both read the post-attention norm in h_ / hb_.
  void moe(const LayerWeights& L, int moe_layer, int T, float* out, CaptureSlot* slot,
           int num_real);
  void dense_ffn(const ExpertWeights& w, int T, float* out);
  void add_and_norm(const float* add, const TensorView& norm, int T);
  void rotate(float* head, int pos, bool interleaved) const {
    if (interleaved)
      rope_.apply_interleaved(head, pos);
    else
      rope_.apply(head, pos);
  }
  // weights_ = the checkpoint's views (packed), and MLA's absorbed heads packed from kv_b.
  void pack_weights();
  // MLA (multi-head latent attention, DeepSeek-V3): the absorbed per-head weights and the block.
  struct MlaHead {
    TensorView uk_t,
        uv;  // [kv_lora, nope] (copy of kv_b's key rows, transposed), [v, kv_lora] (view)
  };
  void build_mla_heads();
  void per_head_matmul(const std::vector<MlaHead>& heads, bool key, const float* xs,
                       const uint16_t* xb, int T, int in, float* y, int ldy, int out_stride);
  template <typename KvT>
  void mla_attention(const StepPlan& plan, int layer, const LayerWeights& L, int T,
                     KvCache<KvT>& cache);
  template <typename KvT>
  void gqa_attention(const StepPlan& plan, int layer, const LayerWeights& L, int T,
                     KvCache<KvT>& cache);
  // Gated DeltaNet (deltanet_block.cc): attn_ gets [T, value_dim], each request's tokens run in
  // order against its state slot (PlannedSeq::state_slot), reset where it starts at position 0.
  void deltanet(const StepPlan& plan, int layer, const LayerWeights& L, int T);
  // A DeltaNet layer's state (the S matrices [v_heads][k_head_dim][v_head_dim], then the conv
  // window) in one of the buffers laid out [index][DeltaNet layer][state_floats].
  float* deltanet_state_in(float* base, size_t index, int layer) {
    return base + (index * dn_layers_.size() + size_t(dn_index_[size_t(layer)])) * dn_state_floats_;
  }
  float* deltanet_state(int slot, int layer) {  // a running request's
    return deltanet_state_in(dn_state_.data(), size_t(slot), layer);
  }
  float* deltanet_draft(int draft_slot, int token, int layer) {  // after a draft step's token
    return deltanet_state_in(dn_draft_.data(),
                             size_t(draft_slot) * size_t(dn_max_drafts_) + size_t(token), layer);
  }
  float* deltanet_snapshot(int snapshot, int layer) {  // a prefix-caching snapshot
    return deltanet_state_in(dn_snapshots_->get(), size_t(snapshot), layer);
  }

  std::shared_ptr<Checkpoint> ckpt_;
  ModelWeights weights_;  // views the kernels read (the checkpoint's panels)
  // Storage behind MLA's absorbed heads' TensorView::packed (the rest is the checkpoint's).
  std::unique_ptr<BigArray<uint16_t>> packed_;
  std::vector<size_t> packed_at_;  // [matrix + 1] element offsets into packed_, 64-byte aligned
  bool packed_released_ = false;
  std::vector<std::vector<MlaHead>> mla_heads_;    // [layer][head]
  std::vector<std::vector<uint8_t>> mla_storage_;  // behind each uk_t
  int num_blocks_, block_size_, max_tokens_, max_seqs_;
  int window_blocks_;
  ThreadPool* pool_;
  kernels::Rope rope_;
  size_t kv_dim_;         // K elements per token and layer: the kv heads' keys, or MLA's latent row
  AnyKvCache kv_;         // the full-attention layers (every layer without sliding ones)
  AnyKvCache window_kv_;  // the sliding-window layers, in their own pool (window_blocks_ > 0)
  std::vector<int> cache_layer_;  // layer -> its index in kv_ or window_kv_
  bool sliding(int layer) const {
    return window_blocks_ > 0 && config().layers[size_t(layer)].attention.sliding_window > 0;
  }
  EplbMap eplb_;
  ExpertExchange* exchange_ = nullptr;  // expert parallelism, or null
  // The physical experts [first, last) of num_physical this process computes (all in one process).
  std::pair<int, int> own_physical(int num_physical) const {
    const int rank = exchange_ ? exchange_->rank() : 0, ranks = exchange_ ? exchange_->ranks() : 1;
    return {first_physical(rank, ranks, num_physical),
            first_physical(rank + 1, ranks, num_physical)};
  }
  std::vector<int> moe_layers_;  // decoder layer of each MoE layer (ModelConfig::moe_layers)
  float norm_offset_ = 0.f;      // 1: norms applied as (1 + w) (ModelConfig::zero_centred_norms)
  // Gated DeltaNet: the decoder layers that are, each one's index among them (-1 for others), and
  // every state slot's recurrent and conv state for each of them, fp32, zeroed as a request starts.
  std::vector<int> dn_layers_, dn_index_;
  size_t dn_state_floats_ = 0;
  // [draft slot][token][DeltaNet layer][state]: the states after a drafting request's tokens.
  std::vector<float> dn_draft_;
  int dn_max_drafts_ = 0;
  std::vector<float> dn_state_;  // [max_num_seqs slots][DeltaNet layers][state_floats]
  std::unique_ptr<BigArray<float>> dn_snapshots_;  // [snapshots][DeltaNet layers][state_floats]
  std::vector<float> dn_mixed_, dn_conv_, dn_z_, dn_b_,
      dn_a_;  // [T, C], [T, C], [T, vd], [T, nv] x 2
  std::vector<float> qg_,
      attn_gate_;  // output-gated attention: q_proj's [T, 2 qd], the gates [T, qd]
  std::vector<std::unique_ptr<std::atomic<uint64_t>[]>> load_, phys_load_;
  std::atomic<uint64_t> weight_bytes_{0};
  std::atomic<uint64_t> attention_ns_{0};
  std::atomic<uint64_t> deltanet_ns_{0};  // whole Gated DeltaNet blocks, projections included
  // Scratch, sized once (no allocation per step in the steady state).
  std::vector<float> x_, h_, q_, k_, v_, attn_, tmp_, ffn_, logits_, probs_;
  std::vector<float> gate_, up_, act_, expert_out_, route_w_;
  std::vector<float> shared_gate_, router_bias_;  // [T], [E]
  // MLA: [T, q_lora], [nh][T][nope] (head-major), [T][nh][latent + rope], [nh][T][kv_lora]
  std::vector<float> qa_, q_nope_, q_lat_, o_lat_;
  std::vector<uint16_t> qab_, q_nopeb_, o_latb_;
  std::vector<uint16_t> hb_, attnb_, actb_;  // bf16 bits of the matmul inputs
  std::vector<int16_t> route_ids_;
  std::vector<int> group_offsets_, slot_token_, slot_of_, nth_of_logical_, phys_, fill_;
  struct AttentionGroup {
    int first, count;  // consecutive plan tokens of one request (or one padding token)
  };
  std::vector<AttentionGroup> attn_groups_;
  std::vector<float> sink_logits_;  // [num_heads] of the layer being attended (sinks as fp32)
};

}  // namespace r3
