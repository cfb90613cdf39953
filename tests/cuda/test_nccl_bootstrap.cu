// SPDX-License-Identifier: Apache-2.0
// The NCCL unique id through a shared file (one process per GPU without MPI), across two real
// processes, without a GPU: the reader waits for the writer and gets its bytes; a missing writer
// ends in a comm_error that names the rank, the wait and the path. nccl_options.timeout must be
// positive; a wait that gives up raises nccl_error with the story.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "stria/comm/nccl.cuh"

using stria::comm::nccl;

namespace {

std::string fresh_path(const char* name) {
  const auto path = std::filesystem::temp_directory_path() / (std::string(name) + "." + std::to_string(::getpid()));
  std::filesystem::remove(path);
  return path.string();
}

}  // namespace

TEST_CASE("the NCCL unique id travels through a file from rank 0 to a process that waits for it") {
  const std::string path = fresh_path("stria_nccl_id");
  int to_parent[2];
  REQUIRE(::pipe(to_parent) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // rank 1: starts first and waits for the file
    ::close(to_parent[0]);
    int status = 1;
    try {
      const ncclUniqueId id = nccl::unique_id_through_file(path, 1, std::chrono::seconds(30));
      status = ::write(to_parent[1], &id, sizeof(id)) == static_cast<ssize_t>(sizeof(id)) ? 0 : 2;
    } catch (...) {
      status = 3;
    }
    ::_exit(status);
  }
  ::close(to_parent[1]);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const ncclUniqueId written = nccl::unique_id_through_file(path, 0);
  ncclUniqueId received{};
  std::size_t got = 0;
  while (got < sizeof(received)) {
    const ssize_t n = ::read(to_parent[0], reinterpret_cast<char*>(&received) + got, sizeof(received) - got);
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(to_parent[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  REQUIRE(got == sizeof(received));
  CHECK(std::memcmp(&written, &received, sizeof(received)) == 0);
  // A second bootstrap writes a new id.
  std::filesystem::remove(path);
  const ncclUniqueId again = nccl::unique_id_through_file(path, 0);
  CHECK(std::memcmp(&again, &written, sizeof(again)) != 0);
  std::filesystem::remove(path);
}

TEST_CASE("a rank whose id file never appears gets a comm_error naming the rank, the wait and the path") {
  const std::string path = fresh_path("stria_nccl_id_missing");
  const std::string expected = "rank 3 waited 60 ms for the NCCL id file " + path;
  CHECK_THROWS_WITH_AS(nccl::unique_id_through_file(path, 3, std::chrono::milliseconds(60)), doctest::Contains(expected.c_str()), stria::comm_error);
}

TEST_CASE("nccl_options.timeout must be positive, and is refused before any NCCL call") {
  using stria::comm::nccl_options;
  CHECK(nccl_options{}.timeout == std::chrono::minutes(10));
  CHECK_NOTHROW(nccl_options{}.validate());
  for (const std::chrono::milliseconds timeout : {std::chrono::milliseconds(0), std::chrono::milliseconds(-5)}) {
    const std::string expected = "stria: nccl_options.timeout (ms) = " + std::to_string(timeout.count()) + ": must be positive";
    CHECK_THROWS_WITH_AS(nccl::wrap(nullptr, nccl_options{timeout}), expected.c_str(), stria::invalid_argument);
    CHECK_THROWS_WITH_AS(nccl::create_all({}, nccl_options{timeout}), expected.c_str(), stria::invalid_argument);
  }
}

TEST_CASE("a wait that gives up raises nccl_error with the whole story, call \"wait\" and NCCL's code") {
  const stria::nccl_error e = stria::nccl_error::stalled(6, "rank 3 waited 1.50 s for X: ncclCommGetAsyncError reported code 6 (remote error)");
  CHECK(std::string(e.what()) == "stria: NCCL: rank 3 waited 1.50 s for X: ncclCommGetAsyncError reported code 6 (remote error)");
  CHECK(e.call() == "wait");
  CHECK(e.code() == 6);
}
