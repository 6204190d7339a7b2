// Per-channel math shared by the CPU twin and the CUDA kernels of batch_norm, so both compute
// bit-for-bit the same coefficients: the Chan/Welford merge of (count, mean, M2) partials and
// the affine coefficients the elementwise passes apply.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define JAXOPS_HD __host__ __device__ __forceinline__
#else
#define JAXOPS_HD inline
#endif

namespace jaxops::batch_norm {

// Merges partial statistics b into a (Chan et al.): exact for any split of the data and stable
// because only centred quantities are combined.
template <class A>
JAXOPS_HD void chan_merge(A& n, A& mean, A& m2, A nb, A mean_b, A m2_b) {
  const A nn = n + nb;
  if (nb == A(0)) return;
  const A d = mean_b - mean;
  const A f = nb / nn;
  mean += d * f;
  m2 += m2_b + d * d * n * f;
  n = nn;
}

template <class A>
JAXOPS_HD A inv_std(A var, A eps) {
#if defined(__CUDA_ARCH__)
  return A(1) / ::sqrt(var + eps);  // correctly rounded, like the host's std::sqrt
#else
  return A(1) / std::sqrt(var + eps);
#endif
}

// One channel's coefficients, stored as one 16/32-byte record so a kernel fetches them with
// single vector load. Forward: y = (x - shift) * a + b. Backward: dx = a * dy' + b * (x - shift) + c.
template <class A>
struct alignas(16) Coef {  // 16, not 32, for double: XLA only promises 16-byte buffers
  A shift, a, b, c;
};

template <class A>
JAXOPS_HD Coef<A> forward_coef(A scale, A bias, A mean, A var, A eps) {
  return Coef<A>{mean, scale * inv_std(var, eps), bias, A(0)};
}

// dx of y = (x - mean) * invstd * scale + bias (+ residual, then relu: dy' = masked dy).
// Training mode (mean and biased var taken over `count` elements of the channel, including the
// mean/var outputs' own cotangents dmean, dvar):
//   dx = A dy' - A/N (sum_dy + xhat sum_dyxhat) + dmean/N + 2 dvar (x - mean)/N,  A = scale*invstd.
// Inference mode (given statistics): dx = A dy'.
template <class A>
JAXOPS_HD Coef<A> backward_coef(A scale, A mean, A var, A eps, A sum_dy, A sum_dyxhat, A dmean,
                                A dvar, A count, bool train) {
  const A invstd = inv_std(var, eps);
  const A a = scale * invstd;
  if (!train) return Coef<A>{mean, a, A(0), A(0)};
  const A rn = A(1) / count;
  return Coef<A>{mean, a, (A(2) * dvar - a * invstd * sum_dyxhat) * rn, (dmean - a * sum_dy) * rn};
}

}  // namespace jaxops::batch_norm
