// SPDX-License-Identifier: Apache-2.0
// Host execution of a dynamic solver plan (DESIGN 9), the oracle for the device execution: the solver
// engine (engine/solver_engine.hpp) on a host communicator (buffered sends, blocking receives), each
// task the reference kernels on fp32 copies of its chunks. Sequential sharding: rank r holds chunks
// [r m, (r + 1) m). Forward: partial O and LSE go home and are merged into the owner's fp32 running
// state; backward: Q, O, dO and LSE travel with a query chunk, and fp32 dQ and dK/dV go home and are
// added. Checked mode raises non_finite_error at the first NaN or infinity the engine's checks meet.
#pragma once

#include <cstddef>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/attention_tensors.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/engine/solver_engine.hpp"
#include "stria/host/reference_attention.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/index/local_index.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/solver/execution.hpp"

namespace stria::host {

namespace detail {

/// The value of `key` in `cache`, made by make(key) the first time (an own chunk is converted once).
template <class Value, class Make>
Value& cached(std::map<index_t, Value>& cache, index_t key, const Make& make) {
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make(key)).first;
  return it->second;
}

/// Checked mode's view of a rank's own results: chunk(c) points at chunk c's [parts, width] (O: one
/// part, LSE: a part per head); the result is the whole shard's [parts, chunks x width].
template <class Chunk>
std::vector<float> whole(const solver::rank_chunks& me, index_t parts, std::size_t width, const Chunk& chunk) {
  std::vector<float> y;
  for (index_t part = 0; part < parts; ++part)
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) y.insert(y.end(), chunk(c) + part * width, chunk(c) + (part + 1) * width);
  return y;
}

/// What both directions of the host backend share: the rank's inputs, its fp32 K/V chunks ([2, tokens,
/// Hkv, D]: its own converted once, and those moved here) and the transport. Sends never block, so a
/// chunk moved here is received after stage 0 (await_chunks) and a result when it is added.
template <class Comm, class T>
struct solver_backend_base {
  Comm& comm;
  const solver::problem& p;
  const global_selection& g;
  const solver::rank_chunks& me;
  tensor_view<const T, 3> q, k, v;
  double scale;
  index_t hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2), ct = me.tokens();
  std::size_t q_elems = me.elements(hq, dim), kv_elems = me.elements(hkv, dim), lse_elems = static_cast<std::size_t>(hq) * ct;
  std::map<index_t, std::vector<float>> own_kv{}, moved_kv{};
  std::vector<solver::chunk_move> arriving{};

  void begin_transfers() {}
  void end_transfers() {}
  void receive_chunk(const solver::chunk_move& move) { arriving.push_back(move); }
  void receive_result(const solver::chunk_move&, std::size_t) {}
  void await_results() {}

  void send(const std::vector<float>& x, index_t to, solver::message what, index_t chunk) { comm.send(x.data(), x.size(), to, me.tag(what, chunk)); }
  std::vector<float> receive(std::size_t count, index_t from, solver::message what, index_t chunk) {
    std::vector<float> x(count);
    comm.recv(x.data(), count, from, me.tag(what, chunk));
    return x;
  }
  std::vector<float>& kv_chunk(index_t c) {
    if (!me.owns(c)) return moved_kv.at(c);
    return cached(own_kv, c, [&](index_t x) { return rows_to_float<T>({k, v}, me.first_token(x), ct); });
  }
  void receive_kv(const solver::chunk_move& move) {
    moved_kv.emplace(move.chunk, receive(2 * kv_elems, me.owner(move.chunk), solver::message::kv, move.chunk));
  }
  step_index task_index(const solver::task& t) const {  // query chunk i against KV chunk j, both chunk-local
    return build_local_index(g, sharding::sequential{}, p.num_chunks(), t.query_chunk, t.kv_chunk);
  }
  template <class X>
  tensor_view<X, 3> rows(X* x, index_t heads) const { return {x, {ct, heads, dim}}; }
  template <class X>
  tensor_view<X, 2> columns(X* x) const { return {x, {hq, ct}}; }
  /// Rounds rank chunk c's fp32 rows [tokens, heads, D] to T into `y`.
  void write_rows(const float* x, index_t c, tensor_view<T, 3> y) const { rows_from_float(x, y, me.first_token(c), ct); }
};

