// SPDX-License-Identifier: Apache-2.0
// Benchmark (a program, not a test): one attention layer, forward + backward, on several GPUs over
// NCCL (one process, one thread and NCCL rank per GPU), through the front template. Qwen2.5-3B shape
// (Hq 16, Hkv 2, D 128), bf16, causal. Every sparse variant runs the same index (the generator's
// planted Vertical-Slash selection at 95% sparsity, given with use_selection), so the variants differ
// only in layout and communication:
//   dense         estimator::dense on zigzag, flat ring (plain ring attention, all causal tiles)
//   zigzag        sparse, zigzag, flat ring
//   striped       sparse, striped<64>, flat ring
//   hierarchical  sparse, striped<64>, hierarchical ring 2 x G/2, inner and outer links on split
//                 communicators (G >= 4, even)
//   solver        sparse, sequential, topology::solver (--solver-chunks chunks per rank, at most
//                 --solver-volume-cap times the flat ring's volume)
// Per variant and GPU count: wall time per layer (barrier to barrier, median of --repeats after one
// warm-up), effective TFLOPS per GPU (active entries only), the index (or plan) build time, the planned
// imbalance (active entries per rank and step; the solver: its plan's busiest rank over the mean)
// and, for the sparse rings, the measured imbalance: every rank times its own steps' kernels alone
// on its GPU (all GPUs at once), as ring_bench does on one; "steps ms" sums the slowest rank's
// kernels over the steps: the layer's time if the ring engine and its transfers added nothing.
// Outputs are poisoned (NaN) before the first layer and checked finite after the last. For the
// solver, rank 0 also times its per-layer planning phase by phase. Beside each sparse variant's
// measured times, the cost model's (stria/index/cost_model.hpp: the built-in H200 kernel speeds,
// NVLink between every pair of GPUs, each rank's transfers on one stream as the engine posts them)
// predicted forward and backward, and the error (issue 23's check, on whatever GPUs are lent).
//   multi_gpu_bench [--seq-len N | --tokens-per-gpu N] [--gpus 1,2,4] [--variants dense,zigzag,...]
//                   [--repeats 3] [--dense-repeats 1] [--solver-chunks 4] [--solver-volume-cap 1] [--json]
#include <cuda_bf16.h>
#include <thrust/count.h>
#include <thrust/execution_policy.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "stria/comm/nccl.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/estimator/dense.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/index/cost_model.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "stria/topology/solver.hpp"
#include "args.hpp"
#include "step_times.cuh"
#include "timing.cuh"
#include "../../examples/common/progress.hpp"

using namespace stria;
using T = __nv_bfloat16;

