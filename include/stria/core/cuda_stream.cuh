// SPDX-License-Identifier: Apache-2.0
// Owning handles of a CUDA stream and a CUDA event, and the one ordering step the ring engines use
// everywhere: make stream `waiter` wait for what is queued on stream `signaller` so far. Also a
// second stream beside a caller's for work that shares nothing with it, forked and joined back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <utility>

#include "stria/core/cuda_check.cuh"

namespace stria {

/// A non-blocking stream (it does not synchronise with the legacy default stream), of a priority
/// (cudaDeviceGetStreamPriorityRange: lower numbers are higher; 0, the default, is the lowest).
class cuda_stream {
 public:
  explicit cuda_stream(int priority = 0) { STRIA_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority)); }
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

/// Work queued on `side` while this object lives joins the caller's stream at its end:
/// construction makes `side` wait for what `caller` has queued so far, destruction makes `caller`
/// wait for everything then queued on `side`, on every way out of the scope (an exception too), so
/// that memory the caller's stream releases afterwards is no longer in use. Where queuing the join
/// fails, the destructor waits on the host for `side` instead (outside a stream capture: in one, that
/// failure has invalidated the capture already).
class forked_stream {
 public:
  forked_stream(cudaStream_t caller, cudaStream_t side) : caller_(caller), side_(side) { wait_for(side, caller); }
  ~forked_stream() {
    if (cudaEventRecord(joined_.get(), side_) != cudaSuccess || cudaStreamWaitEvent(caller_, joined_.get(), 0) != cudaSuccess)
      (void)cudaStreamSynchronize(side_);
  }
  forked_stream(const forked_stream&) = delete;
  forked_stream& operator=(const forked_stream&) = delete;

  [[nodiscard]] cudaStream_t get() const { return side_; }

 private:
  cudaStream_t caller_, side_;
  cuda_event joined_;
};

namespace detail {
/// A non-blocking stream beside `caller`, of the caller's priority (for a forked_stream): one per
/// host thread, current device and caller's stream, created at first use and kept for the thread's
/// life. A thread that has used 64 releases them all before it makes another (a stream destroyed
/// with work queued finishes it first). The handles do not outlive a cudaDeviceReset.
inline cudaStream_t side_stream(cudaStream_t caller) {
  thread_local std::map<std::pair<int, std::uintptr_t>, cuda_stream> streams;
  const std::pair key{current_device(), reinterpret_cast<std::uintptr_t>(caller)};
  if (const auto found = streams.find(key); found != streams.end()) return found->second.get();
  if (streams.size() >= 64) streams.clear();
  int priority = 0;
  STRIA_CUDA_CHECK(cudaStreamGetPriority(caller, &priority));
  return streams.try_emplace(key, priority).first->second.get();
}
}  // namespace detail

}  // namespace stria
