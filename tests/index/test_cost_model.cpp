// SPDX-License-Identifier: Apache-2.0
// The cost model: exact small cases worked by hand, the counts it reads equal the built indices, and
// the sanity a prediction must keep (more bandwidth is never slower, more GPUs at fixed tokens per
// GPU never compute less in all, the hierarchical ring hides its outer transfers behind a round).
#include <doctest/doctest.h>

#include <limits>
#include <numeric>
#include <set>
#include <utility>
#include <vector>

#include "stria/host/synthetic_vs.hpp"
#include "stria/index/cost_model.hpp"
#include "stria/index/local_index.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "support/selection.hpp"

using namespace stria;

namespace {

/// The counts the model reads equal the built indices': non-empty rows, and the padding of the
/// gathered vertical tiles (64 x (64 ceil(v / 64) - v) entries for a row with v tokens).
template <class Sharding, class Topology>
void check_counts(const global_selection& g, const Sharding& sharding, const Topology& topology) {
  const ring_workload rows = cost::count_ring_rows(g, sharding, topology);
  const ring_workload padding = cost::count_ring_vertical_padding(g, sharding, topology);
  for (index_t r = 0; r < topology.world_size(); ++r) {
    const std::vector<step_index> indices = build_ring_indices(g, sharding, topology, r);
    for (index_t s = 0; s < topology.num_steps(); ++s) {
      const step_index& x = indices[static_cast<std::size_t>(s)];
      std::int64_t active = 0, padded = 0;
      for (std::size_t row = 0; row + 1 < x.block_ptr.size(); ++row) {
        const std::int64_t tokens = x.col_ptr[row + 1] - x.col_ptr[row];
        active += x.block_ptr[row + 1] > x.block_ptr[row] || tokens > 0;
        padded += (block_tokens - tokens % block_tokens) % block_tokens * block_tokens;
      }
      CAPTURE(r);
      CAPTURE(s);
      CHECK(rows.at(r, s) == active);
      CHECK(padding.at(r, s) == padded);
    }
  }
}

cost::layer_shape shape_of(index_t seq_len) { return {.seq_len = seq_len, .heads_q = 8, .heads_kv = 2, .head_dim = 128}; }

global_selection vs_input(index_t seq_len) {
  host::synthetic_vs_options o;
  o.seq_len = seq_len;
  o.heads_q = 8;
  o.heads_kv = 2;
  return host::plant_vs_selection(o);
}

template <class Topology>
cost::layer_prediction predict(const global_selection& g, const Topology& topology, const cost::cluster& c) {
  const topology::flat_ring flat(topology.world_size());
  const ring_workload entries = count_ring_workload(g, sharding::striped<64>{}, flat), rows = cost::count_ring_rows(g, sharding::striped<64>{}, flat);
  return cost::predict_ring(cost::reschedule(entries, topology), cost::reschedule(rows, topology), topology, shape_of(g.seq_len),
                            cost::h200_kernel_throughput(128), c);
}

}  // namespace

TEST_CASE("cost model: active rows and vertical padding per (rank, step) equal the built indices'") {
  STRIA_SEEDED_RNG(rng);
  for (const bool causal : {true, false})
    for (const index_t world : {1, 3, 4, 8})
      for (const double token_density : {0.0, 0.02, 0.3}) {
        CAPTURE(causal);
        CAPTURE(world);
        CAPTURE(token_density);
        const global_selection g = test::random_selection(rng, 4 * world * 64, 3, causal, 0.2, token_density);
        check_counts(g, sharding::sequential{}, topology::flat_ring(world));
        check_counts(g, sharding::zigzag{}, topology::flat_ring(world));
        check_counts(g, sharding::striped<64>{}, topology::flat_ring(world));
        if (world % 2 == 0) check_counts(g, sharding::striped<64>{}, topology::hierarchical_ring(2, world / 2));
      }
  // The planted pattern: rows with hundreds of vertical tokens, split over the chunks.
  check_counts(vs_input(8192), sharding::striped<64>{}, topology::flat_ring(8));
  check_counts(vs_input(8192), sharding::zigzag{}, topology::flat_ring(4));
}

TEST_CASE("cost model: a flat ring's counts rescheduled for a hierarchical ring equal its own counts") {
  STRIA_SEEDED_RNG(rng);
  const global_selection g = test::random_selection(rng, 8 * 8 * 64, 2, true, 0.2, 0.05);
  const topology::hierarchical_ring h(2, 4);
  CHECK(cost::reschedule(count_ring_workload(g, sharding::zigzag{}, topology::flat_ring(8)), h).entries ==
        count_ring_workload(g, sharding::zigzag{}, h).entries);
  CHECK(cost::reschedule(cost::count_ring_rows(g, sharding::striped<64>{}, topology::flat_ring(8)), h).entries ==
        cost::count_ring_rows(g, sharding::striped<64>{}, h).entries);
}

