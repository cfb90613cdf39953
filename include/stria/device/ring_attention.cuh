// SPDX-License-Identifier: Apache-2.0
// Device ring attention: the ring engine (engine/ring_engine.hpp) on a device communicator
// (comm::local_device, comm::nccl), each step the sparse kernels on that step's local index while the
// next KV chunk is in flight on the rank's transfer stream; running O/LSE and travelling dK/dV are
// fp32. Checked mode (finite_check::every_step) verifies each step's results on the device
// (device/finite_check.cuh) at the cost of a pass and a host synchronisation per step.
#pragma once

#include <cuda_runtime_api.h>
#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/transform.h>

#include <algorithm>
#include <array>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/attention_tensors.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/device/finite_check.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/engine/ring_engine.hpp"
#include "stria/index/device_index.cuh"
#include "stria/topology/ring_steps.hpp"

namespace stria::device {

namespace detail {

/// However a function ends (an exception included), buffers released in compute order after this
/// guard is destroyed are released only after the transfers queued by then: a peer may still be
/// copying from or into them (a failed step leaves transfers in flight).
class transfers_before_release {
 public:
  transfers_before_release(cudaStream_t compute, cudaStream_t transfer) : compute_(compute), transfer_(transfer) {}
  ~transfers_before_release() {
    cudaEvent_t done = nullptr;
    if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) return;
    if (cudaEventRecord(done, transfer_) == cudaSuccess) (void)cudaStreamWaitEvent(compute_, done, 0);
    (void)cudaEventDestroy(done);
  }
  transfers_before_release(const transfers_before_release&) = delete;
  transfers_before_release& operator=(const transfers_before_release&) = delete;

 private:
  cudaStream_t compute_, transfer_;
};

/// The kernels' rule for K and V, checked before anything is queued: with one step they read the
/// caller's tensors, with more the copies in the slots, and the rule is the same either way.
template <class T>
void check_kv_layout(tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
  check_layout(k, "k", 16);
  check_layout(v, "v", 16);
}

/// x[i] += y[i] for n floats, queued on `stream` (thrust's `par` would also make the host wait for it).
inline void add_into(float* x, const float* y, std::size_t n, cudaStream_t stream) {
  thrust::transform(thrust::cuda::par_nosync.on(stream), x, x + n, y, x, thrust::plus<float>());
}

/// The device backend of the ring engine. A KV chunk ([2, Sk, Hkv, D]: K then V) and a dK/dV
/// partial are one message each; the slots are allocated in compute order when first used. A
/// step's transfers are posted in one group on the transfer stream. Every transfer is confirmed on
/// the host through comm.wait(), which raises (a peer failed, NCCL reported an error, the
/// communicator's timeout passed) instead of letting a dead peer hang the job, at the start of the
/// step after its ready step: a step behind the device, so the device holds queued work meanwhile.
template <class Comm, class T>
class ring_backend {
 public:
  using partial = device_buffer<float>;

  ring_backend(Comm& comm, index_t steps, tensor_view<const T, 3> k, tensor_view<const T, 3> v, cudaStream_t compute, cudaStream_t transfer)
      : comm_(comm), steps_(steps), k_(k), v_(v), compute_(compute), transfer_(transfer) {}

