// SPDX-License-Identifier: Apache-2.0
// The library version; CMakeLists.txt reads it from here, so it is written in one place.
#pragma once

#define STRIA_VERSION_MAJOR 0
#define STRIA_VERSION_MINOR 1
#define STRIA_VERSION_PATCH 0

namespace stria {
inline constexpr int version_major = STRIA_VERSION_MAJOR;
inline constexpr int version_minor = STRIA_VERSION_MINOR;
inline constexpr int version_patch = STRIA_VERSION_PATCH;
}  // namespace stria
