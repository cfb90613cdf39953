// SPDX-License-Identifier: Apache-2.0
// The context-parallel kernel layer for fp16 inputs (built where NCCL was found).
#include <cuda_fp16.h>

#include "binding_ring.cuh"

namespace stria::python {
template void ring_estimate_typed(const problem&, const ring_ranks&, const __half*, const __half*, const estimator_options&,
                                  std::pair<std::int64_t, std::int64_t>, std::int32_t*, std::int32_t*);
template void ring_forward_typed(const problem&, const ring_ranks&, const __half*, const __half*, const __half*, const padded_selection&,
                                 __half*, float*);
template void ring_backward_typed(const problem&, const ring_ranks&, const __half*, const __half*, const __half*, const __half*,
                                  const __half*, const float*, const padded_selection&, bool, __half*, __half*, __half*);
}  // namespace stria::python
