// The AVX2 (x86-64-v3: AVX2, FMA, F16C) tiles of the quantized GEMMs, for builds without AVX512-BF16: the int4 GEMM
// with int8 activations (int4_gemm_cpu.cpp's layout and math, w4a8_tiles.h's integers and epilogue) and the
// grouped 8-bit GEMM (grouped_int8_gemm_cpu.cpp's layout and math). Both take float32 or bf16 activations and
// return the same dtype: an AVX2 engine runs float32 (--dtype auto), and bf16 is only the storage of x and y.
//
// w4a8: llama.cpp's Q4 x Q8 on AVX2. A quad's 32 packed bytes of one 16-channel block, 16 at a time zero-extended
// to words and OR'd with themselves shifted left by 4 under 0x0F0F (w4a8_tiles.h's widening), hold 8 channels'
// q[k], q[k+2], q[k+1], q[k+3] as the bytes of dword lane i: vpmaddubsw with a row's four int8 activations in that
// order (quantize_row) gives two words per channel, which are summed in int16 over up to 8 quads (|word| <= 2 x
// 15 x 127 per quad, 8 quads 30480 < 32767) before one vpmaddwd by ones widens the pair to the channel's int32
// dot product: per 64 weights and row 4 instructions, the widening's 8 shared by the rows. The group's integers
// are those of w4a8::dot_groups and reference_w4a8_gemm, and the epilogue is dot_groups' own operations in the
// same order, so the output has the AVX-512 kernel's bits.
//
// grouped 8-bit: each int8 weight widened to float32 (vpmovsxbd, vcvtdq2ps) and multiplied with x in float32 FMAs,
// sums per group scaled in the epilogue as the AVX-512 kernel does (int8_tiles.h); the products are exact for
// bf16 x (8 + 8 significant bits), float32-rounded for float32 x.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm_tiles.h"

// Builds with AVX512-BF16 run the AVX-512 kernels instead; every other x86-64-v3 or better build (x86-64-v4
// without BF16 included) runs these.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#include <immintrin.h>
#define KUBELLM_AVX2_TILES 1

namespace kubellm_cpu {
namespace avx2 {

// 8 per-group scales or zero points (tiles::GroupParams: float32 or float16) from index i.
__attribute__((always_inline)) inline __m256 load8(tiles::GroupParams p, int64_t i) {
  if (p.half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p.data) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(p.data) + i);
}

// 8 activations as float32 (float32 or bf16 storage).
__attribute__((always_inline)) inline __m256 load_x8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((always_inline)) inline __m256 load_x8(const c10::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
__attribute__((always_inline)) inline __m128 load_x4(const float* p) { return _mm_loadu_ps(p); }
__attribute__((always_inline)) inline __m128 load_x4(const c10::BFloat16* p) {
  const __m128i bits = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm_castsi128_ps(_mm_slli_epi32(bits, 16));
}

// Stores 8 float32 results as y's dtype: float32 as they are, bf16 rounded to nearest even (what
// vcvtneps2bf16 and c10::BFloat16 do; a NaN stays a NaN).
__attribute__((always_inline)) inline void store_y8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
__attribute__((always_inline)) inline void store_y8(c10::BFloat16* y, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40)), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
}

