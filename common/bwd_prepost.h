// The backward pass's arch-neutral pre- and postprocess kernels, shared by every backward family.
//
// Preprocess, per query row: D = rowsum(dout * out) - dlse (fp32; dS = P * (dP - D) then also carries
// the gradient of the LSE output), the LSE in the exp2 domain with +inf for rows that saw no key (so
// P = exp2(s * scale_log2 - lse_log2) is exactly 0 there); the fp32 dq accumulator is cleared by a
// memset before it. Postprocess: dq = softmax_scale * dq_accum in the input dtype (the scale is
// applied once, here, rather than to every dS tile).
// Launch overlap (Hopper): the preprocess lets the main kernel launch as soon as all its CTAs run, and
// the main kernel lets the postprocess launch once all of its CTAs run; with dq_done counted, each
// postprocess CTA waits only for the CTAs of its own (batch, KV head), so the heads finished before
// the main kernel's last wave are converted on the SMs that wave leaves idle.
// 16-byte vectors along the head dim, several rows per warp (PrePostLayout); rows past seqused_q get
// D = 0, lse_log2 = +inf.
// kPermuted: the accumulator is in DqAccumPerm<kHeadDim>'s order (the Ampere path, the Hopper path
// under dq_red); kFragCols > 0: in DqAccumFrag<kHeadDim, kFragCols>'s (the Hopper path under dq_frag);
// else row-major.
#pragma once

#include <cuda_runtime.h>
#include <cute/config.hpp>
#include <cutlass/numeric_conversion.h>

#include "common/bwd_params.h"
#include "common/dq_accum_perm.h"
#include "common/grid_dependency.h"
#include "common/launch_status.h"
#include "common/seq_info.h"

