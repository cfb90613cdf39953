// SPDX-License-Identifier: Apache-2.0
// The kernel layer's work for one element type: a batch element's selection becomes a device step
// index for one rank (sequential sharding, world 1), then the sparse kernels of the device layer run
// on it. binding_bf16.cu and binding_fp16.cu instantiate it, so the two types compile in parallel.
#pragma once

#include <stria/device/sparse_attention_step.cuh>
#include <stria/estimator/window_statistics.cuh>
#include <stria/index/local_index.cuh>
#include <stria/sharding/sequential.hpp>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "binding.hpp"

namespace stria::python {

/// The device collectives of a world of one rank (the estimator's communicator): rank 0 of 1, whose
/// collectives have nothing to exchange.
struct one_rank {
  [[nodiscard]] index_t rank() const { return 0; }
  [[nodiscard]] index_t world_size() const { return 1; }
  template <class T>
  void broadcast(T*, std::size_t, index_t, cudaStream_t) {}
  template <class T>
  void all_gather(const T* send, T* receive, std::size_t count, cudaStream_t stream) {
    copy(send, receive, count, stream);
  }

 private:
  template <class T>
  static void copy(const T* send, T* receive, std::size_t count, cudaStream_t stream) {
    if (send != receive && count > 0) STRIA_CUDA_CHECK(cudaMemcpyAsync(receive, send, count * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }
};

/// Batch element b's selection as a global selection (one head per query head).
inline global_selection unpadded(const problem& p, const padded_selection& s, std::int64_t b) {
  global_selection g{static_cast<index_t>(p.seq_len), p.causal, std::vector<head_selection>(static_cast<std::size_t>(p.heads_q))};
  for (std::int64_t h = 0; h < p.heads_q; ++h) {
    head_selection& head = g.heads[static_cast<std::size_t>(h)];
    const std::int32_t* vertical = s.vertical + (b * p.heads_q + h) * s.vertical_width;
    const std::int32_t* slash = s.slash + (b * p.heads_q + h) * s.slash_width;
    for (std::int64_t i = 0; i < s.vertical_width && vertical[i] != selection_padding; ++i) head.vertical_tokens.push_back(vertical[i]);
    for (std::int64_t i = 0; i < s.slash_width && slash[i] != selection_padding; ++i) head.slash_deltas.push_back(slash[i]);
  }
  try {
    g.validate();
  } catch (const invalid_argument& e) {  // name the batch element too
    const std::string what = e.what(), prefix = "stria: ";
    throw std::invalid_argument(prefix + "batch element " + std::to_string(b) + ": " + (what.starts_with(prefix) ? what.substr(prefix.size()) : what));
  }
  return g;
}

/// Batch element b's index: the whole sequence on one rank.
inline device_step_index index_of(const problem& p, const padded_selection& s, std::int64_t b) {
  const device_selection selection(unpadded(p, s, b), p.stream);
  return build_local_index_device(selection, sharding::sequential{}, 1, 0, 0, {}, p.stream);
}

/// A batch element's tensors in the call's [batch, tokens, heads, dim] and [batch, heads, tokens]
/// arrays: tokens is the sequence length, or a rank's share of it in a context-parallel call.
template <class T>
struct batch_views {
  const problem& p;
  std::int64_t tokens = p.seq_len;
  [[nodiscard]] std::int64_t q_elements() const { return tokens * p.heads_q * p.head_dim; }
  [[nodiscard]] std::int64_t kv_elements() const { return tokens * p.heads_kv * p.head_dim; }
  [[nodiscard]] index_t s() const { return static_cast<index_t>(tokens); }
  template <class U>
  tensor_view<U, 3> q_like(U* base, std::int64_t b) const {
    return tensor_view<U, 3>(base + b * q_elements(), {s(), static_cast<index_t>(p.heads_q), static_cast<index_t>(p.head_dim)});
  }
  template <class U>
  tensor_view<U, 3> kv_like(U* base, std::int64_t b) const {
    return tensor_view<U, 3>(base + b * kv_elements(), {s(), static_cast<index_t>(p.heads_kv), static_cast<index_t>(p.head_dim)});
  }
  template <class U>
  tensor_view<U, 2> rows(U* base, std::int64_t b) const {
    return tensor_view<U, 2>(base + b * p.heads_q * tokens, {static_cast<index_t>(p.heads_q), s()});
  }
};

/// Batch element b's rows of the padded selection arrays (of `widths`) filled from g.
inline void write_padded(const problem& p, const global_selection& g, std::int64_t b, std::pair<std::int64_t, std::int64_t> widths,
                         std::int32_t* vertical, std::int32_t* slash) {
  const auto [vertical_width, slash_width] = widths;
  for (std::int64_t h = 0; h < p.heads_q; ++h) {
    const head_selection& head = g.heads[static_cast<std::size_t>(h)];
    if (std::ssize(head.vertical_tokens) > vertical_width || std::ssize(head.slash_deltas) > slash_width)
      throw invalid_argument("estimate_widths", std::to_string(vertical_width) + " x " + std::to_string(slash_width),
                             "is narrower than head " + std::to_string(h) + "'s selection (" + std::to_string(head.vertical_tokens.size()) +
                                 " verticals, " + std::to_string(head.slash_deltas.size()) + " slashes): a bug in stria");
    std::int32_t* v_row = vertical + (b * p.heads_q + h) * vertical_width;
    std::int32_t* s_row = slash + (b * p.heads_q + h) * slash_width;
    std::fill(std::copy(head.vertical_tokens.begin(), head.vertical_tokens.end(), v_row), v_row + vertical_width, selection_padding);
    std::fill(std::copy(head.slash_deltas.begin(), head.slash_deltas.end(), s_row), s_row + slash_width, selection_padding);
  }
}

template <class T>
void estimate_typed(const problem& p, const T* q, const T* k, const estimator_options& options, std::pair<std::int64_t, std::int64_t> widths,
                    std::int32_t* vertical, std::int32_t* slash) {
  const estimator::vertical_slash_top_p e = estimator_of(options);
  const batch_views<T> views{p};
  one_rank alone;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const device_selection selection =
        estimator::estimate_device(e, alone, sharding::sequential{}, static_cast<index_t>(p.seq_len), p.causal, q + b * views.q_elements(),
                                   k + b * views.kv_elements(), static_cast<index_t>(p.heads_q), static_cast<index_t>(p.heads_kv),
                                   static_cast<index_t>(p.head_dim), p.softmax_scale, p.stream);
    write_padded(p, selection.to_host(p.stream), b, widths, vertical, slash);
  }
}

template <class T>
void forward_typed(const problem& p, const T* q, const T* k, const T* v, const padded_selection& selection, T* out, float* lse) {
  const batch_views<T> views{p};
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const device_step_index index = index_of(p, selection, b);
    device::sparse_forward<T>(index,
                              {.q = views.q_like(q, b),
                               .k = views.kv_like(k, b),
                               .v = views.kv_like(v, b),
                               .out = tensor_view<float, 3>{},
                               .lse = views.rows(lse, b),
                               .final_out = views.q_like(out, b)},
                              p.softmax_scale, p.stream, {.state = device::running_state::overwrite});
  }
}

template <class T>
void backward_typed(const problem& p, const T* q, const T* k, const T* v, const T* out, const T* d_out, const float* lse,
                    const padded_selection& selection, bool deterministic, const backward_scratch& scratch, T* dq, T* dk, T* dv) {
  const batch_views<T> views{p};
  const auto zero = [&](float* x, std::int64_t count) { STRIA_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<std::size_t>(count) * sizeof(float), p.stream)); };
  // dQ goes out in T from the backward itself (step_backward_tensors' dq_out: one step, so no fp32 dQ,
  // no memset and no cast); dK and dV are summed in fp32 (the vertical tokens add by reductions).
  const tensor_view<float, 3> no_dq_sum = views.q_like(static_cast<float*>(nullptr), 0);
  const tensor_view<float, 3> dk_sum = views.kv_like(scratch.dk, 0), dv_sum = views.kv_like(scratch.dv, 0);
  const tensor_view<float, 2> delta = views.rows(scratch.delta, 0);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const device_step_index index = index_of(p, selection, b);
    zero(scratch.dk, views.kv_elements());
    zero(scratch.dv, views.kv_elements());
    device::backward_delta<T>(views.q_like(out, b), views.q_like(d_out, b), delta, p.stream);
    device::sparse_backward<T>(index,
                               {.q = views.q_like(q, b),
                                .k = views.kv_like(k, b),
                                .v = views.kv_like(v, b),
                                .d_out = views.q_like(d_out, b),
                                .lse = views.rows(lse, b),
                                .delta = delta,
                                .dq = no_dq_sum,
                                .dk = dk_sum,
                                .dv = dv_sum,
                                .dq_out = views.q_like(dq, b).data()},
                               p.softmax_scale, p.stream,
                               {.mode = deterministic ? device::determinism::deterministic : device::determinism::atomic});
    device::write_output<T>(dk_sum, views.kv_like(dk, b), p.stream);
    device::write_output<T>(dv_sum, views.kv_like(dv, b), p.stream);
  }
}

}  // namespace stria::python
