// The experts of a mixture-of-experts MLP in one call per layer, for CPUs with AVX512-BF16 (bfloat16 weights):
//   out[t] = sum over t's top-k choices (e, w) of w * down_e(T(T(silu(T(gate_e(x[t])))) * T(up_e(x[t]))))
// with T() bfloat16 rounding where the PyTorch path (per-expert linears and silu_and_mul) rounds.
//
// Why: with 128 experts and top-8 (Qwen3-30B-A3B) a decode step of 32 sequences hits ~110 experts per layer
// with one to a few rows each. One oneDNN call per expert linear plus the gathers, the activation and the
// scatter is ~10 PyTorch ops per hit expert, dispatched one after another, each too small to keep both cores
// busy. Here two parallel loops do a layer: one over every (hit expert, 16 intermediate channels) for gate, up
// and the activation, one over blocks of 32 output channels for the down projection and the weighted sum, so
// the threads stream the hit experts' weights back to back. Items are handed out dynamically (dynamic_for).
//
// Layouts (packed once by kernels/cpu_moe.py, the operand order of vdpbf16ps, as in int8_gemm_cpu.cpp):
//   w13 [E, I/16, 2, H/2, 16, 2]: per expert and block j of 16 intermediate channels, the gate block then the
//       up block, each the 16 channels' (w[n, k], w[n, k+1]) pairs for every input pair k.
//   w2  [E, H/16, I/2, 16, 2]: the down projection, per block of 16 output channels.
// The router's logits [T, E] come in; the kernel routes (see route()).
//
// moe_quantized_experts: the same two loops for experts of 4-bit or 8-bit values with per-group scales and
// optional zero points, each linear in its own width (a Q4_K_M layer: 4-bit gate/up beside a 6-bit down). A linear
// of 4-bit values (AWQ, GPTQ, W4A16, kubellm's int4, GGUF Q4_0/Q4_1/Q4_K) is packed per expert as int4_gemm_cpu.cpp
// packs it, one of 8-bit values (GPTQ 8-bit, W8A16, GGUF Q8_0/Q5_K/Q6_K) as grouped_int8_gemm_cpu.cpp does, and
// stacked over the experts:
//   w13 [E, 2I/16, H/4, 16, 2] uint8 or [E, 2I/16, H/2, 16, 2] int8 (gate blocks, then up blocks),
//       s13/z13 [E, 2I/16, H/group13, 16];
//   w2  [E, H/16, I/4, 16, 2] uint8 or [E, H/16, I/2, 16, 2] int8, s2/z2 [E, H/16, I/group2, 16];
// (scales and zero points per block of 16 channels, its groups one after another: a work item reads them as one
// stream, where the GEMMs' [K/group, N] spread them over K/group lines N apart, each a separate miss at one row);
// scales and zero points float32 or float16; zero points required for 4-bit values, optional for 8-bit ones;
// low13/low2, given for 8-bit values that lie within [low, low + 63] (Q6_K, Q5_K), widen them by table. Rows
// run through int4_tiles.h's or int8_tiles.h's tile (weights widened in registers), gate block j beside up block
// j. The per-expert path's rounding is kept: bfloat16 gate, up, activation and down outputs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "gemm_tiles.h"
#include "int4_tiles.h"
#include "int8_tiles.h"
#include "scalar_math.h"

#if defined(KUBELLM_INT4_TILES) && defined(KUBELLM_INT8_TILES)  // AVX512-BF16 (and F, BW, VL)
#include <immintrin.h>
#define KUBELLM_MOE_CPU 1
#endif

