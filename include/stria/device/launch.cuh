// SPDX-License-Identifier: Apache-2.0
// What every launcher of the device layer shares: the head dim as a template argument, per-device
// facts read without a lock, the dynamic shared-memory attribute set once per kernel and device, and
// `launch`, the one place the library starts a kernel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <source_location>
#include <string>
#include <utility>

#include "stria/core/config.hpp"
#include "stria/core/cuda_check.cuh"

namespace stria::device {

/// The launchers' HeadDim template argument where the call's head dim picks the kernels at run time
/// (both head dims instantiated). The front template and the engines pass their Tile's head_dim
/// instead, and get that one set of kernels only.
inline constexpr index_t any_head_dim = 0;

}  // namespace stria::device

namespace stria::device::detail {

/// Runs `launch.template operator()<D>()` with the head dim as a template argument: HeadDim alone
/// where it is given (one set of kernels per Tile; the launcher checked the call's head dim against
/// it first, check_head_dim), else a runtime switch over both.
template <index_t HeadDim, class Launch>
void with_head_dim(index_t head_dim, Launch&& launch) {
  if constexpr (HeadDim != any_head_dim) {
    launch.template operator()<static_cast<int>(HeadDim)>();
  } else if (head_dim == 64) {
    launch.template operator()<64>();
  } else {
    launch.template operator()<128>();  // attention_shape::validate admits 64 and 128 only
  }
}

/// Devices whose per-process facts (the Hopper probe, the shared-memory attributes) are read
/// without a lock; others take a mutex each time.
inline constexpr int lock_free_devices = 64;

using stria::detail::current_device;

/// Lets `Kernel` launch with `bytes` of dynamic shared memory on the current device. The attribute
/// is set once per kernel and device, and raised only where a call needs more: set before every
/// launch it cost host time on every ring step. (A cudaDeviceReset clears it behind this record:
/// the next launch past 48 KiB then fails with a CUDA error.)
template <auto Kernel>
void allow_shared_bytes(std::size_t bytes) {
  static std::array<std::atomic<std::size_t>, lock_free_devices> allowed{};
  static std::mutex raising;
  const int device = current_device();
  const bool recorded = device < lock_free_devices;
  if (recorded && allowed[static_cast<std::size_t>(device)].load(std::memory_order_acquire) >= bytes) return;
  const std::lock_guard lock(raising);  // raises never lower what another thread set meanwhile
  const std::size_t limit = recorded ? std::max(bytes, allowed[static_cast<std::size_t>(device)].load(std::memory_order_relaxed)) : bytes;
  STRIA_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
  if (recorded) allowed[static_cast<std::size_t>(device)].store(limit, std::memory_order_release);
}

/// A kernel's name for launch errors, with the launcher's file:line.
struct kernel_name {
  kernel_name(const char* text, std::source_location where = std::source_location::current()) : text(text), where(where) {}
  const char* text;
  std::source_location where;
};

/// Grid, block, dynamic shared memory and stream of one launch.
struct launch_shape {
  dim3 grid;
  dim3 threads;
  std::size_t shared_bytes = 0;
  cudaStream_t stream = nullptr;
};

/// Launches `Kernel` (the library's only `<<<`): raises its dynamic shared-memory limit first where
/// the launch has dynamic shared memory (allow_shared_bytes; the default limit is 48 KiB less the
/// kernel's static shared memory, so any nonzero size may need it), and throws stria::cuda_error
/// naming the kernel and the launcher's line when the launch fails (a bad configuration shows up in
/// cudaGetLastError, not in the launch itself).
template <auto Kernel, class... Args>
void launch(kernel_name name, const launch_shape& shape, Args&&... args) {
  if (shape.shared_bytes > 0) allow_shared_bytes<Kernel>(shape.shared_bytes);
  Kernel<<<shape.grid, shape.threads, shape.shared_bytes, shape.stream>>>(std::forward<Args>(args)...);
  if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess)
    stria::detail::check_cuda(status, ("launch of " + std::string(name.text)).c_str(), name.where);
}

}  // namespace stria::device::detail
