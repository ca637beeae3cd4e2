// Global tensors as TMA sees them in the Hopper kernels: (rows, d, heads, batch) with a unit column
// stride. Packed (varlen) tensors have batch extent 1 and are offset by their cu_seqlens row inside
// the kernel; the shape's d is the real head dim, so TMA zero-fills a bucket's padding columns.
#pragma once

#include <cute/tensor.hpp>

namespace flashtile::hopper {

using ShapeQKV = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using StrideQKV = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;

template <class T>
using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<T*>(nullptr)),
                                              cute::make_layout(ShapeQKV{}, StrideQKV{})));

template <class T>
CUTE_HOST_DEVICE GmemTensor<T> make_gmem_tensor(T* ptr, ShapeQKV shape, int64_t row, int64_t head, int64_t batch) {
  return cute::make_tensor(cute::make_gmem_ptr(ptr), cute::make_layout(shape, cute::make_stride(row, cute::_1{}, head, batch)));
}

}  // namespace flashtile::hopper
