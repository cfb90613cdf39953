// SPDX-License-Identifier: Apache-2.0
// The estimator on the GPU: the device index builder gives exactly the host builder's arrays; the
// device window statistics (over comm::local_device: no host crossing) agree with the host's (single
// rank and several ranks sharing the GPU, bf16, fp16 and fp32; the device keeps each union's first
// vertical_candidates) and are identical on every rank; the device combine of the ranks' shares is
// engine::combine_shares bit for bit; the GPU selection picks exactly what the host selection picks
// from the same statistics.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <limits>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/numeric.cuh"
#include "stria/device/window_statistics.cuh"
#include "stria/engine/window_statistics_engine.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/select.cuh"
#include "stria/estimator/vertical_slash_top_k.hpp"
#include "stria/estimator/window_statistics.cuh"
#include "stria/estimator/window_statistics.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/index/local_index.cuh"
#include "stria/index/local_index.hpp"
#include "stria/kernel/window_statistics.cuh"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/topology/flat_ring.hpp"
#include "support/random_shares.hpp"
#include "support/selection.hpp"

using namespace stria;

namespace {

void check_same_index(const step_index& device, const step_index& host) {
  CHECK(device.shape == host.shape);
  CHECK(device.origin == host.origin);
  CHECK(device.query_global_block == host.query_global_block);
  CHECK(device.kv_global_block == host.kv_global_block);
  CHECK(device.block_ptr == host.block_ptr);
  CHECK(device.block_col == host.block_col);
  CHECK(device.col_ptr == host.col_ptr);
  CHECK(device.col_token == host.col_token);
  CHECK(device.kv_query_ptr == host.kv_query_ptr);
  CHECK(device.kv_query == host.kv_query);
  CHECK(device.vtoken_head_ptr == host.vtoken_head_ptr);
  CHECK(device.vtoken == host.vtoken);
  CHECK(device.vtoken_query_ptr == host.vtoken_query_ptr);
  CHECK(device.vtoken_query == host.vtoken_query);
  CHECK_NOTHROW(device.validate());
}

/// The device builder, one index at a time and in batches (a rank's ring steps; an unordered batch
/// with repeated pairs, as a solver rank's tasks are), equals the host builder.
template <class Sharding>
void check_device_builder(const global_selection& g, const Sharding& sharding, index_t world) {
  const device_selection on_device(g);
  const topology::flat_ring ring(world);
  for (index_t r = 0; r < world; ++r) {
    const std::vector<device_step_index> steps = build_ring_indices_device(on_device, sharding, ring, r);
    REQUIRE(steps.size() == static_cast<std::size_t>(world));
    for (index_t s = 0; s < world; ++s) {
      CAPTURE(r);
      CAPTURE(s);
      const step_index_origin origin{0, 0, 0, s, 0};
      const step_index host = build_local_index(g, sharding, world, r, ring.kv_source_rank(r, s), origin);
      check_same_index(steps[static_cast<std::size_t>(s)].to_host(), host);
      check_same_index(build_local_index_device(on_device, sharding, world, r, ring.kv_source_rank(r, s), origin).to_host(), host);
    }
  }
  std::vector<index_request> mixed;
  for (index_t i = 0; i < 2 * world + 1; ++i) mixed.push_back({(3 * i + 1) % world, (5 * i + 2) % world, {0, 0, 0, i, 0}});
  const std::vector<device_step_index> built = build_local_indices_device(on_device, sharding, world, mixed);
  REQUIRE(built.size() == mixed.size());
  for (std::size_t i = 0; i < mixed.size(); ++i) {
    CAPTURE(i);
    check_same_index(built[i].to_host(), build_local_index(g, sharding, world, mixed[i].query_rank, mixed[i].kv_rank, mixed[i].origin));
  }
  CHECK(build_local_indices_device(on_device, sharding, world, {}).empty());
  const index_request out_of_range{0, world, {}};
  CHECK_THROWS_WITH_AS(build_local_indices_device(on_device, sharding, world, std::span<const index_request>(&out_of_range, 1)),
                       doctest::Contains("kv_rank"), const invalid_argument&);
}

/// Inputs rounded to T, then back to float for the host path (both paths see the same values).
template <class T>
struct rounded {
  std::vector<T> values;
  std::vector<float> as_float;
  explicit rounded(const std::vector<float>& x) : values(x.size()), as_float(x.size()) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      values[i] = from_float<T>(x[i]);
      as_float[i] = to_float(values[i]);
    }
  }
};

