// The Hopper backward's walks and its fused preprocess (HopperBwdTile::fused_pre; off by default:
// measured slower, benchmarks/NOTES.md session 53).
//
// A CTA's walk (BwdWalk): its KV block, head and batch element, and the query blocks it visits, for
// any place in the launch order, so that a CTA can reason about the walk of another.
//
// Fused preprocess: instead of a kernel before the main one, two warps of the producer warpgroup
// (otherwise idle) compute D = rowsum(dO * O) - dlse and the LSE in the exp2 domain of the query
// blocks while the consumers run. A block is done once, by whichever warp claims it first:
// abi.dsoftmax_sum and abi.lse_log2 start filled with kFusedPreEmpty (a NaN pattern no arithmetic
// produces), the claim is a CAS of the block's first D row to kFusedPreClaimed, and the rows' values
// replace the pattern as they are computed. Consumers load both as before and reload while a value
// still holds the pattern (fused_pre_pending). Each CTA's warps claim the blocks of their own walk in
// order (so a block a consumer waits for is always claimed by a running warp: no deadlock), then the
// first ones of the CTA launched num_resident places later (one wave later), which then finds them
// done when it starts. The warps stop claiming when their CTA's consumers finish, so that a short
// CTA does not hold its SM for them. O and dO rows reach a warp by cp.async through a shared-memory
// buffer, so that its few registers do not bound the bytes in flight.
#pragma once

#include <cute/config.hpp>
#include <cute/arch/util.hpp>

#include "common/block_order.h"
#include "common/bwd_params.h"
#include "common/bwd_prepost.h"
#include "common/seq_info.h"

namespace flashtile::hopper {

constexpr uint32_t kFusedPreEmpty = 0xFFFFFFFFu;
constexpr uint32_t kFusedPreClaimed = 0xFFFFFFFEu;

// A loaded D or LSE value that the fused preprocess has not written yet.
CUTE_DEVICE bool fused_pre_pending(float v) { return __float_as_uint(v) >= kFusedPreClaimed; }

CUTE_DEVICE float load_relaxed_gpu(float const* ptr) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(ptr) : "memory");
  return v;
}

struct BwdWalk {
  SeqInfo seq;
  int n_block, bidh_k, bidb;
  int m_block_min, m_block_max, m_first;
  int num_m_blocks, num_n_blocks, num_steps;
  bool live;     // the KV block has keys (else the CTA exits at once, and walks nothing)
  bool rotated;  // starts at query block n_block (deterministic mode, common/block_order.h)
};

// The walk of the CTA at grid coordinates cta (band_block_coord). Deterministic mode runs the KV blocks
// in descending order; rotated walks need at most one KV block per query block (non-band:
// m_block_min = 0).
template <bool kIsBand>
CUTE_DEVICE BwdWalk bwd_walk(BwdParams const& params, BlockCoord cta, int block_m, int block_n) {
  FtFwdParams const& p = params.fwd.abi;
  BwdWalk w;
  w.n_block = params.abi.deterministic ? int(gridDim.x) - 1 - cta.block : cta.block;
  w.bidh_k = cta.bidh;
  w.bidb = cta.bidb;
  w.seq = SeqInfo(p, w.bidb);
  w.live = w.n_block * block_n < w.seq.seqlen_k;
  q_block_range<kIsBand>(p, w.seq, w.n_block, block_m, block_n, w.m_block_min, w.m_block_max);
  w.num_m_blocks = max(0, w.m_block_max - w.m_block_min);
  w.num_steps = w.num_m_blocks * params.fwd.h_h_k_ratio;  // of a live walk
  w.num_n_blocks = (w.seq.seqlen_k + block_n - 1) / block_n;
  w.rotated = !kIsBand && params.dq_rotate && w.num_n_blocks <= w.num_m_blocks;
  w.m_first = w.rotated ? w.n_block : w.m_block_min;
  return w;
}

// Step idx of a walk.
CUTE_DEVICE BwdStep bwd_walk_step(BwdWalk const& w, int group, int idx) {
  return bwd_step_at(w.bidh_k, group, w.m_block_min, w.m_block_max, w.m_first, idx);
}

