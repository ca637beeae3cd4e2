// Host launcher of the Hopper forward kernel: TMA descriptors for Q/K/V/O (rows, d, heads, batch),
// dynamic shared memory opt-in, the scheduler's section size and counter clear (unless the caller
// keeps it zero), and the persistent grid (one CTA per SM at most). Host only; instantiated once per
// manifest entry.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "common/launch_status.h"
#include "hopper/fwd_kernel.h"

// Build-time override of the KV heads per group before the last band-mask section (measurement;
// 0 = sections throughout); -1 = policy.
#ifndef FLASHTILE_FWD_LEAD_KV_HEADS
#define FLASHTILE_FWD_LEAD_KV_HEADS -1
#endif

namespace flashtile::hopper {

// Whether to pack the query heads of a GQA group into one tile: pack_gqa 1 / -1 forces it on / off
// (packing needs group <= block_m), 0 packs where the packed tiles are fuller: a tile of block_m rows holds
// block_m / group queries of every head of the group, so short query sequences (decode, short
// prefill) fill whole tiles and load each K/V block once per group rather than once per head.
// Returns the packing factor (the group size) or 1.
inline int fwd_pack_gqa(FtFwdParams const& p, int block_m) {
  int const group = p.num_heads / p.num_heads_k;
  if (group <= 1 || group > block_m || p.pack_gqa < 0) { return 1; }
  if (p.pack_gqa > 0) { return group; }
  int const q_per_tile = block_m / group;
  int64_t const sq = p.seqlen_q;
  double const fill_unpacked = double(sq) / double((sq + block_m - 1) / block_m * block_m);
  double const fill_packed = double(sq * group) / double((sq + q_per_tile - 1) / q_per_tile * block_m);
  return fill_unpacked < 0.9 * fill_packed ? group : 1;
}

// FwdKernelParams::q_shift (kQShift kernels): under a band mask whose right edge is no wider than its
// left one (causal, causal-local windows), a query length that is not a multiple of block_m leaves its
// partial block first, where its rows see the fewest keys. One shift for every batch element: fixed
// query lengths only, and no GQA packing.
template <class Traits, bool kIsBand>
int fwd_q_shift(FtFwdParams const& p, int pack) {
  if (!kQShift<Traits, kIsBand> || pack > 1 || p.cu_seqlens_q || p.seqused_q) { return 0; }
  if (p.window_right < 0 || (p.window_left >= 0 && p.window_left < p.window_right)) { return 0; }
  int const rem = p.seqlen_q % Traits::kBlockM;
  return rem == 0 ? 0 : Traits::kBlockM - rem;
}

// The 5-d TMA descriptor of GQA-packed Q tiles: q as (d, pack, rows, KV heads, batch) with byte
// strides (head, row, pack * head, batch), box (swizzle atom columns, pack, q_per_tile, 1, 1) and the
// swizzle of SmemLayoutQ, so each load fills one column chunk of the tile exactly as the unpacked
// load would, row r holding query r / pack of head r % pack.
template <class Traits>
LaunchStatus encode_q_packed(FtFwdParams const& p, int pack, int q_per_tile, CUtensorMap& desc) {
  using Element = typename Traits::Element;
  constexpr int kChunk = Traits::kQChunkCols;
  constexpr int64_t kBytes = sizeof(Element);
  cuuint64_t const dims[5] = {cuuint64_t(p.head_dim), cuuint64_t(pack), cuuint64_t(p.rows_q), cuuint64_t(p.num_heads_k),
                              cuuint64_t(p.cu_seqlens_q ? 1 : p.batch)};
  cuuint64_t const strides[4] = {cuuint64_t(p.q_head_stride * kBytes), cuuint64_t(p.q_row_stride * kBytes),
                                 cuuint64_t(p.q_head_stride * pack * kBytes),
                                 cuuint64_t((p.cu_seqlens_q ? p.q_row_stride * p.rows_q : p.q_batch_stride) * kBytes)};
  cuuint32_t const box[5] = {cuuint32_t(kChunk), cuuint32_t(pack), cuuint32_t(q_per_tile), 1, 1};
  cuuint32_t const elem_strides[5] = {1, 1, 1, 1, 1};
  CUtensorMapSwizzle const swizzle = kChunk * kBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : kChunk * kBytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                             : CU_TENSOR_MAP_SWIZZLE_32B;
  CUresult const r = cuTensorMapEncodeTiled(
      &desc, std::is_same_v<Element, cutlass::half_t> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      5, const_cast<void*>(p.q), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { return {kFtCudaError, "cuTensorMapEncodeTiled (GQA-packed q) failed: " + std::to_string(int(r))}; }
  return {};
}

// One launch of fwd_kernel with kClusterM CTAs per cluster; `pack` from fwd_pack_gqa.
template <class Traits, bool kIsBand, bool kHasSoftcap, int kClusterM>
LaunchStatus launch_fwd(FwdParams const& params, int pack, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  using KP = FwdKernelParams<Traits, kClusterM>;
  using TmaLoadKV = typename KP::TmaLoadKV;
  FtFwdParams const& p = params.abi;
  auto kernel = fwd_kernel<Traits, kIsBand, kHasSoftcap, kClusterM>;
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
                           typename Traits::SmemLayoutQLoad{}, typename Traits::TileShapeQLoad{}, _1{});
  kp.tma_k = make_tma_copy(TmaLoadKV{}, gmem(p.k, kp.shape_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                           take<0, 2>(typename Traits::SmemLayoutK{}), select<1, 2>(typename Traits::TileShapeQK{}),
                           Int<kClusterM>{});
  kp.tma_v = make_tma_copy(TmaLoadKV{}, gmem(p.v, kp.shape_v, p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                           take<0, 2>(typename Traits::SmemLayoutV{}), select<2, 1>(typename Traits::TileShapePV{}),
                           Int<kClusterM>{});
  // O: one consumer warpgroup's 64 rows per TMA store (only for rows all in bounds; TMA clips the
  // columns of a padded head-dim bucket).
  kp.shape_o = ShapeQKV{p.rows_q, p.head_dim_v, p.num_heads, batch_q};
  kp.tma_o = make_tma_copy(SM90_TMA_STORE{},
                           make_gmem_tensor(static_cast<Element*>(p.out), kp.shape_o, p.o_row_stride, p.o_head_stride, p.o_batch_stride),
                           typename Traits::SmemLayoutOWG{}, typename Traits::TileShapeOWG{}, _1{});

  // GQA packing (see FwdKernelParams::pack).
  kp.pack = pack;
  kp.k_ahead = kIsBand && hopper_fwd_k_ahead_band(Traits::kTile, p.seqlen_k) ? 1 : 0;
  kp.q_per_tile = Traits::kBlockM / kp.pack;
  kp.q_shift = fwd_q_shift<Traits, kIsBand>(p, kp.pack);
  kp.tma_bytes_q = Traits::kTmaBytesQ;
  int const sched_heads = kp.pack > 1 ? p.num_heads_k : p.num_heads;
  if (kp.pack > 1) {
    kp.tma_bytes_q = uint32_t(kp.pack * kp.q_per_tile * kHeadDim * sizeof(Element));
    if (LaunchStatus s = encode_q_packed<Traits>(p, kp.pack, kp.q_per_tile, kp.tma_q_packed); !s.ok()) { return s; }
  }
  kp.num_m_blocks = (p.seqlen_q + kp.q_per_tile - 1) / kp.q_per_tile;
  DeviceAttrs attrs;
  if (LaunchStatus s = device_attrs(p.device, attrs); !s.ok()) { return s; }
  int const num_sms = attrs.num_sms;
  // Band masks interleave the (head, batch) pairs of one section longest-first: as many as keep their
  // K/V within l2_section_bytes (a share of the 50 MB L2 that leaves room for Q/O traffic); query heads
  // of one KV head share its K/V. Short keys take half the share: at seqlen 512 a 32 MB section spans
  // four waves of tiles whose Q/O traffic evicts the K/V before its reuse (ncu: 16-30% more DRAM reads
  // than Q + K + V); 16 MB measured +12% at d 128 causal 512 and +8% at d 64 causal 1k, but -2% at 16k.
  // FLASHTILE_FWD_SECTION_MB (common/block_order.h) overrides the share for measurement; 0: the plain
  // order (each pair's tiles in turn, longest first, no lead groups).
  int64_t const l2_section_bytes = FLASHTILE_FWD_SECTION_MB >= 0 ? int64_t(FLASHTILE_FWD_SECTION_MB) << 20
                                                                 : (p.seqlen_k <= 1024 ? 16ll : 32ll) << 20;
  int64_t const kv_bytes = int64_t(p.seqlen_k) * (kHeadDim + kHeadDimV) * int64_t(sizeof(Element));
  int64_t const section = l2_section_bytes / std::max<int64_t>(kv_bytes, 1) * (kp.pack > 1 ? 1 : params.h_h_k_ratio);
  int const num_pairs = sched_heads * p.batch;
  kp.heads_per_section = int(std::clamp<int64_t>(section, 1, num_pairs));
  // Before the last section, d <= 128 takes the pairs in groups of kLeadKvHeads KV heads, each group
  // longest-first: fewer heads' K/V in use at once (ncu, d 128 causal 2k: DRAM reads 255 -> 231 MB,
  // Q + K + V = 192 MB). Only the last section, whose short tiles fill the tail, interleaves all its
  // pairs. Measured (H100, causal, 5 rounds): +1-3% at d 64 / 128 512-4k; -0-2.5% at d 256, which
  // keeps sections throughout.
  constexpr int kLeadKvHeads = FLASHTILE_FWD_LEAD_KV_HEADS >= 0 ? FLASHTILE_FWD_LEAD_KV_HEADS : (kHeadDim <= 128 ? 4 : 0);
  kp.lead_group = std::max(1, kLeadKvHeads * (kp.pack > 1 ? 1 : params.h_h_k_ratio));
  kp.lead_pairs = kLeadKvHeads > 0 && l2_section_bytes > 0 ? num_pairs - kp.heads_per_section : 0;
  int const units = kp.num_m_blocks / kClusterM * sched_heads * p.batch;
  // CTAs (clusters) the grid may have: as many clusters as can be resident at once (an SM left over in
  // a GPC of odd size stays idle).
  int slots = num_sms;
  if constexpr (kClusterM > 1) {
    if (LaunchStatus s = max_active_clusters(reinterpret_cast<void const*>(kernel), p.device, Traits::kNThreads, kSmem,
                                             kClusterM, slots);
        !s.ok()) {
      return s;
    }
    slots = std::max(1, std::min(slots, num_sms / kClusterM));
  }
  // Tail split (hopper_fwd_split_plan, kTailSplit): every tile walks the same blocks only with one
  // length for all batches; each consumer warpgroup's part needs a record in split_accum and a counter
  // in tile_counter.
  FwdSplitPlan plan{units, 1, 0};
  if constexpr (kTailSplit<Traits, kIsBand>) {
    constexpr int64_t kItemBytes =
        int64_t(Traits::kNMmaThreads) * hopper_fwd_split_record_floats(kHeadDimV) * int64_t(sizeof(float));
    if (p.num_splits == 0 && p.split_accum && !p.cu_seqlens_q && !p.cu_seqlens_k && !p.seqused_q && !p.seqused_k &&
        num_sms * Traits::kNMmaWarpGroups < FT_FWD_COUNTERS) {
      int const max_items = int(std::min<int64_t>(p.split_accum_bytes / kItemBytes / kClusterM, 1 << 20));
      plan = hopper_fwd_split_plan(units, slots, (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, max_items);
    }
  }
  kp.num_whole = plan.num_whole;
  kp.splits = plan.splits;
  kp.blocks_per_part = plan.blocks_per_part;
  if constexpr (kTailSplit<Traits, kIsBand>) {
    if (plan.splits > 1) {
      kernel = fwd_kernel<Traits, kIsBand, kHasSoftcap, kClusterM, true>;
      if (LaunchStatus s = opt_in_smem(reinterpret_cast<void const*>(kernel), p.device, kSmem); !s.ok()) { return s; }
    }
  }
  // The split scheduler's count: the plan's tiles (every unit whole where it does not split).
  TileScheduler<kIsBand, kClusterM, true> const sched{kp.num_m_blocks, sched_heads, p.batch,
                                                kp.heads_per_section, kp.lead_pairs, kp.lead_group, p.tile_counter,
                                                kp.num_whole, kp.splits};
  // A cluster launch that does not split reads no counter (its schedule is static).
  if (!p.tile_counter_zeroed && (kClusterM == 1 || plan.splits > 1)) {
    if (cudaError_t e = cudaMemsetAsync(p.tile_counter, 0, FT_FWD_COUNTERS * sizeof(int32_t), stream)) {
      return LaunchStatus::cuda(e, "cudaMemsetAsync(tile_counter)");
    }
  }
  if constexpr (kClusterM == 1) {
    dim3 const grid(std::min(sched.num_tiles(), num_sms));
    kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(kp);
    return LaunchStatus::cuda(cudaGetLastError(), "hopper fwd_kernel launch");
  } else {
    int const clusters = std::min(sched.num_tiles(), slots);
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t const config =
        cluster_launch_config(clusters * kClusterM, Traits::kNThreads, kSmem, stream, kClusterM, attr);
    return LaunchStatus::cuda(cudaLaunchKernelEx(&config, kernel, kp), "hopper fwd_kernel cluster launch");
  }
}

// Chooses the cluster kernel where its static schedule applies: no band mask (tiles of one length),
// fixed-length batches (cu_seqlens / seqused_q would give the CTAs of a cluster tiles of different
// lengths, or one with no rows), no GQA packing, and query blocks that pair up exactly.
template <class Traits, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_fwd_tile(FwdParams const& params, cudaStream_t stream) {
  FtFwdParams const& p = params.abi;
  int const pack = fwd_pack_gqa(p, Traits::kBlockM);
  if constexpr (Traits::kClusterM > 1 && !kIsBand) {
    int const num_m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    if (pack == 1 && !p.cu_seqlens_q && !p.cu_seqlens_k && !p.seqused_q && num_m_blocks % Traits::kClusterM == 0) {
      return launch_fwd<Traits, kIsBand, kHasSoftcap, Traits::kClusterM>(params, pack, stream);
    }
  }
  return launch_fwd<Traits, kIsBand, kHasSoftcap, 1>(params, pack, stream);
}

// The tile (tall or not) from the tile policy's host heuristic, then the kernel.
template <class Element, int kHeadDim, int kHeadDimV, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Traits = FwdTraits<Element, kHeadDim, kHeadDimV>;
  using TraitsTall = FwdTraits<Element, kHeadDim, kHeadDimV, true>;
  if constexpr (TraitsTall::kBlockM != Traits::kBlockM) {
    if (hopper_fwd_tall(kHeadDim, kHeadDimV, params.abi.seqlen_q)) {
      return run_fwd_tile<TraitsTall, kIsBand, kHasSoftcap>(params, stream);
    }
  }
  return run_fwd_tile<Traits, kIsBand, kHasSoftcap>(params, stream);
}

}  // namespace flashtile::hopper
