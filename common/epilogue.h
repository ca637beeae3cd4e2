// Epilogue pieces shared by the forward kernels: the LSE of a tile's rows and the predicated global
// stores of an O tile staged in shared memory (read back into registers, or vector by vector).
#pragma once

#include <climits>

#include <cute/tensor.hpp>

#include "common/seq_info.h"

namespace flashtile {

// tOcO: (rows, cols) coordinates of the thread's accumulator rows; the thread holding column 0 of a
// row writes its LSE. Rows past seqused_q are empty (-inf); rows past the allocation, or before its
// first row (q0 < 0: the Hopper forward's shifted band tiles), are skipped.
// GQA-packed tile (Hopper forward, pack > 1): row r of the tile is query q0 + r / pack of head
// h0 + r % pack (lse_ptr: the batch element's LSE of head 0); rows at or past rows_used (pack *
// queries per tile) are padding.
template <class TensorLse, class TensorC>
CUTE_DEVICE void write_lse_packed(float* lse_ptr, int64_t head_stride, TensorLse const& lse, TensorC const& tOcO,
                                  int q0, int h0, int pack, int rows_used, SeqInfo const& seq) {
  if (cute::get<1>(tOcO(0, 0)) != 0) { return; }
  CUTE_UNROLL
  for (int mi = 0; mi < cute::size(lse); ++mi) {
    int const r = cute::get<0>(tOcO(mi, 0));
    int const q = q0 + r / pack;
    if (r < rows_used && unsigned(q) < unsigned(seq.seqlen_q_alloc)) {
      lse_ptr[(h0 + r % pack) * head_stride + q] = q < seq.seqlen_q ? lse(mi) : -INFINITY;
    }
  }
}

// An unpacked tile: row r is query row0 + r (lse_ptr: the batch element's and head's LSE).
template <class TensorLse, class TensorC>
CUTE_DEVICE void write_lse(float* lse_ptr, TensorLse const& lse, TensorC const& tOcO, int row0, SeqInfo const& seq) {
  write_lse_packed(lse_ptr, 0, lse, tOcO, row0, 0, 1, INT_MAX, seq);
}

// Predicated register -> global store of a tile: tR/tD/tC are a 16-byte-vector tiled copy's
// (CPY, CPY_M, CPY_K) partitions of the tile in registers, in global memory and of its identity
// coordinates; only rows < max_row and column groups < max_col are written.
template <class TiledCopy, class TensorR, class TensorD, class TensorC>
CUTE_DEVICE void store_rows(TiledCopy const& tiled_copy, TensorR const& tR, TensorD&& tD, TensorC const& tC,
                            int max_row, int max_col) {
  CUTE_UNROLL
  for (int m = 0; m < cute::size<1>(tR); ++m) {
    if (cute::get<0>(tC(0, m, 0)) >= max_row) { continue; }
    CUTE_UNROLL
    for (int k = 0; k < cute::size<2>(tR); ++k) {
      if (cute::get<1>(tC(0, m, k)) < max_col) { cute::copy(tiled_copy, tR(cute::_, m, k), tD(cute::_, m, k)); }
    }
  }
}

// The O tile of query rows [row0, row0 + block_m): rows past seqused_q are written as 0, rows past
// the batch element's allocation not at all.
template <class TiledCopy, class TensorR, class TensorG, class TensorC>
CUTE_DEVICE void store_o_tile(TiledCopy const& copy_o, TensorR& tOrO, TensorG& tOgO, TensorC const& tOcO, int row0,
                              SeqInfo const& seq, int head_dim_v) {
  CUTE_UNROLL
  for (int m = 0; m < cute::size<1>(tOrO); ++m) {
    if (row0 + cute::get<0>(tOcO(0, m, 0)) >= seq.seqlen_q) { cute::clear(tOrO(cute::_, m, cute::_)); }
  }
  store_rows(copy_o, tOrO, tOgO, tOcO, seq.seqlen_q_alloc - row0, head_dim_v);
}

// The same O tile straight from shared memory, one row group at a time: a fraction of the registers
// of staging the whole tile (for wide tiles whose consumers have none to spare), at the cost of
// holding the shared memory until the stores are issued.
template <class TiledCopy, class TensorS, class TensorG, class TensorC>
CUTE_DEVICE void store_o_tile_from_smem(TiledCopy const& copy_o, TensorS const& tOsO, TensorG& tOgO, TensorC const& tOcO,
                                        int row0, SeqInfo const& seq, int head_dim_v) {
  CUTE_UNROLL
  for (int m = 0; m < cute::size<1>(tOsO); ++m) {
    int const row = row0 + cute::get<0>(tOcO(0, m, 0));
    if (row >= seq.seqlen_q_alloc) { continue; }
    cute::Tensor tR = cute::make_fragment_like(tOsO(cute::_, m, cute::_));
    if (row < seq.seqlen_q) {
      cute::copy(copy_o, tOsO(cute::_, m, cute::_), tR);
    } else {
      cute::clear(tR);
    }
    CUTE_UNROLL
    for (int k = 0; k < cute::size<1>(tR); ++k) {
      if (cute::get<1>(tOcO(0, m, k)) < head_dim_v) { cute::copy(copy_o, tR(cute::_, k), tOgO(cute::_, m, k)); }
    }
  }
}

// A tile staged in shared memory (tS: the copy's partition of it) to global memory through registers.
template <class TiledCopy, class TensorS, class TensorD, class TensorC>
CUTE_DEVICE void store_tile(TiledCopy const& tiled_copy, TensorS const& tS, TensorD&& tD, TensorC const& tC, int max_row,
                            int max_col) {
  cute::Tensor tR = cute::make_fragment_like(tS);
  cute::copy(tiled_copy, tS, tR);
  store_rows(tiled_copy, tR, tD, tC, max_row, max_col);
}

// Rows [r0, r0 + kRows) of an O tile staged in shared memory (smem_o, laid out by SmemLayout: (rows,
// d_v), any swizzle, 1024-byte aligned) to global memory in 16-byte vectors by `tid` of `num_threads`
// threads. Tile row r0 + r is query q0 + (r0 + r) / pack of head h0 + (r0 + r) % pack (o_ptr: row 0
// of the batch element, head 0; pack > 1 for a GQA-packed tile, see write_lse_packed). Rows past
// seqlen_q (seqused_q) are written as 0, rows past seqlen_q_alloc, before row 0 (q0 < 0: a shifted
// tile) or at or past rows_used not at all.
// For tiles that cannot take a TMA store: a rolled loop that holds almost no registers.
template <class SmemLayout, class Element>
CUTE_DEVICE void store_o_rows_packed(Element const* smem_o, Element* o_ptr, int64_t row_stride, int64_t head_stride,
                                     int r0, int q0, int h0, int pack, int rows_used, int seqlen_q,
                                     int seqlen_q_alloc, int head_dim_v, int tid, int num_threads) {
  constexpr int kElemsPerVec = 16 / int(sizeof(Element));
  constexpr int kRows = decltype(cute::size<0>(SmemLayout{}))::value;
  // Offset-swizzled view: shared-memory loads rather than generic ones.
  cute::Tensor sO = cute::as_position_independent_swizzle_tensor(cute::make_tensor(cute::make_smem_ptr(smem_o), SmemLayout{}));
  int const vecs = head_dim_v / kElemsPerVec;  // head_dim_v % 8 == 0
  for (int i = tid; i < kRows * vecs; i += num_threads) {
    int const r = i / vecs, c = (i - r * vecs) * kElemsPerVec;
    int const q = q0 + (r0 + r) / pack;
    if (r0 + r >= rows_used || unsigned(q) >= unsigned(seqlen_q_alloc)) { continue; }
    uint4 const v = q < seqlen_q ? *reinterpret_cast<uint4 const*>(&sO(r, c)) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(o_ptr + q * row_stride + (h0 + (r0 + r) % pack) * head_stride + c) = v;
  }
}

// An unpacked tile: rows [row0, row0 + kRows) of one head (o_ptr: row 0 of the batch element and head).
template <class SmemLayout, class Element>
CUTE_DEVICE void store_o_rows_from_smem(Element const* smem_o, Element* o_ptr, int64_t row_stride, int row0,
                                        int seqlen_q, int seqlen_q_alloc, int head_dim_v, int tid, int num_threads) {
  store_o_rows_packed<SmemLayout>(smem_o, o_ptr, row_stride, 0, 0, row0, 0, 1, INT_MAX, seqlen_q, seqlen_q_alloc,
                                  head_dim_v, tid, num_threads);
}

}  // namespace flashtile
