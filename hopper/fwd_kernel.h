// Hopper forward kernel (sm_90a): warp-specialized TMA producer + WGMMA consumers.
//
// Roles (persistent: one CTA per SM takes tiles from the scheduler of hopper/tile_scheduler.h):
//   warpgroup 0  producer: setmaxnreg down; warp 0 issues (one elected lane) TMA loads of each tile's Q
//                (kQStages-deep: the next tile's Q loads during the current tile where shared memory
//                allows) and of its K and V blocks (last block first; K a block ahead of V for
//                one-Q-stage tiles without a band mask, and per launch under one at d 256) into
//                kStages-deep pipelines,
//                fetches the next tile as it starts one and hands its coordinates to the consumers
//                (TileHandoff) once the tile's first block is loading.
//                Clusters (kClusterM > 1): the CTAs of a cluster run adjacent query blocks with the same
//                K/V blocks; each producer loads 1 / kClusterM of every K/V block and TMA multicasts it
//                to all of them, so each block crosses from L2 once per cluster.
//   warpgroups 1..kNMmaWarpGroups  consumers: setmaxnreg up; each owns 64 query rows and runs
//                S = Q K^T (WGMMA, both operands in shared memory), mask + online softmax in
//                registers, O += P V (WGMMA, P from registers, V read MN-major); the schedule
//                (intra-warpgroup overlap, ping-pong) lives in hopper/fwd_consumer.h.
// Pipelines (cutlass::PipelineTmaAsync, Q, K and V): producer arrival count 1 (the TMA thread, with the
// transaction bytes of one tile); consumer arrival count kNMmaThreads (every consumer thread releases
// a stage after its WGMMA on it has completed; a Q stage after the tile's O, staged over it, has been
// read out of it, or under kOOverV once the tile's last S GEMM has completed). Under kOOverV each
// consumer warpgroup's rows of Q are a part with a stage of their own (FwdTraits::kQParts: 128
// arrivals, the warpgroup's own last S GEMM frees it). In a cluster a K/V stage takes one arrival per
// consumer warpgroup of every CTA (ConsumerPipeline), and a producer stays until its stages are all
// released (producer_tail).
// Overlap schedule: the ping-pong turns run on across tiles (a tile's tail turn, its last PV GEMM, is
// followed by the next tile's head turn, its first S GEMM), and each consumer warpgroup runs its own
// epilogue without meeting the other: O is staged in shared memory over the tile's Q stage; rows that
// are all in bounds leave by TMA store (one elected thread, which releases the Q stage once the store
// has read it), others by 16-byte stores. With one Q stage (FwdTraits::kOOverV) O is staged over the
// V stages instead: Q is released after the tile's last S GEMM, the two warpgroups meet once (kVRead:
// neither stages O before the other's last PV GEMM has read V), and the o_free barrier (one arrival
// per consumer warpgroup of every CTA, once its O has left) gates the producer's next V load.
// The serial schedule (only under FLASHTILE_HOPPER_SCHEDULE) stores O with both warpgroups through
// registers. The LSE goes out directly.
// Tail split (kSplit instances, hopper_fwd_split_plan): the grid's last partial wave of tiles runs in
// parts along the keys; each part's warpgroups leave O and LSE in split_accum and the part that counts
// last combines them (combine_parts) before the epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/empty_tile.h"
#include "common/epilogue.h"
#include "common/fragment.h"
#include "common/grid_dependency.h"
#include "common/fwd_params.h"
#include "common/mask.h"
#include "common/seq_info.h"
#include "common/softmax.h"
#include "common/special_regs.h"
#include "hopper/fwd_consumer.h"
#include "hopper/fwd_traits.h"
#include "hopper/gmem_tensors.h"
#include "hopper/named_barriers.h"
#include "hopper/pipeline_params.h"
#include "hopper/tile_scheduler.h"
#include "hopper/wgmma_utils.h"

namespace flashtile::hopper {

using namespace cute;

// kClusterM > 1: K and V load through multicast TMA, each CTA of the cluster one 1 / kClusterM slice.
template <class Traits, int kClusterM = 1>
struct FwdKernelParams {
  using Element = typename Traits::Element;
  using GmemQKV = GmemTensor<Element const>;
  using TmaLoadKV = std::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemQKV{}, typename Traits::SmemLayoutQLoad{},
                                      typename Traits::TileShapeQLoad{}, _1{}));
  using TmaK = decltype(make_tma_copy(TmaLoadKV{}, GmemQKV{}, take<0, 2>(typename Traits::SmemLayoutK{}),
                                      select<1, 2>(typename Traits::TileShapeQK{}), Int<kClusterM>{}));
  using TmaV = decltype(make_tma_copy(TmaLoadKV{}, GmemQKV{}, take<0, 2>(typename Traits::SmemLayoutV{}),
                                      select<2, 1>(typename Traits::TileShapePV{}), Int<kClusterM>{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor<Element>{}, typename Traits::SmemLayoutOWG{},
                                      typename Traits::TileShapeOWG{}, _1{}));
  FwdParams fwd;
  int num_m_blocks;
  int heads_per_section, lead_pairs, lead_group;  // band-mask tile order (TileScheduler)
  int num_whole, splits, blocks_per_part;         // tail split (TileScheduler, hopper_fwd_split_plan)
  // GQA packing: pack > 1 puts the `pack` query heads of a KV head into one tile (row r: query
  // r / pack of head r % pack), a tile spans q_per_tile queries, and the scheduler's heads are KV
  // heads. Q then loads through tma_q_packed; O and the LSE leave through per-row stores.
  int pack;
  int q_per_tile;
  uint32_t tma_bytes_q;  // transaction bytes of one Q tile
  // Band kernels that may take the producer's K-ahead order (kKAheadBand): 1 = this launch takes it
  // (the host heuristic hopper_fwd_k_ahead_band); ignored by the other kernels.
  int k_ahead;
  // kQShift kernels: query block m holds rows [m block_m - q_shift, (m + 1) block_m - q_shift), so that
  // a seqlen_q that is not a multiple of block_m leaves its partial block first, where a causal mask
  // gives it the fewest keys, rather than last, where it gives it the most (fwd_q_shift).
  int q_shift;
  CUtensorMap tma_q_packed;  // q as (d, pack, rows, KV heads, batch), box (swizzle atom columns, pack, q_per_tile, 1, 1)
  ShapeQKV shape_q, shape_k, shape_v;
  TmaQ tma_q;
  TmaK tma_k;
  TmaV tma_v;
  ShapeQKV shape_o;
  TmaO tma_o;
};