namespace flashtile {

constexpr int kPrePostThreads = 128;
constexpr int kPrePostRowsPerBlock = 64;

// The thread layout over a block's rows: each thread owns one 16-byte vector of a row (kVec
// elements); kThreadsPerRow (a power of two, so a row's threads are an aligned lane group and a
// shuffle over its offsets reduces within the row) covers a bucket of kCols columns; the block's 128
// threads take kRowsPerPass rows at once and kPasses passes cover its kPrePostRowsPerBlock rows. Every
// pass's loads are issued before any of them is used: at d = 64 a row is 128 bytes per tensor, and
// one row per warp at a time kept too few bytes in flight to approach DRAM bandwidth.
template <int kCols, int kVec>
struct PrePostLayout {
  static constexpr int kVecsPerRow = (kCols + kVec - 1) / kVec;
  static constexpr int kThreadsPerRow = kVecsPerRow <= 4 ? 4 : kVecsPerRow <= 8 ? 8 : kVecsPerRow <= 16 ? 16 : 32;
  static_assert(kVecsPerRow <= 32, "one vector per thread of a warp at most");
  static constexpr int kRowsPerPass = kPrePostThreads / kThreadsPerRow;
  static constexpr int kPasses = kPrePostRowsPerBlock / kRowsPerPass;
  // Loads in flight per thread: whole groups of passes (16 bytes per tensor each).
  static constexpr int kGroup = kPasses < 4 ? kPasses : 4;
  static_assert(kPasses % kGroup == 0);
};

// One query row's backward statistics from its forward LSE, the upstream dlse and rowsum(dout * out):
// D = dot - dlse and the LSE in the exp2 domain; a row that saw no key (LSE -inf) gets D = 0 and
// lse_log2 = +inf, so that P = exp2(s * scale_log2 - lse_log2) is exactly 0 there.
CUTE_DEVICE void bwd_row_stats(float lse, float dlse, float dot, float& dsum, float& lse_log2) {
  constexpr float kLog2e = 1.4426950408889634f;
  bool const empty = lse == -INFINITY;
  lse_log2 = empty ? INFINITY : lse * kLog2e;
  dsum = empty ? 0.f : dot - dlse;
}

// Grid: (num_heads, ceil(seqlen_q / kPrePostRowsPerBlock), batch): heads fastest, so that blocks
// running together read whole token rows of O and dO (all heads of a token are contiguous; a single
// head's row is 128 bytes at d = 64). kHeadDimV: the bucket of head_dim_v.
template <class Element, int kHeadDimV>
__global__ void __launch_bounds__(kPrePostThreads) bwd_preprocess_kernel(__grid_constant__ BwdParams const params) {
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;
  int const bidh = blockIdx.x, bidb = blockIdx.z;
  SeqInfo const seq(p, bidb);
  constexpr int kVec = 16 / sizeof(Element);
  using L = PrePostLayout<kHeadDimV, kVec>;

  Element const* o_ptr = static_cast<Element const*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride;
  Element const* do_ptr = static_cast<Element const*>(b.dout) +
                          seq.q_like_offset(p, bidb, b.do_batch_stride, b.do_row_stride) + bidh * b.do_head_stride;
  int64_t const lse_off = seq.lse_offset(p, bidb) + bidh * p.lse_head_stride;
  int const col = (threadIdx.x % L::kThreadsPerRow) * kVec;
  int const sub_row = threadIdx.x / L::kThreadsPerRow;
  bool const col_in = col < p.head_dim_v;
  pdl_launch_dependents();  // the main kernel waits for this grid before it reads D and the LSE
  // Row blocks beyond the grid's y extent (65535) are taken by a stride loop.
  for (int row0 = blockIdx.y * kPrePostRowsPerBlock; row0 < seq.seqlen_q_alloc; row0 += gridDim.y * kPrePostRowsPerBlock) {
    CUTE_UNROLL
    for (int g = 0; g < L::kPasses; g += L::kGroup) {
      uint4 o4[L::kGroup], d4[L::kGroup];
      CUTE_UNROLL
      for (int j = 0; j < L::kGroup; ++j) {
        int const row = row0 + (g + j) * L::kRowsPerPass + sub_row;
        o4[j] = d4[j] = make_uint4(0, 0, 0, 0);
        if (col_in && row < seq.seqlen_q) {
          o4[j] = *reinterpret_cast<uint4 const*>(o_ptr + int64_t(row) * p.o_row_stride + col);
          d4[j] = *reinterpret_cast<uint4 const*>(do_ptr + int64_t(row) * b.do_row_stride + col);
        }
      }
      CUTE_UNROLL
      for (int j = 0; j < L::kGroup; ++j) {
        int const row = row0 + (g + j) * L::kRowsPerPass + sub_row;
        Element const* o = reinterpret_cast<Element const*>(&o4[j]);
        Element const* d = reinterpret_cast<Element const*>(&d4[j]);
        float dot = 0.f;
        CUTE_UNROLL
        for (int i = 0; i < kVec; ++i) { dot += float(o[i]) * float(d[i]); }
        CUTE_UNROLL
        for (int offset = L::kThreadsPerRow / 2; offset > 0; offset /= 2) { dot += __shfl_xor_sync(0xffffffff, dot, offset); }
        if (threadIdx.x % L::kThreadsPerRow == 0 && row < seq.seqlen_q_alloc) {
          float const lse = row < seq.seqlen_q ? p.lse[lse_off + row] : -INFINITY;
          float const dlse = b.dlse != nullptr && row < seq.seqlen_q ? b.dlse[lse_off + row] : 0.f;
          bwd_row_stats(lse, dlse, dot, b.dsoftmax_sum[lse_off + row], b.lse_log2[lse_off + row]);
        }
      }
    }
  }
}

// One 16-byte store of 8 converted dq elements (through a C++ store of the Array or of a uint4 it became
// four 4-byte ones).
template <class Element>
CUTE_DEVICE void store_dq_vec8(Element* ptr, cutlass::Array<Element, 8> const& out) {
  uint32_t const* w = reinterpret_cast<uint32_t const*>(&out);
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
}

// Postprocess of one 64-row block of a DqAccumFrag accumulator (one CTA of 128 threads; 64 * d contiguous
// floats). The block goes to shared memory as its warpgroups wrote it (16-byte loads, 512 contiguous bytes
// per warp; from L2: under the counted start other SMs' reductions completed it), each 512-float group of
// register order padded by 4 floats; then a thread takes rows r and r + 8 of 8 columns: DqAccumFrag puts
// them in 4 consecutive 16-byte entries (columns 2 q, 2 q + 1 of both rows in entry q), and the 8 threads
// of a quarter warp, 8 consecutive column groups of one row pair, read them from all 32 banks.
template <class Element, int kHeadDim, int kFragCols>
CUTE_DEVICE void dq_frag_block_out(float const* acc_ptr, Element* dq_ptr, int row0, int rows, int head_dim,
                                   int64_t dq_row_stride, float scale) {
  using Frag = DqAccumFrag<kHeadDim, kFragCols>;
  static_assert(Frag::kRows == kPrePostRowsPerBlock && kPrePostThreads == 128);
  constexpr int kFloats = Frag::kRows * kHeadDim;
  constexpr int kLoads = kFloats / 4 / kPrePostThreads;
  constexpr int kColGroups = kHeadDim / 8, kItems = Frag::kRows / 2 * kColGroups;
  static_assert(kFloats % (4 * kPrePostThreads) == 0 && kItems % kPrePostThreads == 0);
  auto padded = [](int i) { return i + 4 * (i / 512); };
  __shared__ alignas(16) float blk[padded(kFloats)];
  if (row0 >= rows) { return; }  // past a packed sequence's rows (and its accumulator block)
  int const t = threadIdx.x;
  float4 const* const src = reinterpret_cast<float4 const*>(acc_ptr + Frag::offset(row0, 0));
  float4 v[kLoads];
  CUTE_UNROLL
  for (int i = 0; i < kLoads; ++i) { v[i] = __ldcg(src + i * kPrePostThreads + t); }
  CUTE_UNROLL
  for (int i = 0; i < kLoads; ++i) { *reinterpret_cast<float4*>(&blk[padded(4 * (i * kPrePostThreads + t))]) = v[i]; }
  __syncthreads();
  cutlass::NumericArrayConverter<Element, float, 8> convert;
  CUTE_UNROLL
  for (int it = 0; it < kItems / kPrePostThreads; ++it) {
    int const item = it * kPrePostThreads + t;
    int const col = 8 * (item % kColGroups), pair = item / kColGroups;
    int const r = 16 * (pair / 8) + pair % 8;
    if (col >= head_dim) { continue; }
    float const* const e = &blk[padded(int(Frag::offset(r, col)))];
    cutlass::Array<float, 8> lo, hi;
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      float4 const f = *reinterpret_cast<float4 const*>(e + 4 * q);
      lo[2 * q] = f.x * scale, lo[2 * q + 1] = f.y * scale, hi[2 * q] = f.z * scale, hi[2 * q + 1] = f.w * scale;
    }
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      int const row = row0 + r + 8 * h;
      if (row < rows) { store_dq_vec8(dq_ptr + int64_t(row) * dq_row_stride + col, convert(h == 0 ? lo : hi)); }
    }
  }
}

