// The int8-activation few-rows tile of the int4 GEMM (int4_gemm_cpu.cpp; layout there): llama.cpp's Q4 x Q8
// idea on the same packed weights. Each row's activations are quantized to int8 per weight group
// (quantize_block), and the nibbles meet them in AVX512-VNNI integer dot products with int32 group accumulators:
//   y[m, n] = sum_g s[g, n] * a[m, g] * (sum_{k in g} q[n, k] * xq[m, k] - z[g, n] * sum_{k in g} xq[m, k])
// with a[m, g] = max|x[m, g]| / 127 and xq = round(x / a) in -127..127 (kernels/cpu_int4_gemm.py's
// reference_w4a8_gemm is the same math in PyTorch).
// Why: the bf16-activation tile spends, per 64 weights and row, a zero-extension, a shift, two ternary ORs and
// two vdpbf16ps, and at one row it is instruction-bound (benchmarks/results/, issue 12). Here a quad's 32
// packed bytes become the 64 unsigned bytes vpdpbusd multiplies in three instructions shared by all rows, and
// each row adds one vpdpbusd (an embedded broadcast of its four int8 activations) per 64 weights.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemm_tiles.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KUBELLM_W4A8_TILES 1

namespace kubellm_cpu {
namespace w4a8 {

// Rows x[0..rows) quantized per group of `group` inputs (a multiple of 4) into one block of block_rows
// interleaved rows: row r's quad kq (the int8 of inputs 4kq, 4kq+2, 4kq+1, 4kq+3, the byte order the widened
// nibbles take) at xq[kq * block_rows + r], its group g's scale max|x| / 127 at scale[g * block_rows + r] and the
// sum of the group's int8 values at qsum[g * block_rows + r]; xq = round(x * (127 / max|x|)), half to even
// (vcvtps2dq under the default rounding mode). An all-zero group has scale 0 and values 0, and so do the rows
// from `rows` to block_rows (padding a tile computes and its caller drops). block_rows 1 is one plain row.
inline void quantize_block(const c10::BFloat16* x, int64_t ldx, int64_t rows, int64_t block_rows, int64_t K,
                           int64_t group, int32_t* xq, float* scale, float* qsum) {
  const int64_t groups = K / group, K4 = K / 4;
  const __m128i quad_order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  auto load = [](const c10::BFloat16* p, __mmask16 mask) {  // 16 bf16 as float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
  };
  for (int64_t r = 0; r < rows; ++r) {
    const c10::BFloat16* row = x + r * ldx;
    int32_t* out = xq + r;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * group;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) {
        const __mmask16 mask = group - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (group - k)) - 1);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(load(row + k0 + k, mask)));
      }
      const float a = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = 0; k < group; k += 16) {
        const __mmask16 mask = group - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (group - k)) - 1);
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load(row + k0 + k, mask), inv));  // |v| <= 127
        sum = _mm512_add_epi32(sum, v);
        const __m128i quads = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(v), quad_order);
        const int64_t kq = (k0 + k) / 4;
        if (block_rows == 1) {
          _mm_mask_storeu_epi8(reinterpret_cast<int8_t*>(out + kq), mask, quads);
        } else {
          alignas(16) int32_t lanes[4];
          _mm_store_si128(reinterpret_cast<__m128i*>(lanes), quads);
          for (int64_t i = 0; i < std::min<int64_t>(4, (group - k) / 4); ++i) out[(kq + i) * block_rows] = lanes[i];
        }
      }
      scale[g * block_rows + r] = a / 127.f;
      qsum[g * block_rows + r] = static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
  }
  for (int64_t r = rows; r < block_rows; ++r) {
    for (int64_t kq = 0; kq < K4; ++kq) xq[kq * block_rows + r] = 0;
    for (int64_t g = 0; g < groups; ++g) scale[g * block_rows + r] = qsum[g * block_rows + r] = 0.f;
  }
}

