// SPDX-License-Identifier: Apache-2.0
// Step indices and global selections in device memory: device_step_index (what the attention
// kernels read, one per rank and ring step or solver task), device_selection (a layer's global
// selection as per-head lists, once per layer) and index_request (one index of a batch). The GPU
// builder that fills them is index/local_index.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include <span>
#include <utility>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/device_buffer.cuh"
#include "stria/index/global_selection.hpp"
#include "stria/index/step_index.hpp"

namespace stria {

/// A step index in device memory; view() gives the pointers kernels consume.
struct device_step_index {
  step_index_shape shape;
  step_index_origin origin;
  device_buffer<index_t> query_global_block, kv_global_block, block_ptr, block_col, col_ptr, col_token, kv_query_ptr, kv_query,
      vtoken_head_ptr, vtoken, vtoken_query_ptr, vtoken_query;
  // Every row holds every tile the causal rule allows, query blocks ascending (holds_every_allowed_tile):
  // set by the builders, it lets the forward run two query blocks per CTA over one tile stream.
  bool complete = false;

  [[nodiscard]] step_index_view view() const {
    return {shape,           query_global_block.data(), kv_global_block.data(), block_ptr.data(),    block_col.data(),
            col_ptr.data(),  col_token.data(),          kv_query_ptr.data(),    kv_query.data(),     vtoken_head_ptr.data(),
            vtoken.data(),   vtoken_query_ptr.data(),   vtoken_query.data()};
  }

  /// A host copy (for tests and inspection).
  [[nodiscard]] step_index to_host() const {
    return {shape,
            origin,
            query_global_block.download(),
            kv_global_block.download(),
            block_ptr.download(),
            block_col.download(),
            col_ptr.download(),
            col_token.download(),
            kv_query_ptr.download(),
            kv_query.download(),
            vtoken_head_ptr.download(),
            vtoken.download(),
            vtoken_query_ptr.download(),
            vtoken_query.download()};
  }
};

/// A host step index copied to the device, ordered on `stream` (for indices built on the host, and tests).
inline device_step_index upload_step_index(const step_index& host, cudaStream_t stream) {
  auto copy = [stream](const std::vector<index_t>& values) { return device_buffer<index_t>(std::span<const index_t>(values), stream); };
  return {host.shape,
          host.origin,
          copy(host.query_global_block),
          copy(host.kv_global_block),
          copy(host.block_ptr),
          copy(host.block_col),
          copy(host.col_ptr),
          copy(host.col_token),
          copy(host.kv_query_ptr),
          copy(host.kv_query),
          copy(host.vtoken_head_ptr),
          copy(host.vtoken),
          copy(host.vtoken_query_ptr),
          copy(host.vtoken_query),
          holds_every_allowed_tile(host)};
}

/// A global selection flattened into per-head CSR lists on the device: uploaded from a host
/// global_selection, or produced on the device by the GPU selection (estimator/select.cuh).
class device_selection {
 public:
  /// The per-head lists of a device selection (device memory, each [heads + 1] pointers and the
  /// entries they delimit); `vertical_head` holds each vertical token's head.
  struct lists {
    device_buffer<index_t> slash_ptr, slash, vertical_ptr, vertical, tile_ptr, tile_query, tile_key, vertical_head;
  };

  explicit device_selection(const global_selection& g, cudaStream_t stream = nullptr)
      : seq_len_(g.seq_len), heads_(g.num_heads()), causal_(g.causal) {
    g.validate();
    std::vector<index_t> slash_ptr{0}, slash, vertical_ptr{0}, vertical, tile_ptr{0}, tile_query, tile_key, head_of;
    for (index_t h = 0; h < heads_; ++h) {
      const head_selection& head = g.heads[static_cast<std::size_t>(h)];
      slash.insert(slash.end(), head.slash_deltas.begin(), head.slash_deltas.end());
      slash_ptr.push_back(static_cast<index_t>(slash.size()));
      vertical.insert(vertical.end(), head.vertical_tokens.begin(), head.vertical_tokens.end());
      vertical_ptr.push_back(static_cast<index_t>(vertical.size()));
      head_of.insert(head_of.end(), head.vertical_tokens.size(), h);
      for (const block_pair& b : head.blocks) {
        tile_query.push_back(b.query_block);
        tile_key.push_back(b.key_block);
      }
      tile_ptr.push_back(static_cast<index_t>(tile_query.size()));
    }
    auto up = [stream](const std::vector<index_t>& x) { return device_buffer<index_t>(std::span<const index_t>(x), stream); };
    lists_ = {up(slash_ptr), up(slash), up(vertical_ptr), up(vertical), up(tile_ptr), up(tile_query), up(tile_key), up(head_of)};
  }

  /// Adopts lists already on the device (sorted, unique, in range: the producer's promise).
  device_selection(index_t seq_len, index_t heads, bool causal, lists device_lists)
      : seq_len_(seq_len), heads_(heads), causal_(causal), lists_(std::move(device_lists)) {}

  [[nodiscard]] index_t seq_len() const { return seq_len_; }
  [[nodiscard]] index_t num_heads() const { return heads_; }
  [[nodiscard]] bool causal() const { return causal_; }
  [[nodiscard]] index_t num_vertical() const { return static_cast<index_t>(lists_.vertical.size()); }
  /// The head of each flattened vertical token (device).
  [[nodiscard]] const index_t* vertical_head() const { return lists_.vertical_head.data(); }

  /// The per-head lists on the device (what the index builder's kernels read).
  [[nodiscard]] const lists& device_lists() const { return lists_; }

  /// A host copy, after the work queued on `stream` (for tests, and for host planners such as the
  /// workload counts).
  [[nodiscard]] global_selection to_host(cudaStream_t stream = nullptr) const {
    const std::vector<index_t> slash_ptr = lists_.slash_ptr.download(stream), slash = lists_.slash.download(stream),
                               vertical_ptr = lists_.vertical_ptr.download(stream), vertical = lists_.vertical.download(stream),
                               tile_ptr = lists_.tile_ptr.download(stream), tile_query = lists_.tile_query.download(stream),
                               tile_key = lists_.tile_key.download(stream);
    global_selection g{seq_len_, causal_, std::vector<head_selection>(static_cast<std::size_t>(heads_))};
    for (std::size_t h = 0; h < g.heads.size(); ++h) {
      head_selection& head = g.heads[h];
      head.slash_deltas.assign(slash.begin() + slash_ptr[h], slash.begin() + slash_ptr[h + 1]);
      head.vertical_tokens.assign(vertical.begin() + vertical_ptr[h], vertical.begin() + vertical_ptr[h + 1]);
      for (index_t i = tile_ptr[h]; i < tile_ptr[h + 1]; ++i)
        head.blocks.push_back({tile_query[static_cast<std::size_t>(i)], tile_key[static_cast<std::size_t>(i)]});
    }
    return g;
  }

 private:
  index_t seq_len_, heads_;
  bool causal_;
  lists lists_;
};

/// One index of a batch: `query_rank`'s local query blocks against `kv_rank`'s KV shard, with the
/// origin recorded on it (its seq_len, world_size, rank and kv_source_rank are filled in).
struct index_request {
  index_t query_rank = 0, kv_rank = 0;
  step_index_origin origin{};
};

}  // namespace stria
