// SPDX-License-Identifier: Apache-2.0
// Merging partial softmax results: two attention results by their log-sum-exp (fp32 running state of
// a ring), and a row's normaliser from every rank's max and sum (the window statistics).
#pragma once

#include <cmath>
#include <cstdint>

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

/// A softmax row's normaliser: its max and its sum of exp(x - max).
struct row_normaliser {
  float max;
  float sum;
};

/// Row i's global normaliser from every rank's, `every_rank` [world, 2, count] (each rank's row
/// maxes, then its sums against them), in base 2 (Base2: scores in log2 units, as the kernels keep
/// them) or e: the max of the maxes, and each rank's sum rescaled to it in fp64, added in rank order
/// and rounded once. A rank whose max is -inf saw no key of the row and adds 0; a row no rank saw
/// stays (-inf, 0).
template <bool Base2>
STRIA_HOST_DEVICE row_normaliser combine_normaliser_row(const float* every_rank, std::int64_t world, std::int64_t count, std::int64_t i) {
  using std::exp;
  using std::exp2;
  const float neg_inf = -INFINITY;
  float top = neg_inf;
  for (std::int64_t r = 0; r < world; ++r)
    if (const float own = every_rank[2 * r * count + i]; own > top) top = own;
  double total = 0;
  for (std::int64_t r = 0; r < world; ++r)
    if (const float own = every_rank[2 * r * count + i]; own != neg_inf) {
      const double shift = double(own) - double(top);
      total += double(every_rank[(2 * r + 1) * count + i]) * (Base2 ? exp2(shift) : exp(shift));
    }
  return {top, float(total)};
}

}  // namespace stria