TEST_CASE("cost model: kernel fit recovers the speed that made the samples") {
  const cost::kernel_speed truth{.tflops = 300.0, .row_ns = 50.0};
  std::vector<cost::kernel_sample> samples;
  for (const double s : {32768.0, 131072.0, 524288.0}) {
    const double flops = 4 * 128 * 0.05 * s * s / 2 * 16, rows = s / 64 * 16;
    samples.push_back({flops, rows, truth.seconds(flops, rows)});
  }
  const cost::kernel_speed fit = cost::fit_kernel_speed(samples);
  CHECK(fit.tflops == doctest::Approx(300.0));
  CHECK(fit.row_ns == doctest::Approx(50.0));
  // One run cannot tell a row's cost from the throughput: all of it is throughput.
  const cost::kernel_speed one = cost::fit_kernel_speed(std::span(samples).first(1));
  CHECK(one.row_ns == 0.0);
  CHECK(one.seconds(samples[0].flops, samples[0].active_rows) == doctest::Approx(samples[0].seconds));
  CHECK_THROWS_AS(cost::fit_kernel_speed({}), invalid_argument);
  // Two lengths fit a row cost or a call's cost equally well: the row cost is kept.
  const cost::kernel_speed two = cost::fit_kernel_speed(std::span(samples).first(2));
  CHECK(two.tflops == doctest::Approx(300.0));
  CHECK(two.row_ns == doctest::Approx(50.0));
  CHECK(two.call_us == 0.0);
}

TEST_CASE("cost model: three lengths tell a call's fixed cost from the row cost") {
  auto samples_of = [](const cost::kernel_speed& truth) {
    std::vector<cost::kernel_sample> samples;
    for (const double s : {32768.0, 131072.0, 524288.0}) {
      const double flops = 4 * 128 * 0.05 * s * s / 2 * 16, rows = s / 64 * 16;
      samples.push_back({flops, rows, truth.seconds(flops, rows)});
    }
    return samples;
  };
  const cost::kernel_speed all = cost::fit_kernel_speed(samples_of({.tflops = 300.0, .row_ns = 50.0, .call_us = 120.0}));
  CHECK(all.tflops == doctest::Approx(300.0));
  CHECK(all.row_ns == doctest::Approx(50.0));
  CHECK(all.call_us == doctest::Approx(120.0));
  const cost::kernel_speed calls = cost::fit_kernel_speed(samples_of({.tflops = 300.0, .call_us = 200.0}));
  CHECK(calls.tflops == doctest::Approx(300.0));
  CHECK(calls.row_ns == doctest::Approx(0.0).epsilon(1e-6));
  CHECK(calls.call_us == doctest::Approx(200.0));
  // The ring engine calls the kernels at every step, an empty one too.
  CHECK(cost::kernel_speed{.tflops = 300.0, .call_us = 200.0}.seconds(0.0, 0.0) == doctest::Approx(200e-6));
  // The shortest run faster than a fixed cost could allow: the three-term fit would need a negative
  // call cost, so it is dropped, and the row cost's fit (the better of the two-term fits) is kept.
  std::vector<cost::kernel_sample> faster = samples_of({.tflops = 300.0, .row_ns = 50.0});
  faster[0].seconds *= 0.8;
  const cost::kernel_speed dropped = cost::fit_kernel_speed(faster);
  CHECK(dropped.call_us == 0.0);
  CHECK(dropped.row_ns > 0.0);
  auto squared_error = [&](cost::kernel_speed k) {  // of the three terms: the curve holds the samples themselves
    k.curve.clear();
    double sum = 0;
    for (const cost::kernel_sample& x : faster) sum += (k.seconds(x.flops, x.active_rows) / x.seconds - 1) * (k.seconds(x.flops, x.active_rows) / x.seconds - 1);
    return sum;
  };
  std::vector<cost::kernel_sample> calls_only = faster;  // the other two-term fit: no row term in the samples' model
  for (cost::kernel_sample& x : calls_only) x.active_rows = 0;
  const cost::kernel_speed other = cost::fit_kernel_speed(calls_only);
  CHECK(squared_error(dropped) <= squared_error(other));
}

