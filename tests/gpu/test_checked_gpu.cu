// SPDX-License-Identifier: Apache-2.0
// Checked mode on the device (issue 20), 4 ranks on the GPU over comm::local_device: a NaN put into
// one element of K, V or dO raises non_finite_error naming the rank, ring step (or solver stage),
// head and token where it first appears (the host tests' scenario, with the same messages), in the
// ring and in the dynamic solver's execution; clean inputs pass with results bit-identical to
// unchecked runs; the front template's config.check does the same with a ring and with
// topology::solver, and is off by default.
#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/finite_check.hpp"
#include "stria/device/ring_attention.cuh"
#include "stria/device/solver_attention.cuh"
#include "stria/estimator/dense.hpp"
#include "stria/index/local_index.cuh"
#include "stria/sharding/sequential.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/solver.hpp"
#include "support/checked_scenario.hpp"
#include "support/device_tensors.cuh"

using namespace stria;
using test::checked_scenario;

namespace {

using T = __nv_bfloat16;
using s = checked_scenario;

/// Every rank's bf16 shards (host copies) and what the ring wrote.
struct shards {
  std::vector<std::vector<T>> q, k, v, d_out, out, dq, dk, dv;
  std::vector<std::vector<float>> lse;
};

shards random_shards(test::seeded_rng& rng) {
  shards x;
  std::vector<float> unused;
  const std::size_t q_elems = std::size_t(s::local_tokens) * s::heads_q * s::dim, kv_elems = std::size_t(s::local_tokens) * s::heads_kv * s::dim;
  for (index_t r = 0; r < s::world; ++r) {
    x.q.push_back(test::random_values<T>(rng, q_elems, 2.0f, unused));
    x.k.push_back(test::random_values<T>(rng, kv_elems, 2.0f, unused));
    x.v.push_back(test::random_values<T>(rng, kv_elems, 1.0f, unused));
    x.d_out.push_back(test::random_values<T>(rng, q_elems, 1.0f, unused));
  }
  x.out = x.dq = std::vector<std::vector<T>>(s::world);
  x.dk = x.dv = std::vector<std::vector<T>>(s::world);
  x.lse = std::vector<std::vector<float>>(s::world);
  return x;
}

const T nan_value = from_float<T>(std::numeric_limits<float>::quiet_NaN());

/// A rank's device buffers as the ring's and the solver's forward and backward take them.
tensor_view<const T, 3> view_of(const device_buffer<T>& b, index_t heads) { return {b.data(), {s::local_tokens, heads, s::dim}}; }
tensor_view<T, 3> view_of(device_buffer<T>& b, index_t heads) { return {b.data(), {s::local_tokens, heads, s::dim}}; }
forward_tensors<T> forward_of(const device_buffer<T>& q, const device_buffer<T>& k, const device_buffer<T>& v, device_buffer<T>& out,
                              device_buffer<float>& lse) {
  return {view_of(q, s::heads_q), view_of(k, s::heads_kv), view_of(v, s::heads_kv), view_of(out, s::heads_q),
          tensor_view<float, 2>(lse.data(), {s::heads_q, s::local_tokens})};
}
backward_tensors<T> backward_of(const device_buffer<T>& q, const device_buffer<T>& k, const device_buffer<T>& v, const device_buffer<T>& out,
                                const device_buffer<T>& d_out, const device_buffer<float>& lse, device_buffer<T>& dq, device_buffer<T>& dk,
                                device_buffer<T>& dv) {
  return {view_of(q, s::heads_q),
          view_of(k, s::heads_kv),
          view_of(v, s::heads_kv),
          view_of(out, s::heads_q),
          view_of(d_out, s::heads_q),
          tensor_view<const float, 2>(lse.data(), {s::heads_q, s::local_tokens}),
          view_of(dq, s::heads_q),
          view_of(dk, s::heads_kv),
          view_of(dv, s::heads_kv)};
}

/// The device ring's forward (the backward too, on the forward's results, if asked) on 4 ranks
/// sharing the GPU; `deterministic` picks the backward's order (atomic otherwise).
void run_ring(shards& x, finite_check check, bool backward, bool deterministic = false) {
  const global_selection selection = s::selection();
  const topology::flat_ring ring(s::world);
  comm::local_device_world ranks(s::world, 0, std::chrono::seconds(60));
  ranks.run([&](comm::local_device& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const cuda_stream compute, transfer;
    const cudaStream_t st = compute.get();
    {
      const auto up = [&](const std::vector<T>& h) { return device_buffer<T>(std::span<const T>(h), st); };
      const device_buffer<T> q = up(x.q[r]), k = up(x.k[r]), v = up(x.v[r]), d_out = up(x.d_out[r]);
      device_buffer<T> out(q.size(), st), dq(q.size(), st), dk(k.size(), st), dv(v.size(), st);
      device_buffer<float> lse(std::size_t(s::heads_q) * s::local_tokens, st);
      const device_selection on_device(selection, st);
      const std::vector<device_step_index> indices = build_ring_indices_device(on_device, sharding::sequential{}, ring, c.rank(), st);
      const device::run_options run{st, transfer.get(), check};
      device::ring_forward(c, ring, std::span<const device_step_index>(indices), forward_of(q, k, v, out, lse), 0.125, run);
      if (backward)
        device::ring_backward(c, ring, std::span<const device_step_index>(indices), backward_of(q, k, v, out, d_out, lse, dq, dk, dv), 0.125,
                              deterministic ? device::determinism::deterministic : device::determinism::atomic, run);
      x.out[r] = out.download(st);
      x.lse[r] = lse.download(st);
      if (backward) {
        x.dq[r] = dq.download(st);
        x.dk[r] = dk.download(st);
        x.dv[r] = dv.download(st);
      }
    }
  });
}

/// The device solver execution of `plan` (the backward too, on the forward's results, if asked) on
/// the scenario's 4 ranks sharing the GPU.
void run_solver(shards& x, const solver::plan& plan, finite_check check, bool backward, bool deterministic = false) {
  const global_selection selection = s::selection();
  const solver::problem p = s::solver_problem();
  comm::local_device_world ranks(s::world, 0, std::chrono::seconds(60));
  ranks.run([&](comm::local_device& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const cuda_stream compute, transfer;
    const cudaStream_t st = compute.get();
    {
      const auto up = [&](const std::vector<T>& h) { return device_buffer<T>(std::span<const T>(h), st); };
      const device_buffer<T> q = up(x.q[r]), k = up(x.k[r]), v = up(x.v[r]), d_out = up(x.d_out[r]);
      device_buffer<T> out(q.size(), st), dq(q.size(), st), dk(k.size(), st), dv(v.size(), st);
      device_buffer<float> lse(std::size_t(s::heads_q) * s::local_tokens, st);
      const device_selection on_device(selection, st);
      const device::solver_task_indices indices = device::build_solver_indices(on_device, p, plan, c.rank(), st);
      const device::run_options run{st, transfer.get(), check};
      device::solver_forward(c, p, plan, indices, forward_of(q, k, v, out, lse), 0.125, run);
      if (backward)
        device::solver_backward(c, p, plan, indices, backward_of(q, k, v, out, d_out, lse, dq, dk, dv), 0.125,
                                deterministic ? device::determinism::deterministic : device::determinism::atomic, run);
      x.out[r] = out.download(st);
      x.lse[r] = lse.download(st);
      if (backward) {
        x.dq[r] = dq.download(st);
        x.dk[r] = dk.download(st);
        x.dv[r] = dv.download(st);
      }
    }
  });
}

std::string message(const std::string& where) { return "stria: checked mode: " + where + " (the first non-finite value of this step's result)"; }

/// Rank r's output at (local token, head, d = 7).
T out_element(const shards& x, std::size_t r, index_t token, index_t head) { return x.out[r][s::element(token, head, s::heads_q)]; }

bool same_bits(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::size_t i = 0; i < a[r].size(); ++i)
      if (__bfloat16_as_ushort(a[r][i]) != __bfloat16_as_ushort(b[r][i])) return false;
  return true;
}

}  // namespace

