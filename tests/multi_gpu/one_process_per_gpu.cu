// SPDX-License-Identifier: Apache-2.0
// One process per GPU, as a job started by a launcher (srun, torchrun, mpirun) runs: each process
// is one NCCL rank made from a unique id that travels through a shared file. The device ring
// (every sharding x flat, hierarchical with split links), a dynamic solver plan and the front
// template against the double reference; every process checks the joined result of all ranks. launch_ranks.sh starts one
// process per GPU with --rank r --world W --id-file F and the same STRIA_TEST_SEED; with fewer GPUs
// than --world a process exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "stria/comm/nccl.cuh"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "support/ring_check.cuh"
#include "support/selection.hpp"

using namespace stria;
using namespace stria::test;

namespace {

std::optional<comm::nccl> this_rank;

/// The runner of this process: its one rank.
constexpr auto process_runner = [](index_t world, const auto& body) {
  REQUIRE(world == this_rank->world_size());
  body(*this_rank);
};

/// This rank with a hierarchical ring's links on split communicators.
auto hierarchy_runner(index_t nodes, index_t cards) {
  return [nodes, cards](index_t world, const auto& body) {
    REQUIRE(world == this_rank->world_size());
    comm::nccl_hierarchy links(*this_rank, nodes, cards);
    body(links);
  };
}

}  // namespace

TEST_CASE("one process per GPU: collectives between processes") {
  comm::nccl& c = *this_rank;
  std::vector<std::int64_t> value{c.rank() + 1};
  c.host().all_reduce(value.data(), value.data(), 1, comm::reduce_op::sum);
  CHECK(value[0] == c.world_size() * (c.world_size() + 1) / 2);
  std::vector<std::int64_t> ranks(static_cast<std::size_t>(c.world_size()));
  const std::int64_t mine = c.rank();
  c.host().all_gather(&mine, ranks.data(), 1);
  for (index_t r = 0; r < c.world_size(); ++r) CHECK(ranks[static_cast<std::size_t>(r)] == r);
}

TEST_CASE("one process per GPU: the device ring over NCCL equals the whole-sequence reference") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = this_rank->world_size();
  using T = __nv_bfloat16;
  const index_t seq_len = 64 * 2 * 8 * 6;
  const global_problem<T> vs = make_problem<T>(rng, random_selection(rng, seq_len, 4, true, 0.15, 0.03), 2, 64);
  check_every_sharding(vs, topology::flat_ring(world), "VS, flat W" + std::to_string(world), process_runner);
  check_every_sharding(vs, topology::hierarchical_ring(world, 1), "VS, hierarchical " + std::to_string(world) + "x1, split links",
                       hierarchy_runner(world, 1));
  if (world % 2 == 0 && world >= 4)
    check_every_sharding(vs, topology::hierarchical_ring(2, world / 2), "VS, hierarchical 2x" + std::to_string(world / 2) + ", split links",
                         hierarchy_runner(2, world / 2));
}

TEST_CASE("one process per GPU: a dynamic solver plan equals the whole-sequence reference") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = this_rank->world_size();
  using T = __nv_bfloat16;
  check_solver(make_problem<T>(rng, random_selection(rng, world * 2 * 256, 4, true, 0.2, 0.03), 2, 64), world, 2, "VS, m2", process_runner);
}

TEST_CASE("one process per GPU: sparse_attention estimates, runs forward and backward, equal to the reference") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = this_rank->world_size();
  using top_p = estimator::vertical_slash_top_p;
  check_front_template<sparse_attention<top_p, sharding::striped<64>, topology::flat_ring, tile<64, 64, 128>>>(
      rng, topology::flat_ring(world), "striped, flat, D128", process_runner);
}

int main(int argc, char** argv) {
  int rank = -1, world = 0;
  std::string id_file;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (std::strcmp(argv[i], "--rank") == 0 && has_value) rank = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--world") == 0 && has_value) world = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--id-file") == 0 && has_value) id_file = argv[++i];
    else args.push_back(argv[i]);
  }
  if (rank < 0 || world < 1 || rank >= world || id_file.empty()) {
    std::fprintf(stderr, "usage: %s --rank R --world W --id-file PATH [doctest options] (0 <= R < W)\n", argv[0]);
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < world) {
    std::printf("rank %d: %d usable CUDA device(s), fewer than --world %d: skipping\n", rank, devices, world);
    return 77;
  }
  STRIA_CUDA_CHECK(cudaSetDevice(rank));
  this_rank.emplace(comm::nccl::create(comm::nccl::unique_id_through_file(id_file, rank), world, rank));
  one_process_per_rank = true;
  doctest::Context context(static_cast<int>(args.size()), args.data());
  const int failed = context.run();
  this_rank.reset();
  return failed;
}
