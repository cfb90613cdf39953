// SPDX-License-Identifier: Apache-2.0
// Cost model: one layer's predicted forward and backward time per rank and per ring step (or solver
// stage) on a cluster of N nodes x C GPUs, from the active entries and rows of each step, a kernel
// throughput table and the links' bandwidth and latency. Host only; nothing here runs a kernel.
//
// What it models, and why in this form:
//  - a step's kernel time = a call's fixed cost + active rows x the time measured for a row that
//    carries as much work (FLOPs of the executed entries per row), linear in the work between
//    one-step runs of several lengths and extended beyond them (fit_kernel_speed; without such runs,
//    executed FLOPs / effective throughput + active rows x a row's fixed cost + the call's). Executed
//    entries are the active ones plus the padding of the tiles that gather vertical tokens
//    (count_ring_vertical_padding, executed_entries): few tokens per rank leave those tiles nearly
//    empty, which the active entries alone do not show. The per-row and per-call costs are why a
//    step of 1/W of the work is not 1/W of the time (RESULTS.md, 2026-11-29, four GPUs, and
//    2026-12-05);
//  - a ring's forward also streams its fp32 running state: every step after the first reads the
//    old output before merging (running_state_bytes, at device memory speed), as do the solver's
//    forward tasks after a query chunk's first on a rank;
//  - ranks sharing one GPU (predict_shared_gpu): the forward's calls take turns, the backward's
//    fill each other's idle SMs (measured: RESULTS.md, 2026-12-05, sixth);
//  - a message takes latency + bytes / bandwidth on the link between its two GPUs (inner ring and
//    intra-node: NVLink; across nodes: the network);
//  - the schedule is simulated rank by rank as engine/ring_engine.hpp runs it on device/ring_attention.cuh:
//    step s's transfers leave when step s - 1's compute is done, a step computes once its chunk has
//    arrived (so compute of step i hides the transfer of step i + 1), dK/dV partials leave after a
//    step's compute and are due by the end of their ready step, a send meets its receive (both ends
//    post), and transfers on one stream go one after another. The hierarchical ring's outer transfer
//    is hidden behind a whole inner round when it has a stream of its own (DESIGN 5); the device
//    engine of this commit posts inner and outer transfers on one transfer stream, which
//    `transfer_streams::one_per_rank` models;
//  - the dynamic solver (DESIGN 9): stage 0 computes local tasks while the moves travel, stage 1 the
//    remote tasks, then partial outputs (backward: dQ, dK/dV) return to their owners.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "stria/solver/execution.hpp"
#include "stria/topology/flat_ring.hpp"

namespace stria::cost {

// ---------------------------------------------------------------------------------------------
// Kernels

/// A measured row: in a one-call run whose active rows each carried `flops_per_row` (FLOPs of the
/// executed entries over the active rows; a 64 x 64 tile is 4096 entries), a row took `row_ns`
/// beyond the call's fixed cost.
struct speed_point {
  double flops_per_row = 0;
  double row_ns = 0;
};

/// One direction (forward or backward) of the sparse kernels: a call's time is
/// call_us x 1e-6 + active_rows x (the curve's row time at the rows' mean work) where there is a
/// curve, else flops / (tflops x 1e12) + active_rows x row_ns x 1e-9 + call_us x 1e-6.
struct kernel_speed {
  double tflops = 0;   // effective: FLOPs of the executed entries (active + gathered tiles' padding), 4 D forward, 10 D backward
  double row_ns = 0;   // per active (query block, head) row and step: loading Q (and dO), writing the row
  double call_us = 0;  // per call: its launches (5 backward), their ramp and tail, the host's work between them
  /// A row's time by its work, ascending in flops_per_row and never falling (fit_kernel_speed):
  /// linear in the work between points, the end segments extended beyond them, and no faster per
  /// FLOP than the fastest point. The kernels lose per row in a way throughput + a row's fixed cost
  /// do not follow (a row of 2-4 tiles pays its prologue and epilogue nearly alone: RESULTS
  /// 2026-12-05, second), and a point holds its run's costs at the shape of a ring step with the same
  /// row work: a striped step over W ranks has the rows and the row work of a whole run of S / W.
  std::vector<speed_point> curve = {};

  /// One call's time. The ring engine calls the kernels at every step, an empty one too.
  [[nodiscard]] double seconds(double flops, double active_rows) const {
    if (!curve.empty() && active_rows > 0) return call_us * 1e-6 + active_rows * curve_row_ns(flops / active_rows) * 1e-9;
    return flops / (tflops * 1e12) + active_rows * row_ns * 1e-9 + call_us * 1e-6;
  }
  /// The curve's time for a row of `flops_per_row`.
  [[nodiscard]] double curve_row_ns(double flops_per_row) const {
    if (curve.empty()) throw invalid_argument("curve_row_ns: curve.size()", 0, "needs at least one point");
    double fastest = 0;  // FLOPs per ns
    for (const speed_point& p : curve) fastest = std::max(fastest, p.flops_per_row / p.row_ns);
    if (curve.size() == 1) return flops_per_row / fastest;
    const auto above = std::upper_bound(curve.begin() + 1, curve.end() - 1, flops_per_row, [](double w, const speed_point& p) { return w < p.flops_per_row; });
    const speed_point &a = *(above - 1), &b = *above;
    const double t = a.row_ns + (flops_per_row - a.flops_per_row) * (b.row_ns - a.row_ns) / (b.flops_per_row - a.flops_per_row);
    return std::max(t, flops_per_row / fastest);
  }
  void validate(const char* what) const {
    if (!(tflops > 0) || !std::isfinite(tflops)) throw invalid_argument(std::string(what) + ".tflops", tflops, "must be positive and finite");
    if (!(row_ns >= 0) || !std::isfinite(row_ns)) throw invalid_argument(std::string(what) + ".row_ns", row_ns, "must be >= 0 and finite");
    if (!(call_us >= 0) || !std::isfinite(call_us)) throw invalid_argument(std::string(what) + ".call_us", call_us, "must be >= 0 and finite");
    for (std::size_t i = 0; i < curve.size(); ++i) {
      const std::string at = std::string(what) + ".curve[" + std::to_string(i) + "]";
      if (!(curve[i].flops_per_row > (i == 0 ? 0.0 : curve[i - 1].flops_per_row)) || !std::isfinite(curve[i].flops_per_row))
        throw invalid_argument(at + ".flops_per_row", curve[i].flops_per_row, "must be finite and above the point before it (or 0)");
      if (!(curve[i].row_ns >= (i == 0 ? 0.0 : curve[i - 1].row_ns)) || !(curve[i].row_ns > 0) || !std::isfinite(curve[i].row_ns))
        throw invalid_argument(at + ".row_ns", curve[i].row_ns, "must be positive, finite and not below the point before it (more work never takes less time)");
    }
  }
};

/// The kernels' speed for one head dim.
struct kernel_throughput {
  index_t head_dim = 128;
  kernel_speed forward;
  kernel_speed backward;
  /// Device memory bandwidth (1e9 bytes per second) at which a ring's forward streams its fp32
  /// running state (running_state_bytes): the H200's copy ceiling, 4.2 TB/s (ANCHORS.md).
  double memory_gbytes_per_s = 4200;

  /// Seconds to stream `bytes` through device memory at that speed.
  [[nodiscard]] double memory_seconds(double bytes) const { return bytes / (memory_gbytes_per_s * 1e9); }

