// SPDX-License-Identifier: Apache-2.0
// The NCCL bootstrap over MPI, run by mpiexec with two or more processes on one host (no GPU
// needed): every process receives the root's unique id, two bootstraps differ, the local rank
// counts this host's processes, and a root outside the communicator is refused by name.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "stria/comm/nccl_mpi.cuh"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int failures = 0;
  const auto expect = [&](bool holds, const char* what) {
    if (holds) return;
    std::fprintf(stderr, "process %d: %s\n", rank, what);
    ++failures;
  };
  try {
    expect(size >= 2, "run this test with at least two processes");
    constexpr int bytes = static_cast<int>(sizeof(ncclUniqueId));
    const ncclUniqueId first = stria::comm::unique_id_through_mpi(MPI_COMM_WORLD);
    std::vector<char> everyone(static_cast<std::size_t>(bytes) * static_cast<std::size_t>(size));
    MPI_Allgather(&first, bytes, MPI_BYTE, everyone.data(), bytes, MPI_BYTE, MPI_COMM_WORLD);
    for (int r = 0; r < size; ++r)
      expect(std::memcmp(everyone.data() + static_cast<std::size_t>(r) * bytes, everyone.data(), bytes) == 0,
             "a process received another unique id than process 0");
    const ncclUniqueId second = stria::comm::unique_id_through_mpi(MPI_COMM_WORLD, size - 1);
    expect(std::memcmp(&first, &second, bytes) != 0, "two bootstraps gave the same unique id");
    expect(stria::comm::mpi_local_rank(MPI_COMM_WORLD) == rank, "the local rank on a single host differs from the rank");
    try {
      (void)stria::comm::unique_id_through_mpi(MPI_COMM_WORLD, size);
      expect(false, "a root outside the communicator was accepted");
    } catch (const stria::invalid_argument& e) {
      expect(std::strstr(e.what(), "root") != nullptr && std::strstr(e.what(), "must be a process of the MPI communicator") != nullptr,
             "the refused root's message does not name the argument and the rule");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "process %d: %s\n", rank, e.what());
    ++failures;
  }
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf(total == 0 ? "ok: %d processes share one NCCL unique id\n" : "FAILED on %d processes\n", total == 0 ? size : total);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
