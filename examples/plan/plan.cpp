// SPDX-License-Identifier: Apache-2.0
// plan: how evenly each sharding x ring topology spreads a Vertical-Slash pattern over the ranks.
// For a synthetic VS input (or a recorded selection) it prints, per combination, the worker- and
// step-level imbalance degrees and the busiest rank's attention FLOPs (placed_stripes: 64-token
// stripes placed for this selection by balance_stripes); with --solver, the dynamic solver's plan of
// the same selection. With --cluster it predicts one layer's time on N nodes x G
// GPUs instead (stria/index/cost_model.hpp) and ranks the choices. Runs on any machine.
#include <stria/comm/host_threads.hpp>
#include <stria/estimator/vertical_slash_top_p.hpp>
#include <stria/estimator/window_statistics.hpp>
#include <stria/host/oracle_selection.hpp>
#include <stria/host/recall.hpp>
#include <stria/host/synthetic_vs.hpp>
#include <stria/index/cost_model.hpp>
#include <stria/index/stripe_balance.hpp>
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
#include <type_traits>
#include <vector>

#include "plan_input.hpp"
#include "plan_svg.hpp"

namespace {

using plan_input::options;
using plan_input::parse;
using plan_input::read_selection;

struct row {
  std::string sharding, topology;
  stria::imbalance_degrees imbalance;
  double max_rank_flops;
  double total_flops;
  stria::ring_workload workload;  // for --svg
};

template <class Sharding, class Topology>
row plan_one(const stria::global_selection& g, const Sharding& sharding, const Topology& topology, stria::index_t head_dim,
             const std::string& topology_name) {
  const stria::ring_workload w = stria::count_ring_workload(g, sharding, topology);
  return {std::string(Sharding::name), topology_name, stria::measure_imbalance(w), stria::forward_flops(w.max_rank_total(), head_dim),
          stria::forward_flops(w.total(), head_dim), w};
}

/// The synthetic input the options describe, at `seq_len` tokens.
stria::host::synthetic_vs_options synthetic_input(const options& o, stria::index_t seq_len) {
  stria::host::synthetic_vs_options s;
  s.seq_len = seq_len;
  s.heads_q = o.heads_q;
  s.heads_kv = o.heads_kv;
  s.head_dim = o.head_dim;
  s.rope_theta = o.rope_theta;
  s.token_noise = o.token_noise;
  s.density = 1.0 - o.sparsity;
  s.seed = o.seed;
  for (const auto p : {stria::host::vs_pattern::rope, stria::host::vs_pattern::power_law_slash, stria::host::vs_pattern::periodic_slash,
                       stria::host::vs_pattern::clustered_vertical, stria::host::vs_pattern::mixture})
    if (o.pattern == stria::host::pattern_name(p)) s.pattern = p;
  return s;
}

/// The distributed estimator on `world` simulated ranks (striped<64> shards); every rank must agree.
stria::global_selection estimate_on_ranks(const stria::estimator::vertical_slash_top_p& estimator, const stria::host::synthetic_vs& data,
                                          const stria::host::synthetic_vs_options& s, stria::index_t world, double& seconds) {
  const auto start = std::chrono::steady_clock::now();
  const stria::sharding::striped<64> sharding;
  const stria::index_t local = s.seq_len / world;
  const auto q = stria::sharding::split(sharding, std::span<const float>(data.q), std::array<stria::index_t, 3>{s.seq_len, s.heads_q, s.head_dim}, world);
  const auto k = stria::sharding::split(sharding, std::span<const float>(data.k), std::array<stria::index_t, 3>{s.seq_len, s.heads_kv, s.head_dim}, world);
  std::vector<stria::global_selection> found(static_cast<std::size_t>(world));
  stria::comm::host_world ranks(world);
  ranks.run([&](stria::comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    found[r] = stria::estimator::estimate(estimator, c, sharding, s.seq_len, true,
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

// ---------------------------------------------------------------------------------------------
// --cluster: the cost model

struct choice {
  std::string sharding, topology;
  stria::cost::layer_prediction layer;
};

/// Step indices where a phase is communication-bound, as "0-3, 8" (empty: none).
std::vector<stria::index_t> bound_steps(const stria::cost::phase_prediction& p) {
  std::vector<stria::index_t> out;
  for (std::size_t s = 0; s < p.steps.size(); ++s)
    if (p.steps[s].communication_bound) out.push_back(static_cast<stria::index_t>(s));
  return out;
}
std::string as_ranges(const std::vector<stria::index_t>& steps) {
  std::string out;
  for (std::size_t i = 0; i < steps.size();) {
    std::size_t j = i;
    while (j + 1 < steps.size() && steps[j + 1] == steps[j] + 1) ++j;
    // Appended piece by piece (operator+ on temporaries trips GCC 12's -Wrestrict, PR 105329).
    if (!out.empty()) out.push_back(',');
    out.append(std::to_string(steps[i]));
    if (j > i) {
      out.push_back('-');
      out.append(std::to_string(steps[j]));
    }
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

struct cluster_result {
  stria::index_t nodes, gpus, seq_len;
  double density;
  stria::cost::layer_prediction one_gpu;
  std::vector<choice> ranking;  // fastest first
};

cluster_result predict_cluster(const options& o, stria::index_t nodes, stria::index_t gpus, stria::index_t seq_len,
                               const stria::cost::kernel_throughput& kernel) {
  const stria::global_selection g = stria::host::plant_vs_selection(synthetic_input(o, seq_len));
  const stria::index_t world = nodes * gpus;
  const stria::cost::layer_shape shape{.seq_len = seq_len, .heads_q = o.heads_q, .heads_kv = o.heads_kv, .head_dim = o.head_dim};
  const stria::cost::cluster c{.nodes = nodes,
                               .gpus_per_node = gpus,
                               .intra_node = {.gbytes_per_s = o.intra_gbps / 8, .latency_us = o.intra_latency_us},
                               .inter_node = {.gbytes_per_s = o.inter_gbps / 8, .latency_us = o.inter_latency_us},
                               .streams = o.outer_stream ? stria::cost::transfer_streams::one_per_link : stria::cost::transfer_streams::one_per_rank};
  cluster_result out{nodes, gpus, seq_len, 0.0, {}, {}};
  const stria::topology::flat_ring flat(world);
  auto plan_sharding = [&](const auto& sharding) {
    using sharding_type = std::decay_t<decltype(sharding)>;
    const stria::ring_workload entries = stria::count_ring_workload(g, sharding, flat);
    const stria::ring_workload rows = stria::cost::count_ring_rows(g, sharding, flat);
    const stria::ring_workload padding = stria::cost::count_ring_vertical_padding(g, sharding, flat);
    if (out.ranking.empty()) {
      const std::int64_t one_rank_padding = stria::cost::count_ring_vertical_padding(g, sharding, stria::topology::flat_ring(1)).total();
      out.one_gpu = stria::cost::predict_one_gpu(entries.total(), shape, kernel, one_rank_padding);
      out.density = double(entries.total()) / (double(seq_len) * (double(seq_len) + 1.0) / 2.0 * g.num_heads());
    }
    out.ranking.push_back({std::string(sharding_type::name), "flat_ring", stria::cost::predict_ring(entries, rows, flat, shape, kernel, c, padding)});
    if (nodes > 1) {
      const stria::topology::hierarchical_ring h(nodes, gpus);
      out.ranking.push_back({std::string(sharding_type::name), "hierarchical_ring(" + std::to_string(nodes) + "x" + std::to_string(gpus) + ")",
                             stria::cost::predict_ring(stria::cost::reschedule(entries, h), stria::cost::reschedule(rows, h), h, shape, kernel, c,
                                                       stria::cost::reschedule(padding, h))});
    }
  };
  plan_sharding(stria::sharding::sequential{});
  plan_sharding(stria::sharding::zigzag{});
  plan_sharding(stria::sharding::striped<64>{});
  if (o.solver_chunks > 0) {
    const stria::solver::problem p = stria::solver::problem_from_selection(g, world, o.solver_chunks, o.heads_kv);
    const stria::solver::plan x = stria::solver::solve(p, {1.10, o.volume_cap});
    out.ranking.push_back({"sequential", "solver(m=" + std::to_string(o.solver_chunks) + ")", stria::cost::predict_solver(p, x, stria::cost::solver_task_rows(g, p), shape, kernel, c,
                                                                                       stria::cost::solver_task_vertical_padding(g, p))});
  }
  std::stable_sort(out.ranking.begin(), out.ranking.end(), [](const choice& a, const choice& b) { return a.layer.seconds() < b.layer.seconds(); });
  return out;
}

double efficiency(const cluster_result& r, const choice& x) {
  return r.one_gpu.seconds() / (double(r.nodes) * r.gpus * x.layer.seconds());
}

nlohmann::ordered_json phase_steps(const stria::cost::phase_prediction& p) {
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const stria::cost::step_prediction& s : p.steps)
    steps.push_back({{"compute_ms", s.compute_seconds * 1e3},
                     {"transfer_ms", s.transfer_seconds * 1e3},
                     {"wait_ms", s.wait_seconds * 1e3},
                     {"communication_bound", s.communication_bound}});
  return steps;
}

int run_cluster(const options& o) {
  const auto start = std::chrono::steady_clock::now();
  stria::cost::kernel_throughput kernel =
      o.throughput_file.empty() ? stria::cost::h200_kernel_throughput(o.head_dim) : plan_input::read_throughput(o.throughput_file, o.head_dim);
  std::string kernel_source = o.throughput_file.empty()
                                  ? "built in: tests/bench/results/attention_lengths_h200.json, 89a7cd3, and attention_h200.json, 481fc28"
                                  : o.throughput_file;
  if (o.kernel_scale != 1.0) {  // another GPU, as a multiple of the table's
    // The call's fixed cost stays: launches and the host's work between them do not follow the FLOPs.
    for (stria::cost::kernel_speed* k : {&kernel.forward, &kernel.backward}) {
      k->tflops *= o.kernel_scale, k->row_ns /= o.kernel_scale;
      for (stria::cost::speed_point& point : k->curve) point.row_ns /= o.kernel_scale;
    }
    std::ostringstream note;
    note << "; scaled by " << o.kernel_scale;
    kernel_source += note.str();
  }
  kernel.memory_gbytes_per_s = o.memory_gbs;
  const char* streams = o.outer_stream ? "inner and outer ring on a stream each (--outer-stream)" : "one transfer stream per rank (the device engine)";
  std::vector<cluster_result> results;
  for (const auto& [nodes, gpus] : o.clusters)
    for (const stria::index_t s : o.seq_lens) results.push_back(predict_cluster(o, nodes, gpus, s, kernel));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // A curve point's row work in tiles (64 x 64 entries), as attention_bench reports rows.
  auto tiles_per_row = [&](const stria::cost::speed_point& point, bool backward) {
    return point.flops_per_row / (stria::cost::entry_flops(o.head_dim, backward) * stria::block_tokens * stria::block_tokens);
  };
  if (o.json) {
    auto curve = [&](const stria::cost::kernel_speed& k, bool backward) {
      nlohmann::ordered_json points = nlohmann::ordered_json::array();
      for (const stria::cost::speed_point& point : k.curve) points.push_back({{"tiles_per_row", tiles_per_row(point, backward)}, {"row_ns", point.row_ns}});
      return points;
    };
    nlohmann::ordered_json config = {
        {"heads_q", o.heads_q}, {"heads_kv", o.heads_kv}, {"head_dim", o.head_dim}, {"sparsity", o.sparsity}, {"seed", o.seed},
        {"kernel", {{"source", kernel_source}, {"scale", o.kernel_scale},
                    {"forward_tflops", kernel.forward.tflops}, {"forward_row_ns", kernel.forward.row_ns}, {"forward_call_us", kernel.forward.call_us},
                    {"backward_tflops", kernel.backward.tflops}, {"backward_row_ns", kernel.backward.row_ns}, {"backward_call_us", kernel.backward.call_us},
                    {"forward_curve", curve(kernel.forward, false)}, {"backward_curve", curve(kernel.backward, true)},
                    {"memory_gbytes_per_s", kernel.memory_gbytes_per_s}}},
        {"intra_node", {{"gbps", o.intra_gbps}, {"latency_us", o.intra_latency_us}}},
        {"inter_node", {{"gbps", o.inter_gbps}, {"latency_us", o.inter_latency_us}}},
        {"transfer_streams", o.outer_stream ? "one_per_link" : "one_per_rank"},
        {"seconds", seconds}};
    nlohmann::ordered_json out = {{"config", config}, {"predictions", nlohmann::ordered_json::array()}};
    for (const cluster_result& r : results) {
      nlohmann::ordered_json ranking = nlohmann::ordered_json::array();
      for (const choice& x : r.ranking)
        ranking.push_back({{"sharding", x.sharding},
                           {"topology", x.topology},
                           {"forward_ms", x.layer.forward.seconds * 1e3},
                           {"backward_ms", x.layer.backward.seconds * 1e3},
                           {"layer_ms", x.layer.seconds() * 1e3},
                           {"efficiency", efficiency(r, x)},
                           {"busiest_compute_forward_ms", x.layer.forward.busiest_compute_seconds() * 1e3},
                           {"busiest_compute_backward_ms", x.layer.backward.busiest_compute_seconds() * 1e3},
                           {"communication_bound_forward", bound_steps(x.layer.forward)},
                           {"communication_bound_backward", bound_steps(x.layer.backward)}});
      out["predictions"].push_back({{"cluster", std::to_string(r.nodes) + "x" + std::to_string(r.gpus)},
                                    {"gpus", r.nodes * r.gpus},
                                    {"seq_len", r.seq_len},
                                    {"density", r.density},
                                    {"one_gpu", {{"forward_ms", r.one_gpu.forward.seconds * 1e3}, {"backward_ms", r.one_gpu.backward.seconds * 1e3}}},
                                    {"ranking", ranking},
                                    {"best_steps", {{"forward", phase_steps(r.ranking.front().layer.forward)},
                                                    {"backward", phase_steps(r.ranking.front().layer.backward)}}}});
    }
    std::printf("%s\n", out.dump(1).c_str());
    return 0;
  }

  std::printf("plan --cluster: predicted time of one attention layer (cost model; heads %d/%d, head_dim %d, synthetic VS pattern at %.0f%% sparsity)\n",
              o.heads_q, o.heads_kv, o.head_dim, 100.0 * o.sparsity);
  std::printf("kernels (%s):\n", kernel_source.c_str());
  for (const bool backward : {false, true}) {
    const stria::cost::kernel_speed& k = backward ? kernel.backward : kernel.forward;
    std::printf("  %s %.0f us per call + per active row and step", backward ? "backward" : "forward ", k.call_us);
    if (k.curve.empty()) {
      std::printf(" %.1f ns + %.1f TF on executed entries\n", k.row_ns, k.tflops);
      continue;
    }
    std::printf(", by tiles per row:");
    for (std::size_t i = 0; i < k.curve.size(); ++i)
      std::printf("%s %.1f %.0f ns", i == 0 ? "" : ",", tiles_per_row(k.curve[i], backward), k.curve[i].row_ns);
    std::printf("\n");
  }
  std::printf("  (executed entries: the active ones and the gathered vertical tiles' padding; a row's time linear in its work\n"
              "  between the measured rows, the end segments extended beyond them; a ring's forward also reads its fp32 running\n"
              "  state at %.0f GB/s)\n", kernel.memory_gbytes_per_s);
  std::printf("links: intra-node %.0f Gb/s + %.0f us, inter-node %.0f Gb/s + %.0f us per message; %s\n", o.intra_gbps, o.intra_latency_us,
              o.inter_gbps, o.inter_latency_us, streams);
  std::printf("efficiency = one GPU's time for the whole layer / (GPUs x time); comm-bound: steps whose message took longer than the compute it could hide behind\n");
  if (results.size() == 1) {
    const cluster_result& r = results.front();
    std::printf("\n%d GPUs (%d nodes x %d), seq_len %d, density %.2f%%; one GPU: forward %.1f ms, backward %.1f ms\n\n", r.nodes * r.gpus, r.nodes,
                r.gpus, r.seq_len, 100.0 * r.density, r.one_gpu.forward.seconds * 1e3, r.one_gpu.backward.seconds * 1e3);
    std::printf("%-4s %-11s %-26s %10s %10s %10s %10s  %s\n", "rank", "sharding", "topology", "fwd ms", "bwd ms", "layer ms", "efficiency",
                "comm-bound steps fwd / bwd");
    for (std::size_t i = 0; i < r.ranking.size(); ++i) {
      const choice& x = r.ranking[i];
      std::printf("%-4zu %-11s %-26s %10.2f %10.2f %10.2f %9.1f%%  %s / %s\n", i + 1, x.sharding.c_str(), x.topology.c_str(), x.layer.forward.seconds * 1e3,
                  x.layer.backward.seconds * 1e3, x.layer.seconds() * 1e3, 100.0 * efficiency(r, x), as_ranges(bound_steps(x.layer.forward)).c_str(),
                  as_ranges(bound_steps(x.layer.backward)).c_str());
    }
    const choice& best = r.ranking.front();
    if (best.layer.forward.steps.size() <= 32) {
      std::printf("\nsteps of the fastest (%s, %s), ms: busiest rank's compute, longest transit of a message due, longest wait\n", best.sharding.c_str(),
                  best.topology.c_str());
      std::printf("%-5s %27s   %27s\n", "step", "forward compute/transit/wait", "backward compute/transit/wait");
      for (std::size_t s = 0; s < best.layer.forward.steps.size(); ++s) {
        const auto& f = best.layer.forward.steps[s];
        const auto& b = best.layer.backward.steps[s];
        std::printf("%-5zu %8.3f %8.3f %8.3f%s  %8.3f %8.3f %8.3f%s\n", s, f.compute_seconds * 1e3, f.transfer_seconds * 1e3, f.wait_seconds * 1e3,
                    f.communication_bound ? "*" : " ", b.compute_seconds * 1e3, b.transfer_seconds * 1e3, b.wait_seconds * 1e3,
                    b.communication_bound ? "*" : " ");
      }
      std::printf("(* communication-bound)\n");
    }
  } else {
    std::printf("\n%-6s %-8s %-8s %-36s %9s %9s %9s %10s %-17s %s\n", "GPUs", "cluster", "seq_len", "fastest", "fwd ms", "bwd ms", "layer ms",
                "efficiency", "comm-bound f/b", "next (layer ms)");
    for (const cluster_result& r : results) {
      const choice& x = r.ranking.front();
      const choice& y = r.ranking.size() > 1 ? r.ranking[1] : x;
      const std::string cluster_name = std::to_string(r.nodes) + "x" + std::to_string(r.gpus);
      const std::string fastest = x.sharding + ", " + x.topology;
      const std::string bound = std::to_string(x.layer.forward.communication_bound_steps()) + "/" + std::to_string(x.layer.backward.communication_bound_steps()) +
                                " of " + std::to_string(x.layer.forward.steps.size());
      char next[96];
      std::snprintf(next, sizeof next, "%s, %s (%.2f)", y.sharding.c_str(), y.topology.c_str(), y.layer.seconds() * 1e3);
      std::printf("%-6d %-8s %-8d %-36s %9.2f %9.2f %9.2f %9.1f%% %-17s %s\n", r.nodes * r.gpus, cluster_name.c_str(), r.seq_len, fastest.c_str(),
                  x.layer.forward.seconds * 1e3, x.layer.backward.seconds * 1e3, x.layer.seconds() * 1e3, 100.0 * efficiency(r, x), bound.c_str(), next);
    }
  }
  std::printf("\n(%.2f s)\n", seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  if (!o.clusters.empty()) return run_cluster(o);
  const auto start = std::chrono::steady_clock::now();
  stria::global_selection g;
  std::string source = "synthetic";
  double estimate_seconds = 0, recall_mean = -1, recall_min = -1;
  struct oracle_row {
    double recall_mean = -1, recall_min = -1, density = -1;
  } oracle, oracle_top_p;
  // The best mean recall of a selection of any shape (the largest probabilities): at the estimate's
  // density and at issue 21's 10%.
  double any_shape_recall = -1, any_shape_recall_10pct = -1;
  stria::estimator::vertical_slash_top_p estimator;
  estimator.vertical.max = o.vertical_max;
  estimator.slash.max = o.slash_max;
  estimator.local_diagonals = o.local_diagonals;
  estimator.sink_tokens = o.sink_tokens;
  estimator.p_vertical = o.p_vertical > 0 ? o.p_vertical : o.p > 0 ? o.p : estimator.p_vertical;
  estimator.p_slash = o.p_slash > 0 ? o.p_slash : o.p > 0 ? o.p : estimator.p_slash;
  const stria::index_t recall_stride = o.recall_stride > 0 ? o.recall_stride : 1;
  const bool with_recall = o.seq_len <= 16384 || o.recall_stride > 0;
  if (!o.selection_file.empty()) {
    g = read_selection(o.selection_file);
    source = "selection";
  } else {
    const stria::host::synthetic_vs_options s = synthetic_input(o, o.seq_len);
    if (!o.estimate) {
      g = stria::host::plant_vs_selection(s);
    } else {
      source = "estimated";
      const stria::host::synthetic_vs data = stria::host::make_synthetic_vs(s);
      estimator.validate(s.seq_len, s.heads_q);
      g = estimate_on_ranks(estimator, data, s, o.world, estimate_seconds);
      if (with_recall) {
        const stria::tensor_view<const float, 3> q(data.q.data(), {o.seq_len, o.heads_q, o.head_dim});
        const stria::tensor_view<const float, 3> k(data.k.data(), {o.seq_len, o.heads_kv, o.head_dim});
        const double scale = 1.0 / std::sqrt(double(o.head_dim));
        const stria::host::recall_summary r = stria::host::attention_recall(g, q, k, scale, 0, recall_stride);
        recall_mean = r.mean;
        recall_min = r.min;
        // The oracle: the estimator's rule on the exact attention of all (sampled) rows, once at
        // the estimate's density (per head), once with its top-p.
        const stria::host::oracle_selections best =
            stria::host::oracle_vs_selection(q, k, scale, {estimator.rule(o.seq_len), &g, recall_stride});
        const stria::host::recall_summary b = stria::host::attention_recall(best.same_density, q, k, scale, 0, recall_stride);
        oracle = {b.mean, b.min, stria::host::selected_share(best.same_density)};
        const stria::host::recall_summary t = stria::host::attention_recall(best.top_p, q, k, scale, 0, recall_stride);
        oracle_top_p = {t.mean, t.min, stria::host::selected_share(best.top_p)};
        // What a selection of any shape recalls at the estimate's share of the same rows, and at 10%.
        const stria::host::attention_mass_profile profile = stria::host::attention_mass_profile_of(q, k, scale, g.causal, 0, recall_stride);
        any_shape_recall = profile.best_mean_recall(stria::host::selected_share(g, recall_stride));
        any_shape_recall_10pct = profile.best_mean_recall(0.10);
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
  // Stripes placed for this selection: the same traffic as striped<64>, the work balanced per rank and step.
  double placement_ms = -1;
  if (o.world <= stria::max_balanced_world_size) {
    const auto t0 = std::chrono::steady_clock::now();
    const stria::sharding::placed_stripes placed = stria::balance_stripes(g, o.world);
    placement_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    plan_sharding(placed);
  }

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
  if (!o.svg_file.empty()) {
    std::vector<plan_svg::panel> panels;
    for (const row& r : rows) panels.push_back({r.sharding + ", " + r.topology, r.workload, r.imbalance});
    char heading[160];
    std::snprintf(heading, sizeof heading, "plan: seq_len %d, world %d (%d node%s), %d heads, %s pattern, density %.2f%% of causal entries", g.seq_len,
                  o.world, o.nodes, o.nodes > 1 ? "s" : "", g.num_heads(), source.c_str(), 100.0 * density);
    std::ofstream file(o.svg_file);
    if (!file) throw stria::invalid_argument("--svg", o.svg_file, "must name a file that can be written");
    plan_svg::write(file, heading, panels, g, 0);
    file.close();
    if (!file) throw stria::invalid_argument("--svg", o.svg_file, "could not be written completely");
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (o.json) {
    nlohmann::ordered_json config = {{"seq_len", g.seq_len}, {"world", o.world},   {"nodes", o.nodes},           {"heads_q", g.num_heads()},
                                     {"heads_kv", o.heads_kv}, {"head_dim", o.head_dim}, {"sparsity", 1.0 - density}, {"density", density},
                                     {"source", source},     {"seconds", seconds}};
    // A recorded selection has no seed, nor a pattern (below).
    config["seed"] = o.selection_file.empty() ? nlohmann::ordered_json(o.seed) : nlohmann::ordered_json();
    config["placement_ms"] = placement_ms >= 0 ? nlohmann::ordered_json(placement_ms) : nlohmann::ordered_json();
    if (o.estimate) {
      config["estimator"] = "vertical_slash_top_p";
      config["estimate_seconds"] = estimate_seconds;
      config["recall_mean"] = recall_mean >= 0 ? nlohmann::ordered_json(recall_mean) : nlohmann::ordered_json();
      config["recall_min"] = recall_min >= 0 ? nlohmann::ordered_json(recall_min) : nlohmann::ordered_json();
      auto value = [](double x) { return x >= 0 ? nlohmann::ordered_json(x) : nlohmann::ordered_json(); };
      config["oracle_recall_mean"] = value(oracle.recall_mean);
      config["oracle_recall_min"] = value(oracle.recall_min);
      config["oracle_density"] = value(oracle.density);
      config["oracle_top_p_recall_mean"] = value(oracle_top_p.recall_mean);
      config["oracle_top_p_recall_min"] = value(oracle_top_p.recall_min);
      config["oracle_top_p_density"] = value(oracle_top_p.density);
      config["any_shape_recall_mean"] = value(any_shape_recall);
      config["any_shape_recall_mean_10pct"] = value(any_shape_recall_10pct);
      config["recall_stride"] = recall_stride;
      config["vertical_cap"] = estimator.rule(o.seq_len).vertical_cap;
      config["slash_cap"] = estimator.rule(o.seq_len).slash_cap;
      config["local_diagonals"] = estimator.local_diagonals;
      config["sink_tokens"] = estimator.sink_tokens;
      config["p_vertical"] = estimator.p_vertical;
      config["p_slash"] = estimator.p_slash;
    }
    config["pattern"] = o.selection_file.empty() ? nlohmann::ordered_json(o.pattern) : nlohmann::ordered_json();
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
    if (recall_mean >= 0)
      std::printf("; recalled attention mass over %s query rows: mean %.4f, min %.4f\n"
                  "oracle VS selection (exact statistics of all rows): at the estimate's density mean %.4f, min %.4f at density %.2f%%;\n"
                  "with its top-p mean %.4f, min %.4f at density %.2f%%;\n"
                  "a selection of any shape (the largest probabilities) recalls at most mean %.4f at the estimate's density, %.4f at 10%%",
                  recall_stride > 1 ? "sampled" : "all", recall_mean, recall_min, oracle.recall_mean, oracle.recall_min, 100.0 * oracle.density,
                  oracle_top_p.recall_mean, oracle_top_p.recall_min, 100.0 * oracle_top_p.density, any_shape_recall, any_shape_recall_10pct);
    else std::printf("; recall not computed (needs --seq-len <= 16384 or --recall-stride)");
    std::printf("\n");
  }
  std::printf("imbalance = busiest / mean (1.00 is perfect); worker: over ranks within a step, step: over one rank's steps\n");
  if (placement_ms >= 0)
    std::printf("placed_stripes: 64-token stripes placed for this selection (balance_stripes, %.1f ms), striped's traffic\n", placement_ms);
  else
    std::printf("placed_stripes: not planned (balance_stripes takes at most %d ranks)\n", stria::max_balanced_world_size);
  // Widths for imbalances up to 99999 (the busiest rank of 2048 holds all the work: 2048.000).
  std::printf("\n%-14s %-26s %21s %21s %22s\n", "sharding", "topology", "worker mean / max", "step mean / max", "busiest rank fwd GFLOP");
  for (const row& r : rows)
    std::printf("%-14s %-26s %9.3f / %9.3f %9.3f / %9.3f %22.1f\n", r.sharding.c_str(), r.topology.c_str(), r.imbalance.worker_mean,
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
