// Weight-only int4 GEMM for CPUs with AVX512-BF16 (both activation kinds below) or AVX2 (int8 activations only,
// float32 or bf16 x: avx2_tiles.h), with per-group scales and zero points (AWQ, GPTQ, compressed-tensors W4A16,
// kubellm's own int4, GGUF 4-bit):
//   y[m, n] = sum_g s[g, n] * (sum_{k in g} q[n, k] * x[m, k] - z[g, n] * sum_{k in g} x[m, k])  (+ bias[n])
// with q in 0..15 (unsigned nibbles; a symmetric format passes z = 8), x and y bfloat16, s and z float32 or
// float16 (each its own; tiles::GroupParams).
//
// Why: a decode step is bound by weight bytes; int4 reads a quarter of bf16's. The nibbles are widened to bf16
// in registers and multiplied with vdpbf16ps like the int8 kernel, and the widening is the costly part, so it
// is two bit operations per 16 lanes: a nibble v OR'd into the bits 0x4300 is the bf16 of 128 + v (exact: 7
// mantissa bits), so the dot products sum x * (q + 128) and the epilogue subtracts (z + 128) * sum(x) per
// group with the scale, using the row's sums of x over each group (computed once per call). (A vpermw table
// lookup of each nibble pair, the first version, cost three times the instructions.) That is the path for few
// rows; from kDequantMinRows rows the weights are dequantized to bf16 once per call instead (below).
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
#include <vector>

#include "gemm_checks.h"
#include "gemm_tiles.h"
#include "avx2_tiles.h"
#include "int4_tiles.h"
#include "w4a8_tiles.h"

#ifdef KUBELLM_INT4_TILES
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

bool int4_gemm_int8_available() {  // int4_gemm's int8_activations (AVX512-VNNI, or AVX2 in a build without AVX-512)
#if (defined(KUBELLM_INT4_GEMM) && defined(KUBELLM_W4A8_TILES)) || defined(KUBELLM_AVX2_TILES)
  return true;
#else
  return false;
#endif
}

bool int4_gemm_takes_float32() {  // float32 x (and y): the AVX2 build's int8 activations
#ifdef KUBELLM_AVX2_TILES
  return true;
#else
  return false;
#endif
}

// Per call, `rows` rows of int8 activations (K4 quads each) with their per-group scales and sums, in the calling
// thread's buffers, reused across calls (two tensor allocations cost ~5% of a 576x576 call).
struct QuantizedRows {
  int32_t* xq;
  float* scale;
  float* qsum;
};
[[maybe_unused]] inline QuantizedRows quantized_rows(int64_t rows, int64_t K4, int64_t groups) {
  thread_local std::vector<int32_t> xq_buffer;
  thread_local std::vector<float> params;
  xq_buffer.resize(rows * K4);
  params.resize(2 * rows * groups);
  return {xq_buffer.data(), params.data(), params.data() + rows * groups};
}

#ifdef KUBELLM_INT4_GEMM
constexpr int kMaxRows4 = 12;  // MR group sums + MR outputs + two weights, two broadcasts, two constants <= 32 zmm

// Adds the bias to a tile's float32 results and stores them as bf16 rows of y.
template <int MR, int NB>
__attribute__((always_inline)) inline void store_tile(const __m512 (&out)[MR][NB], const float* bias, c10::BFloat16* y,
                                                      int64_t ldy) {
  for (int b = 0; b < NB; ++b) {
    const __m512 bi = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + b * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(out[r][b], bi)));
  }
}

template <int MR, int NB>
void micro_kernel4(const int32_t* x_pairs, int64_t x_pair_stride, const float* xsum, int64_t groups,
                   const uint8_t* w, int64_t w_block_stride, int64_t K4, int64_t group_quads,
                   tiles::GroupParams scales, tiles::GroupParams zeros, int64_t N, const float* bias, c10::BFloat16* y, int64_t ldy) {
  __m512 out[MR][NB];
  int4::dot_groups<MR, NB>(x_pairs, x_pair_stride, xsum, groups, w, w_block_stride, K4, group_quads, scales, zeros,
                           N, 16, out, NB * w_block_stride);  // prefetch the next item (int4_tiles.h)
  store_tile<MR, NB>(out, bias, y, ldy);
}

