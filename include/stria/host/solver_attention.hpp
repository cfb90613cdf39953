// SPDX-License-Identifier: Apache-2.0
// Host execution of a dynamic solver plan (DESIGN 9): one rank's part of attention when query/output
// and key/value chunks both move. Sequential sharding: rank r holds chunks [r m, (r + 1) m).
// Forward: the rank sends the chunks the plan moves (K and V, or Q), computes its local tasks
// (stage 0), receives what moved to it, computes its remote tasks (stage 1: one chunk its own, or
// both moved there), and returns each moved
// query chunk's partial O and LSE to the chunk's owner, which merges them into its fp32 running
// state. Backward: Q, O, dO and LSE travel with a moved query chunk; the dQ of a moved query chunk
// and the fp32 dK/dV of a moved KV chunk go back to their owners and are added there. The oracle for
// the device execution; communicator: the host_threads surface (buffered sends, blocking receives).
// Checked mode (finite_check::every_step) verifies each stage's results: after stage 0 the rank's
// own O and LSE (backward: dQ, dK, dV); after stage 1 those and the partials computed here for
// other ranks, before they travel, and the rank's own results again once the returned partials
// are merged (a sum of finite gradients can overflow). The first NaN or infinity raises
// non_finite_error naming rank, stage, tensor, head and token.
#pragma once

#include <cstddef>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/host/reference_attention.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/index/local_index.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/solver/execution.hpp"

namespace stria::host {

namespace detail {

/// Rows of one of this rank's chunks in fp32: [tokens, heads, D].
template <class T>
std::vector<float> chunk_rows(const solver::rank_chunks& me, tensor_view<const T, 3> x, index_t chunk) {
  std::vector<float> y;
  y.reserve(me.elements(x.extent(1), x.extent(2)));
  const index_t first = me.first_token(chunk);
  for (index_t t = first; t < first + me.tokens(); ++t)
    for (index_t h = 0; h < x.extent(1); ++h)
      for (index_t d = 0; d < x.extent(2); ++d) y.push_back(float(x(t, h, d)));
  return y;
}

/// K then V of one of this rank's chunks, in fp32 and one buffer ([2, tokens, Hkv, D]: one message).
template <class T>
std::vector<float> chunk_kv(const solver::rank_chunks& me, tensor_view<const T, 3> k, tensor_view<const T, 3> v, index_t chunk) {
  std::vector<float> x = chunk_rows(me, k, chunk);
  const std::vector<float> values = chunk_rows(me, v, chunk);
  x.insert(x.end(), values.begin(), values.end());
  return x;
}

/// The LSE columns of one of this rank's chunks: [Hq, tokens].
inline std::vector<float> chunk_lse(const solver::rank_chunks& me, tensor_view<const float, 2> lse, index_t chunk) {
  std::vector<float> y;
  const index_t first = me.first_token(chunk);
  for (index_t h = 0; h < lse.extent(0); ++h)
    for (index_t t = first; t < first + me.tokens(); ++t) y.push_back(lse(h, t));
  return y;
}

/// The sparse index of query chunk i against KV chunk j (both chunk-local).
inline step_index task_index(const global_selection& g, const solver::problem& p, const solver::task& t) {
  return build_local_index(g, sharding::sequential{}, p.num_chunks(), t.query_chunk, t.kv_chunk);
}

/// The value of `key` in `cache`, made by make(key) the first time (a rank's own chunks are
/// converted once, however many tasks use them).
template <class Value, class Make>
const Value& cached(std::map<index_t, Value>& cache, index_t key, const Make& make) {
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make(key)).first;
  return it->second;
}

/// Checked mode's view of a rank's own results: its chunks' fp32 [tokens, heads, D] rows (chunk(c)
/// points at chunk c's), laid out as the rank's whole shard [m x tokens, heads, D].
template <class Chunk>
std::vector<float> whole_rows(const solver::rank_chunks& me, std::size_t chunk_elements, const Chunk& chunk) {
  std::vector<float> whole;
  for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) whole.insert(whole.end(), chunk(c), chunk(c) + chunk_elements);
  return whole;
}

