// SPDX-License-Identifier: Apache-2.0
// The window statistics engine on a backend written as a third party would, with no attention math:
// the window and the normaliser reach every rank, block masses land on their diagonals, and each
// head's union keeps exactly the global top `keep` candidates (ties, skewed ranks, every world 1-8)
// while the all-gathers carry no more than `keep` candidates per rank; one rank makes no collective. On
// the host backend, statistics cut to the vertical cap select exactly what the whole union selects.
// combine_shares alone matches every run sorted together, bit for bit, for W up to 16, causal or not.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/engine/window_statistics_engine.hpp"
#include "stria/estimator/vertical_slash_top_k.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "support/counting_comm.hpp"
#include "support/random.hpp"
#include "support/random_shares.hpp"

namespace third_party {

using stria::index_t;
using stria::vertical_candidate;

/// A rank's share as a test gives it: its masses [Hq, rank_blocks + 1] and candidates [Hq, per_rank].
struct given_share {
  std::vector<float> mass;
  std::vector<vertical_candidate> candidates;
};

/// A rank's share is given; its window is two rows of its rank, its normaliser normaliser_of(rank)
/// (`normaliser_size` overrides its size). It records the members the engine calls, in order.
struct share_backend {
  using floats = std::vector<float>;
  using share = stria::engine::rank_share<floats, std::vector<std::uint64_t>>;
  using window_rows = std::span<float>;
  using statistics = stria::vs_statistics;

  const stria::engine::window_plan& plan;
  index_t rank;
  const given_share& given;
  std::size_t normaliser_size = 2 * static_cast<std::size_t>(plan.shape.num_heads * plan.shape.window_rows);
  std::vector<float> rows{}, every_normaliser{};
  std::vector<std::string> calls{};

  template <class Comm>
  stria::engine::host_exchange<Comm> exchange(Comm& comm) {
    calls.emplace_back("exchange");
    return {comm};
  }
  window_rows window() {
    calls.emplace_back("window");
    rows.assign(2, static_cast<float>(rank));
    return rows;
  }
  void score_window() { calls.emplace_back("score_window"); }
  /// Rank r's made-up normaliser of `size` values: every row's max, then its sum (distinct per rank and row).
  static std::vector<float> normaliser_of(index_t r, std::size_t size) {
    std::vector<float> values(size);
    for (std::size_t i = 0; i < size; ++i) values[i] = static_cast<float>(r) + 0.25f * static_cast<float>(i);
    return values;
  }
  std::vector<float> row_normaliser() {
    calls.emplace_back("row_normaliser");
    return normaliser_of(rank, normaliser_size);
  }
  void place_normaliser(std::vector<float> every_rank) {
    calls.emplace_back("place_normaliser");
    every_normaliser = std::move(every_rank);
  }
  void probabilities() { calls.emplace_back("probabilities"); }
  share rank_share() {
    calls.emplace_back("rank_share");
    return {given.mass, keys()};
  }
  statistics global_statistics(share all) {
    calls.emplace_back("global_statistics");
    return stria::engine::combine_shares(plan, all.mass, all.candidates);
  }
  statistics own_statistics() {
    calls.emplace_back("own_statistics");
    return stria::engine::combine_shares(plan, given.mass, keys());
  }
  [[nodiscard]] std::vector<std::uint64_t> keys() const {
    std::vector<std::uint64_t> keys;
    for (const vertical_candidate& c : given.candidates) keys.push_back(stria::detail::selection_key(c));
    return keys;
  }
};
static_assert(stria::engine::window_statistics_backend<share_backend, stria::comm::host_threads>);

}  // namespace third_party

