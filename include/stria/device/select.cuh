// SPDX-License-Identifier: Apache-2.0
// The launcher of the GPU top-p selection (estimator/select.cuh): the kernels of kernel/select.cuh
// and CUB's segmented sort turn device_statistics into a device_selection on one stream, with one
// host read (the list sizes).
#pragma once

#include <cub/device/device_segmented_radix_sort.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/error.hpp"
#include "stria/device/local_index.cuh"
#include "stria/estimator/device_statistics.cuh"
#include "stria/estimator/select.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/device_index.cuh"
#include "stria/kernel/select.cuh"

namespace stria::device {

namespace detail {

/// Start of segment i of equal-length segments (CUB's segment offsets, without an array).
struct segment_start {
  index_t length;
  __host__ __device__ index_t operator()(index_t i) const { return i * length; }
};

}  // namespace detail

/// estimator::select_device: the selection of `rule` (what the host's select_with_rule picks from
/// the same statistics), built on `stream`. One host synchronisation reads the two list sizes.
inline device_selection select_with_rule(const estimator::device_statistics& st, const estimator::top_p_rule& rule, cudaStream_t stream) {
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

}  // namespace stria::device
