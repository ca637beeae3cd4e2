// Result of a host-side launch: an FtStatus plus a message, so launchers can explain failures
// (not enough shared memory, no code for this GPU) without exceptions crossing the C ABI.
#pragma once

#include <cstdio>
#include <string>

#include <cuda_runtime.h>

#include "common/flash_api.h"

namespace flashtile {

struct LaunchStatus {
  int code = kFtOk;
  std::string message;

  bool ok() const { return code == kFtOk; }

  static LaunchStatus cuda(cudaError_t e, char const* what) {
    if (e == cudaSuccess) { return {}; }
    std::string msg = std::string(what) + ": " + cudaGetErrorString(e);
    if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
      msg += " (this library was not compiled for this GPU's architecture; see flashtile.build_config())";
      return {kFtUnsupportedDevice, msg};
    }
    return {kFtCudaError, msg};
  }
};

// Fails cleanly when a kernel's shared memory exceeds what the device grants one block.
inline LaunchStatus check_smem_fits(int device, int smem_bytes) {
  int limit = 0;
  if (cudaError_t e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) {
    return LaunchStatus::cuda(e, "cudaDeviceGetAttribute");
  }
  if (smem_bytes > limit) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "kernel needs %d bytes of shared memory per block; device %d allows %d",
                  smem_bytes, device, limit);
    return {kFtUnsupportedDevice, buf};
  }
  return {};
}

}  // namespace flashtile