/// The same for an LSE: chunk(c) points at chunk c's [Hq, tokens]; the result is [Hq, m x tokens].
template <class Chunk>
std::vector<float> whole_lse(const solver::rank_chunks& me, index_t heads, const Chunk& chunk) {
  std::vector<float> whole;
  const index_t tokens = me.tokens();
  for (index_t h = 0; h < heads; ++h)
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) whole.insert(whole.end(), chunk(c) + h * tokens, chunk(c) + (h + 1) * tokens);
  return whole;
}

/// The local token where chunk `chunk` starts on its owner (chunks_per_rank chunks of `tokens` each).
inline index_t owner_first_token(const solver::problem& p, index_t chunk) { return (chunk % p.chunks_per_rank) * p.chunk_tokens; }

template <class Comm>
void send_vector(Comm& comm, const std::vector<float>& x, index_t to, int tag) {
  comm.send(x.data(), x.size(), to, tag);
}
template <class Comm>
std::vector<float> recv_vector(Comm& comm, std::size_t count, index_t from, int tag) {
  std::vector<float> x(count);
  comm.recv(x.data(), count, from, tag);
  return x;
}

}  // namespace detail

/// This rank's forward as `plan` places the tasks of `g` (p = the problem the plan solved, e.g.
/// solver::problem_from_selection(g, W, m, Hkv)). q [m x tokens, Hq, D], k, v [m x tokens, Hkv, D]
/// are this rank's sequential shards; writes out and the fp32 lse [Hq, m x tokens] of the whole
/// sequence's attention for the local queries. With finite_check::every_step each stage's results
/// are checked ("solver stage 0", "solver stage 1").
template <class Comm, class T>
void solver_forward(Comm& comm, const solver::problem& p, const solver::plan& plan, const global_selection& g, tensor_view<const T, 3> q,
                    tensor_view<const T, 3> k, tensor_view<const T, 3> v, double softmax_scale, tensor_view<T, 3> out, tensor_view<float, 2> lse,
                    finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  using solver::message;
  const index_t rank = comm.rank(), hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2);
  const solver::rank_chunks me(p, plan, g.seq_len, g.num_heads(), rank, comm.world_size(), q.extent(0), k.extent(0), hq, hkv);
  check_extents(v, {k.extent(0), hkv, dim}, "v");
  check_extents(out, {q.extent(0), hq, dim}, "out");
  check_extents(lse, {hq, q.extent(0)}, "lse");
  const index_t ct = me.tokens();
  const std::size_t q_elems = me.elements(hq, dim), kv_elems = me.elements(hkv, dim), lse_elems = static_cast<std::size_t>(hq) * ct;
  const auto packed_kv = [&](index_t chunk) { return detail::chunk_kv(me, k, v, chunk); };
  // 1. What this rank's chunks owe other ranks.
  for (const solver::chunk_move& move : plan.moves) {
    if (!me.owns(move.chunk)) continue;
    if (move.what == solver::chunk_move::kind::kv) detail::send_vector(comm, packed_kv(move.chunk), move.to, me.tag(message::kv, move.chunk));
    else detail::send_vector(comm, detail::chunk_rows(me, q, move.chunk), move.to, me.tag(message::query, move.chunk));
  }

  struct partial {  // fp32 running O [tokens, Hq, D] and LSE [Hq, tokens] of one query chunk
    std::vector<float> out, lse;
  };
  const auto empty_partial = [&] { return partial{std::vector<float>(q_elems, 0.0f), std::vector<float>(lse_elems, -std::numeric_limits<float>::infinity())}; };
  std::map<index_t, partial> running;  // own query chunks
  for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) running.emplace(c, empty_partial());
  std::map<index_t, partial> returned;  // moved-in query chunks: their partials go back
  std::map<index_t, std::vector<float>> own_q, own_kv, moved_q, moved_kv;
  partial part = empty_partial();
  const auto run_task = [&](const solver::task& t, const std::vector<float>& q_chunk, const std::vector<float>& kv_chunk, partial& into) {
    const step_index index = detail::task_index(g, p, t);
    reference_forward<float>(tensor_view<const float, 3>(q_chunk.data(), {ct, hq, dim}), tensor_view<const float, 3>(kv_chunk.data(), {ct, hkv, dim}),
                             tensor_view<const float, 3>(kv_chunk.data() + kv_elems, {ct, hkv, dim}), index.view(), softmax_scale,
                             tensor_view<float, 3>(part.out.data(), {ct, hq, dim}), tensor_view<float, 2>(part.lse.data(), {hq, ct}));
    merge_partial<float>(tensor_view<float, 3>(into.out.data(), {ct, hq, dim}), tensor_view<float, 2>(into.lse.data(), {hq, ct}),
                         tensor_view<const float, 3>(part.out.data(), {ct, hq, dim}), tensor_view<const float, 2>(part.lse.data(), {hq, ct}));
  };
  const auto own_query = [&](index_t c) -> const std::vector<float>& {
    return detail::cached(own_q, c, [&](index_t x) { return detail::chunk_rows(me, q, x); });
  };
  const auto own_kv_chunk = [&](index_t c) -> const std::vector<float>& { return detail::cached(own_kv, c, packed_kv); };
  // Checked mode: the rank's own merged O and LSE, then (`moved`) the partials computed here for other ranks.
  const bool checked = check == finite_check::every_step;
  const auto check_stage = [&](index_t stage, bool moved) {
    const std::string phase = "solver stage " + std::to_string(stage);
    const index_t local = q.extent(0);
    check_finite(std::span<const float>(detail::whole_rows(me, q_elems, [&](index_t c) { return running.at(c).out.data(); })),
                 checked_tensor::queries("O", local, hq, dim), rank, stage, phase);
    check_finite(std::span<const float>(detail::whole_lse(me, hq, [&](index_t c) { return running.at(c).lse.data(); })),
                 checked_tensor::lse(hq, local), rank, stage, phase);
    if (!moved) return;
    for (const auto& [chunk, result] : returned) {
      const index_t owner = p.owner(chunk), first = detail::owner_first_token(p, chunk);
      check_finite(std::span<const float>(result.out), checked_tensor::solver_chunk(checked_tensor::queries("O", ct, hq, dim), owner, first), rank,
                   stage, phase);
      check_finite(std::span<const float>(result.lse), checked_tensor::solver_chunk(checked_tensor::lse(hq, ct), owner, first), rank, stage, phase);
    }
  };

  // 2. Stage 0: tasks of this rank's own chunks, while the moves travel.
  for (const solver::task& t : plan.local_tasks[static_cast<std::size_t>(rank)])
    run_task(t, own_query(t.query_chunk), own_kv_chunk(t.kv_chunk), running.at(t.query_chunk));
  if (checked) check_stage(0, false);

  // 3. What moved here.
  for (const solver::chunk_move& move : plan.moves) {
    if (move.to != rank) continue;
    const index_t from = p.owner(move.chunk);
    if (move.what == solver::chunk_move::kind::kv) moved_kv.emplace(move.chunk, detail::recv_vector(comm, 2 * kv_elems, from, me.tag(message::kv, move.chunk)));
    else {
      moved_q.emplace(move.chunk, detail::recv_vector(comm, q_elems, from, me.tag(message::query, move.chunk)));
      returned.emplace(move.chunk, empty_partial());  // returned even if no task used it, so the owner never waits in vain
    }
  }

  // 4. Stage 1: the remote tasks. Each chunk is this rank's own or moved here; a task may use two
  // moved chunks (a third rank's work: the query's partial goes home like any moved query's).
  for (const solver::task& t : plan.remote_tasks[static_cast<std::size_t>(rank)]) {
    const std::vector<float>* kv_chunk = nullptr;
    if (me.owns(t.kv_chunk)) kv_chunk = &own_kv_chunk(t.kv_chunk);
    else if (const auto kv = moved_kv.find(t.kv_chunk); kv != moved_kv.end()) kv_chunk = &kv->second;
    else throw me.missing_move("KV", t.kv_chunk);
    if (me.owns(t.query_chunk)) {
      run_task(t, own_query(t.query_chunk), *kv_chunk, running.at(t.query_chunk));
    } else {
      const auto qc = moved_q.find(t.query_chunk);
      if (qc == moved_q.end()) throw me.missing_move("query", t.query_chunk);
      run_task(t, qc->second, *kv_chunk, returned.at(t.query_chunk));
    }
  }

  // Checked before any partial travels: a NaN is named on the rank where it first appears.
  if (checked) check_stage(1, true);

  // 5. Partials home: sent for every query chunk that moved here, merged by its owner in fp32.
  for (const auto& [chunk, result] : returned) {
    detail::send_vector(comm, result.out, p.owner(chunk), me.tag(message::partial_out, chunk));
    detail::send_vector(comm, result.lse, p.owner(chunk), me.tag(message::partial_lse, chunk));
  }
  for (const solver::chunk_move& move : plan.moves) {
    if (move.what != solver::chunk_move::kind::qo || !me.owns(move.chunk)) continue;
    part.out = detail::recv_vector(comm, q_elems, move.to, me.tag(message::partial_out, move.chunk));
    part.lse = detail::recv_vector(comm, lse_elems, move.to, me.tag(message::partial_lse, move.chunk));
    partial& into = running.at(move.chunk);
    merge_partial<float>(tensor_view<float, 3>(into.out.data(), {ct, hq, dim}), tensor_view<float, 2>(into.lse.data(), {hq, ct}),
                         tensor_view<const float, 3>(part.out.data(), {ct, hq, dim}), tensor_view<const float, 2>(part.lse.data(), {hq, ct}));
  }
  if (checked) check_stage(1, false);
  for (const auto& [chunk, result] : running) {
    const index_t first = me.first_token(chunk);
    for (index_t t = 0, i = 0; t < ct; ++t)
      for (index_t h = 0; h < hq; ++h)
        for (index_t d = 0; d < dim; ++d) out(first + t, h, d) = T(result.out[static_cast<std::size_t>(i++)]);
    for (index_t h = 0; h < hq; ++h)
      for (index_t t = 0; t < ct; ++t) lse(h, first + t) = result.lse[static_cast<std::size_t>(h) * ct + t];
  }
}

