// Shared-memory layouts and global-memory copy types shared by the Ampere-path kernels: swizzled
// row-major tiles (conflict-free for ldmatrix and 16-byte cp.async), their transposed views for
// operands read with transposing ldmatrix, and the 16-byte-vector thread layouts for global copies.
#pragma once

#include <cute/tensor.hpp>

namespace flashtile::ampere {

using namespace cute;

// 64-element (128 B) swizzled rows where the width allows, else 32 (hdim 96).
template <int kCols>
constexpr int kSmemRowElems = kCols % 64 == 0 ? 64 : 32;

template <int kCols>
using SmemLayoutAtom = decltype(composition(
    Swizzle<kSmemRowElems<kCols> == 64 ? 3 : 2, 3, 3>{},
    Layout<Shape<_8, Int<kSmemRowElems<kCols>>>, Stride<Int<kSmemRowElems<kCols>>, _1>>{}));

// A (kRows, kCols) row-major tile.
template <int kRows, int kCols>
using SmemLayoutTile = decltype(tile_to_shape(SmemLayoutAtom<kCols>{}, Shape<Int<kRows>, Int<kCols>>{}));

// The same memory seen as (kCols, kRows): element (c, r) is the tile's (r, c).
template <class TileLayout, int kRows, int kCols>
using SmemLayoutTransposed =
    decltype(composition(TileLayout{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));

// Global <-> shared copies of a (rows, kCols) tile: 16-byte vectors, one swizzle-atom row per group
// of kSmemRowElems / 8 threads.
template <class Element, int kNThreads, int kCols, class CopyOp>
using GmemTiledCopy = decltype(make_tiled_copy(
    Copy_Atom<CopyOp, Element>{},
    Layout<Shape<Int<kNThreads / (kSmemRowElems<kCols> * int(sizeof(Element)) / 16)>,
                 Int<kSmemRowElems<kCols> * int(sizeof(Element)) / 16>>,
           Stride<Int<kSmemRowElems<kCols> * int(sizeof(Element)) / 16>, _1>>{},
    Layout<Shape<_1, Int<16 / int(sizeof(Element))>>>{}));

template <class Element, int kNThreads, int kCols>
using GmemTiledCopyAsync = GmemTiledCopy<Element, kNThreads, kCols, SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>>;

template <class Element, int kNThreads, int kCols>
using GmemTiledCopyStore = GmemTiledCopy<Element, kNThreads, kCols, AutoVectorizingCopyWithAssumedAlignment<128>>;

// mma.sync atom for the element type, fp32 accumulation.
template <class Element>
using MmaAtomF32 = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                      MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                      MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

using SmemCopyAtomN = SM75_U32x4_LDSM_N;   // ldmatrix for K-major operands
using SmemCopyAtomT = SM75_U16x8_LDSM_T;   // transposing ldmatrix for MN-major operands

}  // namespace flashtile::ampere
