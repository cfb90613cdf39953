// SPDX-License-Identifier: Apache-2.0
// Benchmark (a program, not a test; host only, one thread): balance_stripes' placement time and the
// worker- and step-level imbalance of its placement on a flat ring, against striped<64>, on the
// generator's heavy-tailed families at 128K and 512K tokens and W = 8 to 256.
//   stripe_bench [--seq-len 131072,524288] [--world 8,32,128,256] [--pattern LIST] [--heads-q 16]
//                [--heads-kv 2] [--sparsity 0.95] [--runs N] [--json] [--commit SHA]
// (--pattern: comma-separated of rope, power_law_slash, periodic_slash, clustered_vertical, mixture;
// default the four heavy-tailed ones. Each row places N times, default 3: placement_ms is the
// median of the placing thread's CPU time (the cores may be shared), placement_min_ms the least,
// wall_ms the median wall time. Imbalance as measure_imbalance reports it: mean and max over the
// ring's steps (worker) and ranks (step); round_bound: the least busiest-rank KV-side or query-side load / mean of any
// placement with one block per rank in each round of W blocks, as balance_stripes places them.)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "stria/host/synthetic_vs.hpp"
#include "stria/index/stripe_balance.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/topology/flat_ring.hpp"
#include "args.hpp"

using namespace stria;

namespace {

/// CPU time of the calling thread: a placement's own cost, apart from other work sharing the cores.
double thread_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) * 1e-6;
}

struct row {
  std::string pattern;
  index_t seq_len, world;
  double placement_ms, min_ms, wall_ms;
  imbalance_degrees placed, striped;
  double round_bound;
};

