// Session 5: the lean team forward (`forward_lean`) for 16-byte packs of float, bfloat16 and
// float16. Same row split as forward_team (kWidth lanes a row, kPacks packs a lane, kRows rows a
// team per iteration), rewritten from the SASS of forward_team<bf16,8,1,16,2>, which issued ~42
// thread-instructions per element (Nsight) against XLA's ~13 and was instruction-bound:
//  - per row and lane it ran a 64-bit integer division (`row / rows_per_group`, scale row) per
//    pack, three IEEE float divisions by cols (FCHK + slow-path branch each) and a correctly
//    rounded sqrt + reciprocal; here 1/cols is computed once, rstd is rsqrtf (MUFU.RSQ, <= 2 ulp,
//    what XLA uses), and scale/bias are loaded once per kernel when there is one group;
//  - bfloat16 -> float took PRMT + SHL for every odd element, in each of three passes, and the
//    scale/bias packs were re-loaded and re-converted for every row; here a bf16x2 word converts
//    with one SHL / one LOP3, and (rows of <= 16 values a lane) the centred row d = x - shift
//    stays in float registers, so x converts once;
//  - y = fma(fma(d, rstd, -mean_rel * rstd), s, b): 2 FFMA an element (was FADD, FADD, FMUL, FFMA);
//  - the row shift (first element) comes from lane 0's registers by one shuffle, not a load;
//  - rms_norm is a separate instantiation of the body (kRms): no shift, no mean pass, no bias.
#pragma once
#include "layer_norm/layer_norm_fwd_kernels.cuh"

