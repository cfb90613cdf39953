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
//     it starts above a floor no feasible K can be below, and skips the budgets at which an
//     attempt would run exactly as one already made;
//  2. greedy edge selection by unlocked work / cost within K (an edge unlocks the tasks it makes
//     runnable somewhere; a task unlocked by one edge no longer counts for its other edge);
//  3. assignment by (fewest candidate ranks, largest area): on the query's owner when it has room,
//     else on the least loaded candidate;
//  4. refinement: tasks leave ranks above mu x mean, largest first, for their other owner when it
//     has room, adding the edge that allows it if it fits within K.
// Candidate ranks are a task's two owners (a third rank would need two moves for one task). Every
// plan places every task; none moves more than the cap allows (by default the flat ring's volume).
// Deterministic.
// A task spans all heads (DESIGN 9's optional head groups are not used). Where the mask is the same
// in every head, a head group's task has 1/G of the area and its moves 1/G of the cost: groups only
// make tasks finer, which chunks_per_rank does too (and, unlike groups, with moves that shrink where
// the mask is sparse). On VS selections every head group has work in every task and on every edge
// (solver_bench's inputs, W 8 and 64: 8 of 8 groups), so groups would save no move either.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
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

/// One chunk moved from its owner to another rank.
struct chunk_move {
  enum class kind : unsigned char { kv, qo };
  kind what;
  index_t chunk;
  index_t to;
  friend bool operator==(const chunk_move&, const chunk_move&) = default;
  friend auto operator<=>(const chunk_move&, const chunk_move&) = default;
};

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
  /// What one move costs in all (the sum over ranks of what they send): a KV chunk, or a QO chunk
  /// (Q there, O back).
  [[nodiscard]] std::int64_t move_cost(chunk_move::kind what) const { return what == chunk_move::kind::kv ? kv_cost() : 2 * qo_cost(); }
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
  for (const chunk_move& m : x.moves) volume += p.move_cost(m.what);
  return volume;
}

namespace detail {

/// What every attempt of one solve starts from, computed once: each edge's unplaced area before any
/// task is placed (the tasks of two ranks' chunks it would unlock: a KV edge j -> r, column j over
/// r's rows; a QO edge i -> r, row i over r's columns), laid out [kind, chunk, rank]; the total area;
/// a floor under the budget.
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

