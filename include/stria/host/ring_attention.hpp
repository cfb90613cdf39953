// SPDX-License-Identifier: Apache-2.0
// Host ring attention, the oracle for the device ring: the ring engine (engine/ring_engine.hpp) on a
// host communicator, each step the reference kernel on that step's local index; the running O/LSE
// and the travelling dK/dV are fp32. In checked mode (finite_check::every_step) each step's merged O
// and LSE (backward: dQ and the travelling dK/dV) must be finite, else non_finite_error.
#pragma once

#include <array>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/attention_tensors.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/engine/ring_engine.hpp"
#include "stria/host/reference_attention.hpp"
#include "stria/index/step_index.hpp"
#include "stria/topology/ring_steps.hpp"

namespace stria::host {

namespace detail {

/// The host backend of the ring engine. A KV chunk and a dK/dV partial are one message each
/// ([2, Sk, Hkv, D]: K then V, dK then dV). Sends never block and a receive returns with the data,
/// so no buffer is ever in flight.
template <class Comm>
struct ring_backend {
  using partial = std::vector<float>;

  Comm& comm;
  std::vector<float> own;  // this rank's K and V
  std::array<index_t, 3> kv_extents;
  std::size_t half = own.size() / 2;
  std::array<std::vector<float>, 4> slots{};

  [[nodiscard]] index_t rank() const { return comm.rank(); }
  void load_own_kv(int slot) { slots[static_cast<std::size_t>(slot)] = std::move(own); }
  void post_kv(index_t, const transfer_list& list) {
    for (const ring_transfer& t : list) send(slots[static_cast<std::size_t>(t.send_buffer)], t, false);
  }
  void complete_kv(const ring_transfer& t) { slots[static_cast<std::size_t>(t.receive_buffer)] = receive(t, false); }
  void finish_transfers() {}
  void add_partial(partial& sum, const partial& x) {
    for (std::size_t i = 0; i < x.size(); ++i) sum[i] += x[i];
  }
  void send_partial(const ring_transfer& t, const partial& sum) { send(sum, t, true); }
  partial receive_partial(const ring_transfer& t, std::size_t) { return receive(t, true); }

