// Branch-free element selects and relu-mask bits for the CPU twins. Selects are integer masks,
// not `c ? a : b` or `&&`, which the compiler turns into branches that stop the vectorizer (and
// that mispredict on half the elements of random data); mask bits come from a table, since SSE2
// has no per-lane variable shift; masks are packed and read 32 bits at a time at any bit offset.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cpu_float.h"

namespace jaxops::cpu {

// A storage type's bits as a signed integer of its width (may_alias: the buffers hold T).
template <class T> struct Raw;
template <> struct Raw<float> {
  typedef int32_t __attribute__((may_alias)) type;
  static constexpr int32_t kInf = 0x7f800000, kMag = 0x7fffffff;
};
template <> struct Raw<double> {
  typedef int64_t __attribute__((may_alias)) type;
  static constexpr int64_t kInf = 0x7ff0000000000000, kMag = 0x7fffffffffffffff;
};
template <> struct Raw<bf16> {
  typedef int16_t __attribute__((may_alias)) type;
  static constexpr int16_t kInf = 0x7f80, kMag = 0x7fff;
};
template <> struct Raw<f16> {
  typedef int16_t __attribute__((may_alias)) type;
  static constexpr int16_t kInf = 0x7c00, kMag = 0x7fff;
};

// a where `take`, else b (bits), for the vectorizer.
template <class A>
inline A select_bits(bool take, A a, A b) {
  using I = std::conditional_t<sizeof(A) == 2, uint16_t, std::conditional_t<sizeof(A) == 4, uint32_t, uint64_t>>;
  I ia, ib;
  std::memcpy(&ia, &a, sizeof ia);
  std::memcpy(&ib, &b, sizeof ib);
  const I m = ones_if<I>(take);
  const I r = (ia & m) | (ib & ~m);
  std::memcpy(&a, &r, sizeof a);
  return a;
}

// v where `keep`, else +0 (all bits 0).
template <class A>
inline A keep_if(A v, bool keep) {
  return select_bits(keep, v, A(0));
}

// v[i] = fill where keep[i] is false (a jax `where` mask of bools, read as bytes: the vectorizer
// has no vector type for bool).
template <class A>
inline void fill_unkept(const bool* keep, A* v, A fill, int64_t n) {
  const uint8_t* k = reinterpret_cast<const uint8_t*>(keep);
  for (int64_t i = 0; i < n; ++i) v[i] = select_bits(k[i] != 0, v[i], fill);
}

// dst[i] = src[i] in the accumulation type where keep[i], else fill: a masked row's copy in one
// pass (a widen, then fill_unkept, took two).
template <class T, class A>
inline void widen_kept(const bool* keep, const T* src, A* dst, A fill, int64_t n) {
  const uint8_t* k = reinterpret_cast<const uint8_t*>(keep);
  for (int64_t i = 0; i < n; ++i) dst[i] = select_bits(k[i] != 0, static_cast<A>(to_float(src[i])), fill);
}

// Bit j of a 32-bit mask word.
alignas(64) inline constexpr uint32_t kBit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

// ORs n flags (nonzero: bit set) into bits [bit0, bit0 + n) of `words` (bit j of word i is bit
// 32 i + j), 32 flags at a time; bits that straddle two words are split between them.
inline void pack_bits(const int32_t* flags, int64_t n, uint32_t* words, int64_t bit0) {
  for (int64_t k = 0; k < n; k += 32) {
    const int m = n - k < 32 ? static_cast<int>(n - k) : 32;
    uint32_t w = 0;
    if (m == 32) {
      for (int j = 0; j < 32; ++j) w |= kBit[j] & ones_if<uint32_t>(flags[k + j] != 0);
    } else {
      for (int j = 0; j < m; ++j) w |= kBit[j] & ones_if<uint32_t>(flags[k + j] != 0);
    }
    const int64_t p = bit0 + k;
    const int off = static_cast<int>(p & 31);
    words[p >> 5] |= w << off;
    if (off != 0 && (w >> (32 - off)) != 0) words[(p >> 5) + 1] |= w >> (32 - off);
  }
}

// Bits [bit0, bit0 + n) of `words` as flags: all ones where set, else 0.
inline void unpack_bits(const uint32_t* words, int64_t bit0, int64_t n, int32_t* flags) {
  for (int64_t k = 0; k < n; k += 32) {
    const int m = n - k < 32 ? static_cast<int>(n - k) : 32;
    const int64_t p = bit0 + k;
    const int off = static_cast<int>(p & 31);
    uint32_t w = words[p >> 5] >> off;
    if (off != 0 && m > 32 - off) w |= words[(p >> 5) + 1] << (32 - off);  // only bits that exist
    if (m == 32) {
      for (int j = 0; j < 32; ++j) flags[k + j] = ones_if<int32_t>((w & kBit[j]) != 0);
    } else {
      for (int j = 0; j < m; ++j) flags[k + j] = ones_if<int32_t>((w & kBit[j]) != 0);
    }
  }
}

}  // namespace jaxops::cpu
