// The backward pass's arch-neutral pre- and postprocess kernels, shared by every backward family.
//
// Preprocess, per query row: D = rowsum(dout * out) - dlse (fp32; dS = P * (dP - D) then also carries
// the gradient of the LSE output), the LSE in the exp2 domain with +inf for rows that saw no key (so
// P = exp2(s * scale_log2 - lse_log2) is exactly 0 there), and the row of the fp32 dq accumulator
// cleared. Postprocess: dq = softmax_scale * dq_accum in the input dtype (the scale is applied once,
// here, rather than to every dS tile).
// One warp per row, 16-byte vectors along the head dim; rows past seqused_q get D = 0, lse_log2 = +inf.
// kPermD > 0: the accumulator is in DqAccumPerm<kPermD>'s order (the Ampere path), else row-major.
#pragma once

#include <cuda_runtime.h>
#include <cute/config.hpp>
#include <cutlass/numeric_conversion.h>

#include "common/bwd_params.h"
#include "common/dq_accum_perm.h"
#include "common/launch_status.h"
#include "common/seq_info.h"

namespace flashtile {

constexpr int kPrePostThreads = 128;
constexpr int kPrePostRowsPerBlock = 32;


// Grid: (ceil(seqlen_q / kPrePostRowsPerBlock), num_heads, batch).
template <class Element, int kPermD>
__global__ void __launch_bounds__(kPrePostThreads) bwd_preprocess_kernel(__grid_constant__ BwdParams const params) {
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;
  int const bidh = blockIdx.y, bidb = blockIdx.z;
  SeqInfo const seq(p, bidb);
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kVec = 16 / sizeof(Element);
  constexpr float kLog2e = 1.4426950408889634f;

  Element const* o_ptr = static_cast<Element const*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride;
  Element const* do_ptr = static_cast<Element const*>(b.dout) +
                          seq.q_like_offset(p, bidb, b.do_batch_stride, b.do_row_stride) + bidh * b.do_head_stride;
  float* acc_ptr = b.dq_accum + seq.dq_accum_offset(p, bidb, b.dq_accum_batch_stride, b.dq_accum_row_stride) +
                   bidh * b.dq_accum_head_stride;
  int64_t const lse_off = seq.lse_offset(p, bidb) + bidh * p.lse_head_stride;

  // Permuted accumulator: a row's values live anywhere in its 8-row group, over all kPermD columns, so
  // whole groups are cleared (the accumulator's row padding covers them).
  int const rows_alloc = seq.seqlen_q_alloc;
  int const clear_end = kPermD > 0 ? (rows_alloc + 7) / 8 * 8 : rows_alloc;
  int const clear_cols = kPermD > 0 ? kPermD : p.head_dim;
  int const row_end = min(clear_end, int(blockIdx.x + 1) * kPrePostRowsPerBlock);
  for (int row = blockIdx.x * kPrePostRowsPerBlock + warp; row < row_end; row += kPrePostThreads / 32) {
    for (int c = lane * 4; c < clear_cols; c += 32 * 4) {
      *reinterpret_cast<float4*>(acc_ptr + row * b.dq_accum_row_stride + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (row >= rows_alloc) { continue; }  // warp-uniform
    float dot = 0.f;
    if (row < seq.seqlen_q) {
      for (int c = lane * kVec; c < p.head_dim_v; c += 32 * kVec) {
        uint4 const o4 = *reinterpret_cast<uint4 const*>(o_ptr + row * p.o_row_stride + c);
        uint4 const d4 = *reinterpret_cast<uint4 const*>(do_ptr + row * b.do_row_stride + c);
        Element const* o = reinterpret_cast<Element const*>(&o4);
        Element const* d = reinterpret_cast<Element const*>(&d4);
        CUTE_UNROLL
        for (int i = 0; i < kVec; ++i) { dot += float(o[i]) * float(d[i]); }
      }
    }
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) { dot += __shfl_xor_sync(0xffffffff, dot, offset); }
    if (lane == 0) {
      float const lse = row < seq.seqlen_q ? p.lse[lse_off + row] : -INFINITY;
      float const dlse = b.dlse != nullptr && row < seq.seqlen_q ? b.dlse[lse_off + row] : 0.f;
      bool const empty = lse == -INFINITY;
      b.lse_log2[lse_off + row] = empty ? INFINITY : lse * kLog2e;
      b.dsoftmax_sum[lse_off + row] = empty ? 0.f : dot - dlse;
    }
  }
}

// Grid: (ceil(seqlen_q / kPrePostRowsPerBlock), num_heads, batch).
template <class Element, int kPermD>
__global__ void __launch_bounds__(kPrePostThreads) bwd_postprocess_kernel(__grid_constant__ BwdParams const params) {
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;
  int const bidh = blockIdx.y, bidb = blockIdx.z;
  SeqInfo const seq(p, bidb);
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kVec = 8;  // 8 fp32 in, 8 16-bit out (16 bytes)

  float const* acc_ptr = b.dq_accum + seq.dq_accum_offset(p, bidb, b.dq_accum_batch_stride, b.dq_accum_row_stride) +
                         bidh * b.dq_accum_head_stride;
  Element* dq_ptr = static_cast<Element*>(b.dq) + seq.q_like_offset(p, bidb, b.dq_batch_stride, b.dq_row_stride) +
                    bidh * b.dq_head_stride;
  float const scale = p.softmax_scale;
  cutlass::NumericArrayConverter<Element, float, kVec> convert;

  int const row_end = min(seq.seqlen_q_alloc, int(blockIdx.x + 1) * kPrePostRowsPerBlock);
  for (int row = blockIdx.x * kPrePostRowsPerBlock + warp; row < row_end; row += kPrePostThreads / 32) {
    for (int c = lane * kVec; c < p.head_dim; c += 32 * kVec) {
      cutlass::Array<float, kVec> acc;
      int src_row = row, src_col = c;
      if constexpr (kPermD > 0) { DqAccumPerm<kPermD>::map(row, c, src_row, src_col); }
      float4 const* src = reinterpret_cast<float4 const*>(acc_ptr + src_row * b.dq_accum_row_stride + src_col);
      *reinterpret_cast<float4*>(&acc[0]) = src[0];
      *reinterpret_cast<float4*>(&acc[4]) = src[1];
      CUTE_UNROLL
      for (int i = 0; i < kVec; ++i) { acc[i] *= scale; }
      *reinterpret_cast<cutlass::Array<Element, kVec>*>(dq_ptr + row * b.dq_row_stride + c) = convert(acc);
    }
  }
}

// Host: the two launches every backward family brackets its main kernel with.
inline dim3 bwd_prepost_grid(FtFwdParams const& p) {
  return dim3((p.seqlen_q + kPrePostRowsPerBlock - 1) / kPrePostRowsPerBlock, p.num_heads, p.batch);
}

template <class Element, int kPermD = 0>
LaunchStatus launch_bwd_preprocess(BwdParams const& params, cudaStream_t stream) {
  bwd_preprocess_kernel<Element, kPermD><<<bwd_prepost_grid(params.fwd.abi), kPrePostThreads, 0, stream>>>(params);
  return LaunchStatus::cuda(cudaGetLastError(), "bwd_preprocess_kernel launch");
}

template <class Element, int kPermD = 0>
LaunchStatus launch_bwd_postprocess(BwdParams const& params, cudaStream_t stream) {
  bwd_postprocess_kernel<Element, kPermD><<<bwd_prepost_grid(params.fwd.abi), kPrePostThreads, 0, stream>>>(params);
  return LaunchStatus::cuda(cudaGetLastError(), "bwd_postprocess_kernel launch");
}

}  // namespace flashtile
