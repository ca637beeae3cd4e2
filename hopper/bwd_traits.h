// Compile-time configuration of the Hopper backward kernel: tile shape (from the tile policy), warpgroup
// roles, the five WGMMA tiled MMAs with their operand majors, the GMMA-swizzled shared-memory layouts
// (with the transposed views the dK/dV/dQ GEMMs read), the Q/dO pipelines and the shared storage.
//
// Two schedules, fixed by the tile:
//  kSwapSdP (block_n = 128, d <= 128): the warpgroups compute S^T = K Q^T and dP^T = V dO^T, each for
//    its own 64 keys, which are exactly the rows of dK/dV it accumulates. P^T and dS^T therefore stay
//    in registers as the A operands of dV += P^T dO and dK += dS^T Q (register-sourced WGMMA, issued
//    as soon as each is computed); only dS goes to shared memory (transposing stmatrix) for dQ.
//  otherwise (block_n = 64): S = Q K^T and dP = dO V^T split along their columns; P and dS go to
//    shared memory and every GEMM reads its operands there:
//      dV += P^T dO  A = P^T MN-major,  B = dO MN-major
//      dK += dS^T Q  A = dS^T MN-major, B = Q MN-major
// In both, dQ = dS K reads A = dS K-major and B = K MN-major from shared memory. The MN-major operands
// are the K-major tiles seen through a transposing composition: no copies.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/tile_policy.h"
#include "hopper/fwd_traits.h"

namespace flashtile::hopper {

using namespace cute;

// A (rows, cols[, stages]) K-major tile seen as (cols, rows[, stages]): the same bytes, MN-major.
template <class Layout, int kRows, int kCols>
using Transposed2 = decltype(composition(Layout{}, make_ordered_layout(Shape<Int<kCols>, Int<kRows>>{}, Step<_2, _1>{})));
template <class Layout, int kRows, int kCols, int kStages>
using Transposed3 = decltype(composition(
    Layout{}, make_ordered_layout(Shape<Int<kCols>, Int<kRows>, Int<kStages>>{}, Step<_2, _1, _3>{})));

template <class Element_, int kHeadDim_, int kHeadDimV_>
struct BwdTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr HopperBwdTile kTile = hopper_bwd_tile(kHeadDim, kHeadDimV);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kQStages = kTile.q_stages;
  static constexpr int kdOStages = kTile.do_stages;
  static constexpr int kNMmaWarpGroups = 2;
  static constexpr int kNMmaThreads = kNMmaWarpGroups * 128;
  static constexpr int kNThreads = kNMmaThreads + 128;  // + the producer warpgroup (loads, dQ writer)
  static constexpr int kProducerRegs = kTile.producer_regs;
  static constexpr int kConsumerRegs = kTile.consumer_regs;
  static_assert(register_budgets_fit(kNThreads, kProducerRegs, kConsumerRegs, kNMmaWarpGroups));

  // Warpgroups along the rows of each GEMM (the rest along its columns).
  static constexpr int kWgMSdP = kBlockM / 64 >= 2 ? 2 : 1;
  static constexpr int kWgMdKV = kBlockN / 64 >= 2 ? 2 : 1;
  static constexpr int kWgMdQ = kWgMSdP;
  static constexpr bool kSwapSdP = kWgMdKV == 2;
  static_assert(kBlockN % (64 * kWgMdKV) == 0 && kBlockM % (64 * kWgMSdP) == 0);

