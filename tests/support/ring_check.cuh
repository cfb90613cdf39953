// SPDX-License-Identifier: Apache-2.0
// Checks of the distributed device attention against the double reference of the whole sequence,
// for any communicator: a runner `run_world(W, body)` calls body(comm) on each of W ranks (one
// thread each, on its device) with comm::local_device, comm::nccl, or another device communicator.
#pragma once

#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/device/ring_attention.cuh"
#include "stria/device/solver_attention.cuh"
#include "stria/host/reference_attention.hpp"
#include "stria/index/local_index.cuh"
#include "stria/index/local_index.hpp"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "support/device_tensors.cuh"
#include "support/oracle.hpp"

namespace stria::test {

/// Set by a program that runs one rank per process (tests/multi_gpu/one_process_per_gpu.cu): its
/// runner calls the body once, for its own rank, and share_shards hands every rank's results to
/// every process through the communicator, so each process checks the whole joined result.
inline bool one_process_per_rank = false;

/// With one process per rank, fills the other ranks' entries of `shards` (equal sizes on every rank)
/// by an all-gather of this rank's; otherwise every rank filled its own entry in this process.
template <class Comm, class V>
void share_shards(Comm& c, std::vector<std::vector<V>>& shards) {
  if (!one_process_per_rank) return;
  const auto mine = static_cast<std::size_t>(c.rank());
  const std::size_t n = shards[mine].size();
  std::vector<V> everyone(n * shards.size());
  c.host().all_gather(shards[mine].data(), everyone.data(), n);
  for (std::size_t r = 0; r < shards.size(); ++r)
    shards[r].assign(everyone.begin() + static_cast<std::ptrdiff_t>(r * n), everyone.begin() + static_cast<std::ptrdiff_t>((r + 1) * n));
}

/// One global problem: inputs rounded to T, and the double reference of the whole sequence.
template <class T>
struct global_problem {
  index_t seq_len = 0, hq = 0, hkv = 0, dim = 0;
  double scale = 0;
  global_selection selection;
  std::vector<T> q, k, v, d_out, out_rounded;  // the backward gets the reference output rounded to T
  std::vector<float> lse;
  std::vector<double> out_ref, lse_ref, dq_ref, dk_ref, dv_ref;
};

template <class T>
std::vector<float> as_float(const std::vector<T>& x) {
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = to_float(x[i]);
  return y;
}

/// The reference of `p.selection` on p's inputs; the backward's reference takes `out_for_backward`
/// and `lse_for_backward` (what the device backward is given).
template <class T>
void compute_reference(global_problem<T>& p, const std::vector<float>& out_for_backward, const std::vector<float>& lse_for_backward) {
  const index_t s = p.seq_len, hq = p.hq, hkv = p.hkv, dim = p.dim;
  std::vector<float> q(p.q.size()), k(p.k.size()), v(p.v.size()), d_out(p.d_out.size());
  for (auto [from, to] : {std::pair{&p.q, &q}, std::pair{&p.k, &k}, std::pair{&p.v, &v}, std::pair{&p.d_out, &d_out}})
    for (std::size_t i = 0; i < from->size(); ++i) (*to)[i] = to_float((*from)[i]);
  const step_index whole = build_local_index(p.selection, sharding::sequential{}, 1, 0, 0, {});
  p.out_ref.assign(q.size(), 0.0);
  p.lse_ref.assign(std::size_t(hq) * s, 0.0);
  host::reference_forward<double>(view3(std::as_const(q), s, hq, dim), view3(std::as_const(k), s, hkv, dim), view3(std::as_const(v), s, hkv, dim),
                                  whole.view(), p.scale, view3(p.out_ref, s, hq, dim), view2(p.lse_ref, hq, s));
  if (out_for_backward.empty()) return;
  p.dq_ref.assign(q.size(), 0.0);
  p.dk_ref.assign(k.size(), 0.0);
  p.dv_ref.assign(v.size(), 0.0);
  host::reference_backward<double>(view3(std::as_const(q), s, hq, dim), view3(std::as_const(k), s, hkv, dim), view3(std::as_const(v), s, hkv, dim),
                                   view3(out_for_backward, s, hq, dim), view3(std::as_const(d_out), s, hq, dim), view2(lse_for_backward, hq, s),
                                   whole.view(), p.scale, view3(p.dq_ref, s, hq, dim), view3(p.dk_ref, s, hkv, dim), view3(p.dv_ref, s, hkv, dim));
}

/// Random inputs rounded to T (the selection is set later when it comes from the data).
template <class T>
global_problem<T> make_inputs(seeded_rng& rng, index_t seq_len, index_t hq, index_t hkv, index_t dim) {
  global_problem<T> p;
  p.seq_len = seq_len;
  p.hq = hq;
  p.hkv = hkv;
  p.dim = dim;
  p.scale = 1.0 / std::sqrt(double(dim));
  std::vector<float> unused;
  p.q = random_values<T>(rng, std::size_t(seq_len) * hq * dim, 2.0f, unused);
  p.k = random_values<T>(rng, std::size_t(seq_len) * hkv * dim, 2.0f, unused);
  p.v = random_values<T>(rng, std::size_t(seq_len) * hkv * dim, 1.0f, unused);
  p.d_out = random_values<T>(rng, std::size_t(seq_len) * hq * dim, 1.0f, unused);
  return p;
}

/// Inputs and the reference for a given selection; the backward gets the reference output rounded to T.
template <class T>
global_problem<T> make_problem(seeded_rng& rng, global_selection selection, index_t hkv, index_t dim) {
  global_problem<T> p = make_inputs<T>(rng, selection.seq_len, selection.num_heads(), hkv, dim);
  p.selection = std::move(selection);
  compute_reference(p, {}, {});  // forward only (no backward inputs yet)
  p.out_rounded.resize(p.out_ref.size());
  std::vector<float> out_exact(p.out_ref.size());
  for (std::size_t i = 0; i < p.out_ref.size(); ++i) {
    p.out_rounded[i] = from_float<T>(float(p.out_ref[i]));
    out_exact[i] = to_float(p.out_rounded[i]);
  }
  p.lse.assign(p.lse_ref.begin(), p.lse_ref.end());
  compute_reference(p, out_exact, p.lse);
  return p;
}

/// The ranks' results joined into global tensors against p's references, within T's tolerance.
template <class T, class Sharding>
void check_joined(const global_problem<T>& p, const Sharding& sharding, const std::string& name, const std::vector<float>& out,
                  const std::vector<float>& lse, const std::vector<std::vector<T>>& dq_s, const std::vector<std::vector<T>>& dk_s,
                  const std::vector<std::vector<T>>& dv_s) {
  const std::array<index_t, 3> q_extents{p.seq_len, p.hq, p.dim}, kv_extents{p.seq_len, p.hkv, p.dim};
  const double out_error = max_relative_error(out, p.out_ref), lse_error = max_relative_error(lse, p.lse_ref);
  const double dq_error = max_relative_error(as_float(sharding::join(sharding, dq_s, q_extents)), p.dq_ref);
  const double dk_error = max_relative_error(as_float(sharding::join(sharding, dk_s, kv_extents)), p.dk_ref);
  const double dv_error = max_relative_error(as_float(sharding::join(sharding, dv_s, kv_extents)), p.dv_ref);
  MESSAGE(name, ": max relative error O ", out_error, ", LSE ", lse_error, ", dQ ", dq_error, ", dK ", dk_error, ", dV ", dv_error);
  CHECK(out_error < tolerance<T>());
  CHECK(lse_error < tolerance<T>());
  CHECK(dq_error < tolerance<T>());
  CHECK(dk_error < tolerance<T>());
  CHECK(dv_error < tolerance<T>());
}

/// One rank's device tensors in a check: its shards of the inputs (and of the reference output and
/// LSE the backward takes), and outputs poisoned with NaN so that every element must be written.
template <class T>
struct rank_tensors {
  index_t local, hq, hkv, dim;
  device_buffer<T> q, k, v, d_out, out_in;
  device_buffer<float> lse_in;
  device_buffer<T> out, dq, dk, dv;
  device_buffer<float> lse;

