// Per-(batch) sequence geometry shared by all forward kernels: where a batch element's rows start in
// the (possibly packed) tensors, how many rows are allocated and how many are used, and which KV
// blocks a query block can see under the band mask.
#pragma once

#include <cute/config.hpp>

#include "common/fwd_params.h"

namespace flashtile {

struct SeqInfo {
  int64_t q_row0;      // first row of this batch element in q/out (varlen: cu_seqlens_q[b])
  int64_t k_row0;
  int seqlen_q_alloc;  // rows of out that belong to this element (and must be written)
  int seqlen_q;        // rows that attend (seqused_q overrides)
  int seqlen_k;        // keys that are attended (seqused_k overrides)

  SeqInfo() = default;
  CUTE_DEVICE SeqInfo(FtFwdParams const& p, int bidb) {
    if (p.cu_seqlens_q) {
      q_row0 = p.cu_seqlens_q[bidb];
      seqlen_q_alloc = p.cu_seqlens_q[bidb + 1] - p.cu_seqlens_q[bidb];
    } else {
      q_row0 = 0;
      seqlen_q_alloc = p.seqlen_q;
    }
    if (p.cu_seqlens_k) {
      k_row0 = p.cu_seqlens_k[bidb];
      seqlen_k = p.cu_seqlens_k[bidb + 1] - p.cu_seqlens_k[bidb];
    } else {
      k_row0 = 0;
      seqlen_k = p.seqlen_k;
    }
    seqlen_q = p.seqused_q ? min(p.seqused_q[bidb], seqlen_q_alloc) : seqlen_q_alloc;
    if (p.seqused_k) { seqlen_k = p.seqused_k[bidb]; }
  }

