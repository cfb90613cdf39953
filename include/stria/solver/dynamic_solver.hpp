// SPDX-License-Identifier: Apache-2.0
// The dynamic attention solver (DESIGN 9, after MagiAttention's dispatch solver). Sharding is
// sequential: rank r owns chunks [r m, (r + 1) m) of the sequence (m chunks per rank), as query/output
// chunks and as key/value chunks. A task (i, j) is query chunk i against KV chunk j, weighted by its
// active entries; it runs on a rank that holds both, which for a task of two ranks' chunks means a
// move: KV chunk j to the owner of i, or QO chunk i to the owner of j (its partial O comes back).
// The solver picks the moves (edges) and each task's rank so that every load stays within mu x the
// mean while the busiest rank's traffic stays small:
//  1. binary search over the per-rank budget K (what a rank may send, and receive), feasible when
//     the loads fit and the total stays within the flat ring's volume (times options.volume_cap);
//  2. greedy edge selection by unlocked work / cost within K (an edge unlocks the tasks it makes
//     runnable somewhere; a task unlocked by one edge no longer counts for its other edge);
//  3. assignment by (fewest candidate ranks, largest area): on the query's owner when it has room,
//     else on the least loaded candidate;
//  4. refinement: tasks leave ranks above mu x mean, largest first, for their other owner when it
//     has room, adding the edge that allows it if it fits within K.
// Candidate ranks are a task's two owners (a third rank would need two moves for one task). Every
// plan places every task; none moves more than the cap allows (by default the flat ring's volume).
// Deterministic.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/topology/flat_ring.hpp"

namespace stria::solver {

/// What the solver balances: task areas [C, C] over C = world_size x chunks_per_rank chunks (active
/// entries of query chunk i against KV chunk j), and what a chunk costs to move.
struct problem {
  index_t world_size = 0;
  index_t chunks_per_rank = 1;
  index_t chunk_tokens = 0;
  index_t heads_q = 0;
  index_t heads_kv = 0;
  std::vector<std::int64_t> area;  // [C, C], row = query chunk

  [[nodiscard]] index_t num_chunks() const { return world_size * chunks_per_rank; }
  [[nodiscard]] index_t owner(index_t chunk) const { return chunk / chunks_per_rank; }
  [[nodiscard]] std::int64_t at(index_t i, index_t j) const {
    return area[static_cast<std::size_t>(i) * static_cast<std::size_t>(num_chunks()) + static_cast<std::size_t>(j)];
  }
  /// Moving a KV chunk: its K and V (tokens x 2 Hkv elements).
  [[nodiscard]] std::int64_t kv_cost() const { return std::int64_t{chunk_tokens} * 2 * heads_kv; }
  /// Moving a QO chunk: Q there, and the partial O back (tokens x Hq elements each way).
  [[nodiscard]] std::int64_t qo_cost() const { return std::int64_t{chunk_tokens} * heads_q; }
  /// What the flat ring sends in total: every KV chunk to every other rank.
  [[nodiscard]] std::int64_t ring_volume() const { return std::int64_t{world_size} * (world_size - 1) * chunks_per_rank * kv_cost(); }

