// Band / sequence-length masking of one score tile held in registers.
//
// Contract: `tSrS` is a thread's accumulator fragment and `tScS` the same partition of an identity
// tensor over the (block_m, block_n) tile, so tScS(i) is the (row, col) of tSrS(i) inside the tile.
// Masked scores become -inf; the softmax turns them into exact zeros.
#pragma once

#include <climits>
#include <cstdint>

#include <cute/tensor.hpp>

namespace flashtile {

struct BandMask {
  int seqlen_q, seqlen_k;
  int window_left, window_right;  // negative = unbounded; causal has window_right == 0
  // GQA packing (Hopper forward): row r of a tile holds query r / pack of query head r % pack of the
  // group; a tile spans q_per_tile queries. pack == 1: row r is query r.
  int pack = 1;
  int q_per_tile = 0;

  static constexpr int kUnbounded = 1 << 29;  // a window edge beyond any sequence (no overflow when offset)

  // Whether KV block n_block, seen from query block m_block, has any element the mask removes.
  CUTE_DEVICE bool block_needs_mask(bool is_band, int m_block, int n_block, int block_m,
                                    int block_n) const {
    int const col0 = n_block * block_n;
    if (col0 + block_n > seqlen_k) { return true; }
    if (!is_band) { return false; }
    int const offset = seqlen_k - seqlen_q;
    int const row0 = m_block * block_m;
    if (window_right >= 0 && col0 + block_n - 1 > row0 + offset + window_right) { return true; }
    if (window_left >= 0 && col0 < row0 + block_m - 1 + offset - window_left) { return true; }
    return false;
  }

  // Whether a thread's fragment is a WGMMA accumulator, ((2 cols, 2 rows, N/8), MMA_M = 1, MMA_N),
  // whose column offsets c (mode 1 of the identity tensor) are all 8 j + e with e in {0, 1}: then
  // "c < limit" is "k < paired_limit(limit)" for the element's rank k = 2 j + e among the thread's
  // columns (c = 0, 1, 8, 9, ... -> k = 0, 1, 2, 3, ...).
  template <class Layout>
  static constexpr bool columns_paired() {
    if constexpr (cute::rank(Layout{}) != 3 || cute::rank(cute::get<0>(Layout{})) != 3) {
      return false;
    } else {
      Layout const layout{};
      for (int i = 0; i < int(cute::size(layout)); ++i) {
        if (int(cute::get<1>(layout(i))) % 8 >= 2) { return false; }
      }
      return int(cute::size<0, 0>(layout)) == 2 && int(cute::size<0, 1>(layout)) == 2 &&
             int(cute::size<1>(layout)) == 1;
    }
  }

  CUTE_DEVICE static int paired_limit(int limit) { return (limit >> 3) * 2 + min(limit & 7, 2); }

  // Bits [0, n) set, n clamped to [0, 32] (shl.b32 gives 0 for shifts of 32 or more).
  CUTE_DEVICE static uint32_t low_bits(int n) {
    uint32_t one_shl;
    asm("shl.b32 %0, 1, %1;" : "=r"(one_shl) : "r"(max(n, 0)));
    return one_shl - 1u;
  }

  // apply()'s right edge on a columns_paired fragment: elements of row offset r whose rank is at or
  // past paired_limit(min(col_end, hi + r + 1)) become -inf. Each row's ranks are tested in order as
  // the bits of one mask per 24 of them, which ptxas turns into R2P (up to seven predicates per
  // instruction) rather than a compare per element.
  template <class EngineS, class LayoutS, class LayoutC>
  CUTE_DEVICE static void mask_paired_columns(cute::Tensor<EngineS, LayoutS>& tSrS, LayoutC const& layout,
                                              int col_end, int hi) {
    constexpr int kJ = cute::size<0, 2>(LayoutC{}), kN = cute::size<2>(LayoutC{});
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      int const r = cute::get<0>(layout(2 * rh));
      int const limit = paired_limit(min(col_end, hi + r + 1));
      CUTE_UNROLL
      for (int n = 0; n < kN; ++n) {
        CUTE_UNROLL
        for (int j = 0; j < kJ; ++j) {
          CUTE_UNROLL
          for (int e = 0; e < 2; ++e) {
            int const i = e + 2 * (rh + 2 * (j + kJ * n));
            int const c = cute::get<1>(layout(i));
            int const k = (c >> 3) * 2 + (c & 1);
            uint32_t const bits = low_bits(limit - (k / 24) * 24);
            if (!(bits & (1u << (k % 24)))) { tSrS(i) = -INFINITY; }
          }
        }
      }
    }
  }

