// Weight-only FP8 (e4m3fn) GEMM for CPUs with AVX512-BF16, with a scale per (output, group of inputs):
//   y[m, n] = sum_g s[g, n] * sum_{k in g} w[n, k] * x[m, k]  (+ bias[n])
// with w e4m3fn (FP8 checkpoints: quant_method fp8, compressed-tensors float-quantized), x and y bfloat16, s
// float32 or float16 (tiles::GroupParams). One group (group = K) is the per-channel (and per-tensor) case; a
// 128 x 128 block scale is a group of 128 inputs per output row. The last group may be shorter (K % group).
//
// Why: a decode step is bound by weight bytes; FP8 reads half of bf16's. Each byte is widened to bf16 in
// registers, exactly (every e4m3 value has 4 significant bits and an exponent bf16 holds as a normal number),
// and multiplied with vdpbf16ps like the int8 kernels, the scale applied once per group. The widening is the
// costly part, so with AVX512-VBMI it is a table lookup: vpermi2b maps the 7 exponent and mantissa bits of 64
// bytes to their bf16's high bytes and, a second time, to its low bytes, the sign bit is OR'd in, and two byte
// unpacks interleave them into the bf16 words: 5 instructions per 64 weights. (The first version, the exact
// float16 trick below for every weight, cost ~10 per 32 and ran batch-1 decode at ~1.15x bf16 instead of ~2x.)
// Without VBMI (Cooper Lake; the portable x86-64-v4-bf16 build) the same words come from that trick: a byte's
// 7 exponent and mantissa bits moved left by 7, its sign to bit 15, are a float16 of w * 2^-8 (the biases are
// 7 and 15), which vcvtph2ps widens exactly, subnormals included (float16 subnormals are converted, not flushed,
// whatever MXCSR's DAZ says); the 2^8 goes into the scale. NaN (0x7f, 0xff) is not kept.
//
// From kDequantMinRows rows each work item's weights are dequantized to bf16 once (w * s rounded to bf16, as
// a bf16 model's weights are) and the rows run over them as a plain bf16 GEMM, like int4_gemm_cpu.cpp. With one
// scale per channel (group >= K: per-channel and per-tensor checkpoints) the scratch holds the widened bytes
// themselves, exact, and the scale multiplies the tile's sums as in the few-rows path: the dequantization is
// then the widening alone (no float conversion), cheap enough from kDequantMinRowsPerChannel rows, and a row
// gets the same bits alone or in a batch.
//
// Layout (kernels/cpu_fp8_gemm.py packs it once): [ceil(N/16)][K/4][64] bytes; for block n0 and inputs k..k+3
// (k % 4 == 0), byte 16 l + 8 p + i holds w[n0 + c, k + 2 p + j] with 2 c + j = 8 l + i (l 0..3, p 0..1, i 0..7):
// the two pairs of inputs' 32 (channel, input) bytes in the int8 kernels' order, 8 at a time, alternating, so
// the byte unpacks (which work within 16-byte lanes) give pair p's bf16 words in vdpbf16ps's operand order.
// The last block's missing channels are zero and never stored. Scales [ceil(K/group)][N].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gemm_checks.h"
#include "gemm_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KUBELLM_FP8_GEMM 1
#endif

