// Ampere-path forward kernel (FA2-style): one CTA computes one (query block, head, batch) tile.
//
// Data flow per CTA: Q block and the last visible K block are loaded with cp.async; the KV blocks
// are then walked from last to first (so the masked diagonal blocks come first). In each step the V
// load overlaps S = Q K^T (ldmatrix + mma.sync), masking and the online softmax; the next K load
// overlaps O += P V, with P converted in registers. The epilogue normalizes O, stages it through
// shared memory for 16-byte global stores and writes the natural-log LSE.
// Split tiles (Traits::kSplitN, above hdim 128): the two warps of a pair own the same rows, each
// half of S's keys and half of O's columns. They exchange their rows' block maxima through shared
// memory (one pair barrier per block), each stores its half of P, and the PV GEMM reads all of its
// rows' P from shared memory; the row sums are combined once, in the epilogue.
// Synchronization: two __syncthreads per KV block, each after a cp.async wait — the first makes K
// (and V's buffer, P's and the row maxima's) safe to reuse, the second makes V and P visible and
// K's buffer free.
// Register budget (the kernel runs at the 255-register limit): blocks that need a mask run their own
// loop body, so unmasked blocks carry no always-issued selects; whole K/V tiles load unpredicated;
// the ldmatrix addresses and the thread index are read from shared memory where they are needed
// (see the stash below) instead of being held through the loop, and O's global address is formed
// only in the epilogue; the O rescale sits behind the second barrier, in the PV GEMM's basic block,
// where its multiplies issue in the HMMAs' shadow.
#pragma once

#include <cute/tensor.hpp>

#include "ampere/fwd_traits.h"
#include "ampere/mma_utils.h"
#include "common/block_order.h"
#include "common/empty_tile.h"
#include "common/epilogue.h"
#include "common/fragment.h"
#include "common/fwd_params.h"
#include "common/mask.h"
#include "common/seq_info.h"
#include "common/softmax.h"

