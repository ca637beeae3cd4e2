// Every named barrier id used by the Hopper kernels (ids are offset past CUTLASS's reserved ones by
// cutlass::arch::NamedBarrier). Barrier 0 (__syncthreads) is used only before the roles split.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

namespace flashtile::hopper {

enum class FwdNamedBarrier : int {
  kEpilogue = 0,    // all consumer threads (serial schedule): O staged in shared memory
  kWarpGroup1 = 1,  // ping-pong turn of consumer warpgroup 1 (arrive: the previous one, sync: WG1)
  kWarpGroup2 = 2,  // ping-pong turn of consumer warpgroup 2
  kWarpGroup3 = 3,  // ping-pong turn of consumer warpgroup 3 (block_m 192)
  kEpilogue1 = 4,   // consumer warpgroup 1's threads (overlap schedule): its O rows are staged
  kEpilogue2 = 5,   // the same for consumer warpgroups 2 and 3
  kEpilogue3 = 6,
  // FwdTraits::kOOverV (two consumer warpgroups): consumer warpgroup 1 (2) has completed its last PV
  // GEMM of the tile (arrive), the other one waits before staging O over V (sync). kVRead2 takes
  // kWarpGroup3's id, which only a three-warpgroup tile uses.
  kVRead1 = 7,
  kVRead2 = 3,
};
static_assert(int(FwdNamedBarrier::kVRead1) + int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) <
                  int(cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers),
              "named barrier ids past CUTLASS's reserved ones must stay below the hardware's 16");

// The kVRead barrier of consumer warpgroup wg (0-based): wg arrives on it, the other one syncs.
constexpr int fwd_vread_barrier(int wg) {
  return int(wg == 0 ? FwdNamedBarrier::kVRead1 : FwdNamedBarrier::kVRead2);
}

// bar.red.or on named barrier `id` (offset past CUTLASS's reserved ones, as cutlass::arch::NamedBarrier
// does) of num_threads threads: each of them gets whether any passed pred.
CUTE_DEVICE bool named_barrier_or(int num_threads, int id, bool pred) {
  uint32_t any = 0;
#if defined(__CUDA_ARCH__)
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(uint32_t(id) + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount),
        "r"(num_threads)
      : "memory");
#endif
  return any != 0;
}

// Backward kernel (ids reused: a kernel uses one of the two sets).
enum class BwdNamedBarrier : int {
  kPdSEmpty = 0,  // all consumer threads: every warpgroup is done reading the previous P/dS
  kPdSFull = 1,   // all consumer threads: P and dS of this step are in shared memory
  kdQEmpty = 2,   // dQ writer warp (arrive) -> consumers (sync): the dQ staging tile may be rewritten
  kdQFull = 3,    // consumers (arrive) -> dQ writer warp (sync): the dQ tile is staged
  kEpilogue = 4,  // all consumer threads: K/V no longer read, dK/dV may be staged over them
  // dQ staged per consumer warpgroup: kdQEmpty/kdQFull serve warpgroup 1's part, these warpgroup 2's
  kdQEmpty2 = 5,
  kdQFull2 = 6,
  kdQTurn = 7,  // all consumer threads (dq_red, deterministic mode): the query block's dQ turn, taken / done
  // BwdTraits::kPingPong (dq_lag order, staged dQ, block_n = 128): the consumer warpgroups' GEMM turns
  // (BwdTurns). kPdSEmpty is unused with block_n = 128 and kdQTurn without dq_red.
  kTurn1 = 0,
  kTurn2 = 7,
};

// The staging barriers of dQ part `part` (one part per consumer warpgroup, or one for the tile).
constexpr int bwd_dq_empty_barrier(int part) {
  return int(part == 0 ? BwdNamedBarrier::kdQEmpty : BwdNamedBarrier::kdQEmpty2);
}
constexpr int bwd_dq_full_barrier(int part) {
  return int(part == 0 ? BwdNamedBarrier::kdQFull : BwdNamedBarrier::kdQFull2);
}

}  // namespace flashtile::hopper
