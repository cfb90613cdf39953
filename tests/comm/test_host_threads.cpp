// SPDX-License-Identifier: Apache-2.0
// comm::host_threads: point-to-point and collectives are correct and deterministic; disagreeing
// ranks, a failing rank, a missing peer and an unreceived message are errors, never hangs.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "stria/comm/host_threads.hpp"

using namespace stria;
using namespace std::chrono_literals;
using comm::host_threads;
using comm::host_world;

TEST_CASE("a grouped ring exchange moves every rank's data to its successor") {
  for (index_t w : {1, 2, 3, 5, 8}) {
    host_world world(w, 10s);
    world.run([&](host_threads& c) {
      std::vector<int> mine(100), got(100, -1);
      std::iota(mine.begin(), mine.end(), 1000 * c.rank());
      c.group_start();
      c.send(mine.data(), mine.size(), (c.rank() + 1) % w);
      c.recv(got.data(), got.size(), (c.rank() + w - 1) % w);
      c.group_end();
      const index_t from = (c.rank() + w - 1) % w;
      for (int i = 0; i < 100; ++i) REQUIRE(got[static_cast<std::size_t>(i)] == 1000 * from + i);
    });
  }
}

TEST_CASE("messages match in order per tag") {
  host_world world(2, 10s);
  world.run([](host_threads& c) {
    if (c.rank() == 0) {
      const float a = 1, b = 2, z = 3;
      c.send(&a, 1, 1, 0);
      c.send(&b, 1, 1, 0);
      c.send(&z, 1, 1, 7);
    } else {
      float x = 0, y = 0, z = 0;
      c.recv(&z, 1, 0, 7);  // a different tag is its own queue
      c.recv(&x, 1, 0, 0);
      c.recv(&y, 1, 0, 0);
      REQUIRE(x == 1);
      REQUIRE(y == 2);
      REQUIRE(z == 3);
    }
  });
}

TEST_CASE("collectives: all_gather, all_reduce in rank order, broadcast, repeated barriers") {
  const index_t w = 6;
  host_world world(w, 10s);
  world.run([&](host_threads& c) {
    for (int round = 0; round < 20; ++round) {
      std::vector<double> mine{double(c.rank()), 0.1 * c.rank() + round}, all(2 * w);
      c.all_gather(mine.data(), all.data(), 2);
      for (index_t r = 0; r < w; ++r) REQUIRE(all[static_cast<std::size_t>(2 * r + 1)] == 0.1 * r + round);
      std::vector<float> x{0.1f * float(c.rank() + 1), -float(c.rank())}, sum(2), top(2);
      c.all_reduce(x.data(), sum.data(), 2, comm::reduce_op::sum);
      c.all_reduce(x.data(), top.data(), 2, comm::reduce_op::max);
      float expected = 0;
      for (index_t r = 0; r < w; ++r) expected += 0.1f * float(r + 1);  // the same order: bit-identical
      REQUIRE(sum[0] == expected);
      REQUIRE(top[1] == 0.0f);
      int value = c.rank() == 4 ? 42 : -1;
      c.broadcast(&value, 1, 4);
      REQUIRE(value == 42);
      c.barrier();
    }
  });
}

TEST_CASE("ranks that call different collectives get a comm_error naming both calls") {
  host_world world(3, 10s);
  CHECK_THROWS_WITH_AS(world.run([](host_threads& c) {
                         std::vector<float> x(4), y(12);
                         if (c.rank() == 2) c.all_reduce(x.data(), x.data(), 4, comm::reduce_op::sum);
                         else c.all_gather(x.data(), y.data(), 4);
                       }),
                       doctest::Contains("collective mismatch"), stria::comm_error);
  host_world counts(2, 10s);
  CHECK_THROWS_WITH_AS(counts.run([](host_threads& c) {
                         std::vector<float> x(8);
                         c.all_reduce(x.data(), x.data(), c.rank() == 0 ? 8 : 4, comm::reduce_op::sum);
                       }),
                       doctest::Contains("all_reduce(8 x float)"), stria::comm_error);
}

TEST_CASE("receives with no matching send time out with a clear error instead of hanging") {
  host_world world(2, 200ms);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run([](host_threads& c) {
                         int x = 0;
                         c.recv(&x, 1, 1 - c.rank());  // each waits for the other: a deadlock the timeout ends
                       }),
                       doctest::Contains("timed out after 200 ms waiting for a message from rank"), stria::comm_error);
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("a rank that returns while a peer waits for its message fails that wait at once, naming it") {
  host_world world(2, 300s);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run([](host_threads& c) {
                         if (c.rank() == 1) {
                           int x = 0;
                           c.recv(&x, 1, 0, 5);
                         }
                       }),
                       "stria: rank 1 waits for a message from rank 0 (tag 5), but rank 0 has returned without posting it", stria::comm_error);
  CHECK(std::chrono::steady_clock::now() - start < 1s);
}