TEST_CASE("cost model: a row's time by its work, from the measured runs, never falling as the work grows") {
  // Runs whose rows lose more than throughput and a row's fixed cost can say: 100 TF at 2 tiles per
  // row, 300 at 8, 400 at 32, 4096 rows each (one call each, so the fitted call cost is 0 or small).
  const double tile = 4.0 * 128 * 64 * 64;  // forward FLOPs of one 64 x 64 tile at D 128
  std::vector<cost::kernel_sample> samples;
  for (const auto& [tiles, tflops] : {std::pair{2.0, 100.0}, std::pair{8.0, 300.0}, std::pair{32.0, 400.0}}) {
    const double rows = 4096, flops = tiles * tile * rows;
    samples.push_back({flops, rows, flops / (tflops * 1e12)});
  }
  const cost::kernel_speed fit = cost::fit_kernel_speed(samples);
  REQUIRE(fit.curve.size() == 3);
  CHECK_NOTHROW(fit.validate("fit"));
  // At every run the prediction is the run's time: the call's cost plus its rows' time.
  for (const cost::kernel_sample& x : samples) CHECK(fit.seconds(x.flops, x.active_rows) == doctest::Approx(x.seconds));
  // Between runs a row's time is linear in its work; more work never takes less time, and at the
  // ends the time runs on continuously (the end segments extended, no faster than the fastest run).
  const double mid = fit.curve_row_ns(5 * tile);
  CHECK(mid == doctest::Approx((fit.curve[0].row_ns + fit.curve[1].row_ns) / 2));
  double previous = 0;
  for (double tiles = 0.5; tiles < 128; tiles *= 1.1) {
    const double t = fit.curve_row_ns(tiles * tile);
    CHECK(t >= previous);
    CHECK(t >= tiles * tile / (400e12 * 1e-9) * (1 - 1e-9));  // never faster than the fastest run's 400 TF
    previous = t;
  }
  for (const double end : {fit.curve.front().flops_per_row, fit.curve.back().flops_per_row})
    CHECK(fit.curve_row_ns(end * (1 - 1e-9)) == doctest::Approx(fit.curve_row_ns(end * (1 + 1e-9))));
  // Two runs of one work (another call of the same length) pool: both runs' time over both runs' rows.
  std::vector<cost::kernel_sample> again = samples;
  again.push_back({samples[1].flops * 2, samples[1].active_rows * 2, samples[1].seconds * 2 * 1.5});
  const cost::kernel_speed pooled = cost::fit_kernel_speed(again);
  REQUIRE(pooled.curve.size() == 3);
  CHECK(pooled.curve[1].row_ns ==
        doctest::Approx((samples[1].seconds * 4 - 2 * pooled.call_us * 1e-6) / (samples[1].active_rows * 3) * 1e9));
  // A run faster per row than a shorter one leaves the row's time where the shorter run put it.
  std::vector<cost::kernel_sample> dip = samples;
  dip[1].seconds = dip[0].seconds * 0.5;  // 8 tiles a row in half the time of 2
  const cost::kernel_speed held = cost::fit_kernel_speed(dip);
  CHECK(held.curve[1].row_ns >= held.curve[0].row_ns);
  // An empty call costs the call; a curve must ascend in work and never fall in time.
  CHECK(fit.seconds(0.0, 0.0) == doctest::Approx(fit.call_us * 1e-6));
  cost::kernel_speed bad = fit;
  std::swap(bad.curve[0].flops_per_row, bad.curve[1].flops_per_row);
  CHECK_THROWS_WITH_AS(bad.validate("k"), doctest::Contains("k.curve[1].flops_per_row"), invalid_argument);
  bad = fit;
  bad.curve[2].row_ns = bad.curve[1].row_ns / 2;
  CHECK_THROWS_WITH_AS(bad.validate("k"), doctest::Contains("k.curve[2].row_ns"), invalid_argument);
  bad.curve[2].row_ns = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(bad.validate("k"), doctest::Contains("k.curve[2].row_ns"), invalid_argument);
  // The built-in D 128 speeds: seven runs; a row of 2.7 tiles costs nearly twice as much per tile as
  // one of 203 (1.92x in the fit to 481fc28's results, 2.1x in the one before, whose call cost was
  // 2 us less).
  const cost::kernel_throughput h200 = cost::h200_kernel_throughput(128);
  CHECK_NOTHROW(h200.validate());
  REQUIRE(h200.forward.curve.size() == 7);
  const cost::speed_point &shortest = h200.forward.curve.front(), &longest = h200.forward.curve.back();
  CHECK(shortest.row_ns / shortest.flops_per_row > 1.8 * longest.row_ns / longest.flops_per_row);
}