// Many rows: the kernel above pays its per-group epilogue (two FMAs per row, block and group) for every row,
// which left it ~13% behind bf16's GEMM from 32 rows up. Instead each work item's weights are dequantized to
// bf16 once and the rows run a plain bf16 GEMM over them (tiles::dequantized_gemm); done as a pass of its own
// the dequantization cost ~15% of the GEMM at 32 rows, spread over the previous item's GEMM ~3 points less.
// The weights are rounded to bf16 before the products, as a bf16 model's are.
constexpr int64_t kDequantMinRows = 16;  // from here on the dequantizing path (benchmarks/results/)

// Per group and block, the scale and offset the dequantization multiplies and adds, in the lane order of
// dequantize_quad: sc[(g * nb + b) * 4 + {S0, C0, S1, C1}] (tiles::pair_lane_constants).
void dequant_constants(tiles::GroupParams scales, tiles::GroupParams zeros, int64_t N, int64_t groups, int nb,
                       __m512* sc) {
  for (int64_t g = 0; g < groups; ++g)
    for (int b = 0; b < nb; ++b) {
      const __m512 s = scales.load16(g * N + b * 16);
      const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(-16.f), zeros.load16(g * N + b * 16)), s);
      tiles::pair_lane_constants(_mm512_mul_ps(s, _mm512_set1_ps(16.f)), c, sc + (g * nb + b) * 4);
    }
}

// One block's quad of inputs k..k+3 (32 packed bytes) as bf16 of (q - z) * s: the (k, k+1) pairs of its 16
// channels in p01, the (k+2, k+3) pairs in p23. Zero-extending 16 bytes to dwords puts channel i / 2's byte j in
// lane i (i = 2c + j), the order vcvtne2ps2bf16 interleaves into pairs, so no shuffle is needed; a nibble v
// shifted into the mantissa of 1.0 is the float 1 + v / 16 (exact), and (1 + v / 16) * 16 s - (16 + z) s is the
// weight in one FMA.
// (Inlined by force: called out of line from the GEMM loop, it would spill all the accumulators, 2x slower.)
__attribute__((always_inline)) inline void dequantize_quad(const uint8_t* bytes, const __m512* sc, __m512i& p01,
                                                           __m512i& p23) {
  const __m512i mant = _mm512_set1_epi32(0x00780000);  // the 4 mantissa bits a nibble lands in
  const __m512i one = _mm512_set1_epi32(0x3F800000);
  const __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
  auto weight = [&](__m512i d, int shift, int half) {  // low nibble: shift 19, high: 15
    const __m512 v = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_slli_epi32(d, shift), mant, one, 0xEA));
    return _mm512_fmadd_ps(v, sc[2 * half], sc[2 * half + 1]);
  };
  p01 = (__m512i)_mm512_cvtne2ps_pbh(weight(d1, 19, 1), weight(d0, 19, 0));
  p23 = (__m512i)_mm512_cvtne2ps_pbh(weight(d1, 15, 1), weight(d0, 15, 0));
}

// The dequantization of one item into its scratch (a tiles::dequantized_gemm side), a quad (64 weights) a
// step, block by block within each quad of inputs (counters rather than divisions: this runs inside the GEMM's
// inner loop).
struct Dequantization {
  const uint8_t* w = nullptr;  // the item's first block
  int64_t w_block_stride = 0, group_quads = 1;
  const __m512* sc = nullptr;  // dequant_constants of the item
  __m512i* scratch = nullptr;
  int nb = 1;
  int64_t left = 0;  // quads still to do
  int64_t kq = 0, g = 0, in_group = 0;
  int b = 0;

  __attribute__((always_inline)) void step() {
    __m512i p01, p23;
    dequantize_quad(w + b * w_block_stride + kq * 32, sc + (g * nb + b) * 4, p01, p23);
    _mm512_store_si512(scratch + (2 * kq) * nb + b, p01);
    _mm512_store_si512(scratch + (2 * kq + 1) * nb + b, p23);
    --left;
    if (++b == nb) {
      b = 0;
      ++kq;
      if (++in_group == group_quads) in_group = 0, ++g;
    }
  }
  void finish() {  // on a local copy (tiles::dequantized_tile says why)
    auto local = *this;
    while (local.left > 0) local.step();
    *this = local;
  }
};

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