// out[r][b] = sum over groups g of s * a[r, g] * (xq_r . q_b over g - z * qsum[r, g]) for MR (1 or 2) plain rows
// of quantized activations (quantize_block's block_rows 1, x_stride int32 apart) and NB 16-channel weight blocks
// (w_block_stride bytes apart); scales and zeros as in int4::dot_groups (param_row apart per group, 16 per block).
// Widening: a quad's bytes zero-extended to words (word 2i + j = channel i's byte j), OR'd with themselves
// shifted left by 4 and masked with 0x0F0F, hold channel i's q[k], q[k+2], q[k+1], q[k+3] as the four bytes of
// dword lane i: the order quantize_block stores each row's four activations in.
// Consecutive quads go to two accumulator sets (as int4::dot_groups does at 1-2 rows), so the additions into one
// do not wait on each other. prefetch_bytes > 0: each cache line of the weights prefetches that far ahead
// (the GEMM passes its item's size, as for int4::dot_groups), at one row too: with the widening this cheap,
// the hardware prefetcher alone left one row from memory slower than two (benchmarks/results/).
template <int MR, int NB>
__attribute__((always_inline)) inline void dot_groups(const int32_t* xq, int64_t x_stride, const float* scale,
                                                      const float* qsum, int64_t groups, const uint8_t* w,
                                                      int64_t w_block_stride, int64_t K4, int64_t group_quads,
                                                      tiles::GroupParams scales, tiles::GroupParams zeros,
                                                      int64_t param_row, __m512 (&out)[MR][NB],
                                                      int64_t prefetch_bytes = 0) {
  static_assert(MR <= 2, "3 or more rows run dot_groups_rows");
  constexpr int KC = 2;  // accumulator sets
  const __m512i low_nibbles = _mm512_set1_epi16(0x0F0F);
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0, kq0 = 0; kq0 < K4; ++g, kq0 += group_quads) {
    __m512i acc[KC][MR][NB];
    for (int c = 0; c < KC; ++c)
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b) acc[c][r][b] = _mm512_setzero_si512();
    const int64_t kq1 = std::min(K4, kq0 + group_quads);
    auto quad = [&](int64_t kq, int c) __attribute__((always_inline)) {
      __m512i wq[NB];
      if (prefetch_bytes > 0 && (kq & 1) == 0)  // one line (two quads) at a time
        for (int b = 0; b < NB; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(w + b * w_block_stride + kq * 32) + prefetch_bytes, _MM_HINT_T0);
      for (int b = 0; b < NB; ++b) {
        const __m512i words =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * w_block_stride + kq * 32)));
        wq[b] = _mm512_ternarylogic_epi32(words, _mm512_slli_epi16(words, 4), low_nibbles, 0xA8);  // (a | b) & c
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i xr = _mm512_set1_epi32(xq[r * x_stride + kq]);
        for (int b = 0; b < NB; ++b) acc[c][r][b] = _mm512_dpbusd_epi32(acc[c][r][b], wq[b], xr);
      }
    };
    int64_t kq = kq0;
    for (; kq + KC <= kq1; kq += KC)
      for (int c = 0; c < KC; ++c) quad(kq + c, c);
    if (kq < kq1) quad(kq, 0);
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[0][r][b] = _mm512_add_epi32(acc[0][r][b], acc[1][r][b]);
    // out += s * a * (acc - z * qsum)
    for (int b = 0; b < NB; ++b) {
      const int64_t at = g * param_row + b * 16;
      const __m512 s = scales.load16(at);
      const __m512 z = zeros.load16(at);
      for (int r = 0; r < MR; ++r) {
        const __m512 centred =
            _mm512_fnmadd_ps(z, _mm512_set1_ps(qsum[r * groups + g]), _mm512_cvtepi32_ps(acc[0][r][b]));
        out[r][b] = _mm512_fmadd_ps(centred, _mm512_mul_ps(s, _mm512_set1_ps(scale[r * groups + g])), out[r][b]);
      }
    }
  }
}

