// The Hopper backward's walks (BwdWalk): a CTA's KV block, head and batch element, and the query
// blocks it visits (bwd_walk, from band_block_coord's coordinates).
#pragma once

#include <cute/config.hpp>

#include "common/block_order.h"
#include "common/bwd_params.h"
#include "common/seq_info.h"

namespace flashtile::hopper {

struct BwdWalk {
  SeqInfo seq;
  int n_block, bidh_k, bidb;
  int m_block_min, m_block_max, m_first;
  int num_m_blocks, num_n_blocks, num_steps;
  bool live;     // the KV block has keys (else the CTA exits at once, and walks nothing)
  bool rotated;  // starts at query block n_block (deterministic mode, common/block_order.h)
};

// The walk of the CTA at grid coordinates cta (band_block_coord). Deterministic mode runs the KV blocks
// in descending order; rotated walks need at most one KV block per query block (non-band:
// m_block_min = 0).
template <bool kIsBand>
CUTE_DEVICE BwdWalk bwd_walk(BwdParams const& params, BlockCoord cta, int block_m, int block_n) {
  FtFwdParams const& p = params.fwd.abi;
  BwdWalk w;
  w.n_block = params.abi.deterministic ? int(gridDim.x) - 1 - cta.block : cta.block;
  w.bidh_k = cta.bidh;
  w.bidb = cta.bidb;
  w.seq = SeqInfo(p, w.bidb);
  w.live = w.n_block * block_n < w.seq.seqlen_k;
  q_block_range<kIsBand>(p, w.seq, w.n_block, block_m, block_n, w.m_block_min, w.m_block_max);
  w.num_m_blocks = max(0, w.m_block_max - w.m_block_min);
  w.num_steps = w.num_m_blocks * params.fwd.h_h_k_ratio;  // of a live walk
  w.num_n_blocks = (w.seq.seqlen_k + block_n - 1) / block_n;
  w.rotated = !kIsBand && params.dq_rotate && w.num_n_blocks <= w.num_m_blocks;
  w.m_first = w.rotated ? w.n_block : w.m_block_min;
  return w;
}

}  // namespace flashtile::hopper