  void validate() const {
    if (head_dim != 64 && head_dim != 128) throw invalid_argument("kernel_throughput.head_dim", head_dim, "must be 64 or 128");
    if (!(memory_gbytes_per_s >= 1e-6) || !std::isfinite(memory_gbytes_per_s))
      throw invalid_argument("kernel_throughput.memory_gbytes_per_s", memory_gbytes_per_s, "must be finite and at least 1e-6");
    forward.validate("kernel_throughput.forward");
    backward.validate("kernel_throughput.backward");
  }
};

/// One measured run of a kernel over a whole sequence on one GPU (one ring step, one call): the
/// FLOPs of its executed entries, its active rows (S / 64 x Hq where every row has work) and its time.
struct kernel_sample {
  double flops = 0;
  double active_rows = 0;
  double seconds = 0;
};

/// The kernel_speed that fits `samples` best in relative error (each sample's error divided by its
/// time, so a 32K run counts as much as a 512K one). Its three terms grow differently with the length
/// (FLOPs as S^2 at a fixed density, rows as S, the call's cost not at all), so runs of three lengths
/// can tell them apart. A term that such a fit leaves negative, or that the runs cannot tell apart,
/// is dropped: of the fits with fewer terms the one with the smaller error wins, and where both fit
/// exactly (two lengths) the row cost is kept (DESIGN's per-row work; the call's cost needs a third
/// length to show). One run gives the plain throughput. The curve holds every run's time per row
/// beyond the call's cost, by its rows' work (kernel_speed::curve).
inline kernel_speed fit_kernel_speed(std::span<const kernel_sample> samples) {
  if (samples.empty()) throw invalid_argument("fit_kernel_speed: samples.size()", 0, "needs at least one measured run");
  for (const kernel_sample& x : samples)
    if (!(x.flops > 0 && x.seconds > 0 && x.active_rows >= 0) || !std::isfinite(x.flops + x.seconds + x.active_rows))
      throw invalid_argument("fit_kernel_speed: sample seconds", x.seconds, "needs flops > 0, seconds > 0 and active_rows >= 0, all finite");
  // Unknowns: 1 / (tflops x 1e12), row_ns x 1e-9, call_us x 1e-6; a sample's row is its
  // (flops, rows, 1) / seconds, its target 1. Least squares over the terms in `use`.
  using terms = std::array<double, 3>;
  auto solve = [&](std::array<bool, 3> use) -> std::optional<terms> {
    std::vector<std::size_t> term;  // the unknowns in use
    for (std::size_t j = 0; j < 3; ++j)
      if (use[j]) term.push_back(j);
    const std::size_t n = term.size();
    if (samples.size() < n) return std::nullopt;
    std::array<std::array<double, 4>, 3> m{};  // the normal equations, n x (n + 1)
    for (const kernel_sample& x : samples) {
      const terms a{x.flops / x.seconds, x.active_rows / x.seconds, 1.0 / x.seconds};
      for (std::size_t r = 0; r < n; ++r) {
        for (std::size_t c = 0; c < n; ++c) m[r][c] += a[term[r]] * a[term[c]];
        m[r][n] += a[term[r]];
      }
    }
    terms diagonal{};  // before elimination: what a pivot is judged against
    for (std::size_t r = 0; r < n; ++r) diagonal[r] = m[r][r];
    for (std::size_t c = 0; c < n; ++c) {  // Gauss-Jordan on a symmetric positive semi-definite matrix
      if (!(m[c][c] > 1e-12 * diagonal[c])) return std::nullopt;  // a term the runs cannot tell apart
      for (std::size_t r = 0; r < n; ++r)
        if (r != c) {
          const double f = m[r][c] / m[c][c];
          for (std::size_t j = c; j <= n; ++j) m[r][j] -= f * m[c][j];
        }
    }
    terms u{};
    for (std::size_t r = 0; r < n; ++r) u[term[r]] = m[r][n] / m[r][r];
    if (!(u[0] > 0) || u[1] < 0 || u[2] < 0) return std::nullopt;
    return u;
  };
  auto squared_error = [&](const terms& u) {
    double sum = 0;
    for (const kernel_sample& x : samples) {
      const double e = (u[0] * x.flops + u[1] * x.active_rows + u[2]) / x.seconds - 1.0;
      sum += e * e;
    }
    return sum;
  };
  std::optional<terms> best = solve({true, true, true});
  if (!best)
    for (const std::array<bool, 3> use : {std::array{true, true, false}, std::array{true, false, true}})  // ties keep the first
      if (const std::optional<terms> u = solve(use); u && (!best || squared_error(*u) < squared_error(*best) - 1e-12)) best = u;
  if (!best) best = solve({true, false, false});
  if (!best)  // positive samples always give a positive throughput alone
    throw invalid_argument("fit_kernel_speed: samples.size()", samples.size(), "gave no positive throughput");
  kernel_speed fit{1.0 / ((*best)[0] * 1e12), (*best)[1] * 1e9, (*best)[2] * 1e6, {}};
  // The curve: each run's time beyond the fitted call cost, per row, by its rows' work; runs whose
  // works lie within 0.1% pooled (one length and pattern, whose FLOPs files give as TF x ms,
  // rounded); a row's time never falls as its work grows (the larger of it and the points before).
  std::vector<kernel_sample> by_work;
  for (const kernel_sample& x : samples)
    if (x.active_rows > 0) by_work.push_back(x);
  std::sort(by_work.begin(), by_work.end(), [](const kernel_sample& a, const kernel_sample& b) { return a.flops / a.active_rows < b.flops / b.active_rows; });
  for (std::size_t i = 0; i < by_work.size();) {
    const double work = by_work[i].flops / by_work[i].active_rows;
    double rows = 0, beyond_calls = 0;
    for (; i < by_work.size() && by_work[i].flops / by_work[i].active_rows <= work * 1.001; ++i)
      rows += by_work[i].active_rows, beyond_calls += std::max(by_work[i].seconds - fit.call_us * 1e-6, 0.01 * by_work[i].seconds);
    const double row_ns = std::max(beyond_calls / rows * 1e9, fit.curve.empty() ? 0.0 : fit.curve.back().row_ns);
    fit.curve.push_back({work, row_ns});
  }
  return fit;
}

/// Defaults for the H200: fit_kernel_speed over the bare `vs95` rows of
/// tests/bench/results/attention_lengths_h200.json (89a7cd3: 4K to 128K) and attention_h200.json
/// (481fc28: 32K, 128K, 512K; RESULTS 2026-12-06, third), pooled (bf16, Hq 16, Hkv 2, atomic
/// backward, dS stored at D 128), each row's executed entries counted on the selection it ran. D 64
/// has one run (128K): the plain throughput, its row and call costs unknown and counted as 0, and a
/// one-point curve through it.
/// `plan --throughput FILE,FILE` fits files instead; a test checks these numbers against the files.
inline kernel_throughput h200_kernel_throughput(index_t head_dim) {
  if (head_dim == 128)
    return {.head_dim = 128,
            .forward = {.tflops = 449.9243, .row_ns = 13.7724, .call_us = 21.0545,
                        .curve = {{5.618576e+06, 25.2398}, {8.966526e+06, 35.5691}, {1.554303e+07, 50.6459}, {2.896667e+07, 75.0971},
                                  {5.514312e+07, 132.8824}, {1.080562e+08, 257.1852}, {4.265192e+08, 996.7380}}},
            .backward = {.tflops = 415.2912, .row_ns = 39.4102, .call_us = 152.4573,
                         .curve = {{1.405076e+07, 55.7058}, {2.241989e+07, 119.5521}, {3.885322e+07, 173.9362}, {7.241972e+07, 187.1451},
                                   {1.378570e+08, 366.1342}, {2.701401e+08, 712.1122}, {1.066298e+09, 2819.9130}}}};
  if (head_dim == 64)
    return {.head_dim = 64,
            .forward = {.tflops = 330.7594, .row_ns = 0, .call_us = 0, .curve = {{5.397350e+07, 163.1805}}},
            .backward = {.tflops = 277.0299, .row_ns = 0, .call_us = 0, .curve = {{1.349329e+08, 487.0697}}}};
  throw invalid_argument("head_dim", head_dim, "must be 64 or 128");
}

// ---------------------------------------------------------------------------------------------
// Links and the cluster

/// One direction of one GPU's link to its peer.
struct link {
  double gbytes_per_s = 0;  // 1e9 bytes per second
  double latency_us = 0;    // per message, start to first byte (NCCL's launch and handshake included)

