// Storage types for bfloat16/float16 on the CPU and their float32 conversions (round to
// nearest even), so the CPU twins read and write the same bits XLA does.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace jaxops::cpu {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }
inline float to_float(bf16 v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }

inline float to_float(f16 v) {
  uint32_t sign = (v.bits & 0x8000u) << 16, exp = (v.bits >> 10) & 0x1f, man = v.bits & 0x3ff;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {                                                     // zero / subnormal
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

template <class T> T from_float(float v);
template <class T> T from_float(double v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline double from_float<double>(double v) { return v; }
template <> inline double from_float<double>(float v) { return v; }
template <> inline float from_float<float>(double v) { return static_cast<float>(v); }

template <> inline bf16 from_float<bf16>(float v) {
  uint32_t u = float_bits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

template <> inline f16 from_float<f16>(float v) {
  uint32_t u = float_bits(v);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (a < 0x38800000u) {  // subnormal half: round |v| * 2^24 to an integer, ties to even
    float m = std::nearbyint(std::fabs(v) * 16777216.0f);
    return f16{static_cast<uint16_t>(sign | static_cast<uint16_t>(m))};
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13))};
}
template <> inline bf16 from_float<bf16>(double v) { return from_float<bf16>(static_cast<float>(v)); }
template <> inline f16 from_float<f16>(double v) { return from_float<f16>(static_cast<float>(v)); }

// Accumulation type: float32 for every input type except float64.
template <class T> struct acc { using type = float; };
template <> struct acc<double> { using type = double; };
template <class T> using acc_t = typename acc<T>::type;

// Calls f(T{}) with T the CPU storage type of `d`; returns false for an unsupported dtype.
template <class F>
bool dispatch_float(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kF32: f(float{}); return true;
    case Dtype::kF64: f(double{}); return true;
    case Dtype::kBF16: f(bf16{}); return true;
    case Dtype::kF16: f(f16{}); return true;
    default: return false;
  }
}

}  // namespace jaxops::cpu
