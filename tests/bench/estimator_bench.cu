// SPDX-License-Identifier: Apache-2.0
// Benchmark (a program, not a test): the online estimator on the GPU against the attention it serves.
// Qwen2.5-3B attention shape (Hq 16, Hkv 2, D 128), bf16 synthetic Vertical-Slash inputs.
//  - S = 128K on one GPU: window statistics + GPU selection (estimate_device), then the step index build;
//  - S = 128K and 512K over W = 8 ranks sharing the one GPU (threads, comm::local_device collectives): every rank's
//    estimate and its 8 step indices; per rank = total / 8 is what one rank would take on its own GPU
//    if the 8 shared nothing (they share this GPU, so the total is close to the sum of their work);
//    at 128K also rank 0's statistics phase by phase, from one more synchronising run;
//  - for each length, the sparse forward + backward over the estimated selection on one GPU (the
//    Hopper kernels, random V and dO): what the estimate is a share of. Per rank of W that is the
//    one-GPU time / W (a balanced ring's compute).
// Medians of repeated runs after warm-up; wall-clock for the estimate (it includes its host steps:
// the selection's and the index build's, and the ranks meeting in each collective), CUDA events for
// the attention.
//   estimator_bench [--once] [--json FILE --commit SHA]   (--once, for profilers: the 128K phase breakdown (4 estimates)
//                                                          and the one-rank case with 2 warm-ups and 1 timed run, no attention;
//                                                          --json: rows as tests/bench/results/estimator_h200.json)
#include <cuda_bf16.h>
#include <thrust/count.h>
#include <thrust/execution_policy.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/numeric.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.cuh"
#include "stria/host/synthetic_vs.hpp"
#include "stria/index/local_index.cuh"
#include "stria/index/workload.hpp"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/topology/flat_ring.hpp"
#include "../../examples/common/progress.hpp"
#include "timing.cuh"

using namespace stria;
using clock_type = std::chrono::steady_clock;