namespace kubellm_cpu {
namespace {

bool fp8_gemm_available() {
#ifdef KUBELLM_FP8_GEMM
  return true;
#else
  return false;
#endif
}

#ifdef KUBELLM_FP8_GEMM
constexpr int kMaxRowsF8 = 12;           // MR x NB group sums + MR x NB outputs + the widening's registers <= 32 zmm
// From here on the dequantizing path: below it the cheap widening costs less than a dequantization pass (1 thread,
// SmolLM2 shapes: streaming 1.0-1.2x bf16 at 16-32 rows where dequantizing gave 0.8-1.0x; from 64 the reverse).
constexpr int64_t kDequantMinRows = 48;
// One scale per channel: the widening is the whole dequantization (benchmarks/results/, "batched int4 and FP8").
constexpr int64_t kDequantMinRowsPerChannel = 16;
constexpr int kTileRows = 6;             // bf16 tile: 6 x 4 accumulators + 4 weights + 1 broadcast

#ifdef __AVX512VBMI__
constexpr float kScaleFold = 1.f;  // the words are the bf16 of w

// The bf16 of each e4m3 magnitude (byte & 0x7f), its high bytes and its low bytes: vpermi2b's two 64-byte tables
// each. From c10's own e4m3 conversion (index 0x7f, NaN, is never looked up for a finite weight).
struct E4m3Tables {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};

const E4m3Tables& e4m3_tables() {
  static const E4m3Tables tables = [] {
    E4m3Tables t{};
    for (int v = 0; v < 128; ++v) {
      const float f = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(v), c10::Float8_e4m3fn::from_bits()));
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      t.high[v] = static_cast<uint8_t>(bits >> 24);
      t.low[v] = static_cast<uint8_t>(bits >> 16);  // the rest is zero: 4 significant bits
    }
    return t;
  }();
  return tables;
}

// 64 packed bytes (one block, inputs k..k+3) → the bf16 pairs of inputs (k, k+1) in p0 and (k+2, k+3) in p1.
struct Widen {
  __m512i high0, high1, low0, low1, sign;
  Widen() {
    const E4m3Tables& t = e4m3_tables();
    high0 = _mm512_load_si512(t.high), high1 = _mm512_load_si512(t.high + 64);
    low0 = _mm512_load_si512(t.low), low1 = _mm512_load_si512(t.low + 64);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  __attribute__((always_inline)) void operator()(const uint8_t* src, __m512i& p0, __m512i& p1) const {
    const __m512i bytes = _mm512_loadu_si512(src);
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, bytes, high1), bytes, sign,
                                                   0xF8);  // table | (bytes & 0x80)
    const __m512i low = _mm512_permutex2var_epi8(low0, bytes, low1);
    p0 = _mm512_unpacklo_epi8(low, high);
    p1 = _mm512_unpackhi_epi8(low, high);
  }
};
#else
constexpr float kScaleFold = 256.f;  // the words are the bf16 of w * 2^-8

struct Widen {
  // A word holding a byte twice, shifted right by one (arithmetically), has the byte's sign in bits 15 and 14
  // and its magnitude in bits 7..13: masked, the float16 of w * 2^-8.
  static __m512 half_words(__m256i words) { return _mm512_cvtph_ps(words); }
  static __m512i bf16_words(__m512i doubled) {
    const __m512i h = _mm512_and_si512(_mm512_srai_epi16(doubled, 1), _mm512_set1_epi16(static_cast<short>(0xBF80)));
    return (__m512i)_mm512_cvtne2ps_pbh(half_words(_mm512_extracti64x4_epi64(h, 1)),
                                       half_words(_mm512_castsi512_si256(h)));
  }
  __attribute__((always_inline)) void operator()(const uint8_t* src, __m512i& p0, __m512i& p1) const {
    const __m512i bytes = _mm512_loadu_si512(src);
    p0 = bf16_words(_mm512_unpacklo_epi8(bytes, bytes));
    p1 = bf16_words(_mm512_unpackhi_epi8(bytes, bytes));
  }
};
#endif

// The group's scale of 16 channels (masked: channels of the last block that exist), times what the widening
// left out.
inline __m512 group_scale(tiles::GroupParams scales, int64_t i, __mmask16 mask) {
  const __m512 s = scales.load16(i, mask);
  return kScaleFold == 1.f ? s : _mm512_mul_ps(s, _mm512_set1_ps(kScaleFold));
}

