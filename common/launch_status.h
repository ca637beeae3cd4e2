// Result of a host-side launch: an FtStatus plus a message, so launchers can explain failures
// (not enough shared memory, no code for this GPU) without exceptions crossing the C ABI.
#pragma once

#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

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

// Per-device attributes the launchers need, queried once per device (the host path of a launch is
// paid on every call, and short sequences are bound by it).
struct DeviceAttrs {
  int cc_major = 0;
  int num_sms = 0;
  int smem_optin = 0;   // dynamic shared memory a block may opt in to
  int smem_per_sm = 0;  // shared memory of one SM, shared by its resident blocks
};

inline LaunchStatus device_attrs(int device, DeviceAttrs& out) {
  constexpr int kMaxDevices = 64;
  static DeviceAttrs cache[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  bool const cached = device >= 0 && device < kMaxDevices;
  if (cached && ready[device].load(std::memory_order_acquire)) {
    out = cache[device];
    return {};
  }
  DeviceAttrs a;
  for (auto [attr, dst] : {std::pair{cudaDevAttrComputeCapabilityMajor, &a.cc_major},
                           std::pair{cudaDevAttrMultiProcessorCount, &a.num_sms},
                           std::pair{cudaDevAttrMaxSharedMemoryPerBlockOptin, &a.smem_optin},
                           std::pair{cudaDevAttrMaxSharedMemoryPerMultiprocessor, &a.smem_per_sm}}) {
    if (cudaError_t e = cudaDeviceGetAttribute(dst, attr, device)) { return LaunchStatus::cuda(e, "cudaDeviceGetAttribute"); }
  }
  if (cached) {
    cache[device] = a;  // racing writers store the same values
    ready[device].store(true, std::memory_order_release);
  }
  out = a;
  return {};
}

// Checks that `kernel` fits the device's shared memory and raises its dynamic limit to smem_bytes,
// once per (kernel, device).
inline LaunchStatus opt_in_smem(void const* kernel, int device, int smem_bytes) {
  static std::mutex mutex;
  static std::set<std::pair<void const*, int>> done;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (done.count({kernel, device})) { return {}; }
  }
  DeviceAttrs attrs;
  if (LaunchStatus s = device_attrs(device, attrs); !s.ok()) { return s; }
  if (smem_bytes > attrs.smem_optin) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "kernel needs %d bytes of shared memory per block; device %d allows %d",
                  smem_bytes, device, attrs.smem_optin);
    return {kFtUnsupportedDevice, buf};
  }
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes)) {
    return LaunchStatus::cuda(e, "cudaFuncSetAttribute");
  }
  std::lock_guard<std::mutex> lock(mutex);
  done.insert({kernel, device});
  return {};
}

// A launch of `blocks` CTAs of `threads` threads in clusters of `cluster_size` along x; `attr` holds the
// configuration's one attribute and must outlive its use.
inline cudaLaunchConfig_t cluster_launch_config(int blocks, int threads, int smem_bytes, cudaStream_t stream,
                                                int cluster_size, cudaLaunchAttribute& attr) {
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(cluster_size);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(blocks));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return config;
}

// How many clusters of `cluster_size` CTAs (threads, smem_bytes each, along x) can be resident at once:
// a persistent grid larger than that would leave whole clusters waiting for a second wave. Once per
// (kernel, device); the kernel's shared-memory opt-in must already be done.
inline LaunchStatus max_active_clusters(void const* kernel, int device, int threads, int smem_bytes, int cluster_size,
                                        int& out) {
  static std::mutex mutex;
  static std::map<std::pair<void const*, int>, int> done;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = done.find({kernel, device}); it != done.end()) {
      out = it->second;
      return {};
    }
  }
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t const config = cluster_launch_config(cluster_size, threads, smem_bytes, nullptr, cluster_size, attr);
  if (cudaError_t e = cudaOccupancyMaxActiveClusters(&out, kernel, &config)) {
    return LaunchStatus::cuda(e, "cudaOccupancyMaxActiveClusters");
  }
  std::lock_guard<std::mutex> lock(mutex);
  done[{kernel, device}] = out;
  return {};
}

}  // namespace flashtile
