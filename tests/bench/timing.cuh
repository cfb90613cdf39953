// SPDX-License-Identifier: Apache-2.0
// Shared by the benchmarks: random non-zero bf16 device tensors, and CUDA-event timing (warm-up,
// then the median of repeated runs).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"

namespace stria::bench {

/// Uniform values in [-magnitude, magnitude] from a counter hash; never exactly zero. (A template:
/// kernels cannot be `inline`, and a header may be included by several translation units.)
template <int Unused = 0>
__global__ void fill_random(__nv_bfloat16* x, std::int64_t n, std::uint64_t seed, float magnitude) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    std::uint64_t h = (static_cast<std::uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ULL ^ seed;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 29;
    const float u = static_cast<float>(h >> 40) / static_cast<float>(1 << 24);  // [0, 1)
    float value = (2.0f * u - 1.0f) * magnitude;
    if (__bfloat162float(__float2bfloat16(value)) == 0.0f) value = 0.5f * magnitude;
    x[i] = __float2bfloat16(value);
  }
}

inline device_buffer<__nv_bfloat16> random_buffer(std::size_t n, std::uint64_t seed, float magnitude) {
  device_buffer<__nv_bfloat16> x(n);
  fill_random<><<<2048, 256>>>(x.data(), static_cast<std::int64_t>(n), seed, magnitude);
  STRIA_CUDA_CHECK_LAUNCH("fill_random");
  return x;
}

/// Milliseconds of one run() between events recorded on `stream` (the stream run() queues its work on).
template <class Run>
float time_ms(Run& run, cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop) {
  STRIA_CUDA_CHECK(cudaEventRecord(start, stream));
  run();
  STRIA_CUDA_CHECK(cudaEventRecord(stop, stream));
  STRIA_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  STRIA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  return ms;
}

inline double median_of(std::vector<float> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

/// Median of `repeats` timings of run() after three warm-up runs, events recorded on `stream` (the
/// stream run() queues its work on).
template <class Run>
double median_ms(int repeats, Run run, cudaStream_t stream = nullptr) {
  cudaEvent_t start, stop;
  STRIA_CUDA_CHECK(cudaEventCreate(&start));
  STRIA_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) run();  // warm-up
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) times.push_back(time_ms(run, stream, start, stop));
  STRIA_CUDA_CHECK(cudaEventDestroy(start));
  STRIA_CUDA_CHECK(cudaEventDestroy(stop));
  return median_of(times);
}

/// Medians of `repeats` timings each of run_a() (on stream_a) and run_b() (on stream_b), taken in
/// turns after three warm-up runs of each: how two paths are compared. Measured one after the
/// other, in separate loops, the same kernels differed by up to 5% between the loops (RESULTS,
/// 2026-12-03, ninth), as much as the difference being measured.
template <class RunA, class RunB>
std::pair<double, double> median_ms_alternating(int repeats, RunA run_a, cudaStream_t stream_a, RunB run_b, cudaStream_t stream_b) {
  cudaEvent_t start, stop;
  STRIA_CUDA_CHECK(cudaEventCreate(&start));
  STRIA_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) {  // warm-up
    run_a();
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_a));
    run_b();
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_b));
  }
  std::vector<float> a, b;
  for (int i = 0; i < repeats; ++i) {
    a.push_back(time_ms(run_a, stream_a, start, stop));
    b.push_back(time_ms(run_b, stream_b, start, stop));
  }
  STRIA_CUDA_CHECK(cudaEventDestroy(start));
  STRIA_CUDA_CHECK(cudaEventDestroy(stop));
  return {median_of(a), median_of(b)};
}

/// Median host time of one run() in microseconds, the GPU idle at its start: what the call spends on
/// the host (checks, allocations, launches) before its work is queued. Part of a timed run while the
/// GPU waits for its first launch; hidden behind earlier work when calls are queued back to back.
template <class Run>
double median_host_us(int repeats, Run run) {
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) {
    STRIA_CUDA_CHECK(cudaDeviceSynchronize());
    const auto start = std::chrono::steady_clock::now();
    run();
    times.push_back(std::chrono::duration<float, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  STRIA_CUDA_CHECK(cudaDeviceSynchronize());
  return median_of(times);
}

}  // namespace stria::bench
