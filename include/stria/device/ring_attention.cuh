// SPDX-License-Identifier: Apache-2.0
// Device ring attention: one rank's part of the distributed sparse forward and backward, on a
// device communicator (comm::local_device; comm::nccl has the same surface). Each step runs the
// sparse kernels on that step's local index while the next KV chunk is in flight on the rank's
// transfer stream; events order the two streams, so a chunk is computed with only once it has
// arrived and a slot is overwritten only once the steps that read it are done. Running O/LSE are
// fp32; in backward the fp32 dK/dV partials travel as the topology's gradient_transfers say and end
// at their owners. host/ring_attention.hpp is the same algorithm on the host (the tests' oracle).
// Checked mode (finite_check::every_step) verifies each step's results on the device
// (device/finite_check.cuh) at the cost of a pass and a host synchronisation per step.
#pragma once

#include <cuda_runtime_api.h>
#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/transform.h>

#include <array>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/error.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/device/finite_check.cuh"
#include "stria/device/sparse_attention_step.cuh"
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

/// A transfer's completion on the transfer stream: the compute stream waits for it before
/// `ready_step` computes, and the host confirms it (comm.wait) at the start of the step after, a
/// step behind the device, so the device always holds queued work while the host waits.
struct arrival {
  index_t ready_step;
  cuda_event done;
  std::string what;  // for the error of a wait that gives up
};

/// The KV chunks of one rank's ring: K and V packed in one buffer per slot ([2, Sk, Hkv, D], so a
/// transfer is one message), moved as the topology's transfers say. Sends and receives of a step
/// are posted together in one group at the step's start, on the transfer stream. Every transfer is
/// confirmed on the host through comm.wait(), which raises (a peer failed, NCCL reported an error,
/// the communicator's timeout passed) instead of letting a dead peer hang the job; the backward adds
/// its dK/dV transfers to the same confirmations (watch()).
template <class Comm, ring_topology Topology, class T>
class kv_ring {
 public:
  kv_ring(Comm& comm, const Topology& topology, tensor_view<const T, 3> k, tensor_view<const T, 3> v, cudaStream_t compute,
          cudaStream_t transfer)
      : comm_(comm), topology_(topology), elements_(static_cast<std::size_t>(k.size())), compute_(compute), transfer_(transfer) {
    T* own = slot(topology.kv_buffer(comm.rank(), 0));
    STRIA_CUDA_CHECK(cudaMemcpyAsync(own, k.data(), elements_ * sizeof(T), cudaMemcpyDeviceToDevice, compute));
    STRIA_CUDA_CHECK(cudaMemcpyAsync(own + elements_, v.data(), elements_ * sizeof(T), cudaMemcpyDeviceToDevice, compute));
  }

  /// Posts this step's transfers, makes the compute stream wait for the chunks due now, and
  /// returns the chunk this step computes with.
  const T* begin_step(index_t step) {
    const index_t rank = comm_.rank();
    const transfer_list list = topology_.transfers(rank, step);
    if (list.count > 0) {
      for (const ring_transfer& t : list) (void)slot(t.receive_buffer);  // allocated in compute order
      // Sends read chunks the compute stream put in place; receives overwrite slots earlier steps read.
      wait_for(transfer_, compute_);
      comm_.group_start();
      for (const ring_transfer& t : list) {
        comm_.send(slot(t.send_buffer), 2 * elements_, t.send_to, transfer_, ring_message_tag(t, false));
        comm_.recv(slot(t.receive_buffer), 2 * elements_, t.receive_from, transfer_, ring_message_tag(t, false));
      }
      comm_.group_end();
      for (const ring_transfer& t : list) {
        arrivals_.push_back({t.ready_step, cuda_event{},
                             "the KV chunk of rank " + std::to_string(t.received_origin) + " for ring step " + std::to_string(t.ready_step) +
                                 " (from rank " + std::to_string(t.receive_from) + ")"});
        arrivals_.back().done.record(transfer_);
      }
    }
    wait_arrivals(step);
    confirm_before(step);
    return slot(topology_.kv_buffer(rank, step));
  }

  /// Confirms on the host, like the KV transfers, what is queued on the transfer stream now (a
  /// transfer just posted), at the start of the step after `ready_step`.
  void watch(index_t ready_step, std::string what) {
    confirming_.push_back({ready_step, cuda_event{}, std::move(what)});
    confirming_.back().done.record(transfer_);
  }