// Per-tile geometry; `active` is false for tiles whose rows see no key (written as 0 / -inf). Under a
// row shift (FwdKernelParams::q_shift) `seq` is the tile's frame: its rows start q_shift rows before
// the sequence (q_row0, the TMA row of Q, moves back by q_shift; seqlen_q and seqlen_q_alloc grow by
// it), so the query block's first row is m_block * block_m as without a shift, and the band mask,
// whose diagonal depends on seqlen_k - seqlen_q and the row only, stays the same. Those leading rows
// load as zeros (TMA's out-of-bounds fill) and are never written.
struct TileWork {
  TileCoord coord;
  SeqInfo seq;
  int n_block_min, n_block_max;
  bool in_range, active;

  // The sequence's own geometry (seq without the shift).
  CUTE_DEVICE SeqInfo sequence(int q_shift) const {
    SeqInfo s = seq;
    s.q_row0 += q_shift;
    s.seqlen_q -= q_shift;
    s.seqlen_q_alloc -= q_shift;
    return s;
  }
};

// The kernels that shift their query blocks (FwdKernelParams::q_shift): band masks on the tall tile
// (three consumer warpgroups) in the overlapped schedule. With the partial block last, a causal mask's
// longest tile ran on one or two of the three warpgroups (4096 = 21 x 192 + 64, 2048 = 10 x 192 + 128).
// The 128-row band kernels take no shift: their code with one measured 1% slower at d 64 causal 1k,
// where no block is partial (benchmarks/NOTES.md, session 48).
template <class Traits, bool kIsBand>
constexpr bool kQShift = kIsBand && Traits::kIntraWGOverlap && Traits::kBlockM > 128;

// Build-time switch of the producer's K-ahead order where the tile takes it (0: K and V of each block
// in turn everywhere), for measuring its gain.
#ifndef FLASHTILE_FWD_K_AHEAD
#define FLASHTILE_FWD_K_AHEAD 1
#endif

// The producer's K-ahead order (see fwd_kernel): one-Q-stage tiles of the overlapped schedule take it
// without a band mask always (kKAhead); their band kernels where the tile policy allows it
// (HopperFwdTile::band_k_ahead) take it per launch (kKAheadBand, FwdKernelParams::k_ahead), and keep
// K and V on their own pipeline states either way.
template <class Traits>
constexpr bool kKAheadTile = Traits::kIntraWGOverlap && Traits::kQStages == 1 && FLASHTILE_FWD_K_AHEAD != 0;
template <class Traits, bool kIsBand>
constexpr bool kKAhead = kKAheadTile<Traits> && !kIsBand;
template <class Traits, bool kIsBand>
constexpr bool kKAheadBand = kKAheadTile<Traits> && kIsBand && Traits::kTile.band_k_ahead;

// Build-time switch of the per-warpgroup block range below (0: every warpgroup walks the tile's
// blocks), for measuring its gain.
#ifndef FLASHTILE_FWD_WG_SKIP
#define FLASHTILE_FWD_WG_SKIP 1
#endif

// Whether a warpgroup can have blocks of its tile masked whole: band masks on tiles with
// block_n < block_m (the tall tile; 128 x 96 at d 192, 128 x 80 at d 256).
template <class Traits, bool kIsBand>
constexpr bool kWgSkip = kIsBand && Traits::kBlockN < Traits::kBlockM && FLASHTILE_FWD_WG_SKIP != 0;

// The end of consumer warpgroup wg's KV blocks in tile w, kept at least one block past n_block_min
// (a warpgroup walks at least its first block):
//  - the tall tile's rows all past seqlen_q (its last query block at lengths that are not multiples
//    of 192): that one block, their output rows being written as zeros. Under band masks the last
//    query block is the longest tile; H100 causal 4k-16k +2-5% at d 64 and 128. Without a mask the
//    skip's code in the tall kernel measured -0.5% on average at d 128 (+1.8% at d 64), so that
//    kernel keeps none (benchmarks/NOTES.md, session 22);
//  - under a band mask with a right edge, the tile's last blocks can lie past the last key any of
//    the warpgroup's 64 rows (queries up to (64 wg + 63) / pack of the tile) sees.
template <class Traits, bool kIsBand>
CUTE_DEVICE int wg_block_max(FtFwdParams const& p, TileWork const& w, int wg, int q_per_tile, int pack) {
  if constexpr (!kWgSkip<Traits, kIsBand>) {
    return w.n_block_max;
  } else {
    int const q_tile = w.coord.m_block * q_per_tile;
    if constexpr (Traits::kBlockM > 128) {
      if (q_tile + 64 * wg / pack >= w.seq.seqlen_q) { return w.n_block_min + 1; }
    }
    if (p.window_right < 0) { return w.n_block_max; }
    int const q_end = q_tile + (64 * wg + 63) / pack + 1;
    return max(min(w.n_block_max, kv_block_end_right(p, w.seq, q_end, Traits::kBlockN)), w.n_block_min + 1);
  }
}

// The tiles that may split their tail (hopper_fwd_split_plan): the overlapped schedule without a band
// mask, except where O is staged over V (d 192 / 256): there the parts' combine spilled 28-48 B in the
// mainloop (its 128 O registers and the combine's loads live at once). Their launches that split run
// a second instance of the kernel (kSplit): with the parts' code the others measured 2-3.5% slower at
// d 64 512-1k (benchmarks/NOTES.md session 46).
template <class Traits, bool kIsBand>
constexpr bool kTailSplit = !kIsBand && Traits::kIntraWGOverlap && !Traits::kOOverV;

// q_per_tile: queries per tile (block_m, or fewer under GQA packing). Part i of a split tile walks its
// blocks [i, i + 1) * blocks_per_part (hopper_fwd_split_plan: every part has one).
template <class Traits, bool kIsBand, bool kSplit>
CUTE_DEVICE TileWork make_tile_work(FwdParams const& params, TileCoord const c, int q_per_tile, int blocks_per_part,
                                    int q_shift) {
  SeqInfo seq(params.abi, c.bidb);
  if constexpr (kQShift<Traits, kIsBand>) {
    seq.q_row0 -= q_shift;
    seq.seqlen_q += q_shift;
    seq.seqlen_q_alloc += q_shift;
  }
  TileWork w{c, seq, 0, 0, c.m_block * q_per_tile < seq.seqlen_q_alloc, false};
  if (w.in_range) {
    kv_block_range<kIsBand>(params.abi, seq, c.m_block, q_per_tile, Traits::kBlockN, w.n_block_min, w.n_block_max);
    if (kSplit && c.split >= 0) {
      // Multiplications only: with the parts' bounds as divisions (on the vector pipes) the consumers'
      // pipeline stages and the GMMA descriptors made from them left the uniform registers (an R2UR
      // per k-slice in the KV loop: -6% at d 64 512-1k, split or not).
      w.n_block_min += (c.split & 0xffff) * blocks_per_part;
      w.n_block_max = min(w.n_block_max, w.n_block_min + blocks_per_part);
    }
    w.active = c.m_block * q_per_tile < seq.seqlen_q && w.n_block_max > w.n_block_min;
  }
  return w;
}

