// SPDX-License-Identifier: Apache-2.0
// Device execution of a dynamic solver plan (DESIGN 9): one rank's part of attention when query/output
// and key/value chunks both move, on a device communicator (comm::local_device, comm::nccl).
// Sequential sharding: rank r holds chunks [r m, (r + 1) m), whose rows are contiguous in its
// token-major tensors, so a chunk travels as it lies. Forward: the plan's moves are posted in one
// group on the transfer stream while the local tasks compute (stage 0); the remote tasks (one chunk
// the rank's own, or both moved there) follow once the moves have arrived (stage 1); each moved
// query chunk's fp32 partial O and LSE then go back to the chunk's owner, which merges them into
// its running state. Backward: Q, dO, LSE and delta travel with a moved query chunk; its dQ and a
// moved KV chunk's fp32 dK/dV go back and are added by their owners. host/solver_attention.hpp is
// the same algorithm on the host (the tests' oracle). As in the ring engine, the host confirms each
// group of transfers through comm.wait() (bounded: a dead peer raises instead of hanging), the
// moves once stage 1 is queued and the returns before the call ends. Checked mode
// (finite_check::every_step) checks what the host execution checks, in the same order, with the
// ring's device pass (device/finite_check.cuh): after stage 0 the rank's own results; after stage
// 1 those and the partials computed here for other ranks, before they travel; and the rank's own
// results again once the returned partials are merged.
#pragma once

#include <cuda_runtime_api.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include <limits>
#include <map>
#include <optional>
#include <string>
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
#include "stria/device/ring_attention.cuh"
#include "stria/device/sparse_attention_step.cuh"
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

/// The checks every solver call makes: the indices belong to this rank and this plan.
inline solver::rank_chunks checked_solver_rank(const solver::problem& p, const solver::plan& plan, const solver_task_indices& indices,
                                               index_t rank, index_t world, index_t query_tokens, index_t kv_tokens, index_t heads_q,
                                               index_t heads_kv) {
  solver::rank_chunks me(p, plan, indices.seq_len, indices.heads, rank, world, query_tokens, kv_tokens, heads_q, heads_kv);
  if (indices.rank != rank || indices.local.size() != plan.local_tasks[static_cast<std::size_t>(rank)].size() ||
      indices.remote.size() != plan.remote_tasks[static_cast<std::size_t>(rank)].size())
    throw invalid_argument("indices.rank", indices.rank,
                           "must be the indices built for this rank (" + std::to_string(rank) + ") and this plan (an index built for another configuration?)");
  return me;
}

/// Rows [first, first + tokens) of a token-major tensor: contiguous, as the kernels need.
template <class T>
tensor_view<T, 3> chunk_view(T* data, index_t first, index_t tokens, index_t heads, index_t dim) {
  return tensor_view<T, 3>(data + static_cast<std::size_t>(first) * heads * dim, {tokens, heads, dim});
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

inline void fill(device_buffer<float>& x, float value, cudaStream_t stream) {
  thrust::fill(thrust::cuda::par.on(stream), x.data(), x.data() + x.size(), value);
}

/// Checked mode's name for a chunk computed here for its owner: positions in the owner's local tokens.
inline checked_tensor moved_chunk(const checked_tensor& t, const solver::problem& p, index_t chunk) {
  return checked_tensor::solver_chunk(t, p.owner(chunk), (chunk % p.chunks_per_rank) * p.chunk_tokens);
}

}  // namespace detail

