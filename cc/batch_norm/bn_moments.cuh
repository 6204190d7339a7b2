// Per-channel partial statistics shared by the streaming statistics kernels (bn_reduce.cu) and
// the one-kernel forward (bn_resident.cu): values shifted by a pivot, folded with chan_merge.
//
// Accuracy: every value is shifted by a per-(group, channel) pivot, the channel's first-row
// value, before it is accumulated. With mean 1e4 and std 0.1 an unshifted float32 Welford mean
// sits at 1e4, where one ulp is 1e-3 (1% of a std): late updates d/n round away and the mean
// drifts by about an ulp. Shifted, the accumulators hold values of the order of the spread, so
// the only rounding of the order of ulp(mean) left is the final `pivot + shifted mean` (as in
// the CPU twin's float64 -> float32 cast).
// Non-finite values: a Welford mean turns one inf into NaN (its next update is inf - inf), but
// jnp.mean gives inf. So a plain sum of x - pivot rides along; when it is not finite the mean is
// `pivot + sum / n` (inf for infs of one sign, NaN for +inf with -inf or a NaN, like jnp.mean),
// else the Welford mean is used. M2 is NaN whenever the channel holds a non-finite value, like
// the reference's mean((x - mean)^2). A non-finite pivot is replaced by 0 so that it cannot
// poison the finite values.
#pragma once
#include "batch_norm/bn_math.h"

namespace jaxops::batch_norm {

template <class A>
__device__ __forceinline__ A pivot_of(A first) {
  return isfinite(first) ? first : A(0);
}

// Partial (count, shifted sum, mean, M2) of one channel.
template <class A>
struct Moments {
  A n, s, m, m2;
  __device__ __forceinline__ void merge(const Moments& b) {
    chan_merge(n, m, m2, b.n, b.m, b.m2);
    s += b.s;
  }
  // The channel's mean with the pivot added back: the merged mean for finite data (its error
  // scales with the spread, not with |mean - pivot|), otherwise the plain sum's inf/NaN.
  __device__ __forceinline__ A mean(A pivot) const { return pivot + (isfinite(s) ? m : s / n); }
  __device__ __forceinline__ A var() const { return m2 / n; }  // biased
};

}  // namespace jaxops::batch_norm
