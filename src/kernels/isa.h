// The instruction set a kernel translation unit is compiled for. The kernels (matmul tiles,
// attention, per-token ops, machine limits) are compiled once per instruction set and chosen at
// run time (kernel_set.h), so one build runs on any x86-64 at the speed its CPU allows.
//
// - Names. Everything the kernels define, and the inline helpers of vec16.h, dot.h and exp.h,
//   sits in the inline namespace r3::kernels::R3_ISA_NS (portable, avx2, avx512, avx512bf16):
//   each set's copy is a different symbol, so code compiled for one never links against
//   another's. Translation units outside the kernels see namespace `base`.
// - Instructions. A kernel file includes every standard header it needs, then isa_begin.h, which
//   switches code generation to the set with `#pragma GCC target` (not -m flags): the standard
//   library's templates and inline functions are then compiled for the baseline wherever they
//   are instantiated, so the linker cannot keep an AVX-512 copy of, say, a std::vector member
//   for callers on a CPU without it. isa_end.h switches back.
// - Paths. Code chooses its path with R3_ISA_AVX2 / R3_ISA_AVX512 / R3_ISA_AVX512BF16 (0 or 1;
//   each implies the ones before it; R3_ISA_AVX512BF16 also means AVX512-VBMI), since the
//   compiler's own __AVX2__-style macros do not follow the pragma in C++. Outside the kernels
//   they follow the build's flags.
#pragma once

#ifndef R3_ISA_NS
#define R3_ISA_NS base
#if defined(__AVX2__) && defined(__FMA__)
#define R3_ISA_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && R3_ISA_AVX2
#define R3_ISA_AVX512 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && R3_ISA_AVX512
#define R3_ISA_AVX512BF16 1
#endif
#endif

#ifndef R3_ISA_AVX2
#define R3_ISA_AVX2 0
#endif
#ifndef R3_ISA_AVX512
#define R3_ISA_AVX512 0
#endif
#ifndef R3_ISA_AVX512BF16
#define R3_ISA_AVX512BF16 0
#endif

#define R3_ISA_CAT2(a, b) a##b
#define R3_ISA_CAT(a, b) R3_ISA_CAT2(a, b)
