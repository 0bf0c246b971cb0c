// The bf16 peak the benchmarks compare against (kernels/machine_limits.h): the faster of the two
// instructions the bf16 tiles may run, named with the figure it replaced.
#include <gtest/gtest.h>

#include "kernels/machine_limits.h"

namespace r3 {
namespace {

using kernels::MachineLimits;
using kernels::take_faster_bf16_peak;

MachineLimits measured(double dp, double fma) {
  MachineLimits m;
  m.peak_gflops = dp;
  m.peak_instruction = "vdpbf16ps zmm (AVX512-BF16)";
  m.fma_peak_gflops = fma;
  return m;
}

TEST(MachineLimits, FmaPeakReplacesAHalfRateDotProduct) {
  MachineLimits m = measured(246, 475);  // Sapphire Rapids: vdpbf16ps on one port
  take_faster_bf16_peak(m);
  EXPECT_DOUBLE_EQ(m.peak_gflops, 475);
  EXPECT_NE(m.peak_instruction.find("vfmadd231ps"), std::string::npos) << m.peak_instruction;
  EXPECT_NE(m.peak_instruction.find("vdpbf16ps zmm (AVX512-BF16): 246 GFLOP/s"), std::string::npos)
      << m.peak_instruction;
  EXPECT_DOUBLE_EQ(m.fma_peak_gflops, 475);
}

TEST(MachineLimits, FullRateDotProductStaysThePeak) {
  MachineLimits m = measured(900, 475);  // Zen 4/5: vdpbf16ps at the FMA rate, twice the work
  take_faster_bf16_peak(m);
  EXPECT_DOUBLE_EQ(m.peak_gflops, 900);
  EXPECT_EQ(m.peak_instruction, "vdpbf16ps zmm (AVX512-BF16)");
  MachineLimits no_bf16 = measured(475, 475);  // no AVX512-BF16: both loops ran fma
  take_faster_bf16_peak(no_bf16);
  EXPECT_EQ(no_bf16.peak_instruction, "vdpbf16ps zmm (AVX512-BF16)");
}

}  // namespace
}  // namespace r3
