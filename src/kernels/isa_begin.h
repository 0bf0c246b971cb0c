// Start of a kernel file's code for its instruction set (isa.h). Include after every standard
// and project header the file needs except vec16.h, dot.h and exp.h, which follow it; end the
// file with isa_end.h.
// GCC 12 reports the _mm512_undefined_* inside its own AVX-512 headers as uninitialised (GCC bug
// 105593); the reports point into the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "kernels/isa.h"

#define R3_ISA_STR2(...) #__VA_ARGS__
#define R3_ISA_STR(...) R3_ISA_STR2(__VA_ARGS__)

#pragma GCC push_options
#ifdef R3_ISA_TARGET
_Pragma(R3_ISA_STR(GCC target(R3_ISA_STR(R3_ISA_TARGET))))
#endif
