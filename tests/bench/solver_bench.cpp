// SPDX-License-Identifier: Apache-2.0
// Benchmark (a program, not a test; host only): the dynamic solver's solve time, balance and
// communication volume against the flat ring, MagiAttention's setting: 8K tokens per rank, GQA 64:8,
// chunks of 1K tokens (8 per rank), W = 8 to 256, for full, causal and causal-document (varlen:
// documents of 1K-64K tokens) masks (task areas computed exactly in closed form), and VS selections
// (the generator's, task areas from the workload counter); plus, at S = 128K and W = 8 on a VS
// input, the flat striped ring's imbalance.
//   solver_bench [--world 8,16,32,64,128,256] [--mask full,causal,document,vs] [--volume-cap X]
//                [--runs N] [--json] [--commit SHA]
// (--volume-cap: a plan may move X times the flat ring's volume; default 1. Each row solves N times,
// default 7: solve_ms is the median, first_solve_ms the first solve of the row, which also pays for
// the fresh memory its plan is written to. --json: the rows as JSON on stdout, as
// tests/bench/results/solver_host.json; --commit names the commit measured there.)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "stria/host/synthetic_vs.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/topology/flat_ring.hpp"
#include "args.hpp"

using namespace stria;

namespace {

constexpr index_t tokens_per_rank = 8192, chunks_per_rank = 8, heads_q = 64, heads_kv = 8;
constexpr index_t chunk = tokens_per_rank / chunks_per_rank;

/// Pairs (q, k) with k <= q, q in [q0, q1), k in [k0, k1).
std::int64_t causal_pairs(std::int64_t q0, std::int64_t q1, std::int64_t k0, std::int64_t k1) {
  std::int64_t sum = 0;
  if (q0 >= q1 || k0 >= k1) return 0;
  // q >= k1 - 1: every key; k0 <= q < k1 - 1: q - k0 + 1 keys; q < k0: none.
  const std::int64_t full_from = std::max(q0, k1 - 1);
  if (full_from < q1) sum += (q1 - full_from) * (k1 - k0);
  const std::int64_t a = std::max(q0, k0), b = std::min(q1, k1 - 1);
  if (a < b) sum += (b - a) * (a - k0 + 1 + b - 1 - k0 + 1) / 2;
  return sum;
}

/// Closed-form task areas: full, causal, or causal within documents (sorted [start, end) token ranges).
solver::problem analytic(index_t world, const std::string& mask, const std::vector<std::pair<std::int64_t, std::int64_t>>& docs) {
  const index_t c = world * chunks_per_rank;
  solver::problem p{world, chunks_per_rank, chunk, heads_q, heads_kv, std::vector<std::int64_t>(std::size_t(c) * c, 0)};
  for (index_t i = 0; i < c; ++i)
    for (index_t j = 0; j < c; ++j) {
      const std::int64_t q0 = std::int64_t{i} * chunk, q1 = q0 + chunk, k0 = std::int64_t{j} * chunk, k1 = k0 + chunk;
      std::int64_t a = 0;
      if (mask == "full") a = std::int64_t{chunk} * chunk;
      else if (mask == "causal") a = causal_pairs(q0, q1, k0, k1);
      else
        for (const auto& [s, e] : docs) {
          if (e <= std::max(q0, k0) || s >= std::min(q1, k1)) continue;
          a += causal_pairs(std::max(q0, s), std::min(q1, e), std::max(k0, s), std::min(k1, e));
        }
      p.area[std::size_t(i) * c + j] = a * heads_q;
    }
  return p;
}

/// Documents of random lengths between 1K and 64K tokens (seeded), covering the sequence.
std::vector<std::pair<std::int64_t, std::int64_t>> random_documents(std::int64_t seq_len, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> length(1024, 65536);
  std::vector<std::pair<std::int64_t, std::int64_t>> docs;
  for (std::int64_t s = 0; s < seq_len;) {
    const std::int64_t e = std::min(seq_len, s + length(rng));
    docs.push_back({s, e});
    s = e;
  }
  return docs;
}

struct row {
  index_t world;
  std::string mask;
  double solve_ms, first_solve_ms, max_load_over_mean;
  std::int64_t comm_volume, ring_comm_volume, max_rank_traffic, ring_rank_traffic;
  std::size_t third_rank_tasks;
  bool feasible;
};

solver::options solve_options;
int runs = 7;

row run(const solver::problem& p, const std::string& mask) {
  std::vector<double> times;
  solver::plan x;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    solver::plan y = solver::solve(p, solve_options);
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    x = std::move(y);  // the previous plan is freed outside the timed call
  }
  const double first = times.front();
  std::sort(times.begin(), times.end());
  std::size_t third = 0;  // tasks on a rank that owns neither chunk
  for (index_t r = 0; r < p.world_size; ++r)
    for (const solver::task& t : x.remote_tasks[static_cast<std::size_t>(r)]) third += p.owner(t.query_chunk) != r && p.owner(t.kv_chunk) != r;
  // The flat ring's busiest rank receives every other rank's KV chunks.
  const std::int64_t ring_rank = std::int64_t{p.world_size - 1} * p.chunks_per_rank * p.kv_cost();
  return {p.world_size, mask, times[times.size() / 2], first, x.max_load_over_mean(), solver::comm_volume(p, x), p.ring_volume(), x.max_rank_traffic,
          ring_rank, third, x.feasible};
}


}  // namespace

