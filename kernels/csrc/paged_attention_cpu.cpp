// Paged-attention decode on CPU: one query token per sequence, K/V read in place from the paged pool.
//
// Layouts (see kubellm/kernels/cpu_paged_attention.py for the Python contract):
//   q            [B, H, D]                                  float32 / bfloat16 / float16, last dim contiguous
//   k/v cache    [num_blocks, block_size, KVH, D]           same dtype, last dim contiguous
//   block_tables [B, max_blocks] int32, context_lens [B] int32
//   out          [B, H, D] in q's dtype
//
// Work item = (sequence, kv head, head pass, partition). A pass handles up to kMaxHeadsPerPass of the
// G = H / KVH query heads sharing that kv head, so each K/V row is read once per pass (once in total when
// G <= 4). Within an item the tokens are walked in chunks: scores for the chunk (fp32 dot products), then an
// online softmax update (running max / sum, accumulator rescaled once per chunk), then the V accumulation.
// K rows are software-prefetched a few tokens ahead and the chunk's V rows during the score phase.
// Sequences are split into partitions (merged at the end, flash-decoding style) only when there are too few
// (sequence, kv head) items to keep the threads busy, e.g. one long sequence. Items are handed out
// dynamically (longest sequences first) to the threads of at::parallel_for, so the kernel follows torch's
// intra-op thread count (torch.set_num_threads).
//
// SIMD: a 16-lane fp32 vector type with AVX-512, AVX2+FMA+F16C and portable (auto-vectorised) versions; the
// extension is compiled with -march=native on the machine that runs it, which picks one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "scalar_math.h"