// Three or more rows: MR (4, 6 or 8) rows x NB (1 or 2) blocks over one block of quantize_block, in assembly because
// GCC 12 compiled the same loop in intrinsics (dot_groups<8, 1>, and a variant with 2 blocks) with a register copy
// beside each vpdpbusd (about 40 instructions per quad of the 8 vpdpbusd; about 50 per 16 with 2 blocks,
// accumulators spilled to the stack), and the tile ran at 40-50% of the core's two vpdpbusd per cycle, no faster
// than native bf16. A quad of the 8 x 2 tile here is 36 instructions: 16 vpdpbusd, 8 broadcasts, 6 widening, 2
// prefetches, 4 of loop. zmm0-15 hold the int32 group
// sums (row r, block b: zmm(NB * r + b)), zmm16-17 the widened quads of the two blocks, zmm18 a broadcast: per
// quad and block 3 widening instructions, per row one broadcast, per row and block one vpdpbusd. The group's
// epilogue is dot_groups' own (the same operations in the same order: a row's bits do not depend on the tile it
// ran in, tested), accumulating into out[(r * NB + b) * 16 ..] (an L1 tile of 64-byte-aligned floats, zeroed
// here): 16 float sums would not fit beside 16 integer ones. Each quad prefetches prefetch_bytes ahead in each
// block's stream: the caller passes its item's size to an item's first row block (the same quad of the next
// item, as dot_groups does) and 0 to the others (a prefetch of the line being read, all but free); without it 8
// rows from memory ran 0.7-0.9x the bf16-activation path, which prefetches.
#define KUBELLM_W4A8_ZERO(a) "vpxord %%zmm" #a ", %%zmm" #a ", %%zmm" #a "\n\t"
#define KUBELLM_W4A8_ZERO4 KUBELLM_W4A8_ZERO(0) KUBELLM_W4A8_ZERO(1) KUBELLM_W4A8_ZERO(2) KUBELLM_W4A8_ZERO(3)
#define KUBELLM_W4A8_ZERO8 KUBELLM_W4A8_ZERO4 KUBELLM_W4A8_ZERO(4) KUBELLM_W4A8_ZERO(5) KUBELLM_W4A8_ZERO(6) \
  KUBELLM_W4A8_ZERO(7)
#define KUBELLM_W4A8_ZERO6 KUBELLM_W4A8_ZERO4 KUBELLM_W4A8_ZERO(4) KUBELLM_W4A8_ZERO(5)
#define KUBELLM_W4A8_ZERO12 KUBELLM_W4A8_ZERO8 KUBELLM_W4A8_ZERO(8) KUBELLM_W4A8_ZERO(9) KUBELLM_W4A8_ZERO(10) \
  KUBELLM_W4A8_ZERO(11)
#define KUBELLM_W4A8_ZERO16 KUBELLM_W4A8_ZERO8 KUBELLM_W4A8_ZERO(8) KUBELLM_W4A8_ZERO(9) KUBELLM_W4A8_ZERO(10) \
  KUBELLM_W4A8_ZERO(11) KUBELLM_W4A8_ZERO(12) KUBELLM_W4A8_ZERO(13) KUBELLM_W4A8_ZERO(14) KUBELLM_W4A8_ZERO(15)
#define KUBELLM_W4A8_WIDEN(reg, mem)                       \
  "vpmovzxbw " mem ", %%zmm" #reg "\n\t"                   \
  "vpsllw $4, %%zmm" #reg ", %%zmm18\n\t"                  \
  "vpternlogd $0xA8, %[nibbles], %%zmm18, %%zmm" #reg "\n\t" /* (q | q << 4) & 0x0F0F */
#define KUBELLM_W4A8_WIDEN1 "prefetcht0 (%[w],%[ahead])\n\t" KUBELLM_W4A8_WIDEN(16, "(%[w])")
#define KUBELLM_W4A8_WIDEN2 KUBELLM_W4A8_WIDEN1 "prefetcht0 (%[w],%[ahead2])\n\t" KUBELLM_W4A8_WIDEN(17, "(%[w],%[ws])")
#define KUBELLM_W4A8_ROW1(r, a0) \
  "vpbroadcastd " #r "*4(%[x]), %%zmm18\n\t" "vpdpbusd %%zmm18, %%zmm16, %%zmm" #a0 "\n\t"
#define KUBELLM_W4A8_ROW2(r, a0, a1) KUBELLM_W4A8_ROW1(r, a0) "vpdpbusd %%zmm18, %%zmm17, %%zmm" #a1 "\n\t"
#define KUBELLM_W4A8_ROWS4x1 KUBELLM_W4A8_ROW1(0, 0) KUBELLM_W4A8_ROW1(1, 1) KUBELLM_W4A8_ROW1(2, 2) \
  KUBELLM_W4A8_ROW1(3, 3)