/// This rank's forward as `plan` places its tasks, on `stream` (transfers on `transfer_stream`,
/// left with nothing pending past the call). q [m x tokens, Hq, D], k, v [m x tokens, Hkv, D] are
/// this rank's sequential shards (bf16 or fp16, device); writes out and the fp32 lse [Hq, m x tokens].
/// With finite_check::every_step each stage's results are checked ("solver stage 0", "solver stage 1").
template <index_t HeadDim = any_head_dim, class Comm, class T>
void solver_forward(Comm& comm, const solver::problem& p, const solver::plan& plan, const solver_task_indices& indices,
                    tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v, double softmax_scale,
                    tensor_view<T, 3> out, tensor_view<float, 2> lse, cudaStream_t stream, cudaStream_t transfer_stream,
                    finite_check check = finite_check::off) {
  static_assert(check_device_communicator<Comm>());
  using solver::message;
  const index_t rank = comm.rank(), hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2), local = q.extent(0);
  const solver::rank_chunks me = detail::checked_solver_rank(p, plan, indices, rank, comm.world_size(), local, k.extent(0), hq, hkv);
  attention_shape{local, k.extent(0), hq, hkv, dim}.validate();
  detail::check_head_dim<HeadDim>(dim);  // before any transfer or launch
  check_extents(v, {k.extent(0), hkv, dim}, "v");
  check_extents(out, {local, hq, dim}, "out");
  check_extents(lse, {hq, local}, "lse");
  detail::check_layout(lse, "lse", 4);
  const index_t ct = me.tokens();
  const std::size_t q_elems = me.elements(hq, dim), kv_elems = me.elements(hkv, dim), lse_elems = static_cast<std::size_t>(hq) * ct;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // The running state of this rank's query chunks: O [local, Hq, D] and one [Hq, tokens] LSE per chunk.
  device_buffer<float> running(static_cast<std::size_t>(local) * hq * dim, stream), running_lse(lse_elems * static_cast<std::size_t>(p.chunks_per_rank), stream);
  running.fill_bytes(0, stream);
  detail::fill(running_lse, neg_inf, stream);
  const auto own_state = [&](index_t chunk) {
    return std::pair{detail::chunk_view(running.data(), me.first_token(chunk), ct, hq, dim),
                     tensor_view<float, 2>(running_lse.data() + static_cast<std::size_t>(chunk - me.first_chunk()) * lse_elems, {hq, ct})};
  };
  struct moved_query {  // a query chunk computed here for its owner: Q, and its partial state
    device_buffer<T> q;
    device_buffer<float> out, lse;
  };
  struct returned_partial {  // a partial of an own query chunk computed elsewhere
    device_buffer<float> out, lse;
  };
  std::map<index_t, device_buffer<T>> moved_kv;  // [2, tokens, Hkv, D]: K then V
  std::map<index_t, moved_query> moved_q;
  std::map<std::size_t, returned_partial> returned;  // by move: a chunk may have moved to several ranks
  for (std::size_t i = 0; i < plan.moves.size(); ++i) {
    const solver::chunk_move& move = plan.moves[i];
    if (move.to == rank && move.what == solver::chunk_move::kind::kv) moved_kv.emplace(move.chunk, device_buffer<T>(2 * kv_elems, stream));
    if (move.to == rank && move.what == solver::chunk_move::kind::qo) {
      moved_query mq{device_buffer<T>(q_elems, stream), device_buffer<float>(q_elems, stream), device_buffer<float>(lse_elems, stream)};
      mq.out.fill_bytes(0, stream);
      detail::fill(mq.lse, neg_inf, stream);
      moved_q.emplace(move.chunk, std::move(mq));
    }
    if (me.owns(move.chunk) && move.what == solver::chunk_move::kind::qo)
      returned.emplace(i, returned_partial{device_buffer<float>(q_elems, stream), device_buffer<float>(lse_elems, stream)});
  }
  // Checked mode: the rank's own merged O and LSE (its chunks' LSEs gathered into `lse`), then
  // (`moved`) the partials computed here for other ranks.
  std::optional<step_check> checks;
  if (check == finite_check::every_step) checks.emplace(stream, 2 + 2 * moved_q.size());
  const auto check_stage = [&](index_t stage, bool moved) {
    checks->begin();
    checks->add(running.data(), checked_tensor::queries("O", local, hq, dim));
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c)
      detail::scatter_columns(own_state(c).second.data(), ct, hq, lse.data(), local, me.first_token(c), stream);
    checks->add(lse.data(), checked_tensor::lse(hq, local));
    if (moved)
      for (const auto& [chunk, mq] : moved_q) {
        checks->add(mq.out.data(), detail::moved_chunk(checked_tensor::queries("O", ct, hq, dim), p, chunk));
        checks->add(mq.lse.data(), detail::moved_chunk(checked_tensor::lse(hq, ct), p, chunk));
      }
    checks->finish(rank, stage, "solver stage " + std::to_string(stage));
  };

  // 1. The moves, in plan order on both sides of every pair (NCCL matches a pair's messages in order).
  const detail::transfers_before_release guard(stream, transfer_stream);  // after the buffers: destroyed before them
  wait_for(transfer_stream, stream);  // the inputs are ready and the receive buffers allocated
  comm.group_start();
  for (const solver::chunk_move& move : plan.moves) {
    const index_t first = me.owns(move.chunk) ? me.first_token(move.chunk) : 0;
    if (move.what == solver::chunk_move::kind::kv) {
      if (me.owns(move.chunk)) {
        comm.send(k.data() + static_cast<std::size_t>(first) * hkv * dim, kv_elems, move.to, transfer_stream, me.tag(message::kv, move.chunk));
        comm.send(v.data() + static_cast<std::size_t>(first) * hkv * dim, kv_elems, move.to, transfer_stream, me.tag(message::kv_values, move.chunk));
      } else if (move.to == rank) {
        T* into = moved_kv.at(move.chunk).data();
        comm.recv(into, kv_elems, me.owner(move.chunk), transfer_stream, me.tag(message::kv, move.chunk));
        comm.recv(into + kv_elems, kv_elems, me.owner(move.chunk), transfer_stream, me.tag(message::kv_values, move.chunk));
      }
    } else if (me.owns(move.chunk)) {
      comm.send(q.data() + static_cast<std::size_t>(first) * hq * dim, q_elems, move.to, transfer_stream, me.tag(message::query, move.chunk));
    } else if (move.to == rank) {
      comm.recv(moved_q.at(move.chunk).q.data(), q_elems, me.owner(move.chunk), transfer_stream, me.tag(message::query, move.chunk));
    }
  }
  comm.group_end();
  cuda_event arrived;
  arrived.record(transfer_stream);

  // 2. Stage 0: this rank's own tasks, while the moves travel.
  const auto own_kv = [&](index_t chunk) {
    return std::pair{detail::chunk_view(k.data(), me.first_token(chunk), ct, hkv, dim), detail::chunk_view(v.data(), me.first_token(chunk), ct, hkv, dim)};
  };
  const auto arrived_kv = [&](index_t chunk) {
    const T* packed = moved_kv.at(chunk).data();
    return std::pair{tensor_view<const T, 3>(packed, {ct, hkv, dim}), tensor_view<const T, 3>(packed + kv_elems, {ct, hkv, dim})};
  };
  const auto& local_tasks = plan.local_tasks[static_cast<std::size_t>(rank)];
  for (std::size_t t = 0; t < local_tasks.size(); ++t) {
    const auto [kc, vc] = own_kv(local_tasks[t].kv_chunk);
    const auto [o, l] = own_state(local_tasks[t].query_chunk);
    sparse_forward<T, HeadDim>(indices.local[t], detail::chunk_view(q.data(), me.first_token(local_tasks[t].query_chunk), ct, hq, dim), kc, vc,
                               softmax_scale, o, l, running_state::merge, stream);
  }
  if (checks) check_stage(0, false);

  // 3. Stage 1: the remote tasks, once the moves have arrived.
  arrived.make_wait(stream);
  const auto& remote_tasks = plan.remote_tasks[static_cast<std::size_t>(rank)];
  for (std::size_t t = 0; t < remote_tasks.size(); ++t) {
    const solver::task& task = remote_tasks[t];
    // Each chunk is this rank's own or moved here (both moved: a third rank's work).
    if (!me.owns(task.kv_chunk) && !moved_kv.contains(task.kv_chunk)) throw me.missing_move("KV", task.kv_chunk);
    const auto [kc, vc] = me.owns(task.kv_chunk) ? own_kv(task.kv_chunk) : arrived_kv(task.kv_chunk);
    if (me.owns(task.query_chunk)) {
      const auto [o, l] = own_state(task.query_chunk);
      sparse_forward<T, HeadDim>(indices.remote[t], detail::chunk_view(q.data(), me.first_token(task.query_chunk), ct, hq, dim), kc, vc,
                                 softmax_scale, o, l, running_state::merge, stream);
    } else {
      const auto it = moved_q.find(task.query_chunk);
      if (it == moved_q.end()) throw me.missing_move("query", task.query_chunk);
      sparse_forward<T, HeadDim>(indices.remote[t], tensor_view<const T, 3>(it->second.q.data(), {ct, hq, dim}), kc, vc, softmax_scale,
                                 tensor_view<float, 3>(it->second.out.data(), {ct, hq, dim}),
                                 tensor_view<float, 2>(it->second.lse.data(), {hq, ct}), running_state::merge, stream);
    }
  }

  if (checks) check_stage(1, true);  // before any partial travels: a NaN is named where it first appears

  // 4. Partials home: one for every query chunk that moved here (even if no task used it).
  wait_for(transfer_stream, stream);
  comm.group_start();
  for (std::size_t i = 0; i < plan.moves.size(); ++i) {
    const solver::chunk_move& move = plan.moves[i];
    if (move.what != solver::chunk_move::kind::qo) continue;
    if (move.to == rank) {
      const moved_query& mq = moved_q.at(move.chunk);
      comm.send(mq.out.data(), q_elems, me.owner(move.chunk), transfer_stream, me.tag(message::partial_out, move.chunk));
      comm.send(mq.lse.data(), lse_elems, me.owner(move.chunk), transfer_stream, me.tag(message::partial_lse, move.chunk));
    } else if (me.owns(move.chunk)) {
      returned_partial& r = returned.at(i);
      comm.recv(r.out.data(), q_elems, move.to, transfer_stream, me.tag(message::partial_out, move.chunk));
      comm.recv(r.lse.data(), lse_elems, move.to, transfer_stream, me.tag(message::partial_lse, move.chunk));
    }
  }
  comm.group_end();
  cuda_event partials_home;
  partials_home.record(transfer_stream);
  comm.wait(arrived.get(), "the chunks the plan moves to rank " + std::to_string(rank));
  wait_for(stream, transfer_stream);
  for (auto& [i, r] : returned) {  // plan order: deterministic
    const auto [o, l] = own_state(plan.moves[i].chunk);
    const std::int64_t rows = static_cast<std::int64_t>(ct) * hq;
    kernel::merge_partial<float><<<stria::detail::blocks_for(rows * 32, 256), 256, 0, stream>>>(o.data(), l.data(), r.out.data(), r.lse.data(), ct, hq, dim);
    STRIA_CUDA_CHECK_LAUNCH("merge_partial");
  }
  if (checks) check_stage(1, false);
  write_output(tensor_view<const float, 3>(running.data(), {local, hq, dim}), out, stream);
  for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c)
    detail::scatter_columns(own_state(c).second.data(), ct, hq, lse.data(), local, me.first_token(c), stream);
  comm.wait(partials_home.get(), "the partial results returned to or from rank " + std::to_string(rank));
}

