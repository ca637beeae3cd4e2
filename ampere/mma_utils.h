// mma.sync helpers for the Ampere path: warp-level GEMMs that stream operands from shared memory
// through ldmatrix one k-slice ahead of the MMAs (whole tile, one row block, or column chunks, to
// bound the registers live in the main loops), ldmatrix sources addressed from one base register per
// tile (LdsmXorSource), the register-layout views that let the softmax
// address accumulators by (row, col) and feed P back as the A operand without shared memory, and
// predicated copies and masking that keep per-thread coordinates to one base register.
#pragma once

#include <climits>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "common/dq_accum_perm.h"
#include "common/mask.h"
#include "common/special_regs.h"

namespace flashtile::ampere {

using namespace cute;

// Named barriers as raw bar.sync / bar.arrive: cutlass::arch::NamedBarrier compiles to a trap below
// sm_90. Id 0 is __syncthreads'; kThreads counts every thread of the barrier, arrivals included.
template <int kThreads>
CUTE_DEVICE void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
CUTE_DEVICE void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// ldmatrix from a swizzled tile with XOR-folded addresses. tP is a thread's partition (CPY, M, K) of
// the tile's unswizzled layout (pointer: tile + t, t the thread's element offset; static layout L);
// the swizzled tile holds element e at Swz(e). When every L(0, m, k) = x + a with x only in Swz's
// target bits and a only above its source bits, and t has none of x's bits (ldmatrix partitions: a
// thread's column chunk lies below every k-slice offset), then
//   Swz(t + L(0, m, k)) = (Swz(t) ^ x) + a:
// one register, Swz(t), addresses the whole tile (one XOR per distinct x). The tiled copy's own
// addressing keeps one register per (m, k) combination the compiler cannot relate, 12-19 at hdim 128,
// all live through the main loop.
// The folding for swizzle Swz over Element-sized entries, shared by the XOR-folded loads and stores.
template <class Swz, class Element>
struct XorFold {
  static constexpr int kTarget = ((1 << Swz::num_bits) - 1) << Swz::num_base;
  static constexpr int kBelowSourceEnd = (1 << (Swz::num_base + Swz::num_shft + Swz::num_bits)) - 1;
  static constexpr int kBytes = int(sizeof(Element));

  // Whether a compile-time offset splits into x (target bits) + a (above the source bits).
  static constexpr bool foldable(int off) { return (off & kBelowSourceEnd & ~kTarget) == 0; }
  // Swz(t) in bytes, t the thread's element offset within the tile.
  CUTE_HOST_DEVICE static uint32_t base(int t) { return uint32_t(Swz{}(t) * kBytes); }
  // The byte address of entry t + off: tile + (Swz(t) ^ x) + a.
  CUTE_DEVICE static uint32_t address(uint32_t tile, uint32_t base, int off) {
    return tile + ((base ^ uint32_t((off & kTarget) * kBytes)) + uint32_t((off & ~kTarget) * kBytes));
  }
};

template <class Swz, class Layout>
constexpr bool ldsm_xor_foldable() {
  for (int m = 0; m < int(size<1>(Layout{})); ++m) {
    for (int k = 0; k < int(size<2>(Layout{})); ++k) {
      if (!XorFold<Swz, uint16_t>::foldable(int(Layout{}(0, m, k)))) { return false; }
    }
  }
  return true;
}

// ldmatrix.x4 from a 32-bit shared-memory address (CuTe's SM75 LDSM atoms take a reference and
// convert it back from a generic pointer).
template <bool kTrans>
CUTE_DEVICE void ldsm_x4(uint32_t addr, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3) : "r"(addr));
  }
}

template <class Swz, class Layout, class Element>
struct LdsmXorSource {
  static_assert(ldsm_xor_foldable<Swz, Layout>());
  uint32_t tile;  // shared-memory byte address of the tile
  uint32_t base;  // Swz(t) in bytes

  // ldmatrix of entries (m, k), m in [m0, m1), into tD(_, m, k), tD the copy's (CPY, M, K) view of
  // the register fragment.
  template <bool kTrans, class TensorD>
  CUTE_DEVICE void load(TensorD& tD, int m0, int m1, int k) const {
    CUTE_UNROLL
    for (int m = m0; m < m1; ++m) {
      Tensor d = recast<uint32_t>(tD(_, m, k));
      static_assert(decltype(size(d))::value == 4);
      ldsm_x4<kTrans>(XorFold<Swz, Element>::address(tile, base, Layout{}(0, m, k)), d(0), d(1), d(2), d(3));
    }
  }
};

