// Storage types for bfloat16/float16 on the CPU and their float32 conversions (round to
// nearest even), so the CPU twins read and write the same bits XLA does. Branch-free, so loops
// over rows vectorize; the bits equal the branchy textbook conversions' for every input (all 2^16
// halves and all 2^32 floats compared, session 53).
#pragma once
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

// All ones where `c`, else 0: the vectorizable form of a select's condition. The conversions
// below select with it instead of branching, so that rows of 16-bit values convert a vector at a
// time (the branchy float16 conversions kept f16 rows scalar: 4x float32's time).
template <class I>
inline I ones_if(bool c) {
  return static_cast<I>(-static_cast<I>(c));
}

// float16 -> float32: subnormal halves become normal floats through one exact float subtraction,
// (1 + m / 2^10) * 2^-14 - 2^-14.
inline float to_float(f16 v) {
  const uint32_t o = static_cast<uint32_t>(v.bits & 0x7fffu) << 13;  // exponent and mantissa
  const uint32_t exp = o & (0x7c00u << 13);
  const uint32_t normal = o + ((127u - 15u) << 23);
  const uint32_t inf_nan = normal + ((128u - 16u) << 23);  // exponent field all ones
  const uint32_t sub = float_bits(bits_float(normal + (1u << 23)) - 6.103515625e-05f);
  const uint32_t is_inf_nan = ones_if<uint32_t>(exp == (0x7c00u << 13));
  const uint32_t is_sub = ones_if<uint32_t>(exp == 0);
  const uint32_t mag = (inf_nan & is_inf_nan) | (sub & is_sub) | (normal & ~(is_inf_nan | is_sub));
  return bits_float(mag | (static_cast<uint32_t>(v.bits & 0x8000u) << 16));
}

template <class T> T from_float(float v);
template <class T> T from_float(double v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline double from_float<double>(double v) { return v; }
template <> inline double from_float<double>(float v) { return v; }
template <> inline float from_float<float>(double v) { return static_cast<float>(v); }

// Rounding to nearest even; NaN becomes a quiet NaN with its sign (bf16: the top bits | 0x40,
// f16: 0x7e00), as XLA's conversions give.
template <> inline bf16 from_float<bf16>(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ones_if<uint32_t>(static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000);
  return bf16{static_cast<uint16_t>((((u >> 16) | 0x40u) & nan) | (rounded & ~nan))};
}

template <> inline f16 from_float<f16>(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u ^ sign;
  // >= 65520 rounds to inf.
  const uint32_t big = static_cast<uint32_t>(static_cast<int32_t>(a) > 0x7f800000 ? 0x7e00u : 0x7c00u);
  // Subnormal halves (|v| < 2^-14): adding 0.5 moves the value's bits 2^-24 and up into the low
  // mantissa bits, rounded to nearest even by the float addition itself; minus the bits of 0.5.
  const uint32_t sub = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
  // Normal halves: rebias the exponent, round the 13 dropped bits to nearest even.
  const uint32_t normal = (a + ((15u - 127u) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t is_big = ones_if<uint32_t>(static_cast<int32_t>(a) >= 0x477ff000);
  const uint32_t is_sub = ones_if<uint32_t>(static_cast<int32_t>(a) < 0x38800000);
  const uint32_t mag = (big & is_big) | (sub & is_sub & ~is_big) | (normal & ~(is_big | is_sub));
  return f16{static_cast<uint16_t>(mag | (sign >> 16))};
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
