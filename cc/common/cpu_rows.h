// Rows between their storage type and the CPU twins' accumulation type (float; double for
// float64): the twins widen a row into scratch, compute there a vectorizable pass at a time, and
// narrow it back. Every conversion here is branch-free and gives the bits of cpu_float.h's.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cpu_bits.h"
#include "common/cpu_float.h"

namespace jaxops::cpu {

// float16 <-> float32 without branches (the conversions of cpu_float.h take one for inf / NaN
// and subnormals, which kept f16 rows scalar: 4x float32's time). Same bits as to_float /
// from_float<f16> for every input (checked exhaustively, session 52): subnormal halves become
// normal floats through one float subtraction, floats round to nearest even through integer
// adds (normal halves) or one float addition (subnormal halves).
inline uint32_t f16_bits_to_f32_bits(uint16_t h) {
  const uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa, moved
  const uint32_t exp = o & (0x7c00u << 13);
  const uint32_t normal = o + ((127u - 15u) << 23);
  const uint32_t inf_nan = normal + ((128u - 16u) << 23);  // exponent field all ones
  // Subnormal (and zero): 2^-14 * mantissa / 1024, exactly, as (1 + m / 2^10) * 2^-14 - 2^-14.
  uint32_t sub_bits = normal + (1u << 23);
  float sub;
  std::memcpy(&sub, &sub_bits, 4);
  sub -= 6.103515625e-05f;  // 2^-14
  std::memcpy(&sub_bits, &sub, 4);
  const uint32_t is_inf_nan = ones_if<uint32_t>(exp == (0x7c00u << 13));
  const uint32_t is_sub = ones_if<uint32_t>(exp == 0);
  const uint32_t mag = (inf_nan & is_inf_nan) | (sub_bits & is_sub) | (normal & ~(is_inf_nan | is_sub));
  return mag | (static_cast<uint32_t>(h & 0x8000u) << 16);
}

inline uint16_t f32_to_f16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u ^ sign;
  // >= 65520 rounds to inf; NaN becomes the quiet NaN 0x7e00 (with the sign), as from_float does.
  const uint32_t big = static_cast<uint32_t>(static_cast<int32_t>(a) > 0x7f800000 ? 0x7e00u : 0x7c00u);
  // Subnormal halves (|v| < 2^-14): adding 0.5 moves the value's bits 2^-24 and up into the low
  // mantissa bits, rounded to nearest even by the float addition itself.
  float af;
  std::memcpy(&af, &a, 4);
  float sf = af + 0.5f;
  uint32_t sb;
  std::memcpy(&sb, &sf, 4);
  const uint32_t sub = sb - 0x3f000000u;  // minus the bits of 0.5
  // Normal halves: rebias the exponent, round the 13 dropped bits to nearest even.
  const uint32_t normal = (a + ((15u - 127u) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t is_big = ones_if<uint32_t>(static_cast<int32_t>(a) >= 0x477ff000);
  const uint32_t is_sub = ones_if<uint32_t>(static_cast<int32_t>(a) < 0x38800000);
  const uint32_t mag = (big & is_big) | (sub & is_sub & ~is_big) | (normal & ~(is_big | is_sub));
  return static_cast<uint16_t>(mag | (sign >> 16));
}

// Storage row -> accumulation-type row (float; double for float64).
template <class T, class A>
inline void widen(const T* src, A* dst, int64_t n) {
  if constexpr (std::is_same_v<T, bf16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
  } else if constexpr (std::is_same_v<T, f16> && std::is_same_v<A, float>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = f16_bits_to_f32_bits(s[i]);
      std::memcpy(dst + i, &u, 4);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<A>(to_float(src[i]));
  }
}

// Accumulation-type row -> storage row, rounding to nearest even (bf16: NaN stays a quiet NaN,
// the bits from_float<bf16> gives, without its branch).
template <class T, class A>
inline void narrow(const A* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, bf16>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, src + i, 4);
      const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const uint32_t nan = ones_if<uint32_t>(static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000);
      d[i] = static_cast<uint16_t>((((u >> 16) | 0x40u) & nan) | (rounded & ~nan));
    }
  } else if constexpr (std::is_same_v<T, f16> && std::is_same_v<A, float>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16_bits(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
  }
}

}  // namespace jaxops::cpu
