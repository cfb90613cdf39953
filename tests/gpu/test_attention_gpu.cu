// SPDX-License-Identifier: Apache-2.0
// The sparse attention kernels against the host reference in double: forward (overwrite and merge
// into the fp32 running state) and backward (dQ, dK, dV), bf16 and fp16, head dim 64 and 128, GQA
// 1/2/8, causal and full, on random, dense and Vertical-Slash step indices; outputs poisoned first.
// Deterministic backward is bit-identical on repeated runs; bad calls are rejected.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/device_buffer.cuh"
#include "stria/core/numeric.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/host/reference_attention.hpp"
#include "stria/index/local_index.cuh"
#include "stria/index/local_index.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "support/device_tensors.cuh"
#include "support/oracle.hpp"
#include "support/selection.hpp"

using namespace stria;
using namespace stria::test;

namespace {

/// A step index over local query blocks `query_global` and KV blocks `kv_global`.
step_index random_index(test::seeded_rng& rng, index_t heads, bool causal, std::vector<index_t> query_global, std::vector<index_t> kv_global,
                        double block_density, double token_density) {
  const step_index_shape shape{heads, static_cast<index_t>(query_global.size()), static_cast<index_t>(kv_global.size()), causal};
  return test::random_row_sets(rng, shape, std::move(query_global), std::move(kv_global), block_density, token_density).build();
}

struct problem {
  index_t heads_q, heads_kv, dim;
  std::string name;
};

/// Forward then backward of one step against the host reference, checked inside. `backward_part`
/// (a sweep part, or null for all): each backward kernel family in each mode is one configuration
/// of it, so that a case too slow for racecheck in one process splits finer. Returns how many
/// (family, mode) backward runs it made.
template <class T>
int check_step(test::seeded_rng& rng, const step_index& index, const problem& shape, test::sweep_part* backward_part = nullptr) {
  const index_t sq = index.shape.num_query_blocks * block_tokens, sk = index.shape.num_kv_blocks * block_tokens;
  const index_t hq = shape.heads_q, hkv = shape.heads_kv, dim = shape.dim;
  const double scale = 1.0 / std::sqrt(double(dim));
  CAPTURE(type_name<T>());
  CAPTURE(shape.name);
  CAPTURE(index.shape.causal);
  auto q = random_tensor<T>(rng, std::size_t(sq) * hq * dim, 2.0f);
  auto k = random_tensor<T>(rng, std::size_t(sk) * hkv * dim, 2.0f);
  auto v = random_tensor<T>(rng, std::size_t(sk) * hkv * dim, 1.0f);
  auto d_out = random_tensor<T>(rng, std::size_t(sq) * hq * dim, 1.0f);
  const device_step_index on_device = upload_step_index(index, nullptr);

  // Forward.
  std::vector<double> out_ref(std::size_t(sq) * hq * dim), lse_ref(std::size_t(hq) * sq);
  host::reference_forward<double>(view3(std::as_const(q.host), sq, hq, dim), view3(std::as_const(k.host), sk, hkv, dim), view3(std::as_const(v.host), sk, hkv, dim), index.view(), scale,
                                  view3(out_ref, sq, hq, dim), view2(lse_ref, hq, sq));
  const auto dq_view = [&](device_buffer<float>& b) { return tensor_view<float, 3>(b.data(), {sq, hq, dim}); };
  const auto dk_view = [&](device_buffer<float>& b) { return tensor_view<float, 3>(b.data(), {sk, hkv, dim}); };
  const tensor_view<const T, 3> q_view(q.device.data(), {sq, hq, dim}), k_view(k.device.data(), {sk, hkv, dim}),
      v_view(v.device.data(), {sk, hkv, dim}), d_out_view(d_out.device.data(), {sq, hq, dim});
  std::vector<device::forward_kernel> kernels{device::forward_kernel::mma_sync};
  if (device::hopper_kernels_available()) kernels.push_back(device::forward_kernel::wgmma);
  // A complete index (every tile the causal rule allows) at D 128 also runs two query blocks per CTA.
  if (device::hopper_kernels_available() && on_device.complete && dim == 128) kernels.push_back(device::forward_kernel::wgmma_paired);
  for (const device::forward_kernel which : kernels) {
    const std::string kernel_name = which == device::forward_kernel::wgmma          ? "wgmma"
                                    : which == device::forward_kernel::wgmma_paired ? "wgmma paired"
                                                                                    : "mma.sync";
    CAPTURE(kernel_name);
    device_buffer<float> out(out_ref.size()), lse(lse_ref.size());
    const auto forward = [&](device::launch_order order) {
      out.fill_bytes(0xff);  // NaN: every element must be written
      lse.fill_bytes(0xff);
      device::sparse_forward<T>(on_device,
                                {.q = q_view, .k = k_view, .v = v_view, .out = dq_view(out), .lse = tensor_view<float, 2>(lse.data(), {hq, sq})},
                                scale, nullptr, {.state = device::running_state::overwrite, .which = which, .order = order});
      return std::pair{out.download(), lse.download()};
    };
    const auto [out_first, lse_first] = forward(device::launch_order::automatic);
    const double out_error = max_relative_error(out_first, out_ref);
    const double lse_error = max_relative_error(lse_first, lse_ref);
    MESSAGE(type_name<T>(), " ", shape.name, " causal=", index.shape.causal, " ", kernel_name, ": max relative error O ", out_error, ", LSE ",
            lse_error);
    CHECK(out_error < tolerance<T>());
    CHECK(lse_error < tolerance<T>());
    // Every launch order computes each row the same way: the same bits.
    for (const device::launch_order order :
         {device::launch_order::query_blocks_inner, device::launch_order::kv_group_inner, device::launch_order::heads_inner}) {
      CAPTURE(static_cast<int>(order));
      const auto [out_ordered, lse_ordered] = forward(order);
      CHECK(std::memcmp(out_ordered.data(), out_first.data(), out_first.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(lse_ordered.data(), lse_first.data(), lse_first.size() * sizeof(float)) == 0);
    }
  }

  // Backward on the reference's output rounded to T, as a training step would hand it over.
  std::vector<T> out_rounded(out_ref.size());
  std::vector<float> out_host(out_ref.size()), lse_host(lse_ref.begin(), lse_ref.end());
  for (std::size_t i = 0; i < out_ref.size(); ++i) {
    out_rounded[i] = from_float<T>(static_cast<float>(out_ref[i]));
    out_host[i] = to_float(out_rounded[i]);
  }
  std::vector<double> dq_ref(out_ref.size(), 0.0), dk_ref(k.host.size(), 0.0), dv_ref(v.host.size(), 0.0);
  host::reference_backward<double>(view3(std::as_const(q.host), sq, hq, dim), view3(std::as_const(k.host), sk, hkv, dim), view3(std::as_const(v.host), sk, hkv, dim),
                                   view3(std::as_const(out_host), sq, hq, dim), view3(std::as_const(d_out.host), sq, hq, dim), view2(std::as_const(lse_host), hq, sq), index.view(), scale,
                                   view3(dq_ref, sq, hq, dim), view3(dk_ref, sk, hkv, dim), view3(dv_ref, sk, hkv, dim));
  device_buffer<T> out_device = upload(out_rounded);
  device_buffer<float> lse_device = upload(lse_host), delta(lse_host.size());
  delta.fill_bytes(0xff);
  device::backward_delta<T>(tensor_view<const T, 3>(out_device.data(), {sq, hq, dim}), d_out_view, tensor_view<float, 2>(delta.data(), {hq, sq}),
                            nullptr);
  // The step's inputs; each run below sets the gradient sums it adds to.
  const device::step_backward_tensors<T> inputs{.q = q_view,
                                                .k = k_view,
                                                .v = v_view,
                                                .d_out = d_out_view,
                                                .lse = tensor_view<const float, 2>(lse_device.data(), {hq, sq}),
                                                .delta = tensor_view<const float, 2>(delta.data(), {hq, sq}),
                                                .dq = {},
                                                .dk = {},
                                                .dv = {}};
  auto run_backward = [&](device::determinism mode, device::backward_kernel which, device::dq_source source, std::size_t ds_limit,
                          device::launch_order order = device::launch_order::automatic, bool overlap = true) {
    struct gradients {
      std::vector<float> dq, dk, dv;
    };
    device_buffer<float> dq(dq_ref.size()), dk(dk_ref.size()), dv(dv_ref.size());
    dq.fill_bytes(0);
    dk.fill_bytes(0);
    dv.fill_bytes(0);
    device::step_backward_tensors<T> tensors = inputs;
    tensors.dq = dq_view(dq);
    tensors.dk = dk_view(dk);
    tensors.dv = dk_view(dv);
    device::sparse_backward<T>(on_device, tensors, scale, nullptr,
                               {.mode = mode, .which = which, .source = source, .ds_workspace_limit = ds_limit, .order = order, .overlap_passes = overlap});
    return gradients{dq.download(), dk.download(), dv.download()};
  };
  // The same step as a layer's only one: no fp32 dq, dQ written out in T (poisoned first).
  auto run_backward_dq_out = [&](device::determinism mode, device::backward_kernel which, device::dq_source source, std::size_t ds_limit) {
    device_buffer<float> dk(dk_ref.size()), dv(dv_ref.size());
    dk.fill_bytes(0);
    dv.fill_bytes(0);
    device_buffer<T> dq_out(dq_ref.size());
    dq_out.fill_bytes(0xff);
    device::step_backward_tensors<T> tensors = inputs;  // no fp32 dq
    tensors.dk = dk_view(dk);
    tensors.dv = dk_view(dv);
    tensors.dq_out = dq_out.data();
    device::sparse_backward<T>(on_device, tensors, scale, nullptr, {.mode = mode, .which = which, .source = source, .ds_workspace_limit = ds_limit});
    return dq_out.download();
  };
  // Every backward kernel family (mma.sync, and wgmma on Hopper with dS stored and recomputed) in
  // both modes: the deterministic mode repeats bit for bit, the atomic mode agrees to rounding.
  // The stored dS also over ranges of heads: a workspace limit of the largest head's dS.
  // Also over ranges of whole KV groups (the largest group's dS): ranges that start past head 0 on a
  // group boundary, which the grouped dQ launch covers (backward_options::order).
  std::size_t largest_head = 0, largest_group = 0;
  const auto head_ds_bytes = [&](index_t h) {
    const auto row = [&](index_t head) { return static_cast<std::size_t>(head * index.shape.num_query_blocks); };
    const std::size_t rows = static_cast<std::size_t>(index.block_ptr[row(h + 1)] - index.block_ptr[row(h)]) * block_tokens +
                             static_cast<std::size_t>(index.col_ptr[row(h + 1)] - index.col_ptr[row(h)]);
    return rows * block_tokens * sizeof(T);
  };
  for (index_t h = 0; h < index.shape.num_heads; ++h) largest_head = std::max(largest_head, head_ds_bytes(h));
  for (index_t g = 0; g < hkv; ++g) {
    std::size_t group = 0;
    for (index_t h = g * (hq / hkv); h < (g + 1) * (hq / hkv); ++h) group += head_ds_bytes(h);
    largest_group = std::max(largest_group, group);
  }
  struct backward_variant {
    device::backward_kernel which;
    device::dq_source source;
    std::size_t ds_limit;
    const char* name;
  };
  std::vector<backward_variant> backward_kernels{{device::backward_kernel::mma_sync, device::dq_source::automatic, 0, "mma.sync"}};
  if (device::hopper_kernels_available()) {
    backward_kernels.push_back({device::backward_kernel::wgmma, device::dq_source::stored, 0, "wgmma, dS stored"});
    backward_kernels.push_back({device::backward_kernel::wgmma, device::dq_source::stored, std::max<std::size_t>(largest_head, 1),
                                "wgmma, dS stored by ranges of heads"});
    backward_kernels.push_back({device::backward_kernel::wgmma, device::dq_source::recomputed, 0, "wgmma, dS recomputed"});
    // Not in a case split into parts (the 300-block backward's parts keep their configurations).
    if (backward_part == nullptr && hq / hkv > 1 && hkv > 1)
      backward_kernels.push_back({device::backward_kernel::wgmma, device::dq_source::stored, std::max<std::size_t>(largest_group, 1),
                                  "wgmma, dS stored by ranges of KV groups"});
  }
  // dS stored by request with a limit below one head's workspace: an error naming the limit.
  if (device::hopper_kernels_available() && largest_head > 1)
    CHECK_THROWS_WITH_AS(run_backward(device::determinism::atomic, device::backward_kernel::wgmma, device::dq_source::stored, largest_head - 1),
                         doctest::Contains("options.ds_workspace_limit"), stria::invalid_argument);
  int backward_runs = 0;
  for (const auto& [which, source, ds_limit, name] : backward_kernels) {
    const std::string kernel_name = name;
    CAPTURE(kernel_name);
    for (const device::determinism mode : {device::determinism::deterministic, device::determinism::atomic}) {
      if (backward_part != nullptr && !backward_part->next()) continue;
      ++backward_runs;
      const bool deterministic = mode == device::determinism::deterministic;
      CAPTURE(deterministic);
      const auto grads = run_backward(mode, which, source, ds_limit);
      const double dq_error = max_relative_error(grads.dq, dq_ref), dk_error = max_relative_error(grads.dk, dk_ref),
                   dv_error = max_relative_error(grads.dv, dv_ref);
      MESSAGE(type_name<T>(), " ", shape.name, " causal=", index.shape.causal, " ", kernel_name, std::string(deterministic ? " deterministic" : " atomic"),
              ": max relative error dQ ", dq_error, ", dK ", dk_error, ", dV ", dv_error);
      CHECK(dq_error < 2 * tolerance<T>());
      CHECK(dk_error < 2 * tolerance<T>());
      CHECK(dv_error < 2 * tolerance<T>());
      // The atomic Hopper backward with dS stored in one range over two or more KV heads runs the
      // halves of the KV heads side by side (backward_options::overlap_passes, on by default): also
      // without it, with it in the heads-inner launch order (each half's dQ pass in sections of its
      // own heads), and with it writing dQ out in T directly.
      if (!deterministic && which == device::backward_kernel::wgmma && backward_part == nullptr) {
        const auto serial = run_backward(mode, which, source, ds_limit, device::launch_order::automatic, false);
        const auto heads_inner = run_backward(mode, which, source, ds_limit, device::launch_order::heads_inner);
        for (const auto* other : {&serial, &heads_inner}) {
          CHECK(max_relative_error(other->dq, dq_ref) < 2 * tolerance<T>());
          CHECK(max_relative_error(other->dk, dk_ref) < 2 * tolerance<T>());
          CHECK(max_relative_error(other->dv, dv_ref) < 2 * tolerance<T>());
        }
        std::vector<float> dq_out;
        for (const T x : run_backward_dq_out(mode, which, source, ds_limit)) dq_out.push_back(to_float(x));
        CHECK(max_relative_error(dq_out, dq_ref) < 2 * tolerance<T>());
      }
      if (deterministic) {
        const auto again = run_backward(mode, which, source, ds_limit);
        CHECK(std::memcmp(again.dq.data(), grads.dq.data(), grads.dq.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(again.dk.data(), grads.dk.data(), grads.dk.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(again.dv.data(), grads.dv.data(), grads.dv.size() * sizeof(float)) == 0);
        // The dQ passes in every launch order: the same bits (not in a case split into parts for
        // racecheck, whose runs the other cases' orders cover).
        if (which == device::backward_kernel::wgmma && backward_part == nullptr)
          for (const device::launch_order order :
               {device::launch_order::query_blocks_inner, device::launch_order::kv_group_inner, device::launch_order::heads_inner}) {
            CAPTURE(static_cast<int>(order));
            const auto ordered = run_backward(mode, which, source, ds_limit, order);
            CHECK(std::memcmp(ordered.dq.data(), grads.dq.data(), grads.dq.size() * sizeof(float)) == 0);
            CHECK(std::memcmp(ordered.dk.data(), grads.dk.data(), grads.dk.size() * sizeof(float)) == 0);
            CHECK(std::memcmp(ordered.dv.data(), grads.dv.data(), grads.dv.size() * sizeof(float)) == 0);
          }
        const std::vector<T> dq_out = run_backward_dq_out(mode, which, source, ds_limit);
        std::size_t differing = 0;
        for (std::size_t i = 0; i < dq_out.size(); ++i)
          differing += to_float(dq_out[i]) != to_float(from_float<T>(grads.dq[i])) ? 1 : 0;
        CHECK_MESSAGE(differing == 0, "dQ written out in T differs from the fp32 dQ rounded once");
      }
    }
  }
  return backward_runs;
}

const problem problems[] = {{2, 2, 64, "Hq2 Hkv2 D64"}, {4, 2, 128, "Hq4 Hkv2 D128"}, {8, 1, 64, "Hq8 Hkv1 D64"}, {8, 1, 128, "Hq8 Hkv1 D128"}};

}  // namespace

TEST_CASE_TEMPLATE("sparse attention kernels match the reference on random step indices", T, __nv_bfloat16, __half) {
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  test::sweep_part part;  // STRIA_TEST_PART
  const std::string part_name = part.name();
  CAPTURE(part_name);
  for (const problem& shape : problems)
    for (bool causal : {true, false}) {
      // Striped-like maps: query rank 1 of 3 against KV rank 1 (diagonal tiles) and rank 0.
      const std::vector<index_t> queries{1, 4, 7, 10, 13};
      if (part.next()) check_step<T>(rng, random_index(rng, shape.heads_q, causal, queries, {1, 4, 7, 10}, 0.4, 0.05), shape);
      if (part.next()) check_step<T>(rng, random_index(rng, shape.heads_q, causal, queries, {0, 3, 6, 9, 12, 15}, 0.3, 0.08), shape);
    }
}

// One small problem through every kernel (both forwards, all backward modes): racecheck's quick
// check (under it a sweep outlasts a device call unless split into parts: STRIA_TEST_PART).
TEST_CASE("sparse attention kernels on one small problem") {
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  const problem shape{4, 2, 128, "Hq4 Hkv2 D128"};
  check_step<__nv_bfloat16>(rng, random_index(rng, shape.heads_q, true, {1, 4, 7}, {1, 4, 7}, 0.5, 0.08), shape);
}

// Three KV heads: the atomic backward with dS stored splits them into halves of one and two KV
// groups (backward_options::overlap_passes; check_step runs every backward family).
TEST_CASE("sparse attention kernels with an odd number of KV heads") {
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  const problem shape{6, 3, 128, "Hq6 Hkv3 D128"};
  check_step<__nv_bfloat16>(rng, random_index(rng, shape.heads_q, true, {1, 4, 7}, {0, 1, 4, 7}, 0.5, 0.08), shape);
}

// The atomic backward splits each vertical-token group's queries into ranges of 256 query blocks,
// one CTA each: 300 local query blocks make two ranges, with tokens used on both sides of the cut.
// At both head dims (D 128: the Hopper dK/dV passes' 255-register shape).
TEST_CASE("the atomic backward over more than 256 query blocks (vertical tokens split into query ranges)") {
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  test::sweep_part part;  // STRIA_TEST_PART
  const std::string part_name = part.name();
  CAPTURE(part_name);
  std::vector<index_t> blocks(300);
  std::iota(blocks.begin(), blocks.end(), 0);
  // The part picks (problem, backward family, mode): under racecheck one problem's backward runs
  // longer than a device call. On Hopper that is 4 problems x 4 families x 2 modes = 32
  // configurations (mma.sync alone elsewhere: 8); every process runs every problem's forward and
  // host reference.
  int backward_runs = 0;
  for (const problem& shape : {problem{2, 1, 64, "Hq2 Hkv1 D64"}, problem{2, 1, 128, "Hq2 Hkv1 D128"}})
    for (const bool causal : {true, false})
      backward_runs += check_step<__nv_bfloat16>(rng, random_index(rng, shape.heads_q, causal, blocks, blocks, 0.01, 0.003), shape, &part);
  MESSAGE("part ", part_name, ": ", backward_runs, " backward configurations");
  WARN_MESSAGE(backward_runs > 0, "this part of the sweep ran no backward configuration (more parts than configurations)");
}

TEST_CASE_TEMPLATE("sparse attention kernels on dense and Vertical-Slash ring-step indices", T, __nv_bfloat16, __half) {
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  test::sweep_part part;  // STRIA_TEST_PART
  const std::string part_name = part.name();
  CAPTURE(part_name);
  const index_t world = 3, seq_len = 64 * world * 6;
  const sharding::striped<64> striped;
  for (const problem& shape : problems) {
    const global_selection dense = test::random_selection(rng, seq_len, shape.heads_q, true, 1.0, 0.0);
    const global_selection vs = test::random_selection(rng, seq_len, shape.heads_q, true, 0.2, 0.06);
    for (index_t source : {index_t{1}, index_t{0}, index_t{2}}) {
      CAPTURE(source);
      if (part.next()) check_step<T>(rng, build_local_index(dense, striped, world, 1, source, {}), shape);
      if (part.next()) check_step<T>(rng, build_local_index(vs, striped, world, 1, source, {}), shape);
    }
  }
}

// The paired Hopper forward (two query blocks per CTA over the later block's tiles) on complete
// indices: an odd count of query blocks (the last CTA's second consumer has no block), full
// attention, striped ring steps whose KV blocks lie before, around and after the queries, and GQA.
TEST_CASE("the paired Hopper forward on complete indices") {
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  test::sweep_part part;  // STRIA_TEST_PART
  const std::string part_name = part.name();
  CAPTURE(part_name);
  for (const problem& shape : {problem{4, 2, 128, "Hq4 Hkv2 D128"}, problem{8, 1, 128, "Hq8 Hkv1 D128"}, problem{2, 2, 128, "Hq2 Hkv2 D128"}})
    for (const index_t blocks : {index_t{1}, index_t{2}, index_t{7}, index_t{10}})
      for (const bool causal : {true, false}) {
        if (!part.next()) continue;
        const index_t nb = blocks;
        const global_selection all = test::band_selection(nb * block_tokens, shape.heads_q, causal ? 0 : -(nb - 1), nb - 1, causal);
        const step_index index = build_local_index(all, sharding::sequential{}, 1, 0, 0, {});
        CHECK(upload_step_index(index, nullptr).complete);
        check_step<__nv_bfloat16>(rng, index, shape);
      }
  const problem shape{4, 2, 128, "Hq4 Hkv2 D128 striped W3"};
  const global_selection all = test::band_selection(64 * 3 * 5, shape.heads_q, 0, 3 * 5 - 1, true);
  for (const index_t source : {index_t{0}, index_t{1}, index_t{2}}) {
    if (!part.next()) continue;
    CAPTURE(source);
    const step_index index = build_local_index(all, sharding::striped<64>{}, 3, 1, source, {});
    REQUIRE(upload_step_index(index, nullptr).complete);  // else check_step would not run the paired kernel
    check_step<__half>(rng, index, shape);
  }
  // Zigzag at W 2: a rank's two chunks, so that a pair of query blocks can straddle them and the
  // first consumer masks many of the later block's tiles.
  const global_selection zig = test::band_selection(64 * 4 * 3, shape.heads_q, 0, 4 * 3 - 1, true);
  for (const index_t rank : {index_t{0}, index_t{1}})
    for (const index_t source : {index_t{0}, index_t{1}}) {
      if (!part.next()) continue;
      CAPTURE(rank);
      CAPTURE(source);
      const step_index index = build_local_index(zig, sharding::zigzag{}, 2, rank, source, {});
      REQUIRE(upload_step_index(index, nullptr).complete);
      check_step<__nv_bfloat16>(rng, index, shape);
    }
  // The device builder decides completeness by count: it must agree with the row-by-row rule on
  // dense and sparse selections, every sharding, rank and source.
  for (const global_selection& g : {zig, test::random_selection(rng, 64 * 4 * 3, 4, true, 0.5, 0.0), test::random_selection(rng, 64 * 4 * 3, 4, true, 0.3, 0.02)}) {
    if (!part.next()) continue;
    const device_selection on_device(g);
    for (const index_t world : {1, 2, 3})
      for (index_t rank = 0; rank < world; ++rank)
        for (index_t source = 0; source < world; ++source) {
          CAPTURE(world);
          CAPTURE(rank);
          CAPTURE(source);
          const device_step_index seq = build_local_index_device(on_device, sharding::sequential{}, world, rank, source);
          CHECK(seq.complete == holds_every_allowed_tile(seq.to_host()));
          const device_step_index str = build_local_index_device(on_device, sharding::striped<64>{}, world, rank, source);
          CHECK(str.complete == holds_every_allowed_tile(str.to_host()));
          const device_step_index zz = build_local_index_device(on_device, sharding::zigzag{}, world, rank, source);
          CHECK(zz.complete == holds_every_allowed_tile(zz.to_host()));
        }
  }
  // An index that lacks an allowed tile runs the one-block kernels; asking for the paired one fails.
  const global_selection sparse = test::random_selection(rng, 64 * 8, 4, true, 0.3, 0.0);
  const device_step_index incomplete = upload_step_index(build_local_index(sparse, sharding::sequential{}, 1, 0, 0, {}), nullptr);
  CHECK_FALSE(incomplete.complete);
  if (device::hopper_kernels_available() && part.next()) {
    device_buffer<__nv_bfloat16> x(std::size_t(64 * 8) * 4 * 128);
    device_buffer<float> out(x.size()), lse(std::size_t(4) * 64 * 8);
    const tensor_view<const __nv_bfloat16, 3> q_view(x.data(), {64 * 8, 4, 128}), kv_view(x.data(), {64 * 8, 2, 128});
    CHECK_THROWS_WITH_AS(device::sparse_forward<__nv_bfloat16>(
                             incomplete,
                             {.q = q_view, .k = kv_view, .v = kv_view, .out = tensor_view<float, 3>(out.data(), {64 * 8, 4, 128}),
                              .lse = tensor_view<float, 2>(lse.data(), {4, 64 * 8})},
                             1.0 / std::sqrt(128.0), nullptr, {.state = device::running_state::overwrite, .which = device::forward_kernel::wgmma_paired}),
                         doctest::Contains("options.which"), invalid_argument);
  }
}

TEST_CASE("sparse forward merges ring steps into the fp32 running state") {
  using T = __nv_bfloat16;
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  const index_t world = 3, seq_len = 64 * world * 5, hq = 4, hkv = 2, dim = 128, sq = seq_len / world;
  const double scale = 1.0 / std::sqrt(double(dim));
  const global_selection g = test::random_selection(rng, seq_len, hq, true, 0.3, 0.05);
  auto q = random_tensor<T>(rng, std::size_t(sq) * hq * dim, 2.0f);
  const tensor_view<const T, 3> q_view(q.device.data(), {sq, hq, dim});
  std::vector<double> out_ref(std::size_t(sq) * hq * dim), lse_ref(std::size_t(hq) * sq);
  device_buffer<float> out(out_ref.size()), lse(lse_ref.size());
  out.fill_bytes(0xff);
  lse.fill_bytes(0xff);
  // The last step once more from the state before it, writing the output in T itself (final_out).
  device_buffer<float> out_before(out_ref.size()), lse_before(lse_ref.size());
  device_buffer<T> direct_out(out_ref.size());
  direct_out.fill_bytes(0xff);
  std::vector<float> running_before;
  for (index_t step = 0; step < world; ++step) {
    const step_index index = build_local_index(g, sharding::striped<64>{}, world, 1, (1 - step + world) % world, {});
    auto k = random_tensor<T>(rng, std::size_t(sq) * hkv * dim, 2.0f);
    auto v = random_tensor<T>(rng, std::size_t(sq) * hkv * dim, 1.0f);
    std::vector<double> part_out(out_ref.size()), part_lse(lse_ref.size());
    host::reference_forward<double>(view3(std::as_const(q.host), sq, hq, dim), view3(std::as_const(k.host), sq, hkv, dim), view3(std::as_const(v.host), sq, hkv, dim), index.view(), scale,
                                    view3(part_out, sq, hq, dim), view2(part_lse, hq, sq));
    if (step == 0) {
      out_ref = part_out;
      lse_ref = part_lse;
    } else {
      host::merge_partial<double>(view3(out_ref, sq, hq, dim), view2(lse_ref, hq, sq), view3(std::as_const(part_out), sq, hq, dim),
                                  view2(std::as_const(part_lse), hq, sq));
    }
    const device_step_index on_device = upload_step_index(index, nullptr);
    const tensor_view<const T, 3> k_view(k.device.data(), {sq, hkv, dim}), v_view(v.device.data(), {sq, hkv, dim});
    if (step == world - 1) {
      STRIA_CUDA_CHECK(cudaMemcpy(out_before.data(), out.data(), out_ref.size() * sizeof(float), cudaMemcpyDeviceToDevice));
      STRIA_CUDA_CHECK(cudaMemcpy(lse_before.data(), lse.data(), lse_ref.size() * sizeof(float), cudaMemcpyDeviceToDevice));
      running_before = out_before.download();
      device::sparse_forward<T>(on_device,
                                {.q = q_view,
                                 .k = k_view,
                                 .v = v_view,
                                 .out = tensor_view<float, 3>(out_before.data(), {sq, hq, dim}),
                                 .lse = tensor_view<float, 2>(lse_before.data(), {hq, sq}),
                                 .final_out = tensor_view<T, 3>(direct_out.data(), {sq, hq, dim})},
                                scale, nullptr, {.state = device::running_state::merge});
    }
    device::sparse_forward<T>(on_device,
                              {.q = q_view,
                               .k = k_view,
                               .v = v_view,
                               .out = tensor_view<float, 3>(out.data(), {sq, hq, dim}),
                               .lse = tensor_view<float, 2>(lse.data(), {hq, sq})},
                              scale, nullptr, {.state = step == 0 ? device::running_state::overwrite : device::running_state::merge});
  }
  const double out_error = max_relative_error(out.download(), out_ref), lse_error = max_relative_error(lse.download(), lse_ref);
  MESSAGE("3 merged steps, bf16: max relative error O ", out_error, ", LSE ", lse_error);
  CHECK(out_error < tolerance<T>());
  CHECK(lse_error < tolerance<T>());

  // The final cast to the input type.
  device_buffer<T> final_out(out_ref.size());
  device::write_output<T>(tensor_view<const float, 3>(out.data(), {sq, hq, dim}), tensor_view<T, 3>(final_out.data(), {sq, hq, dim}), nullptr);
  const std::vector<float> running = out.download();
  const std::vector<T> cast = final_out.download();
  bool exact = true;
  for (std::size_t i = 0; i < cast.size(); ++i) exact = exact && to_float(cast[i]) == to_float(from_float<T>(running[i]));
  CHECK(exact);

  // The last step writing the output itself: the same bits as the cast, the same LSE, and the running
  // output left as it was.
  auto same_bits = [](const auto& a, const auto& b) { return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0; };
  CHECK(same_bits(direct_out.download(), cast));
  CHECK(same_bits(lse_before.download(), lse.download()));
  CHECK(same_bits(out_before.download(), running_before));
}

TEST_CASE("a single step writes its output in T with no fp32 running output") {
  using T = __nv_bfloat16;
  test::seeded_rng rng;
  CAPTURE(rng.seed);
  const index_t seq_len = 64 * 6, hq = 4, hkv = 2, dim = 128;
  const double scale = 1.0 / std::sqrt(double(dim));
  const global_selection g = test::random_selection(rng, seq_len, hq, true, 0.3, 0.05);
  const device_step_index index = upload_step_index(build_local_index(g, sharding::sequential{}, 1, 0, 0, {}), nullptr);
  auto q = random_tensor<T>(rng, std::size_t(seq_len) * hq * dim, 2.0f);
  auto k = random_tensor<T>(rng, std::size_t(seq_len) * hkv * dim, 2.0f);
  auto v = random_tensor<T>(rng, std::size_t(seq_len) * hkv * dim, 1.0f);
  const tensor_view<const T, 3> q_view(q.device.data(), {seq_len, hq, dim}), k_view(k.device.data(), {seq_len, hkv, dim}),
      v_view(v.device.data(), {seq_len, hkv, dim});
  for (const auto which : {device::forward_kernel::automatic, device::forward_kernel::mma_sync}) {
    // Through the running output and the cast, then straight into T with `out` empty: the same bits.
    device_buffer<float> running(std::size_t(seq_len) * hq * dim), lse(std::size_t(hq) * seq_len), lse_direct(lse.size());
    device_buffer<T> cast(running.size()), direct(running.size());
    lse_direct.fill_bytes(0xff);
    direct.fill_bytes(0xff);
    device::sparse_forward<T>(index,
                              {.q = q_view,
                               .k = k_view,
                               .v = v_view,
                               .out = tensor_view<float, 3>(running.data(), {seq_len, hq, dim}),
                               .lse = tensor_view<float, 2>(lse.data(), {hq, seq_len})},
                              scale, nullptr, {.state = device::running_state::overwrite, .which = which});
    device::write_output<T>(tensor_view<const float, 3>(running.data(), {seq_len, hq, dim}), tensor_view<T, 3>(cast.data(), {seq_len, hq, dim}), nullptr);
    device::sparse_forward<T>(index,
                              {.q = q_view,
                               .k = k_view,
                               .v = v_view,
                               .out = tensor_view<float, 3>{},
                               .lse = tensor_view<float, 2>(lse_direct.data(), {hq, seq_len}),
                               .final_out = tensor_view<T, 3>(direct.data(), {seq_len, hq, dim})},
                              scale, nullptr, {.state = device::running_state::overwrite, .which = which});
    const std::vector<T> a = cast.download(), b = direct.download();
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
    const std::vector<float> la = lse.download(), lb = lse_direct.download();
    CHECK(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0);
  }
  // A merging step needs the running output it merges into.
  device_buffer<float> lse(std::size_t(hq) * seq_len);
  device_buffer<T> direct(std::size_t(seq_len) * hq * dim);
  CHECK_THROWS_WITH_AS(device::sparse_forward<T>(index,
                                                 {.q = q_view,
                                                  .k = k_view,
                                                  .v = v_view,
                                                  .out = tensor_view<float, 3>{},
                                                  .lse = tensor_view<float, 2>(lse.data(), {hq, seq_len}),
                                                  .final_out = tensor_view<T, 3>(direct.data(), {seq_len, hq, dim})},
                                                 scale, nullptr, {.state = device::running_state::merge}),
                       doctest::Contains("out"), invalid_argument);
}

TEST_CASE("sparse attention calls reject bad input with the argument named") {
  using T = __half;
  test::seeded_rng rng;
  const index_t sq = 128, hq = 2, dim = 64;
  const step_index index = random_index(rng, hq, true, {0, 1}, {0, 1}, 0.5, 0.0);
  const device_step_index on_device = upload_step_index(index, nullptr);
  // Written before use (the one good call runs the kernel on it; compute-sanitizer's initcheck
  // reports reads of memory never written). The 8 extra elements back the misaligned view.
  const std::vector<T> host_q(std::size_t(sq) * hq * dim + 8, from_float<T>(1.0f));
  const device_buffer<T> q{std::span<const T>(host_q), nullptr};
  device_buffer<float> out(std::size_t(sq) * hq * dim), lse(std::size_t(hq) * sq);
  const tensor_view<const T, 3> good(q.data(), {sq, hq, dim});
  const tensor_view<float, 3> out_view(out.data(), {sq, hq, dim});
  const tensor_view<float, 2> lse_view(lse.data(), {hq, sq});
  auto forward = [&](tensor_view<const T, 3> a, tensor_view<const T, 3> b, double scale) {
    device::sparse_forward<T>(on_device, {.q = a, .k = b, .v = b, .out = out_view, .lse = lse_view}, scale, nullptr,
                              {.state = device::running_state::overwrite});
  };
  auto message = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  CHECK(message([&] { forward(good, good, 0.125); }) == "no error");
  CHECK(message([&] { forward(tensor_view<const T, 3>(q.data() + 1, {sq, hq, dim}), good, 0.125); }).find("q.data()") != std::string::npos);
  CHECK(message([&] { forward(good, good, 0.0); }).find("softmax_scale") != std::string::npos);
  CHECK(message([&] { forward(good, good, NAN); }).find("softmax_scale") != std::string::npos);
  const tensor_view<const T, 3> three_heads(q.data(), {sq / 2, 3, dim});
  CHECK(message([&] { forward(good, three_heads, 0.125); }).find("query heads") != std::string::npos);
  const tensor_view<const T, 3> odd_dim(q.data(), {sq / 2, hq, 96});
  CHECK(message([&] { forward(odd_dim, odd_dim, 0.125); }).find("head dim") != std::string::npos);
  const tensor_view<const T, 3> short_kv(q.data(), {sq / 2, hq, dim});
  CHECK(message([&] { forward(good, short_kv, 0.125); }).find("index.shape.num_kv_blocks") != std::string::npos);
  CHECK(message([&] { forward(tensor_view<const T, 3>(host_q.data(), {sq, hq, dim}), good, 0.125); }).find("device") != std::string::npos);
}
