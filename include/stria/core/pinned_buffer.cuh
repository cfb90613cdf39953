// SPDX-License-Identifier: Apache-2.0
// pinned_buffer<T>: owning, move-only page-locked host memory from a process-wide cache, for the
// host round trips of small arrays (the GPU selection's list sizes, the NCCL communicator's host-array collectives).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <mutex>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "stria/core/cuda_check.cuh"

namespace stria {

namespace detail {

/// A page-locked block and the event that marks the end of its last stream's work on it.
struct pinned_block {
  void* data = nullptr;
  std::size_t bytes = 0;
  int device = 0;                // the event's device
  cudaEvent_t released = nullptr;
};

/// Blocks given back, kept for the life of the process (as stria's device pool keeps its memory):
/// page-locking costs far more than the copies these blocks serve, and freeing page-locked memory
/// synchronises the device.
struct pinned_cache {
  std::mutex mutex;
  std::vector<pinned_block> free;
};
inline pinned_cache& pinned_blocks() {
  static auto* cache = new pinned_cache;  // never destroyed: blocks may be given back during exit
  return *cache;
}

/// A block of at least `bytes` (sizes round up to powers of two, at least 4 KiB, so that blocks are
/// reused) whose previous work has finished, from the cache or newly page-locked.
inline pinned_block acquire_pinned(std::size_t bytes) {
  const int device = current_device();
  const std::size_t size = std::bit_ceil(std::max<std::size_t>(bytes, 4096));
  {
    pinned_cache& cache = pinned_blocks();
    const std::lock_guard lock(cache.mutex);
    for (auto it = cache.free.begin(); it != cache.free.end(); ++it)
      if (it->bytes == size && it->device == device && cudaEventQuery(it->released) == cudaSuccess) {
        const pinned_block b = *it;
        cache.free.erase(it);
        return b;
      }
  }
  pinned_block b{nullptr, size, device, nullptr};
  STRIA_CUDA_CHECK(cudaMallocHost(&b.data, size));
  if (const cudaError_t status = cudaEventCreateWithFlags(&b.released, cudaEventDisableTiming); status != cudaSuccess) {
    (void)cudaFreeHost(b.data);
    STRIA_CUDA_CHECK(status);
  }
  return b;
}

/// Gives `b` back once the work queued so far on `stream` (copies from or to it) has finished.
inline void release_pinned(pinned_block b, cudaStream_t stream) noexcept {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device != b.device || cudaEventRecord(b.released, stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // no way to tell when its copies end: the block stays out of the cache
  }
  pinned_cache& cache = pinned_blocks();
  const std::lock_guard lock(cache.mutex);
  cache.free.push_back(b);
}

}  // namespace detail

/// Host memory that copies reach by DMA: cudaMemcpyAsync from and to it returns at once and overlaps
/// other threads' copies, where pageable memory is staged by the driver while the host waits. The
/// buffer belongs to the stream given at construction, as a device_buffer does: when it is
/// destroyed, its memory returns to the cache for reuse only after the work queued on that stream by
/// then (say, an upload from it) has finished. Copies on another stream must be synchronised first.
template <class T>
class pinned_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "pinned_buffer holds trivially copyable elements (it is copied byte-wise)");

 public:
  pinned_buffer() = default;
  pinned_buffer(std::size_t count, cudaStream_t stream) : count_(count), stream_(stream) {
    if (count_ > 0) block_ = detail::acquire_pinned(count_ * sizeof(T));
  }
  pinned_buffer(pinned_buffer&& other) noexcept
      : block_(std::exchange(other.block_, {})), count_(std::exchange(other.count_, 0)), stream_(other.stream_) {}
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    if (this != &other) {
      release();
      block_ = std::exchange(other.block_, {});
      count_ = std::exchange(other.count_, 0);
      stream_ = other.stream_;
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  ~pinned_buffer() { release(); }

  [[nodiscard]] T* data() const { return static_cast<T*>(block_.data); }
  [[nodiscard]] std::size_t size() const { return count_; }
  [[nodiscard]] std::size_t bytes() const { return count_ * sizeof(T); }
  [[nodiscard]] T* begin() const { return data(); }
  [[nodiscard]] T* end() const { return data() + count_; }
  [[nodiscard]] T& operator[](std::size_t i) const { return data()[i]; }
  [[nodiscard]] std::span<T> span() const { return {data(), count_}; }
  [[nodiscard]] cudaStream_t stream() const { return stream_; }

 private:
  void release() noexcept {
    if (block_.data != nullptr) detail::release_pinned(block_, stream_);
    block_ = {};
    count_ = 0;
  }

  detail::pinned_block block_{};
  std::size_t count_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace stria
