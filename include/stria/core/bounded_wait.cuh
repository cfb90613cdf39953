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
/// (completed: false), calling check(elapsed) between polls, which may throw: at most every 100 us
/// while spinning (it may take a lock the peers share), then at every poll, and always before giving
/// up. For the first `spin` a poll only yields the core (as cudaDeviceScheduleYield does): a ring
/// step's confirmation is due microseconds after the copy it waits for, and a sleep may overshoot
/// by far more than it asks where the host's timers are coarse, leaving the GPU idle meanwhile. Past
/// `spin` (a peer slow or gone) the polls sleep from 10 us up to 1 ms, so a long wait costs little
/// host time.
template <class Check>
poll_result poll_event(cudaEvent_t done, std::chrono::milliseconds timeout, const Check& check,
                       std::chrono::microseconds spin = std::chrono::milliseconds(20)) {
  using clock = std::chrono::steady_clock;
  const clock::time_point start = clock::now();
  std::chrono::microseconds pause(0);
  std::chrono::duration<double> checked(-1.0);  // when check() last ran: while spinning, every 100 us
  while (true) {
    const cudaError_t state = cudaEventQuery(done);
    const std::chrono::duration<double> elapsed = clock::now() - start;
    if (state == cudaSuccess) return {true, elapsed};
    if (state != cudaErrorNotReady) STRIA_CUDA_CHECK(state);
    if (elapsed >= spin || elapsed >= timeout || elapsed - checked >= std::chrono::microseconds(100)) {
      check(elapsed);
      checked = elapsed;
    }
    if (elapsed >= timeout) return {false, elapsed};
    if (elapsed < spin) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::clamp<std::chrono::microseconds>(2 * pause, std::chrono::microseconds(10), std::chrono::milliseconds(1));
  }
}

/// "2.01 s": a duration as a message shows it.
inline std::string seconds_text(std::chrono::duration<double> d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f s", d.count());
  return text;
}

}  // namespace stria::detail
