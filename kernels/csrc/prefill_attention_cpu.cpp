// Causal prefill attention on CPU for one sequence's chunk, flash-style (online softmax, no T x S matrix).
// See kubellm/kernels/cpu_prefill_attention.py for the Python contract and the PyTorch reference.
//
//   q [T, H, D], k/v [S, KVH, D] (S >= T: the chunk's T queries are the last T positions of the context),
//   rows and heads may be strided, head_dim contiguous; out [T, H, D] in q's dtype. Query t attends keys
//   0 .. S - T + t. GQA: query head h reads kv head h / (H / KVH).
//
// Why not PyTorch's SDPA: on 2 cores its flash CPU kernel reaches ~30 GFLOP/s at the head sizes of small
// Llamas (9 heads of 64, a few hundred tokens), a quarter of a prefill step. Here a work item is (kv head,
// block of kQueries query tokens): the G query heads sharing the kv head and kQueries tokens make up to
// G * kQueries rows that reuse each K/V block once it is converted to float32 (K transposed, so a score row
// is D broadcast-FMAs over kKeys lanes, no horizontal sums). Items are handed out longest first through an
// atomic counter, since causal rows near the end of the chunk see the most keys.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "scalar_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kubellm_cpu {
namespace {

constexpr int kKeys = 64;     // keys per block (score row width)
constexpr int kQueries = 16;  // query tokens per work item
constexpr int kMaxHeadDim = 256;
constexpr int kRows = 4;  // query rows per register block (fixed head_dim path)

using math::bf16_bits;
using math::exp_nonpos;
inline float load_f(float x) { return x; }
inline float load_f(c10::BFloat16 x) { return math::to_f(x); }
inline float load_f(c10::Half x) { return math::to_f(x); }

// One online-softmax step for a score row over a key block: turns sc[lo, valid) into probabilities (0
// elsewhere), folds the block into the running max m and normaliser l, and returns the factor (<= 1) that
// rescales the row's earlier accumulation. lo > 0 only for a sliding window that starts inside the block.
inline float online_softmax(float* sc, int64_t lo, int64_t valid, float& m, float& l) {
  float mb = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mb)
  for (int j = 0; j < kKeys; ++j)
    mb = std::max(mb, j >= lo && j < valid ? sc[j] : -std::numeric_limits<float>::infinity());
  const float m_new = std::max(m, mb);
  const float corr = exp_nonpos(m - m_new);  // 0 on the first block (m = -inf)
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < kKeys; ++j) {
    const float p = j >= lo && j < valid ? exp_nonpos(sc[j] - m_new) : 0.0f;
    sc[j] = p;
    sum += p;
  }
  l = l * corr + sum;
  m = m_new;
  return corr;
}

struct Shape {
  int64_t T, S, H, KVH, G, D;
  int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh;  // token and head strides (elements)
  float scale;
  int64_t window;  // > 0: query p sees keys (p - window, p] only
  float softcap;   // > 0: scores become softcap * tanh(score / softcap)
};

// The keys [lo, valid) of the block [kb, kb + nk) that query token `token` sees: up to itself, and within
// its window. valid = 0 when it sees none of them.
inline void row_keys(const Shape& s, int64_t token, int64_t kb, int64_t nk, int64_t& lo, int64_t& valid) {
  valid = std::max<int64_t>(0, std::min<int64_t>(nk, token - kb + 1));
  lo = s.window > 0 ? std::max<int64_t>(0, token - s.window + 1 - kb) : 0;
  if (lo >= valid) valid = lo = 0;
}

// row_keys for each of the kRows rows from r0 (padding rows past `rows` see nothing); returns the largest
// valid. Row r is query token first_token + r / G.
inline int64_t visible_keys(const Shape& s, int64_t r0, int64_t rows, int64_t first_token, int64_t kb, int64_t nk,
                            int64_t lo[kRows], int64_t valid[kRows]) {
  int64_t most = 0;
  for (int i = 0; i < kRows; ++i) {
    if (r0 + i < rows) {
      row_keys(s, first_token + (r0 + i) / s.G, kb, nk, lo[i], valid[i]);
    } else {
      lo[i] = valid[i] = 0;
    }
    most = std::max(most, valid[i]);
  }
  return most;
}

