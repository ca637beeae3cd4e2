"""The Hopper backward's fragment-order dq accumulator (common/dq_accum_perm.h, DqAccumFrag), checked on the
host against the dQ WGMMA's own accumulator partition for every head dim that takes it (d 64 / 96 / 128).

Under HopperBwdTile::dq_frag each consumer warpgroup stages its dQ part in register order (entry i of
warpgroup thread t at 512 (i / 4) + 4 t + i % 4 of the part) and the dQ writer adds the part with one bulk
reduction at DqAccumFrag::offset of the part's first row and column; the postprocess reads rows r and
r + 8 of 8 columns back from 4 consecutive 16-byte entries. A wrong map adds dQ into the wrong rows: the
GPU tests would see it only at the head dims built there. Checked here, per thread and register:
  - the offset the staging and the bulk reduction give entry i equals DqAccumFrag::offset of the
    (row, column) that CuTe's partition of the tiled MMA gives it, in both warpgroups' parts;
  - the map is a bijection of a 64-row block onto its 64 * d floats;
  - the postprocess's reading (rows r and r + 8 of 8 columns as 4 consecutive 16-byte entries) agrees
    with DqAccumFrag::offset;
  - the dS row permutation (dQRowPerm) is the identity when the accumulator is in fragment order.
"""

PROGRAM = r"""
#define FLASHTILE_BWD_DQ_FRAG 1
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cstdio>
#include <vector>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include "hopper/bwd_traits.h"
#include "common/dq_accum_perm.h"

using namespace cute;
static int failures = 0;
static long checked = 0;

template <int kD>
void check_head_dim() {
  using Traits = flashtile::hopper::BwdTraits<cutlass::bfloat16_t, kD, kD>;
  static_assert(Traits::kdQFrag, "the head dim stages dQ in fragment order under FLASHTILE_BWD_DQ_FRAG");
  using Frag = flashtile::DqAccumFrag<kD, Traits::kdQFragCols>;
  constexpr int kBlockM = Traits::kBlockM, kRegs = Traits::kdQPartRows * Traits::kdQPartCols / 128;
  typename Traits::TiledMmadQ mma;
  // One m-block of the accumulator: every element written exactly once.
  std::vector<int> hits(kBlockM * kD, 0);
  for (int t = 0; t < Traits::kNMmaThreads; ++t) {
    Tensor tC = mma.get_thread_slice(t).partition_C(make_identity_tensor(typename Traits::TileShapedQ{}));
    if (int(size(tC)) != kRegs) { ++failures; std::printf("FAIL d %d: %d registers, expected %d\n", kD, int(size(tC)), kRegs); return; }
    int const part = t / 128;
    int64_t const part0 = Frag::offset(Traits::kdQRowParts ? part * 64 : 0, Traits::kdQRowParts ? 0 : part * Traits::kdQPartCols);
    for (int i = 0; i < kRegs; ++i) {
      int const r = get<0>(tC(i)), c = get<1>(tC(i));
      int64_t const staged = part0 + (i / 4) * 512 + 4 * (t % 128) + i % 4;
      int64_t const want = Frag::offset(r, c);
      ++checked;
      if (staged != want) {
        ++failures;
        if (failures < 10) { std::printf("FAIL d %d t %d i %d (%d, %d): staged at %ld, map %ld\n", kD, t, i, r, c, long(staged), long(want)); }
      }
      if (want >= 0 && want < kBlockM * kD) { ++hits[want]; }
    }
  }
  for (int j = 0; j < kBlockM * kD; ++j) {
    if (hits[j] != 1) { ++failures; if (failures < 10) { std::printf("FAIL d %d: element %d written %d times\n", kD, j, hits[j]); } }
  }
  // The postprocess (one 64-row block per CTA): rows r, r + 8 of the 8 columns from col are the 4
  // consecutive 16-byte entries from DqAccumFrag::offset(r, col), entry q holding columns col + 2 q and
  // col + 2 q + 1 of row r, then of row r + 8; r runs over the rows whose bit 3 is clear.
  for (int pair = 0; pair < 32; ++pair) {
    int const r = 16 * (pair / 8) + pair % 8;
    for (int col = 0; col < kD; col += 8) {
      int64_t const at = Frag::offset(64 + r, col);
      if (at % 4 != 0) { ++failures; std::printf("FAIL d %d: entry (%d, %d) not 16-byte aligned\n", kD, r, col); }
      for (int q = 0; q < 4; ++q)
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 2; ++e) {
            ++checked;
            if (Frag::offset(64 + r + 8 * h, col + 2 * q + e) != at + 4 * q + 2 * h + e) {
              ++failures;
              if (failures < 10) { std::printf("FAIL d %d postprocess (%d, %d)\n", kD, r + 8 * h, col + 2 * q + e); }
            }
          }
    }
  }
  for (int j = 0; j < kBlockM; ++j) {
    if (int(typename Traits::dQRowPerm{}(j)) != j) { ++failures; std::printf("FAIL d %d: dQRowPerm(%d) = %d\n", kD, j, int(typename Traits::dQRowPerm{}(j))); }
  }
}

int main() {
  check_head_dim<64>();
  check_head_dim<96>();
  check_head_dim<128>();
  std::printf("%ld entries checked\n", checked);
  if (checked == 0) { ++failures; }
  std::printf("%d failures\n", failures);
  return failures != 0;
}
"""


def test_dq_accum_frag_matches_the_wgmma_partition(run_host_program):
    run_host_program(PROGRAM, cute=True, timeout=300)