// The XOR-folded view Folded<Swz, Layout, Element> (LdsmXorSource, StsXorTarget) of a tile (tile_layout:
// swizzle o layout), Layout being the thread's partition (partition(tensor)) of the unswizzled layout.
template <template <class, class, class> class Folded, class TileLayout, class Element, class Partition>
CUTE_DEVICE auto make_xor_folded(TileLayout const& tile_layout, Element* tile, Partition const& partition) {
  using Swz = decltype(get_swizzle_portion(tile_layout));
  using E = remove_cv_t<Element>;
  Tensor tP = partition(make_tensor(make_smem_ptr(tile), get_nonswizzle_portion(tile_layout)));
  Folded<Swz, remove_cvref_t<decltype(tP.layout())>, E> f;
  f.tile = cast_smem_ptr_to_uint(tile);
  f.base = XorFold<Swz, E>::base(int(raw_pointer_cast(tP.data()) - tile));
  return f;
}

// The same view with Swz(t) given (base_bytes, as make_xor_folded computed it).
template <template <class, class, class> class Folded, class TileLayout, class Element, class Partition>
CUTE_DEVICE auto xor_folded_with_base(TileLayout const& tile_layout, Element* tile, Partition const& partition,
                                      uint32_t base_bytes) {
  decltype(make_xor_folded<Folded>(tile_layout, tile, partition)) f;
  f.tile = cast_smem_ptr_to_uint(tile);
  f.base = base_bytes;
  return f;
}

// The LdsmXorSource of a tile for thread slice thr_copy.
template <class ThrCopy, class TileLayout, class Element>
CUTE_DEVICE auto make_ldsm_xor_source(ThrCopy const& thr_copy, TileLayout const& tile_layout, Element const* tile) {
  return make_xor_folded<LdsmXorSource>(tile_layout, tile, [&](auto const& t) { return thr_copy.partition_S(t); });
}

// The same source with Swz(t) given.
template <class ThrCopy, class TileLayout, class Element>
CUTE_DEVICE auto ldsm_xor_source_with_base(ThrCopy const& thr_copy, TileLayout const& tile_layout, Element const* tile,
                                           uint32_t base_bytes) {
  return xor_folded_with_base<LdsmXorSource>(tile_layout, tile, [&](auto const& t) { return thr_copy.partition_S(t); },
                                             base_bytes);
}

// An accumulator-layout fragment of 16-bit elements stored into a swizzled tile with XOR-folded
// addresses (as LdsmXorSource reads one): Layout is the thread's partition_C ((2 cols, 2 rows), MMA_M,
// MMA_N) of the tile's unswizzled layout, each column pair one 32-bit store; one register, Swz(t),
// addresses the whole tile.
template <class Swz, class Layout, class Element>
struct StsXorTarget {
  static constexpr bool foldable() {
    for (int r = 0; r < 2; ++r) {
      for (int m = 0; m < int(size<1>(Layout{})); ++m) {
        for (int n = 0; n < int(size<2>(Layout{})); ++n) {
          int const off = Layout{}(make_coord(make_coord(0, r), m, n));
          if (!XorFold<Swz, Element>::foldable(off)) { return false; }
          if (Layout{}(make_coord(make_coord(1, r), m, n)) != off + 1) { return false; }
        }
      }
    }
    return true;
  }
  static_assert(sizeof(Element) == 2 && foldable());
  uint32_t tile;  // shared-memory byte address of the tile
  uint32_t base;  // Swz(t) in bytes

  template <class TensorR>
  CUTE_DEVICE void store(TensorR const& tR) const {
    Tensor tR32 = recast<uint32_t>(tR);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      CUTE_UNROLL
      for (int m = 0; m < int(size<1>(Layout{})); ++m) {
        CUTE_UNROLL
        for (int n = 0; n < int(size<2>(Layout{})); ++n) {
          uint32_t const addr = XorFold<Swz, Element>::address(tile, base, Layout{}(make_coord(make_coord(0, r), m, n)));
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(tR32(make_coord(make_coord(0, r), m, n))));
        }
      }
    }
  }
};

// The StsXorTarget of a tile for MMA thread slice thr_mma.
template <class ThrMma, class TileLayout, class Element>
CUTE_DEVICE auto make_sts_xor_target(ThrMma const& thr_mma, TileLayout const& tile_layout, Element* tile) {
  return make_xor_folded<StsXorTarget>(tile_layout, tile, [&](auto const& t) { return thr_mma.partition_C(t); });
}