// An opaque copy of v: what is derived from it is recomputed where it is needed instead of being hoisted
// and kept live (the fused preprocess runs in the producer warpgroup's 40 registers).
CUTE_DEVICE int opaque(int v) {
  asm volatile("mov.b32 %0, %0;" : "+r"(v));
  return v;
}

// One warp: D of query block m_block of head bidh of batch element bidb (rows below seqlen_q), O and
// dO staged kRows rows at a time in `stage` (kStageBytes): each lane copies one 16-byte column of a
// row, several rows apart, through running pointers. Each row's statistics as in the preprocess
// kernel (bwd_row_stats).
template <class Element, int kHeadDimV, int kBlockM, int kStageBytes>
CUTE_DEVICE void fused_pre_block(BwdParams const& params, int bidb, int bidh, int m_block, char* stage) {
  FtFwdParams const& p = params.fwd.abi;
  FtBwdParams const& b = params.abi;
  constexpr int kVec = 16 / int(sizeof(Element));
  constexpr int kVecsPerRow = kHeadDimV / kVec;
  constexpr int kCopyLanes = kVecsPerRow <= 4 ? 4 : kVecsPerRow <= 8 ? 8 : kVecsPerRow <= 16 ? 16 : 32;
  static_assert(kVecsPerRow <= 32);
  constexpr int kCopyRows = 32 / kCopyLanes;  // rows one copy instruction covers
  constexpr int kFit = kStageBytes / (2 * kHeadDimV * int(sizeof(Element)));
  constexpr int kRows = kFit >= 32 ? 32 : kFit >= 16 ? 16 : kFit >= 8 ? 8 : kFit >= 4 ? 4 : 2;
  static_assert(kFit >= 2 && kBlockM % kRows == 0 && kRows % kCopyRows == 0);
  constexpr int kLanes = 32 / kRows;  // lanes per row in the reduction
  static_assert(kVecsPerRow % kLanes == 0, "a row's vectors split evenly over its lanes");
  constexpr int kChunkBytes = kRows * kHeadDimV * int(sizeof(Element));  // one tensor's rows of a chunk
  int const lane = threadIdx.x % 32;
  SeqInfo const seq(p, bidb);
  int const row0 = m_block * kBlockM;
  int const rows = min(kBlockM, seq.seqlen_q - row0);
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    // This lane's column of rows r0 + lane / kCopyLanes + j * kCopyRows; `left` counts the rows to the
    // block's end from there.
    int const sub = lane / kCopyLanes;
    int const col = (lane % kCopyLanes) * kVec;
    int const row = row0 + r0 + sub;
    Element const* o = static_cast<Element const*>(p.out) + seq.o_offset(p, bidb) + bidh * p.o_head_stride +
                       int64_t(row) * p.o_row_stride + col;
    Element const* d = static_cast<Element const*>(b.dout) + seq.q_like_offset(p, bidb, b.do_batch_stride, b.do_row_stride) +
                       bidh * b.do_head_stride + int64_t(row) * b.do_row_stride + col;
    uint32_t at = cute::cast_smem_ptr_to_uint(stage) + (sub * kVecsPerRow + lane % kCopyLanes) * 16;
    int left = rows - r0 - sub;
    bool const col_in = lane % kCopyLanes < kVecsPerRow && col < p.head_dim_v;
#pragma unroll 1
    for (int j = 0; j < kRows / kCopyRows; ++j) {
      uint32_t const bytes = col_in && left > 0 ? 16 : 0;
      if (lane % kCopyLanes < kVecsPerRow) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(o), "r"(bytes) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at + kChunkBytes), "l"(d), "r"(bytes) : "memory");
      }
      o += kCopyRows * p.o_row_stride;
      d += kCopyRows * b.do_row_stride;
      at += kCopyRows * kVecsPerRow * 16;
      left -= kCopyRows;
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
    __syncwarp();
    int const r = lane / kLanes, part = lane % kLanes;
    float dot = 0.f;
    // Each row starts at its own column, so that the 8 lanes of a 16-byte shared load phase read
    // different banks.
    CUTE_UNROLL
    for (int i = 0; i < kVecsPerRow / kLanes; ++i) {
      int const c = (i * kLanes + part + r) % kVecsPerRow;
      uint4 const a = *reinterpret_cast<uint4 const*>(stage + (r * kVecsPerRow + c) * 16);
      uint4 const g = *reinterpret_cast<uint4 const*>(stage + kChunkBytes + (r * kVecsPerRow + c) * 16);
      Element const* ae = reinterpret_cast<Element const*>(&a);
      Element const* ge = reinterpret_cast<Element const*>(&g);
      CUTE_UNROLL
      for (int k = 0; k < kVec; ++k) { dot += float(ae[k]) * float(ge[k]); }
    }
    CUTE_UNROLL
    for (int off = kLanes / 2; off > 0; off /= 2) { dot += __shfl_xor_sync(0xffffffff, dot, off); }
    if (part == 0 && r0 + r < rows) {
      int64_t const at = seq.lse_offset(p, bidb) + bidh * p.lse_head_stride + row0 + r0 + r;
      float dsum, lse_log2;
      bwd_row_stats(p.lse[at], b.dlse != nullptr ? b.dlse[at] : 0.f, dot, dsum, lse_log2);
      // Published as the pending pattern's replacement: never the pattern itself.
      auto publish = [](float* dst, float v) {
        uint32_t const bits = fused_pre_pending(v) ? 0x7FFFFFFFu : __float_as_uint(v);
        asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(dst), "r"(bits) : "memory");
      };
      publish(b.dsoftmax_sum + at, dsum);
      publish(b.lse_log2 + at, lse_log2);
    }
    __syncwarp();  // the chunk's staging read before the next chunk's copies
  }
}

