// SPDX-License-Identifier: Apache-2.0
// Seeded synthetic attention inputs whose Vertical-Slash structure comes from the math, with the
// selection that was planted (for tests, examples, benchmarks and the planner).
//
// MTraining's Theorem 3.1: with RoPE, if queries and keys have nonzero means mu_q, mu_k, the expected
// score E[q_n . k_m] = f(n - m) = sum_i |mu_q,i| |mu_k,i| cos(theta_i (n - m) + phi_i) depends on the
// relative position only, so it is constant along diagonals: slash lines. Keys with a large norm in
// the slowest-rotating RoPE pairs, which every query's mean shares, are attended from everywhere:
// vertical lines. The generator knows f, so the slash lines it plants are the block diagonals with
// the largest expected attention mass, and the vertical tokens are the outlier keys it placed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <numeric>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"
#include "stria/core/error.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::host {

/// The pattern family. `rope` is the original generator (its output depends on the seed alone and
/// is what the benchmarks and GPU tests use); the others are heavy-tailed variants built on it:
/// - power_law_slash: extra slash lines at random offsets whose peak weights fall as a power law
///   (line j: exp(logit) proportional to j^-slash_power);
/// - periodic_slash: extra slash lines of equal weight every period_blocks block diagonals. The
///   lines share the fast RoPE pairs and interfere: off them the expected score's spread grows about
///   as the square root of the number of lines, and from about 7 lines its maximum there tops the
///   lines' mean, and the grown query mean widens the key noise's spread (tests/bench/recall_bounds
///   prints the spreads and the lines' masses);
/// - clustered_vertical: the outlier keys fall in a few clusters of nearby tokens;
/// - mixture: per query head one of rope, power_law_slash, periodic_slash (head h: h mod 3), and
///   clustered outliers on odd KV heads.
enum class vs_pattern { rope, power_law_slash, periodic_slash, clustered_vertical, mixture };

inline constexpr const char* pattern_name(vs_pattern p) {
  switch (p) {
    case vs_pattern::rope: return "rope";
    case vs_pattern::power_law_slash: return "power_law_slash";
    case vs_pattern::periodic_slash: return "periodic_slash";
    case vs_pattern::clustered_vertical: return "clustered_vertical";
    case vs_pattern::mixture: return "mixture";
  }
  return "?";
}

struct synthetic_vs_options {
  index_t seq_len = 16384;
  index_t heads_q = 16;
  index_t heads_kv = 2;
  index_t head_dim = 128;
  double rope_theta = 1e6;   // 1e4 (Llama 2) and 1e6 (Qwen2.5) both work
  double density = 0.05;     // planted fraction of the causal entries (sparsity = 1 - density)
  double slash_share = 0.6;  // of the planted entries, the share on slash diagonals (the rest vertical)
  double token_noise = 0.5;  // per-element standard deviation of Q's and K's token noise (0: every score is expected)
  index_t sink_tokens = 4;   // the first tokens are always vertical
  std::uint64_t seed = 1;
  vs_pattern pattern = vs_pattern::rope;
  index_t extra_slashes = 16;       // power_law_slash, periodic_slash: lines added
  double slash_power = 1.5;         // power_law_slash: weight of line j ~ j^-slash_power
  double slash_peak_logit = 4.0;    // scaled expected score at the strongest added line's peak
  index_t period_blocks = 0;        // periodic_slash: block diagonals between lines (0: 8, fewer where the sequence has fewer blocks)
  index_t vertical_clusters = 8;    // clustered_vertical: cluster count per KV head
  index_t cluster_tokens = 1024;    // clustered_vertical: a cluster's width in tokens (at most the tokens after the sinks)

