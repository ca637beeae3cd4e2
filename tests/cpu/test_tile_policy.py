"""The Ampere-path forward's tile choice above hdim 128 (common/tile_policy.h), compiled for the host.

Shared-memory bytes per tile are recomputed here the way ampere/fwd_traits.h adds them up (16-bit Q, K,
V and, for split tiles, P; fp32 row statistics; 4-byte per-thread constants), and
ampere_fwd_tile_kind is asked for each device's limits:
  - sm_90 (227 KB per block, 228 KB per SM) holds two split 64-row CTAs: split, not wide;
  - sm_80 (163 / 164 KB) holds one: the split wide tile (8 warps per SM);
  - sm_86 / sm_89 (99 / 100 KB) fit no split tile twice nor a split wide one: at hdim 256 the unsplit
    64-row tile (96 KB + constants), at hdim 192 the unsplit wide one (one CTA of 8 warps);
  - every tile chosen fits the device's per-block limit, and the tiles' shapes are what the kernels
    assume (32 rows per warp pair, warps_n 2 only on split tiles);
  - ampere_fwd_load_after places each step's K / V load within both GEMMs' k-slices;
  - the backward stores P after its dP GEMM only on unsplit tiles, where measured, and loads Q/dO
    inside its dQ GEMM only in sm_90 code, after a k-slice that GEMM has.
"""

