// Dense bf16 linear for CPUs with AVX512-BF16: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x, w and y
// bfloat16, sums and bias float32, y rounded to nearest even once.
//
// Why: every dense linear ran oneDNN's prepacked GEMM, which at 1-8 rows streams the weights well below the
// host's read bandwidth (a batch-1 decode step is nothing but that stream) and at 16 rows ran the tied LM head
// at ~270 of the ~425 GFLOP/s one vdpbf16ps per cycle per core allows. Here the weight is packed once into the
// vdpbf16ps operand layout (gemm_tiles.h; kernels/cpu_bf16_gemm.py packs it, zero-padded to whole blocks and
// pairs) and two paths run over it:
//   * up to kStreamMaxRows rows, a stream: each thread takes one contiguous run of blocks and reads it once,
//     with a software prefetch a few lines ahead in every block it reads and, at 1-2 rows, two accumulator sets
//     over alternating input pairs so the additions do not wait on each other;
//   * more rows, register tiles of up to 6 rows x 4 blocks (tiles::bf16_tile) over each work item's blocks,
//     which stay in L2 while all row tiles pass over them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "bf16_linear.h"
#include "gemm_tiles.h"

namespace kubellm_cpu {
namespace {

bool bf16_gemm_available() {
#ifdef KUBELLM_BF16_TILE
  return true;
#else
  return false;
#endif
}

#ifdef KUBELLM_BF16_TILE
constexpr int64_t kStreamMaxRows = 8;
constexpr int kTileRows = 6;          // 6 x 4 accumulators + 4 lines + 1 broadcast
constexpr int64_t kPrefetchLines = 24;  // per block stream, ~1.5 KB ahead

// MR rows x NB blocks (each a contiguous run of K2 lines, K2 lines apart) with KC accumulator sets over
// alternating input pairs.
template <int MR, int NB, int KC>
void stream_tile(const int32_t* x_pairs, int64_t x_pair_stride, const __m512i* w, int64_t K2, const float* bias,
                 c10::BFloat16* y, int64_t ldy, int64_t valid) {
  __m512 acc[KC][MR][NB];
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[c][r][b] = _mm512_setzero_ps();
  auto pair = [&](int c, int64_t kp) __attribute__((always_inline)) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + b * K2 + kp + kPrefetchLines), _MM_HINT_T0);
      wv[b] = _mm512_loadu_si512(w + b * K2 + kp);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(x_pairs[r * x_pair_stride + kp]);
      for (int b = 0; b < NB; ++b) acc[c][r][b] = _mm512_dpbf16_ps(acc[c][r][b], (__m512bh)xb, (__m512bh)wv[b]);
    }
  };
  int64_t kp = 0;
  for (; kp + KC <= K2; kp += KC)
    for (int c = 0; c < KC; ++c) pair(c, kp + c);
  for (; kp < K2; ++kp) pair(0, kp);
  for (int c = 1; c < KC; ++c)
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[0][r][b] = _mm512_add_ps(acc[0][r][b], acc[c][r][b]);
  tiles::store_tile<MR, NB>(acc[0], bias, y, ldy, valid);
}

template <int MR>
void stream_rows(int nb, const int32_t* x_pairs, int64_t x_pair_stride, const __m512i* w, int64_t K2,
                 const float* bias, c10::BFloat16* y, int64_t ldy, int64_t valid) {
  constexpr int KC = MR <= 2 ? 2 : 1;
  switch (nb) {
    case 4: stream_tile<MR, 4, KC>(x_pairs, x_pair_stride, w, K2, bias, y, ldy, valid); break;
    case 3: stream_tile<MR, 3, KC>(x_pairs, x_pair_stride, w, K2, bias, y, ldy, valid); break;
    case 2: stream_tile<MR, 2, KC>(x_pairs, x_pair_stride, w, K2, bias, y, ldy, valid); break;
    default: stream_tile<MR, 1, KC>(x_pairs, x_pair_stride, w, K2, bias, y, ldy, valid); break;
  }
}

// All M rows over one item of NB blocks, in row tiles of equal size (M / tiles rounded, at most kTileRows).
template <int NB>
void item_rows(int64_t M, const int32_t* x_pairs, int64_t x_pair_stride, const __m512i* w, int64_t K2,
               const float* bias, c10::BFloat16* y, int64_t ldy, int64_t valid) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  auto nothing = [](int64_t) {};
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int mr = static_cast<int>(M / tiles + (t < M % tiles));
    const int32_t* xr = x_pairs + m * x_pair_stride;
    c10::BFloat16* yr = y + m * ldy;
    switch (mr) {
#define KUBELLM_TILE(R)                                                      \
  case R: {                                                                  \
    __m512 acc[R][NB];                                                       \
    tiles::bf16_tile<R, NB>(acc, xr, x_pair_stride, w, K2, 1, K2, nothing); \
    tiles::store_tile<R, NB>(acc, bias, yr, ldy, valid);                     \
    break;                                                                   \
  }
      KUBELLM_TILE(1) KUBELLM_TILE(2) KUBELLM_TILE(3) KUBELLM_TILE(4) KUBELLM_TILE(5) KUBELLM_TILE(6)
#undef KUBELLM_TILE
      default: TORCH_CHECK(false, "bf16_linear: bad row tile ", mr);
    }
    m += mr;
  }
}
#endif

}  // namespace

