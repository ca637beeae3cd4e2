// Tile policy: the one place that chooses block sizes, warps and pipeline depth per kernel family.
// Both the kernels (as template arguments) and the host launchers/heuristics call these constexpr
// functions, so the two can never disagree.
#pragma once

#include <cstdint>

namespace flashtile {

struct FwdTile {
  int block_m;
  int block_n;
  int num_warps;
  // Warps along the keys of S = Q K^T and along the value columns of O (the rest along the rows).
  // 2: a warp pair shares its rows; each warp takes half the keys of S and half the columns of O,
  // the pair combines its row maxima through shared memory and P goes through shared memory.
  int warps_n = 1;
};

// Ampere-path forward (mma.sync + cp.async); also runs on sm_90 when that path is forced.
// Shared memory: (block_m * d + 2 * block_n * d) * 2 bytes, plus 1 KB of per-thread constants; hdim
// 128: 64 KB. Up to hdim 128 each warp owns 16 rows of every 16 * num_warps-row slice of the query
// block (32 rows, O in 64-128 registers). Above hdim 128 a warp's O takes 128 registers at 16 rows
// of 256 columns, so a warp that owned all its rows' keys and columns would read every K and V
// byte per 16 rows: 72 KB of ldmatrix per 1 MFLOP at d = 256, against 40 KB at d = 128, the
// shared-memory pipe then bounding the step. Warp pairs split the keys and columns instead
// (warps_n = 2): 32 rows per warp, 52 KB per 1 MFLOP, for a row-max exchange per block and P
// (block_m x block_n) through shared memory. Tiles above hdim 128:
// - split: 64 x 64 on 2 x 2 warps (hdim 256: 106 KB; two CTAs per SM on sm_90);
// - split wide: 128 x 64 on 4 x 2 warps (hdim 256: 148 KB; sm_80, where a split one does not fit
//   twice, keeping 8 warps per SM);
// - unsplit: 64 x 64 on 4 warps (96 KB), for sm_86 / sm_89's 99 KB per block.
// (Unsplit, 64 x 64 on 4 warps measured 3-13% faster on an H100 than 128 x 64 on 8 warps, whose
// single CTA per SM stalls at every block barrier.)
constexpr FwdTile ampere_fwd_tile(int head_dim, bool wide = false, bool split = false) {
  return head_dim <= 64    ? FwdTile{128, 128, 4}
         : head_dim <= 128 ? FwdTile{128, 64, 4}
         : split           ? (wide ? FwdTile{128, 64, 8, 2} : FwdTile{64, 64, 4, 2})
         : wide            ? FwdTile{128, 64, 8}
                           : FwdTile{64, 64, 4};
}

// The split 64-row tile (2 x 2 warps; the wide split tile has 128 rows on 4 x 2).
constexpr bool ampere_fwd_is_split_narrow(FwdTile const& t) { return t.warps_n == 2 && t.block_m == 64; }

// Build-time override of ampere_fwd_load_after: -1 policy, n >= 0 the k-slices issued before the loads.
#ifndef FLASHTILE_AMPERE_FWD_LOAD_AFTER
#define FLASHTILE_AMPERE_FWD_LOAD_AFTER -1
#endif

// Ampere-path forward: each KV step loads V[n] after the barrier that precedes S = Q K^T and K[n-1] after
// the one that precedes O += P V; the loads' address arithmetic (64-bit row addresses from the stashed
// thread index, ~50 instructions per load) then issues before the GEMM's first MMA. The number of k-slices
// of each GEMM issued before its load (0: the load first). Measured on an H200 (sustained rounds,
// benchmarks/NOTES.md session 44): d = 256 split 64 x 64 without a mask, 2 (after the second slice of each
// GEMM): +1.3% / +1.6% / +2.8% at 1k / 4k / 16k over seven rounds; causal -1-2.3% (kept at 0); V after
// slice 4 or 8 of S: +1-2%; after the first slice of each: -3%. d = 128 with the K load inside the PV
// GEMM: +1% but 88-128 B of spills at every slice, the V load alone: level; d = 64: 4-16 B of spills. The
// wide split tile (sm_80) keeps 0: not measured.
constexpr int ampere_fwd_load_after(FwdTile const& t, int head_dim, bool band) {
  if (FLASHTILE_AMPERE_FWD_LOAD_AFTER >= 0) { return FLASHTILE_AMPERE_FWD_LOAD_AFTER; }
  return head_dim > 192 && ampere_fwd_is_split_narrow(t) && !band ? 2 : 0;
}

// Ampere-path forward, split tiles: whether each warp stores its half of P through XOR-folded addresses
// from one base read from the per-thread constants (StsXorTarget) rather than the store copy's addressing,
// which re-derives ~15 integer instructions per block from the thread index between the softmax and the
// barrier. H200 (benchmarks/NOTES.md session 44), d = 256 split 64 x 64: +1.3-1.7% without a mask,
// -0.4-0.7% causal. Taken where measured: that tile without a mask.
constexpr bool ampere_fwd_p_store_xor(FwdTile const& t, int head_dim, bool band) {
  return head_dim > 192 && ampere_fwd_is_split_narrow(t) && !band;
}

// Build-time overrides of the tile choice above hdim 128 (ampere_fwd_tile_kind), to test each tile on
// any device: FLASHTILE_AMPERE_FWD_WIDE 0 never, 1 wherever it fits; FLASHTILE_AMPERE_FWD_SPLIT 0
// never, 1 wherever it fits; -1 the policy.
#ifndef FLASHTILE_AMPERE_FWD_WIDE
#define FLASHTILE_AMPERE_FWD_WIDE -1
#endif
#ifndef FLASHTILE_AMPERE_FWD_SPLIT
#define FLASHTILE_AMPERE_FWD_SPLIT -1
#endif

// The tile above hdim 128 for a device, as (wide, split): the first of split, split wide, unsplit,
// unsplit wide that the device admits with 8 warps per SM (each resident block also reserves 1 KB
// of the SM's shared memory); the unsplit tile where none does. bytes[wide][split]: each tile's
// shared memory.
struct FwdTileKind {
  bool wide;
  bool split;
};

constexpr FwdTileKind ampere_fwd_tile_kind(int const (&bytes)[2][2], int smem_per_sm, int smem_optin) {
  auto fits = [&](bool wide, bool split) {
    int const b = bytes[wide][split];
    return b <= smem_optin && (wide || smem_per_sm >= 2 * (b + 1024));
  };
  constexpr int kWide = FLASHTILE_AMPERE_FWD_WIDE;
  constexpr int kSplit = FLASHTILE_AMPERE_FWD_SPLIT;
  for (int split = 1; split >= 0; --split) {
    if (kSplit >= 0 && split != kSplit) { continue; }
    for (int wide = 0; wide <= 1; ++wide) {
      if (kWide >= 0 && wide != kWide) { continue; }
      if (fits(wide, split)) { return FwdTileKind{wide == 1, split == 1}; }
    }
  }
  return FwdTileKind{false, false};
}

// An arch threshold no __CUDA_ARCH__ reaches (a policy taken on no arch).
inline constexpr int kArchNever = 1 << 30;

// Ampere-path backward: each CTA owns block_n keys and walks the query blocks of block_m rows. Three
// warp layouts (rows x cols of warps) tile the three GEMM shapes: S/dP (block_m x block_n), dK/dV
// (block_n x d) and dQ (block_m x d). The dK/dV accumulators (2 * block_n * d fp32 over the CTA) set
// the register budget: block_n 128 up to d = 128, 64 above.
// On sm_90 the kernel is estimated to be bound by shared-memory bandwidth (ldmatrix operand reads),
// not mma.sync, so each layout is the one that reads the fewest operand bytes per step: a warp tile
// of w_m x w_n over a GEMM with inner dimension k reads (w_m + w_n) * k, least when w_m and w_n are
// close. Hence block_m 128 at d = 64 (K/V and the dK/dV GEMMs' B operands amortized over twice the
// rows) and square-ish warp tiles: d = 64: 128 x 128, S/dP on 2 x 4 warps (64 x 32 warp tiles), dK/dV
// and dQ on 4 x 2; d = 128: dQ on 2 x 4 warps (32 x 32 warp tiles, not 16 x 64); d >= 192: S/dP on
// 4 x 2, dK/dV and dQ on 2 x 4 (d = 256: S/dP on 2 x 2 and dK/dV on 1 x 4 warps of one half, below).
// At d = 64, S/dP on 2 x 4 instead of 4 x 2 (the same operand bytes)
// measured +0-2% on an H100 and left the sm_90 code without the 4 / 8 B of spills.
// The column tile of each layout must divide its GEMM's width (hence d = 96 keeps dQ on 4 x 2).
// Shared memory: q_stages * Q, dO (block_m x d) + K, V (block_n x d) + P, dS (block_m x block_n),
// 16-bit, + D (fp32) per stage, + the fp32 P buffer of sdp_split: d = 64: 161 KB, d = 96: 128 KB,
// d = 128: 161 KB, d = 192: 161 KB, d = 256: 161 KB (one stage, split).
struct BwdTile {
  int block_m;
  int block_n;
  int num_warps;
  int warps_m_sdp;  // warps along block_m for S = Q K^T and dP = dO V^T (the rest along block_n; of
                    // half the warps under sdp_split)
  int warps_n_dkv;  // warps along block_n for dK/dV (the rest along d; of half under dkv_split)
  int warps_m_dq;   // warps along block_m for dQ (the rest along d)
  int q_stages;     // Q/dO buffers: 2 loads the next query block during the whole current one
  int dp_whole_arch;  // from this __CUDA_ARCH__ on, the dP GEMM covers all of a warp's rows at once
                      // (V read once) rather than one 16-row block at a time (fewer accumulators
                      // live; never under softcap). sm_80 code fits it at d <= 128 only with the
                      // XOR-folded ldmatrix sources below (12-32 B of spills without them)
  int ldsm_xor_below_arch;  // below this __CUDA_ARCH__, ldmatrix sources are XOR-folded from one base
                            // per tile (LdsmXorSource) rather than the tiled copies' partitions: sm_80
                            // code at d <= 128 needs the registers; sm_90 code measured 2% faster
                            // with the partitions (H100, d = 64 / 128); above d = 128 the folded
                            // forms spill more
  bool dq_first_unmasked = false;  // without a mask, dQ's GEMM and reductions run between dV and dK
                                   // (the reductions drain under dK) rather than last; H100, P stored
                                   // early: d = 128 +1.5-2.4%, with the band mask -4%, d = 64 / 256
                                   // within +-1%; H200 with p_late: d = 64 +1%, d = 128 -3.5% (below)
  // S on the first half of the warps and dP on the second, each over the whole block_m x block_n tile
  // (warps_m_sdp x (num_warps / 2 / warps_m_sdp)); P (times the tanh derivative under softcap) goes
  // to the dP warps through a block_m x block_n fp32 buffer in shared memory. Each warp's tile is
  // twice as large, so the two GEMMs read a third fewer operand bytes (d = 256, 64 x 64 on 8 warps:
  // 384 -> 256 KB of ldmatrix per step, of ~680 KB in all).
  bool sdp_split = false;
  // sdp_split tiles only (d = d_v): the dK/dV GEMMs split the same way, dV on the S warps (from their
  // own P as soon as it is stored) and dK on the dP warps, each over the whole block_n x d tile
  // (1 x num_warps / 2 warps, 64 x 64 warp tiles at d = 256) in one 128-register accumulator per
  // thread: dV runs while the dP warps form dS, and the two GEMMs read a third fewer operand bytes.
  bool dkv_split = false;
  // Unsplit tiles: P goes to shared memory after the dP GEMM, with dS, rather than between the
  // exponentials and that GEMM. ptxas cannot tell the P stores from the GEMM's ldmatrix reads, so
  // stored first they hold the whole dP GEMM until every exponential is done; stored late, the
  // exponentials and the GEMM interleave in one basic block. P stays in its fp32 fragment until then,
  // which dS needs anyway: no registers added (0 B of spills, sm_80 / sm_90 code, softcap included).
  // H200, sustained (benchmarks/NOTES.md session 45), against P stored early: d = 64 +3% without a mask
  // (+4% with dQ first there), +1-1.5% causal; d = 128 +3.5% without a mask (with dQ last; -0.7% with dQ
  // first), +2-2.5% causal. The sm_86 tiles and d = 96 / 192 are not measured and keep it off.
  bool p_late = false;
  // From this __CUDA_ARCH__ on, the next step's Q/dO load is issued inside the dQ GEMM, after k-slice
  // qdo_slice (below), rather than ahead of that GEMM (single-stage tiles) or of the step's S GEMM
  // (two-stage tiles). Ahead, ptxas keeps the GEMM's ldmatrix reads behind the load's cp.async writes
  // (it cannot tell them apart) and its ~50 instructions of address arithmetic; inside, they issue
  // under the first slices' MMAs. H200 (benchmarks/NOTES.md sessions 45, 47): d = 256 split tile +2%
  // without a mask, +3-3.5% causal at 4k-16k (after the third or fourth slice less); its sm_90 code
  // spills 20-28 B (8 B before), its sm_80 code would spill 8 B (0 B before, not measured), so that
  // tile takes it from sm_90 on. d = 64 (two stages, 0 B of spills): +1.3-1.6% without a mask at
  // 1k-16k, causal level; d = 128: level without a mask, -1-1.3% causal (not taken). sm_80 code of the
  // two-stage tiles is not measured and keeps the load ahead.
  int qdo_in_dq_arch = kArchNever;
  // From this __CUDA_ARCH__ on, with a band mask, dQ between dV and dK as dq_first_unmasked without one.
  // H200, d = 64 with the load inside dQ (benchmarks/NOTES.md session 47): +1.3-2.4% causal at 1k-16k
  // over dQ last (on an H100 with P stored early and the load at the step's start it had lost 4%);
  // sm_80 code, whose load stays at the step's start, keeps dQ last.
  int dq_first_band_arch = kArchNever;
  // The k-slice of the dQ GEMM after which qdo_in_dq issues the load, without / with a band mask. H200,
  // d = 64 (session 47): without a mask slice 0 +1.5-2% over slice 1 (slice 3: -1%); with the band mask
  // and dQ first, slice 0 lost 1.5-2.5% against slice 1. d = 256 (session 45): slice 1 over 2 and 3.
  int qdo_slice[2] = {1, 1};
};

// Build-time override of BwdTile::dq_first_unmasked / dq_first_band_arch: 0 never, 1 always (with or
// without a mask, every arch), -1 policy.
#ifndef FLASHTILE_AMPERE_BWD_DQ_FIRST
#define FLASHTILE_AMPERE_BWD_DQ_FIRST -1
#endif
// Build-time override of BwdTile::sdp_split: 0 never (d = 256 then runs its earlier unsplit tiles:
// one stage, two with large_smem), -1 policy.
#ifndef FLASHTILE_AMPERE_BWD_SDP_SPLIT
#define FLASHTILE_AMPERE_BWD_SDP_SPLIT -1
#endif
// Build-time override of BwdTile::dkv_split: 0 never (dK/dV then run on all the warps), -1 policy.
#ifndef FLASHTILE_AMPERE_BWD_DKV_SPLIT
#define FLASHTILE_AMPERE_BWD_DKV_SPLIT -1
#endif
// Build-time override of BwdTile::ldsm_xor_below_arch: 0 never, 1 on every arch for the tiles that use
// them on some (d <= 128: tests the sm_80 code's sources on sm_90), -1 policy.
#ifndef FLASHTILE_AMPERE_BWD_XOR
#define FLASHTILE_AMPERE_BWD_XOR -1
#endif
// Build-time override of BwdTile::qdo_in_dq_arch: 0 never, 1 on every arch for every tile whose dQ GEMM
// can take the load (single-stage tiles: with dQ last), -1 policy.
#ifndef FLASHTILE_AMPERE_BWD_QDO_IN_DQ
#define FLASHTILE_AMPERE_BWD_QDO_IN_DQ -1
#endif
// Build-time override of BwdTile::p_late: 0 never, 1 on every unsplit tile, -1 policy.
#ifndef FLASHTILE_AMPERE_BWD_P_LATE
#define FLASHTILE_AMPERE_BWD_P_LATE -1
#endif

// Double-buffered Q/dO where the total stays within sm_80's 163 KB; d = 256 (split, below) is
// single-buffered everywhere, so a step's Q/dO load has only the dQ GEMM to land behind.
// small_smem: devices whose blocks get less than these tiles need (sm_86 / sm_89: 99 KB) take tiles of
// at most 99 KB: d = 64: 97 KB, 96: 89 KB, 128 (one Q/dO stage): 81 KB, 192 (block_m 32): 81 KB,
// 256 (32 x 32 on 4 warps, one stage): 68 KB.
constexpr BwdTile ampere_bwd_tile_small(int head_dim) {
  return head_dim <= 64    ? BwdTile{64, 128, 8, 2, 4, 2, 2, 800, 900}
         : head_dim <= 96  ? BwdTile{64, 64, 8, 4, 4, 4, 2, 0, 900}
         : head_dim <= 128 ? BwdTile{64, 64, 8, 4, 2, 2, 1, 0, 900}
         : head_dim <= 192 ? BwdTile{32, 64, 8, 2, 2, 2, 1, 0, 0}
                           : BwdTile{32, 32, 4, 2, 2, 2, 1, 0, 0};
}

// Build-time override of the backward's small-tile choice, to test the small tiles on any device:
// 1 always, -1 the policy (where the default tile does not fit).
#ifndef FLASHTILE_AMPERE_BWD_SMALL
#define FLASHTILE_AMPERE_BWD_SMALL -1
#endif

// d = 256 splits S / dP (sdp_split) on one Q/dO stage on every device (161 KB, within sm_80's
// 163 KB). Measured on an H100 (benchmarks/NOTES.md, session 31): with the sm_80 tile forced there,
// +3.5-4% non-causal and +1-2% causal over the unsplit one-stage tile; as the policy, +1-2% non-causal
// and +0-2% causal over the unsplit double-buffered 209 KB tile that large_smem devices ran before
// (whose split form spilled 68-80 B and lost 4%). d = 192 keeps its unsplit double-buffered tile:
// split (177 KB) it measured 0-3% slower. dkv_split on top (session 32, H100, sm_90 code): +2.4-4.7% on
// the backward at 512-16k, both masks; its sm_90 code reloads 8 B per step from local memory (sm_80: 0).
// equal_dv: d = d_v (dkv_split needs K's and V's tiles alike).
constexpr BwdTile ampere_bwd_tile(int head_dim, bool large_smem = false, bool small_smem = false, bool equal_dv = true) {
  if (small_smem) { return ampere_bwd_tile_small(head_dim); }
  return head_dim <= 64    ? BwdTile{128, 128, 8, 2, 4, 4, 2, 800, 900, true, false, false, true, 900, 900, {0, 1}}
         : head_dim <= 96  ? BwdTile{64, 128, 8, 2, 4, 4, 2, 800, 900}
         : head_dim <= 128 ? BwdTile{64, 128, 8, 2, 4, 2, 2, 800, 900, false, false, false, true}
         : head_dim <= 192 ? BwdTile{64, 64, 8, 4, 2, 2, 2, 0, 0}
         : FLASHTILE_AMPERE_BWD_SDP_SPLIT == 0 ? BwdTile{64, 64, 8, 4, 2, 2, large_smem ? 2 : 1, 0, 0}
         : FLASHTILE_AMPERE_BWD_DKV_SPLIT != 0 && equal_dv ? BwdTile{64, 64, 8, 2, 1, 2, 1, 0, 0, false, true, true, false, 900}
                                                           : BwdTile{64, 64, 8, 2, 2, 2, 1, 0, 0, false, true};
}

// Hopper forward (TMA + WGMMA, warp-specialized): block_m = 64 rows per consumer warpgroup; K/V
// pipeline depth; setmaxnreg budgets (producer + consumers <= 512 registers per thread slot).
// Shared memory: Q/O (block_m * d) + stages * block_n * (d + d_v), 16-bit elements.
struct HopperFwdTile {
  int block_m;
  int block_n;
  int stages;
  int producer_regs;
  int consumer_regs;
  bool intra_wg_overlap;  // issue QK^T of block j with PV of block j+1
  bool pingpong;          // the consumer warpgroups take turns issuing their GEMMs (named barriers)
  bool lazy_rescale;      // rescale O only when a row max moves enough (OnlineSoftmax::kRescaleLog2)
  int exp_fma_per16;      // exponentials per 16 score columns computed on the FMA pipe (exp2_fma)
  // CTAs per cluster along the query blocks; > 1: the CTAs of a cluster run adjacent query blocks of
  // one (head, batch) and each loads 1 / cluster_m of every K/V block, multicast by TMA to all of
  // them (non-band masks on fixed-length batches; other problems run the cluster-less kernel).
  int cluster_m;
  // Q stages where shared memory fits them (fewer where it does not): with O staged over its tile's Q
  // stage, the producer loads a tile's Q only once the store of the tile that many tiles back has read
  // its stage out, which bounds how far its loads run ahead of the consumers on short tiles.
  int q_stages = 2;
  // Band masks without a left window edge tested as bits of one mask per row (common/mask.h, R2P)
  // rather than a compare per score (non-band kernels' sequence-end masks keep the compare).
  bool paired_mask = true;
  // Band kernels may load K a block ahead of V, chosen per launch (hopper_fwd_k_ahead_band); only
  // one-Q-stage tiles of the overlapped schedule take the order at all (hopper/fwd_kernel.h).
  bool band_k_ahead = false;
};

// Build-time override of the Hopper consumer schedule, for measuring each overlap's gain:
// 0 serial, 1 intra-warpgroup overlap, 2 overlap + ping-pong, 3 serial + ping-pong; -1 = policy.
#ifndef FLASHTILE_HOPPER_SCHEDULE
#define FLASHTILE_HOPPER_SCHEDULE -1
#endif
// Build-time override of HopperFwdTile::exp_fma_per16 (0-16); -1 = policy.
#ifndef FLASHTILE_EXP_FMA_PER16
#define FLASHTILE_EXP_FMA_PER16 -1
#endif
// Build-time override of HopperFwdTile::cluster_m (1 or 2); -1 = policy.
#ifndef FLASHTILE_HOPPER_CLUSTER
#define FLASHTILE_HOPPER_CLUSTER -1
#endif
// Build-time overrides of HopperFwdTile::q_stages (both tiles) and of the 128-row tile's stages and
// block_n; -1 = policy.
#ifndef FLASHTILE_HOPPER_Q_STAGES
#define FLASHTILE_HOPPER_Q_STAGES -1
#endif
#ifndef FLASHTILE_HOPPER_KV_STAGES
#define FLASHTILE_HOPPER_KV_STAGES -1
#endif
#ifndef FLASHTILE_HOPPER_BLOCK_N
#define FLASHTILE_HOPPER_BLOCK_N -1
#endif
// Build-time override of hopper_fwd_head_in_loop (0 never, 1 wherever the schedule allows); -1 = policy.
#ifndef FLASHTILE_FWD_HEAD_IN_LOOP
#define FLASHTILE_FWD_HEAD_IN_LOOP -1
#endif
// Build-time override of HopperFwdTile::paired_mask (0 off, 1 on); -1 = policy.
#ifndef FLASHTILE_PAIRED_MASK
#define FLASHTILE_PAIRED_MASK -1
#endif
// Build-time override of the Hopper forward's tall tile (hopper_fwd_tall): 0 never, 1 wherever there
// is one (d <= 128); -1 = policy.
#ifndef FLASHTILE_HOPPER_FWD_TALL
#define FLASHTILE_HOPPER_FWD_TALL -1
#endif

// tall: the tile with three consumer warpgroups (block_m 192), where the head dim has one (d <= 128;
// see hopper_fwd_tall); elsewhere the same tile as tall = false.
constexpr HopperFwdTile hopper_fwd_tile(int head_dim, int head_dim_v, bool tall = false) {
  int const d = head_dim > head_dim_v ? head_dim : head_dim_v;
  // d <= 64: four K/V stages (176 KB with three Q stages) give the short blocks more loads in flight.
  // d = 256: block_n 80 with the overlapped schedule (S, P and O: 40 + 20 + 128 registers of the 240)
  // measured 1.06-1.24x the serial schedule with block_n 64 on an H100 at 1k-16k (causal 512: 0.95x
  // then; 1.05x on an H200 with the later K / Q loading changes, benchmarks/NOTES.md session 36);
  // 80 needs CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (the 64 x 80 WGMMA atoms). d = 192: the overlapped
  // schedule measured 1.02-1.13x the serial one with block_n 96; block_n 112 was faster only at 16k
  // and lost 4-6% at causal 512-1k. Every head dim now runs the overlapped schedule; the serial one
  // stays for FLASHTILE_HOPPER_SCHEDULE (measuring the overlap's gain).
  // Lazy rescaling measured +3-8% at d = 256 causal 4k and neutral at d = 128; at d = 64 (32 O
  // registers) the warp vote cost 4% (causal 1k, non-causal 4k).
  // exp2 on the FMA pipe: 2 of 16 at d = 64 measured +1-3%; at d = 128 every share tried was slower.
  // Non-causal block_n 160-192 (FA3: 176 at d = 128) measured slower at d = 128 and below 4k at d = 64
  // (benchmarks/NOTES.md, session 7): both mask kinds take the same tile.
  // K/V multicast across 2-CTA clusters (non-band masks) measured +1-2.5% at d = 64, 128 and 256,
  // 512-16k, and no shape slower (benchmark protocol, two rounds, benchmarks/NOTES.md session 8).
  HopperFwdTile t = d <= 64   ? HopperFwdTile{128, 128, 4, 24, 240, true, true, false, 2, 2}
                  : d <= 128 ? HopperFwdTile{128, 128, 2, 24, 240, true, true, true, 0, 2}
                  : d <= 192 ? HopperFwdTile{128, 96, 2, 24, 240, true, true, true, 0, 2}
                             : HopperFwdTile{128, 80, 2, 24, 240, true, true, true, 0, 2};
  if (FLASHTILE_HOPPER_SCHEDULE >= 0) {
    t.intra_wg_overlap = FLASHTILE_HOPPER_SCHEDULE == 1 || FLASHTILE_HOPPER_SCHEDULE == 2;
    t.pingpong = FLASHTILE_HOPPER_SCHEDULE >= 2;
  }
  if (FLASHTILE_EXP_FMA_PER16 >= 0) { t.exp_fma_per16 = FLASHTILE_EXP_FMA_PER16; }
  if (FLASHTILE_HOPPER_CLUSTER > 0) { t.cluster_m = FLASHTILE_HOPPER_CLUSTER; }
  // d <= 64: three Q stages (176 KB) measured +4% at causal 512 and neutral elsewhere on an H100 (four:
  // +5%, five K/V stages with three Q: +4%); at d = 128 (224 KB) neutral at 512-2k (benchmarks/NOTES.md,
  // session 17).
  bool const is_tall = tall && d <= 128;
  if (d <= 64 && !is_tall) { t.q_stages = 3; }
  if (FLASHTILE_HOPPER_KV_STAGES > 0) { t.stages = FLASHTILE_HOPPER_KV_STAGES; }
  if (FLASHTILE_HOPPER_BLOCK_N > 0) { t.block_n = FLASHTILE_HOPPER_BLOCK_N; }
  // Tall: three consumer warpgroups of 64 rows, 160 registers each (24 + 3 * 160 <= 512 per thread
  // slot). d <= 64: S, P and O take 64 + 32 + 32 of them (176 KB of shared memory with four K/V
  // stages); d <= 128 with block_n 80: 40 + 20 + 64 (block_n 96 spilled), three K/V stages (216 KB;
  // +0-4% over two, mostly causal).
  if (is_tall) {
    t.block_m = 192;
    t.block_n = d <= 64 ? 128 : 80;
    t.stages = d <= 64 ? 4 : 3;
    t.consumer_regs = 160;
  }
  if (FLASHTILE_HOPPER_Q_STAGES > 0) { t.q_stages = FLASHTILE_HOPPER_Q_STAGES; }
  // Under band masks the K-ahead order lost 1-6.5% at d = 192 from 2k and gained nothing below; at
  // d = 256 it pays on short keys (hopper_fwd_k_ahead_band).
  t.band_k_ahead = d > 192;
  // Paired masks measured +2-3% at d = 64 causal 512-2k on an H100, neutral at d = 128, and -3% at
  // d = 256 causal 4k (block_n 80; neutral at its other lengths), so d = 256 keeps a compare per score.
  t.paired_mask = FLASHTILE_PAIRED_MASK >= 0 ? FLASHTILE_PAIRED_MASK == 1 : d <= 128;
  return t;
}

// Overlapped schedule: whether a tile's first block runs through the steady-state loop body (its PV
// GEMM replaced by an empty group, the softmax restarted from an empty state, whose correction is then
// 0) instead of a head of its own, so that a tile runs one copy of the softmax code, not two. H200
// (benchmarks/NOTES.md session 54), against the separate head: d = 256 causal +0.4% at 512, +0.7-1.2% at
// 1k, +1-2% at 2k, +1.8-2% at 4k-16k; d = 64 and 128 1-3% slower with either mask, d = 256 non-causal
// -2% at 512 and level at 1k-2k.
constexpr bool hopper_fwd_head_in_loop(HopperFwdTile const& t, int head_dim, bool band) {
  if (!t.intra_wg_overlap) { return false; }
  if (FLASHTILE_FWD_HEAD_IN_LOOP >= 0) { return FLASHTILE_FWD_HEAD_IN_LOOP == 1; }
  return head_dim > 192 && band;
}

// Host heuristic: whether a forward problem runs the tall tile (hopper_fwd_tile(.., true)). Measured
// against the 128-row tile on an H100 (bf16, benchmarks/NOTES.md session 13): d 64 1.04-1.11x
// non-causal at 2k-16k and 1.06-1.07x causal at 8k-16k; d 128 (192 x 80 against 128 x 128)
// 1.04-1.10x non-causal at 2k-16k and 1.04-1.11x causal at 8k-16k (both 0.99-1.00x causal at 4k).
// Causal 2k (session 41): d 64 +5-8% (H200) / +4.5% (H100), d 128 +1.5-3% / +1.5%, so band masks
// take it from 2k too.
// Below 2k it loses (d 64: 0.98x non-causal at 1k, 0.85-0.93x causal at 512-1k; causal 1k on an
// H200: d 64 0.97x, d 128 0.94x): 192 rows leave more of the last query block empty (a seqlen of 1k
// fills 5.3 of 6 blocks) and, under a band mask, compute more of the masked-out corner of each
// diagonal block.
constexpr bool hopper_fwd_tall(int head_dim, int head_dim_v, int seqlen_q) {
  if (hopper_fwd_tile(head_dim, head_dim_v, true).block_m == hopper_fwd_tile(head_dim, head_dim_v).block_m) {
    return false;
  }
  if (FLASHTILE_HOPPER_FWD_TALL >= 0) { return FLASHTILE_HOPPER_FWD_TALL == 1; }
  return seqlen_q >= 2048;
}

// Hopper forward tail split (FtFwdParams::num_splits 0; hopper/fwd_kernel.h). Without a band mask
// every tile of a fixed-length batch walks the same KV blocks, so a grid of `units` tiles (tile groups
// under clusters) on `slots` CTAs (clusters) runs units / slots whole waves and a last wave of
// tail = units % slots tiles that leaves the other CTAs idle. The tail's tiles are split along the
// keys into `splits` parts of at least one block, one CTA each, all in one round (tail * splits <=
// slots: two rounds of 3 parts measured -1.7% at d 128 2k, benchmarks/NOTES.md session 46). A tile of
// n KV blocks costs about n + 1 blocks' time (its head and tail overlap nothing: session 33's probe),
// a part ceil(n / splits) + 1; the plan takes as many parts as fit, within max_items (the scratch that
// holds their outputs), as ceil(n / splits) blocks each (none empty), where a part costs at most 3 / 4
// of a whole tile, and only for grids of at most kSplitMaxWaves whole waves before the tail. Measured
// (H200, benchmarks/NOTES.md session 46): grids below one wave 1.25-2.7x (b 1, 4-32 heads, keys 2k-32k);
// the benchmark's grids of 10-31 waves split / unsplit 0.99-1.015 (d 64 non-causal 512-4k), less than
// the split kernel's own cost there (2-3.5% at d 64 512-1k), so they run whole.
struct FwdSplitPlan {
  int num_whole;        // units before the tail, run whole
  int splits;           // parts per tail unit (1: no split)
  int blocks_per_part;  // KV blocks of each part but the last (which may have fewer, at least one); 0 unsplit
};

constexpr int kSplitMaxWaves = 2;
constexpr int kSplitMaxParts = 16;

constexpr FwdSplitPlan hopper_fwd_split_plan(int units, int slots, int n_blocks, int max_items) {
  FwdSplitPlan plan{units, 1, 0};
  if (slots <= 0 || units % slots == 0 || units / slots > kSplitMaxWaves) { return plan; }
  int const tail = units % slots;
  int s = slots / tail;
  s = s < max_items / tail ? s : max_items / tail;
  s = s < n_blocks ? s : n_blocks;
  s = s < kSplitMaxParts ? s : kSplitMaxParts;
  if (s < 2) { return plan; }
  int const per_part = (n_blocks + s - 1) / s;
  s = (n_blocks + per_part - 1) / per_part;
  if (s >= 2 && 4 * (per_part + 1) <= 3 * (n_blocks + 1)) { plan = FwdSplitPlan{units - tail, s, per_part}; }
  return plan;
}

// fp32 per consumer thread in one split's record: its O fragment (64 rows x d_v over 128 threads) and
// its two rows' LSE, padded to whole float4.
constexpr int hopper_fwd_split_record_floats(int head_dim_v) { return head_dim_v / 2 + 4; }

// Build-time override of hopper_fwd_k_ahead_band: 0 never, 1 wherever the tile allows; -1 = policy.
#ifndef FLASHTILE_FWD_K_AHEAD_BAND
#define FLASHTILE_FWD_K_AHEAD_BAND -1
#endif

// Host heuristic: whether a band-mask (causal, local) launch of tile t (band_k_ahead: d = 256) loads
// each KV block's K one block ahead of its V (the order the one-Q-stage tiles take without a mask), so
// that a tile's second S GEMM does not wait for its first block's V. It pays where tiles are short
// (few KV blocks, so that wait is a large part of each) and costs where they are long: H100, causal,
// d = 256, against the per-block order, +1% at 512, +2-3% at 1k, +0.4-1% at 2k, -1-2% at 8k-16k
// (benchmarks/NOTES.md, sessions 34-35).
constexpr bool hopper_fwd_k_ahead_band(HopperFwdTile const& t, int seqlen_k) {
  if (!t.band_k_ahead) { return false; }
  if (FLASHTILE_FWD_K_AHEAD_BAND >= 0) { return FLASHTILE_FWD_K_AHEAD_BAND == 1; }
  return seqlen_k <= 2048;
}

// Hopper backward (TMA + WGMMA, warp-specialized): each CTA owns block_n keys and walks the query
// blocks of block_m rows with two consumer warpgroups. Each of the three GEMM shapes, S/dP
// (block_m x block_n), dK/dV (block_n x d) and dQ (block_m x d), is split between the warpgroups
// along its rows when it has 128 of them, else along its columns (WGMMA M is 64 per warpgroup).
// Registers: dK + dV accumulators (2 * block_n * d fp32 over 256 threads) and the S/dP tiles.
// Shared memory: K, V (block_n x d) + q_stages * Q + do_stages * dO (block_m x d) + P, dS
// (block_m x block_n, 16-bit) + the fp32 dQ staging tile (block_m x d): d = 64: 192 KB, 96: 152 KB,
// 128: 192 KB, 192: 208 KB, 256: 208 KB (one Q and one dO stage).
// At d = 256 a step's Q and dO are released as soon as the GEMMs that read them complete (dO after
// dV, Q after dK, before dQ's second pass): the next loads then overlap the rest of the step. With
// both released at the end of the step the consumers waited for them every step (ncu: a third of
// their stall samples); releasing early gained 7-21% (H100). A second Q stage instead (at the cost of
// one dO stage and half the dQ staging tile, whose two column passes then took turns in it) gained
// less: 299 / 353 / 381 TFLOP/s non-causal at 1k / 4k / 16k against 313 / 393 / 424 with one stage
// of each, and it lost 1-3% causal; it was removed.
struct HopperBwdTile {
  int block_m;
  int block_n;
  int q_stages;
  int do_stages;
  int producer_regs;
  int consumer_regs;
  // block_n = 128 (S^T/dP^T schedule) only: dS is stored before dV is issued, dQ is issued between
  // dV and dK and staged while dK runs, each consumer warpgroup into its own part of the staging
  // tile with its own barriers to the dQ writer. Otherwise dV and dK are issued as soon as P^T and
  // dS^T are ready and dQ is staged as one tile after all three GEMMs have completed.
  bool dq_overlap;
  // dQ added into the fp32 accumulator straight from the consumers' registers (red.global.add.v2.f32
  // into common/dq_accum_perm.h's order, where each warp-wide add covers 256 contiguous bytes)
  // instead of staged in shared memory for a TMA reduce-add: no staging tile, no writer handshake,
  // and the staging stores and TMA reads leave the shared-memory pipe the SS GEMMs are bound by.
  bool dq_red;
  // block_n = 128 (S^T/dP^T schedule) only: step s + 1 issues step s's dQ GEMM (its dS is already in
  // shared memory) ahead of its own S^T / dP^T, and stages it once those are done, so the dQ GEMM
  // leaves the chain S^T -> exp -> dS -> dQ and runs under the next step's exponentials; dV and dK are
  // issued as soon as P^T and dS^T are ready. The last step's dQ follows the walk.
  bool dq_lag;
  // With dq_lag (BwdTraits::kPingPong): the two consumer warpgroups take turns issuing their GEMMs
  // (previous dQ + S^T, dP^T, dV + dK) instead of meeting once per step, so one warpgroup's
  // exponentials and dS run under the other's GEMMs (hopper/bwd_kernel.h). d = 64 on an H200: +3-6%
  // sustained, 1.07-1.16x of cuDNN against 1.03-1.09x; d = 128 in the lag order with turns stays 4-5%
  // below its dq_overlap order (benchmarks/NOTES.md, session 42).
  bool pingpong = false;
  // block_n = 128 (S^T/dP^T schedule) only: each consumer warpgroup stages its dQ part in register order
  // (16-byte stores, 512 contiguous bytes per warp) and the dQ writer adds it with one 1-D bulk reduction
  // into an accumulator kept in that order (common/dq_accum_perm.h, DqAccumFrag), instead of a swizzled
  // row-major tile (8-byte stores) and a TMA tensor reduce-add into a row-major accumulator. On wherever
  // block_n = 128. Sustained backward on an H100 against the row-major path: d 128 non-causal +0 / +1.7 /
  // +3.0 / +0.5% at 2k / 4k / 8k / 16k, causal -0.3 to +1.0%; d 64 causal +3% (benchmarks/NOTES.md,
  // session 64).
  bool dq_frag = false;
};

// Build-time override of the Hopper backward tile, for measuring its gain (-1 = policy):
// FLASHTILE_BWD_ORDER: HopperBwdTile::dq_overlap (0 off, 1 on; block_n = 128 only).
#ifndef FLASHTILE_BWD_ORDER
#define FLASHTILE_BWD_ORDER -1
#endif
// FLASHTILE_BWD_DQ_RED: HopperBwdTile::dq_red (0 off, 1 on).
#ifndef FLASHTILE_BWD_DQ_RED
#define FLASHTILE_BWD_DQ_RED -1
#endif
// FLASHTILE_BWD_QDO_STAGES: Q and dO stages (both).
#ifndef FLASHTILE_BWD_QDO_STAGES
#define FLASHTILE_BWD_QDO_STAGES -1
#endif
// FLASHTILE_BWD_DQ_LAG: HopperBwdTile::dq_lag (0 off, 1 on; block_n = 128 only).
#ifndef FLASHTILE_BWD_DQ_LAG
#define FLASHTILE_BWD_DQ_LAG -1
#endif
// FLASHTILE_BWD_PINGPONG: HopperBwdTile::pingpong (0 off, 1 on; dq_lag tiles only).
#ifndef FLASHTILE_BWD_PINGPONG
#define FLASHTILE_BWD_PINGPONG -1
#endif

// FLASHTILE_BWD_DQ_FRAG: HopperBwdTile::dq_frag (0 off, 1 on; block_n = 128 only).
#ifndef FLASHTILE_BWD_DQ_FRAG
#define FLASHTILE_BWD_DQ_FRAG -1
#endif

// d = 64 keeps dq_overlap off: with it, block_m 128 spilled 20 B under band mask + softcap. It takes
// dq_lag instead: +1-2% causal, +-1% non-causal on an H100 at 1k-16k (four rounds); at d = 128 dq_lag
// measured 3-7% slower than dq_overlap (benchmarks/NOTES.md, session 22).
constexpr HopperBwdTile hopper_bwd_tile(int head_dim, int head_dim_v) {
  int const d = head_dim > head_dim_v ? head_dim : head_dim_v;
  HopperBwdTile t = d <= 64    ? HopperBwdTile{128, 128, 2, 2, 24, 240, false, false, true, true}
                    : d <= 128 ? HopperBwdTile{64, 128, 2, 2, 24, 240, true, false, false}
                    : d <= 192 ? HopperBwdTile{64, 64, 2, 2, 24, 240, false, false, false}
                               : HopperBwdTile{64, 64, 1, 1, 24, 240, false, false, false};
  if (t.block_n == 128 && FLASHTILE_BWD_ORDER >= 0) { t.dq_overlap = FLASHTILE_BWD_ORDER == 1; }
  if (FLASHTILE_BWD_DQ_RED >= 0) { t.dq_red = FLASHTILE_BWD_DQ_RED == 1; }
  if (t.block_n == 128 && FLASHTILE_BWD_DQ_LAG >= 0) { t.dq_lag = FLASHTILE_BWD_DQ_LAG == 1; }
  if (FLASHTILE_BWD_PINGPONG >= 0) { t.pingpong = FLASHTILE_BWD_PINGPONG == 1; }
  if (t.block_n == 128) { t.dq_frag = FLASHTILE_BWD_DQ_FRAG != 0; }
  if (FLASHTILE_BWD_QDO_STAGES > 0) { t.q_stages = t.do_stages = FLASHTILE_BWD_QDO_STAGES; }
  // Without the dQ staging tile (64 KB at d = 256) a second Q and dO stage fit.
  if (t.dq_red && d > 192) { t.q_stages = t.do_stages = 2; }
  return t;
}

// Head-dim buckets that kernels are instantiated for; any d <= 256 that is a multiple of 8 runs on
// the smallest bucket >= d.
constexpr int kHeadDimBuckets[] = {64, 96, 128, 192, 256};

constexpr int head_dim_bucket(int d) {
  for (int b : kHeadDimBuckets) {
    if (d <= b) { return b; }
  }
  return 0;
}

// Scratch for the tail split on a device of num_sms SMs: one record per consumer thread of as many CTAs
// as the grid has (a tail's parts run in one round), for the largest tile of the head dims' buckets; none
// above d 128, whose one-Q-stage tiles do not split (kTailSplit in hopper/fwd_kernel.h).
constexpr int64_t hopper_fwd_split_accum_bytes(int num_sms, int head_dim, int head_dim_v) {
  int const d = head_dim_bucket(head_dim), dv = head_dim_bucket(head_dim_v);
  if (d == 0 || dv == 0 || d > 128 || dv > 128) { return 0; }
  int const consumer_threads = hopper_fwd_tile(d, dv, true).block_m * 2;
  return int64_t(num_sms) * consumer_threads * hopper_fwd_split_record_floats(dv) * int64_t(sizeof(float));
}

}  // namespace flashtile