PROGRAM = r"""
#include <cstdio>
#include <initializer_list>
#include "common/tile_policy.h"
using namespace flashtile;

static int failures = 0;
#define CHECK(c) do { if (!(c)) { ++failures; std::printf("FAIL line %d: %s\n", __LINE__, #c); } } while (0)

static int tile_bytes(int d, bool wide, bool split) {
  FwdTile const t = ampere_fwd_tile(d, wide, split);
  int const threads = 32 * t.num_warps;
  int bytes = 2 * (t.block_m * d + 2 * t.block_n * d);
  if (t.warps_n > 1) { bytes += 2 * t.block_m * t.block_n + 4 * t.warps_n * t.block_m; }
  return bytes + (t.warps_n > 1 ? 3 : 2) * threads * 4;
}

int main() {
  struct Dev { char const* name; int per_sm, optin; };
  Dev const devs[] = {{"sm_90", 233472, 232448}, {"sm_80", 167936, 166912}, {"sm_86", 102400, 101376}};
  // Expected (wide, split) per device, for the head-dim buckets above 128.
  struct Case { int d; FwdTileKind want[3]; };
  Case const cases[] = {{192, {{false, true}, {true, true}, {true, false}}},
                        {256, {{false, true}, {true, true}, {false, false}}}};
  for (Case const& c : cases) {
    int const d = c.d;
    int const bytes[2][2] = {{tile_bytes(d, false, false), tile_bytes(d, false, true)},
                             {tile_bytes(d, true, false), tile_bytes(d, true, true)}};
    for (int i = 0; i < 3; ++i) {
      FwdTileKind const k = ampere_fwd_tile_kind(bytes, devs[i].per_sm, devs[i].optin);
      if (k.wide != c.want[i].wide || k.split != c.want[i].split) {
        ++failures;
        std::printf("FAIL d %d %s: wide %d split %d\n", d, devs[i].name, k.wide, k.split);
      }
      CHECK(bytes[k.wide][k.split] <= devs[i].optin);
    }
    for (int w = 0; w < 2; ++w) {
      FwdTile const s = ampere_fwd_tile(d, w == 1, true);
      FwdTile const u = ampere_fwd_tile(d, w == 1, false);
      CHECK(s.warps_n == 2 && s.block_m == 32 * (s.num_warps / 2));
      CHECK(u.warps_n == 1 && u.block_m == 16 * u.num_warps);
    }
  }
  for (int d : {64, 96, 128}) {
    CHECK(ampere_fwd_tile(d, false, true).warps_n == 1);
  }
  // The K / V loads placed after n k-slices of each step's GEMMs: a placement past the last slice of
  // either GEMM (S: d / 16 slices, PV: block_n / 16 in its first column chunk) would never issue them.
  int placed = 0;
  for (int d : {64, 96, 128, 192, 256}) {
    for (int w = 0; w < 2; ++w) {
      for (int sp = 0; sp < 2; ++sp) {
        for (int band = 0; band < 2; ++band) {
          FwdTile const t = ampere_fwd_tile(d, w == 1, sp == 1);
          int const n = ampere_fwd_load_after(t, d, band == 1);
          CHECK(n >= 0 && n <= d / 16 && n <= t.block_n / 16);
          placed += n > 0;
        }
      }
    }
  }
  CHECK(placed == 1);  // only the d = 256 split 64 x 64 tile without a mask (measured)
  // The XOR-folded P store only on a split tile (the others have no P in shared memory).
  for (int d : {64, 96, 128, 192, 256}) {
    for (int w = 0; w < 2; ++w) {
      for (int sp = 0; sp < 2; ++sp) {
        FwdTile const t = ampere_fwd_tile(d, w == 1, sp == 1);
        CHECK(!ampere_fwd_p_store_xor(t, d, false) || t.warps_n == 2);
      }
    }
  }
  // The backward's late P store only on unsplit tiles (the split ones pass P between warp halves
  // before dP exists), and where measured: the default d 64 and d 128 tiles.
  int late = 0;
  for (int d : {64, 96, 128, 192, 256}) {
    for (int small = 0; small < 2; ++small) {
      BwdTile const t = ampere_bwd_tile(d, false, small == 1);
      CHECK(!t.p_late || !t.sdp_split);
      late += t.p_late;
    }
  }
  CHECK(late == 2);
  // The Q/dO load inside the dQ GEMM after a k-slice the GEMM has, and on no sm_8x code (not measured
  // there; the single-stage tile's spilled). Taken where measured: d = 256 (one stage) and d = 64 (two).
  for (int d : {64, 96, 128, 192, 256}) {
    for (int large = 0; large < 2; ++large) {
      for (int small = 0; small < 2; ++small) {
        BwdTile const t = ampere_bwd_tile(d, large == 1, small == 1);
        if (t.qdo_in_dq_arch != kArchNever) {
          CHECK(t.block_n / 16 > 1 && t.qdo_in_dq_arch >= 900);
        }
      }
    }
  }
  CHECK(ampere_bwd_tile(256).qdo_in_dq_arch == 900);
  CHECK(ampere_bwd_tile(64).qdo_in_dq_arch == 900 && ampere_bwd_tile(64).q_stages == 2);
  // d = 64 on sm_90 code: dQ between dV and dK with either mask, the load after slice 0 / 1; the load's
  // slice is one the dQ GEMM has (block_n / 16 k-slices) on every tile.
  CHECK(ampere_bwd_tile(64).dq_first_unmasked && ampere_bwd_tile(64).dq_first_band_arch == 900);
  CHECK(ampere_bwd_tile(64).qdo_slice[0] == 0 && ampere_bwd_tile(64).qdo_slice[1] == 1);
  for (int d : {64, 96, 128, 192, 256}) {
    for (int variant = 0; variant < 8; ++variant) {
      BwdTile const t = ampere_bwd_tile(d, variant & 1, variant & 2, !(variant & 4));
      CHECK(t.qdo_slice[0] >= 0 && t.qdo_slice[1] >= 0);
      CHECK(t.qdo_slice[0] < t.block_n / 16 && t.qdo_slice[1] < t.block_n / 16);
      CHECK(t.dq_first_band_arch >= 900);  // not measured in sm_8x code
    }
  }
  CHECK(ampere_bwd_tile(128).qdo_in_dq_arch == kArchNever);
  std::printf("%d failures\n", failures);
  return failures != 0;
}
"""


def test_ampere_fwd_tile_choice_on_the_host(run_host_program):
    run_host_program(PROGRAM)


