// The dispatch tables: one entry per compiled kernel instance, generated from the manifest
// (cmake/manifest.py) together with the instantiation files and build_config.json, so the three
// always list the same kernels. One table per operation (forward, backward).
#pragma once

#include <cuda_runtime.h>

#include "common/bwd_params.h"
#include "common/fwd_params.h"
#include "common/launch_status.h"

namespace flashtile {

template <class Params>
struct KernelEntry {
  int path;        // FtPath
  int dtype;       // FtDtype
  int head_dim;    // bucket
  int head_dim_v;  // bucket
  bool band;       // causal / sliding window
  bool softcap;
  LaunchStatus (*launch)(Params const&, cudaStream_t);
  char const* name;
};

using FwdKernelEntry = KernelEntry<FwdParams>;
using BwdKernelEntry = KernelEntry<BwdParams>;

// nullptr when no instance matches.
FwdKernelEntry const* find_fwd_kernel(int path, int dtype, int head_dim, int head_dim_v, bool band, bool softcap);
BwdKernelEntry const* find_bwd_kernel(int path, int dtype, int head_dim, int head_dim_v, bool band, bool softcap);

char const* build_config_json();

}  // namespace flashtile
