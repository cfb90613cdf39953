// SPDX-License-Identifier: Apache-2.0
// The estimator's window statistics, written once for the host and the device backend (DESIGN 7
// and 10): the steps of one rank's gathering and the collectives that make them global.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
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
/// world}. Each head's union keeps its first `keep` entries, the global top `keep` when keep <=
/// per_rank (or every rank sends all its tokens): a selection that reads no more than its cap loses
/// nothing when `keep` is that cap.
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
                std::min(request.vertical_candidates, blocks * block_tokens), keep, {}};
  for (index_t r = 0; r < world; ++r)
    for (index_t b = 0; b < blocks; ++b) p.key_global_block.push_back(sharding.global_block(layout, {r, b}));
  return p;
}

/// A head's sketch of a rank's run of candidates: the masses at positions sketch_position(i) - 1,
/// i < sketch_points, ceil((i + 1) * per_rank / 64).
inline constexpr index_t sketch_points = 64;
inline std::size_t sketch_position(index_t i, index_t per_rank) { return static_cast<std::size_t>((i + 1) * std::int64_t{per_rank} + 63) / 64; }

/// One rank's share of the statistics, what the first all-gather of step 5 combines. A rank's
/// candidates, each head's top per_rank vertical candidates in selection order (tokens of the
/// request's local blocks carry mass -1, so they sort last and never enter the union), stay with
/// the backend until the engine knows how many of each head's run can matter (b.candidates).
struct rank_share {
  /// [Hq, rank_blocks + 1]: the window mass on each local key block (the window lies in the last
  /// block, so a key block's mass is all on one block diagonal), then the rank's whole window mass.
  std::vector<float> mass;
  /// [Hq, sketch_points]: each head's sketch of its candidates (sketch_of); empty when per_rank is 0.
  std::vector<float> sketch;
};

/// The sketches of `candidates` [Hq, per_rank] (rank_share::sketch), for backends that hold them on the host.
inline std::vector<float> sketch_of(std::span<const vertical_candidate> candidates, index_t heads, index_t per_rank) {
  std::vector<float> sketch;
  for (index_t h = 0; h < heads && per_rank > 0; ++h)
    for (index_t i = 0; i < sketch_points; ++i)
      sketch.push_back(candidates[static_cast<std::size_t>(h) * static_cast<std::size_t>(per_rank) + sketch_position(i, per_rank) - 1].mass);
  return sketch;
}

/// Each head's first width[h] of `candidates` [Hq, per_rank], head after head (what b.candidates
/// returns), for backends that hold them on the host.
inline std::vector<vertical_candidate> runs_up_to(std::span<const vertical_candidate> candidates, index_t per_rank, std::span<const index_t> width) {
  std::vector<vertical_candidate> sent;
  for (std::size_t h = 0; h < width.size(); ++h) {
    const auto first = candidates.begin() + static_cast<std::ptrdiff_t>(h) * per_rank;
    sent.insert(sent.end(), first, first + width[h]);
  }
  return sent;
}

/// Requirements of a window statistics backend B, one rank's local work (built-ins:
/// estimator::detail::window_backend, device::detail::window_backend). The engine makes every
/// collective. Over one rank, where they are identities, it makes none and calls no member marked
/// (W > 1): the backend's own window, row max and sums are then the global ones.
/// - `b.window()` (W > 1): the window rows, a host array `B::window_rows&` that the owner has filled and
///   the broadcast fills on the other ranks; `b.score_window()`: pass 1 against the local keys;
/// - `b.row_max()` (W > 1): this rank's row max [Hq, rows]; `b.row_sum(global_max)` (W > 1): its
///   sums of exp against the global max; `b.place_normaliser(global_max, global_sum)` (W > 1);
/// - `b.probabilities()`: pass 2, each key token's and key block's window mass, each head's top
///   per_rank candidates;
/// - `b.rank_share()` (W > 1): the masses and the candidates' sketches; `b.candidates(width)` (W > 1):
///   a `std::vector<vertical_candidate>` of each head's first width[h] candidates, head after head
///   (width: `const std::vector<index_t>&`, Hq entries, each <= per_rank);
/// - `b.global_statistics(st)` (W > 1): the result `B::statistics` from the combined shares;
///   `b.own_statistics()` (W = 1): the result from this rank's share alone.
template <class B>
concept window_statistics_backend = requires(B& b, const std::vector<float>& f, const std::vector<index_t>& w, vs_statistics st) {
  { b.window() } -> std::same_as<typename B::window_rows&>;
  b.score_window();
  { b.row_max() } -> std::same_as<std::vector<float>>;
  { b.row_sum(f) } -> std::same_as<std::vector<float>>;
  b.place_normaliser(f, f);
  b.probabilities();
  { b.rank_share() } -> std::same_as<rank_share>;
  { b.candidates(w) } -> std::same_as<std::vector<vertical_candidate>>;
  { b.global_statistics(std::move(st)) } -> std::same_as<typename B::statistics>;
  { b.own_statistics() } -> std::same_as<typename B::statistics>;
};

