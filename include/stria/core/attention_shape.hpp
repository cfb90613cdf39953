// SPDX-License-Identifier: Apache-2.0
// attention_shape: the sizes of one attention call, checked once with messages that name the tensor.
#pragma once

#include <cmath>
#include <string>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"

namespace stria {

struct attention_shape {
  index_t query_tokens = 0;  // local query tokens (rows of q)
  index_t kv_tokens = 0;     // tokens of the KV chunk (rows of k and v)
  index_t heads_q = 0;
  index_t heads_kv = 0;
  index_t head_dim = 0;

  [[nodiscard]] constexpr index_t group_size() const { return heads_q / heads_kv; }  // query heads per KV head
  [[nodiscard]] constexpr index_t kv_head(index_t query_head) const { return query_head / group_size(); }

  /// Throws stria::invalid_argument for a shape no stria kernel accepts.
  void validate() const {
    if (query_tokens <= 0 || query_tokens % block_tokens != 0)
      throw invalid_argument("q.extent(0) (query tokens)", query_tokens, "must be a positive multiple of 64 (the block size)");
    if (kv_tokens <= 0 || kv_tokens % block_tokens != 0)
      throw invalid_argument("k.extent(0) (KV tokens)", kv_tokens, "must be a positive multiple of 64 (the block size)");
    if (heads_q <= 0) throw invalid_argument("q.extent(1) (query heads)", heads_q, "must be positive");
    if (heads_kv <= 0) throw invalid_argument("k.extent(1) (KV heads)", heads_kv, "must be positive");
    if (heads_q % heads_kv != 0)
      throw invalid_argument("q.extent(1) (query heads)", heads_q,
                             "must be a multiple of the KV heads " + std::to_string(heads_kv) + " (Hq % Hkv == 0 for GQA)");
    if (head_dim != 64 && head_dim != 128)
      throw invalid_argument("q.extent(2) (head_dim)", head_dim, "unsupported head dim: stria supports 64 and 128");
  }
};

/// Throws unless the softmax scale is a positive, finite number (every backend checks it the same way).
inline void check_softmax_scale(double softmax_scale) {
  if (!(softmax_scale > 0.0) || !std::isfinite(softmax_scale))
    throw invalid_argument("softmax_scale", softmax_scale, "must be positive and finite");
}

/// Throws unless `view` has exactly the extents `expected` (names the tensor and the dimension).
template <class View, std::size_t Rank>
void check_extents(const View& view, const index_t (&expected)[Rank], const char* name) {
  static_assert(View::rank == Rank);
  if (view.data() == nullptr) throw invalid_argument(std::string(name) + ".data()", "nullptr", "must point to memory");
  for (std::size_t d = 0; d < Rank; ++d)
    if (view.extent(d) != expected[d])
      throw invalid_argument(std::string(name) + ".extent(" + std::to_string(d) + ")", view.extent(d),
                             "must be " + std::to_string(expected[d]) + " to match the other tensors");
}

/// The shape of a call from q [Sq, Hq, D] and k, v [Sk, Hkv, D], validated, with every extent (and
/// pointer) of the three checked against it.
template <class Q, class KV>
attention_shape checked_attention_shape(const Q& q, const KV& k, const KV& v) {
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  check_extents(q, {shape.query_tokens, shape.heads_q, shape.head_dim}, "q");
  check_extents(k, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "k");
  check_extents(v, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "v");
  return shape;
}

/// The extents every backward call checks: out, d_out, dq like q; lse [Hq, Sq]; dk, dv like k.
template <class Out, class Lse, class Grad, class GradKV>
void check_backward_tensors(const attention_shape& shape, const Out& out, const Out& d_out, const Lse& lse, const Grad& dq, const GradKV& dk,
                            const GradKV& dv) {
  check_extents(out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "out");
  check_extents(d_out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "d_out");
  check_extents(lse, {shape.heads_q, shape.query_tokens}, "lse");
  check_extents(dq, {shape.query_tokens, shape.heads_q, shape.head_dim}, "dq");
  check_extents(dk, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "dk");
  check_extents(dv, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "dv");
}

}  // namespace stria