TEST_CASE("checked mode, device ring over local_device: a NaN in K or V is named where it first appears (rank, step, head, token)") {
  STRIA_SEEDED_RNG(rng);
  const std::string expected =
      "stria: checked mode: rank 2, ring step 1, head 3, local token 64: O is NaN (the first non-finite value of this step's result)";
  for (const bool in_values : {false, true}) {
    CAPTURE(in_values);
    shards x = random_shards(rng);
    (in_values ? x.v : x.k)[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
    CHECK_THROWS_WITH_AS(run_ring(x, finite_check::every_step, false), expected.c_str(), non_finite_error);
  }
}

TEST_CASE("checked mode, device ring over local_device: a NaN in dO is named in dQ at the step it is first used") {
  STRIA_SEEDED_RNG(rng);
  shards x = random_shards(rng);
  x.d_out[s::d_out_rank][s::element(s::d_out_token, s::d_out_head, s::heads_q)] = nan_value;
  for (const bool deterministic : {false, true}) {
    CAPTURE(deterministic);
    CHECK_THROWS_WITH_AS(run_ring(x, finite_check::every_step, true, deterministic),
                         "stria: checked mode: rank 2, ring step 1, head 3, local token 70: dQ is NaN (the first non-finite value of this step's result)",
                         non_finite_error);
  }
}

TEST_CASE("checked mode, device ring over local_device: clean inputs pass, results bit-identical to unchecked runs, LSE -inf legal") {
  STRIA_SEEDED_RNG(rng);
  shards checked = random_shards(rng);
  shards unchecked = checked;
  REQUIRE_NOTHROW(run_ring(checked, finite_check::every_step, true, true));
  run_ring(unchecked, finite_check::off, true, true);
  for (const auto& lse : checked.lse) CHECK(lse[2 * s::local_tokens] == -std::numeric_limits<float>::infinity());  // head 2: empty rows
  CHECK(checked.lse == unchecked.lse);
  CHECK(same_bits(checked.out, unchecked.out));
  CHECK(same_bits(checked.dq, unchecked.dq));
  CHECK(same_bits(checked.dk, unchecked.dk));
  CHECK(same_bits(checked.dv, unchecked.dv));
}

TEST_CASE("checked mode through sparse_attention: config.check names the NaN; off by default it passes silently") {
  STRIA_SEEDED_RNG(rng);
  using attention = sparse_attention<estimator::dense, sharding::sequential, topology::flat_ring, tile<64, 64, 64>>;
  shards x = random_shards(rng);
  x.k[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
  std::vector<std::vector<T>> out(s::world);
  const auto run = [&](attention_config config) {
    comm::local_device_world ranks(s::world, 0, std::chrono::seconds(60));
    ranks.run([&](comm::local_device& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      const cuda_stream stream;
      const cudaStream_t st = stream.get();
      {
        attention layer({}, {}, topology::flat_ring(s::world), config);
        const auto up = [&](const std::vector<T>& h) { return device_buffer<T>(std::span<const T>(h), st); };
        const device_buffer<T> q = up(x.q[r]), k = up(x.k[r]), v = up(x.v[r]);
        device_buffer<T> o(q.size(), st);
        device_buffer<float> lse(std::size_t(s::heads_q) * s::local_tokens, st);
        layer.use_selection(c, s::selection(), st);
        layer.forward(c, view_of(q, s::heads_q), view_of(k, s::heads_kv), view_of(v, s::heads_kv), view_of(o, s::heads_q),
                      tensor_view<float, 2>(lse.data(), {s::heads_q, s::local_tokens}), st);
        out[r] = o.download(st);
      }
    });
  };
  attention_config config{s::seq_len, s::heads_q, s::heads_kv, false};
  CHECK(config.check == finite_check::off);
  REQUIRE_NOTHROW(run(config));
  CHECK(std::isnan(to_float(out[2][s::element(64, 3, s::heads_q) + 7])));  // rank 2's head 3, local token 64: NaN, unreported
  config.check = finite_check::every_step;
  CHECK_THROWS_WITH_AS(run(config),
                       "stria: checked mode: rank 2, ring step 1, head 3, local token 64: O is NaN (the first non-finite value of this step's result)",
                       non_finite_error);
}

TEST_CASE("checked mode, device solver over local_device: a NaN in K or V is named on the rank that computes with it, at stage 1") {
  STRIA_SEEDED_RNG(rng);
  // Only task (5, 2) reads rank 1's KV chunk 2 through KV head 1; each plan runs it elsewhere.
  const std::pair<test::placement, std::string> cases[] = {
      {test::placement::kv_moves, message("rank 2, solver stage 1, head 3, local token 64: O is NaN")},
      {test::placement::query_moves, message("rank 1, solver stage 1, head 3, local token 64 of rank 2: O is NaN")},
      {test::placement::third_rank, message("rank 0, solver stage 1, head 3, local token 64 of rank 2: O is NaN")},
  };
  for (const auto& [how, expected] : cases)
    for (const bool in_values : {false, true}) {
      const std::string plan_name = test::name_of(how);
      CAPTURE(plan_name);
      CAPTURE(in_values);
      shards x = random_shards(rng);
      (in_values ? x.v : x.k)[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
      CHECK_THROWS_WITH_AS(run_solver(x, test::hand_plan(s::solver_problem(), how), finite_check::every_step, false), expected.c_str(),
                           non_finite_error);
    }
}

TEST_CASE("checked mode, device solver over local_device: a NaN in Q is named at stage 0; in dO, in dQ or the dK it reaches first") {
  STRIA_SEEDED_RNG(rng);
  shards x = random_shards(rng);
  x.q[1][s::element(5, 0, s::heads_q)] = nan_value;  // rank 1's chunk 2, a local task's query
  CHECK_THROWS_WITH_AS(run_solver(x, test::hand_plan(s::solver_problem(), test::placement::kv_moves), finite_check::every_step, false),
                       message("rank 1, solver stage 0, head 0, local token 5: O is NaN").c_str(), non_finite_error);
  const std::pair<test::placement, std::string> cases[] = {
      {test::placement::kv_moves, message("rank 2, solver stage 1, head 3, local token 70: dQ is NaN")},
      {test::placement::query_moves, message("rank 1, solver stage 1, KV head 1, local token 0: dK is NaN")},
      {test::placement::third_rank, message("rank 0, solver stage 1, head 3, local token 70 of rank 2: dQ is NaN")},
  };
  for (const auto& [how, expected] : cases)
    for (const bool deterministic : {false, true}) {
      const std::string plan_name = test::name_of(how);
      CAPTURE(plan_name);
      CAPTURE(deterministic);
      shards y = random_shards(rng);
      y.d_out[s::d_out_rank][s::element(s::d_out_token, s::d_out_head, s::heads_q)] = nan_value;
      CHECK_THROWS_WITH_AS(run_solver(y, test::hand_plan(s::solver_problem(), how), finite_check::every_step, true, deterministic),
                           expected.c_str(), non_finite_error);
    }
}

TEST_CASE("checked mode, device solver over local_device: clean inputs pass, results bit-identical to unchecked runs, LSE -inf legal") {
  STRIA_SEEDED_RNG(rng);
  const solver::problem p = s::solver_problem();
  for (const auto& [name, plan] : {std::pair{"solve()", solver::solve(p)}, std::pair{"query moves", test::hand_plan(p, test::placement::query_moves)},
                                   std::pair{"third rank", test::hand_plan(p, test::placement::third_rank)}}) {
    CAPTURE(name);
    shards checked = random_shards(rng);
    shards unchecked = checked;
    REQUIRE_NOTHROW(run_solver(checked, plan, finite_check::every_step, true, true));
    run_solver(unchecked, plan, finite_check::off, true, true);
    for (const auto& lse : checked.lse) CHECK(lse[2 * s::local_tokens] == -std::numeric_limits<float>::infinity());  // head 2: empty rows
    CHECK(checked.lse == unchecked.lse);
    CHECK(same_bits(checked.out, unchecked.out));
    CHECK(same_bits(checked.dq, unchecked.dq));
    CHECK(same_bits(checked.dk, unchecked.dk));
    CHECK(same_bits(checked.dv, unchecked.dv));
  }
}

TEST_CASE("checked mode through sparse_attention with topology::solver: config.check names the NaN; off by default it passes silently") {
  STRIA_SEEDED_RNG(rng);
  using attention = sparse_attention<estimator::dense, sharding::sequential, topology::solver, tile<64, 64, 64>>;
  // solve() puts task (5, 2) on rank 2 (KV chunk 2 moves there): the host test asserts it.
  REQUIRE(test::rank_of_task(solver::solve(s::solver_problem()), 5, 2) == 2);
  const auto run = [&](shards& x, attention_config config, bool backward) {
    comm::local_device_world ranks(s::world, 0, std::chrono::seconds(60));
    ranks.run([&](comm::local_device& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      const cuda_stream stream;
      const cudaStream_t st = stream.get();
      {
        attention layer({}, {}, topology::solver(s::world, s::solver_chunks_per_rank), config);
        const auto up = [&](const std::vector<T>& h) { return device_buffer<T>(std::span<const T>(h), st); };
        const device_buffer<T> q = up(x.q[r]), k = up(x.k[r]), v = up(x.v[r]), d_out = up(x.d_out[r]);
        device_buffer<T> o(q.size(), st), dq(q.size(), st), dk(k.size(), st), dv(v.size(), st);
        device_buffer<float> lse(std::size_t(s::heads_q) * s::local_tokens, st);
        layer.use_selection(c, s::selection(), st);
        layer.forward(c, view_of(q, s::heads_q), view_of(k, s::heads_kv), view_of(v, s::heads_kv), view_of(o, s::heads_q),
                      tensor_view<float, 2>(lse.data(), {s::heads_q, s::local_tokens}), st);
        if (backward)
          layer.backward(c, view_of(q, s::heads_q), view_of(k, s::heads_kv), view_of(v, s::heads_kv), view_of(std::as_const(o), s::heads_q),
                         view_of(d_out, s::heads_q), tensor_view<const float, 2>(lse.data(), {s::heads_q, s::local_tokens}), view_of(dq, s::heads_q),
                         view_of(dk, s::heads_kv), view_of(dv, s::heads_kv), st);
        x.out[r] = o.download(st);
        if (backward) x.dq[r] = dq.download(st);
      }
    });
  };
  shards x = random_shards(rng);
  x.k[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
  attention_config config{s::seq_len, s::heads_q, s::heads_kv, false};
  CHECK(config.check == finite_check::off);
  REQUIRE_NOTHROW(run(x, config, false));
  CHECK(std::isnan(to_float(out_element(x, 2, 64, 3))));  // rank 2's head 3, local token 64: NaN, unreported
  config.check = finite_check::every_step;
  CHECK_THROWS_WITH_AS(run(x, config, false), message("rank 2, solver stage 1, head 3, local token 64: O is NaN").c_str(), non_finite_error);

  shards y = random_shards(rng);
  y.d_out[s::d_out_rank][s::element(s::d_out_token, s::d_out_head, s::heads_q)] = nan_value;
  config.check = finite_check::off;
  REQUIRE_NOTHROW(run(y, config, true));
  CHECK(std::isnan(to_float(y.dq[2][s::element(70, 3, s::heads_q)])));  // rank 2's dQ, head 3, local token 70 (d = 7)
  config.check = finite_check::every_step;
  CHECK_THROWS_WITH_AS(run(y, config, true), message("rank 2, solver stage 1, head 3, local token 70: dQ is NaN").c_str(), non_finite_error);
}
