// SPDX-License-Identifier: Apache-2.0
// comm::host_threads: W ranks as threads of one process, with the surface of the NCCL communicator
// (grouped send/recv, all_gather, all_reduce, broadcast, barrier). The host backend runs on it.
// Ranks that disagree on an operation, a rank that fails, or a wait past the timeout raise
// stria::comm_error on every rank instead of hanging.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/config.hpp"
#include "stria/core/error.hpp"

namespace stria::comm {

class host_threads;

namespace detail {

/// What a rank asked for, so that ranks can be checked to agree before data moves.
struct operation {
  std::string name;  // "all_reduce", ...
  std::string type;  // element type
  std::size_t count = 0;
  index_t root = -1;
  int reduce = -1;

  friend bool operator==(const operation&, const operation&) = default;
  [[nodiscard]] std::string text() const {
    std::ostringstream out;
    out << name << "(" << count << " x " << type;
    if (root >= 0) out << ", root " << root;
    out << ")";
    return out.str();
  }
};

struct message {
  std::string type;
  std::size_t count;
  std::vector<std::byte> bytes;
};

struct world_state {
  index_t world_size;
  std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::tuple<index_t, index_t, int>, std::deque<message>> mailbox;  // (source, destination, tag)
  // Rendezvous for collectives: generation-counted, two phases (arrive, then depart).
  std::size_t generation = 0;
  index_t arrived = 0;
  index_t departed = 0;
  std::vector<operation> ops;
  std::vector<const void*> data;
  std::string failure;  // non-empty once any rank failed: every wait then throws
  std::vector<char> finished;  // per rank: its body has returned (it will post nothing more)

  world_state(index_t world, std::chrono::milliseconds t)
      : world_size(world), timeout(t), ops(static_cast<std::size_t>(world)),
        data(static_cast<std::size_t>(world)), finished(static_cast<std::size_t>(world), 0) {}

  /// A fresh start for the next run: a failure or a message left by the previous one stays there.
  void reset() {
    mailbox.clear();
    arrived = 0;
    departed = 0;
    failure.clear();
    finished.assign(finished.size(), 0);
  }

  /// The first finished rank, or -1.
  [[nodiscard]] index_t first_finished() const {
    for (index_t r = 0; r < world_size; ++r)
      if (finished[static_cast<std::size_t>(r)]) return r;
    return -1;
  }

  /// Waits under `lock` until `ready()`; throws comm_error on another rank's failure, on timeout,
  /// or as soon as `waiting_on()` names a finished rank whose part can no longer come (-1: none).
  template <class Ready, class WaitingOn>
  void wait(std::unique_lock<std::mutex>& lock, index_t rank, const std::string& what, Ready ready, WaitingOn waiting_on) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!ready()) {
      if (!failure.empty()) throw comm_error("rank " + std::to_string(rank) + " stopped waiting for " + what + ": " + failure);
      if (const index_t gone = waiting_on(); gone >= 0) {
        const std::string reason =
            "rank " + std::to_string(rank) + " waits for " + what + ", but rank " + std::to_string(gone) + " has returned without posting it";
        fail(reason);
        throw comm_error(reason);
      }
      if (changed.wait_until(lock, deadline) == std::cv_status::timeout && !ready()) {
        const std::string reason = "rank " + std::to_string(rank) + " timed out after " + std::to_string(timeout.count()) +
                                   " ms waiting for " + what + " (a peer never posted the matching operation)";
        fail(reason);
        throw comm_error(reason);
      }
    }
    if (!failure.empty()) throw comm_error("rank " + std::to_string(rank) + " stopped waiting for " + what + ": " + failure);
  }
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lock, index_t rank, const std::string& what, Ready ready) {
    wait(lock, rank, what, ready, [] { return index_t{-1}; });
  }

  void fail(const std::string& reason) {
    if (failure.empty()) failure = reason;
    changed.notify_all();
  }
};

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, int>) return "int";
  else if constexpr (std::is_same_v<T, long long>) return "long long";
  else return typeid(T).name();
}

