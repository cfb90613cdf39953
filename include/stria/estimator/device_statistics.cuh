// SPDX-License-Identifier: Apache-2.0
// The window statistics in device memory (device_statistics), what the GPU estimator gathers and the
// GPU selection reads, and where the time of gathering them goes (statistics_timing).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <span>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/device_buffer.cuh"
#include "stria/core/pinned_buffer.cuh"
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

  /// Host statistics copied to the device, ordered on `stream`. The arrays are laid out in
  /// page-locked memory first, so the copies return at once (and overlap other threads' copies).
  static device_statistics upload(const vs_statistics& s, cudaStream_t stream) {
    device_statistics d;
    d.shape = s;
    d.shape.window_mass.clear();
    d.shape.slash_mass.clear();
    d.shape.vertical.clear();
    for (const auto& head : s.vertical) d.candidates_per_head = std::max(d.candidates_per_head, static_cast<index_t>(head.size()));
    const std::size_t window = s.window_mass.size(), slash = s.slash_mass.size(),
                      candidates = static_cast<std::size_t>(s.num_heads) * static_cast<std::size_t>(d.candidates_per_head);
    const pinned_buffer<float> masses(window + slash + candidates, stream);  // window, slash, then candidate masses
    const pinned_buffer<index_t> token(candidates, stream);
    std::copy(s.slash_mass.begin(), s.slash_mass.end(), std::copy(s.window_mass.begin(), s.window_mass.end(), masses.begin()));
    float* mass = masses.data() + window + slash;
    std::fill(mass, mass + candidates, -1.0f);
    std::fill(token.begin(), token.end(), index_t{0});
    for (std::size_t h = 0; h < s.vertical.size(); ++h)
      for (std::size_t i = 0; i < s.vertical[h].size(); ++i) {
        mass[h * static_cast<std::size_t>(d.candidates_per_head) + i] = s.vertical[h][i].mass;
        token[h * static_cast<std::size_t>(d.candidates_per_head) + i] = s.vertical[h][i].token;
      }
    d.window_mass = device_buffer<float>(std::span<const float>(masses.data(), window), stream);
    d.slash_mass = device_buffer<float>(std::span<const float>(masses.data() + window, slash), stream);
    d.candidate_mass = device_buffer<float>(std::span<const float>(mass, candidates), stream);
    d.candidate_token = device_buffer<index_t>(std::span<const index_t>(token.span()), stream);
    return d;
  }

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
  double setup_ms = 0;        // checks, window broadcast, uploads
  double pass1_ms = 0;        // row max / sum kernels
  double softmax_ms = 0;      // their download and the two collectives of the global softmax
  double pass2_ms = 0;        // probability kernel
  double topk_ms = 0;         // candidate sort
  double collectives_ms = 0;  // downloads, the masses' and the candidates' all-gathers, union, upload
                              // (one rank: the kernel that finishes the statistics on the device)
};

}  // namespace stria::estimator
