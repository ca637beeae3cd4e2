// The dispatch table: one entry per compiled kernel instance, generated from the manifest
// (cmake/manifest.py) together with the instantiation files and build_config.json, so the three
// always list the same kernels.
#pragma once

#include <cuda_runtime.h>

#include "common/fwd_params.h"
#include "common/launch_status.h"

namespace flashtile {

using FwdLaunchFn = LaunchStatus (*)(FwdParams const&, cudaStream_t);

struct FwdKernelEntry {
  int path;        // FtPath
  int dtype;       // FtDtype
  int head_dim;    // bucket
  int head_dim_v;  // bucket
  bool band;       // causal / sliding window
  bool softcap;
  FwdLaunchFn launch;
  char const* name;
};

// nullptr when no instance matches.
FwdKernelEntry const* find_fwd_kernel(int path, int dtype, int head_dim, int head_dim_v, bool band, bool softcap);

char const* build_config_json();

}  // namespace flashtile
