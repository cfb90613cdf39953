// SPDX-License-Identifier: Apache-2.0
// The launcher of the GPU window statistics (estimator/window_statistics.cuh): the host algorithm
// of gather_window_statistics (window_statistics.hpp) with the heavy work (window x local keys,
// twice) in the kernels of kernel/window_statistics.cuh and the candidate top-k by one CUB radix
// sort, between the collectives of host arrays that make the statistics global. A world of one rank
// needs no collective and no host round trip.
#pragma once

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/error.hpp"
#include "stria/core/numeric.cuh"
#include "stria/estimator/device_statistics.cuh"
#include "stria/estimator/statistics.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/kernel/window_statistics.cuh"

namespace stria::device {

namespace detail {

/// Wall-clock laps that synchronise the stream first; disabled timers cost nothing.
class phase_timer {
 public:
  explicit phase_timer(bool enabled) : enabled_(enabled), last_(std::chrono::steady_clock::now()) {}
  void lap(cudaStream_t stream, double* into) {
    if (!enabled_ || into == nullptr) return;
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto now = std::chrono::steady_clock::now();
    *into = std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
  }

 private:
  bool enabled_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace detail

/// estimator::gather_window_statistics_device: the window statistics, identical on every rank, in
/// device memory, queued on `stream` (the algorithm of the host gather_window_statistics).
template <class Comm, sharding_policy Sharding, class T>
estimator::device_statistics gather_window_statistics(Comm& comm, const Sharding& sharding, index_t seq_len, bool causal, const T* q_local,
                                                      const T* k_local, index_t heads_q, index_t heads_kv, index_t dim, double softmax_scale,
                                                      statistics_request request, cudaStream_t stream, estimator::statistics_timing* timing) {
  detail::phase_timer timer(timing != nullptr);
  const index_t world = comm.world_size(), rank = comm.rank();
  const shard_layout layout{seq_len / block_tokens, world};
  sharding.validate(layout);
  const index_t local_blocks = sharding.local_blocks(layout), local_tokens = local_blocks * block_tokens;
  attention_shape{local_tokens, local_tokens, heads_q, heads_kv, dim}.validate();
  if (q_local == nullptr) throw invalid_argument("q_local", "nullptr", "must point to device memory");
  if (k_local == nullptr) throw invalid_argument("k_local", "nullptr", "must point to device memory");
  for (const auto& [name, pointer] : {std::pair{"q_local", static_cast<const void*>(q_local)}, std::pair{"k_local", static_cast<const void*>(k_local)}})
    if (reinterpret_cast<std::uintptr_t>(pointer) % 16 != 0)
      throw invalid_argument(name, pointer, "must be 16-byte aligned (the kernels load 16-byte vectors)");
  if (request.window_rows < 1 || request.window_rows > std::min(seq_len, block_tokens))
    throw invalid_argument("request.window_rows", request.window_rows, "must lie in [1, 64]: the window is the end of the last block");
  const index_t rows = request.window_rows, first_row = seq_len - rows;

  // Global block of each local block. Every device buffer below lives in stream order on `stream`.
  std::vector<index_t> key_global_block(static_cast<std::size_t>(local_blocks));
  for (index_t b = 0; b < local_blocks; ++b) key_global_block[static_cast<std::size_t>(b)] = sharding.global_block(layout, {rank, b});
  const device_buffer<index_t> key_global_block_d{std::span<const index_t>(key_global_block), stream};

  // 1. The window lies in the last block, so one rank owns all of it: it broadcasts the rows, in
  // the input type (every rank then scores exactly the same values). Collectives over one rank are
  // identities; that case stays on the device here and below.
  const bool alone = world == 1;
  const block_location owner = sharding.locate(layout, layout.num_blocks - 1);
  device_buffer<T> window_d(static_cast<std::size_t>(rows) * heads_q * dim, stream);
  const std::size_t first_local = static_cast<std::size_t>(owner.local_block) * block_tokens + static_cast<std::size_t>(first_row % block_tokens);
  if (alone) {
    STRIA_CUDA_CHECK(cudaMemcpyAsync(window_d.data(), q_local + first_local * heads_q * dim, window_d.bytes(), cudaMemcpyDeviceToDevice, stream));
  } else {
    std::vector<T> window(window_d.size());
    if (owner.rank == rank) {
      STRIA_CUDA_CHECK(cudaMemcpyAsync(window.data(), q_local + first_local * heads_q * dim, window_d.bytes(), cudaMemcpyDeviceToHost, stream));
      STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    comm.broadcast(window.data(), window.size(), owner.rank);
    window_d.upload(window, stream);
  }

  // 2. Pass 1: this rank's row max and sum of exp2.
  const float scale_log2 = float(softmax_scale * 1.4426950408889634);
  const std::size_t shared = kernel::window_shared_bytes<T>(dim);
  STRIA_CUDA_CHECK(cudaFuncSetAttribute(kernel::window_tile_partials<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  STRIA_CUDA_CHECK(cudaFuncSetAttribute(kernel::window_tile_probabilities<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>((local_blocks + kernel::window_blocks_per_cta - 1) / kernel::window_blocks_per_cta),
                  static_cast<unsigned>(heads_q));
  timer.lap(stream, timing ? &timing->setup_ms : nullptr);
  device_buffer<float> tile_max(static_cast<std::size_t>(heads_q) * local_blocks * rows, stream), tile_sum(tile_max.size(), stream);
  kernel::window_tile_partials<T><<<grid, kernel::window_threads, shared, stream>>>(
      window_d.data(), k_local, key_global_block_d.data(), rows, heads_q, heads_kv, dim, first_row, scale_log2, causal, local_blocks,
      tile_max.data(), tile_sum.data());
  STRIA_CUDA_CHECK_LAUNCH("window_tile_partials");
  device_buffer<float> row_max_d(static_cast<std::size_t>(heads_q) * rows, stream), row_sum_d(row_max_d.size(), stream);
  kernel::combine_row_partials<><<<static_cast<unsigned>(heads_q * rows), 256, 0, stream>>>(
      tile_max.data(), tile_sum.data(), heads_q, local_blocks, rows, row_max_d.data(), row_sum_d.data());
  STRIA_CUDA_CHECK_LAUNCH("combine_row_partials");

  // 3. Global softmax normaliser: max over ranks, then every rank's sum rescaled to that max.
  timer.lap(stream, timing ? &timing->pass1_ms : nullptr);
  if (!alone) {
    std::vector<float> row_max = row_max_d.download(stream), row_sum = row_sum_d.download(stream);
    std::vector<float> global_max = row_max;
    comm.all_reduce(global_max.data(), global_max.data(), global_max.size(), comm::reduce_op::max);
    for (std::size_t i = 0; i < row_sum.size(); ++i)
      row_sum[i] = row_max[i] == -INFINITY ? 0.0f : float(double(row_sum[i]) * std::exp2(double(row_max[i]) - double(global_max[i])));
    comm.all_reduce(row_sum.data(), row_sum.data(), row_sum.size(), comm::reduce_op::sum);
    row_max_d.upload(global_max, stream);
    row_sum_d.upload(row_sum, stream);
  }
  timer.lap(stream, timing ? &timing->softmax_ms : nullptr);

  // 4. Pass 2: probabilities into per-token vertical mass and per-tile (block diagonal) mass.
  device_buffer<float> vertical(static_cast<std::size_t>(heads_q) * local_tokens, stream),
      tile_mass(static_cast<std::size_t>(heads_q) * local_blocks, stream);
  kernel::window_tile_probabilities<T><<<grid, kernel::window_threads, shared, stream>>>(
      window_d.data(), k_local, key_global_block_d.data(), rows, heads_q, heads_kv, dim, first_row, scale_log2, causal, local_blocks,
      row_max_d.data(), row_sum_d.data(), layout.num_blocks - request.local_blocks, vertical.data(), tile_mass.data());
  STRIA_CUDA_CHECK_LAUNCH("window_tile_probabilities");
  timer.lap(stream, timing ? &timing->pass2_ms : nullptr);

  // Each head's candidates: one device-wide stable radix sort on (head, mass descending) keeps
  // ascending tokens among equal masses, the order every rank and the host use (vertical_candidate's
  // operator<); each head's run is then contiguous and in selection order.
  const index_t per_rank = std::min(request.vertical_candidates, local_tokens);
  const std::size_t items = vertical.size();
  device_buffer<std::uint64_t> keys_in(items, stream), keys_out(items, stream);
  device_buffer<index_t> tokens_in(items, stream), tokens_out(items, stream);
  kernel::candidate_keys<><<<static_cast<unsigned>((items + 255) / 256), 256, 0, stream>>>(vertical.data(), key_global_block_d.data(), heads_q,
                                                                                       local_tokens, keys_in.data(), tokens_in.data());
  STRIA_CUDA_CHECK_LAUNCH("candidate_keys");
  const int end_bit = 32 + std::bit_width(static_cast<unsigned>(heads_q));  // head bits above the 32 mass bits
  std::size_t temp_bytes = 0;
  STRIA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in.data(), keys_out.data(), tokens_in.data(), tokens_out.data(),
                                                   static_cast<int>(items), 0, end_bit, stream));
  device_buffer<unsigned char> temp(std::max<std::size_t>(temp_bytes, 1), stream);
  STRIA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys_in.data(), keys_out.data(), tokens_in.data(),
                                                   tokens_out.data(), static_cast<int>(items), 0, end_bit, stream));
  timer.lap(stream, timing ? &timing->topk_ms : nullptr);

  // 5. The collectives: none for one rank; else the host path's, on the top candidates and tiles.
  vs_statistics st = estimator::detail::empty_statistics(seq_len, heads_q, causal, rows, request.local_blocks);
  const index_t diagonals = st.num_diagonals(), offset = st.diagonal_offset();
  if (alone) {
    estimator::device_statistics out;
    out.shape = std::move(st);
    out.candidates_per_head = per_rank;
    out.window_mass = device_buffer<float>(static_cast<std::size_t>(heads_q), stream);
    out.slash_mass = device_buffer<float>(static_cast<std::size_t>(heads_q) * diagonals, stream);
    out.candidate_mass = device_buffer<float>(static_cast<std::size_t>(heads_q) * per_rank, stream);
    out.candidate_token = device_buffer<index_t>(out.candidate_mass.size(), stream);
    kernel::single_rank_statistics<><<<static_cast<unsigned>(heads_q), 256, 0, stream>>>(
        tile_mass.data(), key_global_block_d.data(), keys_out.data(), tokens_out.data(), local_blocks, local_tokens, per_rank,
        layout.num_blocks, diagonals, offset, out.slash_mass.data(), out.window_mass.data(), out.candidate_mass.data(),
        out.candidate_token.data());
    STRIA_CUDA_CHECK_LAUNCH("single_rank_statistics");
    timer.lap(stream, timing ? &timing->collectives_ms : nullptr);
    return out;
  }
  std::vector<std::uint64_t> top_key(static_cast<std::size_t>(heads_q) * per_rank);
  std::vector<index_t> top_token(top_key.size());
  STRIA_CUDA_CHECK(cudaMemcpy2DAsync(top_key.data(), per_rank * sizeof(std::uint64_t), keys_out.data(), local_tokens * sizeof(std::uint64_t),
                                     per_rank * sizeof(std::uint64_t), static_cast<std::size_t>(heads_q), cudaMemcpyDeviceToHost, stream));
  STRIA_CUDA_CHECK(cudaMemcpy2DAsync(top_token.data(), per_rank * sizeof(index_t), tokens_out.data(), local_tokens * sizeof(index_t),
                                     per_rank * sizeof(index_t), static_cast<std::size_t>(heads_q), cudaMemcpyDeviceToHost, stream));
  const std::vector<float> tiles = tile_mass.download(stream);  // synchronises the stream
  for (index_t h = 0; h < heads_q; ++h) {
    double total = 0;
    for (index_t b = 0; b < local_blocks; ++b) {
      const float m = tiles[static_cast<std::size_t>(h) * local_blocks + b];
      st.slash_mass[static_cast<std::size_t>(h) * diagonals + static_cast<std::size_t>(st.diagonal_of(key_global_block[static_cast<std::size_t>(b)] * block_tokens) + offset)] = m;
      total += m;
    }
    st.window_mass[static_cast<std::size_t>(h)] = float(total);
  }
  std::vector<vertical_candidate> mine(top_key.size());
  for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = {kernel::mass_of_descending_bits(static_cast<std::uint32_t>(top_key[i])), top_token[i]};
  estimator::detail::finish_statistics(comm, st, mine, per_rank);
  estimator::device_statistics out = estimator::device_statistics::upload(st, stream);
  timer.lap(stream, timing ? &timing->collectives_ms : nullptr);
  return out;
}

}  // namespace stria::device
