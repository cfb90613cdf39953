// SPDX-License-Identifier: Apache-2.0
// The launcher of the GPU window statistics (estimator/window_statistics.cuh): the device backend of
// the window statistics engine (engine/window_statistics_engine.hpp), with the heavy work (window x
// local keys, twice) in the kernels of kernel/window_statistics.cuh. A world of one rank needs no
// collective and no host round trip.
#pragma once

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/error.hpp"
#include "stria/core/numeric.cuh"
#include "stria/core/pinned_buffer.cuh"
#include "stria/device/launch.cuh"
#include "stria/engine/window_statistics_engine.hpp"
#include "stria/estimator/device_statistics.cuh"
#include "stria/estimator/statistics.hpp"
#include "stria/kernel/window_statistics.cuh"

namespace stria::device::detail {

/// The device backend of the window statistics engine: the window against this rank's keys in the
/// kernels of kernel/window_statistics.cuh and the candidates' top-k by one CUB radix sort, every
/// buffer in stream order on `stream`. The window is read where it lies: in q_local on its owner
/// (and on the only rank), uploaded on the others. Its host round trips go through page-locked
/// memory, so that ranks sharing a GPU copy at once rather than one after another through the
/// driver's staging; of the candidates only those the union can use come down (candidates).
/// With `timing`, each phase ends by synchronising.
template <class T>
class window_backend {
 public:
  using window_rows = pinned_buffer<T>;  // [rows, Hq, D] in the input type: every rank scores the same values
  using statistics = estimator::device_statistics;

  window_backend(const engine::window_plan& plan, index_t rank, const T* q_local, const T* k_local, index_t heads_kv, index_t dim,
                 double softmax_scale, cudaStream_t stream, estimator::statistics_timing* timing, std::chrono::steady_clock::time_point start)
      : plan_(plan), owner_(rank == plan.window_owner), k_(k_local), heads_(plan.shape.num_heads), heads_kv_(heads_kv), dim_(dim),
        rows_(plan.shape.window_rows), blocks_(plan.rank_blocks), tokens_(plan.rank_blocks * block_tokens),
        scale_log2_(float(softmax_scale * 1.4426950408889634)), stream_(stream), timing_(timing), last_(start),
        window_(q_local + static_cast<std::size_t>(plan.window_local_token) * static_cast<std::size_t>(heads_ * dim)),
        key_global_block_(plan.global_blocks(rank), stream), chunk_blocks_(chunk_blocks(blocks_, heads_)) {}

