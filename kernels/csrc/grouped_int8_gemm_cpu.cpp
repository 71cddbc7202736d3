// Weight-only 8-bit GEMM for CPUs with AVX512-BF16, or AVX2 (float32 or bf16 x: avx2_tiles.h, below), with
// per-group scales and optional zero points (GPTQ 8-bit,
// compressed-tensors W8A16, GGUF Q8_0 / Q6_K / Q5_K after runtime/quantization/gguf.py):
//   y[m, n] = sum_g s[g, n] * (sum_{k in g} q[n, k] * x[m, k] - z[g, n] * sum_{k in g} x[m, k])  (+ bias[n])
// with q int8 (-128..127), x and y bfloat16, s and z float32 or float16 (tiles::GroupParams; no z: symmetric). One group (group = K)
// is the per-channel case.
//
// Why: the 8-bit formats keep a scale per 16..128 inputs, which the per-channel int8 kernel cannot take. The
// inner loop (int8_tiles.h, shared with moe_cpu.cpp's 8-bit experts) is the int8 kernel's (each int8 widened to
// bf16 in registers, exact; vdpbf16ps products, float32 sums) run per group, and the scale and zero point are
// applied once per group to the group's partial sum, using the row's sum of x over the group (computed once per
// call, only when there are zero points). That is
// the path for few rows; from kDequantMinRows rows it cost more than the narrower reads save (0.77-0.97x bf16
// at 64 and 256 rows: the widening repeated per tile of 12 rows, the epilogue per row, block and group), so
// each work item's weights are dequantized once per call to bf16 (q - z) * s and the rows run a plain bf16
// GEMM over them (tiles::dequantized_gemm). Those weights are rounded to bf16 before the products, as a bf16
// model's are; per channel without zero points the scale stays in the epilogue and the result is exact.
//
// Layout (kernels/cpu_grouped_int8_gemm.py packs it once): [ceil(N/16)][K/2][16][2] int8, the int8 kernel's
// order; the last block's missing channels are zero and never stored. Scales and zero points [K/group][N].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx2_tiles.h"
#include "gemm_checks.h"
#include "gemm_tiles.h"
#include "int8_tiles.h"

#ifdef KUBELLM_INT8_TILES  // AVX512-BF16 (and F, BW, VL)
#include <immintrin.h>
#define KUBELLM_GROUPED_INT8_GEMM 1
#endif

namespace kubellm_cpu {
namespace {

bool grouped_int8_gemm_available() {  // AVX512-BF16, or AVX2 in a build without it
#if defined(KUBELLM_GROUPED_INT8_GEMM) || defined(KUBELLM_AVX2_TILES)
  return true;
#else
  return false;
#endif
}

bool grouped_int8_gemm_takes_float32() {  // float32 x (and y): the AVX2 build
#ifdef KUBELLM_AVX2_TILES
  return true;
#else
  return false;
#endif
}

#ifdef KUBELLM_GROUPED_INT8_GEMM
constexpr int kMaxRowsG8 = 12;  // MR x NB group sums + MR x NB outputs + NB weights + a broadcast <= 32 zmm
constexpr int64_t kDequantMinRowsG8 = 16;  // from here on the dequantizing path (benchmarks/results/)

// MR rows x NB blocks of 16 outputs (int8_tiles.h's tile); `tail` masks the channels of the last block that exist
// (0xFFFF: all).
template <int MR, int NB, bool ZP>
void micro_kernel_g8(const int32_t* x_pairs, int64_t x_pair_stride, const float* xsum, int64_t groups,
                     const int8_t* w, int64_t w_block_stride, int64_t K2, int64_t group_pairs, tiles::GroupParams scales,
                     tiles::GroupParams zeros, int64_t N, const float* bias, __mmask16 tail, c10::BFloat16* y,
                     int64_t ldy) {
  __m512 out[MR][NB];
  int8::dot_groups<MR, NB, ZP>(x_pairs, x_pair_stride, xsum, groups, w, w_block_stride, K2, group_pairs, scales, zeros,
                               N, 16, tail, out);
  for (int b = 0; b < NB; ++b) {
    const __mmask16 mask = b == NB - 1 ? tail : __mmask16(0xFFFF);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy + b * 16, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(out[r][b], bi)));
  }
}

