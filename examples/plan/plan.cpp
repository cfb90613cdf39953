// SPDX-License-Identifier: Apache-2.0
// plan: how evenly each sharding x ring topology spreads a Vertical-Slash pattern over the ranks.
// For a synthetic VS input (or a recorded selection) it prints, per combination, the worker- and
// step-level imbalance degrees and the busiest rank's attention FLOPs; with --solver, the dynamic
// solver's plan of the same selection. Runs on any machine.
#include <stria/comm/host_threads.hpp>
#include <stria/estimator/vertical_slash_top_p.hpp>
#include <stria/estimator/window_statistics.hpp>
#include <stria/host/recall.hpp>
#include <stria/host/synthetic_vs.hpp>
#include <stria/index/workload.hpp>
#include <stria/sharding/dispatch.hpp>
#include <stria/sharding/sequential.hpp>
#include <stria/sharding/striped.hpp>
#include <stria/sharding/zigzag.hpp>
#include <stria/solver/dynamic_solver.hpp>
#include <stria/topology/flat_ring.hpp>
#include <stria/topology/hierarchical_ring.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "plan_input.hpp"

namespace {

using plan_input::options;
using plan_input::parse;
using plan_input::read_selection;

struct row {
  std::string sharding, topology;
  stria::imbalance_degrees imbalance;
  double max_rank_flops;
  double total_flops;
};

template <class Sharding, class Topology>
row plan_one(const stria::global_selection& g, const Sharding& sharding, const Topology& topology, stria::index_t head_dim,
             const std::string& topology_name) {
  const stria::ring_workload w = stria::count_ring_workload(g, sharding, topology);
  return {std::string(Sharding::name), topology_name, stria::measure_imbalance(w), stria::forward_flops(w.max_rank_total(), head_dim),
          stria::forward_flops(w.total(), head_dim)};
}

/// The distributed estimator on `world` simulated ranks (striped<64> shards); every rank must agree.
stria::global_selection estimate_on_ranks(const stria::host::synthetic_vs& data, const stria::host::synthetic_vs_options& s,
                                          stria::index_t world, double& seconds) {
  const auto start = std::chrono::steady_clock::now();
  const stria::sharding::striped<64> sharding;
  const stria::index_t local = s.seq_len / world;
  const auto q = stria::sharding::split(sharding, std::span<const float>(data.q), std::array<stria::index_t, 3>{s.seq_len, s.heads_q, s.head_dim}, world);
  const auto k = stria::sharding::split(sharding, std::span<const float>(data.k), std::array<stria::index_t, 3>{s.seq_len, s.heads_kv, s.head_dim}, world);
  std::vector<stria::global_selection> found(static_cast<std::size_t>(world));
  stria::comm::host_world ranks(world);
  ranks.run([&](stria::comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    found[r] = stria::estimator::estimate(stria::estimator::vertical_slash_top_p{}, c, sharding, s.seq_len, true,
                                          stria::tensor_view<const float, 3>(q[r].data(), {local, s.heads_q, s.head_dim}),
                                          stria::tensor_view<const float, 3>(k[r].data(), {local, s.heads_kv, s.head_dim}),
                                          1.0 / std::sqrt(double(s.head_dim)));
  });
  for (std::size_t r = 1; r < found.size(); ++r)
    for (std::size_t h = 0; h < found[0].heads.size(); ++h)
      if (found[r].heads[h].vertical_tokens != found[0].heads[h].vertical_tokens || found[r].heads[h].slash_deltas != found[0].heads[h].slash_deltas)
        throw stria::comm_error("ranks 0 and " + std::to_string(r) + " estimated different selections");
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return found[0];
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  const auto start = std::chrono::steady_clock::now();
  stria::global_selection g;
  std::string source = "synthetic";
  double estimate_seconds = 0, recall_mean = -1, recall_min = -1;
  if (!o.selection_file.empty()) {
    g = read_selection(o.selection_file);
    source = "selection";
  } else {
    stria::host::synthetic_vs_options s;
    s.seq_len = o.seq_len;
    s.heads_q = o.heads_q;
    s.heads_kv = o.heads_kv;
    s.head_dim = o.head_dim;
    s.rope_theta = o.rope_theta;
    s.density = 1.0 - o.sparsity;
    s.seed = o.seed;
    if (!o.estimate) {
      g = stria::host::plant_vs_selection(s);
    } else {
      source = "estimated";
      const stria::host::synthetic_vs data = stria::host::make_synthetic_vs(s);
      g = estimate_on_ranks(data, s, o.world, estimate_seconds);
      if (o.seq_len <= 16384) {
        const stria::host::recall_summary r = stria::host::attention_recall(
            g, stria::tensor_view<const float, 3>(data.q.data(), {o.seq_len, o.heads_q, o.head_dim}),
            stria::tensor_view<const float, 3>(data.k.data(), {o.seq_len, o.heads_kv, o.head_dim}), 1.0 / std::sqrt(double(o.head_dim)));
        recall_mean = r.mean;
        recall_min = r.min;
      }
    }
  }
  const stria::index_t cards = o.world / o.nodes;
  std::vector<row> rows;
  auto plan_sharding = [&](const auto& sharding) {
    rows.push_back(plan_one(g, sharding, stria::topology::flat_ring(o.world), o.head_dim, "flat_ring"));
    if (o.nodes > 1)
      rows.push_back(plan_one(g, sharding, stria::topology::hierarchical_ring(o.nodes, cards), o.head_dim,
                              "hierarchical_ring(" + std::to_string(o.nodes) + "x" + std::to_string(cards) + ")"));
  };
  plan_sharding(stria::sharding::sequential{});
  plan_sharding(stria::sharding::zigzag{});
  plan_sharding(stria::sharding::striped<64>{});

  // The dynamic solver's plan of the same selection (sequential sharding, M chunks per rank).
  struct solver_row {
    double max_load_over_mean = 0, volume_over_ring = 0, solve_ms = 0;
    bool feasible = false;
    std::size_t moves = 0;
  } solved;
  if (o.solver_chunks > 0) {
    const stria::solver::problem p = stria::solver::problem_from_selection(g, o.world, o.solver_chunks, o.heads_kv);
    const auto t0 = std::chrono::steady_clock::now();
    const stria::solver::plan x = stria::solver::solve(p, {1.10, o.volume_cap});
    solved = {x.max_load_over_mean(), double(stria::solver::comm_volume(p, x)) / double(p.ring_volume()),
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(), x.feasible, x.moves.size()};
  }

  const double causal_entries = double(g.seq_len) * (double(g.seq_len) + 1.0) / 2.0 * g.num_heads();
  const double density = rows.front().total_flops / (4.0 * o.head_dim) / causal_entries;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (o.json) {
    nlohmann::ordered_json config = {{"seq_len", g.seq_len}, {"world", o.world},   {"nodes", o.nodes},           {"heads_q", g.num_heads()},
                                     {"heads_kv", o.heads_kv}, {"head_dim", o.head_dim}, {"sparsity", 1.0 - density}, {"density", density},
                                     {"source", source},     {"seed", o.seed},     {"seconds", seconds}};
    if (o.estimate) {
      config["estimator"] = "vertical_slash_top_p";
      config["estimate_seconds"] = estimate_seconds;
      config["recall_mean"] = recall_mean >= 0 ? nlohmann::ordered_json(recall_mean) : nlohmann::ordered_json();
      config["recall_min"] = recall_min >= 0 ? nlohmann::ordered_json(recall_min) : nlohmann::ordered_json();
    }
    nlohmann::ordered_json out = {{"config", config}, {"rows", nlohmann::ordered_json::array()}};
    for (const row& r : rows)
      out["rows"].push_back({{"sharding", r.sharding},
                             {"topology", r.topology},
                             {"worker_imbalance", r.imbalance.worker_mean},
                             {"worker_imbalance_max", r.imbalance.worker_max},
                             {"step_imbalance", r.imbalance.step_mean},
                             {"step_imbalance_max", r.imbalance.step_max},
                             {"max_rank_flops", r.max_rank_flops}});
    if (o.solver_chunks > 0)
      out["solver"] = {{"chunks_per_rank", o.solver_chunks},
                       {"volume_cap", o.volume_cap},
                       {"max_load_over_mean", solved.max_load_over_mean},
                       {"volume_over_ring", solved.volume_over_ring},
                       {"feasible", solved.feasible},
                       {"moves", solved.moves},
                       {"solve_ms", solved.solve_ms}};
    std::printf("%s\n", out.dump(1).c_str());
    return 0;
  }
  std::printf("plan: seq_len %d, world %d (%d node%s), heads %d, head_dim %d, %s pattern, density %.2f%% of causal entries\n",
              g.seq_len, o.world, o.nodes, o.nodes > 1 ? "s" : "", g.num_heads(), o.head_dim,
              o.estimate ? "estimated (vertical_slash_top_p)" : o.selection_file.empty() ? "synthetic Vertical-Slash" : o.selection_file.c_str(),
              100.0 * density);
  if (o.estimate) {
    std::printf("estimator on %d simulated ranks: %.2f s", o.world, estimate_seconds);
    if (recall_mean >= 0) std::printf("; recalled attention mass over all query rows: mean %.4f, min %.4f", recall_mean, recall_min);
    else std::printf("; recall not computed (needs --seq-len <= 16384)");
    std::printf("\n");
  }
  std::printf("imbalance = busiest / mean (1.00 is perfect); worker: over ranks within a step, step: over one rank's steps\n\n");
  std::printf("%-11s %-26s %17s %17s %22s\n", "sharding", "topology", "worker mean/max", "step mean/max", "busiest rank fwd GFLOP");
  for (const row& r : rows)
    std::printf("%-11s %-26s %8.3f /%7.3f %8.3f /%7.3f %22.1f\n", r.sharding.c_str(), r.topology.c_str(), r.imbalance.worker_mean,
                r.imbalance.worker_max, r.imbalance.step_mean, r.imbalance.step_max, r.max_rank_flops * 1e-9);
  if (o.solver_chunks > 0)
    std::printf("\ndynamic solver (sequential, %d chunks per rank, mu 1.10, volume cap %.2f): busiest rank / mean %.3f, volume %.3f of the\n"
                "flat ring's, %zu chunk moves, %s (solved in %.1f ms)\n",
                o.solver_chunks, o.volume_cap, solved.max_load_over_mean, solved.volume_over_ring, solved.moves,
                solved.feasible ? "balanced within mu" : "not balanced within mu under the cap", solved.solve_ms);
  std::printf("\n(%.2f s)\n", seconds);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