  [[nodiscard]] std::size_t elements() const { return elements_; }

  /// After the last step: nothing in flight is left behind, and the slots may be released in
  /// compute order.
  void finish() {
    wait_arrivals(topology_.num_steps());
    confirm_before(topology_.num_steps() + 1);
    wait_for(compute_, transfer_);
  }

 private:
  T* slot(int i) {
    device_buffer<T>& s = slots_[static_cast<std::size_t>(i)];
    if (s.size() == 0) s = device_buffer<T>(2 * elements_, compute_);
    return s.data();
  }

  void wait_arrivals(index_t step) {
    for (auto it = arrivals_.begin(); it != arrivals_.end();) {
      if (it->ready_step > step) {
        ++it;
        continue;
      }
      it->done.make_wait(compute_);
      confirming_.push_back(std::move(*it));
      it = arrivals_.erase(it);
    }
  }

  /// Waits on the host (bounded: comm.wait) for every watched transfer due before `step`.
  void confirm_before(index_t step) {
    for (auto it = confirming_.begin(); it != confirming_.end();) {
      if (it->ready_step >= step) {
        ++it;
        continue;
      }
      comm_.wait(it->done.get(), it->what);
      it = confirming_.erase(it);
    }
  }

  Comm& comm_;
  const Topology& topology_;
  std::size_t elements_;
  cudaStream_t compute_, transfer_;
  std::array<device_buffer<T>, 4> slots_;
  transfers_before_release guard_{compute_, transfer_};  // destroyed before the slots
  std::vector<arrival> arrivals_;    // posted, not yet awaited by the compute stream
  std::vector<arrival> confirming_;  // awaited by the compute stream (or watched), not yet confirmed on the host
};

/// x[i] += y[i] for n floats, on `stream`.
inline void add_into(float* x, const float* y, std::size_t n, cudaStream_t stream) {
  thrust::transform(thrust::cuda::par.on(stream), x, x + n, y, x, thrust::plus<float>());
}

}  // namespace detail

/// This rank's ring forward on `stream` (the transfers run on `transfer_stream`, which the call
/// leaves with nothing pending past its end). q [Sq, Hq, D], k, v [Sk, Hkv, D] are the local
/// shards (bf16 or fp16, device); indices[s] is this rank's index for step s. Writes out
/// [Sq, Hq, D] and the fp32 lse [Hq, Sq] of the whole sequence's attention for the local queries.
/// With finite_check::every_step the merged O (the last step: `out` itself) and LSE are checked
/// after every step.
template <index_t HeadDim = any_head_dim, class Comm, ring_topology Topology, class T>
void ring_forward(Comm& comm, const Topology& topology, std::span<const device_step_index> indices, tensor_view<const T, 3> q,
                  tensor_view<const T, 3> k, tensor_view<const T, 3> v, double softmax_scale, tensor_view<T, 3> out,
                  tensor_view<float, 2> lse, cudaStream_t stream, cudaStream_t transfer_stream,
                  forward_kernel which = forward_kernel::automatic, finite_check check = finite_check::off) {
  static_assert(check_device_communicator<Comm>());
  check_ring_world(comm.world_size(), topology);
  check_ring_indices(topology, comm.rank(), indices);
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  detail::check_head_dim<HeadDim>(shape.head_dim);  // before any transfer or launch
  check_extents(out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "out");
  device_buffer<float> running(static_cast<std::size_t>(q.size()), stream);  // [Sq, Hq, D] fp32
  const tensor_view<float, 3> running_view(running.data(), {shape.query_tokens, shape.heads_q, shape.head_dim});
  std::optional<step_check> checks;
  if (check == finite_check::every_step) checks.emplace(stream);
  detail::kv_ring<Comm, Topology, T> ring(comm, topology, k, v, stream, transfer_stream);
  for (index_t s = 0; s < topology.num_steps(); ++s) {
    const T* chunk = ring.begin_step(s);
    const tensor_view<const T, 3> k_step(chunk, {shape.kv_tokens, shape.heads_kv, shape.head_dim});
    const tensor_view<const T, 3> v_step(chunk + ring.elements(), {shape.kv_tokens, shape.heads_kv, shape.head_dim});
    // The last step writes `out` itself (rounded to T), so the running output needs no final pass.
    const bool last = s + 1 == topology.num_steps();
    sparse_forward<T, HeadDim>(indices[static_cast<std::size_t>(s)], q, k_step, v_step, softmax_scale, running_view, lse,
                               s == 0 ? running_state::overwrite : running_state::merge, stream, which, last ? out : tensor_view<T, 3>{});
    if (checks) {
      checks->begin();
      const checked_tensor o = checked_tensor::queries("O", shape.query_tokens, shape.heads_q, shape.head_dim);
      if (last) checks->add(out.data(), o);
      else checks->add(running.data(), o);
      checks->add(lse.data(), checked_tensor::lse(shape.heads_q, shape.query_tokens));
      checks->finish(comm.rank(), s, "ring step " + std::to_string(s));
    }
  }
  ring.finish();
}