template <int NB, bool ZP>
void rows_kernel_g8(int mr, const int32_t* x_pairs, int64_t x_pair_stride, const float* xsum, int64_t groups,
                    const int8_t* w, int64_t w_block_stride, int64_t K2, int64_t group_pairs, tiles::GroupParams scales,
                    tiles::GroupParams zeros, int64_t N, const float* bias, __mmask16 tail, c10::BFloat16* y, int64_t ldy) {
  switch (mr) {
#define KUBELLM_ROWS_G8(R)                                                                                       \
  case R:                                                                                                        \
    micro_kernel_g8<R, NB, ZP>(x_pairs, x_pair_stride, xsum, groups, w, w_block_stride, K2, group_pairs, scales, \
                               zeros, N, bias, tail, y, ldy);                                                    \
    break;
    KUBELLM_ROWS_G8(1) KUBELLM_ROWS_G8(2) KUBELLM_ROWS_G8(3) KUBELLM_ROWS_G8(4) KUBELLM_ROWS_G8(5)
    KUBELLM_ROWS_G8(6) KUBELLM_ROWS_G8(7) KUBELLM_ROWS_G8(8) KUBELLM_ROWS_G8(9) KUBELLM_ROWS_G8(10)
    KUBELLM_ROWS_G8(11) KUBELLM_ROWS_G8(12)
#undef KUBELLM_ROWS_G8
    default: TORCH_CHECK(false, "grouped_int8_gemm: bad row tile ", mr);
  }
}

template <bool ZP>
void run_g8(int nb, int mr, const int32_t* xr, int64_t x_pair_stride, const float* xs, int64_t groups,
            const int8_t* w, int64_t w_block_stride, int64_t K2, int64_t group_pairs, tiles::GroupParams sp,
            tiles::GroupParams zp, int64_t N, const float* bp, __mmask16 tail, c10::BFloat16* yr) {
#define KUBELLM_NB_G8(B)                                                                                      \
  rows_kernel_g8<B, ZP>(mr, xr, x_pair_stride, xs, groups, w, w_block_stride, K2, group_pairs, sp, zp, N, bp, \
                        tail, yr, N)
  switch (nb) {
    case 4: KUBELLM_NB_G8(4); break;
    case 3: KUBELLM_NB_G8(3); break;
    case 2: KUBELLM_NB_G8(2); break;
    default: KUBELLM_NB_G8(1); break;
  }
#undef KUBELLM_NB_G8
}

// Many rows: y = x @ dequantized weights (tiles::dequantized_gemm), the dequantization as `kMode` says.
template <tiles::Int8Weights kMode>
void dequantized_g8(int64_t M, const int32_t* xp, int64_t x_pair_stride, const int8_t* wp, int64_t K2,
                    int64_t NBLK, int64_t group_pairs, int64_t groups, tiles::GroupParams sp, tiles::GroupParams zpp,
                    int64_t N, const float* bias_p, __mmask16 last_tail, c10::BFloat16* yp) {
  using Side = tiles::Int8Dequantization<kMode>;
  constexpr bool kWiden = kMode == tiles::Int8Weights::kWiden;
  const int64_t w_block_stride = K2 * 32;
  auto tail_of = [&](int64_t blk, int n) { return blk + n == NBLK ? last_tail : __mmask16(0xFFFF); };
  auto make_side = [&](int64_t blk, int n, __m512i* scratch, __m512* sc) {
    if constexpr (!kWiden) {  // per group and block, {s, z} in the widened lanes' order; missing channels 0
      for (int64_t g = 0; g < groups; ++g)
        for (int b = 0; b < n; ++b) {
          const __mmask16 mask = b == n - 1 ? tail_of(blk, n) : __mmask16(0xFFFF);
          const int64_t i = g * N + (blk + b) * 16;
          tiles::pair_lane_constants(sp.load16(i, mask), zpp.data ? zpp.load16(i, mask) : _mm512_setzero_ps(),
                                     sc + (g * n + b) * 4);
        }
    }
    return Side{wp + blk * w_block_stride, w_block_stride, group_pairs, sc, scratch, n, K2 * n};
  };
  auto output_of = [&](int64_t blk, int n) {  // per channel without zero points: the scale applied here
    return tiles::TileOutput{kWiden ? sp.offset(blk * 16) : tiles::GroupParams{}, bias_p ? bias_p + blk * 16 : nullptr,
                             std::min<int64_t>(n * 16, N - blk * 16)};
  };
  tiles::dequantized_gemm<Side>(M, xp, x_pair_stride, K2, NBLK, kWiden ? 0 : groups * 4, make_side, output_of, yp,
                                N);
}
#endif

