// Attention of query heads over a paged latent cache (multi-head latent attention, absorbed
// form): key j is the whole cached row j (the latent, then the rotary key part), value j is its
// first `value_width` elements. Reduced in absolute position order exactly as attend() is
// (attention.h): scores by fma over the row in order, times scale; weights exp_nonpositive(score
// - max) summed in key order; out[d] by fma of weight and value in key order, then times 1/sum.
// So a token's result does not depend on chunking, caching or batching.
#pragma once
#include <cstddef>
#include <cstdint>

namespace r3::kernels {

template <typename KvT>
struct PagedLatent {
  const KvT* base;  // this layer's cache: [block][slot][width]
  const int* block_table;
  int block_size;
  int width;  // elements per cached row
};

// Heads per attend_latent_heads call: one lane each of a 16-lane vector.
inline constexpr int kLatentHeads = 16;

// Query heads [h0, h1) of one token at pos (h1 - h0 <= kLatentHeads), each head's output
// computed as above, bit for bit whatever heads share the call. Every head reads the same rows,
// so the vector path keeps the heads in lanes: each cached element is loaded (and widened) once
// for all of them, and each (head, key) score is its own fma chain. q: [heads][width] of the
// token by absolute head (the absorbed query, then its rotary part); out: head h's [value_width]
// at out + h * out_stride. scores: (h1 - h0) rows of score_stride floats (>= pos + 1).
template <typename KvT>
void attend_latent_heads(const float* q, int h0, int h1, int value_width, int pos, float scale,
                         const PagedLatent<KvT>& cache, float* scores, int score_stride, float* out,
                         size_t out_stride);

}  // namespace r3::kernels