namespace jaxops::layer_norm {

// kPack values of a 16-byte pack as floats. bfloat16 is the high half of a float: the low element
// of a 32-bit word is `w << 16`, the high one `w & 0xffff0000` (one instruction each).
template <class T, int kPack>
__device__ __forceinline__ void unpack_floats(const Pack<T, kPack>& p, float (&out)[kPack]) {
  if constexpr (sizeof(T) == 2 && kPack == 1) {  // single elements (rows not whole 16-byte packs)
    out[0] = to_acc(p.v[0]);
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int e = 0; e < kPack; ++e) out[e] = p.v[e];
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    static_assert(kPack % 2 == 0, "bfloat16 packs hold whole 32-bit words");
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&p);
#pragma unroll
    for (int i = 0; i < kPack / 2; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    static_assert(std::is_same_v<T, __half> && kPack % 2 == 0, "float16 packs hold whole half2 words");
    const __half2* h = reinterpret_cast<const __half2*>(&p);
#pragma unroll
    for (int i = 0; i < kPack / 2; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

// kPack floats rounded to T (round to nearest even), two at a time for 16-bit types (F2FP).
template <class T, int kPack>
__device__ __forceinline__ Pack<T, kPack> pack_floats(const float (&v)[kPack]) {
  Pack<T, kPack> p;
  if constexpr (sizeof(T) == 2 && kPack == 1) {
    p.v[0] = from_acc<T>(v[0]);
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int e = 0; e < kPack; ++e) p.v[e] = v[e];
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&p);
#pragma unroll
    for (int i = 0; i < kPack / 2; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  } else {
    __half2* h = reinterpret_cast<__half2*>(&p);
#pragma unroll
    for (int i = 0; i < kPack / 2; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
  }
  return p;
}

// Keep the centred row as floats across the passes when it is small (<= 16 values a lane):
// larger rows (wide teams) keep the packs and convert again per pass (registers).
template <class T, int kPack, int kPacks, int kRows>
constexpr bool kLeanKeepFloats = kRows * kPacks * kPack <= 16;

// Per-kernel constants of the lean forward kernels (forward_lean, forward_block_lean), in the
// order the kernels unpack them: const auto [inv_cols, eps, x, y, scale, bias] = lean_setup<T>(a).
template <class T>
struct LeanSetup {
  float inv_cols;  // 1 / cols, once per kernel (no division per row)
  float eps;
  const T* x;
  T* y;
  const T* scale;
  const T* bias;
};

template <class T>
__device__ __forceinline__ LeanSetup<T> lean_setup(const ForwardArgs& a) {
  return {1.0f / static_cast<float>(a.shape.cols), static_cast<float>(a.shape.epsilon), static_cast<const T*>(a.x),
          static_cast<T*>(a.y), static_cast<const T*>(a.scale), static_cast<const T*>(a.bias)};
}

template <class T, int kPack, int kPacks, int kWidth, int kRows, bool kRms>
__device__ __forceinline__ void forward_lean_body(const ForwardArgs& a) {
  constexpr bool kKeep = kLeanKeepFloats<T, kPack, kPacks, kRows>;
  const Shape& s = a.shape;
  const int teams = blockDim.x / kWidth, team = threadIdx.x / kWidth, lane = threadIdx.x % kWidth;
  const int npacks = static_cast<int>(s.cols / kPack);  // <= 32 * 8 here
  const auto [inv_cols, eps, x, y, scale, bias] = lean_setup<T>(a);
  // One group only (the launcher sends vmapped per-example parameters to forward_team). Narrow
  // rows (teams narrower than a warp: one or two packs a lane) keep the scale/bias packs for the
  // whole kernel; wide rows re-load them per row (L1 hits): holding kPacks x 2 packs more spilled.
  // With one group the lane's scale/bias packs are the same for every row.
  constexpr bool hold_params = kPacks == 1 || kWidth < 32;
  constexpr int kHeld = hold_params ? kPacks : 1;
  Pack<T, kPack> sp[kHeld], bp[kHeld];
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int p = lane + k * kWidth;
    if (hold_params && p < npacks) {  // (lanes past the row never use them)
      sp[k] = load_pack<T, kPack>(scale + p * kPack);
      if constexpr (!kRms) bp[k] = load_pack<T, kPack>(bias + p * kPack);
    }
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * teams * kRows;
  // Block-uniform trip count: the shuffles need every lane of a warp, even past the last row.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * teams * kRows; base < s.rows; base += step) {
    // Two held 16-bit packs a lane: opaque every row, or the compiler converts them to 32 floats
    // once, outside the loop (spills at the 56-register cap).
    if constexpr (kHeld > 1 && sizeof(T) == 2) {
      opaque_packs(sp);
      if constexpr (!kRms) opaque_packs(bp);
    }
    Pack<T, kPack> xp[kRows][kPacks];
    float d[kKeep ? kRows : 1][kKeep ? kPacks : 1][kPack];
    float shift[kRows], mean_rel[kRows], rstd[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = base + r * teams + team;
      const T* xr = x + row * s.cols;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * kWidth;
        if (row < s.rows && p < npacks) xp[r][k] = load_pack<T, kPack>(xr + p * kPack);
        else xp[r][k] = Pack<T, kPack>{};  // (finite: the unused shuffles below stay harmless)
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if constexpr (kRms) {
        shift[r] = 0.0f;
        mean_rel[r] = 0.0f;
      } else {
        // The row's first element: lane 0 of the team holds it (pack 0, element 0).
        shift[r] = __shfl_sync(0xffffffffu, to_acc(xp[r][0].v[0]), 0, kWidth);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < kPacks; ++k) {
          float f[kPack];
          unpack_floats<T, kPack>(xp[r][k], f);
          float part = 0.0f;
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            const float v = f[e] - shift[r];
            if constexpr (kKeep) d[r][k][e] = v;
            part += v;
          }
          if (lane + k * kWidth < npacks) sum += part;  // (packs past the row are zeros)
        }
        mean_rel[r] = team_sum<kWidth>(sum) * inv_cols;
      }
    }
    if constexpr (!kKeep && sizeof(T) == 2) opaque_rows(xp);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float sq = 0.0f;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        float f[kPack];
        if constexpr (kKeep && !kRms) {
#pragma unroll
          for (int e = 0; e < kPack; ++e) f[e] = d[r][k][e];
        } else {
          unpack_floats<T, kPack>(xp[r][k], f);
          if constexpr (kKeep) {
#pragma unroll
            for (int e = 0; e < kPack; ++e) d[r][k][e] = f[e];  // rms: d = x
          }
          if constexpr (!kRms) {
#pragma unroll
            for (int e = 0; e < kPack; ++e) f[e] -= shift[r];
          }
        }
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          const float q = f[e] - mean_rel[r];
          part = fmaf(q, q, part);
        }
        if (lane + k * kWidth < npacks) sq += part;
      }
      rstd[r] = rsqrtf(team_sum<kWidth>(sq) * inv_cols + eps);
    }
    if constexpr (!kKeep && sizeof(T) == 2) opaque_rows(xp);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = base + r * teams + team;
      if (row >= s.rows) continue;
      const float c = -mean_rel[r] * rstd[r];
      T* yr = y + row * s.cols;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * kWidth;
        if (p >= npacks) continue;
        float f[kPack], sf[kPack], bf[kPack], out[kPack];
        if constexpr (kKeep) {
#pragma unroll
          for (int e = 0; e < kPack; ++e) f[e] = d[r][k][e];
        } else {
          unpack_floats<T, kPack>(xp[r][k], f);
          if constexpr (!kRms) {
#pragma unroll
            for (int e = 0; e < kPack; ++e) f[e] -= shift[r];
          }
        }
        if constexpr (hold_params) {
          unpack_floats<T, kPack>(sp[k], sf);
          if constexpr (!kRms) unpack_floats<T, kPack>(bp[k], bf);
        } else {
          unpack_floats<T, kPack>(load_pack<T, kPack>(scale + p * kPack), sf);
          if constexpr (!kRms) unpack_floats<T, kPack>(load_pack<T, kPack>(bias + p * kPack), bf);
        }
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          if constexpr (kRms) {
            out[e] = (f[e] * rstd[r]) * sf[e];
          } else {
            out[e] = fmaf(fmaf(f[e], rstd[r], c), sf[e], bf[e]);
          }
        }
        store_pack(yr + p * kPack, pack_floats<T, kPack>(out));
      }
      if (lane == 0) {
        if (!kRms && a.mean) static_cast<float*>(a.mean)[row] = shift[r] + mean_rel[r];
        static_cast<float*>(a.rstd)[row] = rstd[r];
      }
    }
  }
}