/// Throws unless `peer` is a rank of a world of `world_size` ranks; `what` names the call ("send", ...).
inline void check_peer(index_t peer, index_t world_size, const char* what) {
  if (peer < 0 || peer >= world_size)
    throw invalid_argument(std::string(what) + " peer", peer, "must be a rank in [0, " + std::to_string(world_size) + ")");
}

}  // namespace detail

/// W ranks' shared state. `run` starts one thread per rank and rethrows the first failure.
class host_world {
 public:
  explicit host_world(index_t world_size, std::chrono::milliseconds timeout = std::chrono::seconds(300))
      : state_(std::make_shared<detail::world_state>(check_world(world_size), check_timeout(timeout))) {}

  [[nodiscard]] index_t world_size() const { return state_->world_size; }

  /// Runs `body(host_threads&)` on one thread per rank and joins them. If any rank throws, the
  /// others are released from their waits (comm_error) and the first exception is rethrown here; a
  /// rank that returns while a peer waits for its message or a collective fails that wait at once,
  /// naming it. Messages sent but never received are an error too: nothing is lost silently. Each
  /// run starts afresh: a failure does not outlive the run it happened in.
  template <class Body>
  void run(Body&& body);

 private:
  static index_t check_world(index_t world_size) {
    if (world_size < 1) throw invalid_argument("world_size", world_size, "must be at least 1");
    // A thread and per-rank state each: unbounded, 2^30 ranks asked for an 80 GB table (std::bad_alloc).
    if (world_size > max_world_size)
      throw invalid_argument("world_size", world_size, "must be at most " + std::to_string(max_world_size) + " ranks (a thread each)");
    return world_size;
  }
  static std::chrono::milliseconds check_timeout(std::chrono::milliseconds timeout) {
    if (timeout.count() <= 0) throw invalid_argument("timeout (ms)", timeout.count(), "must be positive");
    return timeout;
  }

  std::shared_ptr<detail::world_state> state_;
};

/// One rank's handle. Sends are buffered (they never block); receives block until the matching
/// send arrives. Messages between two ranks match in order per `tag` (as operations on one NCCL
/// communicator do; different tags stand for different communicators). Inside
/// group_start()/group_end() operations are queued and run at group_end, sends first, as with NCCL groups.
class host_threads {
 public:
  host_threads(std::shared_ptr<detail::world_state> state, index_t rank) : state_(std::move(state)), rank_(rank) {}

  [[nodiscard]] index_t rank() const { return rank_; }
  [[nodiscard]] index_t world_size() const { return state_->world_size; }

  void group_start() { ++group_depth_; }
  void group_end() {
    if (group_depth_ == 0) throw invalid_argument("group_end()", "without group_start()", "calls must pair up");
    if (--group_depth_ > 0) return;
    std::vector<queued> ops;
    ops.swap(queue_);
    for (auto& op : ops)
      if (op.is_send) op.run();
    for (auto& op : ops)
      if (!op.is_send) op.run();
  }

  template <class T>
  void send(const T* data, std::size_t count, index_t peer, int tag = 0) {
    static_assert(std::is_trivially_copyable_v<T>);
    detail::check_peer(peer, world_size(), "send");
    run_or_queue(true, [this, data, count, peer, tag] { post_send(data, count, peer, tag); });
  }

  template <class T>
  void recv(T* data, std::size_t count, index_t peer, int tag = 0) {
    static_assert(std::is_trivially_copyable_v<T>);
    detail::check_peer(peer, world_size(), "recv");
    run_or_queue(false, [this, data, count, peer, tag] { complete_recv(data, count, peer, tag); });
  }

  /// recv holds world_size * count elements: rank r's `count` elements at offset r * count.
  template <class T>
  void all_gather(const T* send_data, T* recv_data, std::size_t count) {
    collective({"all_gather", detail::type_name<T>(), count}, send_data, [&](const std::vector<const void*>& all) {
      for (std::size_t r = 0; r < all.size(); ++r)  // in place (rank r's part already there): nothing to copy
        if (all[r] != recv_data + r * count) std::memcpy(recv_data + r * count, all[r], count * sizeof(T));
    });
  }