  void validate() const {
    if (seq_len <= 0 || seq_len % block_tokens != 0)
      throw invalid_argument("seq_len", seq_len, "must be a positive multiple of 64 (the block size)");
    if (heads_kv <= 0) throw invalid_argument("heads_kv", heads_kv, "must be positive");
    if (heads_q <= 0 || heads_q % heads_kv != 0)
      throw invalid_argument("heads_q", heads_q, "must be a positive multiple of heads_kv = " + std::to_string(heads_kv));
    if (head_dim != 64 && head_dim != 128) throw invalid_argument("head_dim", head_dim, "unsupported head dim: stria supports 64 and 128");
    // The model's per-head tables ([Hq, D]) are indexed in index_t: past it they wrapped (to an empty table).
    if (const std::int64_t elements = std::int64_t{heads_q} * head_dim; elements > std::numeric_limits<index_t>::max())
      throw invalid_argument("heads_q x head_dim", elements, "must be at most " + std::to_string(std::numeric_limits<index_t>::max()));
    if (!(density > 0.0 && density <= 1.0)) throw invalid_argument("density", density, "must lie in (0, 1]");
    if (!(slash_share >= 0.0 && slash_share <= 1.0)) throw invalid_argument("slash_share", slash_share, "must lie in [0, 1]");
    if (!(rope_theta > 1.0)) throw invalid_argument("rope_theta", rope_theta, "must be greater than 1");
    if (!(token_noise >= 0.0 && token_noise <= 1e3)) throw invalid_argument("token_noise", token_noise, "must lie in [0, 1000]");
    if (sink_tokens < 0 || sink_tokens > seq_len)
      throw invalid_argument("sink_tokens", sink_tokens, "must lie in [0, seq_len]");
    // A family's settings are checked where some head reads them.
    bool power_law = false, periodic = false, clustered = false;
    for (index_t h = 0; h < heads_q; ++h) {
      power_law = power_law || head_pattern(h) == vs_pattern::power_law_slash;
      periodic = periodic || head_pattern(h) == vs_pattern::periodic_slash;
    }
    for (index_t hk = 0; hk < heads_kv; ++hk) clustered = clustered || clustered_kv_head(hk);
    const std::string family = std::string(" (the ") + pattern_name(pattern) + " pattern)";
    if (power_law || periodic) {
      // Bounded by the token offsets there are: a line per offset at most (unbounded, a small
      // slash_power kept the power-law loop going for every one of 2^31 lines).
      if (extra_slashes < 1 || extra_slashes > seq_len) throw invalid_argument("extra_slashes", extra_slashes, "must lie in [1, seq_len]" + family);
      if (!(slash_power > 0.0 && slash_power <= 8.0)) throw invalid_argument("slash_power", slash_power, "must lie in (0, 8]" + family);
      if (!(slash_peak_logit > 0.0 && slash_peak_logit <= 12.0))
        throw invalid_argument("slash_peak_logit", slash_peak_logit, "must lie in (0, 12]" + family);
    }
    if (periodic && seq_len < 2 * block_tokens)
      throw invalid_argument("seq_len", seq_len, "must hold at least two blocks (128 tokens): periodic lines lie between block diagonals" + family);
    if (periodic && period_blocks != 0 && (period_blocks < 1 || period_blocks >= seq_len / block_tokens))
      throw invalid_argument("period_blocks", period_blocks, "must be 0 (automatic) or lie in [1, seq_len / 64)" + family);
    if (clustered) {
      if (vertical_clusters < 1 || vertical_clusters > seq_len)  // a centre per cluster is drawn: bounded by the tokens
        throw invalid_argument("vertical_clusters", vertical_clusters, "must lie in [1, seq_len]" + family);
      if (cluster_tokens < 1) throw invalid_argument("cluster_tokens", cluster_tokens, "must be at least 1" + family);
    }
  }

  /// The family query head h follows: the pattern, or for the mixture rope, power_law_slash and
  /// periodic_slash in turn.
  [[nodiscard]] vs_pattern head_pattern(index_t h) const {
    constexpr vs_pattern cycle[3] = {vs_pattern::rope, vs_pattern::power_law_slash, vs_pattern::periodic_slash};
    return pattern == vs_pattern::mixture ? cycle[h % 3] : pattern;
  }
  /// Whether KV head hk's outlier keys fall in clusters (the mixture: odd KV heads).
  [[nodiscard]] bool clustered_kv_head(index_t hk) const {
    return pattern == vs_pattern::clustered_vertical || (pattern == vs_pattern::mixture && hk % 2 == 1);
  }

