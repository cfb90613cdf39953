// SPDX-License-Identifier: Apache-2.0
// Checked mode on the device (issue 20): after a step, one pass per result tensor finds its first
// NaN or infinity (kernel/finite_check.cuh); one copy of the few 64-bit results comes back, and
// the first tensor with a bad element raises non_finite_error naming rank, step, head and token.
// Only runs when the caller's finite_check asks for it: off, nothing here is launched.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/finite_check.hpp"
#include "stria/device/launch.cuh"
#include "stria/kernel/finite_check.cuh"

namespace stria::device {

/// The checks of one step. Use: begin(), add() each tensor (in the order they should be reported),
/// then finish(), which waits for the passes (a host synchronisation with `stream`) and throws.
/// `capacity`: the most tensors one step adds (a solver stage adds one or two per moved chunk).
class step_check {
 public:
  static constexpr std::size_t default_capacity = 4;  // a ring step: O and LSE; or dQ, dK and dV

  explicit step_check(cudaStream_t stream, std::size_t capacity = default_capacity)
      : stream_(stream), capacity_(capacity), found_(capacity, stream) {}

  void begin() {
    tensors_.clear();
    found_.fill_bytes(0xff, stream_);  // ~0: nothing found
  }

  /// Queues the pass over `data`, laid out and ruled as `t` says.
  template <class T>
  void add(const T* data, const checked_tensor& t) {
    if (tensors_.size() == capacity_)
      throw invalid_argument("step_check::add", tensors_.size(), "takes at most " + std::to_string(capacity_) + " tensors per step (its capacity)");
    const std::int64_t count = t.size();
    unsigned long long* slot = found_.data() + tensors_.size();
    tensors_.push_back(t);
    if (count == 0) return;
    const unsigned threads = 256;
    const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((count + threads - 1) / threads, 4096));
    detail::launch<&kernel::first_non_finite<T>>("first_non_finite", {blocks, threads, 0, stream_}, data, count, t.negative_infinity_allowed, slot);
  }

  /// Reads the results back and throws non_finite_error for the first tensor holding a bad value.
  void finish(index_t rank, index_t step, const std::string& phase) {
    std::vector<unsigned long long> found(tensors_.size());
    if (found.empty()) return;
    STRIA_CUDA_CHECK(cudaMemcpyAsync(found.data(), found_.data(), found.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream_));
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (std::size_t i = 0; i < found.size(); ++i)
      if (found[i] != ~0ull)
        throw non_finite_found(rank, step, phase, tensors_[i],
                               {static_cast<std::int64_t>(found[i] / 4), static_cast<non_finite_kind>(found[i] % 4)});
  }

 private:
  cudaStream_t stream_;
  std::size_t capacity_;
  device_buffer<unsigned long long> found_;
  std::vector<checked_tensor> tensors_;
};

}  // namespace stria::device