#include <algorithm>
#include <atomic>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kubellm_cpu {
namespace {

#ifndef KUBELLM_PREFETCH
#define KUBELLM_PREFETCH 8
#endif
constexpr int kLanes = 16;
constexpr int kMaxHeadsPerPass = 4;
constexpr int kMaxChunk = 512;    // tokens per chunk (upper bound of the runtime chunk argument)
constexpr int kMaxHeadDim = 512;  // head_dim bound of the generic (runtime head_dim) path
constexpr int64_t kMinPartition = 256;  // shortest automatic partition when a sequence is split

// ---------------------------------------------------------------------------------------------------------
// A 16-lane fp32 vector: AVX-512, AVX2 (two 8-lane halves) or plain lane loops. All implement the same math,
// including exp: e^x = 2^n * e^r with n = round(x / ln2), r = x - n ln2 (two-constant split), e^r by its
// Taylor series to degree 7; arguments below -87 give 0.
// ---------------------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int kRegsPerVec = 1, kNumRegs = 32;  // zmm
struct Vec {
  __m512 v;
};
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vset(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec vload(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline Vec vload(const c10::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float vhmax(Vec a) { return _mm512_reduce_max_ps(a.v); }
// exp(x) for x <= 0 (scores minus their running max); 0 below -87 (also for -inf).
inline Vec vexp(Vec x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  __mmask16 keep = _mm512_cmp_ps_mask(x.v, lo, _CMP_GE_OQ);
  __m512 xc = _mm512_max_ps(x.v, lo);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  // Taylor series of e^r to degree 7; |r| <= ln2/2 gives a relative error below 1e-8.
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return {_mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e))};
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kRegsPerVec = 2, kNumRegs = 16;  // ymm
struct Vec {
  __m256 lo, hi;
};
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8_to_f32(const void* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline Vec vload(const c10::BFloat16* p) { return {bf16x8_to_f32(p), bf16x8_to_f32(p + 8)}; }
inline Vec vload(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void vstore(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec vfma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vsum(Vec a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vhmax(Vec a) {
  __m256 x = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 exp8(__m256 x) {  // same scheme as the AVX-512 vexp
  const __m256 lo = _mm256_set1_ps(-87.0f);
  __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  __m256 xc = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
inline Vec vexp(Vec x) { return {exp8(x.lo), exp8(x.hi)}; }
#else
// Portable fallback: fixed-length lane loops, which -O3 auto-vectorises (NEON, SSE, ...).
constexpr int kRegsPerVec = 4, kNumRegs = 32;  // e.g. 128-bit NEON
struct Vec {
  float v[kLanes];
};
inline Vec vzero() {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = 0.0f;
  return r;
}
inline Vec vset(float x) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
template <typename T>
inline Vec vload(const T* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline void vstore(float* p, Vec a) {
  for (int i = 0; i < kLanes; ++i) p[i] = a.v[i];
}
inline Vec operator+(Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline Vec operator-(Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] - b.v[i];
  return r;
}
inline Vec operator*(Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];  // contracted to FMA where available
  return r;
}
inline Vec vmax(Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return r;
}
inline float vsum(Vec a) {  // pairwise tree
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a.v[i] += a.v[i + w];
  return a.v[0];
}
inline float vhmax(Vec a) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a.v[i] = a.v[i] > a.v[i + w] ? a.v[i] : a.v[i + w];
  return a.v[0];
}
inline Vec vexp(Vec x) {  // same scheme as the AVX-512 vexp, lane by lane
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = math::exp_nonpos(x.v[i]);
  return r;
}
#endif

// ---------------------------------------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------------------------------------
constexpr int kPrefetch = KUBELLM_PREFETCH;

constexpr int pow2_floor(int x) { return x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; }

// Prefetch the cache lines of one K/V row.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* c = static_cast<const char*>(row);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

template <typename scalar_t>
struct Params {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  scalar_t* out;
  const int32_t* block_tables;
  const int32_t* context_lens;
  int64_t q_sb, q_sh;        // q strides (batch, head), in elements
  int64_t k_sb, k_st, k_sh;  // k_cache strides (block, token, kv head)
  int64_t v_sb, v_st, v_sh;  // v_cache strides
  int64_t bt_stride;         // block_tables row stride
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int nv;     // head_dim / 16
  int chunk;  // tokens per chunk
  float scale;
  int64_t window;  // > 0: a sequence attends only its last `window` tokens (sliding-window layers)
  float softcap;   // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
};

// One unit of work: query heads [h0, h0 + gt) of the group of kv head `kvh` of sequence `b`, over context
// tokens [t0, t1). When the sequence is split into several partitions (`partial` >= 0), the unnormalised
// state (running max, sum, accumulator) goes to the scratch slot `partial` instead of the output.
struct Item {
  int64_t b, kvh, h0, gt, t0, t1, partial;
};

// Scratch for split sequences: per (partial slot, head of the pass) the running max m, the sum l and the
// fp32 accumulator [D].
struct Partials {
  float* ml;   // [slots, H, 2]
  float* acc;  // [slots, H, D]
};

template <typename scalar_t, int GT, int NV>
void attend(const Params<scalar_t>& p, const Item& item, const Partials& partials, const scalar_t** krow,
            const scalar_t** vrow) {
  constexpr int kDimCap = NV > 0 ? NV * kLanes : kMaxHeadDim;
  // Register budget: V accumulator tile of JT vectors per head; one or two score accumulators per head.
  constexpr int JT = pow2_floor(std::min(8, (kNumRegs - 1) / ((GT + 1) * kRegsPerVec)));
  constexpr bool kTwoAcc = (2 * GT + 1) * kRegsPerVec <= kNumRegs / 2 + 1;
  const int nv = NV > 0 ? NV : p.nv;
  const int64_t D = p.head_dim;
  const int64_t b = item.b;
  const int64_t head0 = item.kvh * p.group + item.h0;  // first query head of this item
  const int64_t t_begin = item.t0, L = item.t1 - item.t0;

  if (L <= 0) {  // empty context (context_lens <= 0): zeros
    scalar_t* out = p.out + (b * p.num_heads + head0) * D;
    for (int64_t i = 0; i < GT * D; ++i) out[i] = scalar_t(0.0f);
    return;
  }

  alignas(64) float qf[GT][kDimCap];
  alignas(64) float acc[GT][kDimCap];
  alignas(64) float s[GT][kMaxChunk + kLanes];
  float m[GT], l[GT], corr[GT];
  for (int g = 0; g < GT; ++g) {
    const scalar_t* qp = p.q + b * p.q_sb + (head0 + g) * p.q_sh;
    for (int64_t d = 0; d < D; ++d) {
      qf[g][d] = static_cast<float>(qp[d]) * p.scale;
      acc[g][d] = 0.0f;
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }

  // Row pointers of the item's tokens (block-table lookups done once, sequentially).
  const int32_t* table = p.block_tables + b * p.bt_stride;
  const scalar_t* kbase = p.k + item.kvh * p.k_sh;
  const scalar_t* vbase = p.v + item.kvh * p.v_sh;
  const int64_t bs = p.block_size;
  int64_t blk_i = t_begin / bs, off = t_begin % bs;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t blk = table[blk_i];
    krow[t] = kbase + blk * p.k_sb + off * p.k_st;
    vrow[t] = vbase + blk * p.v_sb + off * p.v_st;
    if (++off == bs) {
      off = 0;
      ++blk_i;
    }
  }
  const int64_t row_bytes = (NV > 0 ? int64_t(kDimCap) : D) * int64_t(sizeof(scalar_t));
  for (int64_t t = 0; t < std::min<int64_t>(kPrefetch, L); ++t) prefetch_row(krow[t], row_bytes);

  for (int64_t c0 = 0; c0 < L; c0 += p.chunk) {
    const int n = static_cast<int>(std::min<int64_t>(p.chunk, L - c0));
    const scalar_t* const* kr_c = krow + c0;
    const scalar_t* const* vr_c = vrow + c0;

    // Scores: s[g][t] = (scale * q_g) . k_t
    for (int t = 0; t < n; ++t) {
      const scalar_t* kr = kr_c[t];
      // K rows kPrefetch tokens ahead (possibly in the next chunk); the chunk's V rows for the V phase.
      if (c0 + t + kPrefetch < L) prefetch_row(kr_c[t + kPrefetch], row_bytes);
      prefetch_row(vr_c[t], row_bytes);
      // Two accumulators per head when registers allow (more independent FMA chains).
      Vec a0[GT], a1[GT];
      for (int g = 0; g < GT; ++g) {
        a0[g] = vzero();
        a1[g] = vzero();
      }
      for (int j = 0; j < nv; ++j) {
        const Vec kj = vload(kr + j * kLanes);
        for (int g = 0; g < GT; ++g) {
          if (kTwoAcc && (j & 1))
            a1[g] = vfma(vload(&qf[g][j * kLanes]), kj, a1[g]);
          else
            a0[g] = vfma(vload(&qf[g][j * kLanes]), kj, a0[g]);
        }
      }
      for (int g = 0; g < GT; ++g) s[g][t] = vsum(kTwoAcc ? a0[g] + a1[g] : a0[g]);
    }
    if (p.softcap > 0.0f) {
      const float cap = p.softcap, inv_cap = 1.0f / p.softcap;
      for (int g = 0; g < GT; ++g)
        for (int t = 0; t < n; ++t) s[g][t] = cap * std::tanh(s[g][t] * inv_cap);
    }

    // Online softmax update; s becomes the unnormalised probabilities exp(s - m).
    const int npad = (n + kLanes - 1) / kLanes * kLanes;
    for (int g = 0; g < GT; ++g) {
      for (int t = n; t < npad; ++t) s[g][t] = -std::numeric_limits<float>::infinity();
      Vec mx = vload(&s[g][0]);
      for (int t = kLanes; t < npad; t += kLanes) mx = vmax(mx, vload(&s[g][t]));
      const float m_new = std::max(m[g], vhmax(mx));
      corr[g] = std::exp(m[g] - m_new);  // 0 on the first chunk (m = -inf)
      const Vec mv = vset(m_new);
      Vec sum = vzero();
      for (int t = 0; t < npad; t += kLanes) {
        Vec e = vexp(vload(&s[g][t]) - mv);
        vstore(&s[g][t], e);
        sum = sum + e;
      }
      l[g] = l[g] * corr[g] + vsum(sum);
      m[g] = m_new;
    }

    // acc[g] = corr[g] * acc[g] + sum_t p[g][t] * v_t, a tile of JT vectors per head at a time.
    for (int j0 = 0; j0 < nv; j0 += JT) {
      const int jt = std::min(JT, nv - j0);
      Vec a[GT][JT];
      for (int g = 0; g < GT; ++g) {
        const Vec cg = vset(corr[g]);
        for (int jj = 0; jj < JT; ++jj)
          if (jj < jt) a[g][jj] = vload(&acc[g][(j0 + jj) * kLanes]) * cg;
      }
      for (int t = 0; t < n; ++t) {
        const scalar_t* vr = vr_c[t] + j0 * kLanes;
        Vec vv[JT];
        for (int jj = 0; jj < JT; ++jj)
          if (jj < jt) vv[jj] = vload(vr + jj * kLanes);
        for (int g = 0; g < GT; ++g) {
          const Vec pg = vset(s[g][t]);
          for (int jj = 0; jj < JT; ++jj)
            if (jj < jt) a[g][jj] = vfma(pg, vv[jj], a[g][jj]);
        }
      }
      for (int g = 0; g < GT; ++g)
        for (int jj = 0; jj < JT; ++jj)
          if (jj < jt) vstore(&acc[g][(j0 + jj) * kLanes], a[g][jj]);
    }
  }

  if (item.partial < 0) {
    scalar_t* out = p.out + (b * p.num_heads + head0) * D;
    for (int g = 0; g < GT; ++g) {
      const float inv = 1.0f / l[g];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g][d] * inv);
    }
  } else {
    const int64_t slot = item.partial * p.num_heads + head0;
    for (int g = 0; g < GT; ++g) {
      partials.ml[(slot + g) * 2] = m[g];
      partials.ml[(slot + g) * 2 + 1] = l[g];
      std::memcpy(partials.acc + (slot + g) * D, acc[g], D * sizeof(float));
    }
  }
}

template <typename scalar_t, int NV>
void attend_dispatch_gt(const Params<scalar_t>& p, const Item& item, const Partials& partials,
                        const scalar_t** krow, const scalar_t** vrow) {
  switch (item.gt) {
    case 1: return attend<scalar_t, 1, NV>(p, item, partials, krow, vrow);
    case 2: return attend<scalar_t, 2, NV>(p, item, partials, krow, vrow);
    case 3: return attend<scalar_t, 3, NV>(p, item, partials, krow, vrow);
    default: return attend<scalar_t, 4, NV>(p, item, partials, krow, vrow);
  }
}

// (first token, number of tokens) sequence b attends: its whole context, or the last `window` tokens of it.
template <typename scalar_t>
std::pair<int64_t, int64_t> span_of(const Params<scalar_t>& p, int64_t b) {
  const int64_t L = std::max<int32_t>(0, p.context_lens[b]);
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, L - p.window) : 0;
  return {start, L - start};
}

template <typename scalar_t>
void run(const Params<scalar_t>& p, int64_t batch, int64_t partition) {
  if (batch == 0) return;
  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  // Split each group into passes of at most kMaxHeadsPerPass heads, as evenly as possible.
  const int64_t npass = (p.group + kMaxHeadsPerPass - 1) / kMaxHeadsPerPass;
  const int64_t per_part = p.num_kv_heads * npass;

  // Longest sequences first, so dynamic scheduling balances the tail.
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t c) { return p.context_lens[a] > p.context_lens[c]; });
  const int64_t max_len = std::max<int64_t>(0, p.context_lens[order[0]]);

  // Partition length: split sequences only when there are too few (sequence, kv head) items to keep the
  // threads busy; then aim at about 4 items per thread, with partitions of at least kMinPartition tokens.
  int64_t part_len = partition;
  if (part_len <= 0) {
    part_len = std::numeric_limits<int64_t>::max();
    if (batch * per_part < 2 * nthreads && nthreads > 1) {
      int64_t total = 0;
      for (int64_t b = 0; b < batch; ++b) total += span_of(p, b).second;
      const int64_t want = (total * per_part + 4 * nthreads - 1) / (4 * nthreads);
      part_len = std::max<int64_t>(kMinPartition, want);
    }
  }

  std::vector<Item> items;
  items.reserve(batch * per_part);
  int64_t n_slots = 0;  // partial-result slots (one per partition of a split sequence)
  std::vector<int64_t> first_slot(batch, -1), n_parts(batch, 1);
  for (int64_t b : order) {
    const auto [start, L] = span_of(p, b);  // the tokens attended: [start, start + L)
    const int64_t parts = L > part_len ? (L + part_len - 1) / part_len : 1;
    n_parts[b] = parts;
    if (parts > 1) {
      first_slot[b] = n_slots;
      n_slots += parts;
    }
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t t0 = start + part * (L / parts) + std::min(part, L % parts);
      const int64_t t1 = t0 + L / parts + (part < L % parts ? 1 : 0);
      for (int64_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
        for (int64_t pass = 0; pass < npass; ++pass) {
          const int64_t base = p.group / npass, extra = p.group % npass;
          const int64_t gt = base + (pass < extra ? 1 : 0);
          const int64_t h0 = pass * base + std::min(pass, extra);
          items.push_back({b, kvh, h0, gt, t0, t1, parts > 1 ? first_slot[b] + part : -1});
        }
      }
    }
  }

  std::vector<float> ml(n_slots * p.num_heads * 2), acc(n_slots * p.num_heads * p.head_dim);
  const Partials partials{ml.data(), acc.data()};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t row_cap = std::max<int64_t>(1, std::min(max_len, part_len));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(nthreads, n_items), 1, [&](int64_t, int64_t) {
    std::vector<const scalar_t*> rows(2 * static_cast<size_t>(row_cap));
    const scalar_t** krow = rows.data();
    const scalar_t** vrow = rows.data() + row_cap;
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& item = items[i];
      switch (p.nv) {
        case 4: attend_dispatch_gt<scalar_t, 4>(p, item, partials, krow, vrow); break;
        case 8: attend_dispatch_gt<scalar_t, 8>(p, item, partials, krow, vrow); break;
        default: attend_dispatch_gt<scalar_t, 0>(p, item, partials, krow, vrow); break;
      }
    }
  });
  if (n_slots == 0) return;

