// SPDX-License-Identifier: Apache-2.0
// How much of the exact attention a selection keeps: per query row, the share of its softmax mass
// that falls on the selected entries. Exact (every key is scored); for validating estimators.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::host {

namespace detail {

/// run_head(h) for every head h < heads, the heads dealt round-robin to `threads` threads (0: all
/// hardware threads), at most one thread per head.
template <class RunHead>
void for_each_head(index_t heads, unsigned threads, RunHead&& run_head) {
  const unsigned workers =
      std::max(1u, std::min<unsigned>(threads ? threads : std::thread::hardware_concurrency(), static_cast<unsigned>(heads)));
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (index_t h = static_cast<index_t>(w); h < heads; h += static_cast<index_t>(workers)) run_head(h);
    });
  for (auto& t : pool) t.join();
}

/// 2^x for x <= 0 without branches or calls, so loops over it vectorise: x = n + f with n the
/// nearest integer and |f| <= 1/2, 2^f by a degree-6 Taylor series of e^(f ln 2) (relative error
/// below 2e-7), 2^n through the exponent bits. Results below 2^-126 flush to 0.
inline float exp2_nonpositive(float x) {
  x = 0.5f * (x - 126.0f + std::fabs(x + 126.0f));  // max(x, -126) without a branch
  const int n = static_cast<int>(x - 0.5f);   // truncation of x - 1/2 rounds x to nearest for x <= 0
  const float t = (x - float(n)) * 0.6931471805599453f;
  float p = 1.0f / 720.0f;
  p = p * t + 1.0f / 120.0f;
  p = p * t + 1.0f / 24.0f;
  p = p * t + 1.0f / 6.0f;
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  return p * std::bit_cast<float>(static_cast<std::uint32_t>(n + 127) << 23);
}

/// Scores of one 64x64 tile in the exp2 domain, [64 query rows, 64 keys]: qs holds the 64 queries
/// pre-scaled by scale * log2(e), [64, D]; kt the head's keys transposed, [D, S]. Four query rows
/// share each key load (the b loop vectorises).
inline void score_tile(const float* qs, const float* kt, index_t seq_len, index_t dim, index_t key_block, float* score) {
  std::fill(score, score + block_tokens * block_tokens, 0.0f);
  const float* keys = kt + static_cast<std::size_t>(key_block) * block_tokens;
  for (index_t a = 0; a < block_tokens; a += 4) {
    float* r0 = score + static_cast<std::size_t>(a) * block_tokens;
    float* r1 = r0 + block_tokens;
    float* r2 = r1 + block_tokens;
    float* r3 = r2 + block_tokens;
    const float* q0 = qs + static_cast<std::size_t>(a) * dim;
    for (index_t d = 0; d < dim; ++d) {
      const float x0 = q0[d], x1 = q0[dim + d], x2 = q0[2 * dim + d], x3 = q0[3 * dim + d];
      const float* key = keys + static_cast<std::size_t>(d) * seq_len;
      for (index_t b = 0; b < block_tokens; ++b) {
        const float kv = key[b];
        r0[b] += x0 * kv;
        r1[b] += x1 * kv;
        r2[b] += x2 * kv;
        r3[b] += x3 * kv;
      }
    }
  }
}

/// A head's keys transposed, [D, S] (score_tile's kt): KV head hk of k [S, Hkv, D].
template <class T>
std::vector<float> transposed_keys(tensor_view<const T, 3> k, index_t hk) {
  const index_t s = k.extent(0), dim = k.extent(2);
  std::vector<float> kt(static_cast<std::size_t>(dim) * s);
  for (index_t m = 0; m < s; ++m)
    for (index_t d = 0; d < dim; ++d) kt[static_cast<std::size_t>(d) * s + m] = float(k(m, hk, d));
  return kt;
}

/// Query block qb of head h, pre-scaled by softmax_scale * log2(e) (score_tile's qs, [64, D]): the
/// scores come out in the exp2 domain.
template <class T>
void scaled_queries(tensor_view<const T, 3> q, index_t h, index_t qb, double softmax_scale, float* qs) {
  constexpr float log2e = 1.4426950408889634f;
  const index_t dim = q.extent(2);
  for (index_t a = 0; a < block_tokens; ++a)
    for (index_t d = 0; d < dim; ++d)
      qs[static_cast<std::size_t>(a) * dim + d] = float(q(qb * block_tokens + a, h, d)) * float(softmax_scale) * log2e;
}