/// The forward: per query chunk an fp32 running O [tokens, Hq, D] and LSE [Hq, tokens]; those of a
/// query chunk moved here go home, where merge_partial adds them in.
template <class Comm, class T>
struct solver_forward_backend : solver_backend_base<Comm, T> {
  using base = solver_backend_base<Comm, T>;
  using base::me, base::q, base::hq, base::hkv, base::dim, base::ct, base::q_elems, base::kv_elems, base::lse_elems, base::rows, base::columns;
  static constexpr bool kv_results = false;
  struct partial { std::vector<float> out, lse; };

  tensor_view<T, 3> out;
  tensor_view<float, 2> lse;
  std::map<index_t, partial> running{}, moved_out{};  // this rank's query chunks; those moved here
  std::map<index_t, std::vector<float>> own_q{}, moved_q{};
  partial part{};

  partial empty() const { return {std::vector<float>(q_elems, 0.0f), std::vector<float>(lse_elems, -std::numeric_limits<float>::infinity())}; }
  partial& state(index_t c) { return me.owns(c) ? cached(running, c, [&](index_t) { return empty(); }) : moved_out.at(c); }
  std::vector<float>& query(index_t c) {
    return me.owns(c) ? cached(own_q, c, [&](index_t x) { return rows_to_float<T>({q}, me.first_token(x), ct); }) : moved_q.at(c);
  }
  void merge(partial& into, const partial& x) const {
    merge_partial<float>(rows(into.out.data(), hq), columns(into.lse.data()), rows(x.out.data(), hq), columns(x.lse.data()));
  }

  void send_chunk(const solver::chunk_move& move) {
    if (move.what == solver::chunk_move::kind::kv) this->send(this->kv_chunk(move.chunk), move.to, solver::message::kv, move.chunk);
    else this->send(query(move.chunk), move.to, solver::message::query, move.chunk);
  }
  void await_chunks() {
    for (const solver::chunk_move& move : this->arriving) {
      if (move.what == solver::chunk_move::kind::kv) {
        this->receive_kv(move);
      } else {
        moved_q.emplace(move.chunk, this->receive(q_elems, me.owner(move.chunk), solver::message::query, move.chunk));
        moved_out.emplace(move.chunk, empty());
      }
    }
  }
  void compute(const solver::task& t, index_t, std::size_t) {
    const step_index index = this->task_index(t);
    const std::vector<float>& kv = this->kv_chunk(t.kv_chunk);
    part.out.resize(q_elems);
    part.lse.resize(lse_elems);
    reference_forward<float>(rows(std::as_const(query(t.query_chunk)).data(), hq), rows(kv.data(), hkv), rows(kv.data() + kv_elems, hkv), index.view(),
                             this->scale, rows(part.out.data(), hq), columns(part.lse.data()));
    merge(state(t.query_chunk), part);
  }
  void check(index_t stage, const std::string& phase, bool moved) {
    const index_t local = q.extent(0), rank = me.rank();
    check_finite(std::span<const float>(whole(me, 1, q_elems, [&](index_t c) { return state(c).out.data(); })),
                 checked_tensor::queries("O", local, hq, dim), rank, stage, phase);
    check_finite(std::span<const float>(whole(me, hq, static_cast<std::size_t>(ct), [&](index_t c) { return state(c).lse.data(); })),
                 checked_tensor::lse(hq, local), rank, stage, phase);
    if (!moved) return;
    for (const auto& [chunk, x] : moved_out) {
      check_finite(std::span<const float>(x.out), engine::moved_chunk(checked_tensor::queries("O", ct, hq, dim), this->p, chunk), rank, stage, phase);
      check_finite(std::span<const float>(x.lse), engine::moved_chunk(checked_tensor::lse(hq, ct), this->p, chunk), rank, stage, phase);
    }
  }
  void send_result(const solver::chunk_move& move) {
    this->send(moved_out.at(move.chunk).out, me.owner(move.chunk), solver::message::partial_out, move.chunk);
    this->send(moved_out.at(move.chunk).lse, me.owner(move.chunk), solver::message::partial_lse, move.chunk);
  }
  void add_result(const solver::chunk_move& move, std::size_t) {
    part.out = this->receive(q_elems, move.to, solver::message::partial_out, move.chunk);
    part.lse = this->receive(lse_elems, move.to, solver::message::partial_lse, move.chunk);
    merge(state(move.chunk), part);
  }
  void finish() {
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) {
      this->write_rows(state(c).out.data(), c, out);
      for (index_t h = 0; h < hq; ++h)
        for (index_t t = 0; t < ct; ++t) lse(h, me.first_token(c) + t) = state(c).lse[static_cast<std::size_t>(h * ct + t)];
    }
  }
};

