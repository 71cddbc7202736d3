// Weight-only int4 GEMM for CPUs with AVX512-BF16, with per-group scales and zero points (AWQ, GPTQ,
// compressed-tensors W4A16, kubellm's own int4):
//   y[m, n] = sum_g s[g, n] * (sum_{k in g} q[n, k] * x[m, k] - z[g, n] * sum_{k in g} x[m, k])  (+ bias[n])
// with q in 0..15 (unsigned nibbles; a symmetric format passes z = 8), x and y bfloat16, s and z float32 or
// float16 (each its own; tiles::GroupParams).
//
// Why: a decode step is bound by weight bytes; int4 reads a quarter of bf16's. The nibbles are widened to bf16
// in registers and multiplied with vdpbf16ps like the int8 kernel, and the widening is the costly part, so it
// is two bit operations per 16 lanes: a nibble v OR'd into the bits 0x4300 is the bf16 of 128 + v (exact: 7
// mantissa bits), so the dot products sum x * (q + 128) and the epilogue subtracts (z + 128) * sum(x) per
// group with the scale, using the row's sums of x over each group (computed once per call). (A vpermw table
// lookup of each nibble pair, the first version, cost three times the instructions.)
//
// Layout (kernels/cpu_int4_gemm.py packs it once): [N/16][K/4][16][2] bytes; for inputs k..k+3 (k % 4 == 0),
// byte 2i + j (j = 0, 1) of the 32 holds q[n0 + i, k + j] in its low nibble and q[n0 + i, k + 2 + j] in its
// high one. Zero-extended to 16-bit lanes, the low nibbles are then the 16 channels' (q[k], q[k+1]) bf16 pairs
// and the high nibbles their (q[k+2], q[k+3]) pairs. Scales and zero points [K/group][N].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "gemm_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KUBELLM_INT4_GEMM 1
#endif

namespace kubellm_cpu {
namespace {

bool int4_gemm_available() {
#ifdef KUBELLM_INT4_GEMM
  return true;
#else
  return false;
#endif
}

#ifdef KUBELLM_INT4_GEMM
constexpr int kMaxRows4 = 12;  // MR group sums + MR outputs + two weights, two broadcasts, two constants <= 32 zmm

template <int MR, int NB>
void micro_kernel4(const int32_t* x_pairs, int64_t x_pair_stride, const float* xsum, int64_t groups,
                   const uint8_t* w, int64_t w_block_stride, int64_t K4, int64_t group_quads,
                   tiles::GroupParams scales, tiles::GroupParams zeros, int64_t N, const float* bias, c10::BFloat16* y, int64_t ldy) {
  const __m512i nibble = _mm512_set1_epi32(0x000F000F);
  const __m512i magic = _mm512_set1_epi32(0x43004300);  // bf16 128.0 in both halves
  __m512 out[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0, kq0 = 0; kq0 < K4; ++g, kq0 += group_quads) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    const int64_t kq1 = std::min(K4, kq0 + group_quads);
    for (int64_t kq = kq0; kq < kq1; ++kq) {
      __m512i lo[NB], hi[NB];
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
          acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)x0, (__m512bh)lo[b]);
          acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)x1, (__m512bh)hi[b]);
        }
      }
    }
    // out += s * (acc - (z + 128) * sum(x over the group))
    for (int b = 0; b < NB; ++b) {
      const __m512 s = scales.load16(g * N + b * 16);
      const __m512 z = _mm512_add_ps(zeros.load16(g * N + b * 16), _mm512_set1_ps(128.f));
      for (int r = 0; r < MR; ++r) {
        const __m512 centred = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), acc[r][b]);
        out[r][b] = _mm512_fmadd_ps(centred, s, out[r][b]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 bi = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + b * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(out[r][b], bi)));
  }
}

