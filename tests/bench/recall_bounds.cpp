// SPDX-License-Identifier: Apache-2.0
// What the index formats can recall at a density (issue 21): on a synthetic input, the estimate's
// VS selection, then oracle additions to it from the exact attention, each filled to one density:
// 64 x 64 tiles (a format the kernels run) and 64-row column segments (finer than any format here);
// the best of any index of 64-row granularity (from scratch: the diagonal tiles and the heaviest
// column segments); what a selection of any shape reaches (host::attention_mass_profile); and each
// row's own best keys; the generator's expected scores (their spread, off periodic_slash's planted
// lines, and the key noise's spread through the query mean); and the mass on the token offsets and
// the block diagonals where periodic_slash plants its lines (every pattern: a baseline).
// Host code, exact attention: seconds at 4K, minutes at 16K (or sample rows, --stride).
//   recall_bounds [--seq-len S] [--pattern LIST] [--density X] [--stride N] [--heads-q H] [--heads-kv H] [--p X] [--p-vertical X]
//                 [--noise X] [--vertical-max N] [--slash-max N]
// --p sets the estimator's p_vertical and p_slash, --p-vertical (after it) p_vertical alone.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "args.hpp"
#include "stria/comm/host_threads.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/host/oracle_selection.hpp"
#include "stria/host/recall.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/sharding/sequential.hpp"

using namespace stria;

