// SPDX-License-Identifier: Apache-2.0
// Umbrella header: everything in stria that builds with a plain C++20 compiler.
#pragma once

#include "stria/comm/host_threads.hpp"
#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/core/softmax_merge.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/core/tile.hpp"
#include "stria/engine/ring_engine.hpp"
#include "stria/estimator/block_mask.hpp"
#include "stria/estimator/dense.hpp"
#include "stria/estimator/select.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/estimator/vertical_slash_top_k.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/host/recall.hpp"
#include "stria/host/reference_attention.hpp"
#include "stria/host/ring_attention.hpp"
#include "stria/host/solver_attention.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/index/cost_model.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/index/local_index.hpp"
#include "stria/index/step_index.hpp"
#include "stria/index/stripe_balance.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/placed_stripes.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/solver/execution.hpp"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "stria/topology/solver.hpp"
#include "stria/version.hpp"

// Under nvcc the CUDA error checks come too (NCCL's only where nccl.h is reachable); the device
// layer is stria/sparse_attention.cuh (the front template) and the .cuh headers it includes.
#if defined(__CUDACC__)
#include "stria/core/cuda_check.cuh"
#if __has_include(<nccl.h>)
#include "stria/core/nccl_check.cuh"
#endif
#endif
