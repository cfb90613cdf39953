// SPDX-License-Identifier: Apache-2.0
// stria::sparse_attention: the front template on the device (DESIGN 3). Policies chosen at compile
// time (estimator, sharding, ring topology, tile); per layer: estimate() finds the sparse index from
// this rank's data and builds the rank's step indices, forward() and backward() run the ring on the
// caller's stream with the KV transfers on the object's own transfer stream. With topology::solver
// (sequential sharding only) estimate() also solves the layer's task placement, and forward() and
// backward() move query and KV chunks as the plan says (device/solver_attention.cuh). One object
// per rank, over any device_communicator that has the device_collectives too (comm::local_device,
// comm::nccl, or a user's own).
//
//   using attention = stria::sparse_attention<stria::estimator::vertical_slash_top_p,
//                                             stria::sharding::striped<64>, stria::topology::flat_ring>;
//   attention layer({}, {}, stria::topology::flat_ring(world), {seq_len, heads_q, heads_kv});
//   layer.estimate(comm, q, k, stream);
//   layer.forward(comm, q, k, v, out, lse, stream);
//   layer.backward(comm, q, k, v, out, d_out, lse, dq, dk, dv, stream);
#pragma once

#include <cmath>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_communicator.cuh"
#include "stria/core/error.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/core/tile.hpp"
#include "stria/device/ring_attention.cuh"
#include "stria/device/solver_attention.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/estimator/window_statistics.cuh"
#include "stria/index/local_index.cuh"
#include "stria/sharding/sequential.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/topology/ring_steps.hpp"
#include "stria/topology/solver.hpp"

namespace stria {

/// The global shape of one attention layer; every rank holds seq_len / world tokens of it.
struct attention_config {
  index_t seq_len = 0;
  index_t heads_q = 0;
  index_t heads_kv = 0;
  bool causal = true;
  double softmax_scale = 0;  // 0: 1 / sqrt(head_dim)
  device::determinism backward_mode = device::determinism::atomic;
  /// Checked mode: every ring step's merged O and LSE (backward: dQ and the travelling dK/dV), or
  /// with topology::solver every stage's results (the partials computed for other ranks before they
  /// travel, the rank's own after the merge), are checked on the device; the first NaN or infinity
  /// raises stria::non_finite_error naming the rank, step ("ring step 2", "solver stage 1"), head
  /// and token. Costs a pass over those tensors and a host synchronisation per step, so it is off by
  /// default.
  finite_check check = finite_check::off;
};

namespace detail {
/// The front template's topology: topology::solver, or a ring_topology checked member by member.
template <class Topology>
constexpr bool check_front_topology() {
  if constexpr (topology::is_dynamic_solver<Topology>) return true;
  else return check_ring_topology<Topology>();
}
}  // namespace detail

/// The policies are checked in the class body rather than constrained, so that a policy missing a
/// member fails with one message naming it (core/concepts.hpp's check_* functions).
template <class Estimator, class Sharding, class Topology, class Tile = tile<64, 64, 128>>
class sparse_attention {
  static_assert(check_index_estimator<Estimator>());
  static_assert(check_sharding_policy<Sharding>());
  static_assert(detail::check_front_topology<Topology>());
  static_assert(check_tile_traits<Tile>());
  static constexpr bool dynamic = topology::is_dynamic_solver<Topology>;
  static_assert(!dynamic || std::is_same_v<Sharding, sharding::sequential>,
                "topology::solver needs sharding::sequential: its plan moves the query and KV chunks of a sequential layout");

 public:
  using estimator_type = Estimator;
  using sharding_type = Sharding;
  using topology_type = Topology;
  using tile_type = Tile;