/// window_statistics_backend<B> as one static_assert per requirement, each naming the missing member.
template <class B>
constexpr bool check_window_statistics_backend() {
  using floats = const std::vector<float>&;
  static_assert(requires { typename B::window_rows; }, "stria: Backend must have a member type window_rows (a host array)");
  static_assert(requires { typename B::statistics; }, "stria: Backend must have a member type statistics (the gathering's result)");
  static_assert(requires(B& b) { { b.window() } -> std::same_as<typename B::window_rows&>; },
                "stria: Backend must have window() returning window_rows&");
  static_assert(requires(B& b) { b.score_window(); }, "stria: Backend must have score_window()");
  static_assert(requires(B& b) { { b.row_max() } -> std::same_as<std::vector<float>>; },
                "stria: Backend must have row_max() returning std::vector<float>");
  static_assert(requires(B& b, floats m) { { b.row_sum(m) } -> std::same_as<std::vector<float>>; },
                "stria: Backend must have row_sum(const std::vector<float>& global_max) returning std::vector<float>");
  static_assert(requires(B& b, floats m) { b.place_normaliser(m, m); },
                "stria: Backend must have place_normaliser(const std::vector<float>& global_max, const std::vector<float>& global_sum)");
  static_assert(requires(B& b) { b.probabilities(); }, "stria: Backend must have probabilities()");
  static_assert(requires(B& b) { { b.rank_share() } -> std::same_as<rank_share>; },
                "stria: Backend must have rank_share() returning stria::engine::rank_share");
  static_assert(requires(B& b, const std::vector<index_t>& w) { { b.candidates(w) } -> std::same_as<std::vector<vertical_candidate>>; },
                "stria: Backend must have candidates(const std::vector<index_t>& width) returning std::vector<stria::vertical_candidate>");
  static_assert(requires(B& b, vs_statistics st) { { b.global_statistics(std::move(st)) } -> std::same_as<typename B::statistics>; },
                "stria: Backend must have global_statistics(stria::vs_statistics) returning statistics");
  static_assert(requires(B& b) { { b.own_statistics() } -> std::same_as<typename B::statistics>; },
                "stria: Backend must have own_statistics() returning statistics");
  return true;
}