/// This rank's ring backward on `stream` (transfers on `transfer_stream`). out and lse are the
/// forward results, d_out the incoming gradient (local shards). Writes dq [Sq, Hq, D] and the
/// complete dk, dv [Sk, Hkv, D] of this rank's own KV chunk, summed in fp32 as they travel. With
/// finite_check::every_step, dQ and the step's chunk's dK/dV sum are checked after every step,
/// before that sum travels on.
template <index_t HeadDim = any_head_dim, class Comm, ring_topology Topology, class T>
void ring_backward(Comm& comm, const Topology& topology, std::span<const device_step_index> indices, tensor_view<const T, 3> q,
                   tensor_view<const T, 3> k, tensor_view<const T, 3> v, tensor_view<const T, 3> out, tensor_view<const T, 3> d_out,
                   tensor_view<const float, 2> lse, double softmax_scale, tensor_view<T, 3> dq, tensor_view<T, 3> dk,
                   tensor_view<T, 3> dv, determinism mode, cudaStream_t stream, cudaStream_t transfer_stream,
                   finite_check check = finite_check::off) {
  static_assert(check_device_communicator<Comm>());
  check_ring_world(comm.world_size(), topology);
  const index_t rank = comm.rank();
  check_ring_indices(topology, rank, indices);
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  detail::check_head_dim<HeadDim>(shape.head_dim);  // before any transfer or launch
  check_extents(dq, {shape.query_tokens, shape.heads_q, shape.head_dim}, "dq");
  check_extents(dk, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "dk");
  check_extents(dv, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "dv");
  const std::array<index_t, 3> q_extents{shape.query_tokens, shape.heads_q, shape.head_dim};
  const std::array<index_t, 3> kv_extents{shape.kv_tokens, shape.heads_kv, shape.head_dim};
  const auto kv_elems = static_cast<std::size_t>(k.size());

  // The last step writes dQ out in T (dq32 + its own), and a single step needs no fp32 dQ at all;
  // with per-step checks, which read dq32 after every step, dQ is cast at the end instead.
  const index_t steps = topology.num_steps();
  const bool dq_out_by_last_step = check == finite_check::off;
  const bool dq32_needed = steps > 1 || !dq_out_by_last_step;
  device_buffer<float> delta(static_cast<std::size_t>(shape.heads_q) * shape.query_tokens, stream),
      dq32(dq32_needed ? static_cast<std::size_t>(q.size()) : 0, stream);
  backward_delta(out, d_out, tensor_view<float, 2>(delta.data(), {shape.heads_q, shape.query_tokens}), stream);
  if (dq32_needed) dq32.fill_bytes(0, stream);

  // The travelling fp32 partial sums ([2, Sk, Hkv, D]: dK then dV), keyed by the chunk's owner.
  // Buffers that were sent stay alive until the end (their sends may still be reading them).
  std::map<index_t, device_buffer<float>> partial;
  std::vector<device_buffer<float>> sent;
  struct incoming {
    ring_transfer transfer;
    device_buffer<float> data;
    cuda_event done;
  };
  std::vector<incoming> pending;
  auto add_partial = [&](index_t origin, device_buffer<float> x) {  // x is read in compute order only
    if (auto it = partial.find(origin); it != partial.end()) detail::add_into(it->second.data(), x.data(), x.size(), stream);
    else partial.emplace(origin, std::move(x));
  };
  auto finish_receives = [&](index_t step) {  // the gradient receives due by the end of `step`
    for (auto it = pending.begin(); it != pending.end();) {
      if (it->transfer.ready_step > step) {
        ++it;
        continue;
      }
      it->done.make_wait(stream);
      add_partial(it->transfer.received_origin, std::move(it->data));
      it = pending.erase(it);
    }
  };

  std::optional<step_check> checks;
  if (check == finite_check::every_step) checks.emplace(stream);
  detail::kv_ring<Comm, Topology, T> ring(comm, topology, k, v, stream, transfer_stream);
  for (index_t s = 0; s < steps; ++s) {
    const T* chunk = ring.begin_step(s);
    device_buffer<float> working(2 * kv_elems, stream);
    working.fill_bytes(0, stream);
    const bool last = s + 1 == steps;
    sparse_backward<T, HeadDim>(indices[static_cast<std::size_t>(s)], q, tensor_view<const T, 3>(chunk, kv_extents),
                                tensor_view<const T, 3>(chunk + kv_elems, kv_extents), d_out, lse,
                                tensor_view<const float, 2>(delta.data(), {shape.heads_q, shape.query_tokens}), softmax_scale,
                                tensor_view<float, 3>(dq32.data(), q_extents), tensor_view<float, 3>(working.data(), kv_extents),
                                tensor_view<float, 3>(working.data() + kv_elems, kv_extents), mode, stream, backward_kernel::automatic,
                                dq_source::automatic, 0, last && dq_out_by_last_step ? dq.data() : nullptr);
    const index_t source = topology.kv_source_rank(rank, s);
    add_partial(source, std::move(working));
    if (checks) {
      checks->begin();
      checks->add(dq32.data(), checked_tensor::queries("dQ", shape.query_tokens, shape.heads_q, shape.head_dim));
      const float* sum = partial.at(source).data();
      checks->add(sum, checked_tensor::kv_gradient("dK", shape.kv_tokens, shape.heads_kv, shape.head_dim, source));
      checks->add(sum + kv_elems, checked_tensor::kv_gradient("dV", shape.kv_tokens, shape.heads_kv, shape.head_dim, source));
      checks->finish(rank, s, "ring step " + std::to_string(s));
    }
    // In list order; before each send, every partial due at this step's end is added in.
    for (const ring_transfer& t : topology.gradient_transfers(rank, s)) {
      finish_receives(s);
      auto it = partial.find(t.sent_origin);
      if (it == partial.end())
        throw gradient_schedule_error(rank, "has no dK/dV partial of rank " + std::to_string(t.sent_origin) + "'s chunk to send at step " +
                                                std::to_string(s));
      device_buffer<float> into(2 * kv_elems, stream);
      wait_for(transfer_stream, stream);  // the partial is complete; `into` is allocated
      comm.group_start();
      comm.send(it->second.data(), it->second.size(), t.send_to, transfer_stream, ring_message_tag(t, true));
      comm.recv(into.data(), into.size(), t.receive_from, transfer_stream, ring_message_tag(t, true));
      comm.group_end();
      pending.push_back({t, std::move(into), cuda_event{}});
      pending.back().done.record(transfer_stream);
      ring.watch(t.ready_step, "the dK/dV sum of rank " + std::to_string(t.received_origin) + "'s chunk " +
                                   (t.ready_step == topology.num_steps() ? std::string("delivered after the last ring step")
                                                                         : "due at the end of ring step " + std::to_string(t.ready_step)) +
                                   " (from rank " + std::to_string(t.receive_from) + ")");
      sent.push_back(std::move(it->second));
      partial.erase(it);
    }
    finish_receives(s);
  }
  ring.finish();
  finish_receives(steps);
  wait_for(stream, transfer_stream);  // every send is done before `sent` is released in compute order
  if (partial.size() != 1 || partial.begin()->first != rank)
    throw gradient_schedule_error(rank, "ended the backward ring without exactly its own dK/dV");
  const float* own = partial.begin()->second.data();
  if (!dq_out_by_last_step) write_output(tensor_view<const float, 3>(dq32.data(), q_extents), dq, stream);
  write_output(tensor_view<const float, 3>(own, kv_extents), dk, stream);
  write_output(tensor_view<const float, 3>(own + kv_elems, kv_extents), dv, stream);
}

}  // namespace stria::device
