// SPDX-License-Identifier: Apache-2.0
// comm::nccl on every GPU of the machine (one thread per GPU, communicators from ncclCommInitAll):
// its collectives, its host-array surface, split(), and the device ring and the front template over
// it (hierarchical rings also with their links on split communicators, comm::nccl_hierarchy), for
// every sharding x topology that fits the GPU count, and a dynamic solver plan, against the double
// reference.
#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <numeric>
#include <string>
#include <vector>

#include "stria/comm/nccl.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "support/ring_check.cuh"
#include "support/selection.hpp"

using namespace stria;
using namespace stria::test;

namespace {

index_t device_count() {
  int devices = 0;
  STRIA_CUDA_CHECK(cudaGetDeviceCount(&devices));
  return devices;
}

/// Runs body(comm) on the first `world` GPUs, one thread and NCCL rank each.
void on_gpus(index_t world, const auto& body) {
  REQUIRE(world <= device_count());
  std::vector<int> devices(static_cast<std::size_t>(world));
  std::iota(devices.begin(), devices.end(), 0);
  comm::run_on_devices(devices, [&](comm::nccl& c) { body(c); });
}

constexpr auto gpu_runner = [](index_t world, const auto& body) { on_gpus(world, body); };

/// The same GPUs with a hierarchical ring's inner and outer links on split communicators.
auto hierarchy_runner(index_t nodes, index_t cards) {
  return [nodes, cards](index_t world, const auto& body) {
    on_gpus(world, [&](comm::nccl& c) {
      comm::nccl_hierarchy links(c, nodes, cards);
      body(links);
    });
  };
}

}  // namespace

TEST_CASE("comm::nccl collectives, send/recv groups, host-array surface and split on every GPU") {
  const index_t world = device_count();
  on_gpus(world, [&](comm::nccl& c) {
    // Every wrapper was made on the main thread (ncclCommInitAll): its own stream must still live
    // on its rank's GPU.
    CHECK(c.device() == c.rank());
    int stream_device = -1;
    STRIA_CUDA_CHECK(cudaStreamGetDevice(c.own_stream(), &stream_device));
    CHECK(stream_device == c.device());
    const cuda_stream stream;
    {
      const cudaStream_t st = stream.get();
      const std::size_t n = 4096;
      std::vector<float> mine(n);
      for (std::size_t i = 0; i < n; ++i) mine[i] = float(c.rank() * 10000 + i);
      const device_buffer<float> send(std::span<const float>(mine), st);
      device_buffer<float> gathered(n * static_cast<std::size_t>(world), st), reduced(n, st), from_left(n, st);
      c.all_gather(send.data(), gathered.data(), n, st);
      c.all_reduce(send.data(), reduced.data(), n, comm::reduce_op::sum, st);
      c.group_start();
      c.send(send.data(), n, (c.rank() + 1) % world, st);
      c.recv(from_left.data(), n, (c.rank() + world - 1) % world, st);
      c.group_end();
      const std::vector<float> g = gathered.download(st), sum = reduced.download(st), left = from_left.download(st);
      const index_t left_rank = (c.rank() + world - 1) % world;
      for (std::size_t i = 0; i < n; i += 97) {
        float expected = 0;
        for (index_t r = 0; r < world; ++r) {
          CHECK(g[static_cast<std::size_t>(r) * n + i] == float(r * 10000 + i));
          expected += float(r * 10000 + i);
        }
        CHECK(sum[i] == expected);
        CHECK(left[i] == float(left_rank * 10000 + i));
      }
      // The host-array surface (what the estimator's statistics use).
      std::vector<int> value{static_cast<int>(c.rank()) + 1};
      c.host().all_reduce(value.data(), value.data(), 1, comm::reduce_op::max);
      CHECK(value[0] == world);
      // Ranks of one color form their own communicator.
      const comm::nccl half = c.split(static_cast<int>(c.rank() % 2), static_cast<int>(c.rank()));
      CHECK(half.world_size() == (world + 1 - c.rank() % 2) / 2);
      CHECK(half.rank() == c.rank() / 2);
    }
  });
}

