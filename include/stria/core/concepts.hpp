// SPDX-License-Identifier: Apache-2.0
// The four policy kinds a user composes (sharding, ring topology, index estimator, tile) and the
// host communicator the host backend and the estimators run on, as C++20 concepts.
#pragma once

#include <concepts>
#include <cstddef>
#include <string_view>

#include "stria/core/config.hpp"

namespace stria {

// ---------------------------------------------------------------------------------------------
// Sharding: how 64-token blocks are laid out over the context-parallel ranks.

/// The global problem a sharding is applied to: `num_blocks` = seq_len / 64 blocks over `world_size` ranks.
struct shard_layout {
  index_t num_blocks;
  index_t world_size;
};

/// Where a global block lives: its owner rank and its position in the owner's local shard.
struct block_location {
  index_t rank;
  index_t local_block;

  friend constexpr bool operator==(const block_location&, const block_location&) = default;
};

namespace detail {
// One concept per requirement of each policy kind, so that the check_* functions below name the one
// that is missing.
template <class P>
concept policy_name = requires {  // every policy kind's short name for reports
  { P::name } -> std::convertible_to<std::string_view>;
};
template <class P>
concept sharding_validate = requires(const P p, shard_layout layout) {
  { p.validate(layout) } -> std::same_as<void>;
};
template <class P>
concept sharding_local_blocks = requires(const P p, shard_layout layout) {
  { p.local_blocks(layout) } -> std::same_as<index_t>;
};
template <class P>
concept sharding_locate = requires(const P p, shard_layout layout, index_t global_block) {
  { p.locate(layout, global_block) } -> std::same_as<block_location>;
};
template <class P>
concept sharding_global_block = requires(const P p, shard_layout layout, block_location location) {
  { p.global_block(layout, location) } -> std::same_as<index_t>;
};
}  // namespace detail

/// Requirements of a sharding policy P (built-ins: sharding::sequential, zigzag, striped<G>):
/// - `P::name`: a short name for reports;
/// - `p.validate(layout)`: throws stria::invalid_argument naming seq_len or world_size when the
///   layout cannot be sharded (every rank must own the same number of blocks);
/// - `p.local_blocks(layout)`: blocks per rank;
/// - `p.locate(layout, global_block)` and `p.global_block(layout, location)`: inverse bijections;
///   each rank's local order keeps global order (local block i < j implies global(i) < global(j)).
template <class P>
concept sharding_policy = std::semiregular<P> && detail::policy_name<P> && detail::sharding_validate<P> && detail::sharding_local_blocks<P> &&
                          detail::sharding_locate<P> && detail::sharding_global_block<P>;

/// sharding_policy<P> as one static_assert per requirement, each naming the missing member. Use as
/// `static_assert(check_sharding_policy<P>());` (true once the asserts pass).
template <class P>
constexpr bool check_sharding_policy() {
  static_assert(std::semiregular<P>, "stria: a Sharding policy must be default-constructible and copyable (std::semiregular)");
  static_assert(detail::policy_name<P>, "stria: Sharding must have a static member name convertible to std::string_view");
  static_assert(detail::sharding_validate<P>, "stria: Sharding must have validate(stria::shard_layout) const returning void");
  static_assert(detail::sharding_local_blocks<P>, "stria: Sharding must have local_blocks(stria::shard_layout) const returning stria::index_t");
  static_assert(detail::sharding_locate<P>,
                "stria: Sharding must have locate(stria::shard_layout, index_t global_block) const returning stria::block_location");
  static_assert(detail::sharding_global_block<P>,
                "stria: Sharding must have global_block(stria::shard_layout, stria::block_location) const returning stria::index_t");
  return true;
}

// ---------------------------------------------------------------------------------------------
// Ring topology: which KV chunk each rank computes with at each step, and how chunks move.

/// Links a transfer can use; hierarchical rings keep inner (intra-node) and outer (inter-node) apart.
enum class ring_channel : unsigned char { inner, outer };

/// One point-to-point move of a KV chunk (and, in backward, its travelling dK/dV), posted at the
/// start of `post_step` and complete before `ready_step` begins. Buffers are per-rank slots.
struct ring_transfer {
  ring_channel channel;
  index_t send_to;         // rank that receives what this rank sends
  index_t receive_from;    // rank whose send this rank receives
  index_t sent_origin;     // rank that owns the KV chunk being sent
  index_t received_origin; // rank that owns the KV chunk being received
  int send_buffer;         // slot read by the send
  int receive_buffer;      // slot written by the receive
  index_t post_step;
  index_t ready_step;
};

/// The transfers a rank posts at the start of one step (at most one per channel).
struct transfer_list {
  static constexpr int capacity = 2;
  ring_transfer items[capacity];
  int count = 0;