  sparse_attention(Estimator estimator, Sharding sharding, Topology topology, attention_config config)
      : estimator_(std::move(estimator)), sharding_(std::move(sharding)), topology_(std::move(topology)), config_(config) {
    if (config_.heads_q < 1) throw invalid_argument("config.heads_q", config_.heads_q, "must be at least 1");
    if (config_.heads_kv < 1 || config_.heads_q % config_.heads_kv != 0)
      throw invalid_argument("config.heads_kv", config_.heads_kv,
                             "must divide config.heads_q = " + std::to_string(config_.heads_q) + " (grouped-query attention)");
    if (config_.seq_len <= 0 || config_.seq_len % block_tokens != 0)
      throw invalid_argument("config.seq_len", config_.seq_len, "must be a positive multiple of 64 (the block size)");
    sharding_.validate({config_.seq_len / block_tokens, topology_.world_size()});
    if constexpr (dynamic) topology_.check_seq_len(config_.seq_len);
    estimator_.validate(config_.seq_len, config_.heads_q);
    if (config_.softmax_scale == 0) config_.softmax_scale = 1.0 / std::sqrt(double(Tile::head_dim));
  }

  [[nodiscard]] const attention_config& config() const { return config_; }
  [[nodiscard]] const Topology& topology() const { return topology_; }
  [[nodiscard]] const Sharding& sharding() const { return sharding_; }
  /// Tokens each rank holds.
  [[nodiscard]] index_t local_tokens() const { return config_.seq_len / topology_.world_size(); }
  /// This layer's task placement (after estimate(); topology::solver only): tasks per rank and stage
  /// (calc meta), chunk moves (comm meta), loads.
  [[nodiscard]] const solver::plan& plan() const
    requires dynamic
  {
    if (!plan_) throw invalid_argument("plan()", "(none)", "call estimate() or use_selection() first");
    return *plan_;
  }
  /// This layer's selection (after estimate()), on the device.
  [[nodiscard]] const device_selection& selection() const {
    if (!selection_) throw invalid_argument("selection()", "(none)", "call estimate() first");
    return *selection_;
  }

  /// Finds this layer's sparse index from the rank's shards q [S_local, Hq, D] and k [S_local, Hkv, D]
  /// (identical on every rank) and builds the rank's index for every ring step, on `stream`.
  template <class Comm, class T>
  void estimate(Comm& comm, tensor_view<const T, 3> q, tensor_view<const T, 3> k, cudaStream_t stream) {
    static_assert(check_device_communicator<Comm>());
    static_assert(check_device_collectives<Comm>());
    check_comm(comm);
    check_shard(q, config_.heads_q, "q");
    check_shard(k, config_.heads_kv, "k");
    forget();  // a failed estimate leaves no earlier layer's index behind
    adopt(comm.rank(), estimator::estimate_device(estimator_, comm, sharding_, config_.seq_len, config_.causal, q.data(), k.data(),
                                                  config_.heads_q, config_.heads_kv, Tile::head_dim, config_.softmax_scale, stream),
          stream);
  }

  /// Uses a given global selection instead of estimating one (a user block mask, a recorded index).
  template <class Comm>
  void use_selection(Comm& comm, const global_selection& g, cudaStream_t stream) {
    static_assert(check_device_communicator<Comm>());
    check_comm(comm);
    if (g.seq_len != config_.seq_len || g.num_heads() != config_.heads_q || g.causal != config_.causal)
      throw invalid_argument("selection", "(seq_len " + std::to_string(g.seq_len) + ", " + std::to_string(g.num_heads()) + " heads)",
                             "was built for another configuration: this layer has seq_len " + std::to_string(config_.seq_len) + " and " +
                                 std::to_string(config_.heads_q) + " query heads");
    forget();
    adopt(comm.rank(), device_selection(g, stream), stream);
  }

  /// out [S_local, Hq, D] and lse [Hq, S_local] (fp32, natural log) of the rank's queries.
  template <class Comm, class T>
  void forward(Comm& comm, tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v, tensor_view<T, 3> out,
               tensor_view<float, 2> lse, cudaStream_t stream) {
    static_assert(check_device_communicator<Comm>());
    const device::run_options run = checked_call(comm, q, k, v, stream);
    const forward_tensors<T> tensors{.q = q, .k = k, .v = v, .out = out, .lse = lse};
    if constexpr (dynamic)
      device::solver_forward<Tile::head_dim>(comm, *problem_, *plan_, solver_indices_, tensors, config_.softmax_scale, run);
    else
      device::ring_forward<Tile::head_dim>(comm, topology_, std::span<const device_step_index>(indices_), tensors, config_.softmax_scale, run);
  }

