// Device-side forward parameters: FtFwdParams (the C ABI) plus values the launcher derives once
// (scales in the exp2 domain, GQA ratio). Passed to kernels by value as a __grid_constant__.
#pragma once

#include <cstdint>

#include "common/flash_api.h"

namespace flashtile {

struct FwdParams {
  FtFwdParams abi;

  int h_h_k_ratio;       // query heads per KV head
  float scale_log2;      // multiplies raw scores (or tanh-capped scores) before exp2
  float scale_ln;        // converts the running max back to natural-log units for the LSE
  float softcap_scale;   // softmax_scale / softcap (softcap on only)
  bool is_band;          // causal or sliding window
  // Ampere-path forward under band masks: (head, batch) pairs per longest-first section of the grid
  // (common/block_order.h), set by its launcher; 0 = the plain order.
  int pairs_per_section;
};

// Fills the derived fields; the caller has validated `abi`.
inline FwdParams make_fwd_params(FtFwdParams const& abi) {
  constexpr float kLog2e = 1.4426950408889634f;
  FwdParams p{};
  p.abi = abi;
  // Causal is the band (window_left, 0): normalized here once, so kernels read only the window.
  if (abi.is_causal) { p.abi.window_right = 0; }
  p.h_h_k_ratio = abi.num_heads / abi.num_heads_k;
  if (abi.softcap > 0.f) {
    // S' = softcap * tanh(S * scale / softcap): the kernel computes tanh(S * softcap_scale) and folds
    // the outer softcap factor into the exp2 scale.
    p.softcap_scale = abi.softmax_scale / abi.softcap;
    p.scale_log2 = abi.softcap * kLog2e;
  } else {
    p.softcap_scale = 0.f;
    p.scale_log2 = abi.softmax_scale * kLog2e;
  }
  p.scale_ln = p.scale_log2 / kLog2e;
  p.is_band = abi.is_causal || abi.window_left >= 0 || abi.window_right >= 0;
  return p;
}

}  // namespace flashtile
