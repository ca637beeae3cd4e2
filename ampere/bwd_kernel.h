// Ampere-path backward kernel (mma.sync): one CTA owns block_n keys of one KV head and walks every
// query block of every query head of that head's group that sees those keys.
//
// Per query block: S = Q K^T and dP = dO V^T (ldmatrix + mma.sync), P = exp2(S * scale_log2 - lse_log2)
// (exact probabilities from the forward's LSE), dS = P * (dP - D) (times the tanh derivative under
// softcap). P and dS go to shared memory in the input dtype (P before the dP GEMM, or with dS after it:
// BwdTile::p_late); dV += P^T dO and dK += dS^T Q read them through transposing ldmatrix and
// accumulate in registers for the whole walk; dQ = dS K is added to
// the fp32 dq accumulator with atomics (8-byte vector reductions on sm_90; in n_block order per
// query block in deterministic mode), stored in common/dq_accum_perm.h's order so that each warp-wide
// reduction covers 256 contiguous bytes rather than 32 bytes in each of 8 rows. The dQ GEMM and its
// reductions come after dK, or between dV and dK (BwdTile::dq_first_unmasked / dq_first_band_arch), so
// that the reductions drain while dK computes. D of each step's rows is staged in shared memory with its Q/dO.
// Owning all query heads of a group makes GQA/MQA dK/dV plain register sums: no atomics and no
// expanded K/V.
// d = 256 (BwdTile::sdp_split): S and dP each run on half of the warps over the whole tile (larger
// warp tiles, fewer ldmatrix bytes); the S warps pass P to the dP warps through shared memory and a
// named barrier. dK/dV split the same way (BwdTile::dkv_split): the S warps run dV as soon as their
// own P is stored, while the dP warps form dS and then run dK.
// Q/dO are double-buffered where shared memory allows (tile policy): the load of step s + 1 goes into
// the buffers step s - 1 used, issued right after step s's opening barrier or inside its dQ GEMM
// (BwdTile::qdo_in_dq_arch); one cp.async group per step.
// Synchronization: after each wait for Q/dO (which is also where every thread is done with the
// previous step); after P/dS are written (dkv_split: each half after its own, on named barriers 2 and
// 3); single-buffered, also after the dK/dV GEMMs, before the next Q/dO load overwrites their operands
// (issued then, or inside the dQ GEMM where that runs last: BwdTile::qdo_in_dq_arch).
#pragma once

#include <cute/tensor.hpp>

#include "ampere/bwd_traits.h"
#include "ampere/mma_utils.h"
#include "common/block_order.h"
#include "common/bwd_params.h"
#include "common/epilogue.h"
#include "common/fragment.h"
#include "common/mask.h"
#include "common/seq_info.h"

namespace flashtile::ampere {

using namespace cute;

// Waits until the CTAs of the lower KV blocks have added their dQ contribution to this query block
// (deterministic mode): `expected` of them precede this one.
CUTE_DEVICE void wait_dq_turn(int const* semaphore, int expected) {
  if (threadIdx.x == 0) { wait_dq_semaphore(semaphore, expected); }
  __syncthreads();
}

CUTE_DEVICE void pass_dq_turn(int* semaphore) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) { atomicAdd(semaphore, 1); }
}