  /// The periodic lines' spacing in block diagonals: period_blocks, or where 0, 8 (at most the
  /// sequence's block count less one).
  [[nodiscard]] index_t period() const { return period_blocks != 0 ? period_blocks : std::min<index_t>(8, seq_len / block_tokens - 1); }
};

/// Q, K, V after RoPE, and the planted causal selection (one head_selection per query head).
struct synthetic_vs {
  global_selection planted;
  std::vector<float> q;  // [S, Hq, D]
  std::vector<float> k;  // [S, Hkv, D]
  std::vector<float> v;  // [S, Hkv, D]
};

namespace detail {

/// The pre-RoPE means and outlier positions that define one problem; the tensors and the planted
/// selection are both derived from it, so they always agree.
struct vs_model {
  index_t pairs = 0;                       // RoPE frequency pairs: head_dim / 2
  std::vector<double> theta;               // [pairs] rotation per token of pair i: rope_theta^(-2i/D)
  std::vector<double> mean_k;              // [Hkv, D] key mean (pre-RoPE)
  std::vector<double> mean_q;              // [Hq, D] query mean (pre-RoPE)
  std::vector<std::vector<index_t>> vertical;  // [Hkv] outlier key positions, ascending (sinks included)
  std::vector<double> outlier;             // [Hkv, D] direction of the outliers' extra norm (slow pairs)
  double scale = 0;                        // softmax scale 1/sqrt(D)
  double noise = 0;                        // per-element standard deviation of the token noise
};

inline constexpr double expected_peak_logit = 6.0;    // scale * f(0): the local window's pull
inline constexpr double outlier_logit = 9.0;          // scale * q . outlier: the vertical lines' pull

/// Adds `gain` x KV head hk's key mean in RoPE pair i, turned by `angle`, to query head h's mean.
inline void add_turned_key_mean(vs_model& m, index_t d, index_t h, index_t hk, index_t i, double angle, double gain) {
  const double ka = m.mean_k[static_cast<std::size_t>(hk * d + 2 * i)], kb = m.mean_k[static_cast<std::size_t>(hk * d + 2 * i + 1)];
  m.mean_q[static_cast<std::size_t>(h * d + 2 * i)] += gain * (std::cos(angle) * ka - std::sin(angle) * kb);
  m.mean_q[static_cast<std::size_t>(h * d + 2 * i + 1)] += gain * (std::sin(angle) * ka + std::cos(angle) * kb);
}

/// Adds distinct tokens draw(n) (n = 0, 1, ...; at most 4 x count tries) to `tokens` until it holds `count`.
template <class Draw>
void draw_vertical_tokens(std::vector<index_t>& tokens, std::vector<bool>& taken, index_t count, index_t seq_len, Draw draw) {
  for (index_t n = 0; n < 4 * count && static_cast<index_t>(tokens.size()) < count; ++n) {
    const index_t t = draw(n);
    if (t < seq_len && !taken[static_cast<std::size_t>(t)]) tokens.push_back(t), taken[static_cast<std::size_t>(t)] = true;
  }
  std::sort(tokens.begin(), tokens.end());
}

/// The heavy-tailed families on top of the rope model (synthetic_vs_options::pattern). They draw
/// from a stream of their own, so the rope model's draws are untouched.
///
/// A slash line at token offset delta_j: each fast RoPE pair's query mean gets c_j R(-theta_i delta_j) k_i,
/// which adds c_j * scale * cos(theta_i (delta - delta_j)) to f(delta): all fast pairs peak together
/// at delta_j (height c_j * scale * pairs). Pairs slower than a 256-token period are left out: they
/// barely turn over the sequence and would raise f everywhere instead of at one line.
inline void add_heavy_tail(const synthetic_vs_options& o, vs_model& m, index_t slow_begin, index_t verticals_per_kv_head) {
  std::mt19937_64 rng(o.seed * 0xd1b54a32d192ed03ULL + 0x2545f4914f6cdd1dULL);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const index_t d = o.head_dim, group = o.heads_q / o.heads_kv;
  std::vector<index_t> fast;
  for (index_t i = 0; i < slow_begin; ++i)
    if (m.theta[static_cast<std::size_t>(i)] * 256.0 >= 2.0 * std::numbers::pi) fast.push_back(i);
  for (index_t h = 0; h < o.heads_q; ++h) {
    const vs_pattern p = o.head_pattern(h);
    if (p != vs_pattern::power_law_slash && p != vs_pattern::periodic_slash) continue;
    const index_t hk = h / group;
    for (index_t j = 1; j <= o.extra_slashes; ++j) {
      double delta = 0, height = o.slash_peak_logit;
      if (p == vs_pattern::periodic_slash) {
        delta = double(j) * o.period() * block_tokens;  // in index_t it wraps past 2^31 tokens
        if (delta >= double(o.seq_len)) break;
      } else {
        delta = 2.0 * block_tokens + uniform(rng) * double(o.seq_len - 2 * block_tokens);
        height -= o.slash_power * std::log(double(j));  // weight exp(height) ~ j^-slash_power
        if (height <= 0) break;
      }
      const double c = height / (m.scale * double(fast.size()));
      for (const index_t i : fast) add_turned_key_mean(m, d, h, hk, i, -m.theta[static_cast<std::size_t>(i)] * delta, c);
    }
  }
  // Clustered outliers: the same count per KV head, the sinks kept, the rest near a few centres.
  for (index_t hk = 0; hk < o.heads_kv; ++hk) {
    if (!o.clustered_kv_head(hk)) continue;
    auto& tokens = m.vertical[static_cast<std::size_t>(hk)];
    std::vector<bool> taken(static_cast<std::size_t>(o.seq_len));
    tokens.erase(std::remove_if(tokens.begin(), tokens.end(), [&](index_t t) { return t >= o.sink_tokens; }), tokens.end());
    for (const index_t t : tokens) taken[static_cast<std::size_t>(t)] = true;
    const index_t first = std::min(o.sink_tokens, o.seq_len - 1), width = std::min(o.cluster_tokens, o.seq_len - first);
    std::vector<index_t> centre(static_cast<std::size_t>(o.vertical_clusters));
    for (index_t& c : centre) c = first + static_cast<index_t>(uniform(rng) * double(o.seq_len - first - width + 1));
    draw_vertical_tokens(tokens, taken, verticals_per_kv_head, o.seq_len, [&](index_t n) {
      return centre[static_cast<std::size_t>(n % o.vertical_clusters)] + static_cast<index_t>(uniform(rng) * double(width));
    });
  }
}

inline vs_model make_model(const synthetic_vs_options& o, std::mt19937_64& rng, index_t verticals_per_kv_head) {
  vs_model m;
  const index_t d = o.head_dim;
  m.pairs = d / 2;
  m.scale = 1.0 / std::sqrt(double(d));
  m.noise = o.token_noise;
  m.theta.resize(static_cast<std::size_t>(m.pairs));
  for (index_t i = 0; i < m.pairs; ++i) m.theta[static_cast<std::size_t>(i)] = std::pow(o.rope_theta, -2.0 * i / double(d));
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);