  // kTransposed: the tile is S^T, so tScS(i) is (key, query) rather than (query, key).
  // Register-lean form: with the thread's base coordinate in registers and each element's offset
  // (r, c) a compile-time constant, an element is masked iff c >= min(col_end, hi + r + 1) (right
  // edge: sequence end and window_right) or c - r < lo (window_left). The limit depends on r only,
  // so a thread computes one per distinct row and spends a compare and a select per element. Band
  // masks without a left edge on a WGMMA accumulator (columns_paired) go through mask_paired_columns
  // instead, unless the caller passes kPairedOk = false; the sequence-end mask alone (non-band
  // kernels, one block per row at most) keeps the compare.
  template <bool kIsBand, bool kTransposed = false, bool kPairedOk = true, class EngineS, class LayoutS, class EngineC, class LayoutC>
  CUTE_DEVICE void apply(cute::Tensor<EngineS, LayoutS>& tSrS, cute::Tensor<EngineC, LayoutC> const& tScS,
                         int row0, int col0) const {
    constexpr int kR = kTransposed ? 1 : 0, kC = kTransposed ? 0 : 1;
    auto const base = *tScS.data();
    int const col_t = col0 + cute::get<kC>(base);
    int const col_end = seqlen_k - col_t;  // masked: c >= col_end
    constexpr bool kPaired = kPairedOk && !kTransposed && columns_paired<LayoutC>();
    if constexpr (!kIsBand) {
      CUTE_UNROLL
      for (int i = 0; i < cute::size(tSrS); ++i) {
        if (int(cute::get<kC>(tScS.layout()(i))) >= col_end) { tSrS(i) = -INFINITY; }
      }
    } else {
      // col - row - (seqlen_k - seqlen_q) = diag + (c - r) for the element at offset (r, c).
      int const diag = col_t - (row0 + cute::get<kR>(base)) - (seqlen_k - seqlen_q);
      int const hi = window_right >= 0 ? window_right - diag : kUnbounded;  // masked: c - r > hi
      if constexpr (kPaired) {
        if (window_left < 0) {
          mask_paired_columns(tSrS, tScS.layout(), col_end, hi);
          return;
        }
      }
      if (window_left < 0) {
        CUTE_UNROLL
        for (int i = 0; i < cute::size(tSrS); ++i) {
          auto const off = tScS.layout()(i);
          int const r = cute::get<kR>(off), c = cute::get<kC>(off);
          if (c >= min(col_end, hi + r + 1)) { tSrS(i) = -INFINITY; }
        }
      } else {
        int const lo = -window_left - diag;  // masked: c - r < lo
        CUTE_UNROLL
        for (int i = 0; i < cute::size(tSrS); ++i) {
          auto const off = tScS.layout()(i);
          int const r = cute::get<kR>(off), c = cute::get<kC>(off);
          if (c >= min(col_end, hi + r + 1) || c < lo + r) { tSrS(i) = -INFINITY; }
        }
      }
    }
  }

  // apply() for a GQA-packed tile (row r is query q0 + r / pack): the same per-row limits, one
  // division per distinct row of the thread. Rows at or past pack * q_per_tile (padding when pack
  // does not divide the tile) are masked whole: their Q rows hold whatever shared memory held, and
  // must not reach the softmax (nor, through the lazy-rescale vote, their warp's other rows).
  template <bool kIsBand, class EngineS, class LayoutS, class EngineC, class LayoutC>
  CUTE_DEVICE void apply_packed(cute::Tensor<EngineS, LayoutS>& tSrS, cute::Tensor<EngineC, LayoutC> const& tScS,
                                int q0, int col0) const {
    auto const base = *tScS.data();
    int const row_t = cute::get<0>(base);
    int const rows_used = pack * q_per_tile;
    int const col_t = col0 + cute::get<1>(base);
    int const col_end = seqlen_k - col_t;  // masked: c >= col_end
    CUTE_UNROLL
    for (int i = 0; i < cute::size(tSrS); ++i) {
      auto const off = tScS.layout()(i);
      int const r = cute::get<0>(off), c = cute::get<1>(off);
      int limit = row_t + r < rows_used ? col_end : INT_MIN;
      bool below = false;
      if constexpr (kIsBand) {
        int const diag = col_t - (q0 + (row_t + r) / pack) - (seqlen_k - seqlen_q);  // col - query - offset = diag + c
        if (window_right >= 0) { limit = min(limit, window_right - diag + 1); }
        below = window_left >= 0 && c < -window_left - diag;
      }
      if (c >= limit || below) { tSrS(i) = -INFINITY; }
    }
  }
};

}  // namespace flashtile
