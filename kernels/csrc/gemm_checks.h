// The entry checks of the native GEMMs (int8, int4, fp8, grouped 8-bit, bf16): one definition of each check, so
// every GEMM refuses the same fault with the same words (tests/kernels pins them). Compiled on every build: the
// checks use no vector instructions, and the entries run them before choosing an AVX-512 or AVX2 path.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace kubellm_cpu {
namespace gemm_checks {

// x is [M, K] bfloat16 (or float32 where the build takes it), rows contiguous.
inline void check_x(const at::Tensor& x, bool takes_float32) {
  const bool dtype_ok = x.scalar_type() == at::kBFloat16 || (takes_float32 && x.scalar_type() == at::kFloat);
  TORCH_CHECK(x.dim() == 2 && dtype_ok && x.stride(1) == 1,
              takes_float32 ? "x must be [M, K] bfloat16 or float32, rows contiguous"
                            : "x must be [M, K] bfloat16, rows contiguous");
}

// x's K matches the packed weight's, and its row stride is even: the bf16 kernels read x as int32 pairs.
inline void check_columns(const at::Tensor& x, int64_t weight_columns) {
  TORCH_CHECK(x.size(1) == weight_columns, "x has ", x.size(1), " columns, the weight ", weight_columns);
  TORCH_CHECK(x.stride(0) % 2 == 0, "x's row stride must be even (bf16 pairs)");
}

// packed is a contiguous [blocks of 16 channels, K steps, tail...] tensor of `dtype`; `layout` is the message that
// names the whole layout and the pack function that makes it.
inline void check_packed(const at::Tensor& packed, at::ScalarType dtype, c10::IntArrayRef tail, const char* layout) {
  TORCH_CHECK(packed.dim() == 2 + static_cast<int64_t>(tail.size()) && packed.scalar_type() == dtype &&
                  packed.is_contiguous() && packed.sizes().slice(2).equals(tail),
              layout);
}

// group_size is a positive multiple of `step` (the inputs one packed K step holds), so no step straddles two
// groups; with `whole_groups` it also divides K (a kernel without a ragged last group).
inline void check_group_size(int64_t group_size, int64_t step, int64_t K, bool whole_groups) {
  const bool steps_ok = group_size >= step && group_size % step == 0;
  if (whole_groups) {
    TORCH_CHECK(steps_ok && K % group_size == 0, "group_size (", group_size, ") must be a multiple of ", step,
                " and divide K (", K, ")");
  } else {
    TORCH_CHECK(steps_ok, "group_size (", group_size, ") must be a multiple of ", step);
  }
}

// N from per-group scales [groups, N] (`shape` names it in the message), which must fill the packed weight's
// blocks of 16 channels; tiles::group_params then checks the rest.
inline int64_t scale_channels(const at::Tensor& scales, int64_t blocks, const char* shape) {
  TORCH_CHECK(scales.dim() == 2, "scales must be ", shape);
  const int64_t N = scales.size(1);
  TORCH_CHECK((N + 15) / 16 == blocks, "scales have ", N, " channels, the packed weight ", blocks, " blocks of 16");
  return N;
}

// A per-channel [N] float32 vector (per-channel scales, a bias).
inline const float* channel_vector(const at::Tensor& t, int64_t N, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be [N] float32");
  return t.const_data_ptr<float>();
}

// The bias's data, or nullptr without one.
inline const float* optional_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  return bias.has_value() && bias->defined() ? channel_vector(*bias, N, "bias") : nullptr;
}

}  // namespace gemm_checks
}  // namespace kubellm_cpu