// D's first row of step idx of the walk w (the claim word of its query block).
template <int kBlockM>
CUTE_DEVICE float* fused_pre_claim_word(BwdParams const& params, BwdWalk const& w, int idx) {
  FtFwdParams const& p = params.fwd.abi;
  BwdStep const st = bwd_walk_step(w, params.fwd.h_h_k_ratio, idx);
  return params.abi.dsoftmax_sum + w.seq.lse_offset(p, w.bidb) + st.bidh * p.lse_head_stride + st.m_block * kBlockM;
}

// One warp: claims, in walk order, the blocks of the first max_steps steps of the walk of the CTA at
// launch place `place` that nobody has, and computes their D; stops claiming once *done is set (this
// CTA's consumers have finished: its SM is not held for work that the CTAs needing it can claim
// themselves). 32 steps' blocks are checked at once (a lane each); the open ones are then claimed in
// turn. The walk is recomputed from `place` where it is needed.
template <bool kIsBand, class Element, int kHeadDimV, int kBlockM, int kBlockN, int kStageBytes>
CUTE_DEVICE void fused_pre_walk(BwdParams const& params, int place, int max_steps, int const volatile* done, char* stage) {
  auto walk_of = [&] {
    return bwd_walk<kIsBand>(params, band_block_coord(params.pairs_per_section, opaque(place)), kBlockM, kBlockN);
  };
  auto stopped = [&] { return __shfl_sync(0xffffffff, *done, 0) != 0; };
  int const lane = threadIdx.x % 32;
  for (int s0 = 0;; s0 += 32) {
    uint32_t open;
    {
      BwdWalk const w = walk_of();
      if (!w.live || s0 >= min(w.num_steps, max_steps) || stopped()) { return; }
      bool const mine = s0 + lane < min(w.num_steps, max_steps) &&
                        __float_as_uint(load_relaxed_gpu(fused_pre_claim_word<kBlockM>(params, w, s0 + lane))) == kFusedPreEmpty;
      open = __ballot_sync(0xffffffff, mine);
    }
    while (open != 0 && !stopped()) {
      int const src = __ffs(open) - 1;
      open &= open - 1;
      BwdWalk const w = walk_of();
      int won = 0;
      if (lane == 0) {
        won = atomicCAS(reinterpret_cast<unsigned*>(fused_pre_claim_word<kBlockM>(params, w, s0 + src)), kFusedPreEmpty,
                        kFusedPreClaimed) == kFusedPreEmpty;
      }
      if (__shfl_sync(0xffffffff, won, 0)) {
        BwdStep const st = bwd_walk_step(w, params.fwd.h_h_k_ratio, s0 + src);
        fused_pre_block<Element, kHeadDimV, kBlockM, kStageBytes>(params, w.bidb, st.bidh, st.m_block, stage);
      }
    }
  }
}

}  // namespace flashtile::hopper
