// Dynamic persistent tile scheduler of the Hopper forward kernel.
//
// The grid has one CTA per SM (or fewer). CTA i starts with tile i; each later tile comes from a
// global atomic counter (tile = gridDim.x + old count), fetched by the producer warp while it still
// has loads of the current tile in flight and handed to the consumers through shared memory (see
// TileHandoff). So a CTA that drew short tiles takes more of them, and the tail is short.
//
// Tile order (tile index -> (m_block, head, batch)):
//   no band mask: the query blocks of one (head, batch) are adjacent, so the CTAs running at one time
//     share the K/V of a few heads in L2.
//   band mask (causal, local): tiles differ in length (causal: m_block + 1 KV blocks), so they go
//     longest first, within sections of `heads_per_section` (head, batch) pairs whose K/V fit in L2
//     together: section by section, and in a section all its heads' last query blocks first, then the
//     blocks before them. Ordering all heads' last blocks first without sections was measured slower
//     at 4k-16k causal (K/V of every head competing for L2).
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

namespace flashtile::hopper {

struct TileCoord {
  int m_block, bidh, bidb;
};

template <bool kIsBand>
struct TileScheduler {
  int num_m_blocks, num_heads, num_batch;
  int heads_per_section;  // band masks only: (head, batch) pairs interleaved longest-first
  int* tile_counter;      // zeroed before the launch; counts tiles handed out past the first wave

  CUTE_HOST_DEVICE int num_tiles() const { return num_m_blocks * num_heads * num_batch; }

  CUTE_DEVICE TileCoord tile(int idx) const {
    if constexpr (!kIsBand) {
      int const m = idx % num_m_blocks;
      idx /= num_m_blocks;
      return {m, idx % num_heads, idx / num_heads};
    } else {
      int const section_tiles = heads_per_section * num_m_blocks;
      int const section = idx / section_tiles;
      int const r = idx - section * section_tiles;
      int const hb0 = section * heads_per_section;
      int const heads = min(heads_per_section, num_heads * num_batch - hb0);  // the last section may be short
      int const m_rank = r / heads;
      int const hb = hb0 + (r - m_rank * heads);
      return {num_m_blocks - 1 - m_rank, hb % num_heads, hb / num_heads};
    }
  }

  // Producer side: the tile after this CTA's current one.
  CUTE_DEVICE int fetch_next() const { return int(gridDim.x) + atomicAdd(tile_counter, 1); }
};

// Hands the next tile's coordinates from the producer warp to the consumer warpgroups through shared
// memory (so the consumers run none of the scheduler's index math), guarded by two named barriers
// (kThreads = consumers + the producer warp):
//   producer: sync(empty) -> write -> arrive(full)     consumers: sync(full) -> read -> arrive(empty)
// m_block < 0 ends the walk. The consumers arrive on `empty` once before their first tile, and skip
// their arrival after reading the end marker, so every barrier phase that is started completes.
template <int kThreads, int kEmptyId, int kFullId>
struct TileHandoff {
  TileCoord* slot;

  static constexpr TileCoord kDone{-1, 0, 0};

  CUTE_DEVICE void consumer_start() const { cutlass::arch::NamedBarrier::arrive(kThreads, kEmptyId); }

  CUTE_DEVICE void producer_publish(TileCoord next, bool lane_leader) const {
    cutlass::arch::NamedBarrier::sync(kThreads, kEmptyId);
    if (lane_leader) { *slot = next; }
    cutlass::arch::NamedBarrier::arrive(kThreads, kFullId);
  }

  CUTE_DEVICE TileCoord consumer_receive() const {
    cutlass::arch::NamedBarrier::sync(kThreads, kFullId);
    TileCoord const next = *slot;
    if (next.m_block >= 0) { cutlass::arch::NamedBarrier::arrive(kThreads, kEmptyId); }
    return next;
  }
};

}  // namespace flashtile::hopper
