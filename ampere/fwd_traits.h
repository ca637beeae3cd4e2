// Compile-time configuration of the Ampere-path forward kernel: tile shape (from the tile policy),
// the mma.sync tiled MMA, swizzled shared-memory layouts and the copy atoms (cp.async for global ->
// shared, ldmatrix for shared -> registers).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/tile_policy.h"

namespace flashtile::ampere {

using namespace cute;

template <class Element_, int kHeadDim_, int kHeadDimV_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr FwdTile kTile = ampere_fwd_tile(kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.num_warps;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0);

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  // Warps tile the M dimension; each warp owns 16 rows of every M-subtile.
  using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

  // Swizzled row-major atoms: 64-element (128 B) rows where d allows, else 32 (hdim 96).
  template <int kD>
  static constexpr int kSmemRowElems = kD % 64 == 0 ? 64 : 32;
  template <int kD>
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSmemRowElems<kD> == 64 ? 3 : 2, 3, 3>{},
      Layout<Shape<_8, Int<kSmemRowElems<kD>>>, Stride<Int<kSmemRowElems<kD>>, _1>>{}));

  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom<kHeadDim>{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemLayoutAtom<kHeadDim>{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemLayoutAtom<kHeadDimV>{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  // V seen as (d_v, block_n) for O += P V, read with transposing ldmatrix.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = decltype(tile_to_shape(SmemLayoutAtom<kHeadDimV>{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global <-> shared: 16-byte vectors, a row of the swizzle atom per group of threads.
  static constexpr int kGmemElemsPerVec = 16 / sizeof(Element);
  template <int kD>
  using GmemThreadLayout = Layout<
      Shape<Int<kNThreads / (kSmemRowElems<kD> / kGmemElemsPerVec)>, Int<kSmemRowElems<kD> / kGmemElemsPerVec>>,
      Stride<Int<kSmemRowElems<kD> / kGmemElemsPerVec>, _1>>;
  using GmemVecLayout = Layout<Shape<_1, Int<kGmemElemsPerVec>>>;
  using GmemTiledCopyQK = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemThreadLayout<kHeadDim>{}, GmemVecLayout{}));
  using GmemTiledCopyV = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemThreadLayout<kHeadDimV>{}, GmemVecLayout{}));
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemThreadLayout<kHeadDimV>{}, GmemVecLayout{}));

  // Shared memory: O reuses Q's region once the last QK^T has been issued.
  static constexpr int kSmemQO = cute::max(cosize(SmemLayoutQ{}), cosize(SmemLayoutO{}));
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (kSmemQO + cosize(SmemLayoutK{}) + cosize(SmemLayoutV{}));
};

}  // namespace flashtile::ampere
