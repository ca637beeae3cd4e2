// Lookup over the generated dispatch table (fwd_dispatch_table.inc, from cmake/manifest.py).
#include "common/dispatch.h"

#include <iterator>

#include "fwd_dispatch_table.inc"  // declares the instance launchers and kFwdKernels[]
#include "build_config.inc"        // kBuildConfigJson

namespace flashtile {

FwdKernelEntry const* find_fwd_kernel(int path, int dtype, int head_dim, int head_dim_v, bool band, bool softcap) {
  for (FwdKernelEntry const& e : kFwdKernels) {
    if (e.path == path && e.dtype == dtype && e.head_dim == head_dim && e.head_dim_v == head_dim_v &&
        e.band == band && e.softcap == softcap) {
      return &e;
    }
  }
  return nullptr;
}

char const* build_config_json() { return kBuildConfigJson; }

}  // namespace flashtile