/// This rank's backward as `plan` places the tasks. out and lse are the forward's results, d_out
/// the incoming gradient (all local shards). Writes dq and the complete dk, dv of this rank's
/// chunks; the partial gradients of moved chunks are summed in fp32 at their owners. With
/// finite_check::every_step each stage's dQ and dK/dV sums are checked.
template <class Comm, class T>
void solver_backward(Comm& comm, const solver::problem& p, const solver::plan& plan, const global_selection& g, tensor_view<const T, 3> q,
                     tensor_view<const T, 3> k, tensor_view<const T, 3> v, tensor_view<const T, 3> out, tensor_view<const T, 3> d_out,
                     tensor_view<const float, 2> lse, double softmax_scale, tensor_view<T, 3> dq, tensor_view<T, 3> dk, tensor_view<T, 3> dv,
                     finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  using solver::message;
  const index_t rank = comm.rank(), hq = q.extent(1), hkv = k.extent(1), dim = q.extent(2);
  const solver::rank_chunks me(p, plan, g.seq_len, g.num_heads(), rank, comm.world_size(), q.extent(0), k.extent(0), hq, hkv);
  const attention_shape shape{q.extent(0), k.extent(0), hq, hkv, dim};
  shape.validate();
  detail::check_backward_tensors(shape, out, d_out, lse, dq, dk, dv);
  const index_t ct = me.tokens();
  const std::size_t q_elems = me.elements(hq, dim), kv_elems = me.elements(hkv, dim), lse_elems = static_cast<std::size_t>(hq) * ct;

  // A query chunk's backward inputs, [3, tokens, Hq, D] (Q, O, dO), and its LSE [Hq, tokens].
  struct query_side {
    std::vector<float> q_out_dout, lse;
  };
  const auto own_query_side = [&](index_t c) {
    query_side s{detail::chunk_rows(me, q, c), detail::chunk_lse(me, lse, c)};
    for (const auto* x : {&out, &d_out}) {
      const std::vector<float> r = detail::chunk_rows(me, *x, c);
      s.q_out_dout.insert(s.q_out_dout.end(), r.begin(), r.end());
    }
    return s;
  };
  const auto packed_kv = [&](index_t chunk) { return detail::chunk_kv(me, k, v, chunk); };
  // 1. What this rank's chunks owe other ranks.
  for (const solver::chunk_move& move : plan.moves) {
    if (!me.owns(move.chunk)) continue;
    if (move.what == solver::chunk_move::kind::kv) {
      detail::send_vector(comm, packed_kv(move.chunk), move.to, me.tag(message::kv, move.chunk));
    } else {
      const query_side s = own_query_side(move.chunk);
      detail::send_vector(comm, s.q_out_dout, move.to, me.tag(message::query_backward, move.chunk));
      detail::send_vector(comm, s.lse, move.to, me.tag(message::lse_backward, move.chunk));
    }
  }

  // fp32 gradient sums per chunk: this rank's own chunks, and the moved-in chunks (sent home at the end).
  std::map<index_t, std::vector<float>> dq_sum, dkv_sum, dq_home, dkv_home;  // dkv: [2, tokens, Hkv, D]
  for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) {
    dq_sum.emplace(c, std::vector<float>(q_elems, 0.0f));
    dkv_sum.emplace(c, std::vector<float>(2 * kv_elems, 0.0f));
  }
  std::map<index_t, query_side> own_q, moved_q;
  std::map<index_t, std::vector<float>> own_kv, moved_kv;
  const auto run_task = [&](const solver::task& t, const query_side& qs, const std::vector<float>& kv_chunk, std::vector<float>& dq_into,
                            std::vector<float>& dkv_into) {
    const step_index index = detail::task_index(g, p, t);
    const auto q3 = [&](std::size_t part) { return tensor_view<const float, 3>(qs.q_out_dout.data() + part * q_elems, {ct, hq, dim}); };
    reference_backward<float>(q3(0), tensor_view<const float, 3>(kv_chunk.data(), {ct, hkv, dim}),
                              tensor_view<const float, 3>(kv_chunk.data() + kv_elems, {ct, hkv, dim}), q3(1), q3(2),
                              tensor_view<const float, 2>(qs.lse.data(), {hq, ct}), index.view(), softmax_scale,
                              tensor_view<float, 3>(dq_into.data(), {ct, hq, dim}), tensor_view<float, 3>(dkv_into.data(), {ct, hkv, dim}),
                              tensor_view<float, 3>(dkv_into.data() + kv_elems, {ct, hkv, dim}));
  };
  const auto own_query = [&](index_t c) -> const query_side& { return detail::cached(own_q, c, own_query_side); };
  const auto own_kv_chunk = [&](index_t c) -> const std::vector<float>& { return detail::cached(own_kv, c, packed_kv); };
  // Checked mode: the rank's own dQ, dK and dV sums, then (`moved`) the sums computed here for other ranks.
  const bool checked = check == finite_check::every_step;
  const auto check_stage = [&](index_t stage, bool moved) {
    const std::string phase = "solver stage " + std::to_string(stage);
    const index_t local = q.extent(0);
    check_finite(std::span<const float>(detail::whole_rows(me, q_elems, [&](index_t c) { return dq_sum.at(c).data(); })),
                 checked_tensor::queries("dQ", local, hq, dim), rank, stage, phase);
    for (const auto& [name, half] : {std::pair{"dK", std::size_t{0}}, std::pair{"dV", kv_elems}})
      check_finite(std::span<const float>(detail::whole_rows(me, kv_elems, [&](index_t c) { return dkv_sum.at(c).data() + half; })),
                   checked_tensor::solver_chunk(checked_tensor::kv_gradient(name, local, hkv, dim, rank), rank, 0), rank, stage, phase);
    if (!moved) return;
    for (const auto& [chunk, x] : dq_home)
      check_finite(std::span<const float>(x),
                   checked_tensor::solver_chunk(checked_tensor::queries("dQ", ct, hq, dim), p.owner(chunk), detail::owner_first_token(p, chunk)),
                   rank, stage, phase);
    for (const auto& [chunk, x] : dkv_home)
      for (const auto& [name, half] : {std::pair{"dK", std::size_t{0}}, std::pair{"dV", kv_elems}})
        check_finite(std::span<const float>(x).subspan(half, kv_elems),
                     checked_tensor::solver_chunk(checked_tensor::kv_gradient(name, ct, hkv, dim, p.owner(chunk)), p.owner(chunk),
                                                  detail::owner_first_token(p, chunk)),
                     rank, stage, phase);
  };

  // 2. Stage 0: this rank's own tasks.
  for (const solver::task& t : plan.local_tasks[static_cast<std::size_t>(rank)])
    run_task(t, own_query(t.query_chunk), own_kv_chunk(t.kv_chunk), dq_sum.at(t.query_chunk), dkv_sum.at(t.kv_chunk));
  if (checked) check_stage(0, false);

  // 3. What moved here; each moved chunk's gradient goes home even if no task touched it.
  for (const solver::chunk_move& move : plan.moves) {
    if (move.to != rank) continue;
    const index_t from = p.owner(move.chunk);
    if (move.what == solver::chunk_move::kind::kv) {
      moved_kv.emplace(move.chunk, detail::recv_vector(comm, 2 * kv_elems, from, me.tag(message::kv, move.chunk)));
      dkv_home.emplace(move.chunk, std::vector<float>(2 * kv_elems, 0.0f));
    } else {
      query_side s;
      s.q_out_dout = detail::recv_vector(comm, 3 * q_elems, from, me.tag(message::query_backward, move.chunk));
      s.lse = detail::recv_vector(comm, lse_elems, from, me.tag(message::lse_backward, move.chunk));
      moved_q.emplace(move.chunk, std::move(s));
      dq_home.emplace(move.chunk, std::vector<float>(q_elems, 0.0f));
    }
  }

  // 4. Stage 1: the remote tasks; each chunk's gradient goes to its owner's sum or to the moved
  // chunk's sum here (sent home below). A task may use two moved chunks.
  for (const solver::task& t : plan.remote_tasks[static_cast<std::size_t>(rank)]) {
    const std::vector<float>* kv_chunk = nullptr;
    std::vector<float>* dkv_into = nullptr;
    if (me.owns(t.kv_chunk)) {
      kv_chunk = &own_kv_chunk(t.kv_chunk);
      dkv_into = &dkv_sum.at(t.kv_chunk);
    } else if (const auto kv = moved_kv.find(t.kv_chunk); kv != moved_kv.end()) {
      kv_chunk = &kv->second;
      dkv_into = &dkv_home.at(t.kv_chunk);
    } else {
      throw me.missing_move("KV", t.kv_chunk);
    }
    if (me.owns(t.query_chunk)) {
      run_task(t, own_query(t.query_chunk), *kv_chunk, dq_sum.at(t.query_chunk), *dkv_into);
    } else {
      const auto qs = moved_q.find(t.query_chunk);
      if (qs == moved_q.end()) throw me.missing_move("query", t.query_chunk);
      run_task(t, qs->second, *kv_chunk, dq_home.at(t.query_chunk), *dkv_into);
    }
  }

  // Checked before any sum travels: a NaN is named on the rank where it first appears.
  if (checked) check_stage(1, true);

  // 5. Gradients home, added by the owners in fp32.
  for (const auto& [chunk, x] : dq_home) detail::send_vector(comm, x, p.owner(chunk), me.tag(message::partial_dq, chunk));
  for (const auto& [chunk, x] : dkv_home) detail::send_vector(comm, x, p.owner(chunk), me.tag(message::partial_dkv, chunk));
  for (const solver::chunk_move& move : plan.moves) {
    if (!me.owns(move.chunk)) continue;
    const bool kv = move.what == solver::chunk_move::kind::kv;
    std::vector<float>& into = kv ? dkv_sum.at(move.chunk) : dq_sum.at(move.chunk);
    const std::vector<float> x = detail::recv_vector(comm, into.size(), move.to, me.tag(kv ? message::partial_dkv : message::partial_dq, move.chunk));
    for (std::size_t i = 0; i < x.size(); ++i) into[i] += x[i];
  }
  if (checked) check_stage(1, false);
  for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) {
    const index_t first = me.first_token(c);
    const std::vector<float>& gq = dq_sum.at(c);
    const std::vector<float>& gkv = dkv_sum.at(c);
    for (index_t t = 0, i = 0; t < ct; ++t)
      for (index_t h = 0; h < hq; ++h)
        for (index_t d = 0; d < dim; ++d) dq(first + t, h, d) = T(gq[static_cast<std::size_t>(i++)]);
    for (index_t t = 0, i = 0; t < ct; ++t)
      for (index_t h = 0; h < hkv; ++h)
        for (index_t d = 0; d < dim; ++d, ++i) {
          dk(first + t, h, d) = T(gkv[static_cast<std::size_t>(i)]);
          dv(first + t, h, d) = T(gkv[kv_elems + static_cast<std::size_t>(i)]);
        }
  }
}

}  // namespace stria::host
