// Hopper forward kernel (sm_90a): warp-specialized TMA producer + WGMMA consumers.
//
// Roles (one CTA per (query block, head, batch)):
//   warpgroup 0  producer: setmaxnreg down; one thread issues TMA loads of Q (once) and of K and V
//                (one block each per step) into kStages-deep mbarrier pipelines, last block first.
//   warpgroups 1..kNMmaWarpGroups  consumers: setmaxnreg up; each owns 64 query rows and runs
//                S = Q K^T (WGMMA, both operands in shared memory), mask + online softmax in
//                registers, O += P V (WGMMA, P from registers, V read MN-major); the schedule
//                (intra-warpgroup overlap, ping-pong) lives in hopper/fwd_consumer.h.
// Pipelines (cutlass::PipelineTmaAsync): producer arrival count 1 (the TMA thread, with the
// transaction bytes of one K or V block); consumer arrival count kNMmaThreads (every consumer thread
// releases a stage after its WGMMA on it has completed). Q has its own transaction barrier.
// Epilogue: consumers stage O in shared memory over Q (see FwdTraits::SharedStorage), meet at the
// kEpilogue named barrier and write O with 16-byte predicated stores; the LSE goes out directly.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/empty_tile.h"
#include "common/fragment.h"
#include "common/fwd_params.h"
#include "common/mask.h"
#include "common/seq_info.h"
#include "common/softmax.h"
#include "hopper/fwd_consumer.h"
#include "hopper/fwd_traits.h"
#include "hopper/named_barriers.h"
#include "hopper/wgmma_utils.h"

namespace flashtile::hopper {

using namespace cute;

// Global tensors seen by TMA: (rows, d, heads, batch). Packed (varlen) tensors have batch extent 1 and
// are offset by their cu_seqlens row inside the kernel.
using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;

template <class Traits>
struct FwdKernelParams {
  using Element = typename Traits::Element;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          make_layout(ShapeQKV{}, StrideQKV{})));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, typename Traits::SmemLayoutQ{},
                                      select<0, 2>(typename Traits::TileShapeQK{}), _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(typename Traits::SmemLayoutK{}),
                                      select<1, 2>(typename Traits::TileShapeQK{}), _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(typename Traits::SmemLayoutV{}),
                                      select<2, 1>(typename Traits::TileShapePV{}), _1{}));
  FwdParams fwd;
  ShapeQKV shape_q, shape_k, shape_v;
  TmaQ tma_q;
  TmaK tma_k;
  TmaV tma_v;
};