namespace {

double ms(clock_type::time_point a, clock_type::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

struct result {
  double estimate_ms, index_ms, density;
  estimator::statistics_timing phases;  // rank 0's, from the extra synchronising run (with `breakdown`)
  double statistics_ms, selection_ms;   // that run's statistics and GPU selection on rank 0
  index_t candidates_per_head;          // the width of rank 0's union rows (each head's first `keep`)
  global_selection selection;           // rank 0's (every rank's) estimate of the last run
};

/// All ranks' estimate and index builds on `world` threads sharing the GPU; medians over `repeats`.
/// With `breakdown`, one more run outside the medians times rank 0's statistics phase by phase
/// (each phase ends with a synchronisation; the other ranks run unprofiled).
result run(const host::synthetic_vs& data, const host::synthetic_vs_options& o, index_t world, int repeats, bool breakdown) {
  const index_t s = o.seq_len, hq = o.heads_q, hkv = o.heads_kv, d = o.head_dim, local = s / world;
  const sharding::striped<64> sharding;
  const topology::flat_ring ring(world);
  // Per-rank bf16 shards on the device.
  std::vector<device_buffer<__nv_bfloat16>> q_d, k_d;
  for (index_t r = 0; r < world; ++r) {
    std::vector<__nv_bfloat16> q(static_cast<std::size_t>(local) * hq * d), k(static_cast<std::size_t>(local) * hkv * d);
    for (index_t lb = 0; lb < local / 64; ++lb) {
      const index_t gb = sharding.global_block({s / 64, world}, {r, lb});
      for (index_t t = 0; t < 64; ++t) {
        const std::size_t gt = static_cast<std::size_t>(gb * 64 + t), lt = static_cast<std::size_t>(lb * 64 + t);
        for (index_t x = 0; x < hq * d; ++x) q[lt * hq * d + x] = from_float<__nv_bfloat16>(data.q[gt * hq * d + x]);
        for (index_t x = 0; x < hkv * d; ++x) k[lt * hkv * d + x] = from_float<__nv_bfloat16>(data.k[gt * hkv * d + x]);
      }
    }
    q_d.emplace_back(std::span<const __nv_bfloat16>(q));
    k_d.emplace_back(std::span<const __nv_bfloat16>(k));
  }
  std::vector<double> estimate_ms, index_ms;
  global_selection selection;
  result out{};
  comm::local_device_world ranks(world, 0, std::chrono::seconds(600));
  ranks.run([&](comm::local_device& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    cudaStream_t stream{};
    STRIA_CUDA_CHECK(cudaStreamCreate(&stream));
    const estimator::vertical_slash_top_p estimator;
    for (int i = 0; i < repeats + 2; ++i) {  // two warm-up rounds
      c.barrier();
      const auto t0 = clock_type::now();
      const device_selection on_device = estimator::estimate_device(estimator, c, sharding, s, true, q_d[r].data(), k_d[r].data(), hq,
                                                                    hkv, d, 1.0 / std::sqrt(double(d)), stream);
      c.barrier();
      const auto t1 = clock_type::now();
      const std::vector<device_step_index> indices = build_ring_indices_device(on_device, sharding, ring, c.rank(), stream);
      STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));  // the builds' last kernels belong to this timing
      c.barrier();
      const auto t2 = clock_type::now();
      if (r == 0 && i >= 2) {
        estimate_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        index_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
      if (r == 0 && i == repeats + 1) selection = on_device.to_host(stream);
    }
    if (breakdown) {
      c.barrier();
      const auto t0 = clock_type::now();
      const estimator::device_statistics st = estimator::gather_window_statistics_device(
          c, sharding, s, true, q_d[r].data(), k_d[r].data(), hq, hkv, d, 1.0 / std::sqrt(double(d)), estimator.request(s), stream,
          r == 0 ? &out.phases : nullptr);
      STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto t1 = clock_type::now();
      (void)estimator::select_device(st, estimator.rule(s), stream);
      STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (r == 0) {
        out.statistics_ms = ms(t0, t1);
        out.selection_ms = ms(t1, clock_type::now());
        out.candidates_per_head = st.candidates_per_head;
      }
    }
    STRIA_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  const ring_workload w = count_ring_workload(selection, sharding, ring);
  out.selection = std::move(selection);
  out.estimate_ms = median(estimate_ms);
  out.index_ms = median(index_ms);
  out.density = double(w.total()) / (double(s) * (s + 1) / 2.0 * hq);
  return out;
}

struct not_finite {
  __device__ bool operator()(float v) const { return !isfinite(v); }
};

/// Counts NaN or infinite values of x (after a run into poisoned outputs).
std::size_t non_finite(const device_buffer<float>& x) {
  return static_cast<std::size_t>(thrust::count_if(thrust::device, x.data(), x.data() + x.size(), not_finite{}));
}

/// The sparse forward and backward (atomic mode, the automatic kernels) over `g` on one GPU, one step
/// over the whole sequence: medians of CUDA-event timings after a warm-up, on random non-zero Q, K,
/// V and dO (the times do not depend on the values), outputs poisoned and checked once.
std::pair<double, double> attention_ms(const global_selection& g, index_t heads_q, index_t heads_kv, index_t dim, int repeats) {
  using T = __nv_bfloat16;
  const index_t s = g.seq_len;
  const auto q_elements = static_cast<std::size_t>(s) * static_cast<std::size_t>(heads_q * dim),
             kv_elements = static_cast<std::size_t>(s) * static_cast<std::size_t>(heads_kv * dim);
  const device_buffer<T> q = bench::random_buffer(q_elements, 1, 2.0f), k = bench::random_buffer(kv_elements, 2, 2.0f),
                         v = bench::random_buffer(kv_elements, 3, 1.0f), d_out = bench::random_buffer(q_elements, 4, 1.0f);
  device_buffer<float> out(q_elements), lse(static_cast<std::size_t>(heads_q) * s), delta(lse.size()), dq(q_elements), dk(kv_elements),
      dv(kv_elements);
  device_buffer<T> out_t(q_elements);
  const tensor_view<const T, 3> qv(q.data(), {s, heads_q, dim}), kv(k.data(), {s, heads_kv, dim}), vv(v.data(), {s, heads_kv, dim}),
      dov(d_out.data(), {s, heads_q, dim});
  const tensor_view<float, 3> out_view(out.data(), {s, heads_q, dim}), dq_view(dq.data(), {s, heads_q, dim}),
      dk_view(dk.data(), {s, heads_kv, dim}), dv_view(dv.data(), {s, heads_kv, dim});
  const tensor_view<float, 2> lse_view(lse.data(), {heads_q, s}), delta_view(delta.data(), {heads_q, s});
  const double scale = 1.0 / std::sqrt(double(dim));
  const device_selection selection(g);
  const device_step_index index = build_local_index_device(selection, sharding::sequential{}, 1, 0, 0, {});
  auto forward = [&] {
    device::sparse_forward<T>(index, {.q = qv, .k = kv, .v = vv, .out = out_view, .lse = lse_view}, scale, nullptr,
                              {.state = device::running_state::overwrite});
  };
  auto backward = [&] {
    device::sparse_backward<T>(
        index, {.q = qv, .k = kv, .v = vv, .d_out = dov, .lse = lse_view, .delta = delta_view, .dq = dq_view, .dk = dk_view, .dv = dv_view}, scale,
        nullptr);
  };
  out.fill_bytes(0xff);  // NaN
  forward();
  device::write_output<T>(out_view, tensor_view<T, 3>(out_t.data(), {s, heads_q, dim}), nullptr);
  device::backward_delta<T>(tensor_view<const T, 3>(out_t.data(), {s, heads_q, dim}), dov, delta_view, nullptr);
  for (device_buffer<float>* x : {&dq, &dk, &dv}) x->fill_bytes(0);
  backward();
  if (const std::size_t bad = non_finite(out) + non_finite(dq) + non_finite(dk) + non_finite(dv); bad != 0)
    throw std::runtime_error(std::to_string(bad) + " non-finite values in the attention's output or gradients");
  return {bench::median_ms(repeats, forward), bench::median_ms(repeats, backward)};
}

/// One row of tests/bench/results/estimator_h200.json. Per rank: the estimate and index of all
/// ranks sharing the GPU / world; attention = the one-GPU forward + backward / world.
struct json_row {
  std::string name;
  index_t seq_len, world;
  double estimate_ms, index_ms, forward_ms, backward_ms, density;
};

void write_json(const std::string& path, const std::string& commit, const std::string& gpu, const std::vector<json_row>& rows) {
  std::ofstream out(path);
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  auto number = [](double x) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.4f", x);
    return std::string(buffer);
  };
  out << "{\"commit\": \"" << commit << "\", \"date\": \"" << date << "\", \"gpu\": \"" << gpu << "\", \"rows\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const json_row& r = rows[i];
    const double w = r.world, attention = (r.forward_ms + r.backward_ms) / w;
    out << (i ? "," : "") << "\n  {\"name\": \"" << r.name << "\", \"seq_len\": " << r.seq_len << ", \"world\": " << r.world
        << ", \"estimate_ms\": " << number(r.estimate_ms / w) << ", \"index_ms\": " << number(r.index_ms / w)
        << ", \"attention_ms\": " << number(attention) << ", \"share\": " << number((r.estimate_ms + r.index_ms) / w / attention)
        << ", \"all_ranks_estimate_ms\": " << number(r.estimate_ms) << ", \"all_ranks_index_ms\": " << number(r.index_ms)
        << ", \"one_gpu_forward_ms\": " << number(r.forward_ms) << ", \"one_gpu_backward_ms\": " << number(r.backward_ms)
        << ", \"density\": " << number(r.density) << "}";
  }
  out << "\n]}\n";
  if (!out) throw std::runtime_error("--json " + path + ": could not be written");
}

}  // namespace

