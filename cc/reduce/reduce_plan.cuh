// The reduction kernels' plans, shared by host and device: packs in flight per thread (unroll),
// launch bounds (min_blocks), how many threads read a row (warp_rows, row_block_threads), and
// when row blocks stream through the shared-memory ring. Each rule carries the H100 measurement
// that chose it.
#pragma once
#include <climits>
#include <cstdint>

#include "reduce/reduce_fast16.cuh"
#include "reduce/reduce_ops.h"

namespace jaxops::reduce::kernels {

constexpr int kMinRowLanes = 2;      // see row_warp_kernel
constexpr int kBlockThreads = 256;   // column / merge kernels
constexpr int kMaxGrid = INT_MAX;
// Rows shorter than this run row_block_kernel with int offsets (rows that are not whole packs only,
// see launch_rows): every offset of such a row, plus a round of packs past its end, fits an int.
constexpr int64_t kNarrowRow = int64_t(1) << 30;

// float32 with a 4-byte state (sum, mean, max, min) in 16-byte packs: 8 packs (128 B) in flight
// per thread under >= 4 blocks of 256 (<= 64 registers; 1024 threads x 128 B = 128 KB per SM
// instead of 1280 x 64 B). Session 4, H100: 0.5-2 % faster than 4 packs on rows, full and
// columns (sum 16384x4096 88.4 -> 87.8 µs, sum_cols 262144x256 93.5 -> 91.9).
template <class Op, class T, int P>
constexpr bool f32_wide() {
  return sizeof(T) == 4 && sizeof(typename Op::State) == 4 && P * sizeof(T) == 16;
}

// float32 argmax/argmin in 16-byte packs: 8 packs in flight per thread too, under >= 3 blocks of
// 256 (row_block 60-64 registers, columns 80; row_warp keeps 4, see warp_unroll). Session 14,
// H100, same-run A/B against 4 packs: rows 4096x16384 91.5 -> 89.5 µs, 1024x65536 92.6 -> 90.7,
// full 95.4 -> 93.6, argmax_cols 1048576x64 99.6 -> 98.8; 64x2^20 (one wave of 512-thread
// blocks) 93.4 -> 95.0, also 94.8 on ~1024 blocks; the rest unchanged.
template <class Op, class T, int P>
constexpr bool f32_arg8() {
  return sizeof(T) == 4 && Op::kIndex && P * sizeof(T) == 16;
}

// Independent packs in flight per thread: 8 for 2-byte types, f32_wide and f32_arg8 (128 B),
// else 4 (64 B; f64: 4 x 16 B). Two-byte types carry twice the elements per byte, so with the
// same pack count a thread would have half the bytes in flight of float32 for the same
// per-element work. The generic arg loop on 2-byte types (8 elements a pack) is the exception:
// its per-element compare/select/index work made 8 packs compute-bound (session 3, H100: bf16
// argmax rows fell from 0.68-0.83 to 0.54-0.64 of copy); float32 packs hold 4 elements
// (f32_arg8); the packed 2-byte arg loop (reduce_fast16.cuh, ~3 instructions an element) takes 8
// (4 packs under >= 4 blocks lost 1-24 % on rows in session 4).
template <class Op, class T, int P>
constexpr int unroll_for() {
  return (sizeof(T) <= 2 && (!Op::kIndex || arg16_types<Op, T, P>())) || f32_wide<Op, T, P>() ||
                 f32_arg8<Op, T, P>()
             ? 8
             : 4;
}

// Packs in flight per lane of row_warp_kernel: float32 arg keeps 4 there, since 8 meant fewer
// lanes per short row and lost 1-2 % (session 14, H100: 524288x128 90.7 -> 92.4 µs, 262144x256
// 89.3 -> 90.4, 131072x512 88.3 -> 89.4; 1024-4096 columns unchanged).
template <class Op, class T, int P>
constexpr int warp_unroll() {
  return f32_arg8<Op, T, P>() ? 4 : unroll_for<Op, T, P>();
}

// Launch bounds. Without them ptxas keeps the 2-byte kernels near 32 registers by issuing
// each 16-byte load right before its use, i.e. about one load in flight per thread (seen in
// the SASS of the bf16 column kernel: load, use, load, use). Promising fewer resident blocks
// lets it hold all unroll_for<Op, T, P>() packs at once: 2-byte types get <= 80 registers at 256
// threads (>= 3 blocks, 768 threads x 128 B = 96 KB in flight per SM). 4-byte types with a
// 4-byte state (sum, max) keep <= 48 (>= 5 blocks, 1280 x 64 B) for single-element loads and
// <= 64 (>= 4 blocks, 1024 x 128 B) with 16-byte packs (f32_wide), wider states (logsumexp,
// arg) <= 64 (>= 4 blocks), float32 arg in 16-byte packs <= 80 (>= 3 blocks, f32_arg8): near the
// unhinted counts, without spills. float64 gets <= 128
// (its software exp in logsumexp spills at 64). Rows of 2-byte types never use 512-thread
// blocks (max_row_block_threads), which would halve the register budget.
constexpr int min_blocks_for(int element_bytes, int state_bytes, int threads) {
  const int blocks_of_256 = element_bytes <= 2 ? 3 : element_bytes >= 8 ? 2 : state_bytes == 4 ? 5 : 4;
  return (blocks_of_256 * 256 + threads - 1) / threads;  // rounded up: 512 threads keep >= as many threads
}
// V == false (element loads for a misaligned base, see load_pack_v): a 16-byte pack is P loads
// into P registers, so the budgets above spill (ptxas: up to 76 bytes in the bf16 arg/logsumexp
// kernels, 4 in f32 max columns); those variants promise >= 2 blocks (<= 128 registers) instead.
// Occupancy only: the tiles and the order of operations stay those of the vector-load kernel.
template <class Op, class T, int P, bool V = true>
constexpr int min_blocks(int threads) {
  if constexpr (!V && P > 1) return (2 * 256 + threads - 1) / threads;
  else if constexpr (f32_wide<Op, T, P>()) return (4 * 256 + threads - 1) / threads;
  else if constexpr (f32_arg8<Op, T, P>()) return (3 * 256 + threads - 1) / threads;
  else return min_blocks_for(static_cast<int>(sizeof(T)), static_cast<int>(sizeof(typename Op::State)), threads);
}
template <class T>
constexpr int max_row_block_threads() {
  return sizeof(T) <= 2 ? 256 : 512;
}

// Packs a thread takes from one row (or chunk of a split row) of 16-byte packs: the unroll, so a
// row is read in one round of loads (a 4096-long float32 row by 128 threads, 8192 bf16 by 128),
// except logsumexp (float32 32 packs, 16-bit 16) and 16-bit argmax/argmin (32), whose per-row
// merges want fewer, longer threads (see below). Until session 16 every block row had 256 threads
// and rows up to 4096 elements a warp: bf16 rows of 4097-16383 elements then left each thread fewer
// packs than the unroll, all in the one-pack-at-a-time tail. H100, session 16 run 5, µs, same-run
// A/B: 8192x8192 bf16 (256 -> 128 threads) sum 49.6 -> 43.9, max 48.0 -> 44.0, logsumexp 91.0 ->
// 45.8, argmax 88.3 -> 45.9 (XLA 43.3-47.4); 16384x6000 bf16 argmax 148.4 -> 88.3, float32 192.0 ->
// 139.6; 8192x8192 float32 logsumexp 96.5 -> 91.4. 16384x4096 float32 (a warp -> a block of 128):
// sum 85.6 -> 85.3, max 86.0 -> 85.5, argmax 88.5 -> 88.0 (XLA 85.6), on the hosts of runs 2-4 87.8
// -> 86.1, 88.2 -> 86.2, 90.9 -> 88.2 (XLA 85.5 / 85.5 / 86.3).
// 16-bit logsumexp takes 16 packs (two rounds of its 8-pack loop): its per-row cost (the merges of
// a warp's and a block's threads, an exp each; ncu: ~13 instructions an element at 8 packs, 0.62
// issues a cycle, DRAM 66 %) fell on half as many elements a thread. H200, session 35 runs 4 and
// 6, µs: 65536x1024 41.3 -> 36.8 (8 instead of 16 lanes a row), 16384x4096 40.4 -> 37.6 (a warp a
// row instead of a block of 64), 8192x8192 39.4 -> 36.7, 4096x16384 41.7 -> 36.1, 64x2^20 42.7 ->
// 39.6; 1024x65536 and the full reduction unchanged (37.4, 40.4).
// 16-bit argmax/argmin take 32 packs (four rounds of their 8-pack loop), for the same reason:
// a block's or a group's merge and its barriers are a per-row cost. H200, session 36 run 1,
// same-run A/B of 8 / 16 / 32 packs a thread, bf16 argmax µs: 32768x2048 40.9 / 39.6 / 36.2,
// 65536x1024 40.2 / 39.8 / 37.7, 16384x4096 40.2 / 39.5 / 36.7, 8192x8192 39.5 / 35.9 / 36.1,
// 4096x16384 39.9 / 35.3 / 34.5, 64x2^20 43.3 / 38.6 / 36.7, 16384x4095 41.9 / 40.5 / 37.1;
// 1024x65536 and the full reduction equal (34.3, 36.3). Rows under 1024 elements keep 8 a lane
// (lane_packs_for). That holds where DRAM outruns the SMs (cuda::dram_outruns_sms, Plan::fast_dram);
// on the H100 the unroll a thread (session 34's plan: more threads a row) is faster. H100, session
// 62 run 4, same-run, main / session 34's tree twice, bf16 argmax µs: 65536x1024 47.5 / 45.8,
// 16384x4096 46.8 / 45.2, 8192x8192 46.8 / 45.2, 4096x16384 45.5 / 45.1; 1024x65536, 64x2^20 and
// the full reduction equal (46.0, 47.7, 48.1). argmax's result is the first index of the extremum
// whatever the plan, so this plan may follow the chip; logsumexp's (summation order) may not.
template <class Op, class T, int P>
constexpr int row_packs_per_thread(bool fast_dram) {
  if constexpr (lse16_path<Op, T, P>()) return 16;
  if constexpr (arg16_types<Op, T, P>()) return fast_dram ? 32 : unroll_for<Op, T, P>();
  return sizeof(T) == 4 && !Op::kIndex && sizeof(typename Op::State) == 8 ? 32 : unroll_for<Op, T, P>();
}

// Packs a lane of row_warp_kernel takes (the group of lanes a row gets follows from it): the
// unroll, except logsumexp and (from 1024 elements, lane_packs_for) 16-bit argmax/argmin, which
// take row_packs_per_thread there too. logsumexp's group merge is
// log2(group) shuffles with an expf each, a per-row cost that 1024-long rows in groups of 32
// lanes of 8 packs paid on every 1024 elements (65536x1024: 0.906 of copy, where a warp of 32
// packs a lane on 4096-long rows reads at 0.972). Session 18, H100: 65536x1024 99.4 -> 92.0 us,
// 131072x512 123.5 -> 94.1, 262144x256 118.9 -> 100.6, 524288x128 114.2 -> 99.7.
template <class Op, class T, int P>
constexpr int warp_lane_packs(bool fast_dram) {
  const int per_thread = row_packs_per_thread<Op, T, P>(fast_dram);
  return per_thread > unroll_for<Op, T, P>() ? per_thread : warp_unroll<Op, T, P>();
}

// Lanes of row_warp_kernel a row of `packs` packs gets (a power of two in [kMinRowLanes, 32]). Up
// to session 22 every op halved the group while a lane would have fewer than warp_lane_packs
// packs, so a row of 500 bf16 elements (63 packs) got 4 lanes of ~16 packs: a whole round, a
// partial round and the second head/tail element, three latencies in a row. Sums, max and min
// (4-byte states) and the packed 16-bit arg loop now take the smallest group that reads the row
// in one round (8 lanes there). H100, session 23 run 2, µs, same build, old/new rule (XLA):
// bf16 sum 131072x500 47.3 / 44.5 (43.2), 65536x1001 45.6 / 43.9 (44.4), 32768x2001 44.5 / 43.7;
// float32 sum 131072x500 88.2 / 85.9 (85.3), 262144x250 92.4 / 87.4 (86.0); bf16 argmax
// 131072x500 50.4 / 46.4. logsumexp (an expf a merge level) and float32 arg lost with more lanes
// (float32 argmax 262144x250 89.7 / 98.1, bf16 logsumexp 32768x2001 47.8 / 50.4) and keep the
// old rule. Rows whose packs are a power-of-two multiple of the unroll get the same group from both.
template <class Op, class T, int P>
constexpr bool warp_rows_one_round() {
  return Op::kIndex ? arg16_types<Op, T, P>() : sizeof(typename Op::State) == 4;
}
// 16-bit arg rows of fewer than 128 packs (1024 elements) keep the unroll a lane: at 512
// elements 2 lanes of 32 packs took 41.9 µs where 8 lanes of 8 took 40.2 and 4 of 16 40.0 (H200,
// session 36 run 1, bf16 argmax 131072x512), while 1024-element rows gained (4 lanes of 32).
constexpr int64_t kArg16LongWarpRow = 128;
template <class Op, class T, int P>
constexpr int64_t lane_packs_for(int64_t packs, bool fast_dram) {
  if constexpr (arg16_types<Op, T, P>()) {
    if (packs < kArg16LongWarpRow) return unroll_for<Op, T, P>();
  }
  return warp_lane_packs<Op, T, P>(fast_dram);
}
template <class Op, class T, int P>
int warp_row_group(int64_t packs, bool fast_dram) {
  const int64_t per_lane = lane_packs_for<Op, T, P>(packs, fast_dram);
  int group = 32;
  if constexpr (warp_rows_one_round<Op, T, P>()) {
    while (group > kMinRowLanes && group / 2 * per_lane >= packs) group /= 2;
  } else {
    while (group > kMinRowLanes && group * per_lane > packs) group /= 2;
  }
  return group;
}

// Whether unsplit rows of n elements go to row_warp_kernel: those one warp reads in one round.
template <class Op, class T, int P>
bool warp_rows(int64_t n, bool fast_dram) {
  return (n + P - 1) / P <= 32 * row_packs_per_thread<Op, T, P>(fast_dram);
}

// Threads of a row_block_kernel launch for chunks of `chunk` elements: the largest power of two
// in [32, max_row_block_threads<T>()] that leaves each thread row_packs_per_thread packs. Below
// 32768-element chunks float32 arg stops at 256 (4096x16384 with 512: 89.4 -> 90.2 µs, where sum
// and max gained 0.6).
template <class Op, class T, int P>
int row_block_threads(int64_t chunk, bool fast_dram) {
  const int64_t packs = (chunk + P - 1) / P, per_thread = row_packs_per_thread<Op, T, P>(fast_dram);
  const int most = f32_arg8<Op, T, P>() && chunk < 32768 ? 256 : max_row_block_threads<T>();
  int threads = 32;
  while (threads < most && threads * 2 * per_thread <= packs) threads *= 2;
  return threads;
}

// Threads of a row_block_kernel launch of `rows` rows in `splits` chunks of `chunk` elements:
// row_block_threads, with two caps that depend on the launch, not only the chunk.
// - Unsplit rows of 16-bit logsumexp, argmax and argmin (16-byte packs): these kernels hold 80
//   registers, so 3 blocks of 256 fit an SM and 396 an H100. Between one and two such waves of rows
//   (397-792, rows the warp kernel does not take: logsumexp's > 4096 elements since session 35,
//   argmax's > 8192 since session 36), blocks of 128 (6 an SM) make every row resident at once
//   instead of leaving a second, mostly empty wave. H100, session 22 runs 9-10, µs, 256 -> 128
//   threads: logsumexp 512x131072 52.6 -> 47.5, 640x104857 50.6 -> 49.5, 768x87381 50.2 -> 49.7,
//   512x50257 25.5 -> 22.3; argmax 50.5 -> 46.3, 52.1 -> 48.1, 51.2 -> 48.8, 22.7 -> 21.2;
//   768x32768 equal. Not at 1024 rows (2.6 waves of 256 but 1.3 of 128: 1024x65536 logsumexp
//   47.7 -> 53.0, argmax 46.8 -> 48.1).
// - float32 logsumexp launches of >= 512 blocks (rows x chunks; two or more waves of 512-thread
//   blocks, 2 an SM, 264 an H100): at most 256 threads (64+ packs each) instead of 512. Session 22 run 13,
//   same-run A/B, µs: 1024x65536 92.9 -> 91.3, 512x131072 91.3 -> 90.4, full 2^26 (1024
//   chunks) 95.9 -> 94.3, full 2^26 - 1 96.1 -> 94.5. Smaller launches keep 512, which fill the
//   one wave they are (256 lost: 64x2^20 in 256 chunks 93.6 -> 96.0, 256x262144 89.7 -> 92.2).
// A fixed function of the shape, like the split counts, so results do not depend on the device
// (fast_dram moves only argmax / argmin, whose results no plan changes); the H100 sets the constants.
constexpr int64_t kPlanSms = 132;  // H100 SMs, as _PLAN_SMS in jaxops/_reductions.py
constexpr int64_t kWave16 = kPlanSms * 3;
template <class Op, class T, int P>
int row_launch_threads(int64_t rows, int64_t splits, int64_t chunk, bool fast_dram) {
  const int threads = row_block_threads<Op, T, P>(chunk, fast_dram);
  constexpr bool k80 = arg16_types<Op, T, P>() || lse16_path<Op, T, P>();
  constexpr bool f32_lse = sizeof(T) == 4 && !Op::kIndex && sizeof(typename Op::State) == 8;
  if (k80 && splits == 1 && rows > kWave16 && rows <= 2 * kWave16) return threads > 128 ? 128 : threads;
  if (f32_lse && rows * splits >= 512) return threads > 256 ? 256 : threads;
  return threads;
}

// The packed arg loop's shared-memory ring (arg16_stream_ring) in row_block_kernel (kRing): aligned
// 16-byte packs of 2-byte types on sm_90+ (arg16_path; the host asks with arg16_types, as it
// cannot see the device's path), blocks of kBlockThreads with at least kRingMinPacks packs a
// thread (chunks of >= 32768 elements). H100, session
// 15 (runs 3-7, same-run A/B against the register loop, bf16 argmax, µs): 1024x65536 48.9 -> 47.0,
// 64x2^20 52.7 -> 50.0, full 51.9 -> 50.1 with 4 stages (3 stages: 47.5 / 50.6 / 50.5; 2: 47.9 /
// 51.0 / 50.8), 16384x4096 (a warp a row, 16 packs a lane) 48.8 -> 47.3, since session 16 blocks
// of 64 threads with 8 packs each and no ring, 46.2; 4096x16384 (8 packs a thread) 46.9 -> 47.7
// through the ring, hence the minimum. The column kernel keeps the register
// loop: through a 2-stage ring (16 KB of fold states plus a 4-stage ring leave 2 blocks an SM)
// argmax_cols moved 54.0 -> 53.6 (1048576x64), 54.5 -> 54.3 (262144x256), 52.5 -> 53.6 (16384x4096).
constexpr int kRowRingStages = 4;
constexpr int kRingMinPacks = 16;

// Whether a row launch streams through the ring (a function of the plan): chunks of `chunk`
// elements over `threads` threads of P-element packs, whose count a thread still fits the ring's
// 32 bits.
constexpr bool ring_rows(int64_t chunk, int threads, int P) {
  const int64_t packs = chunk / (int64_t(threads) * P);
  return packs >= kRingMinPacks && packs < INT_MAX;
}

template <class Op, class T, int P, bool V>
__host__ __device__ constexpr bool uses_ring() {
#if defined(__CUDA_ARCH__)
  return V && arg16_path<Op, T, P>();
#else
  return V && arg16_types<Op, T, P>();
#endif
}

}  // namespace jaxops::reduce::kernels
