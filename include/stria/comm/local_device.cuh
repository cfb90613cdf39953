// SPDX-License-Identifier: Apache-2.0
// comm::local_device: W ranks on one GPU, one host thread per rank, with the device surface of
// comm::nccl (send/recv in groups, all_gather, all_reduce, broadcast of device buffers, each queued
// on the stream the caller names). Transfers are device copies ordered by events; the host side
// (who sends what to whom, errors, timeouts) is comm::host_threads, whose handle host() also gives
// for collectives of host arrays. wait() confirms device work within the same timeout. For tests,
// and for per-rank timing of multi-rank work on one GPU.
#pragma once

#include <cuda_runtime_api.h>
#include <thrust/execution_policy.h>
#include <thrust/transform.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/core/bounded_wait.cuh"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/error.hpp"

namespace stria::comm {

namespace detail {

/// What a sender tells its receiver: where the bytes are, when they are ready (an event on the
/// sender's stream), and the event the receiver records once its copy is queued.
struct device_transfer {
  const void* data;
  std::size_t bytes;
  cudaEvent_t ready;
  cudaEvent_t done;
};

/// One rank's part of a collective: its buffer and when it is ready.
struct device_contribution {
  const void* data;
  cudaEvent_t ready;
};

/// A rank's two collective events, recorded anew by each collective: `ready` where its stream
/// enters, `done` once its copies are queued. local_device_world owns them, so that none is
/// destroyed with a rank's handle while a peer has yet to queue its wait on it.
struct collective_events {
  cuda_event ready, done;
};

/// Host message tags of a device transfer on user tag `tag` (the descriptor, then the receiver's ack).
constexpr int transfer_tag(int tag) { return 64 + 2 * tag; }
constexpr int ack_tag(int tag) { return 65 + 2 * tag; }

template <class T>
struct reduce_with {
  reduce_op op;
  __host__ __device__ T operator()(T a, T b) const {
    if (op == reduce_op::sum) return a + b;
    if (op == reduce_op::max) return a < b ? b : a;
    return b < a ? b : a;
  }
};

}  // namespace detail

/// One rank's handle. As with NCCL, a send completes only with its matching receive, so sends and
/// receives that depend on each other (a ring step) belong in one group_start()/group_end(); at
/// group_end every send is posted first, then the receives are queued, then the sends complete.
/// Collectives and groups return once their copies are queued on the named streams (the host waits
/// for the peers to arrive, never for the GPU).
class local_device {
 public:
  /// `events`: this rank's collective events, which must outlive every rank's handle (local_device_world keeps them).
  local_device(host_threads& host, int device, detail::collective_events& events) : host_(host), device_(device), events_(events) {}
  local_device(const local_device&) = delete;  // a rank's one handle: its collectives' events are its own
  local_device& operator=(const local_device&) = delete;

  [[nodiscard]] index_t rank() const { return host_.rank(); }
  [[nodiscard]] index_t world_size() const { return host_.world_size(); }
  [[nodiscard]] int device() const { return device_; }
  /// The host-surface handle of the same ranks (collectives of host arrays, e.g. the host estimator's).
  [[nodiscard]] host_threads& host() { return host_; }

  void group_start() { ++group_depth_; }
  void group_end() {
    if (group_depth_ == 0) throw invalid_argument("group_end()", "without group_start()", "calls must pair up");
    if (--group_depth_ > 0) return;
    std::vector<queued> ops;
    ops.swap(queue_);
    std::vector<posted_send> sends;
    for (const queued& op : ops)
      if (op.is_send) sends.push_back(post_send(op));
    for (const queued& op : ops)
      if (!op.is_send) complete_recv(op);
    for (posted_send& s : sends) {  // the receiver queued its copy: later work on our stream follows it
      int ack = 0;
      host_.recv(&ack, 1, s.op.peer, detail::ack_tag(s.op.tag));
      s.done.make_wait(s.op.stream);
    }
  }