// Q of a GQA-packed tile: one 5-d TMA load per swizzle-atom column chunk of the head dim, each
// filling rows [0, pack * q_per_tile) of its chunk (the chunks of SmemLayoutQ are block_m rows apart).
template <class Traits>
CUTE_DEVICE void load_q_packed(CUtensorMap const& desc, uint64_t* barrier, typename Traits::Element* smem_stage,
                               int q_row, int bidh_k, int bidb) {
  constexpr int kChunk = Traits::kQChunkCols;
  CUTE_UNROLL
  for (int c = 0; c < Traits::kHeadDim / kChunk; ++c) {
    SM90_TMA_LOAD_5D::copy(&desc, barrier, static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                           smem_stage + c * Traits::kBlockM * kChunk, c * kChunk, 0, q_row, bidh_k, bidb);
  }
}

// A K/V pipeline as the consumers see it. In a cluster each warpgroup's release of a stage must reach
// every CTA's empty barrier once; PipelineTmaAsync chooses its signalling threads at construction and
// keeps that choice in two registers through the mainloop (at d = 256 they spill). Here lane 0 of the
// warpgroup's warp r signals CTA r, recomputed from the thread index at each release.
template <class Pipeline, int kClusterM>
struct ConsumerPipeline {
  Pipeline& pipeline;
  typename Pipeline::SharedStorage& storage;

  template <class State>
  CUTE_DEVICE void consumer_wait(State const& state) const { pipeline.consumer_wait(state); }

  template <class State>
  CUTE_DEVICE void consumer_release(State const& state) const {
    if constexpr (kClusterM == 1) {
      pipeline.consumer_release(state);
    } else {
      int const t = thread_idx_reread();
      uint32_t const warp = uint32_t(t / 32) % 4;
      storage.empty_barrier_[state.index()].arrive(warp, t % 32 == 0 && warp < kClusterM);
    }
  }
};