/// Each row's softmax normaliser for query block qb (qs as scaled_queries makes it) over key blocks
/// [0, key_blocks), the diagonal one masked past each row where causal: row_max[a] and row_sum[a],
/// the sum of exp2(score - row_max[a]) over the row's keys. `score` is score_tile's workspace.
inline void row_normalisers(const float* qs, const float* kt, index_t seq_len, index_t dim, index_t qb, index_t key_blocks, bool causal,
                            float* score, float* row_max, double* row_sum) {
  std::fill(row_max, row_max + block_tokens, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + block_tokens, 0.0);
  for (index_t kb = 0; kb < key_blocks; ++kb) {
    score_tile(qs, kt, seq_len, dim, kb, score);
    for (index_t a = 0; a < block_tokens; ++a) {
      const index_t count = causal && kb == qb ? a + 1 : block_tokens;
      const float* row = score + static_cast<std::size_t>(a) * block_tokens;
      const float top = *std::max_element(row, row + count);
      if (top > row_max[a]) {
        row_sum[a] *= std::exp2(double(row_max[a]) - double(top));
        row_max[a] = top;
      }
      double sum = 0;
      for (index_t b = 0; b < count; ++b) sum += exp2_nonpositive(row[b] - row_max[a]);
      row_sum[a] += sum;
    }
  }
}

}  // namespace detail

struct recall_summary {
  double mean = 0;      // over all (head, query token) rows that have keys
  double min = 1;
  std::int64_t rows = 0;
};

