// A Hugging Face checkpoint directory: config.json plus model.safetensors, or shards listed in
// model.safetensors.index.json. Every weight is held once. The matrices the engine multiplies
// (bf16, MXFP4, block-scaled FP8) live only as packed panels (core/panel_layout.h), built layer by
// layer as the files are read: a layer's tensors are read into a reused staging area, packed on
// every thread, and dropped. Small tensors (norms, biases, an untied embedding, FP8 block scales)
// are kept as stored; F16 ones are widened to F32 once. Anything that needs a matrix's values
// reads them back from its panels (TensorView::at). Files rewritten after the load change nothing:
// nothing is read from them again, except by reload(), which first checks they are the same files.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/big_alloc.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace r3 {

class ThreadPool;

struct ExpertWeights {
  TensorView gate, up, down;                 // [I, H], [I, H], [H, I]
  TensorView gate_bias, up_bias, down_bias;  // [I], [I], [H]; empty without expert biases
};

struct LayerWeights {
  TensorView input_norm, post_norm;  // [H]
  TensorView q, k, v, o;             // [nh*hd, H], [nkv*hd, H], [nkv*hd, H], [H, nh*hd]
                                     // (q [nh*2*hd, H] with an output gate: per head query, gate)
  // Gated DeltaNet (q, k, v empty; o is out_proj [H, vd]): qkv [2kd + vd, H] (q, k, v channels,
  // head-major), z [vd, H], b and a [nv, H] (Checkpoint::build_deltanet); conv1d [C, 1, K];
  // dt_bias, A_log [nv]; the gated norm [dv] (applied as w, never 1 + w).
  TensorView dn_qkv, dn_z, dn_b, dn_a;
  TensorView dn_conv, dn_dt_bias, dn_a_log, dn_norm;
  TensorView q_bias, k_bias, v_bias;  // [nh*hd], [nkv*hd], [nkv*hd]; empty without qkv_bias
  // MLA (k, v empty): q = q (q_proj [nh*qk, H]) or q_b(norm(q_a h)) with q_a [qr, H], q_a_norm
  // [qr], q (q_b_proj) [nh*qk, qr]; latent = kv_a h [kvr + rope, H], kv_a_norm [kvr]; kv_b
  // [nh*(nope+v), kvr]; o [H, nh*v].
  TensorView q_a, q_a_norm, kv_a, kv_a_norm, kv_b;
  TensorView q_norm, k_norm;  // [hd] (per head) or [nh*hd] / [nkv*hd] (whole); empty if none
  TensorView o_bias;          // [H] or empty
  TensorView sinks;           // [nh] per-head sink logits, or empty
  bool moe = false;
  TensorView router;       // [E, H]
  TensorView router_bias;  // [E] selection-only bias (e_score_correction_bias), or the
                           // logit bias of RouterSpec::logit_bias; or empty
  std::vector<ExpertWeights> experts;
  ExpertWeights shared;    // shared experts as one MLP [S, H], [S, H], [H, S]; empty if none
  TensorView shared_gate;  // [1, H]: the shared output is scaled by sigmoid(gate . h); or empty
  ExpertWeights dense;     // dense FFN layers
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
  // pool: threads to pack on (and build GPT-OSS's per-expert split); none: this one.
  // refuse_non_finite: a NaN or infinity in any float tensor is an error (a refit's new weights).
  static std::shared_ptr<Checkpoint> open(const std::string& dir, const HeldExperts& held = {},
                                          ThreadPool* pool = nullptr,
                                          bool refuse_non_finite = false);
  // The description and the tensor headers only (config.json, the index, each file's header,
  // every check that needs no tensor's bytes): a refit's first step (check_refit, refit_from).
  static std::shared_ptr<Checkpoint> headers(const std::string& dir, const HeldExperts& held = {});
  // A refit from disk in place. check_refit throws r3::Error (this checkpoint unchanged) unless
  // `next` (from headers()) stores exactly the tensors this one uses, with their shapes and
  // dtypes, and block scales the loader accepts (each read and checked now). refit_from then
  // reads and packs a layer at a time into the served panels, checking each layer's values
  // before it changes it; an error there (a NaN, a file truncated meanwhile) leaves some layers
  // new and the rest old: the caller must not serve until a refit succeeds. Call refit_from only
  // while nothing reads the weights.
  void check_refit(const Checkpoint& next) const;
  void refit_from(Checkpoint& next, ThreadPool* pool = nullptr);
  // The same checkpoint read again from its files (after release_panels), refused with an
  // r3::Error when a file changed since it was read (device, inode, size, modification time) or
  // the served weights came from an update in memory (they are on no disk).
  std::shared_ptr<Checkpoint> reload(ThreadPool* pool = nullptr) const;
  // Frees the packed panels (release_memory_occupation); weights() then holds no matrix.
  void release_panels();
  bool panels_released() const { return released_; }
  // From memory, or updated in memory since its files were read: reload() cannot rebuild it.
  bool updated_in_memory() const { return updated_in_memory_; }
  // Bytes of the packed panels and of the small tensors kept as stored.
  uint64_t packed_bytes() const;
  uint64_t kept_bytes() const;
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
  // Throws r3::Error naming the first weight (a bf16 matrix's panels or a kept float tensor)
  // holding a NaN or an infinity: a refit from a checkpoint made in memory checks it before it
  // serves (open(..., refuse_non_finite) checks each tensor as it is read).
  void refuse_non_finite_values() const;
  // Copies of every stored tensor under its Hugging Face name (a trainer's view of the weights),
  // read from the files (r3 keeps packed panels only) after checking they did not change;
  // refused for a checkpoint updated in memory or made from memory.
  std::vector<TensorToWrite> stored_tensors() const;
  // Every stored tensor's description by name, without its data: what an update may send
  // (refits never change them), for checking a request's tensor list before its data arrives.
  std::map<std::string, TensorView> catalog() const;
  // The rule every tensor an update sends meets: `have` (the served tensor, null when there is
  // none) has its shape and dtype; U8 bytes for an F8_E4M3 tensor are taken as its codes (`dtype`
  // becomes F8_E4M3). Throws r3::Error naming the tensor. check_update applies it first.
  static void check_sent_tensor(const TensorView* have, const std::string& name, DType& dtype,
                                const std::vector<int64_t>& shape);
  // The stored tensors the weights are built from (a full refit sends every one).
  const std::set<std::string>& used_tensors() const { return used_; }
  // Bytes of every stored tensor (as in the files).
  uint64_t stored_bytes() const;
  // The last load from the files: seconds spent waiting for reads of stored bytes and packing
  // them into panels (first-touching the panels' pages included; the rest of open() is the
  // description, headers and checks), and the bytes read past the page cache.
  struct LoadFigures {
    double read_seconds = 0, pack_seconds = 0;
    uint64_t direct_bytes = 0;
    uint64_t adopted_bytes = 0;  // kept in the staging chunk they were read into (no copy)
  };
  const LoadFigures& load_figures() const { return load_figures_; }
  // Tests: load every checkpoint as one whose files exceed half the memory, as a full-size one is
  // (cached pages given back), its layers read past the page cache even where it holds them (a
  // small file is all cached once its first tensor is read: the kernel reads ahead).
  static void treat_files_as_large(bool on);
  // The staging area's chunk size (256 MiB; 0 restores it). Tests: small chunks, so a small
  // model's embedding is read into a chunk of its own and kept there, as a large vocabulary's is.
  static void set_staging_chunk_bytes(size_t bytes);
  // The stored tensors an update would rather receive together with `name` (an FP8 weight and
  // its scales, MXFP4 blocks and scales, a tied checkpoint's embedding and stored lm_head): a
  // refit in buckets applies a tensor once these have arrived too (apply_update decides which
  // combinations it refuses).
  std::vector<std::string> sent_together(const std::string& name) const;
  // apply_update checks everything first, then rebuilds the layers the sent tensors belong to:
  // their matrices are packed into the panels they had (in place: a refit needs the sent bytes
  // beyond the resident weights, never a second copy), their small tensors replace the kept ones.
  // A block-scaled FP8 weight's scales need its codes sent with them, MXFP4 blocks their scales,
  // and a tied checkpoint's stored lm_head the embedding (their old bytes are not kept as stored).
  // Call it only while nothing reads the weights.
  struct Update {
    // Storage the update replaced, for the caller to free where the time does not count.
    std::vector<std::shared_ptr<void>> replaced;
  };
  // pool: threads to rebuild the derived copies on (the engine's, idle between steps); none: this
  // one.
  Update apply_update(std::vector<TensorToWrite> tensors, ThreadPool* pool = nullptr);
  // The same, leaving the sent bytes with the caller (refit_from reuses them for the next unit).
  Update apply_update_of(std::vector<TensorToWrite>& tensors, ThreadPool* pool = nullptr);