#define KUBELLM_W4A8_ROWS6x1 KUBELLM_W4A8_ROWS4x1 KUBELLM_W4A8_ROW1(4, 4) KUBELLM_W4A8_ROW1(5, 5)
#define KUBELLM_W4A8_ROWS8x1 KUBELLM_W4A8_ROWS6x1 KUBELLM_W4A8_ROW1(6, 6) KUBELLM_W4A8_ROW1(7, 7)
#define KUBELLM_W4A8_ROWS4x2 KUBELLM_W4A8_ROW2(0, 0, 1) KUBELLM_W4A8_ROW2(1, 2, 3) KUBELLM_W4A8_ROW2(2, 4, 5) \
  KUBELLM_W4A8_ROW2(3, 6, 7)
#define KUBELLM_W4A8_ROWS6x2 KUBELLM_W4A8_ROWS4x2 KUBELLM_W4A8_ROW2(4, 8, 9) KUBELLM_W4A8_ROW2(5, 10, 11)
#define KUBELLM_W4A8_ROWS8x2 KUBELLM_W4A8_ROWS6x2 KUBELLM_W4A8_ROW2(6, 12, 13) KUBELLM_W4A8_ROW2(7, 14, 15)
// out = fma(s * scale, acc - z * qsum, out), with zmm16 = qsum and zmm17 = scale of the row broadcast
#define KUBELLM_W4A8_EPI1(a, b, off)                           \
  "vcvtdq2ps %%zmm" #a ", %%zmm" #a "\n\t"                     \
  "vfnmadd231ps %%zmm16, %[z" #b "], %%zmm" #a "\n\t"          \
  "vmulps %%zmm17, %[s" #b "], %%zmm18\n\t"                    \
  "vfmadd213ps " #off "(%[out]), %%zmm18, %%zmm" #a "\n\t"     \
  "vmovaps %%zmm" #a ", " #off "(%[out])\n\t"
#define KUBELLM_W4A8_BCAST(r) "vbroadcastss " #r "*4(%[qsum]), %%zmm16\n\t" "vbroadcastss " #r "*4(%[scale]), %%zmm17\n\t"
#define KUBELLM_W4A8_EPI_ROW1(r, a0) KUBELLM_W4A8_BCAST(r) KUBELLM_W4A8_EPI1(a0, 0, (r)*64)
#define KUBELLM_W4A8_EPI_ROW2(r, a0, a1) \
  KUBELLM_W4A8_BCAST(r) KUBELLM_W4A8_EPI1(a0, 0, (2*(r))*64) KUBELLM_W4A8_EPI1(a1, 1, (2*(r)+1)*64)
#define KUBELLM_W4A8_EPIS4x1 KUBELLM_W4A8_EPI_ROW1(0, 0) KUBELLM_W4A8_EPI_ROW1(1, 1) KUBELLM_W4A8_EPI_ROW1(2, 2) \
  KUBELLM_W4A8_EPI_ROW1(3, 3)
#define KUBELLM_W4A8_EPIS6x1 KUBELLM_W4A8_EPIS4x1 KUBELLM_W4A8_EPI_ROW1(4, 4) KUBELLM_W4A8_EPI_ROW1(5, 5)
#define KUBELLM_W4A8_EPIS8x1 KUBELLM_W4A8_EPIS6x1 KUBELLM_W4A8_EPI_ROW1(6, 6) KUBELLM_W4A8_EPI_ROW1(7, 7)
#define KUBELLM_W4A8_EPIS4x2 KUBELLM_W4A8_EPI_ROW2(0, 0, 1) KUBELLM_W4A8_EPI_ROW2(1, 2, 3) \
  KUBELLM_W4A8_EPI_ROW2(2, 4, 5) KUBELLM_W4A8_EPI_ROW2(3, 6, 7)