/// Statistics and selections of `world` ranks sharing the GPU, from the host path (over the host
/// surface of the same ranks) and the device path (over comm::local_device).
template <class T, class Sharding>
void compare_paths(const host::synthetic_vs& data, const host::synthetic_vs_options& o, const Sharding& sharding, index_t world) {
  const index_t s = o.seq_len, hq = o.heads_q, hkv = o.heads_kv, d = o.head_dim, local = s / world;
  const double scale = 1.0 / std::sqrt(double(d));
  const rounded<T> q(data.q), k(data.k);
  const auto q_s = stria::sharding::split(sharding, std::span<const float>(q.as_float), std::array<index_t, 3>{s, hq, d}, world);
  const auto k_s = stria::sharding::split(sharding, std::span<const float>(k.as_float), std::array<index_t, 3>{s, hkv, d}, world);
  estimator::vertical_slash_top_p e;
  e.vertical = {1, 512};
  std::vector<vs_statistics> host_stats(static_cast<std::size_t>(world)), device_stats(host_stats.size());
  comm::local_device_world ranks(world, 0, std::chrono::seconds(120));
  ranks.run([&](comm::local_device& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    host_stats[r] = estimator::gather_window_statistics(c.host(), sharding, s, true, tensor_view<const float, 3>(q_s[r].data(), {local, hq, d}),
                                                        tensor_view<const float, 3>(k_s[r].data(), {local, hkv, d}), scale, e.request(s));
    std::vector<T> q_local(q_s[r].size()), k_local(k_s[r].size());
    for (std::size_t i = 0; i < q_local.size(); ++i) q_local[i] = from_float<T>(q_s[r][i]);  // exact: already rounded to T
    for (std::size_t i = 0; i < k_local.size(); ++i) k_local[i] = from_float<T>(k_s[r][i]);
    const device_buffer<T> q_d{std::span<const T>(q_local)}, k_d{std::span<const T>(k_local)};
    cudaStream_t stream{};
    STRIA_CUDA_CHECK(cudaStreamCreate(&stream));
    {  // buffers ordered on `stream` are freed on it: they go before the stream does
      const estimator::device_statistics on_device =
          estimator::gather_window_statistics_device(c, sharding, s, true, q_d.data(), k_d.data(), hq, hkv, d, scale, e.request(s), stream);
      device_stats[r] = on_device.download(stream);
      // The whole device estimate selects exactly what the host selects from these statistics.
      CHECK(estimator::estimate_device(e, c, sharding, s, true, q_d.data(), k_d.data(), hq, hkv, d, scale, stream).to_host(stream) ==
            e.select(device_stats[r]));
    }
    STRIA_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  for (index_t r = 1; r < world; ++r) {  // identical on every rank
    CHECK(device_stats[static_cast<std::size_t>(r)].slash_mass == device_stats[0].slash_mass);
    CHECK(device_stats[static_cast<std::size_t>(r)].window_mass == device_stats[0].window_mass);
    CHECK(device_stats[static_cast<std::size_t>(r)].vertical == device_stats[0].vertical);
  }
  const vs_statistics& a = device_stats[0];
  const vs_statistics& b = host_stats[0];
  REQUIRE(a.slash_mass.size() == b.slash_mass.size());
  for (std::size_t i = 0; i < a.slash_mass.size(); ++i) CHECK(a.slash_mass[i] == doctest::Approx(b.slash_mass[i]).epsilon(1e-4).scale(1e-6));
  for (std::size_t h = 0; h < a.window_mass.size(); ++h) CHECK(a.window_mass[h] == doctest::Approx(b.window_mass[h]).epsilon(1e-4));
  for (index_t h = 0; h < hq; ++h) {
    const auto& va = a.vertical[static_cast<std::size_t>(h)];
    const auto& vb = b.vertical[static_cast<std::size_t>(h)];
    // The device keeps the first vertical_candidates of the union, all that a selection reads.
    REQUIRE(va.size() == std::min<std::size_t>(vb.size(), static_cast<std::size_t>(e.request(s).vertical_candidates)));
    for (std::size_t i = 0; i < std::min<std::size_t>(va.size(), 256); ++i)
      CHECK(va[i].mass == doctest::Approx(vb[i].mass).epsilon(1e-4).scale(1e-7));  // the same top masses in order
  }
  // Same selection, up to lines whose masses tie within rounding at the budget's edge.
  const global_selection ga = e.select(a), gb = e.select(b);
  for (index_t h = 0; h < hq; ++h) {
    const auto& ha = ga.heads[static_cast<std::size_t>(h)];
    const auto& hb = gb.heads[static_cast<std::size_t>(h)];
    std::vector<index_t> diff;
    std::set_symmetric_difference(ha.vertical_tokens.begin(), ha.vertical_tokens.end(), hb.vertical_tokens.begin(), hb.vertical_tokens.end(),
                                  std::back_inserter(diff));
    CHECK(diff.size() <= std::max<std::size_t>(2, hb.vertical_tokens.size() / 100));
    CHECK(ha.slash_deltas.size() == doctest::Approx(hb.slash_deltas.size()).epsilon(0.05));
  }
}

/// Host statistics in device memory, each head's candidates padded with mass -1 to the longest row.
estimator::device_statistics upload_statistics(const vs_statistics& s, cudaStream_t stream) {
  index_t width = 0;
  for (const auto& head : s.vertical) width = std::max(width, static_cast<index_t>(head.size()));
  std::vector<float> mass(static_cast<std::size_t>(s.num_heads) * static_cast<std::size_t>(width), -1.0f);
  std::vector<index_t> token(mass.size(), 0);
  for (std::size_t h = 0; h < s.vertical.size(); ++h)
    for (std::size_t i = 0; i < s.vertical[h].size(); ++i) {
      mass[h * static_cast<std::size_t>(width) + i] = s.vertical[h][i].mass;
      token[h * static_cast<std::size_t>(width) + i] = s.vertical[h][i].token;
    }
  vs_statistics shape = s;
  shape.window_mass.clear();
  shape.slash_mass.clear();
  shape.vertical.clear();
  return {shape, width, device_buffer<float>(std::span<const float>(s.window_mass), stream), device_buffer<float>(std::span<const float>(s.slash_mass), stream),
          device_buffer<float>(std::span<const float>(mass), stream), device_buffer<index_t>(std::span<const index_t>(token), stream)};
}

/// Random statistics with many exact ties (masses on a coarse grid, some zero), candidate rows of
/// different lengths per head (up to `max_candidates`), and verticals heavier than their diagonal's
/// slash mass (so residuals go negative and are clamped), in selection order as the collectives
/// leave them. `clustered`: the candidates crowd into a few key blocks, so that many chosen
/// verticals share a diagonal and the order of their subtractions matters.
vs_statistics random_statistics(test::seeded_rng& rng, index_t seq_len, index_t heads, bool causal, index_t local_blocks,
                                int max_candidates = 300, bool clustered = false) {
  vs_statistics s = engine::empty_statistics(seq_len, heads, causal, 64, local_blocks);
  auto grid_mass = [&](int levels) { return rng.chance(0.1) ? 0.0f : float(rng.integer(1, levels)) / 4096.0f; };
  for (float& m : s.slash_mass) m = grid_mass(8);
  const index_t first_local_token = (s.num_blocks() - local_blocks) * block_tokens;
  for (index_t h = 0; h < heads; ++h) {
    double total = 0;
    for (index_t i = 0; i < s.num_diagonals(); ++i) total += s.slash_mass[static_cast<std::size_t>(h * s.num_diagonals() + i)];
    std::vector<vertical_candidate> c;
    const int count = rng.integer(0, std::min<int>(first_local_token, max_candidates));
    std::set<index_t> crowded_blocks;  // distinct key blocks that hold room for all the clustered candidates
    const int key_blocks = first_local_token / block_tokens, wanted = std::min(key_blocks, (count + 63) / 64 + rng.integer(0, 8));
    while (clustered && static_cast<int>(crowded_blocks.size()) < wanted) crowded_blocks.insert(rng.integer(0, key_blocks - 1));
    const std::vector<index_t> crowded(crowded_blocks.begin(), crowded_blocks.end());
    std::set<index_t> tokens;
    while (static_cast<int>(tokens.size()) < count)
      tokens.insert(clustered ? crowded[static_cast<std::size_t>(rng.integer(0, static_cast<int>(crowded.size()) - 1))] * block_tokens +
                                    rng.integer(0, block_tokens - 1)
                              : rng.integer(0, first_local_token - 1));
    for (const index_t t : tokens) c.push_back({grid_mass(16), t});
    std::sort(c.begin(), c.end());
    for (const auto& x : c) total += x.mass;
    s.window_mass[static_cast<std::size_t>(h)] = float(total * rng.uniform(1.0, 1.5));
    s.vertical.push_back(std::move(c));
  }
  return s;
}

/// One round of the selection test: random statistics and random top-p and top-k rules, the GPU's
/// selection against the host's.
void check_selection_round(test::seeded_rng& rng, cudaStream_t stream, index_t seq_len, bool causal, int max_candidates, bool clustered) {
  const index_t blocks = seq_len / 64, local = rng.integer(1, std::min<index_t>(3, blocks - 1));
  CAPTURE(seq_len);
  CAPTURE(causal);
  CAPTURE(local);
  CAPTURE(clustered);
  const vs_statistics s = random_statistics(rng, seq_len, 3, causal, local, max_candidates, clustered);
  const auto on_device = upload_statistics(s, stream);
  CHECK(on_device.download(stream).vertical == s.vertical);  // the pads are invisible
  const int most_verticals = std::min(seq_len, 2 * max_candidates);
  estimator::vertical_slash_top_p p;
  p.p_vertical = rng.chance(0.2) ? 1.0 : rng.uniform(0.05, 1.0);
  p.p_slash = rng.uniform(0.05, 1.0);
  p.local_diagonals = local;
  p.sink_tokens = rng.integer(0, 100);
  p.vertical = {rng.integer(1, 20), rng.chance(0.5) ? 0 : rng.integer(20, most_verticals)};
  p.slash = {rng.integer(1, 3), rng.chance(0.5) ? 0 : rng.integer(3, static_cast<int>(blocks))};
  CHECK(estimator::select_device(on_device, p.rule(seq_len), stream).to_host(stream) == p.select(s));
  estimator::vertical_slash_top_k k;
  k.vertical_count = rng.integer(1, most_verticals);
  k.slash_count = rng.integer(1, static_cast<int>(blocks));
  k.local_diagonals = local;
  CHECK(estimator::select_device(on_device, k.rule(seq_len), stream).to_host(stream) == k.select(s));
}

}  // namespace

TEST_CASE("the device index builder reproduces the host builder, array for array") {
  STRIA_SEEDED_RNG(rng);
  for (const bool causal : {true, false})
    for (const index_t world : {1, 2, 3, 4, 8}) {
      CAPTURE(causal);
      CAPTURE(world);
      const global_selection g = test::random_selection(rng, 2 * world * 64 * 3, 3, causal, 0.3, 0.03);
      check_device_builder(g, sharding::sequential{}, world);
      check_device_builder(g, sharding::zigzag{}, world);
      check_device_builder(g, sharding::striped<64>{}, world);
    }
  // A synthetic Vertical-Slash selection at a larger size.
  host::synthetic_vs_options o;
  o.seq_len = 32768;
  o.heads_q = 4;
  o.heads_kv = 1;
  check_device_builder(host::plant_vs_selection(o), sharding::striped<64>{}, 8);
}

TEST_CASE("the device index builder sums its entry counts in 64 bits: past 2^31 - 1 is an error, never a wrapped offset") {
  // An index's five count arrays back to back, as the builder lays them out, scanned at once: the
  // first array's total wraps 32 bits, and the vertical arrays span more values than the split
  // kernel's capped grid covers in one stride.
  const index_t most = std::numeric_limits<index_t>::max(), rows = 3, total = 1 << 20;
  kernel::count_layout at = stria::detail::count_layout_for(rows, total);
  const std::int64_t n = at.start[kernel::index_counts];
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n), 0);
  const std::vector<std::int64_t> rows_of[3] = {{most, most, 5}, {1, 2, 3}, {0, 0, 0}};
  for (int a = 0; a < 3; ++a) std::copy(rows_of[a].begin(), rows_of[a].end(), counts.begin() + at.start[a]);
  std::fill(counts.begin() + at.start[3], counts.begin() + at.start[4] - 1, 3);
  std::fill(counts.begin() + at.start[4], counts.end() - 1, 1);
  std::vector<device_buffer<index_t>> ptr;
  for (int a = 0; a < kernel::index_counts; ++a) {
    ptr.emplace_back(static_cast<std::size_t>(at.start[a + 1] - at.start[a]));
    at.ptr[a] = ptr.back().data();
  }
  const device_buffer<std::int64_t> counts_d{std::span<const std::int64_t>(counts)};
  device_buffer<std::int64_t> prefix(static_cast<std::size_t>(n));
  device_buffer<unsigned long long> totals_d(kernel::index_counts);
  stria::detail::scan_counts(counts_d.data(), prefix.data(), at, totals_d.data(), nullptr);
  const std::vector<unsigned long long> totals = totals_d.download();
  CHECK(totals == std::vector<unsigned long long>{2ULL * static_cast<unsigned long long>(most) + 5, 6, 0, 3ULL << 20, 1ULL << 20});
  CHECK_THROWS_WITH(csr_offset(static_cast<std::size_t>(totals[0]), "step index tiles"),
                    doctest::Contains("step index tiles = 4294967299: exceed the 32-bit offsets of a step index"));
  CHECK(ptr[1].download() == std::vector<index_t>{0, 1, 3, 6});
  CHECK(ptr[2].download() == std::vector<index_t>{0, 0, 0, 0});
  const std::vector<index_t> used = ptr[3].download(), queries = ptr[4].download();
  for (index_t v = 0; v <= total; ++v) {
    if (used[static_cast<std::size_t>(v)] != 3 * v || queries[static_cast<std::size_t>(v)] != v) {
      FAIL_CHECK("pointer " << v << ": " << used[static_cast<std::size_t>(v)] << ", " << queries[static_cast<std::size_t>(v)]);
      break;
    }
  }
}

