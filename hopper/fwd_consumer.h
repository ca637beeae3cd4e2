// Consumer-warpgroup mainloop pieces of the Hopper forward kernel: they walk the KV blocks of one query
// tile, last block first, and accumulate O in registers; the tile loop lives in hopper/fwd_kernel.h.
//
// Two schedules (FwdTraits::kIntraWGOverlap):
//   serial:  S_j = Q K_j^T; wait; softmax(S_j); O += P_j V_j; wait.
//   overlap: S_j = Q K_j^T and O += P_{j+1} V_{j+1} are issued back to back, so the tensor cores run
//            the PV GEMM while the warpgroup waits for S_j; the softmax of S_j then overlaps nothing
//            of its own warpgroup, but (kPingPong) the other warpgroups' GEMMs.
// Ping-pong (FwdTraits::kPingPong, two or three consumer warpgroups): the warpgroups issue their GEMMs
// in a fixed ring order. Before issuing its GEMMs a warpgroup waits on its own named barrier, and after
// issuing them it arrives on the next one's, so the GEMMs of one warpgroup run while the others
// compute their softmax. Warpgroup 1 is released first by an arrival of the last warpgroup, which
// skips its final arrival, so every barrier phase completes. All warpgroups take the same tiles and so
// the same number of turns: per tile in the serial schedule, over the CTA's whole walk in the overlap
// schedule.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/fragment.h"
#include "common/mask.h"
#include "common/softmax.h"
#include "hopper/named_barriers.h"
#include "hopper/wgmma_utils.h"

namespace flashtile::hopper {

using namespace cute;

// A hook that does nothing (overlap_body's first-block hooks when there is no first block).
struct NoHook {
  CUTE_DEVICE void operator()() const {}
};

template <class Traits>
struct PingPong {
  static constexpr int kN = Traits::kNMmaWarpGroups;
  int warp_group;  // 1-based consumer warpgroup index

  CUTE_DEVICE void start() const {
    if constexpr (Traits::kPingPong) {
      if (warp_group == kN) { arrive(1); }
    }
  }
  CUTE_DEVICE void wait_turn() const {
    if constexpr (Traits::kPingPong) {
      cutlass::arch::NamedBarrier::sync(256, int(FwdNamedBarrier::kWarpGroup1) + warp_group - 1);
    }
  }
  CUTE_DEVICE void pass_turn(bool last) const {
    if constexpr (Traits::kPingPong) {
      if (!(last && warp_group == kN)) { arrive(warp_group % kN + 1); }
    }
  }
  // 256 threads per barrier phase: the waiting warpgroup and the one that passes it the turn.
  CUTE_DEVICE static void arrive(int to_warp_group) {
    cutlass::arch::NamedBarrier::arrive(256, int(FwdNamedBarrier::kWarpGroup1) + to_warp_group - 1);
  }
};

// Scores of one block: softcap, then the band / sequence-end mask where the block needs it.
template <class Traits, bool kIsBand, bool kHasSoftcap, class TensorS, class TensorC>
CUTE_DEVICE void prepare_scores(TensorS& tSrS, TensorC const& tScS, BandMask const& mask, float softcap_scale,
                                int m_block, int n_block) {
  if constexpr (kHasSoftcap) {
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = tanhf(tSrS(i) * softcap_scale); }
  }
  if (mask.pack == 1) {
    if (mask.block_needs_mask(kIsBand, m_block, n_block, Traits::kBlockM, Traits::kBlockN)) {
      mask.template apply<kIsBand, false, Traits::kPairedMask>(tSrS, tScS, m_block * Traits::kBlockM, n_block * Traits::kBlockN);
    }
  } else if (mask.pack * mask.q_per_tile < Traits::kBlockM ||
             mask.block_needs_mask(kIsBand, m_block, n_block, mask.q_per_tile, Traits::kBlockN)) {
    mask.template apply_packed<kIsBand>(tSrS, tScS, m_block * mask.q_per_tile, n_block * Traits::kBlockN);
  }
}

// Serial schedule over one tile: S_j = Q K_j^T; wait; softmax(S_j); O += P_j V_j; wait. Ping-pong turns
// start and end inside the tile.
template <class Traits, bool kIsBand, bool kHasSoftcap, class Pipeline, class PipelineState, class TensorQ,
          class TensorK, class TensorV, class TensorO, class TensorC, class Softmax>
CUTE_DEVICE void serial_mainloop(Pipeline const& pipeline_k, Pipeline const& pipeline_v, PipelineState& read_state,
                                 TensorQ const& tSrQ, TensorK const& tSrK, TensorV const& tOrV, TensorO& tOrO,
                                 TensorC const& tScS, BandMask const& mask, Softmax& softmax, float softcap_scale,
                                 int m_block, int n_block_min, int n_block_max, PingPong<Traits> const& turn) {
  using Element = typename Traits::Element;
  typename Traits::TiledMmaQK tiled_mma_qk;
  typename Traits::TiledMmaPV tiled_mma_pv;
  Tensor out = rowcol(tOrO);
  turn.start();
  for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(typename Traits::TileShapeQK{}));
    bool const first = n_block == n_block_max - 1;
    turn.wait_turn();
    pipeline_k.consumer_wait(read_state);
    wg_gemm<true, -1>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_state.index()), tSrS);
    turn.pass_turn(n_block == n_block_min);
    warpgroup_wait<0>();
    pipeline_k.consumer_release(read_state);
    prepare_scores<Traits, kIsBand, kHasSoftcap>(tSrS, tScS, mask, softcap_scale, m_block, n_block);
    Tensor scores = rowcol(tSrS);
    if (first) {
      softmax.template online<true>(scores);
    } else {
      softmax.template online<false>(scores);
      softmax.rescale_o(out);
    }
    Tensor tOrP = convert_fragment<Element>(tSrS);
    pipeline_v.consumer_wait(read_state);
    wg_gemm<false, 0>(tiled_mma_pv, make_tensor(tOrP.data(), acc_to_a_layout(tOrP.layout())),
                      tOrV(_, _, _, read_state.index()), tOrO);
    pipeline_v.consumer_release(read_state);
    ++read_state;
  }
}

