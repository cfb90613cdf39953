// SPDX-License-Identifier: Apache-2.0
// A stream held for as long as a test wants (issue 20, faults): a gate kernel spins on a host-mapped
// flag, so the work queued behind it waits as it would behind a peer that died or never posted its
// part; open_after opens the gate from another thread, so a test can fail but never hang.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <thread>

#include "stria/core/cuda_check.cuh"

namespace stria::test {

/// Spins until the host opens the gate (host-mapped memory). A template, so that every program
/// including this header may define it (one instance, merged by the linker).
template <class Flag>
__global__ void hold_until_open(const volatile Flag* gate) {
  while (*gate == 0) __nanosleep(1000);
}

/// A gate in host-mapped memory, opened by the host; closed while it lives, opened when it goes.
class gate {
 public:
  gate() {
    void* host = nullptr;
    STRIA_CUDA_CHECK(cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped));
    host_ = static_cast<int*>(host);
    open_ref().store(0);
    void* device = nullptr;
    STRIA_CUDA_CHECK(cudaHostGetDevicePointer(&device, host, 0));
    device_ = static_cast<const int*>(device);
  }
  ~gate() {
    open();
    (void)cudaDeviceSynchronize();  // whatever waited behind it has run
    (void)cudaFreeHost(host_);
  }
  gate(const gate&) = delete;
  gate& operator=(const gate&) = delete;

  void hold(cudaStream_t stream) const {
    hold_until_open<int><<<1, 1, 0, stream>>>(device_);
    STRIA_CUDA_CHECK_LAUNCH("hold_until_open");
  }
  /// Any thread may open it (open_after does).
  void open() { open_ref().store(1); }

 private:
  [[nodiscard]] std::atomic_ref<int> open_ref() const { return std::atomic_ref<int>(*host_); }

  int* host_ = nullptr;
  const int* device_ = nullptr;
};

/// Opens `g` after `delay` unless destroyed first. Where the code under test waits on the held
/// stream itself (a synchronisation, a call that drains the device), the gate opens anyway and the
/// test fails on its time bound instead of hanging; opened() says whether that happened.
class open_after {
 public:
  open_after(gate& g, std::chrono::milliseconds delay)
      : thread_([this, &g, delay](std::stop_token stop) {
          std::mutex mutex;
          std::unique_lock lock(mutex);
          std::condition_variable_any never_notified;  // woken by a stop request, or by the delay's end
          if (!never_notified.wait_for(lock, stop, delay, [] { return false; }) && !stop.stop_requested()) {
            opened_.store(true);
            g.open();
          }
        }) {}
  ~open_after() = default;  // std::jthread: asks the thread to stop and joins it
  open_after(const open_after&) = delete;
  open_after& operator=(const open_after&) = delete;

  /// Whether the delay passed and this opened the gate.
  [[nodiscard]] bool opened() const { return opened_.load(); }

 private:
  std::atomic<bool> opened_{false};
  std::jthread thread_;  // the last member: started once opened_ exists
};

}  // namespace stria::test
