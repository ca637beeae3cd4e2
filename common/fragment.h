// Register-fragment helpers shared by all kernel families.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashtile {

// Conversion of a whole register fragment (e.g. fp32 accumulators -> bf16 operands) through
// cutlass::NumericArrayConverter, which emits paired conversions (cvt.rn.bf16x2.f32) instead of one
// per element.
template <class To, class Engine, class Layout>
CUTE_DEVICE auto convert_fragment(cute::Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int kN = decltype(cute::size(t))::value;
  cute::Tensor out = cute::make_tensor<To>(t.layout());
  cutlass::NumericArrayConverter<To, From, kN> convert;
  *reinterpret_cast<cutlass::Array<To, kN>*>(out.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, kN> const*>(t.data()));
  return out;
}

}  // namespace flashtile
