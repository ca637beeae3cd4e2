// Hopper backward kernel (sm_90a): warp-specialized TMA producer, dQ writer and WGMMA consumers.
//
// One CTA owns block_n keys of one KV head (grid: KV blocks x KV heads x batch; under band masks the
// longest CTAs start first, see common/block_order.h, except in deterministic mode) and walks every
// query block of every query head of that head's group that sees those keys, so GQA/MQA dK/dV are
// register sums.
// Roles:
//   warpgroup 0, warp 0  producer: K and V once (one transaction barrier), then Q and dO of each step
//                        through two PipelineTmaAsync pipelines (kQStages / kdOStages deep).
//   warpgroup 0, warp 1  dQ writer: per step, waits for the staged fp32 dQ tile (kdQFull), adds it to
//                        the dq accumulator with one TMA reduce-add (under kdQFrag one 1-D bulk
//                        reduction per part; in descending KV-block order behind a semaphore in
//                        deterministic mode) and frees the staging tile (kdQEmpty) once the TMA has
//                        read it. Under kdQPerWg the same per consumer warpgroup's part,
//                        each with its own barrier pair (one warpgroup never waits for the other's dQ),
//                        both parts of a step behind the step's one semaphore turn. After the walk,
//                        once its adds have landed, counts the CTA into dq_done (the postprocess of a
//                        head starts at its full count). Idle under kdQRed.
//   warpgroups 1, 2      consumers: S and dP (transposed under kSwapSdP, see hopper/bwd_traits.h);
//                        P = exp2(S * scale_log2 - lse_log2) from the forward's LSE, dS = P * (dP - D)
//                        (times the tanh derivative under softcap); dV += P^T dO, dK += dS^T Q
//                        (accumulated in registers over the whole walk); dQ = dS K staged for the writer,
//                        or under kdQRed added into the accumulator from registers (8-byte vector
//                        reductions in DqAccumPerm order; the consumers take the deterministic turn).
// Consumer synchronization per step (named barriers over the 256 consumer threads): kPdSFull once dS
// (and P) of the step are in shared memory, since both warpgroups read all of them; without kSwapSdP,
// kPdSEmpty before they are overwritten (kSwapSdP double-buffers dS instead). The Q and dO stages are
// released after the GEMMs that read them have completed.
// kSwapSdP step orders (HopperBwdTile::dq_overlap, dq_lag):
//   neither: S^T, dP^T; P^T; dV issued; dS^T; dK issued; dS stored; kPdSFull; dQ; all done; dQ staged.
//   overlap: S^T, dP^T; P^T, dS^T; dS stored; dV issued; kPdSFull; dQ issued; dV done (dO released);
//            dK issued; dQ done, staged while dK runs; dK done (Q released).
//   lag:     [the previous step's dQ issued;] S^T; [that dQ done, staged while S^T runs;] dP^T; P^T;
//            dV issued; dS^T; dK issued; dS stored; kPdSFull; all done. The last step's dQ follows the
//            walk; the dQ writer sees the same sequence of hand-offs.
//   lag + ping-pong (HopperBwdTile::pingpong): turn 1 [the previous step's dQ,] S^T; [that dQ done,
//            staged;] turn 2 dP^T; P^T; dS^T; dS stored; turn 3 dV, dK; all done. No kPdSFull: the
//            turns order the warpgroups (see kPingPong's comment below).
// Otherwise: S, dP; P, dS; kPdSEmpty; P, dS stored; kPdSFull; dQ, dV, dK issued; dQ done, staged
//   while dV and dK run; dV done (dO released); [d = 256: second dQ pass issued]; dK done (Q
//   released); [second pass done, staged].
// Rows past seqlen_q get lse_log2 = +inf (P = 0); columns past seqlen_k and outside the band are
// masked to -inf, so padded rows and columns contribute exact zeros.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/block_order.h"
#include "common/bwd_params.h"
#include "common/dq_accum_perm.h"
#include "common/epilogue.h"
#include "common/fragment.h"
#include "common/grid_dependency.h"
#include "common/mask.h"
#include "common/seq_info.h"
#include "common/special_regs.h"
#include "hopper/bwd_traits.h"
#include "hopper/bwd_walk.h"
#include "hopper/gmem_tensors.h"
#include "hopper/named_barriers.h"
#include "hopper/pipeline_params.h"
#include "hopper/wgmma_utils.h"

namespace flashtile::hopper {

using namespace cute;

// The ring of GEMM turns of the backward's two consumer warpgroups (BwdTraits::kPingPong; the
// forward's PingPong of hopper/fwd_consumer.h is the same ring over its own barrier ids): a warpgroup
// syncs on its own barrier before its turn and arrives on the other's after it; warpgroup 2 opens the
// ring and skips its final arrival, so every barrier phase completes.
struct BwdTurns {
  int wg;  // 0-based consumer warpgroup
  static constexpr int id(int w) { return int(w == 0 ? BwdNamedBarrier::kTurn1 : BwdNamedBarrier::kTurn2); }
  CUTE_DEVICE void start() const {
    if (wg == 1) { cutlass::arch::NamedBarrier::arrive(256, id(0)); }
  }
  CUTE_DEVICE void wait() const { cutlass::arch::NamedBarrier::sync(256, id(wg)); }
  CUTE_DEVICE void pass(bool last) const {
    if (!(last && wg == 1)) { cutlass::arch::NamedBarrier::arrive(256, id(1 - wg)); }
  }
};

template <class Traits>
struct BwdKernelParams {
  using Element = typename Traits::Element;
  using GmemIn = GmemTensor<Element const>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemIn{}, take<0, 2>(typename Traits::SmemLayoutQ{}),
                                      Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, _1{}));
  using TmadO = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemIn{}, take<0, 2>(typename Traits::SmemLayoutdO{}),
                                       Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDimV>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemIn{}, typename Traits::SmemLayoutK{},
                                      Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemIn{}, typename Traits::SmemLayoutV{},
                                      Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDimV>>{}, _1{}));
  using TmadQ = decltype(make_tma_copy(SM90_TMA_REDUCE_ADD{}, GmemTensor<float>{}, typename Traits::SmemLayoutdQPart{},
                                       Shape<Int<Traits::kdQPartRows>, Int<Traits::kdQPartCols>>{}, _1{}));
  BwdParams bwd;
  ShapeQKV shape_q, shape_do, shape_k, shape_v, shape_dq_accum;
  TmaQ tma_q;
  TmadO tma_do;
  TmaK tma_k;
  TmaV tma_v;
  TmadQ tma_dq;
};