// kSplit (kTailSplit tiles only): the instance for launches that split their tail.
template <class Traits, bool kIsBand, bool kHasSoftcap, int kClusterM, bool kSplit = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(__grid_constant__ FwdKernelParams<Traits, kClusterM> const kp) {
  static_assert(!kSplit || kTailSplit<Traits, kIsBand>, "only kTailSplit tiles have a split instance");
  using Element = typename Traits::Element;
  using MainloopPipeline = typename Traits::MainloopPipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  constexpr bool kHeadInLoop = hopper_fwd_head_in_loop(
      Traits::kTile, Traits::kHeadDim > kHeadDimV ? Traits::kHeadDim : kHeadDimV, kIsBand);
  FwdParams const& params = kp.fwd;
  FtFwdParams const& p = params.abi;
  int const q_shift = kQShift<Traits, kIsBand> ? kp.q_shift : 0;
  TileScheduler<kIsBand, kClusterM, kSplit> const sched{kp.num_m_blocks, kp.pack > 1 ? p.num_heads_k : p.num_heads, p.batch,
                                                kp.heads_per_section, kp.lead_pairs, kp.lead_group, p.tile_counter,
                                                kp.num_whole, kp.splits};

  extern __shared__ __align__(1024) char smem_buf[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutVt{});

  int const warp_group_idx = cutlass::canonical_warp_group_idx();
  int const warp_idx = cutlass::canonical_warp_idx_sync();
  bool const lane_predicate = cute::elect_one_sync();
  if (warp_idx == 0 && lane_predicate) {
    cute::prefetch_tma_descriptor(kp.pack > 1 ? &kp.tma_q_packed : kp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
  }
  bool const producer = warp_group_idx == 0;
  // PipelineQ is a type of its own when kQStages != kStages; under kQParts each part is one warpgroup's.
  constexpr int kQParts = Traits::kQParts;
  typename Traits::PipelineQ pipeline_q(
      ss.pipeline_q,
      tma_pipeline_params<typename Traits::PipelineQ>(producer, Traits::kNMmaThreads / kQParts, kp.tma_bytes_q / kQParts),
      Shape<_1, _1, _1>{});
  // The pipeline state of part `part` of the Q stage `state` tracks.
  auto q_part = [](typename Traits::PipelineStateQ const& state, int part) {
    return typename Traits::PipelineQ::PipelineState(kQParts * state.index() + part, state.phase(), state.count());
  };
  // K/V: a stage is free again once the consumers of every CTA of the cluster have released it (the
  // pipeline spreads each warpgroup's release over the cluster's CTAs); the transaction bytes stay a
  // whole block, since every CTA receives all of it.
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
  MainloopPipeline pipeline_k(
      ss.pipeline_k, tma_pipeline_params<MainloopPipeline>(producer, Traits::kNMmaThreads, Traits::kTmaBytesK), ClusterShape{});
  MainloopPipeline pipeline_v(
      ss.pipeline_v, tma_pipeline_params<MainloopPipeline>(producer, Traits::kNMmaThreads, Traits::kTmaBytesV), ClusterShape{});
  // Q is the CTA's own: its stages are released by arrivals on this CTA's barrier. (PipelineTmaAsync
  // built for a cluster of one would send them to the cluster's first CTA.)
  // A consumer warpgroup releases its own part.
  auto release_q = [&](int stage) {
    ss.pipeline_q.empty_barrier_[kQParts * stage + (kQParts > 1 ? warp_group_idx - 1 : 0)].arrive();
  };
  using Handoff = TileHandoff<kSplit>;
  Handoff const handoff{ss.handoff, ss.handoff_split};
  if (threadIdx.x == 0) {
    handoff.init(Traits::kNMmaThreads);
    // One arrival per consumer warpgroup of every CTA: a multicast V load writes all of them.
    if constexpr (Traits::kOOverV) { ss.o_free.init(Traits::kNMmaWarpGroups * kClusterM); }
  }
  cutlass::arch::fence_barrier_init();
  if constexpr (kClusterM > 1) {
    // The other CTAs' multicast loads and releases reach this CTA's barriers: all initialized first.
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }

  // The overlapped schedule issues block n - 1's S GEMM before block n's PV GEMM, so with one Q stage
  // (d 192 / 256) and no band mask the producer loads K(n - 1) before V(n): a tile's second S GEMM
  // then waits for one V block fewer (H100: d 256 +1-5%, d 192 +3-6% at 512-1k, neutral above).
  // Under band masks the d 256 kernels take it per launch (k_ahead: short keys) and the d 192 ones
  // never (HopperFwdTile::band_k_ahead, hopper_fwd_k_ahead_band); with two Q stages (d <= 128) it
  // measured neutral to -2.6% (benchmarks/NOTES.md, sessions 34-35). Elsewhere K and V of each block
  // load in turn.
  constexpr bool kKAheadStates = kKAhead<Traits, kIsBand> || kKAheadBand<Traits, kIsBand>;
  bool const k_ahead = kKAhead<Traits, kIsBand> || (kKAheadBand<Traits, kIsBand> && kp.k_ahead != 0);
  if (warp_group_idx == 0) {
    // ---------------------------------------------------------------- producer (warp 0)
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp_idx != 0) { return; }
    Tensor mQ = kp.tma_q.get_tma_tensor(kp.shape_q);
    Tensor mK = kp.tma_k.get_tma_tensor(kp.shape_k);
    Tensor mV = kp.tma_v.get_tma_tensor(kp.shape_v);
    // K and V stages are written in the same order; under k_ahead the K loads run one block ahead.
    // Kernels that may take that order keep V on a state of its own (in the per-block order it
    // advances with K's), the others one state for both.
    PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
    PipelineState own_state_v = write_state;
    PipelineState& write_state_v = kKAheadStates ? own_state_v : write_state;
    int const cluster_rank = sched.cluster_rank();
    uint16_t const mcast_mask = (1u << kClusterM) - 1;  // K/V slices go to every CTA of the cluster
    typename Traits::PipelineStateQ q_write_state(0, 1, 0);  // producer start: every stage free
    // kOOverV: parity of the o_free phase the next tile's V loads wait for (the first passes at once).
    uint32_t o_phase = 1;
    auto produce_tile = [&](TileWork const& w, auto const& after_first_block) {
      int const bidh_k = kp.pack > 1 ? w.coord.bidh : w.coord.bidh / params.h_h_k_ratio;
      Tensor mQh = domain_offset(make_coord(w.seq.q_row0, _0{}), mQ(_, _, w.coord.bidh, p.cu_seqlens_q ? 0 : w.coord.bidb));
      Tensor gK = local_tile(domain_offset(make_coord(w.seq.k_row0, _0{}), mK(_, _, bidh_k, p.cu_seqlens_k ? 0 : w.coord.bidb)),
                             select<1, 2>(typename Traits::TileShapeQK{}), make_coord(_, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(w.seq.k_row0, _0{}), mV(_, _, bidh_k, p.cu_seqlens_k ? 0 : w.coord.bidb)),
                             select<2, 1>(typename Traits::TileShapePV{}), make_coord(_, _0{}));
      auto const tK = tma_partition(kp.tma_k, cluster_rank, Layout<Int<kClusterM>>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto const tV = tma_partition(kp.tma_v, cluster_rank, Layout<Int<kClusterM>>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

      auto load_k = [&](int n) {
        pipeline_k.producer_acquire(write_state);
        if (lane_predicate) {
          copy(kp.tma_k.with(*pipeline_k.producer_get_barrier(write_state), mcast_mask), get<0>(tK)(_, n),
               get<1>(tK)(_, write_state.index()));
        }
        if constexpr (kKAheadStates) { ++write_state; }
      };
      auto load_v = [&](int n) {
        pipeline_v.producer_acquire(write_state_v);
        if (lane_predicate) {
          copy(kp.tma_v.with(*pipeline_v.producer_get_barrier(write_state_v), mcast_mask), get<0>(tV)(_, n),
               get<1>(tV)(_, write_state_v.index()));
        }
        ++write_state_v;
      };

      // The first K block goes out before the Q stage may have to wait for an earlier tile's O (or,
      // under kOOverV, for its last S GEMM).
      int n_block = w.n_block_max - 1;
      load_k(n_block);
      Element* const q_stage = ss.smem_q.data() + q_write_state.index() * (cosize_v<typename Traits::SmemLayoutQ> / Traits::kQStages);
      if (kp.pack > 1) {
        // Whole, on part 0's barrier (armed for all of the tile's bytes), once every part is free.
        pipeline_q.producer_acquire(q_part(q_write_state, 0));
        CUTE_UNROLL
        for (int h = 1; h < kQParts; ++h) {
          ss.pipeline_q.empty_barrier_[kQParts * q_write_state.index() + h].wait(q_write_state.phase());
        }
        if constexpr (kQParts > 1) {
          pipeline_q.producer_expect_transaction(q_part(q_write_state, 0), kp.tma_bytes_q - kp.tma_bytes_q / kQParts);
        }
        if (lane_predicate) {
          load_q_packed<Traits>(kp.tma_q_packed, pipeline_q.producer_get_barrier(q_part(q_write_state, 0)), q_stage,
                                int(w.seq.q_row0) + w.coord.m_block * kp.q_per_tile, bidh_k, p.cu_seqlens_q ? 0 : w.coord.bidb);
        }
      } else if constexpr (kQParts == 1) {
        Tensor gQ = local_tile(mQh, select<0, 2>(typename Traits::TileShapeQK{}), make_coord(w.coord.m_block, _0{}));
        auto [tQgQ, tQsQ] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        pipeline_q.producer_acquire(q_write_state);
        if (lane_predicate) {
          copy(kp.tma_q.with(*pipeline_q.producer_get_barrier(q_write_state), 0), tQgQ, tQsQ(_, q_write_state.index()));
        }
      } else {
        // Part h: rows [64 h, 64 h + 64) of every column chunk (chunks are block_m rows apart), one
        // TileShapeQLoad box each.
        Tensor gQ = local_tile(mQh, typename Traits::TileShapeQLoad{}, make_coord(_, _));
        constexpr int kChunk = Traits::kQChunkCols;
        CUTE_UNROLL
        for (int h = 0; h < kQParts; ++h) {
          pipeline_q.producer_acquire(q_part(q_write_state, h));
          if (lane_predicate) {
            CUTE_UNROLL
            for (int c = 0; c < Traits::kHeadDim / kChunk; ++c) {
              Tensor sQb = make_tensor(make_smem_ptr(q_stage + (c * kBlockM + 64 * h) * kChunk), typename Traits::SmemLayoutQLoad{});
              auto [tg, ts] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQb),
                                            group_modes<0, 2>(gQ(_, _, kQParts * w.coord.m_block + h, c)));
              copy(kp.tma_q.with(*pipeline_q.producer_get_barrier(q_part(q_write_state, h)), 0), tg, ts);
            }
          }
        }
      }
      ++q_write_state;
      if (k_ahead && n_block > w.n_block_min) { load_k(n_block - 1); }
      if constexpr (Traits::kOOverV) {
        ss.o_free.wait(o_phase);  // the previous tile's O has left the V stages
        o_phase ^= 1;
      }
      load_v(n_block);
      after_first_block();
      for (--n_block; n_block >= w.n_block_min; --n_block) {
        if (k_ahead) {
          if (n_block > w.n_block_min) { load_k(n_block - 1); }
        } else {
          load_k(n_block);
        }
        load_v(n_block);
      }
    };
    auto handoff_state = Handoff::producer_start_state();
    int const leader_lane = __ffs(__ballot_sync(0xffffffff, lane_predicate)) - 1;
    int const num_tiles = sched.num_tiles();
    TileCoord coord = sched.tile(sched.first());
    for (int idx = sched.first(); idx < num_tiles;) {
      // The next index is fetched first so the atomic's latency hides behind this tile's first loads,
      // and the next tile is published once they are out: its index math (several hundred cycles under
      // band masks) then runs while the producer waits for stages, not between this tile's last load
      // and the next tile's first ones.
      int next = 0;
      if (lane_predicate) { next = sched.fetch_next(idx); }
      TileWork const w = make_tile_work<Traits, kIsBand, kSplit>(params, coord, kp.q_per_tile, kp.blocks_per_part, q_shift);
      auto publish = [&] {
        idx = __shfl_sync(0xffffffff, next, leader_lane);
        coord = idx < num_tiles ? sched.tile(idx) : Handoff::kDone;
        handoff.producer_publish(handoff_state, coord, lane_predicate);
      };
      if (w.active) {
        produce_tile(w, publish);
      } else {
        publish();
      }
    }
    if constexpr (kClusterM > 1) {
      // Stay until every stage has been released by all CTAs of the cluster: no release from another
      // CTA may arrive here after this CTA has exited.
      pipeline_k.producer_tail(write_state);
      pipeline_v.producer_tail(write_state_v);
      if constexpr (Traits::kOOverV) { ss.o_free.wait(o_phase); }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  constexpr int kQStageElems = int(cosize_v<typename Traits::SmemLayoutQ>) / Traits::kQStages;
  int const thread_idx = int(threadIdx.x) - 128;
  int const wg = warp_group_idx - 1;  // this consumer warpgroup, 0-based
  ConsumerPipeline<MainloopPipeline, kClusterM> const consumer_k{pipeline_k, ss.pipeline_k};
  ConsumerPipeline<MainloopPipeline, kClusterM> const consumer_v{pipeline_v, ss.pipeline_v};
  int const wg_thread = thread_idx % 128;
  bool const store_leader = wg_thread == 0;  // issues the warpgroup's TMA stores
  typename Traits::TiledMmaQK tiled_mma_qk;  // partitioning only; the mainloop owns the MMA state
  typename Traits::TiledMmaPV tiled_mma_pv;
  auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
  auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
  // Shared-memory operands (WGMMA descriptors) depend only on the warpgroup: sliced by its first
  // thread, with `wg` warp-uniform (a shuffle), so the descriptors live in uniform registers. Sliced
  // by thread_idx they were computed per thread and moved over with R2UR at every GEMM.
  auto wg_mma_qk = tiled_mma_qk.get_slice(wg * cutlass::NumThreadsPerWarpGroup);
  auto wg_mma_pv = tiled_mma_pv.get_slice(wg * cutlass::NumThreadsPerWarpGroup);
  Tensor tSrQ = wg_mma_qk.partition_fragment_A(sQ);
  Tensor tSrK = wg_mma_qk.partition_fragment_B(sK);
  Tensor tOrV = wg_mma_pv.partition_fragment_B(sVt);
  Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapeQK{})));
  Tensor tOcO = rowcol(thr_mma_pv.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapePV{}))));
  constexpr int kRowsPerThread = decltype(size<0>(tOcO))::value;

  PipelineState read_state;
  typename Traits::PipelineStateQ q_read_state;
  typename Handoff::State handoff_state;
  PingPong<Traits> const turn{warp_group_idx};

  // The next tile with work, from `coord` on; tiles whose rows see no key are written on the way.
  auto next_work = [&](TileCoord coord, TileWork& w) {
    for (; coord.m_block >= 0; coord = handoff.consumer_receive(handoff_state)) {
      w = make_tile_work<Traits, kIsBand, kSplit>(params, coord, kp.q_per_tile, kp.blocks_per_part, q_shift);
      if (!w.in_range) { continue; }
      if (w.active) { return true; }
      write_empty_tile<Element, kBlockM>(params, w.sequence(q_shift), w.coord.m_block, w.coord.bidh, w.coord.bidb,
                                         thread_idx, Traits::kNMmaThreads, kp.pack, kp.q_per_tile, q_shift);
    }
    return false;
  };

  // kOOverV: this warpgroup's O has left the V stages (one thread), on every CTA of the cluster.
  auto release_o = [&] {
    if constexpr (kClusterM == 1) {
      ss.o_free.arrive();
    } else {
      CUTE_UNROLL
      for (int r = 0; r < kClusterM; ++r) { ss.o_free.arrive(r); }
    }
  };
  // Every thread of the warpgroup has read its staged O rows: the staging buffer is released. The
  // proxy fence orders this thread's generic stores to the buffer before the TMA loads that refill it.
  auto staged_o_read = [&](int q_stage, int barrier) {
    cutlass::arch::fence_view_async_shared();
    if constexpr (Traits::kOOverV) {
      cutlass::arch::NamedBarrier::sync(128, barrier);
      if (store_leader) { release_o(); }
    } else {
      release_q(q_stage);
    }
  };
  // A TMA store in flight (store_leader only) still reads its staging buffer (Q stage store_q_stage,
  // or under kOOverV the V stages: store_q_stage >= 0 then only marks the store pending), which is
  // released once it has.
  int store_q_stage = -1;
  auto finish_store = [&] {
    if (store_q_stage >= 0) {
      tma_store_wait<0>();
      if constexpr (Traits::kOOverV) {
        release_o();
      } else {
        release_q(store_q_stage);
      }
      store_q_stage = -1;
    }
  };

  // Tail split (overlap schedule, no band mask): each consumer warpgroup writes its part of a split
  // tile, O (normalized) and its rows' LSE, to a record of its own in split_accum, one float4 column
  // per thread (coalesced), and counts the part on the tile's counter for its rows. The part that
  // counts last reads every part's record back, its own included, so that the sum runs in part order
  // whichever part finishes last (the same bits on every run), and leaves the combined rows in tOrO
  // and lse for the epilogue. Returns whether this warpgroup holds them.
  auto combine_parts = [&](TileCoord const c, auto& tOrO, auto& lse) {
    constexpr int kNWG = Traits::kNMmaWarpGroups;
    Tensor out = rowcol(tOrO);
    constexpr int kCols = decltype(size<1>(out))::value;
    constexpr int kChunks = kRowsPerThread * kCols / 4;  // float4 of O per thread, then one of LSE
    static_assert(kCols % 4 == 0 && kRowsPerThread <= 4, "a record row is whole float4");
    static_assert(4 * (kChunks + 1) == hopper_fwd_split_record_floats(Traits::kHeadDimV),
                  "the launcher sizes records by hopper_fwd_split_record_floats");
    int const splits = kp.splits;
    int const part = c.split & 0xffff;
    int const slot = (c.split >> 16) * kClusterM + sched.cluster_rank();
    float4* const records = reinterpret_cast<float4*>(p.split_accum) + (int64_t(slot) * splits * kNWG + wg) * 128 * (kChunks + 1);
    auto record = [&](int i) { return records + int64_t(i) * kNWG * 128 * (kChunks + 1) + wg_thread; };
    float4* const mine = record(part);
    CUTE_UNROLL
    for (int q = 0; q < kChunks; ++q) {
      int const r = 4 * q / kCols, c0 = 4 * q % kCols;
      __stcg(mine + q * 128, make_float4(out(r, c0), out(r, c0 + 1), out(r, c0 + 2), out(r, c0 + 3)));
    }
    float l[4] = {0.f, 0.f, 0.f, 0.f};
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) { l[r] = lse(r); }
    __stcg(mine + kChunks * 128, make_float4(l[0], l[1], l[2], l[3]));
    // One thread counts the part with acquire-release semantics at GPU scope, between two barriers of
    // the warpgroup: the barrier orders every thread's record stores before the count's release, and
    // the count's acquire before every thread's loads of the other records (rather than a
    // __threadfence per thread: MEMBAR.SC.GPU with an L1 invalidation, 256 of them per part).
    int const barrier = int(FwdNamedBarrier::kEpilogue1) + wg;
    cutlass::arch::NamedBarrier::sync(128, barrier);
    bool last = false;
    if (wg_thread == 0) {
      int* const counter = p.tile_counter + 1 + slot * kNWG + wg;
      last = atomic_add_acq_rel_gpu(counter, 1) == splits - 1;
      if (last) { atomicExch(counter, 0); }  // zero again for the next launch
    }
    if (!named_barrier_or(128, barrier, last)) { return false; }
    float lmax[kRowsPerThread], lsum[kRowsPerThread];
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) { lmax[r] = -INFINITY, lsum[r] = 0.f; }
    auto part_lse = [&](int i, int r) {
      float4 const v = __ldcg(record(i) + kChunks * 128);
      return r == 0 ? v.x : r == 1 ? v.y : r == 2 ? v.z : v.w;
    };
