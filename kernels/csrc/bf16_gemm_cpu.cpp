// Dense bf16 linear for CPUs with AVX512-BF16, or AVX2 + FMA: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x, w and y
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
//
// On AVX2 (x86-64-v3: AMD Zen 1-3, Intel before AVX-512) the same packed weight is widened in registers: each
// 32-bit lane of a line holds one channel's (w[n, k], w[n, k+1]) pair, so a shift and a mask give the two
// float32 halves, and two FMAs with the row's x[k], x[k+1] (widened once per call) add the pair's products.
// Products of two bf16 values are exact in float32, as vdpbf16ps's are; only the summation order differs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "bf16_linear.h"
#include "gemm_checks.h"
#include "gemm_tiles.h"

namespace kubellm_cpu {
namespace {

#if !defined(KUBELLM_BF16_TILE) && defined(__AVX2__) && defined(__FMA__)
#define KUBELLM_BF16_AVX2 1
#include <immintrin.h>
#endif

bool bf16_gemm_available() {
#if defined(KUBELLM_BF16_TILE) || defined(KUBELLM_BF16_AVX2)
  return true;
#else
  return false;
#endif
}

// Which instructions this build's bf16 linear runs on: "avx512-bf16", "avx2" or "" (none).
std::string bf16_gemm_isa() {
#if defined(KUBELLM_BF16_TILE)
  return "avx512-bf16";
#elif defined(KUBELLM_BF16_AVX2)
  return "avx2";
#else
  return "";
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

#ifdef KUBELLM_BF16_AVX2
constexpr int kAvx2TileRows = 4;  // 4 rows x 16 channels: 8 accumulators, 4 widened weight vectors, 2 broadcasts

// acc (MR rows x 16 channels as two 8-lane halves) over K2 pairs of one block's lines; x rows are float32,
// ldx apart, zero-padded to 2 * K2 columns.
template <int MR>
__attribute__((always_inline)) inline void avx2_block(const float* x, int64_t ldx, const __m256i* w, int64_t K2,
                                                      __m256 (&acc)[MR][2]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * (kp + 16)), _MM_HINT_T0);
    const __m256i lo = _mm256_loadu_si256(w + 2 * kp), hi = _mm256_loadu_si256(w + 2 * kp + 1);
    const __m256 lo_even = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    const __m256 lo_odd = _mm256_castsi256_ps(_mm256_and_si256(lo, high));
    const __m256 hi_even = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
    const __m256 hi_odd = _mm256_castsi256_ps(_mm256_and_si256(hi, high));
    for (int r = 0; r < MR; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * kp);
      const __m256 xo = _mm256_broadcast_ss(x + r * ldx + 2 * kp + 1);
      acc[r][0] = _mm256_fmadd_ps(lo_odd, xo, _mm256_fmadd_ps(lo_even, xe, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(hi_odd, xo, _mm256_fmadd_ps(hi_even, xe, acc[r][1]));
    }
  }
}

// y[r, i] = bf16(acc + bias) for the `valid` first of the block's 16 channels (rounded to nearest even).
template <int MR>
inline void avx2_store(__m256 (&acc)[MR][2], const float* bias, c10::BFloat16* y, int64_t ldy, int64_t valid) {
  alignas(32) float out[16];
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    for (int64_t i = 0; i < std::min<int64_t>(valid, 16); ++i)
      y[r * ldy + i] = c10::BFloat16(bias ? out[i] + bias[i] : out[i]);
  }
}