  window_rows& window() {
    host_window_ = pinned_buffer<T>(static_cast<std::size_t>(rows_ * heads_ * dim_), stream_);
    if (owner_) {
      STRIA_CUDA_CHECK(cudaMemcpyAsync(host_window_.data(), window_, host_window_.size() * sizeof(T), cudaMemcpyDeviceToHost, stream_));
      STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return host_window_;
  }

  /// Pass 1: per (head, chunk, row) the max score and sum of exp2, then this rank's per row.
  void score_window() {
    if (!owner_ && host_window_.size() > 0) {  // the broadcast rows
      uploaded_window_ = device_buffer<T>(std::span<const T>(host_window_.span()), stream_);
      window_ = uploaded_window_.data();
    }
    lap(&estimator::statistics_timing::setup_ms);
    const index_t chunks = grid().y;
    device_buffer<float> partial_max(row_count() * static_cast<std::size_t>(chunks), stream_), partial_sum(partial_max.size(), stream_);
    with_head_dim<any_head_dim>(dim_, [&]<int D>() {
      allow_shared_bytes<&kernel::window_partials<T, D>>(kernel::window_shared_bytes<T, D>());
      kernel::window_partials<T, D><<<grid(), kernel::window_threads, kernel::window_shared_bytes<T, D>(), stream_>>>(params(), partial_max.data(),
                                                                                                                    partial_sum.data());
    });
    STRIA_CUDA_CHECK_LAUNCH("window_partials");
    normaliser_ = device_buffer<float>(2 * row_count(), stream_);
    kernel::combine_row_partials<><<<static_cast<unsigned>(row_count()), 256, 0, stream_>>>(partial_max.data(), partial_sum.data(), heads_, chunks,
                                                                                          rows_, normaliser_.data(), normaliser_.data() + row_count());
    STRIA_CUDA_CHECK_LAUNCH("combine_row_partials");
    lap(&estimator::statistics_timing::pass1_ms);
  }

  /// This rank's row max; its sums come down with it (one synchronisation).
  std::vector<float> row_max() {
    host_normaliser_ = pinned_buffer<float>(normaliser_.size(), stream_);
    STRIA_CUDA_CHECK(cudaMemcpyAsync(host_normaliser_.data(), normaliser_.data(), normaliser_.bytes(), cudaMemcpyDeviceToHost, stream_));
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {host_normaliser_.begin(), host_normaliser_.begin() + row_count()};
  }
  /// Each row's sum of exp2, rescaled from this rank's max to the global one.
  std::vector<float> row_sum(const std::vector<float>& global_max) const {
    const float* own = host_normaliser_.data();  // this rank's max, then its sums, until place_normaliser
    std::vector<float> sum(own + row_count(), own + 2 * row_count());
    for (std::size_t i = 0; i < sum.size(); ++i)
      sum[i] = own[i] == -INFINITY ? 0.0f : float(double(sum[i]) * std::exp2(double(own[i]) - double(global_max[i])));
    return sum;
  }
  /// The global max and sums replace this rank's (row_max's download has finished: it synchronised).
  void place_normaliser(const std::vector<float>& global_max, const std::vector<float>& global_sum) {
    if (global_max.size() + global_sum.size() != host_normaliser_.size())
      throw invalid_argument("global_max.size() + global_sum.size()", global_max.size() + global_sum.size(),
                             "must be 2 * Hq * rows = " + std::to_string(host_normaliser_.size()));
    std::copy(global_sum.begin(), global_sum.end(), std::copy(global_max.begin(), global_max.end(), host_normaliser_.begin()));
    normaliser_.upload(std::span<const float>(host_normaliser_.span()), stream_);
  }

  /// Pass 2: per-token vertical mass and per-tile (block diagonal) mass; then each head's first
  /// per_rank candidates in vertical_candidate's order (mass descending, ascending tokens among
  /// equal masses): by a radix select and a block sort per head (candidate_top_k) where per_rank
  /// fits one CTA, else by one device-wide stable radix sort on (head, mass descending) of every
  /// token. Either way head h's run starts at h * run_stride_.
  void probabilities() {
    lap(&estimator::statistics_timing::softmax_ms);
    const auto items = static_cast<std::size_t>(heads_) * static_cast<std::size_t>(tokens_);
    device_buffer<float> vertical(items, stream_);
    tile_mass_ = device_buffer<float>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(blocks_), stream_);
    with_head_dim<any_head_dim>(dim_, [&]<int D>() {
      allow_shared_bytes<&kernel::window_probabilities<T, D>>(kernel::window_shared_bytes<T, D>());
      kernel::window_probabilities<T, D><<<grid(), kernel::window_threads, kernel::window_shared_bytes<T, D>(), stream_>>>(
          params(), normaliser_.data(), normaliser_.data() + row_count(), plan_.shape.num_blocks() - plan_.shape.local_blocks, vertical.data(),
          tile_mass_.data());
    });
    STRIA_CUDA_CHECK_LAUNCH("window_probabilities");
    lap(&estimator::statistics_timing::pass2_ms);
    const index_t per_rank = plan_.per_rank;
    if (per_rank == 0) {  // no candidates asked for: nothing reads a run
      run_stride_ = 0;
    } else if (per_rank <= kernel::top_k_capacity) {
      run_stride_ = per_rank;
      sorted_keys_ = device_buffer<std::uint64_t>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(per_rank), stream_);
      sorted_tokens_ = device_buffer<index_t>(sorted_keys_.size(), stream_);
      allow_shared_bytes<&kernel::candidate_top_k<>>(kernel::top_k_shared_bytes());
      kernel::candidate_top_k<><<<static_cast<unsigned>(heads_), kernel::top_k_threads, kernel::top_k_shared_bytes(), stream_>>>(
          vertical.data(), key_global_block_.data(), tokens_, per_rank, sorted_keys_.data(), sorted_tokens_.data());
      STRIA_CUDA_CHECK_LAUNCH("candidate_top_k");
    } else {
      run_stride_ = tokens_;
      sort_all_candidates(vertical);
    }
    lap(&estimator::statistics_timing::topk_ms);
  }

