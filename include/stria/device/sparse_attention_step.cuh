// SPDX-License-Identifier: Apache-2.0
// Sparse attention of one ring step on the device (DESIGN 8): checks the tensors and the step index,
// then launches the forward (merged into the fp32 running O/LSE) or the three backward passes on the
// caller's stream (backward_options::overlap_passes: half of them on a stream beside it, joined
// before the call returns). The device counterpart of host/reference_attention.hpp, on the same formats.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/tensor_view.hpp"
#include "stria/device/launch.cuh"
#include "stria/device/local_index.cuh"
#include "stria/index/device_index.cuh"
#include "stria/index/step_index.hpp"
#include "stria/kernel/sparse_backward.cuh"
#include "stria/kernel/sparse_backward_wgmma.cuh"
#include "stria/kernel/sparse_forward.cuh"

namespace stria::device {

/// What the forward does with the running state: overwrite it (the first ring step) or merge into it.
/// Neither is zero: forward_options' `state` has no default, and one left out (value-initialized) is an
/// error, not an overwrite of a ring's earlier steps.
enum class running_state { overwrite = 1, merge };

/// Backward accumulation order. atomic: dQ is formed inside the dK/dV passes and added by fp32
/// atomics, as are the vertical tokens' dK/dV (fastest; the summation order varies between runs).
/// deterministic: a separate dQ pass and per-entry scratch for the vertical dK/dV folded in a fixed
/// order, so repeated runs give bit-identical gradients.
enum class determinism { atomic, deterministic };

/// Which forward kernel runs: the Hopper one (wgmma) where the device and this build support it,
/// else the mma.sync one (sm80+); or one of them by name (tests compare them). On Hopper at head dim
/// 128 an index that holds every tile the causal rule allows (device_step_index::complete: dense
/// attention) runs two query blocks per CTA over one stream of K/V tiles (`wgmma_paired`; dense 128K
/// 2-4% faster, RESULTS 2026-12-04, sixth); `wgmma` names the one-block kernel. Ring and solver calls
/// take `automatic`, `mma_sync` or `wgmma`: their steps' indices differ in completeness.
enum class forward_kernel { automatic, mma_sync, wgmma, wgmma_paired };

/// The order in which the forward's CTAs are launched (kernel::detail::launched_row_unit; the Hopper
/// dQ passes' too, backward_options::order), in sections of heads, longest rows first within a
/// section: `query_blocks_inner` launches a head's query blocks one after another; `kv_group_inner`
/// the query heads of a KV head for one query block one after another, so that the heads that read
/// one KV head run at once and share in L2 the tiles their selections have in common; `heads_inner`
/// every head of a query block one after another. The paired kernel launches a head's pairs one
/// after another in every order. `automatic` picks kv_group_inner, and query_blocks_inner for an
/// index that holds every tile the causal rule allows (where grouping showed no gain that held) or
/// for more than 65535 query blocks. kv_group_inner against query_blocks_inner, vs95, D 128: 32K
/// +6-11% (L2 hits 85 -> 93%), 128K +0-1.5% (with Hkv = Hq it is the same order); heads_inner loses
/// up to 4.5% at 128K with Hkv 16; the dQ passes gain 0.4-1.2%, and `automatic` keeps the forward's
/// choice for them though heads_inner was a little faster at 32K (RESULTS, 2026-12-06, second and
/// third).
enum class launch_order { automatic, query_blocks_inner, kv_group_inner, heads_inner };

/// Which kernels run the backward's passes: the Hopper ones (wgmma) where the device and this build
/// support them, else the mma.sync ones (sm80+); or one of them by name (tests compare both).
enum class backward_kernel { automatic, mma_sync, wgmma };

/// Where the Hopper backward's dQ pass gets dS from. `stored`: the dK/dV passes write each active
/// entry's dS (one T per entry of workspace), and the dQ pass is one product per tile (dQ += dS K)
/// instead of three; the passes run over ranges of query heads whose workspace fits
/// backward_options' `ds_workspace_limit` (0: for `stored`, what the device has available less a
/// sixteenth of its memory, in ranges of about equal size; for `automatic`, a quarter of the device's
/// memory and at most half of what is available); a head alone past it is an error for `stored`, and
/// `automatic` then recomputes (as it does where the workspace cannot be allocated after all). Where
/// the ranges split a GQA group, the deterministic mode's bits depend on the device's free memory.
/// The workspace returns to stria's memory pool, which keeps it for the next layer. `recomputed`: the
/// dQ pass forms S, dP and dS again from Q, K, V and dO (no workspace). `automatic` stores at head dim
/// 128 only: the stored dS costs DRAM traffic (2 bytes per entry out and back) that only the larger
/// head dim's recomputation outweighs (RESULTS, 2026-12-02). The mma.sync backward ignores it.
enum class dq_source { automatic, stored, recomputed };

/// Whether the current device runs stria's wgmma kernels: an sm_90 device and code built for
/// sm_90a (probed once per device with a one-thread kernel; every launch asks, so the answer is
/// read without a lock once known).
inline bool hopper_kernels_available() {
  static std::array<std::atomic<int>, detail::lock_free_devices> answer{};  // 0 not probed, 1 no, 2 yes
  static std::mutex mutex;
  static std::map<int, bool> known;
  const int device = detail::current_device();
  if (device < detail::lock_free_devices)
    if (const int a = answer[static_cast<std::size_t>(device)].load(std::memory_order_acquire); a != 0) return a == 2;
  const std::lock_guard lock(mutex);
  if (auto it = known.find(device); it != known.end()) return it->second;
  int major = 0;
  STRIA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  bool available = false;
  if (major == 9) {
    device_buffer<int> flag(1);
    flag.fill_bytes(0);
    detail::launch<&kernel::probe_wgmma<>>("probe_wgmma", {1, 1, 0, flag.stream()}, flag.data());
    available = flag.download()[0] == 1;
  }
  known.emplace(device, available);
  if (device < detail::lock_free_devices) answer[static_cast<std::size_t>(device)].store(available ? 2 : 1, std::memory_order_release);
  return available;
}

namespace detail {

/// The stored dS's workspace limit where backward_options gives none, from the device's memory
/// (`total`) and what is available now (`available`: free, plus what stria's pool holds unused).
/// `automatic`: a quarter of the memory and at most half of what is available, so that the backward
/// leaves the memory that the caller's own allocator (PyTorch's, say) holds alone. `stored`: what is
/// available less a sixteenth of the memory (room for the step's smaller buffers), so that a workspace
/// too large for the device is stored by ranges of heads instead of failing to allocate.
constexpr std::size_t default_ds_workspace_limit(dq_source source, std::size_t available, std::size_t total) {
  if (source == dq_source::stored) return available > total / 16 ? available - total / 16 : 0;
  return std::min(total / 4, available / 2);
}

/// default_ds_workspace_limit on the current device.
inline std::size_t device_ds_workspace_limit(dq_source source) {
  std::size_t free_bytes = 0, total_bytes = 0;
  STRIA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::uint64_t reserved = 0, used = 0;
  const cudaMemPool_t pool = stria::detail::memory_pool();
  STRIA_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  STRIA_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  const std::size_t available = free_bytes + static_cast<std::size_t>(reserved > used ? reserved - used : 0);
  return default_ds_workspace_limit(source, available, total_bytes);
}

/// A range of query heads whose dS a backward stores at once.
struct ds_head_range {
  index_t begin, end;                       // query heads
  std::size_t first_block, first_vertical;  // their first forward-form entries
  std::size_t block_rows, rows;             // dS rows of their block tiles, and in all
};

/// The ranges of query heads whose dS is stored one after another, each at most `limit` bytes of
/// `row_bytes` rows; `block_at` and `vertical_at` hold each head's first block and vertical entry
/// (heads + 1 values each). Ranges end on whole GQA groups of `group` heads where they can: a group
/// split between ranges loads its K and V twice, and its dK/dV sums in a different order
/// (deterministic bits that would depend on the device's memory). `stored` with a limit the caller
/// did not give fills its ranges to about whole / ceil(whole / limit) bytes each, so that the
/// workspace (which stria's pool keeps for the next layer) is no larger than the work needs rather
/// than nearly all the memory there was. A head alone past the limit leaves dS recomputed
/// (automatic: no range) or is refused (stored), naming the option that set the limit.
inline std::vector<ds_head_range> ds_head_ranges(std::span<const index_t> block_at, std::span<const index_t> vertical_at, index_t group,
                                                 std::size_t row_bytes, dq_source source, bool limit_given, std::size_t limit) {
  const std::size_t heads = block_at.size() - 1;
  auto range_of = [&](std::size_t begin, std::size_t end) {
    const std::size_t blocks = static_cast<std::size_t>(block_at[end] - block_at[begin]) * block_tokens;
    return ds_head_range{static_cast<index_t>(begin), static_cast<index_t>(end), static_cast<std::size_t>(block_at[begin]),
                         static_cast<std::size_t>(vertical_at[begin]), blocks,
                         blocks + static_cast<std::size_t>(vertical_at[end] - vertical_at[begin])};
  };
  std::size_t fill = limit;
  if (source == dq_source::stored && !limit_given && limit > 0) {
    const std::size_t whole = range_of(0, heads).rows * row_bytes, pieces = (whole + limit - 1) / limit;
    fill = (whole + pieces - 1) / pieces;
  }
  const auto g = static_cast<std::size_t>(group);
  std::vector<ds_head_range> ranges;
  for (std::size_t begin = 0; begin < heads;) {
    std::size_t end = begin + 1;
    if (const std::size_t bytes = range_of(begin, end).rows * row_bytes; bytes > limit) {
      if (source == dq_source::stored && limit_given)
        throw invalid_argument("options.ds_workspace_limit", limit,
                               "is smaller than query head " + std::to_string(begin) + "'s stored dS (" + std::to_string(bytes) +
                                   " bytes): raise it, or let dq_source::automatic recompute dS");
      if (source == dq_source::stored)
        throw invalid_argument("options.dq_source", "dq_source::stored",
                               "needs query head " + std::to_string(begin) + "'s stored dS (" + std::to_string(bytes) +
                                   " bytes) at once, more than the device has available less a sixteenth of its memory (" +
                                   std::to_string(limit) +
                                   " bytes): free device memory, give options.ds_workspace_limit, or let dq_source::automatic recompute dS");
      return {};
    }
    while (end < heads && range_of(begin, end + 1).rows * row_bytes <= fill) ++end;
    if (end < heads && end % g != 0 && end - end % g > begin) end -= end % g;
    ranges.push_back(range_of(begin, end));
    begin = end;
  }
  return ranges;
}

/// The layout rules every tensor of a kernel call obeys: contiguous, and aligned for the kernel's
/// vector accesses. Pure argument checks, so they run (and are tested) without a GPU.
template <class T, std::size_t Rank>
void check_layout(tensor_view<T, Rank> view, const char* name, std::size_t alignment) {
  if (!view.is_contiguous()) throw invalid_argument(std::string(name) + ".stride(0)", view.stride(0), "the tensor must be contiguous");
  const auto address = reinterpret_cast<std::uintptr_t>(view.data());
  if (address % alignment != 0)
    throw invalid_argument(std::string(name) + ".data()", address, "must be aligned to " + std::to_string(alignment) + " bytes");
}

/// Throws unless every pointer is device (or managed) memory of the current device (a rank's
/// tensors must live on the GPU its kernels run on): the last check of a call, after all the
/// argument checks, since it asks the CUDA runtime.
inline void check_on_device(std::initializer_list<std::pair<const void*, const char*>> pointers) {
  const int current = current_device();
  for (const auto& [pointer, name] : pointers) {
    cudaPointerAttributes attributes{};
    STRIA_CUDA_CHECK(cudaPointerGetAttributes(&attributes, pointer));
    if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
      throw invalid_argument(std::string(name) + ".data()", reinterpret_cast<std::uintptr_t>(pointer), "must point to device (or managed) memory");
    if (attributes.type == cudaMemoryTypeDevice && attributes.device != current)
      throw invalid_argument(std::string(name) + ".data()", reinterpret_cast<std::uintptr_t>(pointer),
                             "is memory of device " + std::to_string(attributes.device) + ", but the kernels run on the current device " +
                                 std::to_string(current));
  }
}

/// The shape of a call from q, k, v, checked with the index and the scale (no CUDA calls).
template <class T>
attention_shape checked_shape(tensor_view<const T, 3> q, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
                              const device_step_index& index, double softmax_scale) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "the sparse attention kernels take bf16 (__nv_bfloat16) or fp16 (__half) inputs");
  const attention_shape shape = checked_attention_shape(q, k, v);
  for (auto [view, name] : {std::pair{q, "q"}, std::pair{k, "k"}, std::pair{v, "v"}}) check_layout(view, name, 16);
  check_index_shape(index.shape, {shape.heads_q, shape.query_tokens / block_tokens, shape.kv_tokens / block_tokens, index.shape.causal});
  check_softmax_scale(softmax_scale);
  return shape;
}