namespace kubellm_cpu {
namespace {

bool moe_experts_available() {
#ifdef KUBELLM_MOE_CPU
  return true;
#else
  return false;
#endif
}

#ifdef KUBELLM_MOE_CPU
using math::exp_nonpos;
using math::round_as;
using math::to_f;
using math::from_f;
using BF16 = c10::BFloat16;

constexpr int kMaxRows = 12;  // MR x 2 accumulators + 2 weights + 1 broadcast within the 32 zmm registers

inline float silu(float x) {
  const float e = exp_nonpos(-std::fabs(x));  // same formula as layer_ops_cpu.cpp's silu_and_mul
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

// acc[r][b] = sum over input pairs of rows[r] . weight block b (two 16-channel blocks, w_block_stride apart).
template <int MR, int NB>
void dot_tile(const int32_t* const* rows, const BF16* w, int64_t w_block_stride, int64_t K2, float* out) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + b * w_block_stride + kp * 32);
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(rows[r][kp]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + (r * NB + b) * 16, acc[r][b]);
}

template <int NB>
void dot_rows(int mr, const int32_t* const* rows, const BF16* w, int64_t w_block_stride, int64_t K2, float* out) {
  switch (mr) {
#define KUBELLM_ROWS(R) \
  case R: dot_tile<R, NB>(rows, w, w_block_stride, K2, out); break;
    KUBELLM_ROWS(1) KUBELLM_ROWS(2) KUBELLM_ROWS(3) KUBELLM_ROWS(4) KUBELLM_ROWS(5) KUBELLM_ROWS(6)
    KUBELLM_ROWS(7) KUBELLM_ROWS(8) KUBELLM_ROWS(9) KUBELLM_ROWS(10) KUBELLM_ROWS(11) KUBELLM_ROWS(12)
#undef KUBELLM_ROWS
    default: TORCH_CHECK(false, "moe_experts: bad row tile ", mr);
  }
}

// h = T(T(silu(T(gate))) * T(up)) for mr rows of acc (per row the 16 gate channels' sums, then the 16 up ones')
// into 16 channels of h's rows (row stride ldh).
inline void store_activations(int mr, const float* acc, BF16* h, int64_t ldh) {
  for (int r = 0; r < mr; ++r) {
    const float* g = acc + r * 32;
    for (int c = 0; c < 16; ++c)
      h[r * ldh + c] = from_f<BF16>(round_as<BF16>(silu(round_as<BF16>(g[c]))) * round_as<BF16>(g[16 + c]));
  }
}

// Runs body(i, scratch) for i in [0, n) on the intra-op threads, items handed out one at a time from a shared
// counter rather than split evenly up front: on a host whose cores are shared, a thread that is descheduled
// for a while then delays only the item it holds, not a fixed half of the work. scratch is per thread.
template <typename Body>
void dynamic_for(int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(std::max(1, at::get_num_threads()), std::max<int64_t>(n, 1));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) body(i, scratch);
  });
}

// The down projection's epilogue, shared by the bf16 and quantized kernels: each of mr rows (pairs) of acc, rounded
// to bf16 as the PyTorch path rounds the expert's output, times its pair's routing weight into its token's sums.
inline void add_weighted_rows(int mr, const float* acc, const float* weights, const int64_t* tokens, int width,
                              float* sums) {
  for (int r = 0; r < mr; ++r) {
    const float scale = round_as<BF16>(weights[r]);
    float* dst = sums + tokens[r] * width;
    for (int c = 0; c < width; ++c) dst[c] += round_as<BF16>(acc[r * width + c]) * scale;
  }
}

// Each token's sums over one output slice of `width` channels into its row of the output (row stride ldo).
inline void store_sums(const float* sums, int64_t T, int width, BF16* out, int64_t ldo) {
  for (int64_t t = 0; t < T; ++t)
    for (int c = 0; c < width; ++c) out[t * ldo + c] = from_f<BF16>(sums[t * width + c]);
}

// The router's choice, as the PyTorch path makes it: softmax over the E logits of a token in float32, the top_k
// probabilities (ties to the lower expert id), rescaled to sum to 1 when renormalize; then the T * top_k
// (token, choice) pairs counted and placed by expert, each expert's pairs in token order. In C++ because the
// dozen small PyTorch ops it replaces each cost a parallel region's start and end, per layer and step.
struct Routing {
  std::vector<int64_t> offsets;  // [E + 1]: expert e's pairs are offsets[e] .. offsets[e + 1]
  std::vector<int64_t> tokens;   // [P]: the token of each pair
  std::vector<float> weights;    // [P]: its router weight
};

