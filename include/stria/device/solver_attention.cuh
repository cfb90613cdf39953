// SPDX-License-Identifier: Apache-2.0
// Device execution of a dynamic solver plan (DESIGN 9): the solver engine (engine/solver_engine.hpp)
// on a device communicator (comm::local_device, comm::nccl), each task the sparse kernels on its
// chunks. Sequential sharding: a rank's chunks are contiguous rows of its token-major tensors, so a
// chunk travels as it lies, on the transfer stream while stage 0 computes. Forward: fp32 partial O
// and LSE go home and are merged; backward: Q, dO, LSE and delta travel with a query chunk, and fp32
// dQ and dK/dV go home and are added. The host confirms each group of transfers through comm.wait()
// (bounded: a dead peer raises instead of hanging). Checked mode checks on the device
// (device/finite_check.cuh) what the host execution checks, in the same order.
#pragma once

#include <cuda_runtime_api.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/error.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/device/finite_check.cuh"
#include "stria/device/launch.cuh"
#include "stria/device/ring_attention.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/engine/solver_engine.hpp"
#include "stria/index/local_index.cuh"
#include "stria/kernel/merge.cuh"
#include "stria/sharding/sequential.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/solver/execution.hpp"

namespace stria::device {

/// The sparse indices of one rank's tasks in a plan (local tasks, then remote tasks, in plan order),
/// built once per layer on the device and used by forward and backward.
struct solver_task_indices {
  index_t rank = -1;
  index_t seq_len = 0, heads = 0;
  std::vector<device_step_index> local, remote;
};

/// Builds rank `rank`'s task indices from the global selection the plan's problem was made from.
inline solver_task_indices build_solver_indices(const device_selection& selection, const solver::problem& p, const solver::plan& plan,
                                                index_t rank, cudaStream_t stream) {
  if (rank < 0 || rank >= p.world_size) throw invalid_argument("rank", rank, "must lie in [0, " + std::to_string(p.world_size) + ")");
  solver::check_plan_of(p, plan);
  solver::check_rank_tasks(p, plan, rank);
  // One batch (one host synchronisation) for all of the rank's tasks, local first.
  const std::vector<solver::task>&local = plan.local_tasks[static_cast<std::size_t>(rank)], &remote = plan.remote_tasks[static_cast<std::size_t>(rank)];
  std::vector<index_request> requests;
  for (const auto* tasks : {&local, &remote})
    for (const solver::task& t : *tasks) requests.push_back({t.query_chunk, t.kv_chunk, {}});
  std::vector<device_step_index> built = build_local_indices_device(selection, sharding::sequential{}, p.num_chunks(), requests, stream);
  solver_task_indices out{rank, selection.seq_len(), selection.num_heads(), {}, {}};
  const auto split = built.begin() + static_cast<std::ptrdiff_t>(local.size());
  out.local.assign(std::make_move_iterator(built.begin()), std::make_move_iterator(split));
  out.remote.assign(std::make_move_iterator(split), std::make_move_iterator(built.end()));
  return out;
}

namespace detail {

/// The checks every solver call makes before any transfer or launch: the indices belong to this
/// rank and this plan, and q, k have a shape the kernels accept.
template <index_t HeadDim, class Comm, class T>
solver::rank_chunks checked_solver_call(Comm& comm, const solver::problem& p, const solver::plan& plan, const solver_task_indices& indices,
                                        tensor_view<const T, 3> q, tensor_view<const T, 3> k) {
  const index_t rank = comm.rank();
  solver::rank_chunks me(p, plan, indices.seq_len, indices.heads, rank, comm.world_size(), q.extent(0), k.extent(0), q.extent(1), k.extent(1));
  if (indices.rank != rank || indices.local.size() != plan.local_tasks[static_cast<std::size_t>(rank)].size() ||
      indices.remote.size() != plan.remote_tasks[static_cast<std::size_t>(rank)].size())
    throw invalid_argument("indices.rank", indices.rank,
                           "must be the indices built for this rank (" + std::to_string(rank) + ") and this plan (an index built for another configuration?)");
  attention_shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)}.validate();
  check_head_dim<HeadDim>(q.extent(2));
  return me;
}

