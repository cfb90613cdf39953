// SPDX-License-Identifier: Apache-2.0
// The whole sequence's attention on one rank, in double, on a global selection: what every
// distributed host execution (the ring, the solver's plan) is compared with.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "stria/host/reference_attention.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/index/local_index.hpp"
#include "stria/sharding/sequential.hpp"
#include "support/oracle.hpp"
#include "support/random.hpp"

namespace stria::test {

/// Random fp32 inputs of a whole sequence (no exact zeros) and the reference in double on `selection`.
struct whole_problem {
  index_t seq = 0, hq = 0, hkv = 0, dim = 0;
  double scale = 0;
  std::vector<float> q, k, v, d_out;           // [S, Hq, D], [S, Hkv, D] x 2, [S, Hq, D]
  std::vector<double> out, lse, dq, dk, dv;    // the reference

  whole_problem(seeded_rng& rng, const global_selection& selection, index_t heads_kv, index_t head_dim)
      : seq(selection.seq_len), hq(selection.num_heads()), hkv(heads_kv), dim(head_dim), scale(1.0 / std::sqrt(double(head_dim))) {
    q = rng.values<float>(static_cast<std::size_t>(seq) * hq * dim);
    k = rng.values<float>(static_cast<std::size_t>(seq) * hkv * dim);
    v = rng.values<float>(k.size());
    d_out = rng.values<float>(q.size());
    const step_index whole = build_local_index(selection, sharding::sequential{}, 1, 0, 0);
    const std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end()), d_out64(d_out.begin(), d_out.end());
    out.assign(q.size(), 0.0);
    lse.assign(static_cast<std::size_t>(hq) * seq, 0.0);
    dq.assign(q.size(), 0.0);
    dk.assign(k.size(), 0.0);
    dv.assign(k.size(), 0.0);
    host::reference_forward<double>(view3(q64, seq, hq, dim), view3(k64, seq, hkv, dim), view3(v64, seq, hkv, dim), whole.view(), scale,
                                    view3(out, seq, hq, dim), view2(lse, hq, seq));
    host::reference_backward<double>(view3(q64, seq, hq, dim), view3(k64, seq, hkv, dim), view3(v64, seq, hkv, dim),
                                     view3(std::as_const(out), seq, hq, dim), view3(d_out64, seq, hq, dim), view2(std::as_const(lse), hq, seq),
                                     whole.view(), scale, view3(dq, seq, hq, dim), view3(dk, seq, hkv, dim), view3(dv, seq, hkv, dim));
  }
};

/// Relative errors of a joined distributed result against the reference.
struct attention_errors {
  double out, lse, dq, dk, dv;
  [[nodiscard]] double max() const { return std::max({out, lse, dq, dk, dv}); }
};

inline attention_errors errors_against(const whole_problem& p, const std::vector<float>& out, const std::vector<float>& lse,
                                       const std::vector<float>& dq, const std::vector<float>& dk, const std::vector<float>& dv) {
  return {relative_error(out, p.out), relative_error(lse, p.lse), relative_error(dq, p.dq), relative_error(dk, p.dk), relative_error(dv, p.dv)};
}

/// Every error below `tolerance` (each reported with a failure).
inline void check_errors(const attention_errors& e, double tolerance) {
  CAPTURE(e.out);
  CAPTURE(e.lse);
  CAPTURE(e.dq);
  CAPTURE(e.dk);
  CAPTURE(e.dv);
  CHECK(e.max() < tolerance);
}

}  // namespace stria::test