TEST_CASE("cost model: message sizes and link times") {
  const cost::layer_shape shape{.seq_len = 131072, .heads_q = 16, .heads_kv = 2, .head_dim = 128};
  // 128K over 2 ranks: 64 MiB of KV per message forward; fp32 dK/dV are twice the KV's bytes.
  CHECK(shape.kv_bytes(65536) == 64.0 * 1024 * 1024);
  CHECK(shape.kv_gradient_bytes(65536) == 128.0 * 1024 * 1024);
  const cost::link l{.gbytes_per_s = 2.0, .latency_us = 5.0};
  CHECK(l.seconds(4e9) == doctest::Approx(2.000005));
  CHECK_THROWS_AS((cost::cluster{.nodes = 0}.validate()), invalid_argument);
  CHECK_THROWS_AS((cost::cluster{.nodes = 300, .gpus_per_node = 300}.validate()), invalid_argument);
  CHECK_THROWS_AS((cost::link{.gbytes_per_s = 0.0}.validate("l")), invalid_argument);
  // Links whose times are not finite numbers (a bad-input hunt's leftovers): 1e-300 GB/s made every
  // transfer infinite, and a latency past 1e9 us is no link either.
  CHECK_THROWS_WITH_AS((cost::link{.gbytes_per_s = 1e-300}.validate("l")), doctest::Contains("l.gbytes_per_s = 1e-300: must be finite and at least 1e-6 (1 kB/s)"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS((cost::link{.gbytes_per_s = 1.0, .latency_us = 1e300}.validate("l")), doctest::Contains("l.latency_us = 1e+300: must lie in [0, 1e9]"),
                       invalid_argument);
  CHECK_NOTHROW((cost::link{.gbytes_per_s = 1e-6, .latency_us = 1e9}.validate("l")));
}

TEST_CASE("cost model: two ranks worked by hand, forward and backward") {
  // 1 us per entry both ways, no row cost; 512 local tokens: KV 524288 bytes, dK/dV 1048576 bytes;
  // 1 GB/s without latency: 0.524288 ms and 1.048576 ms per message.
  const cost::kernel_throughput kernel{.head_dim = 128, .forward = {.tflops = 512e-6, .row_ns = 0}, .backward = {.tflops = 1280e-6, .row_ns = 0}};
  const cost::link slow{.gbytes_per_s = 1.0, .latency_us = 0.0};
  const cost::cluster c{.nodes = 1, .gpus_per_node = 2, .intra_node = slow, .inter_node = slow};
  const ring_workload entries{2, 2, {1000, 300, 200, 400}};  // rank 0: 1.0, 0.3 ms; rank 1: 0.2, 0.4 ms
  const ring_workload rows{2, 2, {0, 0, 0, 0}};
  const cost::layer_prediction p = cost::predict_ring(entries, rows, topology::flat_ring(2), shape_of(1024), kernel, c);
  // Forward: rank 1 waits for the KV until 0.524288 ms, then computes 0.4; rank 0 ends at 1.0 + 0.3.
  CHECK(p.forward.seconds == doctest::Approx(1.3e-3));
  CHECK(p.forward.steps[1].wait_seconds == doctest::Approx(0.324288e-3));
  CHECK(p.forward.steps[1].communication_bound);
  CHECK_FALSE(p.forward.steps[0].communication_bound);
  CHECK(p.forward.rank_compute_seconds[1] == doctest::Approx(0.6e-3));
  // Backward: step 0's partials leave when both ends are done (rank 0 at 1.0 ms) and arrive at
  // 2.048576; step 1 ends when they are in; its partials reach their owners at 3.097152 ms.
  CHECK(p.backward.seconds == doctest::Approx(3.097152e-3));
  CHECK(p.backward.steps[1].communication_bound);
  // A fast link: nothing waits; each phase is the busiest rank's compute, step by step.
  const cost::cluster fast{.nodes = 1, .gpus_per_node = 2, .intra_node = {.gbytes_per_s = 1e6, .latency_us = 0}};
  const cost::layer_prediction q = cost::predict_ring(entries, rows, topology::flat_ring(2), shape_of(1024), kernel, fast);
  CHECK(q.forward.seconds == doctest::Approx(1.3e-3).epsilon(1e-4));
  CHECK(q.forward.communication_bound_steps() == 0);
  CHECK(q.backward.seconds == doctest::Approx(1.3e-3).epsilon(1e-3));
  CHECK_THROWS_AS(cost::predict_ring(entries, rows, topology::flat_ring(2), shape_of(1024), kernel, cost::cluster{.nodes = 1, .gpus_per_node = 3}),
                  invalid_argument);
}

TEST_CASE("cost model: counts that do not fill the ring's ranks x steps, or are negative, are refused") {
  // The predictions and reschedule indexed the counts unchecked (entries {2, 2, {}}: a null read;
  // {2, 2, {1}}: heap-buffer-overflow), and negative counts predicted negative times.
  const cost::kernel_throughput k = cost::h200_kernel_throughput(128);
  const cost::cluster two{.nodes = 1, .gpus_per_node = 2};
  const ring_workload good{2, 2, {1000, 300, 200, 400}}, empty{2, 2, {}}, short_one{2, 2, {1}}, negative{1, 1, {-1000000000000}};
  CHECK_THROWS_WITH_AS(cost::predict_ring(empty, good, topology::flat_ring(2), shape_of(1024), k, two),
                       "stria: entries.entries.size() = 0: must be world_size x num_steps = 4", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_ring(good, short_one, topology::flat_ring(2), shape_of(1024), k, two),
                       "stria: rows.entries.size() = 1: must be world_size x num_steps = 4", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_ring(good, good, topology::flat_ring(2), shape_of(1024), k, two, short_one),
                       "stria: vertical_padding.entries.size() = 1: must be world_size x num_steps = 4", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_shared_gpu(short_one, short_one, shape_of(1024), k),
                       "stria: entries.entries.size() = 1: must be world_size x num_steps = 4", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_shared_gpu(negative, ring_workload{1, 1, {0}}, shape_of(1024), k),
                       "stria: entries.entries[0] = -1000000000000: counts must be >= 0", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::reschedule(empty, topology::hierarchical_ring(1, 2)),
                       "stria: reschedule: workload.entries.size() = 0: must be world_size x num_steps = 4", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_one_gpu(-1000000000000, shape_of(1024), k), "stria: total_entries = -1000000000000: must be >= 0", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_one_gpu(1000, shape_of(1024), k, -1), "stria: vertical_padding = -1: must be >= 0", invalid_argument);
}

TEST_CASE("cost model: more bandwidth never predicts a slower layer") {
  const global_selection g = vs_input(16384);
  for (const auto streams : {cost::transfer_streams::one_per_rank, cost::transfer_streams::one_per_link}) {
    double flat_before[2] = {1e30, 1e30}, hier_before[2] = {1e30, 1e30};
    for (const double gbytes : {0.5, 2.0, 8.0, 32.0, 128.0, 512.0}) {
      CAPTURE(gbytes);
      const cost::cluster c{.nodes = 2, .gpus_per_node = 4, .intra_node = {.gbytes_per_s = 4 * gbytes, .latency_us = 10},
                            .inter_node = {.gbytes_per_s = gbytes, .latency_us = 20}, .streams = streams};
      const cost::layer_prediction flat = predict(g, topology::flat_ring(8), c), hier = predict(g, topology::hierarchical_ring(2, 4), c);
      CHECK(flat.forward.seconds <= flat_before[0] * (1 + 1e-12));
      CHECK(flat.backward.seconds <= flat_before[1] * (1 + 1e-12));
      CHECK(hier.forward.seconds <= hier_before[0] * (1 + 1e-12));
      CHECK(hier.backward.seconds <= hier_before[1] * (1 + 1e-12));
      flat_before[0] = flat.forward.seconds, flat_before[1] = flat.backward.seconds;
      hier_before[0] = hier.forward.seconds, hier_before[1] = hier.backward.seconds;
    }
    // A slow network makes the flat ring communication-bound, and it is slower than a fast one.
    const cost::cluster slow{.nodes = 2, .gpus_per_node = 4, .inter_node = {.gbytes_per_s = 0.5, .latency_us = 20}, .streams = streams};
    CHECK(predict(g, topology::flat_ring(8), slow).forward.communication_bound_steps() > 0);
    CHECK(predict(g, topology::flat_ring(8), slow).forward.seconds > flat_before[0]);
  }
}

TEST_CASE("cost model: more GPUs at fixed tokens per GPU never compute less in all") {
  double before[2] = {0, 0};
  for (const index_t world : {1, 2, 4, 8}) {
    CAPTURE(world);
    const global_selection g = vs_input(4096 * world);
    const cost::layer_prediction p = predict(g, topology::flat_ring(world), cost::cluster{.nodes = 1, .gpus_per_node = world});
    const double total[2] = {std::accumulate(p.forward.rank_compute_seconds.begin(), p.forward.rank_compute_seconds.end(), 0.0),
                             std::accumulate(p.backward.rank_compute_seconds.begin(), p.backward.rank_compute_seconds.end(), 0.0)};
    CHECK(total[0] >= before[0]);
    CHECK(total[1] >= before[1]);
    CHECK(p.forward.seconds >= p.forward.busiest_compute_seconds() * (1 - 1e-12));
    before[0] = total[0], before[1] = total[1];
  }
}

TEST_CASE("cost model: the hierarchical ring hides an outer transfer behind an inner round") {
  // Dense causal attention over 2 nodes x 4 GPUs, an inter-node link on which one KV message takes
  // about 2.5 steps of compute: longer than a step, shorter than a round of 4.
  const index_t seq_len = 8192;
  const global_selection g = test::band_selection(seq_len, 8, 0, seq_len / 64 - 1, true);
  const cost::cluster probe{.nodes = 2, .gpus_per_node = 4};
  const double step = predict(g, topology::hierarchical_ring(2, 4), probe).forward.busiest_compute_seconds() / 8;
  const double kv = shape_of(seq_len).kv_bytes(seq_len / 8);
  const cost::link network{.gbytes_per_s = kv / (2.5 * step) / 1e9, .latency_us = 0};
  const cost::link nvlink{.gbytes_per_s = 1e4, .latency_us = 0};  // the inner ring keeps up at this small size
  const cost::cluster design{.nodes = 2, .gpus_per_node = 4, .intra_node = nvlink, .inter_node = network, .streams = cost::transfer_streams::one_per_link};
  const cost::layer_prediction hier = predict(g, topology::hierarchical_ring(2, 4), design);
  const cost::layer_prediction flat = predict(g, topology::flat_ring(8), design);
  CHECK(hier.forward.communication_bound_steps() == 0);
  CHECK(flat.forward.communication_bound_steps() > 0);
  CHECK(hier.forward.seconds < flat.forward.seconds);
  // With every transfer of a rank on one stream (the device engine), the next inner transfer waits
  // behind the outer one: the hierarchy no longer hides it.
  cost::cluster engine = design;
  engine.streams = cost::transfer_streams::one_per_rank;
  const cost::layer_prediction queued = predict(g, topology::hierarchical_ring(2, 4), engine);
  CHECK(queued.forward.communication_bound_steps() > 0);
  CHECK(queued.forward.seconds > hier.forward.seconds);
}

TEST_CASE("cost model: the solver's two stages") {
  const global_selection g = vs_input(16384);
  // One rank: no moves; the layer is its kernels.
  {
    const solver::problem p = solver::problem_from_selection(g, 1, 2, 2);
    const solver::plan x = solver::solve(p);
    const cost::kernel_throughput k = cost::h200_kernel_throughput(128);
    const cost::layer_prediction l = cost::predict_solver(p, x, cost::solver_task_rows(g, p), shape_of(16384), k, cost::cluster{.nodes = 1, .gpus_per_node = 1});
    // One call per task, a (query chunk, KV chunk) pair with work; all but a chunk's first read its
    // running output (chunk 0: one task, chunk 1: two).
    double seconds = cost::running_state_read_bytes(shape_of(16384), p.chunk_tokens) / (k.memory_gbytes_per_s * 1e9);
    const std::vector<std::int64_t> task_rows = cost::solver_task_rows(g, p);
    for (std::size_t i = 0; i < p.area.size(); ++i)
      if (p.area[i] > 0) seconds += k.forward.seconds(cost::entry_flops(128, false) * double(p.area[i]), double(task_rows[i]));
    CHECK(l.forward.seconds == doctest::Approx(seconds));
    CHECK_FALSE(l.forward.steps[0].communication_bound);
  }
  // Four ranks: the moves and returns cost time; more bandwidth is never slower.
  const solver::problem p = solver::problem_from_selection(g, 4, 2, 2);
  const solver::plan x = solver::solve(p);
  double before = 1e30;
  for (const double gbytes : {1.0, 10.0, 100.0, 1000.0}) {
    const cost::cluster c{.nodes = 1, .gpus_per_node = 4, .intra_node = {.gbytes_per_s = gbytes, .latency_us = 10}};
    const cost::layer_prediction l = cost::predict_solver(p, x, cost::solver_task_rows(g, p), shape_of(16384), cost::h200_kernel_throughput(128), c);
    CHECK(l.seconds() <= before);
    CHECK(l.forward.seconds >= l.forward.busiest_compute_seconds());
    before = l.seconds();
  }
}

TEST_CASE("cost model: the solver's prediction refuses a plan, shape or selection of another problem") {
  // predict_solver read the plan unchecked: a task of chunk 7 of 2 read past task_rows, a move to
  // rank 99 wrote past the per-rank tables (ASan heap-buffer-overflow); a layer_shape of 1M tokens
  // was priced with the problem's 128-token chunks; solver_task_rows counted a selection of another
  // length for the problem's chunks.
  const global_selection g = vs_input(1024);
  const solver::problem p = solver::problem_from_selection(g, 2, 1, 2);
  const solver::plan x = solver::solve(p);
  const std::vector<std::int64_t> rows = cost::solver_task_rows(g, p);
  const cost::kernel_throughput k = cost::h200_kernel_throughput(128);
  const cost::cluster two{.nodes = 1, .gpus_per_node = 2};
  CHECK_NOTHROW(cost::predict_solver(p, x, rows, shape_of(1024), k, two));
  solver::plan bad_task = x;
  bad_task.local_tasks[0].push_back({7, 9, 5});
  CHECK_THROWS_WITH_AS(cost::predict_solver(p, bad_task, rows, shape_of(1024), k, two),
                       doctest::Contains("].query_chunk = 7: must be a chunk in [0, 2)"), invalid_argument);
  solver::plan bad_move = x;
  bad_move.moves.push_back({solver::chunk_move::kind::qo, 0, 99});
  CHECK_THROWS_WITH_AS(cost::predict_solver(p, bad_move, rows, shape_of(1024), k, two),
                       doctest::Contains(".to = 99: must be a rank in [0, 2) other than the chunk's owner 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_solver(p, x, rows, shape_of(1 << 20), k, two),
                       "stria: layer_shape.seq_len = 1048576: must equal the problem's chunks x chunk tokens = 1024", invalid_argument);
  cost::layer_shape other_heads = shape_of(1024);
  other_heads.heads_q = 64;
  CHECK_THROWS_WITH_AS(cost::predict_solver(p, x, rows, other_heads, k, two), doctest::Contains("layer_shape.heads_q = 64: must equal the problem's heads_q = 8"),
                       invalid_argument);
  std::vector<std::int64_t> negative = rows;
  negative[0] = -5;
  CHECK_THROWS_WITH_AS(cost::predict_solver(p, x, negative, shape_of(1024), k, two), "stria: task_rows = -5: counts must be >= 0", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::solver_task_rows(vs_input(2048), p),
                       "stria: selection.seq_len = 2048: must equal the problem's chunks x chunk tokens = 1024 (a problem of another selection?)",
                       invalid_argument);
  CHECK_THROWS_AS(cost::solver_task_vertical_padding(vs_input(2048), p), invalid_argument);
}

TEST_CASE("cost model: the gathered tiles' padding costs both directions its FLOPs, on a ring, a shared GPU and the solver") {
  const global_selection g = vs_input(8192);
  const topology::flat_ring flat(4);
  const ring_workload entries = count_ring_workload(g, sharding::striped<64>{}, flat), rows = cost::count_ring_rows(g, sharding::striped<64>{}, flat),
                      padding = cost::count_ring_vertical_padding(g, sharding::striped<64>{}, flat);
  REQUIRE(padding.total() > 0);
  // The three terms, whose FLOPs term is linear (the curve's speed moves with the padding too).
  const cost::kernel_throughput measured = cost::h200_kernel_throughput(128);
  cost::kernel_throughput k = measured;
  k.forward.curve.clear();
  k.backward.curve.clear();
  const cost::link instant{.gbytes_per_s = 1e9, .latency_us = 0};
  const cost::cluster c{.nodes = 1, .gpus_per_node = 4, .intra_node = instant, .inter_node = instant};
  const cost::layer_prediction without = cost::predict_ring(entries, rows, flat, shape_of(8192), k, c);
  const cost::layer_prediction with = cost::predict_ring(entries, rows, flat, shape_of(8192), k, c, padding);
  for (index_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    const double flops = double(padding.rank_total(r));
    CHECK(with.forward.rank_compute_seconds[static_cast<std::size_t>(r)] - without.forward.rank_compute_seconds[static_cast<std::size_t>(r)] ==
          doctest::Approx(cost::entry_flops(128, false) * flops / (k.forward.tflops * 1e12)).epsilon(1e-9));
    CHECK(with.backward.rank_compute_seconds[static_cast<std::size_t>(r)] - without.backward.rank_compute_seconds[static_cast<std::size_t>(r)] ==
          doctest::Approx(cost::entry_flops(128, true) * flops / (k.backward.tflops * 1e12)).epsilon(1e-9));
  }
  CHECK(with.seconds() > without.seconds());
  // One GPU: the same sum.
  const std::int64_t one = cost::count_ring_vertical_padding(g, sharding::striped<64>{}, topology::flat_ring(1)).total();
  CHECK(cost::predict_one_gpu(entries.total(), shape_of(8192), k, one).forward.seconds - cost::predict_one_gpu(entries.total(), shape_of(8192), k).forward.seconds ==
        doctest::Approx(cost::entry_flops(128, false) * double(one) / (k.forward.tflops * 1e12)).epsilon(1e-9));
  CHECK(cost::predict_one_gpu(entries.total(), shape_of(8192), measured, one).seconds() > cost::predict_one_gpu(entries.total(), shape_of(8192), measured).seconds());
  // Ranks sharing one GPU: the same sum over all ranks.
  const double shared_extra = cost::predict_shared_gpu(entries, rows, shape_of(8192), k, padding).forward.seconds -
                              cost::predict_shared_gpu(entries, rows, shape_of(8192), k).forward.seconds;
  CHECK(shared_extra == doctest::Approx(cost::entry_flops(128, false) * double(padding.total()) / (k.forward.tflops * 1e12)).epsilon(1e-9));
  // The hierarchical ring's counts are the flat ring's, rescheduled.
  const topology::hierarchical_ring h(2, 2);
  CHECK(cost::reschedule(padding, h).entries == cost::count_ring_vertical_padding(g, sharding::striped<64>{}, h).entries);
  // The solver's tasks: each task's padding is its (query chunk, KV chunk) pair's in a sequential ring over the chunks.
  const solver::problem p = solver::problem_from_selection(g, 2, 2, 2);
  const std::vector<std::int64_t> task_padding = cost::solver_task_vertical_padding(g, p);
  const ring_workload chunk_padding = cost::count_ring_vertical_padding(g, sharding::sequential{}, topology::flat_ring(4));
  for (index_t i = 0; i < 4; ++i)
    for (index_t j = 0; j < 4; ++j) {
      const index_t step = ((i - j) % 4 + 4) % 4;  // at step s chunk i meets KV chunk (i - s) mod 4
      CHECK(task_padding[static_cast<std::size_t>(i * 4 + j)] == chunk_padding.at(i, step));
    }
  CHECK(std::accumulate(task_padding.begin(), task_padding.end(), std::int64_t{0}) > 0);
  const solver::plan x = solver::solve(p);
  const cost::cluster two{.nodes = 1, .gpus_per_node = 2, .intra_node = instant, .inter_node = instant};
  CHECK(cost::predict_solver(p, x, cost::solver_task_rows(g, p), shape_of(8192), k, two, task_padding).seconds() >
        cost::predict_solver(p, x, cost::solver_task_rows(g, p), shape_of(8192), k, two).seconds());
  // Padding counted for another ring is refused.
  const ring_workload other = cost::count_ring_vertical_padding(g, sharding::striped<64>{}, topology::flat_ring(2));
  CHECK_THROWS_WITH_AS(cost::predict_ring(entries, rows, flat, shape_of(8192), k, c, other),
                       "stria: vertical_padding world_size = 2: must be counted for this topology, as the entries are", invalid_argument);
}

TEST_CASE("cost model: a ring's forward streams the fp32 running state, a shared GPU's ranks overlap their calls") {
  // The running state beyond an overwriting call: none on the first step, the old output read on
  // every later one (4 bytes an element); none in a one-step ring.
  const cost::layer_shape shape = shape_of(8192);
  const double elements = 2048.0 * 8 * 128;  // 2048 tokens of a rank, Hq 8, D 128
  CHECK(cost::running_state_bytes(shape, 2048, 0, 1) == 0);
  CHECK(cost::running_state_bytes(shape, 2048, 0, 4) == 0);
  CHECK(cost::running_state_bytes(shape, 2048, 1, 4) == 4 * elements);
  CHECK(cost::running_state_bytes(shape, 2048, 2, 4) == 4 * elements);
  CHECK(cost::running_state_bytes(shape, 2048, 3, 4) == 4 * elements);

  const global_selection g = vs_input(8192);
  const topology::flat_ring flat(4);
  const ring_workload entries = count_ring_workload(g, sharding::striped<64>{}, flat), rows = cost::count_ring_rows(g, sharding::striped<64>{}, flat);
  const cost::kernel_throughput k = cost::h200_kernel_throughput(128);
  cost::kernel_throughput fast_memory = k;
  fast_memory.memory_gbytes_per_s = 1e12;  // the state's traffic all but free
  const cost::link instant{.gbytes_per_s = 1e9, .latency_us = 0};
  const cost::cluster c{.nodes = 1, .gpus_per_node = 4, .intra_node = instant, .inter_node = instant};
  const cost::layer_prediction ring = cost::predict_ring(entries, rows, flat, shape, k, c);
  const cost::layer_prediction ring_free = cost::predict_ring(entries, rows, flat, shape, fast_memory, c);
  const double state_seconds = (0 + 4 + 4 + 4) * elements / (k.memory_gbytes_per_s * 1e9);  // each rank's four steps
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(ring.forward.rank_compute_seconds[r] - ring_free.forward.rank_compute_seconds[r] == doctest::Approx(state_seconds).epsilon(1e-6));
    CHECK(ring.backward.rank_compute_seconds[r] == ring_free.backward.rank_compute_seconds[r]);
  }

  // The solver's forward tasks merge into their query chunk's running output on the rank, which
  // starts empty: every task but a chunk's first there reads the old output.
  const solver::problem sp = solver::problem_from_selection(g, 2, 2, 2);
  const solver::plan plan = solver::solve(sp);
  const cost::cluster two{.nodes = 1, .gpus_per_node = 2, .intra_node = instant, .inter_node = instant};
  const std::vector<std::int64_t> task_rows = cost::solver_task_rows(g, sp);
  const cost::layer_prediction solved = cost::predict_solver(sp, plan, task_rows, shape, k, two);
  const cost::layer_prediction solved_free = cost::predict_solver(sp, plan, task_rows, shape, fast_memory, two);
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    std::set<index_t> chunks;
    for (const auto* tasks : {&plan.local_tasks[r], &plan.remote_tasks[r]})
      for (const solver::task& t : *tasks) chunks.insert(t.query_chunk);
    const double merges = double(plan.local_tasks[r].size() + plan.remote_tasks[r].size() - chunks.size());
    REQUIRE(merges > 0);
    CHECK(solved.forward.rank_compute_seconds[r] - solved_free.forward.rank_compute_seconds[r] ==
          doctest::Approx(merges * cost::running_state_read_bytes(shape, sp.chunk_tokens) / (k.memory_gbytes_per_s * 1e9)).epsilon(1e-6));
    CHECK(solved.backward.rank_compute_seconds[r] == solved_free.backward.rank_compute_seconds[r]);
  }

  // Sharing one GPU: a forward step is its calls one after another, state included; a backward
  // step takes the ranks' work at the long-run rates with one call's cost, or its slowest call
  // alone where that is longer, and never more than its calls one after another.
  // The memory speed, the head dim and the world size are checked.
  cost::kernel_throughput no_memory = k;
  no_memory.memory_gbytes_per_s = 0;
  CHECK_THROWS_WITH_AS(cost::predict_ring(entries, rows, flat, shape, no_memory, c),
                       "stria: kernel_throughput.memory_gbytes_per_s = 0: must be finite and at least 1e-6", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::predict_shared_gpu(entries, rows, shape, cost::h200_kernel_throughput(64)),
                       "stria: kernel_throughput.head_dim = 64: must equal the layer's head_dim 128", invalid_argument);
  const ring_workload three{3, 3, std::vector<std::int64_t>(9, 1)};
  CHECK_THROWS_WITH_AS(cost::predict_shared_gpu(three, three, shape, k), "stria: layer_shape.seq_len = 8192: must be divisible by the world size 3",
                       invalid_argument);
  const cost::layer_prediction shared = cost::predict_shared_gpu(entries, rows, shape, k);
  for (const bool backward : {false, true}) {
    CAPTURE(backward);
    const cost::kernel_speed& speed = backward ? k.backward : k.forward;
    const cost::kernel_speed long_run{.tflops = speed.tflops, .row_ns = speed.row_ns, .call_us = 0};
    const cost::phase_prediction& phase = backward ? shared.backward : shared.forward;
    const double per_entry = cost::entry_flops(128, backward);
    for (index_t s = 0; s < 4; ++s) {
      CAPTURE(s);
      const double state = backward ? 0.0 : cost::running_state_bytes(shape, 2048, s, 4) / (k.memory_gbytes_per_s * 1e9);
      double at_long_run = speed.call_us * 1e-6, slowest = 0, one_after_another = 0;
      for (index_t r = 0; r < 4; ++r) {
        const double alone = speed.seconds(per_entry * double(entries.at(r, s)), double(rows.at(r, s))) + state;
        at_long_run += long_run.seconds(per_entry * double(entries.at(r, s)), double(rows.at(r, s)));
        slowest = std::max(slowest, alone);
        one_after_another += alone;
      }
      const double t = phase.steps[static_cast<std::size_t>(s)].compute_seconds;
      CHECK(t == doctest::Approx(backward ? std::max(at_long_run, slowest) : one_after_another).epsilon(1e-9));
      CHECK(t <= one_after_another * (1 + 1e-9));
    }
  }
}
