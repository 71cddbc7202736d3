// Weight-only int4 GEMM for CPUs with AVX512-BF16, with per-group scales and zero points (AWQ, GPTQ,
// compressed-tensors W4A16, kubellm's own int4):
//   y[m, n] = sum_g s[g, n] * (sum_{k in g} q[n, k] * x[m, k] - z[g, n] * sum_{k in g} x[m, k])  (+ bias[n])
// with q in 0..15 (unsigned nibbles; a symmetric format passes z = 8), x and y bfloat16, s and z float32.
//
// Why: a decode step is bound by weight bytes; int4 reads a quarter of bf16's. Each nibble is widened to bf16
// in registers (0..15 is exact in bf16) and multiplied with vdpbf16ps like the int8 kernel; the zero point
// and scale are applied once per group of inputs to the group's partial sum, using the row's sum of x over
// the group (computed once per call), so the inner loop is unpack + dot product only.
//
// Layout (kernels/cpu_int4_gemm.py packs it once): [N/16][K/2][16] bytes; byte i of the 16 for input pair
// (k, k+1) holds q[n0 + i, k] in its low nibble and q[n0 + i, k + 1] in its high nibble. Scales and zero
// points [K/group][N] float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
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
constexpr int kMaxRows4 = 12;  // MR group accumulators + MR outputs + a weight, the table and a broadcast <= 32 zmm

// bf16 bit patterns of 0..15 (twice: vpermw reads 5 index bits).
alignas(64) constexpr uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
    0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170};

// 16 bytes = 16 channels' (q[k], q[k+1]) nibble pairs → 16 lanes of bf16 pairs (low half q[k], high half q[k+1]):
// each byte spread so its nibbles index the two 16-bit halves of a lane, then one table lookup (vpermw).
inline __m512i widen_pairs(const uint8_t* src, __m512i table) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i idx = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0xF)),
                                      _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF0)), 12));
  return _mm512_permutexvar_epi16(idx, table);
}

template <int MR, int NB>
void micro_kernel4(const int32_t* x_pairs, int64_t x_pair_stride, const float* xsum, int64_t groups,
                   const uint8_t* w, int64_t w_block_stride, int64_t K2, int64_t group_pairs, const float* scales,
                   const float* zeros, int64_t N, const float* bias, c10::BFloat16* y, int64_t ldy) {
  const __m512i table = _mm512_load_si512(kNibbleBf16);
  __m512 out[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0, kp0 = 0; kp0 < K2; ++g, kp0 += group_pairs) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    const int64_t kp1 = std::min(K2, kp0 + group_pairs);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = widen_pairs(w + b * w_block_stride + kp * 16, table);
      for (int r = 0; r < MR; ++r) {
        const __m512i xb = _mm512_set1_epi32(x_pairs[r * x_pair_stride + kp]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
      }
    }
    // out += s * (acc - z * sum(x over the group))
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(scales + g * N + b * 16);
      const __m512 z = _mm512_loadu_ps(zeros + g * N + b * 16);
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
                  const uint8_t* w, int64_t w_block_stride, int64_t K2, int64_t group_pairs, const float* scales,
                  const float* zeros, int64_t N, const float* bias, c10::BFloat16* y, int64_t ldy) {
  switch (mr) {
#define KUBELLM_ROWS4(R)                                                                                         \
  case R:                                                                                                        \
    micro_kernel4<R, NB>(x_pairs, x_pair_stride, xsum, groups, w, w_block_stride, K2, group_pairs, scales, zeros, \
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
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == 16,
              "packed must be a contiguous [N/16, K/2, 16] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0), K2 = packed.size(1), N = NBLK * 16;
  TORCH_CHECK(K == 2 * K2, "x has ", K, " columns, the weight ", 2 * K2);
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0 && K % group_size == 0, "group_size (", group_size,
              ") must be even and divide K (", K, ")");
  const int64_t groups = K / group_size;
  TORCH_CHECK(x.stride(0) % 2 == 0, "x's row stride must be even (bf16 pairs)");
  for (const auto* t : {&scales, &zeros})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == groups && t->size(1) == N && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "scales and zeros must be contiguous [K/group, N] float32");
  const float* bias_p = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be [N] float32");
    bias_p = bias->const_data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // Per row and group, the sum of x (float32 of the bf16 values the products use): a plain loop for a few
  // rows (ATen's fixed cost would show at batch 1), ATen's vectorised reduction for more.
  const c10::BFloat16* xv = x.const_data_ptr<c10::BFloat16>();
  at::Tensor xsum_t;
  if (M * K <= 8192) {
    xsum_t = at::zeros({M, groups}, x.options().dtype(at::kFloat));
    float* s = xsum_t.mutable_data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) s[m * groups + k / group_size] += static_cast<float>(xv[m * x.stride(0) + k]);
  } else {
    xsum_t = x.to(at::kFloat).reshape({M, groups, group_size}).sum(-1).contiguous();
  }
  const float* xsum = xsum_t.const_data_ptr<float>();
  const auto* xp = reinterpret_cast<const int32_t*>(xv);
  const int64_t x_pair_stride = x.stride(0) / 2;
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const float* zp = zeros.const_data_ptr<float>();
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  const int64_t w_block_stride = K2 * 16, group_pairs = group_size / 2;
  // Work items of NB 16-channel blocks over all rows, in tiles of MR rows. Few rows: several blocks per tile,
  // for independent dot-product chains; many rows: one block and up to kMaxRows4 rows per tile, so each weight
  // slice is widened once for as many rows as possible (the widening is the costly part).
  const int nb = M <= 2 ? 4 : M <= 6 ? 2 : 1;
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
  rows_kernel4<B>(mr, xr, x_pair_stride, xs, groups, w, w_block_stride, K2, group_pairs, sp + blk * 16, \
                  zp + blk * 16, N, bp, yr, N)
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
