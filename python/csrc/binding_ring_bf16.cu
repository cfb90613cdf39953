// SPDX-License-Identifier: Apache-2.0
// The context-parallel kernel layer for bf16 inputs (built where NCCL was found).
#include <cuda_bf16.h>

#include "binding_ring.cuh"

namespace stria::python {
template void ring_estimate_typed(const problem&, const ring_ranks&, const __nv_bfloat16*, const __nv_bfloat16*, const estimator_options&,
                                  std::pair<std::int64_t, std::int64_t>, std::int32_t*, std::int32_t*);
template void ring_forward_typed(const problem&, const ring_ranks&, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const padded_selection&,
                                 __nv_bfloat16*, float*);
template void ring_backward_typed(const problem&, const ring_ranks&, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                                  const __nv_bfloat16*, const float*, const padded_selection&, bool, __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*);
}  // namespace stria::python
