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

}  // namespace flashtile
