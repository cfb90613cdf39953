// SPDX-License-Identifier: Apache-2.0
// forward_tensors / backward_tensors: one rank's tensors of a layer's forward or backward, passed
// to the ring and solver calls as one argument (local shards; bf16 or fp16 with fp32 LSE).
#pragma once

#include "stria/core/tensor_view.hpp"

namespace stria {

/// One rank's forward: its queries and its own KV shard in, its output and LSE out.
template <class T>
struct forward_tensors {
  tensor_view<const T, 3> q;     // [S_local, Hq, D]
  tensor_view<const T, 3> k, v;  // [S_local_kv, Hkv, D]
  tensor_view<T, 3> out;         // [S_local, Hq, D]
  tensor_view<float, 2> lse;     // [Hq, S_local], natural log
};

/// One rank's backward: the forward's inputs and results and the incoming gradient d_out in; dq and
/// the complete dk, dv of the rank's own KV shard out.
template <class T>
struct backward_tensors {
  tensor_view<const T, 3> q, k, v;    // as forward_tensors
  tensor_view<const T, 3> out, d_out;  // [S_local, Hq, D]
  tensor_view<const float, 2> lse;     // [Hq, S_local]
  tensor_view<T, 3> dq;                // [S_local, Hq, D]
  tensor_view<T, 3> dk, dv;            // [S_local_kv, Hkv, D]
};

}  // namespace stria
