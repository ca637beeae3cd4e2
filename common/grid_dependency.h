// Programmatic dependent launch (sm_90+) and the acquire/release counters that let a dependent kernel
// start on the parts of its input that are already done (and the one that counts a split tile's parts).
//
// A kernel launched with launch_dependent() may begin once every CTA of the kernel before it on the
// stream has called pdl_launch_dependents() (or exited); until then the two run in stream order. Its
// threads call pdl_wait_prior_grids() before touching anything that kernel writes: it returns once that
// kernel has completed and its writes are visible. Below sm_90, and in a kernel not launched that way,
// both instructions do nothing.
#pragma once

#include <cuda_runtime.h>
#include <cute/config.hpp>

namespace flashtile {

CUTE_DEVICE void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

CUTE_DEVICE void pdl_wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

CUTE_DEVICE int load_acquire_gpu(int const* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// One thread, after its bulk reductions completed (cp.async.bulk.wait_group 0, which makes them visible
// to it): orders those async-proxy writes before its generic ones, then adds 1 to *counter with release
// semantics, so that whoever acquires the count sees them. A release reduction, not __threadfence +
// atomicAdd: the SC fence costs about twice as much (H100).
CUTE_DEVICE void release_bulk_adds(int* counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// atom.add with acquire-release semantics at GPU scope; returns the old value. One thread of a group
// that synchronized on a barrier before it (and does after it) publishes the group's writes and
// acquires the ones published before its count (hopper/fwd_kernel.h's tail split).
CUTE_DEVICE int atomic_add_acq_rel_gpu(int* ptr, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
  return old;
}

// Spins (one thread) until *counter reaches `target`.
CUTE_DEVICE void wait_counter_at_least(int const* counter, int target) {
  while (load_acquire_gpu(counter) < target) { __nanosleep(256); }
}

// Host: launches `kernel` so that it may start while the kernel before it on `stream` finishes.
template <class... KernelArgs, class... Args>
cudaError_t launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args const&... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace flashtile