/// A launcher's head dim rule (no CUDA calls): with a compile-time HeadDim (a Tile's), the call's
/// must be it.
template <index_t HeadDim>
void check_head_dim(index_t head_dim) {
  static_assert(HeadDim == any_head_dim || HeadDim == 64 || HeadDim == 128, "stria's kernels exist for head_dim 64 and 128");
  if constexpr (HeadDim != any_head_dim)
    if (head_dim != HeadDim)
      throw invalid_argument("q.extent(2) (head_dim)", head_dim,
                             "must be " + std::to_string(HeadDim) + ": this launcher is instantiated for head_dim " +
                                 std::to_string(HeadDim) + " alone (its Tile's)");
}

}  // namespace detail

/// One ring step's forward operands (device tensors): the step's queries and KV chunk in; the fp32
/// running state, which the step overwrites or merges into, and on the layer's last step the output.
template <class T>
struct step_forward_tensors {
  tensor_view<const T, 3> q;         // [Sq, Hq, D]
  tensor_view<const T, 3> k, v;      // [Sk, Hkv, D]
  tensor_view<float, 3> out;         // [Sq, Hq, D] fp32, the running output
  tensor_view<float, 2> lse;         // [Hq, Sq] fp32 (natural log), the running LSE
  tensor_view<T, 3> final_out = {};  // [Sq, Hq, D] T, the layer's last step only (sparse_forward)
};