/// Copies the columns [first, first + tokens) of a [heads, whole_tokens] array into a [heads, tokens]
/// chunk array (gather), or back (scatter).
inline void gather_columns(const float* whole, index_t whole_tokens, index_t first, float* chunk, index_t tokens, index_t heads,
                           cudaStream_t stream) {
  const std::size_t row = sizeof(float) * static_cast<std::size_t>(tokens), whole_row = sizeof(float) * static_cast<std::size_t>(whole_tokens);
  STRIA_CUDA_CHECK(cudaMemcpy2DAsync(chunk, row, whole + first, whole_row, row, static_cast<std::size_t>(heads), cudaMemcpyDeviceToDevice, stream));
}
inline void scatter_columns(const float* chunk, index_t tokens, index_t heads, float* whole, index_t whole_tokens, index_t first,
                            cudaStream_t stream) {
  const std::size_t row = sizeof(float) * static_cast<std::size_t>(tokens), whole_row = sizeof(float) * static_cast<std::size_t>(whole_tokens);
  STRIA_CUDA_CHECK(cudaMemcpy2DAsync(whole + first, whole_row, chunk, row, row, static_cast<std::size_t>(heads), cudaMemcpyDeviceToDevice, stream));
}

/// What both directions of the device backend share: the rank's inputs, the KV chunks moved here
/// ([2, tokens, Hkv, D]: K then V), the task indices and the transport. A group of transfers starts
/// after the compute stream's queued work (what it sends is written, what it receives allocated).
template <class Comm, class T>
struct solver_backend_base {
  Comm& comm;
  const solver::problem& p;
  const solver::rank_chunks& me;
  const solver_task_indices& indices;
  tensor_view<const T, 3> q, k, v;
  double scale;
  cudaStream_t stream, transfer;
  index_t hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2), local = q.extent(0), ct = me.tokens();
  std::size_t q_elems = me.elements(hq, dim), kv_elems = me.elements(hkv, dim), lse_elems = static_cast<std::size_t>(hq) * ct;
  std::map<index_t, device_buffer<T>> moved_kv{};
  std::optional<step_check> checks{};
  cuda_event arrived{}, home{};  // the moves; the results' returns
  bool moves_posted = false;

  void begin_transfers() {
    wait_for(transfer, stream);
    comm.group_start();
  }
  void end_transfers() {
    comm.group_end();
    (moves_posted ? home : arrived).record(transfer);
    moves_posted = true;
  }
  void await_chunks() { arrived.make_wait(stream); }
  void await_results() {
    comm.wait(arrived.get(), "the chunks the plan moves to rank " + std::to_string(me.rank()));
    wait_for(stream, transfer);
  }
  void confirm_returns(const char* what) { comm.wait(home.get(), std::string(what) + " returned to or from rank " + std::to_string(me.rank())); }

  const device_step_index& index(index_t stage, std::size_t i) const { return (stage == 0 ? indices.local : indices.remote)[i]; }
  template <class X>
  tensor_view<X, 3> rows(X* x, index_t heads) const { return {x, {ct, heads, dim}}; }
  template <class X>
  tensor_view<X, 2> columns(X* x) const { return {x, {hq, ct}}; }
  template <class X>  // this rank's chunk c of a token-major tensor: contiguous, as the kernels need
  tensor_view<X, 3> own_rows(X* x, index_t c, index_t heads) const { return rows(x + static_cast<std::size_t>(me.first_token(c)) * heads * dim, heads); }

  void send_kv(const solver::chunk_move& move) {
    comm.send(own_rows(k.data(), move.chunk, hkv).data(), kv_elems, move.to, transfer, me.tag(solver::message::kv, move.chunk));
    comm.send(own_rows(v.data(), move.chunk, hkv).data(), kv_elems, move.to, transfer, me.tag(solver::message::kv_values, move.chunk));
  }
  void receive_kv(const solver::chunk_move& move) {
    T* into = moved_kv.at(move.chunk).data();
    comm.recv(into, kv_elems, me.owner(move.chunk), transfer, me.tag(solver::message::kv, move.chunk));
    comm.recv(into + kv_elems, kv_elems, me.owner(move.chunk), transfer, me.tag(solver::message::kv_values, move.chunk));
  }
  std::pair<tensor_view<const T, 3>, tensor_view<const T, 3>> kv_chunk(index_t c) const {
    if (me.owns(c)) return {own_rows(k.data(), c, hkv), own_rows(v.data(), c, hkv)};
    const T* packed = moved_kv.at(c).data();
    return {rows(packed, hkv), rows(packed + kv_elems, hkv)};
  }
};