namespace {

using namespace stria;

enum class masses { spread, one_rank_heavy, all_equal };

/// Rank r's share under `plan`: block masses on a grid, and per head its tokens' masses on a coarse
/// grid (many exact ties), the local blocks' tokens as sentinels, the top per_rank in selection order.
third_party::given_share make_share(const engine::window_plan& plan, index_t r, masses kind, test::seeded_rng& rng) {
  const index_t heads = plan.shape.num_heads, first_local_block = plan.shape.num_blocks() - plan.shape.local_blocks;
  third_party::given_share share;
  for (index_t i = 0; i < heads * (plan.rank_blocks + 1); ++i) share.mass.push_back(static_cast<float>(rng.integer(0, 64)) / 256.0f);
  for (index_t h = 0; h < heads; ++h) {
    std::vector<vertical_candidate> run;
    for (const index_t block : plan.global_blocks(r))
      for (index_t t = 0; t < block_tokens; ++t) {
        float m = kind == masses::all_equal ? 0.25f : static_cast<float>(rng.integer(0, 40)) / 64.0f;
        if (kind == masses::one_rank_heavy && r == plan.world / 2) m += 1.0f;
        run.push_back({block >= first_local_block ? -1.0f : m, block * block_tokens + t});
      }
    std::sort(run.begin(), run.end());
    share.candidates.insert(share.candidates.end(), run.begin(), run.begin() + plan.per_rank);
  }
  return share;
}

template <class Sharding>
void check_engine(const Sharding& sharding, index_t world, index_t vertical_candidates, index_t keep, masses kind, test::seeded_rng& rng) {
  const index_t seq_len = 256 * world, heads = 3;
  const engine::window_plan plan = engine::make_window_plan(sharding, seq_len, world, true, heads, {64, vertical_candidates, 1}, keep);
  std::vector<third_party::given_share> shares;
  for (index_t r = 0; r < world; ++r) shares.push_back(make_share(plan, r, kind, rng));
  std::vector<vs_statistics> result(static_cast<std::size_t>(world));
  std::vector<std::vector<std::string>> calls(result.size());
  comm::host_world ranks(world);
  std::vector<std::vector<float>> rows(result.size()), normalisers(result.size());
  std::vector<std::size_t> gathered(result.size());
  std::vector<int> collectives(result.size());
  ranks.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    third_party::counting_comm counting(c);
    third_party::share_backend b{plan, c.rank(), shares[r]};
    result[r] = engine::gather_window_statistics(b, counting, plan);
    calls[r] = b.calls;
    rows[r] = b.rows;
    normalisers[r] = b.every_normaliser;
    gathered[r] = counting.gathered_bytes;
    collectives[r] = counting.broadcasts * 100 + counting.all_reduces * 10 + counting.all_gathers;
  });

  // The reference: every rank's run, sorted together, sentinels out, the first `keep`.
  for (index_t r = 0; r < world; ++r) {
    CAPTURE(r);
    const auto rank = static_cast<std::size_t>(r);
    if (world == 1) {
      CHECK(calls[rank] == std::vector<std::string>{"score_window", "probabilities", "own_statistics"});
      CHECK(collectives[rank] == 0);
    } else {
      CHECK(calls[rank] == std::vector<std::string>{"exchange", "window", "score_window", "row_normaliser", "place_normaliser", "probabilities",
                                                   "rank_share", "global_statistics"});
      CHECK(collectives[rank] == 103);  // one broadcast, three all-gathers
      CHECK(rows[rank] == std::vector<float>(2, static_cast<float>(plan.window_owner)));
      std::vector<float> every_rank;  // each rank's normaliser, rank after rank
      const std::size_t size = 2 * static_cast<std::size_t>(heads * plan.shape.window_rows);
      for (index_t s = 0; s < world; ++s) {
        const std::vector<float> one = third_party::share_backend::normaliser_of(s, size);
        every_rank.insert(every_rank.end(), one.begin(), one.end());
      }
      CHECK(normalisers[rank] == every_rank);
    }
    const vs_statistics& st = result[rank];
    CHECK(st.slash_mass == result[0].slash_mass);
    CHECK(st.window_mass == result[0].window_mass);
    CHECK(st.vertical == result[0].vertical);
  }
  const vs_statistics& st = result[0];
  for (index_t h = 0; h < heads; ++h) {
    CAPTURE(h);
    float window = 0;
    std::vector<vertical_candidate> all;
    for (index_t r = 0; r < world; ++r) {
      const third_party::given_share& share = shares[static_cast<std::size_t>(r)];
      const float* m = share.mass.data() + h * (plan.rank_blocks + 1);
      for (index_t b = 0; b < plan.rank_blocks; ++b) {
        const index_t block = plan.global_blocks(r)[static_cast<std::size_t>(b)];
        CHECK(st.slash_mass[static_cast<std::size_t>(h * st.num_diagonals() + st.diagonal_of(block * block_tokens))] == m[b]);
      }
      window = r == 0 ? m[plan.rank_blocks] : window + m[plan.rank_blocks];
      all.insert(all.end(), share.candidates.begin() + h * plan.per_rank, share.candidates.begin() + (h + 1) * plan.per_rank);
    }
    CHECK(st.window_mass[static_cast<std::size_t>(h)] == window);
    std::sort(all.begin(), all.end());
    all.erase(std::find_if(all.begin(), all.end(), [](const vertical_candidate& c) { return c.mass < 0.0f; }), all.end());
    const std::vector<vertical_candidate> expected(all.begin(), all.begin() + std::min<std::ptrdiff_t>(keep, static_cast<std::ptrdiff_t>(all.size())));
    CHECK(st.vertical[static_cast<std::size_t>(h)] == expected);
  }
  // The all-gathers carry every rank's normaliser, masses and runs of at most `keep` candidates, nothing more.
  CHECK(plan.per_rank == std::min({vertical_candidates, plan.rank_blocks * block_tokens, keep}));
  if (world > 1)
    CHECK(gathered[0] == static_cast<std::size_t>(world * heads) *
                             (2 * static_cast<std::size_t>(plan.shape.window_rows) * sizeof(float) +
                              static_cast<std::size_t>(plan.rank_blocks + 1) * sizeof(float) + static_cast<std::size_t>(plan.per_rank) * sizeof(std::uint64_t)));
}