TEST_CASE("device window statistics agree with the host's, for bf16 and fp16, head dims 128 and 64, on 1 and several ranks") {
  host::synthetic_vs_options o;
  o.seq_len = 8192;
  o.heads_q = 8;
  o.heads_kv = 2;
  o.head_dim = 128;
  o.density = 0.05;
  const host::synthetic_vs data = host::make_synthetic_vs(o);
  SUBCASE("bf16") {
    compare_paths<__nv_bfloat16>(data, o, sharding::sequential{}, 1);
    compare_paths<__nv_bfloat16>(data, o, sharding::striped<64>{}, 4);
    compare_paths<__nv_bfloat16>(data, o, sharding::sequential{}, 8);
  }
  SUBCASE("fp16") { compare_paths<__half>(data, o, sharding::zigzag{}, 2); }
  SUBCASE("head_dim 64, ranks whose key blocks end in a partial chunk of the window kernels") {
    host::synthetic_vs_options o64 = o;
    o64.head_dim = 64;
    o64.seq_len = 5760;  // 90 blocks: 30 per rank, a partial last chunk for any chunk size not dividing 30 (4 on an H200)
    compare_paths<__nv_bfloat16>(host::make_synthetic_vs(o64), o64, sharding::striped<64>{}, 3);
    compare_paths<__half>(host::make_synthetic_vs(o64), o64, sharding::sequential{}, 1);
  }
}

