// Persistent tile scheduler of the Hopper forward kernel: the grid has one CTA per SM (or fewer), and
// CTA i takes tiles i, i + gridDim.x, ... in a fixed order, so the producer can prefetch the next
// tile's K/V while the consumers finish the current one. The query blocks of one (head, batch) are
// adjacent, so the CTAs running at one time share the K/V of a few heads in L2; with a band mask
// (causal, local) each head's blocks go last-first (longest first), and the launcher gives every tile
// its own CTA so the hardware balances the uneven tiles (see fwd_launch.h). Ordering all heads' last
// blocks first was measured slower at 4k-16k causal (K/V of every head competing for L2).
#pragma once

#include <cute/config.hpp>

namespace flashtile::hopper {

struct TileCoord {
  int m_block, bidh, bidb;
};

template <bool kIsBand>
struct TileScheduler {
  int num_m_blocks, num_heads, num_batch;

  CUTE_HOST_DEVICE int num_tiles() const { return num_m_blocks * num_heads * num_batch; }

  CUTE_DEVICE TileCoord tile(int idx) const {
    int const m = idx % num_m_blocks;
    idx /= num_m_blocks;
    return {kIsBand ? num_m_blocks - 1 - m : m, idx % num_heads, idx / num_heads};
  }
};

}  // namespace flashtile::hopper
