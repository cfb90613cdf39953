// SPDX-License-Identifier: Apache-2.0
// The device communicator as a C++20 concept: what the device ring engine, the solver executor and
// the front template need of one rank's handle (built-ins: comm::local_device, comm::nccl,
// comm::nccl_hierarchy), with check_device_communicator naming a missing member; and the device
// collectives the GPU estimator needs (device_collectives, check_device_collectives).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "stria/core/concepts.hpp"

namespace stria {

namespace detail {
// One concept per requirement (rank and world_size are the host ones); member templates are probed
// with float arrays, the element type the engines move.
template <class C>
concept comm_group_start = requires(C& c) { c.group_start(); };
template <class C>
concept comm_group_end = requires(C& c) { c.group_end(); };
template <class C>
concept comm_device_send = requires(C& c, const float* data, std::size_t count, index_t peer, cudaStream_t stream, int tag) {
  c.send(data, count, peer, stream, tag);
};
template <class C>
concept comm_device_recv = requires(C& c, float* data, std::size_t count, index_t peer, cudaStream_t stream, int tag) {
  c.recv(data, count, peer, stream, tag);
};
template <class C>
concept comm_bounded_wait = requires(C& c, cudaEvent_t done, const std::string& what) { c.wait(done, what); };
// The estimator broadcasts 2-byte elements (its bf16 / fp16 window rows) and all-gathers 64-bit
// keys besides floats, so the collectives are probed with those sizes too.
template <class C>
concept comm_device_broadcast = requires(C& c, float* data, std::uint16_t* rows, std::size_t count, index_t root, cudaStream_t stream) {
  c.broadcast(data, count, root, stream);
  c.broadcast(rows, count, root, stream);
};
template <class C>
concept comm_device_all_gather = requires(C& c, const float* send, float* recv, const std::uint64_t* keys, std::uint64_t* all_keys,
                                          std::size_t count, cudaStream_t stream) {
  c.all_gather(send, recv, count, stream);
  c.all_gather(keys, all_keys, count, stream);
};
}  // namespace detail

/// Requirements of a device communicator C:
/// - `c.rank()`, `c.world_size()` (const, convertible to index_t);
/// - `c.send(data, count, peer, stream, tag)` and `c.recv(data, count, peer, stream, tag)` of device
///   arrays, ordered on `stream`; inside `c.group_start()` ... `c.group_end()` they are posted
///   together (as NCCL groups), so a ring step's send and receive cannot deadlock;
/// - `c.wait(event, what)`: returns once the work `event` captured has completed, or raises
///   (naming `what`) when a peer failed or a timeout passed, instead of hanging.
template <class C>
concept device_communicator = detail::comm_rank<C> && detail::comm_world_size<C> && detail::comm_group_start<C> &&
                              detail::comm_group_end<C> && detail::comm_device_send<C> && detail::comm_device_recv<C> &&
                              detail::comm_bounded_wait<C>;

/// device_communicator<C> as one static_assert per requirement, each naming the missing member.
/// Use as `static_assert(check_device_communicator<Comm>());` (true once the asserts pass).
template <class C>
constexpr bool check_device_communicator() {
  static_assert(detail::check_rank_and_world_size<C>());
  static_assert(detail::comm_group_start<C>, "stria: Comm must have group_start() (sends and receives posted together until group_end)");
  static_assert(detail::comm_group_end<C>, "stria: Comm must have group_end() (posts the group's sends and receives)");
  static_assert(detail::comm_device_send<C>,
                "stria: Comm must have send(const T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag) of device arrays");
  static_assert(detail::comm_device_recv<C>,
                "stria: Comm must have recv(T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag) of device arrays");
  static_assert(detail::comm_bounded_wait<C>,
                "stria: Comm must have wait(cudaEvent_t done, const std::string& what), the bounded wait that confirms a transfer");
  return true;
}

/// What the GPU estimator's window statistics need of a communicator (built-ins: comm::local_device,
/// comm::nccl, comm::nccl_hierarchy), so that they never cross the host:
/// - `c.rank()`, `c.world_size()` (const, convertible to index_t);
/// - collectives of device arrays, queued on `stream` and called by every rank in the same order:
///   `c.broadcast(data, count, root, stream)` and `c.all_gather(send, recv, count, stream)` (rank r's
///   part at r * count), each a template over the element type. The built-in communicators also
///   offer all_reduce; the estimator does not need it.
template <class C>
concept device_collectives =
    detail::comm_rank<C> && detail::comm_world_size<C> && detail::comm_device_broadcast<C> && detail::comm_device_all_gather<C>;

/// device_collectives<C> as one static_assert per requirement, each naming the missing member.
template <class C>
constexpr bool check_device_collectives() {
  static_assert(detail::check_rank_and_world_size<C>());
  static_assert(detail::comm_device_broadcast<C>,
                "stria: Comm must have broadcast(T* data, std::size_t count, index_t root, cudaStream_t stream) of device arrays, for any T");
  static_assert(detail::comm_device_all_gather<C>,
                "stria: Comm must have all_gather(const T* send, T* recv, std::size_t count, cudaStream_t stream) of device arrays, for any T");
  return true;
}

}  // namespace stria
