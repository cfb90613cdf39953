// SPDX-License-Identifier: Apache-2.0
// The dynamic attention solver (DESIGN 9, after MagiAttention's dispatch solver). Sharding is
// sequential: rank r owns chunks [r m, (r + 1) m) of the sequence (m chunks per rank), as query/output
// chunks and as key/value chunks. A task (i, j) is query chunk i against KV chunk j, weighted by its
// active entries; it runs on any rank that holds both chunks, its own or moved there: KV chunk j to
// the rank (its dK/dV come back), QO chunk i to the rank (its partial O/LSE, or dQ, come back).
// The solver places every task so that every load stays within mu x the mean, moving in all no
// more than the flat ring does (every KV chunk to every other rank, times options.volume_cap):
//  1. every task on its query's owner, each rank fetching the KV chunks its rows need (a subset
//     of what the flat ring moves): under sequential sharding the loads follow the mask (causal:
//     the last rank has ~2W x the first's), the volume is at most the ring's;
//  2. shedding: each rank above the fill level (halfway between the mean and mu x mean), busiest
//     first, hands work to the least loaded rank below it until it is down to the level or that
//     rank is full, then to the next. What moves is the busy rank's column pieces: all its tasks
//     (i, j) of one KV chunk j. The light rank receives the busy rank's query chunks once (QO
//     moves) and each piece's KV chunk unless it holds it already; the busy rank no longer needs
//     KV chunk j (its move there is dropped). So pieces go in the order of what they cost: KV chunks
//     the light rank holds first (net one move less), then chunks of third ranks (net none), the
//     busy rank's own chunks last (one more); larger pieces first. A piece larger than what is left
//     to hand over goes task by task. Moves that would lift the total past the cap are not made;
//  3. a second pass at mu x mean itself for any rank still above it.
// A task may thus run on a third rank (query and KV chunks both moved there): that is what lets a
// causal or document mask balance with GQA, where a query chunk costs (Hq / Hkv) x a KV chunk to
// move (Q there and O back), and a task can leave a rank only if the rank that takes it holds, or
// is sent, the KV chunks the task needs. The pieces are a rank's whole columns, so a busy rank that
// gives away columns also stops receiving those KV chunks: for causal masks at W = 64 the plan moves
// less than the query-owner placement of step 1. Deterministic.
// A task spans all heads (DESIGN 9's optional head groups are not used): where the mask is the same
// in every head, a group's task has 1/G of the area and its moves 1/G of the cost, so groups only
// make tasks finer, which chunks_per_rank does too (with moves that shrink where the mask is
// sparse), and on VS selections every head group has work in every task and on every edge
// (solver_bench's inputs), so they save no move.
#pragma once

#include <algorithm>
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
    // Checked in 64 bits: num_chunks() and the sequence it covers are index_t products that would wrap.
    if (const std::int64_t tokens = std::int64_t{world_size} * chunks_per_rank * chunk_tokens; tokens > std::numeric_limits<index_t>::max())
      throw invalid_argument("problem world_size x chunks_per_rank x chunk_tokens", tokens,
                             "must be at most " + std::to_string(std::numeric_limits<index_t>::max()) + " (the sequence length is an index_t)");
    if (heads_q < 1 || heads_kv < 1 || heads_q % heads_kv != 0)
      throw invalid_argument("problem.heads_kv", heads_kv, "must be >= 1 and divide heads_q = " + std::to_string(heads_q));
    // The volumes the solver sums are int64 element counts: the flat ring's (every KV chunk to every
    // other rank) and every chunk moved once each way as Q and O. Counted in double, exact far past
    // the limit's order, so that a product that would wrap is refused rather than read as negative.
    const double chunks = double(world_size) * double(chunks_per_rank);
    const double most = std::max(double(world_size - 1) * 2.0 * double(heads_kv), 2.0 * double(heads_q)) * chunks * double(chunk_tokens);
    if (most > 0x1p62)
      throw invalid_argument("problem volume (elements: world_size x chunks_per_rank x chunk_tokens x heads)", most,
                             "the volumes moved (elements: the ring's every chunk to every other rank, or every chunk's Q and O) must be at "
                             "most 2^62");
    const auto c = static_cast<std::size_t>(num_chunks());
    if (area.size() != c * c) throw invalid_argument("problem.area.size()", area.size(), "must be (world_size x chunks_per_rank)^2 = " + std::to_string(c * c));
    for (const std::int64_t a : area)
      if (a < 0) throw invalid_argument("problem.area", a, "task areas must be >= 0");
  }
};

