// SPDX-License-Identifier: Apache-2.0
// device_buffer<T>: owning, move-only device memory with checked uploads and downloads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/cuda_check.cuh"
#include "stria/core/error.hpp"

namespace stria {

namespace detail {

/// stria's stream-ordered memory pool on the current device, created once per device. Freed memory
/// stays in the pool (release threshold = max) instead of going back to the OS at every
/// synchronisation, so the same sizes allocated each layer cost almost nothing; the user's default
/// pool is left as it is.
inline cudaMemPool_t memory_pool() {
  const int device = current_device();
  static std::mutex mutex;
  static std::map<int, cudaMemPool_t> pools;
  const std::lock_guard lock(mutex);
  if (const auto it = pools.find(device); it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool{};
  STRIA_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  std::uint64_t keep_everything = UINT64_MAX;
  STRIA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything));
  pools.emplace(device, pool);
  return pool;
}

}  // namespace detail

/// Memory is allocated and freed in stream order (from stria's pool, on the stream given at
/// construction, so it costs no device-wide synchronisation): use the buffer on that stream, or
/// synchronise before using it on another. The stream must outlive the buffer.
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t count, cudaStream_t stream = nullptr) : count_(count), stream_(stream) {
    if (count_ > 0)
      STRIA_CUDA_CHECK(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&data_), count_ * sizeof(T), detail::memory_pool(), stream_));
  }
  /// A device copy of `host`, ordered on `stream` (the host memory may be released on return).
  explicit device_buffer(std::span<const T> host, cudaStream_t stream = nullptr) : device_buffer(host.size(), stream) {
    upload(host, stream);
  }

  device_buffer(device_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)), stream_(other.stream_) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
      stream_ = other.stream_;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { release(); }

  [[nodiscard]] T* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return count_; }
  [[nodiscard]] std::size_t bytes() const { return count_ * sizeof(T); }

  /// Copies host data in, ordered on `stream` (pageable host memory is staged before the call
  /// returns, so it may be released right after).
  void upload(std::span<const T> host, cudaStream_t stream) {
    if (host.size() != count_)
      throw invalid_argument("host.size()", host.size(), "must equal the device buffer's size " + std::to_string(count_));
    if (count_ > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(data_, host.data(), bytes(), cudaMemcpyHostToDevice, stream));
  }
  void upload(std::span<const T> host) { upload(host, stream_); }

  /// The contents, copied back after the work queued on `stream` (default: the buffer's own).
  [[nodiscard]] std::vector<T> download(cudaStream_t stream) const {
    std::vector<T> host(count_);
    if (count_ == 0) return host;
    STRIA_CUDA_CHECK(cudaMemcpyAsync(host.data(), data_, bytes(), cudaMemcpyDeviceToHost, stream));
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return host;
  }
  [[nodiscard]] std::vector<T> download() const { return download(stream_); }

  /// Sets every byte (for poisoning outputs before a kernel, and zeroing accumulators).
  void fill_bytes(int byte, cudaStream_t stream) {
    if (count_ > 0) STRIA_CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes(), stream));
  }
  void fill_bytes(int byte) { fill_bytes(byte, stream_); }

  [[nodiscard]] cudaStream_t stream() const { return stream_; }

 private:
  void release() noexcept {
    if (data_) (void)cudaFreeAsync(data_, stream_);  // never throws from a destructor
    data_ = nullptr;
    count_ = 0;
  }

  T* data_ = nullptr;
  std::size_t count_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace stria