/// The backward: per query chunk its fp32 dQ sum, per KV chunk its dK/dV sum ([2, tokens, Hkv, D]);
/// those of a chunk moved here go home, where they are added in.
template <class Comm, class T>
struct solver_backward_backend : solver_backend_base<Comm, T> {
  using base = solver_backend_base<Comm, T>;
  using base::me, base::q, base::hq, base::hkv, base::dim, base::ct, base::q_elems, base::kv_elems, base::lse_elems, base::rows, base::columns;
  static constexpr bool kv_results = true;
  struct query_side {  // Q, O and dO [3, tokens, Hq, D], LSE [Hq, tokens]
    std::vector<float> q_out_dout, lse;
  };

  tensor_view<const T, 3> out, d_out;
  tensor_view<const float, 2> lse;
  tensor_view<T, 3> dq, dk, dv;
  std::map<index_t, query_side> own_q{}, moved_q{};
  std::map<index_t, std::vector<float>> dq_sum{}, dkv_sum{}, dq_home{}, dkv_home{};  // this rank's chunks; those moved here

  query_side& query(index_t c) {
    if (!me.owns(c)) return moved_q.at(c);
    return cached(own_q, c, [&](index_t x) {
      query_side s{rows_to_float<T>({q, out, d_out}, me.first_token(x), ct), {}};
      for (index_t h = 0; h < hq; ++h)
        for (index_t t = me.first_token(x); t < me.first_token(x) + ct; ++t) s.lse.push_back(lse(h, t));
      return s;
    });
  }
  std::vector<float>& dq_of(index_t c) { return me.owns(c) ? cached(dq_sum, c, [&](index_t) { return std::vector<float>(q_elems, 0.0f); }) : dq_home.at(c); }
  std::vector<float>& dkv_of(index_t c) {
    return me.owns(c) ? cached(dkv_sum, c, [&](index_t) { return std::vector<float>(2 * kv_elems, 0.0f); }) : dkv_home.at(c);
  }

  void send_chunk(const solver::chunk_move& move) {
    if (move.what == solver::chunk_move::kind::kv) {
      this->send(this->kv_chunk(move.chunk), move.to, solver::message::kv, move.chunk);
    } else {
      this->send(query(move.chunk).q_out_dout, move.to, solver::message::query_backward, move.chunk);
      this->send(query(move.chunk).lse, move.to, solver::message::lse_backward, move.chunk);
    }
  }
  void await_chunks() {  // each moved chunk's gradient goes home even if no task touched it
    for (const solver::chunk_move& move : this->arriving) {
      const index_t from = me.owner(move.chunk);
      if (move.what == solver::chunk_move::kind::kv) {
        this->receive_kv(move);
        dkv_home.emplace(move.chunk, std::vector<float>(2 * kv_elems, 0.0f));
      } else {
        std::vector<float> rows_in = this->receive(3 * q_elems, from, solver::message::query_backward, move.chunk);
        moved_q.emplace(move.chunk, query_side{std::move(rows_in), this->receive(lse_elems, from, solver::message::lse_backward, move.chunk)});
        dq_home.emplace(move.chunk, std::vector<float>(q_elems, 0.0f));
      }
    }
  }
  void compute(const solver::task& t, index_t, std::size_t) {
    const step_index index = this->task_index(t);
    const query_side& s = query(t.query_chunk);
    const std::vector<float>& kv = this->kv_chunk(t.kv_chunk);
    std::vector<float>& dkv = dkv_of(t.kv_chunk);
    const auto q3 = [&](std::size_t i) { return rows(s.q_out_dout.data() + i * q_elems, hq); };
    reference_backward<float>(q3(0), rows(kv.data(), hkv), rows(kv.data() + kv_elems, hkv), q3(1), q3(2), columns(s.lse.data()), index.view(),
                              this->scale, rows(dq_of(t.query_chunk).data(), hq), rows(dkv.data(), hkv), rows(dkv.data() + kv_elems, hkv));
  }
  void check(index_t stage, const std::string& phase, bool moved) {
    const index_t local = q.extent(0), rank = me.rank();
    const std::pair<const char*, std::size_t> halves[] = {{"dK", 0}, {"dV", kv_elems}};
    check_finite(std::span<const float>(whole(me, 1, q_elems, [&](index_t c) { return dq_of(c).data(); })),
                 checked_tensor::queries("dQ", local, hq, dim), rank, stage, phase);
    for (const auto& [name, half] : halves)
      check_finite(std::span<const float>(whole(me, 1, kv_elems, [&](index_t c) { return dkv_of(c).data() + half; })),
                   checked_tensor::solver_chunk(checked_tensor::kv_gradient(name, local, hkv, dim, rank), rank, 0), rank, stage, phase);
    if (!moved) return;
    for (const auto& [chunk, x] : dq_home)
      check_finite(std::span<const float>(x), engine::moved_chunk(checked_tensor::queries("dQ", ct, hq, dim), this->p, chunk), rank, stage, phase);
    for (const auto& [chunk, x] : dkv_home)
      for (const auto& [name, half] : halves)
        check_finite(std::span<const float>(x).subspan(half, kv_elems),
                     engine::moved_chunk(checked_tensor::kv_gradient(name, ct, hkv, dim, me.owner(chunk)), this->p, chunk), rank, stage, phase);
  }
  void send_result(const solver::chunk_move& move) {
    const bool kv = move.what == solver::chunk_move::kind::kv;
    this->send(kv ? dkv_home.at(move.chunk) : dq_home.at(move.chunk), me.owner(move.chunk), kv ? solver::message::partial_dkv : solver::message::partial_dq,
               move.chunk);
  }
  void add_result(const solver::chunk_move& move, std::size_t) {
    const bool kv = move.what == solver::chunk_move::kind::kv;
    std::vector<float>& into = kv ? dkv_of(move.chunk) : dq_of(move.chunk);
    const std::vector<float> x = this->receive(into.size(), move.to, kv ? solver::message::partial_dkv : solver::message::partial_dq, move.chunk);
    for (std::size_t i = 0; i < x.size(); ++i) into[i] += x[i];
  }
  void finish() {
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) {
      this->write_rows(dq_of(c).data(), c, dq);
      this->write_rows(dkv_of(c).data(), c, dk);
      this->write_rows(dkv_of(c).data() + kv_elems, c, dv);
    }
  }
};

}  // namespace detail