#ifdef KUBELLM_W4A8_TILES
// int8 activations (w4a8_tiles.h). Rows in blocks of 8; the last block's 1-7 rows: 1-2 as plain rows (decode at
// batch 1 and 2: dot_groups, two rows over items of 3-4 blocks in the assembly dot_groups_two_rows), 3-4 / 5-6 / 7
// in a block of 4 / 6 / 8 padded with zero rows.
// Blocks of 3-8 rows run the assembly tile dot_groups_rows over items of up to 2 blocks (the item's weights,
// L1-resident after its first row block, are read from memory once per call). Against native bf16 (1 thread,
// cache-resident) it runs 1.1-1.3x from 8 to 1024 rows, where dot_groups in intrinsics ran 0.83-0.98x at 4-32
// rows (benchmarks/results/, 2026-11-28).

// Adds the bias to the first `rows` rows of a float32 tile (row r, block b at tile[(r * NB + b) * 16 ..]) and
// stores them as bf16 rows of y: store_tile for the assembly tiles, whose results are in memory.
template <int NB>
void store_float_tile(const float* tile, int rows, const float* bias, c10::BFloat16* y, int64_t ldy) {
  for (int b = 0; b < NB; ++b) {
    const __m512 bi = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + b * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(tile + (r * NB + b) * 16), bi)));
  }
}

// dot_groups_rows over one row block, then the store of its first `rows` rows.
template <int MR, int NB>
void w4a8_rows_kernel(int rows, const int32_t* xq, const float* scale, const float* qsum, int64_t groups,
                      const uint8_t* w, int64_t w_block_stride, int64_t group_quads, tiles::GroupParams scales,
                      tiles::GroupParams zeros, int64_t N, const float* bias, c10::BFloat16* y, int64_t ldy,
                      int64_t prefetch_bytes) {
  alignas(64) float tile[MR * NB * 16];
  w4a8::dot_groups_rows<MR, NB>(xq, scale, qsum, groups, w, w_block_stride, group_quads, scales, zeros, N, tile,
                                prefetch_bytes);
  store_float_tile<NB>(tile, rows, bias, y, ldy);
}

// dot_groups_two_rows over two plain rows, then their store.
template <int NB>
void w4a8_two_rows_kernel(const int32_t* xq, int64_t x_stride, const float* scale, const float* qsum, int64_t groups,
                          const uint8_t* w, int64_t w_block_stride, int64_t group_quads, tiles::GroupParams scales,
                          tiles::GroupParams zeros, int64_t N, const float* bias, c10::BFloat16* y, int64_t ldy,
                          int64_t prefetch_bytes) {
  alignas(64) float tile[2 * NB * 16];
  w4a8::dot_groups_two_rows<NB>(xq, x_stride, scale, qsum, groups, w, w_block_stride, group_quads, scales, zeros, N,
                                tile, prefetch_bytes);
  store_float_tile<NB>(tile, 2, bias, y, ldy);
}

