"""The Ampere-path kernels' XOR-folded ldmatrix addressing (ampere/mma_utils.h, LdsmXorSource), checked on
the host against the tiled copies' own addressing, for every thread of every tile the launchers build.

A thread's ldmatrix row address for entry (m, k) of its copy partition is Swz(t + L(0, m, k)), t its
offset in the unswizzled tile and L the partition's static layout. LdsmXorSource computes it from one
base register as (Swz(t) ^ x) + a, x = L(0, m, k)'s bits in the swizzle's target bits and a the rest.
The kernels' static_assert (ldsm_xor_foldable) checks L's half of that; whether t shares no bits with
x depends on the tiled MMA's thread layout and is checked here, per thread: forward Q, K, V^T and (split
tiles) P; backward Q, dO, K, V, P^T / dS^T, dO^T, Q^T, dS and K^T at the head dims that use the XOR
sources (kXorSources: d <= 128), default and small (99 KB devices) tiles. A wrong fold reads the wrong
shared-memory row: silent garbage on a device the GPU tests may not cover (sm_80 / sm_86 tiles).
"""

PROGRAM = r"""
#include <cstdio>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include "ampere/bwd_traits.h"
#include "ampere/fwd_traits.h"

using namespace cute;
using namespace flashtile::ampere;
using Element = cutlass::bfloat16_t;

static int failures = 0;
static int checked = 0;
static Element buf[1 << 17];

// Every thread's every (m, k) entry of `tiled_copy` over `tile` (swizzle o plain layout).
template <class TiledCopy, class TileLayout>
void check(char const* kernel, int d, char const* operand, TiledCopy const& tiled_copy, TileLayout const& tile) {
  using Swz = decltype(get_swizzle_portion(tile));
  constexpr int kTarget = ((1 << Swz::num_bits) - 1) << Swz::num_base;
  int bad = 0;
  for (int t = 0; t < int(size(tiled_copy)); ++t) {
    Tensor tP = tiled_copy.get_thread_slice(t).partition_S(make_tensor(&buf[0], get_nonswizzle_portion(tile)));
    int const t_off = int(tP.data() - &buf[0]);
    int const base = Swz{}(t_off);
    for (int m = 0; m < int(size<1>(tP)); ++m) {
      for (int k = 0; k < int(size<2>(tP)); ++k) {
        int const off = int(tP.layout()(0, m, k));
        int const want = Swz{}(t_off + off);
        int const got = (base ^ (off & kTarget)) + (off & ~kTarget);
        ++checked;
        if (want != got && bad++ == 0) {
          std::printf("FAIL %s d %d %s: thread %d entry (%d, %d): %d != %d\n", kernel, d, operand, t, m, k, got, want);
        }
      }
    }
  }
  failures += bad != 0;
}

template <int kD, bool kWide, bool kSplit>
void check_fwd() {
  using T = FwdTraits<Element, kD, kD, kWide, kSplit>;
  typename T::TiledMma mma;
  auto copy_q = make_tiled_copy_A(typename T::SmemCopyAtom{}, mma);
  auto copy_k = make_tiled_copy_B(typename T::SmemCopyAtom{}, mma);
  auto copy_v = make_tiled_copy_B(typename T::SmemCopyAtomTransposed{}, mma);
  char const* name = kSplit ? (kWide ? "fwd split wide" : "fwd split") : (kWide ? "fwd wide" : "fwd");
  check(name, kD, "Q", copy_q, typename T::SmemLayoutQ{});
  check(name, kD, "K", copy_k, typename T::SmemLayoutK{});
  check(name, kD, "V^T", copy_v, typename T::SmemLayoutVt{});
  if constexpr (T::kSplitN) { check(name, kD, "P", copy_q, typename T::SmemLayoutP{}); }
}

template <int kD, bool kSmall>
void check_bwd() {
  using T = BwdTraits<Element, kD, kD, false, kSmall>;
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  auto sdp_a = make_tiled_copy_A(typename T::SmemCopyAtom{}, mma_sdp);
  auto sdp_b = make_tiled_copy_B(typename T::SmemCopyAtom{}, mma_sdp);
  auto dkv_a = make_tiled_copy_A(typename T::SmemCopyAtomTransposed{}, mma_dkv);
  auto dkv_b = make_tiled_copy_B(typename T::SmemCopyAtomTransposed{}, mma_dkv);
  auto dq_a = make_tiled_copy_A(typename T::SmemCopyAtom{}, mma_dq);
  auto dq_b = make_tiled_copy_B(typename T::SmemCopyAtomTransposed{}, mma_dq);
  char const* name = kSmall ? "bwd small" : "bwd";
  check(name, kD, "Q", sdp_a, typename T::SmemLayoutQ{});
  check(name, kD, "dO", sdp_a, typename T::SmemLayoutdO{});
  check(name, kD, "K", sdp_b, typename T::SmemLayoutK{});
  check(name, kD, "V", sdp_b, typename T::SmemLayoutV{});
  check(name, kD, "P^T / dS^T", dkv_a, typename T::SmemLayoutPdSt{});
  check(name, kD, "dO^T", dkv_b, typename T::SmemLayoutdOt{});
  check(name, kD, "Q^T", dkv_b, typename T::SmemLayoutQt{});
  check(name, kD, "dS", dq_a, typename T::SmemLayoutPdS{});
  check(name, kD, "K^T", dq_b, typename T::SmemLayoutKt{});
}

template <int kD>
void check_head_dim() {
  check_fwd<kD, false, false>();
  check_fwd<kD, true, false>();
  if constexpr (kD > 128) {
    check_fwd<kD, false, true>();
    check_fwd<kD, true, true>();
  } else {
    check_bwd<kD, false>();
    check_bwd<kD, true>();
  }
}

int main() {
  check_head_dim<64>();
  check_head_dim<96>();
  check_head_dim<128>();
  check_head_dim<192>();
  check_head_dim<256>();
  std::printf("%d entries checked\n", checked);
  if (checked == 0) { ++failures; }
  std::printf("%d failures\n", failures);
  return failures != 0;
}
"""


def test_ldsm_xor_addresses_match_the_tiled_copies(run_host_program):
    run_host_program(PROGRAM, cute=True, timeout=300)
