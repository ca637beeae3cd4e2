// Device-side backward parameters: the forward's derived parameters (FwdParams, which holds the
// forward call's C ABI struct) plus FtBwdParams (gradients, workspaces, deterministic mode). Passed to
// the backward kernels by value as a __grid_constant__.
#pragma once

#include "common/fwd_params.h"

namespace flashtile {

struct BwdParams {
  FwdParams fwd;     // geometry, mask and scales of the forward call (fwd.abi == abi.fwd)
  FtBwdParams abi;
  // Band masks outside deterministic mode: (head, batch) pairs per longest-first section of the grid
  // (common/block_order.h), set by the launcher; 0 = the plain order.
  int pairs_per_section;
  // abi.dq_done set: the main kernel's CTAs per (batch, KV head), the count at which that head's dQ
  // adds have all landed (set by the launcher whose main kernel counts them; 0 = not counted).
  int dq_done_count;
  // 1: deterministic non-band walks start at query block n_block (rotated, common/block_order.h).
  int dq_rotate;
};

inline BwdParams make_bwd_params(FtBwdParams const& abi) {
  BwdParams p{};
  p.fwd = make_fwd_params(abi.fwd);
  p.abi = abi;
  return p;
}

}  // namespace flashtile
