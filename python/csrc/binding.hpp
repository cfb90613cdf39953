// SPDX-License-Identifier: Apache-2.0
// The PyTorch extension's kernel layer: stria's estimator, index builder and sparse kernels over raw
// pointers of contiguous [batch, seq, heads, dim] tensors, one batch element after another. It includes
// no PyTorch header (torch_ops.cpp turns tensors into these calls), so it builds with nvcc alone.
#pragma once

#include <cuda_runtime_api.h>

#include <stria/estimator/vertical_slash_top_p.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace stria::python {

enum class element { bf16, fp16 };

/// One call's shapes: q [batch, seq_len, heads_q, head_dim], k and v [batch, seq_len, heads_kv, head_dim].
struct problem {
  std::int64_t batch = 0, seq_len = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  bool causal = true;
  double softmax_scale = 0;
  element type = element::bf16;
  cudaStream_t stream = nullptr;
};

/// Fills a padded selection's tail; after every real entry of a row, so rows stay ascending.
inline constexpr std::int32_t selection_padding = std::numeric_limits<std::int32_t>::max();

/// A selection per (batch element, query head) as the op's tensors hold it, in host memory: vertical
/// key tokens [batch, heads_q, vertical_width] and slash block diagonals (query block - key block)
/// [batch, heads_q, slash_width], each row ascending and padded with selection_padding.
struct padded_selection {
  const std::int32_t* vertical = nullptr;
  std::int64_t vertical_width = 0;
  const std::int32_t* slash = nullptr;
  std::int64_t slash_width = 0;
};

/// estimator::vertical_slash_top_p's settings (0 for a max: the default cap at the sequence length),
/// its defaults (python/stria/_ops.py repeats them).
struct estimator_options {
  double p_vertical = estimator::vertical_slash_top_p{}.p_vertical, p_slash = estimator::vertical_slash_top_p{}.p_slash;
  std::int64_t vertical_max = 0, slash_max = 0, sink_tokens = estimator::vertical_slash_top_p{}.sink_tokens,
               local_diagonals = estimator::vertical_slash_top_p{}.local_diagonals, last_q = estimator::vertical_slash_top_p{}.last_q;
};

inline estimator::vertical_slash_top_p estimator_of(const estimator_options& o) {
  estimator::vertical_slash_top_p e;
  e.p_vertical = o.p_vertical;
  e.p_slash = o.p_slash;
  e.vertical.max = static_cast<index_t>(o.vertical_max);
  e.slash.max = static_cast<index_t>(o.slash_max);
  e.sink_tokens = static_cast<index_t>(o.sink_tokens);
  e.local_diagonals = static_cast<index_t>(o.local_diagonals);
  e.last_q = static_cast<index_t>(o.last_q);
  return e;
}

/// How a call ended: the entry points below catch every error themselves (no exception crosses into
/// the operators' translation unit) and report it here, the message kept whole.
struct outcome {
  enum class kind { ok, invalid_argument, failure } what = kind::ok;
  std::string message;
};

/// The widths every head's estimated selection fits in at `seq_len` (an invalid_argument outcome for
/// settings the estimator refuses).
outcome estimate_widths(const estimator_options& options, std::int64_t seq_len, std::int64_t heads_q, bool causal,
                        std::pair<std::int64_t, std::int64_t>& widths) noexcept;

/// The global 64-token blocks each rank owns under a sharding ("sequential", "zigzag", "striped": stria's
/// sharding::sequential, zigzag, striped<64>), rank after rank, each rank's in local order: blocks[r *
/// seq_len / 64 / world + i] is rank r's local block i.
outcome rank_blocks(const std::string& layout, std::int64_t seq_len, std::int64_t world, std::vector<std::int64_t>& blocks) noexcept;

/// Estimates each batch element's selection from q and k (device) into host arrays of
/// estimate_widths' widths.
outcome estimate(const problem& p, const void* q, const void* k, const estimator_options& options, std::int32_t* vertical, std::int32_t* slash) noexcept;

/// out [batch, seq, heads_q, dim] (the input type) and lse [batch, heads_q, seq] (fp32, natural log).
outcome forward(const problem& p, const void* q, const void* k, const void* v, const padded_selection& selection, void* out, float* lse) noexcept;

/// Device scratch of one batch element's backward, fp32: dk and dv [seq, heads_kv, dim], delta [heads_q, seq]
/// (dQ needs none: the backward writes it out in the input type itself).
struct backward_scratch {
  float* dk = nullptr;
  float* dv = nullptr;
  float* delta = nullptr;
};

/// dq, dk, dv (the input type, shaped as q, k, v) from d_out and the forward's out and lse.
outcome backward(const problem& p, const void* q, const void* k, const void* v, const void* out, const void* d_out, const float* lse,
                 const padded_selection& selection, bool deterministic, const backward_scratch& scratch, void* dq, void* dk, void* dv) noexcept;

// --- Context parallelism: one rank of a ring over the processes of a torch.distributed group ------

/// The bytes of an NCCL unique id (ncclUniqueId).
inline constexpr std::size_t nccl_id_bytes = 128;

/// This rank's place in a context-parallel call: rank `rank` of `world`, joined to the others through
/// the NCCL communicator that `nccl_id` (made by rank 0 with nccl_unique_id, then broadcast over the
/// group) names, the sequence laid out over the ranks as `layout` says ("striped", "zigzag",
/// "sequential"). In such a call problem::seq_len is the whole sequence and the tensors are this
/// rank's shards: q [batch, seq_len / world, heads_q, dim], k and v likewise.
struct ring_ranks {
  std::array<unsigned char, nccl_id_bytes> nccl_id{};
  std::int64_t rank = 0, world = 1;
  std::string layout = "striped";
};

/// A new NCCL unique id (rank 0 of a group makes it; a failure outcome where the extension was built
/// without NCCL).
outcome nccl_unique_id(std::array<unsigned char, nccl_id_bytes>& id) noexcept;

/// Makes this process's communicator of `r` on the current device (NCCL's initialisation: every rank
/// of the group calls it at once, right after the id's broadcast). Later calls that name the same id
/// on this device use it; one whose wait gave up and aborted it raises, naming why (a new group, with a
/// new id, is the way on).
outcome ring_init(const ring_ranks& r) noexcept;

/// The selection of every batch element, estimated online from every rank's shards of q and k (the
/// estimator's collectives run over the ring's communicator), into host arrays of estimate_widths'
/// widths at the whole sequence's length; identical on every rank.
outcome ring_estimate(const problem& p, const ring_ranks& r, const void* q, const void* k, const estimator_options& options, std::int32_t* vertical,
                      std::int32_t* slash) noexcept;

/// This rank's out [batch, seq_len / world, heads_q, dim] and lse [batch, heads_q, seq_len / world] of
/// ring attention over the whole sequence, on a selection of the whole sequence (the same on every rank).
outcome ring_forward(const problem& p, const ring_ranks& r, const void* q, const void* k, const void* v, const padded_selection& selection,
                     void* out, float* lse) noexcept;

/// This rank's dq, and the complete dk, dv of its own keys and values (summed over every rank whose
/// queries used them), from its shards of d_out and of the forward's out and lse.
outcome ring_backward(const problem& p, const ring_ranks& r, const void* q, const void* k, const void* v, const void* out, const void* d_out,
                      const float* lse, const padded_selection& selection, bool deterministic, void* dq, void* dk, void* dv) noexcept;

}  // namespace stria::python