namespace detail {

/// How many entries of each head's run every rank sends, from the sketches [world, Hq, 64]: the
/// first p_i entries of a run weigh >= its sketch point i, the rest <= it. So T, the largest sketch
/// mass that `keep` entries are known to reach, has `keep` entries ahead of any lighter one, and a
/// run is needed only before its first point lighter than T. All ranks send a head's largest need.
inline std::vector<index_t> run_widths(std::span<const float> sketch, index_t world, index_t heads, index_t per_rank, index_t keep) {
  std::vector<index_t> width(static_cast<std::size_t>(heads), per_rank);
  for (index_t h = 0; h < heads && per_rank > 0; ++h) {
    const auto reach = [&](index_t r, float t) {  // sketch points of rank r that weigh >= t (a run descends)
      const float* s = sketch.data() + static_cast<std::size_t>((r * heads + h) * sketch_points);
      return static_cast<index_t>(std::partition_point(s, s + sketch_points, [t](float m) { return m >= t; }) - s);
    };
    const auto known_below_keep = [&](float t) {
      std::size_t known = 0;
      for (index_t r = 0; r < world; ++r)
        if (const index_t j = reach(r, t); j > 0) known += sketch_position(j - 1, per_rank);
      return known < static_cast<std::size_t>(keep);
    };
    std::vector<float> masses;
    for (index_t r = 0; r < world; ++r)
      for (index_t i = 0; i < sketch_points; ++i)
        if (const float m = sketch[static_cast<std::size_t>((r * heads + h) * sketch_points + i)]; m == m) masses.push_back(m);  // NaN: no threshold
    std::sort(masses.begin(), masses.end(), std::greater<>());
    const auto threshold = std::partition_point(masses.begin(), masses.end(), known_below_keep);
    if (threshold == masses.end()) continue;  // `keep` reaches past every run: all of them
    index_t& need = width[static_cast<std::size_t>(h)] = 0;
    for (index_t r = 0; r < world; ++r)
      need = std::max(need, reach(r, *threshold) < sketch_points ? static_cast<index_t>(sketch_position(reach(r, *threshold), per_rank)) - 1 : per_rank);
  }
  return width;
}

/// A candidate as one integer whose order is selection order (vertical_candidate's operator<,
/// smaller first), so that a merge compares one integer instead of two fields: the mass's bits,
/// turned to sort heavier first, above token * 2 (tokens lie in [0, 2^31)), and in the last bit the
/// sign of a zero mass (-0.0 == 0.0 in selection order, so both share their mass bits). A NaN mass
/// has no place in selection order; here it sorts as its bits say.
inline std::uint64_t selection_key(const vertical_candidate& c) {
  const auto bits = std::bit_cast<std::uint32_t>(c.mass);
  const std::uint32_t negative_zero = bits == 0x80000000u, mass = bits & ~(negative_zero << 31);
  // Non-negative masses: their 31 bits reversed, heaviest first; then the negative ones as they are.
  const std::uint32_t order = mass ^ (((mass >> 31) - 1u) & 0x7fffffffu);
  return std::uint64_t{order} << 32 | static_cast<std::uint64_t>(c.token) << 1 | negative_zero;
}
inline vertical_candidate candidate_of(std::uint64_t key) {
  const auto order = static_cast<std::uint32_t>(key >> 32), mass = order ^ (((order >> 31) - 1u) & 0x7fffffffu);
  return {std::bit_cast<float>(key & 1 ? 0x80000000u : mass), static_cast<index_t>(static_cast<std::uint32_t>(key) >> 1)};
}
/// The first key of a negative mass (a sentinel): every lighter candidate's key is at least this.
inline constexpr std::uint64_t negative_masses = std::uint64_t{1} << 63;
/// Closes every run of keys: larger than any candidate's key.
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

/// The statistics of `plan` from the ranks' shares: mass [world, Hq, rank_blocks + 1] (as in
/// rank_share) and candidates [world, Hq, width[h]], each run in selection order. Each key block's
/// mass lands on its block diagonal, window masses add up in rank order, and each head's union
/// (runs merged pairwise, as the ranks' order fixes no tie: tokens differ) keeps its first plan.keep
/// entries, the sentinels (mass -1) left out. A union's first `keep` entries come from the first
/// `keep` of each run merged into it, so every merge stops there.
inline vs_statistics combine_shares(const window_plan& plan, std::span<const float> mass, std::span<const vertical_candidate> candidates,
                                    const std::vector<index_t>& width) {
  vs_statistics st = plan.shape;
  const index_t heads = st.num_heads, world = plan.world;
  const auto row = static_cast<std::size_t>(plan.rank_blocks + 1), diagonals = static_cast<std::size_t>(st.num_diagonals());
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

  // Each head's runs as selection keys, each closed by end_of_run: pass after pass, runs 2i and
  // 2i + 1 merge into run i of the next, until one is left.
  const std::size_t rank_size = candidates.size() / static_cast<std::size_t>(world), keep = static_cast<std::size_t>(plan.keep);
  std::vector<std::uint64_t> runs, merged;
  std::vector<std::size_t> first, next_first;  // run i is runs[first[i], first[i + 1] - 1), then its end_of_run
  st.vertical.assign(static_cast<std::size_t>(heads), {});
  for (std::size_t h = 0, offset = 0; h < static_cast<std::size_t>(heads); offset += static_cast<std::size_t>(width[h++])) {
    const std::size_t cut = std::min(static_cast<std::size_t>(width[h]), keep);
    runs.resize((cut + 1) * static_cast<std::size_t>(world));
    first.assign(1, 0);
    for (std::size_t r = 0; r < static_cast<std::size_t>(world); ++r) {
      const auto run = candidates.subspan(r * rank_size + offset, cut);
      std::transform(run.begin(), run.end(), runs.begin() + static_cast<std::ptrdiff_t>(first.back()), detail::selection_key);
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
    union_h.resize(static_cast<std::size_t>(std::lower_bound(kept.begin(), kept.end(), detail::negative_masses) - kept.begin()));
    std::transform(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(union_h.size()), union_h.begin(), detail::candidate_of);
  }
  return st;
}

/// One rank's window statistics of `plan` on backend `b`, identical on every rank (DESIGN 7):
/// 1. the window (the last window_rows global query tokens, all in the last block, so one rank owns
///    them) reaches every rank: its owner broadcasts the rows;
/// 2. each rank scores it against its local keys (scaled, causal by global position);
/// 3. the softmax becomes global: all-reduce of the row max, then of every rank's sum of exp against it;
/// 4. the probabilities give each key token's and each key block's window mass, and each rank its
///    top per_rank vertical candidates per head;
/// 5. an all-gather brings every rank's block and window masses with its candidates' sketch, a
///    second the candidates that may reach a union's first plan.keep entries (with whole_union: all
///    of them), and combine_shares makes the statistics. The backend hands over only those
///    candidates (b.candidates), so a device backend copies no more of them to the host.
template <class Backend, class Comm>
typename Backend::statistics gather_window_statistics(Backend& b, Comm& comm, const window_plan& plan) {
  static_assert(check_window_statistics_backend<Backend>());
  static_assert(check_host_collectives<Comm>());
  const index_t world = comm.world_size(), heads = plan.shape.num_heads, per_rank = plan.per_rank;
  if (world != plan.world) throw invalid_argument("comm.world_size()", world, "must equal the plan's world " + std::to_string(plan.world));
  if (world == 1) {  // every collective is an identity
    b.score_window();
    b.probabilities();
    return b.own_statistics();
  }
  typename Backend::window_rows& rows = b.window();
  comm.broadcast(rows.data(), rows.size(), plan.window_owner);
  b.score_window();
  std::vector<float> max = b.row_max();
  comm.all_reduce(max.data(), max.data(), max.size(), comm::reduce_op::max);
  std::vector<float> sum = b.row_sum(max);
  comm.all_reduce(sum.data(), sum.data(), sum.size(), comm::reduce_op::sum);
  b.place_normaliser(max, sum);
  b.probabilities();

  rank_share mine = b.rank_share();
  const auto masses = static_cast<std::size_t>(heads) * static_cast<std::size_t>(plan.rank_blocks + 1),
             sketches = static_cast<std::size_t>(heads * sketch_points);
  if (mine.mass.size() != masses)
    throw invalid_argument("b.rank_share().mass.size()", mine.mass.size(), "must be Hq * (rank_blocks + 1) = " + std::to_string(masses));
  if (mine.sketch.size() != (per_rank > 0 ? sketches : 0))
    throw invalid_argument("b.rank_share().sketch.size()", mine.sketch.size(), "must be Hq * 64 = " + std::to_string(sketches) + " (0 without candidates)");
  mine.mass.insert(mine.mass.end(), mine.sketch.begin(), mine.sketch.end());
  const std::size_t share = masses + sketches;
  mine.mass.resize(share);  // no candidates: a sketch of zeros
  std::vector<float> gathered(share * static_cast<std::size_t>(world)), mass, sketch;
  comm.all_gather(mine.mass.data(), gathered.data(), share);
  for (auto first = gathered.begin(); first != gathered.end(); first += static_cast<std::ptrdiff_t>(share)) {
    mass.insert(mass.end(), first, first + static_cast<std::ptrdiff_t>(masses));
    sketch.insert(sketch.end(), first + static_cast<std::ptrdiff_t>(masses), first + static_cast<std::ptrdiff_t>(share));
  }
  const std::vector<index_t> width = detail::run_widths(sketch, world, heads, per_rank, plan.keep);
  const std::vector<vertical_candidate> sent = b.candidates(width);  // each head's run up to its width
  if (const auto expected = static_cast<std::size_t>(std::accumulate(width.begin(), width.end(), std::int64_t{0})); sent.size() != expected)
    throw invalid_argument("b.candidates(width).size()", sent.size(), "must be the widths' sum " + std::to_string(expected));
  std::vector<vertical_candidate> candidates(sent.size() * static_cast<std::size_t>(world));
  comm.all_gather(sent.data(), candidates.data(), sent.size());
  return b.global_statistics(combine_shares(plan, mass, candidates, width));
}

}  // namespace stria::engine