Routing route(const at::Tensor& logits, int64_t top_k, bool renormalize) {
  const int64_t T = logits.size(0), E = logits.size(1), P = T * top_k;
  const float* lp = logits.const_data_ptr<float>();
  std::vector<int64_t> ids(P);
  std::vector<float> w(P);
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {  // serial below 256 tokens: a decode step
    for (int64_t t = begin; t < end; ++t) {
      const float* l = lp + t * E;
      const float mx = *std::max_element(l, l + E);
      float total = 0.0f;
      for (int64_t e = 0; e < E; ++e) total += std::exp(l[e] - mx);
      int64_t* id = ids.data() + t * top_k;
      float* wt = w.data() + t * top_k;
      for (int64_t j = 0; j < top_k; ++j) {  // top_k passes: k is small (8 of 128)
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (std::find(id, id + j, e) != id + j) continue;
          if (best < 0 || l[e] > l[best]) best = e;
        }
        id[j] = best;
        wt[j] = std::exp(l[best] - mx) / total;
      }
      if (renormalize) {
        float sum = 0.0f;
        for (int64_t j = 0; j < top_k; ++j) sum += wt[j];
        for (int64_t j = 0; j < top_k; ++j) wt[j] /= sum;
      }
    }
  });
  Routing r{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(P), std::vector<float>(P)};
  for (int64_t p = 0; p < P; ++p) ++r.offsets[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] += r.offsets[e];
  std::vector<int64_t> fill(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t at = fill[ids[p]]++;
    r.tokens[at] = p / top_k;
    r.weights[at] = w[p];
  }
  return r;
}

struct Item {
  int64_t expert, block;
};

// The (expert, block) work items of the experts that received pairs.
std::vector<Item> work_items(const int64_t* offsets, int64_t E, int64_t blocks) {
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t b = 0; b < blocks; ++b) items.push_back({e, b});
  return items;
}

// The row tile of both quantized widths: MR x 2 accumulators and MR x 2 group sums (int4_tiles.h; int8_tiles.h
// with zero points likewise) beside the weights and broadcasts in 32 zmm.
constexpr int kMaxRowsQuantized = 6;

// One stacked linear of moe_quantized_experts, [E, N/16, ...] blocks of 16 channels over K inputs.
struct ExpertLinear {
  const uint8_t* w = nullptr;
  bool int4 = false;  // else int8 values
  int64_t N = 0, K = 0, group = 0, groups = 0, block_bytes = 0;
  tiles::GroupParams scales, zeros;  // over [E * groups, N]; zeros without data: none (8-bit values only)
  bool table = false;  // int8 values within [low, low + 63]: widened by int8_tiles.h's table
  int8::WidenTable widen{0};

  bool needs_sums() const { return int4 || zeros.data; }  // the sums of x per group that zero points multiply
};

// Checks one stacked linear (see the top of the file) and describes it.
ExpertLinear expert_linear(const char* name, const at::Tensor& packed, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& zeros, int64_t group, c10::optional<int64_t> low,
                           int64_t E, int64_t N, int64_t K) {
  ExpertLinear l;
  l.int4 = packed.scalar_type() == at::kByte;
  const int per_byte = l.int4 ? 2 : 1;
  TORCH_CHECK(packed.dim() == 5 && (l.int4 || packed.scalar_type() == at::kChar) && packed.is_contiguous() &&
                  packed.size(0) == E && packed.size(1) * 16 == N && packed.size(2) * 2 * per_byte == K &&
                  packed.size(3) == 16 && packed.size(4) == 2,
              name, " must be a contiguous [", E, ", ", N / 16, ", K/4, 16, 2] uint8 (4-bit) or [", E, ", ", N / 16,
              ", K/2, 16, 2] int8 (8-bit) tensor for ", K, " inputs, got ", packed.sizes(), " ", packed.scalar_type());
  const int64_t unit = l.int4 ? 4 : 2;  // inputs per step of the tile: a quad of nibbles, a pair of int8
  TORCH_CHECK(group >= unit && group % unit == 0 && K % group == 0, name, "'s group size (", group,
              ") must be a multiple of ", unit, " that divides ", K);
  const bool has_zeros = zeros.has_value() && zeros->defined();
  TORCH_CHECK(has_zeros || !l.int4, name, ": 4-bit values need zero points");
  l.N = N, l.K = K, l.group = group, l.groups = K / group, l.block_bytes = K / per_byte * 16;
  const int64_t rows = E * (N / 16) * l.groups;  // [E, N/16, K/group, 16] as [rows, 16]
  const auto params = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.dim() == 4 && t.size(0) == E && t.size(1) * 16 == N && t.size(2) == l.groups && t.size(3) == 16,
                name, "'s ", what, " must be [E, N/16, K/group, 16] = [", E, ", ", N / 16, ", ", l.groups,
                ", 16], got ", t.sizes());
    return tiles::group_params(t.view({rows, 16}), what, rows, 16);
  };
  l.scales = params(scales, "scales");
  if (has_zeros) l.zeros = params(*zeros, "zeros");
  if (low.has_value()) {
    TORCH_CHECK(!l.int4 && *low >= -128 && *low <= 64, name, ": a value table (low ", *low,
                ") is for int8 values within [low, low + 63]");
    l.table = true;
    l.widen = int8::WidenTable(static_cast<int>(*low));
  }
  l.w = static_cast<const uint8_t*>(packed.const_data_ptr());
  return l;
}

