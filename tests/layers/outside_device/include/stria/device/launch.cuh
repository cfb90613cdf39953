// SPDX-License-Identifier: Apache-2.0
// The launch where it belongs, for the test of cmake/check_layers.cmake: not reported.
#pragma once

#include "stria/kernel/select.cuh"

template <auto Kernel, class... Args>
void launch(dim3 grid, dim3 threads, Args... args) { Kernel<<<grid, threads>>>(args...); }
