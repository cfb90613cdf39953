// SPDX-License-Identifier: Apache-2.0
// The quickstart's GPU path: one rank per GPU over NCCL where there are several GPUs (or with
// --nccl), else W ranks on the one GPU (comm::local_device); each rank runs the front template
// sparse_attention<vertical_slash_top_p, striped<64>, Topology, tile<64, 64, D>> in bf16:
// the online estimate, forward and backward of one layer, timed per phase (median over repeats
// after a warm-up). The distributed result is compared with the same sparse attention run as one
// step on one rank: splitting it over ranks and steps must not change it beyond bf16 rounding.
#include <cuda_bf16.h>

#include <stria/comm/local_device.cuh>
#if defined(STRIA_QUICKSTART_NCCL)
#include <stria/comm/nccl.cuh>
#endif
#include <stria/sparse_attention.cuh>
#include <stria/stria.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "../common/progress.hpp"
#include "options.hpp"

/// A device is present and this build has code for it (STRIA_CUDA_GENCODE picks the architectures).
bool quickstart_gpu_present() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return false;
  cudaFuncAttributes attributes{};
  const bool runnable = cudaFuncGetAttributes(&attributes, stria::kernel::write_output<__nv_bfloat16>) == cudaSuccess;
  (void)cudaGetLastError();
  return runnable;
}

