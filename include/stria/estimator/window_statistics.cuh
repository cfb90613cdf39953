// SPDX-License-Identifier: Apache-2.0
// Window statistics on the GPU: the same algorithm and the same statistics as
// gather_window_statistics (window_statistics.hpp), kept in device memory (device_statistics), with
// the heavy work in kernels (device/window_statistics.cuh launches them); then estimate_device,
// which selects on the GPU too. The collectives exchange small host arrays (rows x heads, diagonals
// x heads, candidates), so any host_collectives communicator works; a world of one rank needs no
// collective and no host round trip.
#pragma once

#include <cuda_runtime_api.h>

#include <concepts>

#include "stria/comm/host_threads.hpp"
#include "stria/core/concepts.hpp"
#include "stria/device/window_statistics.cuh"
#include "stria/estimator/device_statistics.cuh"
#include "stria/estimator/select.cuh"
#include "stria/estimator/statistics.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::estimator {

/// The window statistics, identical on every rank, in device memory, queued on `stream`.
/// q_local [S_local, Hq, D] and k_local [S_local, Hkv, D] are contiguous device tensors of bf16,
/// fp16 or float. device/window_statistics.cuh launches the kernels.
template <class Comm, sharding_policy Sharding, class T>
device_statistics gather_window_statistics_device(Comm& comm, const Sharding& sharding, index_t seq_len, bool causal, const T* q_local,
                                              const T* k_local, index_t heads_q, index_t heads_kv, index_t dim, double softmax_scale,
                                              statistics_request request, cudaStream_t stream,
                                              statistics_timing* timing = nullptr) {
  static_assert(check_host_collectives<Comm>());
  return device::gather_window_statistics(comm, sharding, seq_len, causal, q_local, k_local, heads_q, heads_kv, dim, softmax_scale, request,
                                          stream, timing);
}

/// estimate() on the GPU: the window statistics, then the selection, into a device_selection for
/// build_local_index_device. Top-p and top-k select on the GPU (what the host select() would pick
/// from the same statistics); other estimators select on the host and upload.
template <index_estimator Estimator, class Comm, sharding_policy Sharding, class T>
device_selection estimate_device(const Estimator& estimator, Comm& comm, const Sharding& sharding, index_t seq_len, bool causal,
                                 const T* q_local, const T* k_local, index_t heads_q, index_t heads_kv, index_t dim, double softmax_scale,
                                 cudaStream_t stream) {
  static_assert(check_host_collectives<Comm>());
  estimator.validate(seq_len, heads_q);
  const statistics_request request = estimator.request(seq_len);
  if (request.window_rows == 0) return device_selection(detail::select_without_statistics(estimator, seq_len, heads_q, causal), stream);
  const device_statistics st = gather_window_statistics_device(comm, sharding, seq_len, causal, q_local, k_local, heads_q, heads_kv, dim,
                                                               softmax_scale, request, stream);
  if constexpr (requires { { estimator.rule(seq_len) } -> std::same_as<top_p_rule>; })
    return select_device(st, estimator.rule(seq_len), stream);
  else
    return device_selection(estimator.select(st.download(stream)), stream);
}

}  // namespace stria::estimator
