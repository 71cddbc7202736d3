// Helpers shared by the CPU GEMMs: the bf16 register tile of vdpbf16ps on weights in its operand layout
// (bf16_gemm_cpu.cpp, int4_gemm_cpu.cpp; int8/fp8 kernels widen into the same layout), how many 16-channel
// blocks one work item takes; for the weight-only GEMMs with zero points (int4, grouped int8) the per-group sums
// of x the zero points multiply and the per-group scales and zero points in float32 or float16.
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

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KUBELLM_BF16_TILE 1
// The vdpbf16ps operand layout: per block of 16 output channels and pair of inputs (k, k+1), one 64-byte line
// holding the 16 channels' (w[n, k], w[n, k+1]) bf16 pairs. A tile reads the line of block b and pair kp at
// w + b * block_stride + kp * pair_stride (in lines): [N/16][K/2][16][2] is (K/2, 1) (a packed bf16 weight),
// a per-item scratch [K/2][NB][16][2] is (1, NB) (int4's dequantized blocks).

// y[r, b * 16 + i] = bf16(acc[r][b] + bias) for the `valid` first channels (a partial last block is masked).
template <int MR, int NB>
__attribute__((always_inline)) inline void store_tile(__m512 (&acc)[MR][NB], const float* bias, c10::BFloat16* y,
                                                      int64_t ldy, int64_t valid = NB * 16) {
  for (int b = 0; b < NB; ++b) {
    const int64_t left = valid - b * 16;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy + b * 16, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bi)));
  }
}

// acc[r][b] (zeroed here) = sum over the K2 input pairs of row r's pair . block b's line. x_pairs: each row's
// (x[k], x[k+1]) bf16 pairs as int32, rows x_pair_stride apart. Per pair, NB line loads and MR broadcasts feed
// MR x NB vdpbf16ps (MR x NB <= 24 keeps the accumulators, the NB lines and a broadcast in the 32 registers).
// side(kp) runs after each pair: work interleaved with the products (int4's next dequantization), or nothing.
template <int MR, int NB, typename Side>
__attribute__((always_inline)) inline void bf16_tile(__m512 (&acc)[MR][NB], const int32_t* x_pairs,
                                                     int64_t x_pair_stride, const __m512i* w, int64_t block_stride,
                                                     int64_t pair_stride, int64_t K2, Side&& side) {
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + b * block_stride + kp * pair_stride);
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(x_pairs[r * x_pair_stride + kp]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
    }
    side(kp);
  }
}
#endif

}  // namespace tiles
}  // namespace kubellm_cpu