namespace {

using namespace stria;
using T = __nv_bfloat16;
using clock_type = std::chrono::steady_clock;

double ms_between(clock_type::time_point a, clock_type::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

std::vector<T> to_bf16(const std::vector<float>& x) {
  std::vector<T> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
  return y;
}

std::vector<float> to_float(const std::vector<T>& x) {
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}

/// Relative L2 error of `got` against `want`, over the entries where `want` is finite.
double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(want[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// The whole sequence as one step on one rank, with the kernels the ring runs (the reference). Its
/// backward takes the distributed forward's output and LSE (`out_in`, `lse_in`), as the distributed
/// backward did, so that each comparison measures one pass: dS = P (dP - rowsum(dO O)) subtracts
/// nearly equal numbers, and a bf16 rounding difference in O would otherwise show up amplified in dQ.
struct single_rank_result {
  std::vector<float> out, lse, dq, dk, dv;
};
single_rank_result single_rank(const global_selection& g, const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                               const std::vector<T>& d_out, const std::vector<T>& out_in, const std::vector<float>& lse_in, index_t hq,
                               index_t hkv, index_t dim, double scale) {
  const index_t s = g.seq_len;
  const device_selection selection(g);
  const device_step_index index = build_local_index_device(selection, sharding::sequential{}, 1, 0, 0);
  const device_buffer<T> q_d{std::span<const T>(q)}, k_d{std::span<const T>(k)}, v_d{std::span<const T>(v)}, d_out_d{std::span<const T>(d_out)};
  device_buffer<float> running(q.size()), lse(std::size_t(hq) * s), delta(lse.size()), dq(q.size()), dk(k.size()), dv(v.size());
  device_buffer<T> out(q.size());
  const tensor_view<const T, 3> qv(q_d.data(), {s, hq, dim}), kv(k_d.data(), {s, hkv, dim}), vv(v_d.data(), {s, hkv, dim}),
      dov(d_out_d.data(), {s, hq, dim}), ov(out.data(), {s, hq, dim});
  device::sparse_forward<T>(index,
                            {.q = qv,
                             .k = kv,
                             .v = vv,
                             .out = tensor_view<float, 3>(running.data(), {s, hq, dim}),
                             .lse = tensor_view<float, 2>(lse.data(), {hq, s})},
                            scale, nullptr, {.state = device::running_state::overwrite});
  device::write_output(tensor_view<const float, 3>(running.data(), {s, hq, dim}), tensor_view<T, 3>(out.data(), {s, hq, dim}), nullptr);
  single_rank_result result{to_float(out.download()), lse.download(), {}, {}, {}};
  out.upload(out_in);
  lse.upload(lse_in);
  device::backward_delta(ov, dov, tensor_view<float, 2>(delta.data(), {hq, s}), nullptr);
  for (auto* b : {&dq, &dk, &dv}) b->fill_bytes(0);
  device::sparse_backward<T>(index,
                             {.q = qv,
                              .k = kv,
                              .v = vv,
                              .d_out = dov,
                              .lse = tensor_view<const float, 2>(lse.data(), {hq, s}),
                              .delta = tensor_view<const float, 2>(delta.data(), {hq, s}),
                              .dq = tensor_view<float, 3>(dq.data(), {s, hq, dim}),
                              .dk = tensor_view<float, 3>(dk.data(), {s, hkv, dim}),
                              .dv = tensor_view<float, 3>(dv.data(), {s, hkv, dim})},
                             scale, nullptr);
  // Rounded to bf16, as the distributed run returns them.
  auto rounded = [](const std::vector<float>& x) { return to_float(to_bf16(x)); };
  result.dq = rounded(dq.download());
  result.dk = rounded(dk.download());
  result.dv = rounded(dv.download());
  return result;
}

/// This rank's transfers of one layer with no compute, as the ring moves them: the forward's KV
/// chunks (bf16, K and V packed), or the backward's KV chunks and fp32 dK/dV partials; each step's
/// sends and receives posted in one group, the step's transfers done before the next step's.
/// Timed alone, they show how much communication the steps have to hide.
template <class Comm, class Topology>
void transfers_alone(Comm& c, const Topology& topology, std::size_t kv_elements, bool backward, cudaStream_t st) {
  std::vector<device_buffer<T>> kv;
  std::vector<device_buffer<float>> partials;
  for (int slot = 0; slot < 4; ++slot) {
    kv.emplace_back(2 * kv_elements, st);
    if (backward) partials.emplace_back(2 * kv_elements, st);
  }
  const auto at = [](auto& slots, int i) { return slots[static_cast<std::size_t>(i) % slots.size()].data(); };
  for (index_t step = 0; step < topology.num_steps(); ++step) {
    c.group_start();
    for (const ring_transfer& t : topology.transfers(c.rank(), step)) {
      c.send(at(kv, t.send_buffer), 2 * kv_elements, t.send_to, st, ring_message_tag(t, false));
      c.recv(at(kv, t.receive_buffer), 2 * kv_elements, t.receive_from, st, ring_message_tag(t, false));
    }
    if (backward)
      for (const ring_transfer& t : topology.gradient_transfers(c.rank(), step)) {
        c.send(at(partials, t.send_buffer), 2 * kv_elements, t.send_to, st, ring_message_tag(t, true));
        c.recv(at(partials, t.receive_buffer), 2 * kv_elements, t.receive_from, st, ring_message_tag(t, true));
      }
    c.group_end();
  }
  STRIA_CUDA_CHECK(cudaStreamSynchronize(st));  // the buffers go back to the pool on this stream
}

/// Runs body(comm) on every rank: W ranks sharing GPU 0 (local_device), or one rank per GPU over NCCL.
template <class Body>
void run_ranks(index_t world, bool use_nccl, const Body& body) {
  if (!use_nccl) {
    comm::local_device_world ranks(world);
    ranks.run([&](comm::local_device& c) { body(c); });
    return;
  }
#if defined(STRIA_QUICKSTART_NCCL)
  std::vector<int> devices(static_cast<std::size_t>(world));
  std::iota(devices.begin(), devices.end(), 0);
  comm::run_on_devices(devices, [&](comm::nccl& c) { body(c); });
#else
  throw invalid_argument("--nccl", "(this build)", "needs NCCL, which was not found when the quickstart was built");
#endif
}

template <index_t HeadDim, class Topology>
int run(const quickstart::options& o, const Topology& topology, const std::string& topology_name) {
  using attention = sparse_attention<estimator::vertical_slash_top_p, sharding::striped<64>, Topology, tile<64, 64, HeadDim>>;
  const auto start = clock_type::now();
  STRIA_CUDA_CHECK(cudaSetDevice(0));  // the input, the single-rank reference and rank 0 (local_device: every rank)
  const index_t s = o.seq_len, w = o.world, hq = o.heads_q, hkv = o.heads_kv, d = HeadDim, local = s / w;
  cudaDeviceProp prop{};
  STRIA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (o.use_nccl)
    std::printf("stria %d.%d.%d quickstart: GPU backend, %d rank(s), one per GPU (%s), over NCCL\n", version_major, version_minor,
                version_patch, w, prop.name);
  else
    std::printf("stria %d.%d.%d quickstart: GPU backend on %s, %d ranks sharing it (comm::local_device)\n", version_major, version_minor,
                version_patch, prop.name, w);
  std::printf("  seq_len %d, heads %d/%d, head_dim %d, bf16, causal; synthetic Vertical-Slash input (%.0f%% planted sparsity)\n", s, hq, hkv,
              d, 100.0 * o.sparsity);
  std::printf("  estimator vertical_slash_top_p (defaults), sharding striped<64>, topology %s\n", topology_name.c_str());
  std::printf("  generating the input...\n");
  std::fflush(stdout);
  host::synthetic_vs_options input;
  input.seq_len = s;
  input.heads_q = hq;
  input.heads_kv = hkv;
  input.head_dim = d;
  input.density = 1.0 - o.sparsity;
  input.seed = o.seed;
  const host::synthetic_vs data = host::make_synthetic_vs(input);
  std::vector<float> d_out_f(data.q.size());
  std::uint64_t state = o.seed * 0x9e3779b97f4a7c15ULL + 1;
  for (float& x : d_out_f) {  // a cheap deterministic stream in [-1, 1), never exactly zero
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    x = float((state >> 40) + 1) / float(1 << 24) * 2.0f - 1.0f;
  }
  const std::vector<T> q = to_bf16(data.q), k = to_bf16(data.k), v = to_bf16(data.v), d_out = to_bf16(d_out_f);
  const sharding::striped<64> sharding;
  const std::array<index_t, 3> q_ext{s, hq, d}, kv_ext{s, hkv, d};
  const auto split3 = [&](const std::vector<T>& x, std::array<index_t, 3> e) { return sharding::split(sharding, std::span<const T>(x), e, w); };
  const auto q_s = split3(q, q_ext), k_s = split3(k, kv_ext), v_s = split3(v, kv_ext), d_out_s = split3(d_out, q_ext);

  std::printf("  running %d layer(s) (1 warm-up)...\n", o.repeats + 1);
  std::fflush(stdout);
  cli::progress progress;  // on stderr, when it is a terminal; rank 0 reports
  progress.phase("layers: estimate, forward, backward, transfers alone");
  std::vector<double> estimate_ms, forward_ms, backward_ms, forward_transfers_ms, backward_transfers_ms;
  std::vector<std::vector<T>> out_s(static_cast<std::size_t>(w)), dq_s(out_s.size()), dk_s(out_s.size()), dv_s(out_s.size());
  std::vector<std::vector<float>> lse_s(out_s.size());
  global_selection selection;
  run_ranks(w, o.use_nccl, [&](auto& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const cuda_stream stream;
    const cudaStream_t st = stream.get();
    attention layer({}, sharding, topology, {s, hq, hkv});
    {
      auto up = [&](const std::vector<T>& x) { return device_buffer<T>(std::span<const T>(x), st); };
      const device_buffer<T> q_d = up(q_s[r]), k_d = up(k_s[r]), v_d = up(v_s[r]), d_out_d = up(d_out_s[r]);
      device_buffer<T> out(q_d.size(), st), dq(q_d.size(), st), dk(k_d.size(), st), dv(v_d.size(), st);
      device_buffer<float> lse(std::size_t(hq) * local, st);
      const auto in = [&](const device_buffer<T>& b, index_t heads) { return tensor_view<const T, 3>(b.data(), {local, heads, d}); };
      const auto to = [&](device_buffer<T>& b, index_t heads) { return tensor_view<T, 3>(b.data(), {local, heads, d}); };
      const auto phase_end = [&] {  // every rank's work of the phase is done
        stream.synchronize();
        c.barrier();
        return clock_type::now();
      };
      for (int i = 0; i <= o.repeats; ++i) {
        const auto t0 = phase_end();
        layer.estimate(c, in(q_d, hq), in(k_d, hkv), st);
        const auto t1 = phase_end();
        layer.forward(c, in(q_d, hq), in(k_d, hkv), in(v_d, hkv), to(out, hq), tensor_view<float, 2>(lse.data(), {hq, local}), st);
        const auto t2 = phase_end();
        layer.backward(c, in(q_d, hq), in(k_d, hkv), in(v_d, hkv), in(out, hq), in(d_out_d, hq),
                       tensor_view<const float, 2>(lse.data(), {hq, local}), to(dq, hq), to(dk, hkv), to(dv, hkv), st);
        const auto t3 = phase_end();
        transfers_alone(c, topology, k_d.size(), false, st);
        const auto t4 = phase_end();
        transfers_alone(c, topology, k_d.size(), true, st);
        const auto t5 = phase_end();
        if (r == 0) progress.step("layers (the first a warm-up)", i + 1, o.repeats + 1);
        if (r == 0 && i > 0) {
          estimate_ms.push_back(ms_between(t0, t1));
          forward_ms.push_back(ms_between(t1, t2));
          backward_ms.push_back(ms_between(t2, t3));
          forward_transfers_ms.push_back(ms_between(t3, t4));
          backward_transfers_ms.push_back(ms_between(t4, t5));
        }
      }
      if (r == 0) selection = layer.selection().to_host(st);
      out_s[r] = out.download(st);
      lse_s[r] = lse.download(st);
      dq_s[r] = dq.download(st);
      dk_s[r] = dk.download(st);
      dv_s[r] = dv.download(st);
    }
  });

  const ring_workload workload = count_ring_workload(selection, sharding, topology);
  const imbalance_degrees balance = measure_imbalance(workload);
  const double entries = double(workload.total()), causal = double(s) * (s + 1) / 2.0 * hq;
  const double fwd = median(forward_ms), bwd = median(backward_ms);
  // Rank 0's transfers: KV chunks in bf16, dK/dV partials in fp32 (twice the bytes).
  const double kv_bytes = 2.0 * local * hkv * d * sizeof(T);
  double kv_moves = 0, gradient_moves = 0;
  for (index_t step = 0; step < topology.num_steps(); ++step) {
    kv_moves += topology.transfers(0, step).count;
    gradient_moves += topology.gradient_transfers(0, step).count;
  }
  std::printf("  estimated index: %.2f%% of the causal entries; planned imbalance on it: worker %.3f, step %.3f\n", 100.0 * entries / causal,
              balance.worker_mean, balance.step_mean);
  std::printf("  time per layer (median of %d%s):\n", o.repeats, o.use_nccl ? "" : "; all ranks share the GPU, so this is the whole layer's time");
  std::printf("    estimate %.2f ms (window statistics, top-p selection, every rank's step indices)\n", median(estimate_ms));
  std::printf("    forward  %.2f ms (%.0f effective TFLOPS)\n", fwd, 4.0 * d * entries / (fwd * 1e9));
  std::printf("    backward %.2f ms (%.0f effective TFLOPS)\n", bwd, 10.0 * d * entries / (bwd * 1e9));
  std::printf("    communication %.2f ms forward, %.2f ms backward, timed alone (the same transfers with no compute; in\n"
              "      the layer they overlap the steps on a transfer stream): per rank %.1f MiB of KV forward, %.1f MiB of\n"
              "      KV + fp32 dK/dV backward, %s\n",
              median(forward_transfers_ms), median(backward_transfers_ms), kv_moves * kv_bytes / 1048576.0,
              (kv_moves * kv_bytes + gradient_moves * 2.0 * kv_bytes) / 1048576.0, o.use_nccl ? "NCCL send/recv" : "device copies on one GPU");

  std::printf("  checking against the same sparse attention as one step on one rank...\n");
  std::fflush(stdout);
  const std::vector<T> out = sharding::join(sharding, out_s, q_ext);
  const std::vector<float> lse = sharding::join(sharding, lse_s, std::array<index_t, 2>{hq, s}, 1);
  const single_rank_result ref = single_rank(selection, q, k, v, d_out, out, lse, hq, hkv, d, 1.0 / std::sqrt(double(d)));
  const auto join3 = [&](const std::vector<std::vector<T>>& x, std::array<index_t, 3> e) { return to_float(sharding::join(sharding, x, e)); };
  const double e_out = relative_error(to_float(out), ref.out), e_lse = relative_error(lse, ref.lse);
  const double e_dq = relative_error(join3(dq_s, q_ext), ref.dq), e_dk = relative_error(join3(dk_s, kv_ext), ref.dk),
               e_dv = relative_error(join3(dv_s, kv_ext), ref.dv);
  std::printf("  relative error vs one rank: out %.1e, lse %.1e, dq %.1e, dk %.1e, dv %.1e\n", e_out, e_lse, e_dq, e_dk, e_dv);
  const bool ok = std::max({e_out, e_lse, e_dq, e_dk, e_dv}) < 1e-2;
  std::printf("%s (total %.1f s)\n", ok ? "ok" : "FAILED: the distributed result differs from one rank's beyond 1e-2",
              std::chrono::duration<double>(clock_type::now() - start).count());
  return ok ? 0 : 1;
}

template <index_t HeadDim>
int run_with_topology(const quickstart::options& o) {
  if (o.nodes > 1)
    return run<HeadDim>(o, topology::hierarchical_ring(o.nodes, o.world / o.nodes),
                        "hierarchical_ring(" + std::to_string(o.nodes) + "x" + std::to_string(o.world / o.nodes) + ")");
  return run<HeadDim>(o, topology::flat_ring(o.world), "flat_ring(" + std::to_string(o.world) + ")");
}

}  // namespace

int quickstart_gpu_count() {
  int devices = 0;
  STRIA_CUDA_CHECK(cudaGetDeviceCount(&devices));
  return devices;
}

int quickstart_on_gpu(const quickstart::options& o) { return o.head_dim == 64 ? run_with_topology<64>(o) : run_with_topology<128>(o); }