/// The forward: the fp32 running O [local, Hq, D] and per chunk LSE [Hq, tokens] of this rank's
/// query chunks; Q and the partial state of each query chunk moved here, which goes home.
template <index_t HeadDim, class Comm, class T>
struct solver_forward_backend : solver_backend_base<Comm, T> {
  using base = solver_backend_base<Comm, T>;
  using base::comm, base::me, base::q, base::hq, base::dim, base::local, base::ct, base::q_elems, base::lse_elems, base::stream, base::transfer,
      base::checks, base::rows, base::columns;
  static constexpr bool kv_results = false;
  struct partial { device_buffer<float> out, lse; };
  struct moved_query { device_buffer<T> q; partial state; };  // Q and its partial state, computed here for its owner

  tensor_view<T, 3> out;
  tensor_view<float, 2> lse;
  device_buffer<float> running{}, running_lse{};
  std::map<index_t, moved_query> moved_q{};
  std::map<std::size_t, partial> returned{};  // by move: a chunk may have moved to several ranks
  transfers_before_release guard{stream, transfer};  // the last member: destroyed before every buffer

  template <class... Base>
  solver_forward_backend(const solver::plan& plan, finite_check check, tensor_view<T, 3> o, tensor_view<float, 2> l, Base&&... b)
      : base{std::forward<Base>(b)...}, out(o), lse(l) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    running = device_buffer<float>(static_cast<std::size_t>(local) * hq * dim, stream);
    running_lse = device_buffer<float>(lse_elems * static_cast<std::size_t>(this->p.chunks_per_rank), stream);
    running.fill_bytes(0, stream);
    thrust::fill(thrust::cuda::par_nosync.on(stream), running_lse.data(), running_lse.data() + running_lse.size(), neg_inf);
    for (std::size_t i = 0; i < plan.moves.size(); ++i) {
      const solver::chunk_move& move = plan.moves[i];
      if (move.what == solver::chunk_move::kind::kv) {
        if (move.to == me.rank()) this->moved_kv.emplace(move.chunk, device_buffer<T>(2 * this->kv_elems, stream));
      } else if (move.to == me.rank()) {
        moved_query m{device_buffer<T>(q_elems, stream), {device_buffer<float>(q_elems, stream), device_buffer<float>(lse_elems, stream)}};
        m.state.out.fill_bytes(0, stream);
        thrust::fill(thrust::cuda::par_nosync.on(stream), m.state.lse.data(), m.state.lse.data() + lse_elems, neg_inf);
        moved_q.emplace(move.chunk, std::move(m));
      } else if (me.owns(move.chunk)) {
        returned.emplace(i, partial{device_buffer<float>(q_elems, stream), device_buffer<float>(lse_elems, stream)});
      }
    }
    if (check == finite_check::every_step) checks.emplace(stream, 2 + 2 * moved_q.size());
  }

  /// A query chunk's Q, O and LSE: this rank's own (in the running state) or moved here.
  std::tuple<tensor_view<const T, 3>, tensor_view<float, 3>, tensor_view<float, 2>> query(index_t c) {
    if (me.owns(c))
      return {this->own_rows(q.data(), c, hq), this->own_rows(running.data(), c, hq),
              columns(running_lse.data() + static_cast<std::size_t>(c - me.first_chunk()) * lse_elems)};
    moved_query& m = moved_q.at(c);
    return {rows(static_cast<const T*>(m.q.data()), hq), rows(m.state.out.data(), hq), columns(m.state.lse.data())};
  }
  void own_lse_into_output() {  // the chunks' LSEs, gathered into `lse`
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c)
      scatter_columns(std::get<2>(query(c)).data(), ct, hq, lse.data(), local, me.first_token(c), stream);
  }

  void send_chunk(const solver::chunk_move& move) {
    if (move.what == solver::chunk_move::kind::kv) this->send_kv(move);
    else comm.send(std::get<0>(query(move.chunk)).data(), q_elems, move.to, transfer, me.tag(solver::message::query, move.chunk));
  }
  void receive_chunk(const solver::chunk_move& move) {
    if (move.what == solver::chunk_move::kind::kv) this->receive_kv(move);
    else comm.recv(moved_q.at(move.chunk).q.data(), q_elems, me.owner(move.chunk), transfer, me.tag(solver::message::query, move.chunk));
  }
  void compute(const solver::task& t, index_t stage, std::size_t i) {
    const auto [kc, vc] = this->kv_chunk(t.kv_chunk);
    const auto [qc, o, l] = query(t.query_chunk);
    sparse_forward<T, HeadDim>(this->index(stage, i), {.q = qc, .k = kc, .v = vc, .out = o, .lse = l}, this->scale, stream,
                               {.state = running_state::merge});
  }
  void check(index_t stage, const std::string& phase, bool moved) {
    checks->begin();
    checks->add(running.data(), checked_tensor::queries("O", local, hq, dim));
    own_lse_into_output();
    checks->add(lse.data(), checked_tensor::lse(hq, local));
    if (moved)
      for (const auto& [chunk, m] : moved_q) {
        checks->add(m.state.out.data(), engine::moved_chunk(checked_tensor::queries("O", ct, hq, dim), this->p, chunk));
        checks->add(m.state.lse.data(), engine::moved_chunk(checked_tensor::lse(hq, ct), this->p, chunk));
      }
    checks->finish(me.rank(), stage, phase);
  }
  void send_result(const solver::chunk_move& move) {
    const partial& x = moved_q.at(move.chunk).state;
    comm.send(x.out.data(), q_elems, me.owner(move.chunk), transfer, me.tag(solver::message::partial_out, move.chunk));
    comm.send(x.lse.data(), lse_elems, me.owner(move.chunk), transfer, me.tag(solver::message::partial_lse, move.chunk));
  }
  void receive_result(const solver::chunk_move& move, std::size_t i) {
    partial& x = returned.at(i);
    comm.recv(x.out.data(), q_elems, move.to, transfer, me.tag(solver::message::partial_out, move.chunk));
    comm.recv(x.lse.data(), lse_elems, move.to, transfer, me.tag(solver::message::partial_lse, move.chunk));
  }
  void add_result(const solver::chunk_move& move, std::size_t i) {
    const auto chunk = query(move.chunk);  // its running O and LSE: elements 1 and 2
    const partial& x = returned.at(i);
    const std::int64_t row_count = static_cast<std::int64_t>(ct) * hq;
    detail::launch<&kernel::merge_partial<float>>("merge_partial", {stria::detail::blocks_for(row_count * 32, 256), 256, 0, stream},
                                                  std::get<1>(chunk).data(), std::get<2>(chunk).data(), x.out.data(), x.lse.data(), ct, hq, dim);
  }
  void finish() {
    write_output(tensor_view<const float, 3>(running.data(), {local, hq, dim}), out, stream);
    own_lse_into_output();
    this->confirm_returns("the partial results");
  }
};

