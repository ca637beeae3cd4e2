// Parameters of the Hopper kernels' TMA load pipelines (cutlass::PipelineTmaAsync): warpgroup 0
// produces, with thread 0 as the leader that arms the transaction barriers; the consumer threads
// consume.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace flashtile::hopper {

template <class Pipeline>
CUTE_DEVICE typename Pipeline::Params tma_pipeline_params(bool producer, int consumers, uint32_t transaction_bytes) {
  typename Pipeline::Params params;
  params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumers;
  params.transaction_bytes = transaction_bytes;
  return params;
}

}  // namespace flashtile::hopper
