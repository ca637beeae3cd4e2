// Launch order of the non-persistent grids whose CTAs differ in length under a band mask: the
// backward's KV blocks (grid: KV blocks x KV heads x batch) and the Ampere-path forward's query blocks
// (grid: query blocks x heads x batch).
//
// Under a causal mask backward KV block n walks the query blocks from its diagonal on (block 0 is the
// longest) and forward query block m the KV blocks up to its diagonal (the last is the longest). The
// hardware dispatches a grid in linear block order, x fastest; walking each (head, batch) pair's
// blocks in turn starts the last pairs' long blocks about one pair's work before the end, and SMs idle
// while they finish. Band masks therefore take the CTAs longest first across a section of (head,
// batch) pairs: all of the section's longest CTAs, then the next, and so on. A section holds as many
// pairs as keep the data their CTAs share (backward: Q, dO and the dq accumulator; forward: K and V)
// within a 16 MB share of L2, rounded down to a power of two so that sections tile the usual
// power-of-two head * batch counts exactly.
// Backward, H100, causal, against the plain order: Hopper +1.5-4% at 4k-8k (d 64 / 128; d 256 with
// 32 MB shares: +2%), within +-1% at 1k-2k, -3% at 512 (short CTAs), so its launcher passes a 2k-key
// floor; Ampere path +2-6% at 2k-8k, +2-3% at 1k, +0-2% at 512 (its CTAs walk longer per step), floor
// 512. 32 MB shares measured the same at 4k-8k and 1-3% slower at 1k; 8 MB lost the 8k gain.
// Deterministic mode keeps the plain order: its dQ turns assume CTAs launched in KV-block order.
// Ampere-path forward, H100, causal, against the plain (per-pair last-first) order: +4-10% at 512-8k
// (d 64 / 128 / 256) and 16k (d 64 / 128); sequences of fewer than 512 queries keep the plain order.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cute/config.hpp>

#include "common/bwd_params.h"
#include "common/fwd_params.h"

namespace flashtile {

// Build-time overrides of the sections' L2 share in MB (measurement; 0 = the plain order); -1 = policy.
#ifndef FLASHTILE_BWD_SECTION_MB
#define FLASHTILE_BWD_SECTION_MB -1
#endif
#ifndef FLASHTILE_FWD_SECTION_MB
#define FLASHTILE_FWD_SECTION_MB -1
#endif
// Build-time overrides of the shortest sequence that takes sections (measurement); -1 = policy.
#ifndef FLASHTILE_BWD_SECTION_MIN_KEYS
#define FLASHTILE_BWD_SECTION_MIN_KEYS -1
#endif
#ifndef FLASHTILE_FWD_SECTION_MIN_QUERIES
#define FLASHTILE_FWD_SECTION_MIN_QUERIES -1
#endif

struct BlockCoord {
  int block, bidh, bidb;
};

// The largest power of two of (head, batch) pairs, at most num_pairs, whose bytes fit share_mb; 0
// (the plain order) for a share of 0.
inline int pairs_in_share(int64_t bytes_per_pair, int num_pairs, int share_mb) {
  if (share_mb <= 0) { return 0; }
  int64_t const fit = (int64_t(share_mb) << 20) / std::max<int64_t>(bytes_per_pair, 1);
  int pairs = 1;
  while (int64_t(pairs) * 2 <= fit && pairs * 2 <= num_pairs) { pairs *= 2; }
  return pairs;
}

// Pairs per section of the backward grid `grid`; 0 = the plain order (x = block, y = head, z =
// batch). A pair's shared bytes: its query heads' Q, dO and fp32 dq accumulator rows. Sequences of
// fewer than min_keys keys keep the plain order.
template <class Element, int kHeadDim, int kHeadDimV>
int bwd_pairs_per_section(BwdParams const& params, bool is_band, dim3 grid, int min_keys) {
  FtFwdParams const& p = params.fwd.abi;
  if (FLASHTILE_BWD_SECTION_MIN_KEYS >= 0) { min_keys = FLASHTILE_BWD_SECTION_MIN_KEYS; }
  if (!is_band || params.abi.deterministic || p.seqlen_k < min_keys) { return 0; }
  int64_t const rows = int64_t(p.seqlen_q) * params.fwd.h_h_k_ratio;
  int64_t const bytes = rows * ((kHeadDim + kHeadDimV) * int64_t(sizeof(Element)) + kHeadDim * int64_t(sizeof(float)));
  return pairs_in_share(bytes, int(grid.y * grid.z), FLASHTILE_BWD_SECTION_MB >= 0 ? FLASHTILE_BWD_SECTION_MB : 16);
}

// Pairs per section of the Ampere-path forward grid `grid` (pairs of query heads: the query heads of
// one KV head share its K / V); 0 = the plain order.
template <class Element, int kHeadDim, int kHeadDimV>
int fwd_pairs_per_section(FwdParams const& params, bool is_band, dim3 grid) {
  constexpr int kMinQueries = FLASHTILE_FWD_SECTION_MIN_QUERIES >= 0 ? FLASHTILE_FWD_SECTION_MIN_QUERIES : 512;
  FtFwdParams const& p = params.abi;
  if (!is_band || p.seqlen_q < kMinQueries) { return 0; }
  int64_t const bytes = int64_t(p.seqlen_k) * (kHeadDim + kHeadDimV) * int64_t(sizeof(Element)) / params.h_h_k_ratio;
  return pairs_in_share(bytes, int(grid.y * grid.z), FLASHTILE_FWD_SECTION_MB >= 0 ? FLASHTILE_FWD_SECTION_MB : 16);
}

// Index idx of num_blocks * num_pairs work items in section order -> (rank, pair): sections of
// pairs_per_section consecutive pairs (the last may hold fewer), and in a section rank by rank, each
// rank over the section's pairs. Also the Hopper forward scheduler's band-mask tile order.
CUTE_HOST_DEVICE void section_order(int idx, int num_blocks, int num_pairs, int pairs_per_section, int& rank, int& pair) {
  int const section_items = pairs_per_section * num_blocks;
  int const section = idx / section_items;
  int const r = idx - section * section_items;
  int const pair0 = section * pairs_per_section;
  int const pairs = min(pairs_per_section, num_pairs - pair0);
  rank = r / pairs;
  pair = pair0 + (r - rank * pairs);
}

// Index idx of num_blocks * num_pairs work items -> (rank, pair) in two parts: the first lead_pairs
// pairs in section order with sections of lead_group pairs, then the rest in sections of
// pairs_per_section (the Hopper forward scheduler's band-mask tile order: small groups while work
// remains, one wide longest-first section for the tail). lead_pairs = 0 is plain section_order.
CUTE_HOST_DEVICE void lead_section_order(int idx, int num_blocks, int num_pairs, int lead_pairs, int lead_group,
                                         int pairs_per_section, int& rank, int& pair) {
  int const lead = lead_pairs * num_blocks;
  if (idx < lead) {
    section_order(idx, num_blocks, lead_pairs, lead_group, rank, pair);
  } else {
    section_order(idx - lead, num_blocks, num_pairs - lead_pairs, pairs_per_section, rank, pair);
    pair += lead_pairs;
  }
}

// The coordinates of this CTA; block is its rank in launch order (0 first: the caller maps it to the
// longest block). pairs_per_section > 0: the section order; <= 0: the plain order. The statement order
// is the measured kernels': with idx computed before the grid dimensions, ptxas scheduled the Ampere-path
// d 64 backward (249 registers) differently and it ran 3-4% slower without a mask (benchmarks/NOTES.md,
// session 56).
CUTE_DEVICE BlockCoord band_block_coord(int pairs_per_section) {
  if (pairs_per_section <= 0) { return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)}; }
  int const num_blocks = gridDim.x, num_heads = gridDim.y, num_pairs = gridDim.y * gridDim.z;
  int const idx = int(blockIdx.x) + num_blocks * (int(blockIdx.y) + num_heads * int(blockIdx.z));
  int block, pair;
  section_order(idx, num_blocks, num_pairs, pairs_per_section, block, pair);
  return {block, pair % num_heads, pair / num_heads};
}

