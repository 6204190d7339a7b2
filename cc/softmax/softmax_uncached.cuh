// Softmax uncached path: rows too long for any cluster's shared memory, in the fewest passes.
#pragma once
#include <cstdint>

#include "softmax/softmax_common.cuh"

namespace jaxops::softmax {

// Uncached path: one block per row, online (max, sum) in the first pass, output in the second.

template <class A>
__device__ __forceinline__ void online_update(A& m, A& s, A a) {
  if (a != a) {
    m = a;
    s = a;
  } else if (a > m) {
    s = s * fast_exp(m - a) + A(1);
    m = a;
  } else if (a > neg_inf<A>()) {
    s += fast_exp(a - m);
  }
}

template <class T, int P>
__global__ void __launch_bounds__(1024)
forward_uncached(const T* __restrict__ x, const bool* __restrict__ mask, T* __restrict__ y, int64_t rows,
                 int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A scratch[33];
  const int64_t npacks = cols / P;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    A m = neg_inf<A>(), s = 0;
    for (int64_t i0 = threadIdx.x; i0 < npacks; i0 += kUnroll * blockDim.x) {
      Pack<T, P> pk[kUnroll];
      Pack<bool, P> mk[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u * blockDim.x;
        if (i < npacks) {
          pk[u] = load_pack<T, P>(x + off + i * P);
          if (mask) mk[u] = load_pack<bool, P>(mask + off + i * P);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + u * blockDim.x < npacks) {
#pragma unroll
          for (int p = 0; p < P; ++p)
            online_update(m, s, (mask && !mk[u].v[p]) ? neg_inf<A>() : to_acc(pk[u].v[p]));
        }
      }
    }
    const A row_max = block_reduce<MaxOp>(m, scratch);
    // Rescale each thread's sum to the row max; threads that saw only -inf contribute nothing.
    const A scaled = s == A(0) ? A(0) : s * fast_exp(m - row_max);
    const RowStats<A> st(row_max, block_reduce<SumOp>(scaled, scratch), log);
    for (int64_t i = threadIdx.x; i < npacks; i += blockDim.x) {
      const Pack<T, P> pk = load_pack<T, P>(x + off + i * P);
      Pack<bool, P> mk;
      if (mask) mk = load_pack<bool, P>(mask + off + i * P);
      Pack<T, P> out;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const bool off_mask = mask && !mk.v[p];
        out.v[p] = from_acc<T>(off_mask ? masked_out<A>(log) : st.out(to_acc(pk.v[p]), log));
      }
      store_pack<T, P>(y + off + i * P, out);
    }
  }
}

template <class T, int P>
__global__ void __launch_bounds__(1024)
backward_uncached(const T* __restrict__ y, const T* __restrict__ dy, const bool* __restrict__ mask,
                  T* __restrict__ dx, int64_t rows, int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A scratch[33];
  const int64_t npacks = cols / P;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    A s = 0;
    for (int64_t i = threadIdx.x; i < npacks; i += blockDim.x) {
      const Pack<T, P> pg = load_pack<T, P>(dy + off + i * P);
      Pack<bool, P> mk;
      if (mask) mk = load_pack<bool, P>(mask + off + i * P);
      if (log) {
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (!mask || mk.v[p]) s += to_acc(pg.v[p]);
      } else {
        const Pack<T, P> py = load_pack<T, P>(y + off + i * P);
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (!mask || mk.v[p]) s += to_acc(py.v[p]) * to_acc(pg.v[p]);
      }
    }
    s = block_reduce<SumOp>(s, scratch);
    for (int64_t i = threadIdx.x; i < npacks; i += blockDim.x) {
      const Pack<T, P> py = load_pack<T, P>(y + off + i * P);
      const Pack<T, P> pg = load_pack<T, P>(dy + off + i * P);
      Pack<bool, P> mk;
      if (mask) mk = load_pack<bool, P>(mask + off + i * P);
      Pack<T, P> out;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const A yy = to_acc(py.v[p]), g = to_acc(pg.v[p]);
        A r = log ? g - fast_exp(yy) * s : yy * (g - s);
        if (mask && !mk.v[p]) r = 0;  // no gradient, as in jax.nn (also in NaN rows)
        out.v[p] = from_acc<T>(r);
      }
      store_pack<T, P>(dx + off + i * P, out);
    }
  }
}

}  // namespace jaxops::softmax
