// Fused elementwise ops of a Llama layer on CPU: RMSNorm (with the residual add folded in), SiLU-and-mul,
// rotary embedding, and Qwen3's per-head q/k RMSNorm fused with rotary. See kubellm/kernels/cpu_layer_ops.py
// for the Python contract and the PyTorch references.
//
// Why: at decode batch sizes each of these is a handful of tiny PyTorch ops (RMSNorm alone is eight), so a
// step spends more time dispatching them than computing; in prefill the float32 temporaries cost memory
// passes. Each op here is one pass over its rows.
//
// Bit-compatibility: every intermediate the reference rounds to the model dtype is rounded here too, at the
// same point (round-to-nearest-even, like PyTorch), so bfloat16 results match the reference bit for bit
// except where the reference's own float32 reductions (mean of squares) or exp differ in the last float32
// ulp. Loops are plain float code that -O3 -march=native vectorises (omp simd for the reductions).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "scalar_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kubellm_cpu {
namespace {

using math::from_f;
using math::round_as;
using math::to_f;

// Rows per parallel task: enough elements that the thread hand-off pays for itself.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// ---- RMSNorm ------------------------------------------------------------------------------------------------
// 1 / sqrt(mean(x^2) + eps) over n values, summed in float32 (rms_norm_rows and norm_rotate_head share it).
template <typename T>
inline float inv_rms(const T* x, int64_t n, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  return 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// out = w * T(x * rsqrt(mean(x^2) + eps)); with a residual: first residual = T(residual + x) (in place), then
// normalise that. The reference normalises in float32, rounds to T, then multiplies by the weight in T.
template <typename T>
void rms_norm_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, T* residual, int64_t res_stride,
                   const T* w, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* outr = out + r * out_stride;
      const T* src = xr;
      if (residual != nullptr) {
        T* rr = residual + r * res_stride;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) rr[i] = from_f<T>(to_f(rr[i]) + to_f(xr[i]));
        src = rr;
      }
      const float inv = inv_rms(src, hidden, eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) outr[i] = from_f<T>(to_f(w[i]) * round_as<T>(to_f(src[i]) * inv));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name, int64_t hidden) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [tokens, hidden], got ", t.sizes());
  TORCH_CHECK(t.size(1) == hidden && t.stride(1) == 1, name, " must have ", hidden, " contiguous columns");
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t hidden = weight.size(0);
  check_rows(x, "x", hidden);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "weight: contiguous, x's dtype");
  at::Tensor out = at::empty({x.size(0), hidden}, x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(out.mutable_data_ptr<T>(), hidden, x.const_data_ptr<T>(), x.stride(0), nullptr, 0,
                     weight.const_data_ptr<T>(), x.size(0), hidden, static_cast<float>(eps));
  });
  return out;
}

// residual <- residual + x; x <- rms_norm(residual). Both in place (x is a fresh layer output).
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t hidden = weight.size(0);
  check_rows(x, "x", hidden);
  check_rows(residual, "residual", hidden);
  TORCH_CHECK(x.size(0) == residual.size(0), "x and residual must have the same number of rows");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "x, residual and weight must share one dtype; weight contiguous");
  dispatch(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.mutable_data_ptr<T>(), x.stride(0), x.const_data_ptr<T>(), x.stride(0),
                     residual.mutable_data_ptr<T>(), residual.stride(0), weight.const_data_ptr<T>(), x.size(0),
                     hidden, static_cast<float>(eps));
  });
}

// ---- SiLU and mul -------------------------------------------------------------------------------------------
// gate_up [T, 2I] -> T(T(silu(gate)) * up) [T, I]. exp_nonpos has no libm call, so the loop vectorises; only
// non-positive arguments reach it (sigmoid written for the sign of x).
using math::exp_nonpos;

inline float silu(float x) {
  const float e = exp_nonpos(-std::fabs(x));  // e^-|x| in (0, 1]: x * sigmoid(x) without overflow
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be 2-D [tokens, 2 * intermediate] with contiguous columns, got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = gate_up.const_data_ptr<T>();
    T* dst = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = src + r * stride;
        const T* u = g + inter;
        T* o = dst + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) o[i] = from_f<T>(round_as<T>(silu(to_f(g[i]))) * to_f(u[i]));
      }
    });
  });
  return out;
}

// ---- Rotary embedding (rotate-half layout) -------------------------------------------------------------------
// In place on q [T, H, D] and k [T, KVH, D] (views into the fused qkv output: rows strided, heads and dims
// contiguous). cos/sin [max_positions, D] in the model dtype. The reference is x * cos + rotate_half(x) * sin
// with both products rounded to T before the sum.
template <typename T>
void rotate_heads(T* base, int64_t row_stride, int64_t head_stride, int64_t heads, const int64_t* pos,
                  const T* cos, const T* sin, int64_t table_stride, int64_t rows, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + pos[r] * table_stride;
      const T* s = sin + pos[r] * table_stride;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = base + r * row_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_f(x[i]), b = to_f(x[i + half]);
          x[i] = from_f<T>(round_as<T>(a * to_f(c[i])) + round_as<T>(-b * to_f(s[i])));
          x[i + half] = from_f<T>(round_as<T>(b * to_f(c[i + half])) + round_as<T>(a * to_f(s[i + half])));
        }
      }
    }
  });
}