  // Merge the partitions of split sequences: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
  std::vector<int64_t> split;
  for (int64_t b = 0; b < batch; ++b)
    if (n_parts[b] > 1) split.push_back(b);
  const int64_t H = p.num_heads, D = p.head_dim;
  at::parallel_for(0, static_cast<int64_t>(split.size()) * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = split[i / H], h = i % H;
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t part = 0; part < n_parts[b]; ++part)
        M = std::max(M, ml[((first_slot[b] + part) * H + h) * 2]);
      float total = 0.0f;
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t part = 0; part < n_parts[b]; ++part) {
        const int64_t slot = (first_slot[b] + part) * H + h;
        const float w = std::exp(ml[slot * 2] - M);
        total += w * ml[slot * 2 + 1];
        const float* a = acc.data() + slot * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      scalar_t* out = p.out + (b * H + h) * D;
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<scalar_t>(o[d] * inv);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  double scale, int64_t chunk, int64_t partition, int64_t window,
                                  double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors expected");
  TORCH_CHECK(q.dim() == 3, "q must be [B, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ: ", k_cache.sizes(),
              " vs ", v_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables must be [B, max_blocks] "
              "with contiguous rows");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.is_contiguous(), "context_lens must be contiguous [B]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head_dim axis of q, k_cache and v_cache must be contiguous");
  TORCH_CHECK(chunk >= 1 && chunk <= kMaxChunk, "chunk must be in [1, ", kMaxChunk, "]");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: off)");

  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim mismatch between q (", D, ") and the cache (", k_cache.size(3),
              ")");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads (", H, ") must be a multiple of num_kv_heads (", KVH, ")");
  TORCH_CHECK(D % kLanes == 0 && D <= kMaxHeadDim, "head_dim must be a multiple of 16 and at most ",
              kMaxHeadDim, ", got ", D);
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "block_tables/context_lens batch size ",
              "must match q");

  // Validate every block id that will be dereferenced (cheap: B * ceil(L / block_size) int32 reads).
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), bt_stride = block_tables.stride(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = cl[b];
    const int64_t nb = (L + bs - 1) / bs;
    TORCH_CHECK(nb <= max_blocks, "context_lens[", b, "] = ", L, " needs ", nb,
                " blocks but block_tables has ", max_blocks, " columns");
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t blk = bt[b * bt_stride + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", b, ", ", i, "] = ", blk,
                  " is out of range [0, ", num_blocks, ")");
    }
  }

  at::Tensor out = at::empty({B, H, D}, q.options());
  if (B == 0) return out;

  auto launch = [&](auto tag) {
    using scalar_t = decltype(tag);
    Params<scalar_t> p;
    p.q = q.const_data_ptr<scalar_t>();
    p.k = k_cache.const_data_ptr<scalar_t>();
    p.v = v_cache.const_data_ptr<scalar_t>();
    p.out = out.mutable_data_ptr<scalar_t>();
    p.block_tables = bt;
    p.context_lens = cl;
    p.q_sb = q.stride(0);
    p.q_sh = q.stride(1);
    p.k_sb = k_cache.stride(0);
    p.k_st = k_cache.stride(1);
    p.k_sh = k_cache.stride(2);
    p.v_sb = v_cache.stride(0);
    p.v_st = v_cache.stride(1);
    p.v_sh = v_cache.stride(2);
    p.bt_stride = bt_stride;
    p.num_heads = H;
    p.num_kv_heads = KVH;
    p.group = H / KVH;
    p.head_dim = D;
    p.block_size = bs;
    p.nv = static_cast<int>(D / kLanes);
    p.chunk = static_cast<int>(chunk);
    p.scale = static_cast<float>(scale);
    p.window = window;
    p.softcap = static_cast<float>(softcap);
    run<scalar_t>(p, B, partition);
  };
  switch (q.scalar_type()) {
    case at::kFloat: launch(float{}); break;
    case at::kBFloat16: launch(c10::BFloat16{}); break;
    case at::kHalf: launch(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY(kubellm_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int chunk=128, int partition=0, int window=0, float softcap=0.0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) {
  m.impl("paged_decode_attention", &kubellm_cpu::paged_decode_attention);
}
