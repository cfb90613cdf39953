// SPDX-License-Identifier: Apache-2.0
// comm::nccl: one rank of an NCCL communicator with the device surface the ring engines use
// (send/recv in groups, all_gather, all_reduce, broadcast of device buffers on a named stream), as
// comm::local_device offers on one GPU. Wraps a user's ncclComm_t (not owned: the training code
// that made it keeps it) or owns one it created; split() gives sub-communicators (ncclCommSplit),
// and nccl_hierarchy puts a hierarchical ring's inner and outer links on separate ones (DESIGN 5).
// wait() confirms NCCL work within a timeout (nccl_options): a failed or stuck peer aborts the
// communicator with an error instead of hanging the job.
// Bootstrap helpers for examples and tests:
// every local GPU from one process (ncclCommInitAll), or one process per GPU with the unique id
// passed through a shared file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/core/bounded_wait.cuh"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/error.hpp"
#include "stria/core/nccl_check.cuh"
#include "stria/core/pinned_buffer.cuh"
#include "stria/topology/ring_steps.hpp"

namespace stria::comm {

namespace detail {

template <class T>
constexpr ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  else if constexpr (std::is_same_v<T, __half>) return ncclFloat16;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return ncclBfloat16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return ncclUint64;
  else return ncclUint8;  // bytes, and any other trivially copyable type as bytes (send/recv only)
}

template <class T>
constexpr std::size_t nccl_count(std::size_t count) {
  return nccl_type<T>() == ncclUint8 ? count * sizeof(T) : count;
}

constexpr ncclRedOp_t nccl_op(reduce_op op) { return op == reduce_op::sum ? ncclSum : op == reduce_op::max ? ncclMax : ncclMin; }

}  // namespace detail

class nccl;

/// Settings of a comm::nccl rank.
struct nccl_options {
  /// How long wait() lets NCCL work run without completing before it aborts the communicator
  /// (ncclCommAbort) and raises stria::nccl_error: a failed or stuck peer then ends the job with an
  /// error instead of a hang. Must be positive; the default leaves room for any training step.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);

  void validate() const {
    if (timeout.count() <= 0) throw invalid_argument("nccl_options.timeout (ms)", timeout.count(), "must be positive");
  }
};

/// Collectives of host arrays over an NCCL communicator (for host-side code such as the host estimator):
/// each goes through a device staging buffer on the communicator's own stream and returns with the
/// result on the host. Each is confirmed through the communicator's bounded wait() before its
/// result is read back, so a failed or stuck peer raises nccl_error instead of hanging the rank.
/// The host side is page-locked (pinned_buffer): the copies are DMA, and the result's copy back is
/// queued behind the collective, so one wait covers both.
class nccl_host_surface {
 public:
  explicit nccl_host_surface(nccl& owner) : owner_(&owner) {}
  [[nodiscard]] index_t rank() const;
  [[nodiscard]] index_t world_size() const;
  template <class T>
  void broadcast(T* data, std::size_t count, index_t root);
  template <class T>
  void all_reduce(const T* send_data, T* recv_data, std::size_t count, reduce_op op);
  template <class T>
  void all_gather(const T* send_data, T* recv_data, std::size_t count);
  void barrier();

 private:
  /// nccl::wait() for the collective just queued on the communicator's own stream.
  void confirm(const std::string& what);

  nccl* owner_;
};
static_assert(stria::host_collectives<nccl_host_surface>);

class nccl {
 public:
  /// Wraps the user's communicator; it stays theirs (never destroyed here, but aborted by a wait()
  /// that times out: see wait()).
  static nccl wrap(ncclComm_t comm, nccl_options options = {}) {
    options.validate();
    return nccl(comm, false, options);
  }

  /// Creates (and owns) rank `rank` of `world_size` from the unique id rank 0 made, on the current device.
  static nccl create(const ncclUniqueId& id, index_t world_size, index_t rank, nccl_options options = {}) {
    options.validate();
    if (world_size < 1) throw invalid_argument("world_size", world_size, "must be at least 1");
    if (rank < 0 || rank >= world_size)
      throw invalid_argument("rank", rank, "must lie in [0, world_size = " + std::to_string(world_size) + ")");
    ncclComm_t comm = nullptr;
    STRIA_NCCL_CHECK(ncclCommInitRank(&comm, static_cast<int>(world_size), id, static_cast<int>(rank)));
    return nccl(comm, true, options);
  }

