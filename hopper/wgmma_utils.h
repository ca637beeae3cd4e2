// WGMMA helpers: a warpgroup GEMM wrapper with explicit commit/wait control, and the register-layout
// views of WGMMA accumulators used by the softmax (rows x cols) and by O += P V (P as the A operand).
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>

namespace flashtile::hopper {

using namespace cute;

// acc (+)= A * B over all k-slices, issued as one warpgroup batch. kZeroInit overwrites acc.
// kWait < 0 returns with the batch in flight (the caller waits with warpgroup_wait<N>()).
template <bool kZeroInit, int kWait, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTE_DEVICE void wg_gemm(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB, TensorC& tCrC) {
  constexpr bool kARegs = !std::is_base_of_v<GMMA::DescriptorIterator, typename TensorA::engine_type::iterator>;
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) { warpgroup_wait<kWait>(); }
  warpgroup_fence_operand(tCrC);
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
}

// WGMMA accumulator ((2 cols, 2 rows, N/8), MMA_M, MMA_N) viewed as (rows, cols) =
// ((2, MMA_M), (2, N/8, MMA_N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout const& acc) {
  static_assert(rank(Layout{}) == 3 && rank(get<0>(Layout{})) == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <class Tensor_>
CUTE_DEVICE auto rowcol(Tensor_&& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// A 16-bit WGMMA accumulator over k = 16 columns holds exactly one A-operand k-slice in A's
// register order: ((2,2,N/8), MMA_M, 1) -> ((2,2,2), MMA_M, N/16).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_a_layout(Layout const& acc) {
  static_assert(decltype(size<2>(acc))::value == 1);
  auto v = logical_divide(get<0, 2>(acc), _2{});  // (2, N/16)
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(v)), get<1>(acc), get<1>(v));
}

}  // namespace flashtile::hopper