/// This rank's forward (`tensors`: q, k, v in, out, lse out) as `plan` places the tasks of `g` (p = the
/// problem the plan solved, e.g. solver::problem_from_selection(g, W, m, Hkv)). q [m x tokens, Hq, D], k, v
/// [m x tokens, Hkv, D] are this rank's sequential shards; writes out and the fp32 lse [Hq, m x tokens] of
/// the whole sequence's attention for the local queries. With finite_check::every_step each stage's results
/// are checked ("solver stage 0", "solver stage 1").
template <class Comm, class T>
void solver_forward(Comm& comm, const solver::problem& p, const solver::plan& plan, const global_selection& g, const forward_tensors<T>& tensors,
                    double softmax_scale, finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  const auto [q, k, v, out, lse] = tensors;
  const index_t hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2);
  const solver::rank_chunks me(p, plan, g.seq_len, g.num_heads(), comm.rank(), comm.world_size(), q.extent(0), k.extent(0), hq, hkv);
  check_extents(v, {k.extent(0), hkv, dim}, "v");
  check_extents(out, {q.extent(0), hq, dim}, "out");
  check_extents(lse, {hq, q.extent(0)}, "lse");
  detail::solver_forward_backend<Comm, T> backend{{comm, p, g, me, q, k, v, softmax_scale}, out, lse};
  engine::run_solver_plan(backend, plan, me, check);
}

/// This rank's backward (`tensors`: q, k, v, out, d_out, lse in; dq, dk, dv out) as `plan` places the tasks.
/// out and lse are the forward's results, d_out the incoming gradient (all local shards). Writes dq and the
/// complete dk, dv of this rank's chunks; the partial gradients of moved chunks are summed in fp32 at their
/// owners. With finite_check::every_step each stage's dQ and dK/dV sums are checked.
template <class Comm, class T>
void solver_backward(Comm& comm, const solver::problem& p, const solver::plan& plan, const global_selection& g, const backward_tensors<T>& tensors,
                     double softmax_scale, finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  const auto [q, k, v, out, d_out, lse, dq, dk, dv] = tensors;
  const solver::rank_chunks me(p, plan, g.seq_len, g.num_heads(), comm.rank(), comm.world_size(), q.extent(0), k.extent(0), q.extent(1), k.extent(1));
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  check_backward_tensors(shape, out, d_out, lse, dq, dk, dv);
  detail::solver_backward_backend<Comm, T> backend{{comm, p, g, me, q, k, v, softmax_scale}, out, d_out, lse, dq, dk, dv};
  engine::run_solver_plan(backend, plan, me, check);
}

}  // namespace stria::host
