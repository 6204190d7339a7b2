// layer_norm / rms_norm forward kernels: team (rows in registers), block (the row cached in
// shared memory) and uncached (shifted sums, then y).
#pragma once
#include "layer_norm/layer_norm_kernels.cuh"

namespace jaxops::layer_norm {

// The row's first element. Rows far from zero (mean 1e4, std 0.1) lose most digits in float32
// when summed or centred as x - mean (the mean itself rounds to 1e-3 there); x - shift is
// exact, so the kernels keep the mean as shift + mean_rel and centre as (x - shift) - mean_rel.
template <class T>
__device__ __forceinline__ acc_t<T> row_shift(const Shape& s, const T* x, int64_t row) {
  return s.rms ? acc_t<T>(0) : to_acc(x[row * s.cols]);
}

// Where row's scale / bias start. Without per-example parameters (groups == 1, a uniform branch)
// skip the 64-bit division (a 32-bit one, ~20 instructions, where both fit). It ran per pack: per
// element for scalar packs (rows not whole 16-byte packs); the compiler cannot hoist a division
// out of a guarded loop.
__device__ __forceinline__ int64_t param_offset(const Shape& s, int64_t row) {
  return s.groups == 1 ? 0 : row / s.rows_per_group * s.cols;
}

// forward_block's split of write_y: the scale (and bias) packs of a column position are loaded
// first, y is computed and stored later (bias is left unset for rms_norm). (write_y itself is
// kept as it was for the team kernels: routing them through these helpers made ptxas spill.)
template <class T, int kPack>
struct ParamPacks {
  Pack<T, kPack> s, b;
};

template <class T, int kPack>
__device__ __forceinline__ ParamPacks<T, kPack> load_params(const ForwardArgs& a, int64_t row, int64_t col) {
  const Shape& s = a.shape;
  const int64_t prow = param_offset(s, row) + col;
  ParamPacks<T, kPack> pp;
  pp.s = load_pack<T, kPack>(static_cast<const T*>(a.scale) + prow);
  if (a.bias) pp.b = load_pack<T, kPack>(static_cast<const T*>(a.bias) + prow);
  return pp;
}

template <class T, int kPack>
__device__ __forceinline__ void store_y(const ForwardArgs& a, const Pack<T, kPack>& xp, const ParamPacks<T, kPack>& pp,
                                        int64_t row, int64_t col, acc_t<T> shift, acc_t<T> mean_rel, acc_t<T> rstd) {
  using A = acc_t<T>;
  const Shape& s = a.shape;
  const Pack<T, kPack>& sp = pp.s;
  const Pack<T, kPack>& bp = pp.b;
  Pack<T, kPack> yp;
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    A v = ((to_acc(xp.v[e]) - shift) - mean_rel) * rstd * to_acc(sp.v[e]);
    if (a.bias) v += to_acc(bp.v[e]);
    yp.v[e] = from_acc<T>(v);
  }
  store_pack(static_cast<T*>(a.y) + row * s.cols + col, yp);
}

template <class T, int kPack>
__device__ __forceinline__ void write_y(const ForwardArgs& a, const Pack<T, kPack>& xp, int64_t row,
                                        int64_t col, acc_t<T> shift, acc_t<T> mean_rel, acc_t<T> rstd) {
  using A = acc_t<T>;
  const Shape& s = a.shape;
  const int64_t prow = param_offset(s, row) + col;
  const auto sp = load_pack<T, kPack>(static_cast<const T*>(a.scale) + prow);
  Pack<T, kPack> bp;
  if (a.bias) bp = load_pack<T, kPack>(static_cast<const T*>(a.bias) + prow);
  Pack<T, kPack> yp;
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    A v = ((to_acc(xp.v[e]) - shift) - mean_rel) * rstd * to_acc(sp.v[e]);
    if (a.bias) v += to_acc(bp.v[e]);
    yp.v[e] = from_acc<T>(v);
  }
  store_pack(static_cast<T*>(a.y) + row * s.cols + col, yp);
}