/// Recalled attention mass of `selection` for every query row of q [S, Hq, D] against k [S, Hkv, D].
/// Work: S^2 / 2 * Hq * D multiply-adds (causal); threads share the heads (0: all hardware threads).
/// With query_block_stride > 1 only the rows of every stride-th query block count (the last block
/// always), which makes long sequences affordable.
template <class T>
recall_summary attention_recall(const global_selection& selection, tensor_view<const T, 3> q, tensor_view<const T, 3> k,
                                double softmax_scale, unsigned threads = 0, index_t query_block_stride = 1) {
  selection.validate();
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  check_extents(k, {shape.query_tokens, shape.heads_kv, shape.head_dim}, "k");
  if (shape.query_tokens != selection.seq_len)
    throw invalid_argument("q.extent(0)", shape.query_tokens, "must equal the selection's seq_len " + std::to_string(selection.seq_len));
  if (shape.heads_q != selection.num_heads())
    throw invalid_argument("q.extent(1)", shape.heads_q, "must equal the selection's head count " + std::to_string(selection.num_heads()));

  const index_t s = shape.query_tokens, nb = s / block_tokens, dim = shape.head_dim;
  if (query_block_stride < 1 || query_block_stride > nb)
    throw invalid_argument("query_block_stride", query_block_stride, "must lie in [1, seq_len / 64]");
  const bool causal = selection.causal;
  struct head_result {
    double sum = 0, min = 1;
    std::int64_t rows = 0;
  };
  std::vector<head_result> results(static_cast<std::size_t>(shape.heads_q));

  auto run_head = [&](index_t h) {
    const head_selection& sel = selection.heads[static_cast<std::size_t>(h)];
    const index_t hk = shape.kv_head(h);
    const std::vector<float> kt = detail::transposed_keys(k, hk);
    std::vector<unsigned char> on_slash(static_cast<std::size_t>(2 * nb - 1), 0), vertical(static_cast<std::size_t>(s), 0);
    for (const index_t delta : sel.slash_deltas) on_slash[static_cast<std::size_t>(delta + nb - 1)] = 1;
    for (const index_t t : sel.vertical_tokens) vertical[static_cast<std::size_t>(t)] = 1;
    std::vector<float> qs(static_cast<std::size_t>(block_tokens) * dim), score(static_cast<std::size_t>(block_tokens) * block_tokens);
    std::vector<float> keep(static_cast<std::size_t>(block_tokens)), exps(static_cast<std::size_t>(block_tokens));
    // valid[count * 64 + b]: 1 for the first `count` keys of a tile, else 0 (row `count` is unused padding).
    std::vector<float> valid(static_cast<std::size_t>(block_tokens + 1) * block_tokens);
    for (index_t c = 0; c <= block_tokens; ++c)
      for (index_t b = 0; b < block_tokens; ++b) valid[static_cast<std::size_t>(c * block_tokens + b)] = b < c ? 1.0f : 0.0f;
    head_result& out = results[static_cast<std::size_t>(h)];
    for (index_t qb = (nb - 1) % query_block_stride; qb < nb; qb += query_block_stride) {
      detail::scaled_queries(q, h, qb, softmax_scale, qs.data());
      float row_max[block_tokens];
      double total[block_tokens] = {}, kept[block_tokens] = {};
      std::fill(row_max, row_max + block_tokens, -1e30f);
      for (index_t kb = 0; kb < (causal ? qb + 1 : nb); ++kb) {
        const bool tile_on = on_slash[static_cast<std::size_t>(qb - kb + nb - 1)] ||
                             (!sel.blocks.empty() && std::binary_search(sel.blocks.begin(), sel.blocks.end(), block_pair{qb, kb}));
        for (index_t b = 0; b < block_tokens; ++b)
          keep[static_cast<std::size_t>(b)] = tile_on || vertical[static_cast<std::size_t>(kb * block_tokens + b)] ? 1.0f : 0.0f;
        detail::score_tile(qs.data(), kt.data(), s, dim, kb, score.data());
        for (index_t a = 0; a < block_tokens; ++a) {
          // On a diagonal tile of causal attention, keys after the query are masked out.
          const index_t count = causal && kb == qb ? a + 1 : block_tokens;
          float* row = score.data() + static_cast<std::size_t>(a) * block_tokens;
          // Reductions through eight explicit lanes, which vectorise without -ffast-math.
          // Masked keys read as -1e30 (finite, so the branch-free max below stays exact enough).
          constexpr int lanes = 8;
          for (index_t b = 0; b < block_tokens; ++b) row[b] = row[b] * valid[static_cast<std::size_t>(count * block_tokens + b)] +
                                                              (valid[static_cast<std::size_t>(count * block_tokens + b)] - 1.0f) * 1e30f;
          float lane_max[lanes];
          std::fill(lane_max, lane_max + lanes, -1e30f);
          for (index_t b = 0; b < block_tokens; b += lanes)
            for (int l = 0; l < lanes; ++l) {  // max(x, y) = (x + y + |x - y|) / 2: no compare, so it vectorises
              const float x = lane_max[l], y = row[b + l];
              lane_max[l] = 0.5f * (x + y + std::fabs(x - y));
            }
          float tile_max = row_max[a];
          for (int l = 0; l < lanes; ++l) tile_max = std::max(tile_max, lane_max[l]);
          if (tile_max > row_max[a]) {  // online softmax: rescale what was summed so far
            const double rescale = std::exp2(double(row_max[a]) - double(tile_max));
            total[a] *= rescale;
            kept[a] *= rescale;
            row_max[a] = tile_max;
          }
          for (index_t b = 0; b < block_tokens; ++b)
            exps[static_cast<std::size_t>(b)] =
                detail::exp2_nonpositive(row[b] - row_max[a]) * valid[static_cast<std::size_t>(count * block_tokens + b)];
          float lane_total[lanes] = {}, lane_kept[lanes] = {};
          for (index_t b = 0; b < block_tokens; b += lanes)
            for (int l = 0; l < lanes; ++l) {
              lane_total[l] += exps[static_cast<std::size_t>(b + l)];
              lane_kept[l] += exps[static_cast<std::size_t>(b + l)] * keep[static_cast<std::size_t>(b + l)];
            }
          for (int l = 0; l < lanes; ++l) {
            total[a] += lane_total[l];
            kept[a] += lane_kept[l];
          }
        }
      }
      for (index_t a = 0; a < block_tokens; ++a) {
        if (total[a] == 0) continue;
        const double r = kept[a] / total[a];
        out.sum += r;
        out.min = std::min(out.min, r);
        ++out.rows;
      }
    }
  };

  detail::for_each_head(shape.heads_q, threads, run_head);

  recall_summary summary;
  double sum = 0;
  for (const head_result& r : results) {
    sum += r.sum;
    summary.rows += r.rows;
    summary.min = std::min(summary.min, r.min);
  }
  summary.mean = summary.rows ? sum / double(summary.rows) : 0.0;
  return summary;
}

