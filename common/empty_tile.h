// Output of a query tile whose rows see no key (fully masked, or past seqused_q): zeros in O and
// -inf in the LSE, written by all threads of the CTA with 16-byte stores.
#pragma once

#include <cute/config.hpp>

#include "common/fwd_params.h"
#include "common/seq_info.h"

namespace flashtile {

// `tid` in [0, num_threads): the participating threads (the whole CTA, or the consumer warpgroups).
template <class Element, int kBlockM>
CUTE_DEVICE void write_empty_tile(FwdParams const& params, SeqInfo const& seq, int m_block, int bidh, int bidb,
                                  int tid, int num_threads) {
  FtFwdParams const& p = params.abi;
  Element* o_ptr = static_cast<Element*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride;
  float* lse_ptr = p.lse + seq.lse_offset(p, bidb) + bidh * p.lse_head_stride;
  int const row_begin = m_block * kBlockM;
  int const rows = min(kBlockM, seq.seqlen_q_alloc - row_begin);
  int const vecs_per_row = p.head_dim_v * int(sizeof(Element)) / 16;  // head_dim_v % 8 == 0
  for (int i = tid; i < rows * vecs_per_row; i += num_threads) {
    int const r = i / vecs_per_row, c = i % vecs_per_row;
    reinterpret_cast<uint4*>(o_ptr + (row_begin + r) * p.o_row_stride)[c] = make_uint4(0, 0, 0, 0);
  }
  for (int r = tid; r < rows; r += num_threads) { lse_ptr[row_begin + r] = -INFINITY; }
}

}  // namespace flashtile
