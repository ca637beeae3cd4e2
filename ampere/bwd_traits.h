// Compile-time configuration of the Ampere-path backward kernel: tile shape and warp layouts (from the
// tile policy), the three mma.sync tiled MMAs, swizzled shared-memory tiles with the transposed views
// that the dK/dV and dQ GEMMs read through transposing ldmatrix, and the copy types.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "ampere/layouts.h"
#include "common/flash_api.h"
#include "common/tile_policy.h"

namespace flashtile::ampere {

using namespace cute;

// kLargeSmem: the tile for devices that allow more than sm_80's 163 KB per block; kSmallSmem: the
// tile for devices that allow less than the default one needs (tile policy).
template <class Element_, int kHeadDim_, int kHeadDimV_, bool kLargeSmem = false, bool kSmallSmem = false>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr BwdTile kTile = ampere_bwd_tile(kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV, kLargeSmem, kSmallSmem,
                                                       kHeadDim == kHeadDimV);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.num_warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kQStages = kTile.q_stages;
  static constexpr int kDpWholeArch = kTile.dp_whole_arch;
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0);
  static_assert(kBlockM % FT_BWD_SEMAPHORE_ROWS == 0, "dq_semaphore is indexed in units of FT_BWD_SEMAPHORE_ROWS");

  // Each warp takes 16 x 16 of every tile step (two 16x8 atoms along N: one x4 ldmatrix for B).
  template <int kWarpsM, int kWarps = kNWarps>
  using TiledMmaWarps = TiledMMA<MmaAtomF32<Element>, Layout<Shape<Int<kWarpsM>, Int<kWarps / kWarpsM>, _1>>,
                                 Tile<Int<16 * kWarpsM>, Int<16 * (kWarps / kWarpsM)>, _16>>;
  // kSdpSplit: S and dP each on half the warps (BwdTile::sdp_split).
  static constexpr bool kSdpSplit = kTile.sdp_split;
  static constexpr int kSdpWarps = kSdpSplit ? kNWarps / 2 : kNWarps;
  // kDkvSplit: dV on the S warps, dK on the dP warps (BwdTile::dkv_split); their tiles then coincide.
  static constexpr bool kDkvSplit = kTile.dkv_split;
  static_assert(!kDkvSplit || (kSdpSplit && kHeadDim == kHeadDimV));
  static constexpr int kDkvWarps = kDkvSplit ? kNWarps / 2 : kNWarps;
  using TiledMmaSdP = TiledMmaWarps<kTile.warps_m_sdp, kSdpWarps>;  // (block_m, block_n), K = d
  using TiledMmadKV = TiledMmaWarps<kTile.warps_n_dkv, kDkvWarps>;  // (block_n, d), K = block_m
  using TiledMmadQ = TiledMmaWarps<kTile.warps_m_dq>;    // (block_m, d),       K = block_n

  using SmemLayoutQ = SmemLayoutTile<kBlockM, kHeadDim>;
  using SmemLayoutdO = SmemLayoutTile<kBlockM, kHeadDimV>;
  using SmemLayoutK = SmemLayoutTile<kBlockN, kHeadDim>;
  using SmemLayoutV = SmemLayoutTile<kBlockN, kHeadDimV>;
  using SmemLayoutPdS = SmemLayoutTile<kBlockM, kBlockN>;
  // Transposed views: Q^T and dO^T are the B operands of dK/dV, P^T and dS^T their A operands, K^T
  // the B operand of dQ.
  using SmemLayoutQt = SmemLayoutTransposed<SmemLayoutQ, kBlockM, kHeadDim>;
  using SmemLayoutdOt = SmemLayoutTransposed<SmemLayoutdO, kBlockM, kHeadDimV>;
  using SmemLayoutKt = SmemLayoutTransposed<SmemLayoutK, kBlockN, kHeadDim>;
  using SmemLayoutPdSt = SmemLayoutTransposed<SmemLayoutPdS, kBlockM, kBlockN>;

  using SmemCopyAtom = Copy_Atom<SmemCopyAtomN, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SmemCopyAtomT, Element>;
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemTiledCopyQK = GmemTiledCopyAsync<Element, kNThreads, kHeadDim>;
  using GmemTiledCopyV = GmemTiledCopyAsync<Element, kNThreads, kHeadDimV>;
  using GmemTiledCopydK = GmemTiledCopyStore<Element, kNThreads, kHeadDim>;
  using GmemTiledCopydV = GmemTiledCopyStore<Element, kNThreads, kHeadDimV>;

  static constexpr int kSmemQ = cosize(SmemLayoutQ{});
  static constexpr int kSmemdO = cosize(SmemLayoutdO{});
  static constexpr int kSmemK = cosize(SmemLayoutK{});
  static constexpr int kSmemV = cosize(SmemLayoutV{});
  static constexpr int kSmemPdS = cosize(SmemLayoutPdS{});
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (kQStages * (kSmemQ + kSmemdO) + kSmemK + kSmemV + 2 * kSmemPdS) +
      int(sizeof(float)) * kQStages * 2 * kBlockM +  // D and LSE of each stage's rows
      int(sizeof(float)) * (kSdpSplit ? kBlockM * kBlockN : 0);  // P for the dP warps
};

}  // namespace flashtile::ampere