// Waits for full completion (not only the shared-memory read) of this thread's bulk async groups.
CUTE_DEVICE void bulk_wait_all_complete() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Adds bytes of contiguous fp32 shared memory into global memory with one 1-D bulk reduction, part of the
// issuing thread's bulk group (as the TMA reduce-adds are).
CUTE_DEVICE void bulk_reduce_add_f32(float* gmem, float const* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem),
               "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
}

static_assert(int(BwdNamedBarrier::kdQTurn) + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount <
              cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers);

template <class Traits, bool kIsBand, bool kHasSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    bwd_kernel(__grid_constant__ BwdKernelParams<Traits> const kp) {
  using Element = typename Traits::Element;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelinedO = typename Traits::PipelinedO;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  constexpr int kNMmaThreads = Traits::kNMmaThreads;
  constexpr int kdQParts = Traits::kdQParts;
  constexpr int kdQSyncThreads = kNMmaThreads / kdQParts + 32;  // a part's consumers + the dQ writer warp
  BwdParams const& params = kp.bwd;
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;

  // Deterministic mode adds each query block's dQ contributions in descending KV-block order, and the
  // grid runs high KV blocks first: under a causal mask KV block n starts at its diagonal, so block
  // n - 1 reaches a query block after n has, and no CTA waits in steady state (ascending order would
  // make block n wait for the walk of all lower blocks); a CTA then only waits for CTAs launched before
  // it, which cannot deadlock. Without a mask, grids of at most half the SMs' worth of KV blocks walk
  // rotated instead (dq_rotate, common/block_order.h): query block j takes its adds in the order of the
  // steps at which the KV blocks reach it, which needs a head's KV blocks resident at once. Band masks
  // outside deterministic mode run longest first (common/block_order.h).
  BwdWalk const walk = bwd_walk<kIsBand>(params, band_block_coord(params.pairs_per_section), kBlockM, kBlockN);
  int const n_block = walk.n_block;
  int const bidh_k = walk.bidh_k, bidb = walk.bidb;
  SeqInfo const seq = walk.seq;
  // The postprocess may launch once every CTA of this grid runs; it waits for dq_done (below) or for
  // the grid. This grid in turn waits for the preprocess before reading D and the LSE.
  pdl_launch_dependents();
  // Counts this CTA into its (batch, KV head)'s dq_done once its dQ adds have landed (the caller has
  // waited for its bulk reductions to complete). Per CTA, the SC fence of __threadfence + atomicAdd
  // cost 5% at d 64 causal 512, the release 2%.
  auto count_dq_done = [&]() {
    if (params.dq_done_count > 0) { release_bulk_adds(b.dq_done + int64_t(bidb) * p.num_heads_k + bidh_k); }
  };
  if (!walk.live) {  // uniform over the CTA, before any barrier
    if (threadIdx.x == 0) { count_dq_done(); }
    return;
  }
  int const m_block_min = walk.m_block_min, m_block_max = walk.m_block_max;
  int const num_m_blocks = walk.num_m_blocks;
  int const group = params.fwd.h_h_k_ratio;
  int const num_steps = walk.num_steps;
  bool const varlen_q = p.cu_seqlens_q != nullptr;
  int const num_n_blocks = walk.num_n_blocks;
  bool const rotated = walk.rotated;
  int const m_first = walk.m_first;
  // Deterministic mode: the semaphore of query block `m_block` of head `bidh`, and the number of KV
  // blocks whose dQ adds precede this CTA's there. One semaphore per query block: block_m >=
  // FT_BWD_SEMAPHORE_ROWS, so the index stays below the sem_blocks allocated.
  auto dq_semaphore = [&](int bidh, int m_block, int& expected) {
    static_assert(kBlockM >= FT_BWD_SEMAPHORE_ROWS);
    int const sem_blocks = (p.seqlen_q + FT_BWD_SEMAPHORE_ROWS - 1) / FT_BWD_SEMAPHORE_ROWS;
    if (rotated) {
      int const step = m_block - m_first + (m_block < m_first ? num_m_blocks : 0);
      expected = rotated_dq_turn(n_block, step, num_n_blocks, num_m_blocks);
    } else {
      int n_block_lo, n_block_hi;
      kv_block_range<kIsBand>(p, seq, m_block, kBlockM, kBlockN, n_block_lo, n_block_hi);
      expected = n_block_hi - 1 - n_block;
    }
    return b.dq_semaphore + (int64_t(bidb) * p.num_heads + bidh) * sem_blocks + m_block * (kBlockM / FT_BWD_SEMAPHORE_ROWS);
  };

  extern __shared__ __align__(1024) char smem_buf[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.smem_do.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutV{});
  Tensor sP = make_tensor(make_smem_ptr(ss.smem_p.data()), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.smem_ds.data()), typename Traits::SmemLayoutdS{});  // (m, n, stage)
  Tensor sQt = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.smem_do.data()), typename Traits::SmemLayoutdOt{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKt{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.smem_p.data()), typename Traits::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.smem_ds.data()), typename Traits::SmemLayoutdSt{});
  Tensor sdQ = make_tensor(make_smem_ptr(ss.smem_dq.data()), typename Traits::SmemLayoutdQ{});

  int const warp_group_idx = cutlass::canonical_warp_group_idx();
  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const lane = threadIdx.x % 32;
  if (warp_idx == 0 && lane == 0) {
    ss.barrier_kv.init(1);
    cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
    if constexpr (!Traits::kdQRed && !Traits::kdQFrag) { cute::prefetch_tma_descriptor(kp.tma_dq.get_tma_descriptor()); }
  }
  bool const producer = warp_group_idx == 0;
  PipelineQ pipeline_q(ss.pipeline_q, tma_pipeline_params<PipelineQ>(producer, kNMmaThreads, Traits::kTmaBytesQ),
                       Shape<_1, _1, _1>{});
  PipelinedO pipeline_do(ss.pipeline_do, tma_pipeline_params<PipelinedO>(producer, kNMmaThreads, Traits::kTmaBytesdO),
                         Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group_idx == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (num_steps == 0) {
      if (warp_idx == 1 && lane == 0) { count_dq_done(); }
      return;
    }
    if (warp_idx == 0) {
      // -------------------------------------------------------------- producer
      Tensor mQ = kp.tma_q.get_tma_tensor(kp.shape_q);
      Tensor mdO = kp.tma_do.get_tma_tensor(kp.shape_do);
      Tensor mK = kp.tma_k.get_tma_tensor(kp.shape_k);
      Tensor mV = kp.tma_v.get_tma_tensor(kp.shape_v);
      int const batch_k = p.cu_seqlens_k ? 0 : bidb;
      Tensor gK = local_tile(domain_offset(make_coord(seq.k_row0, _0{}), mK(_, _, bidh_k, batch_k)),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(seq.k_row0, _0{}), mV(_, _, bidh_k, batch_k)),
                             Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, _0{}));
      auto [tKgK, tKsK] = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      if (lane == 0) {
        ss.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
        copy(kp.tma_k.with(reinterpret_cast<uint64_t&>(ss.barrier_kv), 0), tKgK, tKsK);
        copy(kp.tma_v.with(reinterpret_cast<uint64_t&>(ss.barrier_kv), 0), tVgV, tVsV);
      }
      auto write_q = cutlass::make_producer_start_state<PipelineQ>();
      auto write_do = cutlass::make_producer_start_state<PipelinedO>();
      BwdStep st(bidh_k, group, m_first);
      for (int step = 0; step < num_steps; ++step, st.advance(m_block_min, m_block_max, m_first)) {
        int const batch_q = varlen_q ? 0 : bidb;
        Tensor gQ = local_tile(domain_offset(make_coord(seq.q_row0, _0{}), mQ(_, _, st.bidh, batch_q)),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        Tensor gdO = local_tile(domain_offset(make_coord(seq.q_row0, _0{}), mdO(_, _, st.bidh, batch_q)),
                                Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(_, _0{}));
        auto [tQgQ, tQsQ] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto [tdOgdO, tdOsdO] = tma_partition(kp.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
        pipeline_q.producer_acquire(write_q);
        if (lane == 0) {
          copy(kp.tma_q.with(*pipeline_q.producer_get_barrier(write_q), 0), tQgQ(_, st.m_block), tQsQ(_, write_q.index()));
        }
        pipeline_do.producer_acquire(write_do);
        if (lane == 0) {
          copy(kp.tma_do.with(*pipeline_do.producer_get_barrier(write_do), 0), tdOgdO(_, st.m_block),
               tdOsdO(_, write_do.index()));
        }
        ++write_q;
        ++write_do;
      }
    } else if (!Traits::kdQRed && warp_idx == 1) {
      // -------------------------------------------------------------- dQ writer
      Tensor mdQ = kp.tma_dq.get_tma_tensor(kp.shape_dq_accum);
      auto cta_tma = kp.tma_dq.get_slice(_0{});
      using ShapePart = Shape<Int<Traits::kdQPartRows>, Int<Traits::kdQPartCols>>;
      auto tdQsdQ = [&](int part) {
        return cta_tma.partition_S(make_tensor(make_smem_ptr(ss.smem_dq.data() + part * size(ShapePart{})),
                                               typename Traits::SmemLayoutdQPart{}));
      };
      // Packed batches: each sequence's accumulator rows start FT_BWD_ACCUM_ROW_PAD rows further on.
      int64_t const acc_row0 = varlen_q ? seq.q_row0 + int64_t(FT_BWD_ACCUM_ROW_PAD) * bidb : 0;
      pdl_wait_prior_grids();
      BwdStep st(bidh_k, group, m_first);
      for (int step = 0; step < num_steps; ++step, st.advance(m_block_min, m_block_max, m_first)) {
        Tensor gdQ = local_tile(domain_offset(make_coord(acc_row0, _0{}), mdQ(_, _, st.bidh, varlen_q ? 0 : bidb)),
                                Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(st.m_block, _0{}));
        auto tdQgdQ = [&](int part) {
          return cta_tma.partition_D(
              local_tile(gdQ, ShapePart{}, Traits::kdQRowParts ? make_coord(part, 0) : make_coord(0, part)));
        };
        // kdQFrag: the part's block of the DqAccumFrag accumulator, 64 rows from the step's first.
        auto add_part = [&](int part) {
          if constexpr (Traits::kdQFrag) {
            using Frag = DqAccumFrag<kHeadDim, Traits::kdQFragCols>;
            float* const g = b.dq_accum + seq.dq_accum_offset(p, bidb, b.dq_accum_batch_stride, b.dq_accum_row_stride) +
                             st.bidh * b.dq_accum_head_stride +
                             Frag::offset(st.m_block * kBlockM + (Traits::kdQRowParts ? part * 64 : 0),
                                          Traits::kdQRowParts ? 0 : part * Traits::kdQPartCols);
            bulk_reduce_add_f32(g, ss.smem_dq.data() + part * size(ShapePart{}), int(size(ShapePart{}) * sizeof(float)));
          } else {
            copy(kp.tma_dq, tdQsdQ(part), tdQgdQ(part));
          }
        };
        int* semaphore = nullptr;
        if (b.deterministic) {
          int expected;
          semaphore = dq_semaphore(st.bidh, st.m_block, expected);
          if (lane == 0) { wait_dq_semaphore(semaphore, expected); }
          __syncwarp();  // the warp reconverges before its aligned bar.sync below
        }
        static_assert(kdQParts <= 2);
        // Every part issued, then each freed once its staging has been read.
        CUTE_UNROLL
        for (int part = 0; part < kdQParts; ++part) {
          cutlass::arch::NamedBarrier::sync(kdQSyncThreads, bwd_dq_full_barrier(part));
          if (lane == 0) {
            add_part(part);
            tma_store_arrive();
          }
        }
        CUTE_UNROLL
        for (int part = 0; part < kdQParts; ++part) {
          if (lane == 0) {  // the part's staging has been read (its bulk group and all older ones)
            if (part + 1 < kdQParts) { tma_store_wait<1>(); } else { tma_store_wait<0>(); }
          }
          __syncwarp();
          if (step + 1 < num_steps) { cutlass::arch::NamedBarrier::arrive(kdQSyncThreads, bwd_dq_empty_barrier(part)); }
        }
        if (lane == 0 && b.deterministic) {
          bulk_wait_all_complete();  // the adds have landed before the next KV block's turn
          release_bulk_adds(semaphore);
        }
      }
      if (lane == 0) {
        bulk_wait_all_complete();
        count_dq_done();
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  pdl_wait_prior_grids();  // D and the LSE come from the preprocess
  constexpr bool kSwap = Traits::kSwapSdP;
  // Steps of the dq_overlap order without softcap issue the next step's LSE / D load behind their S^T
  // and dP^T GEMMs where they carry no mask code (see step_body below).
  constexpr bool kStatAfterGemmsOrder = kSwap && !kHasSoftcap && Traits::kdQPerWg && !Traits::kdQLag;
  // Ping-pong (BwdTraits::kPingPong, dq_lag order): the two consumer warpgroups take turns issuing
  // their GEMMs (BwdTurns) instead of meeting at kPdSFull every step, so one
  // warpgroup's exponentials and dS run under the other's GEMMs. Each step: turn 1 the previous dQ and
  // S^T, turn 2 dP^T, turn 3 dV and dK (dS and the next LSE / D stored before it); after the walk one
  // turn for the last dQ. The turn order carries the dS hand-off (a warpgroup's dQ of step j is issued
  // in its turn 1 of step j + 1, after the other's turn 3 of step j, which follows that one's dS
  // stores), the dS buffers' reuse (step j + 2's stores follow the other's dQ of step j, which it waited
  // for before its turn 2 of step j + 1) and the LSE / D hand-off (warpgroup 1 stores step j + 1's
  // before its turn 3 of step j; warpgroup 2 reads step j's before its own turn 3 of step j).
  constexpr bool kPingPong = Traits::kPingPong;
  BwdTurns const turns{warp_group_idx - 1};
  int const thread_idx = int(threadIdx.x) - 128;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadK mma_dk;
  typename Traits::TiledMmadV mma_dv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(thread_idx);
  // Shared-memory operands (WGMMA descriptors) depend only on the warpgroup: sliced by its first
  // thread, with the warpgroup index warp-uniform (a shuffle), so the descriptors live in uniform
  // registers. Sliced by thread_idx they were computed per thread and moved over with R2UR.
  int const wg_thread0 = (warp_group_idx - 1) * cutlass::NumThreadsPerWarpGroup;
  auto wg_sdp = mma_sdp.get_slice(wg_thread0);
  auto wg_dk = mma_dk.get_slice(wg_thread0);
  auto wg_dv = mma_dv.get_slice(wg_thread0);
  auto wg_dq = mma_dq.get_slice(wg_thread0);
  // S (or S^T) and dP (or dP^T) operands; the query-side ones are staged (last mode).
  Tensor tSrQ = [&] {
    if constexpr (kSwap) { return wg_sdp.partition_fragment_B(sQ); } else { return wg_sdp.partition_fragment_A(sQ); }
  }();
  Tensor tSrK = [&] {
    if constexpr (kSwap) { return wg_sdp.partition_fragment_A(sK); } else { return wg_sdp.partition_fragment_B(sK); }
  }();
  Tensor tdPrdO = [&] {
    if constexpr (kSwap) { return wg_sdp.partition_fragment_B(sdO); } else { return wg_sdp.partition_fragment_A(sdO); }
  }();
  Tensor tdPrV = [&] {
    if constexpr (kSwap) { return wg_sdp.partition_fragment_A(sV); } else { return wg_sdp.partition_fragment_B(sV); }
  }();
  Tensor tdVrdOt = wg_dv.partition_fragment_B(sdOt);
  Tensor tdKrQt = wg_dk.partition_fragment_B(sQt);
  constexpr int kdQCols = Traits::kdQCols;
  using TileShapedQ = typename Traits::TileShapedQ;
  // dQ = dS K: dS staged (last mode); pass `pass` reads its columns of K^T.
  Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);
  auto dq_gemm = [&](int ds_stage, int pass, auto& acc_dq) {
    wg_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, ds_stage),
                      wg_dq.partition_fragment_B(local_tile(sKt, Shape<Int<kdQCols>, Int<kBlockN>>{}, make_coord(pass, _0{}))),
                      acc_dq);
  };
  Tensor acc_dk = partition_fragment_C(mma_dk, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dv, Shape<Int<kBlockN>, Int<kHeadDimV>>{});
  clear(acc_dk);
  clear(acc_dv);

  // The S tile as the SdP MMA sees it: (keys, queries) when swapped.
  using TileSdP = std::conditional_t<kSwap, Shape<Int<kBlockN>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kBlockN>>>;
  auto thr_sdp_of = [&](int t) { return mma_sdp.get_thread_slice(t).partition_C(make_identity_tensor(TileSdP{})); };
  Tensor tScS = thr_sdp_of(thread_idx);
  // Pass `pass` of dQ into the staging tile.
  auto smem_copy_dq = make_tiled_copy_C(typename Traits::SmemCopyAtomdQ{}, mma_dq);
  // Under kSwap accumulator row j is query perm(j) (see Traits::dQRowPerm) and is staged there.
  Tensor sdQ_stage = [&] {
    Tensor t = as_position_independent_swizzle_tensor(sdQ);
    if constexpr (kSwap) {
      return t.compose(make_tile(typename Traits::dQRowPerm{}, Layout<Int<kHeadDim>>{}));
    } else {
      return t;
    }
  }();
  auto stage_dq = [&](auto const& acc_dq, int pass) {
    if constexpr (Traits::kdQFrag) {  // register order (DqAccumFrag): entries 4 g ... 4 g + 3 at 512 g + 4 t
      constexpr int kRegs = decltype(size(acc_dq))::value;
      static_assert(kRegs * 128 == Traits::kdQPartRows * Traits::kdQPartCols && kRegs % 4 == 0);
      int const t = thread_idx_reread() - 128;
      float* const base = ss.smem_dq.data() + (t / 128) * (kRegs * 128) + (t % 128) * 4;
      CUTE_UNROLL
      for (int g = 0; g < kRegs / 4; ++g) {
        *reinterpret_cast<float4*>(base + g * 512) =
            make_float4(acc_dq(4 * g), acc_dq(4 * g + 1), acc_dq(4 * g + 2), acc_dq(4 * g + 3));
      }
    } else {
      auto smem_thr_dq = smem_copy_dq.get_thread_slice(thread_idx_reread() - 128);  // addresses not held across the walk
      copy(smem_copy_dq, smem_thr_dq.retile_S(acc_dq),
           smem_thr_dq.partition_D(local_tile(sdQ_stage, TileShapedQ{}, make_coord(_0{}, pass))));
    }
  };
  // This thread's part of the staging tile (its warpgroup's under kdQPerWg) and the writer handshake.
  int const dq_part = kdQParts == 1 ? 0 : thread_idx / 128;
  // A step's dQ: dq_begin, then dq_put per column pass, then dq_end.
  //  staged: wait for the staging part to be free; stage; hand it to the writer.
  //  kdQRed: [deterministic: wait for the query block's turn]; add into the accumulator from
  //    registers; [pass the turn once every consumer thread's adds are visible].
  int* dq_sem = nullptr;
  auto dq_begin = [&](BwdStep const& s, bool first) {
    if constexpr (Traits::kdQRed) {
      if (b.deterministic) {
        int expected;
        dq_sem = dq_semaphore(s.bidh, s.m_block, expected);
        if (thread_idx == 0) { wait_dq_semaphore(dq_sem, expected); }
        cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kdQTurn));
      }
    } else {
      if (!first) { cutlass::arch::NamedBarrier::sync(kdQSyncThreads, bwd_dq_empty_barrier(dq_part)); }
    }
  };
  auto dq_put = [&](auto const& acc_dq, int pass, BwdStep const& s) {
    if constexpr (Traits::kdQRed) {
      float* const g = b.dq_accum + seq.dq_accum_offset(p, bidb, b.dq_accum_batch_stride, b.dq_accum_row_stride) +
                       s.bidh * b.dq_accum_head_stride + int64_t(s.m_block) * kBlockM * b.dq_accum_row_stride;
      red_add_dq_perm<kHeadDim>(acc_dq,
                                mma_dq.get_thread_slice(thread_idx_reread() - 128).partition_C(make_identity_tensor(TileShapedQ{})),
                                g, pass * kdQCols);
    } else {
      stage_dq(acc_dq, pass);
    }
  };
  auto dq_end = [&] {
    if constexpr (Traits::kdQRed) {
      if (b.deterministic) {
        __threadfence();
        cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kdQTurn));
        if (thread_idx == 0) { atomicAdd(dq_sem, 1); }
      }
    } else {
      tma_store_fence();  // generic-proxy stores of dQ -> the writer's TMA reads
      cutlass::arch::NamedBarrier::arrive(kdQSyncThreads, bwd_dq_full_barrier(dq_part));
    }
  };

  // Hands off a completed one-pass dQ of step s (`first`: the walk's first step).
  auto put_dq = [&](auto& acc_dq, BwdStep const& s, bool first) {
    warpgroup_fence_operand(acc_dq);
    dq_begin(s, first);
    dq_put(acc_dq, 0, s);
    dq_end();
  };
  // kdQLag: the step whose dQ is pending (handed off one step after its GEMM).
  BwdStep prev(bidh_k, group, m_first);

  BandMask const mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
  float const scale_log2 = params.fwd.scale_log2;
  // LSE (exp2 domain) and D of one query row of a step: +inf / 0 past seqlen_q, so P = dS = 0 there.
  auto row_stat = [&](BwdStep const& st, int r, bool lse) {
    int const row = st.m_block * kBlockM + r;
    int64_t const off = seq.lse_offset(p, bidb) + st.bidh * p.lse_head_stride + row;
    if (row >= seq.seqlen_q) { return lse ? INFINITY : 0.f; }
    return lse ? b.lse_log2[off] : b.dsoftmax_sum[off];
  };
  // kSwap: the rows' statistics go through shared memory (a thread needs those of all its columns);
  // consumer thread t < 2 * block_m loads LSE (t < block_m) or D of one row, one step ahead.
  bool const stat_thread = thread_idx < 2 * kBlockM;
  auto load_stat = [&](BwdStep const& st) { return row_stat(st, thread_idx % kBlockM, thread_idx < kBlockM); };
  BwdStep st(bidh_k, group, m_first);
  if (num_steps > 0) {
    if constexpr (kSwap) {
      if (stat_thread) { ss.smem_stats[0][thread_idx] = load_stat(st); }
      cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kPdSFull));
    }
    ss.barrier_kv.wait(0);
    if constexpr (kPingPong) { turns.start(); }
  }

  typename PipelineQ::PipelineState read_q;
  typename PipelinedO::PipelineState read_do;
  for (int step = 0; step < num_steps; ++step) {
    BwdStep const next = [&] {
      BwdStep n = st;
      n.advance(m_block_min, m_block_max, m_first);
      return n;
    }();
    int const m_block = st.m_block;
    int const stage_q = read_q.index();
    int const stage_do = read_do.index();
    bool const needs_mask = mask.block_needs_mask(kIsBand, m_block, n_block, kBlockM, kBlockN);
    // kMaskMode 0: the mask applied where needs_mask says; 1 / 2: this copy of the step always / never
    // applies it. The band kernels of the dq_overlap order without softcap run two copies, so that the
    // steps that need no mask (all but the diagonal ones under a causal mask) run the non-band
    // kernel's step, its next-step LSE / D load behind the GEMMs included. H200, d 128: +1-2% on
    // unmasked work (window (-1, s)), +0.5-1.5% causal at 2k-16k; the load alone, with the mask
    // branch still in the step, measured nothing (benchmarks/NOTES.md, session 39).
    auto step_body = [&](auto mask_mode) {
      constexpr int kMaskMode = decltype(mask_mode)::value;
      bool const apply_mask = kMaskMode == 0 ? needs_mask : kMaskMode == 1;
      Tensor acc_s = partition_fragment_C(mma_sdp, TileSdP{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, TileSdP{});

      if constexpr (kSwap) {
        // The thread's score coordinates and dS store addresses anew each step (special_regs.h): held
        // across the walk they spilled at d = 64.
        int const t_step = thread_idx_reread() - 128;
        Tensor tScS = thr_sdp_of(t_step);
        constexpr bool kLag = Traits::kdQLag;
        // The next step's LSE / D global load: issued behind this step's S^T and dP^T GEMMs in the
        // dq_overlap order without softcap, in steps without mask code (its ~40 instructions then no
        // longer delay the S^T issue: H100, d = 128, +1-3% at 1k-16k), ahead of them elsewhere (in a
        // step with the mask branch the same move measured 1-3% slower at causal 1k-4k, session 34).
        constexpr bool kMaskFree = kMaskMode == 2 || (kMaskMode == 0 && !kIsBand);
        constexpr bool kStatAfterGemms = kMaskFree && kStatAfterGemmsOrder;
        auto next_stat_of = [&] { return stat_thread && step + 1 < num_steps ? load_stat(next) : 0.f; };
        float next_stat = kStatAfterGemms ? 0.f : next_stat_of();
        float const* stat_lse = ss.smem_stats[step % 2];
        float const* stat_d = stat_lse + kBlockM;
        auto s_gemm = [&] {
          pipeline_q.consumer_wait(read_q);
          wg_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage_q), acc_s);
        };
        // kLag: the previous step's dQ goes first (its dS has been in shared memory since that step's
        // kPdSFull, or under kPingPong since the other warpgroup's turn 3 of it), then S^T; dQ is
        // staged once done, before dP^T is issued (which keeps its accumulators and dP^T's from being
        // live together).
        if constexpr (kPingPong) { turns.wait(); }
        if (kLag && step > 0) {
          Tensor acc_dq_prev = partition_fragment_C(mma_dq, TileShapedQ{});
          dq_gemm((step + 1) % 2, 0, acc_dq_prev);
          s_gemm();
          if constexpr (kPingPong) { turns.pass(false); }
          warpgroup_wait<1>();  // the previous dQ done; S^T running
          put_dq(acc_dq_prev, prev, step == 1);
        } else {
          s_gemm();
          if constexpr (kPingPong) { turns.pass(false); }
        }
        pipeline_do.consumer_wait(read_do);
        if constexpr (kPingPong) { turns.wait(); }
        wg_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage_do), acc_dp);
        if constexpr (kPingPong) { turns.pass(false); }
        if constexpr (kStatAfterGemms) { next_stat = next_stat_of(); }
        if constexpr (kHasSoftcap) {
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_s);
          warpgroup_fence_operand(acc_dp);
          CUTE_UNROLL
          for (int i = 0; i < size(acc_s); ++i) {
            float const t = tanhf(acc_s(i) * params.fwd.softcap_scale);
            acc_dp(i) = (acc_dp(i) - stat_d[get<1>(tScS(i))]) * (1.f - t * t);  // (dP - D) t', before masking
            acc_s(i) = t;
          }
          if (apply_mask) { mask.apply<kIsBand, true>(acc_s, tScS, m_block * kBlockM, n_block * kBlockN); }
          CUTE_UNROLL
          for (int i = 0; i < size(acc_s); ++i) {
            acc_s(i) = exp2f(acc_s(i) * scale_log2 - stat_lse[get<1>(tScS(i))]);
            acc_dp(i) *= acc_s(i);
          }
        } else {
          warpgroup_wait<1>();  // S^T done; dP^T still running
          warpgroup_fence_operand(acc_s);
          if (apply_mask) { mask.apply<kIsBand, true>(acc_s, tScS, m_block * kBlockM, n_block * kBlockN); }
          CUTE_UNROLL
          for (int i = 0; i < size(acc_s); ++i) { acc_s(i) = exp2f(acc_s(i) * scale_log2 - stat_lse[get<1>(tScS(i))]); }
        }
        constexpr bool kOverlap = Traits::kdQPerWg && !kLag;
        // Without kOverlap dV and dK are issued as soon as P^T and dS^T are ready; with it, dV follows
        // the dS stores and dK the dQ GEMM.
        Tensor rP = convert_fragment<Element>(acc_s);
        auto dv_gemm = [&] {
          wg_gemm<false, -1>(mma_dv, make_tensor(rP.data(), acc_to_a_layout(rP.layout())), tdVrdOt(_, _, _, stage_do), acc_dv);
        };
        constexpr bool kEarlyDKV = !kOverlap && !kPingPong;  // dV / dK issued as soon as P^T / dS^T exist
        if constexpr (kEarlyDKV) { dv_gemm(); }
        if constexpr (!kHasSoftcap) {
          warpgroup_wait<kEarlyDKV ? 1 : 0>();  // dP^T done (dV still running if issued)
          warpgroup_fence_operand(acc_dp);
          CUTE_UNROLL
          for (int i = 0; i < size(acc_dp); ++i) { acc_dp(i) = acc_s(i) * (acc_dp(i) - stat_d[get<1>(tScS(i))]); }
        }
        Tensor rdS = convert_fragment<Element>(acc_dp);
        auto dk_gemm = [&] {
          wg_gemm<false, -1>(mma_dk, make_tensor(rdS.data(), acc_to_a_layout(rdS.layout())), tdKrQt(_, _, _, stage_q), acc_dk);
        };
        if constexpr (kEarlyDKV) { dk_gemm(); }
        // dS for dQ: both warpgroups' keys are needed, so it goes through shared memory, query q at
        // row perm^-1(q) (Traits::dQRowPerm). Its buffer was last read by step s - 2's dQ GEMMs, which
        // both warpgroups completed before step s - 1's kPdSFull (under kPingPong: before their turn 2
        // of step s - 1, which precedes this warpgroup's turn 1 of step s).
        int const ds_stage = step % 2;
        auto smem_copy_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomdSt{}, mma_sdp);
        auto smem_thr_ds = smem_copy_ds.get_thread_slice(t_step);
        copy(smem_copy_ds, smem_thr_ds.retile_S(rdS),
             smem_thr_ds.partition_D(as_position_independent_swizzle_tensor(sdSt(_, _, ds_stage))
                                         .compose(make_tile(Layout<Int<kBlockN>>{}, typename Traits::dQRowPermInv{}))));
        if constexpr (kOverlap) { dv_gemm(); }  // behind the dS stores
        if (stat_thread && step + 1 < num_steps) { ss.smem_stats[(step + 1) % 2][thread_idx] = next_stat; }
        cutlass::arch::fence_view_async_shared();
        if constexpr (kPingPong) {
          turns.wait();
          dv_gemm();
          dk_gemm();
          turns.pass(false);
        } else {
          cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kPdSFull));
        }
        // rP and rdS are read by the dV/dK GEMMs: they stay live (fenced) until those complete.
        // kLag: no dQ in this step (the next one issues it).
        Tensor acc_dq = partition_fragment_C(mma_dq, TileShapedQ{});
        if constexpr (!kLag) { dq_gemm(ds_stage, 0, acc_dq); }
        if constexpr (kOverlap) {
          warpgroup_wait<1>();  // dV done; dQ still running
          warpgroup_fence_operand(rP);
          warpgroup_fence_operand(acc_dv);
          pipeline_do.consumer_release(read_do);
          dk_gemm();
          warpgroup_wait<1>();  // dQ done; dK still running
          put_dq(acc_dq, st, step == 0);
          warpgroup_wait<0>();
          warpgroup_fence_operand(rdS);
          warpgroup_fence_operand(acc_dk);
          pipeline_q.consumer_release(read_q);
        } else {
          warpgroup_wait<0>();
          warpgroup_fence_operand(rP);
          warpgroup_fence_operand(rdS);
          warpgroup_fence_operand(acc_dv);
          warpgroup_fence_operand(acc_dk);
          pipeline_q.consumer_release(read_q);
          pipeline_do.consumer_release(read_do);
          if constexpr (!kLag) { put_dq(acc_dq, st, step == 0); }
        }
      } else {
        Tensor tScS_rc = rowcol(tScS);
        constexpr int kRows = decltype(size<0>(tScS_rc))::value;
        // This thread's rows' LSE and D; loads issued before the GEMMs to hide their latency.
        float lse_log2[kRows], dsum[kRows];
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          lse_log2[mi] = row_stat(st, get<0>(tScS_rc(mi, 0)), true);
          dsum[mi] = row_stat(st, get<0>(tScS_rc(mi, 0)), false);
        }
        pipeline_q.consumer_wait(read_q);
        wg_gemm<true, -1>(mma_sdp, tSrQ(_, _, _, stage_q), tSrK, acc_s);
        pipeline_do.consumer_wait(read_do);
        wg_gemm<true, -1>(mma_sdp, tdPrdO(_, _, _, stage_do), tdPrV, acc_dp);
        Tensor s = rowcol(acc_s);
        Tensor dp = rowcol(acc_dp);
        if constexpr (kHasSoftcap) {
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_s);
          warpgroup_fence_operand(acc_dp);
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(s); ++ni) {
              float const t = tanhf(s(mi, ni) * params.fwd.softcap_scale);
              dp(mi, ni) = (dp(mi, ni) - dsum[mi]) * (1.f - t * t);  // (dP - D) t', t' before any masking
              s(mi, ni) = t;
            }
          }
          if (apply_mask) { mask.apply<kIsBand>(acc_s, tScS, m_block * kBlockM, n_block * kBlockN); }
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(s); ++ni) {
              float const pr = exp2f(s(mi, ni) * scale_log2 - lse_log2[mi]);
              s(mi, ni) = pr;
              dp(mi, ni) *= pr;
            }
          }
        } else {
          warpgroup_wait<1>();  // S done; dP still running
          warpgroup_fence_operand(acc_s);
          if (apply_mask) { mask.apply<kIsBand>(acc_s, tScS, m_block * kBlockM, n_block * kBlockN); }
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(s); ++ni) { s(mi, ni) = exp2f(s(mi, ni) * scale_log2 - lse_log2[mi]); }
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_dp);
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(dp); ++ni) { dp(mi, ni) = s(mi, ni) * (dp(mi, ni) - dsum[mi]); }
          }
        }
        Tensor rP = convert_fragment<Element>(acc_s);
        Tensor rdS = convert_fragment<Element>(acc_dp);
        if (step > 0) { cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kPdSEmpty)); }
        auto smem_copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
        auto smem_thr_pds = smem_copy_pds.get_thread_slice(thread_idx);
        copy(smem_copy_pds, smem_thr_pds.retile_S(rP), smem_thr_pds.partition_D(as_position_independent_swizzle_tensor(sP)));
        copy(smem_copy_pds, smem_thr_pds.retile_S(rdS),
             smem_thr_pds.partition_D(as_position_independent_swizzle_tensor(sdS(_, _, 0))));
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> WGMMA (async proxy) reads
        cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kPdSFull));

        // dQ's first pass is staged while dV and dK run; dO (one stage at d = 256) is released once dV
        // is done and Q once dK is, so that their next loads overlap the rest of the step. The second
        // pass (d = 256) is issued behind dK into the same registers.
        Tensor acc_dq = partition_fragment_C(mma_dq, TileShapedQ{});
        dq_gemm(0, 0, acc_dq);
        wg_gemm<false, -1>(mma_dv, wg_dv.partition_fragment_A(sPt), tdVrdOt(_, _, _, stage_do), acc_dv);
        wg_gemm<false, -1>(mma_dk, wg_dk.partition_fragment_A(sdSt(_, _, 0)), tdKrQt(_, _, _, stage_q), acc_dk);
        warpgroup_wait<2>();  // dQ (first pass) done; dV and dK still running
        warpgroup_fence_operand(acc_dq);
        dq_begin(st, step == 0);
        dq_put(acc_dq, 0, st);
        warpgroup_wait<1>();  // dV done; dK still running
        warpgroup_fence_operand(acc_dv);
        pipeline_do.consumer_release(read_do);
        static_assert(Traits::kdQPasses <= 2);
        if constexpr (Traits::kdQPasses == 2) {
          dq_gemm(0, 1, acc_dq);
          warpgroup_wait<1>();  // dK done; dQ's second pass still running
          warpgroup_fence_operand(acc_dk);
          pipeline_q.consumer_release(read_q);
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_dq);
          dq_put(acc_dq, 1, st);
        } else {
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_dk);
          pipeline_q.consumer_release(read_q);
        }
        dq_end();
      }
    };
    if constexpr (kIsBand && kStatAfterGemmsOrder) {
      if (needs_mask) { step_body(Int<1>{}); } else { step_body(Int<2>{}); }
    } else {
      step_body(Int<0>{});
    }
    ++read_q;
    ++read_do;
    prev = st;
    st = next;
  }
  if (Traits::kdQLag && num_steps > 0) {  // the last step's dQ
    Tensor acc_dq = partition_fragment_C(mma_dq, TileShapedQ{});
    if constexpr (kPingPong) { turns.wait(); }
    dq_gemm((num_steps + 1) % 2, 0, acc_dq);
    if constexpr (kPingPong) { turns.pass(true); }
    warpgroup_wait<0>();
    put_dq(acc_dq, prev, num_steps == 1);
  }

  // Epilogue: dK (scaled once here) and dV staged over K and V, then 16-byte predicated stores.
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= p.softmax_scale; }
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kEpilogue));  // K/V reads done
  // Offset-swizzled views (the tiles are 1024-byte aligned): shared-memory stores and loads, not generic.
  Tensor sK_pi = as_position_independent_swizzle_tensor(sK);
  Tensor sV_pi = as_position_independent_swizzle_tensor(sV);
  auto smem_copy_dk = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_dk);
  auto smem_thr_dk = smem_copy_dk.get_thread_slice(thread_idx);
  copy(smem_copy_dk, smem_thr_dk.retile_S(rdK), smem_thr_dk.partition_D(sK_pi));
  auto smem_copy_dv = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_dv);
  auto smem_thr_dv = smem_copy_dv.get_thread_slice(thread_idx);
  copy(smem_copy_dv, smem_thr_dv.retile_S(rdV), smem_thr_dv.partition_D(sV_pi));
  cutlass::arch::NamedBarrier::sync(kNMmaThreads, int(BwdNamedBarrier::kEpilogue));

  Tensor mdK = make_tensor(make_gmem_ptr(static_cast<Element*>(b.dk) + seq.k_like_offset(p, bidb, b.dk_batch_stride, b.dk_row_stride) +
                                         bidh_k * b.dk_head_stride),
                           make_shape(seq.seqlen_k, Int<kHeadDim>{}), make_stride(b.dk_row_stride, _1{}));
  Tensor mdV = make_tensor(make_gmem_ptr(static_cast<Element*>(b.dv) + seq.k_like_offset(p, bidb, b.dv_batch_stride, b.dv_row_stride) +
                                         bidh_k * b.dv_head_stride),
                           make_shape(seq.seqlen_k, Int<kHeadDimV>{}), make_stride(b.dv_row_stride, _1{}));
  int const rows_k = seq.seqlen_k - n_block * kBlockN;
  typename Traits::GmemTiledCopydK gmem_copy_dk;
  auto gmem_thr_dk = gmem_copy_dk.get_thread_slice(thread_idx);
  store_tile(gmem_copy_dk, gmem_thr_dk.partition_S(sK_pi),
             gmem_thr_dk.partition_D(local_tile(mdK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0))),
             gmem_thr_dk.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{})), rows_k, p.head_dim);
  typename Traits::GmemTiledCopydV gmem_copy_dv;
  auto gmem_thr_dv = gmem_copy_dv.get_thread_slice(thread_idx);
  store_tile(gmem_copy_dv, gmem_thr_dv.partition_S(sV_pi),
             gmem_thr_dv.partition_D(local_tile(mdV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, 0))),
             gmem_thr_dv.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{})), rows_k, p.head_dim_v);
}

}  // namespace flashtile::hopper
