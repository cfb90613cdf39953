// SPDX-License-Identifier: Apache-2.0
// The estimator's window statistics, written once for the host and the device backend (DESIGN 7
// and 10): the steps of one rank's gathering and the collectives that make them global.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/estimator/statistics.hpp"

namespace stria::engine {

/// Statistics of `heads` query heads with zeroed slash and window masses, ready to be filled.
inline vs_statistics empty_statistics(index_t seq_len, index_t heads, bool causal, index_t window_rows, index_t local_blocks) {
  vs_statistics st{seq_len, heads, causal, window_rows, {}, {}, {}, local_blocks};
  st.slash_mass.assign(static_cast<std::size_t>(heads) * static_cast<std::size_t>(st.num_diagonals()), 0.0f);
  st.window_mass.assign(static_cast<std::size_t>(heads), 0.0f);
  return st;
}

/// One call's window statistics as the engine and both backends see them (make_window_plan).
struct window_plan {
  vs_statistics shape;  // seq_len, heads, causal, window rows and the request's local_blocks; masses zero
  index_t world, rank_blocks;                // ranks; key blocks per rank
  index_t window_owner, window_local_token;  // the last block's owner, and window row 0 as its local token
  index_t per_rank, keep;                    // candidates per head each rank contributes; union entries kept per head
  std::vector<index_t> key_global_block;     // [world, rank_blocks]: every rank's local key blocks as global blocks

  [[nodiscard]] index_t first_row() const { return shape.seq_len - shape.window_rows; }  // global token of window row 0
  [[nodiscard]] std::span<const index_t> global_blocks(index_t rank) const {
    return std::span(key_global_block).subspan(static_cast<std::size_t>(rank * rank_blocks), static_cast<std::size_t>(rank_blocks));
  }
};

/// make_window_plan's `keep` that keeps every rank's candidates in the union.
inline constexpr index_t whole_union = std::numeric_limits<index_t>::max();

/// The plan of `request` over `world` ranks under `sharding`, already validated on {seq_len / 64,
/// world}. Each head's union keeps its first `keep` entries, the global top `keep`: a selection that
/// reads no more than its cap loses nothing when `keep` is that cap. Only a run's first `keep` can
/// reach them, so no rank contributes more (per_rank <= keep).
template <sharding_policy Sharding>
window_plan make_window_plan(const Sharding& sharding, index_t seq_len, index_t world, bool causal, index_t heads, const statistics_request& request,
                             index_t keep = whole_union) {
  if (request.window_rows < 1 || request.window_rows > std::min(seq_len, block_tokens))
    throw invalid_argument("request.window_rows", request.window_rows, "must lie in [1, 64]: the window is the end of the last block");
  if (request.local_blocks < 0 || request.local_blocks > seq_len / block_tokens)
    throw invalid_argument("request.local_blocks", request.local_blocks, "must lie in [0, seq_len / 64]");
  if (request.vertical_candidates < 0) throw invalid_argument("request.vertical_candidates", request.vertical_candidates, "must be >= 0");
  const shard_layout layout{seq_len / block_tokens, world};
  const index_t blocks = sharding.local_blocks(layout);
  const block_location owner = sharding.locate(layout, layout.num_blocks - 1);
  window_plan p{empty_statistics(seq_len, heads, causal, request.window_rows, request.local_blocks),
                world, blocks, owner.rank, owner.local_block * block_tokens + (seq_len - request.window_rows) % block_tokens,
                std::min({request.vertical_candidates, blocks * block_tokens, keep}), keep, {}};
  for (index_t r = 0; r < world; ++r)
    for (index_t b = 0; b < blocks; ++b) p.key_global_block.push_back(sharding.global_block(layout, {r, b}));
  return p;
}

/// One rank's share of the statistics in a backend's arrays (std::vector on the host, device_buffer
/// on the device), what step 5's all-gathers bring to every rank (then [world, ...]).
template <class Floats, class Keys>
struct rank_share {
  /// [Hq, rank_blocks + 1]: the window mass on each local key block (the window lies in the last
  /// block, so a key block's mass is all on one block diagonal), then the rank's whole window mass:
  /// the float of the blocks' sum in fp64.
  Floats mass;
  /// [Hq, per_rank]: each head's top per_rank vertical candidates in selection order, as
  /// selection_key. Tokens of the request's local blocks carry mass -1, so they sort last and never
  /// enter the union.
  Keys candidates;
};

/// The engine's collectives on host arrays (std::vector, a host backend's `floats`), over any
/// host_collectives communicator: what a host backend's exchange(comm) returns.
template <class Comm>
struct host_exchange {
  static_assert(check_host_collectives<Comm>());
  Comm& comm;

