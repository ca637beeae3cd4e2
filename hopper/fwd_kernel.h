// Hopper forward kernel (sm_90a): warp-specialized TMA producer + WGMMA consumers.
//
// Roles (persistent: one CTA per SM takes tiles from the dynamic scheduler of hopper/tile_scheduler.h):
//   warpgroup 0  producer: setmaxnreg down; warp 0 issues (one elected lane) TMA loads of each tile's Q
//                (kQStages-deep: the next tile's Q loads during the current tile where shared memory
//                allows) and of its K and V blocks (last block first) into kStages-deep pipelines,
//                then fetches the next tile and hands its coordinates to the consumers (TileHandoff).
//   warpgroups 1..kNMmaWarpGroups  consumers: setmaxnreg up; each owns 64 query rows and runs
//                S = Q K^T (WGMMA, both operands in shared memory), mask + online softmax in
//                registers, O += P V (WGMMA, P from registers, V read MN-major); the schedule
//                (intra-warpgroup overlap, ping-pong) lives in hopper/fwd_consumer.h.
// Pipelines (cutlass::PipelineTmaAsync, Q, K and V): producer arrival count 1 (the TMA thread, with the
// transaction bytes of one tile); consumer arrival count kNMmaThreads (every consumer thread releases
// a stage after its WGMMA on it has completed; a Q stage after the tile's O, staged over it, has been
// read back).
// Epilogue: consumers stage O in shared memory over the tile's Q stage, meet at the kEpilogue named
// barrier, read O back (all of it into registers for d_v <= 128, else row group by row group), release
// the Q stage and write O with 16-byte predicated stores; the LSE goes out directly.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/empty_tile.h"
#include "common/epilogue.h"
#include "common/fragment.h"
#include "common/fwd_params.h"
#include "common/mask.h"
#include "common/seq_info.h"
#include "common/softmax.h"
#include "hopper/fwd_consumer.h"
#include "hopper/fwd_traits.h"
#include "hopper/gmem_tensors.h"
#include "hopper/named_barriers.h"
#include "hopper/tile_scheduler.h"
#include "hopper/wgmma_utils.h"

namespace flashtile::hopper {

using namespace cute;

template <class Traits>
struct FwdKernelParams {
  using Element = typename Traits::Element;
  using GmemQKV = GmemTensor<Element const>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemQKV{}, take<0, 2>(typename Traits::SmemLayoutQ{}),
                                      select<0, 2>(typename Traits::TileShapeQK{}), _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemQKV{}, take<0, 2>(typename Traits::SmemLayoutK{}),
                                      select<1, 2>(typename Traits::TileShapeQK{}), _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemQKV{}, take<0, 2>(typename Traits::SmemLayoutV{}),
                                      select<2, 1>(typename Traits::TileShapePV{}), _1{}));
  FwdParams fwd;
  int num_m_blocks;
  int heads_per_section;
  ShapeQKV shape_q, shape_k, shape_v;
  TmaQ tma_q;
  TmaK tma_k;
  TmaV tma_v;
};

// Per-tile geometry; `active` is false for tiles whose rows see no key (written as 0 / -inf).
struct TileWork {
  TileCoord coord;
  SeqInfo seq;
  int n_block_min, n_block_max;
  bool in_range, active;
};

template <class Traits, bool kIsBand>
CUTE_DEVICE TileWork make_tile_work(FwdParams const& params, TileCoord const c) {
  SeqInfo const seq(params.abi, c.bidb);
  TileWork w{c, seq, 0, 0, c.m_block * Traits::kBlockM < seq.seqlen_q_alloc, false};
  if (w.in_range) {
    kv_block_range<kIsBand>(params.abi, seq, c.m_block, Traits::kBlockM, Traits::kBlockN, w.n_block_min, w.n_block_max);
    w.active = c.m_block * Traits::kBlockM < seq.seqlen_q && w.n_block_max > w.n_block_min;
  }
  return w;
}

