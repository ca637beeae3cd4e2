// mma.sync helpers for the Ampere path: warp-level GEMMs that stream operands from shared memory
// through ldmatrix one k-slice ahead of the MMAs, and the register-layout views that let the softmax
// address accumulators by (row, col) and feed P back as the A operand without shared memory.
#pragma once

#include <cute/tensor.hpp>

namespace flashtile::ampere {

using namespace cute;

// acc = A * B^T with A and B both read from shared memory (S = Q K^T).
template <class TensorAcc, class TensorRA, class TensorRB, class TensorSA, class TensorSB, class TiledMma,
          class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
CUTE_DEVICE void gemm_ss(TensorAcc& acc, TensorRA& tCrA, TensorRB& tCrB, TensorSA const& tCsA,
                         TensorSB const& tCsB, TiledMma const& tiled_mma, CopyA const& copy_a,
                         CopyB const& copy_b, ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) {
      copy(copy_a, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1));
      copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc = A * B with A already in registers (O += P V) and B read from shared memory.
template <class TensorAcc, class TensorRA, class TensorRB, class TensorSB, class TiledMma, class CopyB,
          class ThrCopyB>
CUTE_DEVICE void gemm_rs(TensorAcc& acc, TensorRA const& tCrA, TensorRB& tCrB, TensorSB const& tCsB,
                         TiledMma const& tiled_mma, CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) { copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1)); }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
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

// Fire-and-forget fp32 add to global memory (red.global.add: no value comes back, unlike the ATOM
// that atomicAdd can compile to, which costs a round trip and twice the L2 traffic).
CUTE_DEVICE void red_add(float* ptr, float value) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr), "f"(value) : "memory");
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
// so that padded K/V rows cannot inject NaN through 0 * garbage.
template <bool kClearOob = true, class TiledCopy, class TensorS, class TensorD, class TensorC, class TensorP>
CUTE_DEVICE void copy_tile(TiledCopy const& tiled_copy, TensorS const& S, TensorD& D, TensorC const& identity,
                           TensorP const& col_pred, int max_row) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(S); ++m) {
    if (get<0>(identity(0, m, 0)) < max_row) {
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
