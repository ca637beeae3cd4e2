// Implementation of the exported C ABI (common/flash_api.h): argument sanity checks that protect
// the kernels, path selection (Hopper on sm_90 when built, else Ampere), dispatch and error text,
// for the forward and the backward pass.
// Python validates user input first; the checks here guard against a mismatched caller.
#include "common/flash_api.h"

#include <cstdio>
#include <string>

#include <cuda_runtime.h>

#include "common/dispatch.h"
#include "common/bwd_params.h"
#include "common/fwd_params.h"
#include "common/launch_status.h"
#include "common/tile_policy.h"

namespace {

thread_local std::string g_last_error;

int fail(int code, std::string msg) {
  g_last_error = std::move(msg);
  return code;
}

char const* dtype_name(int dtype) {
  switch (dtype) {
    case kFtFloat16: return "fp16";
    case kFtBFloat16: return "bf16";
    case kFtFloat8E4M3: return "e4m3";
    default: return "?";
  }
}

}  // namespace

namespace {

using namespace flashtile;

// Checks shared by both passes; on success `major` is the device's compute capability major.
int check_common(FtFwdParams const& p, int& major) {
  if (!p.q || !p.k || !p.v || !p.out || !p.lse) { return fail(kFtInvalidArgument, "a tensor pointer is NULL"); }
  if (p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0) {
    return fail(kFtInvalidArgument, "num_heads must be a positive multiple of num_heads_k");
  }
  if (p.head_dim % 8 != 0 || p.head_dim_v % 8 != 0) {
    return fail(kFtInvalidArgument, "head dims must be multiples of 8");
  }
  if (head_dim_bucket(p.head_dim) == 0 || head_dim_bucket(p.head_dim_v) == 0) {
    return fail(kFtInvalidArgument, "head dim > 256 is not supported");
  }
  if (cudaError_t e = cudaSetDevice(p.device)) {
    return fail(kFtCudaError, std::string("cudaSetDevice: ") + cudaGetErrorString(e));
  }
  DeviceAttrs attrs;
  if (LaunchStatus s = device_attrs(p.device, attrs); !s.ok()) { return fail(s.code, s.message); }
  major = attrs.cc_major;
  if (major < 8) { return fail(kFtUnsupportedDevice, "flashtile needs compute capability 8.0 or newer"); }
  return kFtOk;
}

// Path selection: auto = the Hopper kernel on sm_90 when one is built, else the Ampere path.
template <class Entry, class Find>
int select_kernel(char const* op, FtFwdParams const& p, bool band, int major, Find find, Entry const*& entry) {
  int const hdim = head_dim_bucket(p.head_dim);
  int const hdim_v = head_dim_bucket(p.head_dim_v);
  bool const softcap = p.softcap > 0.f;
  entry = nullptr;
  int path = p.path;
  if (path == kFtPathAuto) {
    if (major == 9) { entry = find(kFtPathHopper, p.dtype, hdim, hdim_v, band, softcap); }
    path = kFtPathAmpere;
  }
  if (path == kFtPathHopper && major != 9) {
    return fail(kFtUnsupportedDevice, "the Hopper path needs an sm_90 GPU");
  }
  if (entry == nullptr) { entry = find(path, p.dtype, hdim, hdim_v, band, softcap); }
  if (entry == nullptr) {
    char buf[256];
    std::snprintf(buf, sizeof(buf), "no %s kernel built for path=%s dtype=%s hdim=%d hdim_v=%d mask=%s softcap=%d", op,
                  path == kFtPathHopper ? "hopper" : "ampere", dtype_name(p.dtype), hdim, hdim_v,
                  band ? "band" : "none", int(softcap));
    return fail(kFtNotBuilt, buf);
  }
  return kFtOk;
}

}  // namespace

extern "C" {

FT_EXPORT int ft_abi_version(void) { return FT_ABI_VERSION; }

FT_EXPORT int ft_fwd_params_size(void) { return int(sizeof(FtFwdParams)); }

FT_EXPORT int ft_bwd_params_size(void) { return int(sizeof(FtBwdParams)); }

FT_EXPORT char const* ft_build_config(void) { return flashtile::build_config_json(); }

FT_EXPORT char const* ft_last_error(void) { return g_last_error.c_str(); }

FT_EXPORT int64_t ft_fwd_split_accum_bytes(int device, int head_dim, int head_dim_v) {
  DeviceAttrs attrs;
  if (!device_attrs(device, attrs).ok() || attrs.cc_major != 9) { return 0; }
  return hopper_fwd_split_accum_bytes(attrs.num_sms, head_dim, head_dim_v);
}

FT_EXPORT int ft_mha_fwd(FtFwdParams const* params, void* stream) {
  if (params == nullptr) { return fail(kFtInvalidArgument, "params is NULL"); }
  FtFwdParams const& p = *params;
  int major = 0;
  if (int rc = check_common(p, major)) { return rc; }
  if (!p.tile_counter) { return fail(kFtInvalidArgument, "tile_counter is NULL"); }
  if (p.num_splits != 0 && p.num_splits != 1) {
    return fail(kFtInvalidArgument, "num_splits must be 0 (heuristic) or 1 (no split)");
  }
  if (p.batch == 0 || p.seqlen_q == 0) { return kFtOk; }
  FwdParams const fp = make_fwd_params(p);
  FwdKernelEntry const* entry = nullptr;
  if (int rc = select_kernel("forward", p, fp.is_band, major, find_fwd_kernel, entry)) { return rc; }
  LaunchStatus const s = entry->launch(fp, static_cast<cudaStream_t>(stream));
  if (!s.ok()) { return fail(s.code, std::string(entry->name) + ": " + s.message); }
  return kFtOk;
}

FT_EXPORT int ft_mha_bwd(FtBwdParams const* params, void* stream) {
  if (params == nullptr) { return fail(kFtInvalidArgument, "params is NULL"); }
  FtBwdParams const& b = *params;
  FtFwdParams const& p = b.fwd;
  int major = 0;
  if (int rc = check_common(p, major)) { return rc; }
  if (!b.dout || !b.dq || !b.dk || !b.dv || !b.dq_accum || !b.dsoftmax_sum || !b.lse_log2) {
    return fail(kFtInvalidArgument, "a gradient or workspace pointer is NULL");
  }
  if (b.dq_accum_row_stride != head_dim_bucket(p.head_dim)) {
    return fail(kFtInvalidArgument, "dq_accum rows must be contiguous (row stride = the head-dim bucket)");
  }
  if (b.deterministic && !b.dq_semaphore) {
    return fail(kFtInvalidArgument, "deterministic mode needs dq_semaphore");
  }
  if (p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) { return kFtOk; }
  BwdParams const bp = make_bwd_params(b);
  BwdKernelEntry const* entry = nullptr;
  if (int rc = select_kernel("backward", p, bp.fwd.is_band, major, find_bwd_kernel, entry)) { return rc; }
  LaunchStatus const s = entry->launch(bp, static_cast<cudaStream_t>(stream));
  if (!s.ok()) { return fail(s.code, std::string(entry->name) + ": " + s.message); }
  return kFtOk;
}

}  // extern "C"