#define KUBELLM_W4A8_EPIS6x2 KUBELLM_W4A8_EPIS4x2 KUBELLM_W4A8_EPI_ROW2(4, 8, 9) KUBELLM_W4A8_EPI_ROW2(5, 10, 11)
#define KUBELLM_W4A8_EPIS8x2 KUBELLM_W4A8_EPIS6x2 KUBELLM_W4A8_EPI_ROW2(6, 12, 13) KUBELLM_W4A8_EPI_ROW2(7, 14, 15)
// One group: zero the sums, n quads (w and x advance one quad each), the epilogue.
#define KUBELLM_W4A8_GROUP(ZEROS, WIDENS, ROWS, X_STEP, EPIS)                                                      \
  asm volatile(ZEROS "1:\n\t" WIDENS ROWS "add $32, %[w]\n\t" "add $" X_STEP ", %[x]\n\t" "dec %[n]\n\t"         \
               "jnz 1b\n\t" EPIS                                                                                  \
               : [w] "+r"(wp), [x] "+r"(xp), [n] "+r"(n)                                                          \
               : [ws] "r"(w_block_stride), [ahead] "r"(prefetch_bytes),                                           \
                 [ahead2] "r"(prefetch_bytes + w_block_stride), [nibbles] "v"(low_nibbles), [s0] "v"(s[0]),      \
                 [s1] "v"(s[1]), [z0] "v"(z[0]), [z1] "v"(z[1]), [scale] "r"(scale + g * MR),                   \
                 [qsum] "r"(qsum + g * MR), [out] "r"(out)                                                        \
               : "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",  \
                 "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18")

template <int MR, int NB>
inline void dot_groups_rows(const int32_t* xq, const float* scale, const float* qsum, int64_t groups,
                            const uint8_t* w, int64_t w_block_stride, int64_t group_quads, tiles::GroupParams scales,
                            tiles::GroupParams zeros, int64_t param_row, float* out, int64_t prefetch_bytes) {
  static_assert((MR == 4 || MR == 6 || MR == 8) && (NB == 1 || NB == 2));
  const __m512i low_nibbles = _mm512_set1_epi16(0x0F0F);
  for (int i = 0; i < MR * NB; ++i) _mm512_store_ps(out + 16 * i, _mm512_setzero_ps());
  const uint8_t* wp = w;
  const int32_t* xp = xq;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s[2], z[2];
    for (int b = 0; b < 2; ++b) {  // NB = 1 loads block 0's twice (the second unused)
      s[b] = scales.load16(g * param_row + (b < NB ? b * 16 : 0));
      z[b] = zeros.load16(g * param_row + (b < NB ? b * 16 : 0));
    }
    int64_t n = group_quads;
    if constexpr (MR == 8 && NB == 2) {
      KUBELLM_W4A8_GROUP(KUBELLM_W4A8_ZERO16, KUBELLM_W4A8_WIDEN2, KUBELLM_W4A8_ROWS8x2, "32", KUBELLM_W4A8_EPIS8x2);
    } else if constexpr (MR == 8) {
      KUBELLM_W4A8_GROUP(KUBELLM_W4A8_ZERO8, KUBELLM_W4A8_WIDEN1, KUBELLM_W4A8_ROWS8x1, "32", KUBELLM_W4A8_EPIS8x1);
    } else if constexpr (MR == 6 && NB == 2) {
      KUBELLM_W4A8_GROUP(KUBELLM_W4A8_ZERO12, KUBELLM_W4A8_WIDEN2, KUBELLM_W4A8_ROWS6x2, "24", KUBELLM_W4A8_EPIS6x2);
    } else if constexpr (MR == 6) {
      KUBELLM_W4A8_GROUP(KUBELLM_W4A8_ZERO6, KUBELLM_W4A8_WIDEN1, KUBELLM_W4A8_ROWS6x1, "24", KUBELLM_W4A8_EPIS6x1);
    } else if constexpr (NB == 2) {
      KUBELLM_W4A8_GROUP(KUBELLM_W4A8_ZERO8, KUBELLM_W4A8_WIDEN2, KUBELLM_W4A8_ROWS4x2, "16", KUBELLM_W4A8_EPIS4x2);
    } else {
      KUBELLM_W4A8_GROUP(KUBELLM_W4A8_ZERO4, KUBELLM_W4A8_WIDEN1, KUBELLM_W4A8_ROWS4x1, "16", KUBELLM_W4A8_EPIS4x1);
    }
  }
}

// Two plain rows (quantize_block's block_rows 1, x_stride int32 apart) x NB (3 or 4) blocks: the two-row step
// (decode at batch 2) as dot_groups<2, NB> computes it, in assembly for the same reason as above (that tile ran
// 0.96-0.99x native bf16 on a cache-resident 576x576). zmm(4r + b) hold the sums, zmm16-19 the widened quads,
// zmm20 the shift, zmm21 a broadcast; the epilogue is dot_groups' (same bits, tested).
#define KUBELLM_W4A8_WIDEN_T(reg, mem)                     \
  "vpmovzxbw " mem ", %%zmm" #reg "\n\t"                   \
  "vpsllw $4, %%zmm" #reg ", %%zmm20\n\t"                  \
  "vpternlogd $0xA8, %[nibbles], %%zmm20, %%zmm" #reg "\n\t"