  void validate() const {
    if (world_size < 1) throw invalid_argument("problem.world_size", world_size, "must be at least 1");
    if (chunks_per_rank < 1) throw invalid_argument("problem.chunks_per_rank", chunks_per_rank, "must be at least 1");
    if (chunk_tokens < 1) throw invalid_argument("problem.chunk_tokens", chunk_tokens, "must be at least 1");
    if (heads_q < 1 || heads_kv < 1 || heads_q % heads_kv != 0)
      throw invalid_argument("problem.heads_kv", heads_kv, "must be >= 1 and divide heads_q = " + std::to_string(heads_q));
    const auto c = static_cast<std::size_t>(num_chunks());
    if (area.size() != c * c) throw invalid_argument("problem.area.size()", area.size(), "must be (world_size x chunks_per_rank)^2 = " + std::to_string(c * c));
    for (const std::int64_t a : area)
      if (a < 0) throw invalid_argument("problem.area", a, "task areas must be >= 0");
  }
};

/// The task areas of a global selection with `chunks_per_rank` chunks per rank (sequential sharding).
inline problem problem_from_selection(const global_selection& g, index_t world_size, index_t chunks_per_rank, index_t heads_kv) {
  const index_t chunks = world_size * chunks_per_rank;
  if (chunks < 1 || g.seq_len % (chunks * block_tokens) != 0)
    throw invalid_argument("world_size x chunks_per_rank", chunks,
                           "must divide seq_len / 64 = " + std::to_string(g.seq_len / block_tokens) + " (whole blocks per chunk)");
  // Chunk c is rank c of a sequential ring over all chunks: the workload counter gives every pair.
  const ring_workload w = count_ring_workload(g, sharding::sequential{}, topology::flat_ring(chunks));
  problem p{world_size, chunks_per_rank, g.seq_len / chunks, g.num_heads(), heads_kv, {}};
  p.area.resize(static_cast<std::size_t>(chunks) * static_cast<std::size_t>(chunks));
  for (index_t i = 0; i < chunks; ++i)
    for (index_t s = 0; s < chunks; ++s)  // at step s chunk i meets KV chunk (i - s) mod C
      p.area[static_cast<std::size_t>(i) * static_cast<std::size_t>(chunks) + static_cast<std::size_t>((i - s + chunks) % chunks)] = w.at(i, s);
  p.validate();
  return p;
}

struct options {
  double mu = 1.10;          // feasible: every rank's load <= mu x the mean
  double volume_cap = 1.0;   // feasible: the total volume <= volume_cap x the flat ring's (above 1: more
                             // traffic than the ring for balance, e.g. GQA, where a QO move costs more)

  void validate() const {
    if (!(mu >= 1.0)) throw invalid_argument("options.mu", mu, "must be >= 1 (loads within mu x the mean)");
    if (!(volume_cap > 0.0) || !std::isfinite(volume_cap))
      throw invalid_argument("options.volume_cap", volume_cap, "must be positive and finite (a multiple of the flat ring's volume)");
  }
};

/// One chunk moved from its owner to another rank.
struct chunk_move {
  enum class kind : unsigned char { kv, qo };
  kind what;
  index_t chunk;
  index_t to;
  friend bool operator==(const chunk_move&, const chunk_move&) = default;
  friend auto operator<=>(const chunk_move&, const chunk_move&) = default;
};

/// One task placed on a rank.
struct task {
  index_t query_chunk, kv_chunk;
  std::int64_t area;
  friend bool operator==(const task&, const task&) = default;
};

/// The solver's output. calc_meta: per rank, stage 0 runs its local tasks (both chunks its own)
/// while the moves arrive, stage 1 its remote tasks. comm_meta: the moves (a QO move returns a
/// partial O/LSE to the query's owner after stage 1).
struct plan {
  bool feasible = false;
  std::int64_t budget = 0;                      // the per-rank budget K of the plan
  std::vector<std::vector<task>> local_tasks;   // [W]
  std::vector<std::vector<task>> remote_tasks;  // [W]
  std::vector<chunk_move> moves;                // sorted, unique
  std::vector<std::int64_t> load;               // [W] active entries per rank

  [[nodiscard]] double max_load_over_mean() const {
    const std::int64_t total = std::accumulate(load.begin(), load.end(), std::int64_t{0});
    if (total == 0) return 1.0;
    return double(*std::max_element(load.begin(), load.end())) / (double(total) / double(load.size()));
  }
};

/// Total volume a plan moves: the sum of what ranks send (a QO move counts Q there and O back).
inline std::int64_t comm_volume(const problem& p, const plan& x) {
  std::int64_t volume = 0;
  for (const chunk_move& m : x.moves) volume += m.what == chunk_move::kind::kv ? p.kv_cost() : 2 * p.qo_cost();
  return volume;
}

namespace detail {

/// What every attempt of one solve starts from, computed once: each edge's unplaced area before any
/// task is placed (the tasks of two ranks' chunks it would unlock: a KV edge j -> r, column j over
/// r's rows; a QO edge i -> r, row i over r's columns), laid out [kind, chunk, rank]; the total area.
struct tables {
  std::vector<std::int64_t> unplaced;
  std::int64_t total = 0;