namespace {

/// A candidate addition to the selection: the exact mass it adds over the sampled rows and its entries.
struct candidate {
  double mass;
  std::int64_t entries;
  index_t head, query_block, key;  // key: a key block (tiles) or a key token (segments)
};

struct row_bounds {
  double own_best_sum = 0, own_best_min = 1, keys_for_80 = 0, keys = 0;
  std::int64_t rows = 0, below_80 = 0;
};

struct head_scan {
  std::vector<candidate> tiles, segments;
  std::vector<double> any_segments;  // every off-diagonal segment's mass, whatever the selection holds
  double diagonal_mass = 0;          // the diagonal tiles', which every causal index keeps
  double line_mass = 0;              // on the token offsets j x line_period, j in [1, lines] (periodic_slash's lines)
  double line_diagonal_mass = 0;     // on the block diagonals those offsets lie on
  std::int64_t diagonal_entries = 0;
  row_bounds rows;
};

/// One head's exact probabilities, block row by block row: the mass outside `sel`'s verticals and
/// slashes (an estimate has no explicit tiles) per tile and per column segment, every off-diagonal
/// segment's mass, each row's own best `share` of its keys and the keys it needs to hold 0.8, and
/// the mass on the token offsets j x line_period, j in [1, lines], and on their block diagonals.
template <class T>
head_scan scan_head(const head_selection& sel, tensor_view<const T, 3> q, tensor_view<const T, 3> k, double scale, index_t h, index_t heads_q_per_kv,
                    index_t stride, double share, index_t line_period, index_t lines) {
  const index_t s = q.extent(0), nb = s / block_tokens, dim = q.extent(2), hk = h / heads_q_per_kv;
  std::vector<unsigned char> vertical(static_cast<std::size_t>(s), 0), on_slash(static_cast<std::size_t>(nb), 0);
  for (const index_t t : sel.vertical_tokens) vertical[static_cast<std::size_t>(t)] = 1;
  for (const index_t d : sel.slash_deltas) on_slash[static_cast<std::size_t>(d)] = 1;
  const std::vector<float> kt = host::detail::transposed_keys(k, hk);
  std::vector<float> qs(static_cast<std::size_t>(block_tokens) * dim), score(static_cast<std::size_t>(block_tokens) * block_tokens);
  std::vector<double> p(static_cast<std::size_t>(block_tokens) * s), sorted;
  head_scan out;
  for (index_t qb = (nb - 1) % stride; qb < nb; qb += stride) {
    host::detail::scaled_queries(q, h, qb, scale, qs.data());
    // Scores in the exp2 domain, row by row (the causal prefix of each), then each row's softmax.
    for (index_t kb = 0; kb <= qb; ++kb) {
      host::detail::score_tile(qs.data(), kt.data(), s, dim, kb, score.data());
      for (index_t a = 0; a < block_tokens; ++a)
        for (index_t b = 0; b < block_tokens; ++b)
          p[static_cast<std::size_t>(a) * s + kb * block_tokens + b] = score[static_cast<std::size_t>(a) * block_tokens + b];
    }
    std::vector<double> tile_mass(static_cast<std::size_t>(qb) + 1, 0.0), column_mass(static_cast<std::size_t>(qb + 1) * block_tokens, 0.0),
        all_column_mass(static_cast<std::size_t>(qb) * block_tokens, 0.0);
    for (index_t a = 0; a < block_tokens; ++a) {
      const index_t n = qb * block_tokens + a, keys = n + 1;
      double* row = p.data() + static_cast<std::size_t>(a) * s;
      const double top = *std::max_element(row, row + keys);
      double total = 0;
      for (index_t m = 0; m < keys; ++m) total += (row[m] = std::exp2(row[m] - top));
      for (index_t m = 0; m < keys; ++m) {
        row[m] /= total;
        if (m / block_tokens == qb) out.diagonal_mass += row[m];
        else all_column_mass[static_cast<std::size_t>(m)] += row[m];
        if (n > m && (n - m) % line_period == 0 && (n - m) / line_period <= lines) out.line_mass += row[m];
        if (const index_t delta = qb - m / block_tokens, period = line_period / block_tokens; delta > 0 && delta % period == 0 && delta / period <= lines)
          out.line_diagonal_mass += row[m];
        if (!on_slash[static_cast<std::size_t>(qb - m / block_tokens)] && !vertical[static_cast<std::size_t>(m)]) {
          tile_mass[static_cast<std::size_t>(m / block_tokens)] += row[m];
          column_mass[static_cast<std::size_t>(m)] += row[m];
        }
      }
      sorted.assign(row, row + keys);
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      // A share of a row's keys (at least one), the last key taken in part.
      const double take = std::max(1.0, share * double(keys));
      const auto whole = static_cast<std::size_t>(take);
      double best = 0, held = 0;
      for (std::size_t i = 0; i < whole; ++i) best += sorted[i];
      if (whole < sorted.size()) best += (take - double(whole)) * sorted[whole];
      std::size_t need = 0;
      while (need < sorted.size() && held < 0.8) held += sorted[need++];
      row_bounds& r = out.rows;
      r.own_best_sum += best;
      r.own_best_min = std::min(r.own_best_min, best);
      r.below_80 += best < 0.8;
      r.keys_for_80 += double(need);
      r.keys += double(keys);
      ++r.rows;
    }
    out.diagonal_entries += std::int64_t{block_tokens} * (block_tokens + 1) / 2;
    out.any_segments.insert(out.any_segments.end(), all_column_mass.begin(), all_column_mass.end());
    // Off the diagonal (always a slash): tiles and segments that the selection leaves out.
    for (index_t kb = 0; kb < qb; ++kb) {
      if (on_slash[static_cast<std::size_t>(qb - kb)]) continue;
      std::int64_t open = 0;
      for (index_t b = 0; b < block_tokens; ++b)
        if (!vertical[static_cast<std::size_t>(kb * block_tokens + b)]) {
          open += block_tokens;
          out.segments.push_back({column_mass[static_cast<std::size_t>(kb * block_tokens + b)], block_tokens, h, qb, kb * block_tokens + b});
        }
      if (open > 0) out.tiles.push_back({tile_mass[static_cast<std::size_t>(kb)], open, h, qb, kb});
    }
  }
  return out;
}

/// The generator's expected scaled score f(delta) (host::detail::expected_logits) beyond the
/// diagonal block (delta >= 64), averaged over the query heads: its spread and largest value off the
/// planted lines at j x `line_period` tokens, j in [1, lines] (more than 63 tokens from each; every
/// offset where line_period is 0), its mean on them, and the spread the key noise adds to a score
/// through the query mean (noise x |mean_q| x scale).
struct expected_scores {
  double sd = 0, max = 0, on_lines = 0, key_noise_sd = 0;
};
expected_scores expected_scores_of(const host::synthetic_vs_options& o, index_t line_period, index_t lines) {
  host::detail::vs_model m;
  (void)host::plant_vs_selection(o, &m);
  expected_scores out;
  for (index_t h = 0; h < o.heads_q; ++h) {
    const std::vector<double> f = host::detail::expected_logits(m, o.head_dim, h, h / (o.heads_q / o.heads_kv), o.seq_len);
    double sum = 0, squares = 0, top = -std::numeric_limits<double>::infinity(), on_sum = 0;
    std::int64_t off = 0, on = 0;
    for (index_t delta = block_tokens; delta < o.seq_len; ++delta) {
      const double x = f[static_cast<std::size_t>(delta)];
      const index_t nearest = line_period > 0 ? (delta + line_period / 2) / line_period : 0;  // the nearest line, 0: none
      if (nearest >= 1 && nearest <= lines && delta == nearest * line_period) on_sum += x, ++on;
      if (nearest >= 1 && nearest <= lines && std::abs(delta - nearest * line_period) < block_tokens) continue;
      sum += x, squares += x * x, top = std::max(top, x), ++off;
    }
    const double mean = sum / double(off);
    out.sd += std::sqrt(std::max(0.0, squares / double(off) - mean * mean));
    out.max += top;
    out.on_lines += on > 0 ? on_sum / double(on) : 0.0;
    double norm = 0;
    for (index_t j = 0; j < o.head_dim; ++j) norm += std::pow(m.mean_q[static_cast<std::size_t>(h * o.head_dim + j)], 2);
    out.key_noise_sd += m.noise * std::sqrt(norm) * m.scale;
  }
  for (double* x : {&out.sd, &out.max, &out.on_lines, &out.key_noise_sd}) *x /= double(o.heads_q);
  return out;
}

/// The candidates of largest mass per entry, in that order, up to the first that does not fit `budget`
/// entries: their mass, entries and count.
struct filled {
  double mass = 0;
  std::int64_t entries = 0;
  std::vector<candidate> taken;
};
filled fill(std::vector<candidate> all, double budget) {
  std::sort(all.begin(), all.end(), [](const candidate& a, const candidate& b) { return a.mass * double(b.entries) > b.mass * double(a.entries); });
  filled out;
  for (const candidate& c : all) {
    if (double(out.entries + c.entries) > budget) break;
    out.mass += c.mass;
    out.entries += c.entries;
    out.taken.push_back(c);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  index_t seq_len = 4096, stride = 1, heads_q = 4, heads_kv = 2, vertical_max = 0, slash_max = 0;
  std::string patterns = "rope,power_law_slash";
  double density = 0.10, noise = host::synthetic_vs_options{}.token_noise;
  double top_p = estimator::vertical_slash_top_p{}.p_slash, p_vertical = estimator::vertical_slash_top_p{}.p_vertical;  // --p sets both
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--seq-len" && i + 1 < argc) seq_len = cli::parse_integer<index_t>(flag, argv[++i], 1024, 1 << 20);
    else if (flag == "--pattern" && i + 1 < argc) patterns = argv[++i];
    else if (flag == "--density" && i + 1 < argc) density = cli::parse_real(flag, argv[++i], 1e-4, 1.0);
    else if (flag == "--stride" && i + 1 < argc) stride = cli::parse_integer<index_t>(flag, argv[++i], 1, 1 << 14);
    else if (flag == "--heads-q" && i + 1 < argc) heads_q = cli::parse_integer<index_t>(flag, argv[++i], 1, 1024);
    else if (flag == "--heads-kv" && i + 1 < argc) heads_kv = cli::parse_integer<index_t>(flag, argv[++i], 1, 1024);
    else if (flag == "--vertical-max" && i + 1 < argc) vertical_max = cli::parse_integer<index_t>(flag, argv[++i], 0, 1 << 20);
    else if (flag == "--slash-max" && i + 1 < argc) slash_max = cli::parse_integer<index_t>(flag, argv[++i], 0, 1 << 14);
    else if (flag == "--p" && i + 1 < argc) top_p = p_vertical = cli::parse_real(flag, argv[++i], 1e-9, 1.0);
    else if (flag == "--p-vertical" && i + 1 < argc) p_vertical = cli::parse_real(flag, argv[++i], 1e-9, 1.0);
    else if (flag == "--noise" && i + 1 < argc) noise = cli::parse_real(flag, argv[++i], 0.0, 1e3);
    else
      throw invalid_argument("flag", flag,
                             "must be --seq-len S, --pattern LIST, --density X, --stride N, --heads-q H, --heads-kv H, --vertical-max N, "
                             "--slash-max N, --p X, --p-vertical X or --noise X");
  }
  if (seq_len % block_tokens != 0) throw invalid_argument("--seq-len", seq_len, "must be a multiple of 64");
  if (stride > seq_len / block_tokens) throw invalid_argument("--stride", stride, "must be at most seq_len / 64");
  const auto wanted = [&](const std::string& p) { return ("," + patterns + ",").find("," + p + ",") != std::string::npos; };
  std::printf("recall_bounds: heads %d/%d, D 128, token noise %g, estimator p_vertical %g and p_slash %g, density %.3f of the causal entries, rows "
              "of every %d-th query block; recall = mean over rows (min)\n", heads_q, heads_kv, noise, p_vertical, top_p, density, stride);
  for (const host::vs_pattern pattern : {host::vs_pattern::rope, host::vs_pattern::power_law_slash, host::vs_pattern::periodic_slash,
                                         host::vs_pattern::clustered_vertical, host::vs_pattern::mixture}) {
    if (!wanted(host::pattern_name(pattern))) continue;
    host::synthetic_vs_options o;
    o.seq_len = seq_len;
    o.heads_q = heads_q;
    o.heads_kv = heads_kv;
    o.head_dim = 128;
    o.pattern = pattern;
    o.token_noise = noise;
    o.validate();
    const host::synthetic_vs x = host::make_synthetic_vs(o);
    const tensor_view<const float, 3> q(x.q.data(), {seq_len, heads_q, o.head_dim}), k(x.k.data(), {seq_len, heads_kv, o.head_dim});
    const double scale = 1.0 / std::sqrt(double(o.head_dim));
    const index_t line_period = o.period() * block_tokens;  // periodic_slash's lines; the other patterns' mass there is a baseline
    const bool periodic = pattern == host::vs_pattern::periodic_slash;
    estimator::vertical_slash_top_p est;
    est.vertical.max = vertical_max;
    est.slash.max = slash_max;
    est.p_slash = top_p;
    est.p_vertical = p_vertical;
    global_selection g;
    comm::host_world one(1);
    one.run([&](comm::host_threads& c) { g = estimator::estimate(est, c, sharding::sequential{}, seq_len, true, q, k, scale); });

    std::vector<head_scan> scans(static_cast<std::size_t>(heads_q));
    host::detail::for_each_head(heads_q, 0, [&](index_t h) {
      scans[static_cast<std::size_t>(h)] =
          scan_head(g.heads[static_cast<std::size_t>(h)], q, k, scale, h, heads_q / heads_kv, stride, density, line_period, o.extra_slashes);
    });
    std::vector<candidate> tiles, segments;
    std::vector<double> any_segments;
    double diagonal_mass = 0, line_mass = 0, line_diagonal_mass = 0;
    std::int64_t diagonal_entries = 0;
    row_bounds rows;
    for (head_scan& s : scans) {
      line_mass += s.line_mass;
      line_diagonal_mass += s.line_diagonal_mass;
      any_segments.insert(any_segments.end(), s.any_segments.begin(), s.any_segments.end());
      diagonal_mass += s.diagonal_mass;
      diagonal_entries += s.diagonal_entries;
      tiles.insert(tiles.end(), s.tiles.begin(), s.tiles.end());
      segments.insert(segments.end(), s.segments.begin(), s.segments.end());
      rows.own_best_sum += s.rows.own_best_sum;
      rows.own_best_min = std::min(rows.own_best_min, s.rows.own_best_min);
      rows.below_80 += s.rows.below_80;
      rows.keys_for_80 += s.rows.keys_for_80;
      rows.keys += s.rows.keys;
      rows.rows += s.rows.rows;
    }
    const double vs_share = host::selected_share(g, stride);
    const double budget = (density - vs_share) * rows.keys;  // entries the additions may take
    const host::recall_summary vs = host::attention_recall(g, q, k, scale, 0, stride);
    std::printf("%s, %d tokens:\n  VS estimate: density %.4f, recall %.4f (%.4f)\n", host::pattern_name(pattern), seq_len, vs_share, vs.mean, vs.min);
    const expected_scores e = expected_scores_of(o, periodic ? line_period : 0, o.extra_slashes);
    std::printf("  the generator's expected scaled score beyond the diagonal block (%s): sd %.2f, max %.2f; the key noise's sd through the query "
                "mean %.2f\n",
                periodic ? "over 63 tokens off the planted lines" : "all offsets", e.sd, e.max, e.key_noise_sd);
    if (periodic) std::printf("  the planted lines' expected scaled score: %.2f\n", e.on_lines);
    std::printf("  %s lines (token offsets j x %d, j = 1..%d): the rows' mass on those offsets %.4f, on their block diagonals %.4f\n",
                periodic ? "the planted" : "periodic_slash's", line_period, std::min(o.extra_slashes, (seq_len - 1) / line_period),
                line_mass / double(rows.rows), line_diagonal_mass / double(rows.rows));
    if (budget > 0) {
      const filled t = fill(tiles, budget);
      global_selection with_tiles = g;
      for (const candidate& c : t.taken) with_tiles.heads[static_cast<std::size_t>(c.head)].blocks.push_back({c.query_block, c.key});
      for (head_selection& h : with_tiles.heads) std::sort(h.blocks.begin(), h.blocks.end());
      const host::recall_summary r = host::attention_recall(with_tiles, q, k, scale, 0, stride);
      std::printf("  + %zu oracle 64 x 64 tiles (largest mass per entry outside the estimate): density %.4f, recall %.4f (%.4f)\n", t.taken.size(),
                  host::selected_share(with_tiles, stride), r.mean, r.min);
      const filled c = fill(segments, budget);
      std::printf("  + %zu oracle column segments of 64 rows instead (no format here): density %.4f, recall %.4f\n", c.taken.size(),
                  vs_share + double(c.entries) / rows.keys, vs.mean + c.mass / double(rows.rows));
    } else {
      std::printf("  the estimate alone is past density %.3f: no additions\n", density);
    }
    // Every index of 64-row granularity (verticals, block diagonals, tiles: all unions of column
    // segments of a query block) with the diagonal tiles: the heaviest segments fill the rest, which
    // is optimal, as every off-diagonal segment costs 64 entries.
    {
      std::sort(any_segments.begin(), any_segments.end(), std::greater<>());
      const double room = density * rows.keys - double(diagonal_entries);
      double kept = diagonal_mass;
      const std::size_t n = room > 0 ? std::min(any_segments.size(), static_cast<std::size_t>(room / block_tokens)) : 0;
      for (std::size_t i = 0; i < n; ++i) kept += any_segments[i];
      std::printf("  any index of 64-row granularity (the diagonal tiles and the heaviest column segments): recall %.4f at density %.4f\n",
                  kept / double(rows.rows), (double(diagonal_entries) + double(n) * block_tokens) / rows.keys);
    }
    const host::attention_mass_profile profile = host::attention_mass_profile_of(q, k, scale, true, 0, stride);
    std::printf("  any shape (the largest probabilities, pooled): recall %.4f at density %.4f\n", profile.best_mean_recall(density), density);
    std::printf("  each row's own best %.1f%% of its keys: recall %.4f (%.4f); %.2f%% of the rows hold under 0.80; every row at 0.80 takes %.2f%% of "
                "the entries\n",
                100.0 * density, rows.own_best_sum / double(rows.rows), rows.own_best_min, 100.0 * double(rows.below_80) / double(rows.rows),
                100.0 * rows.keys_for_80 / rows.keys);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
