// SPDX-License-Identifier: Apache-2.0
// What compute-sanitizer's racecheck makes of a producer-consumer hand-over through mbarriers (the
// Hopper forward's stage rings, kernel/pipeline.cuh), next to the same hand-over through
// __syncthreads. Not a test: run_on_device.sh runs it under racecheck and logs what it reports.
//   usage: stria_racecheck_probe copies|copies-lane0|stores|stores-lane0|syncthreads
// copies: the producer writes a stage by cp.async and arrives through cp.async.mbarrier.arrive, as
//   the forward's copiers do; stores: plain stores, then mbarrier.arrive.release. The consumer waits
//   on the stage's full barrier, reads it, and lane 0 of each warp releases it (stage_ring::release).
//   Where every lane reads (copies, stores: the forward's K ring as of 2026-12-04), lanes 1-31's reads
//   are not ordered before that release, a write-after-read race under the PTX memory model; with
//   -lane0 only lane 0 reads and shuffles the value to its warp, which orders every read. syncthreads:
//   the control. Each exits 0 when the consumer summed what the producer handed over.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "stria/kernel/pipeline.cuh"

namespace {

namespace detail = stria::kernel::detail;
constexpr int stages = 4, tiles = 64, copiers = 64;
enum class hand_over { copies, stores, syncthreads };
enum class readers { all_lanes, lane0 };

__device__ void arrive_release(std::uint64_t* barrier) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(detail::shared_address(barrier)) : "memory");
}

/// Warpgroup 1 hands values[t] to warpgroup 0 through stage t % stages; warpgroup 0 sums them.
template <hand_over How, readers Who>
__global__ void sum_handed_over(const int* values, int* sum_out) {
  __shared__ detail::stage_ring<stages, copiers> ring;
  __shared__ int slot[stages];
  if (threadIdx.x == 0) ring.init();
  __syncthreads();
  int sum = 0;
  if constexpr (How == hand_over::syncthreads) {
    for (int t = 0; t < tiles; ++t) {
      if (threadIdx.x == 128) slot[t % stages] = values[t];
      __syncthreads();
      sum += slot[t % stages];
      __syncthreads();
    }
  } else if (threadIdx.x >= 128) {
    if (threadIdx.x < 128 + copiers) {
      for (int t = 0; t < tiles; ++t) {
        ring.acquire(t);
        if constexpr (How == hand_over::copies) {
          if (threadIdx.x == 128) detail::cp_async_4(&slot[ring.stage(t)], values + t);
          ring.commit(t);
        } else {
          if (threadIdx.x == 128) slot[ring.stage(t)] = values[t];
          arrive_release(&ring.full[ring.stage(t)]);
        }
      }
      detail::cp_async_wait_all();
    }
  } else {
    for (int t = 0; t < tiles; ++t) {
      ring.wait(t);
      if constexpr (Who == readers::lane0) sum += __shfl_sync(0xffffffffu, threadIdx.x % 32 == 0 ? slot[ring.stage(t)] : 0, 0);
      else sum += slot[ring.stage(t)];
      ring.release(t);
    }
  }
  if (threadIdx.x == 0) *sum_out = sum;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string how = argc > 1 ? argv[1] : "";
  if (how != "copies" && how != "copies-lane0" && how != "stores" && how != "stores-lane0" && how != "syncthreads") {
    std::fprintf(stderr, "usage: %s copies|copies-lane0|stores|stores-lane0|syncthreads\n", argv[0]);
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no GPU: nothing to probe\n");
    return 77;
  }
  int host[tiles], expected = 0;
  for (int t = 0; t < tiles; ++t) expected += host[t] = 3 * t + 1;
  int *values = nullptr, *sum = nullptr, got = -1;
  cudaMalloc(&values, sizeof host);
  cudaMalloc(&sum, sizeof(int));
  cudaMemcpy(values, host, sizeof host, cudaMemcpyHostToDevice);
  if (how == "copies") sum_handed_over<hand_over::copies, readers::all_lanes><<<1, 256>>>(values, sum);
  else if (how == "copies-lane0") sum_handed_over<hand_over::copies, readers::lane0><<<1, 256>>>(values, sum);
  else if (how == "stores") sum_handed_over<hand_over::stores, readers::all_lanes><<<1, 256>>>(values, sum);
  else if (how == "stores-lane0") sum_handed_over<hand_over::stores, readers::lane0><<<1, 256>>>(values, sum);
  else sum_handed_over<hand_over::syncthreads, readers::all_lanes><<<1, 256>>>(values, sum);
  const cudaError_t launched = cudaMemcpy(&got, sum, sizeof got, cudaMemcpyDeviceToHost);
  std::printf("%s: consumer summed %d, producer handed over %d (%s)\n", how.c_str(), got, expected, cudaGetErrorString(launched));
  cudaFree(values);
  cudaFree(sum);
  return launched == cudaSuccess && got == expected ? 0 : 1;
}