#define KUBELLM_W4A8_WIDEN3                                                                     \
  "prefetcht0 (%[pf])\n\t" KUBELLM_W4A8_WIDEN_T(16, "(%[w])")                                  \
  "prefetcht0 (%[pf],%[ws])\n\t" KUBELLM_W4A8_WIDEN_T(17, "(%[w],%[ws])")                      \
  "prefetcht0 (%[pf],%[ws],2)\n\t" KUBELLM_W4A8_WIDEN_T(18, "(%[w],%[ws],2)")
#define KUBELLM_W4A8_WIDEN4 KUBELLM_W4A8_WIDEN3 "prefetcht0 (%[pf],%[ws3])\n\t" KUBELLM_W4A8_WIDEN_T(19, "(%[w],%[ws3])")
#define KUBELLM_W4A8_DOT(wreg, a) "vpdpbusd %%zmm21, %%zmm" #wreg ", %%zmm" #a "\n\t"
#define KUBELLM_W4A8_TWO3(mem, a0, a1, a2) \
  "vpbroadcastd " mem ", %%zmm21\n\t" KUBELLM_W4A8_DOT(16, a0) KUBELLM_W4A8_DOT(17, a1) KUBELLM_W4A8_DOT(18, a2)
#define KUBELLM_W4A8_TWO4(mem, a0, a1, a2, a3) KUBELLM_W4A8_TWO3(mem, a0, a1, a2) KUBELLM_W4A8_DOT(19, a3)
#define KUBELLM_W4A8_TWO_BCAST(q, sc) "vbroadcastss " q ", %%zmm16\n\t" "vbroadcastss " sc ", %%zmm17\n\t"
// row r of a tile nb blocks wide (r, nb: digits, for the assembler's offset arithmetic)
#define KUBELLM_W4A8_TWO_EPI3(r, nb, q, sc, a0, a1, a2) KUBELLM_W4A8_TWO_BCAST(q, sc)         \
  KUBELLM_W4A8_EPI1(a0, 0, (r*nb+0)*64) KUBELLM_W4A8_EPI1(a1, 1, (r*nb+1)*64)               \
  KUBELLM_W4A8_EPI1(a2, 2, (r*nb+2)*64)
#define KUBELLM_W4A8_TWO_EPI4(r, q, sc, a0, a1, a2, a3) \
  KUBELLM_W4A8_TWO_EPI3(r, 4, q, sc, a0, a1, a2) KUBELLM_W4A8_EPI1(a3, 3, (r*4+3)*64)
#define KUBELLM_W4A8_TWO_GROUP(ZEROS, WIDENS, ROWS, EPIS)                                                         \
  asm volatile(ZEROS "1:\n\t" WIDENS ROWS "add $32, %[w]\n\t" "add $32, %[pf]\n\t" "add $4, %[x]\n\t"      \
               "dec %[n]\n\t" "jnz 1b\n\t" EPIS                                                                \
               : [w] "+r"(wp), [x] "+r"(xp), [n] "+r"(n), [pf] "+r"(pp)                                          \
               : [ws] "r"(w_block_stride), [ws3] "r"(3 * w_block_stride), [xs] "r"(x_stride * 4),              \
                 [nibbles] "v"(low_nibbles), [s0] "v"(s[0]), [s1] "v"(s[1]), [s2] "v"(s[2]), [s3] "v"(s[3]),    \
                 [z0] "v"(z[0]), [z1] "v"(z[1]), [z2] "v"(z[2]), [z3] "v"(z[3]), [scale] "r"(scale + g),        \
                 [qsum] "r"(qsum + g), [gs] "r"(groups * 4), [out] "r"(out)                                    \
               : "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm16",        \
                 "xmm17", "xmm18", "xmm19", "xmm20", "xmm21")