 private:
  // A float tensor of this shape (F16 widened to F32); U8 with `bytes`. Its bytes are read now
  // (into the staging area) unless it was not read (another rank's) or dropped (a refit that does
  // not send it: data stays null and the views built from it keep what they had).
  const TensorView& require(const std::string& name, std::vector<int64_t> shape,
                            bool bytes = false);
  void materialize(TensorView& t);
  void load_weights();
  void load_weights_on(ThreadPool* pool);  // load_weights with pool_ set for its duration
  // The pieces of load_weights: unit 0 is the embedding, final norm and lm_head, unit 1 + l
  // decoder layer l. build_* describe a unit's weights from require(); settle packs its matrices
  // into panels_[unit] (the panels it had when `old` is given: views without data take old's),
  // keeps the small tensors its views still point at and drops every other byte read for it.
  void build_globals(ModelWeights& w);
  LayerWeights build_layer(int layer);
  void build_deltanet(int layer, LayerWeights& L);
  TensorView gathered_rows(const TensorView& src, const std::string& what,
                           const std::vector<std::pair<int64_t, int64_t>>& runs);
  struct UnitViews {
    std::vector<TensorView*> matrices, small;  // packed panels; read as stored
  };
  void settle(int unit, const UnitViews& now, const UnitViews* old);
  UnitViews unit_views(int unit);
  // Per-expert [out, in] views of a layer's fused expert tensors (LayerTensorNames::fused_experts),
  // copied into derived_ in the source dtype.
  std::vector<ExpertWeights> split_fused_experts(int layer);
  std::vector<ExpertWeights> split_mxfp4_experts(int layer);  // without the biases
  const TensorView& fp8_weight(const TensorView& stored);
  TensorView decoded_bf16(const TensorView& fp8);
  void check_quantized_values(const TensorView& t) const;
  TensorView derived_copy(const TensorView& src, const std::string& what,
                          std::vector<int64_t> shape, int64_t base, int64_t row_stride,
                          int64_t col_stride);
  // A buffer of `bytes` in the unit being built's derived_ list.
  uint8_t* derived_buffer(size_t bytes);
  uint8_t* staging(size_t bytes);  // bytes of the staging area, until the unit is settled

