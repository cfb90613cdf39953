// SPDX-License-Identifier: Apache-2.0
// A header that breaks both layer rules, for the test of cmake/check_layers.cmake.
#pragma once

#include "stria/kernel/select.cuh"

inline void launch() { stria::kernel::select_verticals<><<<1, 1>>>({}); }
