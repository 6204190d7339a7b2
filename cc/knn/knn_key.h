// The total order every KNN kernel ranks by, as one 64-bit key: high word = bits of the
// non-negative float32 distance (NaN -> all ones, so it ranks after +inf), low word = the
// reference index. Comparing keys as unsigned integers is then "ascending distance, ties to
// the lower index, NaN last", and merges of partial lists stay deterministic because no two
// candidates share a key. Shared by the CPU twin (host C++) and the CUDA kernels.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAXOPS_KNN_HD __host__ __device__ __forceinline__
#else
#define JAXOPS_KNN_HD inline
#endif

namespace jaxops::knn {

// Key of an empty slot (the initial running list): larger than every real key, since real
// indices are below 2^31. Decodes to (NaN, -1).
constexpr uint64_t kEmptyKey = ~0ull;
constexpr uint32_t kNanBits = 0xffffffffu;

JAXOPS_KNN_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

JAXOPS_KNN_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Squared distance from the GEMM expansion, clamped at zero (which also folds -0 into +0);
// NaN stays NaN. fp contraction is allowed: the epilogue differs from exact by a few ulps anyway.
JAXOPS_KNN_HD float clamp_distance(float d) { return d > 0.0f ? d : (d != d ? d : 0.0f); }

JAXOPS_KNN_HD uint64_t make_key(float clamped_dist, uint32_t index) {
  const uint32_t hi = clamped_dist != clamped_dist ? kNanBits : float_to_bits(clamped_dist);
  return (static_cast<uint64_t>(hi) << 32) | index;
}

JAXOPS_KNN_HD float key_distance(uint64_t key) {
  const uint32_t hi = static_cast<uint32_t>(key >> 32);
  return hi == kNanBits ? bits_to_float(0x7fc00000u) : bits_to_float(hi);
}

JAXOPS_KNN_HD int32_t key_index(uint64_t key) {
  return static_cast<int32_t>(static_cast<uint32_t>(key & 0xffffffffull));
}

}  // namespace jaxops::knn
