// SPDX-License-Identifier: Apache-2.0
// A device communicator written as a third party would satisfies stria::device_communicator and
// stria::device_collectives, and instantiates the device ring, the solver executor and the front
// template (its estimate() too: the GPU estimator) under nvcc; the built-in communicators satisfy
// their concepts and a host communicator is no device communicator. No GPU is needed: the ring's
// first check (the world size) comes before any CUDA call.
#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <cstddef>
#include <string>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/comm/local_device.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/device/ring_attention.cuh"
#include "stria/device/solver_attention.cuh"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"
#if defined(STRIA_TEST_NCCL)
#include "stria/comm/nccl.cuh"
#endif

namespace third_party {

using stria::index_t;

/// Records what the engines ask of it (a transport of the user's own would move the bytes).
struct recording_comm {
  index_t ranks = 1;
  int groups = 0;
  std::vector<std::string> log;

  index_t rank() const { return 0; }
  index_t world_size() const { return ranks; }
  void group_start() { ++groups; }
  void group_end() {}
  template <class T>
  void send(const T*, std::size_t count, index_t peer, cudaStream_t, int tag) {
    log.push_back("send " + std::to_string(count) + " to " + std::to_string(peer) + " tag " + std::to_string(tag));
  }
  template <class T>
  void recv(T*, std::size_t count, index_t peer, cudaStream_t, int tag) {
    log.push_back("recv " + std::to_string(count) + " from " + std::to_string(peer) + " tag " + std::to_string(tag));
  }
  void wait(cudaEvent_t, const std::string& what) { log.push_back("wait for " + what); }
  template <class T>
  void broadcast(T*, std::size_t count, index_t root, cudaStream_t) {
    log.push_back("broadcast " + std::to_string(count) + " from " + std::to_string(root));
  }
  template <class T>
  void all_reduce(const T*, T*, std::size_t count, stria::comm::reduce_op, cudaStream_t) {
    log.push_back("all_reduce " + std::to_string(count));
  }
  template <class T>
  void all_gather(const T*, T*, std::size_t count, cudaStream_t) {
    log.push_back("all_gather " + std::to_string(count));
  }
};
static_assert(stria::device_communicator<recording_comm>);
static_assert(stria::device_collectives<recording_comm>);

/// A device communicator from before bounded waits: no wait(event, what).
struct without_wait {
  index_t rank() const { return 0; }
  index_t world_size() const { return 1; }
  void group_start() {}
  void group_end() {}
  template <class T>
  void send(const T*, std::size_t, index_t, cudaStream_t, int) {}
  template <class T>
  void recv(T*, std::size_t, index_t, cudaStream_t, int) {}
};
static_assert(!stria::device_communicator<without_wait>);

}  // namespace third_party

static_assert(stria::device_communicator<stria::comm::local_device>);
static_assert(stria::device_collectives<stria::comm::local_device>);
static_assert(!stria::device_communicator<stria::comm::host_threads>);  // host arrays, no streams
static_assert(!stria::device_collectives<stria::comm::host_threads>);
// The device backend of the ring engine.
static_assert(stria::engine::ring_backend<stria::device::detail::ring_backend<stria::comm::local_device, __nv_bfloat16>>);
#if defined(STRIA_TEST_NCCL)
static_assert(stria::device_communicator<stria::comm::nccl>);
static_assert(stria::device_communicator<stria::comm::nccl_hierarchy>);
static_assert(stria::device_collectives<stria::comm::nccl> && stria::device_collectives<stria::comm::nccl_hierarchy>);
static_assert(stria::host_collectives<stria::comm::nccl_host_surface>);
#endif

using namespace stria;
using T = __nv_bfloat16;
using attention = sparse_attention<estimator::vertical_slash_top_p, sharding::striped<64>, topology::flat_ring, tile<64, 64, 64>>;
using solver_attention = sparse_attention<estimator::vertical_slash_top_p, sharding::sequential, topology::solver, tile<64, 64, 64>>;

// The front template's members over the third-party communicator, instantiated (not run: they need a GPU).
[[maybe_unused]] constexpr auto front_estimate = &attention::estimate<third_party::recording_comm, T>;
[[maybe_unused]] constexpr auto front_forward = &attention::forward<third_party::recording_comm, T>;
[[maybe_unused]] constexpr auto front_backward = &attention::backward<third_party::recording_comm, T>;
[[maybe_unused]] constexpr auto front_solver_forward = &solver_attention::forward<third_party::recording_comm, T>;
[[maybe_unused]] constexpr auto front_solver_backward = &solver_attention::backward<third_party::recording_comm, T>;

// The paired forward is chosen per step (automatic); named for a whole ring, a step whose index is not
// complete would refuse it mid-ring, on one rank, with transfers posted: refused before any of them.
TEST_CASE("a device ring refuses forward_kernel::wgmma_paired before any CUDA call") {
  third_party::recording_comm comm;
  std::vector<device_step_index> indices(1);
  indices[0].shape = {2, 1, 1, true};
  std::vector<T> host(64 * 2 * 128);  // never read: the call throws before its first CUDA call
  std::vector<float> host_lse(2 * 64);
  const tensor_view<const T, 3> q(host.data(), {64, 2, 128}), kv(host.data(), {64, 1, 128});
  const tensor_view<T, 3> out(host.data(), {64, 2, 128});
  CHECK_THROWS_WITH_AS(device::ring_forward(comm, topology::flat_ring(1), indices, forward_tensors<T>{q, kv, kv, out, tensor_view<float, 2>(host_lse.data(), {2, 64})},
                                            0.125, {}, device::forward_kernel::wgmma_paired),
                       doctest::Contains("which = forward_kernel::wgmma_paired"), invalid_argument);
  CHECK(comm.log.empty());
}

TEST_CASE("a third-party device communicator drives the device ring: refused for another world size before any CUDA call") {
  third_party::recording_comm comm;
  comm.ranks = 2;
  const tensor_view<const T, 3> x(nullptr, {0, 0, 0});
  const tensor_view<T, 3> y(nullptr, {0, 0, 0});
  const std::string rule = "comm.world_size() = 2: must equal the topology's world size 3";
  CHECK_THROWS_WITH_AS(device::ring_forward(comm, topology::flat_ring(3), {}, forward_tensors<T>{x, x, x, y, tensor_view<float, 2>(nullptr, {0, 0})},
                                            0.125, {}),
                       doctest::Contains(rule.c_str()), invalid_argument);
  CHECK_THROWS_WITH_AS(device::ring_backward(comm, topology::flat_ring(3), {},
                                             backward_tensors<T>{x, x, x, x, x, tensor_view<const float, 2>(nullptr, {0, 0}), y, y, y}, 0.125,
                                             device::determinism::atomic, {}),
                       doctest::Contains(rule.c_str()), invalid_argument);
  CHECK(comm.log.empty());  // nothing was sent before the check
  CHECK(comm.groups == 0);
}