// The channels of block b that exist, of `valid` from the item's first.
inline __mmask16 block_mask(int64_t valid, int b) {
  const int64_t left = valid - b * 16;
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// Few rows: MR rows x NB blocks of 16 outputs from the bytes as stored, the scale applied per group. Each
// block's quad is widened and used at once (two registers live, not 2 NB, beside the MR x NB x 2 sums).
template <int MR, int NB>
void micro_kernel_f8(const int32_t* x_pairs, int64_t x_pair_stride, const uint8_t* w, int64_t w_block_stride,
                     int64_t K4, int64_t group_quads, tiles::GroupParams scales, int64_t N, const float* bias,
                     int64_t valid, c10::BFloat16* y, int64_t ldy) {
  const Widen widen;
  __m512 out[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0, kq0 = 0; kq0 < K4; ++g, kq0 += group_quads) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    const int64_t kq1 = std::min(K4, kq0 + group_quads);
    for (int64_t kq = kq0; kq < kq1; ++kq) {
      for (int b = 0; b < NB; ++b) {
        __m512i p0, p1;
        widen(w + b * w_block_stride + kq * 64, p0, p1);
        for (int r = 0; r < MR; ++r) {
          const int32_t* xr = x_pairs + r * x_pair_stride + 2 * kq;
          acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)_mm512_set1_epi32(xr[0]), (__m512bh)p0);
          acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)_mm512_set1_epi32(xr[1]), (__m512bh)p1);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = group_scale(scales, g * N + b * 16, block_mask(valid, b));
      for (int r = 0; r < MR; ++r) out[r][b] = _mm512_fmadd_ps(acc[r][b], s, out[r][b]);
    }
  }
  tiles::store_tile<MR, NB>(out, bias, y, ldy, valid);
}

template <int NB>
void rows_kernel_f8(int mr, const int32_t* x_pairs, int64_t x_pair_stride, const uint8_t* w, int64_t w_block_stride,
                    int64_t K4, int64_t group_quads, tiles::GroupParams scales, int64_t N, const float* bias,
                    int64_t valid, c10::BFloat16* y, int64_t ldy) {
  switch (mr) {
#define KUBELLM_ROWS_F8(R)                                                                                        \
  case R:                                                                                                         \
    micro_kernel_f8<R, NB>(x_pairs, x_pair_stride, w, w_block_stride, K4, group_quads, scales, N, bias, valid, y, \
                           ldy);                                                                                   \
    break;
    KUBELLM_ROWS_F8(1) KUBELLM_ROWS_F8(2) KUBELLM_ROWS_F8(3) KUBELLM_ROWS_F8(4) KUBELLM_ROWS_F8(5)
    KUBELLM_ROWS_F8(6) KUBELLM_ROWS_F8(7) KUBELLM_ROWS_F8(8) KUBELLM_ROWS_F8(9) KUBELLM_ROWS_F8(10)
    KUBELLM_ROWS_F8(11) KUBELLM_ROWS_F8(12)
#undef KUBELLM_ROWS_F8
    default: TORCH_CHECK(false, "fp8_gemm: bad row tile ", mr);
  }
}

// bf16 pair words (word t: channel t / 2) times per-lane scales, rounded back to bf16 pairs.
inline __m512i scale_pairs(__m512i p, __m512 s_lo, __m512 s_hi) {
  const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(p)), 16));
  const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(p, 1)), 16));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo));
}

// Many rows: one item's nb blocks dequantized into `scratch`, [K/2][nb][16][2] bf16 of w * s (the operand order
// of vdpbf16ps), group by group so each scale is widened once; per_channel: bf16 of w (times 2^-8 without VBMI),
// the scale left to the tile. Missing channels of the last block are zero.
void dequantize_item(const uint8_t* w, int64_t w_block_stride, int64_t K4, int64_t group_quads,
                     tiles::GroupParams scales, int64_t N, int nb, int64_t valid, bool per_channel,
                     __m512i* scratch) {
  const Widen widen;
  if (per_channel) {
    for (int64_t kq = 0; kq < K4; ++kq)
      for (int b = 0; b < nb; ++b) {
        __m512i p0, p1;
        widen(w + b * w_block_stride + kq * 64, p0, p1);
        _mm512_store_si512(scratch + (2 * kq) * nb + b, p0);
        _mm512_store_si512(scratch + (2 * kq + 1) * nb + b, p1);
      }
    return;
  }
  // Word t of a pair vector is channel t / 2: its low 16 words hold channels 0..7, its high 16 words 8..15.
  const __m512i lanes_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i lanes_hi = _mm512_add_epi32(lanes_lo, _mm512_set1_epi32(8));
  for (int b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * w_block_stride;
    for (int64_t g = 0, kq0 = 0; kq0 < K4; ++g, kq0 += group_quads) {
      const __m512 s = group_scale(scales, g * N + b * 16, block_mask(valid, b));
      const __m512 s_lo = _mm512_permutexvar_ps(lanes_lo, s), s_hi = _mm512_permutexvar_ps(lanes_hi, s);
      const int64_t kq1 = std::min(K4, kq0 + group_quads);
      for (int64_t kq = kq0; kq < kq1; ++kq) {
        __m512i p0, p1;
        widen(wb + kq * 64, p0, p1);
        _mm512_store_si512(scratch + (2 * kq) * nb + b, scale_pairs(p0, s_lo, s_hi));
        _mm512_store_si512(scratch + (2 * kq + 1) * nb + b, scale_pairs(p1, s_lo, s_hi));
      }
    }
  }
}

