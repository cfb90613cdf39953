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
    // Keys transposed, [D, S], so the score loop runs over contiguous keys (vectorisable).
    std::vector<float> kt(static_cast<std::size_t>(dim) * s);
    for (index_t m = 0; m < s; ++m)
      for (index_t d = 0; d < dim; ++d) kt[static_cast<std::size_t>(d) * s + m] = float(k(m, hk, d));
    std::vector<unsigned char> on_slash(static_cast<std::size_t>(2 * nb - 1), 0), vertical(static_cast<std::size_t>(s), 0);
    for (const index_t delta : sel.slash_deltas) on_slash[static_cast<std::size_t>(delta + nb - 1)] = 1;
    for (const index_t t : sel.vertical_tokens) vertical[static_cast<std::size_t>(t)] = 1;
    constexpr float log2e = 1.4426950408889634f;
    std::vector<float> qs(static_cast<std::size_t>(block_tokens) * dim), score(static_cast<std::size_t>(block_tokens) * block_tokens);
    std::vector<float> keep(static_cast<std::size_t>(block_tokens)), exps(static_cast<std::size_t>(block_tokens));
    // valid[count * 64 + b]: 1 for the first `count` keys of a tile, else 0 (row `count` is unused padding).
    std::vector<float> valid(static_cast<std::size_t>(block_tokens + 1) * block_tokens);
    for (index_t c = 0; c <= block_tokens; ++c)
      for (index_t b = 0; b < block_tokens; ++b) valid[static_cast<std::size_t>(c * block_tokens + b)] = b < c ? 1.0f : 0.0f;
    head_result& out = results[static_cast<std::size_t>(h)];
    for (index_t qb = (nb - 1) % query_block_stride; qb < nb; qb += query_block_stride) {
      // Queries pre-scaled by scale * log2(e): scores come out in the exp2 domain.
      for (index_t a = 0; a < block_tokens; ++a)
        for (index_t d = 0; d < dim; ++d)
          qs[static_cast<std::size_t>(a) * dim + d] = float(q(qb * block_tokens + a, h, d)) * float(softmax_scale) * log2e;
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

}  // namespace stria::host