  explicit tables(const problem& p) {
    const auto c = static_cast<std::size_t>(p.num_chunks()), w = static_cast<std::size_t>(p.world_size),
               m = static_cast<std::size_t>(p.chunks_per_rank);
    unplaced.assign(2 * c * w, 0);
    for (std::size_t chunk = 0; chunk < c; ++chunk)
      for (std::size_t r = 0; r < w; ++r) {
        if (r == chunk / m) continue;  // no edge to the chunk's own rank
        std::int64_t kv = 0, qo = 0;
        for (std::size_t k = r * m; k < (r + 1) * m; ++k) kv += p.area[k * c + chunk], qo += p.area[chunk * c + k];
        unplaced[chunk * w + r] = kv;
        unplaced[(c + chunk) * w + r] = qo;
      }
    total = std::accumulate(p.area.begin(), p.area.end(), std::int64_t{0});
  }
};

/// The solver's working state at one budget K.
class attempt {
 public:
  attempt(const problem& p, const tables& t, double mu)
      : p_(&p), t_(&t), c_(p.num_chunks()), w_(p.world_size), limit_(mu * double(t.total) / double(w_)),
        kv_at_(static_cast<std::size_t>(c_) * static_cast<std::size_t>(w_)), qo_at_(kv_at_.size()), kv_use_(kv_at_.size()),
        qo_use_(kv_at_.size()), send_(static_cast<std::size_t>(w_)), recv_(send_.size()), load_(send_.size()),
        where_(static_cast<std::size_t>(c_) * static_cast<std::size_t>(c_)), owner_(static_cast<std::size_t>(c_)) {
    for (index_t chunk = 0; chunk < c_; ++chunk) owner_[static_cast<std::size_t>(chunk)] = p.owner(chunk);
  }

  /// One attempt at budget K, from scratch (the storage is reused: the search runs several).
  void run(std::int64_t budget) {
    budget_ = budget;
    over_budget_ = false;
    for (auto* v : {&kv_at_, &qo_at_}) std::fill(v->begin(), v->end(), 0);
    for (auto* v : {&kv_use_, &qo_use_}) std::fill(v->begin(), v->end(), 0);
    for (auto* v : {&send_, &recv_, &load_}) std::fill(v->begin(), v->end(), 0);
    std::fill(where_.begin(), where_.end(), -1);
    unplaced_ = t_->unplaced;
    select_edges();
    assign();
    refine();
  }

  /// Loads within the limit and no move beyond K.
  [[nodiscard]] bool balanced() const {
    return !over_budget_ && double(*std::max_element(load_.begin(), load_.end())) <= limit_ * (1 + 1e-12);
  }
  /// What the moves in use send in total (comm_volume of the plan finish() gives).
  [[nodiscard]] std::int64_t volume() const {
    std::int64_t v = 0;
    for (std::size_t s = 0; s < kv_use_.size(); ++s) v += (kv_use_[s] > 0 ? p_->kv_cost() : 0) + (qo_use_[s] > 0 ? 2 * p_->qo_cost() : 0);
    return v;
  }

 private:
  struct edge {
    chunk_move::kind what;
    index_t chunk, rank;
  };

