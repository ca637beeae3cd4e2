// Output of a query tile whose rows see no key (fully masked, or past seqused_q): zeros in O and
// -inf in the LSE, written by all threads of the CTA with 16-byte stores.
#pragma once

#include <cute/config.hpp>

#include "common/fwd_params.h"
#include "common/seq_info.h"

namespace flashtile {

// `tid` in [0, num_threads): the participating threads (the whole CTA, or the consumer warpgroups).
// A GQA-packed tile (pack > 1, Hopper forward) covers q_per_tile queries of the `pack` query heads of
// KV head `bidh` (see BandMask); otherwise q_per_tile == kBlockM queries of head `bidh`. row_shift:
// the tile's queries start row_shift rows before m_block * q_per_tile (the Hopper forward's shifted
// band tiles, FwdKernelParams::q_shift); rows before the sequence's first are skipped.
template <class Element, int kBlockM>
CUTE_DEVICE void write_empty_tile(FwdParams const& params, SeqInfo const& seq, int m_block, int bidh, int bidb,
                                  int tid, int num_threads, int pack = 1, int q_per_tile = kBlockM, int row_shift = 0) {
  FtFwdParams const& p = params.abi;
  Element* o_ptr = static_cast<Element*>(p.out) + seq.o_offset(p, bidb) + bidh * pack * p.o_head_stride;
  float* lse_ptr = p.lse + seq.lse_offset(p, bidb) + bidh * pack * p.lse_head_stride;
  int const q_first = m_block * q_per_tile - row_shift;
  int const skip = row_shift > 0 ? max(-q_first, 0) : 0;  // rows before the sequence's first
  int const q_begin = q_first + skip;
  int const rows = (min(q_per_tile, seq.seqlen_q_alloc - q_first) - skip) * pack;
  int const vecs_per_row = p.head_dim_v * int(sizeof(Element)) / 16;  // head_dim_v % 8 == 0
  for (int i = tid; i < rows * vecs_per_row; i += num_threads) {
    int const r = i / vecs_per_row, c = i % vecs_per_row;
    reinterpret_cast<uint4*>(o_ptr + (q_begin + r / pack) * p.o_row_stride + (r % pack) * p.o_head_stride)[c] =
        make_uint4(0, 0, 0, 0);
  }
  for (int r = tid; r < rows; r += num_threads) { lse_ptr[(r % pack) * p.lse_head_stride + q_begin + r / pack] = -INFINITY; }
}

}  // namespace flashtile