  /// dq [S_local, Hq, D] of the rank's queries, and dk, dv [S_local, Hkv, D] of its own keys and
  /// values (summed over every rank that used them).
  template <class Comm, class T>
  void backward(Comm& comm, tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v, tensor_view<const T, 3> out,
                tensor_view<const T, 3> d_out, tensor_view<const float, 2> lse, tensor_view<T, 3> dq, tensor_view<T, 3> dk,
                tensor_view<T, 3> dv, cudaStream_t stream) {
    static_assert(check_device_communicator<Comm>());
    const device::run_options run = checked_call(comm, q, k, v, stream);
    const backward_tensors<T> tensors{.q = q, .k = k, .v = v, .out = out, .d_out = d_out, .lse = lse, .dq = dq, .dk = dk, .dv = dv};
    if constexpr (dynamic)
      device::solver_backward<Tile::head_dim>(comm, *problem_, *plan_, solver_indices_, tensors, config_.softmax_scale, config_.backward_mode, run);
    else
      device::ring_backward<Tile::head_dim>(comm, topology_, std::span<const device_step_index>(indices_), tensors, config_.softmax_scale,
                                            config_.backward_mode, run);
  }

 private:
  template <class Comm>
  void check_comm(const Comm& comm) const {
    if constexpr (dynamic) {
      if (comm.world_size() != topology_.world_size())
        throw invalid_argument("comm.world_size()", comm.world_size(),
                               "must equal topology::solver's world size " + std::to_string(topology_.world_size()));
    } else {
      check_ring_world(comm.world_size(), topology_);
    }
  }

  void forget() {
    indices_.clear();
    selection_.reset();
    plan_.reset();
    problem_.reset();
    solver_indices_ = {};
  }

  /// This layer's selection and the rank's index for every ring step; with topology::solver, the
  /// layer's plan (the same on every rank: the selection and the solver are) and the indices of
  /// this rank's tasks. The plan is solved on the host from the selection's task areas.
  void adopt(index_t rank, device_selection selection, cudaStream_t stream) {
    selection_.emplace(std::move(selection));
    if constexpr (dynamic) {
      problem_.emplace(solver::problem_from_selection(selection_->to_host(stream), topology_.world_size(), topology_.chunks_per_rank(),
                                                      config_.heads_kv));
      plan_.emplace(solver::solve(*problem_, topology_.options()));
      solver_indices_ = device::build_solver_indices(*selection_, *problem_, *plan_, rank, stream);
    } else {
      indices_ = build_ring_indices_device(*selection_, sharding_, topology_, rank, stream);
    }
  }

  /// The checks forward() and backward() share, and their run options.
  template <class Comm, class T>
  device::run_options checked_call(const Comm& comm, tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
                                   cudaStream_t stream) const {
    check_comm(comm);
    if (!selection_) throw invalid_argument("forward/backward", "(no index)", "call estimate() or use_selection() first");
    check_shard(q, config_.heads_q, "q");
    check_shard(k, config_.heads_kv, "k");
    check_shard(v, config_.heads_kv, "v");
    return {stream, transfer_.get(), config_.check};
  }

  template <class T>
  void check_shard(tensor_view<const T, 3> x, index_t heads, const char* name) const {
    check_extents(x, {local_tokens(), heads, Tile::head_dim}, name);
  }

  Estimator estimator_;
  Sharding sharding_;
  Topology topology_;
  attention_config config_;
  cuda_stream transfer_;
  std::optional<device_selection> selection_;
  std::vector<device_step_index> indices_;  // ring topologies: one per step
  std::optional<solver::problem> problem_;  // topology::solver: the layer's problem, plan and task indices
  std::optional<solver::plan> plan_;
  device::solver_task_indices solver_indices_;
};

}  // namespace stria