TEST_CASE("a rank that returns before a collective fails the others' wait at once, naming it") {
  host_world world(4, 300s);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run([](host_threads& c) {
                         if (c.rank() != 2) c.barrier();
                       }),
                       doctest::Contains("but rank 2 has returned without posting it"), stria::comm_error);
  CHECK(std::chrono::steady_clock::now() - start < 1s);
}

TEST_CASE("a failure does not outlive its run, the timeout must be positive") {
  host_world world(3, 30s);
  CHECK_THROWS_AS(world.run([](host_threads& c) {
                    if (c.rank() == 0) throw std::runtime_error("first run fails");
                    c.barrier();
                  }),
                  std::runtime_error);
  std::vector<int> sums(3);
  world.run([&](host_threads& c) {  // the same world again: runs as if new
    const int mine = c.rank() + 1;
    c.all_reduce(&mine, &sums[static_cast<std::size_t>(c.rank())], 1, comm::reduce_op::sum);
  });
  CHECK(sums == std::vector<int>{6, 6, 6});
  CHECK_THROWS_WITH_AS(host_world(2, 0ms), "stria: timeout (ms) = 0: must be positive", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(host_world(2, -5ms), "stria: timeout (ms) = -5: must be positive", stria::invalid_argument);
  // Unbounded, host_world(2^30) asked for per-rank tables of 80 GB (std::bad_alloc, no stria message).
  CHECK_THROWS_WITH_AS(host_world(1 << 30), "stria: world_size = 1073741824: must be at most 65536 ranks (a thread each)", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(host_world(0), "stria: world_size = 0: must be at least 1", stria::invalid_argument);
}

TEST_CASE("a receive of the wrong size or type is an error naming both sides") {
  host_world world(2, 10s);
  CHECK_THROWS_WITH_AS(world.run([](host_threads& c) {
                         std::vector<float> x(10);
                         if (c.rank() == 0) c.send(x.data(), 10, 1);
                         else c.recv(x.data(), 8, 0);
                       }),
                       "stria: rank 1 expected 8 x float from rank 0 but rank 0 sent 10 x float", stria::comm_error);
}

TEST_CASE("a failing rank releases the others and its own exception is rethrown") {
  host_world world(4, 30s);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run([](host_threads& c) {
                         if (c.rank() == 3) throw std::runtime_error("rank 3's own failure");
                         c.barrier();  // the others would wait for rank 3 forever
                       }),
                       "rank 3's own failure", std::runtime_error);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

TEST_CASE("a message never received is reported, not lost") {
  host_world world(2, 10s);
  CHECK_THROWS_WITH_AS(world.run([](host_threads& c) {
                         const int x = 1;
                         if (c.rank() == 0) c.send(&x, 1, 1, 3);
                       }),
                       "stria: rank 0 sent 1 message(s) to rank 1 (tag 3) that were never received", stria::comm_error);
}

TEST_CASE("waits outside the communicator: check_peers raises once a rank failed, fail() stops every rank's waits") {
  host_world world(3, 20s);
  std::vector<std::string> errors(3);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run([&](host_threads& c) {
    CHECK(c.timeout() == 20s);
    CHECK_NOTHROW(c.check_peers("device work"));
    // Ranks 0 and 1 report in before rank 2 fails, so their first check ran on a healthy world. (A
    // barrier here raced: a rank still leaving it when rank 2 failed raised from the barrier.)
    const int ready = 1;
    if (c.rank() == 2) {
      int got = 0;
      for (const index_t peer : {0, 1}) c.recv(&got, 1, peer, 1);
      throw c.fail("rank 2 gave up on its device work");
    }
    c.send(&ready, 1, 2, 1);
    try {
      int x = 0;
      c.recv(&x, 1, 2);  // never sent: released by rank 2's failure, not by the timeout
    } catch (const comm_error& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
    CHECK_THROWS_WITH_AS(c.check_peers("device work"), doctest::Contains("stopped waiting for device work: rank 2 gave up on its device work"),
                         comm_error);
  }),
                       "stria: rank 2 gave up on its device work", comm_error);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  for (const std::size_t r : {0u, 1u}) {
    CAPTURE(errors[r]);
    CHECK(errors[r].find("stopped waiting for a message from rank 2 (tag 0): rank 2 gave up") != std::string::npos);
  }
}
