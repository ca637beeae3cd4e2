"""The band-mask launch order of common/block_order.h, compiled for the host and run on the CPU.

The header's device function reads blockIdx / gridDim; the test program gives it host stand-ins (and
a stand-in cute/config.hpp whose CUTE_DEVICE is plain `inline`), sets them to every CTA of a grid and
checks what the kernels rely on:
  - the CTA -> (block, head, batch) map is a bijection onto the grid for every section size,
    including a last section with fewer pairs;
  - within a section the CTAs go block rank by block rank (the longest first) over the section's
    pairs, and sections follow each other;
  - pairs_per_section <= 0 is the plain order;
  - the Hopper forward's tile order (lead_section_order) is a bijection onto (rank, pair) that takes
    the lead pairs first, group by group and rank by rank in a group, then the other pairs in sections;
  - the section sizes the launchers compute are powers of two that fit the L2 share (or 1), never
    more than the grid's pairs, and 0 (the plain order) for deterministic mode, unmasked problems and
    sequences below the floor;
  - rotated backward walks (deterministic mode): the turns that rotated_dq_turn gives the KV blocks
    reaching one query block are 0 ... N - 1 in the order of their steps, so with every KV block
    taking one step per round nobody waits; the launcher rotates only unmasked grids in
    deterministic mode 1 (not 2), and only grids of at most half the SMs along x.
"""