/// combine_shares on given arguments against the plainest reading of its contract: block masses
/// on their diagonals, window masses summed in rank order, and each head's union the first `keep`
/// of every rank's run sorted together, sentinels out. Masses on a coarse grid (many exact ties,
/// zeros of both signs), runs longer and shorter than `keep`, causal or not.
void check_combine(index_t world, index_t blocks_per_rank, bool causal, index_t cap, index_t keep, test::seeded_rng& rng) {
  const index_t heads = 3, seq_len = world * blocks_per_rank * block_tokens;
  engine::window_plan plan = engine::make_window_plan(sharding::striped<64>{}, seq_len, world, causal, heads, {64, cap, rng.integer(0, blocks_per_rank)});
  plan.keep = keep;  // below per_rank too: runs longer than the union
  const test::random_shares shares = test::make_random_shares(plan, rng);
  const vs_statistics st = engine::combine_shares(plan, shares.mass, shares.candidates);
  const auto run_length = static_cast<std::size_t>(plan.per_rank);
  for (index_t h = 0; h < heads; ++h) {
    CAPTURE(h);
    std::vector<float> slash(static_cast<std::size_t>(st.num_diagonals()), 0.0f);
    float window = 0;
    std::vector<vertical_candidate> all;
    for (index_t r = 0; r < world; ++r) {
      const float* m = shares.mass.data() + (r * heads + h) * (plan.rank_blocks + 1);
      for (index_t b = 0; b < plan.rank_blocks; ++b)
        slash[static_cast<std::size_t>(st.diagonal_of(plan.global_blocks(r)[static_cast<std::size_t>(b)] * block_tokens) + st.diagonal_offset())] = m[b];
      window = r == 0 ? m[plan.rank_blocks] : window + m[plan.rank_blocks];
      const auto run = shares.candidates.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r * heads + h) * run_length);
      std::transform(run, run + static_cast<std::ptrdiff_t>(run_length), std::back_inserter(all), stria::detail::candidate_of);
    }
    CHECK(std::equal(slash.begin(), slash.end(), st.slash_mass.begin() + h * st.num_diagonals()));
    CHECK(st.window_mass[static_cast<std::size_t>(h)] == window);
    std::stable_sort(all.begin(), all.end());  // tokens differ: one order, whatever the sort
    all.resize(std::min<std::size_t>(all.size(), static_cast<std::size_t>(keep)));
    all.erase(std::find_if(all.begin(), all.end(), [](const vertical_candidate& c) { return c.mass < 0.0f; }), all.end());
    const auto& got = st.vertical[static_cast<std::size_t>(h)];
    REQUIRE(got.size() == all.size());
    for (std::size_t i = 0; i < all.size(); ++i) {  // bit for bit: a zero keeps its sign
      CAPTURE(i);
      CHECK(std::bit_cast<std::uint32_t>(got[i].mass) == std::bit_cast<std::uint32_t>(all[i].mass));
      CHECK(got[i].token == all[i].token);
    }
  }
}