namespace flashtile::ampere {

using namespace cute;

template <class Traits, bool kIsBand, bool kHasSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(__grid_constant__ FwdParams const params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  FtFwdParams const& p = params.abi;

  // Longest-first order under a band mask (later query blocks see more keys), across (head, batch)
  // pairs where pairs_per_section > 0 (common/block_order.h).
  BlockCoord const cta = band_block_coord(params.pairs_per_section);
  int const m_block = kIsBand ? int(gridDim.x) - 1 - cta.block : cta.block;
  int const bidh = cta.bidh;
  int const bidb = cta.bidb;
  SeqInfo const seq(p, bidb);
  if (m_block * kBlockM >= seq.seqlen_q_alloc) { return; }

  int n_block_min, n_block_max;
  kv_block_range<kIsBand>(p, seq, m_block, kBlockM, kBlockN, n_block_min, n_block_max);
  if (m_block * kBlockM >= seq.seqlen_q || n_block_max <= n_block_min) {
    write_empty_tile<Element, kBlockM>(params, seq, m_block, bidh, bidb, threadIdx.x, Traits::kNThreads);
    return;
  }
  int const bidh_k = bidh / params.h_h_k_ratio;

  // Global tensors of this (batch, head).
  Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q) + seq.q_offset(p, bidb) + bidh * p.q_head_stride),
                          make_shape(seq.seqlen_q, Int<kHeadDim>{}), make_stride(p.q_row_stride, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k) + seq.k_offset(p, bidb) + bidh_k * p.k_head_stride),
                          make_shape(seq.seqlen_k, Int<kHeadDim>{}), make_stride(p.k_row_stride, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v) + seq.v_offset(p, bidb) + bidh_k * p.v_head_stride),
                          make_shape(seq.seqlen_k, Int<kHeadDimV>{}), make_stride(p.v_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));   // (N, D, n)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0));  // (N, Dv, n)

  extern __shared__ char smem_[];
  Element* smem = reinterpret_cast<Element*>(smem_);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sO = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutO{});
  Tensor sK = make_tensor(make_smem_ptr(smem + Traits::kSmemQO), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(sK.data() + cosize(typename Traits::SmemLayoutK{}), typename Traits::SmemLayoutV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});
  Element* const sP_ptr = sV.data().get() + cosize(typename Traits::SmemLayoutV{});
  Tensor sP = make_tensor(make_smem_ptr(sP_ptr), typename Traits::SmemLayoutP{});
  float* const row_stats = reinterpret_cast<float*>(sP_ptr + Traits::kSmemP);  // [kWarpsN][kBlockM]

  int const tidx = threadIdx.x;
  constexpr int kNThreads = Traits::kNThreads;
  Element const* sQ_ptr = smem;
  Element const* sK_ptr = smem + Traits::kSmemQO;
  Element const* sV_ptr = sK_ptr + cosize(typename Traits::SmemLayoutK{});

  // Global -> shared copies of Q and the first K block, with row/column predicates from identity
  // tensors (the main loop's loads derive theirs per block: load_kv).
  typename Traits::GmemTiledCopyQK gmem_copy_qk;
  typename Traits::GmemTiledCopyV gmem_copy_v;
  auto gmem_thr_qk = gmem_copy_qk.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_qk.partition_S(gQ);
  Tensor tQsQ = gmem_thr_qk.partition_D(sQ);
  Tensor tKgK = gmem_thr_qk.partition_S(gK);
  Tensor tKsK = gmem_thr_qk.partition_D(sK);
  Tensor tQcQ = gmem_thr_qk.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKcK = gmem_thr_qk.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tQKp = col_predicate(tQcQ, p.head_dim);

  // MMA partitions and shared -> register copies.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor tOrPs = thr_mma.partition_fragment_A(sP);  // kSplitN: P of the warp's rows, all keys
  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tidx);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tidx);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tidx);

  // Per-thread constants the main loop and the epilogue read from shared memory where they need them
  // instead of holding them in registers through the loop: the ldmatrix bases of Q, K and V^T
  // (LdsmXorSource: one per tile, XOR-folded per k-slice) and the thread index, from which the
  // copies, the mask and the epilogue derive their coordinates (read from here, they are not common
  // subexpressions of values computed before the loop). Word 0: Q | K << 16, word 1: V^T | tid << 16,
  // with kSplitN word 2: P's ldmatrix base | P's store base (StsXorTarget, where kPStoreXor) << 16 (byte
  // offsets within a tile are below 64 KB). Each thread reads only its own words.

  // Tile policy: each step's K / V load right after its barrier, or once the first kLoadAfter k-slices of
  // the GEMM after that barrier are issued (its address arithmetic then issues under their MMAs); the
  // split tiles' P store through StsXorTarget (kPStoreXor) or the store copy's addressing.
  constexpr int kHeadDimMax = kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV;
  constexpr int kLoadAfter = ampere_fwd_load_after(Traits::kTile, kHeadDimMax, kIsBand);
  constexpr bool kPStoreXor = ampere_fwd_p_store_xor(Traits::kTile, kHeadDimMax, kIsBand);
  uint32_t* stash = reinterpret_cast<uint32_t*>(smem_ + Traits::kSmemTiles) + tidx;
  stash[0] = make_ldsm_xor_source(smem_thr_q, typename Traits::SmemLayoutQ{}, sQ_ptr).base |
             make_ldsm_xor_source(smem_thr_k, typename Traits::SmemLayoutK{}, sK_ptr).base << 16;
  stash[kNThreads] = make_ldsm_xor_source(smem_thr_v, typename Traits::SmemLayoutVt{}, sV_ptr).base | uint32_t(tidx) << 16;
  if constexpr (Traits::kSplitN) {
    stash[2 * kNThreads] =
        make_ldsm_xor_source(smem_thr_q, typename Traits::SmemLayoutP{}, sP_ptr).base |
        (kPStoreXor ? make_sts_xor_target(thr_mma, typename Traits::SmemLayoutP{}, sP_ptr).base << 16 : 0u);
  }
  auto stashed_tidx = [&] { return int(stash[kNThreads] >> 16); };

  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDimV>>{});
  clear(acc_o);

  // Causal is the band (window_left, 0); window_left = -1 leaves it unbounded on the left.
  BandMask const mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
  constexpr int kRowsPerThread = decltype(size<0>(rowcol(acc_o)))::value;
  OnlineSoftmax<kRowsPerThread> softmax(params.scale_log2);
  // Row sums reduce-scattered over the quad where a thread holds four rows (OnlineSoftmax::online_lean).
  constexpr bool kQuadSum = kRowsPerThread == 4;

  // Split tiles: P stored by each warp for the pair's PV GEMMs, and the pair's exchanges of per-row
  // values through row_stats[kWarpsN][kBlockM] (w % kWarpsM: the pair's rows; w / kWarpsM: its half).
  auto smem_copy_p_store = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  static_assert(!Traits::kSplitN || kQuadSum);
  // Row r of the thread's fragment rows (rowcol(acc)(r, _)) within the tile, and its pair's barrier.
  auto fragment_row = [&](int t, int r) {
    Tensor c = rowcol(tiled_mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
    return get<0>(c(r, 0));
  };
  auto pair_sync = [&](int t) { named_barrier_sync<64>(1 + t / 32 % Traits::kWarpsM); };
  // The block's row maxima combined with the pair warp's (one lane per quad writes its four rows).
  auto pair_row_max = [&](float (&block_max)[kRowsPerThread]) {
    int const t = stashed_tidx();
    int const half = t / 32 / Traits::kWarpsM;
    if (t % 4 == 0) {
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) { row_stats[half * kBlockM + fragment_row(t, r)] = block_max[r]; }
    }
    pair_sync(t);
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      block_max[r] = fmaxf(block_max[r], row_stats[(1 - half) * kBlockM + fragment_row(t, r)]);
    }
  };

  // K/V tile of KV block n: whole tiles unpredicated, else predicated at the sequence end and past the
  // actual head dim. t: the thread index, read (from the stash) before the barrier preceding the load.
  bool const full_qk_cols = p.head_dim == kHeadDim;
  bool const full_v_cols = p.head_dim_v == kHeadDimV;
  auto load_kv = [&](auto const& tiled_copy, auto const& gX, auto& sX, int n, bool full_cols, int cols, int t) {
    using Tile = Shape<Int<kBlockN>, decltype(size<1>(sX))>;
    auto thr = tiled_copy.get_thread_slice(t);
    Tensor src = thr.partition_S(gX(_, _, n));
    Tensor dst = thr.partition_D(sX);
    int const rows = seq.seqlen_k - n * kBlockN;
    if (full_cols && rows >= kBlockN) {
      copy(tiled_copy, src, dst);
    } else {
      Tensor coord = thr.partition_S(make_identity_tensor(Tile{}));
      copy_tile(tiled_copy, src, dst, coord, col_predicate(coord, cols), rows);
    }
  };

  // Prologue: Q and the last visible K block.
  int n_block = n_block_max - 1;
  copy_tile(gmem_copy_qk, tQgQ, tQsQ, tQcQ, tQKp, seq.seqlen_q - m_block * kBlockM);
  copy_tile(gmem_copy_qk, tKgK(_, _, _, n_block), tKsK, tKcK, tQKp, seq.seqlen_k - n_block * kBlockN);
  cp_async_fence();

  // One KV block; kMask: whether it needs the mask.
  auto kv_step = [&](int n, auto mask_tag) {
    constexpr bool kMask = decltype(mask_tag)::value;
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    uint32_t const bases_qk = stash[0];
    auto const src_q = ldsm_xor_source_with_base(smem_thr_q, typename Traits::SmemLayoutQ{}, sQ_ptr, bases_qk & 0xffffu);
    auto const src_k = ldsm_xor_source_with_base(smem_thr_k, typename Traits::SmemLayoutK{}, sK_ptr, bases_qk >> 16);
    int const t_v = stashed_tidx();
    cp_async_wait<0>();
    __syncthreads();  // K[n] visible; every thread is done with V[n+1]
    // Each load written out twice (here and as the GEMM's hook): called through the hook's lambda, the
    // default placement's SASS changed.
    if constexpr (kLoadAfter == 0) {
      load_kv(gmem_copy_v, gV, sV, n, full_v_cols, p.head_dim_v, t_v);
      cp_async_fence();
    }
    gemm_ss<kLoadAfter - 1>(acc_s, tSrQ, tSrK, src_q, src_k, tiled_mma, smem_copy_q, smem_copy_k, smem_thr_q,
                            smem_thr_k, [&] {
                              load_kv(gmem_copy_v, gV, sV, n, full_v_cols, p.head_dim_v, t_v);
                              cp_async_fence();
                            });
    if constexpr (kHasSoftcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) { acc_s(i) = tanhf(acc_s(i) * params.softcap_scale); }
    }
    if constexpr (kMask) {
      Tensor tScS = tiled_mma.get_thread_slice(stashed_tidx()).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
      apply_mask<kIsBand>(acc_s, tScS, mask, m_block * kBlockM, n * kBlockN);
    }
    Tensor scores = rowcol(acc_s);
    auto const src_vt = ldsm_xor_source_with_base(smem_thr_v, typename Traits::SmemLayoutVt{}, sV_ptr, stash[kNThreads] & 0xffffu);
    // The first block is the last visible one: a uniform test on the block index, no loop-carried flag.
    auto online = [&](auto is_first) {
      if constexpr (Traits::kSplitN) {
        float block_max[kRowsPerThread];
        softmax.quad_row_max(scores, block_max);
        pair_row_max(block_max);
        softmax.template online_lean_from_max<decltype(is_first)::value, kQuadSum>(scores, block_max);
      } else {
        softmax.template online_lean<decltype(is_first)::value, kQuadSum>(scores);
      }
    };
    if (n == n_block_max - 1) {
      online(true_type{});
    } else {
      online(false_type{});
    }
    // P to the input type right away: the 16-bit fragment, not the fp32 one, stays live across the
    // wait and the next K load. Four-wide conversions per 16x8 atom: converting the whole fragment at
    // once spilled 24-56 B in the d 64 band instances.
    Tensor tOrP = make_tensor<Element>(acc_s.layout());
    CUTE_UNROLL
    for (int m = 0; m < size<1>(acc_s); ++m) { convert_rows(acc_s, tOrP, m); }
    if constexpr (Traits::kSplitN) {
      if constexpr (kPStoreXor) {
        sts_xor_target_with_base(thr_mma, typename Traits::SmemLayoutP{}, sP_ptr, stash[2 * kNThreads] >> 16)
            .store(tOrP);
      } else {
        auto thr_store = smem_copy_p_store.get_thread_slice(stashed_tidx());
        copy(smem_copy_p_store, thr_store.retile_S(tOrP), thr_store.partition_D(sP));
      }
    }
    int const t_k = stashed_tidx();
    cp_async_wait<0>();
    __syncthreads();  // V[n] visible; every thread is done with K[n]
    auto load_k = [&] {
      if (n > n_block_min) {
        load_kv(gmem_copy_qk, gK, sK, n - 1, full_qk_cols, p.head_dim, t_k);
        cp_async_fence();
      }
    };
    if constexpr (kLoadAfter == 0) {
      if (n > n_block_min) {
        load_kv(gmem_copy_qk, gK, sK, n - 1, full_qk_cols, p.head_dim, t_k);
        cp_async_fence();
      }
    }
    Tensor out = rowcol(acc_o);
    softmax.rescale_o_always(out);
    if constexpr (Traits::kSplitN) {
      // All of the rows' P (both warps' keys): one ldmatrix pass, then the same register-A GEMM.
      auto const src_p =
          ldsm_xor_source_with_base(smem_thr_q, typename Traits::SmemLayoutP{}, sP_ptr,
                                    kPStoreXor ? stash[2 * kNThreads] & 0xffffu : stash[2 * kNThreads]);
      Tensor tOrPs_view = smem_thr_q.retile_D(tOrPs);
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOrPs); ++k) { copy_k_slice(smem_copy_q, src_p, tOrPs_view, k); }
      gemm_rs<2, kLoadAfter - 1>(acc_o, tOrPs, tOrVt, src_vt, tiled_mma, smem_copy_v, smem_thr_v, load_k);
    } else {
      Tensor tOrP_a = make_tensor(tOrP.data(), acc_to_a_layout(tOrP.layout()));
      gemm_rs<2, kLoadAfter - 1>(acc_o, tOrP_a, tOrVt, src_vt, tiled_mma, smem_copy_v, smem_thr_v, load_k);
    }
  };

  for (; n_block >= n_block_min; --n_block) {
    if (mask.block_needs_mask(kIsBand, m_block, n_block, kBlockM, kBlockN)) {
      kv_step(n_block, true_type{});
    } else {
      kv_step(n_block, false_type{});
    }
  }

  // Epilogue: normalize, LSE, O through shared memory (Q's region: no thread reads sQ any more).
  if constexpr (Traits::kSplitN) {
    // Each warp summed its half of the keys; lane l holds row l % 4's (kQuadSum). The last block's
    // second __syncthreads ordered every read of row_stats before these writes.
    int const t = stashed_tidx();
    int const half = t / 32 / Traits::kWarpsM;
    int const row = fragment_row(t, t % 4);
    row_stats[half * kBlockM + row] = softmax.row_sum(0);
    pair_sync(t);
    softmax.row_sum(0) += row_stats[(1 - half) * kBlockM + row];
  }
  Tensor out = rowcol(acc_o);
  Tensor lse = make_tensor<float>(Shape<Int<kRowsPerThread>>{});
  softmax.template finalize_lean<kQuadSum>(out, lse, params.scale_ln);

  int const tidx_e = stashed_tidx();
  Tensor rO = convert_fragment<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tidx_e);
  Tensor taccOrO = smem_thr_o.retile_S(rO);
  Tensor taccOsO = smem_thr_o.partition_D(sO);
  copy(smem_copy_o, taccOrO, taccOsO);

  Tensor tOcO = rowcol(tiled_mma.get_thread_slice(tidx_e).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{})));
  write_lse(p.lse + seq.lse_offset(p, bidb) + bidh * p.lse_head_stride, lse, tOcO, m_block * kBlockM, seq);
  __syncthreads();

  // O's global tensor formed here, not held through the walk (held, its address spilled in sm_80 code).
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride),
                          make_shape(seq.seqlen_q_alloc, Int<kHeadDimV>{}), make_stride(p.o_row_stride, _1{}));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0));
  typename Traits::GmemTiledCopyO gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(tidx_e);
  Tensor tOsO = gmem_thr_o.partition_S(sO);
  Tensor tOgO = gmem_thr_o.partition_D(gO);
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(gmem_copy_o, tOsO, tOrO);
  Tensor tOcOg = gmem_thr_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  store_o_tile(gmem_copy_o, tOrO, tOgO, tOcOg, m_block * kBlockM, seq, p.head_dim_v);
}

}  // namespace flashtile::ampere