/// How a forward step runs. `state` has no valid default: a ring's later steps merge, and a call that
/// left it out must not silently overwrite what the earlier steps summed. It starts at running_state's
/// value 0, which names neither state, so a call that does not set it throws.
struct forward_options {
  running_state state = {};  // overwrite on a layer's first step, merge on every later one; {} (0) throws
  forward_kernel which = forward_kernel::automatic;
  launch_order order = launch_order::automatic;
};

namespace detail {
/// Whether a launch in sections of `section_heads` heads is grouped (kernel::detail::launched_row_unit):
/// more than one head to a section.
inline bool grouped_launch(index_t section_heads) { return section_heads > 1; }
/// The heads of a launch section (kernel::detail::launched_row_unit) in `order`, for a call over
/// `query_blocks`: 1 is a head's query blocks one after another. automatic: a KV head's query heads,
/// or 1 for a complete index; and 1 where a grouped launch's query blocks would not fit its y
/// dimension (65535), which a named order is refused for instead. An order outside the enum is refused.
inline index_t launched_heads(launch_order order, bool complete, index_t query_blocks, const attention_shape& shape) {
  if (order != launch_order::automatic && order != launch_order::query_blocks_inner && order != launch_order::kv_group_inner &&
      order != launch_order::heads_inner)
    throw invalid_argument("options.order", static_cast<int>(order),
                           "must be launch_order::automatic, query_blocks_inner, kv_group_inner or heads_inner");
  constexpr index_t most_query_blocks = 65535;
  const launch_order resolved = order != launch_order::automatic ? order : complete ? launch_order::query_blocks_inner : launch_order::kv_group_inner;
  const index_t section = resolved == launch_order::heads_inner      ? shape.heads_q
                          : resolved == launch_order::kv_group_inner ? shape.heads_q / shape.heads_kv
                                                                     : 1;
  if (!grouped_launch(section) || query_blocks <= most_query_blocks) return section;
  if (order == launch_order::automatic) return 1;
  throw invalid_argument("options.order", order == launch_order::heads_inner ? "launch_order::heads_inner" : "launch_order::kv_group_inner",
                         "needs at most 65535 local query blocks (index.shape.num_query_blocks, a grid dimension); the call has " +
                             std::to_string(query_blocks) + ": use launch_order::automatic or query_blocks_inner");
}
/// The sections of a dQ pass over `heads` query heads from `first_head` (stored dS: a range of
/// heads; backward_options::overlap_passes: half of them) in a launch of `section_heads`: the same
/// where they divide both, else the largest that divides all three (each inside one of the launch's
/// sections; 1: a head's query blocks one after another).
inline index_t dq_section_heads(index_t section_heads, index_t first_head, index_t heads) {
  return std::gcd(std::gcd(section_heads, first_head), heads);
}
/// The forward's grid over `units` (query blocks, or pairs) and `heads`, in sections of
/// `section_heads` (kernel::detail::launched_row_unit): (units, heads), or grouped (heads of a
/// section, units, sections).
inline dim3 forward_grid(index_t section_heads, index_t units, index_t heads) {
  return grouped_launch(section_heads)
             ? dim3(static_cast<unsigned>(section_heads), static_cast<unsigned>(units), static_cast<unsigned>(heads / section_heads))
             : dim3(static_cast<unsigned>(units), static_cast<unsigned>(heads));
}
}  // namespace detail