// y's M rows from x quantized to int8.
void w4a8_gemm(const at::Tensor& x, const uint8_t* wp, int64_t NBLK, int64_t K4, int64_t group_size,
               tiles::GroupParams sp, tiles::GroupParams zp, const float* bias_p, c10::BFloat16* yp) {
  const int64_t M = x.size(0), K = x.size(1), N = NBLK * 16, groups = K / group_size;
  // Row block i: rows 8i.. (size 0: `rows` plain rows, 1 or 2; else interleaved, padded to `size`).
  struct RowBlock {
    int64_t m0, rows, size;
  };
  const int64_t num_blocks = (M + 7) / 8;
  auto row_block = [M](int64_t i) {
    const int64_t rows = std::min<int64_t>(8, M - 8 * i);
    return RowBlock{8 * i, rows, rows <= 2 ? 0 : rows <= 4 ? 4 : rows <= 6 ? 6 : 8};
  };
  const RowBlock last = row_block(num_blocks - 1);
  const int64_t padded = last.m0 + std::max(last.rows, last.size);
  const QuantizedRows quantized = quantized_rows(padded, K4, groups);
  int32_t* xq = quantized.xq;
  float *scale = quantized.scale, *qsum = quantized.qsum;
  const c10::BFloat16* xv = x.const_data_ptr<c10::BFloat16>();
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RowBlock rb = row_block(i);
      for (int64_t m = rb.m0; m < rb.m0 + (rb.size ? 1 : rb.rows); ++m)  // an interleaved block, or each plain row
        w4a8::quantize_block(xv + m * x.stride(0), x.stride(0), rb.size ? rb.rows : 1,
                             std::max<int64_t>(rb.size, 1), K, group_size, xq + m * K4, scale + m * groups,
                             qsum + m * groups);
    }
  };
  // The quantization is ~10% of a call from 32 rows (64 x 576: ~10 of 76 us on one thread); split over the
  // threads from 4 row blocks, below which a second parallel region costs about what it saves.
  if (num_blocks >= 4)
    at::parallel_for(0, num_blocks, 1, quantize);
  else
    quantize(0, num_blocks);
  const int64_t w_block_stride = K4 * 32, group_quads = group_size / 4;
  const int nb = tiles::blocks_per_item(NBLK, M <= 2 ? 4 : 2);
  at::parallel_for(0, (NBLK + nb - 1) / nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t blk = it * nb;
      const int n = static_cast<int>(std::min<int64_t>(nb, NBLK - blk));
      const uint8_t* w = wp + blk * w_block_stride;
      const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
      const int64_t ahead = blk + n < NBLK ? n * w_block_stride : 0;  // the next item
      const tiles::GroupParams s = sp.offset(blk * 16), z = zp.offset(blk * 16);
      for (int64_t i = 0; i < num_blocks; ++i) {
        const RowBlock rb = row_block(i);
        const int rows = static_cast<int>(rb.rows);
        const int64_t pf = rb.m0 == 0 ? ahead : 0;  // later row blocks find the item in cache
        const int32_t* xr = xq + rb.m0 * K4;
        const float* sr = scale + rb.m0 * groups;
        const float* qr = qsum + rb.m0 * groups;
        c10::BFloat16* yr = yp + rb.m0 * N + blk * 16;
#define KUBELLM_W4A8_PLAIN(R, B)                                                                              \
  case B: {                                                                                                   \
    __m512 out[R][B];                                                                                         \
    w4a8::dot_groups<R, B>(xr, K4, sr, qr, groups, w, w_block_stride, K4, group_quads, s, z, N, out, pf);     \
    store_tile<R, B>(out, bp, yr, N);                                                                         \
    break;                                                                                                    \
  }
#define KUBELLM_W4A8_PLAIN_ROWS(R) \
  switch (n) { KUBELLM_W4A8_PLAIN(R, 4) KUBELLM_W4A8_PLAIN(R, 3) KUBELLM_W4A8_PLAIN(R, 2) KUBELLM_W4A8_PLAIN(R, 1) }
#define KUBELLM_W4A8_ROWS(R, B) \
  w4a8_rows_kernel<R, B>(rows, xr, sr, qr, groups, w, w_block_stride, group_quads, s, z, N, bp, yr, N, pf)
        switch (rb.size * 2 + (n == 2)) {
          case 0:
          case 1:
            if (rows == 1) {
              KUBELLM_W4A8_PLAIN_ROWS(1)
            } else if (n >= 3) {  // two rows over 3-4 blocks: the assembly tile
              if (n == 4)
                w4a8_two_rows_kernel<4>(xr, K4, sr, qr, groups, w, w_block_stride, group_quads, s, z, N, bp, yr, N, pf);
              else
                w4a8_two_rows_kernel<3>(xr, K4, sr, qr, groups, w, w_block_stride, group_quads, s, z, N, bp, yr, N, pf);
            } else {
              KUBELLM_W4A8_PLAIN_ROWS(2)
            }
            break;
          case 8: KUBELLM_W4A8_ROWS(4, 1); break;
          case 9: KUBELLM_W4A8_ROWS(4, 2); break;
          case 12: KUBELLM_W4A8_ROWS(6, 1); break;
          case 13: KUBELLM_W4A8_ROWS(6, 2); break;
          case 16: KUBELLM_W4A8_ROWS(8, 1); break;
          default: KUBELLM_W4A8_ROWS(8, 2); break;
        }
#undef KUBELLM_W4A8_PLAIN_ROWS
#undef KUBELLM_W4A8_PLAIN
#undef KUBELLM_W4A8_ROWS
      }
    }
  });
}
#endif

