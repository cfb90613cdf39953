// SPDX-License-Identifier: Apache-2.0
// The kernel layer for fp16 inputs.
#include <cuda_fp16.h>

#include "binding.cuh"

namespace stria::python {
template void estimate_typed(const problem&, const __half*, const __half*, const estimator_options&,
                             std::pair<std::int64_t, std::int64_t>, std::int32_t*, std::int32_t*);
template void forward_typed(const problem&, const __half*, const __half*, const __half*, const padded_selection&,
                            __half*, float*);
template void backward_typed(const problem&, const __half*, const __half*, const __half*, const __half*,
                             const __half*, const float*, const padded_selection&, bool, const backward_scratch&, __half*,
                             __half*, __half*);
}  // namespace stria::python