  // Key means: random directions per pair. Query means: the key mean per pair, turned by a small
  // random phase and rescaled, so f peaks near delta = 0 (a local window) with head-specific detail.
  const index_t slow_begin = m.pairs - std::max<index_t>(2, m.pairs / 8);  // the slowest pairs carry the outliers
  m.mean_k.assign(static_cast<std::size_t>(o.heads_kv * d), 0.0);
  for (index_t hk = 0; hk < o.heads_kv; ++hk)
    for (index_t i = 0; i < slow_begin; ++i) {
      const double angle = 2.0 * std::numbers::pi * uniform(rng);
      m.mean_k[static_cast<std::size_t>(hk * d + 2 * i)] = std::cos(angle);
      m.mean_k[static_cast<std::size_t>(hk * d + 2 * i + 1)] = std::sin(angle);
    }
  m.mean_q.assign(static_cast<std::size_t>(o.heads_q * d), 0.0);
  const index_t group = o.heads_q / o.heads_kv;
  for (index_t h = 0; h < o.heads_q; ++h) {
    const index_t hk = h / group;
    for (index_t i = 0; i < slow_begin; ++i) {
      const double phase = (uniform(rng) - 0.5) * 2.0 * std::numbers::pi / 3.0;
      add_turned_key_mean(m, d, h, hk, i, phase, 0.5 + uniform(rng));  // onto zeros
    }
    // Normalise so that the expected scaled score at delta = 0 (no rotation: scale * q . k) is expected_peak_logit.
    double f0 = 0;
    for (index_t i = 0; i < m.pairs; ++i) {
      const auto j = static_cast<std::size_t>(h * d + 2 * i), jk = static_cast<std::size_t>(hk * d + 2 * i);
      f0 += m.mean_q[j] * m.mean_k[jk] + m.mean_q[j + 1] * m.mean_k[jk + 1];
    }
    f0 *= m.scale;
    const double fix = f0 > 0 ? expected_peak_logit / f0 : 1.0;
    for (index_t j = 0; j < d; ++j) m.mean_q[static_cast<std::size_t>(h * d + j)] *= fix;
  }

