// SPDX-License-Identifier: Apache-2.0
// Core: error messages carry argument, value, rule (or call and location); tile constants; strided views.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "stria/core/error.hpp"
#include "stria/core/softmax_merge.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/core/tile.hpp"
#include "stria/version.hpp"

using namespace stria;

TEST_CASE("invalid_argument names the argument, the value and the rule") {
  const stria::invalid_argument e("seq_len", 1000, "must be a multiple of 64");
  CHECK(std::string(e.what()) == "stria: seq_len = 1000: must be a multiple of 64");
  CHECK(e.argument() == "seq_len");
  CHECK(e.value() == "1000");
  CHECK(e.rule() == "must be a multiple of 64");
  // It is also a std::invalid_argument, so generic handlers catch it.
  CHECK_THROWS_AS(throw e, std::invalid_argument);
}

TEST_CASE("cuda_error and nccl_error carry the failing call, the code and file:line") {
  const int line = __LINE__ + 1;
  const stria::cuda_error e("cudaMalloc(&p, bytes)", 2, "cudaErrorMemoryAllocation: out of memory");
  CHECK(e.call() == "cudaMalloc(&p, bytes)");
  CHECK(e.code() == 2);
  CHECK(e.line() == static_cast<unsigned>(line));
  CHECK(e.file().find("test_core.cpp") != std::string::npos);
  const std::string what = e.what();
  CHECK(what.find("CUDA call `cudaMalloc(&p, bytes)` failed with code 2 (cudaErrorMemoryAllocation: out of memory) at ") != std::string::npos);
  CHECK(what.find("test_core.cpp:" + std::to_string(line)) != std::string::npos);

  const stria::nccl_error n("ncclAllReduce(...)", 5, "invalid usage");
  CHECK(std::string(n.what()).find("NCCL call `ncclAllReduce(...)` failed with code 5 (invalid usage)") != std::string::npos);
  CHECK_THROWS_AS(throw n, std::runtime_error);
}

TEST_CASE("tile traits expose the derived constants") {
  using t128 = tile<64, 64, 128>;
  using t64 = tile<64, 64, 64>;
  static_assert(t128::block_q == 64 && t128::block_kv == 64 && t128::head_dim == 128);
  static_assert(t128::q_elements == 8192 && t64::kv_elements == 4096);
  CHECK(t64::default_softmax_scale == doctest::Approx(0.125));
  CHECK(t128::default_softmax_scale == doctest::Approx(1.0 / std::sqrt(128.0)).epsilon(1e-15));
  static_assert(tile_traits<t64> && tile_traits<t128>);
}

TEST_CASE("tensor_view indexes row-major and strided memory") {
  std::vector<int> data(2 * 3 * 4);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<int>(i);
  const tensor_view<int, 3> v(data.data(), {2, 3, 4});
  CHECK(v.size() == 24);
  CHECK(v.is_contiguous());
  CHECK(v(1, 2, 3) == 23);
  CHECK(v(1, 0, 2) == 14);
  CHECK(v.stride(0) == 12);
  CHECK(v.stride(2) == 1);
  // A transposed view [4, 3, 2] over the same memory.
  const tensor_view<int, 3> t(data.data(), {4, 3, 2}, {1, 4, 12});
  CHECK_FALSE(t.is_contiguous());
  CHECK(t(3, 2, 1) == v(1, 2, 3));
  const tensor_view<const int, 3> c = v;  // mutable -> const converts implicitly
  CHECK(c(0, 1, 1) == 5);
  v(0, 0, 0) = -7;
  CHECK(c(0, 0, 0) == -7);
}

TEST_CASE("merge_lse combines log-sum-exps stably") {
  const auto m = merge_lse(1000.0, 1000.0);  // exp(1000) overflows; the merge must not
  CHECK(m.lse == doctest::Approx(1000.0 + std::log(2.0)));
  CHECK(m.weight_a == doctest::Approx(0.5));
  const auto f = merge_lse(0.0f, -3.0f);
  CHECK(f.lse == doctest::Approx(std::log(1.0 + std::exp(-3.0))));
  CHECK(f.weight_a + f.weight_b == doctest::Approx(1.0f));
}

TEST_CASE("combine_normaliser_row: the max of the ranks' maxes, their sums rescaled to it in rank order; ranks and rows with no key") {
  // Three ranks, four rows: [world, 2, count], each rank's maxes then its sums.
  const float neg_inf = -INFINITY;
  const std::vector<float> every_rank = {
      1.0f, neg_inf, 2.0f,    neg_inf, /* rank 0 maxes */ 3.0f, 0.0f, 1.5f, 0.0f,  // rank 0 sums
      4.0f, 0.5f,    neg_inf, neg_inf, /* rank 1 maxes */ 2.0f, 5.0f, 0.0f, 0.0f,  // rank 1 sums
      -1.0f, 0.5f,   2.0f,    neg_inf, /* rank 2 maxes */ 7.0f, 1.0f, 0.25f, 0.0f,  // rank 2 sums
  };
  for (const bool base2 : {false, true}) {
    CAPTURE(base2);
    const auto row = [&](std::int64_t i) {
      return base2 ? combine_normaliser_row<true>(every_rank.data(), 3, 4, i) : combine_normaliser_row<false>(every_rank.data(), 3, 4, i);
    };
    const auto scaled = [&](double x) { return base2 ? std::exp2(x) : std::exp(x); };
    // Row 0: every rank saw keys; the sums rescale to the max 4 and add in rank order, in fp64.
    CHECK(row(0).max == 4.0f);
    CHECK(row(0).sum == float(3.0 * scaled(1.0 - 4.0) + 2.0 + 7.0 * scaled(-1.0 - 4.0)));
    // Row 1: rank 0 saw no key (max -inf): it adds nothing, and no NaN comes of -inf - max.
    CHECK(row(1).max == 0.5f);
    CHECK(row(1).sum == 6.0f);
    // Row 2: two equal maxes.
    CHECK(row(2).max == 2.0f);
    CHECK(row(2).sum == 1.75f);
    // Row 3: no rank saw a key: (-inf, 0), which the probabilities read as a row that adds nothing.
    CHECK(row(3).max == neg_inf);
    CHECK(row(3).sum == 0.0f);
  }
}

TEST_CASE("the version macros and constants agree") {
  CHECK(version_major == STRIA_VERSION_MAJOR);
  CHECK(version_minor == STRIA_VERSION_MINOR);
  CHECK(version_patch == STRIA_VERSION_PATCH);
}
