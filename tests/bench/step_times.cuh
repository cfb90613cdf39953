// SPDX-License-Identifier: Apache-2.0
// Shared by ring_bench and multi_gpu_bench: one call's forward and backward kernel time on an index
// alone on the GPU (CUDA events, median after warm-up), one rank's at every ring step, and the measured
// imbalance degrees of a (rank, step) time matrix (MTraining 4.1: worker = max / mean over the ranks
// of a step, step = max / mean over the steps of a rank).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "stria/core/device_buffer.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/index/local_index.cuh"
#include "timing.cuh"

namespace stria::bench {

struct head_shape {
  index_t hq = 16, hkv = 2, dim = 128;
};

/// Random inputs and zeroed fp32 outputs of one call over `tokens` query and as many key tokens, and
/// the time of its forward (into the running state as `state` says) and backward on an index alone
/// on the current device (median of `repeats`). Inputs are random: kernel time depends on the index,
/// not on the values.
struct call_timer {
  using T = __nv_bfloat16;
  index_t tokens;
  head_shape h;
  device_buffer<T> q, k, v, d_out;
  device_buffer<float> out, lse, delta, dq, dk, dv;

  call_timer(index_t tokens_, head_shape shape)
      : tokens(tokens_),
        h(shape),
        q(random_buffer(std::size_t(tokens) * h.hq * h.dim, 1, 2.0f)),
        k(random_buffer(std::size_t(tokens) * h.hkv * h.dim, 2, 2.0f)),
        v(random_buffer(std::size_t(tokens) * h.hkv * h.dim, 3, 1.0f)),
        d_out(random_buffer(q.size(), 4, 1.0f)),
        out(q.size()), lse(std::size_t(h.hq) * tokens), delta(lse.size()), dq(q.size()), dk(k.size()), dv(v.size()) {
    for (auto* b : {&out, &lse, &delta, &dq, &dk, &dv}) b->fill_bytes(0);
  }

  /// Forward and backward milliseconds of `index`.
  std::pair<double, double> ms(const device_step_index& index, device::running_state state, int repeats) {
    const double scale = 1.0 / std::sqrt(double(h.dim));
    const tensor_view<const T, 3> qv(q.data(), {tokens, h.hq, h.dim}), kv(k.data(), {tokens, h.hkv, h.dim}), vv(v.data(), {tokens, h.hkv, h.dim}),
        dov(d_out.data(), {tokens, h.hq, h.dim});
    const double fwd = median_ms(repeats, [&] {
      device::sparse_forward<T>(index,
                                {.q = qv,
                                 .k = kv,
                                 .v = vv,
                                 .out = tensor_view<float, 3>(out.data(), {tokens, h.hq, h.dim}),
                                 .lse = tensor_view<float, 2>(lse.data(), {h.hq, tokens})},
                                scale, nullptr, {.state = state});
    });
    const double bwd = median_ms(repeats, [&] {
      device::sparse_backward<T>(index,
                                 {.q = qv,
                                  .k = kv,
                                  .v = vv,
                                  .d_out = dov,
                                  .lse = tensor_view<const float, 2>(lse.data(), {h.hq, tokens}),
                                  .delta = tensor_view<const float, 2>(delta.data(), {h.hq, tokens}),
                                  .dq = tensor_view<float, 3>(dq.data(), {tokens, h.hq, h.dim}),
                                  .dk = tensor_view<float, 3>(dk.data(), {tokens, h.hkv, h.dim}),
                                  .dv = tensor_view<float, 3>(dv.data(), {tokens, h.hkv, h.dim})},
                                 scale, nullptr);
    });
    return {fwd, bwd};
  }
};

/// Milliseconds of forward + backward kernels at each of the topology's steps for `rank`, on the
/// current device, each forward overwriting the running state.
template <class Sharding, class Topology>
std::vector<double> rank_step_ms(const device_selection& selection, const Sharding& sharding, const Topology& topology, index_t rank,
                                 head_shape h, int repeats) {
  const index_t world = topology.world_size();
  call_timer calls(selection.seq_len() / world, h);
  std::vector<double> ms;
  for (index_t step = 0; step < topology.num_steps(); ++step) {
    const device_step_index index =
        build_local_index_device(selection, sharding, world, rank, topology.kv_source_rank(rank, step), {0, 0, 0, step, 0});
    const auto [fwd, bwd] = calls.ms(index, device::running_state::overwrite, repeats);
    ms.push_back(fwd + bwd);
  }
  return ms;
}

/// What a (rank, step) time matrix says about balance.
struct step_balance {
  double worker_imbalance = 0;  // mean over steps of max / mean over ranks
  double step_imbalance = 0;    // mean over ranks of max / mean over steps
  double ring_ms = 0;           // sum over steps of the slowest rank: what a synchronous ring waits for
  double busiest_rank_ms = 0;   // the largest per-rank sum
  double total_ms = 0;          // all ranks' work
};

inline step_balance measure_balance(const std::vector<std::vector<double>>& ms) {
  step_balance b;
  const std::size_t ranks = ms.size(), steps = ms.empty() ? 0 : ms.front().size();
  for (std::size_t step = 0; step < steps; ++step) {
    double worst = 0, sum = 0;
    for (std::size_t r = 0; r < ranks; ++r) worst = std::max(worst, ms[r][step]), sum += ms[r][step];
    b.worker_imbalance += sum > 0 ? worst / (sum / double(ranks)) / double(steps) : 1.0 / double(steps);
    b.ring_ms += worst;
    b.total_ms += sum;
  }
  for (const std::vector<double>& row : ms) {
    const double sum = std::accumulate(row.begin(), row.end(), 0.0);
    b.step_imbalance += sum > 0 ? *std::max_element(row.begin(), row.end()) / (sum / double(steps)) / double(ranks) : 1.0 / double(ranks);
    b.busiest_rank_ms = std::max(b.busiest_rank_ms, sum);
  }
  return b;
}

}  // namespace stria::bench