/// The host backend through the engine: the first `keep` of each head's union, and nothing else differs.
template <class Sharding>
void check_truncation(const host::synthetic_vs& data, const host::synthetic_vs_options& o, const Sharding& sharding, index_t world) {
  const index_t s = o.seq_len, hq = o.heads_q, hkv = o.heads_kv, d = o.head_dim, local = s / world;
  const auto q = stria::sharding::split(sharding, std::span<const float>(data.q), std::array<index_t, 3>{s, hq, d}, world);
  const auto k = stria::sharding::split(sharding, std::span<const float>(data.k), std::array<index_t, 3>{s, hkv, d}, world);
  estimator::vertical_slash_top_p p, narrow;
  p.p_vertical = 0.9;  // the two goals apart, and narrow's 0.99 a second value
  narrow.vertical = {1, 20};
  narrow.p_vertical = 0.99;
  estimator::vertical_slash_top_k top_k;
  top_k.vertical_count = 9;
  comm::host_world ranks(world);
  ranks.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const tensor_view<const float, 3> qv(q[r].data(), {local, hq, d}), kv(k[r].data(), {local, hkv, d});
    const attention_shape shape{local, local, hq, hkv, d};
    auto check = [&](const auto& e) {
      const statistics_request request = e.request(s);
      const vs_statistics whole = estimator::gather_window_statistics(c, sharding, s, true, qv, kv, 0.125, request);
      const engine::window_plan plan = engine::make_window_plan(sharding, s, world, true, hq, request, request.vertical_candidates);
      estimator::detail::window_backend<float> backend(plan, c.rank(), shape, qv, kv, 0.125);
      const vs_statistics cut = engine::gather_window_statistics(backend, c, plan);
      CHECK(cut.slash_mass == whole.slash_mass);
      CHECK(cut.window_mass == whole.window_mass);
      for (index_t h = 0; h < hq; ++h) {
        const auto& all = whole.vertical[static_cast<std::size_t>(h)];
        const auto kept = std::min<std::size_t>(all.size(), static_cast<std::size_t>(request.vertical_candidates));
        CHECK(cut.vertical[static_cast<std::size_t>(h)] == std::vector<vertical_candidate>(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(kept)));
      }
      const global_selection a = e.select(cut), b = e.select(whole);
      for (index_t h = 0; h < hq; ++h) {
        CHECK(a.heads[static_cast<std::size_t>(h)].vertical_tokens == b.heads[static_cast<std::size_t>(h)].vertical_tokens);
        CHECK(a.heads[static_cast<std::size_t>(h)].slash_deltas == b.heads[static_cast<std::size_t>(h)].slash_deltas);
      }
    };
    check(p);
    check(narrow);
    check(top_k);
  });
}

}  // namespace

TEST_CASE("the window statistics engine on a third-party backend: collectives, diagonals and the exact union, for W = 1-8") {
  STRIA_SEEDED_RNG(rng);
  for (index_t world = 1; world <= 8; ++world)
    for (const masses kind : {masses::spread, masses::one_rank_heavy, masses::all_equal})
      for (const index_t candidates : {1, 37, 100, 256, 300}) {
        CAPTURE(world);
        CAPTURE(static_cast<int>(kind));
        CAPTURE(candidates);
        check_engine(sharding::striped<64>{}, world, candidates, candidates, kind, rng);
        check_engine(sharding::zigzag{}, world, candidates, engine::whole_union, kind, rng);
        check_engine(sharding::sequential{}, world, candidates, std::max(1, candidates / 3), kind, rng);
      }
}

