// SPDX-License-Identifier: Apache-2.0
// Test oracles: naive masked softmax attention in double over explicit (query, key) masks, and
// random sparse step indices described as plain per-row sets (independent of the CSR code).
#pragma once

#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/index/step_index.hpp"
#include "support/random.hpp"

namespace stria::test {

/// Whether (query head, local query token, local key token) is an active entry.
using entry_mask = std::function<bool(index_t, index_t, index_t)>;

struct naive_result {
  std::vector<double> out;  // [Sq, Hq, D]
  std::vector<double> lse;  // [Hq, Sq]
};

/// Softmax attention over exactly the entries `mask` allows, in double, written the obvious way.
template <class T>
naive_result naive_attention(const attention_shape& shape, const std::vector<T>& q, const std::vector<T>& k,
                             const std::vector<T>& v, double scale, const entry_mask& mask) {
  const index_t sq = shape.query_tokens, sk = shape.kv_tokens, hq = shape.heads_q, hkv = shape.heads_kv,
                dim = shape.head_dim;
  naive_result r{std::vector<double>(static_cast<std::size_t>(sq) * hq * dim, 0.0),
                 std::vector<double>(static_cast<std::size_t>(hq) * sq, -std::numeric_limits<double>::infinity())};
  auto at_q = [&](index_t t, index_t h, index_t d) { return double(q[(static_cast<std::size_t>(t) * hq + h) * dim + d]); };
  auto at_kv = [&](const std::vector<T>& x, index_t t, index_t h, index_t d) {
    return double(x[(static_cast<std::size_t>(t) * hkv + h) * dim + d]);
  };
  std::vector<double> s(static_cast<std::size_t>(sk));
  for (index_t h = 0; h < hq; ++h) {
    const index_t hk = h / (hq / hkv);
    for (index_t i = 0; i < sq; ++i) {
      double m = -std::numeric_limits<double>::infinity();
      for (index_t j = 0; j < sk; ++j) {
        if (!mask(h, i, j)) continue;
        double dot = 0;
        for (index_t d = 0; d < dim; ++d) dot += at_q(i, h, d) * at_kv(k, j, hk, d);
        s[static_cast<std::size_t>(j)] = dot * scale;
        m = std::max(m, s[static_cast<std::size_t>(j)]);
      }
      if (m == -std::numeric_limits<double>::infinity()) continue;  // empty row: out 0, lse -inf
      double l = 0;
      for (index_t j = 0; j < sk; ++j) {
        if (!mask(h, i, j)) continue;
        const double p = std::exp(s[static_cast<std::size_t>(j)] - m);
        l += p;
        for (index_t d = 0; d < dim; ++d)
          r.out[(static_cast<std::size_t>(i) * hq + h) * dim + d] += p * at_kv(v, j, hk, d);
      }
      for (index_t d = 0; d < dim; ++d) r.out[(static_cast<std::size_t>(i) * hq + h) * dim + d] /= l;
      r.lse[static_cast<std::size_t>(h) * sq + i] = m + std::log(l);
    }
  }
  return r;
}

struct naive_gradients {
  std::vector<double> dq;  // [Sq, Hq, D]
  std::vector<double> dk;  // [Sk, Hkv, D]
  std::vector<double> dv;  // [Sk, Hkv, D]
};

/// Gradients of sum(out * d_out) by the textbook matrix formulas over the masked entries:
/// P = softmax(scale * Q K^T), dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(dO o O)),
/// dQ = scale * dS K, dK = scale * dS^T Q (GQA: summed over the query heads of a KV head).
template <class T>
naive_gradients naive_attention_backward(const attention_shape& shape, const std::vector<T>& q, const std::vector<T>& k,
                                         const std::vector<T>& v, const std::vector<T>& d_out, double scale,
                                         const entry_mask& mask) {
  const index_t sq = shape.query_tokens, sk = shape.kv_tokens, hq = shape.heads_q, hkv = shape.heads_kv,
                dim = shape.head_dim;
  const naive_result fwd = naive_attention(shape, q, k, v, scale, mask);
  naive_gradients g{std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0), std::vector<double>(v.size(), 0.0)};
  auto qi = [&](index_t t, index_t h, index_t d) { return (static_cast<std::size_t>(t) * hq + h) * dim + d; };
  auto ki = [&](index_t t, index_t h, index_t d) { return (static_cast<std::size_t>(t) * hkv + h) * dim + d; };
  for (index_t h = 0; h < hq; ++h) {
    const index_t hk = h / (hq / hkv);
    for (index_t i = 0; i < sq; ++i) {
      const double lse = fwd.lse[static_cast<std::size_t>(h) * sq + i];
      if (lse == -std::numeric_limits<double>::infinity()) continue;
      double rowsum = 0;
      for (index_t d = 0; d < dim; ++d) rowsum += double(d_out[qi(i, h, d)]) * fwd.out[qi(i, h, d)];
      for (index_t j = 0; j < sk; ++j) {
        if (!mask(h, i, j)) continue;
        double s = 0, dp = 0;
        for (index_t d = 0; d < dim; ++d) {
          s += double(q[qi(i, h, d)]) * double(k[ki(j, hk, d)]);
          dp += double(d_out[qi(i, h, d)]) * double(v[ki(j, hk, d)]);
        }
        const double p = std::exp(s * scale - lse);
        const double ds = p * (dp - rowsum);
        for (index_t d = 0; d < dim; ++d) {
          g.dv[ki(j, hk, d)] += p * double(d_out[qi(i, h, d)]);
          g.dq[qi(i, h, d)] += scale * ds * double(k[ki(j, hk, d)]);
          g.dk[ki(j, hk, d)] += scale * ds * double(q[qi(i, h, d)]);
        }
      }
    }
  }
  return g;
}

