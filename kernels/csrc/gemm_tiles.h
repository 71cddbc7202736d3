// Helpers shared by the CPU GEMMs: the bf16 register tile of vdpbf16ps on weights in its operand layout
// (bf16_gemm_cpu.cpp, int4_gemm_cpu.cpp; int8/fp8 kernels widen into the same layout), how many 16-channel
// blocks one work item takes; for the weight-only GEMMs with zero points (int4, grouped int8) the per-group sums
// of x the zero points multiply and the per-group scales and zero points in float32 or float16; and the
// many-rows path of the weight-only GEMMs (int4, int8, grouped int8): each work item's weights dequantized
// once into a bf16 scratch that the bf16 tile runs over (dequantized_gemm).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

namespace kubellm_cpu {
namespace tiles {

// out[m * groups + g] = float32 sum of x[m, g * group .. (g + 1) * group) (x bfloat16 with row stride ldx).
// Vectorised: at batch 1 this runs once per GEMM call and a scalar loop with a division per element cost as
// much as a small layer's whole GEMM.
inline void bf16_group_sums(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t group, float* out) {
  const int64_t groups = K / group;
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = reinterpret_cast<const uint16_t*>(x + m * ldx);
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* src = row + g * group;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) {
        const __mmask16 mask = group - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (group - k)) - 1);
        const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src + k));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
      }
      out[m * groups + g] = _mm512_reduce_add_ps(acc);
#else
      float s = 0.f;
      for (int64_t k = 0; k < group; ++k) s += static_cast<float>(c10::BFloat16(src[k], c10::BFloat16::from_bits()));
      out[m * groups + g] = s;
#endif
    }
  }
}

// Per-group scales or zero points, [K/group][N] float32 or float16. float16 holds GGUF's d and AWQ/GPTQ's
// scales and integer zero points exactly at half the bytes (the loader narrows only what stays exact); they are
// widened 16 channels at a time, once per group and block, outside the inner loop.
struct GroupParams {
  const void* data = nullptr;
  bool half = false;

  GroupParams offset(int64_t i) const {
    return {data ? static_cast<const char*>(data) + i * (half ? 2 : 4) : nullptr, half};
  }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  __m512 load16(int64_t i, __mmask16 mask = __mmask16(0xFFFF)) const {
    if (half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(data) + i));
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(data) + i);
  }
#endif
};

// `t` as GroupParams after checking it is a contiguous [groups, N] float32 or float16 tensor.
inline GroupParams group_params(const at::Tensor& t, const char* what, int64_t groups, int64_t N) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == groups && t.size(1) == N && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
              what, " must be contiguous [K/group, N] = [", groups, ", ", N, "] float32 or float16, got ", t.sizes(),
              " ", t.scalar_type());
  return {t.const_data_ptr(), t.scalar_type() == at::kHalf};
}

// Blocks of 16 channels per work item, from 1..max_nb: the fewest blocks on the busiest thread (work items are
// split evenly over the threads), the most blocks per item among equals (more independent dot-product chains).
// E.g. 12 blocks on 2 threads: 3 per item (2 items each) rather than 4 (one thread takes 8 blocks).
inline int blocks_per_item(int64_t nblk, int max_nb) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int best = 1;
  int64_t best_load = std::numeric_limits<int64_t>::max();
  for (int nb = max_nb; nb >= 1; --nb) {
    const int64_t items = (nblk + nb - 1) / nb;
    const int64_t load = (items + threads - 1) / threads * nb;
    if (load < best_load) best = nb, best_load = load;
  }
  return best;
}

// f(first block, blocks) for each work item of nb 16-channel blocks (the last may have fewer), split over the
// threads.
template <typename F>
void parallel_items(int64_t nblk, int nb, F&& f) {
  at::parallel_for(0, (nblk + nb - 1) / nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) f(it * nb, static_cast<int>(std::min<int64_t>(nb, nblk - it * nb)));
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KUBELLM_BF16_TILE 1
// The vdpbf16ps operand layout: per block of 16 output channels and pair of inputs (k, k+1), one 64-byte line
// holding the 16 channels' (w[n, k], w[n, k+1]) bf16 pairs. A tile reads the line of block b and pair kp at
// w + b * block_stride + kp * pair_stride (in lines): [N/16][K/2][16][2] is (K/2, 1) (a packed bf16 weight),
// a per-item scratch [K/2][NB][16][2] is (1, NB) (int4's dequantized blocks).

// y[r, b * 16 + i] = bf16(acc[r][b] + bias) for the `valid` first channels (a partial last block is masked).
template <int MR, int NB>
__attribute__((always_inline)) inline void store_tile(__m512 (&acc)[MR][NB], const float* bias, c10::BFloat16* y,
                                                      int64_t ldy, int64_t valid = NB * 16) {
  for (int b = 0; b < NB; ++b) {
    const int64_t left = valid - b * 16;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy + b * 16, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bi)));
  }
}

