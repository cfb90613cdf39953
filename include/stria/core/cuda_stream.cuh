// SPDX-License-Identifier: Apache-2.0
// Owning handles of a CUDA stream and a CUDA event, and the one ordering step the ring engines use
// everywhere: make stream `waiter` wait for what is queued on stream `signaller` so far.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

#include "stria/core/cuda_check.cuh"

namespace stria {

/// A non-blocking stream (it does not synchronise with the legacy default stream).
class cuda_stream {
 public:
  cuda_stream() { STRIA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~cuda_stream() {
    if (stream_) (void)cudaStreamDestroy(stream_);  // never throws from a destructor
  }
  cuda_stream(cuda_stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  cuda_stream& operator=(cuda_stream&& other) noexcept {
    std::swap(stream_, other.stream_);
    return *this;
  }
  cuda_stream(const cuda_stream&) = delete;
  cuda_stream& operator=(const cuda_stream&) = delete;

  [[nodiscard]] cudaStream_t get() const { return stream_; }
  void synchronize() const { STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

/// An event for ordering only (no timing). Destroying it after a wait on it was queued is safe.
class cuda_event {
 public:
  cuda_event() { STRIA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~cuda_event() {
    if (event_) (void)cudaEventDestroy(event_);
  }
  cuda_event(cuda_event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  cuda_event& operator=(cuda_event&& other) noexcept {
    std::swap(event_, other.event_);
    return *this;
  }
  cuda_event(const cuda_event&) = delete;
  cuda_event& operator=(const cuda_event&) = delete;

  [[nodiscard]] cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) const { STRIA_CUDA_CHECK(cudaEventRecord(event_, stream)); }
  /// Queues on `stream` a wait for the work this event captured when last recorded.
  void make_wait(cudaStream_t stream) const { STRIA_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }

 private:
  cudaEvent_t event_ = nullptr;
};

/// Work queued on `waiter` from now on starts after the work queued on `signaller` so far.
inline void wait_for(cudaStream_t waiter, cudaStream_t signaller) {
  if (waiter == signaller) return;
  const cuda_event done;
  done.record(signaller);
  done.make_wait(waiter);
}

}  // namespace stria
