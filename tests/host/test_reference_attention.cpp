// SPDX-License-Identifier: Apache-2.0
// Host reference attention: equals naive softmax attention (dense and sparse), its gradients equal
// finite differences, empty rows stay finite, and LSE merges are order independent.
#include <doctest/doctest.h>

#include <utility>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "stria/host/reference_attention.hpp"
#include "support/oracle.hpp"

using namespace stria;
using test::view2;
using test::view3;

namespace {

template <class T>
struct problem {
  attention_shape shape;
  std::vector<T> q, k, v, d_out;

  problem(test::seeded_rng& rng, attention_shape s) : shape(s) {
    const auto nq = static_cast<std::size_t>(s.query_tokens) * s.heads_q * s.head_dim;
    const auto nk = static_cast<std::size_t>(s.kv_tokens) * s.heads_kv * s.head_dim;
    q = rng.values<T>(nq);
    k = rng.values<T>(nk);
    v = rng.values<T>(nk);
    d_out = rng.values<T>(nq);
  }
  [[nodiscard]] double scale() const { return 1.0 / std::sqrt(double(shape.head_dim)); }
};

template <class Accum, class T>
test::naive_result run_forward(const problem<T>& p, const step_index& index) {
  const attention_shape& s = p.shape;
  test::naive_result r{std::vector<double>(p.q.size(), std::nan("")), std::vector<double>(static_cast<std::size_t>(s.heads_q) * s.query_tokens, std::nan(""))};
  host::reference_forward<Accum>(view3(p.q, s.query_tokens, s.heads_q, s.head_dim), view3(p.k, s.kv_tokens, s.heads_kv, s.head_dim),
                                 view3(p.v, s.kv_tokens, s.heads_kv, s.head_dim), index.view(), p.scale(),
                                 view3(r.out, s.query_tokens, s.heads_q, s.head_dim), view2(r.lse, s.heads_q, s.query_tokens));
  return r;
}

/// Reference backward of one chunk; `out`/`lse` from a forward over the same index.
template <class Accum, class T>
test::naive_gradients run_backward(const problem<T>& p, const step_index& index, const std::vector<T>& out,
                                   const std::vector<T>& lse) {
  const attention_shape& s = p.shape;
  test::naive_gradients g{std::vector<double>(p.q.size(), 0.0), std::vector<double>(p.k.size(), 0.0), std::vector<double>(p.v.size(), 0.0)};
  host::reference_backward<Accum>(view3(p.q, s.query_tokens, s.heads_q, s.head_dim), view3(p.k, s.kv_tokens, s.heads_kv, s.head_dim),
                                  view3(p.v, s.kv_tokens, s.heads_kv, s.head_dim), view3(out, s.query_tokens, s.heads_q, s.head_dim),
                                  view3(p.d_out, s.query_tokens, s.heads_q, s.head_dim), view2(lse, s.heads_q, s.query_tokens),
                                  index.view(), p.scale(), view3(g.dq, s.query_tokens, s.heads_q, s.head_dim),
                                  view3(g.dk, s.kv_tokens, s.heads_kv, s.head_dim), view3(g.dv, s.kv_tokens, s.heads_kv, s.head_dim));
  return g;
}

template <class To, class From>
std::vector<To> cast(const std::vector<From>& x) {
  return std::vector<To>(x.begin(), x.end());
}

std::vector<index_t> iota_blocks(index_t n, index_t stride = 1, index_t offset = 0) {
  std::vector<index_t> b(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) b[static_cast<std::size_t>(i)] = i * stride + offset;
  return b;
}

/// Every causally valid tile of a single-rank sequence (plain dense attention as a step index).
test::row_sets dense_sets(index_t heads, index_t blocks, bool causal) {
  test::row_sets s{{heads, blocks, blocks, causal}, iota_blocks(blocks), iota_blocks(blocks), {}, {}};
  s.blocks.resize(static_cast<std::size_t>(heads * blocks));
  s.tokens.resize(static_cast<std::size_t>(heads * blocks));
  for (index_t h = 0; h < heads; ++h)
    for (index_t q = 0; q < blocks; ++q)
      for (index_t k = 0; k < blocks; ++k)
        if (!causal || k <= q) s.blocks[static_cast<std::size_t>(h * blocks + q)].insert(k);
  return s;
}

bool all_finite(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double v) { return std::isfinite(v); });
}

}  // namespace