  // Outliers: a unit direction in the slowest pairs; every query mean gets a matching component.
  m.outlier.assign(static_cast<std::size_t>(o.heads_kv * d), 0.0);
  m.vertical.assign(static_cast<std::size_t>(o.heads_kv), {});
  for (index_t hk = 0; hk < o.heads_kv; ++hk) {
    double norm = 0;
    for (index_t j = 2 * slow_begin; j < d; ++j) {
      const double x = normal(rng);
      m.outlier[static_cast<std::size_t>(hk * d + j)] = x;
      norm += x * x;
    }
    for (index_t j = 2 * slow_begin; j < d; ++j) m.outlier[static_cast<std::size_t>(hk * d + j)] /= std::sqrt(norm);
    auto& tokens = m.vertical[static_cast<std::size_t>(hk)];
    std::vector<bool> taken(static_cast<std::size_t>(o.seq_len));
    for (index_t t = 0; t < std::min(o.sink_tokens, o.seq_len); ++t) tokens.push_back(t), taken[static_cast<std::size_t>(t)] = true;
    std::uniform_int_distribution<index_t> position(std::min(o.sink_tokens, o.seq_len - 1), o.seq_len - 1);
    draw_vertical_tokens(tokens, taken, verticals_per_kv_head, o.seq_len, [&](index_t) { return position(rng); });
  }
  // Each query's unit-norm outlier component u: scale * u . (L * u) = outlier_logit.
  for (index_t h = 0; h < o.heads_q; ++h)
    for (index_t j = 2 * slow_begin; j < d; ++j)
      m.mean_q[static_cast<std::size_t>(h * d + j)] = m.outlier[static_cast<std::size_t>((h / group) * d + j)];
  if (o.pattern != vs_pattern::rope) add_heavy_tail(o, m, slow_begin, verticals_per_kv_head);
  return m;
}

/// Causal entries of block diagonal delta: the tiles of the triangle on that diagonal.
inline double diagonal_entries(index_t blocks, index_t delta) {
  return delta == 0 ? double(blocks) * 64.0 * 65.0 / 2.0 : double(blocks - delta) * 64.0 * 64.0;
}