  [[nodiscard]] double seconds(double bytes) const { return latency_us * 1e-6 + bytes / (gbytes_per_s * 1e9); }
  void validate(const char* what) const {
    // Bounded so that a layer's times stay finite: 1e-300 GB/s made every transfer infinite.
    if (!(gbytes_per_s >= 1e-6) || !std::isfinite(gbytes_per_s))
      throw invalid_argument(std::string(what) + ".gbytes_per_s", gbytes_per_s, "must be finite and at least 1e-6 (1 kB/s)");
    if (!(latency_us >= 0) || !(latency_us <= 1e9))
      throw invalid_argument(std::string(what) + ".latency_us", latency_us, "must lie in [0, 1e9] (1000 s)");
  }
};

/// H200 NVLink between two GPUs of one node, as NCCL send/recv achieves it: 238 GB/s measured on
/// two H200s (RESULTS.md, 2026-11-29, two GPUs: 320 MiB of KV + dK/dV in 1.41 ms; the link's
/// nominal rate is 450 GB/s per direction, NVIDIA's H200 datasheet: 900 GB/s bidirectional). The
/// latency is an assumption (the order of one NCCL send/recv's launch); at the tens of MiB a ring
/// step moves it hardly matters.
inline constexpr link h200_nvlink{.gbytes_per_s = 238.0, .latency_us = 10.0};
/// One 400 Gb/s InfiniBand NDR port per GPU (as in NVIDIA's DGX H100/H200 systems): the line rate,
/// 50 GB/s per direction, an upper bound a job does not quite reach; the latency an assumption.
inline constexpr link infiniband_400g{.gbytes_per_s = 50.0, .latency_us = 20.0};

/// Which transfers share a queue: each rank's transfers on one stream, one after another (the device
/// ring engine of this commit), or the inner and the outer ring on a stream each (DESIGN 5).
enum class transfer_streams : unsigned char { one_per_rank, one_per_link };

/// N nodes x C GPUs; rank = node x C + card, as hierarchical_ring numbers them.
struct cluster {
  index_t nodes = 1;
  index_t gpus_per_node = 8;
  link intra_node = h200_nvlink;
  link inter_node = infiniband_400g;
  transfer_streams streams = transfer_streams::one_per_link;

  [[nodiscard]] index_t world_size() const { return nodes * gpus_per_node; }
  [[nodiscard]] index_t node_of(index_t rank) const { return rank / gpus_per_node; }
  [[nodiscard]] const link& between(index_t from_rank, index_t to_rank) const {
    return node_of(from_rank) == node_of(to_rank) ? intra_node : inter_node;
  }
  void validate() const {
    if (nodes < 1) throw invalid_argument("cluster.nodes", nodes, "must be at least 1");
    if (gpus_per_node < 1) throw invalid_argument("cluster.gpus_per_node", gpus_per_node, "must be at least 1");
    if (const std::int64_t ranks = std::int64_t{nodes} * gpus_per_node; ranks > max_world_size)
      throw invalid_argument("cluster nodes x gpus_per_node", ranks, "must be at most " + std::to_string(max_world_size) + " GPUs");
    intra_node.validate("cluster.intra_node");
    inter_node.validate("cluster.inter_node");
  }
};

// ---------------------------------------------------------------------------------------------
// What travels

/// The attention shape a layer moves: global tokens, heads, head dim, bf16/fp16 tensors.
struct layer_shape {
  index_t seq_len = 0;
  index_t heads_q = 16;
  index_t heads_kv = 2;
  index_t head_dim = 128;
  index_t element_bytes = 2;  // bf16

  /// A KV chunk of `tokens` tokens: K and V (DESIGN 5: the forward's message).
  [[nodiscard]] double kv_bytes(std::int64_t tokens) const { return double(tokens) * heads_kv * head_dim * 2.0 * element_bytes; }
  /// Its dK and dV partial sums, fp32 (DESIGN 2: the partials that travel are fp32).
  [[nodiscard]] double kv_gradient_bytes(std::int64_t tokens) const { return double(tokens) * heads_kv * head_dim * 2.0 * 4.0; }
  /// A query chunk of `tokens` tokens (Q, or dO) in the element type.
  [[nodiscard]] double query_bytes(std::int64_t tokens) const { return double(tokens) * heads_q * head_dim * element_bytes; }
  /// A query chunk's fp32 partial (O or dQ) and its fp32 per-row statistic (LSE, or delta).
  [[nodiscard]] double query_partial_bytes(std::int64_t tokens) const { return double(tokens) * heads_q * (head_dim + 1) * 4.0; }