template <int NB>
void rows_kernel4(int mr, const int32_t* x_pairs, int64_t x_pair_stride, const float* xsum, int64_t groups,
                  const uint8_t* w, int64_t w_block_stride, int64_t K4, int64_t group_quads,
                  tiles::GroupParams scales, tiles::GroupParams zeros, int64_t N, const float* bias, c10::BFloat16* y, int64_t ldy) {
  switch (mr) {
#define KUBELLM_ROWS4(R)                                                                                         \
  case R:                                                                                                        \
    micro_kernel4<R, NB>(x_pairs, x_pair_stride, xsum, groups, w, w_block_stride, K4, group_quads, scales, zeros, \
                         N, bias, y, ldy);                                                                       \
    break;
    KUBELLM_ROWS4(1) KUBELLM_ROWS4(2) KUBELLM_ROWS4(3) KUBELLM_ROWS4(4) KUBELLM_ROWS4(5) KUBELLM_ROWS4(6)
    KUBELLM_ROWS4(7) KUBELLM_ROWS4(8) KUBELLM_ROWS4(9) KUBELLM_ROWS4(10) KUBELLM_ROWS4(11) KUBELLM_ROWS4(12)
#undef KUBELLM_ROWS4
    default: TORCH_CHECK(false, "int4_gemm: bad row tile ", mr);
  }
}
#endif

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t group_size, const c10::optional<at::Tensor>& bias) {
#ifndef KUBELLM_INT4_GEMM
  TORCH_CHECK(false, "int4_gemm needs a build with AVX512-BF16 (-march of a CPU that has it)");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be [M, K] bfloat16, rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "packed must be a contiguous [N/16, K/4, 16, 2] uint8 tensor (cpu_int4_gemm.pack)");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0), K4 = packed.size(1), N = NBLK * 16;
  TORCH_CHECK(K == 4 * K4, "x has ", K, " columns, the weight ", 4 * K4);
  TORCH_CHECK(group_size >= 4 && group_size % 4 == 0 && K % group_size == 0, "group_size (", group_size,
              ") must be a multiple of 4 and divide K (", K, ")");
  const int64_t groups = K / group_size;
  TORCH_CHECK(x.stride(0) % 2 == 0, "x's row stride must be even (bf16 pairs)");
  const tiles::GroupParams sp = tiles::group_params(scales, "scales", groups, N);
  const tiles::GroupParams zp = tiles::group_params(zeros, "zeros", groups, N);
  const float* bias_p = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be [N] float32");
    bias_p = bias->const_data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // Per row and group, the sum of x (float32 of the bf16 values the products use).
  const c10::BFloat16* xv = x.const_data_ptr<c10::BFloat16>();
  at::Tensor xsum_t = at::empty({M, groups}, x.options().dtype(at::kFloat));
  float* xsum_w = xsum_t.mutable_data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    tiles::bf16_group_sums(xv + m0 * x.stride(0), x.stride(0), m1 - m0, K, group_size, xsum_w + m0 * groups);
  });
  const float* xsum = xsum_w;
  const auto* xp = reinterpret_cast<const int32_t*>(xv);
  const int64_t x_pair_stride = x.stride(0) / 2;
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  const int64_t w_block_stride = K4 * 32, group_quads = group_size / 4;
  // Work items of NB 16-channel blocks over all rows, in tiles of MR rows. Few rows: several blocks per tile,
  // for independent dot-product chains, as many as split evenly over the threads; many rows: one block and up
  // to kMaxRows4 rows per tile, so each weight slice is widened once for as many rows as possible.
  const int nb = M <= 2 ? tiles::blocks_per_item(NBLK, 4) : M <= 6 ? tiles::blocks_per_item(NBLK, 2) : 1;
  const int64_t row_tile = nb == 1 ? kMaxRows4 : M;
  at::parallel_for(0, (NBLK + nb - 1) / nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t blk = it * nb;
      const int n = static_cast<int>(std::min<int64_t>(nb, NBLK - blk));
      for (int64_t m0 = 0; m0 < M; m0 += row_tile) {
        const int mr = static_cast<int>(std::min<int64_t>(row_tile, M - m0));
        const int32_t* xr = xp + m0 * x_pair_stride;
        const float* xs = xsum + m0 * groups;
        const uint8_t* w = wp + blk * w_block_stride;
        const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
        c10::BFloat16* yr = yp + m0 * N + blk * 16;
#define KUBELLM_NB(B)                                                                                       \
  rows_kernel4<B>(mr, xr, x_pair_stride, xs, groups, w, w_block_stride, K4, group_quads, sp.offset(blk * 16), \
                  zp.offset(blk * 16), N, bp, yr, N)
        switch (n) {
          case 4: KUBELLM_NB(4); break;
          case 3: KUBELLM_NB(3); break;
          case 2: KUBELLM_NB(2); break;
          default: KUBELLM_NB(1); break;
        }
#undef KUBELLM_NB
      }
    }
  });
  return y;
#endif
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size, Tensor? bias) -> Tensor");
  m.def("int4_gemm_available() -> bool", &kubellm_cpu::int4_gemm_available);  // no tensors: not dispatched
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("int4_gemm", &kubellm_cpu::int4_gemm); }
