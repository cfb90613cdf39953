// SPDX-License-Identifier: Apache-2.0
// Window statistics on the GPU: the engine of gather_window_statistics (window_statistics.hpp) on
// the device backend, the statistics kept in device memory (device_statistics); then
// estimate_device, which selects on the GPU too. The collectives move device arrays in stream order
// (any device_collectives communicator: comm::local_device, comm::nccl), so from the window to the
// statistics nothing crosses the host, on any world size.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/error.hpp"
#include "stria/device/window_statistics.cuh"
#include "stria/engine/window_statistics_engine.hpp"
#include "stria/estimator/device_statistics.cuh"
#include "stria/estimator/select.cuh"
#include "stria/estimator/statistics.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::estimator {

/// The window statistics, identical on every rank, in device memory, queued on `stream`:
/// engine::gather_window_statistics on the device backend (device/window_statistics.cuh). Each
/// head's candidates are the first request.vertical_candidates of the host statistics' union, all
/// that a selection reads. q_local [S_local, Hq, D] and k_local [S_local, Hkv, D] are contiguous
/// device tensors of bf16 or fp16, as the attention kernels read (fp32 inputs: estimate on the host,
/// estimator::gather_window_statistics). `comm` is the device communicator of the ranks. Over
/// several ranks, where `comm` has a bounded wait (device_communicator's `wait`), the call returns
/// once the collectives have completed, or raises when a peer failed or the communicator's timeout
/// passed: a rank that threw before its share would otherwise leave the others waiting forever at
/// their next synchronisation. With `timing`, every phase ends with a synchronisation.
template <class Comm, sharding_policy Sharding, class T>
device_statistics gather_window_statistics_device(Comm& comm, const Sharding& sharding, index_t seq_len, bool causal, const T* q_local,
                                              const T* k_local, index_t heads_q, index_t heads_kv, index_t dim, double softmax_scale,
                                              statistics_request request, cudaStream_t stream,
                                              statistics_timing* timing = nullptr) {
  static_assert(check_device_collectives<Comm>());
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "stria: the device window statistics read bf16 or fp16 (the tensor cores' inputs); estimate fp32 inputs on the host");
  const auto start = std::chrono::steady_clock::now();
  const shard_layout layout{seq_len / block_tokens, comm.world_size()};
  sharding.validate(layout);
  const index_t local_tokens = sharding.local_blocks(layout) * block_tokens;
  attention_shape{local_tokens, local_tokens, heads_q, heads_kv, dim}.validate();
  if (q_local == nullptr) throw invalid_argument("q_local", "nullptr", "must point to device memory");
  if (k_local == nullptr) throw invalid_argument("k_local", "nullptr", "must point to device memory");
  for (const auto& [name, pointer] : {std::pair{"q_local", static_cast<const void*>(q_local)}, std::pair{"k_local", static_cast<const void*>(k_local)}})
    if (reinterpret_cast<std::uintptr_t>(pointer) % 16 != 0)
      throw invalid_argument(name, pointer, "must be 16-byte aligned (the kernels load 16-byte vectors)");
  const engine::window_plan plan = engine::make_window_plan(sharding, seq_len, layout.world_size, causal, heads_q, request, request.vertical_candidates);
  device::detail::window_backend<T> backend(plan, comm.rank(), q_local, k_local, heads_kv, dim, softmax_scale, stream, timing, start);
  device_statistics statistics = engine::gather_window_statistics(backend, comm, plan);
  if constexpr (requires(cudaEvent_t done, const std::string& what) { comm.wait(done, what); }) {
    if (layout.world_size > 1) {
      const cuda_event collectives_done;
      collectives_done.record(stream);
      comm.wait(collectives_done.get(), "the window statistics' collectives");
    }
  }
  return statistics;
}

/// estimate() on the GPU: the window statistics, then the selection, into a device_selection for
/// build_local_index_device. Top-p and top-k select on the GPU (what the host select() would pick
/// from the same statistics); other estimators select on the host and upload.
template <index_estimator Estimator, class Comm, sharding_policy Sharding, class T>
device_selection estimate_device(const Estimator& estimator, Comm& comm, const Sharding& sharding, index_t seq_len, bool causal,
                                 const T* q_local, const T* k_local, index_t heads_q, index_t heads_kv, index_t dim, double softmax_scale,
                                 cudaStream_t stream) {
  static_assert(check_device_collectives<Comm>());
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
