// Host launcher of the Ampere-path forward kernel: grid shape, dynamic shared memory opt-in and the
// device's shared-memory limit. Host only; instantiated once per manifest entry.
#pragma once

#include <cuda_runtime.h>

#include "ampere/fwd_kernel.h"
#include "common/launch_status.h"

namespace flashtile::ampere {

template <class Element, int kHeadDim, int kHeadDimV, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Traits = FwdTraits<Element, kHeadDim, kHeadDimV>;
  auto kernel = fwd_kernel<Traits, kIsBand, kHasSoftcap>;
  constexpr int kSmem = Traits::kSmemBytes;
  if (LaunchStatus s = opt_in_smem(reinterpret_cast<void const*>(kernel), params.abi.device, kSmem); !s.ok()) { return s; }
  int const num_m_blocks = (params.abi.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  dim3 const grid(num_m_blocks, params.abi.num_heads, params.abi.batch);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  return LaunchStatus::cuda(cudaGetLastError(), "fwd_kernel launch");
}

}  // namespace flashtile::ampere