template <int NB>
inline void dot_groups_two_rows(const int32_t* xq, int64_t x_stride, const float* scale, const float* qsum,
                                int64_t groups, const uint8_t* w, int64_t w_block_stride, int64_t group_quads,
                                tiles::GroupParams scales, tiles::GroupParams zeros, int64_t param_row, float* out,
                                int64_t prefetch_bytes) {
  static_assert(NB == 3 || NB == 4);
  const __m512i low_nibbles = _mm512_set1_epi16(0x0F0F);
  for (int i = 0; i < 2 * NB; ++i) _mm512_store_ps(out + 16 * i, _mm512_setzero_ps());
  const uint8_t* wp = w;
  const uint8_t* pp = w + prefetch_bytes;  // the prefetched stream, in step with wp
  const int32_t* xp = xq;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s[4], z[4];
    for (int b = 0; b < 4; ++b) {  // NB = 3 loads block 0's again as the unused fourth
      s[b] = scales.load16(g * param_row + (b < NB ? b * 16 : 0));
      z[b] = zeros.load16(g * param_row + (b < NB ? b * 16 : 0));
    }
    int64_t n = group_quads;
    if constexpr (NB == 4) {
      KUBELLM_W4A8_TWO_GROUP(KUBELLM_W4A8_ZERO8, KUBELLM_W4A8_WIDEN4,
                             KUBELLM_W4A8_TWO4("(%[x])", 0, 1, 2, 3) KUBELLM_W4A8_TWO4("(%[x],%[xs])", 4, 5, 6, 7),
                             KUBELLM_W4A8_TWO_EPI4(0, "(%[qsum])", "(%[scale])", 0, 1, 2, 3)
                             KUBELLM_W4A8_TWO_EPI4(1, "(%[qsum],%[gs])", "(%[scale],%[gs])", 4, 5, 6, 7));
    } else {
      KUBELLM_W4A8_TWO_GROUP(KUBELLM_W4A8_ZERO8, KUBELLM_W4A8_WIDEN3,
                             KUBELLM_W4A8_TWO3("(%[x])", 0, 1, 2) KUBELLM_W4A8_TWO3("(%[x],%[xs])", 4, 5, 6),
                             KUBELLM_W4A8_TWO_EPI3(0, 3, "(%[qsum])", "(%[scale])", 0, 1, 2)
                             KUBELLM_W4A8_TWO_EPI3(1, 3, "(%[qsum],%[gs])", "(%[scale],%[gs])", 4, 5, 6));
    }
  }
}

#undef KUBELLM_W4A8_ZERO
#undef KUBELLM_W4A8_ZERO4
#undef KUBELLM_W4A8_ZERO8
#undef KUBELLM_W4A8_ZERO16
#undef KUBELLM_W4A8_WIDEN
#undef KUBELLM_W4A8_WIDEN1
#undef KUBELLM_W4A8_WIDEN2
#undef KUBELLM_W4A8_ROW1
#undef KUBELLM_W4A8_ROW2
#undef KUBELLM_W4A8_ROWS4x1
#undef KUBELLM_W4A8_ROWS8x1
#undef KUBELLM_W4A8_ROWS4x2
#undef KUBELLM_W4A8_ROWS8x2
#undef KUBELLM_W4A8_EPI1
#undef KUBELLM_W4A8_BCAST
#undef KUBELLM_W4A8_EPI_ROW1
#undef KUBELLM_W4A8_EPI_ROW2
#undef KUBELLM_W4A8_EPIS4x1
#undef KUBELLM_W4A8_EPIS8x1
#undef KUBELLM_W4A8_EPIS4x2
#undef KUBELLM_W4A8_EPIS8x2
#undef KUBELLM_W4A8_GROUP
#undef KUBELLM_W4A8_WIDEN_T
#undef KUBELLM_W4A8_WIDEN3
#undef KUBELLM_W4A8_WIDEN4
#undef KUBELLM_W4A8_DOT
#undef KUBELLM_W4A8_TWO3
#undef KUBELLM_W4A8_TWO4
#undef KUBELLM_W4A8_TWO_BCAST
#undef KUBELLM_W4A8_TWO_EPI3
#undef KUBELLM_W4A8_TWO_EPI4
#undef KUBELLM_W4A8_TWO_GROUP
#undef KUBELLM_W4A8_ZERO6
#undef KUBELLM_W4A8_ZERO12
#undef KUBELLM_W4A8_ROWS6x1
#undef KUBELLM_W4A8_ROWS6x2
#undef KUBELLM_W4A8_EPIS6x1
#undef KUBELLM_W4A8_EPIS6x2

}  // namespace w4a8
}  // namespace kubellm_cpu
#endif