/// Forward of local queries against the KV chunk of one ring step, on the entries `index` selects.
/// `out` and `lse` are the running state, overwritten on the first step and merged into afterwards;
/// a row no step reaches keeps out = 0, lse = -inf. With `final_out` (the last step) the merged output
/// goes there, rounded to T, and `out` is left as it was (what write_output would do after the step,
/// without the pass). A single step (overwrite with final_out) neither reads nor writes `out`: it may
/// then be empty, which spares a caller with one KV chunk the fp32 running output.
template <class T, index_t HeadDim = any_head_dim>
void sparse_forward(const device_step_index& index, const step_forward_tensors<T>& tensors, double softmax_scale, cudaStream_t stream,
                    const forward_options& options) {
  const auto& [q, k, v, out, lse, final_out] = tensors;
  const auto& [state, which, order] = options;
  const attention_shape shape = detail::checked_shape(q, k, v, index, softmax_scale);
  detail::check_head_dim<HeadDim>(shape.head_dim);
  if (state != running_state::overwrite && state != running_state::merge)
    throw invalid_argument("options.state", static_cast<int>(state),
                           "must be running_state::overwrite (a layer's first step) or running_state::merge (every later one): it has no default");
  const index_t section_heads = detail::launched_heads(order, index.complete, index.shape.num_query_blocks, shape);
  const bool without_running = out.data() == nullptr && final_out.data() && state == running_state::overwrite;
  if (!without_running) {
    check_extents(out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "out");
    detail::check_layout(out, "out", 8);
  }
  check_extents(lse, {shape.heads_q, shape.query_tokens}, "lse");
  detail::check_layout(lse, "lse", 4);
  if (final_out.data()) {
    check_extents(final_out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "final_out");
    detail::check_layout(final_out, "final_out", 4);
  }
  const bool hopper = which == forward_kernel::wgmma || which == forward_kernel::wgmma_paired ||
                      (which == forward_kernel::automatic && hopper_kernels_available());
  if ((which == forward_kernel::wgmma || which == forward_kernel::wgmma_paired) && !hopper_kernels_available())
    throw invalid_argument("options.which", which == forward_kernel::wgmma ? "forward_kernel::wgmma" : "forward_kernel::wgmma_paired",
                           "needs an sm_90 device and code built for sm_90a");
  if (which == forward_kernel::wgmma_paired && (!index.complete || shape.head_dim != 128))
    throw invalid_argument("options.which", "forward_kernel::wgmma_paired",
                           "needs head dim 128 (the call has " + std::to_string(shape.head_dim) +
                               ") and an index that holds every tile the causal rule allows (index.complete: " +
                               (index.complete ? "true" : "false") + ")");
  const bool paired = hopper && shape.head_dim == 128 && index.complete && which != forward_kernel::wgmma;
  detail::check_on_device({{q.data(), "q"}, {k.data(), "k"}, {v.data(), "v"}, {lse.data(), "lse"}});
  if (!without_running) detail::check_on_device({{out.data(), "out"}});
  if (final_out.data()) detail::check_on_device({{final_out.data(), "final_out"}});
  const kernel::forward_params<T> params{index.view(),
                                         q.data(),
                                         k.data(),
                                         v.data(),
                                         out.data(),
                                         lse.data(),
                                         shape.heads_q,
                                         shape.heads_kv,
                                         shape.query_tokens,
                                         static_cast<float>(softmax_scale * kernel::detail::log2e),
                                         state == running_state::merge,
                                         final_out.data()};
  const bool grouped = detail::grouped_launch(section_heads);
  const dim3 grid = detail::forward_grid(section_heads, index.shape.num_query_blocks, shape.heads_q);
  detail::with_head_dim<HeadDim>(shape.head_dim, [&]<int D>() {
    if constexpr (D == 128) {
      if (paired) {  // two query blocks per CTA, a head's pairs one after another in every order
        constexpr std::size_t bytes = kernel::forward_wgmma_shared_bytes<D, true>();
        const dim3 pairs = detail::forward_grid(1, (index.shape.num_query_blocks + 1) / 2, shape.heads_q);
        detail::launch<&kernel::sparse_forward_wgmma<T, D, true>>("sparse_forward_wgmma (paired)",
                                                                  {pairs, kernel::forward_wgmma_threads<D, true>, bytes, stream}, params);
        return;
      }
    }
    auto launch = [&]<bool Grouped>() {
      if (hopper) {
        constexpr std::size_t bytes = kernel::forward_wgmma_shared_bytes<D>();
        detail::launch<&kernel::sparse_forward_wgmma<T, D, false, Grouped>>("sparse_forward_wgmma",
                                                                            {grid, kernel::forward_wgmma_threads<D>, bytes, stream}, params);
      } else {
        constexpr std::size_t bytes = kernel::forward_shared_bytes<D, T>();
        detail::launch<&kernel::sparse_forward<T, D, Grouped>>("sparse_forward", {grid, kernel::attention_threads, bytes, stream}, params);
      }
    };
    if (grouped) launch.template operator()<true>();
    else launch.template operator()<false>();
  });
}

