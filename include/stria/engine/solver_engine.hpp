// SPDX-License-Identifier: Apache-2.0
// The solver executor, written once for the host and the device backend (DESIGN 9 and 10): in what
// order one rank moves chunks, runs its two stages of tasks and returns partial results to their owners.
#pragma once

#include <concepts>
#include <cstddef>
#include <string>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/solver/execution.hpp"

namespace stria::engine {

/// Requirements of a solver backend B, one rank's chunks, results and transport in one direction
/// (built-ins: solver_forward_backend and solver_backward_backend in host::detail and device::detail).
/// - `B::kv_results`: whether a KV chunk has results that go home (backward: its dK/dV);
/// - `b.begin_transfers()` ... `b.end_transfers()` enclose a group of sends and receives, posted in plan order;
/// - `b.send_chunk(move)`: sends one of this rank's chunks where `move` takes it; `b.receive_chunk(move)`:
///   receives a chunk moved here, in place once `b.await_chunks()` returns;
/// - `b.compute(task, stage, i)`: adds the i-th task of `stage` (0: local, 1: remote) into the results
///   of its chunks, each this rank's own or moved here;
/// - `b.check(stage, phase, moved)`: checked mode's check of the rank's own results and, with `moved`,
///   of those computed here for other ranks;
/// - `b.send_result(move)`: the results of a chunk moved here go home; `b.receive_result(move, i)`: those of
///   plan.moves[i] come to the owner, in place once `b.await_results()` returns; `b.add_result(move, i)`
///   adds them into its own; `b.finish()` writes the rank's outputs.
template <class B>
concept solver_backend = requires(B& b, const solver::chunk_move& move, const solver::task& t, index_t stage, std::size_t i, const std::string& phase) {
  { B::kv_results } -> std::convertible_to<bool>;
  b.begin_transfers();
  b.end_transfers();
  b.send_chunk(move);
  b.receive_chunk(move);
  b.await_chunks();
  b.compute(t, stage, i);
  b.check(stage, phase, true);
  b.send_result(move);
  b.receive_result(move, i);
  b.await_results();
  b.add_result(move, i);
  b.finish();
};

/// solver_backend<B> as one static_assert per requirement, each naming the missing member.
template <class B>
constexpr bool check_solver_backend() {
  using move = const solver::chunk_move&;
  static_assert(requires { { B::kv_results } -> std::convertible_to<bool>; }, "stria: Backend must have static constexpr bool kv_results");
  static_assert(requires(B& b) { b.begin_transfers(); }, "stria: Backend must have begin_transfers()");
  static_assert(requires(B& b) { b.end_transfers(); }, "stria: Backend must have end_transfers()");
  static_assert(requires(B& b, move m) { b.send_chunk(m); }, "stria: Backend must have send_chunk(const stria::solver::chunk_move&)");
  static_assert(requires(B& b, move m) { b.receive_chunk(m); }, "stria: Backend must have receive_chunk(const stria::solver::chunk_move&)");
  static_assert(requires(B& b) { b.await_chunks(); }, "stria: Backend must have await_chunks()");
  static_assert(requires(B& b, const solver::task& t) { b.compute(t, index_t{}, std::size_t{}); },
                "stria: Backend must have compute(const stria::solver::task&, stria::index_t stage, std::size_t i)");
  static_assert(requires(B& b, const std::string& phase) { b.check(index_t{}, phase, true); },
                "stria: Backend must have check(stria::index_t stage, const std::string& phase, bool moved)");
  static_assert(requires(B& b, move m) { b.send_result(m); }, "stria: Backend must have send_result(const stria::solver::chunk_move&)");
  static_assert(requires(B& b, move m) { b.receive_result(m, std::size_t{}); },
                "stria: Backend must have receive_result(const stria::solver::chunk_move&, std::size_t)");
  static_assert(requires(B& b) { b.await_results(); }, "stria: Backend must have await_results()");
  static_assert(requires(B& b, move m) { b.add_result(m, std::size_t{}); },
                "stria: Backend must have add_result(const stria::solver::chunk_move&, std::size_t)");
  static_assert(requires(B& b) { b.finish(); }, "stria: Backend must have finish()");
  return true;
}

/// Checked mode's name for a result computed here for a chunk's owner: positions in the owner's local tokens.
inline checked_tensor moved_chunk(const checked_tensor& t, const solver::problem& p, index_t chunk) {
  return checked_tensor::solver_chunk(t, p.owner(chunk), (chunk % p.chunks_per_rank) * p.chunk_tokens);
}

/// One rank's part of `plan` on `b` (DESIGN 9), `me` made from `plan`: the moves are posted, the local
/// tasks run while they travel (stage 0), the remote tasks once they are in place (stage 1: a task's
/// chunks each the rank's own or moved here, both moved for a third rank's work, as `me`'s constructor
/// has checked); then the results of every chunk moved here go home, even if no task used it (its
/// owner never waits in vain), and the owner adds them into its own in plan order. With finite_check::every_step `b.check` runs after stage 0, after
/// stage 1 before any result travels (a NaN is named on the rank where it first appears) and once the
/// returned results are added (a sum of finite results can overflow).
template <class Backend>
void run_solver_plan(Backend& b, const solver::plan& plan, const solver::rank_chunks& me, finite_check check) {
  static_assert(check_solver_backend<Backend>());
  using kind = solver::chunk_move::kind;
  const index_t rank = me.rank();
  const bool checked = check == finite_check::every_step;
  const auto phase = [](index_t stage) { return "solver stage " + std::to_string(stage); };
  // In plan order on both sides of every pair (NCCL matches a pair's messages in order).
  b.begin_transfers();
  for (const solver::chunk_move& move : plan.moves)
    if (me.owns(move.chunk)) b.send_chunk(move);
    else if (move.to == rank) b.receive_chunk(move);
  b.end_transfers();

  const auto& local = plan.local_tasks[static_cast<std::size_t>(rank)];
  for (std::size_t i = 0; i < local.size(); ++i) b.compute(local[i], 0, i);
  if (checked) b.check(0, phase(0), false);

  b.await_chunks();
  const auto& remote = plan.remote_tasks[static_cast<std::size_t>(rank)];
  for (std::size_t i = 0; i < remote.size(); ++i) b.compute(remote[i], 1, i);
  if (checked) b.check(1, phase(1), true);

  std::vector<std::size_t> coming_home;  // moves of this rank's chunks whose results come back
  b.begin_transfers();
  for (std::size_t i = 0; i < plan.moves.size(); ++i) {
    const solver::chunk_move& move = plan.moves[i];
    if (move.what == kind::kv && !Backend::kv_results) continue;
    if (move.to == rank) {
      b.send_result(move);
    } else if (me.owns(move.chunk)) {
      b.receive_result(move, i);
      coming_home.push_back(i);
    }
  }
  b.end_transfers();
  b.await_results();
  for (const std::size_t i : coming_home) b.add_result(plan.moves[i], i);
  if (checked) b.check(1, phase(1), false);
  b.finish();
}

}  // namespace stria::engine