// Rotated backward walks (deterministic mode, non-band masks). Every KV block walks all query blocks;
// walked in the same order, all of a (head, batch)'s KV blocks reach query block j together, and their
// ordered dQ adds there run one after another, each a hand-off (adds landed, semaphore released, seen
// by the next) after the one before: KV block n - 1 starts a step one hand-off after block n, and the
// lags add up along the N KV blocks. Walking from query block n instead (mod the M query blocks), KV
// block n reaches query block j at step (j - n) mod M, one step after block n + 1 did: with the adds
// ordered by step, each waits on an add issued a whole step earlier. That needs N <= M (one KV block
// per query block and step) and all N CTAs resident together (the turns wrap around to CTAs launched
// later), so the launcher rotates only grids of at most half the SMs along x (one CTA per SM; near
// the SM count rotation measured no faster, as the CTAs of a head that start early wait for the rest)
// and not for deterministic = 2 (callers confined to a part of the SMs). Outside deterministic mode
// the walks stay plain (rotated: d 128 within -2.4% to +0.2%, d 256 +0.5% to +3%).

// Turn of KV block n_block at step `step` of its rotated walk (query block (n_block + step) mod
// num_m_blocks): the KV blocks n_block + 1 ... n_block + step (mod num_m_blocks) that exist reached
// that query block at earlier steps. Requires num_n_blocks <= num_m_blocks and step < num_m_blocks.
CUTE_HOST_DEVICE int rotated_dq_turn(int n_block, int step, int num_n_blocks, int num_m_blocks) {
  int const last = n_block + step;
  int const before_wrap = min(last, num_n_blocks - 1) - n_block;  // blocks n_block + 1 ... min(last, N - 1)
  return max(0, before_wrap) + (last >= num_m_blocks ? last - num_m_blocks + 1 : 0);
}

// 1 when the backward kernel of `grid` walks rotated (above), else 0. The kernel keeps the plain walk
// for sequences with more KV blocks than query blocks.
inline int bwd_dq_rotate(BwdParams const& params, bool is_band, dim3 grid, int num_sms) {
  return !is_band && params.abi.deterministic == 1 && 2 * int(grid.x) <= num_sms ? 1 : 0;
}

}  // namespace flashtile