  template <class T>
  void broadcast(std::span<T> rows, index_t root) {
    comm.broadcast(rows.data(), rows.size(), root);
  }
  template <class T>
  std::vector<T> all_gather(const std::vector<T>& mine) {
    std::vector<T> all(mine.size() * static_cast<std::size_t>(comm.world_size()));
    comm.all_gather(mine.data(), all.data(), mine.size());
    return all;
  }
};

/// Requirements of a window statistics backend B on communicator Comm, one rank's local work
/// (built-ins: estimator::detail::window_backend, device::detail::window_backend). The engine makes
/// every collective, on the backend's arrays through `b.exchange(comm)`. Over one rank, where they
/// are identities, it makes none and calls no member marked (W > 1): the backend's own window, row
/// max and sums are then the global ones.
/// - `B::floats` (std::vector<float>, or device_buffer<float> on the device) and `B::share` (a
///   rank_share of such arrays): where its arrays lie; `b.exchange(comm)` (W > 1): broadcast(rows,
///   root) and all_gather(array) on them (engine::host_exchange,
///   device::detail::device_exchange);
/// - `b.window()` (W > 1): the window rows, a `B::window_rows` (a span) that the owner has filled and
///   the broadcast fills on the other ranks; `b.score_window()`: pass 1 against the local keys;
/// - `b.row_normaliser()` (W > 1): this rank's softmax normaliser [2, Hq, rows], each row's max and
///   then its sum of exp against that max; `b.place_normaliser(all)` (W > 1): every rank's, rank
///   after rank [W, 2, Hq, rows], combined into the global ones (the max of the maxes, the sums
///   rescaled to it and added in rank order);
/// - `b.probabilities()`: pass 2, each key token's and key block's window mass, each head's top
///   per_rank candidates;
/// - `b.rank_share()` (W > 1): this rank's share; `b.global_statistics(all)` (W > 1): the result
///   `B::statistics` from every rank's, rank after rank; `b.own_statistics()` (W = 1): the result
///   from this rank's share alone.
template <class B, class Comm>
concept window_statistics_backend =
    requires(B& b, Comm& comm, typename B::floats every_rank, typename B::share all) {
      b.exchange(comm);
      { b.window() } -> std::same_as<typename B::window_rows>;
      b.score_window();
      { b.row_normaliser() } -> std::same_as<typename B::floats>;
      b.place_normaliser(std::move(every_rank));
      b.probabilities();
      { b.rank_share() } -> std::same_as<typename B::share>;
      { b.global_statistics(std::move(all)) } -> std::same_as<typename B::statistics>;
      { b.own_statistics() } -> std::same_as<typename B::statistics>;
    };

/// window_statistics_backend<B, Comm> as one static_assert per requirement, each naming the missing member.
template <class B, class Comm>
constexpr bool check_window_statistics_backend() {
  static_assert(requires { typename B::floats; },
                "stria: Backend must have a member type floats (its arrays: std::vector<float>, or device_buffer<float>)");
  static_assert(requires { typename B::share; }, "stria: Backend must have a member type share (a stria::engine::rank_share of its arrays)");
  static_assert(requires { typename B::window_rows; }, "stria: Backend must have a member type window_rows (a span over the window's rows)");
  static_assert(requires { typename B::statistics; }, "stria: Backend must have a member type statistics (the gathering's result)");
  using floats = typename B::floats;
  static_assert(requires(B& b, Comm& comm) { b.exchange(comm); },
                "stria: Backend must have exchange(Comm&) returning the collectives on its arrays (as engine::host_exchange)");
  static_assert(requires(B& b) { { b.window() } -> std::same_as<typename B::window_rows>; }, "stria: Backend must have window() returning window_rows");
  static_assert(requires(B& b) { b.score_window(); }, "stria: Backend must have score_window()");
  static_assert(requires(B& b) { { b.row_normaliser() } -> std::same_as<floats>; },
                "stria: Backend must have row_normaliser() returning floats (its row max, then its sums of exp against it)");
  static_assert(requires(B& b, floats all) { b.place_normaliser(std::move(all)); },
                "stria: Backend must have place_normaliser(floats every_rank) (every rank's row_normaliser(), rank after rank)");
  static_assert(requires(B& b) { b.probabilities(); }, "stria: Backend must have probabilities()");
  static_assert(requires(B& b) { { b.rank_share() } -> std::same_as<typename B::share>; }, "stria: Backend must have rank_share() returning share");
  static_assert(requires(B& b, typename B::share all) { { b.global_statistics(std::move(all)) } -> std::same_as<typename B::statistics>; },
                "stria: Backend must have global_statistics(share all_ranks) returning statistics");
  static_assert(requires(B& b) { { b.own_statistics() } -> std::same_as<typename B::statistics>; },
                "stria: Backend must have own_statistics() returning statistics");
  return true;
}

namespace detail {

/// Closes every run of selection keys: larger than any candidate's key.
inline constexpr std::uint64_t end_of_run = std::numeric_limits<std::uint64_t>::max();

/// How many of the first k entries of the merge of sorted runs a and b (ties to a) come from a:
/// the least i for which b[k - i - 1] comes before a[i] (the merge path's crossing of diagonal k).
inline std::size_t taken_from_first(std::span<const std::uint64_t> a, std::span<const std::uint64_t> b, std::size_t k) {
  std::size_t low = k > b.size() ? k - b.size() : 0, high = std::min(k, a.size());
  while (low < high)
    if (const std::size_t i = (low + high) / 2; b[k - i - 1] < a[i]) high = i;
    else low = i + 1;
  return low;
}

/// The first `count` entries (count <= |a| + |b|) of the merge of sorted runs a and b, each closed
/// by end_of_run, written to `out` and closed by end_of_run too. The merge path splits the output
/// into `lanes` independent merges of equal length, each run one step at a time in turn: a merge
/// step waits on the previous one's compare, so interleaved lanes keep the processor busy. Within
/// a lane no run ends early (the next key of the other run, or end_of_run, always loses), so no
/// step branches.
inline void merge_first(std::span<const std::uint64_t> a, std::span<const std::uint64_t> b, std::uint64_t* out, std::size_t count) {
  constexpr std::size_t lanes = 4;
  struct lane {
    const std::uint64_t *x, *y;
    std::uint64_t *out, *out_end;
    void step() {
      const std::uint64_t from_x = *x, from_y = *y;
      const bool take_y = from_y < from_x;
      *out++ = take_y ? from_y : from_x;
      x += !take_y;
      y += take_y;
    }
  };
  std::array<lane, lanes> lane_of{};
  for (std::size_t l = 0, begin = 0, from_a = 0; l < lanes; ++l) {
    const std::size_t end = count * (l + 1) / lanes, end_from_a = taken_from_first(a, b, end);
    lane_of[l] = {a.data() + from_a, b.data() + (begin - from_a), out + begin, out + end};
    begin = end;
    from_a = end_from_a;
  }
  for (std::size_t step = 0; step < count / lanes; ++step)
    for (lane& l : lane_of) l.step();
  for (lane& l : lane_of)
    while (l.out != l.out_end) l.step();
  out[count] = end_of_run;
}

}  // namespace detail

/// The statistics of `plan` from the ranks' shares, rank after rank: mass [world, Hq, rank_blocks +
/// 1] and candidates [world, Hq, per_rank] (rank_share). Each key block's mass lands on its block
/// diagonal, window masses add up in rank order, and each head's union (runs merged pairwise, as
/// the ranks' order fixes no tie: tokens differ) keeps its first plan.keep entries, the sentinels
/// (negative masses) left out. A union's first `keep` entries come from the first `keep` of each
/// run merged into it, so every merge stops there.
inline vs_statistics combine_shares(const window_plan& plan, std::span<const float> mass, std::span<const std::uint64_t> candidates) {
  vs_statistics st = plan.shape;
  const index_t heads = st.num_heads, world = plan.world;
  const auto row = static_cast<std::size_t>(plan.rank_blocks + 1), diagonals = static_cast<std::size_t>(st.num_diagonals());
  const std::size_t runs_count = static_cast<std::size_t>(world) * static_cast<std::size_t>(heads), per_rank = static_cast<std::size_t>(plan.per_rank);
  if (mass.size() != runs_count * row)
    throw invalid_argument("mass.size()", mass.size(), "must be world * Hq * (rank_blocks + 1) = " + std::to_string(runs_count * row));
  if (candidates.size() != runs_count * per_rank)
    throw invalid_argument("candidates.size()", candidates.size(), "must be world * Hq * per_rank = " + std::to_string(runs_count * per_rank));
  std::vector<std::size_t> diagonal;  // [world, rank_blocks]: each rank's key blocks' diagonals, as slash_mass indexes them
  for (const index_t block : plan.key_global_block)
    diagonal.push_back(static_cast<std::size_t>(st.diagonal_of(block * block_tokens) + st.diagonal_offset()));
  for (index_t h = 0; h < heads; ++h) {
    float* slash = st.slash_mass.data() + static_cast<std::size_t>(h) * diagonals;
    float& window = st.window_mass[static_cast<std::size_t>(h)];
    for (index_t r = 0; r < world; ++r) {
      const float* m = mass.data() + static_cast<std::size_t>(r * heads + h) * row;
      for (std::size_t b = 0; b + 1 < row; ++b) slash[diagonal[static_cast<std::size_t>(r) * (row - 1) + b]] = m[b];
      window = r == 0 ? m[row - 1] : window + m[row - 1];
    }
  }

  // Each head's runs, each closed by end_of_run: pass after pass, runs 2i and 2i + 1 merge into
  // run i of the next, until one is left.
  const std::size_t keep = static_cast<std::size_t>(plan.keep), cut = std::min(per_rank, keep);
  std::vector<std::uint64_t> runs, merged;
  std::vector<std::size_t> first, next_first;  // run i is runs[first[i], first[i + 1] - 1), then its end_of_run
  st.vertical.assign(static_cast<std::size_t>(heads), {});
  for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h) {
    runs.resize((cut + 1) * static_cast<std::size_t>(world));
    first.assign(1, 0);
    for (std::size_t r = 0; r < static_cast<std::size_t>(world); ++r) {
      const auto run = candidates.subspan((r * static_cast<std::size_t>(heads) + h) * per_rank, cut);
      std::copy(run.begin(), run.end(), runs.begin() + static_cast<std::ptrdiff_t>(first.back()));
      first.push_back(first.back() + cut + 1);
      runs[first.back() - 1] = detail::end_of_run;
    }
    while (first.size() > 2) {
      const auto run = [&](std::size_t i) {  // past the last run: an empty one, at the last one's end_of_run
        const std::span<const std::uint64_t> all(runs);
        return i + 1 < first.size() ? all.subspan(first[i], first[i + 1] - 1 - first[i]) : all.subspan(first.back() - 1, 0);
      };
      merged.resize(runs.size());
      next_first.assign(1, 0);
      for (std::size_t i = 0; i + 1 < first.size(); i += 2) {
        const std::size_t length = std::min(run(i).size() + run(i + 1).size(), keep);
        detail::merge_first(run(i), run(i + 1), merged.data() + next_first.back(), length);
        next_first.push_back(next_first.back() + length + 1);
      }
      std::swap(runs, merged);
      std::swap(first, next_first);
    }
    // The union: the first `keep`, down to the first sentinel.
    const auto kept = std::span(runs).first(first[1] - 1);
    auto& union_h = st.vertical[h];
    union_h.resize(static_cast<std::size_t>(std::lower_bound(kept.begin(), kept.end(), stria::detail::negative_masses) - kept.begin()));
    std::transform(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(union_h.size()), union_h.begin(), stria::detail::candidate_of);
  }
  return st;
}