/// This rank's backward as `plan` places its tasks. out and lse are the forward's results, d_out
/// the incoming gradient (local shards). Writes dq and the complete dk, dv of this rank's chunks;
/// the gradients of moved chunks are summed in fp32 at their owners. With finite_check::every_step
/// each stage's dQ and dK/dV sums are checked.
template <index_t HeadDim = any_head_dim, class Comm, class T>
void solver_backward(Comm& comm, const solver::problem& p, const solver::plan& plan, const solver_task_indices& indices,
                     tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v, tensor_view<const T, 3> out,
                     tensor_view<const T, 3> d_out, tensor_view<const float, 2> lse, double softmax_scale, tensor_view<T, 3> dq,
                     tensor_view<T, 3> dk, tensor_view<T, 3> dv, determinism mode, cudaStream_t stream, cudaStream_t transfer_stream,
                     finite_check check = finite_check::off) {
  static_assert(check_device_communicator<Comm>());
  using solver::message;
  const index_t rank = comm.rank(), hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2), local = q.extent(0);
  const solver::rank_chunks me = detail::checked_solver_rank(p, plan, indices, rank, comm.world_size(), local, k.extent(0), hq, hkv);
  attention_shape{local, k.extent(0), hq, hkv, dim}.validate();
  detail::check_head_dim<HeadDim>(dim);  // before any transfer or launch
  for (auto [x, name] : {std::pair{out, "out"}, std::pair{d_out, "d_out"}}) check_extents(x, {local, hq, dim}, name);
  check_extents(lse, {hq, local}, "lse");
  check_extents(dq, {local, hq, dim}, "dq");
  check_extents(dk, {local, hkv, dim}, "dk");
  check_extents(dv, {local, hkv, dim}, "dv");
  detail::check_layout(lse, "lse", 4);
  const index_t ct = me.tokens();
  const std::size_t q_elems = me.elements(hq, dim), kv_elems = me.elements(hkv, dim), lse_elems = static_cast<std::size_t>(hq) * ct;
  const auto chunk_slot = [&](index_t chunk) { return static_cast<std::size_t>(chunk - me.first_chunk()); };

  // Per own query chunk: LSE and delta = rowsum(dO O), [2, Hq, tokens] each (so one message moves both).
  device_buffer<float> lse_delta(2 * lse_elems * static_cast<std::size_t>(p.chunks_per_rank), stream);
  for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) {
    float* at = lse_delta.data() + 2 * lse_elems * chunk_slot(c);
    detail::gather_columns(lse.data(), local, me.first_token(c), at, ct, hq, stream);
    backward_delta(detail::chunk_view(out.data(), me.first_token(c), ct, hq, dim), detail::chunk_view(d_out.data(), me.first_token(c), ct, hq, dim),
                   tensor_view<float, 2>(at + lse_elems, {hq, ct}), stream);
  }
  device_buffer<float> dq32(static_cast<std::size_t>(local) * hq * dim, stream), dkv32(2 * static_cast<std::size_t>(local) * hkv * dim, stream);
  dq32.fill_bytes(0, stream);
  dkv32.fill_bytes(0, stream);
  float* const dk32 = dkv32.data();
  float* const dv32 = dkv32.data() + static_cast<std::size_t>(local) * hkv * dim;

  struct moved_query {  // Q and dO [2, tokens, Hq, D], LSE and delta [2, Hq, tokens], its dQ sum here
    device_buffer<T> q_dout;
    device_buffer<float> lse_delta, dq;
  };
  struct moved_kv {  // K and V [2, tokens, Hkv, D], its dK/dV sums here [2, tokens, Hkv, D]
    device_buffer<T> kv;
    device_buffer<float> dkv;
  };
  std::map<index_t, moved_query> moved_q;
  std::map<index_t, moved_kv> moved_k;
  std::map<std::size_t, device_buffer<float>> returned;  // by move: a gradient sum of an own chunk from elsewhere
  for (std::size_t i = 0; i < plan.moves.size(); ++i) {
    const solver::chunk_move& move = plan.moves[i];
    const bool kv = move.what == solver::chunk_move::kind::kv;
    if (move.to == rank && kv) {
      moved_k.emplace(move.chunk, moved_kv{device_buffer<T>(2 * kv_elems, stream), device_buffer<float>(2 * kv_elems, stream)});
      moved_k.at(move.chunk).dkv.fill_bytes(0, stream);
    } else if (move.to == rank) {
      moved_q.emplace(move.chunk, moved_query{device_buffer<T>(2 * q_elems, stream), device_buffer<float>(2 * lse_elems, stream),
                                              device_buffer<float>(q_elems, stream)});
      moved_q.at(move.chunk).dq.fill_bytes(0, stream);
    } else if (me.owns(move.chunk)) {
      returned.emplace(i, device_buffer<float>(kv ? 2 * kv_elems : q_elems, stream));
    }
  }
  // Checked mode: the rank's own dQ, dK and dV sums, then (`moved`) the sums computed here for other ranks.
  std::optional<step_check> checks;
  if (check == finite_check::every_step) checks.emplace(stream, 3 + moved_q.size() + 2 * moved_k.size());
  const auto check_stage = [&](index_t stage, bool moved) {
    checks->begin();
    checks->add(dq32.data(), checked_tensor::queries("dQ", local, hq, dim));
    checks->add(dk32, checked_tensor::solver_chunk(checked_tensor::kv_gradient("dK", local, hkv, dim, rank), rank, 0));
    checks->add(dv32, checked_tensor::solver_chunk(checked_tensor::kv_gradient("dV", local, hkv, dim, rank), rank, 0));
    if (moved) {
      for (const auto& [chunk, mq] : moved_q) checks->add(mq.dq.data(), detail::moved_chunk(checked_tensor::queries("dQ", ct, hq, dim), p, chunk));
      for (const auto& [chunk, mk] : moved_k) {
        checks->add(mk.dkv.data(), detail::moved_chunk(checked_tensor::kv_gradient("dK", ct, hkv, dim, p.owner(chunk)), p, chunk));
        checks->add(mk.dkv.data() + kv_elems, detail::moved_chunk(checked_tensor::kv_gradient("dV", ct, hkv, dim, p.owner(chunk)), p, chunk));
      }
    }
    checks->finish(rank, stage, "solver stage " + std::to_string(stage));
  };

  // 1. The moves, in plan order on both sides of every pair.
  const detail::transfers_before_release guard(stream, transfer_stream);  // after the buffers: destroyed before them
  wait_for(transfer_stream, stream);
  comm.group_start();
  for (const solver::chunk_move& move : plan.moves) {
    const bool kv = move.what == solver::chunk_move::kind::kv;
    const int tag = me.tag(kv ? message::kv : message::query_backward, move.chunk);
    const int second_tag = me.tag(kv ? message::kv_values : message::d_out_backward, move.chunk);
    if (me.owns(move.chunk)) {
      const std::size_t first = static_cast<std::size_t>(me.first_token(move.chunk));
      if (kv) {
        comm.send(k.data() + first * hkv * dim, kv_elems, move.to, transfer_stream, tag);
        comm.send(v.data() + first * hkv * dim, kv_elems, move.to, transfer_stream, second_tag);
      } else {
        comm.send(q.data() + first * hq * dim, q_elems, move.to, transfer_stream, tag);
        comm.send(d_out.data() + first * hq * dim, q_elems, move.to, transfer_stream, second_tag);
        comm.send(lse_delta.data() + 2 * lse_elems * chunk_slot(move.chunk), 2 * lse_elems, move.to, transfer_stream,
                  me.tag(message::lse_backward, move.chunk));
      }
    } else if (move.to == rank) {
      if (kv) {
        T* into = moved_k.at(move.chunk).kv.data();
        comm.recv(into, kv_elems, me.owner(move.chunk), transfer_stream, tag);
        comm.recv(into + kv_elems, kv_elems, me.owner(move.chunk), transfer_stream, second_tag);
      } else {
        moved_query& mq = moved_q.at(move.chunk);
        comm.recv(mq.q_dout.data(), q_elems, me.owner(move.chunk), transfer_stream, tag);
        comm.recv(mq.q_dout.data() + q_elems, q_elems, me.owner(move.chunk), transfer_stream, second_tag);
        comm.recv(mq.lse_delta.data(), 2 * lse_elems, me.owner(move.chunk), transfer_stream, me.tag(message::lse_backward, move.chunk));
      }
    }
  }
  comm.group_end();
  cuda_event arrived;
  arrived.record(transfer_stream);

  // One task: its query side (own or moved) and KV side (own or moved), gradients into their sums.
  struct query_side {
    tensor_view<const T, 3> q, d_out;
    tensor_view<const float, 2> lse, delta;
    tensor_view<float, 3> dq;
  };
  struct kv_side {
    tensor_view<const T, 3> k, v;
    tensor_view<float, 3> dk, dv;
  };
  const auto own_query = [&](index_t c) {
    const float* at = lse_delta.data() + 2 * lse_elems * chunk_slot(c);
    return query_side{detail::chunk_view(q.data(), me.first_token(c), ct, hq, dim), detail::chunk_view(d_out.data(), me.first_token(c), ct, hq, dim),
                      tensor_view<const float, 2>(at, {hq, ct}), tensor_view<const float, 2>(at + lse_elems, {hq, ct}),
                      detail::chunk_view(dq32.data(), me.first_token(c), ct, hq, dim)};
  };
  const auto own_kv = [&](index_t c) {
    return kv_side{detail::chunk_view(k.data(), me.first_token(c), ct, hkv, dim), detail::chunk_view(v.data(), me.first_token(c), ct, hkv, dim),
                   detail::chunk_view(dk32, me.first_token(c), ct, hkv, dim), detail::chunk_view(dv32, me.first_token(c), ct, hkv, dim)};
  };
  const auto run = [&](const device_step_index& index, const query_side& qs, const kv_side& ks) {
    sparse_backward<T, HeadDim>(index, qs.q, ks.k, ks.v, qs.d_out, qs.lse, qs.delta, softmax_scale, qs.dq, ks.dk, ks.dv, mode, stream);
  };

  // 2. Stage 0: own tasks while the moves travel. 3. Stage 1: remote tasks once they have arrived.
  const auto& local_tasks = plan.local_tasks[static_cast<std::size_t>(rank)];
  for (std::size_t t = 0; t < local_tasks.size(); ++t) run(indices.local[t], own_query(local_tasks[t].query_chunk), own_kv(local_tasks[t].kv_chunk));
  if (checks) check_stage(0, false);
  arrived.make_wait(stream);
  const auto& remote_tasks = plan.remote_tasks[static_cast<std::size_t>(rank)];
  const auto moved_kv_side = [&](index_t c) {
    const auto it = moved_k.find(c);
    if (it == moved_k.end()) throw me.missing_move("KV", c);
    const T* kv = it->second.kv.data();
    float* g = it->second.dkv.data();
    return kv_side{tensor_view<const T, 3>(kv, {ct, hkv, dim}), tensor_view<const T, 3>(kv + kv_elems, {ct, hkv, dim}),
                   tensor_view<float, 3>(g, {ct, hkv, dim}), tensor_view<float, 3>(g + kv_elems, {ct, hkv, dim})};
  };
  const auto moved_query_side = [&](index_t c) {
    const auto it = moved_q.find(c);
    if (it == moved_q.end()) throw me.missing_move("query", c);
    const moved_query& mq = it->second;
    return query_side{tensor_view<const T, 3>(mq.q_dout.data(), {ct, hq, dim}), tensor_view<const T, 3>(mq.q_dout.data() + q_elems, {ct, hq, dim}),
                      tensor_view<const float, 2>(mq.lse_delta.data(), {hq, ct}), tensor_view<const float, 2>(mq.lse_delta.data() + lse_elems, {hq, ct}),
                      tensor_view<float, 3>(mq.dq.data(), {ct, hq, dim})};
  };
  for (std::size_t t = 0; t < remote_tasks.size(); ++t) {  // each chunk its own or moved here (both: a third rank's work)
    const solver::task& task = remote_tasks[t];
    const kv_side ks = me.owns(task.kv_chunk) ? own_kv(task.kv_chunk) : moved_kv_side(task.kv_chunk);
    run(indices.remote[t], me.owns(task.query_chunk) ? own_query(task.query_chunk) : moved_query_side(task.query_chunk), ks);
  }

  if (checks) check_stage(1, true);  // before any sum travels: a NaN is named where it first appears

  // 4. Gradients home, in plan order; the owners add them in fp32.
  wait_for(transfer_stream, stream);
  comm.group_start();
  for (std::size_t i = 0; i < plan.moves.size(); ++i) {
    const solver::chunk_move& move = plan.moves[i];
    const bool kv = move.what == solver::chunk_move::kind::kv;
    const int tag = me.tag(kv ? message::partial_dkv : message::partial_dq, move.chunk);
    if (move.to == rank) {
      if (kv) comm.send(moved_k.at(move.chunk).dkv.data(), 2 * kv_elems, me.owner(move.chunk), transfer_stream, tag);
      else comm.send(moved_q.at(move.chunk).dq.data(), q_elems, me.owner(move.chunk), transfer_stream, tag);
    } else if (me.owns(move.chunk)) {
      device_buffer<float>& into = returned.at(i);
      comm.recv(into.data(), into.size(), move.to, transfer_stream, tag);
    }
  }
  comm.group_end();
  cuda_event gradients_home;
  gradients_home.record(transfer_stream);
  comm.wait(arrived.get(), "the chunks the plan moves to rank " + std::to_string(rank));
  wait_for(stream, transfer_stream);
  for (const auto& [i, sum] : returned) {
    const solver::chunk_move& move = plan.moves[i];
    const std::size_t first = static_cast<std::size_t>(me.first_token(move.chunk));
    if (move.what == solver::chunk_move::kind::kv) {
      detail::add_into(dk32 + first * hkv * dim, sum.data(), kv_elems, stream);
      detail::add_into(dv32 + first * hkv * dim, sum.data() + kv_elems, kv_elems, stream);
    } else {
      detail::add_into(dq32.data() + first * hq * dim, sum.data(), q_elems, stream);
    }
  }
  if (checks) check_stage(1, false);
  write_output(tensor_view<const float, 3>(dq32.data(), {local, hq, dim}), dq, stream);
  write_output(tensor_view<const float, 3>(dk32, {local, hkv, dim}), dk, stream);
  write_output(tensor_view<const float, 3>(dv32, {local, hkv, dim}), dv, stream);
  comm.wait(gradients_home.get(), "the gradients returned to or from rank " + std::to_string(rank));
}

}  // namespace stria::device
