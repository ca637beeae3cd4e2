// Host launcher of the Ampere-path backward: preprocess (D, LSE in exp2 domain, dq accumulator
// cleared), the main kernel (grid: KV blocks x KV heads x batch) and the dq postprocess, all on one
// stream; the dq accumulator in DqAccumPerm's order (coalesced atomics). Host only; instantiated once
// per manifest entry.
#pragma once

#include <cuda_runtime.h>

#include "ampere/bwd_kernel.h"
#include "common/block_order.h"
#include "common/bwd_prepost.h"
#include "common/launch_status.h"

namespace flashtile::ampere {

template <class Traits, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_bwd_traits(BwdParams const& params_in, cudaStream_t stream) {
  using Element = typename Traits::Element;
  BwdParams params = params_in;
  FtFwdParams const& p = params.fwd.abi;
  auto kernel = bwd_kernel<Traits, kIsBand, kHasSoftcap>;
  constexpr int kSmem = Traits::kSmemBytes;
  if (LaunchStatus s = opt_in_smem(reinterpret_cast<void const*>(kernel), p.device, kSmem); !s.ok()) { return s; }
  if (LaunchStatus s = launch_bwd_preprocess<Element, Traits::kHeadDimV>(params, stream); !s.ok()) { return s; }
  dim3 const grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.num_heads_k, p.batch);
  params.pairs_per_section = bwd_pairs_per_section<Element, Traits::kHeadDim, Traits::kHeadDimV>(params, kIsBand, grid, 512);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  if (LaunchStatus s = LaunchStatus::cuda(cudaGetLastError(), "bwd_kernel launch"); !s.ok()) { return s; }
  return launch_bwd_postprocess<Element, Traits::kHeadDim, true>(params, stream);
}

// The large-shared-memory tile where it differs from the default and the device allows it; the small
// one where the device does not allow the default (sm_86 / sm_89) or FLASHTILE_AMPERE_BWD_SMALL = 1.
template <class Element, int kHeadDim, int kHeadDimV, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Traits = BwdTraits<Element, kHeadDim, kHeadDimV>;
  using TraitsLarge = BwdTraits<Element, kHeadDim, kHeadDimV, true>;
  using TraitsSmall = BwdTraits<Element, kHeadDim, kHeadDimV, false, true>;
  DeviceAttrs attrs;
  if (LaunchStatus s = device_attrs(params.fwd.abi.device, attrs); !s.ok()) { return s; }
  if (FLASHTILE_AMPERE_BWD_SMALL == 1 || attrs.smem_optin < Traits::kSmemBytes) {
    return run_bwd_traits<TraitsSmall, kIsBand, kHasSoftcap>(params, stream);
  }
  if constexpr (TraitsLarge::kSmemBytes != Traits::kSmemBytes) {
    if (attrs.smem_optin >= TraitsLarge::kSmemBytes) {
      return run_bwd_traits<TraitsLarge, kIsBand, kHasSoftcap>(params, stream);
    }
  }
  return run_bwd_traits<Traits, kIsBand, kHasSoftcap>(params, stream);
}

}  // namespace flashtile::ampere
