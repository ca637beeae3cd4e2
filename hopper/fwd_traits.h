// Compile-time configuration of the Hopper forward kernel: tile shape (from the tile policy),
// warpgroup roles, WGMMA tiled MMAs (S = Q K^T from shared memory; O += P V with P in registers and
// V read MN-major, no transpose), GMMA-swizzled shared-memory layouts, the K/V pipelines and the
// shared-storage struct.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/tile_policy.h"
#include "hopper/tile_scheduler.h"

// block_n 80 (d = 256) takes the 64 x 80 WGMMA atoms, which CuTe's op selectors offer only with this
// macro (cmake/cuda_flags.cmake); without it they would pick 64 x 16 and P could not feed the PV GEMM.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "flashtile's Hopper kernels need -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"
#endif

// Build-time override of FwdTraits::kOOverV: 0 stages O over the Q stage everywhere; -1 = policy.
#ifndef FLASHTILE_HOPPER_O_OVER_V
#define FLASHTILE_HOPPER_O_OVER_V -1
#endif

namespace flashtile::hopper {

using namespace cute;

// setmaxnreg only moves registers within the CTA's launch allocation (65536 / threads per thread, in
// steps of 8): warpgroup budgets summing to more would leave the consumers' increase waiting forever.
constexpr bool register_budgets_fit(int threads, int producer_regs, int consumer_regs, int consumer_warpgroups) {
  return producer_regs + consumer_warpgroups * consumer_regs <= (65536 / threads) / 8 * 8 * (threads / 128);
}

// GMMA K-major swizzle atom for rows of kCols 16-bit elements.
template <class T, int kCols>
using SmemAtomKMajor = std::conditional_t<
    kCols % 64 == 0, GMMA::Layout_K_SW128_Atom<T>,
    std::conditional_t<kCols % 32 == 0, GMMA::Layout_K_SW64_Atom<T>, GMMA::Layout_K_SW32_Atom<T>>>;

// kTall: the tile policy's tall tile (three consumer warpgroups) where the head dim has one.
template <class Element_, int kHeadDim_, int kHeadDimV_, bool kTall = false>
struct FwdTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr HopperFwdTile kTile = hopper_fwd_tile(kHeadDim, kHeadDimV, kTall);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kNMmaWarpGroups = kBlockM / 64;  // each consumer warpgroup owns 64 query rows
  static constexpr int kNMmaThreads = kNMmaWarpGroups * 128;
  static constexpr int kNThreads = kNMmaThreads + 128;  // + the producer warpgroup
  static constexpr int kProducerRegs = kTile.producer_regs;
  static constexpr int kConsumerRegs = kTile.consumer_regs;
  static_assert(register_budgets_fit(kNThreads, kProducerRegs, kConsumerRegs, kNMmaWarpGroups));
  static constexpr bool kIntraWGOverlap = kTile.intra_wg_overlap;
  static constexpr bool kPingPong = kTile.pingpong && kNMmaWarpGroups >= 2;
  static_assert(kNMmaWarpGroups <= 3, "named barriers exist for three consumer warpgroups");
  static constexpr bool kLazyRescale = kTile.lazy_rescale;
  static constexpr int kExpFmaPer16 = kTile.exp_fma_per16;
  static constexpr int kClusterM = kTile.cluster_m;
  static constexpr bool kPairedMask = kTile.paired_mask;

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kBlockN>>;
  using AtomLayoutMma = Layout<Shape<Int<kNMmaWarpGroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      AtomLayoutMma{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDimV>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutMma{}));

  // Q is double-buffered where shared memory allows (d <= 128; d = 192 with d_v = 128): the next
  // tile's Q loads while the current tile runs, so a tile never starts by waiting for its Q. The
  // policy's q_stages (three at d <= 64) is the most taken.
  static constexpr int kSmemQStageBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemKVBytes = kStages * kBlockN * (kHeadDim + kHeadDimV) * int(sizeof(Element));
  static constexpr int kSmemLimitBytes = 227 * 1024;  // sm_90 opt-in maximum per block
  static constexpr int q_stages_that_fit(int n) {
    return n > 1 && n * kSmemQStageBytes + kSmemKVBytes + 1024 > kSmemLimitBytes ? q_stages_that_fit(n - 1) : (n > 1 ? n : 1);
  }
  static constexpr int kQStages = q_stages_that_fit(kTile.q_stages);
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomKMajor<Element, kHeadDim>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomKMajor<Element, kHeadDim>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomKMajor<Element, kHeadDimV>{},
                                             Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));
  // V seen as the (d_v, block_n) B operand of O += P V: the same bytes, MN-major.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // O staging, over the tile's own Q stage: each consumer warpgroup reads only its own 64 rows of Q
  // and writes only its own rows of O, and the two layouts place a row at the same bytes, so they
  // never overlap in time. A warpgroup's rows (SmemLayoutOWG, at row 64 * wg) leave through a TMA
  // store when they are all in bounds, else through 16-byte stores of its 128 threads.
  // kOOverV (one Q stage, overlap schedule, two consumer warpgroups): O is staged over the V stages
  // instead, once both warpgroups' last PV GEMMs have completed, and the producer loads the next
  // tile's V only after O has left them. Q is then released after the tile's last S GEMM, so the next
  // tile's Q loads during the tile's last softmax, PV GEMM and epilogue rather than after them.
  // Measured on an H100 against O over Q: d = 256 +3-4% at 512, +1-2% at 1k, -1 to -2% at 4k; d = 192
  // +4-7% at 512-1k, +2-4% causal at 2k-16k (benchmarks/NOTES.md, session 15).
  static constexpr bool kOOverV = FLASHTILE_HOPPER_O_OVER_V != 0 && kQStages == 1 && kIntraWGOverlap &&
                                  kNMmaWarpGroups == 2;
  // Columns of one swizzle atom of Q (SmemAtomKMajor): the width of a GQA-packed Q load's box.
  static constexpr int kQChunkCols = kHeadDim % 64 == 0 ? 64 : kHeadDim % 32 == 0 ? 32 : 16;
  // Q parts: under kOOverV each consumer warpgroup's 64 rows of Q load and are released on their own
  // (a pipeline stage per warpgroup and Q stage, one TMA box per swizzle-atom column chunk of those
  // rows: 64 consecutive rows of a chunk are one contiguous run of SmemLayoutQ). The first warpgroup's
  // rows are then freed by its own last S GEMM and arrive after half the bytes: with one Q stage it
  // waited for the whole 64 KB at d = 256 at every tile start (benchmarks/NOTES.md, session 33). A
  // GQA-packed tile still loads whole, on the first part's barrier, which every warpgroup waits for.
  static constexpr int kQParts = kOOverV ? kNMmaWarpGroups : 1;
  using SmemLayoutQLoad = std::conditional_t<
      kQParts == 1, decltype(take<0, 2>(SmemLayoutQ{})),
      decltype(tile_to_shape(SmemAtomKMajor<Element, kHeadDim>{}, Shape<_64, Int<kQChunkCols>>{}))>;
  using TileShapeQLoad = std::conditional_t<kQParts == 1, Shape<Int<kBlockM>, Int<kHeadDim>>, Shape<_64, Int<kQChunkCols>>>;
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomKMajor<Element, kHeadDimV>{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  static_assert(cosize_v<SmemLayoutO> * int(sizeof(Element)) <= kSmemQStageBytes);
  static_assert(!kOOverV || cosize_v<SmemLayoutO> <= cosize_v<SmemLayoutV>);
  using SmemLayoutOWG = decltype(composition(SmemLayoutO{}, make_layout(Shape<_64, Int<kHeadDimV>>{}, Stride<_1, Int<kBlockM>>{})));
  using TileShapeOWG = Shape<_64, Int<kHeadDimV>>;

  // stmatrix: 8x8 16-bit blocks straight from the accumulator fragment (four per instruction).
  using SmemCopyAtomO = Copy_Atom<SM90_U32x4_STSM_N, Element>;
  // The serial schedule's epilogue: both warpgroups' rows through registers, 16-byte stores.
  static constexpr int kGmemElemsPerVec = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = (kHeadDimV % 64 == 0 ? 64 : 32) / kGmemElemsPerVec;
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
      Layout<Shape<Int<kNMmaThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kGmemElemsPerVec>>>{}));

  using MainloopPipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename MainloopPipeline::PipelineState;
  // A stage per Q part of each Q stage (part h of stage s: kQParts * s + h); the kernels track Q
  // stages (PipelineStateQ) and derive the part's state from them.
  using PipelineQ = cutlass::PipelineTmaAsync<kQStages * kQParts>;
  using PipelineStateQ = cutlass::PipelineState<kQStages>;

  struct SharedStorage {
    // O is staged over each Q stage (kOOverV: over smem_v).
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>> smem_v;
    alignas(16) TileHandoffStorage handoff;
    alignas(8) cutlass::arch::ClusterBarrier o_free;  // kOOverV: O has left the V stages
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename MainloopPipeline::SharedStorage pipeline_k;
    alignas(16) typename MainloopPipeline::SharedStorage pipeline_v;
    TileSplitSlots handoff_split;  // last: see TileHandoffStorage
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimitBytes);
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesV = kBlockN * kHeadDimV * sizeof(Element);
};

}  // namespace flashtile::hopper
