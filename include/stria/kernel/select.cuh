// SPDX-License-Identifier: Apache-2.0
// Kernels of the GPU top-p selection (estimator/select.cuh): the same steps as the host's
// select_head and finish_head (estimator/select.hpp), one CTA per query head. The few steps whose
// result depends on the order of floating-point additions (the running sums that decide how many
// lines reach the goal, the residual masses) run in one thread in the host's order, so the device
// picks exactly what the host picks from the same statistics.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"

namespace stria::kernel {

inline constexpr int select_threads = 256;

/// What the selection kernels read and write. Statistics: [heads] window mass, [heads, diagonals]
/// slash mass, [heads, candidates] vertical candidates in selection order (mass -1 pads the end).
struct selection_params {
  index_t heads, seq_len, num_blocks, diagonals, diagonal_offset, candidates;
  bool causal;
  double p_vertical, p_slash;
  index_t vertical_min, vertical_cap, slash_min, slash_cap, sink_tokens, local_diagonals;
  const float* window_mass;
  const float* slash_mass;
  const float* candidate_mass;
  const index_t* candidate_token;
  double* residual;              // [heads, diagonals]: slash mass left after the verticals; sort keys
  index_t* diagonal;             // [heads, diagonals]: 0 .. diagonals - 1 per head; sort values
  double* covered;               // [heads]: window mass of the local diagonals and the verticals
  std::uint64_t* vertical_bits;  // [heads, words]: bitmap of the selected tokens
  index_t* slash_flag;           // [heads, diagonals]: 1 where the diagonal is selected
  index_t* vertical_count;       // [heads + 1]: selected tokens per head (0 tail for the scan)
  index_t* slash_count;          // [heads + 1]
};

namespace detail {

STRIA_HOST_DEVICE constexpr index_t bitmap_words(index_t seq_len) { return (seq_len + 63) / 64; }

/// The local diagonals, delta in (-local, local), as the index range [begin, end).
struct diagonal_range {
  index_t begin, end;
};
STRIA_HOST_DEVICE constexpr diagonal_range local_diagonal_range(const selection_params& p) {
  const index_t begin = p.diagonal_offset - p.local_diagonals + 1, end = p.diagonal_offset + p.local_diagonals;
  return {begin > 0 ? begin : 0, end < p.diagonals ? end : p.diagonals};
}

/// Masses staged in shared memory per round of the serial loops below: thread 0 then reads shared
/// memory instead of waiting on one global load per step.
inline constexpr int select_chunk = 1024;

/// count_to_goal of select.hpp over the first `n` masses (`mass_at(i)`, a float value), with the
/// host's order of additions; the whole CTA calls it and receives the count (it is a barrier).
template <class MassAt>
__device__ index_t count_to_goal(MassAt mass_at, index_t n, double goal, index_t min, index_t cap, float* staged) {
  __shared__ index_t count;
  __shared__ bool more;
  double sum = 0;  // thread 0's
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  for (index_t first = 0; first < n; first += select_chunk) {
    for (index_t i = threadIdx.x; i < select_chunk && first + i < n; i += blockDim.x) staged[i] = mass_at(first + i);
    __syncthreads();
    if (threadIdx.x == 0) {
      const index_t end = ::min(n, first + select_chunk);
      index_t c = count;
      while (c < end && c < cap && sum < goal) sum += staged[c++ - first];
      count = c;
      more = c == end && c < cap && sum < goal;
    }
    __syncthreads();
    if (!more) break;
  }
  const index_t result = ::min(::max(count, min), ::min(cap, n));
  __syncthreads();  // `count` and `staged` are reused by the next call
  return result;
}

}  // namespace detail

/// Step 1 (select_head, verticals): how many candidates reach p_vertical of the mass outside the
/// local diagonals; their bits, the sinks' bits, and the residual slash masses (local diagonals
/// keyed -1 so that a descending sort puts them last). Grid: heads.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) select_verticals(selection_params p) {
  const index_t h = blockIdx.x, words = detail::bitmap_words(p.seq_len);
  const float* slash = p.slash_mass + static_cast<std::int64_t>(h) * p.diagonals;
  const float* mass = p.candidate_mass + static_cast<std::int64_t>(h) * p.candidates;
  const index_t* token = p.candidate_token + static_cast<std::int64_t>(h) * p.candidates;
  double* residual = p.residual + static_cast<std::int64_t>(h) * p.diagonals;
  std::uint64_t* bits = p.vertical_bits + static_cast<std::int64_t>(h) * words;
  const detail::diagonal_range locals = detail::local_diagonal_range(p);
  __shared__ float staged[detail::select_chunk];
  __shared__ index_t staged_token[detail::select_chunk];
  __shared__ index_t valid;
  for (index_t i = threadIdx.x; i < p.diagonals; i += blockDim.x) {
    residual[i] = slash[i];
    p.diagonal[static_cast<std::int64_t>(h) * p.diagonals + i] = i;
  }
  for (index_t w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0;
  if (threadIdx.x == 0) {  // the pads (mass -1) sort last: binary search for the first
    index_t lo = 0, hi = p.candidates;
    while (lo < hi) {
      const index_t mid = (lo + hi) / 2;
      if (mass[mid] >= 0.0f) lo = mid + 1;
      else hi = mid;
    }
    valid = lo;
  }
  __syncthreads();
  double local = 0;  // thread 0's, in ascending diagonal order as the host adds them
  for (index_t i = locals.begin; threadIdx.x == 0 && i < locals.end; ++i) local += slash[i];
  const double total = p.window_mass[h];
  const index_t chosen = detail::count_to_goal([&](index_t i) { return mass[i]; }, valid, p.p_vertical * (total - local), p.vertical_min,
                                               p.vertical_cap, staged);
  // The chosen verticals leave their diagonals' residual mass, in candidate order (thread 0).
  double covered = local;
  for (index_t first = 0; first < chosen; first += detail::select_chunk) {
    for (index_t i = threadIdx.x; i < detail::select_chunk && first + i < chosen; i += blockDim.x) {
      staged[i] = mass[first + i];
      staged_token[i] = token[first + i];
    }
    __syncthreads();
    for (index_t i = 0; threadIdx.x == 0 && i < detail::select_chunk && first + i < chosen; ++i) {
      residual[p.num_blocks - 1 - staged_token[i] / block_tokens + p.diagonal_offset] -= staged[i];
      covered += staged[i];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) p.covered[h] = covered;
  for (index_t i = threadIdx.x; i < chosen; i += blockDim.x)
    atomicOr(reinterpret_cast<unsigned long long*>(bits + token[i] / 64), 1ull << (token[i] % 64));
  for (index_t t = threadIdx.x; t < p.sink_tokens; t += blockDim.x) atomicOr(reinterpret_cast<unsigned long long*>(bits + t / 64), 1ull << (t % 64));
  for (index_t i = threadIdx.x; i < p.diagonals; i += blockDim.x)  // +0.0 for <= 0: -0.0 and +0.0 must tie, as on the host
    residual[i] = i >= locals.begin && i < locals.end ? -1.0 : (residual[i] > 0.0 ? residual[i] : 0.0);
}

/// Step 2 (select_head, slashes), after each head's diagonals were sorted by residual mass
/// (descending, stable: ties keep the smaller diagonal first): how many reach p_slash of the window
/// mass together with what is covered; their flags and the local diagonals' flags. Grid: heads.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads)
    select_slashes(selection_params p, const double* __restrict__ sorted_residual, const index_t* __restrict__ sorted_diagonal) {
  const index_t h = blockIdx.x;
  const std::int64_t row = static_cast<std::int64_t>(h) * p.diagonals;
  __shared__ float staged[detail::select_chunk];
  for (index_t i = threadIdx.x; i < p.diagonals; i += blockDim.x) p.slash_flag[row + i] = 0;
  const detail::diagonal_range locals = detail::local_diagonal_range(p);
  const index_t n = ::min(p.slash_cap, p.diagonals - (locals.end - locals.begin));  // the host's candidate list
  const index_t chosen = detail::count_to_goal([&](index_t i) { return float(sorted_residual[row + i]); }, n,
                                               p.p_slash * double(p.window_mass[h]) - p.covered[h], p.slash_min, p.slash_cap, staged);
  for (index_t i = threadIdx.x; i < chosen; i += blockDim.x) p.slash_flag[row + sorted_diagonal[row + i]] = 1;
  for (index_t d = threadIdx.x; d < p.local_diagonals; d += blockDim.x) {
    p.slash_flag[row + p.diagonal_offset + d] = 1;
    if (!p.causal) p.slash_flag[row + p.diagonal_offset - d] = 1;
  }
}

/// Per head: selected tokens (bits) and selected diagonals (flags). Grid: heads.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) count_selection(selection_params p) {
  using reduce = cub::BlockReduce<index_t, select_threads>;
  __shared__ typename reduce::TempStorage temp;
  const index_t h = blockIdx.x, words = detail::bitmap_words(p.seq_len);
  index_t tokens = 0, diagonals = 0;
  for (index_t w = threadIdx.x; w < words; w += blockDim.x) tokens += __popcll(p.vertical_bits[static_cast<std::int64_t>(h) * words + w]);
  for (index_t i = threadIdx.x; i < p.diagonals; i += blockDim.x) diagonals += p.slash_flag[static_cast<std::int64_t>(h) * p.diagonals + i];
  const index_t token_total = reduce(temp).Sum(tokens);
  __syncthreads();
  const index_t diagonal_total = reduce(temp).Sum(diagonals);
  if (threadIdx.x == 0) {
    p.vertical_count[h] = token_total;
    p.slash_count[h] = diagonal_total;
  }
}

/// The per-head CSR lists of device_selection, ascending: tokens from the bitmap, deltas from the
/// flags, and each token's head. Grid: heads.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads)
    write_selection(selection_params p, const index_t* __restrict__ vertical_ptr, const index_t* __restrict__ slash_ptr,
                    index_t* __restrict__ vertical, index_t* __restrict__ vertical_head, index_t* __restrict__ slash) {
  using scan = cub::BlockScan<index_t, select_threads>;
  __shared__ typename scan::TempStorage temp;
  const index_t h = blockIdx.x, words = detail::bitmap_words(p.seq_len);
  index_t base = vertical_ptr[h];
  for (index_t first = 0; first < words; first += select_threads) {  // whole CTA in every round (the scan)
    const index_t w = first + static_cast<index_t>(threadIdx.x);
    std::uint64_t bits = w < words ? p.vertical_bits[static_cast<std::int64_t>(h) * words + w] : 0;
    index_t at = 0, round = 0;
    scan(temp).ExclusiveSum(static_cast<index_t>(__popcll(bits)), at, round);
    __syncthreads();
    for (at += base; bits != 0; bits &= bits - 1, ++at) {
      vertical[at] = w * 64 + __ffsll(static_cast<long long>(bits)) - 1;
      vertical_head[at] = h;
    }
    base += round;
  }
  base = slash_ptr[h];
  for (index_t first = 0; first < p.diagonals; first += select_threads) {
    const index_t i = first + static_cast<index_t>(threadIdx.x);
    const index_t flag = i < p.diagonals ? p.slash_flag[static_cast<std::int64_t>(h) * p.diagonals + i] : 0;
    index_t at = 0, round = 0;
    scan(temp).ExclusiveSum(flag, at, round);
    __syncthreads();
    if (flag) slash[base + at] = i - p.diagonal_offset;
    base += round;
  }
}

}  // namespace stria::kernel
