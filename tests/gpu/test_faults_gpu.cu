// SPDX-License-Identifier: Apache-2.0
// Faults injected into the device ring over comm::local_device (issue 20): a rank whose stream never
// reaches its send (its transfers wait behind a gate kernel, as an NCCL peer that died or never
// posted its part leaves the receiver's kernel waiting) makes every rank raise comm_error within the
// world's timeout, through the engine's transfer confirmations (comm.wait), instead of hanging; a
// rank that throws makes the others raise at once, naming it. comm::nccl's wait() is the same path
// with ncclCommGetAsyncError and ncclCommAbort (its timeout option is checked in the host tests).
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/device/ring_attention.cuh"
#include "stria/index/local_index.cuh"
#include "stria/sharding/striped.hpp"
#include "stria/topology/flat_ring.hpp"
#include "support/random.hpp"
#include "support/selection.hpp"
#include "support/stream_gate.cuh"

using namespace stria;
using stria::test::gate;

namespace {

/// comm::local_device with a fault: from its group number `from_group` on (counting group_start
/// calls), rank `faulty`'s transfers wait behind `g` on the device (a rank whose stream never
/// reaches its send), or, with `throw_instead`, rank `faulty` throws there (a rank that fails).
struct faulty_comm {
  comm::local_device& inner;
  index_t faulty;
  int from_group;
  const gate* g;
  bool throw_instead = false;
  int groups = 0;

  [[nodiscard]] index_t rank() const { return inner.rank(); }
  [[nodiscard]] index_t world_size() const { return inner.world_size(); }
  void group_start() {
    if (rank() == faulty && groups == from_group && throw_instead) throw std::runtime_error("injected failure");
    ++groups;
    inner.group_start();
  }
  void group_end() { inner.group_end(); }
  template <class T>
  void send(const T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag) {
    if (rank() == faulty && groups > from_group) g->hold(stream);
    inner.send(data, count, peer, stream, tag);
  }
  template <class T>
  void recv(T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag) {
    inner.recv(data, count, peer, stream, tag);
  }
  void wait(cudaEvent_t done, const std::string& what) { inner.wait(done, what); }
};

/// The device ring forward and backward of a small VS problem on 4 ranks through faulty_comm (rank
/// 1 faulty from its third group on: forward ring step 2); `errors` gets each rank's error message
/// ("" if it returned), and the world's error is rethrown.
void run_faulty_ring(const gate& g, bool throw_instead, std::chrono::milliseconds timeout, std::vector<std::string>& errors) {
  using T = __nv_bfloat16;
  STRIA_SEEDED_RNG(rng);
  const index_t world = 4, seq_len = 2048, hq = 4, hkv = 2, dim = 64, local = seq_len / world;
  const global_selection selection = test::random_selection(rng, seq_len, hq, true, 0.3, 0.02);
  const topology::flat_ring ring(world);
  errors.assign(world, "");
  std::mutex mutex;
  comm::local_device_world ranks(world, 0, timeout);
  ranks.run([&](comm::local_device& c) {
    faulty_comm f{c, 1, 2, &g, throw_instead};
    const cuda_stream compute, transfer;
    const cudaStream_t st = compute.get();
    try {
      device_buffer<T> q(std::size_t(local) * hq * dim, st), k(std::size_t(local) * hkv * dim, st), v(k.size(), st), out(q.size(), st),
          dq(q.size(), st), dk(k.size(), st), dv(k.size(), st);
      device_buffer<float> lse(std::size_t(hq) * local, st);
      for (auto* b : {&q, &k, &v, &out}) b->fill_bytes(0x3c, st);  // bf16 0x3c3c: about 0.0115, finite
      const device_selection on_device(selection, st);
      const std::vector<device_step_index> indices = build_ring_indices_device(on_device, sharding::striped<64>{}, ring, c.rank(), st);
      const std::span<const device_step_index> steps(indices);
      const auto in = [&](const device_buffer<T>& b, index_t heads) { return tensor_view<const T, 3>(b.data(), {local, heads, dim}); };
      const auto to = [&](device_buffer<T>& b, index_t heads) { return tensor_view<T, 3>(b.data(), {local, heads, dim}); };
      const device::run_options run{st, transfer.get()};
      device::ring_forward(f, ring, steps, forward_tensors<T>{in(q, hq), in(k, hkv), in(v, hkv), to(out, hq), tensor_view<float, 2>(lse.data(), {hq, local})},
                           0.125, run);
      device::ring_backward(f, ring, steps,
                            backward_tensors<T>{in(q, hq), in(k, hkv), in(v, hkv), in(out, hq), in(out, hq),
                                                tensor_view<const float, 2>(lse.data(), {hq, local}), to(dq, hq), to(dk, hkv), to(dv, hkv)},
                            0.125, device::determinism::atomic, run);
    } catch (const std::exception& e) {
      const std::lock_guard lock(mutex);
      errors[static_cast<std::size_t>(c.rank())] = e.what();
      throw;
    }
  });
}

}  // namespace

TEST_CASE("local_device fault: a rank whose stream never reaches its send makes every rank raise within the timeout, not hang") {
  using clock = std::chrono::steady_clock;
  gate g;
  std::vector<std::string> errors;
  const clock::time_point start = clock::now();
  // Which wait gives up first depends on timing: a rank confirming a KV transfer on its stream, or
  // a rank waiting on the host for a peer's message (the stuck rank's peers post theirs late).
  CHECK_THROWS_WITH_AS(run_faulty_ring(g, false, std::chrono::milliseconds(2000), errors), doctest::Contains("timed out after 2000 ms waiting for"),
                       comm_error);
  const double seconds = std::chrono::duration<double>(clock::now() - start).count();
  CHECK(seconds >= 2.0);
  CHECK(seconds < 30.0);  // a timeout, not a hang
  g.open();
  // Every rank raised: a rank whose wait timed out names itself and what it waited for (a KV chunk,
  // its step and peer, or a peer's message); the others stopped waiting because of it.
  int timed_out = 0;
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(errors[r]);
    CHECK(errors[r].find("waiting for") != std::string::npos);
    timed_out += errors[r].find("rank " + std::to_string(r) + " timed out after 2000 ms waiting for ") != std::string::npos;
  }
  CHECK(timed_out >= 1);
}

TEST_CASE("local_device fault: a rank that throws makes the others raise at once, naming it") {
  using clock = std::chrono::steady_clock;
  gate g;  // stays open: this rank fails on the host
  std::vector<std::string> errors;
  const clock::time_point start = clock::now();
  CHECK_THROWS_WITH_AS(run_faulty_ring(g, true, std::chrono::milliseconds(60000), errors), "injected failure", std::runtime_error);
  CHECK(std::chrono::duration<double>(clock::now() - start).count() < 10.0);  // far inside the 60 s timeout
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(errors[r]);
    if (r == 1) CHECK(errors[r] == "injected failure");
    else CHECK(errors[r].find("rank 1 failed: injected failure") != std::string::npos);
  }
}