// The first key block (a multiple of kKeys) any query from `first_token` on may see.
inline int64_t first_block(const Shape& s, int64_t first_token) {
  return s.window > 0 ? std::max<int64_t>(0, first_token - s.window + 1) / kKeys * kKeys : 0;
}

inline void soft_cap(const Shape& s, float* sc, int64_t lo, int64_t valid) {
  if (s.softcap <= 0.0f) return;
  const float cap = s.softcap, inv = 1.0f / s.softcap;
  for (int64_t j = lo; j < valid; ++j) sc[j] = cap * std::tanh(sc[j] * inv);
}

// kD > 0: head_dim known at compile time (score and accumulator rows stay in registers); 0: runtime s.D.
template <typename T, int kD>
void run_item(const Shape& s, const T* q, const T* k, const T* v, T* out, int64_t kvh, int64_t qb, float* qf,
              float* acc, float* kt, float* vf) {
  const int64_t D = kD > 0 ? kD : s.D, G = s.G;
  const int64_t t0 = qb * kQueries, t1 = std::min(s.T, t0 + kQueries);
  const int64_t rows = (t1 - t0) * G;
  const int64_t offset = s.S - s.T;  // query t sees keys [0, offset + t]
  float m[kQueries * 16], l[kQueries * 16];  // G <= 16 (checked by the caller)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, h = kvh * G + r % G;
    const T* src = q + t * s.q_st + h * s.q_sh;
    float* dst = qf + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = load_f(src[d]) * s.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const int64_t last_key = offset + t1 - 1;
  for (int64_t kb = first_block(s, offset + t0); kb <= last_key; kb += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, last_key + 1 - kb);
    // K block transposed to [D][kKeys] (zero past nk), V block to [nk][D], both float32.
    for (int64_t j = 0; j < kKeys; ++j) {
      if (j < nk) {
        const T* kr = k + (kb + j) * s.k_st + kvh * s.k_sh;
        const T* vr = v + (kb + j) * s.v_st + kvh * s.v_sh;
        for (int64_t d = 0; d < D; ++d) kt[d * kKeys + j] = load_f(kr[d]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vf[j * D + d] = load_f(vr[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) kt[d * kKeys + j] = 0.0f;
      }
    }
    if constexpr (kD > 0) {
      // kRows rows at a time: each K^T / V vector loaded feeds kRows FMAs (the loop is FMA-bound, not
      // load-bound). Rows past `rows` read zero-padded qf rows and are never stored.
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        int64_t lo[kRows], valid[kRows];
        const int64_t most = visible_keys(s, r0, rows, offset + t0, kb, nk, lo, valid);
        if (most == 0) continue;
        float sc[kRows][kKeys];
        for (int i = 0; i < kRows; ++i)
#pragma omp simd
          for (int j = 0; j < kKeys; ++j) sc[i][j] = 0.0f;
        for (int d = 0; d < kD; ++d) {
          const float* kd = kt + d * kKeys;
          for (int i = 0; i < kRows; ++i) {
            const float qd = qf[(r0 + i) * kD + d];
#pragma omp simd
            for (int j = 0; j < kKeys; ++j) sc[i][j] += qd * kd[j];
          }
        }
        float corr[kRows];
        for (int i = 0; i < kRows; ++i) {
          const int64_t r = r0 + i;
          if (valid[i] == 0) {  // masked (or padding) row: nothing to add
            corr[i] = 1.0f;
#pragma omp simd
            for (int j = 0; j < kKeys; ++j) sc[i][j] = 0.0f;
            continue;
          }
          soft_cap(s, sc[i], lo[i], valid[i]);
          corr[i] = online_softmax(sc[i], lo[i], valid[i], m[r], l[r]);
        }
        float a[kRows][kD];
        for (int i = 0; i < kRows; ++i)
#pragma omp simd
          for (int d = 0; d < kD; ++d) a[i][d] = acc[(r0 + i) * kD + d] * corr[i];
        for (int64_t j = 0; j < most; ++j) {
          const float* vj = vf + j * kD;
          for (int i = 0; i < kRows; ++i) {
            const float p = sc[i][j];
#pragma omp simd
            for (int d = 0; d < kD; ++d) a[i][d] += p * vj[d];
          }
        }
        for (int i = 0; i < kRows; ++i)
#pragma omp simd
          for (int d = 0; d < kD; ++d) acc[(r0 + i) * kD + d] = a[i][d];
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      int64_t lo, valid;
      row_keys(s, offset + t0 + r / G, kb, nk, lo, valid);
      if (valid == 0) continue;
      const float* qr = qf + r * D;
      float sc[kKeys];
#pragma omp simd
      for (int j = 0; j < kKeys; ++j) sc[j] = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qr[d];
        const float* kd = kt + d * kKeys;
#pragma omp simd
        for (int j = 0; j < kKeys; ++j) sc[j] += qd * kd[j];
      }
      soft_cap(s, sc, lo, valid);
      const float corr = online_softmax(sc, lo, valid, m[r], l[r]);
      float* ar = acc + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      for (int64_t j = lo; j < valid; ++j) {
        const float p = sc[j];
        const float* vj = vf + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vj[d];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, h = kvh * G + r % G;
    const float inv = 1.0f / l[r];
    T* dst = out + (t * s.H + h) * D;
    const float* ar = acc + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(ar[d] * inv);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bfloat16 inputs with head_dim 64 on CPUs with AVX512-BF16: both products as bf16 pair dot products
// (vdpbf16ps: 32 multiply-adds per instruction, float32 accumulation), twice the rate of float32 FMAs.
// q and k are used as stored (bf16, exact); the probabilities are rounded to bf16 for P.V, as GPU flash
// attention does; the softmax normaliser sums the unrounded float32 probabilities.
#define KUBELLM_PREFILL_BF16_DOT 1
void run_item_bf16_d64(const Shape& s, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                       c10::BFloat16* out, int64_t kvh, int64_t qb, float* qbuf, float* acc, float* ktbuf,
                       float* vbuf) {
  constexpr int kD = 64, kPairs = kD / 2, kVec = kD / 16, kBlockVec = kKeys / 16;
  const int64_t G = s.G;
  const int64_t t0 = qb * kQueries, t1 = std::min(s.T, t0 + kQueries);
  const int64_t rows = (t1 - t0) * G;
  const int64_t offset = s.S - s.T;
  uint32_t* q2 = reinterpret_cast<uint32_t*>(qbuf);    // [rows + kRows][kPairs]: bf16 pairs of each query row
  uint32_t* kt2 = reinterpret_cast<uint32_t*>(ktbuf);  // [kPairs][kKeys]: pair i of every key in the block
  uint32_t* vt2 = reinterpret_cast<uint32_t*>(vbuf);   // [kKeys / 2][kD]: (key 2j, key 2j+1) per dimension
  float m[kQueries * 16], l[kQueries * 16];
  for (int64_t r = 0; r < rows + kRows; ++r) {
    if (r < rows) {
      const int64_t t = t0 + r / G, h = kvh * G + r % G;
      std::memcpy(q2 + r * kPairs, q + t * s.q_st + h * s.q_sh, kD * sizeof(c10::BFloat16));
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.0f;
    } else {
      std::fill(q2 + r * kPairs, q2 + (r + 1) * kPairs, 0u);
    }
    std::fill(acc + r * kD, acc + (r + 1) * kD, 0.0f);
  }
  const int64_t last_key = offset + t1 - 1;
  for (int64_t kb = first_block(s, offset + t0); kb <= last_key; kb += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, last_key + 1 - kb);
    for (int64_t j = 0; j < kKeys; ++j) {
      if (j < nk) {
        const uint32_t* kr = reinterpret_cast<const uint32_t*>(k + (kb + j) * s.k_st + kvh * s.k_sh);
        for (int i = 0; i < kPairs; ++i) kt2[i * kKeys + j] = kr[i];
      } else {
        for (int i = 0; i < kPairs; ++i) kt2[i * kKeys + j] = 0u;
      }
    }
    for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
      const int64_t j0 = 2 * jp, j1 = j0 + 1;
      const uint16_t* v0 = j0 < nk ? reinterpret_cast<const uint16_t*>(v + (kb + j0) * s.v_st + kvh * s.v_sh) : nullptr;
      const uint16_t* v1 = j1 < nk ? reinterpret_cast<const uint16_t*>(v + (kb + j1) * s.v_st + kvh * s.v_sh) : nullptr;
      uint32_t* dst = vt2 + jp * kD;
      for (int d = 0; d < kD; ++d)
        dst[d] = static_cast<uint32_t>(v0 ? v0[d] : 0) | static_cast<uint32_t>(v1 ? v1[d] : 0) << 16;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      int64_t lo[kRows], valid[kRows];
      const int64_t most = visible_keys(s, r0, rows, offset + t0, kb, nk, lo, valid);
      if (most == 0) continue;
      __m512 sacc[kRows][kBlockVec];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kBlockVec; ++c) sacc[i][c] = _mm512_setzero_ps();
      for (int p = 0; p < kPairs; ++p) {
        __m512i kv[kBlockVec];
        for (int c = 0; c < kBlockVec; ++c) kv[c] = _mm512_loadu_si512(kt2 + p * kKeys + c * 16);
        for (int i = 0; i < kRows; ++i) {
          const __m512i qp = _mm512_set1_epi32(static_cast<int>(q2[(r0 + i) * kPairs + p]));
          for (int c = 0; c < kBlockVec; ++c)
            sacc[i][c] = _mm512_dpbf16_ps(sacc[i][c], (__m512bh)kv[c], (__m512bh)qp);
        }
      }
      float sc[kRows][kKeys];
      const __m512 scale = _mm512_set1_ps(s.scale);
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kBlockVec; ++c) _mm512_storeu_ps(&sc[i][c * 16], _mm512_mul_ps(sacc[i][c], scale));
      float corr[kRows];
      for (int i = 0; i < kRows; ++i) {
        const int64_t r = r0 + i;
        if (valid[i] == 0) {
          corr[i] = 1.0f;
          for (int j = 0; j < kKeys; ++j) sc[i][j] = 0.0f;
          continue;
        }
        soft_cap(s, sc[i], lo[i], valid[i]);
        corr[i] = online_softmax(sc[i], lo[i], valid[i], m[r], l[r]);
      }
      __m512 oacc[kRows][kVec];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kVec; ++c)
          oacc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * kD + c * 16), _mm512_set1_ps(corr[i]));
      const int64_t pairs = (most + 1) / 2;
      for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512i vv[kVec];
        for (int c = 0; c < kVec; ++c) vv[c] = _mm512_loadu_si512(vt2 + jp * kD + c * 16);
        for (int i = 0; i < kRows; ++i) {
          const uint32_t pp = bf16_bits(sc[i][2 * jp]) | bf16_bits(sc[i][2 * jp + 1]) << 16;
          const __m512i pb = _mm512_set1_epi32(static_cast<int>(pp));
          for (int c = 0; c < kVec; ++c) oacc[i][c] = _mm512_dpbf16_ps(oacc[i][c], (__m512bh)vv[c], (__m512bh)pb);
        }
      }
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kVec; ++c) _mm512_storeu_ps(acc + (r0 + i) * kD + c * 16, oacc[i][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, h = kvh * G + r % G;
    const float inv = 1.0f / l[r];
    c10::BFloat16* dst = out + (t * s.H + h) * kD;
    const float* ar = acc + r * kD;
    for (int d = 0; d < kD; ++d) dst[d] = static_cast<c10::BFloat16>(ar[d] * inv);
  }
}
#endif