// int8_tiles.h's tile for R rows of an 8-bit linear, with or without zero points and the value table.
template <int R, int NB>
__attribute__((always_inline)) inline void int8_tile(const ExpertLinear& l, const int32_t* x_pairs,
                                                     int64_t x_pair_stride, const float* xsum, const int8_t* w,
                                                     int64_t w_stride, tiles::GroupParams s, tiles::GroupParams z,
                                                     int64_t param_block_stride, __m512 (&acc)[R][NB],
                                                     int64_t prefetch) {
#define KUBELLM_INT8_TILE(ZP, ...)                                                                                 \
  int8::dot_groups<R, NB, ZP>(x_pairs, x_pair_stride, xsum, l.groups, w, w_stride, l.K / 2, l.group / 2, s, z, 16,  \
                              param_block_stride, 0xFFFF, acc, __VA_ARGS__)
  if (l.table) {
    if (z.data)
      KUBELLM_INT8_TILE(true, l.widen, prefetch);
    else
      KUBELLM_INT8_TILE(false, l.widen, prefetch);
  } else if (z.data) {
    KUBELLM_INT8_TILE(true, int8::WidenAny{}, prefetch);
  } else {
    KUBELLM_INT8_TILE(false, int8::WidenAny{}, prefetch);
  }
#undef KUBELLM_INT8_TILE
}

// out[r * NB * 16 + b * 16 + c] (float32): mr (1..kMaxRowsQuantized) rows of x (bf16 pairs, x_pair_stride int32
// apart; xsum their group sums where the linear needs them) through NB blocks of expert e's linear, from block
// blk on, block_step blocks apart (gate/up: the up block of gate block j is I/16 blocks on).
template <int NB>
void linear_rows(const ExpertLinear& l, int mr, const int32_t* x_pairs, int64_t x_pair_stride, const float* xsum,
                 int64_t e, int64_t blk, int64_t block_step, float* out, int64_t prefetch = 0) {
  const uint8_t* w = l.w + (e * (l.N / 16) + blk) * l.block_bytes;
  // An item's scales and zero points: its blocks' groups one after another (16 values each), block_step blocks on.
  const int64_t params = (e * (l.N / 16) + blk) * l.groups * 16, w_stride = block_step * l.block_bytes;
  const int64_t param_block_stride = block_step * l.groups * 16;
  const tiles::GroupParams s = l.scales.offset(params), z = l.zeros.offset(params);
  const auto* w8 = reinterpret_cast<const int8_t*>(w);
  switch (mr) {
#define KUBELLM_ROWS(R)                                                                                            \
  case R: {                                                                                                        \
    __m512 acc[R][NB];                                                                                             \
    if (l.int4)                                                                                                    \
      int4::dot_groups<R, NB>(x_pairs, x_pair_stride, xsum, l.groups, w, w_stride, l.K / 4, l.group / 4, s, z, 16,  \
                              param_block_stride, acc);                                                            \
    else                                                                                                           \
      int8_tile<R, NB>(l, x_pairs, x_pair_stride, xsum, w8, w_stride, s, z, param_block_stride, acc, prefetch);   \
    for (int r = 0; r < R; ++r)                                                                                    \
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + (r * NB + b) * 16, acc[r][b]);                           \
    break;                                                                                                         \
  }
    KUBELLM_ROWS(1) KUBELLM_ROWS(2) KUBELLM_ROWS(3) KUBELLM_ROWS(4) KUBELLM_ROWS(5) KUBELLM_ROWS(6)
#undef KUBELLM_ROWS
    default: TORCH_CHECK(false, "moe_quantized_experts: bad row tile ", mr);
  }
}

