// The Ampere path's storage order of the fp32 dq accumulator (DqAccumPerm), shared by the backward
// kernel that adds into it and the postprocess that reads it back.
#pragma once

#include <cute/config.hpp>

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

}  // namespace flashtile