template <class Traits, bool kIsBand, bool kHasSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(__grid_constant__ BwdParams const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  // No sm_8x block may have more than sm_80's 163 KB: run_bwd never launches larger tiles there, so
  // their sm_8x code is left empty (their register-bound body only spilled).
  if constexpr (Traits::kSmemBytes > 163 * 1024) { return; }
#endif
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
#if defined(__CUDA_ARCH__)
  constexpr bool kDqFirstBand = __CUDA_ARCH__ >= Traits::kTile.dq_first_band_arch;
#else
  constexpr bool kDqFirstBand = false;
#endif
  constexpr bool kDqFirst = !Traits::kDkvSplit && (FLASHTILE_AMPERE_BWD_DQ_FIRST >= 0
                                                        ? FLASHTILE_AMPERE_BWD_DQ_FIRST == 1
                                                        : kIsBand ? kDqFirstBand : Traits::kTile.dq_first_unmasked);
  // The next step's Q/dO load inside the dQ GEMM (BwdTile::qdo_in_dq_arch), after k-slice kQdoSlice. A
  // single-stage tile needs dQ last: the dK GEMM after it still reads this step's Q.
#if defined(__CUDA_ARCH__)
  constexpr bool kQdoInDq = (Traits::kQStages > 1 || !kDqFirst) && Traits::kBlockN / 16 > 1 &&
                            (FLASHTILE_AMPERE_BWD_QDO_IN_DQ >= 0 ? FLASHTILE_AMPERE_BWD_QDO_IN_DQ == 1
                                                                 : __CUDA_ARCH__ >= Traits::kTile.qdo_in_dq_arch);
#else
  constexpr bool kQdoInDq = false;
#endif
  constexpr int kQdoSlice = Traits::kTile.qdo_slice[kIsBand ? 1 : 0];
  static_assert(!kQdoInDq || kQdoSlice >= 0, "a load inside the dQ GEMM needs a k-slice to follow");
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;

  // Band masks outside deterministic mode run longest first (common/block_order.h).
  BlockCoord const cta = band_block_coord(params.pairs_per_section);
  int const n_block = cta.block;
  int const bidh_k = cta.bidh;
  int const bidb = cta.bidb;
  SeqInfo const seq(p, bidb);
  if (n_block * kBlockN >= seq.seqlen_k) { return; }
  int m_block_min, m_block_max;
  q_block_range<kIsBand>(p, seq, n_block, kBlockM, kBlockN, m_block_min, m_block_max);
  int const num_m_blocks = max(0, m_block_max - m_block_min);
  int const group = params.fwd.h_h_k_ratio;
  int const num_steps = num_m_blocks * group;  // (query head in group, query block), block fastest
  int const tidx = threadIdx.x;

  // This CTA's keys and values, and their gradients.
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k) + seq.k_offset(p, bidb) + bidh_k * p.k_head_stride),
                          make_shape(seq.seqlen_k, Int<kHeadDim>{}), make_stride(p.k_row_stride, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v) + seq.v_offset(p, bidb) + bidh_k * p.v_head_stride),
                          make_shape(seq.seqlen_k, Int<kHeadDimV>{}), make_stride(p.v_row_stride, _1{}));
  Tensor mdK = make_tensor(make_gmem_ptr(static_cast<Element*>(b.dk) + seq.k_like_offset(p, bidb, b.dk_batch_stride, b.dk_row_stride) +
                                         bidh_k * b.dk_head_stride),
                           make_shape(seq.seqlen_k, Int<kHeadDim>{}), make_stride(b.dk_row_stride, _1{}));
  Tensor mdV = make_tensor(make_gmem_ptr(static_cast<Element*>(b.dv) + seq.k_like_offset(p, bidb, b.dv_batch_stride, b.dv_row_stride) +
                                         bidh_k * b.dv_head_stride),
                           make_shape(seq.seqlen_k, Int<kHeadDimV>{}), make_stride(b.dv_row_stride, _1{}));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, 0));
  Tensor gdK = local_tile(mdK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gdV = local_tile(mdV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, 0));

  // Q and dO tiles of a step.
  auto q_tiles = [&](BwdStep const& st) {
    int const bidh = st.bidh, m_block = st.m_block;
    Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q) + seq.q_offset(p, bidb) + bidh * p.q_head_stride),
                            make_shape(seq.seqlen_q, Int<kHeadDim>{}), make_stride(p.q_row_stride, _1{}));
    Tensor mdO = make_tensor(make_gmem_ptr(static_cast<Element const*>(b.dout) +
                                           seq.q_like_offset(p, bidb, b.do_batch_stride, b.do_row_stride) + bidh * b.do_head_stride),
                             make_shape(seq.seqlen_q, Int<kHeadDimV>{}), make_stride(b.do_row_stride, _1{}));
    return cute::make_tuple(local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0)),
                            local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0)));
  };

  extern __shared__ char smem_[];
  Element* smem = reinterpret_cast<Element*>(smem_);
  // [Q x kQStages][dO x kQStages][K][V][P][dS][(D, LSE) x kQStages (fp32)][P passed (fp32, kSdpSplit)];
  // a stage is a whole number of swizzle periods, so a partition of stage 0 plus the stage's offset is
  // the same partition of that stage.
  constexpr int kQStages = Traits::kQStages;
  constexpr int kOffdO = kQStages * Traits::kSmemQ;
  constexpr int kOffK = kOffdO + kQStages * Traits::kSmemdO;
  constexpr int kOffV = kOffK + Traits::kSmemK;
  constexpr int kOffP = kOffV + Traits::kSmemV;
  constexpr int kOffdS = kOffP + Traits::kSmemPdS;
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem + kOffdO), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(smem + kOffK), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem + kOffV), typename Traits::SmemLayoutV{});
  Tensor sP = make_tensor(make_smem_ptr(smem + kOffP), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(smem + kOffdS), typename Traits::SmemLayoutPdS{});
  float* sD = reinterpret_cast<float*>(smem + kOffdS + Traits::kSmemPdS);
  // Register fragments are shaped from swizzle-free transposed views (same shapes, plain offsets).
  Tensor sQtF = make_tensor(sQ.data().get(), get_nonswizzle_portion(typename Traits::SmemLayoutQt{}));
  Tensor sdOtF = make_tensor(sdO.data().get(), get_nonswizzle_portion(typename Traits::SmemLayoutdOt{}));
  Tensor sKtF = make_tensor(sK.data().get(), get_nonswizzle_portion(typename Traits::SmemLayoutKt{}));
  Tensor sPtF = make_tensor(sP.data().get(), get_nonswizzle_portion(typename Traits::SmemLayoutPdSt{}));

  // Global -> shared copies with row/column predicates.
  typename Traits::GmemTiledCopyQK gmem_copy_qk;
  typename Traits::GmemTiledCopyV gmem_copy_v;
  auto gmem_thr_qk = gmem_copy_qk.get_thread_slice(tidx);
  auto gmem_thr_v = gmem_copy_v.get_thread_slice(tidx);
  Tensor tQsQ = gmem_thr_qk.partition_D(sQ);
  Tensor tdOsdO = gmem_thr_v.partition_D(sdO);
  Tensor tQcQ = gmem_thr_qk.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tdOcdO = gmem_thr_v.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  Tensor tKcK = gmem_thr_qk.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tVcV = gmem_thr_v.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  Tensor tQKp = col_predicate(tQcQ, p.head_dim);
  Tensor tVp = col_predicate(tdOcdO, p.head_dim_v);
  bool const full_qk_cols = p.head_dim == kHeadDim;
  bool const full_v_cols = p.head_dim_v == kHeadDimV;
  auto load_q_do = [&](BwdStep const& st, int stage) {
    auto tiles = q_tiles(st);
    int const rows = seq.seqlen_q - st.m_block * kBlockM;
    // D and LSE of the step's rows ride in the same group (zero past seqlen_q; the LSE reader
    // substitutes +inf there): read from shared memory after the GEMMs, they hold no registers
    // during them.
    if (tidx < 2 * kBlockM) {
      int const r = tidx % kBlockM;
      int64_t const row_off = seq.lse_offset(p, bidb) + st.bidh * p.lse_head_stride + st.m_block * kBlockM;
      bool const in = r < rows;
      float const* src = tidx < kBlockM ? b.dsoftmax_sum : b.lse_log2;
      SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>::copy(src[row_off + (in ? r : 0)], sD[stage * 2 * kBlockM + tidx], in);
    }
    Tensor tQsQ_s = at_offset(tQsQ, stage * Traits::kSmemQ);
    Tensor tdOsdO_s = at_offset(tdOsdO, stage * Traits::kSmemdO);
    // Whole tiles load unpredicated: the predicated copy's per-row branches, zero-fill stores and
    // address recomputation cost more instructions than the loads themselves.
    Tensor tQgQ = gmem_thr_qk.partition_S(get<0>(tiles));
    Tensor tdOgdO = gmem_thr_v.partition_S(get<1>(tiles));
    if (rows >= kBlockM && full_qk_cols) {
      copy(gmem_copy_qk, tQgQ, tQsQ_s);
    } else {
      copy_tile(gmem_copy_qk, tQgQ, tQsQ_s, tQcQ, tQKp, rows);
    }
    if (rows >= kBlockM && full_v_cols) {
      copy(gmem_copy_v, tdOgdO, tdOsdO_s);
    } else {
      copy_tile(gmem_copy_v, tdOgdO, tdOsdO_s, tdOcdO, tVp, rows);
    }
  };

  // S = Q K^T and dP = dO V^T. Under kSdpSplit the first kSdpThreads threads compute S and the rest dP,
  // each half over the whole tile with the same partition (thread t + kSdpThreads holds dP where
  // thread t holds S).
  constexpr int kSdpThreads = Traits::kSdpWarps * 32;
  int const sdp_tidx = Traits::kSdpSplit ? tidx % kSdpThreads : tidx;
  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(sdp_tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto copy_sdp_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto thr_sdp_a = copy_sdp_a.get_thread_slice(sdp_tidx);
  auto copy_sdp_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto thr_sdp_b = copy_sdp_b.get_thread_slice(sdp_tidx);
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);
  auto thr_pds = copy_pds.get_thread_slice(sdp_tidx);
  Tensor tPsP = thr_pds.partition_D(sP);
  Tensor tdSsdS = thr_pds.partition_D(sdS);

  // dV += P^T dO and dK += dS^T Q. Under kDkvSplit the S threads accumulate dV and the dP threads dK,
  // each half over the whole tile in acc_dk (the tiles coincide; acc_dv is unused).
  constexpr int kDkvThreads = Traits::kDkvWarps * 32;
  int const dkv_tidx = Traits::kDkvSplit ? tidx % kDkvThreads : tidx;
  bool const dk_half = Traits::kDkvSplit && tidx >= kDkvThreads;
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(dkv_tidx);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtF);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOtF);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sPtF);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtF);
  auto copy_dkv_a = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto thr_dkv_a = copy_dkv_a.get_thread_slice(dkv_tidx);
  auto copy_dkv_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto thr_dkv_b = copy_dkv_b.get_thread_slice(dkv_tidx);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDimV>>{});
  clear(acc_dk);
  clear(acc_dv);

  // dQ = dS K.
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtF);
  auto copy_dq_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
  auto thr_dq_a = copy_dq_a.get_thread_slice(tidx);
  auto copy_dq_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dq);
  auto thr_dq_b = copy_dq_b.get_thread_slice(tidx);

  // ldmatrix sources of the ten operand tiles: with kXorSources one XOR-foldable base each
  // (LdsmXorSource), else the tiled copies' own partitions, which keep one address register per
  // (entry, k-slice) combination the compiler cannot relate, held through the walk (tile policy:
  // BwdTile::ldsm_xor_below_arch). Q/dO (and their transposed views) are of stage 0; a step moves them
  // to its stage with at_offset.
