// Host launcher of the Hopper forward kernel: TMA descriptors for Q/K/V/O (rows, d, heads, batch),
// dynamic shared memory opt-in, the scheduler's section size and counter reset, and the persistent
// grid (one CTA per SM at most). Host only; instantiated once per manifest entry.
#pragma once

#include <algorithm>

#include <cuda_runtime.h>

#include "common/launch_status.h"
#include "hopper/fwd_kernel.h"

namespace flashtile::hopper {

template <class Element, int kHeadDim, int kHeadDimV, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Traits = FwdTraits<Element, kHeadDim, kHeadDimV>;
  using KP = FwdKernelParams<Traits>;
  FtFwdParams const& p = params.abi;
  auto kernel = fwd_kernel<Traits, kIsBand, kHasSoftcap>;
  constexpr int kSmem = Traits::kSmemBytes;
  if (LaunchStatus s = opt_in_smem(reinterpret_cast<void const*>(kernel), p.device, kSmem); !s.ok()) { return s; }

  // Packed (varlen) tensors: one "batch" of rows_* rows; the kernel offsets by cu_seqlens.
  int const batch_q = p.cu_seqlens_q ? 1 : p.batch;
  int const batch_k = p.cu_seqlens_k ? 1 : p.batch;
  auto gmem = [](void const* ptr, ShapeQKV shape, int64_t row, int64_t head, int64_t batch) {
    return make_gmem_tensor(static_cast<Element const*>(ptr), shape, row, head, batch);
  };
  KP kp;
  kp.fwd = params;
  kp.shape_q = ShapeQKV{p.rows_q, p.head_dim, p.num_heads, batch_q};
  kp.shape_k = ShapeQKV{p.rows_k, p.head_dim, p.num_heads_k, batch_k};
  kp.shape_v = ShapeQKV{p.rows_k, p.head_dim_v, p.num_heads_k, batch_k};
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem(p.q, kp.shape_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                           take<0, 2>(typename Traits::SmemLayoutQ{}), select<0, 2>(typename Traits::TileShapeQK{}), _1{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(p.k, kp.shape_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                           take<0, 2>(typename Traits::SmemLayoutK{}), select<1, 2>(typename Traits::TileShapeQK{}), _1{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem(p.v, kp.shape_v, p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                           take<0, 2>(typename Traits::SmemLayoutV{}), select<2, 1>(typename Traits::TileShapePV{}), _1{});
  // O: one consumer warpgroup's 64 rows per TMA store (only for rows all in bounds; TMA clips the
  // columns of a padded head-dim bucket).
  kp.shape_o = ShapeQKV{p.rows_q, p.head_dim_v, p.num_heads, batch_q};
  kp.tma_o = make_tma_copy(SM90_TMA_STORE{},
                           make_gmem_tensor(static_cast<Element*>(p.out), kp.shape_o, p.o_row_stride, p.o_head_stride, p.o_batch_stride),
                           typename Traits::SmemLayoutOWG{}, typename Traits::TileShapeOWG{}, _1{});

  kp.num_m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  DeviceAttrs attrs;
  if (LaunchStatus s = device_attrs(p.device, attrs); !s.ok()) { return s; }
  int const num_sms = attrs.num_sms;
  // Band masks interleave the (head, batch) pairs of one section longest-first: as many as keep their
  // K/V within l2_section_bytes (a share of the 50 MB L2 that leaves room for Q/O traffic); query heads
  // of one KV head share its K/V. Short keys take half the share: at seqlen 512 a 32 MB section spans
  // four waves of tiles whose Q/O traffic evicts the K/V before its reuse (ncu: 16-30% more DRAM reads
  // than Q + K + V); 16 MB measured +12% at d 128 causal 512 and +8% at d 64 causal 1k, but -2% at 16k.
  int64_t const l2_section_bytes = (p.seqlen_k <= 1024 ? 16ll : 32ll) << 20;
  int64_t const kv_bytes = int64_t(p.seqlen_k) * (kHeadDim + kHeadDimV) * int64_t(sizeof(Element));
  int64_t const section = l2_section_bytes / std::max<int64_t>(kv_bytes, 1) * params.h_h_k_ratio;
  kp.heads_per_section = int(std::clamp<int64_t>(section, 1, int64_t(p.num_heads) * p.batch));
  TileScheduler<kIsBand> const sched{kp.num_m_blocks, p.num_heads, p.batch, kp.heads_per_section, p.tile_counter};
  if (cudaError_t e = cudaMemsetAsync(p.tile_counter, 0, sizeof(int32_t), stream)) {
    return LaunchStatus::cuda(e, "cudaMemsetAsync(tile_counter)");
  }
  dim3 const grid(std::min(sched.num_tiles(), num_sms));
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(kp);
  return LaunchStatus::cuda(cudaGetLastError(), "hopper fwd_kernel launch");
}

}  // namespace flashtile::hopper