namespace detail {

/// A sequential ring's counts over C chunks (rank c holds chunk c), laid out [C, C] per task (query
/// chunk i, KV chunk j) like problem::area.
inline std::vector<std::int64_t> per_task(const ring_workload& counts) {
  const index_t chunks = counts.world_size;
  std::vector<std::int64_t> out(static_cast<std::size_t>(chunks) * static_cast<std::size_t>(chunks));
  for (index_t i = 0; i < chunks; ++i)
    for (index_t s = 0; s < chunks; ++s)  // at step s chunk i meets KV chunk (i - s) mod C
      out[static_cast<std::size_t>(i) * static_cast<std::size_t>(chunks) + static_cast<std::size_t>((i - s + chunks) % chunks)] = counts.at(i, s);
  return out;
}

}  // namespace detail

/// The task areas of a global selection with `chunks_per_rank` chunks per rank (sequential sharding).
inline problem problem_from_selection(const global_selection& g, index_t world_size, index_t chunks_per_rank, index_t heads_kv) {
  // In 64 bits: the product in index_t wraps (65536 x 65536 chunks read as 0).
  const std::int64_t wide_chunks = std::int64_t{world_size} * chunks_per_rank;
  if (wide_chunks < 1 || g.seq_len % (wide_chunks * block_tokens) != 0)
    throw invalid_argument("world_size x chunks_per_rank", wide_chunks,
                           "must divide seq_len / 64 = " + std::to_string(g.seq_len / block_tokens) + " (whole blocks per chunk)");
  const auto chunks = static_cast<index_t>(wide_chunks);  // at most seq_len / 64
  // Chunk c is rank c of a sequential ring over all chunks: the workload counter gives every pair.
  problem p{world_size, chunks_per_rank, g.seq_len / chunks, g.num_heads(), heads_kv,
            detail::per_task(count_ring_workload(g, sharding::sequential{}, topology::flat_ring(chunks)))};
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
  std::int64_t max_rank_traffic = 0;            // the most one rank sends or receives (a QO move: Q, then O)
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

/// Where every task runs, the moves that needs (with how many placed tasks use each), the loads
/// and what every rank sends and receives. A task runs on its query's owner unless it was handed
/// over to another rank: those are listed (in order, so the latest can be taken back) and marked in
/// a bit per task; nothing of size C^2 is written per solve but these bits.
class placement {
 public:
  explicit placement(const problem& p)
      : p_(&p), c_(p.num_chunks()), w_(p.world_size), m_(p.chunks_per_rank),
        moved_bits_((static_cast<std::size_t>(c_) * static_cast<std::size_t>(c_) + 63) / 64, 0),
        kv_use_(static_cast<std::size_t>(c_) * static_cast<std::size_t>(w_), 0), qo_use_(kv_use_.size(), 0),
        load_(static_cast<std::size_t>(w_), 0), send_(load_.size(), 0), recv_(load_.size(), 0), tasks_(load_.size(), 0),
        owner_(static_cast<std::size_t>(c_)) {
    for (index_t chunk = 0; chunk < c_; ++chunk) owner_[static_cast<std::size_t>(chunk)] = chunk / m_;
  }

  [[nodiscard]] index_t owner(index_t chunk) const { return owner_[static_cast<std::size_t>(chunk)]; }
  [[nodiscard]] std::int64_t area(index_t i, index_t j) const { return p_->area[task_at(i, j)]; }
  /// Whether (i, j) was handed over (it no longer runs on its query's owner).
  [[nodiscard]] bool moved(index_t i, index_t j) const {
    const std::size_t t = task_at(i, j);
    return (moved_bits_[t / 64] >> (t % 64)) & 1U;
  }
  [[nodiscard]] std::int64_t load(index_t r) const { return load_[static_cast<std::size_t>(r)]; }
  [[nodiscard]] const std::vector<std::int64_t>& loads() const { return load_; }
  [[nodiscard]] std::int64_t volume() const { return volume_; }
  [[nodiscard]] std::size_t handed_over() const { return moved_.size(); }
  /// Whether rank r holds KV chunk j: its own, or moved there for a placed task.
  [[nodiscard]] bool holds_kv(index_t j, index_t r) const { return owner(j) == r || kv_use_[slot(j, r)] > 0; }
  /// The most any rank sends or receives.
  [[nodiscard]] std::int64_t busiest_traffic() const {
    return std::max(*std::max_element(send_.begin(), send_.end()), *std::max_element(recv_.begin(), recv_.end()));
  }

  /// Step 1: every active task on its query's owner, row by row (the hot loop of a solve: C^2 tasks).
  void place_on_query_owners() {
    for (index_t r = 0; r < w_; ++r) {
      index_t* const kv_use = kv_use_.data() + slot(0, r);
      std::int64_t load = 0, tasks = 0;
      for (index_t i = r * m_; i < (r + 1) * m_; ++i) {
        const std::int64_t* const row = p_->area.data() + task_at(i, 0);
        for (index_t j = 0; j < c_; ++j)
          if (row[j] > 0) load += row[j], ++tasks, ++kv_use[j];
      }
      load_[static_cast<std::size_t>(r)] = load;
      tasks_[static_cast<std::size_t>(r)] = tasks;
      for (index_t j = r * m_; j < (r + 1) * m_; ++j) kv_use[j] = 0;  // its own chunks: no move
      for (index_t j = 0; j < c_; ++j)
        if (kv_use[j] > 0) count_move(chunk_move::kind::kv, j, r, +1);
    }
  }

  /// Hands active task (i, j) from its query's owner over to rank s (another rank).
  void hand_over(index_t i, index_t j, index_t s) {
    account(i, j, owner(i), -1);
    account(i, j, s, +1);
    flip(i, j);
    moved_.push_back({i, j, s});
  }
  /// Takes the latest hand-overs back, down to `count` of them.
  void take_back(std::size_t count) {
    while (moved_.size() > count) {
      const handed t = moved_.back();
      moved_.pop_back();
      account(t.i, t.j, t.to, -1);
      account(t.i, t.j, owner(t.i), +1);
      flip(t.i, t.j);
    }
  }

  /// The plan of this placement: tasks per rank and stage (the query owners' in (i, j) order, then
  /// the handed-over ones in the order they moved), the moves in use in (kind, chunk, rank) order
  /// (sorted and unique by construction), the loads.
  [[nodiscard]] plan finish() const {
    plan out;
    out.local_tasks.assign(static_cast<std::size_t>(w_), {});
    out.remote_tasks.assign(static_cast<std::size_t>(w_), {});
    out.load = load_;
    out.max_rank_traffic = busiest_traffic();
    for (index_t r = 0; r < w_; ++r) {
      const auto n = static_cast<std::size_t>(tasks_[static_cast<std::size_t>(r)]);
      std::vector<task>& local = out.local_tasks[static_cast<std::size_t>(r)];
      std::vector<task>& remote = out.remote_tasks[static_cast<std::size_t>(r)];
      local.reserve(std::min(n, static_cast<std::size_t>(m_) * static_cast<std::size_t>(m_)));
      remote.reserve(n);
      const index_t own_first = r * m_, own_last = own_first + m_;
      for (index_t i = own_first; i < own_last; ++i) {
        const std::int64_t* const row = p_->area.data() + task_at(i, 0);
        for (index_t j = 0; j < c_; ++j)
          if (row[j] > 0 && !moved(i, j)) (j >= own_first && j < own_last ? local : remote).push_back({i, j, row[j]});
      }
    }
    for (const handed& t : moved_) out.remote_tasks[static_cast<std::size_t>(t.to)].push_back({t.i, t.j, area(t.i, t.j)});
    for (const auto what : {chunk_move::kind::kv, chunk_move::kind::qo})
      for (index_t chunk = 0; chunk < c_; ++chunk)
        for (index_t r = 0; r < w_; ++r)
          if ((what == chunk_move::kind::kv ? kv_use_ : qo_use_)[slot(chunk, r)] > 0) out.moves.push_back({what, chunk, r});
    return out;
  }

 private:
  struct handed {
    index_t i, j, to;
  };
  [[nodiscard]] std::size_t task_at(index_t i, index_t j) const { return static_cast<std::size_t>(i) * static_cast<std::size_t>(c_) + static_cast<std::size_t>(j); }
  /// [W, C]: a rank's chunks side by side (step 1 walks them row by row).
  [[nodiscard]] std::size_t slot(index_t chunk, index_t r) const { return static_cast<std::size_t>(r) * static_cast<std::size_t>(c_) + static_cast<std::size_t>(chunk); }
  void flip(index_t i, index_t j) {
    const std::size_t t = task_at(i, j);
    moved_bits_[t / 64] ^= std::uint64_t{1} << (t % 64);
  }
  /// Task (i, j) put on (+1) or taken off (-1) rank r, with the moves it needs there: a move is
  /// made when its first task comes, dropped when its last one leaves.
  void account(index_t i, index_t j, index_t r, int sign) {
    load_[static_cast<std::size_t>(r)] += sign * area(i, j);
    tasks_[static_cast<std::size_t>(r)] += sign;
    if (owner(j) != r) {
      index_t& use = kv_use_[slot(j, r)];
      use += sign;
      if (use == (sign > 0 ? 1 : 0)) count_move(chunk_move::kind::kv, j, r, sign);
    }
    if (owner(i) != r) {
      index_t& use = qo_use_[slot(i, r)];
      use += sign;
      if (use == (sign > 0 ? 1 : 0)) count_move(chunk_move::kind::qo, i, r, sign);
    }
  }
  /// A move made (+1) or dropped (-1): the owner sends the chunk; for a QO move the rank also sends
  /// the partial O back.
  void count_move(chunk_move::kind what, index_t chunk, index_t to, int sign) {
    const auto from = static_cast<std::size_t>(owner(chunk)), dest = static_cast<std::size_t>(to);
    const std::int64_t cost = what == chunk_move::kind::kv ? p_->kv_cost() : p_->qo_cost();
    send_[from] += sign * cost;
    recv_[dest] += sign * cost;
    if (what == chunk_move::kind::qo) {
      send_[dest] += sign * cost;
      recv_[from] += sign * cost;
    }
    volume_ += sign * p_->move_cost(what);
  }

  const problem* p_;
  index_t c_, w_, m_;
  std::vector<std::uint64_t> moved_bits_;  // [C, C] bits: handed over
  std::vector<handed> moved_;              // the hand-overs, in order
  std::vector<index_t> kv_use_, qo_use_;   // [W, C]: placed tasks that use the chunk moved to that rank
  std::vector<std::int64_t> load_, send_, recv_, tasks_;  // [W]
  std::vector<index_t> owner_;             // [C]: each chunk's rank (no division in the loops)
  std::int64_t volume_ = 0;
};

/// Step 2 at one fill level: ranks above `level`, busiest first, hand column pieces (and, at the
/// end, single tasks) to the least loaded ranks below it, never lifting the volume past `max_volume`.
inline void shed(const problem& p, placement& x, double level, std::int64_t max_volume) {
  const index_t w = p.world_size, c = p.num_chunks(), m = p.chunks_per_rank;
  std::vector<index_t> busy;
  for (index_t r = 0; r < w; ++r)
    if (double(x.load(r)) > level) busy.push_back(r);
  std::stable_sort(busy.begin(), busy.end(), [&](index_t a, index_t b) { return x.load(a) > x.load(b); });
  std::vector<std::int64_t> column(static_cast<std::size_t>(c));  // the busy rank's work per KV chunk still on it
  std::vector<index_t> by_area, order;                              // its KV chunks with work, largest column first
  std::vector<char> tried(static_cast<std::size_t>(w));
  for (const index_t h : busy) {
    const index_t first = h * m, last = first + m;
    const auto on_h = [&](index_t i, index_t j) { return x.area(i, j) > 0 && !x.moved(i, j); };
    std::fill(column.begin(), column.end(), 0);
    std::int64_t smallest = std::numeric_limits<std::int64_t>::max();  // h's smallest task: less room takes nothing
    for (index_t i = first; i < last; ++i)
      for (index_t j = 0; j < c; ++j)
        if (on_h(i, j)) column[static_cast<std::size_t>(j)] += x.area(i, j), smallest = std::min(smallest, x.area(i, j));
    by_area.clear();
    for (index_t j = 0; j < c; ++j)
      if (column[static_cast<std::size_t>(j)] > 0) by_area.push_back(j);
    std::stable_sort(by_area.begin(), by_area.end(), [&](index_t a, index_t b) { return column[static_cast<std::size_t>(a)] > column[static_cast<std::size_t>(b)]; });
    std::fill(tried.begin(), tried.end(), 0);
    while (double(x.load(h)) - level >= double(smallest)) {
      index_t s = -1;  // the least loaded rank with room for h's smallest task, not tried yet
      for (index_t r = 0; r < w; ++r)
        if (r != h && !tried[static_cast<std::size_t>(r)] && level - double(x.load(r)) >= double(smallest) && (s < 0 || x.load(r) < x.load(s))) s = r;
      if (s < 0) break;
      tried[static_cast<std::size_t>(s)] = 1;  // one round per light rank: after it, it is full or h is done
      // h's columns in the order of the KV moves they add at s less those they save at h (-1, 0,
      // +1), each class largest first.
      order.clear();
      for (const int extra : {-1, 0, 1})
        for (const index_t j : by_area)
          if (column[static_cast<std::size_t>(j)] > 0 && int(!x.holds_kv(j, s)) - int(x.owner(j) != h) == extra) order.push_back(j);
      // What h may still hand over and s still take: moving at most that keeps h at or above the
      // level and s at or below it.
      const auto room = [&] { return std::min(double(x.load(h)) - level, level - double(x.load(s))); };
      for (const index_t j : order) {
        if (room() < double(smallest)) break;
        const std::size_t before = x.handed_over();
        const std::int64_t volume_before = x.volume();
        if (double(column[static_cast<std::size_t>(j)]) <= room()) {  // the whole column: h stops needing KV chunk j
          for (index_t i = first; i < last; ++i)
            if (on_h(i, j)) x.hand_over(i, j, s);
          if (x.volume() > std::max(max_volume, volume_before)) x.take_back(before);  // past the cap: back
          else column[static_cast<std::size_t>(j)] = 0;
          continue;
        }
        // Larger than what is left: its tasks one by one, largest first, each if it fits.
        while (room() >= double(smallest)) {
          index_t best = -1;
          for (index_t i = first; i < last; ++i)
            if (on_h(i, j) && double(x.area(i, j)) <= room() && (best < 0 || x.area(i, j) > x.area(best, j))) best = i;
          if (best < 0) break;
          const std::size_t was = x.handed_over();
          const std::int64_t volume_was = x.volume();
          x.hand_over(best, j, s);
          if (x.volume() > std::max(max_volume, volume_was)) {
            x.take_back(was);
            break;
          }
          column[static_cast<std::size_t>(j)] -= x.area(best, j);
        }
      }
    }
  }
}

}  // namespace detail