  void send(const std::vector<float>& x, const ring_transfer& t, bool gradient) {
    comm.send(x.data(), x.size(), t.send_to, ring_message_tag(t, gradient));
  }
  std::vector<float> receive(const ring_transfer& t, bool gradient) {
    std::vector<float> x(2 * half);
    comm.recv(x.data(), x.size(), t.receive_from, ring_message_tag(t, gradient));
    return x;
  }
  tensor_view<const float, 3> k(int slot) const { return {slots[static_cast<std::size_t>(slot)].data(), kv_extents}; }
  tensor_view<const float, 3> v(int slot) const { return {slots[static_cast<std::size_t>(slot)].data() + half, kv_extents}; }
};

/// Every step's index is read by the tile loops as it stands: check its invariants (a hand-built or
/// corrupted step_index read and wrote past its arrays and the tensors).
inline void check_indices(std::span<const step_index> indices) {
  for (const step_index& index : indices) index.validate();
}

}  // namespace detail

/// This rank's ring forward (`tensors`: q, k, v in, out, lse out). q [Sq, Hq, D], k, v [Sk, Hkv, D] are the
/// local shards; indices[s] is this rank's index for step s (see build_ring_indices). Writes out [Sq, Hq, D]
/// and the fp32 lse [Hq, Sq] of the whole sequence's attention for the local queries. With
/// finite_check::every_step the running O and LSE are checked after every step's merge.
template <class Comm, ring_topology Topology, class T>
void ring_forward(Comm& comm, const Topology& topology, std::span<const step_index> indices, const forward_tensors<T>& tensors, double softmax_scale,
                  finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  const auto [q, k, v, out, lse] = tensors;
  const attention_shape s = engine::check_ring_call(topology, comm.world_size(), comm.rank(), indices, q, k);
  detail::check_indices(indices);
  check_extents(out, {s.query_tokens, s.heads_q, s.head_dim}, "out");
  check_extents(lse, {s.heads_q, s.query_tokens}, "lse");

  const std::vector<float> q32 = detail::rows_to_float<T>({q});
  std::vector<float> running_out(q32.size(), 0.0f), part_out(q32.size());
  std::vector<float> running_lse(static_cast<std::size_t>(s.heads_q) * s.query_tokens, -std::numeric_limits<float>::infinity());
  std::vector<float> part_lse(running_lse.size());
  const std::array<index_t, 3> q_extents{s.query_tokens, s.heads_q, s.head_dim};
  const std::array<index_t, 2> lse_extents{s.heads_q, s.query_tokens};
  detail::ring_backend<Comm> backend{comm, detail::rows_to_float<T>({k, v}), {s.kv_tokens, s.heads_kv, s.head_dim}};
  engine::ring_forward(
      backend, topology, check,
      [&](index_t step, int slot) {
        reference_forward<float>(tensor_view<const float, 3>(q32.data(), q_extents), backend.k(slot), backend.v(slot),
                                 indices[static_cast<std::size_t>(step)].view(), softmax_scale, tensor_view<float, 3>(part_out.data(), q_extents),
                                 tensor_view<float, 2>(part_lse.data(), lse_extents));
        merge_partial<float>(tensor_view<float, 3>(running_out.data(), q_extents), tensor_view<float, 2>(running_lse.data(), lse_extents),
                             tensor_view<float, 3>(part_out.data(), q_extents), tensor_view<float, 2>(part_lse.data(), lse_extents));
      },
      [&](index_t step, const std::string& phase) {
        check_finite(std::span<const float>(running_out), checked_tensor::queries("O", s.query_tokens, s.heads_q, s.head_dim), comm.rank(), step,
                     phase);
        check_finite(std::span<const float>(running_lse), checked_tensor::lse(s.heads_q, s.query_tokens), comm.rank(), step, phase);
      });
  detail::rows_from_float(running_out.data(), out);
  for (index_t h = 0; h < s.heads_q; ++h)
    for (index_t t = 0; t < s.query_tokens; ++t) lse(h, t) = running_lse[static_cast<std::size_t>(h * s.query_tokens + t)];
}

/// This rank's ring backward (`tensors`: q, k, v, out, d_out, lse in; dq, dk, dv out). out and lse are the
/// forward results, d_out the incoming gradient (all local shards). Writes dq [Sq, Hq, D] and the complete
/// dk, dv [Sk, Hkv, D] of this rank's own KV chunk, summed in fp32 over all ranks as they travel the ring.
/// With finite_check::every_step, dQ and the step's chunk's dK/dV sum are checked after every step, before
/// that sum travels on.
template <class Comm, ring_topology Topology, class T>
void ring_backward(Comm& comm, const Topology& topology, std::span<const step_index> indices, const backward_tensors<T>& tensors, double softmax_scale,
                   finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  const auto [q, k, v, out, d_out, lse, dq, dk, dv] = tensors;
  const attention_shape s = engine::check_ring_call(topology, comm.world_size(), comm.rank(), indices, q, k);
  detail::check_indices(indices);
  check_backward_tensors(s, out, d_out, lse, dq, dk, dv);

  const std::vector<float> q32 = detail::rows_to_float<T>({q}), out32 = detail::rows_to_float<T>({out}),
                           d_out32 = detail::rows_to_float<T>({d_out});
  std::vector<float> dq32(q32.size(), 0.0f);
  const auto kv_elems = static_cast<std::size_t>(k.size());
  const std::array<index_t, 3> q_extents{s.query_tokens, s.heads_q, s.head_dim}, kv_extents{s.kv_tokens, s.heads_kv, s.head_dim};
  detail::ring_backend<Comm> backend{comm, detail::rows_to_float<T>({k, v}), kv_extents};
  const std::vector<float> own = engine::ring_backward(
      backend, topology, check,
      [&](index_t step, int slot) {
        std::vector<float> working(2 * kv_elems, 0.0f);
        reference_backward<float>(tensor_view<const float, 3>(q32.data(), q_extents), backend.k(slot), backend.v(slot),
                                  tensor_view<const float, 3>(out32.data(), q_extents), tensor_view<const float, 3>(d_out32.data(), q_extents),
                                  lse, indices[static_cast<std::size_t>(step)].view(), softmax_scale, tensor_view<float, 3>(dq32.data(), q_extents),
                                  tensor_view<float, 3>(working.data(), kv_extents), tensor_view<float, 3>(working.data() + kv_elems, kv_extents));
        return working;
      },
      [&](index_t step, const std::string& phase, index_t owner, const std::vector<float>& sum) {
        check_finite(std::span<const float>(dq32), checked_tensor::queries("dQ", s.query_tokens, s.heads_q, s.head_dim), comm.rank(), step, phase);
        for (const auto& [name, half] : {std::pair{"dK", std::span(sum).first(kv_elems)}, std::pair{"dV", std::span(sum).subspan(kv_elems)}})
          check_finite<float>(half, checked_tensor::kv_gradient(name, s.kv_tokens, s.heads_kv, s.head_dim, owner), comm.rank(), step, phase);
      });
  detail::rows_from_float(own.data(), dk);
  detail::rows_from_float(own.data() + kv_elems, dv);
  detail::rows_from_float(dq32.data(), dq);
}

}  // namespace stria::host
