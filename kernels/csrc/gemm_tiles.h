// Helpers shared by the weight-only GEMMs with zero points (int4_gemm_cpu.cpp, grouped_int8_gemm_cpu.cpp):
// the per-group sums of x the zero points multiply, how many 16-channel blocks one work item takes, and the
// per-group scales and zero points in float32 or float16.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

namespace kubellm_cpu {
namespace tiles {

// out[m * groups + g] = float32 sum of x[m, g * group .. (g + 1) * group) (x bfloat16 with row stride ldx).
// Vectorised: at batch 1 this runs once per GEMM call and a scalar loop with a division per element cost as
// much as a small layer's whole GEMM.
inline void bf16_group_sums(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t group, float* out) {
  const int64_t groups = K / group;
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = reinterpret_cast<const uint16_t*>(x + m * ldx);
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* src = row + g * group;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) {
        const __mmask16 mask = group - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (group - k)) - 1);
        const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src + k));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
      }
      out[m * groups + g] = _mm512_reduce_add_ps(acc);
#else
      float s = 0.f;
      for (int64_t k = 0; k < group; ++k) s += static_cast<float>(c10::BFloat16(src[k], c10::BFloat16::from_bits()));
      out[m * groups + g] = s;
#endif
    }
  }
}

// Per-group scales or zero points, [K/group][N] float32 or float16. float16 holds GGUF's d and AWQ/GPTQ's
// scales and integer zero points exactly at half the bytes (the loader narrows only what stays exact); they are
// widened 16 channels at a time, once per group and block, outside the inner loop.
struct GroupParams {
  const void* data = nullptr;
  bool half = false;

  GroupParams offset(int64_t i) const {
    return {data ? static_cast<const char*>(data) + i * (half ? 2 : 4) : nullptr, half};
  }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  __m512 load16(int64_t i, __mmask16 mask = __mmask16(0xFFFF)) const {
    if (half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(data) + i));
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(data) + i);
  }
#endif
};

// `t` as GroupParams after checking it is a contiguous [groups, N] float32 or float16 tensor.
inline GroupParams group_params(const at::Tensor& t, const char* what, int64_t groups, int64_t N) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == groups && t.size(1) == N && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
              what, " must be contiguous [K/group, N] = [", groups, ", ", N, "] float32 or float16, got ", t.sizes(),
              " ", t.scalar_type());
  return {t.const_data_ptr(), t.scalar_type() == at::kHalf};
}

// Blocks of 16 channels per work item, from 1..max_nb: the fewest blocks on the busiest thread (work items are
// split evenly over the threads), the most blocks per item among equals (more independent dot-product chains).
// E.g. 12 blocks on 2 threads: 3 per item (2 items each) rather than 4 (one thread takes 8 blocks).
inline int blocks_per_item(int64_t nblk, int max_nb) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int best = 1;
  int64_t best_load = std::numeric_limits<int64_t>::max();
  for (int nb = max_nb; nb >= 1; --nb) {
    const int64_t items = (nblk + nb - 1) / nb;
    const int64_t load = (items + threads - 1) / threads * nb;
    if (load < best_load) best = nb, best_load = load;
  }
  return best;
}

}  // namespace tiles
}  // namespace kubellm_cpu