/// The least busiest-rank load / mean load, on the KV side or the query side, of any placement
/// that gives every rank one block of each round of W blocks (balance_stripes' shape): the rank
/// holding block b also holds at least the lightest block of every other round. A flat ring's
/// worker imbalance is about at least this (each step meets the busiest KV rank once).
double round_bound(const block_costs& costs, index_t world) {
  double bound = 0.0;
  for (const auto* side : {&costs.key_entries, &costs.query_entries}) {
    const std::vector<std::int64_t>& cost = *side;
    const auto rounds = static_cast<std::size_t>(cost.size() / static_cast<std::size_t>(world));
    std::vector<double> lightest(rounds, std::numeric_limits<double>::infinity());
    double total = 0.0;
    for (std::size_t b = 0; b < cost.size(); ++b) {
      lightest[b / static_cast<std::size_t>(world)] = std::min(lightest[b / static_cast<std::size_t>(world)], double(cost[b]));
      total += double(cost[b]);
    }
    const double lightest_sum = std::accumulate(lightest.begin(), lightest.end(), 0.0);
    for (std::size_t b = 0; b < cost.size(); ++b)
      bound = std::max(bound, (double(cost[b]) + lightest_sum - lightest[b / static_cast<std::size_t>(world)]) / (total / double(world)));
  }
  return bound;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<index_t> seq_lens{131072, 524288}, worlds{8, 32, 128, 256};
  std::string patterns = "power_law_slash,periodic_slash,clustered_vertical,mixture", commit;
  index_t heads_q = 16, heads_kv = 2;
  double sparsity = 0.95;
  int runs = 3;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--json") json = true;
    else if (flag == "--seq-len" && i + 1 < argc) seq_lens = bench::parse_sizes(flag, argv[++i]);
    else if (flag == "--world" && i + 1 < argc) worlds = bench::parse_sizes(flag, argv[++i]);
    else if (flag == "--pattern" && i + 1 < argc) patterns = argv[++i];
    else if (flag == "--heads-q" && i + 1 < argc) heads_q = cli::parse_integer<index_t>(flag, argv[++i], 1, 1024);
    else if (flag == "--heads-kv" && i + 1 < argc) heads_kv = cli::parse_integer<index_t>(flag, argv[++i], 1, 1024);
    else if (flag == "--sparsity" && i + 1 < argc) sparsity = cli::parse_real(flag, argv[++i], 0.0, 0.999);
    else if (flag == "--runs" && i + 1 < argc) runs = cli::parse_integer<int>(flag, argv[++i], 1, 1000);
    else if (flag == "--commit" && i + 1 < argc) commit = argv[++i];
    else
      throw invalid_argument("flag", flag,
                             "must be --seq-len LIST, --world LIST, --pattern LIST, --heads-q N, --heads-kv N, --sparsity X, --runs N, --json "
                             "or --commit SHA");
  }
  const auto wanted = [&](const std::string& p) { return ("," + patterns + ",").find("," + p + ",") != std::string::npos; };
  std::vector<row> rows;
  if (!json)
    std::printf("stripe_bench: heads %d/%d, density %.3f, flat ring (%d placements: thread CPU ms median and min, wall ms median; bound: least "
                "busiest-rank load / mean of any one-block-per-round placement)\n%-19s %8s %5s %9s %7s %8s   %-27s   %-13s   %s\n",
                heads_q, heads_kv, 1.0 - sparsity, runs, "pattern", "seq_len", "world", "cpu ms", "min", "wall ms", "placed: worker mean/max, step mean/max",
                "striped: w, s", "bound");
  for (const host::vs_pattern pattern : {host::vs_pattern::rope, host::vs_pattern::power_law_slash, host::vs_pattern::periodic_slash,
                                         host::vs_pattern::clustered_vertical, host::vs_pattern::mixture}) {
    if (!wanted(host::pattern_name(pattern))) continue;
    for (const index_t seq_len : seq_lens) {
      host::synthetic_vs_options o;
      o.seq_len = seq_len;
      o.heads_q = heads_q;
      o.heads_kv = heads_kv;
      o.density = 1.0 - sparsity;
      o.pattern = pattern;
      const global_selection g = host::plant_vs_selection(o);
      for (const index_t world : worlds) {
        if (g.num_blocks() % world != 0) continue;
        std::vector<double> times, walls;
        sharding::placed_stripes placement;
        for (int i = 0; i < runs; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          const double c0 = thread_ms();
          sharding::placed_stripes p = balance_stripes(g, world);
          times.push_back(thread_ms() - c0);
          walls.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
          if (i > 0 && !(p == placement)) throw invalid_argument("balance_stripes", "(two runs)", "must give the same placement on the same input");
          placement = std::move(p);
        }
        std::sort(times.begin(), times.end());
        std::sort(walls.begin(), walls.end());
        const topology::flat_ring ring(world);
        rows.push_back({host::pattern_name(pattern), seq_len, world, times[times.size() / 2], times.front(), walls[walls.size() / 2],
                        measure_imbalance(count_ring_workload(g, placement, ring)),
                        measure_imbalance(count_ring_workload(g, sharding::striped<64>{}, ring)), round_bound(count_block_costs(g), world)});
        if (!json) {
          const row& r = rows.back();
          std::printf("%-19s %8d %5d %9.2f %7.2f %8.2f   %6.3f %6.3f %6.3f %6.3f   %6.3f %6.3f   %6.3f\n", r.pattern.c_str(), r.seq_len, r.world, r.placement_ms, r.min_ms,
                      r.wall_ms, r.placed.worker_mean, r.placed.worker_max, r.placed.step_mean, r.placed.step_max, r.striped.worker_mean, r.striped.step_mean, r.round_bound);
          std::fflush(stdout);
        }
      }
    }
  }
  if (json) {
    std::printf("{\n \"commit\": \"%s\",\n \"setting\": \"heads %d/%d, density %.3f, one thread, placement_ms: thread CPU time\",\n \"runs\": %d,\n \"rows\": [", commit.c_str(), heads_q,
                heads_kv, 1.0 - sparsity, runs);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const row& r = rows[i];
      std::printf("%s\n  {\"pattern\": \"%s\", \"seq_len\": %d, \"world\": %d, \"placement_ms\": %.3f, \"placement_min_ms\": %.3f, \"wall_ms\": %.3f, \"worker_mean\": %.4f, \"worker_max\": %.4f, "
                  "\"step_mean\": %.4f, \"step_max\": %.4f, \"striped_worker_mean\": %.4f, \"striped_step_mean\": %.4f, \"round_bound\": %.4f}",
                  i ? "," : "", r.pattern.c_str(), r.seq_len, r.world, r.placement_ms, r.min_ms, r.wall_ms, r.placed.worker_mean, r.placed.worker_max, r.placed.step_mean,
                  r.placed.step_max, r.striped.worker_mean, r.striped.step_mean, r.round_bound);
    }
    std::printf("\n ]\n}\n");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "stripe_bench: %s\n", e.what());
  return 1;
}