TEST_CASE("with a dense index the reference equals plain softmax attention (double), causal and full") {
  STRIA_SEEDED_RNG(rng);
  for (const index_t dim : {64, 128})
    for (const index_t group : {1, 2, 8})
      for (const bool causal : {true, false}) {
        CAPTURE(dim);
        CAPTURE(group);
        CAPTURE(causal);
        const index_t blocks = 3;
        const problem<float> p(rng, {blocks * 64, blocks * 64, 8, 8 / group, dim});
        const step_index index = dense_sets(8, blocks, causal).build();
        REQUIRE_NOTHROW(index.validate());
        // The oracle's mask is plain causality on token positions; it never looks at the index.
        const test::naive_result expected = test::naive_attention(
            p.shape, p.q, p.k, p.v, p.scale(), [causal](index_t, index_t i, index_t j) { return !causal || j <= i; });
        const test::naive_result in_double = run_forward<double>(p, index);
        const test::naive_result in_float = run_forward<float>(p, index);
        CHECK(test::relative_error(in_double.out, expected.out) < 1e-12);
        CHECK(test::relative_error(in_double.lse, expected.lse) < 1e-12);
        CHECK(test::relative_error(in_float.out, expected.out) < 2e-6);
        CHECK(test::relative_error(in_float.lse, expected.lse) < 2e-6);
      }
}

TEST_CASE("with random sparse indices the reference equals naive masked attention, forward and backward") {
  STRIA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 12; ++trial) {
    const index_t dim = trial % 2 ? 128 : 64;
    const index_t group = std::array<index_t, 3>{1, 2, 8}[static_cast<std::size_t>(trial % 3)];
    const bool causal = trial % 4 != 3;
    // Alternate a single-rank layout (diagonal tiles) and a ring step of a 3-rank striped layout.
    const bool ring_step = trial % 2 == 1;
    const index_t nq = 3, nk = 3;
    const std::vector<index_t> q_global = ring_step ? iota_blocks(nq, 3, 2) : iota_blocks(nq);
    const std::vector<index_t> k_global = ring_step ? iota_blocks(nk, 3, 1) : iota_blocks(nk);
    CAPTURE(trial);
    const test::row_sets sets = test::random_row_sets(rng, {8, nq, nk, causal}, q_global, k_global, 0.45, 0.08);
    const step_index index = sets.build();
    REQUIRE_NOTHROW(index.validate());
    const problem<float> p(rng, {nq * 64, nk * 64, 8, 8 / group, dim});

    const test::naive_result expected = test::naive_attention(p.shape, p.q, p.k, p.v, p.scale(), sets.mask());
    const test::naive_result got = run_forward<double>(p, index);
    CHECK(test::relative_error(got.out, expected.out) < 1e-12);
    for (std::size_t i = 0; i < got.lse.size(); ++i) {
      if (std::isinf(expected.lse[i])) CHECK(got.lse[i] == expected.lse[i]);
      else CHECK(std::abs(got.lse[i] - expected.lse[i]) < 1e-12 * std::max(1.0, std::abs(expected.lse[i])));
    }

    const test::naive_gradients expected_grad = test::naive_attention_backward(p.shape, p.q, p.k, p.v, p.d_out, p.scale(), sets.mask());
    const test::naive_gradients grad = run_backward<double>(p, index, cast<float>(got.out), cast<float>(got.lse));
    // The reference backward consumed fp32-rounded O and LSE, hence the 1e-6 bound.
    CHECK(test::relative_error(grad.dq, expected_grad.dq) < 1e-5);
    CHECK(test::relative_error(grad.dk, expected_grad.dk) < 1e-5);
    CHECK(test::relative_error(grad.dv, expected_grad.dv) < 1e-5);
  }
}

TEST_CASE("reference gradients agree with central finite differences of sum(out * d_out)") {
  STRIA_SEEDED_RNG(rng);
  for (const bool causal : {true, false}) {
    CAPTURE(causal);
    const index_t blocks = 2;
    const test::row_sets sets = test::random_row_sets(rng, {2, blocks, blocks, causal}, iota_blocks(blocks), iota_blocks(blocks), 0.7, 0.15);
    const step_index index = sets.build();
    problem<double> p(rng, {blocks * 64, blocks * 64, 2, 1, 64});

    auto loss = [&](const problem<double>& x) {
      const test::naive_result r = run_forward<double>(x, index);
      return std::inner_product(r.out.begin(), r.out.end(), x.d_out.begin(), 0.0);
    };
    const test::naive_result fwd = run_forward<double>(p, index);
    const test::naive_gradients grad = run_backward<double>(p, index, fwd.out, fwd.lse);

    auto check_tensor = [&](std::vector<double> problem<double>::*tensor, const std::vector<double>& analytic, const char* name) {
      for (int probe = 0; probe < 12; ++probe) {
        const auto i = static_cast<std::size_t>(rng.integer(0, static_cast<int>((p.*tensor).size()) - 1));
        const double h = 1e-5;
        problem<double> plus = p, minus = p;
        (plus.*tensor)[i] += h;
        (minus.*tensor)[i] -= h;
        const double numeric = (loss(plus) - loss(minus)) / (2 * h);
        INFO(name, "[", i, "]: analytic ", analytic[i], ", numeric ", numeric);
        CHECK(std::abs(numeric - analytic[i]) < 1e-7 + 1e-6 * std::abs(numeric));
      }
    };
    check_tensor(&problem<double>::q, grad.dq, "dq");
    check_tensor(&problem<double>::k, grad.dk, "dk");
    check_tensor(&problem<double>::v, grad.dv, "dv");
  }
}