  [[nodiscard]] index_t owner_of(index_t chunk) const { return owner_[static_cast<std::size_t>(chunk)]; }
  [[nodiscard]] std::size_t task_at(index_t i, index_t j) const { return static_cast<std::size_t>(i) * static_cast<std::size_t>(c_) + static_cast<std::size_t>(j); }
  [[nodiscard]] std::size_t slot(index_t chunk, index_t rank) const { return static_cast<std::size_t>(chunk) * static_cast<std::size_t>(w_) + static_cast<std::size_t>(rank); }
  [[nodiscard]] bool has_kv(index_t j, index_t r) const { return owner_of(j) == r || kv_at_[slot(j, r)]; }
  [[nodiscard]] bool has_qo(index_t i, index_t r) const { return owner_of(i) == r || qo_at_[slot(i, r)]; }
  [[nodiscard]] bool runnable(index_t i, index_t j, index_t r) const { return has_qo(i, r) && has_kv(j, r); }

  /// Per-rank volumes of an edge: the owner sends the chunk (and receives the O back for QO).
  void edge_costs(const edge& e, std::int64_t& owner_send, std::int64_t& owner_recv, std::int64_t& dest_send, std::int64_t& dest_recv) const {
    if (e.what == chunk_move::kind::kv) {
      owner_send = dest_recv = p_->kv_cost();
      owner_recv = dest_send = 0;
    } else {
      owner_send = owner_recv = dest_send = dest_recv = p_->qo_cost();
    }
  }
  [[nodiscard]] bool fits(const edge& e) const {
    std::int64_t os, orc, ds, dr;
    edge_costs(e, os, orc, ds, dr);
    const auto o = static_cast<std::size_t>(owner_of(e.chunk)), d = static_cast<std::size_t>(e.rank);
    return send_[o] + os <= budget_ && recv_[o] + orc <= budget_ && send_[d] + ds <= budget_ && recv_[d] + dr <= budget_;
  }
  void add_edge(const edge& e, int sign = +1) {
    std::int64_t os, orc, ds, dr;
    edge_costs(e, os, orc, ds, dr);
    const auto o = static_cast<std::size_t>(owner_of(e.chunk)), d = static_cast<std::size_t>(e.rank);
    send_[o] += sign * os;
    recv_[o] += sign * orc;
    send_[d] += sign * ds;
    recv_[d] += sign * dr;
    (e.what == chunk_move::kind::kv ? kv_at_ : qo_at_)[slot(e.chunk, e.rank)] = sign > 0;
  }
  [[nodiscard]] std::int64_t cost(const edge& e) const { return e.what == chunk_move::kind::kv ? p_->kv_cost() : 2 * p_->qo_cost(); }

  /// The unplaced tasks an edge makes runnable on its rank, f(i, j, area): a KV edge (j -> r) the
  /// tasks (i, j) with i owned by r (column j); a QO edge (i -> r) the tasks (i, j) with j owned by
  /// r (row i).
  template <class F>
  void for_each_unplaced_task(const edge& e, F&& f) const {
    const bool kv = e.what == chunk_move::kind::kv;
    const std::size_t row = static_cast<std::size_t>(e.chunk) * static_cast<std::size_t>(c_);
    const index_t first = e.rank * p_->chunks_per_rank, last = first + p_->chunks_per_rank;
    for (index_t k = first; k < last; ++k) {
      const std::size_t t = kv ? task_at(k, e.chunk) : row + static_cast<std::size_t>(k);
      if (where_[t] < 0 && p_->area[t] > 0) {
        if (kv) f(k, e.chunk, p_->area[t]);
        else f(e.chunk, k, p_->area[t]);
      }
    }
  }

  [[nodiscard]] double room(index_t r) const { return limit_ - double(load_[static_cast<std::size_t>(r)]); }

