// Weight-only int8 GEMM for CPUs with AVX512-BF16: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]),
// x and y bfloat16, q int8 (one float32 scale per output channel).
//
// Why: torch's own int8 weight-only CPU GEMM wins only at a single row and runs at ~2.5x bf16's time from 8
// rows up (measured with SmolLM2's shapes, 2 cores). Here every int8 weight is widened to bf16 in registers
// (exact: |q| <= 127 needs 7 mantissa bits) and multiplied with vdpbf16ps, the instruction bf16 GEMMs use,
// so a decode step reads half of bf16's weight bytes at close to bf16's arithmetic rate.
//
// Layout: the weight is packed once (kernels/cpu_int8_gemm.py) as [N/16][K/2][16][2]: for each block of 16
// output channels and each pair of inputs k, 32 bytes = the 16 channels' (q[n, k], q[n, k+1]) pairs, which is
// the operand order of vdpbf16ps. A micro-kernel keeps MR rows x NB blocks of 16 outputs in registers, widens
// each 32-byte weight slice once for all MR rows and broadcasts each row's (x[k], x[k+1]) pair. From
// kDequantMinRows rows that widening, repeated for every tile of 12 rows, cost more than the narrower weight
// reads save (0.96-1.09x bf16 at 64 and 256 rows); each work item's weights are then widened once per call into
// a bf16 scratch and the rows run a plain bf16 GEMM over it (tiles::dequantized_gemm). Both paths widen exactly
// and apply the scale to the same float32 sums, so they give the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "gemm_checks.h"
#include "gemm_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KUBELLM_INT8_GEMM 1
#endif

namespace kubellm_cpu {
namespace {

bool int8_gemm_available() {
#ifdef KUBELLM_INT8_GEMM
  return true;
#else
  return false;
#endif
}

#ifdef KUBELLM_INT8_GEMM
constexpr int kMaxRows = 12;  // MR x NB accumulators + NB weights + 1 broadcast within the 32 zmm registers
constexpr int64_t kDequantMinRows = 16;  // from here on the widen-once path (benchmarks/results/)

template <int MR, int NB>
void micro_kernel(const int32_t* x_pairs, int64_t x_pair_stride, const int8_t* w, int64_t w_block_stride, int64_t K2,
                  const float* scales, const float* bias, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = tiles::widen_int8_pairs(w + b * w_block_stride + kp * 32);
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(x_pairs[r * x_pair_stride + kp]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 sc = _mm512_loadu_ps(scales + b * 16);
    const __m512 bi = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 v = _mm512_fmadd_ps(acc[r][b], sc, bi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + b * 16), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int NB>
void rows_kernel(int mr, const int32_t* x_pairs, int64_t x_pair_stride, const int8_t* w, int64_t w_block_stride,
                 int64_t K2, const float* scales, const float* bias, c10::BFloat16* y, int64_t ldy) {
  switch (mr) {
#define KUBELLM_ROWS(R) \
  case R: micro_kernel<R, NB>(x_pairs, x_pair_stride, w, w_block_stride, K2, scales, bias, y, ldy); break;
    KUBELLM_ROWS(1) KUBELLM_ROWS(2) KUBELLM_ROWS(3) KUBELLM_ROWS(4) KUBELLM_ROWS(5) KUBELLM_ROWS(6)
    KUBELLM_ROWS(7) KUBELLM_ROWS(8) KUBELLM_ROWS(9) KUBELLM_ROWS(10) KUBELLM_ROWS(11) KUBELLM_ROWS(12)
#undef KUBELLM_ROWS
    default: TORCH_CHECK(false, "int8_gemm: bad row tile ", mr);
  }
}
#endif

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
#ifndef KUBELLM_INT8_GEMM
  TORCH_CHECK(false, "int8_gemm needs a build with AVX512-BF16 (-march of a CPU that has it)");
#else
  gemm_checks::check_x(x, /*takes_float32=*/false);
  gemm_checks::check_packed(packed, at::kChar, {16, 2}, "packed must be a contiguous [N/16, K/2, 16, 2] int8 tensor");
  const int64_t M = x.size(0), NBLK = packed.size(0), K2 = packed.size(1), N = NBLK * 16;
  gemm_checks::check_columns(x, 2 * K2);
  const float* sp = gemm_checks::channel_vector(scales, N, "scales");
  const float* bias_p = gemm_checks::optional_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const int32_t*>(x.const_data_ptr<c10::BFloat16>());
  const int64_t x_pair_stride = x.stride(0) / 2;
  const int8_t* wp = packed.const_data_ptr<int8_t>();
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  const int64_t w_block_stride = K2 * 32;
  if (M >= kDequantMinRows) {
    using Widening = tiles::Int8Dequantization<tiles::Int8Weights::kWiden>;
    auto make_side = [&](int64_t blk, int n, __m512i* scratch, __m512*) {
      return Widening{wp + blk * w_block_stride, w_block_stride, 1, nullptr, scratch, n, K2 * n};
    };
    auto output_of = [&](int64_t blk, int) {
      return tiles::TileOutput{{sp + blk * 16, false}, bias_p ? bias_p + blk * 16 : nullptr};
    };
    tiles::dequantized_gemm<Widening>(M, xp, x_pair_stride, K2, NBLK, 0, make_side, output_of, yp, N);
    return y;
  }
  // Work items: pairs of 16-channel blocks (one block for an odd tail), each over all rows, so every thread
  // streams its own slice of the weight once per row tile.
  const int64_t items = (NBLK + 1) / 2;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t blk = it * 2;
      const int nb = std::min<int64_t>(2, NBLK - blk);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
        const int32_t* xr = xp + m0 * x_pair_stride;
        const int8_t* w = wp + blk * w_block_stride;
        c10::BFloat16* yr = yp + m0 * N + blk * 16;
        const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
        if (nb == 2)
          rows_kernel<2>(mr, xr, x_pair_stride, w, w_block_stride, K2, sp + blk * 16, bp, yr, N);
        else
          rows_kernel<1>(mr, xr, x_pair_stride, w, w_block_stride, K2, sp + blk * 16, bp, yr, N);
      }
    }
  });
  return y;
#endif
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("int8_gemm(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int8_gemm_available() -> bool", &kubellm_cpu::int8_gemm_available);  // no tensors: not dispatched
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("int8_gemm", &kubellm_cpu::int8_gemm); }