TEST_CASE("a query row with no keys yields out = 0, lse = -inf, zero gradients and no NaN") {
  STRIA_SEEDED_RNG(rng);
  // Row (head 0, query block 1) and all of head 1's rows are empty.
  const step_index_shape shape{2, 2, 2, true};
  const step_index index = build_step_index(shape, {}, {0, 1}, {0, 1}, {{0}, {}, {}, {}}, {{}, {}, {}, {}});
  REQUIRE_NOTHROW(index.validate());
  const problem<float> p(rng, {128, 128, 2, 2, 64});
  const test::naive_result fwd = run_forward<double>(p, index);
  for (index_t h = 0; h < 2; ++h)
    for (index_t t = 0; t < 128; ++t) {
      const bool empty = h == 1 || t >= 64;
      const double lse = fwd.lse[static_cast<std::size_t>(h * 128 + t)];
      if (empty) CHECK(lse == -std::numeric_limits<double>::infinity());
      else CHECK(std::isfinite(lse));
      for (index_t d = 0; d < 64; ++d) {
        const double o = fwd.out[(static_cast<std::size_t>(t) * 2 + h) * 64 + d];
        CHECK(std::isfinite(o));
        if (empty) CHECK(o == 0.0);
      }
    }
  const test::naive_gradients g = run_backward<double>(p, index, cast<float>(fwd.out), cast<float>(fwd.lse));
  CHECK(all_finite(g.dq));
  CHECK(all_finite(g.dk));
  CHECK(all_finite(g.dv));
  for (index_t t = 64; t < 128; ++t)
    for (index_t d = 0; d < 64; ++d) CHECK(g.dq[(static_cast<std::size_t>(t) * 2) * 64 + d] == 0.0);
}

TEST_CASE("merging partial results gives the full result in any order") {
  STRIA_SEEDED_RNG(rng);
  const index_t blocks = 4, heads = 4;
  const test::row_sets whole = test::random_row_sets(rng, {heads, blocks, blocks, true}, iota_blocks(blocks), iota_blocks(blocks), 0.6, 0.1);
  // Deal every tile and vertical token of `whole` to one of three parts at random; some rows of
  // some parts are empty, which exercises the -inf side of the merge.
  std::array<test::row_sets, 3> parts;
  for (auto& part : parts) {
    part = whole;
    for (auto& b : part.blocks) b.clear();
    for (auto& t : part.tokens) t.clear();
  }
  for (std::size_t r = 0; r < whole.blocks.size(); ++r) {
    for (index_t b : whole.blocks[r]) parts[static_cast<std::size_t>(rng.integer(0, 2))].blocks[r].insert(b);
    for (index_t t : whole.tokens[r]) parts[static_cast<std::size_t>(rng.integer(0, 2))].tokens[r].insert(t);
  }
  const problem<float> p(rng, {blocks * 64, blocks * 64, heads, 2, 64});
  const test::naive_result full = run_forward<double>(p, whole.build());
  std::array<test::naive_result, 3> partial;
  for (std::size_t i = 0; i < 3; ++i) partial[i] = run_forward<double>(p, parts[i].build());

  std::array<std::size_t, 3> order{0, 1, 2};
  std::vector<std::vector<float>> results;
  do {
    // fp32 running state, initialised to the empty result (out 0, lse -inf).
    std::vector<float> out(p.q.size(), 0.0f);
    std::vector<float> lse(static_cast<std::size_t>(heads) * blocks * 64, -std::numeric_limits<float>::infinity());
    for (std::size_t i : order) {
      const std::vector<float> part_out = cast<float>(partial[i].out), part_lse = cast<float>(partial[i].lse);
      host::merge_partial(view3(out, blocks * 64, heads, 64), view2(lse, heads, blocks * 64), view3(part_out, blocks * 64, heads, 64),
                          view2(part_lse, heads, blocks * 64));
    }
    CHECK(test::relative_error(out, full.out) < 1e-6);
    CHECK(test::relative_error(lse, full.lse) < 1e-6);
    results.push_back(out);
  } while (std::next_permutation(order.begin(), order.end()));
  for (const auto& r : results) CHECK(test::relative_error(r, results.front()) < 1e-6);
}