  /// An edge's position among all edges, (kind, chunk, rank) in order.
  [[nodiscard]] std::size_t edge_id(const edge& e) const {
    return (static_cast<std::size_t>(e.what) * static_cast<std::size_t>(c_) + static_cast<std::size_t>(e.chunk)) * static_cast<std::size_t>(w_) +
           static_cast<std::size_t>(e.rank);
  }
  /// A task of two ranks' chunks is unlocked by two edges (its KV to the query's owner, its QO to
  /// the KV's owner); each edge keeps the sum of its unplaced tasks' areas, updated as tasks are
  /// placed and taken off, so scoring an edge costs O(1).
  void count_unplaced(index_t i, index_t j, std::int64_t change) {
    const index_t qi = owner_of(i), kj = owner_of(j);
    if (qi == kj) return;
    unplaced_[edge_id({chunk_move::kind::kv, j, qi})] += change;
    unplaced_[edge_id({chunk_move::kind::qo, i, kj})] += change;
  }

  /// Steps 2 and 3 together: greedy edges by the work they unlock where it fits (unplaced tasks that
  /// the edge makes runnable, up to the rank's room below mu x mean) per unit of cost, within K; an
  /// accepted edge's tasks are placed on its rank, largest first, while there is room. Both the work
  /// and the room only shrink, so a max-heap with lazy re-scoring is exact. Local tasks are placed
  /// first (they have one candidate).
  void select_edges() {
    for (index_t r = 0; r < w_; ++r)  // the local tasks: both chunks rank r's
      for (index_t i = r * p_->chunks_per_rank; i < (r + 1) * p_->chunks_per_rank; ++i)
        for (index_t j = r * p_->chunks_per_rank; j < (r + 1) * p_->chunks_per_rank; ++j)
          if (p_->at(i, j) > 0) place(i, j, r, p_->at(i, j));
    // Work that can land, weighted by how empty the rank still is: edges toward lightly loaded
    // ranks come first, so the busy ranks' chunks travel to where there is room.
    auto work = [&](const edge& e) {
      const double free = std::max(0.0, room(e.rank));
      return std::min(double(unplaced_[edge_id(e)]), free) * (free / limit_);
    };
    // Edges in score buckets, highest first: a bucket is a float score's exponent and its top two
    // mantissa bits (four buckets an octave, neighbours 14-25% apart). Scores only fall (the
    // unplaced work and the rank's room only shrink), so a popped edge is re-scored and either taken
    // (still in its bucket: near the best) or moved down to its new bucket: O(1) per move instead of
    // a heap's O(log n). Deterministic (ids enter in order, each bucket is a stack).
    constexpr int depth = 400;  // 100 octaves below the best initial score; lower scores share the last
    const auto bucket_of = [&](double score, int top_bucket) {
      const int b = static_cast<int>(std::bit_cast<std::uint32_t>(static_cast<float>(score)) >> 21);
      return std::max(b, top_bucket - depth + 1);
    };
    std::vector<std::uint32_t> ids;
    std::vector<double> scores;
    for (const auto what : {chunk_move::kind::kv, chunk_move::kind::qo})
      for (index_t chunk = 0; chunk < c_; ++chunk)
        for (index_t r = 0; r < w_; ++r) {
          if (r == owner_of(chunk)) continue;
          const edge e{what, chunk, r};
          if (const double u = work(e); u > 0) {
            ids.push_back(static_cast<std::uint32_t>(edge_id(e)));
            scores.push_back(u / double(cost(e)));
          }
        }
    if (ids.empty()) return;
    const int top_bucket = static_cast<int>(std::bit_cast<std::uint32_t>(static_cast<float>(*std::max_element(scores.begin(), scores.end()))) >> 21);
    std::vector<std::vector<std::uint32_t>> buckets(depth);  // buckets[top_bucket - b]
    for (std::size_t i = ids.size(); i-- > 0;) buckets[static_cast<std::size_t>(top_bucket - bucket_of(scores[i], top_bucket))].push_back(ids[i]);
    const auto edge_of = [&](std::uint32_t id) {
      const auto w = static_cast<std::uint32_t>(w_), c = static_cast<std::uint32_t>(c_);
      return edge{static_cast<chunk_move::kind>(id / (w * c)), static_cast<index_t>(id / w % c), static_cast<index_t>(id % w)};
    };
    std::vector<std::pair<std::int64_t, std::size_t>> order;
    for (std::size_t level = 0; level < buckets.size(); ++level) {
      std::vector<std::uint32_t>& here = buckets[level];
      while (!here.empty()) {
        const std::uint32_t id = here.back();
        here.pop_back();
        const edge e = edge_of(id);
        const double u = work(e);
        if (u <= 0 || !fits(e)) continue;  // budgets only fill up: an edge that does not fit never will
        const auto now = static_cast<std::size_t>(top_bucket - bucket_of(u / double(cost(e)), top_bucket));
        if (now > level) {  // fell below this bucket: wait there
          buckets[now].push_back(id);
          continue;
        }
        add_edge(e);
        order.clear();
        for_each_unplaced_task(e, [&](index_t i, index_t j, std::int64_t a) { order.push_back({a, task_at(i, j)}); });
        // Largest first, ties in task order: an insertion sort (at most m entries; no buffer to allocate).
        for (std::size_t k = 1; k < order.size(); ++k)
          for (std::size_t x = k; x > 0 && order[x - 1].first < order[x].first; --x) std::swap(order[x - 1], order[x]);
        for (const auto& [a, t] : order)
          if (double(a) <= room(e.rank)) place(static_cast<index_t>(t / static_cast<std::size_t>(c_)), static_cast<index_t>(t % static_cast<std::size_t>(c_)), e.rank, a);
      }
    }
  }

