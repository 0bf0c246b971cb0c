// Attention of one query head over a paged latent cache (multi-head latent attention, absorbed
// form): key j is the whole cached row j (the latent, then the rotary key part), value j is its
// first `value_width` elements. Reduced in absolute position order exactly as attend() is
// (attention.h): scores by fma over the row in order, times scale; weights exp_nonpositive(score
// - max) summed in key order; out[d] by fma of weight and value in key order, then times 1/sum.
// So a token's result does not depend on chunking, caching or batching.
#pragma once
#include <cstdint>

namespace r3::kernels {

template <typename KvT>
struct PagedLatent {
  const KvT* base;  // this layer's cache: [block][slot][width]
  const int* block_table;
  int block_size;
  int width;        // elements per cached row
};

// q: [width] (absorbed query, then its rotary part). scores: scratch of at least pos + 1.
// out: [value_width].
template <typename KvT>
void attend_latent(const float* q, int value_width, int pos, float scale, const PagedLatent<KvT>& cache,
                   float* scores, float* out);

}  // namespace r3::kernels
