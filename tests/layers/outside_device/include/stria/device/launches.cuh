// SPDX-License-Identifier: Apache-2.0
// The same launch where it belongs, for the test of cmake/check_layers.cmake: not reported.
#pragma once

#include "stria/kernel/select.cuh"

inline void launch() { stria::kernel::select_verticals<><<<1, 1>>>({}); }