  void validate() const {
    if (seq_len < block_tokens || seq_len % block_tokens != 0) throw invalid_argument("layer_shape.seq_len", seq_len, "must be a positive multiple of 64");
    if (heads_q < 1 || heads_kv < 1 || heads_q % heads_kv != 0)
      throw invalid_argument("layer_shape.heads_kv", heads_kv, "must be >= 1 and divide heads_q = " + std::to_string(heads_q));
    if (head_dim != 64 && head_dim != 128) throw invalid_argument("layer_shape.head_dim", head_dim, "must be 64 or 128");
    if (element_bytes != 2) throw invalid_argument("layer_shape.element_bytes", element_bytes, "must be 2 (bf16 or fp16)");
  }
};

// ---------------------------------------------------------------------------------------------
// Active rows per (rank, step)

/// How many (local query block, head) rows have any work at each (rank, step): a row of query block
/// q meets KV rank k's chunk when a selected slash diagonal or block puts an active tile of k's on
/// it, or a vertical token of k's lies in range (causal: in a block below q; a token in q's own
/// block is inside the diagonal tile, which is always active). Returned as a ring_workload whose
/// `entries` count rows. O(heads x (blocks x slash lines + W^2)).
template <sharding_policy Sharding, ring_topology Topology>
ring_workload count_ring_rows(const global_selection& selection, const Sharding& sharding, const Topology& topology) {
  const detail::ring_lookup lookup = detail::ring_lookup::checked(selection, sharding, topology);
  const index_t nb = selection.num_blocks(), world = topology.world_size(), steps = topology.num_steps();
  const auto at = [](index_t i, index_t j, index_t n) { return static_cast<std::size_t>(i) * static_cast<std::size_t>(n) + static_cast<std::size_t>(j); };
  const std::vector<index_t>& owner = lookup.owner;

  ring_workload rows{world, steps, std::vector<std::int64_t>(static_cast<std::size_t>(world) * static_cast<std::size_t>(steps), 0)};
  auto add = [&](index_t query_rank, index_t kv_rank, std::int64_t n) { rows.entries[at(query_rank, lookup.step(query_rank, kv_rank), steps)] += n; };

  constexpr index_t none = std::numeric_limits<index_t>::max();
  std::vector<index_t> first_vertical(static_cast<std::size_t>(world));  // per KV rank: its lowest key block with a token
  std::vector<index_t> stamp(static_cast<std::size_t>(world), -1);      // the query block a KV rank was last counted for
  std::vector<std::int64_t> owned(static_cast<std::size_t>(world));      // query blocks per rank walked so far
  std::vector<index_t> by_first(static_cast<std::size_t>(world));
  std::vector<block_pair> blocks;
  for (const head_selection& head : selection.heads) {
    std::fill(first_vertical.begin(), first_vertical.end(), none);
    for (const index_t token : head.vertical_tokens) {
      const index_t k_block = token / block_tokens;
      index_t& f = first_vertical[static_cast<std::size_t>(owner[static_cast<std::size_t>(k_block)])];
      f = std::min(f, k_block);
    }
    const auto vertical_meets = [&](index_t q_block, index_t kv_rank) {
      const index_t f = first_vertical[static_cast<std::size_t>(kv_rank)];
      return f != none && (!selection.causal || f < q_block);
    };
    // Rows met through vertical tokens, per (query rank, KV rank): the query rank's blocks above
    // (causal) the KV rank's first token block, counted in one walk up the blocks.
    std::iota(by_first.begin(), by_first.end(), 0);
    std::sort(by_first.begin(), by_first.end(), [&](index_t a, index_t b) { return first_vertical[static_cast<std::size_t>(a)] < first_vertical[static_cast<std::size_t>(b)]; });
    std::fill(owned.begin(), owned.end(), 0);
    std::vector<std::int64_t> total(static_cast<std::size_t>(world), 0);
    for (index_t b = 0; b < nb; ++b) ++total[static_cast<std::size_t>(owner[static_cast<std::size_t>(b)])];
    index_t walked = 0;  // blocks [0, walked) counted in `owned`
    for (const index_t kv : by_first) {
      const index_t f = first_vertical[static_cast<std::size_t>(kv)];
      if (f == none) break;
      const index_t upto = selection.causal ? f + 1 : 0;  // causal: rows above f; else every row
      for (; walked < upto; ++walked) ++owned[static_cast<std::size_t>(owner[static_cast<std::size_t>(walked)])];
      for (index_t r = 0; r < world; ++r) add(r, kv, total[static_cast<std::size_t>(r)] - owned[static_cast<std::size_t>(r)]);
    }
    // Rows met only through tiles (slash diagonals, explicit blocks), each (row, KV rank) once.
    blocks = head.blocks;  // sorted by (query_block, key_block): validate() checked it
    std::size_t next_block = 0;
    std::fill(stamp.begin(), stamp.end(), -1);
    for (index_t q = 0; q < nb; ++q) {
      const index_t r = owner[static_cast<std::size_t>(q)];
      auto meet = [&](index_t k_block) {
        const index_t kv = owner[static_cast<std::size_t>(k_block)];
        if (stamp[static_cast<std::size_t>(kv)] == q || vertical_meets(q, kv)) return;
        stamp[static_cast<std::size_t>(kv)] = q;
        add(r, kv, 1);
      };
      for (const index_t delta : head.slash_deltas) {
        const index_t k_block = q - delta;
        if (k_block >= 0 && k_block < nb) meet(k_block);
      }
      for (; next_block < blocks.size() && blocks[next_block].query_block == q; ++next_block) meet(blocks[next_block].key_block);
    }
  }
  return rows;
}

/// Entries the kernels compute but mask, per (rank, step): a row's vertical tokens in a step's KV
/// chunk are gathered into tiles of 64 key columns, so v tokens cost ceil(v / 64) whole tiles and
/// (64 ceil(v / 64) - v) x 64 entries are padding (the forward's and the dQ pass's; executed_entries
/// says why the backward counts the same). The fewer tokens a rank holds, the fewer of a
/// row's vertical tokens each chunk has and the emptier those tiles (vs95, striped: 1% of the active
/// entries at 128K tokens per rank, 8% at 16K, 34% at 4K). Counted exactly as build_ring_indices
/// lays the tokens out (tokens inside one of the row's active tiles are not gathered), in
/// O(heads x (vertical token blocks x W + blocks x slash lines + W^2)).
template <sharding_policy Sharding, ring_topology Topology>
ring_workload count_ring_vertical_padding(const global_selection& selection, const Sharding& sharding, const Topology& topology) {
  const detail::ring_lookup lookup = detail::ring_lookup::checked(selection, sharding, topology);
  const index_t nb = selection.num_blocks(), world = topology.world_size(), steps = topology.num_steps();
  const auto n = static_cast<std::size_t>(world);
  // Two layouts, each contiguous where its loop walks: the rows' padding at a change of one KV
  // rank's tokens, [KV rank, query rank]; one row's corrections over many KV ranks, [query rank, KV rank].
  const auto by_kv = [n](std::size_t query_rank, std::size_t kv_rank) { return kv_rank * n + query_rank; };
  const auto by_query = [n](std::size_t query_rank, std::size_t kv_rank) { return query_rank * n + kv_rank; };
  const auto padding_of = [](std::int64_t tokens) { return (block_tokens - tokens % block_tokens) % block_tokens; };  // key columns

  std::vector<std::int64_t> padding(n * n, 0), corrections(n * n, 0);  // padded key columns summed over rows: by_kv, by_query
  std::vector<std::int64_t> tokens_in(static_cast<std::size_t>(nb), 0), gathered(n), owned(n);  // owned: query blocks walked per rank
  std::vector<std::int64_t> excluded(n, 0);  // per KV rank: tokens inside one row's active tiles
  std::vector<index_t> touched;              // the KV ranks with excluded tokens in this row
  for (const head_selection& head : selection.heads) {
    std::fill(tokens_in.begin(), tokens_in.end(), 0);
    for (const index_t token : head.vertical_tokens) ++tokens_in[static_cast<std::size_t>(token / block_tokens)];
    std::fill(owned.begin(), owned.end(), 0);
    std::fill(gathered.begin(), gathered.end(), 0);
    // gathered[k]: the vertical tokens of KV rank k a row of the current query block sees (causal:
    // those before the block; else all). While it stays constant its padding accrues on every row
    // walked; at a change, adding (old - new) padding x the rows walked so far keeps the sum exact
    // (a telescoping sum: no per-row work for the W chunks).
    auto change = [&](index_t kv, std::int64_t tokens) {
      const auto k = static_cast<std::size_t>(kv);
      const std::int64_t before = padding_of(gathered[k]);
      gathered[k] += tokens;
      const std::int64_t delta = before - padding_of(gathered[k]);
      if (delta != 0)
        for (std::size_t r = 0; r < n; ++r) padding[by_kv(r, k)] += delta * owned[r];
    };
    if (!selection.causal)
      for (index_t b = 0; b < nb; ++b)
        if (tokens_in[static_cast<std::size_t>(b)] > 0) change(lookup.owner[static_cast<std::size_t>(b)], tokens_in[static_cast<std::size_t>(b)]);
    std::size_t next_block = 0;
    for (index_t q = 0; q < nb; ++q) {
      if (selection.causal && q > 0 && tokens_in[static_cast<std::size_t>(q - 1)] > 0)
        change(lookup.owner[static_cast<std::size_t>(q - 1)], tokens_in[static_cast<std::size_t>(q - 1)]);
      const index_t r = lookup.owner[static_cast<std::size_t>(q)];
      // Tokens inside the row's active tiles are not gathered: correct this row's padding for them.
      auto exclude = [&](index_t k_block) {
        if (k_block < 0 || k_block >= nb || (selection.causal && k_block >= q)) return;
        const std::int64_t tokens = tokens_in[static_cast<std::size_t>(k_block)];
        if (tokens == 0) return;
        const index_t kv = lookup.owner[static_cast<std::size_t>(k_block)];
        if (excluded[static_cast<std::size_t>(kv)] == 0) touched.push_back(kv);
        excluded[static_cast<std::size_t>(kv)] += tokens;
      };
      for (const index_t delta : head.slash_deltas) exclude(q - delta);
      for (; next_block < head.blocks.size() && head.blocks[next_block].query_block == q; ++next_block) {
        const index_t k_block = head.blocks[next_block].key_block;  // a tile both explicit and on a slash counts once
        if (!std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), q - k_block)) exclude(k_block);
      }
      for (const index_t kv : touched) {
        const std::int64_t seen = gathered[static_cast<std::size_t>(kv)];
        corrections[by_query(static_cast<std::size_t>(r), static_cast<std::size_t>(kv))] += padding_of(seen - excluded[static_cast<std::size_t>(kv)]) - padding_of(seen);
        excluded[static_cast<std::size_t>(kv)] = 0;
      }
      touched.clear();
      ++owned[static_cast<std::size_t>(r)];
    }
    for (std::size_t k = 0; k < n; ++k)
      for (std::size_t r = 0; r < n; ++r) padding[by_kv(r, k)] += padding_of(gathered[k]) * owned[r];
  }
  ring_workload out{world, steps, std::vector<std::int64_t>(n * static_cast<std::size_t>(steps), 0)};
  for (index_t r = 0; r < world; ++r)
    for (index_t k = 0; k < world; ++k)
      out.entries[static_cast<std::size_t>(r) * static_cast<std::size_t>(steps) + static_cast<std::size_t>(lookup.step(r, k))] +=
          (padding[by_kv(static_cast<std::size_t>(r), static_cast<std::size_t>(k))] + corrections[by_query(static_cast<std::size_t>(r), static_cast<std::size_t>(k))]) *
          block_tokens;  // each padded key column spans the block's 64 query rows
  return out;
}

