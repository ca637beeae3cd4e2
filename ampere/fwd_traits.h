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

// kWide: the wide tile above hdim 128 (tile policy, ampere_fwd_wide).
template <class Element_, int kHeadDim_, int kHeadDimV_, bool kWide = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr FwdTile kTile = ampere_fwd_tile(kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV, kWide);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.num_warps;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0);

  // Warps tile the M dimension; each warp owns 16 rows of every M-subtile.
  using TiledMma = TiledMMA<MmaAtomF32<Element>, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

  using SmemLayoutQ = SmemLayoutTile<kBlockM, kHeadDim>;
  using SmemLayoutK = SmemLayoutTile<kBlockN, kHeadDim>;
  using SmemLayoutV = SmemLayoutTile<kBlockN, kHeadDimV>;
  // V seen as (d_v, block_n) for O += P V, read with transposing ldmatrix.
  using SmemLayoutVt = SmemLayoutTransposed<SmemLayoutV, kBlockN, kHeadDimV>;
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutTile<kBlockM, kHeadDimV>;

  using SmemCopyAtom = Copy_Atom<SmemCopyAtomN, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SmemCopyAtomT, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemTiledCopyQK = GmemTiledCopyAsync<Element, kNThreads, kHeadDim>;
  using GmemTiledCopyV = GmemTiledCopyAsync<Element, kNThreads, kHeadDimV>;
  using GmemTiledCopyO = GmemTiledCopyStore<Element, kNThreads, kHeadDimV>;

  // Shared memory: O reuses Q's region once the last QK^T has been issued.
  static constexpr int kSmemQO = cute::max(cosize(SmemLayoutQ{}), cosize(SmemLayoutO{}));
  static constexpr int kSmemTiles = int(sizeof(Element)) * (kSmemQO + cosize(SmemLayoutK{}) + cosize(SmemLayoutV{}));
  // Per-thread constants read in the main loop rather than held in registers: ldmatrix bases of Q, K
  // and V^T (LdsmXorSource) and the thread index; [2][kNThreads] words.
  static constexpr int kSmemStash = 2 * kNThreads * 4;
  static constexpr int kSmemBytes = kSmemTiles + kSmemStash;
};

}  // namespace flashtile::ampere