/// Expected scaled score of a query of head h against a key `delta` tokens earlier, scale * f(delta),
/// for every delta in [0, count): pair i holds dims (2i, 2i + 1), and (R(n) q) . (R(m) k) = q . R(-delta) k,
/// so f = Re sum_i (A_i - i B_i) e^{i theta_i delta}, by one rotating phasor per RoPE pair: no
/// trigonometry inside the loop.
inline std::vector<double> expected_logits(const vs_model& m, index_t head_dim, index_t h, index_t hk, index_t count) {
  std::vector<double> f(static_cast<std::size_t>(count), 0.0);
  for (index_t i = 0; i < m.pairs; ++i) {
    const double qa = m.mean_q[static_cast<std::size_t>(h * head_dim + 2 * i)];
    const double qb = m.mean_q[static_cast<std::size_t>(h * head_dim + 2 * i + 1)];
    const double ka = m.mean_k[static_cast<std::size_t>(hk * head_dim + 2 * i)];
    const double kb = m.mean_k[static_cast<std::size_t>(hk * head_dim + 2 * i + 1)];
    const double a = m.scale * (qa * ka + qb * kb), b = m.scale * (qa * kb - qb * ka);
    if (a == 0.0 && b == 0.0) continue;
    const double step_re = std::cos(m.theta[static_cast<std::size_t>(i)]), step_im = std::sin(m.theta[static_cast<std::size_t>(i)]);
    double re = 1.0, im = 0.0;  // e^{i theta delta}
    for (index_t delta = 0; delta < count; ++delta) {
      f[static_cast<std::size_t>(delta)] += a * re + b * im;
      const double next_re = re * step_re - im * step_im;
      im = re * step_im + im * step_re;
      re = next_re;
      if ((delta & 4095) == 4095) {  // keep the phasor on the unit circle
        const double norm = std::sqrt(re * re + im * im);
        re /= norm;
        im /= norm;
      }
    }
  }
  return f;
}

}  // namespace detail

/// The planted selection only (cheap: no tensors). Identical to make_synthetic_vs(o).planted.
inline global_selection plant_vs_selection(const synthetic_vs_options& o, detail::vs_model* model_out = nullptr) {
  o.validate();
  std::mt19937_64 rng(o.seed);
  const index_t nb = o.seq_len / block_tokens;
  const double causal_entries = double(o.seq_len) * (double(o.seq_len) + 1.0) / 2.0;
  const double target = o.density * causal_entries;
  // A vertical token in a random position covers about half the sequence's rows below it.
  const auto verticals = static_cast<index_t>(std::llround((1.0 - o.slash_share) * target / (0.5 * double(o.seq_len))));
  detail::vs_model m = detail::make_model(o, rng, std::max(verticals, o.sink_tokens));

  global_selection g{o.seq_len, true, {}};
  const index_t group = o.heads_q / o.heads_kv;
  std::vector<double> mass(static_cast<std::size_t>(nb));
  std::vector<index_t> order(static_cast<std::size_t>(nb));
  for (index_t h = 0; h < o.heads_q; ++h) {
    const index_t hk = h / group;
    // Expected attention weight of each block diagonal, per query: over the token offsets of a
    // tile pair (triangular weights), exp(expected logit).
    const std::vector<double> f = detail::expected_logits(m, o.head_dim, h, hk, o.seq_len);
    for (index_t delta = 0; delta < nb; ++delta) {
      double w = 0;
      for (index_t off = -63; off <= 63; ++off) {
        const index_t token_delta = delta * 64 + off;
        if (token_delta < 0 || token_delta >= o.seq_len) continue;
        w += double(64 - std::abs(off)) * std::exp(f[static_cast<std::size_t>(token_delta)]);
      }
      mass[static_cast<std::size_t>(delta)] = w;
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return mass[static_cast<std::size_t>(a)] > mass[static_cast<std::size_t>(b)]; });
    head_selection head;
    double slash_entries = 0;
    head.slash_deltas.push_back(0);  // always: no row is ever empty
    slash_entries += detail::diagonal_entries(nb, 0);
    for (const index_t delta : order) {
      if (slash_entries >= o.slash_share * target) break;
      if (delta == 0) continue;
      head.slash_deltas.push_back(delta);
      slash_entries += detail::diagonal_entries(nb, delta);
    }
    std::sort(head.slash_deltas.begin(), head.slash_deltas.end());
    head.vertical_tokens = m.vertical[static_cast<std::size_t>(hk)];
    g.heads.push_back(std::move(head));
  }
  if (model_out) *model_out = std::move(m);
  return g;
}

