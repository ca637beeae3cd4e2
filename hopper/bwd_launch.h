// Host launcher of the Hopper backward: preprocess (D, LSE in exp2 domain, dq accumulator cleared),
// the main kernel (grid: KV blocks x KV heads x batch; TMA descriptors for Q, dO, K, V and the
// reduce-add into the fp32 dq accumulator) and the dq postprocess, all on one stream; the main kernel
// and the postprocess are launched to overlap the tail of the kernel before them (common/bwd_prepost.h).
// Host only; instantiated once per manifest entry.
#pragma once

#include <cuda_runtime.h>

#include "common/block_order.h"
#include "common/bwd_prepost.h"
#include "common/grid_dependency.h"
#include "common/launch_status.h"
#include "common/tile_policy.h"
#include "hopper/bwd_kernel.h"

namespace flashtile::hopper {

template <class Element, int kHeadDim, int kHeadDimV, bool kIsBand, bool kHasSoftcap>
LaunchStatus run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Traits = BwdTraits<Element, kHeadDim, kHeadDimV>;
  using KP = BwdKernelParams<Traits>;
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;
  auto kernel = bwd_kernel<Traits, kIsBand, kHasSoftcap>;
  constexpr int kSmem = Traits::kSmemBytes;
  if (LaunchStatus s = opt_in_smem(reinterpret_cast<void const*>(kernel), p.device, kSmem); !s.ok()) { return s; }

  int const batch_q = p.cu_seqlens_q ? 1 : p.batch;
  int const batch_k = p.cu_seqlens_k ? 1 : p.batch;
  // The dq accumulator's rows (see FtBwdParams): padded per sequence when packed, to whole
  // FT_BWD_ACCUM_ROW_PAD blocks otherwise; its row width is the head-dim bucket.
  int const pad = FT_BWD_ACCUM_ROW_PAD;
  int const rows_acc = p.cu_seqlens_q ? p.rows_q + pad * p.batch : (p.seqlen_q + pad - 1) / pad * pad;
  static_assert(Traits::kBlockM <= FT_BWD_ACCUM_ROW_PAD, "a dQ tile must stay inside its sequence's padding");
  auto in = [](void const* ptr, ShapeQKV shape, int64_t row, int64_t head, int64_t batch) {
    return make_gmem_tensor(static_cast<Element const*>(ptr), shape, row, head, batch);
  };
  KP kp;
  kp.bwd = params;
  kp.shape_q = ShapeQKV{p.rows_q, p.head_dim, p.num_heads, batch_q};
  kp.shape_do = ShapeQKV{p.rows_q, p.head_dim_v, p.num_heads, batch_q};
  kp.shape_k = ShapeQKV{p.rows_k, p.head_dim, p.num_heads_k, batch_k};
  kp.shape_v = ShapeQKV{p.rows_k, p.head_dim_v, p.num_heads_k, batch_k};
  kp.shape_dq_accum = ShapeQKV{rows_acc, kHeadDim, p.num_heads, batch_q};
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, in(p.q, kp.shape_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                           take<0, 2>(typename Traits::SmemLayoutQ{}), Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
  kp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, in(b.dout, kp.shape_do, b.do_row_stride, b.do_head_stride, b.do_batch_stride),
                            take<0, 2>(typename Traits::SmemLayoutdO{}), Shape<Int<Traits::kBlockM>, Int<kHeadDimV>>{}, _1{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, in(p.k, kp.shape_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                           typename Traits::SmemLayoutK{}, Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, in(p.v, kp.shape_v, p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                           typename Traits::SmemLayoutV{}, Shape<Int<Traits::kBlockN>, Int<kHeadDimV>>{}, _1{});
  if constexpr (!Traits::kdQRed && !Traits::kdQFrag) {
    kp.tma_dq = make_tma_copy(SM90_TMA_REDUCE_ADD{},
                              make_gmem_tensor(b.dq_accum, kp.shape_dq_accum, b.dq_accum_row_stride, b.dq_accum_head_stride,
                                               b.dq_accum_batch_stride),
                              typename Traits::SmemLayoutdQPart{},
                              Shape<Int<Traits::kdQPartRows>, Int<Traits::kdQPartCols>>{}, _1{});
  }

  if (LaunchStatus s = launch_bwd_preprocess<Element, kHeadDimV>(params, stream); !s.ok()) { return s; }
  dim3 const grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.num_heads_k, p.batch);
  kp.bwd.pairs_per_section = bwd_pairs_per_section<Element, kHeadDim, kHeadDimV>(params, kIsBand, grid, 2048);
  // The dQ writer counts its CTA into dq_done once its adds have landed (not under kdQRed, where the
  // consumers add from registers); a (batch, KV head) is done at grid.x counts.
  kp.bwd.dq_done_count = !Traits::kdQRed && b.dq_done != nullptr ? int(grid.x) : 0;
  DeviceAttrs attrs;
  if (LaunchStatus s = device_attrs(p.device, attrs); !s.ok()) { return s; }
  kp.bwd.dq_rotate = bwd_dq_rotate(params, kIsBand, grid, attrs.num_sms);
  if (LaunchStatus s = LaunchStatus::cuda(launch_dependent(kernel, grid, dim3(Traits::kNThreads), kSmem, stream, kp),
                                          "hopper bwd_kernel launch");
      !s.ok()) {
    return s;
  }
  // The accumulator is in DqAccumPerm order when the kernel adds into it from registers, in DqAccumFrag
  // order under kdQFrag, else row-major.
  return launch_bwd_postprocess<Element, kHeadDim, Traits::kdQRed, Traits::kdQFragCols>(kp.bwd, stream,
                                                                                        /*dependent=*/true);
}

}  // namespace flashtile::hopper