namespace {

constexpr bench::head_shape shape{16, 2, 128};
using clock_type = std::chrono::steady_clock;

/// The solver's per-layer planning, phase by phase (rank 0; every rank does the same).
struct planning_ms {
  double to_host = 0, task_areas = 0, solve = 0, task_indices = 0;
};

struct row {
  std::string variant;
  index_t gpus = 0, seq_len = 0;
  double index_ms = 0, forward_ms = 0, backward_ms = 0;
  std::int64_t entries = 0;                       // active (query, key) entries, all heads
  double planned_worker = 1, planned_step = 1;    // from the index's entries per (rank, step)
  double measured_worker = 0, measured_step = 0;  // from kernel times per (rank, step); 0: not measured
  double steps_ms = 0;                            // sum over steps of the slowest rank's kernels alone
  std::int64_t non_finite = 0;                    // entries of out, lse, dq, dk, dv that are not finite
  planning_ms planning;                           // the solver only
  double predicted_forward_ms = 0, predicted_backward_ms = 0;  // the cost model's (0: not predicted, the dense ring)
};

/// The cost model's layer on this host: the built-in kernel speeds, NVLink between every pair of GPUs
/// (the hierarchical ring's "nodes" are halves of one host), each rank's transfers on one stream.
cost::cluster this_host(index_t nodes, index_t gpus) {
  return {.nodes = nodes, .gpus_per_node = gpus / nodes, .intra_node = cost::h200_nvlink, .inter_node = cost::h200_nvlink,
          .streams = cost::transfer_streams::one_per_rank};
}
cost::layer_shape layer_of(index_t s) { return {.seq_len = s, .heads_q = shape.hq, .heads_kv = shape.hkv, .head_dim = shape.dim}; }

struct settings {
  int repeats = 3, dense_repeats = 1;
  index_t solver_chunks = 4;
  double solver_volume_cap = 1.0;
};

struct not_finite {
  template <class E>
  __device__ bool operator()(E e) const {
    return !isfinite(static_cast<float>(e));
  }
};

/// A bf16 or float tensor's entries that are NaN or infinite, counted on the device.
template <class E>
std::int64_t count_non_finite(const device_buffer<E>& x, cudaStream_t stream) {
  return thrust::count_if(thrust::cuda::par.on(stream), x.data(), x.data() + x.size(), not_finite{});
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

/// What use_selection does for topology::solver, timed phase by phase (median of `repeats`): the
/// selection to the host, the task areas, the solve, the rank's task indices on the GPU.
planning_ms time_planning(const device_selection& selection, const topology::solver& topology, cudaStream_t st, int repeats) {
  std::vector<double> to_host, areas, solve, indices;
  const auto since = [](clock_type::time_point t) { return std::chrono::duration<double, std::milli>(clock_type::now() - t).count(); };
  for (int i = 0; i < repeats; ++i) {
    auto t = clock_type::now();
    const global_selection copy = selection.to_host(st);
    to_host.push_back(since(t));
    t = clock_type::now();
    const solver::problem p = solver::problem_from_selection(copy, topology.world_size(), topology.chunks_per_rank(), shape.hkv);
    areas.push_back(since(t));
    t = clock_type::now();
    const solver::plan x = solver::solve(p, topology.options());
    solve.push_back(since(t));
    t = clock_type::now();
    const device::solver_task_indices built = device::build_solver_indices(selection, p, x, 0, st);
    STRIA_CUDA_CHECK(cudaStreamSynchronize(st));
    indices.push_back(since(t));
  }
  return {median(to_host), median(areas), median(solve), median(indices)};
}

/// Runs body(comm) on GPUs 0..gpus-1, one NCCL rank each; `nodes` > 1 hands the body a
/// comm::nccl_hierarchy whose inner and outer links are split communicators.
template <class Body>
void on_gpus(index_t gpus, index_t nodes, const Body& body) {
  std::vector<int> devices(static_cast<std::size_t>(gpus));
  std::iota(devices.begin(), devices.end(), 0);
  comm::run_on_devices(devices, [&](comm::nccl& c) {
    if (nodes > 1) {
      comm::nccl_hierarchy links(c, nodes, gpus / nodes);
      body(links);
    } else {
      body(c);
    }
  });
}

/// One variant on `gpus` GPUs: the layer with selection `g`, timed, checked, and its balance.
template <class Attention>
row run_variant(const std::string& name, const global_selection& g, const typename Attention::estimator_type& estimator,
                const typename Attention::topology_type& topology, index_t nodes, index_t gpus, int repeats) {
  using sharding_type = typename Attention::sharding_type;
  constexpr bool dynamic = topology::is_dynamic_solver<typename Attention::topology_type>;
  // Every step alone costs a layer's work again and more; the dense ring's would take minutes.
  constexpr bool measure_steps = !std::is_same_v<typename Attention::estimator_type, estimator::dense>;
  const index_t s = g.seq_len, local = s / gpus;
  row result;
  result.variant = name;
  result.gpus = gpus;
  result.seq_len = s;
  std::vector<double> index_ms, forward_ms, backward_ms;
  std::vector<std::vector<double>> step_ms(static_cast<std::size_t>(gpus));
  std::vector<std::int64_t> non_finite(static_cast<std::size_t>(gpus));
  solver::plan executed_plan;  // the solver's, as rank 0's layer made it
  planning_ms planning;
  on_gpus(gpus, nodes, [&](auto& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const cuda_stream stream;
    const cudaStream_t st = stream.get();
    {
      Attention layer(estimator, sharding_type{}, topology, {s, shape.hq, shape.hkv});
      const auto q = bench::random_buffer(std::size_t(local) * shape.hq * shape.dim, 10 + r, 2.0f),
                 k = bench::random_buffer(std::size_t(local) * shape.hkv * shape.dim, 20 + r, 2.0f),
                 v = bench::random_buffer(std::size_t(local) * shape.hkv * shape.dim, 30 + r, 1.0f),
                 d_out = bench::random_buffer(q.size(), 40 + r, 1.0f);
      device_buffer<T> out(q.size(), st), dq(q.size(), st), dk(k.size(), st), dv(v.size(), st);
      device_buffer<float> lse(std::size_t(shape.hq) * local, st);
      STRIA_CUDA_CHECK(cudaDeviceSynchronize());  // the random inputs (default stream) are in place
      for (auto* b : {&out, &dq, &dk, &dv}) b->fill_bytes(0xff, st);  // NaN until written
      lse.fill_bytes(0xff, st);
      const auto in = [&](const device_buffer<T>& b, index_t heads) { return tensor_view<const T, 3>(b.data(), {local, heads, shape.dim}); };
      const auto to = [&](device_buffer<T>& b, index_t heads) { return tensor_view<T, 3>(b.data(), {local, heads, shape.dim}); };
      const auto phase_end = [&] {  // every rank's work of the phase is done
        stream.synchronize();
        c.barrier();
        return clock_type::now();
      };
      for (int i = 0; i <= repeats; ++i) {
        const auto t0 = phase_end();
        layer.use_selection(c, g, st);
        const auto t1 = phase_end();
        layer.forward(c, in(q, shape.hq), in(k, shape.hkv), in(v, shape.hkv), to(out, shape.hq),
                      tensor_view<float, 2>(lse.data(), {shape.hq, local}), st);
        const auto t2 = phase_end();
        layer.backward(c, in(q, shape.hq), in(k, shape.hkv), in(v, shape.hkv), in(out, shape.hq), in(d_out, shape.hq),
                       tensor_view<const float, 2>(lse.data(), {shape.hq, local}), to(dq, shape.hq), to(dk, shape.hkv), to(dv, shape.hkv), st);
        const auto t3 = phase_end();
        if (r == 0 && i > 0) {
          index_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
          forward_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
          backward_ms.push_back(std::chrono::duration<double, std::milli>(t3 - t2).count());
        }
      }
      non_finite[r] = count_non_finite(out, st) + count_non_finite(lse, st) + count_non_finite(dq, st) + count_non_finite(dk, st) +
                      count_non_finite(dv, st);
      if constexpr (dynamic) {
        if (r == 0) {
          executed_plan = layer.plan();
          planning = time_planning(layer.selection(), topology, st, repeats);
        }
      } else if (measure_steps) {
        step_ms[r] = bench::rank_step_ms(layer.selection(), layer.sharding(), topology, c.rank(), shape, repeats);
      }
      stream.synchronize();
    }
  });
  result.index_ms = median(index_ms);
  result.forward_ms = median(forward_ms);
  result.backward_ms = median(backward_ms);
  result.non_finite = std::accumulate(non_finite.begin(), non_finite.end(), std::int64_t{0});
  const cost::kernel_throughput kernels = cost::h200_kernel_throughput(shape.dim);
  if constexpr (dynamic) {
    result.planning = planning;
    result.entries = count_ring_workload(g, sharding::sequential{}, topology::flat_ring(gpus)).total();
    result.planned_worker = executed_plan.max_load_over_mean();
    result.planned_step = 1;  // the solver has no ring steps
    // The plan the layer ran, not a second solve of the problem.
    const solver::problem p = solver::problem_from_selection(g, gpus, topology.chunks_per_rank(), shape.hkv);
    const cost::layer_prediction l = cost::predict_solver(p, executed_plan, cost::solver_task_rows(g, p), layer_of(s), kernels, this_host(1, gpus),
                                                          cost::solver_task_vertical_padding(g, p));
    result.predicted_forward_ms = l.forward.seconds * 1e3;
    result.predicted_backward_ms = l.backward.seconds * 1e3;
  } else {
    const ring_workload w = count_ring_workload(g, sharding_type{}, topology);
    const imbalance_degrees planned = measure_imbalance(w);
    result.entries = w.total();
    result.planned_worker = planned.worker_mean;
    result.planned_step = planned.step_mean;
    if (measure_steps) {
      const bench::step_balance measured = bench::measure_balance(step_ms);
      result.measured_worker = measured.worker_imbalance;
      result.measured_step = measured.step_imbalance;
      result.steps_ms = measured.ring_ms;
      // The entries counted above, the rows and the gathered tiles' padding, all under the variant's topology.
      const cost::layer_prediction l = cost::predict_ring(w, cost::count_ring_rows(g, sharding_type{}, topology), topology, layer_of(s), kernels,
                                                          this_host(nodes, gpus), cost::count_ring_vertical_padding(g, sharding_type{}, topology));
      result.predicted_forward_ms = l.forward.seconds * 1e3;
      result.predicted_backward_ms = l.backward.seconds * 1e3;
    }
  }
  return result;
}

/// Every causal tile: what estimator::dense selects (it needs no statistics but the shape).
global_selection all_causal_blocks(index_t seq_len, index_t heads) {
  vs_statistics shape_only;
  shape_only.seq_len = seq_len;
  shape_only.num_heads = heads;
  shape_only.causal = true;
  return estimator::dense{}.select(shape_only);
}

template <index_t D>
using tile_d = tile<64, 64, D>;
using top_p = estimator::vertical_slash_top_p;

/// The planted VS selection of length s (cached: generating it takes a second or more at 512K).
const global_selection& vs_selection(index_t s) {
  static std::map<index_t, global_selection> cache;
  auto [at, fresh] = cache.try_emplace(s);
  if (fresh) {
    host::synthetic_vs_options vs;
    vs.seq_len = s;
    vs.heads_q = shape.hq;
    vs.heads_kv = shape.hkv;
    vs.head_dim = shape.dim;
    vs.density = 0.05;
    at->second = host::plant_vs_selection(vs);
  }
  return at->second;
}

row run_named(const std::string& variant, index_t s, index_t gpus, const settings& o) {
  if (variant == "dense")
    return run_variant<sparse_attention<estimator::dense, sharding::zigzag, topology::flat_ring, tile_d<128>>>(
        variant, all_causal_blocks(s, shape.hq), {}, topology::flat_ring(gpus), 1, gpus, o.dense_repeats);
  const global_selection& g = vs_selection(s);
  if (variant == "zigzag")
    return run_variant<sparse_attention<top_p, sharding::zigzag, topology::flat_ring, tile_d<128>>>(variant, g, {}, topology::flat_ring(gpus), 1,
                                                                                                     gpus, o.repeats);
  if (variant == "striped")
    return run_variant<sparse_attention<top_p, sharding::striped<64>, topology::flat_ring, tile_d<128>>>(variant, g, {}, topology::flat_ring(gpus),
                                                                                                          1, gpus, o.repeats);
  if (variant == "hierarchical") {
    if (gpus < 4 || gpus % 2 != 0) throw invalid_argument("--gpus", gpus, "must be even and at least 4 for the hierarchical variant (2 x G/2)");
    return run_variant<sparse_attention<top_p, sharding::striped<64>, topology::hierarchical_ring, tile_d<128>>>(
        variant + " 2x" + std::to_string(gpus / 2), g, {}, topology::hierarchical_ring(2, gpus / 2), 2, gpus, o.repeats);
  }
  if (variant == "solver")
    return run_variant<sparse_attention<top_p, sharding::sequential, topology::solver, tile_d<128>>>(
        variant + " m" + std::to_string(o.solver_chunks) + (o.solver_volume_cap != 1.0 ? " cap" + std::to_string(o.solver_volume_cap).substr(0, 3) : ""),
        g, {}, topology::solver(gpus, o.solver_chunks, {.mu = 1.10, .volume_cap = o.solver_volume_cap}), 1, gpus, o.repeats);
  throw invalid_argument("--variants", variant, "must be dense, zigzag, striped, hierarchical or solver");
}

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  index_t seq_len = 524288, tokens_per_gpu = 0;
  std::vector<index_t> gpu_counts;
  std::vector<std::string> variants{"dense", "zigzag", "striped", "hierarchical", "solver"};
  settings o;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--json") {
      json = true;
      continue;
    }
    const std::string value = cli::option_value(argc, argv, i);
    if (flag == "--seq-len") seq_len = cli::parse_integer<index_t>(flag, value, 1);
    else if (flag == "--tokens-per-gpu") tokens_per_gpu = cli::parse_integer<index_t>(flag, value, 1);
    else if (flag == "--gpus") gpu_counts = bench::parse_sizes(flag, value);
    else if (flag == "--variants") variants = split_names(value);
    else if (flag == "--repeats") o.repeats = cli::parse_integer<int>(flag, value, 1);
    else if (flag == "--dense-repeats") o.dense_repeats = cli::parse_integer<int>(flag, value, 1);
    else if (flag == "--solver-chunks") o.solver_chunks = cli::parse_integer<index_t>(flag, value, 1);
    else if (flag == "--solver-volume-cap") o.solver_volume_cap = cli::parse_real(flag, value, 1e-9, 1e9);
    else throw invalid_argument("flag", flag, "is not known (see the comment at the top of multi_gpu_bench.cu)");
  }
  int devices = 0;
  STRIA_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (gpu_counts.empty()) gpu_counts = {index_t(devices)};
  for (const index_t g : gpu_counts)
    if (g < 1 || g > devices) throw invalid_argument("--gpus", g, "must be between 1 and the " + std::to_string(devices) + " GPUs present");
  if (o.repeats < 1 || o.dense_repeats < 1) throw invalid_argument("--repeats", o.repeats, "must be at least 1 (also --dense-repeats)");
  cudaDeviceProp prop{};
  STRIA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (!json)
    std::printf("multi_gpu_bench on %d x %s: Hq %d, Hkv %d, D %d, bf16, causal, vs95 (dense: all causal tiles), median of %d (dense %d)\n",
                devices, prop.name, shape.hq, shape.hkv, shape.dim, o.repeats, o.dense_repeats);
  std::vector<row> rows;
  if (!json)
    std::printf("%-16s %4s %8s %9s %10s %10s %10s %10s %8s %8s %8s %8s %8s %8s %10s %10s %7s %7s\n", "variant", "gpus", "S", "index ms", "fwd ms",
                "bwd ms", "layer ms", "steps ms", "fwd TF/G", "bwd TF/G", "plan wkr", "plan stp", "meas wkr", "meas stp", "model fwd", "model bwd",
                "fwd err", "bwd err");
  cli::progress progress;  // on stderr, when it is a terminal
  long long measured = 0;
  const auto measurements = static_cast<long long>(gpu_counts.size() * variants.size());
  for (const index_t gpus : gpu_counts)
    for (const std::string& variant : variants) {
      progress.step("layers measured (" + variant + " on " + std::to_string(gpus) + " GPUs next)", measured++, measurements);
      const index_t s = tokens_per_gpu > 0 ? tokens_per_gpu * gpus : seq_len;
      const row r = run_named(variant, s, gpus, o);
      rows.push_back(r);
      if (!json) {
        const double per_gpu = 1e9 * double(r.gpus);  // effective TFLOPS per GPU: active entries only
        std::printf("%-16s %4d %8d %9.2f %10.2f %10.2f %10.2f ", r.variant.c_str(), r.gpus, r.seq_len, r.index_ms, r.forward_ms, r.backward_ms,
                    r.forward_ms + r.backward_ms);
        if (r.steps_ms > 0) std::printf("%10.2f ", r.steps_ms);
        else std::printf("%10s ", "-");
        std::printf("%8.0f %8.0f %8.3f %8.3f ", forward_flops(r.entries, shape.dim) / (r.forward_ms * per_gpu),
                    backward_flops(r.entries, shape.dim) / (r.backward_ms * per_gpu), r.planned_worker, r.planned_step);
        if (r.measured_worker > 0) std::printf("%8.3f %8.3f", r.measured_worker, r.measured_step);
        else std::printf("%8s %8s", "-", "-");
        if (r.predicted_forward_ms > 0)
          std::printf(" %10.2f %10.2f %+6.1f%% %+6.1f%%", r.predicted_forward_ms, r.predicted_backward_ms, 100.0 * (r.predicted_forward_ms / r.forward_ms - 1),
                      100.0 * (r.predicted_backward_ms / r.backward_ms - 1));
        else std::printf(" %10s %10s %7s %7s", "-", "-", "-", "-");
        std::printf("%s\n", r.non_finite ? "  NON-FINITE OUTPUT" : "");
        if (r.planning.task_indices > 0)
          std::printf("  %s planning per layer (rank 0): selection to host %.2f ms, task areas %.2f ms, solve %.2f ms, task indices %.2f ms\n",
                      r.variant.c_str(), r.planning.to_host, r.planning.task_areas, r.planning.solve, r.planning.task_indices);
        std::fflush(stdout);
      }
    }
  progress.step("layers measured", measured, measurements);
  if (json) {
    std::printf("{\"gpu\": \"%s\", \"rows\": [", prop.name);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const row& r = rows[i];
      std::printf("%s\n  {\"variant\": \"%s\", \"gpus\": %d, \"seq_len\": %d, \"index_ms\": %.3f, \"forward_ms\": %.3f, \"backward_ms\": %.3f, "
                  "\"entries\": %lld, \"planned_worker\": %.4f, \"planned_step\": %.4f, \"measured_worker\": %.4f, \"measured_step\": %.4f, "
                  "\"steps_ms\": %.3f, \"non_finite\": %lld, \"predicted_forward_ms\": %.3f, \"predicted_backward_ms\": %.3f}",
                  i ? "," : "", r.variant.c_str(), r.gpus, r.seq_len, r.index_ms, r.forward_ms, r.backward_ms, static_cast<long long>(r.entries),
                  r.planned_worker, r.planned_step, r.measured_worker, r.measured_step, r.steps_ms, static_cast<long long>(r.non_finite),
                  r.predicted_forward_ms, r.predicted_backward_ms);
    }
    std::printf("\n]}\n");
  }
  for (const row& r : rows)
    if (r.non_finite) {
      std::fprintf(stderr, "multi_gpu_bench: %s on %d GPUs left %lld non-finite output entries\n", r.variant.c_str(), r.gpus,
                   static_cast<long long>(r.non_finite));
      return 1;
    }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "multi_gpu_bench: %s\n", e.what());
  return 1;
}
