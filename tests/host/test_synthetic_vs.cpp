// SPDX-License-Identifier: Apache-2.0
// The synthetic Vertical-Slash generator: deterministic, valid, near its density target, and its
// planted selection holds most of the exact attention mass of the tensors it made (and a shifted
// selection of the same size does not).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "stria/host/recall.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/topology/flat_ring.hpp"

using namespace stria;

namespace {

/// Mean over rows (every `stride`-th) of the exact attention probability on `selection`'s entries, in fp64.
double mean_recall(const host::synthetic_vs& x, const global_selection& selection, const host::synthetic_vs_options& o,
                   index_t stride = 13, double* min_out = nullptr) {
  const index_t s = o.seq_len, hq = o.heads_q, hkv = o.heads_kv, d = o.head_dim, group = hq / hkv;
  std::vector<double> score(static_cast<std::size_t>(s));
  double sum = 0;
  int rows = 0;
  for (index_t h = 0; h < hq; ++h) {
    const head_selection& sel = selection.heads[static_cast<std::size_t>(h)];
    for (index_t n = stride == 1 ? 0 : 5; n < s; n += stride) {
      const index_t keys = selection.causal ? n + 1 : s;
      double top = -1e300;
      for (index_t j = 0; j < keys; ++j) {
        double dot = 0;
        for (index_t e = 0; e < d; ++e)
          dot += double(x.q[(static_cast<std::size_t>(n) * hq + h) * d + e]) * double(x.k[(static_cast<std::size_t>(j) * hkv + h / group) * d + e]);
        score[static_cast<std::size_t>(j)] = dot / std::sqrt(double(d));
        top = std::max(top, score[static_cast<std::size_t>(j)]);
      }
      double total = 0, hit = 0;
      for (index_t j = 0; j < keys; ++j) {
        const double p = std::exp(score[static_cast<std::size_t>(j)] - top);
        total += p;
        if (std::binary_search(sel.vertical_tokens.begin(), sel.vertical_tokens.end(), j) ||
            std::binary_search(sel.slash_deltas.begin(), sel.slash_deltas.end(), n / 64 - j / 64) ||
            std::binary_search(sel.blocks.begin(), sel.blocks.end(), block_pair{n / 64, j / 64}))
          hit += p;
      }
      sum += hit / total;
      if (min_out) *min_out = std::min(*min_out, hit / total);
      ++rows;
    }
  }
  return sum / rows;
}

}  // namespace

TEST_CASE("the generator is deterministic for a seed and its planted selection validates") {
  host::synthetic_vs_options o;
  o.seq_len = 2048;
  o.heads_q = 4;
  o.heads_kv = 2;
  o.head_dim = 64;
  const host::synthetic_vs a = host::make_synthetic_vs(o), b = host::make_synthetic_vs(o);
  CHECK(a.q == b.q);
  CHECK(a.k == b.k);
  CHECK(a.v == b.v);
  CHECK_NOTHROW(a.planted.validate());
  CHECK(a.planted.heads.size() == 4);
  for (const head_selection& h : a.planted.heads) {
    CHECK(h.slash_deltas.front() == 0);
    CHECK(h.vertical_tokens.size() >= 4);
    CHECK(h.vertical_tokens[3] == 3);  // the sink tokens
  }
  // plant_vs_selection alone gives the same selection as the full generator.
  const global_selection planted = host::plant_vs_selection(o);
  CHECK(planted.heads[3].slash_deltas == a.planted.heads[3].slash_deltas);
  o.seed = 2;
  CHECK(host::make_synthetic_vs(o).q != a.q);
}

TEST_CASE("the planted density is near the target at long sequences") {
  for (const double density : {0.05, 0.1}) {
    host::synthetic_vs_options o;
    o.seq_len = 65536;
    o.density = density;
    const global_selection g = host::plant_vs_selection(o);
    const ring_workload w = count_ring_workload(g, sharding::sequential{}, topology::flat_ring(1));
    const double achieved = double(w.total()) / (double(o.seq_len) * (o.seq_len + 1) / 2.0 * o.heads_q);
    CAPTURE(density);
    CAPTURE(achieved);
    CHECK(achieved > 0.8 * density);
    CHECK(achieved < 1.25 * density);
  }
}

