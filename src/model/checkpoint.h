// A Hugging Face checkpoint directory: config.json plus model.safetensors, or shards listed in
// model.safetensors.index.json. Tensors are read into memory the checkpoint owns (files rewritten
// afterwards change nothing); F16 ones are widened to F32 once, since the kernels read F32 or BF16.
// F8_E4M3 matrices (quantization_config fp8) are served with their block scales, kept 8-bit.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"

namespace r3 {

class ThreadPool;

struct ExpertWeights {
  TensorView gate, up, down;  // [I, H], [I, H], [H, I]
  TensorView gate_bias, up_bias, down_bias;  // [I], [I], [H]; empty without expert biases
};

struct LayerWeights {
  TensorView input_norm, post_norm;  // [H]
  TensorView q, k, v, o;             // [nh*hd, H], [nkv*hd, H], [nkv*hd, H], [H, nh*hd]
  TensorView q_bias, k_bias, v_bias; // [nh*hd], [nkv*hd], [nkv*hd]; empty without qkv_bias
  // MLA (k, v empty): q = q (q_proj [nh*qk, H]) or q_b(norm(q_a h)) with q_a [qr, H], q_a_norm [qr],
  // q (q_b_proj) [nh*qk, qr]; latent = kv_a h [kvr + rope, H], kv_a_norm [kvr]; kv_b [nh*(nope+v), kvr];
  // o [H, nh*v].
  TensorView q_a, q_a_norm, kv_a, kv_a_norm, kv_b;
  TensorView q_norm, k_norm;         // [hd] (per head) or [nh*hd] / [nkv*hd] (whole); empty if none
  TensorView o_bias;                 // [H] or empty
  TensorView sinks;                  // [nh] per-head sink logits, or empty
  bool moe = false;
  TensorView router;                 // [E, H]
  TensorView router_bias;            // [E] selection-only bias (e_score_correction_bias), or the
                                     // logit bias of RouterSpec::logit_bias; or empty
  std::vector<ExpertWeights> experts;
  ExpertWeights shared;              // shared experts as one MLP [S, H], [S, H], [H, S]; empty if none
  TensorView shared_gate;            // [1, H]: the shared output is scaled by sigmoid(gate . h); or empty
  ExpertWeights dense;               // dense FFN layers
};

struct ModelWeights {
  ModelConfig config;
  TensorView embed, final_norm, lm_head;  // lm_head aliases embed when tied
  std::vector<LayerWeights> layers;
};

class Checkpoint {
 public:
  // Loads and validates every tensor the architecture needs: each problem is an r3::Error naming
  // the file and the tensor.
  // `held` (given the config): [L_moe][E], the experts one expert-parallel rank computes. The
  // others' tensors, or their rows of a fused per-layer tensor, are validated but never read,
  // so they take no memory, and their ExpertWeights stay empty. Empty: every expert.
  using HeldExperts = std::function<std::vector<std::vector<bool>>(const ModelConfig&)>;
  // pool: threads to build the derived copies on (GPT-OSS's per-expert split); none: this one.
  static std::shared_ptr<Checkpoint> open(const std::string& dir, const HeldExperts& held = {},
                                          ThreadPool* pool = nullptr);
  // The same from tensors in memory (an RL trainer's refit without a round trip through disk):
  // config.json text and tensors under their Hugging Face names; validated the same way.
  static std::shared_ptr<Checkpoint> from_memory(const std::string& config_json,
                                                 std::vector<TensorToWrite> tensors);

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return weights_.config; }
  const ModelWeights& weights() const { return weights_; }
  // What differs between this checkpoint and `other` that a served engine depends on: config
  // keys (config_differences) and tensor dtypes. Empty when `other` can replace this one.
  std::vector<std::string> differences(const Checkpoint& other) const;
  // In-memory weight updates (a trainer's tensors by Hugging Face name). check_update throws
  // r3::Error naming the first tensor this checkpoint does not hold with that shape and dtype, or
  // whose quantized values the loader would refuse, or whose float values are not all finite;
  // U8 bytes sent for an F8_E4M3 tensor are taken as its codes (their dtype is set to F8_E4M3).
  void check_update(std::vector<TensorToWrite>& tensors) const;
  // Throws r3::Error naming the first stored float tensor (BF16, F16, F32) holding a NaN or an
  // infinity, and where: a refit from disk checks the new checkpoint with this before it serves.
  // The initial load does not (its non-finite values fail requests on their logits instead).
  void refuse_non_finite_values() const;
  // Copies of every stored tensor under its Hugging Face name (a trainer's view of the weights).
  std::vector<TensorToWrite> stored_tensors() const;
  // Every stored tensor's description by name, without its data: what an update may send
  // (refits never change them), for checking a request's tensor list before its data arrives.
  std::map<std::string, TensorView> catalog() const;
  // The rule every tensor an update sends meets: `have` (the served tensor, null when there is
  // none) has its shape and dtype; U8 bytes for an F8_E4M3 tensor are taken as its codes (`dtype`
  // becomes F8_E4M3). Throws r3::Error naming the tensor. check_update applies it first.
  static void check_sent_tensor(const TensorView* have, const std::string& name, DType& dtype,
                                const std::vector<int64_t>& shape);
  // Bytes of every stored tensor (as in the files).
  uint64_t stored_bytes() const;
  // apply_update checks everything first, then takes the sent bytes over as this checkpoint's
  // storage (no copy: a refit costs the repacking only) and rebuilds the derived views (F16
  // widening). Call it only while nothing reads the weights; views taken before it dangle.
  struct Update {
    // The bytes now stored for the sent tensors: what any copy derived from them (packed
    // panels) must be rebuilt from.
    std::vector<std::span<const uint8_t>> written;
    // The storage they replaced (a shard once all of its tensors are replaced), for the caller
    // to free where the time does not count.
    std::vector<std::shared_ptr<void>> replaced;
  };
  // pool: threads to rebuild the derived copies on (the engine's, idle between steps); none: this one.
  Update apply_update(std::vector<TensorToWrite> tensors, ThreadPool* pool = nullptr);

