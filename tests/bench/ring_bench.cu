// SPDX-License-Identifier: Apache-2.0
// Benchmark (a program, not a test): load balance of the ring on real kernels, one H200. Qwen2.5-3B
// shape (Hq 16, Hkv 2, D 128), bf16, causal, the generator's Vertical-Slash selection at 95%
// sparsity, W ranks on a flat ring, for sequential, zigzag and striped<64> sharding:
//  1. every (rank, step) alone on the GPU: forward + backward kernel time of that rank's step index
//     (CUDA events, median of repeats after warm-up; every forward overwriting the running state).
//     Worker-level imbalance = max / mean over the ranks of one step (averaged over steps);
//     step-level = max / mean over one rank's steps (averaged over ranks); the ring's time = sum
//     over steps of the slowest rank (a synchronous ring waits for it); the busiest rank's time =
//     the largest per-rank sum.
//  2. the whole ring through comm::local_device (all W ranks at once, sharing the GPU): wall time of
//     device::ring_forward + ring_backward per layer, against the sum of all (rank, step) kernel
//     times: what the ring engine adds, or (below 1) what the ranks' calls gain by running together.
//  3. with --checked: part 2 again in checked mode (finite_check::every_step: every step's O, LSE,
//     dQ, dK/dV checked on the device, one host synchronisation per step), and its cost over part 2.
//  4. with --pool-dependencies: part 2 split into forward and backward (a barrier between them),
//     once as the library runs and once with stria's memory pool forbidden to make one stream's
//     allocation wait for another stream's free (cudaMemPoolReuseAllowInternalDependencies = 0).
//     The W ranks' streams share that pool; this tells whether its cross-rank waits are what the
//     shared-GPU ring loses against the sum of its kernels (RESULTS, 2026-12-02 cost model entry).
//  5. with --forward-kernels automatic,mma_sync,...: part 2 split as in 4, striped, once per named forward
//     kernel (device::forward_kernel): whether the shared GPU's forward depends on the kernel. mma_sync
//     is the sm80 kernel; wgmma is the Hopper kernel without pairing, which automatic uses on the steps
//     whose index is not complete (all of them on vs95).
//  6. with --trace (ring_trace.cuh): instead of 1-5, where the shared-GPU ring spends its time. Per
//     --seq-len, striped, for each forward kernel of --forward-kernels (default automatic): every
//     (rank, step)'s compute call alone (median), the untraced ring (forward and backward timed
//     apart, median), then after a warm-up layer one traced forward and one traced backward: per rank
//     and step, host times (steady_clock from a common t0 after a barrier) at the step's start, after
//     its KV group send/recv, after its confirm wait, after its compute is queued, and CUDA events
//     against one reference event recorded at t0: the compute stream at the step's start and end, the
//     transfer stream around each transfer group; the SM clock sampled through NVML where it loads.
//     Printed: a table per phase, then per phase a summary (wall, summed compute spans against alone,
//     how long the GPU ran any step, host time in group_end / waits, the compute streams' gaps by what
//     came last, the largest whole-GPU idle gaps with each host's state). --trace-spin adds a traced
//     layer whose confirm waits poll without backing off; --trace-json FILE writes everything as JSON.
//     Run with CUDA_DEVICE_MAX_CONNECTIONS unset and =32 (the header prints it) to test the hardware
//     queues (16 streams share 8 by default).
//  7. with --solver-tasks M[,M...]: instead of 1-6, per --seq-len and M, the dynamic solver's plan
//     (solver::solve, default options) of W ranks with M chunks per rank: every rank's tasks, local
//     and remote, each timed alone (median), the forward as device::solver_forward runs it (a query
//     chunk's first task on the rank finds its running output empty and reads none of it, later ones
//     merge into it), and the backward; per rank the sums, which predict_solver's per-rank compute
//     predicts.
//   ring_bench [--seq-len 131072,524288] [--world 8] [--repeats 5] [--checked] [--pool-dependencies] [--forward-kernels LIST]
//              [--trace] [--trace-spin] [--trace-json FILE] [--solver-tasks LIST]
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/finite_check.hpp"
#include "stria/device/ring_attention.cuh"
#include "stria/device/solver_attention.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/host/synthetic_vs.hpp"
#include "stria/index/local_index.cuh"
#include "stria/index/workload.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/topology/flat_ring.hpp"
#include "ring_trace.cuh"
#include "step_times.cuh"
#include "timing.cuh"
#include "args.hpp"
#include "../../examples/common/progress.hpp"