template <class T>
__device__ __forceinline__ void write_stats(const ForwardArgs& a, int64_t row, acc_t<T> mean, acc_t<T> rstd) {
  if (a.mean) static_cast<acc_t<T>*>(a.mean)[row] = mean;
  static_cast<acc_t<T>*>(a.rstd)[row] = rstd;
}

// forward_team's minimum 128-thread blocks per SM for `bytes` of row data per lane, i.e. its
// register cap: 12 blocks = 40 registers (75% occupancy), 10 = 48, 9 = 56, 7 = 72. Uncapped,
// ptxas took 56 registers (54% occupancy) for 1024 columns of bfloat16, the slowest forward (63%
// of DRAM bandwidth); 16 registers of row data (16-bit 1024 columns, float 512) fit 40 without
// spills except bfloat16 on sm_90 (12 bytes), which gets 48. Float at 1024 columns spills
// below 56; double (no target) keeps about its old counts (48 spilled on sm_80; an explicit
// minimum of 1 made ptxas use more than no minimum).
template <class T>
constexpr int forward_min_blocks(int bytes) {
  if (sizeof(T) == 8) return bytes <= 32 ? 12 : bytes <= 64 ? 9 : 7;
  if (bytes > 64) return 9;
  return std::is_same_v<T, __nv_bfloat16> && bytes > 32 ? 10 : 12;
}

// A team of kWidth lanes per row, row in registers: kPacks packs of kPack elements per lane.
// Sum over a team lane's packs of one row (packs lane + k * kWidth < npacks; none when the row is
// past the end) of term(element): forward_team's mean and variance passes.
template <class T, int kPack, int kPacks, int kWidth, class Term>
__device__ __forceinline__ acc_t<T> team_pass_sum(const Pack<T, kPack> (&xp)[kPacks], bool valid_row, int lane,
                                                  int64_t npacks, Term term) {
  acc_t<T> sum = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + k * kWidth;
    if (valid_row && p < npacks) {
#pragma unroll
      for (int e = 0; e < kPack; ++e) sum += term(to_acc(xp[k].v[e]));
    }
  }
  return sum;
}

// kRows rows per team per iteration (session 4, narrow rows of 16-bit types; 1 otherwise): with
// one 16-byte pack per lane a 128-thread block had 2 KB in flight and an SM ~24 KB (bfloat16 128
// columns ran at 0.70 of copy); two rows, all loads issued before the first reduction, double that.
template <class T, int kPack, int kPacks, int kWidth, int kRows>
__global__ void __launch_bounds__(128, forward_min_blocks<T>(kPack* kPacks * kRows * sizeof(T)))
    forward_team(ForwardArgs a) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  const Shape s = a.shape;
  const int teams = blockDim.x / kWidth, team = threadIdx.x / kWidth, lane = threadIdx.x % kWidth;
  const int64_t npacks = s.cols / kPack;
  const T* x = static_cast<const T*>(a.x);
  // Block-uniform trip count: shuffles need every lane of a warp, even past the last row.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * teams * kRows; base < s.rows;
       base += static_cast<int64_t>(gridDim.x) * teams * kRows) {
    Pack<T, kPack> xp[kRows][kPacks];
    A shift[kRows], mean_rel[kRows], rstd[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = base + r * teams + team;
      const bool valid_row = row < s.rows;
      shift[r] = row_shift<T>(s, x, valid_row ? row : 0);
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + k * kWidth;
        if (valid_row && p < npacks) xp[r][k] = load_pack<T, kPack>(x + row * s.cols + p * kPack);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool valid_row = base + r * teams + team < s.rows;
      const A sh = shift[r];
      const A sum = team_pass_sum<T, kPack, kPacks, kWidth>(xp[r], valid_row, lane, npacks, [=](A v) { return v - sh; });
      mean_rel[r] = s.rms ? A(0) : team_sum<kWidth>(sum) / A(s.cols);
    }
    // 16-bit types: convert x again in each pass instead of keeping the converted floats (twice
    // the registers) live across the reductions; needed to fit 40-48 registers without spills.
    if constexpr (sizeof(T) == 2) opaque_rows(xp);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool valid_row = base + r * teams + team < s.rows;
      const A sh = shift[r], m = mean_rel[r];
      const A sq = team_pass_sum<T, kPack, kPacks, kWidth>(xp[r], valid_row, lane, npacks, [=](A v) {
        const A d = (v - sh) - m;
        return d * d;
      });
      rstd[r] = inv_sqrt(team_sum<kWidth>(sq) / A(s.cols) + A(s.epsilon));
    }
    if constexpr (sizeof(T) == 2) opaque_rows(xp);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = base + r * teams + team;
      if (row >= s.rows) continue;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + k * kWidth;
        if (p < npacks) write_y<T, kPack>(a, xp[r][k], row, p * kPack, shift[r], mean_rel[r], rstd[r]);
      }
      if (lane == 0) write_stats<T>(a, row, shift[r] + mean_rel[r], rstd[r]);
    }
  }
}

