// SPDX-License-Identifier: Apache-2.0
// The top-p selection on the GPU: select_device turns window statistics kept in device memory
// (device_statistics) into a device_selection ready for the step-index builder, with one small host
// read (the list sizes). It picks exactly what the host select() picks from the same statistics
// (kernel/select.cuh says how); device/select.cuh launches its kernels.
#pragma once

#include <cuda_runtime_api.h>

#include "stria/device/select.cuh"
#include "stria/estimator/device_statistics.cuh"
#include "stria/estimator/select.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/local_index.cuh"

namespace stria::estimator {

/// The selection of `rule` (what the host's select_with_rule picks from statistics.download()),
/// built on `stream`. One host synchronisation reads the two list sizes.
inline device_selection select_device(const device_statistics& st, const top_p_rule& rule, cudaStream_t stream) {
  return device::select_with_rule(st, rule, stream);
}

}  // namespace stria::estimator