/// One rank's window statistics of `plan` on backend `b`, identical on every rank (DESIGN 7):
/// 1. the window (the last window_rows global query tokens, all in the last block, so one rank owns
///    them) reaches every rank: its owner broadcasts the rows;
/// 2. each rank scores it against its local keys (scaled, causal by global position);
/// 3. the softmax becomes global: one all-gather of every rank's row max and sum of exp against it,
///    which each rank combines (as the online softmax merges partial rows);
/// 4. the probabilities give each key token's and each key block's window mass, and each rank its
///    top per_rank vertical candidates per head;
/// 5. two all-gathers bring every rank's block and window masses and its candidates to every rank,
///    and the backend combines them (combine_shares, or its device twin).
/// So four collectives, whatever the world size (none over one rank).
/// Every collective runs where the backend's arrays lie (b.exchange): on the device backend the
/// whole gathering stays on the device, in stream order.
template <class Backend, class Comm>
typename Backend::statistics gather_window_statistics(Backend& b, Comm& comm, const window_plan& plan) {
  static_assert(stria::detail::check_rank_and_world_size<Comm>());
  static_assert(check_window_statistics_backend<Backend, Comm>());
  const index_t world = comm.world_size(), heads = plan.shape.num_heads;
  if (world != plan.world) throw invalid_argument("comm.world_size()", world, "must equal the plan's world " + std::to_string(plan.world));
  if (world == 1) {  // every collective is an identity
    b.score_window();
    b.probabilities();
    return b.own_statistics();
  }
  auto collectives = b.exchange(comm);
  collectives.broadcast(b.window(), plan.window_owner);
  b.score_window();
  const std::size_t normaliser = 2 * static_cast<std::size_t>(heads) * static_cast<std::size_t>(plan.shape.window_rows);
  const typename Backend::floats own = b.row_normaliser();
  if (own.size() != normaliser)
    throw invalid_argument("b.row_normaliser().size()", own.size(), "must be 2 * Hq * window_rows = " + std::to_string(normaliser));
  b.place_normaliser(collectives.all_gather(own));
  b.probabilities();

  const typename Backend::share mine = b.rank_share();
  const auto masses = static_cast<std::size_t>(heads) * static_cast<std::size_t>(plan.rank_blocks + 1),
             candidates = static_cast<std::size_t>(heads) * static_cast<std::size_t>(plan.per_rank);
  if (mine.mass.size() != masses)
    throw invalid_argument("b.rank_share().mass.size()", mine.mass.size(), "must be Hq * (rank_blocks + 1) = " + std::to_string(masses));
  if (mine.candidates.size() != candidates)
    throw invalid_argument("b.rank_share().candidates.size()", mine.candidates.size(), "must be Hq * per_rank = " + std::to_string(candidates));
  return b.global_statistics({collectives.all_gather(mine.mass), collectives.all_gather(mine.candidates)});  // in this order on every rank
}

}  // namespace stria::engine