  /// Every head's tokens by mass: one device-wide stable radix sort on (head, mass descending).
  void sort_all_candidates(const device_buffer<float>& vertical) {
    const auto items = vertical.size();
    device_buffer<std::uint64_t> keys(items, stream_);
    device_buffer<index_t> tokens(items, stream_);
    sorted_keys_ = device_buffer<std::uint64_t>(items, stream_);
    sorted_tokens_ = device_buffer<index_t>(items, stream_);
    kernel::candidate_keys<><<<static_cast<unsigned>((items + 255) / 256), 256, 0, stream_>>>(vertical.data(), key_global_block_.data(), heads_,
                                                                                            tokens_, keys.data(), tokens.data());
    STRIA_CUDA_CHECK_LAUNCH("candidate_keys");
    const int end_bit = 32 + std::bit_width(static_cast<unsigned>(heads_));  // head bits above the 32 mass bits
    std::size_t temp_bytes = 0;
    STRIA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.data(), sorted_keys_.data(), tokens.data(), sorted_tokens_.data(),
                                                     static_cast<int>(items), 0, end_bit, stream_));
    device_buffer<unsigned char> temp(std::max<std::size_t>(temp_bytes, 1), stream_);
    STRIA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys.data(), sorted_keys_.data(), tokens.data(), sorted_tokens_.data(),
                                                     static_cast<int>(items), 0, end_bit, stream_));
  }

  /// The tile masses, each head's window mass and its candidates' sketch, on the host (one synchronisation).
  engine::rank_share rank_share() const {
    const std::size_t tiles = tile_mass_.size(), sketch = plan_.per_rank > 0 ? static_cast<std::size_t>(heads_ * engine::sketch_points) : 0;
    device_buffer<float> sketch_d(sketch, stream_);
    if (sketch > 0) {
      kernel::candidate_sketch<><<<static_cast<unsigned>(heads_), static_cast<unsigned>(engine::sketch_points), 0, stream_>>>(
          sorted_keys_.data(), run_stride_, plan_.per_rank, sketch_d.data());
      STRIA_CUDA_CHECK_LAUNCH("candidate_sketch");
    }
    const pinned_buffer<float> host(tiles + sketch, stream_);
    STRIA_CUDA_CHECK(cudaMemcpyAsync(host.data(), tile_mass_.data(), tile_mass_.bytes(), cudaMemcpyDeviceToHost, stream_));
    if (sketch > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(host.data() + tiles, sketch_d.data(), sketch_d.bytes(), cudaMemcpyDeviceToHost, stream_));
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    engine::rank_share share;
    for (const float* head = host.data(); head != host.data() + tiles; head += blocks_) {
      share.mass.insert(share.mass.end(), head, head + blocks_);
      share.mass.push_back(float(std::accumulate(head, head + blocks_, 0.0)));  // in fp64, in block order
    }
    share.sketch.assign(host.data() + tiles, host.end());
    return share;
  }

  /// Each head's first width[h] candidates, head after head: one copy of the widest run's length
  /// per head (one synchronisation).
  std::vector<vertical_candidate> candidates(const std::vector<index_t>& width) const {
    const std::size_t most = width.empty() ? 0 : static_cast<std::size_t>(*std::max_element(width.begin(), width.end()));
    const pinned_buffer<std::uint64_t> key(static_cast<std::size_t>(heads_) * most, stream_);
    const pinned_buffer<index_t> token(key.size(), stream_);
    if (most > 0) {
      STRIA_CUDA_CHECK(cudaMemcpy2DAsync(key.data(), most * sizeof(std::uint64_t), sorted_keys_.data(), run_stride_ * sizeof(std::uint64_t),
                                         most * sizeof(std::uint64_t), static_cast<std::size_t>(heads_), cudaMemcpyDeviceToHost, stream_));
      STRIA_CUDA_CHECK(cudaMemcpy2DAsync(token.data(), most * sizeof(index_t), sorted_tokens_.data(), run_stride_ * sizeof(index_t),
                                         most * sizeof(index_t), static_cast<std::size_t>(heads_), cudaMemcpyDeviceToHost, stream_));
      STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    std::vector<vertical_candidate> sent;
    for (std::size_t h = 0; h < width.size(); ++h)
      for (std::size_t i = h * most; i < h * most + static_cast<std::size_t>(width[h]); ++i)
        sent.push_back({kernel::mass_of_descending_bits(static_cast<std::uint32_t>(key[i])), token[i]});
    return sent;
  }

  estimator::device_statistics global_statistics(vs_statistics st) {
    estimator::device_statistics out = estimator::device_statistics::upload(st, stream_);
    lap(&estimator::statistics_timing::collectives_ms);
    return out;
  }

  /// One rank's statistics are already global: one kernel finishes them in device memory.
  estimator::device_statistics own_statistics() {
    const index_t per_rank = plan_.per_rank, diagonals = plan_.shape.num_diagonals();
    estimator::device_statistics out{plan_.shape, per_rank, device_buffer<float>(static_cast<std::size_t>(heads_), stream_),
                                     device_buffer<float>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(diagonals), stream_),
                                     device_buffer<float>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(per_rank), stream_),
                                     device_buffer<index_t>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(per_rank), stream_)};
    kernel::single_rank_statistics<><<<static_cast<unsigned>(heads_), 256, 0, stream_>>>(
        tile_mass_.data(), key_global_block_.data(), sorted_keys_.data(), sorted_tokens_.data(), blocks_, run_stride_, per_rank, plan_.shape.num_blocks(),
        diagonals, plan_.shape.diagonal_offset(), out.slash_mass.data(), out.window_mass.data(), out.candidate_mass.data(), out.candidate_token.data());
    STRIA_CUDA_CHECK_LAUNCH("single_rank_statistics");
    lap(&estimator::statistics_timing::collectives_ms);
    return out;
  }

 private:
  [[nodiscard]] std::size_t row_count() const { return static_cast<std::size_t>(heads_ * rows_); }
  /// Key blocks per CTA of the window kernels: as many as make one wave of CTAs (four per SM fit:
  /// 52 KiB of shared memory at D 128, 94-96 registers by ptxas -v), since each CTA first loads its
  /// window rows and its first key tiles with nothing to overlap; at least 4, and enough that the
  /// chunks fit the grid's y extent.
  static index_t chunk_blocks(index_t blocks, index_t heads) {
    int sms = 0;
    STRIA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, current_device()));
    const std::int64_t chunks_per_head = std::max<std::int64_t>(std::int64_t{4} * std::max(sms, 1) / heads, 1);
    const std::int64_t chunk = std::max<std::int64_t>({(blocks + chunks_per_head - 1) / chunks_per_head, 4, (blocks + 65534) / 65535});
    return static_cast<index_t>(std::min<std::int64_t>(chunk, blocks));
  }
  /// Heads fastest, so that the heads reading one chunk of keys run together (kernel/window_statistics.cuh).
  [[nodiscard]] dim3 grid() const {
    return {static_cast<unsigned>(heads_), static_cast<unsigned>((blocks_ + chunk_blocks_ - 1) / chunk_blocks_)};
  }
  [[nodiscard]] kernel::window_params<T> params() const {
    return {window_, k_, key_global_block_.data(), rows_, heads_, heads_kv_, blocks_, chunk_blocks_, plan_.first_row(), scale_log2_,
            plan_.shape.causal};
  }
  /// Ends a timed phase: synchronises the stream and writes the wall time since the last phase.
  void lap(double estimator::statistics_timing::*phase) {
    if (timing_ == nullptr) return;
    STRIA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const auto now = std::chrono::steady_clock::now();
    timing_->*phase = std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
  }

  const engine::window_plan& plan_;
  bool owner_;
  const T* k_;
  index_t heads_, heads_kv_, dim_, rows_, blocks_, tokens_;
  float scale_log2_;
  cudaStream_t stream_;
  estimator::statistics_timing* timing_;
  std::chrono::steady_clock::time_point last_;
  const T* window_;  // [rows, Hq, D]: in q_local, or uploaded_window_
  window_rows host_window_;                  // the window's rows on the host, when W > 1
  device_buffer<T> uploaded_window_;
  device_buffer<index_t> key_global_block_;  // [local blocks]
  index_t chunk_blocks_;                     // key blocks per CTA of the window kernels
  device_buffer<float> normaliser_;          // [2, Hq, rows]: row max, then sum of exp2 (this rank's, then the global ones)
  pinned_buffer<float> host_normaliser_;     // normaliser_'s host side: this rank's, then the global one
  device_buffer<float> tile_mass_;           // [Hq, local blocks]
  device_buffer<std::uint64_t> sorted_keys_;  // [Hq, run_stride_]: each head's candidates, mass descending (descending_bits)
  device_buffer<index_t> sorted_tokens_;      // [Hq, run_stride_]: their global key tokens
  index_t run_stride_ = 0;                    // per_rank, or the local tokens after the device-wide sort
};

}  // namespace stria::device::detail