TEST_CASE("the device ring over NCCL equals the whole-sequence reference, every sharding x topology") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = device_count();
  using T = __nv_bfloat16;
  const index_t seq_len = 64 * 2 * 8 * 6;  // zigzag and striped fit any W up to 8
  const global_problem<T> vs = make_problem<T>(rng, random_selection(rng, seq_len, 4, true, 0.15, 0.03), 2, 64);
  check_every_sharding(vs, topology::flat_ring(world), "VS, flat W" + std::to_string(world), gpu_runner);
  check_every_sharding(vs, topology::hierarchical_ring(world, 1), "VS, hierarchical " + std::to_string(world) + "x1", gpu_runner);
  // Inner and outer links on their own communicators (ncclCommSplit).
  check_every_sharding(vs, topology::hierarchical_ring(world, 1), "VS, hierarchical " + std::to_string(world) + "x1, split links",
                       hierarchy_runner(world, 1));
  check_every_sharding(vs, topology::hierarchical_ring(1, world), "VS, hierarchical 1x" + std::to_string(world) + ", split links",
                       hierarchy_runner(1, world));
  if (world % 2 == 0 && world >= 4)
    check_every_sharding(vs, topology::hierarchical_ring(2, world / 2), "VS, hierarchical 2x" + std::to_string(world / 2) + ", split links",
                         hierarchy_runner(2, world / 2));
  const global_problem<T> dense = make_problem<T>(rng, random_selection(rng, seq_len, 8, true, 1.0, 0.0), 1, 128);
  check_ring(dense, sharding::striped<64>{}, topology::flat_ring(world), "dense, flat striped", gpu_runner);
}

TEST_CASE("a dynamic solver plan over NCCL (Q and KV chunks moving between GPUs) equals the whole-sequence reference") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = device_count();
  using T = __nv_bfloat16;
  const index_t seq_len = world * 2 * 256;
  std::size_t moved = check_solver(make_problem<T>(rng, random_selection(rng, seq_len, 4, true, 0.2, 0.03), 2, 64), world, 2, "VS, m2", gpu_runner).moves.size();
  moved += check_solver(make_problem<T>(rng, document_selection(rng, seq_len, 4), 1, 128), world, 2, "causal documents, m2, D128", gpu_runner).moves.size();
  if (world > 1) CHECK(moved > 0);
}

TEST_CASE("sparse_attention over NCCL: estimate, forward and backward equal the reference on the estimated index") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = device_count();
  using top_p = estimator::vertical_slash_top_p;
  check_front_template<sparse_attention<top_p, sharding::striped<64>, topology::flat_ring, tile<64, 64, 128>>>(
      rng, topology::flat_ring(world), "striped, flat, D128", gpu_runner);
  check_front_template<sparse_attention<top_p, sharding::zigzag, topology::hierarchical_ring, tile<64, 64, 64>>>(
      rng, topology::hierarchical_ring(world, 1), "zigzag, hierarchical, split links, D64", hierarchy_runner(world, 1));
  check_front_template<sparse_attention<top_p, sharding::sequential, topology::solver, tile<64, 64, 128>>>(
      rng, topology::solver(world, 2), "sequential, solver m2, D128", gpu_runner);
}

TEST_CASE("a tensor on another GPU is refused with the devices named") {
  if (device_count() < 2) return;  // --one-gpu
  using T = __nv_bfloat16;
  STRIA_CUDA_CHECK(cudaSetDevice(1));
  const device_buffer<T> q_other(std::size_t(64) * 2 * 64);
  STRIA_CUDA_CHECK(cudaSetDevice(0));
  const device_buffer<T> k(std::size_t(64) * 1 * 64), v(k.size());
  device_buffer<float> out(q_other.size()), lse(std::size_t(2) * 64);
  seeded_rng rng;
  const global_selection g = random_selection(rng, 64, 2, true, 1.0, 0.0);
  const device_step_index index = upload_step_index(build_local_index(g, sharding::sequential{}, 1, 0, 0, {}), nullptr);
  CHECK_THROWS_WITH_AS(device::sparse_forward<T>(index,
                                                 {.q = tensor_view<const T, 3>(q_other.data(), {64, 2, 64}),
                                                  .k = tensor_view<const T, 3>(k.data(), {64, 1, 64}),
                                                  .v = tensor_view<const T, 3>(v.data(), {64, 1, 64}),
                                                  .out = tensor_view<float, 3>(out.data(), {64, 2, 64}),
                                                  .lse = tensor_view<float, 2>(lse.data(), {2, 64})},
                                                 0.125, nullptr, {.state = device::running_state::overwrite}),
                       doctest::Contains("is memory of device 1, but the kernels run on the current device 0"), stria::invalid_argument);
}