TEST_CASE("merging two empty partials stays empty, and an empty partial never injects NaN") {
  std::vector<float> out{std::nanf("")}, lse{-std::numeric_limits<float>::infinity()};
  const std::vector<float> part_out{0.5f}, part_lse{-std::numeric_limits<float>::infinity()};
  // Running state poisoned with NaN but empty (lse -inf): its weight is 0, so no NaN survives.
  host::merge_partial(view3(out, 1, 1, 1), view2(lse, 1, 1), view3(part_out, 1, 1, 1), view2(part_lse, 1, 1));
  CHECK(out[0] == 0.0f);
  CHECK(lse[0] == -std::numeric_limits<float>::infinity());
  const auto m = merge_lse(1.5, -std::numeric_limits<double>::infinity());
  CHECK(m.lse == 1.5);
  CHECK(m.weight_a == 1.0);
  CHECK(m.weight_b == 0.0);
}

TEST_CASE("bad attention inputs are rejected with the argument, the value and the rule") {
  STRIA_SEEDED_RNG(rng);
  const step_index index = dense_sets(4, 2, true).build();
  auto attempt = [&](attention_shape s, step_index_view iv) {
    const problem<float> p(rng, s);
    std::vector<float> out(p.q.size()), lse(static_cast<std::size_t>(s.heads_q) * s.query_tokens);
    host::reference_forward(view3(p.q, s.query_tokens, s.heads_q, s.head_dim), view3(p.k, s.kv_tokens, s.heads_kv, s.head_dim),
                            view3(p.v, s.kv_tokens, s.heads_kv, s.head_dim), iv, p.scale(),
                            view3(out, s.query_tokens, s.heads_q, s.head_dim), view2(lse, s.heads_q, s.query_tokens));
  };
  CHECK_NOTHROW(attempt({128, 128, 4, 2, 64}, index.view()));
  CHECK_THROWS_WITH_AS(attempt({128, 128, 4, 3, 64}, index.view()),
                       doctest::Contains("q.extent(1) (query heads) = 4: must be a multiple of the KV heads 3"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(attempt({128, 128, 4, 2, 96}, index.view()),
                       doctest::Contains("head_dim) = 96: unsupported head dim: stria supports 64 and 128"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(attempt({100, 128, 4, 2, 64}, index.view()), doctest::Contains("query tokens) = 100: must be a positive multiple of 64"),
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(attempt({192, 128, 4, 2, 64}, index.view()), doctest::Contains("index.shape.num_query_blocks = 2"),
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(attempt({128, 128, 8, 2, 64}, index.view()), doctest::Contains("index.shape.num_heads = 4"), stria::invalid_argument);

  // A v tensor whose extents disagree with k.
  const problem<float> p(rng, {128, 128, 4, 2, 64});
  std::vector<float> out(p.q.size()), lse(4 * 128);
  CHECK_THROWS_WITH_AS(host::reference_forward(view3(p.q, 128, 4, 64), view3(p.k, 128, 2, 64), view3(p.v, 64, 2, 64), index.view(),
                                               p.scale(), view3(out, 128, 4, 64), view2(lse, 4, 128)),
                       doctest::Contains("v.extent(0) = 64: must be 128"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(host::reference_forward(view3(p.q, 128, 4, 64), view3(p.k, 128, 2, 64), tensor_view<const float, 3>(nullptr, {128, 2, 64}),
                                               index.view(), p.scale(), view3(out, 128, 4, 64), view2(lse, 4, 128)),
                       doctest::Contains("v.data() = nullptr"), stria::invalid_argument);

  // The softmax scale (issue 20, defect 5): the host backend's tile math rejects what the kernels do.
  for (const double bad : {0.0, -0.125, std::nan(""), double(INFINITY)}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(host::reference_forward(view3(p.q, 128, 4, 64), view3(p.k, 128, 2, 64), view3(p.v, 128, 2, 64), index.view(), bad,
                                                 view3(out, 128, 4, 64), view2(lse, 4, 128)),
                         doctest::Contains("softmax_scale = "), stria::invalid_argument);
    std::vector<float> dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
    CHECK_THROWS_WITH_AS(host::reference_backward(view3(p.q, 128, 4, 64), view3(p.k, 128, 2, 64), view3(p.v, 128, 2, 64),
                                                  view3(p.q, 128, 4, 64), view3(p.q, 128, 4, 64), view2(std::as_const(lse), 4, 128), index.view(),
                                                  bad, view3(dq, 128, 4, 64), view3(dk, 128, 2, 64), view3(dv, 128, 2, 64)),
                         doctest::Contains("must be positive and finite"), stria::invalid_argument);
  }
}