  /// Step 3 for what is left: each unplaced task, by (fewest candidates, largest area), on the least
  /// loaded rank that can run it, adding the cheaper edge that fits within K if none can yet; if no
  /// edge fits, on its query's owner with its KV moved beyond K (the plan is then infeasible).
  void assign() {
    struct pending {
      int candidates;
      std::int64_t area;
      index_t i, j;
    };
    std::vector<pending> tasks;
    for (index_t i = 0; i < c_; ++i)
      for (index_t j = 0; j < c_; ++j)
        if (p_->at(i, j) > 0 && where_[task_at(i, j)] < 0)
          tasks.push_back({int(runnable(i, j, owner_of(i))) + int(runnable(i, j, owner_of(j))), p_->at(i, j), i, j});
    std::stable_sort(tasks.begin(), tasks.end(), [](const pending& a, const pending& b) {
      return a.candidates != b.candidates ? a.candidates < b.candidates : a.area > b.area;
    });
    for (const pending& t : tasks) {
      index_t best = -1;
      for (const index_t r : {owner_of(t.i), owner_of(t.j)}) {
        const bool can = runnable(t.i, t.j, r) || fits(needed_edge(t.i, t.j, r));
        if (can && (best < 0 || load_[static_cast<std::size_t>(r)] < load_[static_cast<std::size_t>(best)])) best = r;
      }
      if (best < 0) {  // nothing fits within K: where its query lives, its KV moved over the budget
        best = owner_of(t.i);
        over_budget_ = true;
      }
      if (!runnable(t.i, t.j, best)) add_edge(needed_edge(t.i, t.j, best));
      place(t.i, t.j, best, t.area);
    }
  }

  /// Task (i, j) of area `area` (the caller has it at hand: one random read less) on rank r.
  void place(index_t i, index_t j, index_t r, std::int64_t area) {
    where_[task_at(i, j)] = r;
    load_[static_cast<std::size_t>(r)] += area;
    count_unplaced(i, j, -area);
    if (owner_of(j) != r) ++kv_use_[slot(j, r)];
    if (owner_of(i) != r) ++qo_use_[slot(i, r)];
  }