// Float32 sums of bf16 rows [rows, cols] over groups of `group` columns, [rows, cols / group]: what the zero
// points multiply. Undefined when the linear has no zero points.
at::Tensor group_sums(const ExpertLinear& l, const BF16* rows, int64_t n, int64_t cols) {
  if (!l.needs_sums()) return at::Tensor();
  at::Tensor sums = at::empty({n, cols / l.group}, at::TensorOptions().dtype(at::kFloat));
  float* sp = sums.mutable_data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    tiles::bf16_group_sums(rows + r0 * cols, cols, r1 - r0, cols, l.group, sp + r0 * (cols / l.group));
  });
  return sums;
}
#endif

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& w13, const at::Tensor& w2,
                       int64_t top_k, bool renormalize) {
#ifndef KUBELLM_MOE_CPU
  TORCH_CHECK(false, "moe_experts needs a build with AVX512-BF16 (-march of a CPU that has it)");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous [T, H] bfloat16");
  TORCH_CHECK(w13.dim() == 6 && w13.scalar_type() == at::kBFloat16 && w13.is_contiguous() && w13.size(2) == 2 &&
                  w13.size(4) == 16 && w13.size(5) == 2,
              "w13 must be a contiguous [E, I/16, 2, H/2, 16, 2] bfloat16 tensor");
  TORCH_CHECK(w2.dim() == 5 && w2.scalar_type() == at::kBFloat16 && w2.is_contiguous() && w2.size(3) == 16 &&
                  w2.size(4) == 2,
              "w2 must be a contiguous [E, H/16, I/2, 16, 2] bfloat16 tensor");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), IB = w13.size(1), I = IB * 16, HB = w2.size(1);
  TORCH_CHECK(w13.size(3) * 2 == H && HB * 16 == H && w2.size(0) == E && w2.size(2) * 2 == I,
              "weights do not match: x has ", H, " columns, w13 ", w13.sizes(), ", w2 ", w2.sizes());
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == T && logits.size(1) == E, "logits must be [T, E], got ",
              logits.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be 1..", E);
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const Routing routing = route(logits.to(at::kFloat).contiguous(), top_k, renormalize);
  const int64_t* off = routing.offsets.data();
  const int64_t* tok = routing.tokens.data();
  const float* wt = routing.weights.data();
  const int64_t P = T * top_k;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.const_data_ptr<BF16>());
  const BF16* w13p = w13.const_data_ptr<BF16>();
  const BF16* w2p = w2.const_data_ptr<BF16>();

  // Phase 1: h[p] = T(T(silu(T(gate))) * T(up)) for every pair, in sorted order.
  at::Tensor h_buf = at::empty({P, I}, x.options());  // not zeroed: every element is written below
  BF16* h = h_buf.mutable_data_ptr<BF16>();
  const int64_t K2 = H / 2, w13_block = K2 * 32;  // one 16-channel block of H inputs, in bf16 elements
  const std::vector<Item> items1 = work_items(off, E, IB);
  dynamic_for(static_cast<int64_t>(items1.size()), [&](int64_t it, std::vector<float>&) {
    const int32_t* rows[kMaxRows];
    float acc[kMaxRows * 2 * 16];
    const auto [e, j] = items1[it];
    const BF16* w = w13p + (e * IB + j) * 2 * w13_block;
    for (int64_t p0 = off[e]; p0 < off[e + 1]; p0 += kMaxRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, off[e + 1] - p0));
      for (int r = 0; r < mr; ++r) rows[r] = xp + tok[p0 + r] * K2;
      dot_rows<2>(mr, rows, w, w13_block, K2, acc);
      store_activations(mr, acc, h + p0 * I + j * 16, I);
    }
  });

  // Phase 2: out[t] = T(sum over t's pairs p of T(w[p]) * T(down(h[p]))), summed in float32 per token. A work item
  // owns two 16-channel blocks of the output for every token, so items never write the same element and no
  // separate combine pass is needed: it walks the hit experts, reading each one's slice of the down weight once.
  const int64_t I2 = I / 2, w2_block = I2 * 32;
  const int64_t items2 = (HB + 1) / 2;  // pairs of 16-channel output blocks (one for an odd tail)
  const int32_t* hp = reinterpret_cast<const int32_t*>(h);
  BF16* op = out.mutable_data_ptr<BF16>();
  dynamic_for(items2, [&](int64_t pair, std::vector<float>& sums) {
    const int32_t* rows[kMaxRows];
    float acc[kMaxRows * 2 * 16];
    const int64_t blk = pair * 2;
    const int nb = static_cast<int>(std::min<int64_t>(2, HB - blk)), width = nb * 16;
    sums.assign(static_cast<size_t>(T * width), 0.0f);
    for (int64_t e = 0; e < E; ++e) {
      const BF16* w = w2p + (e * HB + blk) * w2_block;
      for (int64_t p0 = off[e]; p0 < off[e + 1]; p0 += kMaxRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, off[e + 1] - p0));
        for (int r = 0; r < mr; ++r) rows[r] = hp + (p0 + r) * I2;
        if (nb == 2)
          dot_rows<2>(mr, rows, w, w2_block, I2, acc);
        else
          dot_rows<1>(mr, rows, w, w2_block, I2, acc);
        add_weighted_rows(mr, acc, wt + p0, tok + p0, width, sums.data());
      }
    }
    store_sums(sums.data(), T, width, op + blk * 16, H);
  });
  return out;
