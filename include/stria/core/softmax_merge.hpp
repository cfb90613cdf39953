// SPDX-License-Identifier: Apache-2.0
// Merging two partial softmax-attention results by their log-sum-exp (fp32 running state of a ring).
#pragma once

#include <cmath>

#include "stria/core/config.hpp"

namespace stria {

/// Weights that merge partial results a and b (each normalised by its own LSE) into one:
/// lse = log(exp(lse_a) + exp(lse_b)), out = weight_a * out_a + weight_b * out_b.
/// A partial with LSE = -inf saw no keys: it gets weight 0, and two empty partials stay empty
/// (lse = -inf, both weights 0) rather than producing NaN.
template <class Real>
struct lse_merge {
  Real lse;
  Real weight_a;
  Real weight_b;
};

template <class Real>
STRIA_HOST_DEVICE lse_merge<Real> merge_lse(Real lse_a, Real lse_b) {
  const Real neg_inf = -static_cast<Real>(INFINITY);  // numeric_limits is host-only under nvcc
  if (lse_a == neg_inf && lse_b == neg_inf) return {neg_inf, Real(0), Real(0)};
  using std::exp;
  using std::log;
  const Real hi = lse_a > lse_b ? lse_a : lse_b;
  const Real ea = exp(lse_a - hi);  // one of the two is exp(0) = 1, the other <= 1
  const Real eb = exp(lse_b - hi);
  const Real sum = ea + eb;
  return {hi + log(sum), ea / sum, eb / sum};
}

}  // namespace stria
