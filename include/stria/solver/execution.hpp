// SPDX-License-Identifier: Apache-2.0
// What a rank needs to execute a solver plan, on the host or the device: its chunks' geometry
// (sequential sharding, m chunks of `chunk_tokens` per rank), the checks that the plan, the
// selection and the rank's tensors belong together, and the tags that name the plan's messages.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/solver/dynamic_solver.hpp"

namespace stria::solver {

/// What a message of a plan's execution carries; with the chunk it names the message (its tag).
enum class message : int { kv, kv_values, query, query_backward, d_out_backward, lse_backward, partial_out, partial_lse, partial_dq, partial_dkv };

/// Throws unless `x` is a plan of `p` in the parts every rank reads: per-rank task lists for p's
/// world size, and moves (sorted and unique, as solve() writes them) of chunks in range to another
/// rank than the chunk's owner. O(moves); no message is built unless a check fails.
inline void check_plan_of(const problem& p, const plan& x) {
  const auto world = static_cast<std::size_t>(p.world_size);
  if (x.local_tasks.size() != world || x.remote_tasks.size() != world)
    throw invalid_argument("plan.local_tasks.size()", x.local_tasks.size(),
                           "must equal the problem's world size " + std::to_string(world) + " (a plan of another problem?)");
  const index_t chunks = p.num_chunks();
  for (std::size_t m = 0; m < x.moves.size(); ++m) {
    const chunk_move& move = x.moves[m];
    if (move.chunk < 0 || move.chunk >= chunks)
      throw invalid_argument("plan.moves[" + std::to_string(m) + "].chunk", move.chunk, "must be a chunk in [0, " + std::to_string(chunks) + ")");
    if (move.to < 0 || move.to >= p.world_size || move.to == p.owner(move.chunk))
      throw invalid_argument("plan.moves[" + std::to_string(m) + "].to", move.to,
                             "must be a rank in [0, " + std::to_string(p.world_size) + ") other than the chunk's owner " + std::to_string(p.owner(move.chunk)));
    if (m > 0 && !(x.moves[m - 1] < move))
      throw invalid_argument("plan.moves[" + std::to_string(m) + "]", "(out of order or repeated)", "moves must be sorted and unique");
  }
}

/// Throws unless `rank`'s own tasks in `x` (checked by check_plan_of) can run there: chunks in range,
/// a local task's two chunks owned by the rank, a remote task's chunks each the rank's own or brought
/// there by a move (its query and KV chunks may both have moved: the solver uses third ranks), not
/// both its own. A corrupted plan is refused here, naming the entry, before the rank acts on it.
/// O(tasks x log moves).
inline void check_rank_tasks(const problem& p, const plan& x, index_t rank) {
  const index_t chunks = p.num_chunks();
  const auto entry = [&](const char* list, std::size_t i) { return std::string("plan.") + list + "[" + std::to_string(rank) + "][" + std::to_string(i) + "]"; };
  const auto pair_text = [](const task& t) { return std::to_string(t.query_chunk) + " x " + std::to_string(t.kv_chunk); };
  const auto check_chunks = [&](const char* list, std::size_t i, const task& t) {
    for (const auto& [field, chunk] : {std::pair{".query_chunk", t.query_chunk}, std::pair{".kv_chunk", t.kv_chunk}})
      if (chunk < 0 || chunk >= chunks) throw invalid_argument(entry(list, i) + field, chunk, "must be a chunk in [0, " + std::to_string(chunks) + ")");
  };
  const auto moved_here = [&](chunk_move::kind what, index_t chunk) { return std::binary_search(x.moves.begin(), x.moves.end(), chunk_move{what, chunk, rank}); };
  const auto& local = x.local_tasks[static_cast<std::size_t>(rank)];
  for (std::size_t i = 0; i < local.size(); ++i) {
    check_chunks("local_tasks", i, local[i]);
    if (p.owner(local[i].query_chunk) != rank || p.owner(local[i].kv_chunk) != rank)
      throw invalid_argument(entry("local_tasks", i), pair_text(local[i]), "a local task's chunks must both belong to rank " + std::to_string(rank));
  }
  const auto& remote = x.remote_tasks[static_cast<std::size_t>(rank)];
  for (std::size_t i = 0; i < remote.size(); ++i) {
    const task& t = remote[i];
    check_chunks("remote_tasks", i, t);
    const bool own_query = p.owner(t.query_chunk) == rank, own_kv = p.owner(t.kv_chunk) == rank;
    const bool query_here = own_query || moved_here(chunk_move::kind::qo, t.query_chunk);
    const bool kv_here = own_kv || moved_here(chunk_move::kind::kv, t.kv_chunk);
    if (!query_here || !kv_here || (own_query && own_kv))
      throw invalid_argument(entry("remote_tasks", i), pair_text(t),
                             "a remote task's query and KV chunks must each be rank " + std::to_string(rank) +
                                 "'s own or brought there by a move, not both its own");
  }
}

/// One rank's chunks in a plan's execution.
class rank_chunks {
 public:
  /// Checks that `p`/`x` are a plan for this communicator, that the selection (seq_len, its query
  /// heads) is the one the problem was made from, and the rank's tensor shapes.
  rank_chunks(const problem& p, const plan& x, index_t selection_seq_len, index_t selection_heads, index_t rank, index_t world,
              index_t query_tokens, index_t kv_tokens, index_t heads_q, index_t heads_kv)
      : p_(p), rank_(rank) {
    if (world != p.world_size) throw invalid_argument("comm.world_size()", world, "must equal the plan's world size " + std::to_string(p.world_size));
    check_plan_of(p, x);
    check_rank_tasks(p, x, rank);
    if (selection_seq_len != p.num_chunks() * p.chunk_tokens)
      throw invalid_argument("selection.seq_len", selection_seq_len,
                             "must equal the problem's chunks x chunk tokens = " + std::to_string(p.num_chunks() * p.chunk_tokens));
    if (selection_heads != heads_q || heads_q != p.heads_q)
      throw invalid_argument("q.extent(1)", heads_q, "must equal the selection's and the problem's query heads " + std::to_string(p.heads_q));
    if (heads_kv != p.heads_kv) throw invalid_argument("k.extent(1)", heads_kv, "must equal the problem's KV heads " + std::to_string(p.heads_kv));
    const index_t local = p.chunks_per_rank * p.chunk_tokens;
    if (query_tokens != local) throw invalid_argument("q.extent(0)", query_tokens, "must equal the rank's chunks x chunk tokens = " + std::to_string(local));
    if (kv_tokens != local) throw invalid_argument("k.extent(0)", kv_tokens, "must equal the rank's chunks x chunk tokens = " + std::to_string(local));
  }

  [[nodiscard]] index_t rank() const { return rank_; }
  [[nodiscard]] index_t tokens() const { return p_.chunk_tokens; }
  [[nodiscard]] index_t first_chunk() const { return rank_ * p_.chunks_per_rank; }
  [[nodiscard]] index_t end_chunk() const { return (rank_ + 1) * p_.chunks_per_rank; }
  [[nodiscard]] bool owns(index_t chunk) const { return p_.owner(chunk) == rank_; }
  [[nodiscard]] index_t owner(index_t chunk) const { return p_.owner(chunk); }
  /// The first local token of one of this rank's chunks.
  [[nodiscard]] index_t first_token(index_t chunk) const { return (chunk - first_chunk()) * p_.chunk_tokens; }
  [[nodiscard]] int tag(message what, index_t chunk) const {
    return static_cast<int>(what) * static_cast<int>(p_.num_chunks()) + static_cast<int>(chunk);
  }
  /// Elements of one chunk of a [tokens, heads, dim] tensor.
  [[nodiscard]] std::size_t elements(index_t heads, index_t dim) const { return static_cast<std::size_t>(p_.chunk_tokens) * heads * dim; }

 private:
  const problem& p_;
  index_t rank_;
};

}  // namespace stria::solver
