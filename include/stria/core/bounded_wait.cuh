// SPDX-License-Identifier: Apache-2.0
// A host wait on device work that cannot hang (DESIGN 11): polls a CUDA event, asks the caller's
// health check between polls (a peer failed, NCCL reported an error) and gives up after a timeout.
// The device communicators' wait() is built on it; the ring engines call that to confirm transfers.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "stria/core/cuda_check.cuh"

namespace stria::detail {

struct poll_result {
  bool completed;
  std::chrono::duration<double> elapsed;
};

/// Polls `done` until the work it captured has completed (completed: true) or `timeout` has passed
/// (completed: false). Between polls calls check(elapsed), which may throw. Polls back off from a
/// yield to 1 ms, so a wait costs little host time and adds at most about 1 ms after completion.
template <class Check>
poll_result poll_event(cudaEvent_t done, std::chrono::milliseconds timeout, const Check& check) {
  using clock = std::chrono::steady_clock;
  const clock::time_point start = clock::now();
  std::chrono::microseconds pause(0);
  while (true) {
    const cudaError_t state = cudaEventQuery(done);
    const std::chrono::duration<double> elapsed = clock::now() - start;
    if (state == cudaSuccess) return {true, elapsed};
    if (state != cudaErrorNotReady) STRIA_CUDA_CHECK(state);
    check(elapsed);
    if (elapsed >= timeout) return {false, elapsed};
    if (pause.count() == 0) std::this_thread::yield();
    else std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(std::max<std::chrono::microseconds>(2 * pause, std::chrono::microseconds(10)),
                                                std::chrono::milliseconds(1));
  }
}

/// "2.01 s": a duration as a message shows it.
inline std::string seconds_text(std::chrono::duration<double> d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f s", d.count());
  return text;
}

}  // namespace stria::detail