// One block per row, the row cached in dynamic shared memory (cols elements of T). Each thread
// re-reads only the packs it cached itself, so no barrier is needed besides the reductions.
// The block kernels' 16-byte pack loops are unrolled 4 times: a rolled loop waits for each
// pack's load before issuing the next (its shared store / sums depend on it), so a
// thread had only one 16-byte load (two in the backward) in flight.
template <class T, int kPack>
__global__ void __launch_bounds__(1024) forward_block(ForwardArgs a) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  // 16-bit packs: a write chunk of 2 spilled at the 64-register cap of 1024 threads.
  constexpr int kLoadChunk = kPack > 1 ? 4 : 1, kWriteChunk = kPack > 1 && sizeof(T) == 4 ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A scratch[64];
  T* cache = reinterpret_cast<T*>(smem_raw);
  const Shape s = a.shape;
  const int64_t npacks = s.cols / kPack;
  const T* x = static_cast<const T*>(a.x);
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const A shift = row_shift<T>(s, x, row);
    A sum = 0, sq = 0, unused = 0;
    // Session 4: all loads of a chunk are issued before any is consumed. The unrolled loop of
    // session 3 compiled to LDG -> STS -> branch per pack (the store needs the load, and the
    // trip-count branches kept the next LDG behind it): one 16-byte load in flight per thread.
    for (int64_t p0 = threadIdx.x; p0 < npacks; p0 += kLoadChunk * blockDim.x) {
      Pack<T, kPack> xp[kLoadChunk];
#pragma unroll
      for (int k = 0; k < kLoadChunk; ++k) {
        const int64_t p = p0 + k * blockDim.x;
        if (p < npacks) xp[k] = load_pack<T, kPack>(x + row * s.cols + p * kPack);
      }
#pragma unroll
      for (int k = 0; k < kLoadChunk; ++k) {
        const int64_t p = p0 + k * blockDim.x;
        if (p < npacks) {
          store_pack(cache + p * kPack, xp[k]);
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            const A d = to_acc(xp[k].v[e]) - shift;
            sum += d;
            sq += d * d;
          }
        }
      }
    }
    block_sum2(sum, sq, scratch);
    const A mean_rel = s.rms ? A(0) : sum / A(s.cols);
    A var;
    if (!shifted_variance(mean_rel, sq / A(s.cols), &var) && !s.rms) {  // (uniform: the same sums everywhere)
      sq = 0;
      for (int64_t p = threadIdx.x; p < npacks; p += blockDim.x) {
        const auto xp = load_pack<T, kPack>(cache + p * kPack);
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          const A d = (to_acc(xp.v[e]) - shift) - mean_rel;
          sq += d * d;
        }
      }
      block_sum2(sq, unused, scratch);
      var = sq / A(s.cols);
    }
    const A rstd = inv_sqrt(var + A(s.epsilon));
    // Same for the scale/bias loads (L1/L2 hits) ahead of the y stores (float: chunks of 2).
    for (int64_t p0 = threadIdx.x; p0 < npacks; p0 += kWriteChunk * blockDim.x) {
      ParamPacks<T, kPack> pp[kWriteChunk];
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int64_t p = p0 + k * blockDim.x;
        if (p < npacks) pp[k] = load_params<T, kPack>(a, row, p * kPack);
      }
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int64_t p = p0 + k * blockDim.x;
        if (p < npacks)
          store_y<T, kPack>(a, load_pack<T, kPack>(cache + p * kPack), pp[k], row, p * kPack, shift, mean_rel, rstd);
      }
    }
    if (threadIdx.x == 0) write_stats<T>(a, row, shift + mean_rel, rstd);
  }
}