/// Every (sampled) row's attention probabilities, binned by value: what a selection of any shape can
/// recall. best_mean_recall(d) bounds the mean row recall of every selection that holds a share d of
/// the rows' entries, VS or not, the oracle's included: it takes the entries of largest probability,
/// pooled over heads and rows. A bin holds probabilities within a factor 1 + 1/128 of each other (the
/// float's exponent and top 7 mantissa bits); the bin that straddles the budget counts each entry
/// taken at the bin's upper edge, so the bound is not under the exact one (up to float rounding: p is
/// binned as a float) and at most 1/128 over it. Bins past 2^-126 (subnormal floats) are wider, with
/// a mass that no density of interest reaches.
struct attention_mass_profile {
  static constexpr std::uint32_t top_key = 127u << 7;    // p = 1: exponent 127, mantissa 0
  static constexpr std::size_t bins = top_key + 1;       // bin 0: p = 1; the last: p below 2^-133
  std::vector<std::int64_t> count = std::vector<std::int64_t>(bins, 0);
  std::vector<double> mass = std::vector<double>(bins, 0.0);
  std::int64_t rows = 0, entries = 0;

  /// The bin of a probability p in [0, 1].
  static std::size_t bin(float p) noexcept { return top_key - std::min(std::bit_cast<std::uint32_t>(p) >> 16, top_key); }
  /// The largest probability bin b holds.
  static double upper_edge(std::size_t b) noexcept {
    return b == 0 ? 1.0 : double(std::bit_cast<float>(((top_key - static_cast<std::uint32_t>(b)) << 16) | 0xffffu));
  }

  /// The best mean row recall of a selection holding a share `density` in (0, 1] of the entries.
  double best_mean_recall(double density) const {
    if (!(density > 0.0 && density <= 1.0)) throw invalid_argument("density", density, "must lie in (0, 1]");
    double budget = density * double(entries), kept = 0;
    for (std::size_t b = 0; b < bins && budget > 0; ++b) {
      const double take = std::min(budget, double(count[b]));
      kept += take == double(count[b]) ? mass[b] : std::min(mass[b], take * upper_edge(b));
      budget -= take;
    }
    return rows ? kept / double(rows) : 0.0;
  }
};

/// The share of the (sampled) rows' entries that `selection` holds: the density at which to read an
/// attention_mass_profile made with the same query_block_stride.
inline double selected_share(const global_selection& selection, index_t query_block_stride = 1) {
  selection.validate();
  const index_t nb = selection.seq_len / block_tokens;
  if (query_block_stride < 1 || query_block_stride > nb)
    throw invalid_argument("query_block_stride", query_block_stride, "must lie in [1, seq_len / 64]");
  constexpr std::int64_t tile = std::int64_t{block_tokens} * block_tokens, triangle = tile / 2 + block_tokens / 2;
  std::int64_t held = 0, all = 0;
  for (const head_selection& head : selection.heads) {
    std::vector<std::int64_t> verticals(static_cast<std::size_t>(nb), 0);  // per key block
    for (const index_t t : head.vertical_tokens) ++verticals[static_cast<std::size_t>(t / block_tokens)];
    std::vector<unsigned char> on_slash(static_cast<std::size_t>(2 * nb - 1), 0);
    for (const index_t delta : head.slash_deltas) on_slash[static_cast<std::size_t>(delta + nb - 1)] = 1;
    for (index_t qb = (nb - 1) % query_block_stride; qb < nb; qb += query_block_stride)
      for (index_t kb = 0; kb < (selection.causal ? qb + 1 : nb); ++kb) {
        const bool diagonal = selection.causal && kb == qb;
        all += diagonal ? triangle : tile;
        if (on_slash[static_cast<std::size_t>(qb - kb + nb - 1)] ||
            std::binary_search(head.blocks.begin(), head.blocks.end(), block_pair{qb, kb}))
          held += diagonal ? triangle : tile;
        else if (!diagonal)
          held += block_tokens * verticals[static_cast<std::size_t>(kb)];
        else  // row a of the diagonal tile sees the verticals at offsets <= a
          for (const index_t t : head.vertical_tokens)
            if (t / block_tokens == kb) held += block_tokens - t % block_tokens;
      }
  }
  return all ? double(held) / double(all) : 0.0;
}