  std::string dir_;
  bool partial_ = false;  // opened without some experts
  bool refuse_non_finite_ = false;
  // The files are too big to stay in the page cache beside the weights (load_weights): each
  // tensor's cached file pages are given back once it is packed.
  bool drop_read_pages_ = false;
  bool updated_in_memory_ = false;  // from_memory, or an apply_update since the files were read
  bool released_ = false;
  std::vector<std::vector<bool>> held_;  // [decoder layer][E]: empty (a dense layer, or all held)
  bool holds(int layer, int64_t expert) const {
    return held_.empty() || held_[size_t(layer)].empty() || held_[size_t(layer)][size_t(expert)];
  }
  SafetensorsFile::UnreadParts unread_parts() const;  // what held_ leaves on disk
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView*> index_;
  std::map<std::string, SafetensorsFile*> file_of_;  // a stored tensor's file (read on demand)
  std::set<std::string> used_;                       // names load_weights read
  std::vector<TensorView*> read_;  // stored tensors whose bytes the unit being built read
  std::map<std::string, TensorView>
      widened_;  // F16 tensors converted to F32; FP8 with their scales
  std::vector<std::vector<float>> owned_;
  int unit_ = 0;  // the unit being built
  LoadFigures load_figures_;
  std::vector<std::vector<std::vector<uint8_t>>> derived_;  // [unit]: split and decoded copies
  // A kept tensor's bytes: copied out of the staging area (small tensors), sent whole by an
  // update, or the staging chunk a large tensor was read into alone (adopted, not copied).
  struct KeptBytes {
    std::vector<uint8_t> vec;
    std::unique_ptr<BigArray<uint8_t>> chunk;
    size_t chunk_bytes = 0;
    uint8_t* data() { return chunk ? chunk->get() : vec.data(); }
    const uint8_t* data() const { return chunk ? chunk->get() : vec.data(); }
    size_t size() const { return chunk ? chunk_bytes : vec.size(); }
    bool empty() const { return !chunk && vec.empty(); }
  };
  std::vector<KeptBytes> kept_;
  std::vector<std::unique_ptr<BigArray<uint16_t>>> panels_;  // [unit]
  std::vector<size_t> panel_elements_;                       // [unit]
  struct Staging {  // reused for every unit: its pages are touched once
    std::vector<std::unique_ptr<BigArray<uint8_t>>> chunks;
    std::vector<size_t> sizes;
    size_t chunk = 0, used = 0;
    // The next `bytes` of s (align: a power of two up to 2 MiB), grown when full.
    static uint8_t* take(Staging& s, size_t bytes, size_t align = 64);
    // The chunk that begins at b and holds `bytes` and nothing else, taken out of s (for a
    // tensor kept as read); null when there is none.
    static std::unique_ptr<BigArray<uint8_t>> adopt(Staging& s, const uint8_t* b, size_t bytes);
  } staging_;
  // Stored tensors load_weights' reader thread has read for the unit being built, and where in
  // staging_ they are: materialize takes them from here.
  std::map<std::string, uint8_t*> read_ahead_;
  ThreadPool* pool_ = nullptr;  // during a load: open's or apply_update's pool
  // During apply_update: the sent tensors, whose bytes a kept tensor adopts instead of copying.
  std::vector<TensorToWrite>* sent_ = nullptr;
  std::vector<TensorToWrite> memory_;  // from_memory: the tensors' bytes (dropped once packed)
  std::vector<TensorView> memory_views_;
  std::set<const void*>
      transient_;  // bytes in memory that are dropped once packed (from_memory, sent)
  ModelWeights weights_;
};

// Hugging Face tensor names of one layer (model/tensor_names.h holds the tables).
std::string layer_prefix(int layer);
std::string embed_name(const ModelConfig& c);  // tensor_prefix + "embed_tokens.weight"
// Stored tensors the loader recognises and leaves unused: rotary inv_freq buffers, MTP layers, a
// vision-language release's vision tower.
bool unused_by_design(const ModelConfig& c, const std::string& name);
std::string router_name(const ModelConfig& c, int layer);
std::string expert_name(const ModelConfig& c, int layer, int expert,
                        const char* which);  // gate|up|down
std::string dense_name(const ModelConfig& c, int layer, const char* which);
std::string shared_expert_name(const ModelConfig& c, int layer, const char* which);  // gate|up|down
std::string shared_gate_name(const ModelConfig& c, int layer);
std::string router_bias_name(const ModelConfig& c, int layer);
// Stored tensors r3 has no use for and may ignore (RoPE inv_freq buffers of old exports).
bool knowingly_unused(const std::string& name);

}  // namespace r3
