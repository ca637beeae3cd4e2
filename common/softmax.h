// Online softmax over score tiles held in registers (arch-neutral).
//
// Contract: tensors are in (row, col) form, a thread's rows being complete only after reducing over
// the kQuadWidth lanes that share them (mma.sync/wgmma accumulators spread a row over 4 lanes).
// Scores are raw (unscaled); `scale_log2` maps them into the exp2 domain. A row whose scores are all
// -inf keeps max = -inf, sum = 0, and finalizes to output 0 and LSE -inf.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace flashtile {

template <int kQuadWidth = 4>
CUTE_DEVICE float quad_allreduce_max(float x) {
  CUTE_UNROLL
  for (int offset = kQuadWidth / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  }
  return x;
}

template <int kQuadWidth = 4>
CUTE_DEVICE float quad_allreduce_sum(float x) {
  CUTE_UNROLL
  for (int offset = kQuadWidth / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return x;
}

// Four per-row partial sums of a quad's lanes reduce-scattered over the quad: lane l gets the quad's
// total of row l % 4 (3 shuffles; the sum then takes one register per thread instead of four).
CUTE_DEVICE float quad_reduce_scatter_sum(float s0, float s1, float s2, float s3) {
  int const lane = int(threadIdx.x) % 4;
  bool const hi_pair = lane & 2;
  float k0 = hi_pair ? s2 : s0, k1 = hi_pair ? s3 : s1;
  k0 += __shfl_xor_sync(0xffffffff, hi_pair ? s0 : s2, 2);
  k1 += __shfl_xor_sync(0xffffffff, hi_pair ? s1 : s3, 2);
  bool const odd = lane & 1;
  return (odd ? k1 : k0) + __shfl_xor_sync(0xffffffff, odd ? k0 : k1, 1);
}

// 2^x on the FMA/ALU pipes, for a share of a block's exponentials: MUFU.EX2 retires 16 results per
// clock per SM, which at d <= 64 takes as long as the block's two GEMMs, while issue slots are free.
// x = j + g with j = round(x) (adding 1.5 * 2^23 leaves j in the low mantissa bits) and g in
// [-0.5, 0.5]; 2^g from a degree-3 polynomial exact at g = 0 (relative error 1.0e-4, far below a
// 16-bit P's rounding), its exponent field raised by j. The clamp at -126 keeps the exponent field
// from wrapping: exp2(-inf) becomes at most 2^-126, which adds nothing visible to O or the row sum
// (finalize treats a row whose max is -inf as empty).
CUTE_DEVICE float exp2_fma(float x) {
  x = fmaxf(x, -126.f);
  float const shifted = x + 0x1.8p23f;
  float const g = x - (shifted - 0x1.8p23f);
  float p = fmaf(0x1.c2a1dcp-5f, g, 0x1.f00c2cp-3f);
  p = fmaf(p, g, 0x1.62f5fap-1f);
  p = fmaf(p, g, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
}

// Rescaling: a row keeps its running max (so O and the sum keep their scale) while a new block's
// max exceeds it by at most kRescaleLog2 in the exp2 domain; P is then at most 2^kRescaleLog2, which
// fp32 accumulators hold exactly as well. The decision is per warp (any of its rows), so the skip
// is a uniform branch; once the max has settled, most blocks rescale nothing. kLazyRescale = false
// rescales on every block: where O is small (d <= 64) the vote on the critical path costs more than
// the multiplies it saves. kExpFmaPer16 of every 16 columns take exp2_fma instead of MUFU.EX2.
template <int kNRows, bool kLazyRescale = false, int kExpFmaPer16 = 0>
struct OnlineSoftmax {
  static constexpr float kRescaleLog2 = 8.f;
  using RowTensor = cute::Tensor<cute::ArrayEngine<float, kNRows>, cute::Layout<cute::Shape<cute::Int<kNRows>>>>;
  RowTensor row_max, row_sum, correction;
  float const scale_log2;
  bool rescale = false;  // the last online<false> moved this warp's maxima: O must be rescaled

  CUTE_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    cute::fill(row_max, -INFINITY);
    cute::fill(row_sum, 0.f);
  }

  // Starts a new tile's rows (their first block then goes through online<true>).
  CUTE_DEVICE void reset() { cute::fill(row_max, -INFINITY); }
  // Starts a new tile's rows whose first block goes through online<false>: the empty state's
  // correction is exp2(-inf) = 0 (scale_log2 > 0), so the sums (and O, which the caller clears) start
  // from zero.
  CUTE_DEVICE void restart() {
    cute::fill(row_max, -INFINITY);
    cute::fill(row_sum, 0.f);
  }

  // Turns scores S (rows x cols) into unnormalized probabilities in place, updating the running max
  // (see kRescaleLog2) and (per-thread partial) sums. The factor by which O must be rescaled is kept
  // in `correction` so the caller can apply it once the GEMM still writing O has completed
  // (rescale_o).
  template <bool kIsFirst, class TensorS>
  CUTE_DEVICE void online(TensorS& S) {
    static_assert(decltype(cute::size<0>(S))::value == kNRows);
    constexpr int kCols = decltype(cute::size<1>(S))::value;
    // Row max and sum in kParts independent chains: a single chain over a row is a dependency of
    // kCols fixed-latency FMNMX / FADD, on the softmax's critical path.
    constexpr int kParts = kCols % 4 == 0 ? 4 : kCols % 2 == 0 ? 2 : 1;
    float block_max[kNRows];
    bool moved = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float part[kParts];
      CUTE_UNROLL
      for (int p = 0; p < kParts; ++p) { part[p] = S(mi, p); }
      CUTE_UNROLL
      for (int ni = kParts; ni < kCols; ++ni) { part[ni % kParts] = fmaxf(part[ni % kParts], S(mi, ni)); }
      float m = part[0];
      CUTE_UNROLL
      for (int p = 1; p < kParts; ++p) { m = fmaxf(m, part[p]); }
      block_max[mi] = quad_allreduce_max(m);
      if constexpr (kLazyRescale) {
        // -inf + kRescaleLog2 stays -inf: a row that saw no key yet takes any finite max.
        moved |= block_max[mi] * scale_log2 > row_max(mi) * scale_log2 + kRescaleLog2;
      }
    }
    rescale = !kIsFirst && (!kLazyRescale || __any_sync(0xffffffff, moved));
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      if (kIsFirst || rescale) {
        float const m = fmaxf(row_max(mi), block_max[mi]);
        // A row without a finite max yet has O = 0 and sum = 0: any finite correction will do.
        float const m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
        correction(mi) = kIsFirst ? 1.f : exp2f(row_max(mi) * scale_log2 - m_scaled);
        row_max(mi) = m;
      }
      // A fully masked row so far has max = -inf; subtracting 0 instead keeps exp2 at exactly 0.
      float const m_scaled = row_max(mi) == -INFINITY ? 0.f : row_max(mi) * scale_log2;
      float part[kParts];
      CUTE_UNROLL
      for (int p = 0; p < kParts; ++p) { part[p] = 0.f; }
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        float const x = S(mi, ni) * scale_log2 - m_scaled;
        S(mi, ni) = ni * kExpFmaPer16 % 16 < kExpFmaPer16 ? exp2_fma(x) : exp2f(x);  // spread over the row
        part[ni % kParts] += S(mi, ni);
      }
      float sum = 0.f;
      CUTE_UNROLL
      for (int p = 0; p < kParts; ++p) { sum += part[p]; }
      if (kIsFirst) {
        row_sum(mi) = sum;
      } else if (rescale) {
        row_sum(mi) = row_sum(mi) * correction(mi) + sum;
      } else {
        row_sum(mi) += sum;
      }
    }
  }

  // online() for kernels at the register limit: rescales on every block (no lazy rescale: pair it
  // with rescale_o_always, `rescale` is not maintained), one max
  // and one sum chain per row rather than online()'s four (with the kNRows rows interleaved that is
  // still kNRows independent chains), and with kQuadSum (kNRows = 4) the row sums reduce-scattered
  // over the quad every block, so that row_sum(0) holds the total of row lane % 4 and three registers
  // are free (finalize_lean). The row sum's order differs from online()'s, in the last bits.
  template <bool kIsFirst, bool kQuadSum, class TensorS>
  CUTE_DEVICE void online_lean(TensorS& S) {
    float block_max[kNRows];
    quad_row_max(S, block_max);
    online_lean_from_max<kIsFirst, kQuadSum>(S, block_max);
  }

  // The block's row maxima over the thread's quad (online_lean's first half; a kernel whose rows span
  // several warps combines them before online_lean_from_max).
  template <class TensorS>
  CUTE_DEVICE static void quad_row_max(TensorS const& S, float (&block_max)[kNRows]) {
    static_assert(decltype(cute::size<0>(S))::value == kNRows);
    constexpr int kCols = decltype(cute::size<1>(S))::value;
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float m = S(mi, 0);
      CUTE_UNROLL
      for (int ni = 1; ni < kCols; ++ni) { m = fmaxf(m, S(mi, ni)); }
      block_max[mi] = quad_allreduce_max(m);
    }
  }

  // online_lean given the block's row maxima (quad_row_max, possibly combined across warps).
  template <bool kIsFirst, bool kQuadSum, class TensorS>
  CUTE_DEVICE void online_lean_from_max(TensorS& S, float const (&block_max)[kNRows]) {
    static_assert(!kQuadSum || kNRows == 4);
    static_assert(!kLazyRescale && kExpFmaPer16 == 0);
    static_assert(decltype(cute::size<0>(S))::value == kNRows);
    constexpr int kCols = decltype(cute::size<1>(S))::value;
    float sum[kNRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float const m = fmaxf(row_max(mi), block_max[mi]);
      float const m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      correction(mi) = kIsFirst ? 1.f : exp2f(row_max(mi) * scale_log2 - m_scaled);
      row_max(mi) = m;
      sum[mi] = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        S(mi, ni) = exp2f(S(mi, ni) * scale_log2 - m_scaled);
        sum[mi] += S(mi, ni);
      }
    }
    if constexpr (kQuadSum) {
      float const block_sum = quad_reduce_scatter_sum(sum[0], sum[1], sum[2], sum[3]);
      if constexpr (kIsFirst) {
        row_sum(0) = block_sum;
      } else {
        int const lane = int(threadIdx.x) % 4;
        float const c = lane & 2 ? (lane & 1 ? correction(3) : correction(2)) : (lane & 1 ? correction(1) : correction(0));
        row_sum(0) = row_sum(0) * c + block_sum;
      }
    } else {
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) { row_sum(mi) = kIsFirst ? sum[mi] : row_sum(mi) * correction(mi) + sum[mi]; }
    }
  }

  // finalize() after online_lean: with kQuadSum each row's total comes from its lane.
  template <bool kQuadSum, class TensorO, class TensorL>
  CUTE_DEVICE void finalize_lean(TensorO& O, TensorL& lse, float scale_ln) {
    if constexpr (kQuadSum) {
      int const quad = int(threadIdx.x) & ~3 & 31;
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        float const sum = __shfl_sync(0xffffffff, row_sum(0), quad + mi);
        bool const empty = sum == 0.f || sum != sum;
        float const inv = empty ? 0.f : 1.f / sum;
        lse(mi) = empty ? -INFINITY : row_max(mi) * scale_ln + logf(sum);
        CUTE_UNROLL
        for (int di = 0; di < cute::size<1>(O); ++di) { O(mi, di) *= inv; }
      }
    } else {
      finalize(O, lse, scale_ln);
    }
  }

  // O *= correction without the branch on `rescale` (the first block's correction is 1): for a
  // caller that wants the multiplies in the same basic block as the GEMM that accumulates into O.
  template <class TensorO>
  CUTE_DEVICE void rescale_o_always(TensorO& O) const {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      CUTE_UNROLL
      for (int di = 0; di < cute::size<1>(O); ++di) { O(mi, di) *= correction(mi); }
    }
  }

  template <class TensorO>
  CUTE_DEVICE void rescale_o(TensorO& O) const {
    if (!rescale) { return; }
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      CUTE_UNROLL
      for (int di = 0; di < cute::size<1>(O); ++di) { O(mi, di) *= correction(mi); }
    }
  }

  // Normalizes O and returns the natural-log LSE per row (-inf for rows that saw no key).
  template <class TensorO, class TensorL>
  CUTE_DEVICE void finalize(TensorO& O, TensorL& lse, float scale_ln) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float const sum = quad_allreduce_sum(row_sum(mi));
      // With exp2_fma, masked scores leave a sum of about 2^-126 in a row that saw no key.
      bool const empty = (kExpFmaPer16 > 0 && row_max(mi) == -INFINITY) || sum == 0.f || sum != sum;
      float const inv = empty ? 0.f : 1.f / sum;
      lse(mi) = empty ? -INFINITY : row_max(mi) * scale_ln + logf(sum);
      CUTE_UNROLL
      for (int di = 0; di < cute::size<1>(O); ++di) { O(mi, di) *= inv; }
    }
  }
};

}  // namespace flashtile