/// The final output: the fp32 running output rounded to T (after the last step).
template <class T>
void write_output(tensor_view<const float, 3> running, tensor_view<T, 3> out, cudaStream_t stream) {
  check_extents(out, {running.extent(0), running.extent(1), running.extent(2)}, "out");
  detail::check_layout(running, "running", 4);
  detail::check_layout(out, "out", sizeof(T));
  detail::check_on_device({{running.data(), "running"}, {out.data(), "out"}});
  const std::int64_t count = out.size();
  detail::launch<&kernel::write_output<T>>("write_output", {std::min(stria::detail::blocks_for(count, 256), 65535u), 256, 0, stream}, running.data(),
                                           out.data(), count);
}

/// delta [Hq, Sq] = rowsum(dO * O), from the final output; computed once per layer before the
/// backward steps.
template <class T>
void backward_delta(tensor_view<const T, 3> out, tensor_view<const T, 3> d_out, tensor_view<float, 2> delta, cudaStream_t stream) {
  check_extents(d_out, {out.extent(0), out.extent(1), out.extent(2)}, "d_out");
  check_extents(delta, {out.extent(1), out.extent(0)}, "delta");
  detail::check_layout(out, "out", sizeof(T));
  detail::check_layout(d_out, "d_out", sizeof(T));
  detail::check_layout(delta, "delta", 4);
  detail::check_on_device({{out.data(), "out"}, {d_out.data(), "d_out"}, {delta.data(), "delta"}});
  const std::int64_t rows = static_cast<std::int64_t>(out.extent(0)) * out.extent(1);
  const index_t dim = out.extent(2);
  const bool aligned = reinterpret_cast<std::uintptr_t>(out.data()) % 16 == 0 && reinterpret_cast<std::uintptr_t>(d_out.data()) % 16 == 0;
  // 16-byte loads of eight 2-byte elements where the rows allow them (D 64 and 128, aligned).
  const int lanes = sizeof(T) == 2 && aligned && (dim == 64 || dim == 128) ? static_cast<int>(dim) / 8 : 0;
  auto vectorized = [&]<int Lanes>() {
    if constexpr (sizeof(T) == 2)
      detail::launch<&kernel::backward_delta_vectorized<T, Lanes>>("backward_delta", {stria::detail::blocks_for(rows * Lanes, 256), 256, 0, stream},
                                                                   out.data(), d_out.data(), out.extent(0), out.extent(1), delta.data());
  };
  if (lanes == 16) vectorized.template operator()<16>();
  else if (lanes == 8) vectorized.template operator()<8>();
  else
    detail::launch<&kernel::backward_delta<T>>("backward_delta", {stria::detail::blocks_for(rows * 32, 256), 256, 0, stream}, out.data(),
                                               d_out.data(), out.extent(0), out.extent(1), dim, delta.data());
}

/// One ring step's backward operands (device tensors): the step's queries and KV chunk, the incoming
/// gradient and the layer's row statistics in; the fp32 gradient sums, which the step adds to.
template <class T>
struct step_backward_tensors {
  tensor_view<const T, 3> q;               // [Sq, Hq, D]
  tensor_view<const T, 3> k, v;            // [Sk, Hkv, D]
  tensor_view<const T, 3> d_out;           // [Sq, Hq, D]
  tensor_view<const float, 2> lse, delta;  // [Hq, Sq]: the final forward LSE; backward_delta's
  tensor_view<float, 3> dq;                // [Sq, Hq, D] fp32, the local queries'
  tensor_view<float, 3> dk, dv;            // [Sk, Hkv, D] fp32, the KV chunk's (they travel with it)
  T* dq_out = nullptr;                     // [Sq, Hq, D] T, the layer's last step only (sparse_backward)
};

/// How a backward step runs; the defaults are what a training step wants.
struct backward_options {
  determinism mode = determinism::atomic;
  backward_kernel which = backward_kernel::automatic;
  dq_source source = dq_source::automatic;
  std::size_t ds_workspace_limit = 0;  // bytes of stored dS (dq_source); 0: the source's default
  // The Hopper dQ passes' CTAs, as forward_options' order; checked (and refused past 65535 query
  // blocks where named grouped) for every kernel family, though the mma.sync passes ignore it.
  launch_order order = launch_order::automatic;
  // Hopper, atomic mode, dS stored in one range over two or more KV heads: the dK/dV-then-dQ chains
  // of the two halves of the KV heads, which share no output, run side by side, the second on a
  // stream beside the caller's (stria::detail::side_stream, joined back before the call returns), so
  // that a launch's last CTAs leave SMs to the other chain's work instead of idle (H100, vs95, D 128:
  // 128K +0.5%, 32K +5.4%). Not taken where it measured slower: the deterministic mode and the dQ
  // pass recomputing dS (RESULTS, 2026-12-07, second).
  bool overlap_passes = true;
};

