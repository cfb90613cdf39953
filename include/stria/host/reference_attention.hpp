// SPDX-License-Identifier: Apache-2.0
// Host reference attention on a step index: forward (O, LSE), backward (dQ, dK, dV), and the LSE
// merge of partial results. The oracle every kernel and the host ring backend are tested against;
// the fp32 row conversions the host ring and solver share.
#pragma once

#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/softmax_merge.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/index/step_index.hpp"

namespace stria::host {

namespace detail {

/// The keys one query row attends to under `index`: the active tiles' tokens (causally masked on
/// tiles that cross the diagonal) followed by the row's vertical tokens. Local KV token numbers.
inline void row_keys(const step_index_view& index, index_t head, index_t local_query_block, index_t row_in_block,
                     std::vector<index_t>& keys) {
  keys.clear();
  const index_t r = index.row(head, local_query_block);
  for (index_t e = index.block_ptr[r]; e < index.block_ptr[r + 1]; ++e) {
    const index_t kv_block = index.block_col[e];
    const index_t last = index.needs_causal_mask(local_query_block, kv_block) ? row_in_block : block_tokens - 1;
    for (index_t b = 0; b <= last; ++b) keys.push_back(kv_block * block_tokens + b);
  }
  for (index_t e = index.col_ptr[r]; e < index.col_ptr[r + 1]; ++e) keys.push_back(index.col_token[e]);
}

template <class T>
attention_shape check_inputs(tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v, const step_index_view& index) {
  const attention_shape shape = checked_attention_shape(q, k, v);
  check_index_shape(index.shape, {shape.heads_q, shape.query_tokens / block_tokens, shape.kv_tokens / block_tokens, index.shape.causal});
  return shape;
}

/// Tokens [first, first + tokens) of each of `xs` in turn as fp32 rows [tokens, heads, D]; tokens < 0:
/// from `first` to each view's end.
template <class T>
std::vector<float> rows_to_float(std::initializer_list<tensor_view<const T, 3>> xs, index_t first = 0, index_t tokens = -1) {
  auto end = [&](const tensor_view<const T, 3>& x) { return tokens < 0 ? x.extent(0) : first + tokens; };
  std::vector<float> y;
  std::size_t size = 0;
  for (const tensor_view<const T, 3>& x : xs) size += static_cast<std::size_t>(end(x) - first) * x.extent(1) * x.extent(2);
  y.reserve(size);
  for (const tensor_view<const T, 3>& x : xs)
    for (index_t t = first; t < end(x); ++t)
      for (index_t h = 0; h < x.extent(1); ++h)
        for (index_t d = 0; d < x.extent(2); ++d) y.push_back(float(x(t, h, d)));
  return y;
}

/// Tokens [first, first + tokens) of y = the fp32 rows x, rounded to T; tokens < 0: from `first` to
/// y's end.
template <class T>
void rows_from_float(const float* x, tensor_view<T, 3> y, index_t first = 0, index_t tokens = -1) {
  std::size_t i = 0;
  for (index_t t = first; t < (tokens < 0 ? y.extent(0) : first + tokens); ++t)
    for (index_t h = 0; h < y.extent(1); ++h)
      for (index_t d = 0; d < y.extent(2); ++d) y(t, h, d) = T(x[i++]);
}

}  // namespace detail

/// Forward attention of local queries against one KV chunk, on the entries `index` selects.
///   q   [Sq, Hq, D]   k, v [Sk, Hkv, D]   out [Sq, Hq, D]   lse [Hq, Sq]  (natural log, scaled scores)
/// Scores, softmax and the weighted sum accumulate in `Accum`. A row with no keys gets out = 0 and
/// lse = -inf. `index.shape.causal` selects causal or full attention.
template <class Accum = double, class T, class Out, class Lse>
void reference_forward(tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
                       const step_index_view& index, double softmax_scale, tensor_view<Out, 3> out,
                       tensor_view<Lse, 2> lse) {
  const attention_shape shape = detail::check_inputs(q, k, v, index);
  check_softmax_scale(softmax_scale);
  check_extents(out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "out");
  check_extents(lse, {shape.heads_q, shape.query_tokens}, "lse");

  const index_t dim = shape.head_dim;
  std::vector<index_t> keys;
  std::vector<Accum> scores;
  std::vector<Accum> acc(static_cast<std::size_t>(dim));
  for (index_t h = 0; h < shape.heads_q; ++h) {
    const index_t hk = shape.kv_head(h);
    for (index_t qb = 0; qb < index.shape.num_query_blocks; ++qb) {
      for (index_t a = 0; a < block_tokens; ++a) {
        const index_t tok = qb * block_tokens + a;
        detail::row_keys(index, h, qb, a, keys);
        scores.assign(keys.size(), Accum(0));
        Accum row_max = -std::numeric_limits<Accum>::infinity();
        for (std::size_t j = 0; j < keys.size(); ++j) {
          Accum dot = 0;
          for (index_t d = 0; d < dim; ++d) dot += Accum(q(tok, h, d)) * Accum(k(keys[j], hk, d));
          scores[j] = dot * Accum(softmax_scale);
          row_max = std::max(row_max, scores[j]);
        }
        std::fill(acc.begin(), acc.end(), Accum(0));
        Accum sum = 0;
        for (std::size_t j = 0; j < keys.size(); ++j) {
          const Accum p = std::exp(scores[j] - row_max);
          sum += p;
          for (index_t d = 0; d < dim; ++d) acc[static_cast<std::size_t>(d)] += p * Accum(v(keys[j], hk, d));
        }
        if (keys.empty()) {
          for (index_t d = 0; d < dim; ++d) out(tok, h, d) = Out(0);
          lse(h, tok) = -std::numeric_limits<Lse>::infinity();
          continue;
        }
        for (index_t d = 0; d < dim; ++d) out(tok, h, d) = Out(acc[static_cast<std::size_t>(d)] / sum);
        lse(h, tok) = Lse(row_max + std::log(sum));
      }
    }
  }
}

/// Backward of `reference_forward` for one KV chunk: ADDS this chunk's contribution to dq, dk, dv
/// (zero them before the first chunk). `out` and `lse` are the final forward results over all
/// chunks, as in FlashAttention's backward: P = exp(scale * q.k - lse), dS = P * (dO.v - dO.out).
///   d_out, out, dq [Sq, Hq, D]   lse [Hq, Sq]   dk, dv [Sk, Hkv, D]
template <class Accum = double, class T, class Lse, class Grad>
void reference_backward(tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
                        tensor_view<const T, 3> out, tensor_view<const T, 3> d_out, tensor_view<const Lse, 2> lse,
                        const step_index_view& index, double softmax_scale, tensor_view<Grad, 3> dq,
                        tensor_view<Grad, 3> dk, tensor_view<Grad, 3> dv) {
  const attention_shape shape = detail::check_inputs(q, k, v, index);
  check_softmax_scale(softmax_scale);
  check_backward_tensors(shape, out, d_out, lse, dq, dk, dv);

  const index_t dim = shape.head_dim;
  const Accum scale = Accum(softmax_scale);
  std::vector<index_t> keys;
  std::vector<Accum> dq_row(static_cast<std::size_t>(dim));
  for (index_t h = 0; h < shape.heads_q; ++h) {
    const index_t hk = shape.kv_head(h);
    for (index_t qb = 0; qb < index.shape.num_query_blocks; ++qb) {
      for (index_t a = 0; a < block_tokens; ++a) {
        const index_t tok = qb * block_tokens + a;
        const Accum row_lse = Accum(lse(h, tok));
        if (row_lse == -std::numeric_limits<Accum>::infinity()) continue;  // the row saw no keys anywhere
        detail::row_keys(index, h, qb, a, keys);
        Accum delta = 0;  // rowsum(dO * O)
        for (index_t d = 0; d < dim; ++d) delta += Accum(d_out(tok, h, d)) * Accum(out(tok, h, d));
        std::fill(dq_row.begin(), dq_row.end(), Accum(0));
        for (const index_t key : keys) {
          Accum dot = 0;
          Accum dp = 0;
          for (index_t d = 0; d < dim; ++d) {
            dot += Accum(q(tok, h, d)) * Accum(k(key, hk, d));
            dp += Accum(d_out(tok, h, d)) * Accum(v(key, hk, d));
          }
          const Accum p = std::exp(dot * scale - row_lse);
          const Accum ds = p * (dp - delta);
          for (index_t d = 0; d < dim; ++d) {
            dv(key, hk, d) += Grad(p * Accum(d_out(tok, h, d)));
            dk(key, hk, d) += Grad(scale * ds * Accum(q(tok, h, d)));
            dq_row[static_cast<std::size_t>(d)] += scale * ds * Accum(k(key, hk, d));
          }
        }
        for (index_t d = 0; d < dim; ++d) dq(tok, h, d) += Grad(dq_row[static_cast<std::size_t>(d)]);
      }
    }
  }
}

/// Merges a partial result into a running one (the fp32 running state of a ring):
///   out, part_out [S, H, D]   lse, part_lse [H, S]
/// Rows where both are empty (lse = -inf) stay out = 0, lse = -inf.
template <class Real>
void merge_partial(tensor_view<Real, 3> out, tensor_view<Real, 2> lse, tensor_view<const Real, 3> part_out,
                   tensor_view<const Real, 2> part_lse) {
  const index_t tokens = out.extent(0);
  const index_t heads = out.extent(1);
  const index_t dim = out.extent(2);
  check_extents(lse, {heads, tokens}, "lse");
  check_extents(part_out, {tokens, heads, dim}, "part_out");
  check_extents(part_lse, {heads, tokens}, "part_lse");
  for (index_t h = 0; h < heads; ++h)
    for (index_t t = 0; t < tokens; ++t) {
      const lse_merge<Real> m = merge_lse(lse(h, t), part_lse(h, t));
      // A zero weight drops its side entirely, so an empty partial cannot inject 0 * inf = NaN.
      for (index_t d = 0; d < dim; ++d) {
        const Real a = m.weight_a == Real(0) ? Real(0) : m.weight_a * out(t, h, d);
        const Real b = m.weight_b == Real(0) ? Real(0) : m.weight_b * part_out(t, h, d);
        out(t, h, d) = a + b;
      }
      lse(h, t) = m.lse;
    }
}

}  // namespace stria::host