// Writes into `out` ([T, H, D], contiguous, q's dtype): a row range of the step's output, so the chunk's result
// needs no copy afterwards.
void prefill_attention_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t window, double softcap, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape");
  Shape s;
  s.T = q.size(0);
  s.H = q.size(1);
  s.D = q.size(2);
  s.S = k.size(0);
  s.KVH = k.size(1);
  TORCH_CHECK(k.size(2) == s.D, "q and k head_dim differ");
  TORCH_CHECK(s.S >= s.T, "the context (", s.S, " keys) must include the chunk's ", s.T, " queries");
  TORCH_CHECK(s.KVH > 0 && s.H % s.KVH == 0, "num_heads must be a multiple of num_kv_heads");
  s.G = s.H / s.KVH;
  TORCH_CHECK(s.G <= 16, "at most 16 query heads per kv head, got ", s.G);
  TORCH_CHECK(s.D <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v dtypes differ");
  s.q_st = q.stride(0);
  s.q_sh = q.stride(1);
  s.k_st = k.stride(0);
  s.k_sh = k.stride(1);
  s.v_st = v.stride(0);
  s.v_sh = v.stride(1);
  s.scale = static_cast<float>(scale);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: off)");
  s.window = window;
  s.softcap = static_cast<float>(softcap);
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out must be a contiguous [tokens, heads, head_dim] tensor of q's dtype");
  if (s.T == 0) return;
  const int64_t qblocks = (s.T + kQueries - 1) / kQueries;
  const int64_t items = qblocks * s.KVH;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.const_data_ptr<T>();
    const T* kp = k.const_data_ptr<T>();
    const T* vp = v.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      const int64_t rows = kQueries * s.G;
      std::vector<float> qf((rows + kRows) * s.D, 0.0f), acc((rows + kRows) * s.D), kt(s.D * kKeys), vf(kKeys * s.D);
      for (int64_t w = begin; w < end; ++w) {
        for (;;) {
          const int64_t i = next.fetch_add(1);
          if (i >= items) break;
          const int64_t qb = qblocks - 1 - i / s.KVH;  // longest (last) query blocks first
#ifdef KUBELLM_PREFILL_BF16_DOT
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (s.D == 64) {
              run_item_bf16_d64(s, qp, kp, vp, op, i % s.KVH, qb, qf.data(), acc.data(), kt.data(), vf.data());
              continue;
            }
          }
#endif
          auto* run = s.D == 64 ? &run_item<T, 64> : s.D == 128 ? &run_item<T, 128> : &run_item<T, 0>;
          run(s, qp, kp, vp, op, i % s.KVH, qb, qf.data(), acc.data(), kt.data(), vf.data());
        }
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: launch(float{}); break;
    case at::kBFloat16: launch(c10::BFloat16{}); break;
    case at::kHalf: launch(c10::Half{}); break;
    default: TORCH_CHECK(false, "prefill_attention: unsupported dtype ", q.scalar_type());
  }
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  prefill_attention_into(q, k, v, scale, window, softcap, out);
  return out;
}

void prefill_attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           int64_t window, double softcap, const at::Tensor& out) {
  prefill_attention_into(q, k, v, scale, window, softcap, out);
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("prefill_attention_out(Tensor q, Tensor k, Tensor v, float scale, int window, float softcap, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) {
  m.impl("prefill_attention", &kubellm_cpu::prefill_attention);
  m.impl("prefill_attention_out", &kubellm_cpu::prefill_attention_out);
}
