// SPDX-License-Identifier: Apache-2.0
// One small problem for checked mode (issue 20), shared by the host and GPU tests: a NaN put into
// one input element is first met by a known rank, at a known ring step (or solver stage), in a known
// head; and hand-made solver plans that put the poisoned task on chosen ranks.
#pragma once

#include <cstddef>
#include <limits>
#include <set>
#include <vector>

#include "stria/index/global_selection.hpp"
#include "stria/solver/dynamic_solver.hpp"

namespace stria::test {

/// 4 ranks on a flat ring, sequential sharding, 512 tokens (two 64-token blocks per rank), Hq 4,
/// Hkv 2, D 64, full (non-causal) attention. Heads 0 and 1 (KV head 0) select block diagonals
/// -2, 0 and 2; head 2 selects nothing, so its rows stay empty (O = 0, LSE = -inf: legal); head 3
/// (KV head 1) selects one tile, query block 5 x key block 2. Query block 5 is rank 2's local block
/// 1 and key block 2 is rank 1's local block 0, which rank 2 holds at ring step 1 ((2 - 1) mod 4);
/// no other query reads key block 2 through KV head 1. So a NaN in K or V of rank 1's local token 5,
/// KV head 1, appears first on rank 2 at ring step 1, in head 3, from local token 64 on; and a NaN
/// in dO of rank 2's local token 70, head 3, reaches dQ there at step 1 (that row is empty at step 0).
/// With topology::solver and 2 chunks per rank, chunks are blocks: the one task that reads KV chunk
/// 2 through KV head 1 is (query chunk 5, KV chunk 2), a stage-1 task wherever a plan puts it.
struct checked_scenario {
  static constexpr index_t world = 4, seq_len = 512, local_tokens = seq_len / world, heads_q = 4, heads_kv = 2, dim = 64;
  static constexpr index_t solver_chunks_per_rank = 2;
  static constexpr index_t poisoned_rank = 1, poisoned_token = 5, poisoned_kv_head = 1;  // K or V
  static constexpr index_t d_out_rank = 2, d_out_token = 70, d_out_head = 3;            // dO

  static global_selection selection() {
    global_selection g;
    g.seq_len = seq_len;
    g.causal = false;
    g.heads.resize(heads_q);
    for (const index_t h : {0, 1}) g.heads[static_cast<std::size_t>(h)].slash_deltas = {-2, 0, 2};
    g.heads[3].blocks = {{5, 2}};
    g.validate();
    return g;
  }

  /// The flat position of (token, head, d = 7) in a rank's token-major [local_tokens, heads, dim] shard.
  static std::size_t element(index_t token, index_t head, index_t heads) {
    return (static_cast<std::size_t>(token) * heads + head) * dim + 7;
  }

  /// The problem a solver plan of the scenario solves: chunks are 64-token blocks, 2 per rank.
  static solver::problem solver_problem() { return solver::problem_from_selection(selection(), world, solver_chunks_per_rank, heads_kv); }
};

/// Where a hand-made plan runs each task whose chunks belong to different ranks.
enum class placement {
  kv_moves,     // on the query's owner: KV chunks move
  query_moves,  // on the KV chunk's owner: query chunks move, their partials go back
  third_rank,   // on the lowest rank owning neither: both move there
};

inline const char* name_of(placement how) {
  return how == placement::kv_moves ? "KV moves" : how == placement::query_moves ? "query moves" : "third rank";
}

/// A plan of `p` that places every task as `how` says (tasks within one rank are local): each puts
/// the checked scenario's task (5, 2) on another rank (2, 1 and 0).
inline solver::plan hand_plan(const solver::problem& p, placement how) {
  solver::plan plan;
  plan.feasible = true;
  plan.local_tasks.resize(static_cast<std::size_t>(p.world_size));
  plan.remote_tasks.resize(static_cast<std::size_t>(p.world_size));
  plan.load.assign(static_cast<std::size_t>(p.world_size), 0);
  std::set<solver::chunk_move> moves;
  for (index_t i = 0; i < p.num_chunks(); ++i)
    for (index_t j = 0; j < p.num_chunks(); ++j) {
      if (p.at(i, j) == 0) continue;
      const solver::task t{i, j, p.at(i, j)};
      const index_t qo = p.owner(i), kv = p.owner(j);
      index_t at = qo;
      if (qo == kv) {
        plan.local_tasks[static_cast<std::size_t>(qo)].push_back(t);
      } else {
        if (how == placement::query_moves) at = kv;
        if (how == placement::third_rank)
          for (at = 0; at == qo || at == kv;) ++at;
        if (at != qo) moves.insert({solver::chunk_move::kind::qo, i, at});
        if (at != kv) moves.insert({solver::chunk_move::kind::kv, j, at});
        plan.remote_tasks[static_cast<std::size_t>(at)].push_back(t);
      }
      plan.load[static_cast<std::size_t>(at)] += t.area;
    }
  plan.moves.assign(moves.begin(), moves.end());
  return plan;
}

/// The rank that runs task (query chunk, KV chunk) in `plan` (-1: none).
inline index_t rank_of_task(const solver::plan& plan, index_t query_chunk, index_t kv_chunk) {
  for (std::size_t r = 0; r < plan.local_tasks.size(); ++r)
    for (const auto* tasks : {&plan.local_tasks[r], &plan.remote_tasks[r]})
      for (const solver::task& t : *tasks)
        if (t.query_chunk == query_chunk && t.kv_chunk == kv_chunk) return static_cast<index_t>(r);
  return -1;
}

}  // namespace stria::test
