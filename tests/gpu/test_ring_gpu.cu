// SPDX-License-Identifier: Apache-2.0
// The device ring over comm::local_device (W ranks sharing the GPU): forward and backward, for every
// sharding x topology (flat rings of 1-8 ranks, hierarchical 2x2, 2x4 and 3x1), equal the double
// host reference of the whole sequence on the same global selection; so does the front template,
// estimating its own index, and a dynamic solver plan (Q and KV chunks moving); and local_device's
// collectives.
#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <chrono>
#include <string>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "stria/topology/solver.hpp"
#include "support/ring_check.cuh"
#include "support/selection.hpp"

using namespace stria;
using namespace stria::test;

namespace {

/// W ranks on the one GPU.
void on_local_device(index_t world, const auto& body) {
  comm::local_device_world ranks(world, 0, std::chrono::seconds(120));
  ranks.run([&](comm::local_device& c) { body(c); });
}

constexpr auto local_device_runner = [](index_t world, const auto& body) { on_local_device(world, body); };

/// Writes `value` to x[0, n) after about `delay_ns` nanoseconds: a stream that runs behind its peers.
__global__ void fill_after_delay(float* x, std::size_t n, float value, unsigned delay_ns) {
  if (threadIdx.x == 0)
    for (unsigned waited = 0; waited < delay_ns; waited += 1000) __nanosleep(1000);
  __syncthreads();
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) x[i] = value;
}

}  // namespace

TEST_CASE("the device ring over local_device equals the whole-sequence reference, every sharding x topology") {
  STRIA_SEEDED_RNG(rng);
  using T = __nv_bfloat16;
  // 3072 tokens: divisible by 2 x 64 x W for W = 1, 2, 3, 4, 8 (zigzag's rule).
  const index_t seq_len = 3072;
  struct selection_case {
    const char* name;
    double slash_density, token_density;
    index_t hq, hkv, dim;
  };
  for (const selection_case& sc : {selection_case{"VS, Hq4 Hkv2 D64", 0.15, 0.03, 4, 2, 64},
                                   selection_case{"dense, Hq8 Hkv1 D128", 1.0, 0.0, 8, 1, 128}}) {
    const global_problem<T> p = make_problem<T>(rng, random_selection(rng, seq_len, sc.hq, true, sc.slash_density, sc.token_density), sc.hkv, sc.dim);
    for (const index_t world : {1, 2, 3, 4, 8}) check_every_sharding(p, topology::flat_ring(world), std::string(sc.name) + ", flat W" + std::to_string(world), local_device_runner);
    check_every_sharding(p, topology::hierarchical_ring(2, 2), std::string(sc.name) + ", hierarchical 2x2", local_device_runner);
    check_every_sharding(p, topology::hierarchical_ring(2, 4), std::string(sc.name) + ", hierarchical 2x4", local_device_runner);
    check_every_sharding(p, topology::hierarchical_ring(3, 1), std::string(sc.name) + ", hierarchical 3x1", local_device_runner);
  }
  SUBCASE("full (non-causal) attention") {
    const global_problem<T> p = make_problem<T>(rng, random_selection(rng, seq_len, 4, false, 0.1, 0.02), 2, 64);
    check_ring(p, sharding::striped<64>{}, topology::flat_ring(4), "full, flat W4 striped", local_device_runner);
    check_ring(p, sharding::zigzag{}, topology::hierarchical_ring(2, 2), "full, hierarchical 2x2 zigzag", local_device_runner);
  }
}

