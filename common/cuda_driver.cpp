// The CUDA driver functions that host code in the kernels uses (TMA descriptor encoding), resolved
// once through the runtime's entry-point query: the library needs no link-time libcuda, so it loads
// on machines without a driver, and each launch skips the per-call entry-point lookup.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace {

PFN_cuTensorMapEncodeTiled_v12000 resolve_encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

}  // namespace

extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap* tensor_map, CUtensorMapDataType dtype, cuuint32_t rank,
                                                   void* global_address, cuuint64_t const* global_dim,
                                                   cuuint64_t const* global_strides, cuuint32_t const* box_dim,
                                                   cuuint32_t const* element_strides, CUtensorMapInterleave interleave,
                                                   CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
                                                   CUtensorMapFloatOOBfill oob_fill) {
  static PFN_cuTensorMapEncodeTiled_v12000 const fn = resolve_encode_tiled();
  if (fn == nullptr) { return CUDA_ERROR_NOT_FOUND; }
  return fn(tensor_map, dtype, rank, global_address, global_dim, global_strides, box_dim, element_strides, interleave,
            swizzle, l2_promotion, oob_fill);
}
