// SPDX-License-Identifier: Apache-2.0
// Compiler configuration: host/device annotations that degrade to plain inline without nvcc.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define STRIA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define STRIA_HOST_DEVICE inline
#endif

namespace stria {

/// Signed index type for token, block and entry positions. 32 bits hold 1M tokens x 64 heads of
/// block-level entries; token-level products that can exceed it are computed in std::int64_t.
using index_t = std::int32_t;

/// The most context-parallel ranks a topology takes: rank and step arithmetic (rank x cards, message
/// tags of rank x chunk kinds) stays far inside index_t below it, and it is 64x the largest CP degree
/// in published training runs.
inline constexpr index_t max_world_size = 65536;

}  // namespace stria
