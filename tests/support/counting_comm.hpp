// SPDX-License-Identifier: Apache-2.0
// A host communicator written as a third party would: one rank of a world of threads, through
// comm::host_threads, counting the messages, the collectives of each kind and the bytes gathered.
#pragma once

#include <cstddef>

#include "stria/comm/host_threads.hpp"

namespace third_party {

class counting_comm {
 public:
  explicit counting_comm(stria::comm::host_threads& inner) : inner_(inner) {}

  [[nodiscard]] stria::index_t rank() const { return inner_.rank(); }
  [[nodiscard]] stria::index_t world_size() const { return inner_.world_size(); }
  template <class T>
  void send(const T* data, std::size_t count, stria::index_t peer, int tag) {
    ++messages;
    inner_.send(data, count, peer, tag);
  }
  template <class T>
  void recv(T* data, std::size_t count, stria::index_t peer, int tag) {
    inner_.recv(data, count, peer, tag);
  }
  template <class T>
  void broadcast(T* data, std::size_t count, stria::index_t root) {
    ++collectives;
    ++broadcasts;
    inner_.broadcast(data, count, root);
  }
  template <class T>
  void all_reduce(const T* send_data, T* recv_data, std::size_t count, stria::comm::reduce_op op) {
    ++collectives;
    ++all_reduces;
    inner_.all_reduce(send_data, recv_data, count, op);
  }
  template <class T>
  void all_gather(const T* send_data, T* recv_data, std::size_t count) {
    ++collectives;
    ++all_gathers;
    gathered_bytes += count * sizeof(T) * static_cast<std::size_t>(world_size());
    inner_.all_gather(send_data, recv_data, count);
  }

  int messages = 0, collectives = 0, broadcasts = 0, all_reduces = 0, all_gathers = 0;
  std::size_t gathered_bytes = 0;  // what the all-gathers brought to this rank

 private:
  stria::comm::host_threads& inner_;
};

}  // namespace third_party