  [[nodiscard]] tensor_view<const T, 3> in(const device_buffer<T>& b, index_t heads) const { return {b.data(), {local, heads, dim}}; }
  [[nodiscard]] tensor_view<T, 3> to(device_buffer<T>& b, index_t heads) const { return {b.data(), {local, heads, dim}}; }
  [[nodiscard]] tensor_view<float, 2> lse_out() { return {lse.data(), {hq, local}}; }
  [[nodiscard]] tensor_view<const float, 2> lse_for_backward() const { return {lse_in.data(), {hq, local}}; }
  /// The forward's tensors (writing out and lse), and the backward's (reading the reference's
  /// out_in and lse_in, writing dq, dk, dv).
  [[nodiscard]] forward_tensors<T> forward() { return {in(q, hq), in(k, hkv), in(v, hkv), to(out, hq), lse_out()}; }
  [[nodiscard]] backward_tensors<T> backward() {
    return {in(q, hq), in(k, hkv), in(v, hkv), in(out_in, hq), in(d_out, hq), lse_for_backward(), to(dq, hq), to(dk, hkv), to(dv, hkv)};
  }
};

/// Splits p over W ranks by `sharding`, runs run_rank(comm, tensors, stream, transfer_stream) on
/// every rank (`run_world`), and checks the joined results against p's references.
template <class T, class Sharding, class Runner, class RunRank>
void check_distributed(const global_problem<T>& p, const Sharding& sharding, index_t world, const std::string& name, Runner run_world,
                       const RunRank& run_rank) {
  const index_t s = p.seq_len, hq = p.hq, hkv = p.hkv, dim = p.dim, local = s / world;
  CAPTURE(name);
  const std::array<index_t, 3> q_extents{s, hq, dim}, kv_extents{s, hkv, dim};
  const auto split3 = [&](const std::vector<T>& x, std::array<index_t, 3> e) { return sharding::split(sharding, std::span<const T>(x), e, world); };
  const auto q_s = split3(p.q, q_extents), k_s = split3(p.k, kv_extents), v_s = split3(p.v, kv_extents), d_out_s = split3(p.d_out, q_extents),
             out_in_s = split3(p.out_rounded, q_extents);
  const auto lse_in_s = sharding::split(sharding, std::span<const float>(p.lse), std::array<index_t, 2>{hq, s}, world, 1);
  std::vector<std::vector<T>> out_s(static_cast<std::size_t>(world)), dq_s(out_s.size()), dk_s(out_s.size()), dv_s(out_s.size());
  std::vector<std::vector<float>> lse_s(out_s.size());
  run_world(world, [&](auto& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const cuda_stream compute, transfer;
    {
      const cudaStream_t st = compute.get();
      auto up = [&](const auto& x) { return device_buffer<std::decay_t<decltype(x[0])>>(std::span(x), st); };
      rank_tensors<T> t{local, hq, hkv, dim, up(q_s[r]), up(k_s[r]), up(v_s[r]), up(d_out_s[r]), up(out_in_s[r]), up(lse_in_s[r]),
                        device_buffer<T>(q_s[r].size(), st), device_buffer<T>(q_s[r].size(), st), device_buffer<T>(k_s[r].size(), st),
                        device_buffer<T>(v_s[r].size(), st), device_buffer<float>(lse_in_s[r].size(), st)};
      for (auto* b : {&t.out, &t.dq, &t.dk, &t.dv}) b->fill_bytes(0xff, st);  // NaN: every element must be written
      t.lse.fill_bytes(0xff, st);
      run_rank(c, t, st, transfer.get());
      out_s[r] = t.out.download(st);
      lse_s[r] = t.lse.download(st);
      dq_s[r] = t.dq.download(st);
      dk_s[r] = t.dk.download(st);
      dv_s[r] = t.dv.download(st);
    }  // buffers go before their streams
    share_shards(c, out_s), share_shards(c, lse_s), share_shards(c, dq_s), share_shards(c, dk_s), share_shards(c, dv_s);
  });
  check_joined(p, sharding, name, as_float(sharding::join(sharding, out_s, q_extents)),
               sharding::join(sharding, lse_s, std::array<index_t, 2>{hq, s}, 1), dq_s, dk_s, dv_s);
}

/// Runs the device ring on W ranks (`run_world`) and checks the joined results.
template <class T, class Sharding, class Topology, class Runner>
void check_ring(const global_problem<T>& p, const Sharding& sharding, const Topology& topology, const std::string& name, Runner run_world) {
  const index_t world = topology.world_size();
  check_distributed(p, sharding, world, name, run_world, [&](auto& c, rank_tensors<T>& t, cudaStream_t st, cudaStream_t transfer) {
    const device_selection selection(p.selection, st);
    const std::vector<device_step_index> indices = build_ring_indices_device(selection, sharding, topology, c.rank(), st);
    const std::span<const device_step_index> steps(indices);
    device::ring_forward(c, topology, steps, t.forward(), p.scale, {st, transfer});
    device::ring_backward(c, topology, steps, t.backward(), p.scale, device::determinism::atomic, {st, transfer});
  });
}

/// Runs the dynamic solver's plan for p's selection (W ranks, m chunks each) on the device and
/// checks the joined results. Returns the plan.
template <class T, class Runner>
solver::plan check_solver(const global_problem<T>& p, index_t world, index_t chunks_per_rank, const std::string& name, Runner run_world) {
  const solver::problem problem = solver::problem_from_selection(p.selection, world, chunks_per_rank, p.hkv);
  const solver::plan plan = solver::solve(problem);
  check_distributed(p, sharding::sequential{}, world, name, run_world, [&](auto& c, rank_tensors<T>& t, cudaStream_t st, cudaStream_t transfer) {
    const device_selection selection(p.selection, st);
    const device::solver_task_indices indices = device::build_solver_indices(selection, problem, plan, c.rank(), st);
    device::solver_forward(c, problem, plan, indices, t.forward(), p.scale, {st, transfer});
    device::solver_backward(c, problem, plan, indices, t.backward(), p.scale, device::determinism::atomic, {st, transfer});
  });
  return plan;
}

/// The tasks of a plan that run on a rank owning neither of their chunks (both moved there).
inline std::size_t third_rank_tasks(const solver::plan& plan) {
  std::size_t n = 0;
  for (std::size_t r = 0; r < plan.remote_tasks.size(); ++r)
    for (const solver::task& t : plan.remote_tasks[r]) {
      const auto moved_here = [&](solver::chunk_move::kind what, index_t chunk) {
        return std::binary_search(plan.moves.begin(), plan.moves.end(), solver::chunk_move{what, chunk, static_cast<index_t>(r)});
      };
      n += moved_here(solver::chunk_move::kind::qo, t.query_chunk) && moved_here(solver::chunk_move::kind::kv, t.kv_chunk);
    }
  return n;
}

/// Whether some chunk of the plan moves to two or more ranks (its partial results come back from each).
inline bool moves_a_chunk_twice(const solver::plan& plan) {
  for (std::size_t i = 1; i < plan.moves.size(); ++i)
    if (plan.moves[i].what == plan.moves[i - 1].what && plan.moves[i].chunk == plan.moves[i - 1].chunk) return true;
  return false;
}

template <class T, class Topology, class Runner>
void check_every_sharding(const global_problem<T>& p, const Topology& topology, const std::string& name, Runner run_world) {
  check_ring(p, sharding::sequential{}, topology, name + " sequential", run_world);
  check_ring(p, sharding::zigzag{}, topology, name + " zigzag", run_world);
  check_ring(p, sharding::striped<64>{}, topology, name + " striped", run_world);
}

/// The front template on W ranks: estimate from the data, forward, backward (on its own forward's
/// output), against the reference on the selection it estimated.
template <class Attention, class Runner>
void check_front_template(seeded_rng& rng, const typename Attention::topology_type& topology, const std::string& name, Runner run_world) {
  using T = __nv_bfloat16;
  CAPTURE(name);
  constexpr index_t dim = Attention::tile_type::head_dim;
  global_problem<T> p = make_inputs<T>(rng, 3072, 4, 2, dim);
  const index_t world = topology.world_size(), s = p.seq_len, hq = p.hq, hkv = p.hkv, local = s / world;
  const typename Attention::sharding_type sharding{};
  const std::array<index_t, 3> q_extents{s, hq, dim}, kv_extents{s, hkv, dim};
  const auto split3 = [&](const std::vector<T>& x, std::array<index_t, 3> e) { return sharding::split(sharding, std::span<const T>(x), e, world); };
  const auto q_s = split3(p.q, q_extents), k_s = split3(p.k, kv_extents), v_s = split3(p.v, kv_extents), d_out_s = split3(p.d_out, q_extents);
  std::vector<std::vector<T>> out_s(static_cast<std::size_t>(world)), dq_s(out_s.size()), dk_s(out_s.size()), dv_s(out_s.size());
  std::vector<std::vector<float>> lse_s(out_s.size());
  std::vector<global_selection> selections(out_s.size());
  run_world(world, [&](auto& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const cuda_stream stream;
    const cudaStream_t st = stream.get();
    {
      Attention layer({}, sharding, topology, {s, hq, hkv});
      auto up = [&](const std::vector<T>& x) { return device_buffer<T>(std::span<const T>(x), st); };
      const device_buffer<T> q = up(q_s[r]), k = up(k_s[r]), v = up(v_s[r]), d_out = up(d_out_s[r]);
      device_buffer<T> out(q.size(), st), dq(q.size(), st), dk(k.size(), st), dv(v.size(), st);
      device_buffer<float> lse(std::size_t(hq) * local, st);
      const auto in = [&](const device_buffer<T>& b, index_t heads) { return tensor_view<const T, 3>(b.data(), {local, heads, dim}); };
      const auto to = [&](device_buffer<T>& b, index_t heads) { return tensor_view<T, 3>(b.data(), {local, heads, dim}); };
      layer.estimate(c, in(q, hq), in(k, hkv), st);
      layer.forward(c, in(q, hq), in(k, hkv), in(v, hkv), to(out, hq), tensor_view<float, 2>(lse.data(), {hq, local}), st);
      layer.backward(c, in(q, hq), in(k, hkv), in(v, hkv), in(out, hq), in(d_out, hq), tensor_view<const float, 2>(lse.data(), {hq, local}),
                     to(dq, hq), to(dk, hkv), to(dv, hkv), st);
      selections[r] = layer.selection().to_host(st);
      out_s[r] = out.download(st);
      lse_s[r] = lse.download(st);
      dq_s[r] = dq.download(st);
      dk_s[r] = dk.download(st);
      dv_s[r] = dv.download(st);
    }
    share_shards(c, out_s), share_shards(c, lse_s), share_shards(c, dq_s), share_shards(c, dk_s), share_shards(c, dv_s);
    if (one_process_per_rank) {  // every rank estimated the same index: compare a digest of it
      const global_selection& mine = selections[r];
      std::vector<std::uint64_t> digest{std::uint64_t(mine.seq_len), std::uint64_t(mine.num_heads()), 0, 0};
      for (const head_selection& head : mine.heads) {
        for (const index_t token : head.vertical_tokens) digest[2] = digest[2] * 1000003 + std::uint64_t(token) + 1;
        for (const index_t delta : head.slash_deltas) digest[3] = digest[3] * 1000003 + std::uint64_t(delta + 1);
      }
      std::vector<std::uint64_t> rank0 = digest;
      c.host().broadcast(rank0.data(), rank0.size(), 0);
      CHECK(digest == rank0);
      for (auto& g : selections) g = mine;
    }
  });
  for (const global_selection& g : selections) CHECK(g == selections[0]);  // every rank estimated the same index
  p.selection = selections[0];
  const std::vector<float> out = as_float(sharding::join(sharding, out_s, q_extents));
  const std::vector<float> lse = sharding::join(sharding, lse_s, std::array<index_t, 2>{hq, s}, 1);
  compute_reference(p, out, lse);  // the backward reference gets what the device backward got
  check_joined(p, sharding, name, out, lse, dq_s, dk_s, dv_s);
}

}  // namespace stria::test