  /// Takes (i, j) off its rank; a moved chunk no placed task uses any more goes back (its budget is free).
  void unplace(index_t i, index_t j) {
    const index_t r = where_[task_at(i, j)];
    where_[task_at(i, j)] = -1;
    load_[static_cast<std::size_t>(r)] -= p_->at(i, j);
    count_unplaced(i, j, p_->at(i, j));
    if (owner_of(j) != r && --kv_use_[slot(j, r)] == 0) add_edge({chunk_move::kind::kv, j, r}, -1);
    if (owner_of(i) != r && --qo_use_[slot(i, r)] == 0) add_edge({chunk_move::kind::qo, i, r}, -1);
  }

  /// Step 4: off ranks above the limit, largest task first, to its other owner when that has room;
  /// the edge it needs is added if it fits within K.
  void refine() {
    for (bool moved = true; moved;) {
      moved = false;
      for (index_t r = 0; r < w_; ++r) {
        if (double(load_[static_cast<std::size_t>(r)]) <= limit_) continue;
        // r's tasks of two ranks (its chunks' rows and columns), largest first, each tried once.
        std::vector<std::pair<std::int64_t, std::size_t>> mine;
        // Only tasks whose other owner has room for them now: while r sheds tasks the other ranks'
        // loads only grow, so a task left out here could not move later in this pass either (and
        // the sort stays short when the plan cannot balance).
        for (index_t k = r * p_->chunks_per_rank; k < (r + 1) * p_->chunks_per_rank; ++k)
          for (index_t x = 0; x < c_; ++x) {
            const index_t other = owner_of(x);
            if (other == r) continue;
            const double other_room = room(other);
            const std::size_t row = task_at(k, x), column = task_at(x, k);
            for (const std::size_t t : {row, column})
              if (where_[t] == r && p_->area[t] > 0 && double(p_->area[t]) <= other_room) mine.push_back({p_->area[t], t});
          }
        std::stable_sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        for (const auto& [a, t] : mine) {
          if (double(load_[static_cast<std::size_t>(r)]) <= limit_) break;
          const auto i = static_cast<index_t>(t / static_cast<std::size_t>(c_)), j = static_cast<index_t>(t % static_cast<std::size_t>(c_));
          const index_t other = owner_of(i) == r ? owner_of(j) : owner_of(i);
          if (double(load_[static_cast<std::size_t>(other)] + a) > limit_) continue;
          if (!runnable(i, j, other) && !fits_after_leaving(i, j, r, needed_edge(i, j, other))) continue;
          unplace(i, j);
          if (!runnable(i, j, other)) add_edge(needed_edge(i, j, other));
          place(i, j, other, a);
          moved = true;
        }
      }
    }
  }

  /// Whether `e` fits within K once (i, j) has left r (freeing the move it used there, if only it did).
  [[nodiscard]] bool fits_after_leaving(index_t i, index_t j, index_t r, const edge& e) {
    const bool frees = owner_of(i) == r ? kv_use_[slot(j, r)] == 1 : qo_use_[slot(i, r)] == 1;
    const edge old = owner_of(i) == r ? edge{chunk_move::kind::kv, j, r} : edge{chunk_move::kind::qo, i, r};
    if (frees) add_edge(old, -1);
    const bool ok = fits(e);
    if (frees) add_edge(old, +1);
    return ok;
  }

  /// The edge that makes (i, j) runnable on one of its owners `r`.
  [[nodiscard]] edge needed_edge(index_t i, index_t j, index_t r) const {
    return owner_of(i) == r ? edge{chunk_move::kind::kv, j, r} : edge{chunk_move::kind::qo, i, r};
  }

