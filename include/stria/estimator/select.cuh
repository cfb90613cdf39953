// SPDX-License-Identifier: Apache-2.0
// The top-p selection on the GPU: window statistics kept in device memory (device_statistics) and
// select_device, which turns them into a device_selection ready for the step-index builder with
// one small host read (the list sizes). It picks exactly what the host select() picks from the
// same statistics (kernel/select.cuh says how).
#pragma once

#include <cub/device/device_segmented_radix_sort.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/error.hpp"
#include "stria/estimator/select.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/local_index.cuh"
#include "stria/kernel/select.cuh"

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

  /// Host statistics copied to the device, ordered on `stream`.
  static device_statistics upload(const vs_statistics& s, cudaStream_t stream) {
    device_statistics d;
    d.shape = s;
    d.shape.window_mass.clear();
    d.shape.slash_mass.clear();
    d.shape.vertical.clear();
    for (const auto& head : s.vertical) d.candidates_per_head = std::max(d.candidates_per_head, static_cast<index_t>(head.size()));
    std::vector<float> mass(static_cast<std::size_t>(s.num_heads) * static_cast<std::size_t>(d.candidates_per_head), -1.0f);
    std::vector<index_t> token(mass.size(), 0);
    for (std::size_t h = 0; h < s.vertical.size(); ++h)
      for (std::size_t i = 0; i < s.vertical[h].size(); ++i) {
        mass[h * static_cast<std::size_t>(d.candidates_per_head) + i] = s.vertical[h][i].mass;
        token[h * static_cast<std::size_t>(d.candidates_per_head) + i] = s.vertical[h][i].token;
      }
    d.window_mass = device_buffer<float>(std::span<const float>(s.window_mass), stream);
    d.slash_mass = device_buffer<float>(std::span<const float>(s.slash_mass), stream);
    d.candidate_mass = device_buffer<float>(std::span<const float>(mass), stream);
    d.candidate_token = device_buffer<index_t>(std::span<const index_t>(token), stream);
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

namespace detail {

/// Start of segment i of equal-length segments (CUB's segment offsets, without an array).
struct segment_start {
  index_t length;
  __host__ __device__ index_t operator()(index_t i) const { return i * length; }
};

}  // namespace detail

/// The selection of `rule` (what the host's select_with_rule picks from statistics.download()),
/// built on `stream`. One host synchronisation reads the two list sizes.
inline device_selection select_device(const device_statistics& st, const top_p_rule& rule, cudaStream_t stream) {
  const vs_statistics& shape = st.shape;
  const index_t heads = shape.num_heads, diagonals = shape.num_diagonals();
  if (shape.empty() || heads < 1)
    throw invalid_argument("statistics", "(empty)", "the GPU selection needs the window statistics of every head");
  if (rule.local_diagonals != shape.local_blocks)
    throw invalid_argument("rule.local_diagonals", rule.local_diagonals,
                           "must equal the statistics' local_blocks " + std::to_string(shape.local_blocks) + " (gathered for another rule)");
  const auto items = static_cast<std::size_t>(heads) * static_cast<std::size_t>(diagonals);
  device_buffer<double> residual(items, stream), sorted_residual(items, stream), covered(static_cast<std::size_t>(heads), stream);
  device_buffer<index_t> diagonal(items, stream), sorted_diagonal(items, stream), slash_flag(items, stream);
  device_buffer<std::uint64_t> bits(static_cast<std::size_t>(heads) * static_cast<std::size_t>(kernel::detail::bitmap_words(shape.seq_len)),
                                    stream);
  device_buffer<index_t> vertical_count(static_cast<std::size_t>(heads) + 1, stream), slash_count(vertical_count.size(), stream);
  vertical_count.fill_bytes(0, stream);
  slash_count.fill_bytes(0, stream);

  kernel::selection_params p{heads,
                             shape.seq_len,
                             shape.num_blocks(),
                             diagonals,
                             shape.diagonal_offset(),
                             st.candidates_per_head,
                             shape.causal,
                             rule.p_vertical,
                             rule.p_slash,
                             rule.vertical_min,
                             rule.vertical_cap,
                             rule.slash_min,
                             rule.slash_cap,
                             rule.sink_tokens,
                             rule.local_diagonals,
                             st.window_mass.data(),
                             st.slash_mass.data(),
                             st.candidate_mass.data(),
                             st.candidate_token.data(),
                             residual.data(),
                             diagonal.data(),
                             covered.data(),
                             bits.data(),
                             slash_flag.data(),
                             vertical_count.data(),
                             slash_count.data()};
  const auto grid = static_cast<unsigned>(heads);
  kernel::select_verticals<><<<grid, kernel::select_threads, 0, stream>>>(p);
  STRIA_CUDA_CHECK_LAUNCH("select_verticals");

  // Each head's diagonals by residual mass, descending; the sort is stable, so equal masses keep the
  // smaller diagonal first (the host's tie rule), and -0.0 equals +0.0 as on the host.
  const auto begin = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), detail::segment_start{diagonals});
  std::size_t temp_bytes = 0;
  STRIA_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, temp_bytes, residual.data(), sorted_residual.data(),
                                                                      diagonal.data(), sorted_diagonal.data(), static_cast<int>(items),
                                                                      static_cast<int>(heads), begin, begin + 1, 0, 64, stream));
  device_buffer<unsigned char> temp(std::max<std::size_t>(temp_bytes, 1), stream);
  STRIA_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(temp.data(), temp_bytes, residual.data(), sorted_residual.data(),
                                                                      diagonal.data(), sorted_diagonal.data(), static_cast<int>(items),
                                                                      static_cast<int>(heads), begin, begin + 1, 0, 64, stream));

  kernel::select_slashes<><<<grid, kernel::select_threads, 0, stream>>>(p, sorted_residual.data(), sorted_diagonal.data());
  STRIA_CUDA_CHECK_LAUNCH("select_slashes");
  kernel::count_selection<><<<grid, kernel::select_threads, 0, stream>>>(p);
  STRIA_CUDA_CHECK_LAUNCH("count_selection");

  device_selection::lists out;
  out.vertical_ptr = device_buffer<index_t>(vertical_count.size(), stream);
  out.slash_ptr = device_buffer<index_t>(slash_count.size(), stream);
  stria::detail::exclusive_scan(vertical_count, out.vertical_ptr, stream);
  stria::detail::exclusive_scan(slash_count, out.slash_ptr, stream);
  index_t totals[2] = {};
  STRIA_CUDA_CHECK(cudaMemcpyAsync(&totals[0], out.vertical_ptr.data() + heads, sizeof(index_t), cudaMemcpyDeviceToHost, stream));
  STRIA_CUDA_CHECK(cudaMemcpyAsync(&totals[1], out.slash_ptr.data() + heads, sizeof(index_t), cudaMemcpyDeviceToHost, stream));
  STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));

  out.vertical = device_buffer<index_t>(static_cast<std::size_t>(totals[0]), stream);
  out.vertical_head = device_buffer<index_t>(static_cast<std::size_t>(totals[0]), stream);
  out.slash = device_buffer<index_t>(static_cast<std::size_t>(totals[1]), stream);
  out.tile_ptr = device_buffer<index_t>(static_cast<std::size_t>(heads) + 1, stream);
  out.tile_ptr.fill_bytes(0, stream);  // no explicit tiles
  kernel::write_selection<><<<grid, kernel::select_threads, 0, stream>>>(p, out.vertical_ptr.data(), out.slash_ptr.data(), out.vertical.data(),
                                                                         out.vertical_head.data(), out.slash.data());
  STRIA_CUDA_CHECK_LAUNCH("write_selection");
  return {shape.seq_len, heads, shape.causal, std::move(out)};  // complete in stream order
}

}  // namespace stria::estimator