using namespace stria;
using T = __nv_bfloat16;

namespace {

constexpr index_t hq = 16, hkv = 2, dim = 128;

struct balance : bench::step_balance {
  double ring_engine_ms = 0;
  double checked_ms = 0;  // the same ring in checked mode (--checked)
};

/// One layer of the ring over local_device: wall ms of the whole layer, and (timed apart, with a
/// barrier between them) of its forward and its backward.
struct ring_times {
  double layer_ms = 0, forward_ms = 0, backward_ms = 0;
};

/// Sets whether stria's pool may make an allocation wait for a free on another stream.
void allow_pool_internal_dependencies(bool allow) {
  int value = allow ? 1 : 0;
  STRIA_CUDA_CHECK(cudaMemPoolSetAttribute(stria::detail::memory_pool(), cudaMemPoolReuseAllowInternalDependencies, &value));
}

/// Part 1: every (rank, step) alone.
template <class Sharding>
balance time_steps(const global_selection& g, const Sharding& sharding, index_t world, int repeats) {
  const device_selection selection(g);
  std::vector<std::vector<double>> ms;
  for (index_t r = 0; r < world; ++r) ms.push_back(bench::rank_step_ms(selection, sharding, topology::flat_ring(world), r, {hq, hkv, dim}, repeats));
  return {bench::measure_balance(ms)};
}

/// The bench's input: the generator's Vertical-Slash selection at 95% sparsity.
global_selection vs95(index_t seq_len) {
  host::synthetic_vs_options o;
  o.seq_len = seq_len;
  o.heads_q = hq;
  o.heads_kv = hkv;
  o.head_dim = dim;
  o.density = 0.05;
  return host::plant_vs_selection(o);
}

/// Part 7: every solver task of every rank alone; per rank its tasks' count and forward / backward ms.
void time_solver_tasks(const global_selection& g, index_t world, index_t chunks_per_rank, int repeats) {
  const solver::problem p = solver::problem_from_selection(g, world, chunks_per_rank, hkv);
  const solver::plan plan = solver::solve(p);
  const device_selection selection(g);
  bench::call_timer calls(p.chunk_tokens, {hq, hkv, dim});
  std::printf("%d tokens, solver of %d ranks x %d chunks (plan: max load / mean %.3f, %zu moves), each task alone, median of %d:\n", g.seq_len,
              world, chunks_per_rank, plan.max_load_over_mean(), plan.moves.size(), repeats);
  double forward = 0, backward = 0;
  for (index_t r = 0; r < world; ++r) {
    const device::solver_task_indices indices = device::build_solver_indices(selection, p, plan, r, nullptr);
    double f = 0, b = 0;
    std::vector<char> seen(static_cast<std::size_t>(p.num_chunks()), 0);  // query chunks computed here so far
    for (const auto& [tasks, built] : {std::pair{&plan.local_tasks[static_cast<std::size_t>(r)], &indices.local},
                                       std::pair{&plan.remote_tasks[static_cast<std::size_t>(r)], &indices.remote}})
      for (std::size_t i = 0; i < tasks->size(); ++i) {
        char& first = seen[static_cast<std::size_t>((*tasks)[i].query_chunk)];
        const auto [fwd, bwd] = calls.ms((*built)[i], first ? device::running_state::merge : device::running_state::overwrite, repeats);
        first = 1;
        f += fwd, b += bwd;
      }
    std::printf("  rank %d: %zu local + %zu remote tasks, forward %.3f ms, backward %.3f ms\n", r, indices.local.size(), indices.remote.size(), f, b);
    forward += f, backward += b;
  }
  std::printf("  all ranks: forward %.3f ms, backward %.3f ms\n", forward, backward);
}

/// One rank's layer on its compute stream `st`: random inputs (seeded by rank), outputs, its ring
/// indices, and the tensors ring_forward and ring_backward take.
template <class Sharding>
struct rank_layer {
  index_t local;
  device_buffer<T> q, k, v, d_out, out, dq, dk, dv;
  device_buffer<float> lse;
  std::vector<device_step_index> indices;
  forward_tensors<T> forward;
  backward_tensors<T> backward;