/// Backward of one ring step: ADDS this step's contribution to dq (fp32, the local queries), and to
/// dk, dv (fp32, the step's KV chunk, travelling with it). With `dq_out` (the layer's last step),
/// dq + this step's dQ goes out there in T, and dq's contents are not needed afterwards (the Hopper dQ
/// passes write dq_out directly and leave dq as it was; the mma.sync passes, or a dq_out not aligned
/// to 4 bytes, add into dq and cast); dq's data may then be null (a single step: no fp32 dq at all).
template <class T, index_t HeadDim = any_head_dim>
void sparse_backward(const device_step_index& index, const step_backward_tensors<T>& tensors, double softmax_scale, cudaStream_t stream,
                     const backward_options& options = {}) {
  const auto& [q, k, v, d_out, lse, delta, dq, dk, dv, dq_out] = tensors;
  const auto& [mode, which, source, ds_workspace_limit, order, overlap_passes] = options;
  const attention_shape shape = detail::checked_shape(q, k, v, index, softmax_scale);
  detail::check_head_dim<HeadDim>(shape.head_dim);
  const index_t section_heads = detail::launched_heads(order, index.complete, index.shape.num_query_blocks, shape);  // of the dQ passes
  check_extents(d_out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "d_out");
  check_extents(lse, {shape.heads_q, shape.query_tokens}, "lse");
  check_extents(delta, {shape.heads_q, shape.query_tokens}, "delta");
  const bool with_dq = dq.data() || !dq_out;  // null with dq_out: no fp32 dQ (then any view, an empty one too)
  if (with_dq) check_extents(dq, {shape.query_tokens, shape.heads_q, shape.head_dim}, "dq");
  check_extents(dk, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "dk");
  check_extents(dv, {shape.kv_tokens, shape.heads_kv, shape.head_dim}, "dv");
  detail::check_layout(d_out, "d_out", 16);
  detail::check_layout(lse, "lse", 4);
  detail::check_layout(delta, "delta", 4);
  if (with_dq) detail::check_layout(dq, "dq", 16);  // the Hopper passes add dQ by 16-byte reductions
  detail::check_layout(dk, "dk", 8);
  detail::check_layout(dv, "dv", 8);
  detail::check_on_device({{q.data(), "q"},
                           {k.data(), "k"},
                           {v.data(), "v"},
                           {d_out.data(), "d_out"},
                           {lse.data(), "lse"},
                           {delta.data(), "delta"},
                           {dk.data(), "dk"},
                           {dv.data(), "dv"}});
  if (dq.data()) detail::check_on_device({{dq.data(), "dq"}});
  if (dq_out) detail::check_on_device({{dq_out, "dq_out"}});

  const bool hopper = which != backward_kernel::mma_sync && hopper_kernels_available();
  if (which == backward_kernel::wgmma && !hopper)
    throw invalid_argument("options.which", "backward_kernel::wgmma", "needs an sm_90 device and code built for sm_90a");
  // dq_out written by the Hopper dQ passes themselves (pairs of T: 4-byte aligned); otherwise the
  // passes add into dq (zeros in a scratch where dq is null) and it is cast to dq_out after them.
  const bool dq_out_direct = dq_out && hopper && reinterpret_cast<std::uintptr_t>(dq_out) % 4 == 0;
  const bool dq_cast_after = dq_out && !dq_out_direct;
  device_buffer<float> dq_scratch(dq_cast_after && !dq.data() ? static_cast<std::size_t>(q.size()) : 0, stream);
  if (dq_scratch.size() > 0) dq_scratch.fill_bytes(0, stream);
  float* const dq_sum = dq.data() ? dq.data() : dq_scratch.data();  // null only with dq_out_direct
  const auto entries = static_cast<index_t>(index.vtoken.size());
  const bool deterministic = mode == determinism::deterministic && entries > 0;
  device_buffer<float> vertical_dk(deterministic ? static_cast<std::size_t>(entries) * shape.head_dim : 0, stream);
  device_buffer<float> vertical_dv(deterministic ? static_cast<std::size_t>(entries) * shape.head_dim : 0, stream);
  // The passes read the LSE in the log2 domain: converted once here rather than per tile.
  const std::int64_t lse_count = std::int64_t{shape.heads_q} * shape.query_tokens;
  device_buffer<float> lse_log2(static_cast<std::size_t>(lse_count), stream);
  if (lse_count > 0) {
    detail::launch<&kernel::log2_lse<>>("log2_lse", {std::min(stria::detail::blocks_for(lse_count, 256), 65535u), 256, 0, stream}, lse.data(),
                                        lse_log2.data(), lse_count);
  }
  // The stored dS (Hopper): 64 rows of 64 values per block tile, one row per vertical entry, for a
  // range of query heads at a time (detail::ds_head_ranges), each within the workspace limit
  // (detail::default_ds_workspace_limit where options give none). No range: the dQ pass recomputes dS.
  std::vector<detail::ds_head_range> head_ranges;
  const std::size_t block_entries = index.block_col.size(), vertical_entries = index.col_token.size();
  const std::size_t total_rows = block_entries * block_tokens + vertical_entries;
  const std::size_t row_bytes = block_tokens * sizeof(T);
  if (hopper && total_rows > 0 && (source == dq_source::stored || (source == dq_source::automatic && shape.head_dim == 128))) {
    const std::size_t limit = ds_workspace_limit != 0 ? ds_workspace_limit : detail::device_ds_workspace_limit(source);
    if (total_rows * row_bytes <= limit) {
      head_ranges.push_back({0, shape.heads_q, 0, 0, block_entries * block_tokens, total_rows});
    } else {  // each head's first entries (one synchronisation, only where the whole does not fit)
      const auto heads = static_cast<std::size_t>(shape.heads_q), pitch = static_cast<std::size_t>(index.shape.num_query_blocks) * sizeof(index_t);
      std::vector<index_t> block_at(heads + 1), vertical_at(heads + 1);
      STRIA_CUDA_CHECK(cudaMemcpy2DAsync(block_at.data(), sizeof(index_t), index.block_ptr.data(), pitch, sizeof(index_t), heads + 1,
                                         cudaMemcpyDeviceToHost, stream));
      STRIA_CUDA_CHECK(cudaMemcpy2DAsync(vertical_at.data(), sizeof(index_t), index.col_ptr.data(), pitch, sizeof(index_t), heads + 1,
                                         cudaMemcpyDeviceToHost, stream));
      STRIA_CUDA_CHECK(cudaStreamSynchronize(stream));
      head_ranges = detail::ds_head_ranges(block_at, vertical_at, shape.group_size(), row_bytes, source, ds_workspace_limit != 0, limit);
    }
  }
  std::size_t workspace_rows = 0;
  for (const detail::ds_head_range& r : head_ranges) workspace_rows = std::max(workspace_rows, r.rows);
  device_buffer<T> ds;
  try {
    ds = device_buffer<T>(workspace_rows * block_tokens, stream);
  } catch (const cuda_error&) {  // out of memory after all: automatic recomputes, stored fails
    if (source == dq_source::stored) throw;
    static_cast<void>(cudaGetLastError());
    head_ranges.clear();
  }
  const bool store_ds = !head_ranges.empty();
  device_buffer<index_t> kv_query_entry(store_ds ? block_entries : 0, stream);
  const std::int64_t group_ids = kernel::detail::vertical_group::id_bound(static_cast<std::int64_t>(index.vtoken.size()), shape.heads_q);
  device_buffer<index_t> vertical_group_entry(store_ds && vertical_entries > 0 ? static_cast<std::size_t>(group_ids * index.shape.num_query_blocks) : 0,
                                              stream);
  if (store_ds) {
    const step_index_view view = index.view();
    if (block_entries > 0) {
      detail::launch<&kernel::transposed_block_entries<>>(
          "transposed_block_entries", {std::min(stria::detail::blocks_for(static_cast<std::int64_t>(block_entries), 256), 65535u), 256, 0, stream},
          view, static_cast<index_t>(block_entries), kv_query_entry.data());
    }
    if (vertical_entries > 0) {
      // The groups of a head are strided over z: sized by all heads' tokens together (what one head
      // could hold), z was ~650 at 128K with ~30 groups per head, and the empty CTAs cost 0.19 ms.
      constexpr std::int64_t group_strides = 16;
      const dim3 grid(stria::detail::blocks_for(index.shape.num_query_blocks, 128), static_cast<unsigned>(shape.heads_q),
                      static_cast<unsigned>(std::min<std::int64_t>(static_cast<std::int64_t>(index.vtoken.size()) / block_tokens + 1, group_strides)));
      detail::launch<&kernel::vertical_group_entries<>>("vertical_group_entries", {grid, 128, 0, stream}, view, vertical_group_entry.data());
    }
  }
  kernel::backward_params<T> params{index.view(),
                                          q.data(),
                                          k.data(),
                                          v.data(),
                                          d_out.data(),
                                          lse_log2.data(),
                                          delta.data(),
                                          dq_sum,
                                          dk.data(),
                                          dv.data(),
                                          deterministic ? vertical_dk.data() : nullptr,
                                          deterministic ? vertical_dv.data() : nullptr,
                                          shape.heads_q,
                                          shape.heads_kv,
                                          shape.query_tokens,
                                          static_cast<float>(softmax_scale),
                                          static_cast<float>(softmax_scale * kernel::detail::log2e)};
  if (dq_out_direct) params.final_dq = dq_out;
  if (store_ds) {
    params.kv_query_entry = kv_query_entry.data();
    params.vertical_group_entry = vertical_group_entry.data();
  }
  detail::with_head_dim<HeadDim>(shape.head_dim, [&]<int D>() {
    // The passes (DESIGN 8): a dQ pass (mma.sync: unless the atomic mode fuses dQ into the dK/dV
    // passes), the dK/dV block pass, and the vertical-token pass.
    auto passes = [&]<bool Atomic>() {
      const dim3 rows(static_cast<unsigned>(index.shape.num_query_blocks), static_cast<unsigned>(shape.heads_q));
      const dim3 columns(static_cast<unsigned>(index.shape.num_kv_blocks), static_cast<unsigned>(shape.heads_kv));
      // One CTA per 64 entries of a head's token list (at most entries / 64 + heads of them) and, in
      // the atomic mode, per range of 256 query blocks: an early token's list runs over every later
      // block, and one CTA walking all of them was the pass's tail.
      const unsigned ranges = static_cast<unsigned>((index.shape.num_query_blocks + 255) / 256);
      const dim3 tokens(static_cast<unsigned>(entries / block_tokens + shape.heads_q), Atomic ? ranges : 1u);
      if (hopper) {
        // On Hopper dQ has its own pass in both modes: a dQ fused into the dK/dV passes goes to global
        // memory by fp32 reductions, and those made the fused passes L2-bound (RESULTS, 2026-12-01).
        // The atomic mode differs only in how dK/dV are added: by reductions (the vertical tokens'
        // rows meet the block rows in one launch), with the vertical walks split into query ranges.
        constexpr std::size_t bytes = kernel::backward_wgmma_shared_bytes<D>();
        auto dkdv_passes = [&](cudaStream_t on) {  // over the heads of params.head_begin .. head_end
          // The vertical CTAs, then the block CTAs, in one launch. Deterministic: (head, group of 64
          // entries) with the head fastest, as many groups as any head could have (a head's list
          // holds at most one entry per KV token; a CTA past its head's last group returns).
          const auto groups = std::min<std::int64_t>((entries + block_tokens - 1) / block_tokens, index.shape.num_kv_blocks);
          kernel::vertical_launch vertical;
          if (entries > 0)
            vertical = Atomic ? kernel::vertical_launch{static_cast<index_t>(tokens.x), static_cast<index_t>(tokens.y)}
                              : kernel::vertical_launch{shape.heads_q, static_cast<index_t>(groups)};
          const std::int64_t ctas = vertical.ctas() + std::int64_t{columns.x} * columns.y;
          if (ctas == 0) return;
          detail::launch<&kernel::sparse_backward_dkdv_wgmma<T, D>>(
              "sparse_backward_dkdv_wgmma", {static_cast<unsigned>(ctas), kernel::attention_threads, bytes, on}, params, vertical);
        };
        auto cover_heads = [&](index_t begin, index_t end) {  // the query heads of the passes launched next
          params.head_begin = begin;
          params.head_end = end;
        };
        // The dQ pass in the forward's launch order: dS stored, over query heads [begin, end) (the
        // dK/dV launch's params.head_begin .. head_end, which it sets); or recomputed, over all heads.
        auto dq_pass = [&](dq_source pass, index_t begin, index_t end, cudaStream_t on) {
          cover_heads(begin, end);
          const index_t section = detail::dq_section_heads(section_heads, begin, end - begin);
          const dim3 grid = detail::forward_grid(section, index.shape.num_query_blocks, end - begin);
          auto launch = [&]<bool Grouped>() {
            if (pass == dq_source::stored) {
              constexpr std::size_t bytes = kernel::backward_dq_stored_shared_bytes<D>();
              detail::launch<&kernel::sparse_backward_dq_stored_wgmma<T, D, Grouped>>("sparse_backward_dq_stored_wgmma",
                                                                                      {grid, kernel::attention_threads, bytes, on}, params);
            } else {
              constexpr std::size_t bytes = kernel::backward_dq_wgmma_shared_bytes<D>();
              detail::launch<&kernel::sparse_backward_dq_wgmma<T, D, Grouped>>("sparse_backward_dq_wgmma",
                                                                               {grid, kernel::attention_threads, bytes, on}, params);
            }
          };
          if (detail::grouped_launch(section)) launch.template operator()<true>();
          else launch.template operator()<false>();
        };
        if (!store_ds) {
          dq_pass(dq_source::recomputed, 0, shape.heads_q, stream);
          dkdv_passes(stream);
          return;
        }
        auto workspace = [&](const detail::ds_head_range& range) {
          params.ds_first_block = static_cast<index_t>(range.first_block);
          params.ds_first_vertical = static_cast<index_t>(range.first_vertical);
          params.ds_blocks = ds.data();
          params.ds_vertical = ds.data() + range.block_rows * block_tokens;
        };
        if (overlap_passes && Atomic && head_ranges.size() == 1 && shape.heads_kv > 1) {
          // Two halves of the KV heads (whole GQA groups, so that each dK/dV row and each dS entry
          // has one chain) over the one workspace at the whole range's offsets (one range: all
          // heads). Both dK/dV launches go first: in practice the GPU hands out the CTAs of launches
          // in the order they were issued, and each dQ pass can start only once its own half's
          // dK/dV launch is done.
          workspace(head_ranges.front());
          const index_t split = shape.heads_kv / 2 * shape.group_size();
          const forked_stream side(stream, stria::detail::side_stream(stream));  // joined when it goes
          cover_heads(0, split);
          dkdv_passes(stream);
          cover_heads(split, shape.heads_q);
          dkdv_passes(side.get());
          dq_pass(dq_source::stored, 0, split, stream);
          dq_pass(dq_source::stored, split, shape.heads_q, side.get());
          return;
        }
        for (const detail::ds_head_range& range : head_ranges) {  // dK/dV accumulate over the ranges; each dq row has one
          cover_heads(range.begin, range.end);
          workspace(range);
          dkdv_passes(stream);
          // After both dK/dV passes, which wrote every dS it reads.
          dq_pass(dq_source::stored, range.begin, range.end, stream);
        }
        return;
      }
      if constexpr (!Atomic) {
        constexpr std::size_t dq_bytes = kernel::backward_dq_shared_bytes<D, T>();
        detail::launch<&kernel::sparse_backward_dq<T, D>>("sparse_backward_dq", {rows, kernel::attention_threads, dq_bytes, stream}, params);
      }
      constexpr std::size_t dkdv_bytes = kernel::backward_dkdv_shared_bytes<D, T, Atomic>();
      detail::launch<&kernel::sparse_backward_dkdv<T, D, Atomic>>("sparse_backward_dkdv", {columns, kernel::attention_threads, dkdv_bytes, stream},
                                                                  params);
      if (entries == 0) return;
      constexpr std::size_t vertical_bytes = kernel::backward_vertical_shared_bytes<D, T, Atomic>();
      detail::launch<&kernel::sparse_backward_vertical<T, D, Atomic>>("sparse_backward_vertical",
                                                                      {tokens, kernel::attention_threads, vertical_bytes, stream}, params);
    };
    if (mode == determinism::atomic) {
      passes.template operator()<true>();
      return;
    }
    passes.template operator()<false>();
    if (!deterministic) return;  // no vertical entries
    const unsigned blocks = stria::detail::blocks_for(static_cast<std::int64_t>(entries) * D, 256);
    for (index_t offset = 0; offset < shape.group_size(); ++offset) {
      detail::launch<&kernel::add_vertical_gradients<D>>("add_vertical_gradients", {blocks, 256, 0, stream}, index.view(), vertical_dk.data(),
                                                         vertical_dv.data(), entries, shape.heads_kv, shape.group_size(), offset, dk.data(),
                                                         dv.data());
    }
  });
  if (dq_cast_after)
    write_output<T>(tensor_view<const float, 3>(dq_sum, {shape.query_tokens, shape.heads_q, shape.head_dim}),
                    tensor_view<T, 3>(dq_out, {shape.query_tokens, shape.heads_q, shape.head_dim}), stream);
}

}  // namespace stria::device