  /// One owned communicator per device of `devices`, rank r on devices[r], made by one process.
  static std::vector<nccl> create_all(std::span<const int> devices, nccl_options options = {}) {
    options.validate();
    if (devices.empty()) throw invalid_argument("devices.size()", 0, "must be at least 1");
    std::vector<ncclComm_t> comms(devices.size());
    STRIA_NCCL_CHECK(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
    std::vector<nccl> out;
    for (ncclComm_t c : comms) out.push_back(nccl(c, true, options));
    return out;
  }

  /// Rank 0 makes the unique id and writes it to `path` (atomically, by rename); the other ranks
  /// read it once it exists. For one process per GPU without MPI (a shared file system suffices).
  static ncclUniqueId unique_id_through_file(const std::string& path, index_t rank,
                                             std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
    ncclUniqueId id{};
    if (rank == 0) {
      STRIA_NCCL_CHECK(ncclGetUniqueId(&id));
      const std::string partial = path + ".partial";
      std::ofstream(partial, std::ios::binary).write(reinterpret_cast<const char*>(&id), sizeof(id));
      std::filesystem::rename(partial, path);
      return id;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!std::filesystem::exists(path)) {
      if (std::chrono::steady_clock::now() > deadline)
        throw comm_error("rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) + " ms for the NCCL id file " + path);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(&id), sizeof(id));
    return id;
  }

  nccl(nccl&& other) noexcept
      : comm_(std::exchange(other.comm_, nullptr)), owned_(other.owned_), rank_(other.rank_), world_(other.world_), stream_(std::exchange(other.stream_, nullptr)),
        device_(other.device_), options_(other.options_), aborted_(std::exchange(other.aborted_, {})), host_(*this) {}
  nccl& operator=(nccl&&) = delete;
  nccl(const nccl&) = delete;
  nccl& operator=(const nccl&) = delete;
  ~nccl() {
    if (stream_) (void)cudaStreamDestroy(stream_);
    if (owned_ && comm_) (void)ncclCommDestroy(comm_);
  }

  [[nodiscard]] ncclComm_t get() const { return comm_; }
  [[nodiscard]] index_t rank() const { return rank_; }
  [[nodiscard]] index_t world_size() const { return world_; }
  /// The CUDA device this rank's communicator drives.
  [[nodiscard]] int device() const { return device_; }
  /// Host-array collectives over this communicator (host-side code; the GPU estimator uses the device ones).
  [[nodiscard]] nccl_host_surface& host() { return host_; }
  /// The stream the host-array collectives use.
  [[nodiscard]] cudaStream_t own_stream() const { return stream_; }
  [[nodiscard]] const nccl_options& options() const { return options_; }
  /// Whether a wait() gave up and aborted the communicator (it refuses every call from then on).
  [[nodiscard]] bool aborted() const { return !aborted_.empty(); }

  /// A sub-communicator of the ranks with the same `color`, ordered by `key` (owned, with these options).
  [[nodiscard]] nccl split(int color, int key) const {
    check_usable();
    ncclComm_t sub = nullptr;
    STRIA_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
    return nccl(sub, true, options_);
  }

  void group_start() {
    check_usable();
    STRIA_NCCL_CHECK(ncclGroupStart());
  }
  void group_end() {
    STRIA_NCCL_CHECK(ncclGroupEnd());
    check_async();
  }

  /// Returns once the work `done` captured has completed (an event recorded after NCCL operations
  /// of this communicator: the ring engines confirm their transfers so). Polls the event and
  /// ncclCommGetAsyncError; on an asynchronous error, or past options().timeout with no progress,
  /// it aborts the communicator (ncclCommAbort: its kernels end, so the streams drain; work of
  /// other kernels queued ahead on the stream still has to finish before the abort returns) and raises
  /// nccl_error naming this rank, `what` and the time waited. An aborted communicator refuses
  /// further calls; a wrapped one is freed by the abort, so its owner must not destroy it again.
  void wait(cudaEvent_t done, const std::string& what) { wait_all(done, what, rank_, {this}); }

  /// wait() on work that depends on several communicators (nccl_hierarchy's two rings): polls each
  /// one's asynchronous error, waits as long as the first one's timeout, and aborts them all.
  /// `rank` is how messages name the waiting rank.
  static void wait_all(cudaEvent_t done, const std::string& what, index_t rank, std::initializer_list<nccl*> comms) {
    for (const nccl* c : comms) c->check_usable();
    const std::chrono::milliseconds timeout = (*comms.begin())->options_.timeout;
    const stria::detail::poll_result r = stria::detail::poll_event(done, timeout, [&](std::chrono::duration<double> elapsed) {
      for (const nccl* c : comms) {
        ncclResult_t state = ncclSuccess;
        STRIA_NCCL_CHECK(ncclCommGetAsyncError(c->comm_, &state));
        if (state != ncclSuccess && state != ncclInProgress)
          abort_all(comms, state,
                    "rank " + std::to_string(rank) + " waited " + stria::detail::seconds_text(elapsed) + " for " + what +
                        ": ncclCommGetAsyncError reported code " + std::to_string(int(state)) + " (" + ncclGetErrorString(state) + ")");
      }
    });
    if (!r.completed)
      abort_all(comms, ncclSuccess,
                "rank " + std::to_string(rank) + " timed out after " + stria::detail::seconds_text(r.elapsed) + " (nccl_options.timeout " +
                    std::to_string(timeout.count()) + " ms) waiting for " + what +
                    "; NCCL reported no error, so a peer stopped or never posted its part");
  }

  /// Sends `count` elements of device memory to `peer` on `stream`. As with every NCCL send, pair it
  /// in one group with the receive it depends on. `tag` is accepted for the surface's sake: NCCL
  /// matches a pair's operations in posting order, which the ring schedules keep on both sides.
  template <class T>
  void send(const T* data, std::size_t count, index_t peer, cudaStream_t stream, int /*tag*/ = 0) {
    check_usable();
    detail::check_peer(peer, world_size(), "send");
    STRIA_NCCL_CHECK(ncclSend(data, detail::nccl_count<T>(count), detail::nccl_type<T>(), static_cast<int>(peer), comm_, stream));
  }

  template <class T>
  void recv(T* data, std::size_t count, index_t peer, cudaStream_t stream, int /*tag*/ = 0) {
    check_usable();
    detail::check_peer(peer, world_size(), "recv");
    STRIA_NCCL_CHECK(ncclRecv(data, detail::nccl_count<T>(count), detail::nccl_type<T>(), static_cast<int>(peer), comm_, stream));
  }

  template <class T>
  void all_gather(const T* send_data, T* recv_data, std::size_t count, cudaStream_t stream) {
    check_usable();
    STRIA_NCCL_CHECK(ncclAllGather(send_data, recv_data, detail::nccl_count<T>(count), detail::nccl_type<T>(), comm_, stream));
    check_async();
  }

  template <class T>
  void all_reduce(const T* send_data, T* recv_data, std::size_t count, reduce_op op, cudaStream_t stream) {
    static_assert(detail::nccl_type<T>() != ncclUint8 || std::is_same_v<T, std::uint8_t>, "all_reduce needs an arithmetic element type");
    check_usable();
    STRIA_NCCL_CHECK(ncclAllReduce(send_data, recv_data, count, detail::nccl_type<T>(), detail::nccl_op(op), comm_, stream));
    check_async();
  }

  template <class T>
  void broadcast(T* data, std::size_t count, index_t root, cudaStream_t stream) {
    check_usable();
    detail::check_peer(root, world_size(), "broadcast root");
    STRIA_NCCL_CHECK(ncclBroadcast(data, data, detail::nccl_count<T>(count), detail::nccl_type<T>(), static_cast<int>(root), comm_, stream));
    check_async();
  }

  /// Every rank has arrived (an all-reduce of one value on the communicator's own stream, waited for).
  void barrier() { host_.barrier(); }

  /// Raises stria::nccl_error if the communicator reported an asynchronous failure (a peer died,
  /// a network error): NCCL's own calls may return success while the operation failed later.
  void check_async() const {
    check_usable();
    ncclResult_t state = ncclSuccess;
    STRIA_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    stria::detail::check_nccl(state, "ncclCommGetAsyncError (an earlier operation failed)", std::source_location::current());
  }

 private:
  nccl(ncclComm_t comm, bool owned, const nccl_options& options) : comm_(comm), owned_(owned), options_(options), host_(*this) {
    int rank = 0, world = 0;
    STRIA_NCCL_CHECK(ncclCommUserRank(comm, &rank));
    STRIA_NCCL_CHECK(ncclCommCount(comm, &world));
    rank_ = rank;
    world_ = world;
    // The own stream lives on the communicator's GPU, whichever device is current here:
    // create_all makes every rank's wrapper from one thread.
    int comm_device = 0;
    STRIA_NCCL_CHECK(ncclCommCuDevice(comm, &comm_device));
    const int current = stria::detail::current_device();
    STRIA_CUDA_CHECK(cudaSetDevice(comm_device));
    const cudaError_t created = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    STRIA_CUDA_CHECK(cudaSetDevice(current));
    STRIA_CUDA_CHECK(created);
    device_ = comm_device;
  }

  void check_usable() const {
    if (comm_) return;
    throw comm_error("rank " + std::to_string(rank_) + ": this NCCL communicator " +
                     (aborted_.empty() ? std::string("was moved from") : "was aborted after an error (" + aborted_ + ")") + "; make a new one");
  }

  /// Aborts every communicator of `comms` (their pending kernels end) and raises nccl_error.
  [[noreturn]] static void abort_all(std::initializer_list<nccl*> comms, ncclResult_t state, const std::string& reason) {
    for (nccl* c : comms) {
      (void)ncclCommAbort(c->comm_);  // a second error would hide the first
      c->comm_ = nullptr;
      c->aborted_ = reason;
    }
    throw nccl_error::stalled(static_cast<int>(state), reason + "; the communicator was aborted (ncclCommAbort)");
  }

  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  index_t rank_ = 0, world_ = 1;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  nccl_options options_;
  std::string aborted_;  // why wait() aborted the communicator ("": it was not)
  nccl_host_surface host_;
};
static_assert(stria::device_communicator<nccl> && stria::device_collectives<nccl>);

inline index_t nccl_host_surface::rank() const { return owner_->rank(); }
inline index_t nccl_host_surface::world_size() const { return owner_->world_size(); }

inline void nccl_host_surface::confirm(const std::string& what) {
  const cuda_event done;
  done.record(owner_->own_stream());
  owner_->wait(done.get(), "the host-surface " + what);
}

template <class T>
void nccl_host_surface::broadcast(T* data, std::size_t count, index_t root) {
  const cudaStream_t stream = owner_->own_stream();
  const pinned_buffer<T> host(count, stream);
  std::copy(data, data + count, host.begin());
  device_buffer<T> staged(std::span<const T>(host.span()), stream);
  owner_->broadcast(staged.data(), count, root, stream);
  if (count > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(host.data(), staged.data(), staged.bytes(), cudaMemcpyDeviceToHost, stream));
  confirm("broadcast of " + std::to_string(count) + " elements from rank " + std::to_string(root));
  std::copy(host.begin(), host.end(), data);
}

template <class T>
void nccl_host_surface::all_reduce(const T* send_data, T* recv_data, std::size_t count, reduce_op op) {
  const cudaStream_t stream = owner_->own_stream();
  const pinned_buffer<T> host(count, stream);
  std::copy(send_data, send_data + count, host.begin());
  device_buffer<T> staged(std::span<const T>(host.span()), stream);
  owner_->all_reduce(staged.data(), staged.data(), count, op, stream);
  if (count > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(host.data(), staged.data(), staged.bytes(), cudaMemcpyDeviceToHost, stream));
  confirm("all_reduce of " + std::to_string(count) + " elements");
  std::copy(host.begin(), host.end(), recv_data);
}

template <class T>
void nccl_host_surface::all_gather(const T* send_data, T* recv_data, std::size_t count) {
  const cudaStream_t stream = owner_->own_stream();
  const pinned_buffer<T> host(count * static_cast<std::size_t>(owner_->world_size()), stream);  // this rank's part, then every rank's
  std::copy(send_data, send_data + count, host.begin());
  const device_buffer<T> staged(std::span<const T>(host.data(), count), stream);
  device_buffer<T> gathered(host.size(), stream);
  owner_->all_gather(staged.data(), gathered.data(), count, stream);
  if (count > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(host.data(), gathered.data(), gathered.bytes(), cudaMemcpyDeviceToHost, stream));
  confirm("all_gather of " + std::to_string(count) + " elements per rank");
  std::copy(host.begin(), host.end(), recv_data);
}

inline void nccl_host_surface::barrier() {
  const cudaStream_t stream = owner_->own_stream();
  device_buffer<int> token(1, stream);
  token.fill_bytes(0, stream);
  owner_->all_reduce(token.data(), token.data(), 1, reduce_op::sum, stream);
  confirm("barrier");
}

/// A hierarchical ring's links on separate communicators (DESIGN 5): the inner ring (a node's
/// cards, rank = node * cards + card) and the outer ring (one card position across the nodes), each
/// split from the whole with ncclCommSplit, so outer transfers never queue behind inner ones. It has
/// the device surface of comm::nccl: a send or receive goes over the link its tag names
/// (ring_message_channel), with the peer's rank translated; collectives use the whole communicator.
class nccl_hierarchy {
 public:
  nccl_hierarchy(nccl& whole, index_t nodes, index_t cards)
      : whole_(&whole), cards_(checked_cards(whole, nodes, cards)),
        inner_(whole.split(static_cast<int>(whole.rank() / cards), static_cast<int>(whole.rank() % cards))),
        outer_(whole.split(static_cast<int>(whole.rank() % cards), static_cast<int>(whole.rank() / cards))) {}

  [[nodiscard]] index_t rank() const { return whole_->rank(); }
  [[nodiscard]] index_t world_size() const { return whole_->world_size(); }
  [[nodiscard]] nccl_host_surface& host() { return whole_->host(); }
  [[nodiscard]] const nccl& inner() const { return inner_; }
  [[nodiscard]] const nccl& outer() const { return outer_; }
  void barrier() { whole_->barrier(); }

  void group_start() { STRIA_NCCL_CHECK(ncclGroupStart()); }
  void group_end() {
    STRIA_NCCL_CHECK(ncclGroupEnd());
    inner_.check_async();
    outer_.check_async();
  }

  /// nccl::wait over both rings (the transfers of a step may use either); a timeout aborts both.
  void wait(cudaEvent_t done, const std::string& what) { nccl::wait_all(done, what, rank(), {&inner_, &outer_}); }

  template <class T>
  void send(const T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag = 0) {
    if (ring_message_channel(tag) == ring_channel::outer) outer_.send(data, count, outer_rank(peer, "send"), stream);
    else inner_.send(data, count, inner_rank(peer, "send"), stream);
  }

  template <class T>
  void recv(T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag = 0) {
    if (ring_message_channel(tag) == ring_channel::outer) outer_.recv(data, count, outer_rank(peer, "recv"), stream);
    else inner_.recv(data, count, inner_rank(peer, "recv"), stream);
  }

  template <class T>
  void all_gather(const T* send_data, T* recv_data, std::size_t count, cudaStream_t stream) {
    whole_->all_gather(send_data, recv_data, count, stream);
  }
  template <class T>
  void all_reduce(const T* send_data, T* recv_data, std::size_t count, reduce_op op, cudaStream_t stream) {
    whole_->all_reduce(send_data, recv_data, count, op, stream);
  }
  template <class T>
  void broadcast(T* data, std::size_t count, index_t root, cudaStream_t stream) {
    whole_->broadcast(data, count, root, stream);
  }

 private:
  static index_t checked_cards(const nccl& whole, index_t nodes, index_t cards) {
    if (nodes < 1 || cards < 1 || nodes * cards != whole.world_size())
      throw invalid_argument("nodes x cards", std::to_string(nodes) + " x " + std::to_string(cards),
                             "must equal the communicator's " + std::to_string(whole.world_size()) + " ranks");
    return cards;
  }
  /// A peer on the inner ring shares this rank's node; on the outer ring, its card.
  index_t inner_rank(index_t peer, const char* what) const {
    if (peer < 0 || peer >= world_size() || peer / cards_ != rank() / cards_)
      throw invalid_argument(std::string(what) + " peer", peer, "is not on this rank's node: inner transfers stay within a node");
    return peer % cards_;
  }
  index_t outer_rank(index_t peer, const char* what) const {
    if (peer < 0 || peer >= world_size() || peer % cards_ != rank() % cards_)
      throw invalid_argument(std::string(what) + " peer", peer, "holds another card position: outer transfers link the same card of each node");
    return peer / cards_;
  }

  nccl* whole_;
  index_t cards_;
  nccl inner_, outer_;
};
static_assert(stria::device_communicator<nccl_hierarchy> && stria::device_collectives<nccl_hierarchy>);

/// One process driving the GPUs `devices`: creates their communicators (ncclCommInitAll), runs
/// body(comm) on one thread per GPU (rank r on devices[r], made current), joins them, and rethrows
/// the first failure. For examples and tests; a training code passes its own ncclComm_t to wrap().
template <class Body>
void run_on_devices(std::span<const int> devices, const Body& body, nccl_options options = {}) {
  std::vector<nccl> comms = nccl::create_all(devices, options);
  std::vector<std::exception_ptr> errors(comms.size());
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        STRIA_CUDA_CHECK(cudaSetDevice(devices[r]));
        body(comms[r]);
      } catch (const std::exception& failure) {
        // Said at once: the other ranks may now wait for this one inside a collective, as in any
        // NCCL program whose peer failed, and the join below would never report it.
        std::fprintf(stderr, "stria::comm::run_on_devices: rank %zu (device %d) failed: %s\n", r, devices[r], failure.what());
        errors[r] = std::current_exception();
      } catch (...) {
        std::fprintf(stderr, "stria::comm::run_on_devices: rank %zu (device %d) failed\n", r, devices[r]);
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace stria::comm