int main(int argc, char** argv) try {
  std::vector<index_t> worlds{8, 16, 32, 64, 128, 256};
  std::string masks = "full,causal,document,vs", commit;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--json") json = true;
    else if (flag == "--world" && i + 1 < argc) worlds = bench::parse_sizes(flag, argv[++i]);
    else if (flag == "--mask" && i + 1 < argc) masks = argv[++i];
    else if (flag == "--volume-cap" && i + 1 < argc) solve_options.volume_cap = cli::parse_real(flag, argv[++i], 1e-9, 1e9);
    else if (flag == "--runs" && i + 1 < argc) runs = cli::parse_integer<int>(flag, argv[++i], 1, 1000);
    else if (flag == "--commit" && i + 1 < argc) commit = argv[++i];
    else
      throw invalid_argument("flag", flag,
                             "must be --world LIST, --mask LIST (of full, causal, document, vs), --volume-cap X, --runs N, --json or --commit SHA");
  }
  const auto wanted = [&](const std::string& mask) { return ("," + masks + ",").find("," + mask + ",") != std::string::npos; };
  std::vector<row> rows;
  for (const index_t w : worlds) {
    const std::int64_t seq_len = std::int64_t{w} * tokens_per_rank;
    for (const std::string mask : {"full", "causal", "document"})
      if (wanted(mask)) rows.push_back(run(analytic(w, mask, random_documents(seq_len, 7)), mask));
    if (wanted("vs")) {
      host::synthetic_vs_options o;
      o.seq_len = static_cast<index_t>(seq_len);
      o.heads_q = heads_q;
      o.heads_kv = heads_kv;
      o.density = 0.05;
      rows.push_back(run(solver::problem_from_selection(host::plant_vs_selection(o), w, chunks_per_rank, heads_kv), "vs"));
    }
  }
  if (json) {
    std::printf("{\n \"commit\": \"%s\",\n \"setting\": \"8K tokens per rank in 1K chunks, GQA 64:8, mu %.2f, volume cap %.2f\",\n \"runs\": %d,\n \"rows\": [",
                commit.c_str(), solve_options.mu, solve_options.volume_cap, runs);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const row& r = rows[i];
      std::printf("%s\n  {\"world\": %d, \"mask\": \"%s\", \"solve_ms\": %.3f, \"first_solve_ms\": %.3f, \"max_load_over_mean\": %.4f, "
                  "\"comm_volume\": %lld, \"ring_comm_volume\": %lld, \"volume_over_ring\": %.4f, \"max_rank_traffic\": %lld, "
                  "\"ring_rank_traffic\": %lld, \"third_rank_tasks\": %zu, \"feasible\": %s}",
                  i ? "," : "", r.world, r.mask.c_str(), r.solve_ms, r.first_solve_ms, r.max_load_over_mean, static_cast<long long>(r.comm_volume),
                  static_cast<long long>(r.ring_comm_volume), double(r.comm_volume) / double(r.ring_comm_volume),
                  static_cast<long long>(r.max_rank_traffic), static_cast<long long>(r.ring_rank_traffic), r.third_rank_tasks,
                  r.feasible ? "true" : "false");
    }
    std::printf("\n ]\n}\n");
    return 0;
  }
  std::printf("solver_bench: 8K tokens per rank in 1K chunks, GQA 64:8, mu %.2f (median of %d solves; first: the row's first solve)\n",
              solve_options.mu, runs);
  std::printf("%6s %-9s %10s %9s %9s %14s %16s %9s\n", "world", "mask", "solve ms", "first ms", "max/mean", "volume / ring", "busiest / ring's",
              "feasible");
  for (const row& r : rows)
    std::printf("%6d %-9s %10.2f %9.2f %9.3f %14.3f %16.3f %9s\n", r.world, r.mask.c_str(), r.solve_ms, r.first_solve_ms, r.max_load_over_mean,
                double(r.comm_volume) / double(r.ring_comm_volume), double(r.max_rank_traffic) / double(r.ring_rank_traffic),
                r.feasible ? "yes" : "no");
  if (!wanted("vs")) return 0;
  // The flat striped ring on a VS input at 128K over 8 ranks (what the solver is an alternative to).
  host::synthetic_vs_options o;
  o.seq_len = 131072;
  o.heads_q = 16;
  o.heads_kv = 2;
  o.density = 0.05;
  const global_selection g = host::plant_vs_selection(o);
  const imbalance_degrees ring = measure_imbalance(count_ring_workload(g, sharding::striped<64>{}, topology::flat_ring(8)));
  const solver::problem p = solver::problem_from_selection(g, 8, chunks_per_rank, 2);
  const solver::plan x = solver::solve(p, solve_options);
  std::printf("VS, S = 128K, W = 8 (Hq 16, Hkv 2): solver max/mean %.3f with %.3f of the ring's volume (feasible: %s); "
              "flat striped ring: worker imbalance %.3f (mean over steps), rank totals max/mean %.3f, all of the ring's volume\n",
              x.max_load_over_mean(), double(solver::comm_volume(p, x)) / double(p.ring_volume()), x.feasible ? "yes" : "no",
              ring.worker_mean, [&] {
                const ring_workload w = count_ring_workload(g, sharding::striped<64>{}, topology::flat_ring(8));
                return double(w.max_rank_total()) / (double(w.total()) / 8.0);
              }());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "solver_bench: %s\n", e.what());
  return 1;
}