TEST_CASE("the planted selection holds most of the exact attention mass, the same lines moved do not") {
  for (const double theta : {1e4, 1e6}) {
    host::synthetic_vs_options o;
    o.seq_len = 2048;
    o.heads_q = 4;
    o.heads_kv = 2;
    o.head_dim = 64;
    o.density = 0.1;
    o.rope_theta = theta;
    const host::synthetic_vs x = host::make_synthetic_vs(o);
    const double planted = mean_recall(x, x.planted, o);
    // Control: as many slash lines and vertical tokens, moved by half the sequence.
    global_selection moved = x.planted;
    const index_t nb = o.seq_len / 64;
    for (head_selection& h : moved.heads) {
      for (index_t& delta : h.slash_deltas) delta = (delta + nb / 2) % nb;
      for (index_t& t : h.vertical_tokens) t = (t + o.seq_len / 2) % o.seq_len;
      std::sort(h.slash_deltas.begin(), h.slash_deltas.end());
      std::sort(h.vertical_tokens.begin(), h.vertical_tokens.end());
    }
    const double control = mean_recall(x, moved, o);
    CAPTURE(theta);
    CAPTURE(planted);
    CAPTURE(control);
    CHECK(planted > 0.85);
    CHECK(control < 0.5 * planted);
  }
}

TEST_CASE("generator options are validated with the argument and the rule") {
  host::synthetic_vs_options o;
  o.seq_len = 1000;
  CHECK_THROWS_WITH_AS(host::plant_vs_selection(o), "stria: seq_len = 1000: must be a positive multiple of 64 (the block size)", stria::invalid_argument);
  o.seq_len = 4096;
  o.density = 0;
  CHECK_THROWS_WITH_AS(host::plant_vs_selection(o), doctest::Contains("density = 0: must lie in (0, 1]"), stria::invalid_argument);
  o.density = 0.05;
  o.heads_q = 6;
  o.heads_kv = 4;
  CHECK_THROWS_WITH_AS(host::plant_vs_selection(o), doctest::Contains("heads_q = 6: must be a positive multiple of heads_kv = 4"), stria::invalid_argument);
  // Past the index widths: heads_q x head_dim = 2^32 wrapped to an empty [Hq, D] table, which the
  // model then wrote through (plan and quickstart --heads-q 33554432 --heads-kv 1: SIGSEGV).
  o.heads_q = 33554432;
  o.heads_kv = 1;
  CHECK_THROWS_WITH_AS(host::plant_vs_selection(o), "stria: heads_q x head_dim = 4294967296: must be at most 2147483647", stria::invalid_argument);
  o.heads_q = 4;
  // Counts bounded by the tokens: vertical_clusters = 2^31 - 1 drew that many centres (8 GiB, minutes);
  // extra_slashes = 2^31 - 1 with a small slash_power kept the power-law loop going for every line.
  // The mixture reads every family's settings (with 3 or more query heads and 2 or more KV heads).
  o.pattern = host::vs_pattern::mixture;
  o.heads_kv = 2;
  o.vertical_clusters = std::numeric_limits<index_t>::max();
  CHECK_THROWS_WITH_AS(o.validate(), "stria: vertical_clusters = 2147483647: must lie in [1, seq_len] (the mixture pattern)", stria::invalid_argument);
  o.vertical_clusters = 8;
  o.extra_slashes = std::numeric_limits<index_t>::max();
  CHECK_THROWS_WITH_AS(o.validate(), "stria: extra_slashes = 2147483647: must lie in [1, seq_len] (the mixture pattern)", stria::invalid_argument);
  o.extra_slashes = 4096;
  CHECK_NOTHROW(o.validate());
}

TEST_CASE("a family's settings are checked only where the pattern reads them") {
  // The defaults (an 8-block period, 1024-token clusters) refused every problem under 1024 tokens
  // (plan and quickstart --seq-len 512 or 768 named settings the user never set).
  using host::vs_pattern;
  host::synthetic_vs_options o;
  o.heads_q = 3;
  o.heads_kv = 1;
  for (const vs_pattern pattern : {vs_pattern::rope, vs_pattern::power_law_slash, vs_pattern::periodic_slash, vs_pattern::clustered_vertical,
                                   vs_pattern::mixture})
    for (const index_t s : {128, 512, 768, 960}) {
      o.pattern = pattern;
      o.seq_len = s;
      CAPTURE(host::pattern_name(pattern));
      CAPTURE(s);
      CHECK_NOTHROW(o.validate());
      CHECK(host::plant_vs_selection(o).seq_len == s);
    }
  // The automatic period: 8 blocks, one less than the blocks where the sequence is shorter.
  o.seq_len = 512;
  CHECK(o.period() == 7);
  o.seq_len = 131072;
  CHECK(o.period() == 8);
  o.seq_len = 64;  // one block: no periodic line fits, whatever the period
  o.pattern = vs_pattern::rope;
  CHECK_NOTHROW(o.validate());
  o.pattern = vs_pattern::periodic_slash;
  CHECK_THROWS_WITH_AS(o.validate(),
                       "stria: seq_len = 64: must hold at least two blocks (128 tokens): periodic lines lie between block diagonals (the periodic_slash pattern)",
                       stria::invalid_argument);
  o.pattern = vs_pattern::mixture;  // heads 0-2: rope, power law, periodic
  CHECK_THROWS_AS(o.validate(), stria::invalid_argument);
  o.heads_q = 2;  // no periodic head
  CHECK_NOTHROW(o.validate());
  // An explicit period is checked as given; a rope problem does not read it.
  o.seq_len = 512;
  o.period_blocks = 8;
  o.pattern = vs_pattern::periodic_slash;
  CHECK_THROWS_WITH_AS(o.validate(), "stria: period_blocks = 8: must be 0 (automatic) or lie in [1, seq_len / 64) (the periodic_slash pattern)",
                       stria::invalid_argument);
  o.pattern = vs_pattern::rope;
  CHECK_NOTHROW(o.validate());
  // Clusters wider than the sequence are clamped to it; a width below one token is refused.
  o.pattern = vs_pattern::clustered_vertical;
  o.cluster_tokens = 0;
  CHECK_THROWS_WITH_AS(o.validate(), "stria: cluster_tokens = 0: must be at least 1 (the clustered_vertical pattern)", stria::invalid_argument);
}