/// The backward: this rank's fp32 dQ [local, Hq, D] and dK/dV [2, local, Hkv, D] sums and per query
/// chunk its LSE and delta = rowsum(dO O) ([2, Hq, tokens]: one message moves both); the inputs
/// and gradient sums of each chunk moved here, whose sums go home.
template <index_t HeadDim, class Comm, class T>
struct solver_backward_backend : solver_backend_base<Comm, T> {
  using base = solver_backend_base<Comm, T>;
  using base::comm, base::me, base::q, base::hq, base::hkv, base::dim, base::local, base::ct, base::q_elems, base::kv_elems, base::lse_elems,
      base::stream, base::transfer, base::checks, base::rows, base::columns, base::own_rows;
  static constexpr bool kv_results = true;
  struct moved_query {  // Q and dO [2, tokens, Hq, D], LSE and delta [2, Hq, tokens], its dQ sum here
    device_buffer<T> q_dout;
    device_buffer<float> lse_delta, dq;
  };
  struct query_side {
    tensor_view<const T, 3> q, d_out;
    tensor_view<const float, 2> lse, delta;
    tensor_view<float, 3> dq;
  };

  tensor_view<const T, 3> d_out;
  tensor_view<T, 3> dq, dk, dv;
  determinism mode;
  device_buffer<float> lse_delta{}, dq32{}, dkv32{};
  std::map<index_t, moved_query> moved_q{};
  std::map<index_t, device_buffer<float>> moved_dkv{};  // the dK/dV sums of the KV chunks moved here
  std::map<std::size_t, device_buffer<float>> returned{};  // by move: a gradient sum of an own chunk from elsewhere
  transfers_before_release guard{stream, transfer};  // the last member: destroyed before every buffer