#ifdef KUBELLM_AVX2_TILES
// AVX2 (avx2_tiles.h): x widened to float32 once per call, with its group sums where there are zero points;
// work items of nb blocks over all rows, in tiles of one row x up to 3 blocks (decode at batch 1) or up to two
// rows x one block. A row's operations do not depend on its tile.
template <int MR, int NB, typename T>
void g8_avx2_tile(const float* x, int64_t K, const float* xsum, int64_t groups, const int8_t* w,
                  int64_t w_block_stride, int64_t group_pairs, tiles::GroupParams s, tiles::GroupParams z, int64_t N,
                  int64_t valid, const float* bias, T* y) {
  alignas(32) float tile[MR * NB * 16];
  avx2::g8_dot_groups<MR, NB>(x, K, xsum, groups, w, w_block_stride, group_pairs, s, z, N, valid, tile);
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NB * 2; ++i) {
      const int64_t left = valid - i * 8;
      if (left <= 0) break;
      alignas(32) float v[8];
      __m256 t = _mm256_load_ps(tile + (r * NB * 2 + i) * 8);
      if (bias && left >= 8) t = _mm256_add_ps(t, _mm256_loadu_ps(bias + i * 8));
      if (left >= 8) {
        avx2::store_y8(y + r * N + i * 8, t);
        continue;
      }
      _mm256_store_ps(v, t);  // the last block's partial half
      for (int64_t j = 0; j < left; ++j) y[r * N + i * 8 + j] = static_cast<T>(v[j] + (bias ? bias[i * 8 + j] : 0.f));
    }
}

template <typename T>
void grouped_int8_gemm_avx2(const T* xv, int64_t ldx, int64_t M, int64_t K, const int8_t* wp, int64_t NBLK,
                            int64_t group_size, tiles::GroupParams sp, tiles::GroupParams zp, int64_t N,
                            const float* bias_p, T* yp) {
  const int64_t groups = K / group_size, K2 = K / 2, w_block_stride = K2 * 32, group_pairs = group_size / 2;
  thread_local std::vector<float> xf_buffer;  // reused across calls
  xf_buffer.resize(M * K + (zp.data ? M * groups : 0));
  float* xf = xf_buffer.data();
  float* xsum = xf + M * K;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k)
        sum += xf[m * K + k] = static_cast<float>(xv[m * ldx + k]);
      if (zp.data) xsum[m * groups + g] = sum;
    }
  const int nb = M == 1 ? tiles::blocks_per_item(NBLK, 3) : 1;
  tiles::parallel_items(NBLK, nb, [&](int64_t blk, int n) {
    const int8_t* w = wp + blk * w_block_stride;
    const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
    const int64_t valid = std::min<int64_t>(n * 16, N - blk * 16);
    const tiles::GroupParams s = sp.offset(blk * 16), z = zp.offset(blk * 16);
    for (int64_t m0 = 0; m0 < M;) {
      const int rows = M == 1 ? 1 : static_cast<int>(std::min<int64_t>(2, M - m0));
      const float* xr = xf + m0 * K;
      const float* xs = xsum + m0 * groups;
      T* yr = yp + m0 * N + blk * 16;
#define KUBELLM_G8_AVX2(R, B) \
  g8_avx2_tile<R, B>(xr, K, xs, groups, w, w_block_stride, group_pairs, s, z, N, valid, bp, yr)
      switch (rows * 4 + n) {
        case 4 + 3: KUBELLM_G8_AVX2(1, 3); break;
        case 4 + 2: KUBELLM_G8_AVX2(1, 2); break;
        case 4 + 1: KUBELLM_G8_AVX2(1, 1); break;
        case 8 + 1: KUBELLM_G8_AVX2(2, 1); break;
        default: TORCH_CHECK(false, "grouped_int8_gemm: bad AVX2 tile ", rows, " x ", n);
      }
#undef KUBELLM_G8_AVX2
      m0 += rows;
    }
  });
}
#endif