  [[nodiscard]] index_t rank() const { return comm_.rank(); }
  /// A chunk that travels is one message (K then V) in a slot. With one step nothing travels, and
  /// the kernels read K and V where they lie (the copy cost 1% of a 128K forward).
  void load_own_kv(int i) {
    if (steps_ == 1) {
      own_in_place_ = i;
      return;
    }
    STRIA_CUDA_CHECK(cudaMemcpyAsync(slot(i), k_.data(), elements() * sizeof(T), cudaMemcpyDeviceToDevice, compute_));
    STRIA_CUDA_CHECK(cudaMemcpyAsync(slot(i) + elements(), v_.data(), elements() * sizeof(T), cudaMemcpyDeviceToDevice, compute_));
  }
  void post_kv(index_t step, const transfer_list& list) {
    if (list.count > 0) {
      if (own_in_place_ >= 0)
        throw invalid_argument("topology", "a transfer in a one-step ring", "a ring of one step has nothing to send or receive");
      for (const ring_transfer& t : list) (void)slot(t.receive_buffer);  // allocated in compute order
      // Sends read chunks the compute stream put in place; receives overwrite slots earlier steps read.
      wait_for(transfer_, compute_);
      comm_.group_start();
      for (const ring_transfer& t : list) {
        comm_.send(slot(t.send_buffer), 2 * elements(), t.send_to, transfer_, ring_message_tag(t, false));
        comm_.recv(slot(t.receive_buffer), 2 * elements(), t.receive_from, transfer_, ring_message_tag(t, false));
      }
      comm_.group_end();
      for (const ring_transfer& t : list)  // a slot has one receive in flight at a time
        arriving_[static_cast<std::size_t>(t.receive_buffer)].emplace(t.ready_step, "the KV chunk of rank " + std::to_string(t.received_origin) +
                                                                      " for ring step " + std::to_string(t.ready_step) + " (from rank " +
                                                                      std::to_string(t.receive_from) + ")", transfer_);
    }
    confirm_before(step);
  }
  void complete_kv(const ring_transfer& t) {
    arrival& a = *arriving_[static_cast<std::size_t>(t.receive_buffer)];
    a.done.make_wait(compute_);
    confirming_.push_back(std::move(a));
  }
  void finish_transfers() {
    confirm_before(steps_ + 1);
    wait_for(compute_, transfer_);
  }
  void add_partial(partial& sum, const partial& x) { add_into(sum.data(), x.data(), x.size(), compute_); }  // x: read in compute order
  void send_partial(const ring_transfer& t, partial sum) {
    const partial& sending = sent_.emplace_back(std::move(sum));  // kept to the end: the send may still read it
    auto& [into, done] = receiving_.emplace_back(partial(sending.size(), compute_), cuda_event{});
    wait_for(transfer_, compute_);  // the partial is complete; `into` is allocated
    comm_.group_start();
    comm_.send(sending.data(), sending.size(), t.send_to, transfer_, ring_message_tag(t, true));
    comm_.recv(into.data(), into.size(), t.receive_from, transfer_, ring_message_tag(t, true));
    comm_.group_end();
    done.record(transfer_);
    const std::string when = t.ready_step == steps_ ? std::string("delivered after the last ring step")
                                                    : "due at the end of ring step " + std::to_string(t.ready_step);
    confirming_.emplace_back(t.ready_step, "the dK/dV sum of rank " + std::to_string(t.received_origin) + "'s chunk " + when + " (from rank " +
                                               std::to_string(t.receive_from) + ")", transfer_);
  }
  partial receive_partial(const ring_transfer&, std::size_t n) {
    receiving_[n].second.make_wait(compute_);
    return std::move(receiving_[n].first);
  }

  [[nodiscard]] std::size_t elements() const { return static_cast<std::size_t>(k_.size()); }  // of K (and of V)
  tensor_view<const T, 3> k(int i) { return i == own_in_place_ ? k_ : tensor_view<const T, 3>{slot(i), {k_.extent(0), k_.extent(1), k_.extent(2)}}; }
  tensor_view<const T, 3> v(int i) {
    return i == own_in_place_ ? v_ : tensor_view<const T, 3>{slot(i) + elements(), {k_.extent(0), k_.extent(1), k_.extent(2)}};
  }

 private:
  struct arrival {  // a transfer's completion: the work queued on `stream` when it is made
    arrival(index_t ready, std::string message, cudaStream_t stream) : ready_step(ready), what(std::move(message)) { done.record(stream); }
    index_t ready_step;
    std::string what;  // for the error of a wait that gives up
    cuda_event done;
  };
  void confirm_before(index_t step) {  // the host waits (bounded: comm.wait) for every transfer due before `step`
    const auto due = std::stable_partition(confirming_.begin(), confirming_.end(), [&](const arrival& a) { return a.ready_step >= step; });
    for (auto it = due; it != confirming_.end(); ++it) comm_.wait(it->done.get(), it->what);
    confirming_.erase(due, confirming_.end());
  }
  T* slot(int i) {
    device_buffer<T>& s = slots_[static_cast<std::size_t>(i)];
    if (s.size() == 0) s = device_buffer<T>(2 * elements(), compute_);
    return s.data();
  }

