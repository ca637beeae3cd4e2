// Every named barrier id used by the Hopper kernels (ids are offset past CUTLASS's reserved ones by
// cutlass::arch::NamedBarrier). Barrier 0 (__syncthreads) is used only before the roles split.
#pragma once

namespace flashtile::hopper {

enum class FwdNamedBarrier : int {
  kEpilogue = 0,   // all consumer threads: O staged in shared memory before the global stores
  kWarpGroup1 = 1, // ping-pong turn of consumer warpgroup 1 (arrive: WG2, sync: WG1)
  kWarpGroup2 = 2, // ping-pong turn of consumer warpgroup 2
  kQueryEmpty = 3, // consumers (arrive) -> producer warp (sync): the Q/O region may be reloaded
};

}  // namespace flashtile::hopper
