// SPDX-License-Identifier: Apache-2.0
// Bootstrap of comm::nccl over MPI, one process per GPU (optional: include it only where <mpi.h>
// is found and the program links MPI; stria itself never needs MPI).
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <string>

#include "stria/comm/nccl.cuh"
#include "stria/core/error.hpp"

namespace stria::comm {

namespace detail {

inline void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw comm_error(std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

}  // namespace detail

/// Process `root` of `comm` makes the NCCL unique id and every process returns it (MPI_Bcast).
/// Collective over `comm`.
inline ncclUniqueId unique_id_through_mpi(MPI_Comm comm, int root = 0) {
  int rank = 0, size = 0;
  detail::check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  detail::check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  if (root < 0 || root >= size) throw invalid_argument("root", root, "must be a process of the MPI communicator, in [0, " + std::to_string(size) + ")");
  ncclUniqueId id{};
  if (rank == root) STRIA_NCCL_CHECK(ncclGetUniqueId(&id));
  detail::check_mpi(MPI_Bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, root, comm), "MPI_Bcast of the NCCL unique id");
  return id;
}

/// This process's index among the processes of `comm` on its host: the GPU it should drive when
/// every host runs one process per GPU. Collective over `comm`.
inline int mpi_local_rank(MPI_Comm comm) {
  MPI_Comm host = MPI_COMM_NULL;
  detail::check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host), "MPI_Comm_split_type");
  int local = 0;
  const int code = MPI_Comm_rank(host, &local);
  MPI_Comm_free(&host);
  detail::check_mpi(code, "MPI_Comm_rank");
  return local;
}

/// One owned NCCL rank per process of `comm`, with MPI's rank and size, on the current device
/// (call cudaSetDevice first, e.g. with mpi_local_rank). Collective over `comm`.
inline nccl create_with_mpi(MPI_Comm comm) {
  int rank = 0, size = 0;
  detail::check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  detail::check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  return nccl::create(unique_id_through_mpi(comm), size, rank);
}

}  // namespace stria::comm