#endif
}

at::Tensor moe_quantized_experts(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& w13,
                                 const at::Tensor& s13, const c10::optional<at::Tensor>& z13, int64_t group13,
                                 const at::Tensor& w2, const at::Tensor& s2, const c10::optional<at::Tensor>& z2,
                                 int64_t group2, c10::optional<int64_t> low13, c10::optional<int64_t> low2,
                                 int64_t top_k, bool renormalize) {
#ifndef KUBELLM_MOE_CPU
  TORCH_CHECK(false, "moe_quantized_experts needs a build with AVX512-BF16 (-march of a CPU that has it)");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous [T, H] bfloat16");
  TORCH_CHECK(w13.dim() == 5 && w2.dim() == 5, "w13 and w2 must be [E, N/16, K/4 or K/2, 16, 2] tensors");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) * 8, IB = I / 16, HB = H / 16;
  TORCH_CHECK(I % 16 == 0 && H % 16 == 0, "moe_quantized_experts: hidden (", H, ") and intermediate (", I,
              ") sizes must be multiples of 16");
  const ExpertLinear l13 = expert_linear("w13", w13, s13, z13, group13, low13, E, 2 * I, H);
  const ExpertLinear l2 = expert_linear("w2", w2, s2, z2, group2, low2, E, H, I);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == T && logits.size(1) == E, "logits must be [T, E], got ",
              logits.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be 1..", E);
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const Routing routing = route(logits.to(at::kFloat).contiguous(), top_k, renormalize);
  const int64_t* off = routing.offsets.data();
  const int64_t* tok = routing.tokens.data();
  const float* wt = routing.weights.data();
  const int64_t P = T * top_k;

  // The pairs' rows of x in sorted order, so that each expert's rows lie evenly spaced as the tile reads them,
  // and their group sums.
  at::Tensor xs_buf = at::empty({P, H}, x.options());
  BF16* xs = xs_buf.mutable_data_ptr<BF16>();
  const BF16* xv = x.const_data_ptr<BF16>();
  at::parallel_for(0, P, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::copy(xv + tok[p] * H, xv + (tok[p] + 1) * H, xs + p * H);
  });
  const int64_t G13 = l13.groups, G2 = l2.groups;
  const at::Tensor xsum_buf = group_sums(l13, xs, P, H);
  const float* xsum = xsum_buf.defined() ? xsum_buf.const_data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const int32_t*>(xs);

  // Phase 1: h[p] = T(T(silu(T(gate))) * T(up)) for every pair, an item per (hit expert, 16 channels).
  at::Tensor h_buf = at::empty({P, I}, x.options());  // not zeroed: every element is written below
  BF16* h = h_buf.mutable_data_ptr<BF16>();
  // One row of 8-bit gate/up: each pair of inputs also prefetches the next item's (the next 16 channels' blocks,
  // block_bytes on): 0.95-1.19x, 5 of 6 one-process A/B runs faster at one row (presumably each item's start
  // waited on memory; benchmarks/results/). Not for 4-bit values, whose tile was slower with it at one row.
  const int64_t prefetch1 = l13.block_bytes;
  const std::vector<Item> items1 = work_items(off, E, IB);
  dynamic_for(static_cast<int64_t>(items1.size()), [&](int64_t it, std::vector<float>&) {
    float acc[kMaxRowsQuantized * 2 * 16];
    const auto [e, j] = items1[it];
    for (int64_t p0 = off[e]; p0 < off[e + 1]; p0 += kMaxRowsQuantized) {
      const int mr = static_cast<int>(std::min<int64_t>(kMaxRowsQuantized, off[e + 1] - p0));
      linear_rows<2>(l13, mr, xp + p0 * (H / 2), H / 2, xsum ? xsum + p0 * G13 : nullptr, e, j, IB, acc,
                     mr == 1 ? prefetch1 : 0);
      store_activations(mr, acc, h + p0 * I + j * 16, I);
    }
  });

  // Phase 2: out[t] = T(sum over t's pairs p of T(w[p]) * T(down(h[p]))), summed in float32 per token; an item
  // owns two 16-channel output blocks for every token and walks the hit experts (as moe_experts does).
  const at::Tensor hsum_buf = group_sums(l2, h, P, I);
  const float* hsum = hsum_buf.defined() ? hsum_buf.const_data_ptr<float>() : nullptr;
  const int64_t items2 = (HB + 1) / 2;
  const int32_t* hp = reinterpret_cast<const int32_t*>(h);
  BF16* op = out.mutable_data_ptr<BF16>();
  dynamic_for(items2, [&](int64_t pair, std::vector<float>& sums) {
    float acc[kMaxRowsQuantized * 2 * 16];
    const int64_t blk = pair * 2;
    const int nb = static_cast<int>(std::min<int64_t>(2, HB - blk)), width = nb * 16;
    sums.assign(static_cast<size_t>(T * width), 0.0f);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t p0 = off[e]; p0 < off[e + 1]; p0 += kMaxRowsQuantized) {
        const int mr = static_cast<int>(std::min<int64_t>(kMaxRowsQuantized, off[e + 1] - p0));
        const float* hs = hsum ? hsum + p0 * G2 : nullptr;
        if (nb == 2)
          linear_rows<2>(l2, mr, hp + p0 * (I / 2), I / 2, hs, e, blk, 1, acc);
        else
          linear_rows<1>(l2, mr, hp + p0 * (I / 2), I / 2, hs, e, blk, 1, acc);
        add_weighted_rows(mr, acc, wt + p0, tok + p0, width, sums.data());
      }
    }
    store_sums(sums.data(), T, width, op + blk * 16, H);
  });
  return out;
#endif
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor logits, Tensor w13, Tensor w2, int top_k, bool renormalize) -> Tensor");
  m.def("moe_quantized_experts(Tensor x, Tensor logits, Tensor w13, Tensor s13, Tensor? z13, int group13, "
        "Tensor w2, Tensor s2, Tensor? z2, int group2, int? low13, int? low2, int top_k, bool renormalize) -> Tensor");
  m.def("moe_experts_available() -> bool", &kubellm_cpu::moe_experts_available);  // no tensors: not dispatched
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) {
  m.impl("moe_experts", &kubellm_cpu::moe_experts);
  m.impl("moe_quantized_experts", &kubellm_cpu::moe_quantized_experts);
}
