// SPDX-License-Identifier: Apache-2.0
// Checked mode (DESIGN 11: never a silent NaN): the engines may verify each step's results for NaN
// and infinity. This file holds what the host and device checks share: the rule for a value, where
// an element of a checked tensor lies (head, token), and the error naming rank, step, head and token.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"

namespace stria {

/// Whether a ring engine or solver executor checks its results after every step (a ring step, or a
/// solver stage; off by default: the check costs a pass over O, LSE (dQ, dK, dV in backward) and a
/// host synchronisation per step).
enum class finite_check { off, every_step };

/// What a checked value is, when it breaks its rule (the codes the device check reports, too).
enum class non_finite_kind : int { nan = 0, positive_infinity = 1, negative_infinity = 2 };

/// -1 if `x` obeys the rule (finite; or -inf where that is allowed), else its non_finite_kind.
/// An LSE of -inf is legal: it marks a row that no key has reached yet (O = 0 there).
STRIA_HOST_DEVICE constexpr int non_finite_code(float x, bool negative_infinity_allowed) {
  if (x != x) return static_cast<int>(non_finite_kind::nan);
  if (x > 3.4028234663852886e38f) return static_cast<int>(non_finite_kind::positive_infinity);
  if (x < -3.4028234663852886e38f) return negative_infinity_allowed ? -1 : static_cast<int>(non_finite_kind::negative_infinity);
  return -1;
}

/// A checked tensor: its name, its layout (how a flat index maps to head and token) and its rule.
struct checked_tensor {
  enum class layout { token_major, head_major };  // [tokens, heads, dim] (O, dQ, dK, dV) or [heads, tokens] (LSE)
  /// How an error names an element's position: in this rank's queries; in the ring's travelling KV
  /// chunk of `chunk_owner`; or in a solver chunk, by `chunk_owner`'s local token (a solver chunk is
  /// part of a rank's shard, starting at `first_token`).
  enum class frame { own_queries, ring_kv_chunk, solver_chunk };
  const char* name;
  layout order;
  index_t tokens, heads, dim;
  bool negative_infinity_allowed = false;
  index_t chunk_owner = -1;  // whose chunk the values belong to (-1: this rank's queries)
  frame naming = frame::own_queries;
  bool kv_heads = false;    // the heads are KV heads (dK, dV)
  index_t first_token = 0;  // solver_chunk: where token 0 lies in the owner's local tokens

  static checked_tensor queries(const char* name, index_t tokens, index_t heads, index_t dim) {
    return {name, layout::token_major, tokens, heads, dim};
  }
  static checked_tensor lse(index_t heads, index_t tokens) { return {"LSE", layout::head_major, tokens, heads, 1, true}; }
  static checked_tensor kv_gradient(const char* name, index_t tokens, index_t heads, index_t dim, index_t owner) {
    return {name, layout::token_major, tokens, heads, dim, false, owner, frame::ring_kv_chunk, true};
  }
  /// `t` (queries, lse or kv_gradient) as a solver chunk of rank `owner`, starting at its local token
  /// `first_token` (a rank's whole shard: first_token 0).
  static checked_tensor solver_chunk(checked_tensor t, index_t owner, index_t first_token) {
    t.chunk_owner = owner;
    t.naming = frame::solver_chunk;
    t.first_token = first_token;
    return t;
  }
  [[nodiscard]] std::int64_t size() const { return std::int64_t{tokens} * heads * dim; }
};

/// The first element that breaks its rule, as a check reports it: flat index and kind.
struct non_finite_value {
  std::int64_t index;
  non_finite_kind kind;
};

inline const char* kind_text(non_finite_kind kind) {
  return kind == non_finite_kind::nan ? "NaN" : kind == non_finite_kind::positive_infinity ? "+inf" : "-inf";
}

/// The error for `value` in tensor `t` on `rank` after `step` (`phase` names the step: "ring step 2",
/// "solver stage 1"). A solver chunk's position is its owner's local token, and the owner is named
/// when it is another rank.
inline non_finite_error non_finite_found(index_t rank, index_t step, const std::string& phase, const checked_tensor& t,
                                         non_finite_value value) {
  const auto row = t.order == checked_tensor::layout::token_major ? value.index / t.dim : value.index;
  const auto head = static_cast<index_t>(t.order == checked_tensor::layout::token_major ? row % t.heads : row / t.tokens);
  const auto token = t.first_token + static_cast<index_t>(t.order == checked_tensor::layout::token_major ? row / t.heads : row % t.tokens);
  const std::string head_text = (t.kv_heads ? "KV head " : "head ") + std::to_string(head);
  std::string where;
  if (t.naming == checked_tensor::frame::ring_kv_chunk)
    where = head_text + ", token " + std::to_string(token) + " of rank " + std::to_string(t.chunk_owner) + "'s KV chunk";
  else if (t.naming == checked_tensor::frame::solver_chunk && t.chunk_owner != rank)
    where = head_text + ", local token " + std::to_string(token) + " of rank " + std::to_string(t.chunk_owner);
  else
    where = head_text + ", local token " + std::to_string(token);
  const index_t owner = t.chunk_owner == rank && t.naming == checked_tensor::frame::solver_chunk ? -1 : t.chunk_owner;
  return non_finite_error("stria: checked mode: rank " + std::to_string(rank) + ", " + phase + ", " + where + ": " + t.name + " is " +
                              kind_text(value.kind) + " (the first non-finite value of this step's result)",
                          rank, step, t.name, head, token, owner);
}

/// The lowest-indexed element of x that breaks the rule, if any (the host check).
template <class T>
std::optional<non_finite_value> first_non_finite(std::span<const T> x, bool negative_infinity_allowed) {
  for (std::size_t i = 0; i < x.size(); ++i)
    if (const int code = non_finite_code(static_cast<float>(x[i]), negative_infinity_allowed); code >= 0)
      return non_finite_value{static_cast<std::int64_t>(i), static_cast<non_finite_kind>(code)};
  return std::nullopt;
}

/// Host checked mode: throws non_finite_error for the first element of x ([t.size()] as t lays it
/// out) that breaks t's rule.
template <class T>
void check_finite(std::span<const T> x, const checked_tensor& t, index_t rank, index_t step, const std::string& phase) {
  if (const auto bad = first_non_finite(x, t.negative_infinity_allowed)) throw non_finite_found(rank, step, phase, t, *bad);
}

}  // namespace stria