// The same target with Swz(t) given.
template <class ThrMma, class TileLayout, class Element>
CUTE_DEVICE auto sts_xor_target_with_base(ThrMma const& thr_mma, TileLayout const& tile_layout, Element* tile,
                                          uint32_t base_bytes) {
  return xor_folded_with_base<StsXorTarget>(tile_layout, tile, [&](auto const& t) { return thr_mma.partition_C(t); },
                                            base_bytes);
}

template <class T>
struct is_ldsm_xor_source : false_type {};
template <class Swz, class Layout, class Element>
struct is_ldsm_xor_source<LdsmXorSource<Swz, Layout, Element>> : true_type {};

// The same source for a copy of its tile `elems` elements further on (a stage of a multi-buffered
// tile: a whole number of swizzle periods, so the thread's offsets within it are unchanged).
template <class Swz, class Layout, class Element>
CUTE_DEVICE LdsmXorSource<Swz, Layout, Element> at_offset(LdsmXorSource<Swz, Layout, Element> src, int elems) {
  src.tile += uint32_t(elems * int(sizeof(Element)));
  return src;
}

template <class Engine, class Layout>
CUTE_DEVICE auto at_offset(Tensor<Engine, Layout> const& t, int elems) {
  return make_tensor(t.data() + elems, t.layout());
}

// The ldmatrix source of a shared-memory tile for a thread's copy slice: an LdsmXorSource (kXor) or
// the copy's own partition.
template <bool kXor, class ThrCopy, class TileLayout, class Element>
CUTE_DEVICE auto make_ldsm_source(ThrCopy const& thr_copy, TileLayout const& tile_layout, Element* tile) {
  if constexpr (kXor) {
    return make_ldsm_xor_source(thr_copy, tile_layout, tile);
  } else {
    return thr_copy.partition_S(make_tensor(make_smem_ptr(tile), tile_layout));
  }
}

template <class TiledCopy>
constexpr bool ldsm_is_trans() {
  using Traits = typename TiledCopy::Traits;
  static_assert(std::is_same_v<Traits, Copy_Traits<SM75_U16x8_LDSM_T>> ||
                std::is_same_v<Traits, Copy_Traits<SM75_U32x4_LDSM_N>>);
  return std::is_same_v<Traits, Copy_Traits<SM75_U16x8_LDSM_T>>;
}

// copy(tiled_copy, src(_, j, k), tD(_, j, k)) for j in [j0, j1): src is the copy's partition of the
// shared-memory tile (the tiled copy's own addressing) or an LdsmXorSource of it.
template <class TiledCopy, class Src, class TensorD>
CUTE_DEVICE void copy_entries(TiledCopy const& tiled_copy, Src const& src, TensorD& tD, int j0, int j1, int k) {
  if constexpr (is_ldsm_xor_source<Src>::value) {
    src.template load<ldsm_is_trans<TiledCopy>()>(tD, j0, j1, k);
  } else {
    CUTE_UNROLL
    for (int j = j0; j < j1; ++j) { copy(tiled_copy, src(_, j, k), tD(_, j, k)); }
  }
}

// copy(tiled_copy, src(_, _, k), tD(_, _, k)), as copy_entries.
template <class TiledCopy, class Src, class TensorD>
CUTE_DEVICE void copy_k_slice(TiledCopy const& tiled_copy, Src const& src, TensorD& tD, int k) {
  if constexpr (is_ldsm_xor_source<Src>::value) {
    copy_entries(tiled_copy, src, tD, 0, int(size<1>(tD)), k);
  } else {
    copy(tiled_copy, src(_, _, k), tD(_, _, k));
  }
}

// The default hook of the GEMMs below: nothing.
struct NoHook {
  CUTE_DEVICE void operator()() const {}
};

// acc = A * B^T with A and B both read from shared memory (S = Q K^T); each source is the copy's
// partition of the tile or an LdsmXorSource of it. hook() runs once the MMAs of k-slice kHookAt are
// issued (work whose instructions then issue while those MMAs execute).
template <int kHookAt = -1, class TensorAcc, class TensorRA, class TensorRB, class TensorSA, class TensorSB,
          class TiledMma, class CopyA, class CopyB, class ThrCopyA, class ThrCopyB, class Hook = NoHook>
CUTE_DEVICE void gemm_ss(TensorAcc& acc, TensorRA& tCrA, TensorRB& tCrB, TensorSA const& tCsA,
                         TensorSB const& tCsB, TiledMma const& tiled_mma, CopyA const& copy_a,
                         CopyB const& copy_b, ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b,
                         Hook&& hook = {}) {
  static_assert(kHookAt < decltype(size<2>(tCrA))::value);
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy_k_slice(copy_a, tCsA, tCrA_view, 0);
  copy_k_slice(copy_b, tCsB, tCrB_view, 0);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) {
      copy_k_slice(copy_a, tCsA, tCrA_view, k + 1);
      copy_k_slice(copy_b, tCsB, tCrB_view, k + 1);
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    if (k == kHookAt) { hook(); }
  }
}

