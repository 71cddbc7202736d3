// The native bf16 linear (bf16_gemm_cpu.cpp) as work items of 16-channel blocks, so that two callers share one
// kernel: its op runs the items over at::parallel_for, the fused decode layer (decode_layer_cpu.cpp) has the
// threads of its one parallel region claim them (shared_items.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace kubellm_cpu {

struct Bf16LinearItems {
  at::Tensor x;  // the input as the kernel reads it (a zero-padded copy when K or the row stride is odd)
  at::Tensor y;  // [M, N] bfloat16, written by run()
  const void* weight = nullptr;  // the packed [NBLK][K2][16][2] weight
  const float* bias = nullptr;
  int64_t M = 0, N = 0, NBLK = 0, K2 = 0;
  int nb = 1;  // blocks of 16 channels per item
  int64_t items = 0;

  void run(int64_t begin, int64_t end) const;  // items [begin, end), from any thread
};

// Checks the arguments as the op does and allocates y; nothing is computed yet.
Bf16LinearItems bf16_linear_items(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                  const c10::optional<at::Tensor>& bias);

}  // namespace kubellm_cpu