at::Tensor grouped_int8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, int64_t group_size,
                             const c10::optional<at::Tensor>& bias) {
#if !defined(KUBELLM_GROUPED_INT8_GEMM) && !defined(KUBELLM_AVX2_TILES)
  TORCH_CHECK(false, "grouped_int8_gemm needs a build with AVX512-BF16 or AVX2 (-march of a CPU that has it)");
#else
  gemm_checks::check_x(x, grouped_int8_gemm_takes_float32());
  gemm_checks::check_packed(packed, at::kChar, {16, 2},
                            "packed must be a contiguous [ceil(N/16), K/2, 16, 2] int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0), K2 = packed.size(1);
  gemm_checks::check_columns(x, 2 * K2);
  gemm_checks::check_group_size(group_size, 2, K, /*whole_groups=*/true);
  const int64_t groups = K / group_size;
  const int64_t N = gemm_checks::scale_channels(scales, NBLK, "[K/group, N]");
  const tiles::GroupParams sp = tiles::group_params(scales, "scales", groups, N);
  const bool zp = zeros.has_value() && zeros->defined();
  const tiles::GroupParams zpp = zp ? tiles::group_params(*zeros, "zeros", groups, N) : tiles::GroupParams{};
  const float* bias_p = gemm_checks::optional_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef KUBELLM_AVX2_TILES
  if (x.scalar_type() == at::kFloat)
    grouped_int8_gemm_avx2(x.const_data_ptr<float>(), x.stride(0), M, K, packed.const_data_ptr<int8_t>(), NBLK,
                           group_size, sp, zpp, N, bias_p, y.mutable_data_ptr<float>());
  else
    grouped_int8_gemm_avx2(x.const_data_ptr<c10::BFloat16>(), x.stride(0), M, K, packed.const_data_ptr<int8_t>(),
                           NBLK, group_size, sp, zpp, N, bias_p, y.mutable_data_ptr<c10::BFloat16>());
  return y;
#else
  const c10::BFloat16* xv = x.const_data_ptr<c10::BFloat16>();
  const auto* xp = reinterpret_cast<const int32_t*>(xv);
  const int64_t x_pair_stride = x.stride(0) / 2;
  const int8_t* wp = packed.const_data_ptr<int8_t>();
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  const int64_t w_block_stride = K2 * 32, group_pairs = group_size / 2;
  const __mmask16 last_tail = N % 16 ? __mmask16((1u << (N % 16)) - 1) : __mmask16(0xFFFF);
  if (M >= kDequantMinRowsG8) {
    if (groups == 1 && !zp)
      dequantized_g8<tiles::Int8Weights::kWiden>(M, xp, x_pair_stride, wp, K2, NBLK, group_pairs, groups, sp, zpp, N,
                                                 bias_p, last_tail, yp);
    else if (zp)
      dequantized_g8<tiles::Int8Weights::kScaleZero>(M, xp, x_pair_stride, wp, K2, NBLK, group_pairs, groups, sp, zpp,
                                                     N, bias_p, last_tail, yp);
    else
      dequantized_g8<tiles::Int8Weights::kScale>(M, xp, x_pair_stride, wp, K2, NBLK, group_pairs, groups, sp, zpp, N,
                                                 bias_p, last_tail, yp);
    return y;
  }
  at::Tensor xsum_t;  // per row and group, the sum of x (only the zero points need it)
  if (zp) {
    xsum_t = at::empty({M, groups}, x.options().dtype(at::kFloat));
    float* s = xsum_t.mutable_data_ptr<float>();
    at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
      tiles::bf16_group_sums(xv + m0 * x.stride(0), x.stride(0), m1 - m0, K, group_size, s + m0 * groups);
    });
  }
  const float* xsum = zp ? xsum_t.const_data_ptr<float>() : nullptr;
  // As the int4 kernel: few rows, several 16-channel blocks per tile (independent dot-product chains, as many
  // as split evenly over the threads); many rows, one block and up to kMaxRowsG8 rows per tile, so each weight slice is widened once for them all.
  const int nb = M <= 2 ? tiles::blocks_per_item(NBLK, 4) : M <= 6 ? tiles::blocks_per_item(NBLK, 2) : 1;
  const int64_t row_tile = nb == 1 ? kMaxRowsG8 : M;
  at::parallel_for(0, (NBLK + nb - 1) / nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t blk = it * nb;
      const int n = static_cast<int>(std::min<int64_t>(nb, NBLK - blk));
      const __mmask16 tail = blk + n == NBLK ? last_tail : __mmask16(0xFFFF);
      for (int64_t m0 = 0; m0 < M; m0 += row_tile) {
        const int mr = static_cast<int>(std::min<int64_t>(row_tile, M - m0));
        const int32_t* xr = xp + m0 * x_pair_stride;
        const float* xs = zp ? xsum + m0 * groups : nullptr;
        const int8_t* w = wp + blk * w_block_stride;
        const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
        const tiles::GroupParams sb = sp.offset(blk * 16), zb = zpp.offset(blk * 16);
        c10::BFloat16* yr = yp + m0 * N + blk * 16;
        if (zp)
          run_g8<true>(n, mr, xr, x_pair_stride, xs, groups, w, w_block_stride, K2, group_pairs, sb, zb, N, bp, tail,
                       yr);
        else
          run_g8<false>(n, mr, xr, x_pair_stride, xs, groups, w, w_block_stride, K2, group_pairs, sb, zb, N, bp,
                        tail, yr);
      }
    }
  });
  return y;
#endif  // KUBELLM_AVX2_TILES
#endif
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def(
      "grouped_int8_gemm(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int group_size, Tensor? bias) "
      "-> Tensor");
  m.def("grouped_int8_gemm_available() -> bool", &kubellm_cpu::grouped_int8_gemm_available);  // not dispatched
  m.def("grouped_int8_gemm_takes_float32() -> bool", &kubellm_cpu::grouped_int8_gemm_takes_float32);
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("grouped_int8_gemm", &kubellm_cpu::grouped_int8_gemm); }