namespace {

std::vector<std::uint32_t> bits_of(const std::vector<float>& x) {
  std::vector<std::uint32_t> bits;
  for (const float v : x) bits.push_back(std::bit_cast<std::uint32_t>(v));
  return bits;
}

/// The device backend's combine of random shares under `plan` against engine::combine_shares on the
/// same shares: the masses bit for bit, each head's row the host's union in order (zeros keep their
/// sign), then mass -1 and token 0 up to the row's width, the most a union holds.
void check_device_combine(const engine::window_plan& plan, test::seeded_rng& rng, cudaStream_t stream) {
  const test::random_shares shares = test::make_random_shares(plan, rng);
  const vs_statistics host = engine::combine_shares(plan, shares.mass, shares.candidates);
  const index_t heads = plan.shape.num_heads, dim = 64, local_tokens = plan.rank_blocks * block_tokens;
  const device_buffer<__nv_bfloat16> q(static_cast<std::size_t>(local_tokens * heads * dim), stream), k(static_cast<std::size_t>(local_tokens * dim), stream);
  device::detail::window_backend<__nv_bfloat16> backend(plan, 0, q.data(), k.data(), 1, dim, 0.125, stream, nullptr, std::chrono::steady_clock::now());
  const estimator::device_statistics got = backend.global_statistics(
      {device_buffer<float>(std::span<const float>(shares.mass), stream), device_buffer<std::uint64_t>(std::span<const std::uint64_t>(shares.candidates), stream)});
  const auto width = static_cast<std::size_t>(std::min<std::int64_t>(plan.keep, std::int64_t{plan.world} * plan.per_rank));
  REQUIRE(got.candidates_per_head == static_cast<index_t>(width));
  CHECK(bits_of(got.slash_mass.download(stream)) == bits_of(host.slash_mass));
  CHECK(bits_of(got.window_mass.download(stream)) == bits_of(host.window_mass));
  const std::vector<float> mass = got.candidate_mass.download(stream);
  const std::vector<index_t> token = got.candidate_token.download(stream);
  for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h) {
    CAPTURE(h);
    const std::vector<vertical_candidate>& expected = host.vertical[h];
    REQUIRE(expected.size() <= width);
    std::vector<std::uint32_t> expected_mass(width, std::bit_cast<std::uint32_t>(-1.0f));
    std::vector<index_t> expected_token(width, 0);
    for (std::size_t i = 0; i < expected.size(); ++i) {
      expected_mass[i] = std::bit_cast<std::uint32_t>(expected[i].mass);
      expected_token[i] = expected[i].token;
    }
    CHECK(bits_of(std::vector<float>(mass.begin() + static_cast<std::ptrdiff_t>(h * width), mass.begin() + static_cast<std::ptrdiff_t>((h + 1) * width))) ==
          expected_mass);
    CHECK(std::vector<index_t>(token.begin() + static_cast<std::ptrdiff_t>(h * width), token.begin() + static_cast<std::ptrdiff_t>((h + 1) * width)) ==
          expected_token);
  }
}

}  // namespace

