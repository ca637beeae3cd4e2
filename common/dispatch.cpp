// Lookup over the generated dispatch tables (dispatch_table.inc, from cmake/manifest.py).
#include "common/dispatch.h"

#include "dispatch_table.inc"  // declares the instance launchers, kFwdKernels[] and kBwdKernels[]
#include "build_config.inc"    // kBuildConfigJson

namespace flashtile {

namespace {

template <class Entry, size_t kN>
Entry const* find_kernel(Entry const (&table)[kN], int path, int dtype, int head_dim, int head_dim_v, bool band,
                         bool softcap) {
  for (Entry const& e : table) {
    if (e.launch != nullptr && e.path == path && e.dtype == dtype && e.head_dim == head_dim &&
        e.head_dim_v == head_dim_v && e.band == band && e.softcap == softcap) {
      return &e;
    }
  }
  return nullptr;
}

}  // namespace

FwdKernelEntry const* find_fwd_kernel(int path, int dtype, int head_dim, int head_dim_v, bool band, bool softcap) {
  return find_kernel(kFwdKernels, path, dtype, head_dim, head_dim_v, band, softcap);
}

BwdKernelEntry const* find_bwd_kernel(int path, int dtype, int head_dim, int head_dim_v, bool band, bool softcap) {
  return find_kernel(kBwdKernels, path, dtype, head_dim, head_dim_v, band, softcap);
}

char const* build_config_json() { return kBuildConfigJson; }

}  // namespace flashtile