// All M rows of one dequantized item, in tiles of equal size (32 rows: 6 + 6 + 5 + 5 + 5 + 5, not a last tile
// of 2 that would keep few dot-product chains in flight), on the shared bf16 tile; `scale` (per channel, from the
// item's first) multiplies the sums when the scratch holds the bytes unscaled, as micro_kernel_f8 does.
template <int NB>
void item_rows_f8(int64_t M, const int32_t* x_pairs, int64_t x_pair_stride, const __m512i* scratch, int64_t K2,
                  tiles::GroupParams scale, const float* bias, int64_t valid, c10::BFloat16* y, int64_t ldy) {
  __m512 s[NB];
  if (scale.data)
    for (int b = 0; b < NB; ++b) s[b] = group_scale(scale, b * 16, block_mask(valid, b));
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int mr = static_cast<int>(M / tiles + (t < M % tiles));
    const int32_t* xr = x_pairs + m * x_pair_stride;
    c10::BFloat16* yr = y + m * ldy;
    switch (mr) {
#define KUBELLM_TILE_F8(R)                                                                   \
  case R: {                                                                                  \
    __m512 acc[R][NB];                                                                       \
    tiles::bf16_tile<R, NB>(acc, xr, x_pair_stride, scratch, 1, NB, K2, [](int64_t) {});     \
    if (scale.data)                                                                          \
      for (int b = 0; b < NB; ++b)                                                           \
        for (int r = 0; r < R; ++r) acc[r][b] = _mm512_mul_ps(acc[r][b], s[b]);              \
    tiles::store_tile<R, NB>(acc, bias, yr, ldy, valid);                                     \
    break;                                                                                   \
  }
      KUBELLM_TILE_F8(1) KUBELLM_TILE_F8(2) KUBELLM_TILE_F8(3) KUBELLM_TILE_F8(4) KUBELLM_TILE_F8(5)
      KUBELLM_TILE_F8(6)
#undef KUBELLM_TILE_F8
      default: TORCH_CHECK(false, "fp8_gemm: bad row tile ", mr);
    }
    m += mr;
  }
}
#endif