// acc[r][b] (zeroed here) = sum over the K2 input pairs of row r's pair . block b's line. x_pairs: each row's
// (x[k], x[k+1]) bf16 pairs as int32, rows x_pair_stride apart. Per pair, NB line loads and MR broadcasts feed
// MR x NB vdpbf16ps (MR x NB <= 24 keeps the accumulators, the NB lines and a broadcast in the 32 registers).
// side(kp) runs after each pair: work interleaved with the products (int4's next dequantization), or nothing.
template <int MR, int NB, typename Side>
__attribute__((always_inline)) inline void bf16_tile(__m512 (&acc)[MR][NB], const int32_t* x_pairs,
                                                     int64_t x_pair_stride, const __m512i* w, int64_t block_stride,
                                                     int64_t pair_stride, int64_t K2, Side&& side) {
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + b * block_stride + kp * pair_stride);
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(x_pairs[r * x_pair_stride + kp]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
    }
    side(kp);
  }
}

// ---- Many rows: dequantize each work item once, then a plain bf16 GEMM over it ----
//
// Widening (or dequantizing) the weights inside the row loop repeats that work for every tile of rows, and a
// per-group epilogue costs FMAs per row, block and group; from a few dozen rows that left the weight-only
// kernels 3-23% behind bf16's GEMM. Instead each work item's nb blocks of 16 channels are dequantized once into
// a bf16 scratch in vdpbf16ps's pair layout, [K/2][nb][16][2], and all rows run over it as a plain bf16 GEMM.
// The next item's dequantization is spread over the current item's GEMM (a few steps every few pairs of
// inputs, into a second scratch), so it overlaps the dot products instead of running as a pass of its own;
// only a thread's first item is dequantized alone.
//
// A kernel supplies the dequantization as a "side" type: default-constructible (nothing to do), with fields
// `scratch` (its item's buffer), `nb` (blocks in the item) and `left` (steps still to do), and `step()` (one
// step, inlined into the GEMM loop) and `finish()`; one step should be ~32-64 weights.