int main(int argc, char** argv) try {
  bool once = false;
  std::string json_path, commit = "unknown";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--once") {
      once = true;
    } else if ((flag == "--json" || flag == "--commit") && i + 1 < argc) {
      (flag == "--json" ? json_path : commit) = argv[++i];
    } else {
      std::fprintf(stderr, "%s: unknown flag or missing value (estimator_bench [--once] [--json FILE --commit SHA])\n", flag.c_str());
      return 2;
    }
  }
  if (once && !json_path.empty()) {
    std::fprintf(stderr, "--once writes no rows: it cannot be combined with --json\n");
    return 2;
  }
  cudaDeviceProp prop{};
  STRIA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("estimator_bench on %s: Hq 16, Hkv 2, D 128, bf16, vertical_slash_top_p defaults, striped<64>\n", prop.name);
  host::synthetic_vs_options o;
  o.heads_q = 16;
  o.heads_kv = 2;
  o.head_dim = 128;
  o.density = 0.05;
  // Where one 128K estimate's time goes (a separate, synchronising run).
  {
    o.seq_len = 131072;
    const host::synthetic_vs data = host::make_synthetic_vs(o);
    std::vector<__nv_bfloat16> q(data.q.size()), k(data.k.size());
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = from_float<__nv_bfloat16>(data.q[i]);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = from_float<__nv_bfloat16>(data.k[i]);
    const device_buffer<__nv_bfloat16> q_d{std::span<const __nv_bfloat16>(q)}, k_d{std::span<const __nv_bfloat16>(k)};
    estimator::statistics_timing t;
    comm::local_device_world one(1, 0);
    one.run([&](comm::local_device& c) {
      const estimator::vertical_slash_top_p e;
      for (int i = 0; i < 3; ++i)
        (void)estimator::gather_window_statistics_device(c, sharding::sequential{}, o.seq_len, true, q_d.data(), k_d.data(), 16, 2, 128,
                                                         1.0 / std::sqrt(128.0), e.request(o.seq_len), nullptr, &t);
      const auto t0 = clock_type::now();
      const estimator::device_statistics st = estimator::gather_window_statistics_device(
          c, sharding::sequential{}, o.seq_len, true, q_d.data(), k_d.data(), 16, 2, 128, 1.0 / std::sqrt(128.0), e.request(o.seq_len), nullptr);
      STRIA_CUDA_CHECK(cudaStreamSynchronize(nullptr));
      const auto t1 = clock_type::now();
      const device_selection on_device = estimator::select_device(st, e.rule(o.seq_len), nullptr);
      STRIA_CUDA_CHECK(cudaStreamSynchronize(nullptr));
      const auto t2 = clock_type::now();
      const vs_statistics host_st = st.download(nullptr);
      const auto t3 = clock_type::now();
      const global_selection g = e.select(host_st);
      const auto t4 = clock_type::now();
      if (!(on_device.to_host(nullptr) == g)) throw std::runtime_error("the GPU and host selections differ");
      std::printf("128K statistics phases (ms): setup %.2f, pass 1 %.2f, softmax %.2f, pass 2 %.2f, top-k %.2f, collectives %.2f;"
                  " unprofiled statistics %.2f, GPU selection %.2f (host selection instead: download %.2f + select %.2f)\n",
                  t.setup_ms, t.pass1_ms, t.softmax_ms, t.pass2_ms, t.topk_ms, t.collectives_ms, ms(t0, t1), ms(t1, t2), ms(t2, t3), ms(t3, t4));
    });
  }
  std::printf("%-34s %12s %14s %10s %22s %10s\n", "case", "estimate ms", "index build ms", "density", "attention fwd + bwd ms", "share");
  cli::progress progress;  // on stderr, when it is a terminal
  std::vector<json_row> rows;
  std::pair<index_t, std::pair<double, double>> attention{0, {}};  // the last length's one-GPU forward and backward
  for (const auto& [seq, world, name] : {std::tuple{131072, 1, "S=128K, 1 rank"}, std::tuple{131072, 8, "S=128K, 8 ranks on one GPU (all)"},
                                          std::tuple{524288, 8, "S=512K, 8 ranks on one GPU (all)"}}) {
    if (once && world > 1) break;
    progress.phase(std::string("case ") + name + ": inputs, then the timed estimates");
    o.seq_len = seq;
    const auto t0 = clock_type::now();
    const host::synthetic_vs data = host::make_synthetic_vs(o);
    const double gen_s = std::chrono::duration<double>(clock_type::now() - t0).count();
    const bool breakdown = world > 1 && seq == 131072;
    const result r = run(data, o, world, once ? 1 : 9, breakdown);
    if (once) break;
    if (attention.first != seq) {  // the estimate is the same on every world size (DESIGN 7): one timing per length
      progress.phase(std::string("case ") + name + ": the attention over the estimate");
      attention = {seq, attention_ms(r.selection, o.heads_q, o.heads_kv, o.head_dim, 5)};
    }
    const auto [forward_ms, backward_ms] = attention.second;
    const double per_rank_attention = (forward_ms + backward_ms) / world;
    std::printf("%-34s %12.2f %14.2f %9.2f%% %10.2f + %8.2f %9.2f%%   (inputs generated in %.1f s)\n", name, r.estimate_ms, r.index_ms,
                100 * r.density, forward_ms, backward_ms, 100 * (r.estimate_ms + r.index_ms) / world / per_rank_attention, gen_s);
    if (world > 1)
      std::printf("%-34s %12.2f %14.2f %10s %22.2f\n", "  per rank (total / 8)", r.estimate_ms / world, r.index_ms / world, "", per_rank_attention);
    if (breakdown)
      std::printf("  rank 0's statistics phases (ms, a separate synchronising run): setup %.2f, pass 1 %.2f, softmax %.2f, pass 2 %.2f,"
                  " top-k %.2f, collectives %.2f; statistics %.2f + GPU selection %.2f; union kept per head %d\n",
                  r.phases.setup_ms, r.phases.pass1_ms, r.phases.softmax_ms, r.phases.pass2_ms, r.phases.topk_ms, r.phases.collectives_ms,
                  r.statistics_ms, r.selection_ms, static_cast<int>(r.candidates_per_head));
    rows.push_back({world == 1 ? "one_rank" : "ranks_sharing_one_gpu", seq, world, r.estimate_ms, r.index_ms, forward_ms, backward_ms, r.density});
  }
  if (!json_path.empty()) write_json(json_path, commit, prop.name, rows);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