// One row of x (K values, float32 or bf16) quantized per group of `group` inputs (a multiple of 4), as
// w4a8::quantize_block's block_rows 1 lays it out: quad kq (the int8 of inputs 4kq, 4kq+2, 4kq+1, 4kq+3) at
// xq[kq], group g's scale max|x| / 127 at scale[g] and the sum of its int8 values at qsum[g];
// xq = round(x * (127 / max|x|)), half to even (vcvtps2dq under the default rounding mode); an all-zero group
// has scale 0 and values 0.
template <typename T>
inline void quantize_row(const T* x, int64_t K, int64_t group, int32_t* xq, float* scale, float* qsum) {
  const __m128i quad_order = _mm_setr_epi8(0, 8, 4, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    const T* src = x + g * group;
    __m256 amax8 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= group; k += 8) amax8 = _mm256_max_ps(amax8, _mm256_and_ps(load_x8(src + k), abs_mask));
    __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    if (k < group) amax4 = _mm_max_ps(amax4, _mm_and_ps(load_x4(src + k), _mm256_castps256_ps128(abs_mask)));
    amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
    amax4 = _mm_max_ss(amax4, _mm_shuffle_ps(amax4, amax4, 1));
    const float a = _mm_cvtss_f32(amax4);
    const __m128 inv = _mm_set1_ps(a > 0.f ? 127.f / a : 0.f);
    __m128i sum = _mm_setzero_si128();
    for (k = 0; k < group; k += 4) {
      const __m128i v = _mm_cvtps_epi32(_mm_mul_ps(load_x4(src + k), inv));  // |v| <= 127
      sum = _mm_add_epi32(sum, v);
      xq[(g * group + k) / 4] = _mm_cvtsi128_si32(_mm_shuffle_epi8(v, quad_order));
    }
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
    scale[g] = a / 127.f;
    qsum[g] = static_cast<float>(_mm_cvtsi128_si32(sum));
  }
}

// out[(r * NB + b) * 16 + i] (+)= w4a8::dot_groups' sums for MR plain rows (quantize_row's, x_stride int32 apart;
// scale and qsum `groups` apart) and NB 16-channel blocks (w_block_stride bytes apart), scales and zero points
// of group g and block b at g * param_row + b * 16. MR x NB <= 4: the int16 sums (two registers per row and
// block), NB widened halves and MR broadcasts stay in the 16 ymm registers.
template <int MR, int NB>
__attribute__((always_inline)) inline void w4a8_dot_groups(const int32_t* xq, int64_t x_stride, const float* scale,
                                                            const float* qsum, int64_t groups, const uint8_t* w,
                                                            int64_t w_block_stride, int64_t group_quads,
                                                            tiles::GroupParams scales, tiles::GroupParams zeros,
                                                            int64_t param_row, float* out) {
  static_assert(MR * NB <= 4, "int16 sums of a tile: 2 x MR x NB registers");
  constexpr int64_t kChunk = 8;  // quads summed in int16 before widening (8 x 3810 < 32767)
  const __m256i low_nibbles = _mm256_set1_epi16(0x0F0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < MR * NB * 2; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[MR][NB][2];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_si256();
    for (int64_t c0 = 0; c0 < group_quads; c0 += kChunk) {
      __m256i part[MR][NB][2];
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b) part[r][b][0] = part[r][b][1] = _mm256_setzero_si256();
      const int64_t c1 = std::min(group_quads, c0 + kChunk);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t kq = g * group_quads + c;
        __m256i xb[MR];
        for (int r = 0; r < MR; ++r) xb[r] = _mm256_set1_epi32(xq[r * x_stride + kq]);
        for (int b = 0; b < NB; ++b) {
          const uint8_t* wq = w + b * w_block_stride + kq * 32;
          for (int h = 0; h < 2; ++h) {
            const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16 * h)));
            const __m256i q = _mm256_and_si256(_mm256_or_si256(words, _mm256_slli_epi16(words, 4)), low_nibbles);
            for (int r = 0; r < MR; ++r)
              part[r][b][h] = _mm256_add_epi16(part[r][b][h], _mm256_maddubs_epi16(q, xb[r]));
          }
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h) acc[r][b][h] = _mm256_add_epi32(acc[r][b][h], _mm256_madd_epi16(part[r][b][h], ones));
    }
    // out += s * a * (acc - z * qsum), as w4a8::dot_groups
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) {
        const int64_t at = g * param_row + b * 16 + h * 8;
        const __m256 s = load8(scales, at);
        const __m256 z = load8(zeros, at);
        for (int r = 0; r < MR; ++r) {
          float* o = out + ((r * NB + b) * 2 + h) * 8;
          const __m256 centred =
              _mm256_fnmadd_ps(z, _mm256_set1_ps(qsum[r * groups + g]), _mm256_cvtepi32_ps(acc[r][b][h]));
          _mm256_storeu_ps(o, _mm256_fmadd_ps(centred, _mm256_mul_ps(s, _mm256_set1_ps(scale[r * groups + g])),
                                              _mm256_loadu_ps(o)));
        }
      }
  }
}