    // A floor under every feasible budget: the tasks of two ranks' chunks need moves, a move
    // unlocks at most its edge's area, and the moves' total cost is what the ranks receive in all
    // (at most W x K). So K >= remote area / (the densest edge's area per unit of cost) / W.
    std::int64_t local = 0;
    for (std::size_t r = 0; r < w; ++r)
      for (std::size_t i = r * m; i < (r + 1) * m; ++i)
        for (std::size_t j = r * m; j < (r + 1) * m; ++j) local += p.area[i * c + j];
    double densest = 0;
    for (std::size_t e = 0; e < unplaced.size(); ++e)
      densest = std::max(densest, double(unplaced[e]) / double(p.move_cost(e < c * w ? chunk_move::kind::kv : chunk_move::kind::qo)));
    if (total > local && densest > 0)  // a hair below the bound, so rounding never lifts it past a feasible K
      budget_floor = static_cast<std::int64_t>(std::ceil(double(total - local) / densest / double(w) * (1 - 1e-9)));
  }

  std::int64_t budget_floor = 0;  // no budget below it can place every task within it
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

  /// One attempt at budget K, from scratch (the storage is reused: the search runs several). With
  /// `decide_only`, it stops as soon as a move beyond K makes it infeasible (no plan can be made of
  /// it then; what it ran is the run at any budget in [K, same_below())).
  void run(std::int64_t budget, bool decide_only = false) {
    budget_ = budget;
    decide_only_ = decide_only;
    complete_ = false;
    over_budget_ = false;
    largest_fit_ = 0;
    smallest_misfit_ = std::numeric_limits<std::int64_t>::max();
    for (auto* v : {&kv_at_, &qo_at_}) std::fill(v->begin(), v->end(), 0);
    for (auto* v : {&kv_use_, &qo_use_}) std::fill(v->begin(), v->end(), 0);
    for (auto* v : {&send_, &recv_, &load_}) std::fill(v->begin(), v->end(), 0);
    std::fill(where_.begin(), where_.end(), -1);
    unplaced_ = t_->unplaced;
    select_edges();
    if (!assign()) return;
    refine();
    complete_ = true;
  }

  /// Whether the run went to the end (a stopped one is infeasible, and has no plan).
  [[nodiscard]] bool complete() const { return complete_; }
  /// The run at K is the run at every K' in [same_from(), same_below()): K only enters through
  /// fits(), whose every answer stays the same there (what fitted is at most same_from(), what did
  /// not is at least same_below()). The search uses it to skip budgets that cannot change a thing.
  [[nodiscard]] std::int64_t same_from() const { return largest_fit_; }
  [[nodiscard]] std::int64_t same_below() const { return smallest_misfit_; }

  /// Loads within the limit and no move beyond K.
  [[nodiscard]] bool balanced() const {
    return !over_budget_ && double(*std::max_element(load_.begin(), load_.end())) <= limit_ * (1 + 1e-12);
  }
  /// What the moves in use send in total (comm_volume of the plan finish() gives).
  [[nodiscard]] std::int64_t volume() const {
    std::int64_t v = 0;
    for (std::size_t s = 0; s < kv_use_.size(); ++s)
      v += (kv_use_[s] > 0 ? p_->move_cost(chunk_move::kind::kv) : 0) + (qo_use_[s] > 0 ? p_->move_cost(chunk_move::kind::qo) : 0);
    return v;
  }

 private:
  struct edge {
    chunk_move::kind what;
    index_t chunk, rank;
  };

  [[nodiscard]] index_t owner_of(index_t chunk) const { return owner_[static_cast<std::size_t>(chunk)]; }
  [[nodiscard]] std::size_t task_at(index_t i, index_t j) const { return static_cast<std::size_t>(i) * static_cast<std::size_t>(c_) + static_cast<std::size_t>(j); }
  [[nodiscard]] std::int64_t area_of(std::size_t task) const { return p_->area[task]; }
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
  /// Whether `e` fits within K: the largest of the four per-rank volumes it would make is at most
  /// K. The only place K is read; it records the largest volume that fitted and the smallest that
  /// did not (see same_from).
  [[nodiscard]] bool fits(const edge& e) {
    std::int64_t os, orc, ds, dr;
    edge_costs(e, os, orc, ds, dr);
    const auto o = static_cast<std::size_t>(owner_of(e.chunk)), d = static_cast<std::size_t>(e.rank);
    const std::int64_t worst = std::max({send_[o] + os, recv_[o] + orc, send_[d] + ds, recv_[d] + dr});
    if (worst <= budget_) {
      largest_fit_ = std::max(largest_fit_, worst);
      return true;
    }
    smallest_misfit_ = std::min(smallest_misfit_, worst);
    return false;
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
  [[nodiscard]] std::int64_t cost(const edge& e) const { return p_->move_cost(e.what); }

  /// The unplaced tasks an edge makes runnable on its rank, f(i, j, area): a KV edge (j -> r) the
  /// tasks (i, j) with i owned by r (column j); a QO edge (i -> r) the tasks (i, j) with j owned by
  /// r (row i).
  template <class F>
  void for_each_unplaced_task(const edge& e, F&& f) const {
    const bool kv = e.what == chunk_move::kind::kv;
    const index_t first = e.rank * p_->chunks_per_rank, last = first + p_->chunks_per_rank;
    for (index_t k = first; k < last; ++k) {
      const std::size_t t = kv ? task_at(k, e.chunk) : task_at(e.chunk, k);
      if (const std::int64_t a = area_of(t); where_[t] < 0 && a > 0) {
        if (kv) f(k, e.chunk, a);
        else f(e.chunk, k, a);
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
          if (const std::int64_t a = area_of(task_at(i, j)); a > 0) place(i, j, r, a);
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
    struct unlocked {
      std::int64_t area;
      index_t i, j;
    };
    std::vector<unlocked> order;
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
        for_each_unplaced_task(e, [&](index_t i, index_t j, std::int64_t a) { order.push_back({a, i, j}); });
        // Largest first, ties in task order (the walk's): an insertion sort (at most m entries; no
        // buffer to allocate).
        for (std::size_t k = 1; k < order.size(); ++k)
          for (std::size_t x = k; x > 0 && order[x - 1].area < order[x].area; --x) std::swap(order[x - 1], order[x]);
        for (const unlocked& t : order)
          if (double(t.area) <= room(e.rank)) place(t.i, t.j, e.rank, t.area);
      }
    }
  }

  /// Step 3 for what is left: each unplaced task, by (fewest candidates, largest area), on the least
  /// loaded rank that can run it, adding the cheaper edge that fits within K if none can yet; if no
  /// edge fits, on its query's owner with its KV moved beyond K (the plan is then infeasible).
  /// Returns false when it stopped early (decide_only and a move went beyond K).
  bool assign() {
    std::vector<pending>& tasks = pending_;
    tasks.clear();
    for (index_t i = 0; i < c_; ++i)
      for (index_t j = 0; j < c_; ++j)
        if (const std::size_t t = task_at(i, j); area_of(t) > 0 && where_[t] < 0)
          tasks.push_back({int(runnable(i, j, owner_of(i))) + int(runnable(i, j, owner_of(j))), area_of(t), i, j});
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
        if (decide_only_) return false;
      }
      if (!runnable(t.i, t.j, best)) add_edge(needed_edge(t.i, t.j, best));
      place(t.i, t.j, best, t.area);
    }
    return true;
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
    const std::size_t t = task_at(i, j);
    const index_t r = where_[t];
    where_[t] = -1;
    load_[static_cast<std::size_t>(r)] -= area_of(t);
    count_unplaced(i, j, area_of(t));
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
        std::vector<movable>& mine = movable_;
        mine.clear();
        // Only tasks whose other owner has room for them now: while r sheds tasks the other ranks'
        // loads only grow, so a task left out here could not move later in this pass either (and
        // the sort stays short when the plan cannot balance).
        for (index_t k = r * p_->chunks_per_rank; k < (r + 1) * p_->chunks_per_rank; ++k)
          for (index_t x = 0; x < c_; ++x) {
            const index_t other = owner_of(x);
            if (other == r) continue;
            const double other_room = room(other);
            for (const auto& [i, j] : {std::pair{k, x}, std::pair{x, k}})  // its row, then its column
              if (const std::size_t t = task_at(i, j); where_[t] == r && area_of(t) > 0 && double(area_of(t)) <= other_room)
                mine.push_back({area_of(t), i, j});
          }
        std::stable_sort(mine.begin(), mine.end(), [](const movable& a, const movable& b) { return a.area > b.area; });
        for (const auto& [a, i, j] : mine) {
          if (double(load_[static_cast<std::size_t>(r)]) <= limit_) break;
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
        const std::size_t t = task_at(i, j);
        const std::int64_t a = area_of(t);
        if (a == 0) continue;
        const index_t r = where_[t];
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
  std::int64_t largest_fit_ = 0, smallest_misfit_ = 0;  // fits()'s record of this run
  bool decide_only_ = false, complete_ = false;
  // Reused buffers of assign() and refine().
  struct pending {
    int candidates;
    std::int64_t area;
    index_t i, j;
  };
  struct movable {
    std::int64_t area;
    index_t i, j;
  };
  std::vector<pending> pending_;
  std::vector<movable> movable_;
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
  auto feasible = [&](const detail::attempt& a) { return a.balanced() && a.volume() <= cap; };  // of a complete run
  std::int64_t hi = 2 * ring_budget;
  best.run(hi, true);
  if (!best.complete() || !feasible(best)) {  // the best effort within the ring's per-rank volume (times the cap)
    std::int64_t budget = ring_budget;
    if (!best.complete() || ring_budget < best.same_from() || ring_budget >= best.same_below()) best.run(budget);  // else: it would run the same
    // Moves forced beyond K can push the total over the cap; then every task runs where its query
    // lives (budget 0: KV moves only, a subset of the ring's).
    if (best.volume() > std::max(cap, p.ring_volume())) best.run(budget = 0);
    plan x = best.finish();
    x.budget = budget;
    x.feasible = false;
    return x;
  }
  // To within a quarter of a KV chunk or 1/32 of the budget, whichever is coarser: at most about
  // six more attempts, the busiest rank's traffic at most ~3% above the smallest feasible budget. An
  // attempt's answer holds over the whole range of budgets at which it runs the same, so a
  // feasible one lowers hi to its same_from() and an infeasible one raises lo to just below its
  // same_below(). Only the chosen attempt is turned into a plan.
  hi = best.same_from();
  std::int64_t lo = hi > 0 ? std::clamp<std::int64_t>(tables.budget_floor - 1, 0, hi - 1) : 0;  // hi: feasible; lo: infeasible, or 0
  while (hi - lo > std::max<std::int64_t>(std::max<std::int64_t>(1, p.kv_cost() / 4), hi / 32)) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    candidate.run(mid, true);
    if (candidate.complete() && feasible(candidate)) {
      hi = candidate.same_from();
      std::swap(best, candidate);
    } else {
      lo = std::clamp(candidate.same_below() - 1, mid, hi - 1);
    }
  }
  plan x = best.finish();
  x.budget = hi;  // the plan best made, and the one K = hi makes
  x.feasible = true;
  return x;
}

}  // namespace stria::solver
