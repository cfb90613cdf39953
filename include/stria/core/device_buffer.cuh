// SPDX-License-Identifier: Apache-2.0
// device_buffer<T>: owning, move-only device memory with checked uploads and downloads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/cuda_check.cuh"
#include "stria/core/error.hpp"

namespace stria {

template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t count) : count_(count) {
    if (count_ > 0) STRIA_CUDA_CHECK(cudaMalloc(&data_, count_ * sizeof(T)));
  }
  /// A device copy of `host` (synchronous).
  explicit device_buffer(std::span<const T> host) : device_buffer(host.size()) { upload(host); }

  device_buffer(device_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { release(); }

  [[nodiscard]] T* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return count_; }
  [[nodiscard]] std::size_t bytes() const { return count_ * sizeof(T); }

  /// Copies host data in (synchronous, or ordered on `stream` when given; host memory must then stay alive).
  void upload(std::span<const T> host, cudaStream_t stream = nullptr) {
    if (host.size() != count_)
      throw invalid_argument("host.size()", host.size(), "must equal the device buffer's size " + std::to_string(count_));
    if (count_ == 0) return;
    if (stream) STRIA_CUDA_CHECK(cudaMemcpyAsync(data_, host.data(), bytes(), cudaMemcpyHostToDevice, stream));
    else STRIA_CUDA_CHECK(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }

  /// The contents, copied back (synchronises `stream` first).
  [[nodiscard]] std::vector<T> download(cudaStream_t stream = nullptr) const {
    std::vector<T> host(count_);
    if (count_ == 0) return host;
    if (stream) STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
    STRIA_CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }

  /// Sets every byte (for poisoning outputs before a kernel, and zeroing accumulators).
  void fill_bytes(int byte, cudaStream_t stream = nullptr) {
    if (count_ > 0) STRIA_CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes(), stream));
  }

 private:
  void release() noexcept {
    if (data_) (void)cudaFree(data_);  // never throws from a destructor
    data_ = nullptr;
    count_ = 0;
  }

  T* data_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace stria