SPLIT_PROGRAM = r"""
#include <cstdio>
#include <initializer_list>
#include "common/tile_policy.h"
using namespace flashtile;

static int failures = 0;
#define CHECK(c) do { if (!(c)) { ++failures; std::printf("FAIL line %d: %s\n", __LINE__, #c); } } while (0)

int main() {
  // Whatever the problem, a plan runs every unit once: the whole ones, then the tail's parts in one
  // round (at most one per CTA of the grid), within the scratch's items, each part a run of
  // blocks_per_part blocks (the last at least one), and only where a part costs at most 3 / 4 of a
  // whole tile (n + 1 blocks' time); as many parts as fit, evened out to whole runs.
  for (int units = 1; units <= 600; units += 7) {
    for (int slots : {66, 114, 132}) {
      for (int n : {1, 2, 3, 4, 8, 16, 40}) {
        for (int max_items : {0, 5, 132, 1 << 20}) {
          FwdSplitPlan const p = hopper_fwd_split_plan(units, slots, n, max_items);
          int const tail = units - p.num_whole;
          CHECK(p.splits >= 1 && p.num_whole >= 0 && tail >= 0);
          if (p.splits == 1) {
            CHECK(p.num_whole == units && p.blocks_per_part == 0);
            continue;
          }
          CHECK(tail == units % slots && tail > 0 && units / slots <= kSplitMaxWaves);
          CHECK(tail * p.splits <= slots && tail * p.splits <= max_items && p.splits <= kSplitMaxParts);
          CHECK(p.blocks_per_part * p.splits >= n && p.blocks_per_part * (p.splits - 1) < n);
          CHECK(4 * (p.blocks_per_part + 1) <= 3 * (n + 1));
          int s0 = slots / tail < max_items / tail ? slots / tail : max_items / tail;
          s0 = s0 < n ? s0 : n;
          s0 = s0 < kSplitMaxParts ? s0 : kSplitMaxParts;
          CHECK(p.blocks_per_part == (n + s0 - 1) / s0);
        }
      }
    }
  }
  // Whole waves, or one KV block per tile: nothing to split.
  CHECK(hopper_fwd_split_plan(264, 132, 8, 1 << 20).splits == 1);
  CHECK(hopper_fwd_split_plan(133, 132, 1, 1 << 20).splits == 1);
  // The benchmark's grids (10-31 waves) run whole: d 64 at 512 (2048 pairs on 66 clusters, 2 left) and
  // 2k (the tall tile: 2816 tiles on 132 CTAs, 44 left); two waves and a tail split.
  CHECK(hopper_fwd_split_plan(2048, 66, 4, 132).splits == 1);
  CHECK(hopper_fwd_split_plan(2816, 132, 16, 264).splits == 1);
  FwdSplitPlan const two = hopper_fwd_split_plan(2 * 132 + 44, 132, 16, 264);
  CHECK(two.num_whole == 264 && two.splits == 3 && two.blocks_per_part == 6);
  CHECK(hopper_fwd_split_plan(3 * 132 + 44, 132, 16, 264).splits == 1);
  // A grid below one wave: its tiles split up to the idle CTAs (9 tiles of 24 blocks on 132 CTAs: at
  // most 14 parts, as 12 runs of 2 blocks).
  FwdSplitPlan const small = hopper_fwd_split_plan(9, 132, 24, 264);
  CHECK(small.num_whole == 0 && small.splits == 12 && small.blocks_per_part == 2);
  // The scratch: a record of d_v / 2 + 4 floats per consumer thread of one grid's worth of CTAs, for the
  // tallest tile of the buckets (192 rows at d <= 128).
  CHECK(hopper_fwd_split_record_floats(64) == 36 && hopper_fwd_split_record_floats(256) == 132);
  CHECK(hopper_fwd_split_accum_bytes(132, 64, 64) == 132ll * 384 * 36 * 4);
  CHECK(hopper_fwd_split_accum_bytes(132, 64, 100) == 132ll * 384 * 68 * 4);
  CHECK(hopper_fwd_split_accum_bytes(132, 128, 128) == 132ll * 384 * 68 * 4);
  // Above d 128 (O staged over V) nothing splits.
  CHECK(hopper_fwd_split_accum_bytes(132, 256, 256) == 0);
  CHECK(hopper_fwd_split_accum_bytes(132, 192, 128) == 0);
  CHECK(hopper_fwd_split_accum_bytes(132, 128, 264) == 0);
  // The tile head inside the loop: only where measured (d 256 under band masks), and only on the
  // overlapped schedule, whose loop body it runs through.
  for (int d : {64, 96, 128, 192, 256}) {
    for (int tall = 0; tall < 2; ++tall) {
      for (int band = 0; band < 2; ++band) {
        HopperFwdTile const t = hopper_fwd_tile(d, d, tall == 1);
        CHECK(hopper_fwd_head_in_loop(t, d, band == 1) == (d > 192 && band == 1));
        HopperFwdTile serial = t;
        serial.intra_wg_overlap = false;
        CHECK(!hopper_fwd_head_in_loop(serial, d, band == 1));
      }
    }
  }
  std::printf("%d failures\n", failures);
  return failures != 0;
}
"""


def test_hopper_fwd_tail_split_plan_on_the_host(run_host_program):
    run_host_program(SPLIT_PROGRAM)