  rank_layer(const global_selection& g, const Sharding& sharding, const topology::flat_ring& ring, index_t rank, cudaStream_t st)
      : local(g.seq_len / ring.world_size()),
        q(bench::random_buffer(std::size_t(local) * hq * dim, 10 + rank, 2.0f)),
        k(bench::random_buffer(std::size_t(local) * hkv * dim, 20 + rank, 2.0f)),
        v(bench::random_buffer(std::size_t(local) * hkv * dim, 30 + rank, 1.0f)),
        d_out(bench::random_buffer(q.size(), 40 + rank, 1.0f)),
        out(q.size(), st), dq(q.size(), st), dk(k.size(), st), dv(v.size(), st), lse(std::size_t(hq) * local, st),
        forward{view(q, hq), view(k, hkv), view(v, hkv), tensor_view<T, 3>(out.data(), {local, hq, dim}), tensor_view<float, 2>(lse.data(), {hq, local})},
        backward{view(q, hq),
                 view(k, hkv),
                 view(v, hkv),
                 view(out, hq),
                 view(d_out, hq),
                 tensor_view<const float, 2>(lse.data(), {hq, local}),
                 tensor_view<T, 3>(dq.data(), {local, hq, dim}),
                 tensor_view<T, 3>(dk.data(), {local, hkv, dim}),
                 tensor_view<T, 3>(dv.data(), {local, hkv, dim})} {
    STRIA_CUDA_CHECK(cudaDeviceSynchronize());  // the inputs (default stream) are in place
    indices = build_ring_indices_device(device_selection(g, st), sharding, ring, rank, st);
  }

