// Storage orders of the fp32 dq accumulator other than row-major, shared with the postprocess that
// reads it back (DqAccumPerm: the backward kernels that add into it from registers, i.e. the Ampere
// path and the Hopper path under HopperBwdTile::dq_red; DqAccumFrag: the Hopper path under dq_frag);
// the vector reductions that add an accumulator fragment into it; the deterministic mode's wait for a
// query block's turn.
#pragma once

#include <cute/config.hpp>
#include <cute/tensor.hpp>

#include "common/grid_dependency.h"

namespace flashtile {

// Storage order of the fp32 dq accumulator that makes an mma.sync accumulator fragment's atomics
// coalesced (the Ampere path). A warp's 16x8 accumulator atom half holds, for one fragment index,
// an 8 x 8 block (rows r0..r0+7, columns 8 b..8 b+7; lane l at row r0 + l / 4, columns 8 b + 2 (l % 4)
// + {0, 1}); stored row-major it spans 8 rows, so each warp-wide reduction touched 8 lines with 32 bytes
// each. Here each group of 8 rows (from the first row of the batch element) of kD columns keeps its 8 x 8
// blocks contiguous, block b at element 64 b of the group, (r, c) at 64 b + 8 (r % 8) + c % 8: lane l's
// pair lands at 64 b + 2 l, so a warp's reduction covers 256 contiguous bytes. 8 consecutive columns
// of a row stay 8 consecutive elements, so the postprocess reads 16-byte vectors as before.
template <int kD>
struct DqAccumPerm {
  static_assert(kD % 8 == 0);
  // (row, col) of the accumulator -> (stored row, stored col), rows relative to an 8-aligned origin.
  // Unsigned bit arithmetic: (r + 8 k) % 8 folds to r % 8 for a compile-time 8 k.
  CUTE_HOST_DEVICE static void map(int r, int c, int& sr, int& sc) {
    unsigned const ur = unsigned(r), uc = unsigned(c);
    unsigned const lin = (uc >> 3) * 64u + (ur & 7u) * 8u + (uc & 7u);
    sr = int((ur & ~7u) + lin / unsigned(kD));
    sc = int(lin % unsigned(kD));
  }
};

// Storage order of the fp32 dq accumulator of the Hopper backward under HopperBwdTile::dq_frag, shared
// with the postprocess. Each 64-row block of a sequence (rows from its first; kD * 64 contiguous floats)
// holds its kD / kCols column parts one after the other, each part (64 x kCols: one consumer
// warpgroup's m64 WGMMA accumulator) in register order: thread t's entries 4 g ... 4 g + 3 at
// 512 g + 4 t. The warpgroup then stages its accumulator with 16-byte stores (512 contiguous bytes per
// warp) and the part leaves shared memory as one contiguous bulk reduction. WGMMA's fp32 accumulator
// puts entry i of thread t = 32 w + l at row 16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) +
// 2 (l % 4) + i % 2, so entries 4 g ... 4 g + 3 are (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1).
template <int kD, int kCols>
struct DqAccumFrag {
  static constexpr int kRows = 64;
  static_assert(kD % kCols == 0 && kCols % 8 == 0);
  // Element offset of (row, col) of a sequence's accumulator.
  CUTE_HOST_DEVICE static int64_t offset(int r, int c) {
    int const rr = r % kRows, cc = c % kCols;
    int const t = 32 * (rr / 16) + 4 * (rr % 8) + (cc % 8) / 2;
    int const e = cc % 2 + 2 * ((rr % 16) / 8);
    return int64_t(r / kRows) * (kRows * kD) + (c / kCols) * (kRows * kCols) + (cc / 8) * 512 + 4 * t + e;
  }
};

// Deterministic mode, one thread: waits until the query block's semaphore counts `expected` earlier
// adds (acquire: its own adds, and those of the threads it then releases through a barrier, come after
// theirs; on sm_90 also the bulk reductions it issues, through the proxy fence).
CUTE_DEVICE void wait_dq_semaphore(int const* semaphore, int expected) {
  while (load_acquire_gpu(semaphore) != expected) {}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}

// Fire-and-forget fp32 add to global memory (red.global.add: no value comes back, unlike the ATOM
// that atomicAdd can compile to, which costs a round trip and twice the L2 traffic).
CUTE_DEVICE void red_add(float* ptr, float value) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr), "f"(value) : "memory");
}

// acc, an fp32 accumulator fragment in the 16x8 atom order that mma.sync and WGMMA share (two adjacent
// columns per row: entries i, i + 1 for even i), added to the tile at g (rows from an 8-aligned origin,
// contiguous: row stride kD) stored in DqAccumPerm<kD>'s order, so a warp's reduction covers 256
// contiguous bytes. tC holds the entries' (row, column) in the tile; col0 is added to the columns (a
// column pass of the tile). With contiguous rows an entry's offset is the thread's first entry's plus
// a compile-time constant (rows step by 8, columns by 8 within the fragment), so every add is one
// instruction on one base address. sm_90 adds each pair with one 8-byte vector reduction.
template <int kD, class TensorAcc, class TensorC>
CUTE_DEVICE void red_add_dq_perm(TensorAcc const& acc, TensorC const& tC, float* g, int col0) {
  auto const t0 = *tC.data();
  int r0, c0;
  DqAccumPerm<kD>::map(cute::get<0>(t0), col0 + cute::get<1>(t0), r0, c0);
  float* const base = g + (r0 * kD + c0);
  cute::for_each(cute::make_int_sequence<decltype(cute::size(acc))::value / 2>{}, [&](auto pair) {
    // (r, c) is stored at (r & ~7) * kD + 64 (c / 8) + 8 (r % 8) + c % 8: an entry (dr, dc) past the
    // first, both multiples of 8, is dr * kD + 8 dc past it.
    constexpr int i = 2 * decltype(pair)::value;
    using Off = decltype(tC.layout()(cute::Int<i>{}));
    using OffNext = decltype(tC.layout()(cute::Int<i + 1>{}));
    constexpr int dr = decltype(cute::get<0>(Off{}))::value, dc = decltype(cute::get<1>(Off{}))::value;
    static_assert(dr % 8 == 0 && dc % 8 == 0, "fragment entries step by whole 8 x 8 blocks");
    static_assert(decltype(cute::get<0>(OffNext{}))::value == dr && decltype(cute::get<1>(OffNext{}))::value == dc + 1,
                  "entries i, i + 1 are adjacent columns of one row");
    float* const ptr = base + (dr * kD + dc * 8);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(acc(i)), "f"(acc(i + 1)) : "memory");
#else
    red_add(ptr, acc(i));
    red_add(ptr + 1, acc(i + 1));
#endif
  });
}

}  // namespace flashtile