Bf16LinearItems bf16_linear_items(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                                  const c10::optional<at::Tensor>& bias) {
#ifndef KUBELLM_BF16_TILE
  TORCH_CHECK(false, "bf16_linear needs a build with AVX512-BF16 (-march of a CPU that has it)");
#else
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "packed must be a contiguous [ceil(N/16), ceil(K/2), 16, 2] bfloat16 tensor (cpu_bf16_gemm.pack)");
  Bf16LinearItems it;
  const int64_t K = x_in.size(1);
  it.M = x_in.size(0), it.N = N, it.NBLK = packed.size(0), it.K2 = packed.size(1);
  TORCH_CHECK(it.K2 == (K + 1) / 2, "x has ", K, " columns, the packed weight ", 2 * it.K2, " (pairs of inputs)");
  TORCH_CHECK(N > 16 * (it.NBLK - 1) && N <= 16 * it.NBLK, "N (", N, ") does not fit ", it.NBLK,
              " blocks of 16 channels");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be [N] float32");
    it.bias = bias->const_data_ptr<float>();
  }
  // Pairs of x are read as int32: an odd K (or row stride) gets a zero-padded copy, like the weight's last pair.
  it.x = x_in;
  if (K % 2 != 0 || x_in.stride(1) != 1 || x_in.stride(0) % 2 != 0) {
    it.x = at::zeros({it.M, 2 * it.K2}, x_in.options());
    it.x.narrow(1, 0, K).copy_(x_in);
  }
  it.y = at::empty({it.M, N}, it.x.options());
  it.weight = packed.const_data_ptr<c10::BFloat16>();
  it.nb = tiles::blocks_per_item(it.NBLK, it.M <= kStreamMaxRows && it.M > 4 ? 3 : 4);
  it.items = it.M == 0 || N == 0 ? 0 : (it.NBLK + it.nb - 1) / it.nb;
  return it;
#endif
}

void Bf16LinearItems::run(int64_t begin, int64_t end) const {
#ifdef KUBELLM_BF16_TILE
  const auto* xp = reinterpret_cast<const int32_t*>(x.const_data_ptr<c10::BFloat16>());
  const int64_t x_pair_stride = x.stride(0) / 2;
  const auto* wp = static_cast<const __m512i*>(weight);
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  for (int64_t it = begin; it < end; ++it) {
    const int64_t blk = it * nb;
    const int n = static_cast<int>(std::min<int64_t>(nb, NBLK - blk));
    const __m512i* w = wp + blk * K2;
    const float* bp = bias ? bias + blk * 16 : nullptr;
    c10::BFloat16* yb = yp + blk * 16;
    const int64_t valid = std::min<int64_t>(16 * n, N - 16 * blk);
    if (M <= kStreamMaxRows) {
      switch (M) {
#define KUBELLM_STREAM(R) \
  case R: stream_rows<R>(n, xp, x_pair_stride, w, K2, bp, yb, N, valid); break;
        KUBELLM_STREAM(1) KUBELLM_STREAM(2) KUBELLM_STREAM(3) KUBELLM_STREAM(4)
        KUBELLM_STREAM(5) KUBELLM_STREAM(6) KUBELLM_STREAM(7) KUBELLM_STREAM(8)
#undef KUBELLM_STREAM
      }
      continue;
    }
    switch (n) {
      case 4: item_rows<4>(M, xp, x_pair_stride, w, K2, bp, yb, N, valid); break;
      case 3: item_rows<3>(M, xp, x_pair_stride, w, K2, bp, yb, N, valid); break;
      case 2: item_rows<2>(M, xp, x_pair_stride, w, K2, bp, yb, N, valid); break;
      default: item_rows<1>(M, xp, x_pair_stride, w, K2, bp, yb, N, valid); break;
    }
  }
#endif
}

namespace {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const c10::optional<at::Tensor>& bias) {
  const Bf16LinearItems items = bf16_linear_items(x, packed, N, bias);
  at::parallel_for(0, items.items, 1, [&](int64_t begin, int64_t end) { items.run(begin, end); });
  return items.y;
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.def("bf16_gemm_available() -> bool", &kubellm_cpu::bf16_gemm_available);  // no tensors: not dispatched
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("bf16_linear", &kubellm_cpu::bf16_linear); }