/// A flat ring's counts (entries or rows per (rank, step)) in the step order of another ring of the
/// same ranks: what a rank computes with one KV chunk does not depend on when it meets it.
template <ring_topology Topology>
ring_workload reschedule(const ring_workload& flat, const Topology& topology) {
  flat.validate("reschedule: workload");
  const index_t w = topology.world_size();
  if (flat.world_size != w || flat.num_steps != w)
    throw invalid_argument("reschedule: workload world_size", flat.world_size, "must be a flat ring's counts over the topology's " + std::to_string(w) + " ranks");
  ring_workload out{w, topology.num_steps(), std::vector<std::int64_t>(flat.entries.size())};
  for (index_t r = 0; r < w; ++r)
    for (index_t s = 0; s < out.num_steps; ++s)  // the flat ring meets KV rank k at step (r - k) mod W
      out.entries[static_cast<std::size_t>(r) * static_cast<std::size_t>(out.num_steps) + static_cast<std::size_t>(s)] =
          flat.at(r, ((r - topology.kv_source_rank(r, s)) % w + w) % w);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Predictions

/// One ring step (or solver stage), over all ranks.
struct step_prediction {
  double compute_seconds = 0;   // the busiest rank's kernels at this step
  double transfer_seconds = 0;  // the longest transit (queueing + latency + bytes on the link) of a message due at this step
  double wait_seconds = 0;      // the longest a rank stood idle at this step, waiting for a message or a late peer
  bool communication_bound = false;  // some message due here was longer in transit than the compute it could hide behind
};

/// One phase (forward or backward) of a layer.
struct phase_prediction {
  double seconds = 0;  // the slowest rank's end
  std::vector<step_prediction> steps;
  std::vector<double> rank_compute_seconds;  // [W] each rank's kernels, summed over its steps

  [[nodiscard]] index_t communication_bound_steps() const {
    return static_cast<index_t>(std::count_if(steps.begin(), steps.end(), [](const step_prediction& s) { return s.communication_bound; }));
  }
  [[nodiscard]] double busiest_compute_seconds() const {
    return rank_compute_seconds.empty() ? 0.0 : *std::max_element(rank_compute_seconds.begin(), rank_compute_seconds.end());
  }
};

struct layer_prediction {
  phase_prediction forward;
  phase_prediction backward;
  [[nodiscard]] double seconds() const { return forward.seconds + backward.seconds; }
};

/// FLOPs per active entry: 4 D forward (QK^T, PV), 2.5x that backward (workload.hpp's convention).
inline double entry_flops(index_t head_dim, bool backward) { return (backward ? backward_flops(1, head_dim) : forward_flops(1, head_dim)); }

/// Entries a step's kernels compute: the active ones and the padding of the tiles that gather
/// vertical tokens. The forward's padding is count_ring_vertical_padding's; the backward's dQ pass
/// walks the same tiles, and its dK/dV pass groups a head's distinct vertical tokens 64 at a time
/// over the union of their query blocks, whose empty columns come to nearly the same count (within
/// 0.3% of the active entries on built striped vs95 indices), so both directions count that padding.
inline double executed_entries(std::int64_t active, std::int64_t vertical_padding) { return double(active) + double(vertical_padding); }

/// Bytes of the fp32 running output of `tokens` query tokens that a merging forward call reads
/// beyond what an overwriting call moves (the kernel speeds are fitted on those: attention_bench's
/// runs write the fp32 output and the LSE once). The LSE (1 / D of it) is left out.
inline double running_state_read_bytes(const layer_shape& shape, std::int64_t tokens) {
  return 4.0 * double(tokens) * double(shape.heads_q) * double(shape.head_dim);
}

/// Bytes a ring's forward call at `step` of `steps` moves to and from the fp32 running output beyond
/// an overwriting call: the first step overwrites (nothing more); every later step reads the old
/// output (running_state_read_bytes). The last step writes T in place of fp32, 2 bytes an element
/// fewer, but ran as long as a middle step (attention_bench --ring-steps, RESULTS.md 2026-12-05,
/// sixth), so that saving is not counted; nor is a one-step ring's (its output goes out in T).
/// Every row of the rank counts, active or not: the forward's grid covers them all.
inline double running_state_bytes(const layer_shape& shape, std::int64_t local_tokens, index_t step, index_t steps) {
  return steps <= 1 || step == 0 ? 0.0 : running_state_read_bytes(shape, local_tokens);
}

namespace detail {

/// A ring's counts per (rank, step) as the predictions read them: entries, rows and padding (empty:
/// none), each checked against the ring's shape.
struct ring_counts {
  const ring_workload& entries;
  const ring_workload& rows;
  const ring_workload& padding;

  ring_counts(const ring_workload& e, const ring_workload& r, const ring_workload& p, index_t world, index_t steps)
      : entries(e), rows(r), padding(p) {
    entries.validate("entries");
    rows.validate("rows");
    if (!padding.entries.empty()) padding.validate("vertical_padding");
    if (entries.world_size != world || entries.num_steps != steps || rows.world_size != world || rows.num_steps != steps)
      throw invalid_argument("workload world_size", entries.world_size, "the entries and rows must be counted for this topology");
    if (!padding.entries.empty() && (padding.world_size != world || padding.num_steps != steps))
      throw invalid_argument("vertical_padding world_size", padding.world_size, "must be counted for this topology, as the entries are");
  }
  [[nodiscard]] double executed(index_t rank, index_t step) const {
    return executed_entries(entries.at(rank, step), padding.entries.empty() ? 0 : padding.at(rank, step));
  }
  /// One (rank, step)'s kernel call.
  [[nodiscard]] double seconds(const kernel_speed& speed, double flops_per_entry, index_t rank, index_t step) const {
    return speed.seconds(flops_per_entry * executed(rank, step), double(rows.at(rank, step)));
  }
};

/// What arrives for which step, per rank: the latest message due there, its transit (from its
/// sender's post to its arrival, queueing included) and its sender's post time. Times in seconds
/// from the phase's start.
struct arrivals {
  index_t steps;
  std::vector<double> at, transit, posted;  // [W, steps + 1]

  arrivals(index_t world, index_t num_steps)
      : steps(num_steps), at(static_cast<std::size_t>(world) * static_cast<std::size_t>(num_steps + 1), 0.0), transit(at.size(), 0.0), posted(at.size(), 0.0) {}
  [[nodiscard]] std::size_t slot(index_t rank, index_t step) const {
    return static_cast<std::size_t>(rank) * static_cast<std::size_t>(steps + 1) + static_cast<std::size_t>(std::min(step, steps));
  }
};

/// Posts item `item` of every rank's transfer list, each rank at post_time[rank]: a send starts when
/// both ends have posted and both ends' queues are free; a rank's queue is busy until its send and
/// its receive are done (one NCCL group). queue_free: [W, 2], the inner and the outer queue.
template <class ListOf>
void post_transfers(std::vector<double>& queue_free, arrivals& due, const cluster& c, ListOf list_of, int item, std::span<const double> post_time,
                    double bytes) {
  const auto w = static_cast<index_t>(post_time.size());
  std::vector<double> done(static_cast<std::size_t>(w), -1.0);  // group end per rank; -1: nothing posted
  const std::vector<double> free_before(queue_free);
  auto queue = [&](index_t rank, ring_channel ch) {
    return static_cast<std::size_t>(rank) * 2 + (c.streams == transfer_streams::one_per_link && ch == ring_channel::outer ? 1 : 0);
  };
  for (index_t r = 0; r < w; ++r) {
    const transfer_list list = list_of(r);
    if (item >= list.count) continue;
    const ring_transfer& t = list.items[item];
    const index_t to = t.send_to;
    const double posted = post_time[static_cast<std::size_t>(r)];
    const double start = std::max({posted, post_time[static_cast<std::size_t>(to)], free_before[queue(r, t.channel)], free_before[queue(to, t.channel)]});
    const double end = start + c.between(r, to).seconds(bytes);
    done[static_cast<std::size_t>(r)] = std::max(done[static_cast<std::size_t>(r)], end);
    done[static_cast<std::size_t>(to)] = std::max(done[static_cast<std::size_t>(to)], end);
    const std::size_t d = due.slot(to, t.ready_step);
    if (end > due.at[d]) due.at[d] = end, due.transit[d] = end - posted, due.posted[d] = posted;
  }
  for (index_t r = 0; r < w; ++r) {
    const transfer_list list = list_of(r);
    if (item < list.count) {
      double& q = queue_free[queue(r, list.items[item].channel)];
      q = std::max(q, done[static_cast<std::size_t>(r)]);
    }
  }
}

/// Adds the messages due at `step` to its record: one is communication-bound when its transit
/// exceeds the time from its sender's post to when the receiver was ready for it.
inline void record_due(const arrivals& due, index_t step, std::span<const double> ready, step_prediction& out) {
  for (index_t r = 0; r < static_cast<index_t>(ready.size()); ++r) {
    const std::size_t d = due.slot(r, step);
    if (due.transit[d] <= 0) continue;
    out.transfer_seconds = std::max(out.transfer_seconds, due.transit[d]);
    if (due.at[d] > ready[static_cast<std::size_t>(r)] && due.transit[d] > ready[static_cast<std::size_t>(r)] - due.posted[d] + 1e-12)
      out.communication_bound = true;
  }
}

}  // namespace detail

/// Predicts one layer of a ring: `entries`, `rows` and `vertical_padding` per (rank, step)
/// (count_ring_workload, count_ring_rows, count_ring_vertical_padding; an empty padding counts as
/// none) under `topology`, on `c` (c.world_size() == topology.world_size()).
template <ring_topology Topology>
layer_prediction predict_ring(const ring_workload& entries, const ring_workload& rows, const Topology& topology, const layer_shape& shape,
                              const kernel_throughput& kernel, const cluster& c, const ring_workload& vertical_padding = {}) {
  shape.validate();
  kernel.validate();
  c.validate();
  const index_t w = topology.world_size(), steps = topology.num_steps();
  if (c.world_size() != w)
    throw invalid_argument("cluster nodes x gpus_per_node", c.world_size(), "must equal the topology's world size " + std::to_string(w));
  const detail::ring_counts counts(entries, rows, vertical_padding, w, steps);
  if (kernel.head_dim != shape.head_dim)
    throw invalid_argument("kernel_throughput.head_dim", kernel.head_dim, "must equal the layer's head_dim " + std::to_string(shape.head_dim));
  if (shape.seq_len % w != 0) throw invalid_argument("layer_shape.seq_len", shape.seq_len, "must be divisible by the world size " + std::to_string(w));
  const std::int64_t local_tokens = shape.seq_len / w;
  const double kv = shape.kv_bytes(local_tokens), kv_gradient = shape.kv_gradient_bytes(local_tokens);
  const auto n = static_cast<std::size_t>(w);

  auto run = [&](bool backward) {
    const kernel_speed& speed = backward ? kernel.backward : kernel.forward;
    const double flops_per_entry = entry_flops(shape.head_dim, backward);
    phase_prediction p;
    p.steps.resize(static_cast<std::size_t>(steps));
    p.rank_compute_seconds.assign(n, 0.0);
    std::vector<double> queue_free(2 * n, 0.0), step_end(n, 0.0), compute_end(n, 0.0), ready(n, 0.0);
    detail::arrivals kv_due(w, steps), gradient_due(w, steps);
    for (index_t s = 0; s < steps; ++s) {
      step_prediction& out = p.steps[static_cast<std::size_t>(s)];
      // KV for later steps leaves once the previous step is done (the transfer stream waits for it).
      for (int item = 0; item < transfer_list::capacity; ++item)
        detail::post_transfers(queue_free, kv_due, c, [&](index_t r) { return topology.transfers(r, s); }, item, step_end, kv);
      detail::record_due(kv_due, s, step_end, out);
      const double state = backward ? 0.0 : kernel.memory_seconds(running_state_bytes(shape, local_tokens, s, steps));
      for (index_t r = 0; r < w; ++r) {
        const auto i = static_cast<std::size_t>(r);
        const double start = std::max(step_end[i], kv_due.at[kv_due.slot(r, s)]);
        const double t = counts.seconds(speed, flops_per_entry, r, s) + state;
        out.wait_seconds = std::max(out.wait_seconds, start - step_end[i]);
        out.compute_seconds = std::max(out.compute_seconds, t);
        p.rank_compute_seconds[i] += t;
        compute_end[i] = step_end[i] = start + t;
      }
      if (!backward) continue;
      // dK/dV partials: an item leaves once the partials due by this step's end have been added in
      // (the engine adds before it sends); they share the KV's queues (one transfer stream).
      for (int item = 0; item < transfer_list::capacity; ++item) {
        for (index_t r = 0; r < w; ++r) ready[static_cast<std::size_t>(r)] = std::max(compute_end[static_cast<std::size_t>(r)], gradient_due.at[gradient_due.slot(r, s)]);
        detail::post_transfers(queue_free, gradient_due, c, [&](index_t r) { return topology.gradient_transfers(r, s); }, item, ready, kv_gradient);
      }
      detail::record_due(gradient_due, s, compute_end, out);
      for (index_t r = 0; r < w; ++r) {
        const auto i = static_cast<std::size_t>(r);
        step_end[i] = std::max(compute_end[i], gradient_due.at[gradient_due.slot(r, s)]);
        out.wait_seconds = std::max(out.wait_seconds, step_end[i] - compute_end[i]);
      }
    }
    for (index_t r = 0; r < w; ++r)
      p.seconds = std::max({p.seconds, step_end[static_cast<std::size_t>(r)], gradient_due.at[gradient_due.slot(r, steps)]});
    return p;
  };
  return {run(false), run(true)};
}

/// The same layer as one step on one GPU (every row active): what scaling efficiency compares with.
/// `vertical_padding`: the padding of a one-rank ring (count_ring_vertical_padding over flat_ring(1)).
inline layer_prediction predict_one_gpu(std::int64_t total_entries, const layer_shape& shape, const kernel_throughput& kernel,
                                        std::int64_t vertical_padding = 0) {
  shape.validate();
  kernel.validate();
  if (total_entries < 0) throw invalid_argument("total_entries", total_entries, "must be >= 0");
  if (vertical_padding < 0) throw invalid_argument("vertical_padding", vertical_padding, "must be >= 0");
  const double rows = double(shape.seq_len / block_tokens) * shape.heads_q;
  layer_prediction p;
  for (const bool backward : {false, true}) {
    phase_prediction& phase = backward ? p.backward : p.forward;
    const double t = (backward ? kernel.backward : kernel.forward)
                         .seconds(entry_flops(shape.head_dim, backward) * executed_entries(total_entries, vertical_padding), rows);
    phase.seconds = t;
    phase.steps = {{t, 0.0, 0.0, false}};
    phase.rank_compute_seconds = {t};
  }
  return p;
}

/// W ranks sharing one GPU (comm::local_device): a step's W calls run at once on the device. The
/// forward's calls take turns: each fills the GPU alone (a CTA per query block and head, many waves),
/// so a step is its calls one after another, each with its running-state traffic
/// (running_state_bytes). The backward's calls fill the SMs each other leave idle (its passes run a
/// CTA per KV block, a few waves with long and short columns), so the device is as busy as in one
/// long call: a step takes the larger of the ranks' work at the long-run rates plus one call's fixed
/// cost (FLOPs over the throughput and active rows x a row's fixed cost: the three terms without
/// the curve, whose extra time for short rows is then filled) and the slowest rank's call alone,
/// and never more than the calls one after another (the three terms exceed the curve at some row
/// works; RESULTS.md, 2026-12-05, sixth: the calls alone against together). The device copies
/// overlap the calls and are not counted (RESULTS.md, 2026-11-29, two GPUs).
inline layer_prediction predict_shared_gpu(const ring_workload& entries, const ring_workload& rows, const layer_shape& shape,
                                           const kernel_throughput& kernel, const ring_workload& vertical_padding = {}) {
  shape.validate();
  kernel.validate();
  const index_t w = entries.world_size, steps = entries.num_steps;
  const detail::ring_counts counts(entries, rows, vertical_padding, w, steps);
  if (kernel.head_dim != shape.head_dim)
    throw invalid_argument("kernel_throughput.head_dim", kernel.head_dim, "must equal the layer's head_dim " + std::to_string(shape.head_dim));
  if (shape.seq_len % w != 0) throw invalid_argument("layer_shape.seq_len", shape.seq_len, "must be divisible by the world size " + std::to_string(w));
  layer_prediction p;
  for (const bool backward : {false, true}) {
    const kernel_speed& speed = backward ? kernel.backward : kernel.forward;
    const kernel_speed long_run{.tflops = speed.tflops, .row_ns = speed.row_ns, .call_us = 0};
    const double flops_per_entry = entry_flops(shape.head_dim, backward);
    phase_prediction& phase = backward ? p.backward : p.forward;
    phase.steps.resize(static_cast<std::size_t>(steps));
    phase.rank_compute_seconds.assign(static_cast<std::size_t>(w), 0.0);
    for (index_t s = 0; s < steps; ++s) {
      const double state = backward ? 0.0 : kernel.memory_seconds(running_state_bytes(shape, shape.seq_len / w, s, steps));
      double together = speed.call_us * 1e-6, slowest = 0, in_turn = 0;
      for (index_t r = 0; r < w; ++r) {
        const double alone = counts.seconds(speed, flops_per_entry, r, s) + state;
        together += counts.seconds(long_run, flops_per_entry, r, s);
        slowest = std::max(slowest, alone);
        in_turn += alone;
        phase.rank_compute_seconds[static_cast<std::size_t>(r)] += alone;
      }
      const double t = backward ? std::min(std::max(together, slowest), in_turn) : in_turn;
      phase.steps[static_cast<std::size_t>(s)].compute_seconds = t;
      phase.seconds += t;
    }
  }
  return p;
}

namespace detail {

/// Throws unless `p` could have been made from `g` (solver::problem_from_selection): the same
/// sequence, split into p's chunks, and the same query heads.
inline void check_problem_of(const global_selection& g, const solver::problem& p) {
  p.validate();
  if (g.seq_len != p.num_chunks() * p.chunk_tokens)
    throw invalid_argument("selection.seq_len", g.seq_len,
                           "must equal the problem's chunks x chunk tokens = " + std::to_string(p.num_chunks() * p.chunk_tokens) + " (a problem of another selection?)");
  if (g.num_heads() != p.heads_q)
    throw invalid_argument("selection.heads.size()", g.num_heads(), "must equal the problem's heads_q = " + std::to_string(p.heads_q));
}

}  // namespace detail

/// Active rows of every solver task (query chunk i, KV chunk j) of `p`, laid out [C, C] like
/// p.area: the rows of a sequential ring over the C chunks (as solver::problem_from_selection counts
/// the areas).
inline std::vector<std::int64_t> solver_task_rows(const global_selection& g, const solver::problem& p) {
  detail::check_problem_of(g, p);
  return solver::detail::per_task(count_ring_rows(g, sharding::sequential{}, topology::flat_ring(p.num_chunks())));
}

/// The gathered vertical tiles' padding of every solver task, laid out like solver_task_rows.
inline std::vector<std::int64_t> solver_task_vertical_padding(const global_selection& g, const solver::problem& p) {
  detail::check_problem_of(g, p);
  return solver::detail::per_task(count_ring_vertical_padding(g, sharding::sequential{}, topology::flat_ring(p.num_chunks())));
}

/// Predicts one layer of the dynamic solver's plan `x` of problem `p` (topology::solver, sequential
/// sharding) on `c`: steps[0] is stage 0 (local tasks while the moves travel), steps[1] stage 1
/// (remote tasks, then the partials' return to their owners). Forward moves: K and V of a KV chunk;
/// Q of a query chunk, whose fp32 partial O and LSE return. Backward: K and V; Q, dO, LSE and delta;
/// returning fp32 dK/dV and dQ (device/solver_attention.cuh). A rank's sends go one after another on
/// its link, and so do its receives. `task_rows` (solver_task_rows) gives each task's active rows,
/// `task_padding` (solver_task_vertical_padding; empty: none) its gathered tiles' padding.
inline layer_prediction predict_solver(const solver::problem& p, const solver::plan& x, std::span<const std::int64_t> task_rows,
                                       const layer_shape& shape, const kernel_throughput& kernel, const cluster& c,
                                       std::span<const std::int64_t> task_padding = {}) {
  p.validate();
  shape.validate();
  kernel.validate();
  c.validate();
  const index_t w = p.world_size;
  if (c.world_size() != w) throw invalid_argument("cluster nodes x gpus_per_node", c.world_size(), "must equal the plan's world size " + std::to_string(w));
  if (x.local_tasks.size() != static_cast<std::size_t>(w) || x.remote_tasks.size() != static_cast<std::size_t>(w))
    throw invalid_argument("plan.local_tasks.size()", x.local_tasks.size(), "must equal the problem's world size " + std::to_string(w));
  const auto n = static_cast<std::size_t>(w);
  if (task_rows.size() != p.area.size())
    throw invalid_argument("task_rows.size()", task_rows.size(), "must be (world_size x chunks_per_rank)^2 = " + std::to_string(p.area.size()));
  if (!task_padding.empty() && task_padding.size() != p.area.size())
    throw invalid_argument("task_padding.size()", task_padding.size(), "must be 0 or (world_size x chunks_per_rank)^2 = " + std::to_string(p.area.size()));
  // The plan's tasks and moves index the rows, the padding and the ranks: a plan of another problem
  // read and wrote outside them.
  solver::check_plan_of(p, x);
  for (index_t r = 0; r < w; ++r) solver::check_rank_tasks(p, x, r);
  if (shape.seq_len != p.num_chunks() * p.chunk_tokens)
    throw invalid_argument("layer_shape.seq_len", shape.seq_len,
                           "must equal the problem's chunks x chunk tokens = " + std::to_string(p.num_chunks() * p.chunk_tokens));
  if (shape.heads_q != p.heads_q || shape.heads_kv != p.heads_kv)
    throw invalid_argument("layer_shape.heads_q", shape.heads_q,
                           "must equal the problem's heads_q = " + std::to_string(p.heads_q) + ", with heads_kv = " + std::to_string(p.heads_kv) +
                               " (layer_shape.heads_kv = " + std::to_string(shape.heads_kv) + ")");
  for (const std::int64_t count : task_rows)
    if (count < 0) throw invalid_argument("task_rows", count, "counts must be >= 0");
  for (const std::int64_t count : task_padding)
    if (count < 0) throw invalid_argument("task_padding", count, "counts must be >= 0");
  const std::int64_t tokens = p.chunk_tokens;

  auto run = [&](bool backward) {
    const kernel_speed& speed = backward ? kernel.backward : kernel.forward;
    const double flops_per_entry = entry_flops(shape.head_dim, backward);
    // A call per task. The forward's calls merge into their query chunk's fp32 running output on
    // the rank, which starts empty (LSE -inf: nothing to read): every task but a chunk's first there
    // reads the old output. The partial outputs' merges at home and the last pass that writes T are
    // not counted.
    const double merge = backward ? 0.0 : kernel.memory_seconds(running_state_read_bytes(shape, p.chunk_tokens));
    std::vector<char> seen;  // query chunks computed on the rank so far (its local tasks, then its remote ones)
    auto stage_seconds = [&](const std::vector<solver::task>& tasks) {
      double seconds = 0;
      for (const solver::task& t : tasks) {
        const std::size_t at = static_cast<std::size_t>(t.query_chunk) * static_cast<std::size_t>(p.num_chunks()) + static_cast<std::size_t>(t.kv_chunk);
        seconds += speed.seconds(flops_per_entry * executed_entries(t.area, task_padding.empty() ? 0 : task_padding[at]), double(task_rows[at]));
        if (seen[static_cast<std::size_t>(t.query_chunk)]) seconds += merge;
        seen[static_cast<std::size_t>(t.query_chunk)] = 1;
      }
      return seconds;
    };
    // What each move carries there and back.
    const double kv_there = shape.kv_bytes(tokens), kv_back = backward ? shape.kv_gradient_bytes(tokens) : 0.0;
    const double qo_there = backward ? 2 * shape.query_bytes(tokens) + double(tokens) * shape.heads_q * 2 * 4.0 : shape.query_bytes(tokens);
    const double qo_back = shape.query_partial_bytes(tokens);
    std::vector<double> send_out(n, 0.0), receive_in(n, 0.0), send_back(n, 0.0), receive_back(n, 0.0);
    std::vector<std::vector<index_t>> senders(n), returners(n);
    for (const solver::chunk_move& m : x.moves) {
      const index_t from = p.owner(m.chunk), to = m.to;
      const bool is_kv = m.what == solver::chunk_move::kind::kv;
      const link& l = c.between(from, to);
      const double there = l.seconds(is_kv ? kv_there : qo_there), back = (is_kv ? kv_back : qo_back) > 0 ? l.seconds(is_kv ? kv_back : qo_back) : 0.0;
      send_out[static_cast<std::size_t>(from)] += there;
      receive_in[static_cast<std::size_t>(to)] += there;
      senders[static_cast<std::size_t>(to)].push_back(from);
      if (back > 0) {
        send_back[static_cast<std::size_t>(to)] += back;
        receive_back[static_cast<std::size_t>(from)] += back;
        returners[static_cast<std::size_t>(from)].push_back(to);
      }
    }
    phase_prediction out;
    out.steps.resize(2);
    out.rank_compute_seconds.assign(n, 0.0);
    std::vector<double> stage_end(n, 0.0);
    for (index_t r = 0; r < w; ++r) {
      const auto i = static_cast<std::size_t>(r);
      seen.assign(static_cast<std::size_t>(p.num_chunks()), 0);
      const double local = stage_seconds(x.local_tasks[i]);
      const double remote = stage_seconds(x.remote_tasks[i]);
      double arrived = receive_in[i];
      for (const index_t s : senders[i]) arrived = std::max(arrived, send_out[static_cast<std::size_t>(s)]);
      const double start = std::max(local, arrived);
      stage_end[i] = start + remote;
      out.rank_compute_seconds[i] = local + remote;
      step_prediction& s0 = out.steps[0];
      s0.compute_seconds = std::max(s0.compute_seconds, local);
      s0.transfer_seconds = std::max(s0.transfer_seconds, arrived);
      s0.wait_seconds = std::max(s0.wait_seconds, start - local);
      s0.communication_bound = s0.communication_bound || arrived > local;
      out.steps[1].compute_seconds = std::max(out.steps[1].compute_seconds, remote);
    }
    // The returns leave after stage 1 on the computing rank; the owner merges them when all are in.
    for (index_t r = 0; r < w; ++r) {
      const auto i = static_cast<std::size_t>(r);
      double end = stage_end[i];
      if (receive_back[i] > 0) {
        double returned = stage_end[i] + receive_back[i];
        for (const index_t from : returners[i]) returned = std::max(returned, stage_end[static_cast<std::size_t>(from)] + send_back[static_cast<std::size_t>(from)]);
        step_prediction& s1 = out.steps[1];
        s1.transfer_seconds = std::max(s1.transfer_seconds, returned - stage_end[i]);
        s1.wait_seconds = std::max(s1.wait_seconds, returned - stage_end[i]);
        s1.communication_bound = true;  // the returns follow the last compute: nothing hides them
        end = returned;
      }
      out.seconds = std::max(out.seconds, end);
    }
    return out;
  };
  return {run(false), run(true)};
}

}  // namespace stria::cost
