// SPDX-License-Identifier: Apache-2.0
// Quickstart: distributed sparse attention on a Vertical-Slash input, forward and backward. On a
// GPU (when this build has CUDA and a device is present): W ranks on the one GPU through
// comm::local_device, the front template sparse_attention (online estimate, striped sharding, a
// flat or hierarchical ring) in bf16, checked against single-rank attention (quickstart_gpu.cu).
// Otherwise: the host backend with W simulated ranks (threads), fp32, checked against single-rank
// attention in double precision (this file).
//
// Usage: see options.hpp (--help).
#include <stria/stria.hpp>

#include "../common/progress.hpp"
#include "options.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point start) { return std::chrono::duration<double>(clock_type::now() - start).count(); }

double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && double(got[i]) == want[i]) continue;
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

/// The host path's memory at its peak: about 60 bytes per element of Q (fp32: the input, dO, the
/// ranks' shards of both, O, dQ, a joined result; fp64: the reference's Q, dO, O, dQ) and 40 per
/// element of K and of V (fp32: the input, shards, gradients, a joined result; fp64: the reference's
/// input and gradient), rounded up to 64 and 40. A sequence past the machine's memory is refused up
/// front with the figure, rather than failing in an allocation (std::bad_alloc) or swapping for hours.
void check_host_memory(const quickstart::options& o) {
  const double need = double(o.seq_len) * double(o.head_dim) * (64.0 * double(o.heads_q) + 2.0 * 40.0 * double(o.heads_kv));
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const double have = pages > 0 && page > 0 ? double(pages) * double(page) : 0.0;
#else
  const double have = 0.0;  // unknown: not checked
#endif
  if (have > 0 && need > have) {
    char rule[256];
    std::snprintf(rule, sizeof rule,
                  "needs about %.1f GB of host memory at heads %d/%d and head dim %d (the host backend's fp32 tensors and the fp64 "
                  "reference); this machine has %.1f GB: use a GPU or a shorter sequence",
                  need / 1e9, o.heads_q, o.heads_kv, o.head_dim, have / 1e9);
    throw stria::invalid_argument("--seq-len", o.seq_len, rule);
  }
}