#pragma unroll 1
    for (int i = 0; i < splits; ++i) {
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) { lmax[r] = fmaxf(lmax[r], part_lse(i, r)); }
    }
#pragma unroll 1
    for (int i = 0; i < splits; ++i) {
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) {
        lsum[r] += lmax[r] == -INFINITY ? 0.f : expf(part_lse(i, r) - lmax[r]);
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) { lse(r) = lmax[r] == -INFINITY ? -INFINITY : lmax[r] + logf(lsum[r]); }
    clear(tOrO);
#pragma unroll 1
    for (int i = 0; i < splits; ++i) {
      float w[kRowsPerThread];
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) { w[r] = lse(r) == -INFINITY ? 0.f : expf(part_lse(i, r) - lse(r)); }
      float4 const* const src = record(i);
      CUTE_UNROLL
      for (int q = 0; q < kChunks; ++q) {
        int const r = 4 * q / kCols, c0 = 4 * q % kCols;
        float4 const v = __ldcg(src + q * 128);
        out(r, c0) += w[r] * v.x;
        out(r, c0 + 1) += w[r] * v.y;
        out(r, c0 + 2) += w[r] * v.z;
        out(r, c0 + 3) += w[r] * v.w;
      }
    }
    return true;
  };

  // -------------------------------------------------------------- epilogue
  // Overlap schedule: each warpgroup stores its own rows without meeting the other one. The sequence
  // geometry and the thread's fragment coordinates and staging addresses are recomputed here from the
  // tile's coordinates rather than kept live across the mainloop: at d = 256 (O: 128 registers) that
  // is what keeps the consumers within 240 registers without spills.
  // Rows are the sequence's here: a shifted tile's first row is m_block * kBlockM - q_shift.
  auto epilogue = [&](TileCoord const c, auto& softmax, auto& tOrO, typename Traits::PipelineStateQ q_state) {
    SeqInfo const seq(p, c.bidb);
    int const m_block = c.m_block, bidh = c.bidh, bidb = c.bidb;
    int const epi_thread = thread_idx_reread() - 128;
    Tensor tOcO = rowcol(tiled_mma_pv.get_thread_slice(epi_thread).partition_C(
        make_identity_tensor(select<0, 1>(typename Traits::TileShapePV{}))));
    Tensor out = rowcol(tOrO);
    Tensor lse = make_tensor<float>(Shape<Int<kRowsPerThread>>{});
    softmax.finalize(out, lse, params.scale_ln);
    if constexpr (kSplit) {
      if (c.split >= 0 && !combine_parts(c, tOrO, lse)) {
        release_q(q_state.index());  // another part stores the tile (kTailSplit: O is staged over Q)
        return;
      }
    }
    Tensor rO = convert_fragment<Element>(tOrO);
    if constexpr (Traits::kOOverV) {
      // The other warpgroup's last PV GEMM, the last reader of V, has completed.
      cutlass::arch::NamedBarrier::sync(256, fwd_vread_barrier(wg == 0 ? 1 : 0));
    }
    Element* const stage = Traits::kOOverV ? ss.smem_v.data() : ss.smem_q.data() + q_state.index() * kQStageElems;
    auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma_pv);
    auto smem_thr_o = smem_copy_o.get_thread_slice(epi_thread);
    copy(smem_copy_o, smem_thr_o.retile_S(rO),
         smem_thr_o.partition_D(as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(stage), typename Traits::SmemLayoutO{}))));
    int const wg_offset = typename Traits::SmemLayoutO{}(wg * 64, 0);  // this warpgroup's first row
    int const barrier = int(FwdNamedBarrier::kEpilogue1) + wg;
    if (kp.pack > 1) {
      int const q0 = m_block * kp.q_per_tile, h0 = bidh * kp.pack, rows_used = kp.pack * kp.q_per_tile;
      write_lse_packed(p.lse + seq.lse_offset(p, bidb), p.lse_head_stride, lse, tOcO, q0, h0, kp.pack, rows_used, seq);
      cutlass::arch::NamedBarrier::sync(128, barrier);
      store_o_rows_packed<typename Traits::SmemLayoutOWG>(
          stage + wg_offset, static_cast<Element*>(p.out) + seq.o_offset(p, bidb), p.o_row_stride, p.o_head_stride,
          wg * 64, q0, h0, kp.pack, rows_used, seq.seqlen_q, seq.seqlen_q_alloc, p.head_dim_v, wg_thread, 128);
      staged_o_read(q_state.index(), barrier);
      return;
    }
    write_lse(p.lse + seq.lse_offset(p, bidb) + bidh * p.lse_head_stride, lse, tOcO, m_block * kBlockM - q_shift, seq);

    int const row0 = m_block * kBlockM + wg * 64 - q_shift;
    if ((!kQShift<Traits, kIsBand> || row0 >= 0) && row0 + 64 <= seq.seqlen_q) {
      cutlass::arch::fence_view_async_shared();  // the stores above, before the TMA unit reads them
      cutlass::arch::NamedBarrier::sync(128, barrier);
      if (store_leader) {
        Tensor sOw = make_tensor(make_smem_ptr(stage + wg_offset), typename Traits::SmemLayoutOWG{});
        Tensor mO = kp.tma_o.get_tma_tensor(kp.shape_o);
        Tensor gO = local_tile(domain_offset(make_coord(seq.q_row0 - q_shift, _0{}), mO(_, _, bidh, p.cu_seqlens_q ? 0 : bidb)),
                               typename Traits::TileShapeOWG{}, make_coord(m_block * Traits::kNMmaWarpGroups + wg, _0{}));
        auto [tOgO, tOsO] = tma_partition(kp.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sOw), group_modes<0, 2>(gO));
        copy(kp.tma_o, tOsO, tOgO);
        tma_store_arrive();
        store_q_stage = q_state.index();
      } else if constexpr (!Traits::kOOverV) {
        release_q(q_state.index());
      }
      return;
    }
    cutlass::arch::NamedBarrier::sync(128, barrier);
    store_o_rows_from_smem<typename Traits::SmemLayoutOWG>(
        stage + wg_offset, static_cast<Element*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride, p.o_row_stride,
        row0, seq.seqlen_q, seq.seqlen_q_alloc, p.head_dim_v, wg_thread, 128);
    staged_o_read(q_state.index(), barrier);
  };

  auto make_mask = [&](TileWork const& w) {
    return BandMask{w.seq.seqlen_q, w.seq.seqlen_k, p.window_left, p.window_right, kp.pack, kp.q_per_tile};
  };
  if constexpr (!Traits::kIntraWGOverlap) {
    // Serial schedule (FLASHTILE_HOPPER_SCHEDULE 0 or 3): both warpgroups meet, read O back and store it with predicated
    // 16-byte stores.
    auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma_pv);
    auto smem_thr_o = smem_copy_o.get_thread_slice(thread_idx);
    typename Traits::GmemTiledCopyO gmem_copy_o;
    auto gmem_thr_o = gmem_copy_o.get_thread_slice(thread_idx);
    Tensor tOcOg = gmem_thr_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    // `continue` also goes through the hand-off (the loop's increment).
    for (TileCoord coord = sched.tile(sched.first()); coord.m_block >= 0; coord = handoff.consumer_receive(handoff_state)) {
      TileWork const w = make_tile_work<Traits, kIsBand, kSplit>(params, coord, kp.q_per_tile, kp.blocks_per_part, q_shift);
      if (!w.in_range) { continue; }
      if (!w.active) {
        write_empty_tile<Element, kBlockM>(params, w.seq, w.coord.m_block, w.coord.bidh, w.coord.bidb, thread_idx,
                                           Traits::kNMmaThreads, kp.pack, kp.q_per_tile);
        continue;
      }
      Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
      clear(tOrO);
      OnlineSoftmax<kRowsPerThread, Traits::kLazyRescale, Traits::kExpFmaPer16> softmax(params.scale_log2);
      pipeline_q.consumer_wait(q_read_state);
      serial_mainloop<Traits, kIsBand, kHasSoftcap>(consumer_k, consumer_v, read_state, tSrQ(_, _, _, q_read_state.index()),
                                                    tSrK, tOrV, tOrO, tScS, make_mask(w), softmax, params.softcap_scale,
                                                    w.coord.m_block, w.n_block_min, w.n_block_max, turn);
      SeqInfo const& seq = w.seq;
      int const m_block = w.coord.m_block, bidh = w.coord.bidh, bidb = w.coord.bidb;
      Tensor out = rowcol(tOrO);
      Tensor lse = make_tensor<float>(Shape<Int<kRowsPerThread>>{});
      softmax.finalize(out, lse, params.scale_ln);
      Tensor rO = convert_fragment<Element>(tOrO);
      Tensor sO = as_position_independent_swizzle_tensor(
          make_tensor(make_smem_ptr(ss.smem_q.data() + q_read_state.index() * kQStageElems), typename Traits::SmemLayoutO{}));
      copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
      if (kp.pack > 1) {
        int const q0 = m_block * kp.q_per_tile, h0 = bidh * kp.pack, rows_used = kp.pack * kp.q_per_tile;
        write_lse_packed(p.lse + seq.lse_offset(p, bidb), p.lse_head_stride, lse, tOcO, q0, h0, kp.pack, rows_used, seq);
        cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(FwdNamedBarrier::kEpilogue));
        store_o_rows_packed<typename Traits::SmemLayoutO>(
            ss.smem_q.data() + q_read_state.index() * kQStageElems, static_cast<Element*>(p.out) + seq.o_offset(p, bidb),
            p.o_row_stride, p.o_head_stride, 0, q0, h0, kp.pack, rows_used, seq.seqlen_q, seq.seqlen_q_alloc,
            p.head_dim_v, thread_idx, Traits::kNMmaThreads);
        release_q(q_read_state.index());
        ++q_read_state;
        continue;
      }
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
        release_q(q_read_state.index());
        store_o_tile(gmem_copy_o, tOrOg, tOgO, tOcOg, m_block * kBlockM, seq, p.head_dim_v);
      } else {
        store_o_tile_from_smem(gmem_copy_o, tOsO, tOgO, tOcOg, m_block * kBlockM, seq, p.head_dim_v);
        release_q(q_read_state.index());
      }
      ++q_read_state;
    }
  } else {
    TileWork w;
    bool const more = next_work(sched.tile(sched.first()), w);
    Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
    OnlineSoftmax<kRowsPerThread, Traits::kLazyRescale, Traits::kExpFmaPer16> softmax(params.scale_log2);
    auto new_scores = [&] { return partition_fragment_C(tiled_mma_qk, select<0, 1>(typename Traits::TileShapeQK{})); };
    Tensor tOrP = make_tensor<Element>(new_scores().layout());
    Tensor tOrPa = make_tensor(tOrP.data(), acc_to_a_layout(tOrP.layout()));
    PipelineState v_state;
    // This warpgroup's end of the tile's KV blocks (wg_block_max).
    int n_max_wg = 0;
    // Head turn of a tile: its first S GEMM, then that block's softmax (under kHeadInLoop the head
    // only skips blocks, restarts the softmax and clears O; overlap_body runs the first block). Blocks
    // masked whole for this warpgroup's rows come first in the walk: for each it takes its turn
    // without GEMMs and releases the K and V stages once they are full (an earlier release could land
    // in the phase of the stage's previous fill, which the other warpgroups may still be reading).
    // Each skipped block's K is released before its V is waited for: under k_ahead the producer issues
    // V(n) only after K(n - 1), whose stage the K of block n + 1 frees (in the per-block order V(n)
    // follows K(n) alone).
    auto skip_blocks = [&](TileWork const& t) {
      n_max_wg = wg_block_max<Traits, kIsBand>(p, t, wg, kp.q_per_tile, kp.pack);
      if constexpr (kWgSkip<Traits, kIsBand>) {
        // Under kOOverV the producer's next V load waits for this warpgroup's previous O store.
        if (n_max_wg < t.n_block_max) { finish_store(); }
        for (int n_block = t.n_block_max - 1; n_block >= n_max_wg; --n_block) {
          turn.wait_turn();
          turn.pass_turn(false);
          consumer_k.consumer_wait(read_state);
          consumer_k.consumer_release(read_state);
          consumer_v.consumer_wait(read_state);
          consumer_v.consumer_release(read_state);
          ++read_state;
        }
      }
    };
    auto head = [&](TileWork const& t) {
      skip_blocks(t);
      if constexpr (kHeadInLoop) {
        // The first block runs in overlap_body (kWithHead).
        softmax.restart();
        clear(tOrO);
        return;
      }
      Tensor tSrS = new_scores();
      turn.wait_turn();
      pipeline_q.consumer_wait(q_part(q_read_state, kp.pack > 1 ? 0 : wg * (kQParts > 1)));
      consumer_k.consumer_wait(read_state);
      wg_gemm<true, -1>(tiled_mma_qk, tSrQ(_, _, _, q_read_state.index()), tSrK(_, _, _, read_state.index()), tSrS);
      turn.pass_turn(false);
      finish_store();  // the previous tile's store (two Q stages, or O over V), under this GEMM
      warpgroup_wait<0>();
      consumer_k.consumer_release(read_state);
      if (Traits::kOOverV && n_max_wg - 1 == t.n_block_min) { release_q(q_read_state.index()); }  // one block
      first_block_softmax<Traits, kIsBand, kHasSoftcap>(tSrS, tOrP, tScS, make_mask(t), softmax, params.softcap_scale,
                                                        t.coord.m_block, n_max_wg - 1);
      clear(tOrO);
      v_state = read_state;
      ++read_state;
    };
    if (more) {
      turn.start();  // once: the turns run on across tiles
      head(w);
      while (true) {  // left by the break after the last tile
        overlap_body<Traits, kIsBand, kHasSoftcap, kHeadInLoop>(
            consumer_k, consumer_v, read_state, v_state, tSrQ(_, _, _, q_read_state.index()), tSrK, tOrV, tOrO, tOrP,
            tScS, make_mask(w), softmax, params.softcap_scale, w.coord.m_block, w.n_block_min, n_max_wg, turn,
            [&] {
              if constexpr (Traits::kOOverV) { release_q(q_read_state.index()); }
            },
            [&] { pipeline_q.consumer_wait(q_part(q_read_state, kp.pack > 1 ? 0 : wg * (kQParts > 1))); },
            [&] { finish_store(); });
        // Tail turn: the tile's last PV GEMM. The next tile's geometry is worked out under it: the
        // turn is passed on as if a tile follows whenever one was handed over, and if it proves to have
        // no work (nor any after it), an empty turn closes the ring as the last one would have. Every
        // warpgroup takes the same tiles, so all decide alike.
        TileCoord const nc = handoff.consumer_receive(handoff_state);
        turn.wait_turn();
        consumer_v.consumer_wait(v_state);
        wg_gemm<false, -1>(tiled_mma_pv, tOrPa, tOrV(_, _, _, v_state.index()), tOrO);
        turn.pass_turn(nc.m_block < 0);
        TileWork nw;
        bool const next = next_work(nc, nw);
        if (nc.m_block >= 0 && !next) {
          turn.wait_turn();
          turn.pass_turn(true);
        }
        warpgroup_wait<0>();
        consumer_v.consumer_release(v_state);
        if constexpr (Traits::kOOverV) {
          cutlass::arch::NamedBarrier::arrive(256, fwd_vread_barrier(wg));
        }
        epilogue(w.coord, softmax, tOrO, q_read_state);
        ++q_read_state;
        if constexpr (Traits::kQStages == 1 && !Traits::kOOverV) { finish_store(); }  // the next Q goes to this stage
        if (!next) { break; }
        w = nw;
        head(w);
      }
    }
  }
  finish_store();
}

}  // namespace flashtile::hopper