 private:
  // A float tensor of this shape (F16 widened to F32); U8 with `bytes`.
  const TensorView& require(const std::string& name, std::vector<int64_t> shape, bool bytes = false);
  void load_weights();
  void load_weights_on(ThreadPool* pool);  // load_weights with pool_ set for its duration
  // Per-expert [out, in] views of a layer's fused expert tensors (LayerTensorNames::fused_experts),
  // copied into derived_ in the source dtype.
  std::vector<ExpertWeights> split_fused_experts(int layer);
  std::vector<ExpertWeights> split_mxfp4_experts(int layer);  // without the biases
  const TensorView& fp8_weight(const TensorView& stored);
  TensorView decoded_bf16(const TensorView& fp8);
  void check_quantized_values(const TensorView& t) const;
  TensorView derived_copy(const TensorView& src, const std::string& what, std::vector<int64_t> shape, int64_t base,
                          int64_t row_stride, int64_t col_stride);
  // A buffer of `bytes` appended to derived_: a spare one of that size left by the previous load
  // when there is one (an update rebuilds the same copies, and fresh pages cost the kernel a
  // clear each), else a new one.
  uint8_t* derived_buffer(size_t bytes);

  std::string dir_;
  bool partial_ = false;  // opened without some experts
  std::vector<std::vector<bool>> held_;  // [decoder layer][E]: empty (a dense layer, or all held)
  bool holds(int layer, int64_t expert) const {
    return held_.empty() || held_[size_t(layer)].empty() || held_[size_t(layer)][size_t(expert)];
  }
  SafetensorsFile::UnreadParts unread_parts() const;  // what held_ leaves on disk
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
  std::set<std::string> used_;  // names load_weights read
  std::map<std::string, TensorView> widened_;  // F16 tensors converted to F32; FP8 with their scales
  std::vector<std::vector<float>> owned_;
  std::vector<std::vector<uint8_t>> derived_;  // split_fused_experts' copies, rebuilt by every update
  std::map<size_t, std::vector<std::vector<uint8_t>>> spare_derived_;  // by size: during an update's load
  ThreadPool* pool_ = nullptr;  // during a load: open's or apply_update's pool
  std::vector<TensorToWrite> memory_;      // from_memory: the tensors' bytes
  std::vector<TensorView> memory_views_;
  struct Adopted {                          // apply_update: a sent tensor's bytes and their view
    std::vector<uint8_t> bytes;
    TensorView view;
  };
  std::map<std::string, Adopted> adopted_;
  ModelWeights weights_;
};

// Hugging Face tensor names of one layer (model/tensor_names.h holds the tables).
std::string layer_prefix(int layer);
std::string router_name(const ModelConfig& c, int layer);
std::string expert_name(const ModelConfig& c, int layer, int expert, const char* which);  // gate|up|down
std::string dense_name(const ModelConfig& c, int layer, const char* which);
std::string shared_expert_name(const ModelConfig& c, int layer, const char* which);  // gate|up|down
std::string shared_gate_name(const ModelConfig& c, int layer);
std::string router_bias_name(const ModelConfig& c, int layer);
// Stored tensors r3 has no use for and may ignore (RoPE inv_freq buffers of old exports).
bool knowingly_unused(const std::string& name);

}  // namespace r3