/// The mass profile of causal (or full) attention of q [S, Hq, D] against k [S, Hkv, D], two passes
/// over every tile (the rows' normalisers, detail::row_normalisers, then their probabilities). query_block_stride samples
/// rows as attention_recall does. Scores that are not finite are refused after the passes.
template <class T>
attention_mass_profile attention_mass_profile_of(tensor_view<const T, 3> q, tensor_view<const T, 3> k, double softmax_scale, bool causal,
                                                 unsigned threads = 0, index_t query_block_stride = 1) {
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  check_extents(k, {shape.query_tokens, shape.heads_kv, shape.head_dim}, "k");
  const index_t s = shape.query_tokens, nb = s / block_tokens, dim = shape.head_dim;
  if (s % block_tokens != 0) throw invalid_argument("q.extent(0)", s, "must be a multiple of 64");
  if (query_block_stride < 1 || query_block_stride > nb)
    throw invalid_argument("query_block_stride", query_block_stride, "must lie in [1, seq_len / 64]");
  if (!(std::fabs(softmax_scale) <= double(std::numeric_limits<float>::max())))
    throw invalid_argument("softmax_scale", softmax_scale, "must be finite in float");
  std::vector<attention_mass_profile> per_head(static_cast<std::size_t>(shape.heads_q));
  std::vector<unsigned char> not_finite(static_cast<std::size_t>(shape.heads_q), 0);

  auto run_head = [&](index_t h) {
    attention_mass_profile& out = per_head[static_cast<std::size_t>(h)];
    const index_t hk = shape.kv_head(h);
    const std::vector<float> kt = detail::transposed_keys(k, hk);
    std::vector<float> qs(static_cast<std::size_t>(block_tokens) * dim), score(static_cast<std::size_t>(block_tokens) * block_tokens);
    for (index_t qb = (nb - 1) % query_block_stride; qb < nb; qb += query_block_stride) {
      detail::scaled_queries(q, h, qb, softmax_scale, qs.data());
      const index_t key_blocks = causal ? qb + 1 : nb;
      float row_max[block_tokens];
      double total[block_tokens];
      detail::row_normalisers(qs.data(), kt.data(), s, dim, qb, key_blocks, causal, score.data(), row_max, total);
      for (index_t kb = 0; kb < key_blocks; ++kb) {
        detail::score_tile(qs.data(), kt.data(), s, dim, kb, score.data());
        for (index_t a = 0; a < block_tokens; ++a) {
          const index_t keys = causal && kb == qb ? a + 1 : block_tokens;
          const float* row = score.data() + static_cast<std::size_t>(a) * block_tokens;
          const double inverse = 1.0 / total[a];
          for (index_t b = 0; b < keys; ++b) {
            const double p = double(detail::exp2_nonpositive(row[b] - row_max[a])) * inverse;
            if (!(p >= 0.0 && p <= 1.0)) {  // a score that is not finite
              not_finite[static_cast<std::size_t>(h)] = 1;
              return;
            }
            const std::size_t i = attention_mass_profile::bin(static_cast<float>(p));
            ++out.count[i];
            out.mass[i] += p;
          }
          out.entries += keys;
        }
      }
      out.rows += block_tokens;
    }
  };
  detail::for_each_head(shape.heads_q, threads, run_head);
  for (index_t h = 0; h < shape.heads_q; ++h)
    if (not_finite[static_cast<std::size_t>(h)])
      throw invalid_argument("q, k", "head " + std::to_string(h), "must give finite scores (softmax_scale * q . k)");

  attention_mass_profile profile;
  for (const attention_mass_profile& head : per_head) {
    profile.rows += head.rows;
    profile.entries += head.entries;
    for (std::size_t b = 0; b < attention_mass_profile::bins; ++b) {
      profile.count[b] += head.count[b];
      profile.mass[b] += head.mass[b];
    }
  }
  return profile;
}

}  // namespace stria::host
