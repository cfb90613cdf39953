// SPDX-License-Identifier: Apache-2.0
// The context-parallel entry's work for one element type: the front template stria::sparse_attention
// (a flat ring, the call's sharding, the estimator's options) on comm::nccl, whose ranks are the
// processes of a torch.distributed group. binding_ring_bf16.cu and binding_ring_fp16.cu instantiate it;
// binding.cu keeps the communicators and builds it only where NCCL was found.
#pragma once

#include <stria/comm/nccl.cuh>
#include <stria/sharding/sequential.hpp>
#include <stria/sharding/striped.hpp>
#include <stria/sharding/zigzag.hpp>
#include <stria/sparse_attention.cuh>
#include <stria/topology/flat_ring.hpp>

#include "binding.cuh"

namespace stria::python {

/// The process's comm::nccl for `r`: made on the first call that names r.nccl_id on the current
/// device (every rank of the group makes that call at once, as NCCL's initialisation needs), then kept
/// for the life of the process. Defined in binding.cu, so that both element types share them.
comm::nccl& ring_communicator(const ring_ranks& r);

/// Calls body(layer) with this call's front template: the sharding that r.layout names, a flat ring
/// over r.world ranks, tiles of the call's head dim (the layer checks the shape against them).
template <class Body>
void with_ring_layer(const problem& p, const ring_ranks& r, const estimator::vertical_slash_top_p& estimator, bool deterministic, Body&& body) {
  const attention_config config{.seq_len = static_cast<index_t>(p.seq_len),
                                .heads_q = static_cast<index_t>(p.heads_q),
                                .heads_kv = static_cast<index_t>(p.heads_kv),
                                .causal = p.causal,
                                .softmax_scale = p.softmax_scale,
                                .backward_mode = deterministic ? device::determinism::deterministic : device::determinism::atomic};
  const auto with_sharding = [&]<index_t D>(auto sharding) {
    sparse_attention<estimator::vertical_slash_top_p, decltype(sharding), topology::flat_ring, tile<64, 64, D>> layer(
        estimator, sharding, topology::flat_ring(static_cast<index_t>(r.world)), config);
    body(layer);
  };
  const auto with_head_dim = [&](auto sharding) {
    if (p.head_dim == 64) with_sharding.template operator()<64>(sharding);
    else with_sharding.template operator()<128>(sharding);
  };
  if (r.layout == "striped") with_head_dim(sharding::striped<>{});
  else if (r.layout == "zigzag") with_head_dim(sharding::zigzag{});
  else if (r.layout == "sequential") with_head_dim(sharding::sequential{});
  else throw invalid_argument("layout", r.layout, "must be \"striped\", \"zigzag\" or \"sequential\"");
}

/// The rank's share of the sequence (the layer checks that the layout divides it so).
inline std::int64_t local_tokens(const problem& p, const ring_ranks& r) { return p.seq_len / r.world; }

template <class T>
void ring_estimate_typed(const problem& p, const ring_ranks& r, const T* q, const T* k, const estimator_options& options,
                         std::pair<std::int64_t, std::int64_t> widths, std::int32_t* vertical, std::int32_t* slash) {
  const batch_views<T> views{p, local_tokens(p, r)};
  with_ring_layer(p, r, estimator_of(options), false, [&](auto& layer) {
    comm::nccl& comm = ring_communicator(r);  // once the layer has checked the call
    for (std::int64_t b = 0; b < p.batch; ++b) {
      layer.estimate(comm, views.q_like(q, b), views.kv_like(k, b), p.stream);
      write_padded(p, layer.selection().to_host(p.stream), b, widths, vertical, slash);
    }
  });
}

template <class T>
void ring_forward_typed(const problem& p, const ring_ranks& r, const T* q, const T* k, const T* v, const padded_selection& selection, T* out,
                        float* lse) {
  const batch_views<T> views{p, local_tokens(p, r)};
  with_ring_layer(p, r, {}, false, [&](auto& layer) {
    comm::nccl& comm = ring_communicator(r);  // once the layer has checked the call
    for (std::int64_t b = 0; b < p.batch; ++b) {
      layer.use_selection(comm, unpadded(p, selection, b), p.stream);
      layer.forward(comm, views.q_like(q, b), views.kv_like(k, b), views.kv_like(v, b), views.q_like(out, b), views.rows(lse, b), p.stream);
    }
  });
}

template <class T>
void ring_backward_typed(const problem& p, const ring_ranks& r, const T* q, const T* k, const T* v, const T* out, const T* d_out,
                         const float* lse, const padded_selection& selection, bool deterministic, T* dq, T* dk, T* dv) {
  const batch_views<T> views{p, local_tokens(p, r)};
  with_ring_layer(p, r, {}, deterministic, [&](auto& layer) {
    comm::nccl& comm = ring_communicator(r);  // once the layer has checked the call
    for (std::int64_t b = 0; b < p.batch; ++b) {
      layer.use_selection(comm, unpadded(p, selection, b), p.stream);
      layer.backward(comm, views.q_like(q, b), views.kv_like(k, b), views.kv_like(v, b), views.q_like(out, b), views.q_like(d_out, b),
                     views.rows(lse, b), views.q_like(dq, b), views.kv_like(dk, b), views.kv_like(dv, b), p.stream);
    }
  });
}

}  // namespace stria::python