#ifdef KUBELLM_AVX2_TILES
// int8 activations on AVX2 (avx2_tiles.h): every row quantized once per call, then work items of nb blocks over
// all rows, in tiles of one row x up to 4 blocks (decode at batch 1), two rows x up to 2 blocks (batch 2), or
// up to 4 rows x one block (more rows: each quad of weights widened once for 4 rows). A row's operations do not
// depend on its tile, so its bits do not depend on the batch.
template <int MR, int NB, typename T>
void w4a8_avx2_tile(const int32_t* xq, int64_t K4, const float* scale, const float* qsum, int64_t groups,
                    const uint8_t* w, int64_t w_block_stride, int64_t group_quads, tiles::GroupParams s,
                    tiles::GroupParams z, int64_t N, const float* bias, T* y) {
  alignas(32) float tile[MR * NB * 16];
  avx2::w4a8_dot_groups<MR, NB>(xq, K4, scale, qsum, groups, w, w_block_stride, group_quads, s, z, N, tile);
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NB * 2; ++i) {
      __m256 v = _mm256_load_ps(tile + (r * NB * 2 + i) * 8);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i * 8));
      avx2::store_y8(y + r * N + i * 8, v);
    }
}

template <typename T>
void w4a8_gemm_avx2(const T* xv, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, int64_t NBLK, int64_t group_size,
                    tiles::GroupParams sp, tiles::GroupParams zp, const float* bias_p, T* yp) {
  const int64_t K4 = K / 4, N = NBLK * 16, groups = K / group_size;
  const QuantizedRows quantized = quantized_rows(M, K4, groups);
  int32_t* xq = quantized.xq;
  float *scale = quantized.scale, *qsum = quantized.qsum;
  auto quantize = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      avx2::quantize_row(xv + m * ldx, K, group_size, xq + m * K4, scale + m * groups, qsum + m * groups);
  };
  if (M >= 8)
    at::parallel_for(0, M, 4, quantize);
  else
    quantize(0, M);
  const int64_t w_block_stride = K4 * 32, group_quads = group_size / 4;
  const int nb = M == 1 ? tiles::blocks_per_item(NBLK, 4) : M == 2 ? tiles::blocks_per_item(NBLK, 2) : 1;
  tiles::parallel_items(NBLK, nb, [&](int64_t blk, int n) {
    const uint8_t* w = wp + blk * w_block_stride;
    const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
    const tiles::GroupParams s = sp.offset(blk * 16), z = zp.offset(blk * 16);
    for (int64_t m0 = 0; m0 < M;) {
      const int rows = M <= 2 ? static_cast<int>(M) : static_cast<int>(std::min<int64_t>(4, M - m0));
      const int32_t* xr = xq + m0 * K4;
      const float* sr = scale + m0 * groups;
      const float* qr = qsum + m0 * groups;
      T* yr = yp + m0 * N + blk * 16;
#define KUBELLM_W4A8_AVX2(R, B) \
  w4a8_avx2_tile<R, B>(xr, K4, sr, qr, groups, w, w_block_stride, group_quads, s, z, N, bp, yr)
      switch (rows * 8 + n) {
        case 8 + 4: KUBELLM_W4A8_AVX2(1, 4); break;
        case 8 + 3: KUBELLM_W4A8_AVX2(1, 3); break;
        case 8 + 2: KUBELLM_W4A8_AVX2(1, 2); break;
        case 8 + 1: KUBELLM_W4A8_AVX2(1, 1); break;
        case 16 + 2: KUBELLM_W4A8_AVX2(2, 2); break;
        case 16 + 1: KUBELLM_W4A8_AVX2(2, 1); break;
        case 24 + 1: KUBELLM_W4A8_AVX2(3, 1); break;
        case 32 + 1: KUBELLM_W4A8_AVX2(4, 1); break;
        default: TORCH_CHECK(false, "int4_gemm: bad AVX2 tile ", rows, " x ", n);
      }
#undef KUBELLM_W4A8_AVX2
      m0 += rows;
    }
  });
}
#endif

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t group_size, const c10::optional<at::Tensor>& bias,
                     bool int8_activations) {
#if !defined(KUBELLM_INT4_GEMM) && !defined(KUBELLM_AVX2_TILES)
  TORCH_CHECK(false, "int4_gemm needs a build with AVX512-BF16 or AVX2 (-march of a CPU that has it)");
#else
  gemm_checks::check_x(x, int4_gemm_takes_float32());
  gemm_checks::check_packed(packed, at::kByte, {16, 2},
                            "packed must be a contiguous [N/16, K/4, 16, 2] uint8 tensor (cpu_int4_gemm.pack)");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0), K4 = packed.size(1), N = NBLK * 16;
  gemm_checks::check_columns(x, 4 * K4);
  gemm_checks::check_group_size(group_size, 4, K, /*whole_groups=*/true);
  const int64_t groups = K / group_size;
  const tiles::GroupParams sp = tiles::group_params(scales, "scales", groups, N);
  const tiles::GroupParams zp = tiles::group_params(zeros, "zeros", groups, N);
  const float* bias_p = gemm_checks::optional_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