  constexpr void push(const ring_transfer& t) { items[count++] = t; }
  constexpr const ring_transfer* begin() const { return items; }
  constexpr const ring_transfer* end() const { return items + count; }
};

namespace detail {
template <class T>
concept topology_world_size = requires(const T t) {
  { t.world_size() } -> std::same_as<index_t>;
};
template <class T>
concept topology_num_steps = requires(const T t) {
  { t.num_steps() } -> std::same_as<index_t>;
};
template <class T>
concept topology_kv_source_rank = requires(const T t, index_t rank, index_t step) {
  { t.kv_source_rank(rank, step) } -> std::same_as<index_t>;
};
template <class T>
concept topology_kv_buffer = requires(const T t, index_t rank, index_t step) {
  { t.kv_buffer(rank, step) } -> std::same_as<int>;
};
template <class T>
concept topology_transfers = requires(const T t, index_t rank, index_t step) {
  { t.transfers(rank, step) } -> std::same_as<transfer_list>;
};
template <class T>
concept topology_gradient_transfers = requires(const T t, index_t rank, index_t step) {
  { t.gradient_transfers(rank, step) } -> std::same_as<transfer_list>;
};
}  // namespace detail

/// Requirements of a ring topology T (built-ins: topology::flat_ring, hierarchical_ring):
/// - `T::name`; `t.world_size()`; `t.num_steps()` (a ring has one step per KV chunk);
/// - `t.kv_source_rank(rank, step)`: whose KV chunk `rank` computes with at `step`; over all steps
///   each rank meets every chunk exactly once;
/// - `t.kv_buffer(rank, step)`: the slot that holds that chunk during the step;
/// - `t.transfers(rank, step)`: KV moves `rank` posts at the start of `step` (each received chunk is
///   in place before `ready_step` computes);
/// - `t.gradient_transfers(rank, step)`: backward only, posted in list order once `step`'s compute is
///   done: the travelling fp32 dK/dV partial sums. A received partial is added into the chunk's sum
///   at the end of `ready_step` (before that step end's sends); `ready_step == num_steps()` marks
///   the final delivery, after which every rank holds the complete dK/dV of its own chunk.
template <class T>
concept ring_topology = std::copyable<T> && detail::policy_name<T> && detail::topology_world_size<T> && detail::topology_num_steps<T> &&
                        detail::topology_kv_source_rank<T> && detail::topology_kv_buffer<T> && detail::topology_transfers<T> &&
                        detail::topology_gradient_transfers<T>;

/// ring_topology<T> as one static_assert per requirement, each naming the missing member.
template <class T>
constexpr bool check_ring_topology() {
  static_assert(std::copyable<T>, "stria: a Topology must be copyable");
  static_assert(detail::policy_name<T>, "stria: Topology must have a static member name convertible to std::string_view");
  static_assert(detail::topology_world_size<T>, "stria: Topology must have world_size() const returning stria::index_t");
  static_assert(detail::topology_num_steps<T>, "stria: Topology must have num_steps() const returning stria::index_t");
  static_assert(detail::topology_kv_source_rank<T>,
                "stria: Topology must have kv_source_rank(index_t rank, index_t step) const returning stria::index_t");
  static_assert(detail::topology_kv_buffer<T>, "stria: Topology must have kv_buffer(index_t rank, index_t step) const returning int");
  static_assert(detail::topology_transfers<T>,
                "stria: Topology must have transfers(index_t rank, index_t step) const returning stria::transfer_list");
  static_assert(detail::topology_gradient_transfers<T>,
                "stria: Topology must have gradient_transfers(index_t rank, index_t step) const returning stria::transfer_list");
  return true;
}

// ---------------------------------------------------------------------------------------------
// Index estimator: how the global sparse selection is found from the data, each layer.

struct global_selection;     // stria/index/global_selection.hpp
struct vs_statistics;        // stria/estimator/statistics.hpp
struct statistics_request;   // stria/estimator/statistics.hpp

namespace detail {
template <class E>
concept estimator_validate = requires(const E e, index_t seq_len, index_t num_heads) {
  { e.validate(seq_len, num_heads) } -> std::same_as<void>;
};
template <class E>
concept estimator_request = requires(const E e, index_t seq_len) {
  { e.request(seq_len) } -> std::same_as<statistics_request>;
};
template <class E>
concept estimator_select = requires(const E e, const vs_statistics& statistics) {
  { e.select(statistics) } -> std::same_as<global_selection>;
};
}  // namespace detail

/// Requirements of an index estimator E (built-ins: estimator::vertical_slash_top_p, top_k, dense, block_mask):
/// - `E::name`;
/// - `e.validate(seq_len, num_heads)`: throws stria::invalid_argument for settings that cannot apply;
/// - `e.request(seq_len)`: the window statistics to gather (window_rows 0: none);
/// - `e.select(statistics)`: the global selection, identical on every rank given identical statistics.
template <class E>
concept index_estimator =
    std::copyable<E> && detail::policy_name<E> && detail::estimator_validate<E> && detail::estimator_request<E> && detail::estimator_select<E>;

/// index_estimator<E> as one static_assert per requirement, each naming the missing member.
template <class E>
constexpr bool check_index_estimator() {
  static_assert(std::copyable<E>, "stria: an Estimator must be copyable");
  static_assert(detail::policy_name<E>, "stria: Estimator must have a static member name convertible to std::string_view");
  static_assert(detail::estimator_validate<E>, "stria: Estimator must have validate(index_t seq_len, index_t num_heads) const returning void");
  static_assert(detail::estimator_request<E>, "stria: Estimator must have request(index_t seq_len) const returning stria::statistics_request");
  static_assert(detail::estimator_select<E>,
                "stria: Estimator must have select(const stria::vs_statistics&) const returning stria::global_selection");
  return true;
}

// ---------------------------------------------------------------------------------------------
// Tile: the kernel's tile shape (stria::tile<64, 64, D>).

namespace detail {
template <class T>
concept tile_members = requires {
  { T::block_q } -> std::convertible_to<index_t>;
  { T::block_kv } -> std::convertible_to<index_t>;
  { T::head_dim } -> std::convertible_to<index_t>;
};
}  // namespace detail

/// Requirements of tile traits T: compile-time `block_q`, `block_kv`, `head_dim`, with the
/// tile sides equal to the 64-token block and head_dim a multiple of the 16-wide mma step. The
/// kernels exist for head_dim 64 and 128 only, so the front template's check_tile_traits asks for
/// one of those (a tile of another head dim satisfies the concept, and fails there).
template <class T>
concept tile_traits = detail::tile_members<T> && T::block_q == 64 && T::block_kv == 64 && T::head_dim > 0 && T::head_dim % 16 == 0;

/// tile_traits<T> as static_asserts: the members first, then their values (the kernels are written
/// for the supported head dims 64 and 128 only).
template <class T>
constexpr bool check_tile_traits() {
  static_assert(detail::tile_members<T>, "stria: Tile must have static members block_q, block_kv and head_dim (use stria::tile<64, 64, HeadDim>)");
  if constexpr (detail::tile_members<T>) {
    static_assert(T::block_q == 64 && T::block_kv == 64, "stria's kernels run 64x64 tiles: use stria::tile<64, 64, HeadDim>");
    static_assert(T::head_dim == 64 || T::head_dim == 128, "stria supports head_dim 64 and 128: use tile<64, 64, 64> or tile<64, 64, 128>");
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Host communicators: one rank's handle on the world, moving host arrays. comm::host_threads is a
// host_communicator; the host surfaces of the device communicators (comm::local_device::host(),
// comm::nccl::host()) are host_collectives, what the host estimators need. The device communicator
// and the device collectives the GPU estimator needs are in stria/core/device_communicator.cuh.

namespace comm {
/// The element-wise reductions of all_reduce.
enum class reduce_op { sum, max, min };
}  // namespace comm

namespace detail {
// One concept per requirement, so that check_host_communicator names the one that is missing.
// Member templates are probed with float arrays, the element type the engines move.
template <class C>
concept comm_rank = requires(const C& c) {
  { c.rank() } -> std::convertible_to<index_t>;
};
template <class C>
concept comm_world_size = requires(const C& c) {
  { c.world_size() } -> std::convertible_to<index_t>;
};
template <class C>
concept comm_host_broadcast = requires(C& c, float* data, std::size_t count, index_t root) { c.broadcast(data, count, root); };
template <class C>
concept comm_host_all_gather = requires(C& c, const float* send, float* recv, std::size_t count) { c.all_gather(send, recv, count); };
template <class C>
concept comm_host_send = requires(C& c, const float* data, std::size_t count, index_t peer, int tag) { c.send(data, count, peer, tag); };
template <class C>
concept comm_host_recv = requires(C& c, float* data, std::size_t count, index_t peer, int tag) { c.recv(data, count, peer, tag); };
}  // namespace detail

/// What the host estimators need of a communicator (window statistics, the exact distributed top-k):
/// - `c.rank()`, `c.world_size()` (const, convertible to index_t);
/// - collectives of host arrays, called by every rank in the same order: `c.broadcast(data, count,
///   root)` and `c.all_gather(send, recv, count)` (rank r's part at r * count). The built-in
///   communicators also offer all_reduce; no estimator needs it.
template <class C>
concept host_collectives =
    detail::comm_rank<C> && detail::comm_world_size<C> && detail::comm_host_broadcast<C> && detail::comm_host_all_gather<C>;

/// What the host backend (host ring and solver execution, and its estimators) needs of a
/// communicator (built-in: comm::host_threads): host_collectives, and point-to-point messages of
/// host arrays, `c.send(data, count, peer, tag)` (never blocks) and `c.recv(data, count, peer, tag)`
/// (returns with the data; messages between two ranks match in order per tag).
template <class C>
concept host_communicator = host_collectives<C> && detail::comm_host_send<C> && detail::comm_host_recv<C>;

namespace detail {
/// The requirements every communicator shares (host and device), one static_assert each.
template <class C>
constexpr bool check_rank_and_world_size() {
  static_assert(comm_rank<C>, "stria: Comm must have rank() const returning stria::index_t (this rank)");
  static_assert(comm_world_size<C>, "stria: Comm must have world_size() const returning stria::index_t (the number of ranks)");
  return true;
}
}  // namespace detail

/// host_collectives<C> as one static_assert per requirement, each naming the missing member.
/// Use as `static_assert(check_host_collectives<Comm>());` (true once the asserts pass).
template <class C>
constexpr bool check_host_collectives() {
  static_assert(detail::check_rank_and_world_size<C>());
  static_assert(detail::comm_host_broadcast<C>, "stria: Comm must have broadcast(T* data, std::size_t count, index_t root) of host arrays");
  static_assert(detail::comm_host_all_gather<C>,
                "stria: Comm must have all_gather(const T* send, T* recv, std::size_t count) of host arrays");
  return true;
}

/// host_communicator<C> as one static_assert per requirement, each naming the missing member.
template <class C>
constexpr bool check_host_communicator() {
  static_assert(check_host_collectives<C>());
  static_assert(detail::comm_host_send<C>, "stria: Comm must have send(const T* data, std::size_t count, index_t peer, int tag) of host arrays");
  static_assert(detail::comm_host_recv<C>, "stria: Comm must have recv(T* data, std::size_t count, index_t peer, int tag) of host arrays");
  return true;
}

}  // namespace stria