/// A sparse pattern as plain sets: per row (head * nq + query block) the active local KV blocks
/// and the vertical local KV tokens, plus the global block of every local block.
struct row_sets {
  step_index_shape shape;
  std::vector<index_t> query_global_block;
  std::vector<index_t> kv_global_block;
  std::vector<std::set<index_t>> blocks;
  std::vector<std::set<index_t>> tokens;

  /// The entry semantics, spelled out at token level: a listed tile's entries (causal by global
  /// token position), and a listed vertical token for every query of its row.
  [[nodiscard]] entry_mask mask() const {
    return [this](index_t h, index_t i, index_t j) {
      const auto r = static_cast<std::size_t>(h * shape.num_query_blocks + i / block_tokens);
      const index_t q_global_token = query_global_block[static_cast<std::size_t>(i / block_tokens)] * block_tokens + i % block_tokens;
      const index_t k_global_token = kv_global_block[static_cast<std::size_t>(j / block_tokens)] * block_tokens + j % block_tokens;
      if (blocks[r].count(j / block_tokens)) return !shape.causal || k_global_token <= q_global_token;
      return tokens[r].count(j) > 0;
    };
  }

  [[nodiscard]] step_index build() const {
    std::vector<std::vector<index_t>> b, t;
    for (const auto& s : blocks) b.emplace_back(s.begin(), s.end());
    for (const auto& s : tokens) t.emplace_back(s.begin(), s.end());
    return build_step_index(shape, {}, query_global_block, kv_global_block, std::move(b), std::move(t));
  }
};

/// Random valid pattern: each causally valid tile active with probability `block_density`, and
/// each causally valid token outside the row's tiles a vertical token with probability `token_density`.
inline row_sets random_row_sets(seeded_rng& rng, const step_index_shape& shape, std::vector<index_t> query_global_block,
                                std::vector<index_t> kv_global_block, double block_density, double token_density) {
  row_sets s{shape, std::move(query_global_block), std::move(kv_global_block), {}, {}};
  s.blocks.resize(static_cast<std::size_t>(shape.num_rows()));
  s.tokens.resize(static_cast<std::size_t>(shape.num_rows()));
  for (index_t h = 0; h < shape.num_heads; ++h)
    for (index_t qb = 0; qb < shape.num_query_blocks; ++qb) {
      const auto r = static_cast<std::size_t>(h * shape.num_query_blocks + qb);
      const index_t q_global = s.query_global_block[static_cast<std::size_t>(qb)];
      for (index_t kb = 0; kb < shape.num_kv_blocks; ++kb) {
        const index_t k_global = s.kv_global_block[static_cast<std::size_t>(kb)];
        if (shape.causal && k_global > q_global) continue;
        if (rng.chance(block_density)) {
          s.blocks[r].insert(kb);
          continue;
        }
        if (shape.causal && k_global == q_global) continue;  // a vertical token must precede the whole query block
        for (index_t t = 0; t < block_tokens; ++t)
          if (rng.chance(token_density)) s.tokens[r].insert(kb * block_tokens + t);
      }
    }
  return s;
}

/// ||a - b|| / ||b|| over all elements (2-norm). Identical infinities (the -inf LSE of empty rows)
/// match exactly and are left out; any other infinity or NaN makes the error infinite or NaN.
template <class A, class B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(double(b[i])) && double(a[i]) == double(b[i])) continue;
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

template <class T>
tensor_view<const T, 3> view3(const std::vector<T>& x, index_t a, index_t b, index_t c) {
  return tensor_view<const T, 3>(x.data(), {a, b, c});
}
template <class T>
tensor_view<T, 3> view3(std::vector<T>& x, index_t a, index_t b, index_t c) {
  return tensor_view<T, 3>(x.data(), {a, b, c});
}
template <class T>
tensor_view<const T, 2> view2(const std::vector<T>& x, index_t a, index_t b) {
  return tensor_view<const T, 2>(x.data(), {a, b});
}
template <class T>
tensor_view<T, 2> view2(std::vector<T>& x, index_t a, index_t b) {
  return tensor_view<T, 2>(x.data(), {a, b});
}

}  // namespace stria::test
