// SPDX-License-Identifier: Apache-2.0
// The kernel layer for bf16 inputs.
#include <cuda_bf16.h>

#include "binding.cuh"

namespace stria::python {
template void estimate_typed(const problem&, const __nv_bfloat16*, const __nv_bfloat16*, const estimator_options&,
                             std::pair<std::int64_t, std::int64_t>, std::int32_t*, std::int32_t*);
template void forward_typed(const problem&, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const padded_selection&,
                            __nv_bfloat16*, float*);
template void backward_typed(const problem&, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                             const __nv_bfloat16*, const float*, const padded_selection&, bool, const backward_scratch&, __nv_bfloat16*,
                             __nv_bfloat16*, __nv_bfloat16*);
}  // namespace stria::python