PROGRAM = r"""
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <set>
#include <tuple>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 blockIdx, gridDim;
using std::max;
using std::min;
#include "common/block_order.h"
using namespace flashtile;

static int failures = 0;
static void check(bool ok, char const* fmt, ...) {
  if (ok) { return; }
  ++failures;
  std::va_list args;
  va_start(args, fmt);
  std::printf("FAIL ");
  std::vprintf(fmt, args);
  std::printf("\n");
  va_end(args);
}

static void check_grid(int blocks, int heads, int batch, int pps) {
  gridDim = dim3{unsigned(blocks), unsigned(heads), unsigned(batch)};
  std::set<std::tuple<int, int, int>> seen;
  int const pairs = heads * batch;
  int prev_section = -1, prev_block = -1;
  for (int z = 0; z < batch; ++z)
    for (int y = 0; y < heads; ++y)
      for (int x = 0; x < blocks; ++x) {
        blockIdx = dim3{unsigned(x), unsigned(y), unsigned(z)};
        BlockCoord const c = band_block_coord(pps);
        check(c.block >= 0 && c.block < blocks && c.bidh >= 0 && c.bidh < heads && c.bidb >= 0 && c.bidb < batch,
              "out of range: grid %d %d %d pps %d", blocks, heads, batch, pps);
        seen.insert({c.block, c.bidh, c.bidb});
        if (pps <= 0) {
          check(c.block == x && c.bidh == y && c.bidb == z, "plain order changed: pps %d", pps);
          continue;
        }
        int const section = (c.bidb * heads + c.bidh) / pps;
        check(section >= prev_section, "sections out of order: grid %d %d %d pps %d", blocks, heads, batch, pps);
        if (section == prev_section) {
          check(c.block >= prev_block, "ranks out of order in a section: grid %d %d %d pps %d", blocks, heads, batch, pps);
        }
        prev_section = section;
        prev_block = c.block;
      }
  check(int(seen.size()) == blocks * pairs, "not a bijection: grid %d %d %d pps %d (%zu of %d)", blocks, heads,
        batch, pps, seen.size(), blocks * pairs);
}

// Every item of lead_section_order: a bijection, the lead pairs' items first (group by group, ranks in
// order within a group), then the rest's (section by section, ranks in order within a section).
static void check_lead(int blocks, int pairs, int lead, int group, int pps) {
  std::set<std::pair<int, int>> seen;
  int prev_part = -1, prev_rank = -1;
  for (int idx = 0; idx < blocks * pairs; ++idx) {
    int rank, pair;
    lead_section_order(idx, blocks, pairs, lead, group, pps, rank, pair);
    check(rank >= 0 && rank < blocks && pair >= 0 && pair < pairs, "lead order out of range: %d %d %d %d %d idx %d", blocks,
          pairs, lead, group, pps, idx);
    seen.insert({rank, pair});
    bool const in_lead = idx < lead * blocks;
    check(in_lead == (pair < lead), "lead order mixes the parts: %d %d %d %d %d idx %d", blocks, pairs, lead, group, pps, idx);
    int const part = in_lead ? pair / group : 1 << 20 | (pair - lead) / pps;  // group, or section after all groups
    check(part >= prev_part, "lead order: groups / sections out of order at idx %d", idx);
    if (part == prev_part) { check(rank >= prev_rank, "lead order: ranks out of order at idx %d", idx); }
    prev_part = part;
    prev_rank = rank;
  }
  check(int(seen.size()) == blocks * pairs, "lead order not a bijection: %d %d %d %d %d", blocks, pairs, lead, group, pps);
}

// Rotated walks of num_n <= num_m KV blocks over num_m query blocks: KV block n is at query block
// (n + s) mod num_m at step s. Per query block the turns must be a permutation of 0 ... num_n - 1
// increasing with the step, and a round-by-round run (every KV block tries its next step each round,
// adds taking effect at the round's end) must finish in num_m rounds: nobody waits.
static void check_rotated(int num_n, int num_m) {
  std::vector<std::vector<int>> turn_at_step(num_m, std::vector<int>(num_m, -1));
  for (int n = 0; n < num_n; ++n)
    for (int s = 0; s < num_m; ++s) {
      int const j = (n + s) % num_m;
      int const t = rotated_dq_turn(n, s, num_n, num_m);
      check(turn_at_step[j][s] == -1, "rotated: two KV blocks at query block %d step %d (%d, %d)", j, s, num_n, num_m);
      turn_at_step[j][s] = t;
    }
  for (int j = 0; j < num_m; ++j) {
    int next = 0;
    for (int s = 0; s < num_m; ++s)
      if (turn_at_step[j][s] >= 0) {
        check(turn_at_step[j][s] == next, "rotated turn %d, expected %d: query block %d step %d (%d, %d)",
              turn_at_step[j][s], next, j, s, num_n, num_m);
        ++next;
      }
    check(next == num_n, "rotated: query block %d gets %d adds of %d (%d, %d)", j, next, num_n, num_n, num_m);
  }
  std::vector<int> sem(num_m, 0), step(num_n, 0);
  int rounds = 0;
  for (bool busy = true; busy && rounds <= 2 * num_m; ++rounds) {
    std::vector<int> done;
    busy = false;
    for (int n = 0; n < num_n; ++n) {
      if (step[n] == num_m) { continue; }
      busy = true;
      int const j = (n + step[n]) % num_m;
      if (sem[j] == rotated_dq_turn(n, step[n], num_n, num_m)) { done.push_back(n); }
    }
    for (int n : done) { ++sem[(n + step[n]) % num_m]; ++step[n]; }
    if (!busy) { break; }
  }
  check(rounds == num_m, "rotated walks of %d KV blocks over %d query blocks take %d rounds", num_n, num_m, rounds);
}

static BwdParams bwd_params(int seqlen, int heads, int heads_k, int deterministic) {
  FtBwdParams abi{};
  abi.fwd.seqlen_q = abi.fwd.seqlen_k = seqlen;
  abi.fwd.num_heads = heads;
  abi.fwd.num_heads_k = heads_k;
  abi.fwd.is_causal = 1;
  abi.deterministic = deterministic;
  return make_bwd_params(abi);
}

int main() {
  int const grids[][3] = {{1, 1, 1}, {7, 1, 1}, {16, 5, 1}, {16, 2, 5}, {33, 3, 3}, {64, 16, 4}, {8, 32, 7}, {5, 7, 9}};
  for (auto const& g : grids)
    for (int pps : {0, 1, 2, 4, 8, 16, 64})
      if (pps <= g[1] * g[2]) check_grid(g[0], g[1], g[2], pps);

  int const leads[][5] = {{4, 128, 96, 4, 32}, {16, 128, 96, 4, 32}, {7, 10, 6, 4, 3}, {3, 9, 0, 4, 4},
                          {5, 64, 63, 1, 1}, {9, 48, 40, 16, 8}, {1, 12, 8, 3, 4}};
  for (auto const& l : leads) check_lead(l[0], l[1], l[2], l[3], l[4]);

  for (int pairs : {1, 3, 5, 16, 100})
    for (long long bytes : {1LL, 1LL << 20, 3LL << 20, 16LL << 20, 1LL << 30})
      for (int mb : {1, 16, 32}) {
        int const s = pairs_in_share(bytes, pairs, mb);
        check(s >= 1 && s <= pairs && (s & (s - 1)) == 0, "pairs_in_share %d %lld %d -> %d", pairs, bytes, mb, s);
        check(s == 1 || s * bytes <= (static_cast<long long>(mb) << 20), "pairs_in_share overflows the share: %d", s);
        check(2 * s > pairs || 2 * s * bytes > (static_cast<long long>(mb) << 20), "pairs_in_share not the largest: %d", s);
      }

  check(pairs_in_share(1 << 20, 8, 0) == 0, "a zero share is not the plain order");

  using E = unsigned short;  // a 16-bit element
  dim3 grid{32, 8, 4};
  check(bwd_pairs_per_section<E, 128, 128>(bwd_params(4096, 8, 8, 0), true, grid, 2048) > 0, "bwd sections off at 4k");
  check(bwd_pairs_per_section<E, 128, 128>(bwd_params(4096, 8, 8, 1), true, grid, 2048) == 0, "bwd sections in deterministic mode");
  check(bwd_pairs_per_section<E, 128, 128>(bwd_params(4096, 8, 8, 0), false, grid, 2048) == 0, "bwd sections without a mask");
  check(bwd_pairs_per_section<E, 128, 128>(bwd_params(1024, 8, 8, 0), true, grid, 2048) == 0, "bwd sections below the floor");
  check(bwd_pairs_per_section<E, 128, 128>(bwd_params(1024, 8, 8, 0), true, grid, 512) > 0, "bwd sections off above the floor");
  // 4k keys, d 128: 4 MB per pair (Q, dO 16-bit, dq fp32) -> 4 pairs in 16 MB; GQA 4:1 -> 1.
  check(bwd_pairs_per_section<E, 128, 128>(bwd_params(4096, 8, 8, 0), true, grid, 2048) == 4, "bwd section size");
  check(bwd_pairs_per_section<E, 128, 128>(bwd_params(4096, 8, 2, 0), true, grid, 2048) == 1, "bwd GQA section size");

  for (int num_m = 1; num_m <= 40; ++num_m)
    for (int num_n = 1; num_n <= num_m; ++num_n) check_rotated(num_n, num_m);
  check(rotated_dq_turn(0, 0, 1, 1) == 0, "rotated: a single KV block");
  check(bwd_dq_rotate(bwd_params(4096, 8, 8, 1), false, dim3{32, 8, 4}, 132) == 1, "deterministic, unmasked: not rotated");
  check(bwd_dq_rotate(bwd_params(4096, 8, 8, 1), true, dim3{32, 8, 4}, 132) == 0, "rotated under a band mask");
  check(bwd_dq_rotate(bwd_params(4096, 8, 8, 1), false, dim3{67, 8, 4}, 132) == 0, "rotated beyond half the SMs");
  check(bwd_dq_rotate(bwd_params(4096, 8, 8, 1), false, dim3{66, 8, 4}, 132) == 1, "not rotated at half the SMs");
  check(bwd_dq_rotate(bwd_params(4096, 8, 8, 2), false, dim3{32, 8, 4}, 132) == 0, "rotated for deterministic = 2");
  check(bwd_dq_rotate(bwd_params(4096, 8, 8, 0), false, dim3{32, 8, 4}, 132) == 0, "rotated outside deterministic mode");

  FwdParams f = bwd_params(4096, 8, 2, 0).fwd;
  // 4k keys, d 128: 2 MB of K/V per KV head, shared by 4 query heads -> 0.5 MB per pair -> 32 pairs.
  check(fwd_pairs_per_section<E, 128, 128>(f, true, grid) == 32, "fwd section size");
  check(fwd_pairs_per_section<E, 128, 128>(f, false, grid) == 0, "fwd sections without a mask");
  FwdParams short_f = bwd_params(256, 8, 2, 0).fwd;
  check(fwd_pairs_per_section<E, 128, 128>(short_f, true, grid) == 0, "fwd sections below the floor");

  std::printf("%d failures\n", failures);
  return failures != 0;
}
"""


def test_band_block_order_on_the_host(tmp_path, run_host_program):
    stub = tmp_path / "stub" / "cute"
    stub.mkdir(parents=True)
    (stub / "config.hpp").write_text("#pragma once\n#define CUTE_HOST_DEVICE inline\n#define CUTE_DEVICE inline\n")
    run_host_program(PROGRAM, include_dirs=[tmp_path / "stub"])
