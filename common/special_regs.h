// Special registers read anew (volatile asm: never merged with an earlier read of the same register), so
// that what a kernel derives from them (a thread's fragment coordinates and shared-memory addresses) is
// recomputed where it is used rather than held in registers across a mainloop.
#pragma once

#include <cute/config.hpp>

namespace flashtile {

CUTE_DEVICE int thread_idx_reread() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// The most threads a block can have: with kFirst = 0, thread_idx_reread_in's count for the whole block.
constexpr int kMaxBlockThreads = 1024;

// thread_idx_reread() as an index among the kCount threads from thread kFirst on (kCount a power of
// two): masked to [0, kCount), so that the compiler knows it is non-negative and derives fragment
// coordinates from it with shifts and masks instead of signed division (whose rounding fix-ups cost ~3
// instructions per divide, repeated wherever the derivation is).
template <int kFirst, int kCount>
CUTE_DEVICE int thread_idx_reread_in() {
  static_assert(kCount > 0 && (kCount & (kCount - 1)) == 0, "kCount must be a power of two");
  return (thread_idx_reread() - kFirst) & (kCount - 1);
}

}  // namespace flashtile