  /// Sends `count` elements of device memory to `peer`, read in the order of `stream`.
  template <class T>
  void send(const T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag = 0) {
    detail::check_peer(peer, world_size(), "send");
    enqueue({true, const_cast<T*>(data), count * sizeof(T), peer, stream, tag});
  }

  /// Receives `count` elements from `peer` into device memory, written in the order of `stream`.
  template <class T>
  void recv(T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag = 0) {
    detail::check_peer(peer, world_size(), "recv");
    enqueue({false, data, count * sizeof(T), peer, stream, tag});
  }

  /// recv holds world_size * count elements: rank r's `count` elements at offset r * count.
  template <class T>
  void all_gather(const T* send_data, T* recv_data, std::size_t count, cudaStream_t stream) {
    const std::vector<detail::device_contribution> all = contribute(send_data, stream, "all_gather");
    for (std::size_t r = 0; r < all.size(); ++r) {
      STRIA_CUDA_CHECK(cudaStreamWaitEvent(stream, all[r].ready, 0));
      if (count > 0)
        STRIA_CUDA_CHECK(cudaMemcpyAsync(recv_data + r * count, all[r].data, count * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    }
    finish_collective(stream);
  }

  /// Element-wise reduction in rank order, so every rank gets identical results; send and recv may alias.
  template <class T>
  void all_reduce(const T* send_data, T* recv_data, std::size_t count, reduce_op op, cudaStream_t stream) {
    const std::vector<detail::device_contribution> all = contribute(send_data, stream, "all_reduce");
    device_buffer<T> result(count, stream);
    for (std::size_t r = 0; r < all.size(); ++r) {
      STRIA_CUDA_CHECK(cudaStreamWaitEvent(stream, all[r].ready, 0));
      const T* x = static_cast<const T*>(all[r].data);
      if (count == 0) continue;
      if (r == 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(result.data(), x, count * sizeof(T), cudaMemcpyDeviceToDevice, stream));
      else thrust::transform(thrust::cuda::par_nosync.on(stream), result.data(), result.data() + count, x, result.data(), detail::reduce_with<T>{op});
    }
    finish_collective(stream);  // every rank has read every send buffer: recv may now be written
    if (count > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(recv_data, result.data(), count * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }

  /// Every rank's `data` becomes root's.
  template <class T>
  void broadcast(T* data, std::size_t count, index_t root, cudaStream_t stream) {
    detail::check_peer(root, world_size(), "broadcast root");
    const std::vector<detail::device_contribution> all = contribute(data, stream, "broadcast");
    if (rank() != root && count > 0) {
      STRIA_CUDA_CHECK(cudaStreamWaitEvent(stream, all[static_cast<std::size_t>(root)].ready, 0));
      STRIA_CUDA_CHECK(cudaMemcpyAsync(data, all[static_cast<std::size_t>(root)].data, count * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    }
    finish_collective(stream);
  }

  /// A host-side barrier (it orders no stream).
  void barrier() { host_.barrier(); }

  /// Returns once the work `done` captured (an event on one of this rank's streams, e.g. after a
  /// receive) has completed on the device: how the ring engines confirm a transfer. Raises
  /// comm_error instead of hanging once another rank has failed, or after the world's timeout (a
  /// peer whose stream never reaches its send leaves the copy waiting forever); a timeout fails the
  /// world, so every rank stops waiting at once.
  void wait(cudaEvent_t done, const std::string& what) {
    const stria::detail::poll_result r = stria::detail::poll_event(done, host_.timeout(), [&](auto) { host_.check_peers(what); });
    if (!r.completed)
      throw host_.fail("rank " + std::to_string(rank()) + " timed out after " + std::to_string(host_.timeout().count()) + " ms waiting for " +
                       what + " on the device (the copy never completed: a peer's stream never reached its send)");
  }

 private:
  struct queued {
    bool is_send;
    void* data;
    std::size_t bytes;
    index_t peer;
    cudaStream_t stream;
    int tag;
  };
  struct posted_send {
    queued op;
    cuda_event ready, done;
  };

  void enqueue(const queued& op) {
    if (op.tag < 0) throw invalid_argument("tag", op.tag, "must be >= 0");
    queue_.push_back(op);
    if (group_depth_ == 0) {  // a lone operation is a group of one
      ++group_depth_;
      group_end();
    }
  }

  posted_send post_send(const queued& op) {
    posted_send s{op, {}, {}};
    s.ready.record(op.stream);
    const detail::device_transfer note{op.data, op.bytes, s.ready.get(), s.done.get()};
    host_.send(&note, 1, op.peer, detail::transfer_tag(op.tag));
    return s;
  }

  void complete_recv(const queued& op) {
    detail::device_transfer note{};
    host_.recv(&note, 1, op.peer, detail::transfer_tag(op.tag));
    if (note.bytes != op.bytes)
      throw comm_error("rank " + std::to_string(rank()) + " expected " + std::to_string(op.bytes) + " bytes from rank " +
                       std::to_string(op.peer) + " (tag " + std::to_string(op.tag) + ") but rank " + std::to_string(op.peer) +
                       " sent " + std::to_string(note.bytes));
    STRIA_CUDA_CHECK(cudaStreamWaitEvent(op.stream, note.ready, 0));
    if (op.bytes > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(op.data, note.data, op.bytes, cudaMemcpyDeviceToDevice, op.stream));
    STRIA_CUDA_CHECK(cudaEventRecord(note.done, op.stream));
    const int ack = 1;
    host_.send(&ack, 1, op.peer, detail::ack_tag(op.tag));
  }

  /// Every rank's buffer and readiness, gathered on the host: the first of a collective's two
  /// meetings. Recording `ready` again is safe here: the last collective's second meeting saw every
  /// peer past its waits on the previous record.
  std::vector<detail::device_contribution> contribute(const void* data, cudaStream_t stream, const char* what) {
    if (group_depth_ > 0) throw invalid_argument(what, "inside group_start()/group_end()", "only send and recv may be grouped");
    events_.ready.record(stream);
    const detail::device_contribution mine{data, events_.ready.get()};
    std::vector<detail::device_contribution> all(static_cast<std::size_t>(world_size()));
    host_.all_gather(&mine, all.data(), 1);
    return all;
  }

  /// The second meeting: no rank's stream runs past the collective before every rank's copies are
  /// done (then send buffers may be reused). Recording `done` again is safe: this collective's first
  /// meeting saw every peer past the last one, waits included.
  void finish_collective(cudaStream_t stream) {
    events_.done.record(stream);
    const detail::device_contribution mine{nullptr, events_.done.get()};
    std::vector<detail::device_contribution> all(static_cast<std::size_t>(world_size()));
    host_.all_gather(&mine, all.data(), 1);
    for (const auto& peer : all) STRIA_CUDA_CHECK(cudaStreamWaitEvent(stream, peer.ready, 0));
  }

  host_threads& host_;
  int device_;
  int group_depth_ = 0;
  std::vector<queued> queue_;
  detail::collective_events& events_;
};
static_assert(stria::device_communicator<local_device> && stria::device_collectives<local_device>);

/// W ranks on one GPU. run() starts one thread per rank on `device` and rethrows the first failure
/// (as host_world does); a peer that never arrives raises comm_error after the timeout.
class local_device_world {
 public:
  explicit local_device_world(index_t world_size, int device = stria::detail::current_device(),
                              std::chrono::milliseconds timeout = std::chrono::seconds(300))
      : host_(world_size, timeout), device_(device) {}

  [[nodiscard]] index_t world_size() const { return host_.world_size(); }

  template <class Body>
  void run(Body&& body) {
    // Each rank creates its events on the device; they go only after every rank's thread has ended.
    std::vector<std::optional<detail::collective_events>> events(static_cast<std::size_t>(world_size()));
    host_.run([&](host_threads& h) {
      STRIA_CUDA_CHECK(cudaSetDevice(device_));
      local_device comm(h, device_, events[static_cast<std::size_t>(h.rank())].emplace());
      body(comm);
    });
  }

 private:
  host_world host_;
  int device_;
};

}  // namespace stria::comm