  Comm& comm_;
  index_t steps_;
  tensor_view<const T, 3> k_, v_;
  cudaStream_t compute_, transfer_;
  std::array<device_buffer<T>, 4> slots_;
  int own_in_place_ = -1;  // the slot whose chunk is read from k_ and v_ (one step), or -1
  std::array<std::optional<arrival>, 4> arriving_;  // per slot: posted, not yet awaited by the compute stream
  std::vector<arrival> confirming_;                 // awaited by the compute stream (or a gradient's), not yet confirmed on the host
  std::vector<partial> sent_;
  std::vector<std::pair<partial, cuda_event>> receiving_;
  transfers_before_release guard_{compute_, transfer_};  // destroyed first: before every buffer
};

}  // namespace detail

/// Where a ring or solver call runs: its kernels on `stream`, its transfers on `transfer_stream`
/// (left with nothing pending past the call), and whether each step's results are checked for
/// NaN and infinity (finite_check::every_step) before they travel on.
struct run_options {
  cudaStream_t stream = nullptr;
  cudaStream_t transfer_stream = nullptr;
  finite_check check = finite_check::off;
};

/// This rank's ring forward (`tensors`: q, k, v in, out, lse out). q [Sq, Hq, D], k, v [Sk, Hkv, D] are the
/// local shards (bf16 or fp16, device); indices[s] is this rank's index for step s. Writes out [Sq, Hq, D]
/// and the fp32 lse [Hq, Sq] of the whole sequence's attention for the local queries. With
/// finite_check::every_step the merged O (the last step: `out` itself) and LSE are checked after every step.
template <index_t HeadDim = any_head_dim, class Comm, ring_topology Topology, class T>
void ring_forward(Comm& comm, const Topology& topology, std::span<const device_step_index> indices, const forward_tensors<T>& tensors,
                  double softmax_scale, run_options run, forward_kernel which = forward_kernel::automatic) {
  const auto [q, k, v, out, lse] = tensors;
  const auto [stream, transfer_stream, check] = run;
  static_assert(check_device_communicator<Comm>());
  const attention_shape s = engine::check_ring_call(topology, comm.world_size(), comm.rank(), indices, q, k);
  detail::check_head_dim<HeadDim>(s.head_dim);  // before any transfer or launch
  detail::check_kv_layout(k, v);
  check_extents(out, {s.query_tokens, s.heads_q, s.head_dim}, "out");
  // A step whose index is not complete would reject it mid-ring, on one rank, with transfers posted.
  if (which == forward_kernel::wgmma_paired)
    throw invalid_argument("which", "forward_kernel::wgmma_paired",
                           "names one step's kernel; a ring takes automatic (which pairs the steps whose index is complete), mma_sync or wgmma");
  const index_t steps = topology.num_steps();
  // [Sq, Hq, D] fp32; a single step writes `out` directly and needs none.
  device_buffer<float> running(steps > 1 ? static_cast<std::size_t>(q.size()) : 0, stream);
  std::optional<step_check> checks;
  if (check == finite_check::every_step) checks.emplace(stream);
  detail::ring_backend<Comm, T> backend(comm, steps, k, v, stream, transfer_stream);
  engine::ring_forward(
      backend, topology, check,
      [&](index_t step, int slot) {  // the last step writes `out` itself (rounded to T): the running output needs no final pass
        const step_forward_tensors<T> operands{.q = q,
                                               .k = backend.k(slot),
                                               .v = backend.v(slot),
                                               .out = tensor_view<float, 3>(running.data(), {s.query_tokens, s.heads_q, s.head_dim}),
                                               .lse = lse,
                                               .final_out = step + 1 == steps ? out : tensor_view<T, 3>{}};
        sparse_forward<T, HeadDim>(indices[static_cast<std::size_t>(step)], operands, softmax_scale, stream,
                                   {.state = step == 0 ? running_state::overwrite : running_state::merge, .which = which});
      },
      [&](index_t step, const std::string& phase) {
        checks->begin();
        const checked_tensor o = checked_tensor::queries("O", s.query_tokens, s.heads_q, s.head_dim);
        if (step + 1 == steps) checks->add(out.data(), o);
        else checks->add(running.data(), o);
        checks->add(lse.data(), checked_tensor::lse(s.heads_q, s.query_tokens));
        checks->finish(comm.rank(), step, phase);
      });
}