template <class Traits, bool kIsBand, bool kHasSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(__grid_constant__ FwdKernelParams<Traits> const kp) {
  using Element = typename Traits::Element;
  using MainloopPipeline = typename Traits::MainloopPipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  FwdParams const& params = kp.fwd;
  FtFwdParams const& p = params.abi;

  int const m_block = kIsBand ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  int const bidh = blockIdx.y;
  int const bidb = blockIdx.z;
  SeqInfo const seq(p, bidb);
  if (m_block * kBlockM >= seq.seqlen_q_alloc) { return; }
  int n_block_min, n_block_max;
  kv_block_range<kIsBand>(p, seq, m_block, kBlockM, kBlockN, n_block_min, n_block_max);
  if (m_block * kBlockM >= seq.seqlen_q || n_block_max <= n_block_min) {
    write_empty_tile<Element, kBlockM, Traits::kNThreads>(params, seq, m_block, bidh, bidb);
    return;
  }

  extern __shared__ __align__(1024) char smem_buf[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutVt{});
  Tensor sO = make_tensor(make_smem_ptr(ss.smem_o.data()), typename Traits::SmemLayoutO{});

  int const warp_group_idx = cutlass::canonical_warp_group_idx();
  int const warp_idx = cutlass::canonical_warp_idx_sync();
  bool const lane_predicate = cute::elect_one_sync();
  if (warp_idx == 0 && lane_predicate) {
    ss.barrier_q.init(1);
    cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
  }
  typename MainloopPipeline::Params pipe_params;
  pipe_params.role = warp_group_idx == 0 ? MainloopPipeline::ThreadCategory::Producer
                                         : MainloopPipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kNMmaThreads;
  pipe_params.transaction_bytes = Traits::kTmaBytesK;
  MainloopPipeline pipeline_k(ss.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  pipe_params.transaction_bytes = Traits::kTmaBytesV;
  MainloopPipeline pipeline_v(ss.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group_idx == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp_idx == 0 && lane_predicate) {
      int const bidh_k = bidh / params.h_h_k_ratio;
      Tensor mQ = kp.tma_q.get_tma_tensor(kp.shape_q);
      Tensor mK = kp.tma_k.get_tma_tensor(kp.shape_k);
      Tensor mV = kp.tma_v.get_tma_tensor(kp.shape_v);
      Tensor gQ = local_tile(domain_offset(make_coord(seq.q_row0, _0{}), mQ(_, _, bidh, p.cu_seqlens_q ? 0 : bidb)),
                             select<0, 2>(typename Traits::TileShapeQK{}), make_coord(m_block, _0{}));
      Tensor gK = local_tile(domain_offset(make_coord(seq.k_row0, _0{}), mK(_, _, bidh_k, p.cu_seqlens_k ? 0 : bidb)),
                             select<1, 2>(typename Traits::TileShapeQK{}), make_coord(_, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(seq.k_row0, _0{}), mV(_, _, bidh_k, p.cu_seqlens_k ? 0 : bidb)),
                             select<2, 1>(typename Traits::TileShapePV{}), make_coord(_, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tKgK, tKsK] = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

      ss.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
      copy(kp.tma_q.with(reinterpret_cast<uint64_t&>(ss.barrier_q), 0), tQgQ, tQsQ);
      PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
      for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
        pipeline_k.producer_acquire(write_state);
        copy(kp.tma_k.with(*pipeline_k.producer_get_barrier(write_state), 0), tKgK(_, n_block), tKsK(_, write_state.index()));
        pipeline_v.producer_acquire(write_state);
        copy(kp.tma_v.with(*pipeline_v.producer_get_barrier(write_state), 0), tVgV(_, n_block), tVsV(_, write_state.index()));
        ++write_state;
      }
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
  Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
  clear(tOrO);
  Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapeQK{})));

  BandMask const mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.is_causal ? 0 : p.window_right};
  constexpr int kRowsPerThread = decltype(size<0>(rowcol(tOrO)))::value;
  OnlineSoftmax<kRowsPerThread> softmax(params.scale_log2);

  ss.barrier_q.wait(0);
  PipelineState read_state;
  consumer_mainloop<Traits, kIsBand, kHasSoftcap>(pipeline_k, pipeline_v, read_state, tSrQ, tSrK, tOrV, tOrO, tScS,
                                                  mask, softmax, params.softcap_scale, m_block, n_block_min,
                                                  n_block_max, warp_group_idx);

  // ------------------------------------------------------------------ epilogue
  Tensor out = rowcol(tOrO);
  Tensor lse = make_tensor<float>(Shape<Int<kRowsPerThread>>{});
  softmax.finalize(out, lse, params.scale_ln);
  Tensor rO = convert_fragment<Element>(tOrO);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma_pv);
  auto smem_thr_o = smem_copy_o.get_thread_slice(thread_idx);
  copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));

  float* lse_ptr = p.lse + seq.lse_offset(p, bidb) + bidh * p.lse_head_stride;
  Tensor tOcO = rowcol(thr_mma_pv.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapePV{}))));
  if (get<1>(tOcO(0, 0)) == 0) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRowsPerThread; ++mi) {
      int const row = m_block * kBlockM + get<0>(tOcO(mi, 0));
      if (row < seq.seqlen_q_alloc) { lse_ptr[row] = row < seq.seqlen_q ? lse(mi) : -INFINITY; }
    }
  }
  cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(FwdNamedBarrier::kEpilogue));

  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride),
                          make_shape(seq.seqlen_q_alloc, Int<kHeadDimV>{}), make_stride(p.o_row_stride, _1{}));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0));
  typename Traits::GmemTiledCopyO gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(thread_idx);
  Tensor tOsO = gmem_thr_o.partition_S(sO);
  Tensor tOgO = gmem_thr_o.partition_D(gO);
  Tensor tOrOg = make_tensor<Element>(shape(tOgO));
  copy(gmem_copy_o, tOsO, tOrOg);
  Tensor tOcOg = gmem_thr_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOrOg); ++m) {
    int const row = m_block * kBlockM + get<0>(tOcOg(0, m, 0));
    if (row >= seq.seqlen_q_alloc) { continue; }
    if (row >= seq.seqlen_q) { clear(tOrOg(_, m, _)); }
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOrOg); ++k) {
      if (get<1>(tOcOg(0, m, k)) < p.head_dim_v) { copy(gmem_copy_o, tOrOg(_, m, k), tOgO(_, m, k)); }
    }
  }
}

}  // namespace flashtile::hopper
