// Scalar helpers shared by the CPU kernels: dtype conversions that round exactly as PyTorch does, and an exp
// for non-positive arguments. All are plain float code without libm calls, so loops over them vectorise.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kubellm_cpu {
namespace math {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// bfloat16 bits of f, rounded to nearest even (no NaN handling: for values known to be finite).
inline uint32_t bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) {
  return f;
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float f) {
  // Round to nearest even; NaN stays a quiet NaN.
  const uint16_t out = std::isnan(f) ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(bf16_bits(f));
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}
template <>
inline c10::Half from_f<c10::Half>(float f) {
  return c10::Half(f);
}

// f rounded to what storing it in T and loading it back gives (identity for float).
template <typename T>
inline float round_as(float f) {
  return to_f(from_f<T>(f));
}

// e^x for x <= 0 (-inf included): 2^n * e^r with n = round(x / ln2) (the 1.5 * 2^23 trick), r = x - n ln2 in
// two constants, e^r by its Taylor series to degree 7 (relative error below 1e-8 for |r| <= ln2 / 2); 0 below -87.
inline float exp_nonpos(float x) {
  const float xc = x > -87.0f ? x : -87.0f;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x >= -87.0f ? p * scale : 0.0f;
}

}  // namespace math
}  // namespace kubellm_cpu