 public:
  /// The plan: tasks per rank and stage, the moves the placement uses (edges nobody uses are
  /// dropped), the loads; feasible when every load is within the limit and no move went beyond K.
  /// (assign() has placed every task.)
  plan finish() const {
    plan out;
    out.budget = budget_;
    out.local_tasks.assign(static_cast<std::size_t>(w_), {});
    out.remote_tasks.assign(static_cast<std::size_t>(w_), {});
    out.load = load_;
    for (index_t i = 0; i < c_; ++i)
      for (index_t j = 0; j < c_; ++j) {
        const std::int64_t a = p_->at(i, j);
        if (a == 0) continue;
        const index_t r = where_[task_at(i, j)];
        const bool local = owner_of(i) == r && owner_of(j) == r;
        (local ? out.local_tasks : out.remote_tasks)[static_cast<std::size_t>(r)].push_back({i, j, a});
      }
    // The moves placed tasks use, in (kind, chunk, rank) order: sorted and unique by construction.
    for (const auto what : {chunk_move::kind::kv, chunk_move::kind::qo})
      for (index_t chunk = 0; chunk < c_; ++chunk)
        for (index_t r = 0; r < w_; ++r)
          if ((what == chunk_move::kind::kv ? kv_use_ : qo_use_)[slot(chunk, r)] > 0) out.moves.push_back({what, chunk, r});
    out.feasible = balanced();
    return out;
  }

 private:
  const problem* p_;
  const tables* t_;
  index_t c_, w_;
  double limit_;
  std::int64_t budget_ = 0;
  std::vector<char> kv_at_, qo_at_;            // [C, W]: the chunk is on that rank (moved there)
  std::vector<index_t> kv_use_, qo_use_;       // [C, W]: placed tasks that use the moved chunk there
  std::vector<std::int64_t> send_, recv_, load_;  // [W]
  std::vector<index_t> where_;                 // [C, C]: the task's rank, -1 unplaced
  std::vector<std::int64_t> unplaced_;         // [2, C, W]: per edge, the area of its unplaced tasks
  std::vector<index_t> owner_;                 // [C]: each chunk's rank (no division in the loops)
  bool over_budget_ = false;                   // a task was placed with a move beyond K
};

}  // namespace detail

/// The plan at the smallest per-rank budget K at which every task is placed with loads within
/// mu x mean and the total volume is at most the flat ring's (a busy rank may use more than its ring
/// share when others use less). K is searched up to twice the ring's per-rank volume; if no K there
/// gives such a plan, the best effort at the ring's own per-rank volume, with feasible = false. Any
/// plan places every active task exactly once (it can be executed) and never moves more than the
/// ring in total.
inline plan solve(const problem& p, const options& o = {}) {
  p.validate();
  o.validate();
  const auto cap = static_cast<std::int64_t>(o.volume_cap * double(p.ring_volume()));
  const auto ring_budget = static_cast<std::int64_t>(o.volume_cap * double(std::int64_t{p.world_size - 1} * p.chunks_per_rank * p.kv_cost()));
  const detail::tables tables(p);
  detail::attempt best(p, tables, o.mu), candidate(p, tables, o.mu);  // two workspaces, swapped
  auto feasible = [&](const detail::attempt& a) { return a.balanced() && a.volume() <= cap; };
  std::int64_t hi = 2 * ring_budget;
  best.run(hi);
  if (!feasible(best)) {  // the best effort within the ring's per-rank volume (times the cap)
    best.run(ring_budget);
    // Moves forced beyond K can push the total over the cap; then every task runs where its query
    // lives (budget 0: KV moves only, a subset of the ring's).
    if (best.volume() > std::max(cap, p.ring_volume())) best.run(0);
    plan x = best.finish();
    x.feasible = false;
    return x;
  }
  // To within a quarter of a KV chunk or 1/32 of the budget, whichever is coarser: at most about
  // six attempts, the busiest rank's traffic at most ~3% above the smallest feasible budget. Only
  // the chosen attempt is turned into a plan.
  std::int64_t lo = 0;  // hi: feasible
  while (hi - lo > std::max<std::int64_t>(std::max<std::int64_t>(1, p.kv_cost() / 4), hi / 32)) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    candidate.run(mid);
    if (feasible(candidate)) {
      hi = mid;
      std::swap(best, candidate);
    } else {
      lo = mid;
    }
  }
  plan x = best.finish();
  x.feasible = true;
  return x;
}

}  // namespace stria::solver
