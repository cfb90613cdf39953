// SPDX-License-Identifier: Apache-2.0
// Shared by ring_bench and multi_gpu_bench: one rank's forward + backward kernel time at every ring
// step with that step's index alone on the GPU (CUDA events, median after warm-up), and the measured
// imbalance degrees of a (rank, step) time matrix (MTraining 4.1: worker = max / mean over the ranks
// of a step, step = max / mean over the steps of a rank).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "stria/core/device_buffer.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/index/local_index.cuh"
#include "timing.cuh"

namespace stria::bench {

struct head_shape {
  index_t hq = 16, hkv = 2, dim = 128;
};

/// Milliseconds of forward + backward kernels at each of the topology's steps for `rank`, on the
/// current device. Inputs are random: kernel time depends on the index, not on the values.
template <class Sharding, class Topology>
std::vector<double> rank_step_ms(const device_selection& selection, const Sharding& sharding, const Topology& topology, index_t rank,
                                 head_shape h, int repeats) {
  using T = __nv_bfloat16;
  const index_t world = topology.world_size(), local = selection.seq_len() / world;
  const double scale = 1.0 / std::sqrt(double(h.dim));
  const auto q = random_buffer(std::size_t(local) * h.hq * h.dim, 1, 2.0f), k = random_buffer(std::size_t(local) * h.hkv * h.dim, 2, 2.0f),
             v = random_buffer(std::size_t(local) * h.hkv * h.dim, 3, 1.0f), d_out = random_buffer(q.size(), 4, 1.0f);
  device_buffer<float> out(q.size()), lse(std::size_t(h.hq) * local), delta(lse.size()), dq(q.size()), dk(k.size()), dv(v.size());
  for (auto* b : {&out, &lse, &delta, &dq, &dk, &dv}) b->fill_bytes(0);
  const tensor_view<const T, 3> qv(q.data(), {local, h.hq, h.dim}), kv(k.data(), {local, h.hkv, h.dim}), vv(v.data(), {local, h.hkv, h.dim}),
      dov(d_out.data(), {local, h.hq, h.dim});
  std::vector<double> ms;
  for (index_t step = 0; step < topology.num_steps(); ++step) {
    const device_step_index index =
        build_local_index_device(selection, sharding, world, rank, topology.kv_source_rank(rank, step), {0, 0, 0, step, 0});
    const double fwd = median_ms(repeats, [&] {
      device::sparse_forward<T>(index,
                                {.q = qv,
                                 .k = kv,
                                 .v = vv,
                                 .out = tensor_view<float, 3>(out.data(), {local, h.hq, h.dim}),
                                 .lse = tensor_view<float, 2>(lse.data(), {h.hq, local})},
                                scale, nullptr, {.state = device::running_state::overwrite});
    });
    const double bwd = median_ms(repeats, [&] {
      device::sparse_backward<T>(index,
                                 {.q = qv,
                                  .k = kv,
                                  .v = vv,
                                  .d_out = dov,
                                  .lse = tensor_view<const float, 2>(lse.data(), {h.hq, local}),
                                  .delta = tensor_view<const float, 2>(delta.data(), {h.hq, local}),
                                  .dq = tensor_view<float, 3>(dq.data(), {local, h.hq, h.dim}),
                                  .dk = tensor_view<float, 3>(dk.data(), {local, h.hkv, h.dim}),
                                  .dv = tensor_view<float, 3>(dv.data(), {local, h.hkv, h.dim})},
                                 scale, nullptr);
    });
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