// All M rows over `n` blocks starting at w, in row tiles of up to kAvx2TileRows (a block's lines stay in L1/L2
// while the row tiles pass over them).
inline void avx2_item(int64_t M, const float* x, int64_t ldx, const __m256i* w, int n, int64_t K2,
                      const float* bias, c10::BFloat16* y, int64_t ldy, int64_t valid) {
  for (int b = 0; b < n; ++b) {
    const __m256i* wb = w + 2 * b * K2;
    const float* bb = bias ? bias + 16 * b : nullptr;
    const int64_t vb = valid - 16 * b;
    for (int64_t m = 0; m < M;) {
      const int mr = static_cast<int>(std::min<int64_t>(kAvx2TileRows, M - m));
      switch (mr) {
#define KUBELLM_AVX2_TILE(R)                                     \
  case R: {                                                      \
    __m256 acc[R][2];                                            \
    avx2_block<R>(x + m * ldx, ldx, wb, K2, acc);                \
    avx2_store<R>(acc, bb, y + m * ldy + 16 * b, ldy, vb);       \
    break;                                                       \
  }
        KUBELLM_AVX2_TILE(1) KUBELLM_AVX2_TILE(2) KUBELLM_AVX2_TILE(3) KUBELLM_AVX2_TILE(4)
#undef KUBELLM_AVX2_TILE
      }
      m += mr;
    }
  }
}
#endif

}  // namespace

Bf16LinearItems bf16_linear_items(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                                  const c10::optional<at::Tensor>& bias) {
#if !defined(KUBELLM_BF16_TILE) && !defined(KUBELLM_BF16_AVX2)
  TORCH_CHECK(false, "bf16_linear needs a build with AVX512-BF16 or AVX2 + FMA (-march of a CPU that has them)");
#else
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  gemm_checks::check_packed(
      packed, at::kBFloat16, {16, 2},
      "packed must be a contiguous [ceil(N/16), ceil(K/2), 16, 2] bfloat16 tensor (cpu_bf16_gemm.pack)");
  Bf16LinearItems it;
  const int64_t K = x_in.size(1);
  it.M = x_in.size(0), it.N = N, it.NBLK = packed.size(0), it.K2 = packed.size(1);
  TORCH_CHECK(it.K2 == (K + 1) / 2, "x has ", K, " columns, the packed weight ", 2 * it.K2, " (pairs of inputs)");
  TORCH_CHECK(N > 16 * (it.NBLK - 1) && N <= 16 * it.NBLK, "N (", N, ") does not fit ", it.NBLK,
              " blocks of 16 channels");
  it.bias = gemm_checks::optional_bias(bias, N);
  // Pairs of x are read as int32: an odd K (or row stride) gets a zero-padded copy, like the weight's last pair.
  it.x = x_in;
  if (K % 2 != 0 || x_in.stride(1) != 1 || x_in.stride(0) % 2 != 0) {
    it.x = at::zeros({it.M, 2 * it.K2}, x_in.options());
    it.x.narrow(1, 0, K).copy_(x_in);
  }
  it.y = at::empty({it.M, N}, it.x.options());
  it.weight = packed.const_data_ptr<c10::BFloat16>();
#ifdef KUBELLM_BF16_TILE
  it.nb = tiles::blocks_per_item(it.NBLK, it.M <= kStreamMaxRows && it.M > 4 ? 3 : 4);
#else
  it.x = it.x.to(at::kFloat);  // widened once: every block's FMAs broadcast from it
  it.nb = tiles::blocks_per_item(it.NBLK, 4);
#endif
  it.items = it.M == 0 || N == 0 ? 0 : (it.NBLK + it.nb - 1) / it.nb;
  return it;
#endif
}

void Bf16LinearItems::run(int64_t begin, int64_t end) const {
#ifdef KUBELLM_BF16_AVX2
  const float* xp = x.const_data_ptr<float>();
  const auto* wp = static_cast<const __m256i*>(weight);
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  for (int64_t it = begin; it < end; ++it) {
    const int64_t blk = it * nb;
    const int n = static_cast<int>(std::min<int64_t>(nb, NBLK - blk));
    avx2_item(M, xp, x.stride(0), wp + 2 * blk * K2, n, K2, bias ? bias + blk * 16 : nullptr, yp + blk * 16, N,
              std::min<int64_t>(16 * n, N - 16 * blk));
  }
#endif
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
  m.def("bf16_gemm_isa() -> str", &kubellm_cpu::bf16_gemm_isa);
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("bf16_linear", &kubellm_cpu::bf16_linear); }