TEST_CASE("the device combine of the ranks' shares is engine::combine_shares bit for bit: ties, zeros of both signs, sentinels, any keep") {
  STRIA_SEEDED_RNG(rng);
  cudaStream_t stream{};
  STRIA_CUDA_CHECK(cudaStreamCreate(&stream));
  {  // buffers ordered on `stream` are freed on it: they go before the stream does
    for (const index_t world : {1, 2, 3, 5, 8})
      for (const index_t heads : {1, 3, 4})
        for (const index_t blocks_per_rank : {1, 3})
          for (const bool causal : {true, false})
            for (const index_t cap : {0, 1, 37, 64, 150})
              for (const int keep_choice : {0, 1, 2, 3}) {
                CAPTURE(world);
                CAPTURE(heads);
                CAPTURE(blocks_per_rank);
                CAPTURE(causal);
                CAPTURE(cap);
                CAPTURE(keep_choice);
                // Local blocks up to every block of a rank: runs of sentinels, and unions shorter than `keep`.
                engine::window_plan plan = engine::make_window_plan(sharding::striped<64>{}, world * blocks_per_rank * 64, world, causal, heads,
                                                                    {64, cap, rng.integer(0, std::min<index_t>(world * blocks_per_rank, 2 * blocks_per_rank))});
                const index_t per_rank = plan.per_rank;
                if (per_rank == 0 && keep_choice > 1) continue;  // no candidates (vertical.max 0): keep 0 or every run
                // keep: per_rank (the estimator's), every run whole, between per_rank and the union, below per_rank.
                const index_t keeps[] = {per_rank, engine::whole_union, rng.integer(per_rank, world * per_rank + 1), rng.integer(1, per_rank)};
                plan.keep = keeps[keep_choice];
                CAPTURE(plan.keep);
                check_device_combine(plan, rng, stream);
              }
  }
  STRIA_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("candidate_top_k keeps each head's first k candidates in the order of the device-wide sort, ties included") {
  STRIA_SEEDED_RNG(rng);
  STRIA_CUDA_CHECK(cudaFuncSetAttribute(kernel::candidate_top_k<>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kernel::top_k_shared_bytes())));
  auto check = [&](index_t heads, index_t blocks, index_t k, auto mass_of) {
    const index_t n = blocks * 64;
    std::vector<float> vertical(static_cast<std::size_t>(heads * n));
    for (std::size_t i = 0; i < vertical.size(); ++i) vertical[i] = mass_of(static_cast<index_t>(i % static_cast<std::size_t>(n)));
    std::vector<index_t> global_block(static_cast<std::size_t>(blocks));
    for (index_t b = 0; b < blocks; ++b) global_block[static_cast<std::size_t>(b)] = 3 * b + 1;  // any ascending map
    const device_buffer<float> vertical_d{std::span<const float>(vertical)};
    const device_buffer<index_t> global_d{std::span<const index_t>(global_block)};
    device_buffer<std::uint64_t> keys(static_cast<std::size_t>(heads * k));
    device_buffer<index_t> tokens(keys.size());
    kernel::candidate_top_k<><<<static_cast<unsigned>(heads), kernel::top_k_threads, kernel::top_k_shared_bytes()>>>(
        vertical_d.data(), global_d.data(), n, k, keys.data(), tokens.data());
    STRIA_CUDA_CHECK_LAUNCH("candidate_top_k");
    const std::vector<std::uint64_t> got_keys = keys.download();
    const std::vector<index_t> got_tokens = tokens.download();
    for (index_t h = 0; h < heads; ++h) {
      std::vector<std::pair<std::uint32_t, index_t>> order;  // (key, local token): what the stable sort orders by
      for (index_t j = 0; j < n; ++j) order.push_back({kernel::descending_bits(vertical[static_cast<std::size_t>(h * n + j)]), j});
      std::sort(order.begin(), order.end());
      for (index_t i = 0; i < k; ++i) {
        const auto [key, j] = order[static_cast<std::size_t>(i)];
        REQUIRE(got_keys[static_cast<std::size_t>(h * k + i)] == key);
        REQUIRE(got_tokens[static_cast<std::size_t>(h * k + i)] == global_block[static_cast<std::size_t>(j / 64)] * 64 + j % 64);
      }
    }
  };
  for (int round = 0; round < 40; ++round) {
    const index_t heads = rng.integer(1, 4), blocks = rng.integer(1, 200), n = blocks * 64;
    const index_t k = rng.integer(1, std::min<index_t>(n, kernel::top_k_capacity));
    const int levels = rng.integer(1, 60);  // a coarse grid: ties at the k-th mass are the rule
    const index_t locals = rng.integer(0, 2) * 64;  // the last tokens are local-block sentinels (mass -1)
    CAPTURE(round);
    CAPTURE(n);
    CAPTURE(k);
    CAPTURE(levels);
    check(heads, blocks, k, [&](index_t j) {
      if (j >= n - locals) return -1.0f;
      return rng.chance(0.1) ? 0.0f : float(rng.integer(1, levels)) / 4096.0f;
    });
  }
  SUBCASE("128K tokens: distinct masses, and every mass equal") {
    check(2, 2048, 4096, [&](index_t) { return float(rng.uniform(0.0, 1.0)); });
    check(1, 2048, kernel::top_k_capacity, [](index_t) { return 0.25f; });
  }
}