TEST_CASE("attention_recall equals the fp64 recall over every row") {
  host::synthetic_vs_options o;
  o.seq_len = 1024;
  o.heads_q = 4;
  o.heads_kv = 1;
  o.head_dim = 64;
  o.density = 0.08;
  const host::synthetic_vs x = host::make_synthetic_vs(o);
  double expected_min = 1;
  const double expected = mean_recall(x, x.planted, o, 1, &expected_min);
  const host::recall_summary r = host::attention_recall(x.planted, tensor_view<const float, 3>(x.q.data(), {1024, 4, 64}),
                                                        tensor_view<const float, 3>(x.k.data(), {1024, 1, 64}), 0.125, 2);
  CHECK(r.rows == 4 * 1024);
  CHECK(r.mean == doctest::Approx(expected).epsilon(1e-5));
  CHECK(r.min == doctest::Approx(expected_min).epsilon(1e-4));
  // Full attention, with explicit tiles and negative diagonals.
  global_selection full{1024, false, {}};
  for (index_t h = 0; h < 4; ++h) full.heads.push_back({{3, 700}, {-5, 0, 2}, {{1, 9}, {15, 0}}});
  double full_min = 1;
  const double full_expected = mean_recall(x, full, o, 1, &full_min);
  const host::recall_summary f = host::attention_recall(full, tensor_view<const float, 3>(x.q.data(), {1024, 4, 64}),
                                                        tensor_view<const float, 3>(x.k.data(), {1024, 1, 64}), 0.125, 2);
  CHECK(f.mean == doctest::Approx(full_expected).epsilon(1e-5));
  CHECK(f.min == doctest::Approx(full_min).epsilon(1e-4));
  CHECK_THROWS_WITH_AS(host::attention_recall(x.planted, tensor_view<const float, 3>(x.q.data(), {1024, 4, 64}),
                                              tensor_view<const float, 3>(x.k.data(), {1024, 1, 128}), 0.125),
                       doctest::Contains("k.extent(2) = 128: must be 64"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(host::attention_recall(x.planted, tensor_view<const float, 3>(x.q.data(), {1024, 2, 64}),
                                              tensor_view<const float, 3>(x.k.data(), {1024, 1, 64}), 0.125),
                       doctest::Contains("q.extent(1) = 2: must equal the selection's head count 4"), stria::invalid_argument);
}

TEST_CASE("heavy-tailed families: planted lines hold the mass, and each family has its shape") {
  using host::vs_pattern;
  for (const vs_pattern pattern : {vs_pattern::power_law_slash, vs_pattern::periodic_slash, vs_pattern::clustered_vertical, vs_pattern::mixture}) {
    host::synthetic_vs_options o;
    o.seq_len = 2048;
    o.heads_q = 6;
    o.heads_kv = 2;
    o.head_dim = 64;
    o.density = 0.1;
    o.pattern = pattern;
    o.period_blocks = 4;
    o.vertical_clusters = 2;
    o.cluster_tokens = 128;
    const host::synthetic_vs x = host::make_synthetic_vs(o);
    CAPTURE(host::pattern_name(pattern));
    x.planted.validate();
    host::synthetic_vs_options rope = o;
    rope.pattern = vs_pattern::rope;
    const global_selection plain = host::plant_vs_selection(rope);
    const double planted = mean_recall(x, x.planted, o);
    CAPTURE(planted);
    CHECK(planted > 0.8);
    bool differs = false;
    for (index_t h = 0; h < o.heads_q; ++h) differs = differs || !(x.planted.heads[static_cast<std::size_t>(h)] == plain.heads[static_cast<std::size_t>(h)]);
    CHECK(differs);
    if (pattern == vs_pattern::clustered_vertical) {
      // Outside the sinks, every outlier lies in one of 2 windows of 128 tokens.
      for (const head_selection& h : x.planted.heads) {
        std::vector<index_t> rest;
        for (const index_t t : h.vertical_tokens)
          if (t >= o.sink_tokens) rest.push_back(t);
        REQUIRE(!rest.empty());
        index_t windows = 0;
        for (std::size_t i = 0; i < rest.size(); ++windows) {
          const index_t start = rest[i];
          while (i < rest.size() && rest[i] < start + o.cluster_tokens) ++i;
        }
        CHECK(windows <= 2 * o.vertical_clusters);  // two clusters may overlap a window edge each
      }
    }
    if (pattern == vs_pattern::periodic_slash) {
      // The strongest slash lines beyond the local window sit at multiples of the period.
      for (const head_selection& h : x.planted.heads) {
        index_t on_period = 0, far = 0;
        for (const index_t delta : h.slash_deltas)
          if (delta >= 2) ++far, on_period += (delta % o.period() == 0 || delta % o.period() == 1 || delta % o.period() == o.period() - 1);
        CHECK(far > 0);
        CHECK(on_period * 4 >= far * 3);
      }
    }
    if (pattern == vs_pattern::mixture) {
      // Head 0 follows rope; heads 1 and 2 (power law, periodic) do not.
      CHECK(x.planted.heads[0].slash_deltas == plain.heads[0].slash_deltas);
      CHECK(!(x.planted.heads[1].slash_deltas == plain.heads[1].slash_deltas));
      CHECK(!(x.planted.heads[2].slash_deltas == plain.heads[2].slash_deltas));
    }
  }
  host::synthetic_vs_options bad;
  bad.pattern = vs_pattern::periodic_slash;
  bad.period_blocks = -1;
  CHECK_THROWS_WITH_AS(host::plant_vs_selection(bad), doctest::Contains("period_blocks = -1: must be 0 (automatic) or lie in [1, seq_len / 64)"),
                       stria::invalid_argument);
}

TEST_CASE("token_noise: at 0 a score away from the outlier keys is its offset's expected score; refused outside [0, 1000]") {
  host::synthetic_vs_options o;
  o.seq_len = 512;
  o.heads_q = 2;
  o.heads_kv = 1;
  o.head_dim = 64;
  o.pattern = host::vs_pattern::periodic_slash;
  const index_t d = o.head_dim;
  // The largest gap, over rows and offsets, between a scaled score (fp64 dot product of the fp32
  // tensors) and the model's expected one, f(offset), away from the outlier keys.
  auto largest_gap = [&](const host::synthetic_vs_options& options) {
    host::detail::vs_model m;
    (void)host::plant_vs_selection(options, &m);
    const host::synthetic_vs x = host::make_synthetic_vs(options);
    const std::vector<index_t>& outliers = m.vertical[0];
    double gap = 0;
    int pairs = 0;
    for (index_t h = 0; h < options.heads_q; ++h) {
      const std::vector<double> f = host::detail::expected_logits(m, d, h, 0, options.seq_len);
      for (const index_t delta : {0, 7, 64, 129, 256})
        for (index_t n = 299; n < options.seq_len; n += 37) {
          if (std::binary_search(outliers.begin(), outliers.end(), n - delta)) continue;
          double s = 0;
          for (index_t j = 0; j < d; ++j)
            s += double(x.q[static_cast<std::size_t>((n * options.heads_q + h) * d + j)]) * double(x.k[static_cast<std::size_t>((n - delta) * d + j)]);
          gap = std::max(gap, std::abs(s * m.scale - f[static_cast<std::size_t>(delta)]));
          ++pairs;
        }
    }
    REQUIRE(pairs > 40);
    return gap;
  };
  o.token_noise = 0;
  CHECK(largest_gap(o) < 1e-5);  // float rounding of q and k after RoPE
  o.token_noise = 0.5;           // the default: the noise moves the largest gap past a logit
  CHECK(largest_gap(o) > 1.0);
  o.token_noise = 1000;  // the bound itself is accepted
  CHECK_NOTHROW(o.validate());
  for (const double bad : {-0.1, 1000.5, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()}) {
    o.token_noise = bad;
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(host::plant_vs_selection(o), doctest::Contains("token_noise = "), stria::invalid_argument);
    CHECK_THROWS_WITH_AS(host::plant_vs_selection(o), doctest::Contains(": must lie in [0, 1000]"), stria::invalid_argument);
  }
  CHECK(host::synthetic_vs_options{}.token_noise == 0.5);
}