// Row blocks [m0, m0 + kRowBlocks) (mode 1 of the A and accumulator partitions) of gemm_ss:
// acc(_, m, _) += A(m) * B^T. Fewer row blocks bound the accumulators live at once, at the cost of
// reading B once per call; every accumulator still sums over k in the same order. Sources as gemm_ss.
template <int kRowBlocks, class TensorAcc, class TensorRA, class TensorRB, class TensorSA, class TensorSB, class TiledMma,
          class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
CUTE_DEVICE void gemm_ss_rows(TensorAcc& acc, int m0, TensorRA& tCrA, TensorRB& tCrB, TensorSA const& tCsA,
                              TensorSB const& tCsB, TiledMma const& tiled_mma, CopyA const& copy_a,
                              CopyB const& copy_b, ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy_entries(copy_a, tCsA, tCrA_view, m0, m0 + kRowBlocks, 0);
  copy_k_slice(copy_b, tCsB, tCrB_view, 0);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) {
      copy_entries(copy_a, tCsA, tCrA_view, m0, m0 + kRowBlocks, k + 1);
      copy_k_slice(copy_b, tCsB, tCrB_view, k + 1);
    }
    CUTE_UNROLL
    for (int m = m0; m < m0 + kRowBlocks; ++m) {
      CUTE_UNROLL
      for (int n = 0; n < size<1>(tCrB); ++n) { cute::gemm(tiled_mma, tCrA(_, m, k), tCrB(_, n, k), acc(_, m, n)); }
    }
  }
}

// acc = A * B with A already in registers (O += P V) and B read from shared memory, in kNChunks
// column chunks: only one chunk's B slices are live at a time (A being in registers, this costs no
// extra shared-memory reads), and each accumulator still sums over k in order.
// hook() as in gemm_ss, after k-slice kHookAt of the first chunk.
template <int kNChunks = 1, int kHookAt = -1, class TensorAcc, class TensorRA, class TensorRB, class TensorSB,
          class TiledMma, class CopyB, class ThrCopyB, class Hook = NoHook>
CUTE_DEVICE void gemm_rs(TensorAcc& acc, TensorRA const& tCrA, TensorRB& tCrB, TensorSB const& tCsB,
                         TiledMma const& tiled_mma, CopyB const& copy_b, ThrCopyB const& thr_copy_b,
                         Hook&& hook = {}) {
  static_assert(kHookAt < decltype(size<2>(tCrA))::value);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  constexpr int kCopiesN = decltype(size<1>(tCrB_view))::value;
  constexpr int kAtomsPerCopy = decltype(size<1>(tCrB))::value / kCopiesN;  // MMA_N per copy along N
  static_assert(kCopiesN % kNChunks == 0);
  constexpr int kChunk = kCopiesN / kNChunks;
  CUTE_UNROLL
  for (int c = 0; c < kNChunks; ++c) {
    copy_entries(copy_b, tCsB, tCrB_view, c * kChunk, (c + 1) * kChunk, 0);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      if (k < size<2>(tCrA) - 1) {
        copy_entries(copy_b, tCsB, tCrB_view, c * kChunk, (c + 1) * kChunk, k + 1);
      }
      CUTE_UNROLL
      for (int n = c * kChunk * kAtomsPerCopy; n < (c + 1) * kChunk * kAtomsPerCopy; ++n) {
        CUTE_UNROLL
        for (int m = 0; m < size<1>(tCrA); ++m) { cute::gemm(tiled_mma, tCrA(_, m, k), tCrB(_, n, k), acc(_, m, n)); }
      }
      if (c == 0 && k == kHookAt) { hook(); }
    }
  }
}

