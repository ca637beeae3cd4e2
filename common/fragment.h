// Register-fragment helpers shared by all kernel families.
#pragma once

#include <cute/tensor.hpp>

namespace flashtile {

// Element-wise conversion of a register fragment (e.g. fp32 accumulators -> bf16 operands).
template <class To, class Engine, class Layout>
CUTE_DEVICE auto convert_fragment(cute::Tensor<Engine, Layout> const& t) {
  cute::Tensor out = cute::make_tensor<To>(t.layout());
  CUTE_UNROLL
  for (int i = 0; i < cute::size(t); ++i) { out(i) = static_cast<To>(t(i)); }
  return out;
}

}  // namespace flashtile