  // Element offsets of this batch element; padded layouts use the batch stride, packed ones the row.
  CUTE_DEVICE int64_t q_offset(FtFwdParams const& p, int bidb) const {
    return p.cu_seqlens_q ? q_row0 * p.q_row_stride : int64_t(bidb) * p.q_batch_stride;
  }
  CUTE_DEVICE int64_t o_offset(FtFwdParams const& p, int bidb) const {
    return p.cu_seqlens_q ? q_row0 * p.o_row_stride : int64_t(bidb) * p.o_batch_stride;
  }
  CUTE_DEVICE int64_t k_offset(FtFwdParams const& p, int bidb) const {
    return p.cu_seqlens_k ? k_row0 * p.k_row_stride : int64_t(bidb) * p.k_batch_stride;
  }
  CUTE_DEVICE int64_t v_offset(FtFwdParams const& p, int bidb) const {
    return p.cu_seqlens_k ? k_row0 * p.v_row_stride : int64_t(bidb) * p.v_batch_stride;
  }
  CUTE_DEVICE int64_t lse_offset(FtFwdParams const& p, int bidb) const {
    return p.cu_seqlens_q ? q_row0 : int64_t(bidb) * p.lse_batch_stride;
  }
  // Offset of a tensor laid out like q (dout, dq, the dq accumulator) or like k (dk, dv).
  CUTE_DEVICE int64_t q_like_offset(FtFwdParams const& p, int bidb, int64_t batch_stride, int64_t row_stride) const {
    return p.cu_seqlens_q ? q_row0 * row_stride : int64_t(bidb) * batch_stride;
  }
  // The backward's fp32 dq accumulator: packed batches are spaced FT_BWD_ACCUM_ROW_PAD rows apart so a
  // tile running past a sequence's end never reaches the next one (see FtBwdParams).
  CUTE_DEVICE int64_t dq_accum_offset(FtFwdParams const& p, int bidb, int64_t batch_stride, int64_t row_stride) const {
    return p.cu_seqlens_q ? (q_row0 + int64_t(FT_BWD_ACCUM_ROW_PAD) * bidb) * row_stride : int64_t(bidb) * batch_stride;
  }
  CUTE_DEVICE int64_t k_like_offset(FtFwdParams const& p, int bidb, int64_t batch_stride, int64_t row_stride) const {
    return p.cu_seqlens_k ? k_row0 * row_stride : int64_t(bidb) * batch_stride;
  }
};

// Under a band with a right edge (window_right >= 0): one past the last KV block that any query
// below q_end (clamped to seqlen_q) sees, i.e. the block of the last such row's last visible column.
CUTE_DEVICE int kv_block_end_right(FtFwdParams const& p, SeqInfo const& s, int q_end, int block_n) {
  int const col_end = min(s.seqlen_q, q_end) + s.seqlen_k - s.seqlen_q + p.window_right;
  return col_end <= 0 ? 0 : (col_end + block_n - 1) / block_n;
}

// KV block range [n_block_min, n_block_max) visible to query block m_block under the bottom-right
// aligned band  i + sk - sq - wl <= j <= i + sk - sq + wr  (negative w = unbounded).
template <bool kIsBand>
CUTE_DEVICE void kv_block_range(FtFwdParams const& p, SeqInfo const& s, int m_block, int block_m,
                                int block_n, int& n_block_min, int& n_block_max) {
  n_block_min = 0;
  n_block_max = (s.seqlen_k + block_n - 1) / block_n;
  if constexpr (kIsBand) {
    // causal: window_right already normalized to 0 (make_fwd_params)
    if (p.window_right >= 0) { n_block_max = min(n_block_max, kv_block_end_right(p, s, (m_block + 1) * block_m, block_n)); }
    if (p.window_left >= 0) {
      int const col_begin = m_block * block_m + s.seqlen_k - s.seqlen_q - p.window_left;
      n_block_min = col_begin <= 0 ? 0 : col_begin / block_n;
    }
  }
}

// The converse, for the backward: query blocks [m_block_min, m_block_max) that see any key of KV block
// n_block. Exactly the m with n_block in kv_block_range(m), so both directions agree on every pair.
template <bool kIsBand>
CUTE_DEVICE void q_block_range(FtFwdParams const& p, SeqInfo const& s, int n_block, int block_m, int block_n,
                               int& m_block_min, int& m_block_max) {
  m_block_min = 0;
  m_block_max = (s.seqlen_q + block_m - 1) / block_m;
  if constexpr (kIsBand) {
    int const offset = s.seqlen_k - s.seqlen_q;
    int const wr = p.window_right;  // causal already normalized to 0 (make_fwd_params)
    if (wr >= 0) {
      // Row i sees the block's first key only if i >= n_block * block_n - offset - wr.
      int const row_begin = n_block * block_n - offset - wr;
      if (row_begin >= s.seqlen_q) { m_block_max = 0; }
      m_block_min = row_begin <= 0 ? 0 : row_begin / block_m;
    }
    if (p.window_left >= 0) {
      // Row i sees the block's last key only if i < (n_block + 1) * block_n - offset + wl.
      int const row_end = (n_block + 1) * block_n - offset + p.window_left;
      m_block_max = min(m_block_max, row_end <= 0 ? 0 : (row_end + block_m - 1) / block_m);
    }
  }
}

// The (query head, query block) of a step of a CTA's walk, query block fastest. Advanced step by step
// rather than derived from the step index: that took two integer divisions per step and thread.
struct BwdStep {
  int bidh, m_block;
  CUTE_DEVICE BwdStep(int bidh_k, int group, int m_block_min) : bidh(bidh_k * group), m_block(m_block_min) {}
  CUTE_DEVICE void advance(int m_block_min, int m_block_max) {
    if (++m_block == m_block_max) {
      m_block = m_block_min;
      ++bidh;
    }
  }
  // A walk that starts at query block m_first (a rotated walk) moves on to the next query head once it
  // is back there.
  CUTE_DEVICE void advance(int m_block_min, int m_block_max, int m_first) {
    if (++m_block == m_block_max) { m_block = m_block_min; }
    if (m_block == m_first) { ++bidh; }
  }
};

}  // namespace flashtile