TEST_CASE("sparse_attention on local_device: estimate, forward and backward equal the reference on the estimated index") {
  STRIA_SEEDED_RNG(rng);
  using top_p = estimator::vertical_slash_top_p;
  check_front_template<sparse_attention<top_p, sharding::striped<64>, topology::flat_ring, tile<64, 64, 64>>>(rng, topology::flat_ring(4),
                                                                                                            "striped, flat W4, D64", local_device_runner);
  check_front_template<sparse_attention<top_p, sharding::zigzag, topology::hierarchical_ring, tile<64, 64, 128>>>(
      rng, topology::hierarchical_ring(2, 2), "zigzag, hierarchical 2x2, D128", local_device_runner);
  // The dynamic solver in place of a ring: the plan is solved from the estimated index.
  check_front_template<sparse_attention<top_p, sharding::sequential, topology::solver, tile<64, 64, 64>>>(
      rng, topology::solver(4, 2), "sequential, solver W4 m2, D64", local_device_runner);
  SUBCASE("a communicator of another size is refused") {
    comm::local_device_world two(2, 0, std::chrono::seconds(60));
    CHECK_THROWS_WITH_AS(two.run([](comm::local_device& c) {
      sparse_attention<top_p, sharding::striped<64>, topology::flat_ring> layer({}, {}, topology::flat_ring(3), {3 * 64 * 4, 4, 2});
      layer.estimate(c, tensor_view<const __nv_bfloat16, 3>(nullptr, {0, 0, 0}), tensor_view<const __nv_bfloat16, 3>(nullptr, {0, 0, 0}), nullptr);
    }),
                         doctest::Contains("comm.world_size() = 2: must equal the topology's world size 3"), stria::invalid_argument);
  }
}

TEST_CASE("local_device collectives: all_gather, all_reduce in rank order, broadcast; mismatched sends are errors") {
  for (const index_t world : {1, 3, 4}) {
    CAPTURE(world);
    comm::local_device_world ranks(world, 0, std::chrono::seconds(60));
    ranks.run([&](comm::local_device& c) {
      const cuda_stream stream;
      {
        const cudaStream_t st = stream.get();
        const std::size_t n = 1000;
        std::vector<float> mine(n);
        for (std::size_t i = 0; i < n; ++i) mine[i] = float(c.rank() * 1000 + i) * 0.5f;
        const device_buffer<float> send(std::span<const float>(mine), st);
        device_buffer<float> gathered(n * static_cast<std::size_t>(world), st), reduced(n, st);
        c.all_gather(send.data(), gathered.data(), n, st);
        c.all_reduce(send.data(), reduced.data(), n, comm::reduce_op::sum, st);
        device_buffer<float> in_place(std::span<const float>(mine), st);
        c.all_reduce(in_place.data(), in_place.data(), n, comm::reduce_op::max, st);
        device_buffer<float> root_value(std::span<const float>(mine), st);
        c.broadcast(root_value.data(), n, world - 1, st);
        const std::vector<float> g = gathered.download(st), sum = reduced.download(st), top = in_place.download(st), b = root_value.download(st);
        for (std::size_t i = 0; i < n; ++i) {
          float expected_sum = 0;
          for (index_t r = 0; r < world; ++r) {
            CHECK(g[static_cast<std::size_t>(r) * n + i] == float(r * 1000 + i) * 0.5f);
            expected_sum += float(r * 1000 + i) * 0.5f;
          }
          CHECK(sum[i] == expected_sum);
          CHECK(top[i] == float((world - 1) * 1000 + i) * 0.5f);
          CHECK(b[i] == float((world - 1) * 1000 + i) * 0.5f);
        }
      }
    });
  }
  comm::local_device_world two(2, 0, std::chrono::seconds(60));
  CHECK_THROWS_WITH_AS(two.run([&](comm::local_device& c) {
    const cuda_stream stream;
    device_buffer<float> x(8, stream.get());
    c.group_start();
    if (c.rank() == 0) c.send(x.data(), 8, 1, stream.get());
    else c.recv(x.data(), 4, 0, stream.get());
    c.group_end();
    stream.synchronize();
  }),
                       doctest::Contains("expected 16 bytes from rank 0"), comm_error);
}

