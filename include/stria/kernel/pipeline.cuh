// SPDX-License-Identifier: Apache-2.0
// A ring of shared-memory stages between a producer warpgroup and a consumer warpgroup, guarded by
// mbarriers (PTX ISA, "mbarrier"): the producer fills stage t % Stages with tile t and the copies
// themselves complete the stage's `full` barrier; the consumer releases the stage through its
// `empty` barrier once its products have read it. Phase parity is (t / Stages) % 2.
#pragma once

#include <cstdint>

#include "stria/kernel/mma.cuh"

namespace stria::kernel::detail {

__device__ inline void barrier_init(std::uint64_t* barrier, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(count) : "memory");
#endif
}

/// Waits until the barrier's phase of parity `parity` has completed.
__device__ inline void barrier_wait(std::uint64_t* barrier, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
#else
  (void)barrier, (void)parity;
  __trap();
#endif
}

/// Sets this warpgroup's registers per thread to Count (inc: waits until the CTA's pool has them;
/// dec: returns them), so that a producer warpgroup needs few and the consumers get the rest.
template <int Count>
__device__ inline void set_registers_increase() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Count));
#endif
}
template <int Count>
__device__ inline void set_registers_decrease() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Count));
#endif
}

/// One arrival from lane 0 of the calling warp (predicated, not branched: the consumer calls it while
/// its products are in flight, and ptxas serializes wgmma across a branch).
__device__ inline void barrier_arrive_lane0(std::uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "{\n.reg .pred lead;\nsetp.eq.u32 lead, %1, 0;\n"
      "@lead mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(shared_address(barrier)),
      "r"(static_cast<unsigned>(threadIdx.x % 32))
      : "memory");
#endif
}

/// One arrival of this thread, made when every cp.async it has issued so far has landed (the
/// barrier's expected count includes it: .noinc).
__device__ inline void barrier_arrive_on_copies(std::uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier)) : "memory");
#endif
}

__device__ inline void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

/// The barriers of a ring of `Stages` stages: full (the `Copiers` producer threads arrive as their
/// copies land) and empty (the `ConsumerWarps` warps of the consumer warpgroups arrive once they are
/// done with the stage).
template <int Stages, int Copiers, int ConsumerWarps = 4>
struct stage_ring {
  std::uint64_t full[Stages];
  std::uint64_t empty[Stages];

  static constexpr int producer_arrivals = Copiers;
  static constexpr int consumer_arrivals = ConsumerWarps;

  /// By one thread, before a __syncthreads that publishes the barriers to the CTA.
  __device__ void init() {
    for (int s = 0; s < Stages; ++s) {
      barrier_init(&full[s], producer_arrivals);
      barrier_init(&empty[s], consumer_arrivals);
    }
  }
  __device__ static int stage(std::int64_t t) { return static_cast<int>(t % Stages); }
  __device__ static unsigned parity(std::int64_t t) { return static_cast<unsigned>((t / Stages) % 2); }

  /// Producer: waits until the consumer has released the stage tile t goes to (its previous tile,
  /// t - Stages); the first Stages tiles find their stages free.
  __device__ void acquire(std::int64_t t) {
    if (t >= Stages) barrier_wait(&empty[stage(t)], parity(t) ^ 1u);
  }
  /// Producer: every thread, after queuing its copies of tile t.
  __device__ void commit(std::int64_t t) { barrier_arrive_on_copies(&full[stage(t)]); }
  /// Consumer: waits until tile t has landed. The copies are generic-proxy writes: wgmma (the async
  /// proxy) reads them only after fence_async_shared, which the caller issues once for all its waits.
  __device__ void wait(std::int64_t t) { barrier_wait(&full[stage(t)], parity(t)); }
  /// Consumer: every warp, once its products on tile t have completed. Lane 0's arrival releases
  /// only lane 0's own accesses: reads of the stage by other lanes need ordering before it.
  __device__ void release(std::int64_t t) { barrier_arrive_lane0(&empty[stage(t)]); }
};

}  // namespace stria::kernel::detail