// One block per row; rows too long for shared memory or a cluster: the shifted sums, then a pass
// writing y (a third pass, the squares around the mean, only for rows shifted_variance does not
// trust). Session 37: a Welford update an element (an IEEE division each) made float32 256x262144
// ALU-bound at 0.26 of copy (H200). Session 38: every pass issues a chunk of loads before using
// any (as forward_block); the rolled loops had one 16-byte load in flight a thread.
template <class T, int kPack>
__global__ void __launch_bounds__(1024) forward_uncached(ForwardArgs a) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  constexpr int kChunk = kPack > 1 ? 4 : 1, kWriteChunk = kPack > 1 && sizeof(T) == 4 ? 2 : 1;
  __shared__ A scratch[64];
  const Shape s = a.shape;
  const int64_t npacks = s.cols / kPack;
  const T* x = static_cast<const T*>(a.x);
  // Calls f(element) for this thread's elements of row xr, kChunk loads in flight.
  auto for_each_element = [&](const T* xr, auto f) {
    for (int64_t p0 = threadIdx.x; p0 < npacks; p0 += kChunk * blockDim.x) {
      Pack<T, kPack> xp[kChunk];
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        const int64_t p = p0 + k * blockDim.x;
        if (p < npacks) xp[k] = load_pack<T, kPack>(xr + p * kPack);
      }
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        if (p0 + k * blockDim.x < npacks) {
#pragma unroll
          for (int e = 0; e < kPack; ++e) f(to_acc(xp[k].v[e]));
        }
      }
    }
  };
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const T* xr = x + row * s.cols;
    const A shift = row_shift<T>(s, x, row);
    A sum = 0, sq = 0, unused = 0;
    for_each_element(xr, [&](A v) {
      const A d = v - shift;
      sq += d * d;
      sum += d;
    });
    block_sum2(sum, sq, scratch);
    const A mean_rel = s.rms ? A(0) : sum / A(s.cols);
    A var;
    if (!shifted_variance(mean_rel, sq / A(s.cols), &var) && !s.rms) {
      sq = 0;
      for_each_element(xr, [&](A v) {
        const A d = (v - shift) - mean_rel;
        sq += d * d;
      });
      block_sum2(sq, unused, scratch);
      var = sq / A(s.cols);
    }
    const A rstd = inv_sqrt(var + A(s.epsilon));
    for (int64_t p0 = threadIdx.x; p0 < npacks; p0 += kWriteChunk * blockDim.x) {
      Pack<T, kPack> xp[kWriteChunk];
      ParamPacks<T, kPack> pp[kWriteChunk];
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int64_t p = p0 + k * blockDim.x;
        if (p < npacks) {
          xp[k] = load_pack<T, kPack>(xr + p * kPack);
          pp[k] = load_params<T, kPack>(a, row, p * kPack);
        }
      }
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int64_t p = p0 + k * blockDim.x;
        if (p < npacks) store_y<T, kPack>(a, xp[k], pp[k], row, p * kPack, shift, mean_rel, rstd);
      }
    }
    if (threadIdx.x == 0) write_stats<T>(a, row, shift + mean_rel, rstd);
  }
}

}  // namespace jaxops::layer_norm