  // A warpgroup's share of a GEMM's N when kWgM warpgroups split its M (the rest split N).
  template <int kN, int kWgM>
  static constexpr int kWgCols = kN / (kNMmaWarpGroups / kWgM);
  template <int kM, int kN, int kK, int kWgM, GMMA::Major kMajorA, GMMA::Major kMajorB>
  using TiledMmaOf = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kM / kWgM>, Int<kWgCols<kN, kWgM>>, Int<kK>>,
                           kMajorA, kMajorB>(),
      Layout<Shape<Int<kWgM>, Int<kNMmaWarpGroups / kWgM>, _1>>{}));
  // dK/dV from P^T / dS^T in registers: M = the warpgroup's 64 keys, K = block_m queries.
  template <int kN>
  using TiledMmadKVRS = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kN>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // S^T / dP^T rows are keys, split between the warpgroups as dK/dV's are (std::conditional_t also
  // instantiates the unused branch, which kWgMdKV keeps a valid WGMMA shape).
  using TiledMmaSdP = std::conditional_t<kSwapSdP, TiledMmaOf<kBlockN, kBlockM, kHeadDim, kWgMdKV, GMMA::Major::K, GMMA::Major::K>,
                                         TiledMmaOf<kBlockM, kBlockN, kHeadDim, kWgMSdP, GMMA::Major::K, GMMA::Major::K>>;
  using TiledMmadK = std::conditional_t<kSwapSdP, TiledMmadKVRS<kHeadDim>,
                                        TiledMmaOf<kBlockN, kHeadDim, kBlockM, kWgMdKV, GMMA::Major::MN, GMMA::Major::MN>>;
  using TiledMmadV = std::conditional_t<kSwapSdP, TiledMmadKVRS<kHeadDimV>,
                                        TiledMmaOf<kBlockN, kHeadDimV, kBlockM, kWgMdKV, GMMA::Major::MN, GMMA::Major::MN>>;
  // dQ = dS K in kdQPasses column passes (d = 256: two), each staged before the next is issued, so
  // only one pass's accumulators are live beside the dK/dV ones (one pass spilled 56 B there).
  static constexpr int kdQPasses = kHeadDim > 192 ? 2 : 1;
  static constexpr int kdQCols = kHeadDim / kdQPasses;
  static_assert(kdQPasses == 1 || !kSwapSdP);
  // dQ added from the consumers' registers into the accumulator (DqAccumPerm order); otherwise
  // staged below for the dQ writer's TMA reduce-adds.
  static constexpr bool kdQRed = kTile.dq_red;
  using TiledMmadQ = TiledMmaOf<kBlockM, kdQCols, kBlockN, kWgMdQ, GMMA::Major::K, GMMA::Major::MN>;
  using TileShapedQ = Shape<Int<kBlockM>, Int<kdQCols>>;  // the C tile of one dQ pass

  // Q, dO and K are also MN-major B operands whose columns are split between the warpgroups (dK/dV
  // without kSwapSdP, dQ): the swizzle atom must divide a warpgroup's share (d = 192: 96 columns).
  // K's share is its columns of one dQ pass (d = 96 under kSwapSdP: 48, a 32-byte atom).
  template <int kCols>
  using SmemAtomQKV = SmemAtomKMajor<Element, kSwapSdP ? kCols : kCols / 2>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQKV<kHeadDim>{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomQKV<kHeadDimV>{}, Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kdOStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomKMajor<Element, kWgCols<kdQCols, kWgMdQ>>{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomQKV<kHeadDimV>{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  // dS is double-buffered under kSwapSdP, which lets a warpgroup write step s + 1's dS while the other
  // may still read step s's (no "dS free" barrier); the other schedule has one P and one dS tile.
  static constexpr int kdSStages = kSwapSdP ? 2 : 1;
  using SmemLayoutPdS = decltype(tile_to_shape(SmemAtomKMajor<Element, kBlockN>{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtomKMajor<Element, kBlockN>{},
                                              Shape<Int<kBlockM>, Int<kBlockN>, Int<kdSStages>>{}));
  using SmemLayoutQt = Transposed3<SmemLayoutQ, kBlockM, kHeadDim, kQStages>;
  using SmemLayoutdOt = Transposed3<SmemLayoutdO, kBlockM, kHeadDimV, kdOStages>;
  using SmemLayoutKt = Transposed2<SmemLayoutK, kBlockN, kHeadDim>;
  using SmemLayoutPdSt = Transposed2<SmemLayoutPdS, kBlockM, kBlockN>;
  using SmemLayoutdSt = Transposed3<SmemLayoutdS, kBlockM, kBlockN, kdSStages>;
  // fp32 dQ staging, swizzled, read by the TMA reduce-adds into the dq accumulator: the whole
  // (block_m, d) tile (dQ's column passes, d = 256, each into its own columns), in kdQParts parts,
  // each with its own buffer, barrier pair and reduce-add.
  //  kdQPerWg: one part per consumer warpgroup (the rows or columns of dQ its MMA owns), the buffers
  //    one after the other as a (block_m, d) tile;
  //  otherwise one part, the whole tile.
  static constexpr bool kdQLag = kSwapSdP && kTile.dq_lag;
  // HopperBwdTile::pingpong: the consumer warpgroups' GEMM turns (hopper/bwd_kernel.h); the staged dQ only.
  static constexpr bool kPingPong = kdQLag && kTile.pingpong && !kdQRed;
  static constexpr bool kdQPerWg = kSwapSdP && (kTile.dq_overlap || kdQLag);
  static constexpr int kdQParts = kdQPerWg ? kNMmaWarpGroups : 1;
  static_assert(kdQRed || kdQPasses == 1 || kQStages + kdOStages == 2,
                "d = 256 fits the whole dQ staging tile with one Q and one dO stage only");
  static constexpr bool kdQRowParts = kdQPerWg && kWgMdQ == kNMmaWarpGroups;
  static constexpr int kdQPartRows = kdQRowParts ? kBlockM / kdQParts : kBlockM;
  static constexpr int kdQPartCols = kdQRowParts ? kHeadDim : kHeadDim / kdQParts;
  static_assert(kdQParts <= 2 && kdQPartCols % 16 == 0);
  // Each warpgroup's part staged in register order and added by one bulk reduction into a DqAccumFrag
  // accumulator (HopperBwdTile::dq_frag): one column pass, parts of one warpgroup's 64 rows.
  static constexpr bool kdQFrag = kTile.dq_frag && kdQPerWg && kdQPasses == 1 && !kdQRed;
  static_assert(!kdQFrag || kdQPartRows == 64);
  // The accumulator's order for the postprocess: DqAccumFrag's column part width, 0 for the others.
  static constexpr int kdQFragCols = kdQFrag ? kdQPartCols : 0;
  static constexpr bool kdQSw128 = kdQPartCols % 32 == 0;
  using SmemAtomdQ = std::conditional_t<kdQSw128, GMMA::Layout_K_SW128_Atom<ElementAccum>,
                                        GMMA::Layout_K_SW64_Atom<ElementAccum>>;
  using SmemLayoutdQPart = decltype(tile_to_shape(SmemAtomdQ{}, Shape<Int<kdQPartRows>, Int<kdQPartCols>>{}));
  // Column parts are already consecutive in a (block_m, d) tile of column-major atoms; row parts
  // are a (part rows, d, parts) tile seen as (block_m, d).
  using SmemLayoutdQ = std::conditional_t<
      kdQRowParts,
      decltype(composition(tile_to_shape(SmemAtomdQ{}, Shape<Int<kdQPartRows>, Int<kHeadDim>, Int<kdQParts>>{}),
                           Layout<Shape<Shape<Int<kdQPartRows>, Int<kdQParts>>, Int<kHeadDim>>,
                                  Stride<Stride<_1, Int<kdQPartRows * kHeadDim>>, Int<kdQPartRows>>>{})),
      decltype(tile_to_shape(SmemAtomdQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}))>;
  // Bank conflicts of the dQ staging: a warp's 64-bit accumulator store covers rows 0-7 (lanes / 4)
  // of 8 columns, and a half-warp's rows 0-3 would share banks in pairs under the swizzle (128-byte:
  // rows r and r ^ 1; 64-byte: r and r ^ 2; ncu: half of the stores' wavefronts excessive). Under
  // kSwapSdP, where only the dQ GEMM reads dS, the queries are permuted within each 8-row group: dS
  // row j holds query perm(j), so accumulator row j is query perm(j) and is staged at its own row
  // perm(j), which puts a half-warp's rows in four distinct bank groups. The tile's rows in shared
  // and global memory keep their order. perm as bit strides (row bits 0, 1, 2, then the 8-row
  // groups); 128-byte: j -> 2 j0 + 4 j1 + j2, 64-byte: j -> j0 + 4 j1 + 2 j2 (its own inverse);
  // the identity under kdQRed and kdQFrag (nothing staged by rows).
  using RowBits = Shape<_2, _2, _2, Int<kBlockM / 8>>;
  using dQRowPerm = std::conditional_t<kdQRed || kdQFrag, Layout<RowBits, Stride<_1, _2, _4, _8>>,
                                       std::conditional_t<kdQSw128, Layout<RowBits, Stride<_2, _4, _1, _8>>,
                                                          Layout<RowBits, Stride<_1, _4, _2, _8>>>>;
  using dQRowPermInv =
      std::conditional_t<kdQSw128 && !kdQRed && !kdQFrag, Layout<RowBits, Stride<_4, _1, _2, _8>>, dQRowPerm>;

  using SmemCopyAtomPdS = Copy_Atom<SM90_U32x4_STSM_N, Element>;  // also dK/dV staging
  using SmemCopyAtomdSt = Copy_Atom<SM90_U16x8_STSM_T, Element>;  // dS^T fragment -> dS (m, n) tile
  using SmemCopyAtomdQ = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<64>, ElementAccum>;

  // dK/dV: 16-byte global stores from the staged tiles, by all consumer threads.
  template <int kCols>
  using GmemTiledCopyOf = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
      Layout<Shape<Int<kNMmaThreads / ((kCols % 64 == 0 ? 64 : 32) / 8)>, Int<(kCols % 64 == 0 ? 64 : 32) / 8>>,
             Stride<Int<(kCols % 64 == 0 ? 64 : 32) / 8>, _1>>{},
      Layout<Shape<_1, Int<16 / sizeof(Element)>>>{}));
  using GmemTiledCopydK = GmemTiledCopyOf<kHeadDim>;
  using GmemTiledCopydV = GmemTiledCopyOf<kHeadDimV>;

  using PipelineQ = cutlass::PipelineTmaAsync<kQStages>;
  using PipelinedO = cutlass::PipelineTmaAsync<kdOStages>;

  template <class T>
  struct NoSmem {
    CUTE_HOST_DEVICE T* data() { return nullptr; }
  };
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> smem_k;  // dK staged here at the end
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>> smem_v;  // dV staged here at the end
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>> smem_do;
    alignas(1024) std::conditional_t<kSwapSdP, NoSmem<Element>, cute::array_aligned<Element, cosize_v<SmemLayoutPdS>>> smem_p;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> smem_ds;
    alignas(1024) std::conditional_t<kdQRed, NoSmem<ElementAccum>, cute::array_aligned<ElementAccum, kBlockM * kHeadDim>> smem_dq;
    alignas(16) float smem_stats[2][2 * kBlockM];  // kSwapSdP: [step % 2][LSE (exp2 domain) rows, D rows]
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelinedO::SharedStorage pipeline_do;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "sm_90 allows 227 KB of shared memory per block");
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesdO = kBlockM * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * (kHeadDim + kHeadDimV) * sizeof(Element);
};

}  // namespace flashtile::hopper