/// Q, K, V drawn from the model (token noise, outlier keys), with RoPE applied, and the planted
/// selection. Tokens are drawn in chunks of 1024, each from its own seeded stream, on all hardware
/// threads: the result depends on the seed only, not on the thread count.
inline synthetic_vs make_synthetic_vs(const synthetic_vs_options& o) {
  detail::vs_model m;
  synthetic_vs out;
  out.planted = plant_vs_selection(o, &m);
  const index_t s = o.seq_len, d = o.head_dim;
  out.q.resize(static_cast<std::size_t>(s) * o.heads_q * d);
  out.k.resize(static_cast<std::size_t>(s) * o.heads_kv * d);
  out.v.resize(out.k.size());
  const double outlier_norm = detail::outlier_logit / m.scale;  // L: scale * (u . L u) = outlier_logit
  constexpr index_t chunk = 1024;
  auto draw_chunk = [&](index_t first) {
    std::mt19937_64 rng(o.seed * 0x9e3779b97f4a7c15ULL + static_cast<std::uint64_t>(first / chunk) + 1);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> x(static_cast<std::size_t>(d));
    // RoPE on pairs (2i, 2i + 1) by angle theta_i * position.
    auto rope_store = [&](float* dst, index_t position) {
      for (index_t i = 0; i < m.pairs; ++i) {
        const double angle = m.theta[static_cast<std::size_t>(i)] * double(position);
        const double c = std::cos(angle), sn = std::sin(angle);
        const double a = x[static_cast<std::size_t>(2 * i)], b = x[static_cast<std::size_t>(2 * i + 1)];
        dst[2 * i] = float(c * a - sn * b);
        dst[2 * i + 1] = float(sn * a + c * b);
      }
    };
    for (index_t t = first; t < std::min(s, first + chunk); ++t) {
      for (index_t h = 0; h < o.heads_q; ++h) {
        for (index_t j = 0; j < d; ++j) x[static_cast<std::size_t>(j)] = m.mean_q[static_cast<std::size_t>(h * d + j)] + m.noise * normal(rng);
        rope_store(out.q.data() + (static_cast<std::size_t>(t) * o.heads_q + h) * d, t);
      }
      for (index_t hk = 0; hk < o.heads_kv; ++hk) {
        const auto& vertical = m.vertical[static_cast<std::size_t>(hk)];
        const bool is_outlier = std::binary_search(vertical.begin(), vertical.end(), t);
        for (index_t j = 0; j < d; ++j) {
          x[static_cast<std::size_t>(j)] = m.mean_k[static_cast<std::size_t>(hk * d + j)] + m.noise * normal(rng);
          if (is_outlier) x[static_cast<std::size_t>(j)] += outlier_norm * m.outlier[static_cast<std::size_t>(hk * d + j)];
        }
        rope_store(out.k.data() + (static_cast<std::size_t>(t) * o.heads_kv + hk) * d, t);
        for (index_t j = 0; j < d; ++j) out.v[(static_cast<std::size_t>(t) * o.heads_kv + hk) * d + static_cast<std::size_t>(j)] = float(normal(rng));
      }
    }
  };
  const index_t chunks = (s + chunk - 1) / chunk;
  const auto workers = static_cast<index_t>(std::max(1u, std::min(std::thread::hardware_concurrency(), static_cast<unsigned>(chunks))));
  std::vector<std::thread> pool;
  for (index_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (index_t c = w; c < chunks; c += workers) draw_chunk(c * chunk);
    });
  for (auto& t : pool) t.join();
  return out;
}

}  // namespace stria::host
