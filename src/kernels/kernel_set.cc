// This instruction set's table (compiled once per set, R3_ISA_NS naming it; see isa.h).
#include "kernels/kernel_set.h"

#include "kernels/isa_entry_points.h"

namespace r3::kernels {

const KernelSet& R3_ISA_CAT(kernel_set_, R3_ISA_NS)() {
  namespace isa = R3_ISA_NS;
  static const KernelSet set{
      .name = R3_ISA_NAME,
      .matmul_rows = &isa::matmul_rows,
      .pack_panels = &isa::pack_panels,
      .attend_f32 = &isa::attend<float>,
      .attend_bf16 = &isa::attend<uint16_t>,
      .attend_group_f32 = &isa::attend_group<float>,
      .attend_group_bf16 = &isa::attend_group<uint16_t>,
      .attend_heads_f32 = &isa::attend_heads<float>,
      .attend_heads_bf16 = &isa::attend_heads<uint16_t>,
      .attend_latent_heads_f32 = &isa::attend_latent_heads<float>,
      .attend_latent_heads_bf16 = &isa::attend_latent_heads<uint16_t>,
      .rms_norm = &isa::rms_norm,
      .add_bias = &isa::add_bias,
      .silu_mul = &isa::silu_mul,
      .clamped_swiglu = &isa::clamped_swiglu,
      .round_to_bf16 = &isa::round_to_bf16,
      .softmax = &isa::softmax,
      .sum_f64 = &isa::sum_f64,
      .measure_read_bandwidth = &isa::measure_read_bandwidth,
      .measure_peak_gflops = &isa::measure_peak_gflops,
      .measure_fma_peak_gflops = &isa::measure_fma_peak_gflops,
  };
  return set;
}

}  // namespace r3::kernels
