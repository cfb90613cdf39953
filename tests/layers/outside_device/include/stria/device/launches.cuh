// SPDX-License-Identifier: Apache-2.0
// A device/ header that launches by itself instead of through device/launch.cuh, for the test of
// cmake/check_layers.cmake: its launch is reported, and so is its thrust call with a synchronizing
// policy (not the one without).
#pragma once

#include "stria/kernel/select.cuh"

inline void launch() { stria::kernel::select_verticals<><<<1, 1>>>({}); }
inline void fill(float* x, cudaStream_t stream) { thrust::fill(thrust::cuda::par.on(stream), x, x + 1, 0.0f); }
inline void fill_nosync(float* x, cudaStream_t stream) { thrust::fill(thrust::cuda::par_nosync.on(stream), x, x + 1, 0.0f); }