  template <class... Base>
  solver_backward_backend(const solver::plan& plan, finite_check check, tensor_view<const T, 3> out, tensor_view<const float, 2> lse,
                          tensor_view<const T, 3> dout, tensor_view<T, 3> gq, tensor_view<T, 3> gk, tensor_view<T, 3> gv, determinism m, Base&&... b)
      : base{std::forward<Base>(b)...}, d_out(dout), dq(gq), dk(gk), dv(gv), mode(m) {
    lse_delta = device_buffer<float>(2 * lse_elems * static_cast<std::size_t>(this->p.chunks_per_rank), stream);
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) {
      gather_columns(lse.data(), local, me.first_token(c), own_lse_delta(c), ct, hq, stream);
      backward_delta(own_rows(out.data(), c, hq), own_rows(d_out.data(), c, hq), columns(own_lse_delta(c) + lse_elems), stream);
    }
    dq32 = device_buffer<float>(static_cast<std::size_t>(local) * hq * dim, stream);
    dkv32 = device_buffer<float>(2 * static_cast<std::size_t>(local) * hkv * dim, stream);
    dq32.fill_bytes(0, stream);
    dkv32.fill_bytes(0, stream);
    for (std::size_t i = 0; i < plan.moves.size(); ++i) {
      const solver::chunk_move& move = plan.moves[i];
      const bool kv = move.what == solver::chunk_move::kind::kv;
      if (move.to == me.rank() && kv) {
        this->moved_kv.emplace(move.chunk, device_buffer<T>(2 * kv_elems, stream));
        moved_dkv.emplace(move.chunk, device_buffer<float>(2 * kv_elems, stream)).first->second.fill_bytes(0, stream);
      } else if (move.to == me.rank()) {
        moved_query mq{device_buffer<T>(2 * q_elems, stream), device_buffer<float>(2 * lse_elems, stream), device_buffer<float>(q_elems, stream)};
        mq.dq.fill_bytes(0, stream);
        moved_q.emplace(move.chunk, std::move(mq));
      } else if (me.owns(move.chunk)) {
        returned.emplace(i, device_buffer<float>(kv ? 2 * kv_elems : q_elems, stream));
      }
    }
    if (check == finite_check::every_step) checks.emplace(stream, 3 + moved_q.size() + 2 * moved_dkv.size());
  }

  float* own_lse_delta(index_t c) { return lse_delta.data() + 2 * lse_elems * static_cast<std::size_t>(c - me.first_chunk()); }
  /// A query chunk's inputs and dQ sum: this rank's own or moved here.
  query_side query(index_t c) {
    if (me.owns(c))
      return {own_rows(q.data(), c, hq), own_rows(d_out.data(), c, hq), columns(own_lse_delta(c)), columns(own_lse_delta(c) + lse_elems),
              own_rows(dq32.data(), c, hq)};
    moved_query& m = moved_q.at(c);
    return {rows(m.q_dout.data(), hq), rows(m.q_dout.data() + q_elems, hq), columns(m.lse_delta.data()), columns(m.lse_delta.data() + lse_elems),
            rows(m.dq.data(), hq)};
  }
  /// A KV chunk's dK and dV sums: this rank's own or moved here.
  std::pair<tensor_view<float, 3>, tensor_view<float, 3>> dkv(index_t c) {
    if (me.owns(c)) return {own_rows(dkv32.data(), c, hkv), own_rows(dkv32.data() + static_cast<std::size_t>(local) * hkv * dim, c, hkv)};
    float* g = moved_dkv.at(c).data();
    return {rows(g, hkv), rows(g + kv_elems, hkv)};
  }

  void send_chunk(const solver::chunk_move& move) {
    if (move.what == solver::chunk_move::kind::kv) return this->send_kv(move);
    const query_side s = query(move.chunk);
    comm.send(s.q.data(), q_elems, move.to, transfer, me.tag(solver::message::query_backward, move.chunk));
    comm.send(s.d_out.data(), q_elems, move.to, transfer, me.tag(solver::message::d_out_backward, move.chunk));
    comm.send(s.lse.data(), 2 * lse_elems, move.to, transfer, me.tag(solver::message::lse_backward, move.chunk));
  }
  void receive_chunk(const solver::chunk_move& move) {
    if (move.what == solver::chunk_move::kind::kv) return this->receive_kv(move);
    moved_query& m = moved_q.at(move.chunk);
    const index_t from = me.owner(move.chunk);
    comm.recv(m.q_dout.data(), q_elems, from, transfer, me.tag(solver::message::query_backward, move.chunk));
    comm.recv(m.q_dout.data() + q_elems, q_elems, from, transfer, me.tag(solver::message::d_out_backward, move.chunk));
    comm.recv(m.lse_delta.data(), 2 * lse_elems, from, transfer, me.tag(solver::message::lse_backward, move.chunk));
  }
  void compute(const solver::task& t, index_t stage, std::size_t i) {
    const auto [kc, vc] = this->kv_chunk(t.kv_chunk);
    const auto [dk_sum, dv_sum] = dkv(t.kv_chunk);
    const query_side s = query(t.query_chunk);
    sparse_backward<T, HeadDim>(
        this->index(stage, i),
        {.q = s.q, .k = kc, .v = vc, .d_out = s.d_out, .lse = s.lse, .delta = s.delta, .dq = s.dq, .dk = dk_sum, .dv = dv_sum}, this->scale,
        stream, {.mode = mode});
  }
  void check(index_t stage, const std::string& phase, bool moved) {
    const index_t rank = me.rank();
    const auto [dk_sum, dv_sum] = dkv(me.first_chunk());
    checks->begin();
    checks->add(dq32.data(), checked_tensor::queries("dQ", local, hq, dim));
    checks->add(dk_sum.data(), checked_tensor::solver_chunk(checked_tensor::kv_gradient("dK", local, hkv, dim, rank), rank, 0));
    checks->add(dv_sum.data(), checked_tensor::solver_chunk(checked_tensor::kv_gradient("dV", local, hkv, dim, rank), rank, 0));
    if (moved) {
      for (const auto& [chunk, m] : moved_q) checks->add(m.dq.data(), engine::moved_chunk(checked_tensor::queries("dQ", ct, hq, dim), this->p, chunk));
      for (const auto& [chunk, g] : moved_dkv) {
        checks->add(g.data(), engine::moved_chunk(checked_tensor::kv_gradient("dK", ct, hkv, dim, me.owner(chunk)), this->p, chunk));
        checks->add(g.data() + kv_elems, engine::moved_chunk(checked_tensor::kv_gradient("dV", ct, hkv, dim, me.owner(chunk)), this->p, chunk));
      }
    }
    checks->finish(rank, stage, phase);
  }
  void send_result(const solver::chunk_move& move) {
    const bool kv = move.what == solver::chunk_move::kind::kv;
    const device_buffer<float>& x = kv ? moved_dkv.at(move.chunk) : moved_q.at(move.chunk).dq;
    comm.send(x.data(), x.size(), me.owner(move.chunk), transfer, me.tag(kv ? solver::message::partial_dkv : solver::message::partial_dq, move.chunk));
  }
  void receive_result(const solver::chunk_move& move, std::size_t i) {
    const solver::message what = move.what == solver::chunk_move::kind::kv ? solver::message::partial_dkv : solver::message::partial_dq;
    comm.recv(returned.at(i).data(), returned.at(i).size(), move.to, transfer, me.tag(what, move.chunk));
  }
  void add_result(const solver::chunk_move& move, std::size_t i) {
    const float* x = returned.at(i).data();
    if (move.what == solver::chunk_move::kind::qo) return add_into(query(move.chunk).dq.data(), x, q_elems, stream);
    const auto [dk_sum, dv_sum] = dkv(move.chunk);
    add_into(dk_sum.data(), x, kv_elems, stream);
    add_into(dv_sum.data(), x + kv_elems, kv_elems, stream);
  }
  void finish() {
    const auto [dk_sum, dv_sum] = dkv(me.first_chunk());
    write_output(tensor_view<const float, 3>(dq32.data(), {local, hq, dim}), dq, stream);
    write_output(tensor_view<const float, 3>(dk_sum.data(), {local, hkv, dim}), dk, stream);
    write_output(tensor_view<const float, 3>(dv_sum.data(), {local, hkv, dim}), dv, stream);
    this->confirm_returns("the gradients");
  }
};

}  // namespace detail

