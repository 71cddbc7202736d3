// The few-rows tile of the grouped 8-bit GEMM (layout and math: grouped_int8_gemm_cpu.cpp), shared by that GEMM
// and by the 8-bit experts of moe_cpu.cpp, which run it over each expert's rows and keep the float32 results.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemm_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KUBELLM_INT8_TILES 1

namespace kubellm_cpu {
namespace int8 {

// out[r][b] = sum over groups g of s * (x_r . q_b over g - z * sum(x_r over g)) (no z without ZP) for MR rows of
// x (bf16 pairs, x_pair_stride int32 apart; xsum[r * groups + g] their group sums, read only with ZP) and NB
// 16-channel weight blocks ([K/2][16][2] int8 each, w_block_stride bytes apart). Block b's scales and zero points
// of group g are 16 values at g * param_row + b * param_block_stride (the GEMM's blocks are adjacent: stride 16;
// a MoE expert's gate and up blocks are I channels apart); `tail` masks the last block's channels that exist.
// Each int8 widens to bf16 in registers (exact), vdpbf16ps sums in float32, the group's epilogue scales once.
// (Inlined by force so the accumulators stay in registers in the caller's tile loop.)
template <int MR, int NB, bool ZP>
__attribute__((always_inline)) inline void dot_groups(const int32_t* x_pairs, int64_t x_pair_stride,
                                                      const float* xsum, int64_t groups, const int8_t* w,
                                                      int64_t w_block_stride, int64_t K2, int64_t group_pairs,
                                                      tiles::GroupParams scales, tiles::GroupParams zeros,
                                                      int64_t param_row, int64_t param_block_stride, __mmask16 tail,
                                                      __m512 (&out)[MR][NB]) {
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0, kp0 = 0; kp0 < K2; ++g, kp0 += group_pairs) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    const int64_t kp1 = std::min(K2, kp0 + group_pairs);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = tiles::widen_int8_pairs(w + b * w_block_stride + kp * 32);
      for (int r = 0; r < MR; ++r) {
        const __m512i xb = _mm512_set1_epi32(x_pairs[r * x_pair_stride + kp]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __mmask16 mask = b == NB - 1 ? tail : __mmask16(0xFFFF);
      const int64_t at = g * param_row + b * param_block_stride;
      const __m512 s = scales.load16(at, mask);
      if constexpr (ZP) {  // out += s * (acc - z * sum(x over the group))
        const __m512 z = zeros.load16(at, mask);
        for (int r = 0; r < MR; ++r)
          out[r][b] = _mm512_fmadd_ps(_mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), acc[r][b]), s,
                                      out[r][b]);
      } else {
        for (int r = 0; r < MR; ++r) out[r][b] = _mm512_fmadd_ps(acc[r][b], s, out[r][b]);
      }
    }
  }
}

}  // namespace int8
}  // namespace kubellm_cpu
#endif