void rotary_embedding_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [tokens, heads, head_dim]");
  const int64_t rows = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == rows && k.size(2) == dim && dim % 2 == 0, "q/k token count or head_dim mismatch");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k need contiguous head_dim");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions must be a contiguous int64 [tokens] tensor");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && cos.stride(1) == 1 && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides(),
              "cos/sin must be [max_positions, head_dim] with contiguous columns");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share one dtype");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " outside the rotary table [0, ", max_pos, ")");
  dispatch(q.scalar_type(), "rotary_embedding_", [&](auto tag) {
    using T = decltype(tag);
    rotate_heads<T>(q.mutable_data_ptr<T>(), q.stride(0), q.stride(1), q.size(1), pos, cos.const_data_ptr<T>(),
                    sin.const_data_ptr<T>(), cos.stride(0), rows, dim);
    rotate_heads<T>(k.mutable_data_ptr<T>(), k.stride(0), k.stride(1), k.size(1), pos, cos.const_data_ptr<T>(),
                    sin.const_data_ptr<T>(), cos.stride(0), rows, dim);
  });
}

// ---- Per-head RMSNorm of q and k, then rotary (Qwen3) -----------------------------------------------------------
// One pass instead of two norms (each a copy of the strided view, then a new tensor) and the rotary kernel:
// every head row is normalised as rms_norm does it (float32, rounded to T, times the weight in T), then rotated
// as rotate_heads does it, in place on the strided q/k views into the fused qkv output.
template <typename T>
void norm_rotate_head(T* x, const T* w, float eps, const T* c, const T* s, int64_t dim) {
  const int64_t half = dim / 2;
  float n[512];  // the normed head, already rounded to T (dim <= 512 is checked)
  const float inv = inv_rms(x, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) n[i] = round_as<T>(to_f(w[i]) * round_as<T>(to_f(x[i]) * inv));
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = n[i], b = n[i + half];
    x[i] = from_f<T>(round_as<T>(a * to_f(c[i])) + round_as<T>(-b * to_f(s[i])));
    x[i + half] = from_f<T>(round_as<T>(b * to_f(c[i + half])) + round_as<T>(a * to_f(s[i + half])));
  }
}

void qk_norm_rotary_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                     const at::Tensor& k_weight, double eps, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [tokens, heads, head_dim]");
  const int64_t rows = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == rows && k.size(2) == dim && dim % 2 == 0 && dim <= 512,
              "q/k token count or head_dim mismatch (head_dim even, at most 512)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k need contiguous head_dim");
  TORCH_CHECK(q_weight.dim() == 1 && q_weight.size(0) == dim && q_weight.is_contiguous() && k_weight.dim() == 1 &&
                  k_weight.size(0) == dim && k_weight.is_contiguous(),
              "q_weight and k_weight must be contiguous [head_dim]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions must be a contiguous int64 [tokens] tensor");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && cos.stride(1) == 1 && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides(),
              "cos/sin must be [max_positions, head_dim] with contiguous columns");
  const at::ScalarType dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && cos.scalar_type() == dt && sin.scalar_type() == dt &&
                  q_weight.scalar_type() == dt && k_weight.scalar_type() == dt,
              "q, k, the norm weights, cos and sin must share one dtype");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " outside the rotary table [0, ", max_pos, ")");
  const int64_t qh = q.size(1), kh = k.size(1);
  dispatch(dt, "qk_norm_rotary_", [&](auto tag) {
    using T = decltype(tag);
    T* qp = q.mutable_data_ptr<T>();
    T* kp = k.mutable_data_ptr<T>();
    const T* qw = q_weight.const_data_ptr<T>();
    const T* kw = k_weight.const_data_ptr<T>();
    const T* cp = cos.const_data_ptr<T>();
    const T* sp = sin.const_data_ptr<T>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, grain_rows((qh + kh) * dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* c = cp + pos[r] * cos.stride(0);
        const T* s = sp + pos[r] * cos.stride(0);
        for (int64_t h = 0; h < qh; ++h) norm_rotate_head<T>(qp + r * q.stride(0) + h * q.stride(1), qw, e, c, s, dim);
        for (int64_t h = 0; h < kh; ++h) norm_rotate_head<T>(kp + r * k.stride(0) + h * k.stride(1), kw, e, c, s, dim);
      }
    });
  });
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_embedding_(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "qk_norm_rotary_(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, float eps, "
      "Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) {
  m.impl("rms_norm", &kubellm_cpu::rms_norm);
  m.impl("add_rms_norm_", &kubellm_cpu::add_rms_norm_);
  m.impl("silu_and_mul", &kubellm_cpu::silu_and_mul);
  m.impl("rotary_embedding_", &kubellm_cpu::rotary_embedding_);
  m.impl("qk_norm_rotary_", &kubellm_cpu::qk_norm_rotary_);
}