TEST_CASE("local_device collectives back to back: one rank's stream behind the others in turn, send buffers overwritten at once") {
  // Each collective meets twice on the host and records each rank's same two events again; a record
  // made before a peer queued its wait on the last one would hang the streams or let a peer read a
  // buffer that has been overwritten. The host never waits for the device until the end.
  const index_t world = 4;
  const int rounds = 200;
  const std::size_t n = 256, history = static_cast<std::size_t>(rounds);
  comm::local_device_world ranks(world, 0, std::chrono::seconds(60));
  ranks.run([&](comm::local_device& c) {
    const cuda_stream stream;
    const cudaStream_t st = stream.get();
    device_buffer<float> send(n, st), gathered(n * static_cast<std::size_t>(world), st), root_value(n, st);
    device_buffer<float> gathered_history(gathered.size() * history, st), broadcast_history(n * history, st);
    for (int round = 0; round < rounds; ++round) {
      const auto at = static_cast<std::size_t>(round);
      const bool behind = round % world == c.rank();
      fill_after_delay<<<1, 256, 0, st>>>(send.data(), n, float(round * world + c.rank()), behind ? 20000u : 0u);
      c.all_gather(send.data(), gathered.data(), n, st);
      fill_after_delay<<<1, 256, 0, st>>>(send.data(), n, -1.0f, 0u);  // the peers must have read it by now
      STRIA_CUDA_CHECK(cudaMemcpyAsync(gathered_history.data() + gathered.size() * at, gathered.data(), gathered.size() * sizeof(float),
                                       cudaMemcpyDeviceToDevice, st));
      fill_after_delay<<<1, 256, 0, st>>>(root_value.data(), n, float(-round - 2 - c.rank()), behind ? 20000u : 0u);
      c.broadcast(root_value.data(), n, round % world, st);
      STRIA_CUDA_CHECK(cudaMemcpyAsync(broadcast_history.data() + n * at, root_value.data(), n * sizeof(float), cudaMemcpyDeviceToDevice, st));
    }
    const std::vector<float> g = gathered_history.download(st), b = broadcast_history.download(st);
    std::size_t wrong = 0;
    for (int round = 0; round < rounds; ++round)
      for (std::size_t i = 0; i < n; ++i) {
        for (index_t r = 0; r < world; ++r)
          wrong += g[(static_cast<std::size_t>(round * world + r)) * n + i] != float(round * world + r);
        wrong += b[static_cast<std::size_t>(round) * n + i] != float(-round - 2 - round % world);
      }
    CHECK(wrong == 0);
  });
}

TEST_CASE("attention run as the dynamic solver plans it, over local_device, equals the whole-sequence reference") {
  STRIA_SEEDED_RNG(rng);
  using T = __nv_bfloat16;
  std::size_t moved = 0, third_rank = 0;
  bool moved_twice = false;
  const auto tally = [&](const solver::plan& plan) {
    moved += plan.moves.size();
    moved_twice = moved_twice || moves_a_chunk_twice(plan);
    third_rank += third_rank_tasks(plan);
  };
  struct solver_case {
    index_t world, chunks_per_rank, hkv, dim;
  };
  for (const solver_case& sc : {solver_case{1, 2, 2, 64}, solver_case{2, 2, 2, 64}, solver_case{3, 1, 1, 128}, solver_case{4, 2, 4, 64},
                                solver_case{5, 1, 2, 128}, solver_case{8, 1, 1, 64}, solver_case{6, 4, 1, 64}}) {
    const index_t seq_len = sc.world * sc.chunks_per_rank * 256, nb = seq_len / 64;
    const std::string where = ", W" + std::to_string(sc.world) + " m" + std::to_string(sc.chunks_per_rank) + " D" + std::to_string(sc.dim);
    tally(check_solver(make_problem<T>(rng, random_selection(rng, seq_len, 4, true, 0.2, 0.03), sc.hkv, sc.dim), sc.world, sc.chunks_per_rank,
                       "VS" + where, local_device_runner));
    tally(check_solver(make_problem<T>(rng, band_selection(seq_len, 4, 0, nb - 1, true), sc.hkv, sc.dim), sc.world, sc.chunks_per_rank,
                       "causal" + where, local_device_runner));
    tally(check_solver(make_problem<T>(rng, document_selection(rng, seq_len, 4), sc.hkv, sc.dim), sc.world, sc.chunks_per_rank,
                       "causal documents" + where, local_device_runner));
  }
  CHECK(moved > 0);     // chunks did move: the remote stages ran
  CHECK(moved_twice);   // and some chunk went to several ranks, each returning its partial results
  CHECK(third_rank > 0);  // and some tasks ran where neither chunk lives (query and KV both moved there)
}