TEST_CASE("the GPU selection picks exactly what the host selection picks, ties and clamps included") {
  STRIA_SEEDED_RNG(rng);
  cudaStream_t stream{};
  STRIA_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int round = 0; round < 24; ++round) {
    CAPTURE(round);
    check_selection_round(rng, stream, 64 * rng.integer(4, 300), round % 2 == 0, 300, round % 3 == 0);
  }
  // Every shape of the GPU selection: one launch per head with up to 2048 and up to 4096
  // diagonals, and the multi-launch path past that (kernel::select_threads * 8), with candidate
  // lists longer than one round of the serial sums and of the per-diagonal subtraction (2048).
  const int path_blocks[][2] = {{1500, 2048}, {2049, 4096}, {4097, 4400}};
  for (const auto& [fewest, most] : path_blocks)
    for (int round = 0; round < 4; ++round) {
      const bool causal = round % 2 == 0;
      const index_t diagonals = rng.integer(fewest, most), blocks = causal ? diagonals : (diagonals + 1) / 2;
      CAPTURE(diagonals);
      check_selection_round(rng, stream, 64 * blocks, causal, 5000, round < 2);
    }
  SUBCASE("statistics gathered for another rule are refused") {
    const vs_statistics s = random_statistics(rng, 4096, 2, true, 2);
    estimator::vertical_slash_top_p p;
    p.local_diagonals = 1;  // the statistics have 2
    CHECK_THROWS_WITH_AS(estimator::select_device(upload_statistics(s, stream), p.rule(4096), stream),
                         doctest::Contains("rule.local_diagonals = 1"), stria::invalid_argument);
  }
  STRIA_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("device statistics reject null and misaligned pointers with the argument and the rule") {
  const device_buffer<__nv_bfloat16> q(4096 * 2 * 64 + 8), k(4096 * 1 * 64 + 8);
  estimator::vertical_slash_top_p e;
  comm::local_device_world one(1, 0);
  one.run([&](comm::local_device& c) {
    CHECK_THROWS_WITH_AS(estimator::gather_window_statistics_device(c, sharding::sequential{}, 4096, true, q.data() + 1, k.data(), 2, 1, 64, 0.125,
                                                                    e.request(4096), nullptr),
                         doctest::Contains("must be 16-byte aligned"), stria::invalid_argument);
    CHECK_THROWS_WITH_AS(estimator::gather_window_statistics_device(c, sharding::sequential{}, 4096, true, q.data(),
                                                                    static_cast<const __nv_bfloat16*>(nullptr), 2, 1, 64, 0.125, e.request(4096),
                                                                    nullptr),
                         doctest::Contains("k_local = nullptr: must point to device memory"), stria::invalid_argument);
  });
}