 private:
  tensor_view<const T, 3> view(const device_buffer<T>& b, index_t heads) const { return {b.data(), {local, heads, dim}}; }
};

/// Part 2: the whole ring on comm::local_device, all ranks at once; wall time per layer (median).
template <class Sharding>
ring_times time_ring(const global_selection& g, const Sharding& sharding, index_t world, int repeats, finite_check check, bool split = false,
                     device::forward_kernel which = device::forward_kernel::automatic) {
  const topology::flat_ring ring(world);
  const double scale = 1.0 / std::sqrt(double(dim));
  std::vector<double> wall, forward_wall, backward_wall;
  comm::local_device_world ranks(world, 0, std::chrono::seconds(600));
  ranks.run([&](comm::local_device& c) {
    const cuda_stream compute, transfer;
    const cudaStream_t st = compute.get();
    {
      const rank_layer<Sharding> layer(g, sharding, ring, c.rank(), st);
      const std::vector<device_step_index>& indices = layer.indices;
      const forward_tensors<T>& forward = layer.forward;
      const backward_tensors<T>& backward = layer.backward;
      const device::run_options run{st, transfer.get(), check};
      for (int i = 0; i < repeats + 1; ++i) {  // one warm-up
        compute.synchronize();
        c.barrier();
        using clock = std::chrono::steady_clock;
        const auto ms_since = [](clock::time_point t) { return std::chrono::duration<double, std::milli>(clock::now() - t).count(); };
        const clock::time_point t0 = clock::now();
        device::ring_forward(c, ring, std::span<const device_step_index>(indices), forward, scale, run, which);
        clock::time_point t1 = t0;
        if (split) {
          compute.synchronize();
          c.barrier();
          if (c.rank() == 0 && i > 0) forward_wall.push_back(ms_since(t0));
          t1 = clock::now();
        }
        device::ring_backward(c, ring, std::span<const device_step_index>(indices), backward, scale, device::determinism::atomic, run);
        compute.synchronize();
        c.barrier();
        if (c.rank() == 0 && i > 0) {
          wall.push_back(ms_since(t0));
          if (split) backward_wall.push_back(ms_since(t1));
        }
      }
    }
  });
  const auto median = [](std::vector<double>& x) {
    if (x.empty()) return 0.0;
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  return {median(wall), median(forward_wall), median(backward_wall)};
}

/// Part 6 (--trace): one traced layer of the striped ring (after a warm-up layer on the same path).
struct trace_run {
  index_t seq_len = 0;
  std::string kernel, waits;  // the forward kernel; "library" (comm.wait's backoff) or "spin"
  ring_times untraced;
  bench::trace::phase_trace forward, backward;
  bench::trace::clock_summary alone_forward_clocks, alone_backward_clocks;  // over a second pass of the calls alone
};

trace_run trace_ring(const global_selection& g, index_t world, device::forward_kernel which, bool spin, bench::trace::clock_sampler* sampler) {
  namespace tr = bench::trace;
  const topology::flat_ring ring(world);
  const sharding::striped<64> sharding;
  const double scale = 1.0 / std::sqrt(double(dim));
  tr::phase_driver forward_phase(world, sampler, "forward"), backward_phase(world, sampler, "backward");
  comm::local_device_world ranks(world, 0, std::chrono::seconds(600));
  ranks.run([&](comm::local_device& c) {
    const cuda_stream compute, transfer;
    const cudaStream_t st = compute.get();
    const rank_layer<sharding::striped<64>> layer(g, sharding, ring, c.rank(), st);
    const std::span<const device_step_index> steps(layer.indices);
    const forward_tensors<T>& forward = layer.forward;
    const backward_tensors<T>& backward = layer.backward;
    tr::event_pool pool(256);
    tr::traced_comm<comm::local_device> traced(c, spin);
    {  // warm-up: one layer on the traced path, its records dropped
      tr::recorder warm_forward(c.rank(), ring.num_steps(), tr::clock::now(), nullptr, pool);
      traced.attach(&warm_forward);
      tr::ring_forward(traced, warm_forward, ring, steps, forward, scale, st, transfer.get(), which);
      tr::recorder warm_backward(c.rank(), ring.num_steps(), tr::clock::now(), nullptr, pool);
      traced.attach(&warm_backward);
      tr::ring_backward(traced, warm_backward, ring, steps, backward, scale, device::determinism::atomic, st, transfer.get());
    }
    forward_phase.run(c, ring.num_steps(), compute, transfer, pool, [&](tr::recorder& rec) {
      traced.attach(&rec);
      tr::ring_forward(traced, rec, ring, steps, forward, scale, st, transfer.get(), which);
    });
    backward_phase.run(c, ring.num_steps(), compute, transfer, pool, [&](tr::recorder& rec) {
      traced.attach(&rec);
      tr::ring_backward(traced, rec, ring, steps, backward, scale, device::determinism::atomic, st, transfer.get());
    });
    traced.attach(nullptr);
  });
  trace_run run;
  run.seq_len = g.seq_len;
  run.waits = spin ? "spin" : "library";
  run.forward = std::move(forward_phase.result);
  run.backward = std::move(backward_phase.result);
  return run;
}

/// --trace: parts 1-5 are skipped; see the header.
int run_traces(const std::vector<index_t>& seq_lens, index_t world, int repeats, bool spin,
               const std::vector<std::pair<std::string, device::forward_kernel>>& kernels, const std::string& json_path) {
  namespace tr = bench::trace;
  cudaDeviceProp prop{};
  STRIA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  std::printf("ring_bench --trace on %s (%d SMs): Hq %d, Hkv %d, D %d, bf16, causal, vs95, striped<64>, flat ring of %d ranks on comm::local_device; "
              "CUDA_DEVICE_MAX_CONNECTIONS=%s; alone and untraced: median of %d\n",
              prop.name, prop.multiProcessorCount, hq, hkv, dim, world, connections ? connections : "(unset: 8)", repeats);
  tr::clock_sampler sampler(0);
  if (!sampler.available()) std::printf("SM clock not sampled: %s\n", sampler.why_not().c_str());
  std::vector<trace_run> runs;
  cli::progress progress;
  for (const index_t s : seq_lens) {
    const global_selection g = vs95(s);
    for (const auto& [name, which] : kernels) {
      progress.phase("S = " + std::to_string(s) + ", " + name + ": alone, untraced, traced");
      const tr::alone_times alone = tr::time_alone(g, sharding::striped<64>{}, world, hq, hkv, dim, repeats, which, sampler.available() ? &sampler : nullptr);
      const ring_times untraced = time_ring(g, sharding::striped<64>{}, world, repeats, finite_check::off, true, which);
      double alone_forward = 0, alone_backward = 0;
      for (std::size_t r = 0; r < alone.forward.size(); ++r)
        for (std::size_t i = 0; i < alone.forward[r].size(); ++i) alone_forward += alone.forward[r][i], alone_backward += alone.backward[r][i];
      std::printf("S %d, forward kernel %s: the %zu (rank, step) compute calls alone sum to %.2f ms forward, %.2f ms backward; the untraced ring: "
                  "forward %.2f ms, backward %.2f ms\n",
                  s, name.c_str(), alone.forward.size() * (alone.forward.empty() ? 0 : alone.forward.front().size()), alone_forward, alone_backward,
                  untraced.forward_ms, untraced.backward_ms);
      const tr::clock_summary alone_forward_clocks = tr::summarize_clocks(alone.forward_clocks),
                              alone_backward_clocks = tr::summarize_clocks(alone.backward_clocks);
      tr::print_clocks(" (a second pass of the forward calls alone)", alone_forward_clocks);
      tr::print_clocks(" (a second pass of the backward calls alone)", alone_backward_clocks);
      std::fflush(stdout);
      for (const bool spinning : spin ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
        trace_run run = trace_ring(g, world, which, spinning, sampler.available() ? &sampler : nullptr);
        run.kernel = name;
        run.untraced = untraced;
        run.alone_forward_clocks = alone_forward_clocks;
        run.alone_backward_clocks = alone_backward_clocks;
        for (std::size_t r = 0; r < run.forward.ranks.size(); ++r)
          for (std::size_t i = 0; i < run.forward.ranks[r].steps.size(); ++i) {
            run.forward.ranks[r].steps[i].alone_ms = alone.forward[r][i];
            run.backward.ranks[r].steps[i].alone_ms = alone.backward[r][i];
          }
        std::printf("\n==== S %d, forward kernel %s, confirm waits: %s ====", s, name.c_str(), run.waits.c_str());
        tr::print_table(run.forward);
        tr::print_table(run.backward);
        std::fflush(stdout);
        runs.push_back(std::move(run));
      }
    }
  }
  std::printf("\n==== summaries (times in ms from t0; the untraced ring's forward / backward are medians) ====\n");
  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
  if (!json_path.empty() && json == nullptr) throw invalid_argument("--trace-json", json_path, "must be a file that can be written");
  tr::json_writer j(json);
  if (json) {
    j.open('{').field("device", std::string(prop.name)).field("sms", prop.multiProcessorCount).field("world", world).field("hq", hq);
    j.field("hkv", hkv).field("dim", dim).field("repeats", repeats).field("cuda_device_max_connections", std::string(connections ? connections : ""));
    j.field("clock_sampled", sampler.available() ? 1 : 0);
    j.key("runs").open('[');
  }
  for (const trace_run& run : runs) {
    char label[160];
    std::snprintf(label, sizeof label, "S %d %s waits=%s", run.seq_len, run.kernel.c_str(), run.waits.c_str());
    std::printf("%s: untraced forward %.2f ms, backward %.2f ms\n", label, run.untraced.forward_ms, run.untraced.backward_ms);
    const tr::phase_summary f = tr::summarize(run.forward), b = tr::summarize(run.backward);
    tr::print_summary(label, run.forward, f);
    tr::print_summary(label, run.backward, b);
    if (json) {
      j.open('{').field("seq_len", run.seq_len).field("forward_kernel", run.kernel).field("waits", run.waits);
      j.field("untraced_forward_ms", run.untraced.forward_ms).field("untraced_backward_ms", run.untraced.backward_ms);
      j.field("alone_forward_median_mhz", run.alone_forward_clocks.median).field("alone_backward_median_mhz", run.alone_backward_clocks.median);
      j.key("phases").open('[');
      tr::write_phase(j, run.forward, f);
      tr::write_phase(j, run.backward, b);
      j.close(']').close('}');
    }
  }
  if (json) {
    j.close(']').close('}');
    std::fputc('\n', json);
    if (std::fclose(json) != 0) throw invalid_argument("--trace-json", json_path, "could not be written completely");
    std::printf("trace written to %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<index_t> seq_lens{131072, 524288};
  index_t world = 8;
  int repeats = 5;
  bool checked = false, pool_dependencies = false, trace = false, trace_spin = false;
  std::string trace_json;
  std::vector<std::pair<std::string, device::forward_kernel>> forward_kernels;  // --forward-kernels
  std::vector<index_t> solver_tasks;                                               // --solver-tasks
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--checked" || flag == "--pool-dependencies") {
      (flag == "--checked" ? checked : pool_dependencies) = true;
      continue;
    }
    if (flag == "--trace" || flag == "--trace-spin") {
      trace = true;
      trace_spin = trace_spin || flag == "--trace-spin";
      continue;
    }
    if (i + 1 >= argc) throw invalid_argument(flag, "(missing)", "needs a value");
    const std::string value = argv[++i];
    if (flag == "--seq-len") seq_lens = bench::parse_sizes(flag, value);
    else if (flag == "--world") world = cli::parse_integer<index_t>(flag, value, 1);
    else if (flag == "--repeats") repeats = cli::parse_integer<int>(flag, value, 1);
    else if (flag == "--forward-kernels") {
      for (const std::string& name : bench::split_list(value)) {
        if (name == "automatic") forward_kernels.emplace_back(name, device::forward_kernel::automatic);
        else if (name == "mma_sync") forward_kernels.emplace_back(name, device::forward_kernel::mma_sync);
        else if (name == "wgmma") forward_kernels.emplace_back(name, device::forward_kernel::wgmma);
        else throw invalid_argument(flag, value, "must be a comma-separated list of automatic, mma_sync and wgmma (\"" + name + "\" is none of them)");
      }
      if (forward_kernels.empty()) throw invalid_argument(flag, value, "must name at least one of automatic, mma_sync and wgmma");
    } else if (flag == "--solver-tasks") solver_tasks = bench::parse_sizes(flag, value);
    else if (flag == "--trace-json") {
      if (value.empty()) throw invalid_argument(flag, value, "must name a file");
      trace_json = value;
      trace = true;
    } else
      throw invalid_argument("flag", flag,
                             "must be --seq-len, --world, --repeats, --checked, --pool-dependencies, --forward-kernels, --trace, --trace-spin, "
                             "--trace-json or --solver-tasks");
  }
  if (!solver_tasks.empty()) {
    if (trace || checked || pool_dependencies || !forward_kernels.empty())
      throw invalid_argument("--solver-tasks", "with --trace, --checked, --pool-dependencies or --forward-kernels", "runs alone");
    for (const index_t s : seq_lens)
      for (const index_t m : solver_tasks) time_solver_tasks(vs95(s), world, m, repeats);
    return 0;
  }
  if (trace) {
    if (checked || pool_dependencies) throw invalid_argument("--trace", "with --checked or --pool-dependencies", "runs alone (parts 1-5 are skipped)");
    if (forward_kernels.empty()) forward_kernels.emplace_back("automatic", device::forward_kernel::automatic);
    return run_traces(seq_lens, world, repeats, trace_spin, forward_kernels, trace_json);
  }
  cudaDeviceProp prop{};
  STRIA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("ring_bench on %s: Hq %d, Hkv %d, D %d, bf16, causal, vs95, flat ring of %d ranks, median of %d\n", prop.name, hq, hkv, dim,
              world, repeats);
  std::printf("%-8s %-11s %9s %9s %10s %12s %10s %14s%s\n", "S", "sharding", "worker", "step", "ring ms", "busiest ms", "work ms",
              "local_device ms", checked ? "     checked ms  checked cost" : "");
  cli::progress progress;  // on stderr, when it is a terminal
  for (const index_t s : seq_lens) {
    progress.phase("S = " + std::to_string(s) + ": sequential, zigzag, striped");
    const global_selection g = vs95(s);
    double busiest_zigzag = 0, busiest_striped = 0, ring_zigzag = 0, ring_striped = 0;
    std::vector<std::string> pool_rows, kernel_rows;  // --pool-dependencies, --forward-kernels: printed after the table
    auto compare_pool = [&](const global_selection& sel, const auto& sharding, const char* name) {
      const ring_times with = time_ring(sel, sharding, world, repeats, finite_check::off, true);
      allow_pool_internal_dependencies(false);
      const ring_times without = time_ring(sel, sharding, world, repeats, finite_check::off, true);
      allow_pool_internal_dependencies(true);
      char line[256];
      std::snprintf(line, sizeof line, "%-8d %-11s %10.2f %10.2f %10.2f %12.2f %10.2f %10.2f", s, name, with.forward_ms, with.backward_ms,
                    with.layer_ms, without.forward_ms, without.backward_ms, without.layer_ms);
      pool_rows.push_back(line);
    };
    auto report = [&](const char* name, balance b) {
      const std::string engine = b.ring_engine_ms > 0 ? std::to_string(b.ring_engine_ms).substr(0, std::to_string(b.ring_engine_ms).find('.') + 3) : "-";
      std::printf("%-8d %-11s %9.3f %9.3f %10.2f %12.2f %10.2f %14s", s, name, b.worker_imbalance, b.step_imbalance, b.ring_ms,
                  b.busiest_rank_ms, b.total_ms, engine.c_str());
      if (b.checked_ms > 0) std::printf(" %14.2f %12.1f%%", b.checked_ms, 100.0 * (b.checked_ms / b.ring_engine_ms - 1.0));
      std::printf("\n");
      std::fflush(stdout);
    };
    {
      balance b = time_steps(g, sharding::sequential{}, world, repeats);
      report("sequential", b);
    }
    {
      balance b = time_steps(g, sharding::zigzag{}, world, repeats);
      b.ring_engine_ms = time_ring(g, sharding::zigzag{}, world, repeats, finite_check::off).layer_ms;
      if (checked) b.checked_ms = time_ring(g, sharding::zigzag{}, world, repeats, finite_check::every_step).layer_ms;
      if (pool_dependencies) compare_pool(g, sharding::zigzag{}, "zigzag");
      busiest_zigzag = b.busiest_rank_ms;
      ring_zigzag = b.ring_ms;
      report("zigzag", b);
    }
    {
      balance b = time_steps(g, sharding::striped<64>{}, world, repeats);
      b.ring_engine_ms = time_ring(g, sharding::striped<64>{}, world, repeats, finite_check::off).layer_ms;
      if (checked) b.checked_ms = time_ring(g, sharding::striped<64>{}, world, repeats, finite_check::every_step).layer_ms;
      if (pool_dependencies) compare_pool(g, sharding::striped<64>{}, "striped");
      for (const auto& [name, which] : forward_kernels) {
        const ring_times t = time_ring(g, sharding::striped<64>{}, world, repeats, finite_check::off, true, which);
        char line[256];
        std::snprintf(line, sizeof line, "%-8d %-11s %-10s %10.2f %10.2f %10.2f", s, "striped", name.c_str(), t.forward_ms, t.backward_ms, t.layer_ms);
        kernel_rows.push_back(line);
      }
      busiest_striped = b.busiest_rank_ms;
      ring_striped = b.ring_ms;
      report("striped", b);
    }
    std::printf("%-8d zigzag / striped: busiest rank %.2fx, synchronous ring %.2fx\n", s, busiest_zigzag / busiest_striped, ring_zigzag / ring_striped);
    if (!pool_rows.empty()) {
      std::printf("local_device ring, forward and backward timed apart; the pool's cross-stream waits allowed | forbidden:\n");
      std::printf("%-8s %-11s %10s %10s %10s %12s %10s %10s\n", "S", "sharding", "fwd ms", "bwd ms", "layer ms", "fwd ms", "bwd ms", "layer ms");
      for (const std::string& line : pool_rows) std::printf("%s\n", line.c_str());
    }
    if (!kernel_rows.empty()) {
      std::printf("local_device ring, forward and backward timed apart, per forward kernel:\n");
      std::printf("%-8s %-11s %-10s %10s %10s %10s\n", "S", "sharding", "forward", "fwd ms", "bwd ms", "layer ms");
      for (const std::string& line : kernel_rows) std::printf("%s\n", line.c_str());
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ring_bench: %s\n", e.what());
  return 1;
}