/// This rank's forward (`tensors`: q, k, v in, out, lse out) as `plan` places its tasks (`run`: its streams;
/// the transfer stream is left with nothing pending past the call). q [m x tokens, Hq, D], k, v [m x tokens,
/// Hkv, D] are this rank's sequential shards (bf16 or fp16, device); writes out and the fp32 lse [Hq, m x
/// tokens]. With finite_check::every_step each stage's results are checked ("solver stage 0", "solver stage
/// 1").
template <index_t HeadDim = any_head_dim, class Comm, class T>
void solver_forward(Comm& comm, const solver::problem& p, const solver::plan& plan, const solver_task_indices& indices,
                    const forward_tensors<T>& tensors, double softmax_scale, run_options run) {
  const auto [q, k, v, out, lse] = tensors;
  const auto [stream, transfer_stream, check] = run;
  static_assert(check_device_communicator<Comm>());
  const solver::rank_chunks me = detail::checked_solver_call<HeadDim>(comm, p, plan, indices, q, k);
  const index_t hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2), local = q.extent(0);
  check_extents(v, {k.extent(0), hkv, dim}, "v");
  check_extents(out, {local, hq, dim}, "out");
  check_extents(lse, {hq, local}, "lse");
  detail::check_layout(lse, "lse", 4);
  detail::solver_forward_backend<HeadDim, Comm, T> backend(plan, check, out, lse, comm, p, me, indices, q, k, v, softmax_scale, stream, transfer_stream);
  engine::run_solver_plan(backend, plan, me, check);
}

