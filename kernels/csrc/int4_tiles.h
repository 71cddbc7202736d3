// The few-rows tile of the weight-only int4 GEMM (layout and math: int4_gemm_cpu.cpp), shared by that GEMM and
// by the 4-bit experts of moe_cpu.cpp, which run it over each expert's rows and keep the float32 results.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemm_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KUBELLM_INT4_TILES 1

namespace kubellm_cpu {
namespace int4 {

// out[r][b] = sum over groups g of s * (x_r . q_b over g - z * sum(x_r over g)) for MR rows of x (bf16 pairs,
// x_pair_stride int32 apart; xsum[r * groups + g] their group sums) and NB 16-channel weight blocks
// (w_block_stride bytes apart). Block b's scales and zero points of group g are 16 values at
// g * param_row + b * param_block_stride (the GEMM's [K/group][N]: N and 16; the MoE kernel's per-block layout:
// 16 and a block's groups).
// Nibbles widen to bf16 in registers: a nibble v OR'd into the bits 0x4300 is the bf16 of 128 + v (exact), so
// the products sum x * (q + 128) and the group's epilogue subtracts (z + 128) * sum(x).
// At 1-2 rows the two products of a quad go to two accumulator sets, so the additions into one do not wait on
// each other (as the bf16 kernel's stream does): 6-10% at one row on cache-resident layers (benchmarks/results/).
// prefetch_bytes > 0: from 2 rows, every quad prefetches that far ahead in each block's stream (the GEMM passes
// its item's size: the same quad of the next item, whose blocks follow). With weights coming from memory, 2 rows
// went 1.2-1.6x -> 1.5-2.1x bf16 and 4 rows 0.9-1.2x -> 1.2-1.7x (benchmarks/results/); at one row prefetching
// (1.5 KB or one item ahead) was slower than the hardware's alone, so one row does not.
// (Inlined by force so the accumulators stay in registers in the caller's tile loop.)
template <int MR, int NB>
__attribute__((always_inline)) inline void dot_groups(const int32_t* x_pairs, int64_t x_pair_stride,
                                                      const float* xsum, int64_t groups, const uint8_t* w,
                                                      int64_t w_block_stride, int64_t K4, int64_t group_quads,
                                                      tiles::GroupParams scales, tiles::GroupParams zeros,
                                                      int64_t param_row, int64_t param_block_stride,
                                                      __m512 (&out)[MR][NB], int64_t prefetch_bytes = 0) {
  const __m512i nibble = _mm512_set1_epi32(0x000F000F);
  const __m512i magic = _mm512_set1_epi32(0x43004300);  // bf16 128.0 in both halves
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0, kq0 = 0; kq0 < K4; ++g, kq0 += group_quads) {
    constexpr int KC = MR <= 2 ? 2 : 1;  // accumulator sets
    __m512 acc[KC][MR][NB];
    for (int c = 0; c < KC; ++c)
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b) acc[c][r][b] = _mm512_setzero_ps();
    const int64_t kq1 = std::min(K4, kq0 + group_quads);
    for (int64_t kq = kq0; kq < kq1; ++kq) {
      __m512i lo[NB], hi[NB];
      if (MR >= 2 && prefetch_bytes > 0)
        for (int b = 0; b < NB; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(w + b * w_block_stride + kq * 32) + prefetch_bytes, _MM_HINT_T0);
      for (int b = 0; b < NB; ++b) {
        const __m512i words =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * w_block_stride + kq * 32)));
        lo[b] = _mm512_ternarylogic_epi32(words, nibble, magic, 0xEA);  // (words & nibble) | magic
        hi[b] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, magic, 0xEA);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i x0 = _mm512_set1_epi32(x_pairs[r * x_pair_stride + 2 * kq]);
        const __m512i x1 = _mm512_set1_epi32(x_pairs[r * x_pair_stride + 2 * kq + 1]);
        for (int b = 0; b < NB; ++b) {
          acc[0][r][b] = _mm512_dpbf16_ps(acc[0][r][b], (__m512bh)x0, (__m512bh)lo[b]);
          acc[KC - 1][r][b] = _mm512_dpbf16_ps(acc[KC - 1][r][b], (__m512bh)x1, (__m512bh)hi[b]);
        }
      }
    }
    if constexpr (KC == 2)
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b) acc[0][r][b] = _mm512_add_ps(acc[0][r][b], acc[1][r][b]);
    // out += s * (acc - (z + 128) * sum(x over the group))
    for (int b = 0; b < NB; ++b) {
      const int64_t at = g * param_row + b * param_block_stride;
      const __m512 s = scales.load16(at);
      const __m512 z = _mm512_add_ps(zeros.load16(at), _mm512_set1_ps(128.f));
      for (int r = 0; r < MR; ++r) {
        const __m512 centred = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), acc[0][r][b]);
        out[r][b] = _mm512_fmadd_ps(centred, s, out[r][b]);
      }
    }
  }
}

}  // namespace int4
}  // namespace kubellm_cpu
#endif