// Grid: (ceil(seqlen_q / kPrePostRowsPerBlock), num_heads, batch). kHeadDim: the bucket of head_dim.
template <class Element, int kHeadDim, bool kPermuted, int kFragCols>
__global__ void __launch_bounds__(kPrePostThreads) bwd_postprocess_kernel(__grid_constant__ BwdParams const params) {
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;
  int const bidh = blockIdx.y, bidb = blockIdx.z;
  SeqInfo const seq(p, bidb);
  constexpr int kVec = 8;  // 8 fp32 in, 8 16-bit out (16 bytes)
  using L = PrePostLayout<kHeadDim, kVec>;

  float const* acc_ptr = b.dq_accum + seq.dq_accum_offset(p, bidb, b.dq_accum_batch_stride, b.dq_accum_row_stride) +
                         bidh * b.dq_accum_head_stride;
  Element* dq_ptr = static_cast<Element*>(b.dq) + seq.q_like_offset(p, bidb, b.dq_batch_stride, b.dq_row_stride) +
                    bidh * b.dq_head_stride;
  float const scale = p.softmax_scale;
  cutlass::NumericArrayConverter<Element, float, kVec> convert;
  int const row0 = blockIdx.x * kPrePostRowsPerBlock;
  int const col = (threadIdx.x % L::kThreadsPerRow) * kVec;
  int const sub_row = threadIdx.x / L::kThreadsPerRow;
  bool const col_in = col < p.head_dim;
  bool const counted = params.dq_done_count > 0;  // set only with b.dq_done
  if (counted) {
    if (threadIdx.x == 0) {
      wait_counter_at_least(b.dq_done + int64_t(bidb) * p.num_heads_k + bidh / params.fwd.h_h_k_ratio,
                            params.dq_done_count);
    }
    __syncthreads();
  } else {
    pdl_wait_prior_grids();
  }

  if constexpr (kFragCols > 0) {
    dq_frag_block_out<Element, kHeadDim, kFragCols>(acc_ptr, dq_ptr, row0, seq.seqlen_q_alloc, p.head_dim,
                                                    b.dq_row_stride, scale);
  } else {
    CUTE_UNROLL
    for (int g = 0; g < L::kPasses; g += L::kGroup) {
      cutlass::Array<float, kVec> acc[L::kGroup];
      CUTE_UNROLL
      for (int j = 0; j < L::kGroup; ++j) {
        int const row = row0 + (g + j) * L::kRowsPerPass + sub_row;
        if (col_in && row < seq.seqlen_q_alloc) {
          int src_row = row, src_col = col;
          if constexpr (kPermuted) { DqAccumPerm<kHeadDim>::map(row, col, src_row, src_col); }
          float4 const* src = reinterpret_cast<float4 const*>(acc_ptr + int64_t(src_row) * b.dq_accum_row_stride + src_col);
          // From L2: under the counted start these rows were completed by other SMs' reductions.
          *reinterpret_cast<float4*>(&acc[j][0]) = __ldcg(src);
          *reinterpret_cast<float4*>(&acc[j][4]) = __ldcg(src + 1);
        }
      }
      CUTE_UNROLL
      for (int j = 0; j < L::kGroup; ++j) {
        int const row = row0 + (g + j) * L::kRowsPerPass + sub_row;
        if (col_in && row < seq.seqlen_q_alloc) {
          CUTE_UNROLL
          for (int i = 0; i < kVec; ++i) { acc[j][i] *= scale; }
          store_dq_vec8(dq_ptr + int64_t(row) * b.dq_row_stride + col, convert(acc[j]));
        }
      }
    }
  }
  // Counted start: the grid's last CTA also waits for the whole main kernel (dK, dV), so that what runs
  // after the postprocess on the stream sees the main kernel's writes.
  if (counted && blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1) {
    pdl_wait_prior_grids();
  }
}

