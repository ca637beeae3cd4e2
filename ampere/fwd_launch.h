// Host launcher of the Ampere-path forward kernel: the tile for the device (tile policy), grid shape,
// dynamic shared memory opt-in and the device's shared-memory limit. Host only; instantiated once per
// manifest entry.
#pragma once

#include <cuda_runtime.h>

#include "ampere/fwd_kernel.h"
#include "common/block_order.h"
#include "common/launch_status.h"

namespace flashtile::ampere {

template <class Traits, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_fwd_traits(FwdParams const& params_in, cudaStream_t stream) {
  using Element = typename Traits::Element;
  FwdParams params = params_in;
  auto kernel = fwd_kernel<Traits, kIsBand, kHasSoftcap>;
  constexpr int kSmem = Traits::kSmemBytes;
  if (LaunchStatus s = opt_in_smem(reinterpret_cast<void const*>(kernel), params.abi.device, kSmem); !s.ok()) { return s; }
  int const num_m_blocks = (params.abi.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  dim3 const grid(num_m_blocks, params.abi.num_heads, params.abi.batch);
  params.pairs_per_section = fwd_pairs_per_section<Element, Traits::kHeadDim, Traits::kHeadDimV>(params, kIsBand, grid);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  return LaunchStatus::cuda(cudaGetLastError(), "fwd_kernel launch");
}

// Above hdim 128 the tile the policy picks for the device (ampere_fwd_tile_kind).
template <class Element, int kHeadDim, int kHeadDimV, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Traits = FwdTraits<Element, kHeadDim, kHeadDimV>;
  using TraitsWide = FwdTraits<Element, kHeadDim, kHeadDimV, true>;
  using TraitsSplit = FwdTraits<Element, kHeadDim, kHeadDimV, false, true>;
  using TraitsSplitWide = FwdTraits<Element, kHeadDim, kHeadDimV, true, true>;
  if constexpr (TraitsSplit::kSplitN) {
    DeviceAttrs attrs;
    if (LaunchStatus s = device_attrs(params.abi.device, attrs); !s.ok()) { return s; }
    int const bytes[2][2] = {{Traits::kSmemBytes, TraitsSplit::kSmemBytes},
                             {TraitsWide::kSmemBytes, TraitsSplitWide::kSmemBytes}};
    FwdTileKind const kind = ampere_fwd_tile_kind(bytes, attrs.smem_per_sm, attrs.smem_optin);
    if (kind.split) {
      return kind.wide ? run_fwd_traits<TraitsSplitWide, kIsBand, kHasSoftcap>(params, stream)
                       : run_fwd_traits<TraitsSplit, kIsBand, kHasSoftcap>(params, stream);
    }
    if (kind.wide) { return run_fwd_traits<TraitsWide, kIsBand, kHasSoftcap>(params, stream); }
  }
  return run_fwd_traits<Traits, kIsBand, kHasSoftcap>(params, stream);
}

}  // namespace flashtile::ampere