// Register cap (ptxas -v, sm_90): narrow rows hold the scale/bias packs and (two 16-bit rows, or
// one row of two packs) 16 floats of row: 56 registers (9 blocks of 128 threads, 56 % occupancy,
// as forward_team achieved; 48 spilled 8 bytes, 40 12-64; two packs at 48 spilled 112); one row
// of one pack: 40. Wide 16-bit rows of 4 packs: 56 (48 spilled 16-100
// bytes), of 2 packs: 48; the widest teams (64 values a lane, session 33): 16-bit 96 (80 spilled
// 40 bytes, 72 116), float 128 (96 spilled 16); the rest as forward_team.
template <class T>
constexpr int lean_min_blocks(int packs, int width, int bytes, int pack_bytes) {
  if (pack_bytes == 8) return packs >= 7 ? 6 : 8;  // 8-byte packs (session 59: 5-7 on 8 lanes, 4 on 16)
  if (width == 16 && packs >= 16) return 6;  // float 16 a lane on 16 lanes: 80 registers (9: spilled 108 B)
  if (packs == 1 || width < 32) return bytes > 16 ? 9 : 12;
  if (bytes / static_cast<int>(sizeof(T)) >= 64) return sizeof(T) == 2 ? 5 : 4;
  if (sizeof(T) == 2 && packs >= 2) return packs >= 4 ? 9 : 10;  // (2 packs: 40 spilled 16 B on sm_80)
  return forward_min_blocks<T>(bytes);
}

template <class T, int kPack, int kPacks, int kWidth, int kRows>
__global__ void __launch_bounds__(128, lean_min_blocks<T>(kPacks, kWidth, kPack* kPacks * kRows * sizeof(T),
                                                           kPack * sizeof(T)))
    forward_lean(ForwardArgs a) {
  cuda::enter_kernel();
  static_assert(sizeof(T) <= 4 && (kPack * sizeof(T) == 16 || kPack * sizeof(T) == 8 || kPack == 1),
                "16- or 8-byte packs of float / 16-bit types, or single elements");
  if (a.shape.rms) forward_lean_body<T, kPack, kPacks, kWidth, kRows, true>(a);
  else forward_lean_body<T, kPack, kPacks, kWidth, kRows, false>(a);
}

}  // namespace jaxops::layer_norm
