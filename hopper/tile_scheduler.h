// Persistent tile scheduler of the Hopper forward kernel.
//
// The grid has one CTA per SM (or fewer). CTA i starts with tile i; each later tile comes from a
// global atomic counter (tile = gridDim.x + old count), fetched by the producer warp while it still
// has loads of the current tile in flight and handed to the consumers through shared memory (see
// TileHandoff). So a CTA that drew short tiles takes more of them, and the tail is short.
// Clusters (kClusterM > 1, no band mask): a tile is a group of kClusterM adjacent query blocks, one per
// CTA of the cluster (all of them load and read the same K/V blocks), and the clusters take the groups
// in a static stride: tiles without a band mask are all equally long, and the CTAs of a cluster must
// agree on each tile without exchanging it.
//
// Tail split (no band mask, hopper_fwd_split_plan): the first num_whole indices are whole tiles; each
// tile after them becomes `splits` consecutive indices, one per part of its KV blocks
// (TileCoord::split), so the tail's parts go to as many CTAs.
// Tile order (tile index -> (m_block, head, batch)):
//   no band mask: the query blocks of one (head, batch) are adjacent, so the CTAs running at one time
//     share the K/V of a few heads in L2.
//   band mask (causal, local): tiles differ in length (causal: m_block + 1 KV blocks), so they go
//     longest first, within sections of `heads_per_section` (head, batch) pairs whose K/V fit in L2
//     together: section by section, and in a section all its heads' last query blocks first, then the
//     blocks before them (common/block_order.h's section_order, shared with the non-persistent
//     grids). Ordering all heads' last blocks first without sections was measured slower at 4k-16k
//     causal (K/V of every head competing for L2). The pairs before the last section may go in
//     smaller groups (`lead_pairs`, `lead_group`: lead_section_order), so that fewer heads' K/V are
//     read at once; the last section's short tiles still fill the tail.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>  // cutlass::PipelineState

#include "common/block_order.h"  // lead_section_order

namespace flashtile::hopper {

struct TileCoord {
  int m_block, bidh, bidb;
  // Tail split: (u << 16) | i for part i of the tail's unit u (the kernel decodes it without a
  // division); -1 for a whole tile.
  int split = -1;
};

// kSplit: the tail-split kernel instance's scheduler (num_whole, splits); the others run every unit whole.
template <bool kIsBand, int kClusterM = 1, bool kSplit = false>
struct TileScheduler {
  static_assert(kClusterM == 1 || !kIsBand, "band-masked tiles differ in length: no static cluster schedule");
  int num_m_blocks, num_heads, num_batch;  // clusters: num_m_blocks is a multiple of kClusterM
  // Band masks only: the first lead_pairs (head, batch) pairs in groups of lead_group, the rest in
  // sections of heads_per_section, each group or section longest-first.
  int heads_per_section, lead_pairs, lead_group;
  int* tile_counter;  // zero at the launch; counts tiles handed out past the first wave, zero again at the end
  // Tail split (no band mask): units before the tail, and parts per tail unit (1: no split); read by
  // kSplit instances only.
  int num_whole, splits;

  CUTE_HOST_DEVICE int num_units() const { return num_m_blocks / kClusterM * num_heads * num_batch; }
  CUTE_HOST_DEVICE int num_tiles() const {
    return kSplit ? num_whole + (num_units() - num_whole) * splits : num_units();
  }

  // This CTA's rank in its cluster (clusters run along x) and its first tile.
  CUTE_DEVICE static int cluster_rank() { return int(blockIdx.x) % kClusterM; }
  CUTE_DEVICE int first() const { return int(blockIdx.x) / kClusterM; }

  CUTE_DEVICE TileCoord tile(int idx) const {
    if constexpr (!kIsBand) {
      int split = -1;
      if (kSplit && idx >= num_whole) {
        int const u = (idx - num_whole) / splits;
        split = u << 16 | (idx - num_whole - u * splits);
        idx = num_whole + u;
      }
      int const groups = num_m_blocks / kClusterM;
      int const m = idx % groups * kClusterM + cluster_rank();
      idx /= groups;
      return {m, idx % num_heads, idx / num_heads, split};
    } else {
      int m_rank, hb;
      lead_section_order(idx, num_m_blocks, num_heads * num_batch, lead_pairs, lead_group, heads_per_section, m_rank, hb);
      return {num_m_blocks - 1 - m_rank, hb % num_heads, hb / num_heads};
    }
  }

