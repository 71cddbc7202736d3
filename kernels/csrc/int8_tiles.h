// The few-rows tile of the grouped 8-bit GEMM (layout and math: grouped_int8_gemm_cpu.cpp), shared by that GEMM
// and by the 8-bit experts of moe_cpu.cpp, which run it over each expert's rows and keep the float32 results.
#pragma once

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>

#include "gemm_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KUBELLM_INT8_TILES 1

namespace kubellm_cpu {
namespace int8 {

// How a line of 32 int8 weights becomes 16 lanes of bf16 pairs (byte i -> bf16 element i, as vdpbf16ps reads them).
// Any int8: widened through float32 (five instructions).
struct WidenAny {
  __attribute__((always_inline)) __m512i operator()(const int8_t* src) const { return tiles::widen_int8_pairs(src); }
};

// Values that span at most 64 (GGUF Q6_K's -32..31, Q5_K's 0..31): two instructions. Each int8, sign-extended to
// 16 bits, indexes a table of 64 bf16 by its low 6 bits (vpermi2w), which tell apart any 64 consecutive values:
// entry i holds the value v in [low, low + 63] with v = i modulo 64. At one row the tile is bound by its
// instructions rather than by reading the weights: the Q6_K-shaped experts went 1.05-1.08x -> 1.17-1.24x bf16
// with it (benchmarks/results/).
struct WidenTable {
  __m512i lo, hi;  // entries 0..31, 32..63

  explicit WidenTable(int low) {
    alignas(64) uint16_t entries[64];
    for (int i = 0; i < 64; ++i) {
      const int v = low + (((i - low) % 64) + 64) % 64;
      entries[i] = c10::BFloat16(static_cast<float>(v)).x;  // exact: |v| <= 128
    }
    lo = _mm512_load_si512(entries);
    hi = _mm512_load_si512(entries + 32);
  }
  __attribute__((always_inline)) __m512i operator()(const int8_t* src) const {
    const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    return _mm512_permutex2var_epi16(lo, words, hi);
  }
};

// tiles::GroupParams::load16, inlined by force: GCC keeps load16 out of line in the MoE kernel's large tile
// functions, and each call (two per block and group with zero points) then spills and reloads every live zmm
// register (all are caller-saved), the float32 accumulators included: Q5_K experts ran ~20% slower than Q6_K's
// for it (benchmarks/results/).
__attribute__((always_inline)) inline __m512 load_params16(const tiles::GroupParams& p, int64_t i, __mmask16 mask) {
  if (p.half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p.data) + i));
  return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p.data) + i);
}

// out[r][b] = sum over groups g of s * (x_r . q_b over g - z * sum(x_r over g)) (no z without ZP) for MR rows of
// x (bf16 pairs, x_pair_stride int32 apart; xsum[r * groups + g] their group sums, read only with ZP) and NB
// 16-channel weight blocks ([K/2][16][2] int8 each, w_block_stride bytes apart). Block b's scales and zero points
// of group g are 16 values at g * param_row + b * param_block_stride (the GEMM's [K/group][N]: N and 16; the MoE
// kernel's per-block layout: 16 and a block's groups); `tail` masks the last block's channels that exist.
// Each int8 widens to bf16 in registers (exact; `widen`), vdpbf16ps sums in float32, the group's epilogue scales
// once. prefetch_bytes > 0: every other pair (a cache line of each block) prefetches that far ahead.
// (Inlined by force so the accumulators stay in registers in the caller's tile loop.)
template <int MR, int NB, bool ZP, class Widen = WidenAny>
__attribute__((always_inline)) inline void dot_groups(const int32_t* x_pairs, int64_t x_pair_stride,
                                                      const float* xsum, int64_t groups, const int8_t* w,
                                                      int64_t w_block_stride, int64_t K2, int64_t group_pairs,
                                                      tiles::GroupParams scales, tiles::GroupParams zeros,
                                                      int64_t param_row, int64_t param_block_stride, __mmask16 tail,
                                                      __m512 (&out)[MR][NB], const Widen& widen = Widen{},
                                                      int64_t prefetch_bytes = 0) {
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0, kp0 = 0; kp0 < K2; ++g, kp0 += group_pairs) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    const int64_t kp1 = std::min(K2, kp0 + group_pairs);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      __m512i wv[NB];
      if (prefetch_bytes > 0 && (kp & 1) == 0)
        for (int b = 0; b < NB; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(w + b * w_block_stride + kp * 32) + prefetch_bytes, _MM_HINT_T0);
      for (int b = 0; b < NB; ++b) wv[b] = widen(w + b * w_block_stride + kp * 32);
      for (int r = 0; r < MR; ++r) {
        const __m512i xb = _mm512_set1_epi32(x_pairs[r * x_pair_stride + kp]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __mmask16 mask = b == NB - 1 ? tail : __mmask16(0xFFFF);
      const int64_t at = g * param_row + b * param_block_stride;
      const __m512 s = load_params16(scales, at, mask);
      if constexpr (ZP) {  // out += s * (acc - z * sum(x over the group))
        const __m512 z = load_params16(zeros, at, mask);
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