/// This rank's backward (`tensors`: q, k, v, out, d_out, lse in; dq, dk, dv out) as `plan` places its tasks.
/// out and lse are the forward's results, d_out the incoming gradient (local shards). Writes dq and the
/// complete dk, dv of this rank's chunks; the gradients of moved chunks are summed in fp32 at their owners.
/// With finite_check::every_step each stage's dQ and dK/dV sums are checked.
template <index_t HeadDim = any_head_dim, class Comm, class T>
void solver_backward(Comm& comm, const solver::problem& p, const solver::plan& plan, const solver_task_indices& indices,
                     const backward_tensors<T>& tensors, double softmax_scale, determinism mode, run_options run) {
  const auto [q, k, v, out, d_out, lse, dq, dk, dv] = tensors;
  const auto [stream, transfer_stream, check] = run;
  static_assert(check_device_communicator<Comm>());
  const solver::rank_chunks me = detail::checked_solver_call<HeadDim>(comm, p, plan, indices, q, k);
  const index_t hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2), local = q.extent(0);
  check_backward_tensors(attention_shape{local, local, hq, hkv, dim}, out, d_out, lse, dq, dk, dv);
  detail::check_layout(lse, "lse", 4);
  detail::solver_backward_backend<HeadDim, Comm, T> backend(plan, check, out, lse, d_out, dq, dk, dv, mode, comm, p, me, indices, q, k, v, softmax_scale,
                                                            stream, transfer_stream);
  engine::run_solver_plan(backend, plan, me, check);
}

}  // namespace stria::device