// 32 int8 = 16 channels' (q[k], q[k+1]) pairs -> 16 lanes of bf16 pairs (exact: |q| <= 128 needs 8 bits).
// Byte i lands in bf16 element i (channel i / 2, input k + i % 2), the order vdpbf16ps reads.
__attribute__((always_inline)) inline void widen_int8_pairs(const int8_t* src, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
}
__attribute__((always_inline)) inline __m512i widen_int8_pairs(const int8_t* src) {
  __m512 lo, hi;
  widen_int8_pairs(src, lo, hi);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// Two per-channel vectors (channel c in lane c) in the lane order of a widened pair slice, where lane i holds
// channel i / 2 (channels 0-7 in the low half, 8-15 in the high one): out = {a_lo, b_lo, a_hi, b_hi}.
inline void pair_lane_constants(__m512 a, __m512 b, __m512* out) {
  const __m512i lanes_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i lanes_hi = _mm512_add_epi32(lanes_lo, _mm512_set1_epi32(8));
  out[0] = _mm512_permutexvar_ps(lanes_lo, a);
  out[1] = _mm512_permutexvar_ps(lanes_lo, b);
  out[2] = _mm512_permutexvar_ps(lanes_hi, a);
  out[3] = _mm512_permutexvar_ps(lanes_hi, b);
}

// What a tile does with its float32 sums: y = acc * scale (per channel, when given) + bias, for the first
// `valid` channels of the item (a partial last block is masked).
struct TileOutput {
  GroupParams scale;  // [N] from the item's first channel, or no data: 1
  const float* bias = nullptr;  // the same
  int64_t valid = 64;
};

constexpr int kTileRows = 6;  // bf16 tile: 6 x 4 accumulators + 4 weights + 1 broadcast (+ the side's registers)

template <int MR, int NB>
__attribute__((always_inline)) inline void store_output(__m512 (&acc)[MR][NB], const TileOutput& out,
                                                        c10::BFloat16* y, int64_t ldy) {
  if (out.scale.data) {  // scale and bias in one FMA (one rounding, as the few-rows int8 kernel)
    for (int b = 0; b < NB; ++b) {
      const int64_t left = out.valid - b * 16;
      const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
      const __m512 sc = out.scale.load16(b * 16, mask);
      const __m512 bi = out.bias ? _mm512_maskz_loadu_ps(mask, out.bias + b * 16) : _mm512_setzero_ps();
      for (int r = 0; r < MR; ++r) acc[r][b] = _mm512_fmadd_ps(acc[r][b], sc, bi);
    }
    store_tile<MR, NB>(acc, nullptr, y, ldy, out.valid);
  } else {
    store_tile<MR, NB>(acc, out.bias, y, ldy, out.valid);
  }
}

// MR rows over an item's dequantized scratch ([K/2][NB][16][2]: lines (1, NB) apart, bf16_tile); every `every`
// pairs, `burst` steps of `side` (the next item) run beside the products.
template <int MR, int NB, class Side>
void dequantized_tile(const int32_t* x_pairs, int64_t x_pair_stride, const __m512i* scratch, int64_t K2,
                      const TileOutput& out, c10::BFloat16* y, int64_t ldy, Side& side, int64_t side_steps,
                      int64_t every, int64_t burst) {
  __m512 acc[MR][NB];
  const int64_t side_left = std::max<int64_t>(0, side.left - side_steps);  // what this tile leaves
  int64_t countdown = every;
  if (every <= 2) {
    // Steps at (nearly) every pair: on a local copy, whose address does not escape, so its counters stay in
    // registers. (On `side` itself each scratch store, which may alias anything, made the compiler store and
    // reload them: int4's step alone went from ~10.7 to ~6.7 cycles per 64 weights, 16 rows from 0.63x to
    // 0.68x bf16.) With sparser steps (32+ rows) the registers the copy holds cost more than the reloads: 64
    // rows on 2 threads ran 3-5% slower with it. (A copy per burst ran 4x slower.)
    Side local = side;
    bf16_tile<MR, NB>(acc, x_pairs, x_pair_stride, scratch, 1, NB, K2, [&](int64_t) {
      if (--countdown == 0) {
        countdown = every;
        for (int64_t s = 0; s < burst && local.left > side_left; ++s) local.step();
      }
    });
    side = local;
  } else {
    bf16_tile<MR, NB>(acc, x_pairs, x_pair_stride, scratch, 1, NB, K2, [&](int64_t) {
      if (--countdown == 0) {
        countdown = every;
        for (int64_t s = 0; s < burst && side.left > side_left; ++s) side.step();
      }
    });
  }
  store_output<MR, NB>(acc, out, y, ldy);
}

// All M rows of one item of NB blocks, in tiles of equal size (32 rows: 6 + 6 + 5 + 5 + 5 + 5, not a last tile
// of 2 that would keep few dot-product chains in flight), running `side` over them.
template <int NB, class Side>
void item_rows(int64_t M, const int32_t* x_pairs, int64_t x_pair_stride, const __m512i* scratch, int64_t K2,
               const TileOutput& out, c10::BFloat16* y, int64_t ldy, Side& side) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t side_steps = (side.left + tiles - 1) / tiles;        // per tile
  const int64_t burst = std::max<int64_t>(1, (side_steps + K2 - 1) / K2);  // per firing
  const int64_t firings = (side_steps + burst - 1) / burst;
  const int64_t every = std::max<int64_t>(1, firings ? K2 / firings : K2);
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int mr = static_cast<int>(M / tiles + (t < M % tiles));
    const int32_t* xr = x_pairs + m * x_pair_stride;
    c10::BFloat16* yr = y + m * ldy;
    switch (mr) {
#define KUBELLM_TILE(R) \
  case R: dequantized_tile<R, NB>(xr, x_pair_stride, scratch, K2, out, yr, ldy, side, side_steps, every, burst); break;
      KUBELLM_TILE(1) KUBELLM_TILE(2) KUBELLM_TILE(3) KUBELLM_TILE(4) KUBELLM_TILE(5) KUBELLM_TILE(6)
#undef KUBELLM_TILE
      default: TORCH_CHECK(false, "bf16 tile: bad row tile ", mr);
    }
    m += mr;
  }
  side.finish();
}