#if defined(__CUDA_ARCH__)
  // The override forces them only on tiles whose policy uses them on some arch.
  constexpr bool kXorSources = FLASHTILE_AMPERE_BWD_XOR >= 0
                                   ? FLASHTILE_AMPERE_BWD_XOR == 1 && Traits::kTile.ldsm_xor_below_arch > 0
                                   : __CUDA_ARCH__ < Traits::kTile.ldsm_xor_below_arch;
#else
  constexpr bool kXorSources = false;
#endif
  auto const src_q = make_ldsm_source<kXorSources>(thr_sdp_a, typename Traits::SmemLayoutQ{}, sQ.data().get());
  auto const src_do = make_ldsm_source<kXorSources>(thr_sdp_a, typename Traits::SmemLayoutdO{}, sdO.data().get());
  auto const src_k = make_ldsm_source<kXorSources>(thr_sdp_b, typename Traits::SmemLayoutK{}, sK.data().get());
  auto const src_v = make_ldsm_source<kXorSources>(thr_sdp_b, typename Traits::SmemLayoutV{}, sV.data().get());
  auto const src_pt = make_ldsm_source<kXorSources>(thr_dkv_a, typename Traits::SmemLayoutPdSt{}, sP.data().get());
  auto const src_dst = make_ldsm_source<kXorSources>(thr_dkv_a, typename Traits::SmemLayoutPdSt{}, sdS.data().get());
  auto const src_dot = make_ldsm_source<kXorSources>(thr_dkv_b, typename Traits::SmemLayoutdOt{}, sdO.data().get());
  auto const src_qt = make_ldsm_source<kXorSources>(thr_dkv_b, typename Traits::SmemLayoutQt{}, sQ.data().get());
  auto const src_ds = make_ldsm_source<kXorSources>(thr_dq_a, typename Traits::SmemLayoutPdS{}, sdS.data().get());
  auto const src_kt = make_ldsm_source<kXorSources>(thr_dq_b, typename Traits::SmemLayoutKt{}, sK.data().get());
  // With kXorSources the code runs at the register limit (sm_80, d <= 128), and the dK/dV GEMMs'
  // sources and the score coordinates held through the walk spilled (4-8 B): that code derives them
  // each step from a re-read thread index instead. Other code uses the ones above, kept as separate
  // variables: held as one tuple (shared with the per-step form), they changed sm_90's allocation
  // (d 128 band + softcap 60 -> 64 B of spills).
  auto step_dkv_sources = [&] {
    if constexpr (kXorSources) {
      int const t = thread_idx_reread_in<0, kMaxBlockThreads>();
      auto const ta = copy_dkv_a.get_thread_slice(t);
      auto const tb = copy_dkv_b.get_thread_slice(t);
      return cute::make_tuple(make_ldsm_xor_source(ta, typename Traits::SmemLayoutPdSt{}, sP.data().get()),
                              make_ldsm_xor_source(ta, typename Traits::SmemLayoutPdSt{}, sdS.data().get()),
                              make_ldsm_xor_source(tb, typename Traits::SmemLayoutdOt{}, sdO.data().get()),
                              make_ldsm_xor_source(tb, typename Traits::SmemLayoutQt{}, sQ.data().get()));
    } else {
      return cute::make_tuple(src_pt, src_dst, src_dot, src_qt);
    }
  };
  // The split tile's sm_8x code derives its score coordinates per step too (held, they spilled 4 B
  // under the band mask); its sm_90 code, measured with them held, keeps them.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr bool kStepCoords = kXorSources || Traits::kSdpSplit;