// SM80 16x8 accumulator fragment ((2 cols, 2 rows), MMA_M, MMA_N) viewed as (rows, cols) =
// ((2, MMA_M), (2, MMA_N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout const& acc) {
  static_assert(rank(Layout{}) == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

template <class Tensor_>
CUTE_DEVICE auto rowcol(Tensor_&& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// Two adjacent 16x8 accumulator atoms hold exactly one 16x16 A-operand fragment, in A's register
// order: ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N / 2).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_a_layout(Layout const& acc) {
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Row block m of an fp32 accumulator ((2,2), MMA_M, MMA_N) converted into the same positions of `out`
// (each 16x8 atom's four values are contiguous: one four-wide conversion per atom).
template <class TensorAcc, class TensorOut>
CUTE_DEVICE void convert_rows(TensorAcc const& acc, TensorOut& out, int m) {
  using To = typename TensorOut::value_type;
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(cosize(layout<0>(acc)))::value == 4);
  cutlass::NumericArrayConverter<To, float, 4> convert;
  CUTE_UNROLL
  for (int n = 0; n < size<2>(acc); ++n) {
    *reinterpret_cast<cutlass::Array<To, 4>*>(&out(0, m, n)) =
        convert(*reinterpret_cast<cutlass::Array<float, 4> const*>(&acc(0, m, n)));
  }
}

// BandMask::apply for a fragment whose (row, col) coordinates tC is a partition of an identity
// tensor: the thread's base coordinate is folded into three limits per tile, and each element compares
// its compile-time offset in the partition against them. Three registers instead of one per distinct
// coordinate, which the compiler would otherwise hoist out of the main loop and keep live.
template <bool kIsBand, class TensorAcc, class TensorC>
CUTE_DEVICE void apply_mask(TensorAcc& acc, TensorC const& tC, BandMask const& mask, int row0, int col0) {
  auto const base = *tC.data();
  int const col_t = col0 + get<1>(base);
  // col - row - (seqlen_k - seqlen_q) = diag + (c - r) for an element at offset (r, c).
  int const diag = col_t - (row0 + get<0>(base)) - (mask.seqlen_k - mask.seqlen_q);
  int const col_end = mask.seqlen_k - col_t;                                           // masked: c >= col_end
  int const hi = mask.window_right >= 0 ? mask.window_right - diag : INT_MAX;          // masked: c - r > hi
  int const lo = mask.window_left >= 0 ? -mask.window_left - diag : INT_MIN;           // masked: c - r < lo
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    auto const off = tC.layout()(i);
    int const c = get<1>(off);
    bool masked = c >= col_end;
    if constexpr (kIsBand) { masked |= c - get<0>(off) > hi || c - get<0>(off) < lo; }
    if (masked) { acc(i) = -INFINITY; }
  }
}

// acc (the fp32 16x8-atom accumulator fragment of tiled_mma over a kRows x kD tile) added to the tile at
// g in DqAccumPerm<kD>'s order (red_add_dq_perm). The thread's coordinates come from a re-read thread
// index: derived once they were loop-invariant addresses, hoisted out of the walk and spilled. Read as
// non-negative (thread_idx_reread_in), its derivation takes shifts, not signed division: 17 fewer
// instructions per d 64 step, and the sm_90 d 128 kernel without a mask no longer spills (12 B before).
template <int kRows, int kD, class TensorAcc, class TiledMma>
CUTE_DEVICE void red_add_fragment_perm(TensorAcc const& acc, TiledMma const& tiled_mma, float* g) {
  auto const thr_mma = tiled_mma.get_thread_slice(thread_idx_reread_in<0, kMaxBlockThreads>());
  red_add_dq_perm<kD>(acc, thr_mma.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kD>>{})), g, 0);
}

// Per-column-group predicate of a tiled copy: tC is its (CPY, CPY_M, CPY_K) partition of an identity
// tensor over the tile; entry k says whether column group k lies below `cols` (the actual head dim).
template <class TensorC>
CUTE_DEVICE auto col_predicate(TensorC const& tC, int cols) {
  Tensor pred = make_tensor<bool>(make_shape(size<2>(tC)));
  CUTE_UNROLL
  for (int k = 0; k < size(pred); ++k) { pred(k) = get<1>(tC(0, 0, k)) < cols; }
  return pred;
}

// Global <-> shared tile copy with row and column predicates; elements outside the tensor are zeroed
// so that padded K/V rows cannot inject NaN through 0 * garbage. Rows are tested as their static
// offset in the partition against max_row less the thread's base row: one register for all of them.
template <bool kClearOob = true, class TiledCopy, class TensorS, class TensorD, class TensorC, class TensorP>
CUTE_DEVICE void copy_tile(TiledCopy const& tiled_copy, TensorS const& S, TensorD& D, TensorC const& identity,
                           TensorP const& col_pred, int max_row) {
  int const rows_left = max_row - get<0>(*identity.data());
  CUTE_UNROLL
  for (int m = 0; m < size<1>(S); ++m) {
    if (get<0>(identity.layout()(0, m, 0)) < rows_left) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(S); ++k) {
        if (col_pred(k)) {
          copy(tiled_copy, S(_, m, k), D(_, m, k));
        } else if constexpr (kClearOob) {
          clear(D(_, m, k));
        }
      }
    } else if constexpr (kClearOob) {
      clear(D(_, m, _));
    }
  }
}

}  // namespace flashtile::ampere
