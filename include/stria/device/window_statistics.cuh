// SPDX-License-Identifier: Apache-2.0
// The launcher of the GPU window statistics (estimator/window_statistics.cuh): the device backend of
// the window statistics engine (engine/window_statistics_engine.hpp), with the heavy work (window x
// local keys, twice) in the kernels of kernel/window_statistics.cuh, and its collectives on device
// arrays (device_exchange). No host round trip on any world size.
#pragma once

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/error.hpp"
#include "stria/core/numeric.cuh"
#include "stria/device/launch.cuh"
#include "stria/engine/window_statistics_engine.hpp"
#include "stria/estimator/device_statistics.cuh"
#include "stria/estimator/statistics.hpp"
#include "stria/kernel/window_statistics.cuh"

namespace stria::device::detail {

/// The window statistics engine's collectives on device arrays (device_buffer, the device backend's
/// `floats`), queued on `stream` over any device_collectives communicator: nothing crosses the
/// host, and nothing waits for the device.
template <class Comm>
struct device_exchange {
  static_assert(check_device_collectives<Comm>());
  Comm& comm;
  cudaStream_t stream;

  template <class T>
  void broadcast(std::span<T> rows, index_t root) {
    comm.broadcast(rows.data(), rows.size(), root, stream);
  }
  /// An empty share (no candidates: vertical.max 0, the same on every rank, the plan being global)
  /// makes no call, so no communicator sees a null buffer.
  template <class T>
  device_buffer<T> all_gather(const device_buffer<T>& mine) {
    device_buffer<T> all(mine.size() * static_cast<std::size_t>(comm.world_size()), stream);
    if (mine.size() > 0) comm.all_gather(mine.data(), all.data(), mine.size(), stream);
    return all;
  }
};

/// The device backend of the window statistics engine: the window against this rank's keys in the
/// kernels of kernel/window_statistics.cuh, the candidates' top-k by one CUB radix sort, and the
/// ranks' shares combined by kernels too; every buffer and collective in stream order on `stream`,
/// so the gathering never waits for the device. The window is read in q_local on the only rank;
/// over several, from a buffer that the owner fills from q_local and the broadcast fills on the
/// others. With `timing`, each phase ends by synchronising.
template <class T>
class window_backend {
 public:
  using floats = device_buffer<float>;
  using share = engine::rank_share<floats, device_buffer<std::uint64_t>>;
  using window_rows = std::span<T>;  // [rows, Hq, D] in the input type: every rank scores the same values
  using statistics = estimator::device_statistics;

  window_backend(const engine::window_plan& plan, index_t rank, const T* q_local, const T* k_local, index_t heads_kv, index_t dim,
                 double softmax_scale, cudaStream_t stream, estimator::statistics_timing* timing, std::chrono::steady_clock::time_point start)
      : plan_(plan), owner_(rank == plan.window_owner), k_(k_local), heads_(plan.shape.num_heads), heads_kv_(heads_kv), dim_(dim),
        rows_(plan.shape.window_rows), blocks_(plan.rank_blocks), tokens_(plan.rank_blocks * block_tokens),
        scale_log2_(float(softmax_scale * 1.4426950408889634)), stream_(stream), timing_(timing), last_(start),
        window_(q_local + static_cast<std::size_t>(plan.window_local_token) * static_cast<std::size_t>(heads_ * dim)),
        every_key_global_block_(plan.key_global_block, stream), key_global_block_(every_key_global_block_.data() + static_cast<std::size_t>(rank * blocks_)),
        chunk_blocks_(chunk_blocks(blocks_, heads_)) {}

  template <class Comm>
  device_exchange<Comm> exchange(Comm& comm) const {
    return {comm, stream_};
  }

  /// A buffer for the window's rows, which the owner fills from q_local (a copy, so that no
  /// communicator's broadcast can write into the caller's const q) and the broadcast on the others.
  window_rows window() {
    const std::size_t count = static_cast<std::size_t>(rows_ * heads_ * dim_);
    received_window_ = device_buffer<T>(count, stream_);
    if (owner_) STRIA_CUDA_CHECK(cudaMemcpyAsync(received_window_.data(), window_, count * sizeof(T), cudaMemcpyDeviceToDevice, stream_));
    window_ = received_window_.data();
    return {received_window_.data(), count};
  }