  /// Element-wise reduction in rank order (deterministic); send and recv may alias.
  template <class T>
  void all_reduce(const T* send_data, T* recv_data, std::size_t count, reduce_op op) {
    std::vector<T> result(count);
    collective({"all_reduce", detail::type_name<T>(), count, -1, static_cast<int>(op)}, send_data,
               [&](const std::vector<const void*>& all) {
                 std::memcpy(result.data(), all[0], count * sizeof(T));
                 for (std::size_t r = 1; r < all.size(); ++r) {
                   const T* x = static_cast<const T*>(all[r]);
                   for (std::size_t i = 0; i < count; ++i) {
                     if (op == reduce_op::sum) result[i] += x[i];
                     else if (op == reduce_op::max) result[i] = std::max(result[i], x[i]);
                     else result[i] = std::min(result[i], x[i]);
                   }
                 }
               });
    std::copy(result.begin(), result.end(), recv_data);
  }

  template <class T>
  void broadcast(T* data, std::size_t count, index_t root) {
    detail::check_peer(root, world_size(), "broadcast root");
    std::vector<T> copy(count);
    collective({"broadcast", detail::type_name<T>(), count, root}, data,
               [&](const std::vector<const void*>& all) { std::memcpy(copy.data(), all[static_cast<std::size_t>(root)], count * sizeof(T)); });
    std::copy(copy.begin(), copy.end(), data);
  }

  void barrier() {
    collective({"barrier", "none", 0}, nullptr, [](const std::vector<const void*>&) {});
  }

  /// The world's wait limit (host_world's timeout).
  [[nodiscard]] std::chrono::milliseconds timeout() const { return state_->timeout; }

  /// For waits outside this communicator (a device communicator polling its GPU work): throws
  /// comm_error, naming what this rank waited for, once any rank has failed.
  void check_peers(const std::string& what) const {
    const std::lock_guard lock(state_->mutex);
    if (!state_->failure.empty()) throw comm_error("rank " + std::to_string(rank_) + " stopped waiting for " + what + ": " + state_->failure);
  }

  /// Fails the world for `reason` (every rank's waits raise from now on) and returns the error to throw here.
  [[nodiscard]] comm_error fail(const std::string& reason) {
    const std::lock_guard lock(state_->mutex);
    state_->fail(reason);
    return comm_error(reason);
  }

 private:
  struct queued {
    bool is_send;
    std::function<void()> run;
  };

  /// Inside a group, queues `op` for group_end; else runs it now.
  void run_or_queue(bool is_send, std::function<void()> op) {
    if (group_depth_ > 0) queue_.push_back({is_send, std::move(op)});
    else op();
  }

  template <class T>
  void post_send(const T* data, std::size_t count, index_t peer, int tag) {
    detail::message m{detail::type_name<T>(), count, std::vector<std::byte>(count * sizeof(T))};
    if (count > 0) std::memcpy(m.bytes.data(), data, count * sizeof(T));
    std::lock_guard lock(state_->mutex);
    state_->mailbox[{rank_, peer, tag}].push_back(std::move(m));
    state_->changed.notify_all();
  }