// Host: the launches every backward family brackets its main kernel with.
inline dim3 bwd_postprocess_grid(FtFwdParams const& p) {
  return dim3((p.seqlen_q + kPrePostRowsPerBlock - 1) / kPrePostRowsPerBlock, p.num_heads, p.batch);
}

// The dq accumulator cleared whole (its extent follows from FtBwdParams' layout: padded, batch x the batch
// stride; varlen, heads x the head stride) with the dq_done counters. The memset runs at copy bandwidth
// (H100: 128 MB in 41 us) and leaves the preprocess a pure read; it measured the same as clearing the
// block's rows inside the preprocess, with simpler code (no 8-row groups of permuted rows).
inline LaunchStatus launch_bwd_clear(BwdParams const& params, cudaStream_t stream) {
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;
  int64_t const elems = p.cu_seqlens_q != nullptr ? int64_t(p.num_heads) * b.dq_accum_head_stride
                                                  : int64_t(p.batch) * b.dq_accum_batch_stride;
  size_t const done_bytes = b.dq_done != nullptr ? size_t(p.batch) * p.num_heads_k * sizeof(int32_t) : 0;
  bool const adjacent = reinterpret_cast<void const*>(b.dq_done) == reinterpret_cast<void const*>(b.dq_accum + elems);
  size_t const bytes = elems * sizeof(float) + (adjacent ? done_bytes : 0);
  if (LaunchStatus s = LaunchStatus::cuda(cudaMemsetAsync(b.dq_accum, 0, bytes, stream), "dq accumulator clear"); !s.ok()) {
    return s;
  }
  if (done_bytes > 0 && !adjacent) {
    if (LaunchStatus s = LaunchStatus::cuda(cudaMemsetAsync(b.dq_done, 0, done_bytes, stream), "dq_done clear"); !s.ok()) {
      return s;
    }
  }
  return LaunchStatus{};
}

// The clear, then the preprocess kernel.
template <class Element, int kHeadDimV>
LaunchStatus launch_bwd_preprocess(BwdParams const& params, cudaStream_t stream) {
  FtFwdParams const& p = params.fwd.abi;
  if (LaunchStatus s = launch_bwd_clear(params, stream); !s.ok()) { return s; }
  int const row_blocks = (p.seqlen_q + kPrePostRowsPerBlock - 1) / kPrePostRowsPerBlock;
  dim3 const grid(p.num_heads, row_blocks < 65535 ? row_blocks : 65535, p.batch);
  bwd_preprocess_kernel<Element, kHeadDimV><<<grid, kPrePostThreads, 0, stream>>>(params);
  return LaunchStatus::cuda(cudaGetLastError(), "bwd_preprocess_kernel launch");
}

// dependent: launched to start while the main kernel finishes (it has called pdl_launch_dependents);
// each CTA then waits for its head's dq_done count, or for the whole main kernel when none is kept.
template <class Element, int kHeadDim, bool kPermuted, int kFragCols = 0>
LaunchStatus launch_bwd_postprocess(BwdParams const& params, cudaStream_t stream, bool dependent = false) {
  auto kernel = bwd_postprocess_kernel<Element, kHeadDim, kPermuted, kFragCols>;
  dim3 const grid = bwd_postprocess_grid(params.fwd.abi);
  if (dependent) {
    return LaunchStatus::cuda(launch_dependent(kernel, grid, dim3(kPrePostThreads), 0, stream, params),
                              "bwd_postprocess_kernel launch");
  }
  kernel<<<grid, kPrePostThreads, 0, stream>>>(params);
  return LaunchStatus::cuda(cudaGetLastError(), "bwd_postprocess_kernel launch");
}

}  // namespace flashtile