  /// Pass 1: per (head, chunk, row) the max score and sum of exp2, then this rank's per row.
  void score_window() {
    lap(&estimator::statistics_timing::setup_ms);
    const index_t chunks = grid().y;
    device_buffer<float> partial_max(row_count() * static_cast<std::size_t>(chunks), stream_), partial_sum(partial_max.size(), stream_);
    with_head_dim<any_head_dim>(dim_, [&]<int D>() {
      detail::launch<&kernel::window_partials<T, D>>("window_partials",
                                                     {grid(), kernel::window_threads, kernel::window_shared_bytes<T, D>(), stream_}, params(),
                                                     partial_max.data(), partial_sum.data());
    });
    normaliser_ = device_buffer<float>(2 * row_count(), stream_);
    detail::launch<&kernel::combine_row_partials<>>("combine_row_partials", {static_cast<unsigned>(row_count()), 256, 0, stream_}, partial_max.data(),
                                                    partial_sum.data(), chunks, rows_, row_max(), row_sum());
    lap(&estimator::statistics_timing::pass1_ms);
  }

  /// This rank's normaliser [2, Hq, rows]: its row max, then its sums of exp2 against it.
  floats row_normaliser() const {
    floats own(normaliser_.size(), stream_);
    STRIA_CUDA_CHECK(cudaMemcpyAsync(own.data(), normaliser_.data(), normaliser_.size() * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    return own;
  }
  /// Every rank's normaliser [W, 2, Hq, rows] becomes the global one (kernel::combine_normalisers).
  void place_normaliser(floats every_rank) {
    if (every_rank.size() != 2 * row_count() * static_cast<std::size_t>(plan_.world))
      throw invalid_argument("every_rank.size()", every_rank.size(), "must be W * 2 * Hq * rows = " + std::to_string(2 * row_count() * static_cast<std::size_t>(plan_.world)));
    detail::launch<&kernel::combine_normalisers<>>("combine_normalisers", {static_cast<unsigned>((row_count() + 255) / 256), 256, 0, stream_},
                                                   every_rank.data(), plan_.world, static_cast<index_t>(row_count()), row_max(), row_sum());
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
      detail::launch<&kernel::window_probabilities<T, D>>(
          "window_probabilities", {grid(), kernel::window_threads, kernel::window_shared_bytes<T, D>(), stream_}, params(), row_max(), row_sum(),
          plan_.shape.num_blocks() - plan_.shape.local_blocks, vertical.data(), tile_mass_.data());
    });
    lap(&estimator::statistics_timing::pass2_ms);
    const index_t per_rank = plan_.per_rank;
    if (per_rank == 0) {  // no candidates asked for: nothing reads a run
      run_stride_ = 0;
    } else if (per_rank <= kernel::top_k_capacity) {
      run_stride_ = per_rank;
      sorted_keys_ = device_buffer<std::uint64_t>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(per_rank), stream_);
      sorted_tokens_ = device_buffer<index_t>(sorted_keys_.size(), stream_);
      detail::launch<&kernel::candidate_top_k<>>("candidate_top_k",
                                                 {static_cast<unsigned>(heads_), kernel::top_k_threads, kernel::top_k_shared_bytes(), stream_},
                                                 vertical.data(), key_global_block_, tokens_, per_rank, sorted_keys_.data(), sorted_tokens_.data());
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
    detail::launch<&kernel::candidate_keys<>>("candidate_keys", {static_cast<unsigned>((items + 255) / 256), 256, 0, stream_}, vertical.data(),
                                              key_global_block_, heads_, tokens_, keys.data(), tokens.data());
    const int end_bit = 32 + std::bit_width(static_cast<unsigned>(heads_));  // head bits above the 32 mass bits
    std::size_t temp_bytes = 0;
    STRIA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.data(), sorted_keys_.data(), tokens.data(), sorted_tokens_.data(),
                                                     static_cast<int>(items), 0, end_bit, stream_));
    device_buffer<unsigned char> temp(std::max<std::size_t>(temp_bytes, 1), stream_);
    STRIA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys.data(), sorted_keys_.data(), tokens.data(), sorted_tokens_.data(),
                                                     static_cast<int>(items), 0, end_bit, stream_));
  }

  /// The tile masses, each head's window mass and its candidates as selection keys, on the device.
  share rank_share() const {
    const index_t per_rank = plan_.per_rank;
    share mine{device_buffer<float>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(blocks_ + 1), stream_),
               device_buffer<std::uint64_t>(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(per_rank), stream_)};
    detail::launch<&kernel::pack_rank_share<>>("pack_rank_share", {static_cast<unsigned>(heads_), 256, 0, stream_}, tile_mass_.data(),
                                               sorted_keys_.data(), sorted_tokens_.data(), blocks_, run_stride_, per_rank, mine.mass.data(),
                                               mine.candidates.data());
    return mine;
  }

  /// Every rank's share combined in device memory, as engine::combine_shares combines them on the
  /// host: the masses onto the diagonals, and each head's union of the runs, its first plan.keep
  /// (the most a union holds: its rows are padded with mass -1).
  estimator::device_statistics global_statistics(share all) {
    const index_t per_rank = plan_.per_rank, diagonals = plan_.shape.num_diagonals();
    const index_t width = static_cast<index_t>(std::min<std::int64_t>(plan_.keep, std::int64_t{plan_.world} * per_rank));
    estimator::device_statistics out = statistics_of_width(width);
    detail::launch<&kernel::combine_block_masses<>>("combine_block_masses", {static_cast<unsigned>(heads_), 256, 0, stream_}, all.mass.data(),
                                                    every_key_global_block_.data(), plan_.world, heads_, blocks_, plan_.shape.num_blocks(), diagonals,
                                                    plan_.shape.diagonal_offset(), out.slash_mass.data(), out.window_mass.data());
    if (const std::int64_t entries = std::int64_t{plan_.world} * heads_ * std::min(per_rank, width); entries > 0) {
      detail::launch<&kernel::merge_candidate_runs<>>("merge_candidate_runs", {static_cast<unsigned>((entries + 255) / 256), 256, 0, stream_},
                                                      all.candidates.data(), plan_.world, heads_, per_rank, width, out.candidate_mass.data(),
                                                      out.candidate_token.data());
    }
    lap(&estimator::statistics_timing::collectives_ms);
    return out;
  }

  /// One rank's statistics are already global: one kernel finishes them in device memory.
  estimator::device_statistics own_statistics() {
    const index_t per_rank = plan_.per_rank, diagonals = plan_.shape.num_diagonals();
    estimator::device_statistics out = statistics_of_width(per_rank);
    detail::launch<&kernel::single_rank_statistics<>>("single_rank_statistics", {static_cast<unsigned>(heads_), 256, 0, stream_}, tile_mass_.data(),
                                                      key_global_block_, sorted_keys_.data(), sorted_tokens_.data(), blocks_, run_stride_, per_rank,
                                                      plan_.shape.num_blocks(), diagonals, plan_.shape.diagonal_offset(), out.slash_mass.data(),
                                                      out.window_mass.data(), out.candidate_mass.data(), out.candidate_token.data());
    lap(&estimator::statistics_timing::collectives_ms);
    return out;
  }

 private:
  [[nodiscard]] std::size_t row_count() const { return static_cast<std::size_t>(heads_ * rows_); }
  // [Hq, rows] each, the normaliser's halves (score_window allocates it; nothing reads them before).
  [[nodiscard]] float* row_max() const { return normaliser_.data(); }
  [[nodiscard]] float* row_sum() const { return normaliser_.data() + row_count(); }
  /// Statistics in device memory with candidate rows of `width` entries, to be filled on stream_.
  [[nodiscard]] estimator::device_statistics statistics_of_width(index_t width) const {
    const auto heads = static_cast<std::size_t>(heads_);
    vs_statistics shape = plan_.shape;  // no masses: they live in the buffers
    shape.window_mass.clear();
    shape.slash_mass.clear();
    return {std::move(shape), width, device_buffer<float>(heads, stream_),
            device_buffer<float>(heads * static_cast<std::size_t>(plan_.shape.num_diagonals()), stream_),
            device_buffer<float>(heads * static_cast<std::size_t>(width), stream_), device_buffer<index_t>(heads * static_cast<std::size_t>(width), stream_)};
  }
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
    return {window_, k_, key_global_block_, rows_, heads_, heads_kv_, blocks_, chunk_blocks_, plan_.first_row(), scale_log2_,
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
  const T* window_;                          // [rows, Hq, D]: in q_local, or received_window_
  device_buffer<T> received_window_;         // over several ranks: the window rows (the owner's copy, the broadcast's elsewhere)
  device_buffer<index_t> every_key_global_block_;  // [world, local blocks]: every rank's key blocks (plan.key_global_block)
  const index_t* key_global_block_;          // [local blocks]: this rank's
  index_t chunk_blocks_;                     // key blocks per CTA of the window kernels
  device_buffer<float> normaliser_;          // [2, Hq, rows]: this rank's row max and sum of exp2, then the global ones
  device_buffer<float> tile_mass_;           // [Hq, local blocks]
  device_buffer<std::uint64_t> sorted_keys_;  // [Hq, run_stride_]: each head's candidates, mass descending (descending_bits)
  device_buffer<index_t> sorted_tokens_;      // [Hq, run_stride_]: their global key tokens
  index_t run_stride_ = 0;                    // per_rank, or the local tokens after the device-wide sort
};

}  // namespace stria::device::detail
