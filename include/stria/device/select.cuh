// SPDX-License-Identifier: Apache-2.0
// The launcher of the GPU top-p selection (estimator/select.cuh): the kernels of kernel/select.cuh
// turn device_statistics into a device_selection on one stream, with one host read (the list
// sizes). A head whose diagonals fit one CTA's shared-memory sort takes one launch (select_head);
// longer sequences take select_verticals, CUB's segmented sort and select_slashes.
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
#include "stria/core/pinned_buffer.cuh"
#include "stria/device/launch.cuh"
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

/// Arrays carved out of one allocation, each 256-byte aligned: laid out once over no memory to
/// learn the size, then over the allocation.
class workspace_layout {
 public:
  explicit workspace_layout(unsigned char* base = nullptr) : base_(reinterpret_cast<std::uintptr_t>(base)) {}
  template <class T>
  T* take(std::size_t count) {
    T* at = reinterpret_cast<T*>(base_ + used_);
    used_ += (count * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  [[nodiscard]] std::size_t bytes() const { return used_; }

 private:
  std::uintptr_t base_;
  std::size_t used_ = 0;
};

/// The single-launch path for heads of up to select_threads * Items diagonals.
template <int Items>
void launch_select_head(const kernel::selection_params& p, cudaStream_t stream) {
  constexpr std::size_t bytes = sizeof(kernel::detail::head_storage<Items>);
  detail::launch<&kernel::select_head<Items>>("select_head", {static_cast<unsigned>(p.heads), kernel::select_threads, bytes, stream}, p);
}

}  // namespace detail

/// estimator::select_device: the selection of `rule` (what the host's select_with_rule picks from
/// the same statistics), built on `stream`. One host synchronisation reads the list sizes.
inline device_selection select_with_rule(const estimator::device_statistics& st, const estimator::top_p_rule& rule, cudaStream_t stream) {
  const vs_statistics& shape = st.shape;
  const index_t heads = shape.num_heads, diagonals = shape.num_diagonals();
  if (shape.empty() || heads < 1)
    throw invalid_argument("statistics", "(empty)", "the GPU selection needs the window statistics of every head");
  if (rule.local_diagonals != shape.local_blocks)
    throw invalid_argument("rule.local_diagonals", rule.local_diagonals,
                           "must equal the statistics' local_blocks " + std::to_string(shape.local_blocks) + " (gathered for another rule)");
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
                             // the chosen candidates and the sinks; the chosen diagonals and the local ones
                             std::min(shape.seq_len, std::min(rule.vertical_cap, st.candidates_per_head) + rule.sink_tokens),
                             std::min(diagonals, rule.slash_cap + 2 * rule.local_diagonals - 1),
                             nullptr,
                             nullptr,
                             nullptr};
  const bool one_launch = diagonals <= kernel::select_threads * 8;
  const auto items = static_cast<std::size_t>(heads) * static_cast<std::size_t>(diagonals);

  // Each head's diagonals by key, descending; the sort is stable, so equal residuals keep the
  // smaller diagonal first (the host's tie rule).
  kernel::selection_scratch x{};
  const auto begin = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), detail::segment_start{diagonals});
  auto sort = [&](void* temp, std::size_t& temp_bytes) {
    STRIA_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(temp, temp_bytes, x.residual, x.sorted_residual, x.diagonal,
                                                                        x.sorted_diagonal, static_cast<int>(items), static_cast<int>(heads),
                                                                        begin, begin + 1, 0, 64, stream));
  };
  std::size_t sort_bytes = 0;
  if (!one_launch) sort(nullptr, sort_bytes);

  unsigned char* sort_temp = nullptr;
  auto carve = [&](detail::workspace_layout w) {
    p.counts = w.take<index_t>(2 * static_cast<std::size_t>(heads));
    p.vertical_rows = w.take<index_t>(static_cast<std::size_t>(heads) * static_cast<std::size_t>(p.vertical_row));
    p.slash_rows = w.take<index_t>(static_cast<std::size_t>(heads) * static_cast<std::size_t>(p.slash_row));
    if (!one_launch) {
      x.residual = w.take<double>(items);
      x.sorted_residual = w.take<double>(items);
      x.diagonal = w.take<index_t>(items);
      x.sorted_diagonal = w.take<index_t>(items);
      x.covered = w.take<double>(static_cast<std::size_t>(heads));
      x.vertical_bits = w.take<std::uint64_t>(static_cast<std::size_t>(heads) * static_cast<std::size_t>(p.num_blocks));
      x.slash_flag = w.take<std::uint8_t>(items);
      sort_temp = w.take<unsigned char>(sort_bytes);
    }
    return w.bytes();
  };
  const device_buffer<unsigned char> workspace(carve(detail::workspace_layout{}), stream);
  carve(detail::workspace_layout{workspace.data()});

  const auto grid = static_cast<unsigned>(heads);
  if (diagonals <= kernel::select_threads * 4) {
    detail::launch_select_head<4>(p, stream);
  } else if (one_launch) {
    detail::launch_select_head<8>(p, stream);
  } else {
    detail::launch<&kernel::select_verticals<>>("select_verticals", {grid, kernel::select_threads, 0, stream}, p, x);
    sort(sort_temp, sort_bytes);
    detail::launch<&kernel::select_slashes<>>("select_slashes", {grid, kernel::select_threads, 0, stream}, p, x);
  }

  const pinned_buffer<index_t> counts(2 * static_cast<std::size_t>(heads), stream);
  STRIA_CUDA_CHECK(cudaMemcpyAsync(counts.data(), p.counts, counts.bytes(), cudaMemcpyDeviceToHost, stream));
  STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::size_t tokens = 0, deltas = 0;
  for (index_t h = 0; h < heads; ++h) {
    tokens += static_cast<std::size_t>(counts[static_cast<std::size_t>(h)]);
    deltas += static_cast<std::size_t>(counts[static_cast<std::size_t>(heads + h)]);
  }

  device_selection::lists out;
  out.vertical_ptr = device_buffer<index_t>(static_cast<std::size_t>(heads) + 1, stream);
  out.slash_ptr = device_buffer<index_t>(static_cast<std::size_t>(heads) + 1, stream);
  out.tile_ptr = device_buffer<index_t>(static_cast<std::size_t>(heads) + 1, stream);  // no explicit tiles
  out.vertical = device_buffer<index_t>(tokens, stream);
  out.vertical_head = device_buffer<index_t>(tokens, stream);
  out.slash = device_buffer<index_t>(deltas, stream);
  detail::launch<&kernel::gather_lists<>>("gather_lists", {grid, kernel::select_threads, 0, stream}, p, out.vertical_ptr.data(), out.slash_ptr.data(),
                                          out.tile_ptr.data(), out.vertical.data(), out.vertical_head.data(), out.slash.data());
  return {shape.seq_len, heads, shape.causal, std::move(out)};  // complete in stream order
}

}  // namespace stria::device