template <class Topology>
int run_host(const quickstart::options& o, const Topology& topology, const std::string& topology_name) {
  using namespace stria;
  const auto start = clock_type::now();
  cli::progress progress;  // on stderr, when it is a terminal
  progress.phase("generating the input");
  host::synthetic_vs_options input;
  input.seq_len = o.seq_len;
  input.heads_q = o.heads_q;
  input.heads_kv = o.heads_kv;
  input.head_dim = o.head_dim;
  input.density = 1.0 - o.sparsity;
  input.seed = o.seed;
  input.validate();  // the shapes' own rules first, then what they cost in memory
  check_host_memory(o);
  const host::synthetic_vs data = host::make_synthetic_vs(input);
  const global_selection& selection = data.planted;
  const sharding::striped<64> sharding;
  const index_t s = o.seq_len, w = o.world, hq = o.heads_q, hkv = o.heads_kv, d = o.head_dim, local = s / w;
  const double scale = 1.0 / std::sqrt(double(d));
  const std::vector<float> d_out = [&] {
    std::vector<float> x(data.q.size());
    std::uint64_t state = o.seed * 0x9e3779b97f4a7c15ULL + 1;
    for (float& v : x) {  // a cheap deterministic stream in [-1, 1), never exactly zero
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      v = float((state >> 40) + 1) / float(1 << 24) * 2.0f - 1.0f;
    }
    return x;
  }();
  const ring_workload workload = count_ring_workload(selection, sharding, topology);
  const imbalance_degrees balance = measure_imbalance(workload);
  const double input_s = seconds_since(start);

  std::printf("stria %d.%d.%d quickstart: host backend, %d simulated ranks (threads), no GPU used\n", version_major, version_minor,
              version_patch, w);
  std::printf("  seq_len %d, heads %d/%d, head_dim %d, causal; synthetic Vertical-Slash input, density %.2f%%\n", s, hq, hkv, d,
              100.0 * double(workload.total()) / (double(s) * (s + 1) / 2.0 * hq));
  std::printf("  sharding striped<64>, topology %s; planned imbalance: worker %.3f, step %.3f\n", topology_name.c_str(),
              balance.worker_mean, balance.step_mean);

  const std::array<index_t, 3> q_ext{s, hq, d}, kv_ext{s, hkv, d};
  const std::array<index_t, 2> lse_ext{hq, s};
  using stria::sharding::join;
  using stria::sharding::split;
  const auto q_s = split(sharding, std::span<const float>(data.q), q_ext, w), k_s = split(sharding, std::span<const float>(data.k), kv_ext, w),
             v_s = split(sharding, std::span<const float>(data.v), kv_ext, w);
  const auto d_out_s = split(sharding, std::span<const float>(d_out), q_ext, w);
  std::vector<std::vector<float>> out_s(q_s), lse_s(static_cast<std::size_t>(w), std::vector<float>(static_cast<std::size_t>(hq) * local));
  std::vector<std::vector<float>> dq_s(q_s), dk_s(k_s), dv_s(k_s);
  std::vector<double> index_s(static_cast<std::size_t>(w)), forward_s(static_cast<std::size_t>(w)), backward_s(static_cast<std::size_t>(w));

  progress.phase("index, forward and backward on " + std::to_string(w) + " simulated ranks");
  comm::host_world world(w);
  world.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    auto t = clock_type::now();
    const std::vector<step_index> indices = build_ring_indices(selection, sharding, topology, c.rank());
    index_s[r] = seconds_since(t);
    auto q3 = [&](const std::vector<float>& x) { return tensor_view<const float, 3>(x.data(), {local, hq, d}); };
    auto kv3 = [&](const std::vector<float>& x) { return tensor_view<const float, 3>(x.data(), {local, hkv, d}); };
    t = clock_type::now();
    host::ring_forward(c, topology, std::span<const step_index>(indices),
                       forward_tensors<float>{q3(q_s[r]), kv3(k_s[r]), kv3(v_s[r]), tensor_view<float, 3>(out_s[r].data(), {local, hq, d}),
                                              tensor_view<float, 2>(lse_s[r].data(), {hq, local})},
                       scale);
    forward_s[r] = seconds_since(t);
    t = clock_type::now();
    host::ring_backward(c, topology, std::span<const step_index>(indices),
                        backward_tensors<float>{q3(q_s[r]), kv3(k_s[r]), kv3(v_s[r]), q3(out_s[r]), q3(d_out_s[r]),
                                                tensor_view<const float, 2>(lse_s[r].data(), {hq, local}),
                                                tensor_view<float, 3>(dq_s[r].data(), {local, hq, d}),
                                                tensor_view<float, 3>(dk_s[r].data(), {local, hkv, d}),
                                                tensor_view<float, 3>(dv_s[r].data(), {local, hkv, d})},
                        scale);
    backward_s[r] = seconds_since(t);
  });
  auto slowest = [](const std::vector<double>& x) { return *std::max_element(x.begin(), x.end()); };
  std::printf("  time (slowest rank): input %.2f s, index build %.3f s, forward %.2f s, backward %.2f s\n", input_s, slowest(index_s),
              slowest(forward_s), slowest(backward_s));

  // Reference: one rank, the whole sequence, double precision.
  std::printf("  checking against single-rank attention in double precision...\n");
  std::fflush(stdout);
  progress.phase("the single-rank reference in double precision");
  const step_index whole = build_local_index(selection, sharding::sequential{}, 1, 0, 0);
  const std::vector<double> q64(data.q.begin(), data.q.end()), k64(data.k.begin(), data.k.end()), v64(data.v.begin(), data.v.end()),
      d_out64(d_out.begin(), d_out.end());
  std::vector<double> out64(q64.size()), lse64(static_cast<std::size_t>(hq) * s), dq64(q64.size(), 0.0), dk64(k64.size(), 0.0),
      dv64(k64.size(), 0.0);
  auto q3 = [&](const std::vector<double>& x) { return tensor_view<const double, 3>(x.data(), q_ext); };
  auto kv3 = [&](const std::vector<double>& x) { return tensor_view<const double, 3>(x.data(), kv_ext); };
  host::reference_forward<double>(q3(q64), kv3(k64), kv3(v64), whole.view(), scale, tensor_view<double, 3>(out64.data(), q_ext),
                                  tensor_view<double, 2>(lse64.data(), lse_ext));
  host::reference_backward<double>(q3(q64), kv3(k64), kv3(v64), q3(out64), q3(d_out64), tensor_view<const double, 2>(lse64.data(), lse_ext),
                                   whole.view(), scale, tensor_view<double, 3>(dq64.data(), q_ext),
                                   tensor_view<double, 3>(dk64.data(), kv_ext), tensor_view<double, 3>(dv64.data(), kv_ext));
  const double e_out = relative_error(join(sharding, out_s, q_ext), out64), e_lse = relative_error(join(sharding, lse_s, lse_ext, 1), lse64);
  const double e_dq = relative_error(join(sharding, dq_s, q_ext), dq64), e_dk = relative_error(join(sharding, dk_s, kv_ext), dk64),
               e_dv = relative_error(join(sharding, dv_s, kv_ext), dv64);
  std::printf("  relative error vs fp64: out %.1e, lse %.1e, dq %.1e, dk %.1e, dv %.1e\n", e_out, e_lse, e_dq, e_dk, e_dv);
  const bool ok = std::max({e_out, e_lse, e_dq, e_dk, e_dv}) < 1e-4;
  std::printf("%s (total %.1f s)\n", ok ? "ok" : "FAILED: the distributed result differs from the reference beyond 1e-4", seconds_since(start));
  return ok ? 0 : 1;
}

}  // namespace

#if defined(STRIA_QUICKSTART_GPU)
bool quickstart_gpu_present();                      // quickstart_gpu.cu
int quickstart_gpu_count();                         // quickstart_gpu.cu
int quickstart_on_gpu(const quickstart::options&);  // quickstart_gpu.cu
#else
bool quickstart_gpu_present() { return false; }
int quickstart_gpu_count() { return 0; }
int quickstart_on_gpu(const quickstart::options&) { return 2; }
#endif

int main(int argc, char** argv) try {
  quickstart::options o = quickstart::parse(argc, argv);
  const bool gpu = o.backend != quickstart::backend_choice::host && quickstart_gpu_present();
  if (o.backend == quickstart::backend_choice::gpu && !gpu) {
    std::fprintf(stderr, "quickstart --gpu: no usable CUDA device (or this build has no CUDA)\n");
    return 77;  // CTest's skip code
  }
  quickstart::apply_defaults(o, gpu, gpu ? quickstart_gpu_count() : 0);
  if (gpu) return quickstart_on_gpu(o);
  if (o.repeats_given)  // no GPU found, so the same command line runs the host path: say what it drops
    std::fprintf(stderr, "quickstart: no GPU, so the host backend runs one layer; --repeats %d times the GPU path only\n", o.repeats);
  if (o.nodes > 1) return run_host(o, stria::topology::hierarchical_ring(o.nodes, o.world / o.nodes),
                                   "hierarchical_ring(" + std::to_string(o.nodes) + "x" + std::to_string(o.world / o.nodes) + ")");
  return run_host(o, stria::topology::flat_ring(o.world), "flat_ring(" + std::to_string(o.world) + ")");
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