  // Producer side: the tile after this CTA's current one `idx`.
  CUTE_DEVICE int fetch_next(int idx) const {
    if constexpr (kClusterM > 1) {
      return idx + int(gridDim.x) / kClusterM;
    } else {
      // Each CTA draws once past the end, so the grid draws num_tiles times in all; the last draw
      // puts the counter back to zero for the next launch on the stream (tile_counter_zeroed).
      int const old = atomicAdd(tile_counter, 1);
      if (old == num_tiles() - 1) { atomicExch(tile_counter, 0); }
      return int(gridDim.x) + old;
    }
  }
};

// Hands tile coordinates from the producer warp to the consumer warpgroups through a two-slot
// mbarrier pipeline in shared memory (so the consumers run none of the scheduler's index math). Each
// consumer warpgroup takes the next tile when it reaches it, without meeting the other one: under
// ping-pong the two run half a turn apart, and a tile boundary must not re-align them.
//   producer (one elected lane): acquire slot -> write -> commit   consumers: wait -> read -> release
// m_block < 0 ends the walk. The slots hold (m_block, bidh, bidb); TileCoord::split, which only kSplit
// instances hand over, has slots of its own (TileSplitSlots, placed last in the kernel's shared
// storage so that no other member moves). With 16-byte TileCoord slots the consumers read each one as
// a vector with the slot index in vector registers rather than uniform ones, and ptxas scheduled the
// non-split d 64 kernel's KV loop differently (same instructions): 2-2.5% more kernel time at 512-1k
// (benchmarks/NOTES.md session 47; shifting the shared storage alone by 16-64 bytes changes nothing).
struct TileHandoffStorage {
  cutlass::arch::ClusterBarrier::ValueType full[2], empty[2];
  int slot[2][3];
};
struct TileSplitSlots {
  int split[2];
};

template <bool kSplit = false>
struct TileHandoff {
  using Barrier = cutlass::arch::ClusterBarrier;
  using State = cutlass::PipelineState<2>;
  using SharedStorage = TileHandoffStorage;

  static constexpr TileCoord kDone{-1, 0, 0, -1};

  SharedStorage& storage;
  TileSplitSlots& split_slots;  // read and written by kSplit instances only

  // One thread, before the CTA-wide barrier that follows the pipelines' initialization.
  CUTE_DEVICE void init(int num_consumer_threads) const {
    for (int i = 0; i < 2; ++i) {
      Barrier::init(&storage.full[i], 1);
      Barrier::init(&storage.empty[i], num_consumer_threads);
    }
  }

  // Both slots start empty (a producer's first wait on each passes at once).
  CUTE_DEVICE static State producer_start_state() { return {0, 1, 0}; }

  CUTE_DEVICE void producer_publish(State& state, TileCoord next, bool lane_leader) const {
    Barrier::wait(&storage.empty[state.index()], state.phase());
    if (lane_leader) {
      int* const slot = storage.slot[state.index()];
      slot[0] = next.m_block, slot[1] = next.bidh, slot[2] = next.bidb;
      if constexpr (kSplit) { split_slots.split[state.index()] = next.split; }
      Barrier::arrive(&storage.full[state.index()]);  // release semantics cover the slot write
    }
    ++state;
  }

  CUTE_DEVICE TileCoord consumer_receive(State& state) const {
    Barrier::wait(&storage.full[state.index()], state.phase());
    int const* const slot = storage.slot[state.index()];
    TileCoord const next{slot[0], slot[1], slot[2], kSplit ? split_slots.split[state.index()] : -1};
    Barrier::arrive(&storage.empty[state.index()]);
    ++state;
    return next;
  }
};

}  // namespace flashtile::hopper