#ifdef KUBELLM_AVX2_TILES
  TORCH_CHECK(int8_activations, "int4_gemm: bf16 activations need a build with AVX512-BF16; this AVX2 build "
              "takes int8_activations=True");
  if (x.scalar_type() == at::kFloat)
    w4a8_gemm_avx2(x.const_data_ptr<float>(), x.stride(0), M, K, wp, NBLK, group_size, sp, zp, bias_p,
                   y.mutable_data_ptr<float>());
  else
    w4a8_gemm_avx2(x.const_data_ptr<c10::BFloat16>(), x.stride(0), M, K, wp, NBLK, group_size, sp, zp, bias_p,
                   y.mutable_data_ptr<c10::BFloat16>());
  return y;
#else
  const c10::BFloat16* xv = x.const_data_ptr<c10::BFloat16>();
  const auto* xp = reinterpret_cast<const int32_t*>(xv);
  const int64_t x_pair_stride = x.stride(0) / 2;
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  if (int8_activations) {
#ifdef KUBELLM_W4A8_TILES
    w4a8_gemm(x, wp, NBLK, K4, group_size, sp, zp, bias_p, yp);
    return y;
#else
    TORCH_CHECK(false, "int4_gemm: int8 activations need a build with AVX512-VNNI");
#endif
  }
  const int64_t w_block_stride = K4 * 32, group_quads = group_size / 4;
  if (M >= kDequantMinRows) {
    auto make_side = [&](int64_t blk, int n, __m512i* scratch, __m512* sc) {
      dequant_constants(sp.offset(blk * 16), zp.offset(blk * 16), N, groups, n, sc);
      return Dequantization{wp + blk * w_block_stride, w_block_stride, group_quads, sc, scratch, n, K4 * n};
    };
    auto output_of = [&](int64_t blk, int) {
      return tiles::TileOutput{{}, bias_p ? bias_p + blk * 16 : nullptr};
    };
    tiles::dequantized_gemm<Dequantization>(M, xp, x_pair_stride, 2 * K4, NBLK, groups * 4, make_side, output_of,
                                            yp, N);
    return y;
  }
  // Per row and group, the sum of x (float32 of the bf16 values the products use).
  at::Tensor xsum_t = at::empty({M, groups}, x.options().dtype(at::kFloat));
  float* xsum_w = xsum_t.mutable_data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    tiles::bf16_group_sums(xv + m0 * x.stride(0), x.stride(0), m1 - m0, K, group_size, xsum_w + m0 * groups);
  });
  const float* xsum = xsum_w;
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
#endif  // KUBELLM_AVX2_TILES
#endif
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size, Tensor? bias, "
        "bool int8_activations=False) -> Tensor");
  m.def("int4_gemm_available() -> bool", &kubellm_cpu::int4_gemm_available);  // no tensors: not dispatched
  m.def("int4_gemm_int8_available() -> bool", &kubellm_cpu::int4_gemm_int8_available);
  m.def("int4_gemm_takes_float32() -> bool", &kubellm_cpu::int4_gemm_takes_float32);
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("int4_gemm", &kubellm_cpu::int4_gemm); }