template <class Traits, bool kIsBand, bool kHasSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(__grid_constant__ FwdKernelParams<Traits> const kp) {
  using Element = typename Traits::Element;
  using MainloopPipeline = typename Traits::MainloopPipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  constexpr int kHandoffThreads = Traits::kNMmaThreads + 32;  // consumers + the producer warp
  FwdParams const& params = kp.fwd;
  FtFwdParams const& p = params.abi;
  TileScheduler<kIsBand> const sched{kp.num_m_blocks, p.num_heads, p.batch, kp.heads_per_section, p.tile_counter};

  extern __shared__ __align__(1024) char smem_buf[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutVt{});
  TileHandoff<kHandoffThreads, int(FwdNamedBarrier::kTileEmpty), int(FwdNamedBarrier::kTileFull)> const
      handoff{&ss.next_tile};

  int const warp_group_idx = cutlass::canonical_warp_group_idx();
  int const warp_idx = cutlass::canonical_warp_idx_sync();
  bool const lane_predicate = cute::elect_one_sync();
  if (warp_idx == 0 && lane_predicate) {
    cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
  }
  typename MainloopPipeline::Params pipe_params;
  pipe_params.role = warp_group_idx == 0 ? MainloopPipeline::ThreadCategory::Producer
                                         : MainloopPipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kNMmaThreads;
  typename Traits::PipelineQ::Params pipe_params_q;  // a type of its own when kQStages != kStages
  pipe_params_q.role = warp_group_idx == 0 ? Traits::PipelineQ::ThreadCategory::Producer
                                           : Traits::PipelineQ::ThreadCategory::Consumer;
  pipe_params_q.is_leader = pipe_params.is_leader;
  pipe_params_q.num_consumers = Traits::kNMmaThreads;
  pipe_params_q.transaction_bytes = Traits::kTmaBytesQ;
  typename Traits::PipelineQ pipeline_q(ss.pipeline_q, pipe_params_q, Shape<_1, _1, _1>{});
  pipe_params.transaction_bytes = Traits::kTmaBytesK;
  MainloopPipeline pipeline_k(ss.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  pipe_params.transaction_bytes = Traits::kTmaBytesV;
  MainloopPipeline pipeline_v(ss.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group_idx == 0) {
    // ---------------------------------------------------------------- producer (warp 0)
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp_idx != 0) { return; }
    Tensor mQ = kp.tma_q.get_tma_tensor(kp.shape_q);
    Tensor mK = kp.tma_k.get_tma_tensor(kp.shape_k);
    Tensor mV = kp.tma_v.get_tma_tensor(kp.shape_v);
    PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
    auto q_write_state = cutlass::make_producer_start_state<typename Traits::PipelineQ>();
    auto produce_tile = [&](TileWork const& w) {
      int const bidh_k = w.coord.bidh / params.h_h_k_ratio;
      Tensor gQ = local_tile(domain_offset(make_coord(w.seq.q_row0, _0{}), mQ(_, _, w.coord.bidh, p.cu_seqlens_q ? 0 : w.coord.bidb)),
                             select<0, 2>(typename Traits::TileShapeQK{}), make_coord(w.coord.m_block, _0{}));
      Tensor gK = local_tile(domain_offset(make_coord(w.seq.k_row0, _0{}), mK(_, _, bidh_k, p.cu_seqlens_k ? 0 : w.coord.bidb)),
                             select<1, 2>(typename Traits::TileShapeQK{}), make_coord(_, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(w.seq.k_row0, _0{}), mV(_, _, bidh_k, p.cu_seqlens_k ? 0 : w.coord.bidb)),
                             select<2, 1>(typename Traits::TileShapePV{}), make_coord(_, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tKgK, tKsK] = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

      // The first K block goes out before the Q stage may have to wait for an earlier tile's O.
      int n_block = w.n_block_max - 1;
      pipeline_k.producer_acquire(write_state);
      if (lane_predicate) {
        copy(kp.tma_k.with(*pipeline_k.producer_get_barrier(write_state), 0), tKgK(_, n_block), tKsK(_, write_state.index()));
      }
      pipeline_q.producer_acquire(q_write_state);
      if (lane_predicate) {
        copy(kp.tma_q.with(*pipeline_q.producer_get_barrier(q_write_state), 0), tQgQ, tQsQ(_, q_write_state.index()));
      }
      ++q_write_state;
      pipeline_v.producer_acquire(write_state);
      if (lane_predicate) {
        copy(kp.tma_v.with(*pipeline_v.producer_get_barrier(write_state), 0), tVgV(_, n_block), tVsV(_, write_state.index()));
      }
      ++write_state;
      for (--n_block; n_block >= w.n_block_min; --n_block) {
        pipeline_k.producer_acquire(write_state);
        if (lane_predicate) {
          copy(kp.tma_k.with(*pipeline_k.producer_get_barrier(write_state), 0), tKgK(_, n_block), tKsK(_, write_state.index()));
        }
        pipeline_v.producer_acquire(write_state);
        if (lane_predicate) {
          copy(kp.tma_v.with(*pipeline_v.producer_get_barrier(write_state), 0), tVgV(_, n_block), tVsV(_, write_state.index()));
        }
        ++write_state;
      }
    };
    int const leader_lane = __ffs(__ballot_sync(0xffffffff, lane_predicate)) - 1;
    int const num_tiles = sched.num_tiles();
    for (int idx = blockIdx.x; idx < num_tiles;) {
      // The next index is fetched first so the atomic's latency hides behind this tile's loads.
      int next = 0;
      if (lane_predicate) { next = sched.fetch_next(); }
      TileWork const w = make_tile_work<Traits, kIsBand>(params, sched.tile(idx));
      if (w.active) { produce_tile(w); }
      idx = __shfl_sync(0xffffffff, next, leader_lane);
      handoff.producer_publish(idx < num_tiles ? sched.tile(idx) : handoff.kDone, lane_predicate);
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  int const thread_idx = int(threadIdx.x) - 128;
  typename Traits::TiledMmaQK tiled_mma_qk;  // partitioning only; the mainloop owns the MMA state
  typename Traits::TiledMmaPV tiled_mma_pv;
  auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
  auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
  Tensor tSrQ = thr_mma_qk.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma_qk.partition_fragment_B(sK);
  Tensor tOrV = thr_mma_pv.partition_fragment_B(sVt);
  Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapeQK{})));
  Tensor tOcO = rowcol(thr_mma_pv.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapePV{}))));
  constexpr int kRowsPerThread = decltype(size<0>(tOcO))::value;
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma_pv);
  auto smem_thr_o = smem_copy_o.get_thread_slice(thread_idx);
  typename Traits::GmemTiledCopyO gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(thread_idx);
  Tensor tOcOg = gmem_thr_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));

  PipelineState read_state;
  typename Traits::PipelineStateQ q_read_state;
  handoff.consumer_start();
  // `continue` also goes through the hand-off (the loop's increment).
  for (TileCoord coord = sched.tile(blockIdx.x); coord.m_block >= 0; coord = handoff.consumer_receive()) {
    TileWork const w = make_tile_work<Traits, kIsBand>(params, coord);
    int const m_block = w.coord.m_block, bidh = w.coord.bidh, bidb = w.coord.bidb;
    if (!w.in_range) { continue; }
    if (!w.active) {
      write_empty_tile<Element, kBlockM>(params, w.seq, m_block, bidh, bidb, thread_idx, Traits::kNMmaThreads);
      continue;
    }
    SeqInfo const& seq = w.seq;
    Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
    clear(tOrO);
    BandMask const mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
    OnlineSoftmax<kRowsPerThread> softmax(params.scale_log2);

    int const q_stage = q_read_state.index();
    pipeline_q.consumer_wait(q_read_state);
    consumer_mainloop<Traits, kIsBand, kHasSoftcap>(pipeline_k, pipeline_v, read_state, tSrQ(_, _, _, q_stage), tSrK,
                                                    tOrV, tOrO, tScS,
                                                    mask, softmax, params.softcap_scale, m_block, w.n_block_min,
                                                    w.n_block_max, warp_group_idx);

    // -------------------------------------------------------------- epilogue
    Tensor out = rowcol(tOrO);
    Tensor lse = make_tensor<float>(Shape<Int<kRowsPerThread>>{});
    softmax.finalize(out, lse, params.scale_ln);
    Tensor rO = convert_fragment<Element>(tOrO);
    Tensor sO = make_tensor(make_smem_ptr(ss.smem_q.data() + q_stage * cosize_v<typename Traits::SmemLayoutQ> / Traits::kQStages),
                            typename Traits::SmemLayoutO{});
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));

    write_lse(p.lse + seq.lse_offset(p, bidb) + bidh * p.lse_head_stride, lse, tOcO, m_block * kBlockM, seq);
    cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(FwdNamedBarrier::kEpilogue));

    Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride),
                            make_shape(seq.seqlen_q_alloc, Int<kHeadDimV>{}), make_stride(p.o_row_stride, _1{}));
    Tensor tOgO = gmem_thr_o.partition_D(local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0)));
    Tensor tOsO = gmem_thr_o.partition_S(sO);
    if constexpr (kHeadDimV <= 128) {
      // The whole tile into registers first, so the Q/O stage is free during the global stores.
      Tensor tOrOg = make_tensor<Element>(shape(tOgO));
      copy(gmem_copy_o, tOsO, tOrOg);
      pipeline_q.consumer_release(q_read_state);
      store_o_tile(gmem_copy_o, tOrOg, tOgO, tOcOg, m_block * kBlockM, seq, p.head_dim_v);
    } else {
      store_o_tile_from_smem(gmem_copy_o, tOsO, tOgO, tOcOg, m_block * kBlockM, seq, p.head_dim_v);
      pipeline_q.consumer_release(q_read_state);
    }
    ++q_read_state;
  }
}

}  // namespace flashtile::hopper