/// A plan that places every active task exactly once (it can be executed), with every load within
/// mu x mean where the shedding can get there, moving in all no more than volume_cap x the flat
/// ring's volume (or the query-owner placement's, if that is more: a cap below 1). feasible: every
/// load within mu x mean and the volume within the cap.
inline plan solve(const problem& p, const options& o = {}) {
  p.validate();
  o.validate();
  detail::placement x(p);
  x.place_on_query_owners();  // 1.
  const std::int64_t total = std::accumulate(x.loads().begin(), x.loads().end(), std::int64_t{0});
  // The cap at most 2^62, where validate bounds the ring's volume: a larger cap is no cap (converted
  // unclamped it was undefined and read as negative), and near the bound a cap above 1 would let a
  // plan's volume, summed in int64, pass 2^63 (a query chunk may go to many ranks).
  const auto cap = static_cast<std::int64_t>(std::min(o.volume_cap * double(p.ring_volume()), 0x1p62));
  const double mean = double(total) / double(p.world_size), limit = o.mu * mean;
  detail::shed(p, x, mean * (1 + (o.mu - 1) / 2), cap);  // 2. to halfway between the mean and the limit
  const auto above = [&] { return std::any_of(x.loads().begin(), x.loads().end(), [&](std::int64_t l) { return double(l) > limit * (1 + 1e-12); }); };
  if (above()) detail::shed(p, x, limit, cap);  // 3. what is left, up to the limit itself
  plan out = x.finish();
  out.feasible = !above() && x.volume() <= cap;
  return out;
}

}  // namespace stria::solver
