// SPDX-License-Identifier: Apache-2.0
// The window statistics in device memory (device_statistics), what the GPU estimator gathers and the
// GPU selection reads, and where the time of gathering them goes (statistics_timing).
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/device_buffer.cuh"
#include "stria/estimator/statistics.hpp"

namespace stria::estimator {

/// vs_statistics in device memory. The vertical candidates are rows of `candidates_per_head`
/// entries in selection order; a head with fewer candidates pads its row with mass -1.
struct device_statistics {
  vs_statistics shape;  // seq_len, heads, causal, window rows, local blocks; no masses
  index_t candidates_per_head = 0;
  device_buffer<float> window_mass;        // [Hq]
  device_buffer<float> slash_mass;         // [Hq, num_diagonals]
  device_buffer<float> candidate_mass;     // [Hq, candidates_per_head]
  device_buffer<index_t> candidate_token;  // [Hq, candidates_per_head] global key tokens

  /// A host copy after the work queued on `stream` (the pads left out), for tests and host selection.
  [[nodiscard]] vs_statistics download(cudaStream_t stream) const {
    vs_statistics s = shape;
    s.window_mass = window_mass.download(stream);
    s.slash_mass = slash_mass.download(stream);
    const std::vector<float> mass = candidate_mass.download(stream);
    const std::vector<index_t> token = candidate_token.download(stream);
    s.vertical.assign(static_cast<std::size_t>(s.num_heads), {});
    for (std::size_t h = 0; h < s.vertical.size(); ++h)
      for (std::size_t i = 0; i < static_cast<std::size_t>(candidates_per_head); ++i) {
        const std::size_t at = h * static_cast<std::size_t>(candidates_per_head) + i;
        if (mass[at] < 0.0f) break;
        s.vertical[h].push_back({mass[at], token[at]});
      }
    return s;
  }
};

/// Where the time of one gather_window_statistics_device call goes (wall clock, ms). Measuring
/// synchronises the stream at each phase end, so pass a pointer only when profiling.
struct statistics_timing {
  double setup_ms = 0;        // checks, the plan's upload, the window's broadcast
  double pass1_ms = 0;        // row max / sum kernels
  double softmax_ms = 0;      // the normalisers' all-gather and their combination into the global softmax
  double pass2_ms = 0;        // probability kernel
  double topk_ms = 0;         // candidate sort
  double collectives_ms = 0;  // the shares' packing, the masses' and the candidates' all-gathers, their
                              // combination (one rank: the kernel that finishes the statistics)
};

}  // namespace stria::estimator