at::Tensor fp8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group_size,
                    const c10::optional<at::Tensor>& bias) {
#ifndef KUBELLM_FP8_GEMM
  TORCH_CHECK(false, "fp8_gemm needs a build with AVX512-BF16 (-march of a CPU that has it)");
#else
  gemm_checks::check_x(x, /*takes_float32=*/false);
  gemm_checks::check_packed(packed, at::kByte, {64},
                            "packed must be a contiguous [ceil(N/16), K/4, 64] uint8 tensor (cpu_fp8_gemm.pack)");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0), K4 = packed.size(1);
  gemm_checks::check_columns(x, 4 * K4);
  gemm_checks::check_group_size(group_size, 4, K, /*whole_groups=*/false);  // a ragged last group is fine
  const int64_t groups = (K + group_size - 1) / group_size;
  const int64_t N = gemm_checks::scale_channels(scales, NBLK, "[ceil(K/group), N]");
  const tiles::GroupParams sp = tiles::group_params(scales, "scales", groups, N);
  const float* bias_p = gemm_checks::optional_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const int32_t*>(x.const_data_ptr<c10::BFloat16>());
  const int64_t x_pair_stride = x.stride(0) / 2;
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  const int64_t w_block_stride = K4 * 64, group_quads = group_size / 4;
  const bool per_channel = groups == 1;
  if (M >= (per_channel ? kDequantMinRowsPerChannel : kDequantMinRows)) {
    // Items of nb blocks split evenly over the threads; each item is dequantized once for all M rows.
    const int nb = tiles::blocks_per_item(NBLK, 4);
    const int64_t K2 = 2 * K4;
    at::parallel_for(0, (NBLK + nb - 1) / nb, 1, [&](int64_t begin, int64_t end) {
      auto* scratch = static_cast<__m512i*>(std::aligned_alloc(64, K2 * nb * sizeof(__m512i)));
      for (int64_t it = begin; it < end; ++it) {
        const int64_t blk = it * nb;
        const int n = static_cast<int>(std::min<int64_t>(nb, NBLK - blk));
        const int64_t valid = N - blk * 16;
        dequantize_item(wp + blk * w_block_stride, w_block_stride, K4, group_quads, sp.offset(blk * 16), N, n, valid,
                        per_channel, scratch);
        const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
#define KUBELLM_ITEM_F8(B)                                                                                   \
  item_rows_f8<B>(M, xp, x_pair_stride, scratch, K2, per_channel ? sp.offset(blk * 16) : tiles::GroupParams{}, bp, \
                  valid, yp + blk * 16, N)
        switch (n) {
          case 4: KUBELLM_ITEM_F8(4); break;
          case 3: KUBELLM_ITEM_F8(3); break;
          case 2: KUBELLM_ITEM_F8(2); break;
          default: KUBELLM_ITEM_F8(1); break;
        }
#undef KUBELLM_ITEM_F8
      }
      std::free(scratch);
    });
    return y;
  }
  // As the grouped int8 kernel: few rows, several 16-channel blocks per tile (independent dot-product chains, as
  // many as split evenly over the threads); more, one block and up to kMaxRowsF8 rows per tile.
  const int nb = M <= 2 ? tiles::blocks_per_item(NBLK, 4) : M <= 6 ? tiles::blocks_per_item(NBLK, 2) : 1;
  const int64_t row_tile = nb == 1 ? kMaxRowsF8 : M;
  at::parallel_for(0, (NBLK + nb - 1) / nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t blk = it * nb;
      const int n = static_cast<int>(std::min<int64_t>(nb, NBLK - blk));
      const int64_t valid = N - blk * 16;
      for (int64_t m0 = 0; m0 < M; m0 += row_tile) {
        const int mr = static_cast<int>(std::min<int64_t>(row_tile, M - m0));
        const int32_t* xr = xp + m0 * x_pair_stride;
        const uint8_t* w = wp + blk * w_block_stride;
        const float* bp = bias_p ? bias_p + blk * 16 : nullptr;
        c10::BFloat16* yr = yp + m0 * N + blk * 16;
#define KUBELLM_NB_F8(B) \
  rows_kernel_f8<B>(mr, xr, x_pair_stride, w, w_block_stride, K4, group_quads, sp.offset(blk * 16), N, bp, valid, yr, \
                    N)
        switch (n) {
          case 4: KUBELLM_NB_F8(4); break;
          case 3: KUBELLM_NB_F8(3); break;
          case 2: KUBELLM_NB_F8(2); break;
          default: KUBELLM_NB_F8(1); break;
        }
#undef KUBELLM_NB_F8
      }
    }
  });
  return y;
#endif
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("fp8_gemm(Tensor x, Tensor packed, Tensor scales, int group_size, Tensor? bias) -> Tensor");
  m.def("fp8_gemm_available() -> bool", &kubellm_cpu::fp8_gemm_available);  // no tensors: not dispatched
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("fp8_gemm", &kubellm_cpu::fp8_gemm); }