#else
  constexpr bool kStepCoords = kXorSources;
#endif
  auto step_score_coords = [&] {
    if constexpr (kStepCoords) {
      int const t = thread_idx_reread_in<0, kMaxBlockThreads>();
      return mma_sdp.get_thread_slice(Traits::kSdpSplit ? t % kSdpThreads : t)
          .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    } else {
      return tScS;
    }
  };
  BandMask const mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
  // Softcap, then the band / sequence-end mask where the block needs it, on a step's scores.
  auto prepare_scores = [&](auto& acc, auto const& coords, int m_block) {
    if constexpr (kHasSoftcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) { acc(i) = tanhf(acc(i) * params.fwd.softcap_scale); }
    }
    if (mask.block_needs_mask(kIsBand, m_block, n_block, kBlockM, kBlockN)) {
      apply_mask<kIsBand>(acc, coords, mask, m_block * kBlockM, n_block * kBlockN);
    }
  };

  constexpr int kRowsPerBlock = decltype(size<0, 0>(rowcol(tScS)))::value;  // rows per MMA_M row block

  // Prologue: K, V and the first Q/dO tile.
  if (num_steps > 0) {
    int const rows_k = seq.seqlen_k - n_block * kBlockN;
    Tensor tKsK = gmem_thr_qk.partition_D(sK);
    Tensor tVsV = gmem_thr_v.partition_D(sV);
    copy_tile(gmem_copy_qk, gmem_thr_qk.partition_S(gK), tKsK, tKcK, tQKp, rows_k);
    copy_tile(gmem_copy_v, gmem_thr_v.partition_S(gV), tVsV, tVcV, tVp, rows_k);
    load_q_do(BwdStep(bidh_k, group, m_block_min), 0);
    cp_async_fence();
  }

  // kSdpSplit: a step's P and dS. S threads: S = Q K^T, P (stored, and passed on with its tanh
  // derivative folded in); dP threads: dP = dO V^T, then dS = P (dP - D) once P is passed.
  auto sdp_split_step = [&](int m_block, int q_off, int do_off, float const* stage_d, float const* stage_lse) {
    static_assert(!Traits::kSdpSplit || !kXorSources, "the split tiles use the tiled copies' own ldmatrix sources");
    // P (fp32, times the tanh derivative under softcap) from the S threads to the dP threads, one
    // 16-byte vector per thread and 16x8 atom: [atom][sdp thread], conflict-free on both sides.
    float4* const sPmail = reinterpret_cast<float4*>(sD + kQStages * 2 * kBlockM) + sdp_tidx;
    Tensor acc = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // ((4), MMA_M, MMA_N)
    constexpr int kMmaM = decltype(size<1>(acc))::value;
    constexpr int kMmaN = decltype(size<2>(acc))::value;
    static_assert(decltype(size<0>(acc))::value == 4);
    Tensor const tScS_step = step_score_coords();
    auto row_of = [&](int e, int m, int n) { return get<0>(tScS_step(e, m, n)); };
    clear(acc);
    if (tidx < kSdpThreads) {
      gemm_ss(acc, tSrQ, tSrK, at_offset(src_q, q_off), src_k, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
      prepare_scores(acc, tScS_step, m_block);
      // LSE in the exp2 domain; rows past seqlen_q get +inf, so P = 0 there.
      auto lse_of = [&](int row) { return m_block * kBlockM + row < seq.seqlen_q ? stage_lse[row] : INFINITY; };
      CUTE_UNROLL
      for (int n = 0; n < kMmaN; ++n) {
        CUTE_UNROLL
        for (int m = 0; m < kMmaM; ++m) {
          float pass[4];
          CUTE_UNROLL
          for (int e = 0; e < 4; ++e) {
            float const t = acc(e, m, n);
            float const pr = exp2f(t * params.fwd.scale_log2 - lse_of(row_of(e, m, n)));
            // Under softcap P t' (t' = 1 - t^2; a masked entry, t = -inf, has P = 0 and keeps it).
            pass[e] = kHasSoftcap ? pr * (t == -INFINITY ? 1.f : 1.f - t * t) : pr;
            acc(e, m, n) = pr;
          }
          sPmail[(m + kMmaM * n) * kSdpThreads] = make_float4(pass[0], pass[1], pass[2], pass[3]);
        }
      }
      Tensor rP = make_tensor<Element>(acc.layout());
      CUTE_UNROLL
      for (int m = 0; m < kMmaM; ++m) { convert_rows(acc, rP, m); }
      copy(copy_pds, thr_pds.retile_S(rP), tPsP);
      named_barrier_arrive<Traits::kNThreads>(1);
    } else {
      gemm_ss(acc, tdPrdO, tdPrV, at_offset(src_do, do_off), src_v, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
      named_barrier_sync<Traits::kNThreads>(1);  // P passed
      CUTE_UNROLL
      for (int n = 0; n < kMmaN; ++n) {
        CUTE_UNROLL
        for (int m = 0; m < kMmaM; ++m) {
          float4 const v = sPmail[(m + kMmaM * n) * kSdpThreads];
          float const pr[4] = {v.x, v.y, v.z, v.w};
          CUTE_UNROLL
          for (int e = 0; e < 4; ++e) { acc(e, m, n) = pr[e] * (acc(e, m, n) - stage_d[row_of(e, m, n)]); }
        }
      }
      Tensor rdS = make_tensor<Element>(acc.layout());
      CUTE_UNROLL
      for (int m = 0; m < kMmaM; ++m) { convert_rows(acc, rdS, m); }
      copy(copy_pds, thr_pds.retile_S(rdS), tdSsdS);
    }
  };

  BwdStep st(bidh_k, group, m_block_min);
  for (int step = 0; step < num_steps; ++step) {
    int const bidh = st.bidh, m_block = st.m_block;
    auto next = [&] {
      BwdStep n = st;
      n.advance(m_block_min, m_block_max);
      return n;
    };
    int const q_off = (step % kQStages) * Traits::kSmemQ;
    int const do_off = (step % kQStages) * Traits::kSmemdO;
    float const* const stage_d = sD + (step % kQStages) * 2 * kBlockM;
    float const* const stage_lse = stage_d + kBlockM;
    cp_async_wait<0>();  // this step's group, the only one in flight
    __syncthreads();  // this step's Q/dO/D/LSE (and K/V) visible; every thread is done with the previous step
    // The next step's Q/dO: into the other stage now, or later inside the dQ GEMM (load_next, kQdoInDq;
    // single-stage tiles once every thread is done with this step's Q and dO). Written out here rather
    // than as a call of load_next: that form reordered the measured d 64 / d 128 kernels' ldmatrix.
    if constexpr (kQStages > 1 && !kQdoInDq) {
      if (step + 1 < num_steps) { load_q_do(next(), (step + 1) % kQStages); }
      cp_async_fence();
    }
    auto load_next = [&] {
      if (step + 1 < num_steps) { load_q_do(next(), (step + 1) % kQStages); }
      cp_async_fence();
    };

    if constexpr (Traits::kSdpSplit) {
      sdp_split_step(m_block, q_off, do_off, stage_d, stage_lse);
    } else {
      Tensor const tScS_step = step_score_coords();
      Tensor tScS_rc = rowcol(tScS_step);
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(acc_s, tSrQ, tSrK, at_offset(src_q, q_off), src_k, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
      prepare_scores(acc_s, tScS_step, m_block);
      Tensor scores = rowcol(acc_s);

      // P, dP and dS in groups of kDpRowBlocks row blocks (MMA_M index): the whole tile reads V once in
      // the dP GEMM; one row block at a time bounds the P and dP accumulators live at once (the tile
      // policy's choice; always under softcap, whose tanh values stay live instead of a second fragment
      // for the tanh derivative).
      Tensor acc_p = make_fragment_like(acc_s);
      Tensor probs = rowcol(acc_p);
      Tensor rP = make_tensor<Element>(acc_p.layout());
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor dp = rowcol(acc_dp);
      Tensor rdS = make_tensor<Element>(acc_dp.layout());
      constexpr int kMBlocks = decltype(size<1>(acc_dp))::value;
#if defined(__CUDA_ARCH__)
      constexpr bool kDpWhole = __CUDA_ARCH__ >= Traits::kDpWholeArch && !kHasSoftcap;
#else
      constexpr bool kDpWhole = false;
#endif
      constexpr int kDpRowBlocks = kDpWhole ? kMBlocks : 1;
      // P stored with dS after the dP GEMM, or before it (BwdTile::p_late).
      constexpr bool kPLate = FLASHTILE_AMPERE_BWD_P_LATE >= 0 ? FLASHTILE_AMPERE_BWD_P_LATE == 1 : Traits::kTile.p_late;
      constexpr int kDpRows = kDpRowBlocks * kRowsPerBlock;
      auto store_p = [&](int m) {
        convert_rows(acc_p, rP, m);
        copy(copy_pds, thr_pds.retile_S(rP)(_, m, _), tPsP(_, m, _));
      };
      CUTE_UNROLL
      for (int m0 = 0; m0 < kMBlocks; m0 += kDpRowBlocks) {
        CUTE_UNROLL
        for (int m = m0; m < m0 + kDpRowBlocks; ++m) {
          CUTE_UNROLL
          for (int r = 0; r < kRowsPerBlock; ++r) {
            int const mi = r + m * kRowsPerBlock;
            // LSE in the exp2 domain; rows past seqlen_q get +inf, so P = 0 there.
            int const row = get<0>(tScS_rc(mi, 0));
            float const lse_log2 = m_block * kBlockM + row < seq.seqlen_q ? stage_lse[row] : INFINITY;
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(probs); ++ni) {
              probs(mi, ni) = exp2f(scores(mi, ni) * params.fwd.scale_log2 - lse_log2);
            }
          }
          if constexpr (!kPLate) { store_p(m); }
        }
        CUTE_UNROLL
        for (int m = m0; m < m0 + kDpRowBlocks; ++m) { clear(acc_dp(_, m, _)); }
        gemm_ss_rows<kDpRowBlocks>(acc_dp, m0, tdPrdO, tdPrV, at_offset(src_do, do_off), src_v, mma_sdp, copy_sdp_a,
                                   copy_sdp_b, thr_sdp_a, thr_sdp_b);
        CUTE_UNROLL
        for (int r = 0; r < kDpRows; ++r) {
          int const mi = r + m0 * kRowsPerBlock;
          float const dsum = stage_d[get<0>(tScS_rc(mi, 0))];
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(dp); ++ni) {
            float ds = probs(mi, ni) * (dp(mi, ni) - dsum);
            if constexpr (kHasSoftcap) {
              // d tanh = 1 - t^2; a masked entry (t = -inf) has P = 0 and keeps its +-0 dS.
              float const t = scores(mi, ni);
              ds *= t == -INFINITY ? 1.f : 1.f - t * t;
            }
            dp(mi, ni) = ds;
          }
        }
        if constexpr (kPLate) {
          CUTE_UNROLL
          for (int m = m0; m < m0 + kDpRowBlocks; ++m) { store_p(m); }
        }
        CUTE_UNROLL
        for (int m = m0; m < m0 + kDpRowBlocks; ++m) {
          convert_rows(acc_dp, rdS, m);
          copy(copy_pds, thr_pds.retile_S(rdS)(_, m, _), tdSsdS(_, m, _));
        }
      }
    }
    // Without kDkvSplit every thread waits for all of P and dS; with it each half waits for its own P or
    // dS only (named barrier 2 or 3) and runs its GEMM while the other half finishes.
    if constexpr (!Traits::kDkvSplit) { __syncthreads(); }

    // dQ = dS K, added to the fp32 accumulator.
    auto dq_step = [&](auto hook_at, auto&& hook) {
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      gemm_ss<decltype(hook_at)::value>(acc_dq, tdQrdS, tdQrKt, src_ds, src_kt, mma_dq, copy_dq_a, copy_dq_b, thr_dq_a,
                                        thr_dq_b, hook);
      int* semaphore = nullptr;
      if (b.deterministic) {
        int n_block_lo, n_block_hi;
        kv_block_range<kIsBand>(p, seq, m_block, kBlockM, kBlockN, n_block_lo, n_block_hi);
        int const sem_blocks = (p.seqlen_q + FT_BWD_SEMAPHORE_ROWS - 1) / FT_BWD_SEMAPHORE_ROWS;
        semaphore = b.dq_semaphore + (int64_t(bidb) * p.num_heads + bidh) * sem_blocks + m_block * (kBlockM / FT_BWD_SEMAPHORE_ROWS);
        wait_dq_turn(semaphore, n_block - n_block_lo);
      }
      // Unpredicated adds: the accumulator is padded to whole tiles, and rows past seqlen_q / columns
      // past head_dim add exact zeros (P = 0 there; K's padding columns are zero-filled).
      float* const gdQacc = b.dq_accum + seq.dq_accum_offset(p, bidb, b.dq_accum_batch_stride, b.dq_accum_row_stride) +
                            bidh * b.dq_accum_head_stride + m_block * kBlockM * b.dq_accum_row_stride;
      red_add_fragment_perm<kBlockM, kHeadDim>(acc_dq, mma_dq, gdQacc);
      if (b.deterministic) { pass_dq_turn(semaphore); }
    };
    // dQ, with the next step's Q/dO load inside its GEMM where kQdoInDq puts it.
    auto run_dq = [&] {
      if constexpr (kQdoInDq) {
        dq_step(Int<kQdoSlice>{}, load_next);
      } else {
        dq_step(Int<-1>{}, NoHook{});
      }
    };

    if constexpr (Traits::kDkvSplit) {
      // dV = P^T dO on the S threads, dK = dS^T Q on the dP threads: one call, the operands offset from
      // P^T to dS^T and from dO^T to Q^T (same tile layouts) on the dP threads.
      named_barrier_sync<kDkvThreads>(2 + int(dk_half));
      gemm_ss(acc_dk, tdVrPt, tdVrdOt, at_offset(src_pt, dk_half ? kOffdS - kOffP : 0),
              at_offset(src_dot, dk_half ? q_off - kOffdO : do_off), mma_dkv, copy_dkv_a, copy_dkv_b, thr_dkv_a, thr_dkv_b);
      __syncthreads();  // dS visible to every thread (dQ); every thread is done with this step's Q and dO
    } else {
      auto const [step_pt, step_dst, step_dot, step_qt] = step_dkv_sources();
      gemm_ss(acc_dv, tdVrPt, tdVrdOt, step_pt, at_offset(step_dot, do_off), mma_dkv, copy_dkv_a, copy_dkv_b, thr_dkv_a, thr_dkv_b);
      if constexpr (kDqFirst) { run_dq(); }
      gemm_ss(acc_dk, tdKrdSt, tdKrQt, step_dst, at_offset(step_qt, q_off), mma_dkv, copy_dkv_a, copy_dkv_b, thr_dkv_a, thr_dkv_b);
      if constexpr (kQStages == 1) { __syncthreads(); }  // every thread is done with this step's Q and dO
    }
    if constexpr (kQStages == 1 && !kQdoInDq) { load_next(); }
    if constexpr (!kDqFirst) { run_dq(); }
    st.advance(m_block_min, m_block_max);
  }

  // Epilogue: dK (scaled once here) and dV through shared memory (K's and V's regions) to global.
  auto copy_dkv_store = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_dkv);
  auto thr_dkv_store = copy_dkv_store.get_thread_slice(dkv_tidx);
  if constexpr (Traits::kDkvSplit) {
    float const scale = dk_half ? p.softmax_scale : 1.f;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= scale; }
    Tensor rdKV = convert_fragment<Element>(acc_dk);
    __syncthreads();  // every thread is done reading K (dQ GEMM) and V
    copy(copy_dkv_store, thr_dkv_store.retile_S(rdKV), at_offset(thr_dkv_store.partition_D(sV), dk_half ? kOffK - kOffV : 0));
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= p.softmax_scale; }
    Tensor rdK = convert_fragment<Element>(acc_dk);
    Tensor rdV = convert_fragment<Element>(acc_dv);
    __syncthreads();  // every thread is done reading K (dQ GEMM) and V
    copy(copy_dkv_store, thr_dkv_store.retile_S(rdK), thr_dkv_store.partition_D(sK));
    copy(copy_dkv_store, thr_dkv_store.retile_S(rdV), thr_dkv_store.partition_D(sV));
  }
  __syncthreads();

  int const rows_k = seq.seqlen_k - n_block * kBlockN;
  typename Traits::GmemTiledCopydK gmem_copy_dk;
  auto gmem_thr_dk = gmem_copy_dk.get_thread_slice(tidx);
  store_tile(gmem_copy_dk, gmem_thr_dk.partition_S(sK), gmem_thr_dk.partition_D(gdK),
             gmem_thr_dk.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{})), rows_k, p.head_dim);
  typename Traits::GmemTiledCopydV gmem_copy_dv;
  auto gmem_thr_dv = gmem_copy_dv.get_thread_slice(tidx);
  store_tile(gmem_copy_dv, gmem_thr_dv.partition_S(sV), gmem_thr_dv.partition_D(gdV),
             gmem_thr_dv.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{})), rows_k, p.head_dim_v);
}

}  // namespace flashtile::ampere