TEST_CASE("combine_shares: the diagonals, the window sums and each union against every run sorted together, for W = 1-16") {
  STRIA_SEEDED_RNG(rng);
  for (const index_t world : {1, 2, 3, 5, 8, 16})
    for (const index_t blocks_per_rank : {1, 3})
      for (const bool causal : {true, false})
        for (const index_t cap : {0, 1, 37, 64, 150})
          for (const int keep_choice : {0, 1, 2, 3}) {
            CAPTURE(world);
            CAPTURE(blocks_per_rank);
            CAPTURE(causal);
            CAPTURE(cap);
            CAPTURE(keep_choice);
            const index_t per_rank = std::min(cap, blocks_per_rank * block_tokens);
            const index_t keeps[] = {std::max(per_rank, 1), engine::whole_union, rng.integer(1, world * per_rank + 1), rng.integer(1, std::max(per_rank, 1))};
            check_combine(world, blocks_per_rank, causal, cap, keeps[keep_choice], rng);
          }
}

TEST_CASE("window statistics cut to the vertical cap select exactly what the whole union selects, for W = 1-8") {
  for (index_t world = 1; world <= 8; ++world) {
    CAPTURE(world);
    host::synthetic_vs_options o;
    o.seq_len = 128 * world * std::max<index_t>(2, (12 + world - 1) / world);
    o.heads_q = 4;
    o.heads_kv = 2;
    o.head_dim = 64;
    o.seed = static_cast<std::uint64_t>(world);
    const host::synthetic_vs data = host::make_synthetic_vs(o);
    check_truncation(data, o, sharding::striped<64>{}, world);
    check_truncation(data, o, sharding::zigzag{}, world);
    if (world % 2 == 1) check_truncation(data, o, sharding::sequential{}, world);
  }
}

TEST_CASE("make_window_plan rejects requests the window cannot satisfy, naming the field") {
  const sharding::striped<64> striped;
  CHECK_THROWS_WITH_AS(engine::make_window_plan(striped, 1024, 2, true, 2, {65, 10, 1}), doctest::Contains("request.window_rows = 65"),
                       const invalid_argument&);
  CHECK_THROWS_WITH_AS(engine::make_window_plan(striped, 1024, 2, true, 2, {64, 10, 17}), doctest::Contains("request.local_blocks = 17"),
                       const invalid_argument&);
  CHECK_THROWS_WITH_AS(engine::make_window_plan(striped, 1024, 2, true, 2, {64, -1, 1}), doctest::Contains("request.vertical_candidates = -1"),
                       const invalid_argument&);
  comm::host_world ranks(2);
  const engine::window_plan plan = engine::make_window_plan(striped, 1024, 3, true, 2, {64, 10, 1});
  ranks.run([&](comm::host_threads& c) {
    const third_party::given_share share;
    third_party::share_backend b{plan, c.rank(), share};
    CHECK_THROWS_WITH_AS(engine::gather_window_statistics(b, c, plan), doctest::Contains("comm.world_size() = 2: must equal the plan's world 3"),
                         const invalid_argument&);
  });
  // A backend whose normaliser has the wrong size is refused before any rank gathers it.
  const engine::window_plan two = engine::make_window_plan(striped, 1024, 2, true, 2, {64, 10, 1});
  ranks.run([&](comm::host_threads& c) {
    const third_party::given_share share;
    third_party::share_backend b{two, c.rank(), share};
    b.normaliser_size = 3;
    CHECK_THROWS_WITH_AS(engine::gather_window_statistics(b, c, two),
                         doctest::Contains("b.row_normaliser().size() = 3: must be 2 * Hq * window_rows = 256"), const invalid_argument&);
  });
}
