// Compile-time configuration of the Ampere-path forward kernel: tile shape (from the tile policy),
// the mma.sync tiled MMA, swizzled shared-memory layouts and the copy atoms (cp.async for global ->
// shared, ldmatrix for shared -> registers).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "ampere/layouts.h"
#include "common/tile_policy.h"

namespace flashtile::ampere {

using namespace cute;

// kWide, kSplit: the tile above hdim 128 (tile policy, ampere_fwd_tile_kind).
template <class Element_, int kHeadDim_, int kHeadDimV_, bool kWide = false, bool kSplit = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr FwdTile kTile = ampere_fwd_tile(kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV, kWide, kSplit);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.num_warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kWarpsN = kTile.warps_n;
  static constexpr int kWarpsM = kNWarps / kWarpsN;
  static constexpr bool kSplitN = kWarpsN > 1;  // P and the row maxima through shared memory
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0);
  static_assert(kWarpsN == 1 || kWarpsN == 2, "row maxima are exchanged between warp pairs");
  static_assert(kBlockM == 32 * kWarpsM || kWarpsN == 1);

  // Each warp owns 16 rows of every 16 * kWarpsM-row slice and, with kWarpsN = 2, 16 of every 32
  // key (S) or value (O) columns (two 16x8 atoms along N: one x4 ldmatrix for B). Warp w is at
  // (w % kWarpsM, w / kWarpsM): the pair sharing rows is (w, w + kWarpsM).
  using TiledMma = TiledMMA<MmaAtomF32<Element>, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;

  using SmemLayoutQ = SmemLayoutTile<kBlockM, kHeadDim>;
  using SmemLayoutK = SmemLayoutTile<kBlockN, kHeadDim>;
  using SmemLayoutV = SmemLayoutTile<kBlockN, kHeadDimV>;
  // V seen as (d_v, block_n) for O += P V, read with transposing ldmatrix.
  using SmemLayoutVt = SmemLayoutTransposed<SmemLayoutV, kBlockN, kHeadDimV>;
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutTile<kBlockM, kHeadDimV>;
  using SmemLayoutP = SmemLayoutTile<kBlockM, kBlockN>;

  using SmemCopyAtom = Copy_Atom<SmemCopyAtomN, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SmemCopyAtomT, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemTiledCopyQK = GmemTiledCopyAsync<Element, kNThreads, kHeadDim>;
  using GmemTiledCopyV = GmemTiledCopyAsync<Element, kNThreads, kHeadDimV>;
  using GmemTiledCopyO = GmemTiledCopyStore<Element, kNThreads, kHeadDimV>;

  // Shared memory: O reuses Q's region once the last QK^T has been issued.
  static constexpr int kSmemQO = cute::max(cosize(SmemLayoutQ{}), cosize(SmemLayoutO{}));
  // With kSplitN: P (block_m x block_n) and the pairs' row maxima / sums (fp32, [kWarpsN][kBlockM]).
  static constexpr int kSmemP = kSplitN ? int(cosize(SmemLayoutP{})) : 0;
  static constexpr int kSmemRowStats = kSplitN ? int(sizeof(float)) * kWarpsN * kBlockM : 0;
  static constexpr int kSmemTiles =
      int(sizeof(Element)) * (kSmemQO + cosize(SmemLayoutK{}) + cosize(SmemLayoutV{}) + kSmemP) + kSmemRowStats;
  // Per-thread constants read in the main loop rather than held in registers: ldmatrix bases of Q, K
  // and V^T (LdsmXorSource) and the thread index, and with kSplitN P's; [2 or 3][kNThreads] words.
  static constexpr int kSmemStash = (kSplitN ? 3 : 2) * kNThreads * 4;
  static constexpr int kSmemBytes = kSmemTiles + kSmemStash;
};

}  // namespace flashtile::ampere