  template <class T>
  void complete_recv(T* data, std::size_t count, index_t peer, int tag) {
    std::unique_lock lock(state_->mutex);
    auto& box = state_->mailbox[{peer, rank_, tag}];
    state_->wait(
        lock, rank_, "a message from rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")", [&] { return !box.empty(); },
        [&] { return state_->finished[static_cast<std::size_t>(peer)] ? peer : index_t{-1}; });
    detail::message m = std::move(box.front());
    box.pop_front();
    if (m.type != detail::type_name<T>() || m.count != count) {
      const std::string reason = "rank " + std::to_string(rank_) + " expected " + std::to_string(count) + " x " +
                                 detail::type_name<T>() + " from rank " + std::to_string(peer) + " but rank " +
                                 std::to_string(peer) + " sent " + std::to_string(m.count) + " x " + m.type;
      state_->fail(reason);
      throw comm_error(reason);
    }
    if (count > 0) std::memcpy(data, m.bytes.data(), count * sizeof(T));
  }

  /// All ranks arrive with their operation and data pointer; once all agree, `consume` reads every
  /// rank's data while the owners wait, then all depart together.
  template <class Consume>
  void collective(const detail::operation& op, const void* data, Consume consume) {
    if (group_depth_ > 0) throw invalid_argument(op.name, "inside group_start()/group_end()", "only send and recv may be grouped");
    auto& s = *state_;
    std::unique_lock lock(s.mutex);
    s.wait(lock, rank_, "the previous collective to finish", [&] { return s.departed == 0; });
    const std::size_t generation = s.generation;
    s.ops[static_cast<std::size_t>(rank_)] = op;
    s.data[static_cast<std::size_t>(rank_)] = data;
    if (++s.arrived == s.world_size) s.changed.notify_all();
    // A rank that has returned can never arrive.
    s.wait(
        lock, rank_, op.text(), [&] { return s.generation != generation || s.arrived == s.world_size; }, [&] { return s.first_finished(); });
    for (index_t r = 0; r < s.world_size; ++r)
      if (!(s.ops[static_cast<std::size_t>(r)] == op)) {
        const std::string reason = "collective mismatch: rank " + std::to_string(rank_) + " called " + op.text() +
                                   " but rank " + std::to_string(r) + " called " + s.ops[static_cast<std::size_t>(r)].text();
        s.fail(reason);
        throw comm_error(reason);
      }
    // The ranks read in parallel, without the lock: every rank's data stays put until all have
    // departed, and each writes only its own output.
    const std::vector<const void*> all = s.data;
    lock.unlock();
    std::exception_ptr error;
    try {
      consume(all);
    } catch (...) {
      error = std::current_exception();  // still departs: the others wait for every reader
    }
    lock.lock();
    // Depart: the last one out resets the rendezvous for the next collective. The others wait for
    // it whatever happens meanwhile (a failure, the timeout), as a peer may still be reading their
    // data; every rank here has nothing left but its copies.
    if (++s.departed == s.world_size) {
      s.arrived = 0;
      s.departed = 0;
      ++s.generation;
      s.changed.notify_all();
    } else {
      s.changed.wait(lock, [&] { return s.generation != generation; });
    }
    if (error) std::rethrow_exception(error);
    if (!s.failure.empty()) throw comm_error("rank " + std::to_string(rank_) + " stopped after " + op.text() + ": " + s.failure);
  }

  std::shared_ptr<detail::world_state> state_;
  index_t rank_;
  int group_depth_ = 0;
  std::vector<queued> queue_;
};
static_assert(stria::host_communicator<host_threads>);

template <class Body>
void host_world::run(Body&& body) {
  const index_t world = state_->world_size;
  {
    std::lock_guard lock(state_->mutex);
    state_->reset();
  }
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world));
  for (index_t r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      host_threads comm(state_, r);
      try {
        body(comm);
        std::lock_guard lock(state_->mutex);
        state_->finished[static_cast<std::size_t>(r)] = 1;
        state_->changed.notify_all();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        std::lock_guard lock(state_->mutex);
        state_->fail("rank " + std::to_string(r) + " failed: " + e.what());
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        std::lock_guard lock(state_->mutex);
        state_->fail("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  // The root cause first: a rank's own error rather than a peer's "stopped waiting".
  for (const auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const comm_error&) {
      continue;
    } catch (...) {
      throw;
    }
  }
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (const auto& [key, box] : state_->mailbox)
    if (!box.empty())
      throw comm_error("rank " + std::to_string(std::get<0>(key)) + " sent " + std::to_string(box.size()) +
                       " message(s) to rank " + std::to_string(std::get<1>(key)) + " (tag " + std::to_string(std::get<2>(key)) +
                       ") that were never received");
}

}  // namespace stria::comm