// y[M, N] (row stride ldy) = x[M, K] (as bf16 pairs, K2 = K / 2 of them per row) times the weight, in work
// items of up to 4 blocks of 16 channels split evenly over the threads; each thread dequantizes item i + 1 into
// one of its two scratches while it multiplies item i from the other.
//   make_side(first_block, blocks, scratch, constants) -> Side: item's dequantization, nothing done yet;
//     `constants` is room for constants_per_block __m512 per block (shared by the thread's items: an item's
//     are written only once the item before it is fully dequantized).
//   output_of(first_block, blocks) -> TileOutput of the item.
template <class Side, class MakeSide, class OutputOf>
void dequantized_gemm(int64_t M, const int32_t* x_pairs, int64_t x_pair_stride, int64_t K2, int64_t NBLK,
                      int64_t constants_per_block, const MakeSide& make_side, const OutputOf& output_of,
                      c10::BFloat16* y, int64_t ldy) {
  const int nb = blocks_per_item(NBLK, 4);
  at::parallel_for(0, (NBLK + nb - 1) / nb, 1, [&](int64_t begin, int64_t end) {
    const int64_t scratch_vectors = K2 * nb;
    auto* buffers = static_cast<__m512i*>(
        std::aligned_alloc(64, (2 * scratch_vectors + constants_per_block * nb) * sizeof(__m512i)));
    auto* constants = reinterpret_cast<__m512*>(buffers + 2 * scratch_vectors);
    auto item = [&](int64_t it) {
      const int64_t blk = it * nb;
      return make_side(blk, static_cast<int>(std::min<int64_t>(nb, NBLK - blk)),
                       buffers + (it - begin) % 2 * scratch_vectors, constants);
    };
    Side current = item(begin);
    current.finish();
    for (int64_t it = begin; it < end; ++it) {
      const int64_t blk = it * nb;
      const __m512i* scratch = current.scratch;
      const int n = current.nb;
      Side next = it + 1 < end ? item(it + 1) : Side{};
      const TileOutput out = output_of(blk, n);
#define KUBELLM_ITEM(B) item_rows<B>(M, x_pairs, x_pair_stride, scratch, K2, out, y + blk * 16, ldy, next)
      switch (n) {
        case 4: KUBELLM_ITEM(4); break;
        case 3: KUBELLM_ITEM(3); break;
        case 2: KUBELLM_ITEM(2); break;
        default: KUBELLM_ITEM(1); break;
      }
#undef KUBELLM_ITEM
      current = next;
    }
    std::free(buffers);
  });
}

// The 8-bit weights' dequantization ([N/16][K/2][16][2] int8, the layout both 8-bit kernels pack), one pair of
// inputs of one block (32 weights) a step, block by block within each pair (counters rather than divisions:
// this runs inside the GEMM's inner loop). kWiden keeps q as it is (exact; the caller scales per channel in
// TileOutput); kScale and kScaleZero write the bf16 of q * s and (q - z) * s, computed in float32 as the
// references do, with s and z per group and block from `sc` (pair_lane_constants of {s, z}).
enum class Int8Weights { kWiden, kScale, kScaleZero };

template <Int8Weights kMode>
struct Int8Dequantization {
  const int8_t* w = nullptr;  // the item's first block
  int64_t w_block_stride = 0, group_pairs = 1;
  const __m512* sc = nullptr;
  __m512i* scratch = nullptr;
  int nb = 1;
  int64_t left = 0;  // steps still to do
  int64_t kp = 0, g = 0, in_group = 0;
  int b = 0;

  __attribute__((always_inline)) void step() {
    const int8_t* src = w + b * w_block_stride + kp * 32;
    __m512i pairs;
    if constexpr (kMode == Int8Weights::kWiden) {
      pairs = widen_int8_pairs(src);
    } else {
      __m512 lo, hi;
      widen_int8_pairs(src, lo, hi);
      const __m512* c = sc + (g * nb + b) * 4;
      if constexpr (kMode == Int8Weights::kScaleZero) {
        lo = _mm512_sub_ps(lo, c[1]);
        hi = _mm512_sub_ps(hi, c[3]);
      }
      pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, c[2]), _mm512_mul_ps(lo, c[0]));
    }
    _mm512_store_si512(scratch + kp * nb + b, pairs);
    --left;
    if (++b == nb) {
      b = 0;
      ++kp;
      if (++in_group == group_pairs) in_group = 0, ++g;
    }
  }
  void finish() {  // on a local copy (dequantized_tile says why)
    auto local = *this;
    while (local.left > 0) local.step();
    *this = local;
  }
};
#endif

}  // namespace tiles
}  // namespace kubellm_cpu