/// This rank's ring backward (`tensors`: q, k, v, out, d_out, lse in; dq, dk, dv out). out and lse are the
/// forward's results, d_out the incoming gradient (local shards). Writes dq [Sq, Hq, D] and the complete dk,
/// dv [Sk, Hkv, D] of this rank's own KV chunk, summed in fp32 as they travel. With finite_check::every_step,
/// dQ and the step's chunk's dK/dV sum are checked after every step, before that sum travels on.
template <index_t HeadDim = any_head_dim, class Comm, ring_topology Topology, class T>
void ring_backward(Comm& comm, const Topology& topology, std::span<const device_step_index> indices, const backward_tensors<T>& tensors,
                   double softmax_scale, determinism mode, run_options run) {
  const auto [q, k, v, out, d_out, lse, dq, dk, dv] = tensors;
  const auto [stream, transfer_stream, check] = run;
  static_assert(check_device_communicator<Comm>());
  const attention_shape s = engine::check_ring_call(topology, comm.world_size(), comm.rank(), indices, q, k);
  detail::check_head_dim<HeadDim>(s.head_dim);  // before any transfer or launch
  detail::check_kv_layout(k, v);
  check_extents(dq, {s.query_tokens, s.heads_q, s.head_dim}, "dq");
  check_extents(dk, {s.kv_tokens, s.heads_kv, s.head_dim}, "dk");
  check_extents(dv, {s.kv_tokens, s.heads_kv, s.head_dim}, "dv");
  const std::array<index_t, 3> q_extents{s.query_tokens, s.heads_q, s.head_dim}, kv_extents{s.kv_tokens, s.heads_kv, s.head_dim};
  const auto kv_elems = static_cast<std::size_t>(k.size());

  // The last step writes dQ out in T (dq32 + its own), and a single step needs no fp32 dQ at all;
  // with per-step checks, which read dq32 after every step, dQ is cast at the end instead.
  const index_t steps = topology.num_steps();
  const bool dq_out_by_last_step = check == finite_check::off;
  const bool dq32_needed = steps > 1 || !dq_out_by_last_step;
  device_buffer<float> delta(static_cast<std::size_t>(s.heads_q) * s.query_tokens, stream),
      dq32(dq32_needed ? static_cast<std::size_t>(q.size()) : 0, stream);
  const tensor_view<float, 2> delta_view(delta.data(), {s.heads_q, s.query_tokens});
  backward_delta(out, d_out, delta_view, stream);
  if (dq32_needed) dq32.fill_bytes(0, stream);
  std::optional<step_check> checks;
  if (check == finite_check::every_step) checks.emplace(stream);
  detail::ring_backend<Comm, T> backend(comm, steps, k, v, stream, transfer_stream);
  const device_buffer<float> own = engine::ring_backward(
      backend, topology, check,
      [&](index_t step, int slot) {
        device_buffer<float> working(2 * kv_elems, stream);
        working.fill_bytes(0, stream);
        const step_backward_tensors<T> operands{.q = q,
                                                .k = backend.k(slot),
                                                .v = backend.v(slot),
                                                .d_out = d_out,
                                                .lse = lse,
                                                .delta = delta_view,
                                                .dq = tensor_view<float, 3>(dq32.data(), q_extents),
                                                .dk = tensor_view<float, 3>(working.data(), kv_extents),
                                                .dv = tensor_view<float, 3>(working.data() + kv_elems, kv_extents),
                                                .dq_out = step + 1 == steps && dq_out_by_last_step ? dq.data() : nullptr};
        sparse_backward<T, HeadDim>(indices[static_cast<std::size_t>(step)], operands, softmax_scale, stream, {.mode = mode});
        return working;
      },
      [&](index_t step, const std::string& phase, index_t owner, const device_buffer<float>& sum) {
        checks->begin();
        checks->add(dq32.data(), checked_tensor::queries("dQ", s.query_tokens, s.heads_q, s.head_dim));
        checks->add(sum.data(), checked_tensor::kv_gradient("dK", s.kv_tokens, s.heads_kv, s.head_dim, owner));
        checks->add(sum.data() + kv_elems, checked_tensor::kv_gradient("dV", s.kv_tokens, s.heads_kv, s.head_dim, owner));
        checks->finish(comm.rank(), step, phase);
      });
  if (!dq_out_by_last_step) write_output(tensor_view<const float, 3>(dq32.data(), q_extents), dq, stream);
  write_output(tensor_view<const float, 3>(own.data(), kv_extents), dk, stream);
  write_output(tensor_view<const float, 3>(own.data() + kv_elems, kv_extents), dv, stream);
}

}  // namespace stria::device