// out[(r * NB + b) * 16 + i] = sum over groups g of s * (x_r . q_b over g - z * xsum[r, g]) for MR rows of x
// (float32 values, x_stride apart) and NB blocks of the grouped 8-bit layout ([K/2][16][2] int8 per block,
// w_block_stride bytes apart); zeros.data null: symmetric. `valid` channels of the last block exist (the padding's
// weights are zero, its scales are not read).
// Four accumulators per row and block, lane 2j + p holding channel 4a + j's inputs of parity p; their pairs are
// summed once per group.
template <int MR, int NB>
__attribute__((always_inline)) inline void g8_dot_groups(const float* x, int64_t x_stride, const float* xsum,
                                                         int64_t groups, const int8_t* w, int64_t w_block_stride,
                                                         int64_t group_pairs, tiles::GroupParams scales,
                                                         tiles::GroupParams zeros, int64_t param_row, int64_t valid,
                                                         float* out) {
  static_assert(MR * NB <= 3, "float sums of a tile: 4 x MR x NB registers");
  for (int i = 0; i < MR * NB * 2; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[MR][NB][4];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b)
        for (int a = 0; a < 4; ++a) acc[r][b][a] = _mm256_setzero_ps();
    for (int64_t kp = g * group_pairs; kp < (g + 1) * group_pairs; ++kp) {
      __m256 xb[MR];
      for (int r = 0; r < MR; ++r) {  // (x[2kp], x[2kp + 1]) in every lane pair
        const __m128d pair = _mm_load_sd(reinterpret_cast<const double*>(x + r * x_stride + 2 * kp));
        xb[r] = _mm256_castpd_ps(_mm256_broadcastsd_pd(pair));
      }
      for (int b = 0; b < NB; ++b) {
        const int8_t* wp = w + b * w_block_stride + kp * 32;
        for (int a = 0; a < 4; ++a) {
          const __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + 8 * a))));
          for (int r = 0; r < MR; ++r) acc[r][b][a] = _mm256_fmadd_ps(wf, xb[r], acc[r][b][a]);
        }
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) {
        const int64_t at = g * param_row + b * 16 + h * 8;
        const bool full = (b * 16 + h * 8) + 8 <= valid;
        __m256 s, z = _mm256_setzero_ps();
        if (full) {
          s = load8(scales, at);
          if (zeros.data) z = load8(zeros, at);
        } else {  // the last block's partial half: only the channels that exist
          alignas(32) float sv[8] = {}, zv[8] = {};
          for (int64_t i = 0; i < valid - (b * 16 + h * 8) && i < 8; ++i) {
            sv[i] = scales.half ? static_cast<float>(static_cast<const c10::Half*>(scales.data)[at + i])
                                : static_cast<const float*>(scales.data)[at + i];
            if (zeros.data)
              zv[i] = zeros.half ? static_cast<float>(static_cast<const c10::Half*>(zeros.data)[at + i])
                                 : static_cast<const float*>(zeros.data)[at + i];
          }
          s = _mm256_load_ps(sv);
          z = _mm256_load_ps(zv);
        }
        for (int r = 0; r < MR; ++r) {
          // lanes [0, 1, 4, 5 | 2, 3, 6, 7] of the half's channels, then in order
          const __m256 sums = _mm256_hadd_ps(acc[r][b][2 * h], acc[r][b][2 * h + 1]);
          __m256 v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sums), 0xD8));
          if (zeros.data) v = _mm256_fnmadd_ps(z, _mm256_set1_ps(xsum[r * groups + g]), v);
          float* o = out + ((r * NB + b) * 2 + h) * 8;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(v, s, _mm256_loadu_ps(o)));
        }
      }
  }
}

}  // namespace avx2
}  // namespace kubellm_cpu
#endif
