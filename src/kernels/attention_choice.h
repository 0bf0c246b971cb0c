// Which of two same-bits decode attention loops the engine runs for a step of single tokens:
// attend_heads (a token's heads in one walk over its blocks, each block's heads one contiguous
// run) or attend once per head (each head's keys and values alone). Both give attend()'s bits for
// every head (kernels/attention.h), so only the speed differs, and that depends on the CPU's
// memory-level parallelism: timed on the machine on a cache larger than the last-level cache,
// once per CPU model, and cached (kernels/machine_cache.h).
#pragma once
#include <string>

namespace r3::kernels {

enum class DecodeAttention { Heads, PerHead };
const char* decode_attention_name(DecodeAttention a);  // "heads" or "per_head"

// The loop the engine runs now (Heads until a choice is made).
DecodeAttention decode_attention();
void set_decode_attention(DecodeAttention a);

struct AttentionChoice {
  DecodeAttention loop = DecodeAttention::Heads;
  // "R3_ATTENTION", "cached for <cpu>" or "timed on <cpu>".
  std::string source;
  double heads_gb_per_s = 0, per_head_gb_per_s = 0;  // KV bytes read per second, when timed
};

// R3_ATTENTION=heads|per_head if set (anything else is an r3::Error), else the entry for this CPU
// model in cache_file, else both loops timed on every hardware thread, as a decode step runs
// them, over a bf16 cache of twice the last-level cache (at least 64 MiB, at most 2 GiB; a
// second or so) and the winner cached. per_head must win by 5% to be chosen: on a tie the
// timing's noise would pick at random. Applies the choice and returns it.
AttentionChoice choose_decode_attention(const std::string& cache_file, const char* forced);
// The same, once per process, with machine_cache_file("decode_attention") and R3_ATTENTION.
const AttentionChoice& tuned_decode_attention();

}  // namespace r3::kernels