// Overlap schedule, the softmax of a tile's first block (its last KV block) once its S has landed:
// starts the row statistics afresh and leaves P in tOrP for the first PV GEMM.
template <class Traits, bool kIsBand, bool kHasSoftcap, class TensorS, class TensorP, class TensorC, class Softmax>
CUTE_DEVICE void first_block_softmax(TensorS& tSrS, TensorP& tOrP, TensorC const& tScS, BandMask const& mask,
                                     Softmax& softmax, float softcap_scale, int m_block, int n_block) {
  prepare_scores<Traits, kIsBand, kHasSoftcap>(tSrS, tScS, mask, softcap_scale, m_block, n_block);
  Tensor scores = rowcol(tSrS);
  softmax.reset();
  softmax.template online<true>(scores);
  Tensor tOrPn = convert_fragment<typename Traits::Element>(tSrS);
  CUTE_UNROLL
  for (int i = 0; i < size(tOrP); ++i) { tOrP(i) = tOrPn(i); }
}

// Overlap schedule, the steady state of one tile: blocks n_block_max - 2 down to n_block_min, each
// turn issuing S_j = Q K_j^T and O += P_{j+1} V_{j+1} back to back, so the tensor cores run the PV
// GEMM while the warpgroup waits for S_j. On entry tOrP / v_state hold the first block's P and V
// stage (the caller's head ran it), on return the last block's; its PV GEMM is left to the caller
// (the tile's tail turn). on_last_s runs once the tile's last S GEMM has completed (Q is read no more).
// kWithHead (hopper_fwd_head_in_loop): the loop starts at the tile's first block, n_block_max - 1
// (tOrP / v_state are not read on entry), whose turn issues its S GEMM and an empty group for the PV
// GEMM; on_first_turn runs in that turn before the GEMM (Q's wait), on_first_s once the turn is
// passed. The softmax comes restart()ed and O cleared, so the first block's correction is 0 (for a
// positive scale, which the API requires) and it adds to nothing. (An empty group rather than a
// branch around the waits: with the waits in branches ptxas serialized the WGMMAs, C7514.)
template <class Traits, bool kIsBand, bool kHasSoftcap, bool kWithHead = false, class Pipeline, class PipelineState,
          class TensorQ, class TensorK, class TensorV, class TensorO, class TensorP, class TensorC, class Softmax,
          class OnLastS, class OnFirstTurn = NoHook, class OnFirstS = NoHook>
CUTE_DEVICE void overlap_body(Pipeline const& pipeline_k, Pipeline const& pipeline_v, PipelineState& read_state,
                              PipelineState& v_state, TensorQ const& tSrQ, TensorK const& tSrK, TensorV const& tOrV,
                              TensorO& tOrO, TensorP& tOrP, TensorC const& tScS, BandMask const& mask,
                              Softmax& softmax, float softcap_scale, int m_block, int n_block_min, int n_block_max,
                              PingPong<Traits> const& turn, OnLastS const& on_last_s,
                              OnFirstTurn const& on_first_turn = {}, OnFirstS const& on_first_s = {}) {
  using Element = typename Traits::Element;
  typename Traits::TiledMmaQK tiled_mma_qk;
  typename Traits::TiledMmaPV tiled_mma_pv;
  Tensor out = rowcol(tOrO);
  Tensor tOrPa = make_tensor(tOrP.data(), acc_to_a_layout(tOrP.layout()));
  for (int n_block = n_block_max - (kWithHead ? 1 : 2); n_block >= n_block_min; --n_block) {
    bool const first = kWithHead && n_block == n_block_max - 1;
    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(typename Traits::TileShapeQK{}));
    turn.wait_turn();
    if (first) { on_first_turn(); }
    pipeline_k.consumer_wait(read_state);
    wg_gemm<true, -1>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_state.index()), tSrS);
    if (!first) {
      pipeline_v.consumer_wait(v_state);
      wg_gemm<false, -1>(tiled_mma_pv, tOrPa, tOrV(_, _, _, v_state.index()), tOrO);
    } else {
      // An empty group in the PV GEMM's place, so that the waits below are the steady state's.
      warpgroup_arrive();
      warpgroup_commit_batch();
    }
    turn.pass_turn(false);
    if (first) { on_first_s(); }
    warpgroup_wait<1>();  // S_j done; PV may still run
    pipeline_k.consumer_release(read_state);
    if (n_block == n_block_min) { on_last_s(); }
    prepare_scores<Traits, kIsBand, kHasSoftcap>(tSrS, tScS, mask, softcap_scale, m_block, n_block);
    Tensor scores = rowcol(tSrS);
    softmax.template online<false>(scores);
    warpgroup_wait<0>();  // PV done: O and P may be overwritten
    if (!first) { pipeline_v.consumer_release(v_state); }
    softmax.rescale_o(out);
    Tensor tOrPn = convert_fragment<Element>(tSrS);
    CUTE_UNROLL
    for (int i = 0; i < size(tOrP); ++i) { tOrP(i) = tOrPn(i); }
    v_state = read_state;
    ++read_state;
  }
}

}  // namespace flashtile::hopper
