// SPDX-License-Identifier: Apache-2.0
// Kernels of the GPU top-p selection (estimator/select.cuh): the steps of the host's select_head
// and finish_head (estimator/select.hpp), one CTA per query head, picking exactly what the host
// picks from the same statistics. Two shapes share the device helpers below: select_head, one
// launch per head whose diagonals fit a block-level sort in shared memory, and, for longer
// sequences, select_verticals + CUB's segmented sort + select_slashes over global memory. Both
// leave each head's lists in rows of a workspace; gather_lists packs the rows into CSR lists once
// the host has read their sizes.
//
// Where the host's result depends on the order of double additions, the device keeps that order:
// - the running sums of count_to_goal stay one serial chain (one thread, 32 masses in registers
//   per batch, comparisons kept off the chain);
// - a diagonal's residual is its slash mass minus the chosen verticals on it in candidate order.
//   The window lies in the last block, so a key token's diagonal is fixed by its 64-token key
//   block: only candidates of one key block touch one residual. A stable sort of the chosen
//   candidates by diagonal keeps candidate order within each diagonal, and one thread per
//   diagonal subtracts its (at most 64) candidates in that order, all diagonals at once.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_merge_sort.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"

namespace stria::kernel {

inline constexpr int select_threads = 512;

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
  index_t vertical_row, slash_row;  // the row lengths below: the most tokens, deltas a head can select
  index_t* vertical_rows;           // [heads, vertical_row]: each head's tokens, ascending
  index_t* slash_rows;              // [heads, slash_row]: each head's deltas, ascending
  index_t* counts;                  // [2, heads]: tokens per head, then deltas per head
};

/// What the multi-launch path keeps in global memory between its kernels.
struct selection_scratch {
  double* residual;               // [heads, diagonals]: sort keys (slash_key)
  index_t* diagonal;              // [heads, diagonals]: 0 .. diagonals - 1 per head; sort values
  double* sorted_residual;        // [heads, diagonals]: descending per head
  index_t* sorted_diagonal;       // [heads, diagonals]
  double* covered;                // [heads]: window mass of the local diagonals and the verticals
  std::uint64_t* vertical_bits;   // [heads, num_blocks]: the selected tokens, one word per key block
  std::uint8_t* slash_flag;       // [heads, diagonals]: 1 where the diagonal is selected
};

namespace detail {

/// The local diagonals, delta in (-local, local), as the index range [begin, end).
struct diagonal_range {
  index_t begin, end;
};
STRIA_HOST_DEVICE constexpr diagonal_range local_diagonal_range(const selection_params& p) {
  const index_t begin = p.diagonal_offset - p.local_diagonals + 1, end = p.diagonal_offset + p.local_diagonals;
  return {begin > 0 ? begin : 0, end < p.diagonals ? end : p.diagonals};
}

/// The diagonal index of a key token for every window row (vs_statistics::diagonal_of + offset).
STRIA_HOST_DEVICE constexpr index_t diagonal_index_of(const selection_params& p, index_t key_token) {
  return p.num_blocks - 1 - key_token / block_tokens + p.diagonal_offset;
}

/// Diagonal i's key in the descending sort by residual mass. The host clamps residuals at 0 and
/// compares -0.0 equal to +0.0: writing +0.0 for both keeps them tied. The local diagonals, which
/// the host leaves out, get -1 and so sort after every other diagonal.
STRIA_HOST_DEVICE constexpr double slash_key(diagonal_range locals, index_t i, double residual) {
  return i >= locals.begin && i < locals.end ? -1.0 : (residual > 0.0 ? residual : 0.0);
}

/// The result of count_to_goal: the host's count and `covered` plus the masses it counts.
struct goal_count {
  index_t count;
  double covered;
};

/// Thread 0's side of count_to_goal: the host's loop over 32 masses at a time. Inside a batch the
/// running sums are a bare chain of dependent double adds; each comparison with the goal only sets
/// a bit of a mask, so the next add never waits for it, and the stop is found once per batch.
struct goal_walk {
  double goal, sum, covered;
  index_t min;
  index_t reached = -1;  // the host's loop exit (sum reached the goal, or the list ended), once known

  /// Adds masses[0, 32), the list's entries first .. first + 31 (entries from `end` on do not
  /// exist). True once the count is known: then `result` holds it.
  __device__ bool walk32(const float* masses, index_t first, index_t end, goal_count& result) {
    float v[32];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float4 q = reinterpret_cast<const float4*>(masses)[k];
      v[4 * k] = q.x;
      v[4 * k + 1] = q.y;
      v[4 * k + 2] = q.z;
      v[4 * k + 3] = q.w;
    }
    double s = sum, c = covered;
    unsigned at_goal = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      if (!(s < goal)) at_goal |= 1u << j;
      s += v[j];
      c += v[j];
    }
    const unsigned at_end = from(end, first);
    if (reached < 0 && (at_goal | at_end) != 0) reached = first + __ffs(static_cast<int>(at_goal | at_end)) - 1;
    // The host counts on to `min` past the goal (never past the end): stop there.
    const unsigned stop = (reached < 0 ? 0u : from(reached, first)) & (at_end | from(min, first));
    if (stop == 0) {
      sum = s;
      covered = c;
      return false;
    }
    const int n = __ffs(static_cast<int>(stop)) - 1;
    double kept = covered;  // the same adds again, up to the stop
#pragma unroll
    for (int j = 0; j < 32; ++j)
      if (j < n) kept += v[j];
    result = {first + n, kept};
    return true;
  }

  /// Bits j of a batch starting at `first` whose entry first + j is at or after `index`.
  __device__ static unsigned from(index_t index, index_t first) {
    return index <= first ? ~0u : index - first >= 32 ? 0u : ~0u << (index - first);
  }
};

/// Masses staged in shared memory per round of count_to_goal, so that thread 0 reads registers
/// loaded from shared memory, not global memory.
inline constexpr int count_chunk = 2048;
static_assert(count_chunk % select_threads == 0 && count_chunk % 32 == 0);

struct count_storage {
  alignas(16) float staged[count_chunk];
  goal_count result;
  bool stopped;
};

/// count_to_goal of select.hpp over the list `mass_at(i)`, i < bound (bound <= cap), with the
/// host's order of additions: how many leading entries reach `goal`, within [min, cap] and the
/// entries there are; `covered` comes back with the counted masses added, as select_head adds them.
/// A negative mass ends the list: the candidates' pads and the local diagonals' keys sort last.
/// The whole CTA calls it (it is a barrier) and receives the result.
template <class MassAt>
__device__ goal_count count_to_goal(MassAt mass_at, index_t bound, double goal, index_t min, double covered, count_storage& s) {
  goal_walk walk{goal, 0.0, covered, min};  // thread 0's
  for (index_t first = 0;; first += count_chunk) {
    constexpr int per_thread = count_chunk / select_threads;
    float m[per_thread];  // all loads in flight before the first barrier
    for (int k = 0; k < per_thread; ++k) {
      const index_t i = first + k * select_threads + static_cast<index_t>(threadIdx.x);
      m[k] = i < bound ? mass_at(i) : -1.0f;
    }
    index_t present = 0;  // entries of this chunk before the end (they come first)
    for (int k = 0; k < per_thread; ++k) {
      s.staged[k * select_threads + threadIdx.x] = m[k];
      present += __syncthreads_count(m[k] >= 0.0f);
    }
    if (threadIdx.x == 0) {
      bool stopped = false;
      for (index_t b = 0; b < count_chunk && !stopped; b += 32) stopped = walk.walk32(s.staged + b, first + b, first + present, s.result);
      s.stopped = stopped;
    }
    __syncthreads();
    if (s.stopped) break;
  }
  const goal_count result = s.result;
  __syncthreads();  // `s` is reused by the caller
  return result;
}

/// Chosen candidates per round of subtract_verticals.
inline constexpr int subtract_items = 4;
inline constexpr int subtract_tile = select_threads * subtract_items;

struct subtract_storage {
  using by_diagonal = cub::BlockRadixSort<unsigned, select_threads, subtract_items, float>;
  union {
    typename by_diagonal::TempStorage sort;
    struct {
      unsigned diagonal[subtract_tile];
      float mass[subtract_tile];
    } sorted;
  };
};

/// Subtracts each of the first `chosen` candidates' masses from its diagonal's residual, in
/// candidate order per diagonal (see the top of this file): rounds of subtract_tile candidates,
/// each sorted stably by diagonal; the first thread of each diagonal's run subtracts the run.
__device__ inline void subtract_verticals(const selection_params& p, const float* mass, const index_t* token, index_t chosen,
                                          double* residual, subtract_storage& s) {
  const int bits = 32 - __clz(p.diagonals);  // the keys and the sentinel `diagonals`
  for (index_t first = 0; first < chosen; first += subtract_tile) {
    unsigned key[subtract_items];
    float m[subtract_items];
    for (int k = 0; k < subtract_items; ++k) {
      const index_t i = first + static_cast<index_t>(threadIdx.x) * subtract_items + k;
      key[k] = static_cast<unsigned>(i < chosen ? diagonal_index_of(p, token[i]) : p.diagonals);
      m[k] = i < chosen ? mass[i] : 0.0f;
    }
    subtract_storage::by_diagonal(s.sort).Sort(key, m, 0, bits);
    __syncthreads();  // the sort's storage becomes the sorted runs
    for (int k = 0; k < subtract_items; ++k) {
      s.sorted.diagonal[threadIdx.x * subtract_items + k] = key[k];
      s.sorted.mass[threadIdx.x * subtract_items + k] = m[k];
    }
    __syncthreads();
    for (int j = static_cast<int>(threadIdx.x); j < subtract_tile; j += select_threads) {
      const unsigned d = s.sorted.diagonal[j];
      if (d == static_cast<unsigned>(p.diagonals) || (j > 0 && s.sorted.diagonal[j - 1] == d)) continue;
      double r = residual[d];
      for (int i = j; i < subtract_tile && s.sorted.diagonal[i] == d; ++i) r -= s.sorted.mass[i];
      residual[d] = r;
    }
    __syncthreads();  // the next round's sort reuses `s`; its runs may continue these diagonals
  }
}

/// Head h's residuals (its slash masses) and token bitmap (the sink tokens), for choose_verticals.
__device__ inline void start_head(const selection_params& p, index_t h, double* residual, std::uint64_t* bits) {
  const float* slash = p.slash_mass + static_cast<std::int64_t>(h) * p.diagonals;
  for (index_t i = threadIdx.x; i < p.diagonals; i += blockDim.x) residual[i] = slash[i];
  for (index_t w = threadIdx.x; w < p.num_blocks; w += blockDim.x) {
    const index_t before = p.sink_tokens - w * 64;  // sink tokens in this word and before
    bits[w] = before <= 0 ? 0 : before >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << before) - 1;
  }
}

/// select_head's verticals, after start_head (and a barrier): how many candidates reach
/// p_vertical of the mass outside the local diagonals; their bits; their masses leave the
/// residuals. Returns `covered` (the local diagonals' mass plus the chosen verticals').
template <class Storage>
__device__ double choose_verticals(const selection_params& p, index_t h, double* residual, std::uint64_t* bits, Storage& s) {
  const float* slash = p.slash_mass + static_cast<std::int64_t>(h) * p.diagonals;
  const float* mass = p.candidate_mass + static_cast<std::int64_t>(h) * p.candidates;
  const index_t* token = p.candidate_token + static_cast<std::int64_t>(h) * p.candidates;
  const diagonal_range locals = local_diagonal_range(p);
  double local = 0;  // in ascending diagonal order, as the host adds them (thread 0 uses it)
  for (index_t i = locals.begin; i < locals.end; ++i) local += slash[i];
  const double total = p.window_mass[h];
  const goal_count chosen =
      count_to_goal([&](index_t i) { return mass[i]; }, ::min(p.vertical_cap, p.candidates), p.p_vertical * (total - local),
                    p.vertical_min, local, s.count);
  for (index_t i = threadIdx.x; i < chosen.count; i += blockDim.x)
    atomicOr(reinterpret_cast<unsigned long long*>(bits + token[i] / 64), 1ull << (token[i] % 64));
  subtract_verticals(p, mass, token, chosen.count, residual, s.subtract);
  return chosen.covered;
}

/// select_head's slashes, from the diagonals sorted by residual mass (descending, stable):
/// how many reach p_slash of the window mass together with `covered`; flags for them and for the
/// local diagonals (finish_head's safeguard). `sorted_mass(i)`, `sorted_diagonal[i]`: rank i.
template <class SortedMass>
__device__ void choose_slashes(const selection_params& p, index_t h, SortedMass sorted_mass, const index_t* sorted_diagonal, double covered,
                               std::uint8_t* flag, count_storage& s) {
  for (index_t i = threadIdx.x; i < p.diagonals; i += blockDim.x) flag[i] = 0;
  // __dmul_rn: the host rounds the product before the subtraction; nvcc would fuse them into an fma.
  const double goal = __dmul_rn(p.p_slash, double(p.window_mass[h])) - covered;
  const goal_count chosen = count_to_goal(sorted_mass, ::min(p.slash_cap, p.diagonals), goal, p.slash_min, 0.0, s);  // (a barrier: the zeros land first)
  for (index_t i = threadIdx.x; i < chosen.count; i += blockDim.x) flag[sorted_diagonal[i]] = 1;
  for (index_t d = threadIdx.x; d < p.local_diagonals; d += blockDim.x) {
    flag[p.diagonal_offset + d] = 1;
    if (!p.causal) flag[p.diagonal_offset - d] = 1;
  }
  __syncthreads();
}

/// Words or flags per thread and round of write_lists.
inline constexpr int list_items = 4;

struct list_storage {
  typename cub::BlockScan<index_t, select_threads>::TempStorage scan;
};

/// finish_head's lists: head h's tokens (bitmap, ascending) and deltas (flags, ascending) into its
/// rows of the workspace, and their sizes into p.counts.
__device__ inline void write_lists(const selection_params& p, index_t h, const std::uint64_t* bits, const std::uint8_t* flag, list_storage& s) {
  using scan = cub::BlockScan<index_t, select_threads>;
  constexpr index_t round = select_threads * list_items;
  index_t* tokens = p.vertical_rows + static_cast<std::int64_t>(h) * p.vertical_row;
  index_t* deltas = p.slash_rows + static_cast<std::int64_t>(h) * p.slash_row;
  const index_t first_item = static_cast<index_t>(threadIdx.x) * list_items;
  index_t token_count = 0, delta_count = 0;
  for (index_t first = 0; first < p.num_blocks; first += round) {
    std::uint64_t word[list_items];
    index_t n[list_items], at[list_items], total = 0;
    for (int k = 0; k < list_items; ++k) {
      const index_t w = first + first_item + k;
      word[k] = w < p.num_blocks ? bits[w] : 0;
      n[k] = __popcll(word[k]);
    }
    scan(s.scan).ExclusiveSum(n, at, total);
    for (int k = 0; k < list_items; ++k)
      for (std::uint64_t b = word[k]; b != 0; b &= b - 1)
        tokens[token_count + at[k]++] = (first + first_item + k) * 64 + __ffsll(static_cast<long long>(b)) - 1;
    token_count += total;
    __syncthreads();  // the scan's storage is reused
  }
  for (index_t first = 0; first < p.diagonals; first += round) {
    index_t n[list_items], at[list_items], total = 0;
    for (int k = 0; k < list_items; ++k) {
      const index_t i = first + first_item + k;
      n[k] = i < p.diagonals ? flag[i] : 0;
    }
    scan(s.scan).ExclusiveSum(n, at, total);
    for (int k = 0; k < list_items; ++k)
      if (n[k]) deltas[delta_count + at[k]] = first + first_item + k - p.diagonal_offset;
    delta_count += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.counts[h] = token_count;
    p.counts[p.heads + h] = delta_count;
  }
}

/// What the single-launch path keeps in shared memory, for up to select_threads * Items diagonals
/// (and as many key blocks: there are no more blocks than diagonals). Phases reuse the unions.
template <int Items>
struct head_storage {
  static constexpr index_t capacity = select_threads * Items;
  using by_residual = cub::BlockMergeSort<double, select_threads, Items, index_t>;
  std::uint64_t bits[capacity];
  std::uint8_t flag[capacity];
  union {
    double residual[capacity];
    typename by_residual::TempStorage sort;
    struct {
      float mass[capacity];
      index_t diagonal[capacity];
    } sorted;
  } slash;
  union {
    count_storage count;
    subtract_storage subtract;
    list_storage lists;
  } work;
};

}  // namespace detail

/// The whole selection of one head in one CTA (grid: heads), for p.diagonals up to
/// select_threads * Items: residuals, bitmap and flags in shared memory, and CUB's block merge
/// sort, stable under `>`, so equal residuals keep the smaller diagonal first and -0.0 ties +0.0,
/// as with the host's comparator. (Its log2(capacity / Items) merge passes took half the time of
/// the 16 four-bit passes a radix sort makes over double keys: 19K against 40K cycles at 2048.)
/// Dynamic shared memory: sizeof(head_storage<Items>).
template <int Items>
__global__ void __launch_bounds__(select_threads) select_head(selection_params p) {
  using storage = detail::head_storage<Items>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  storage& s = *reinterpret_cast<storage*>(shared_bytes);
  const index_t h = blockIdx.x;
  detail::start_head(p, h, s.slash.residual, s.bits);
  __syncthreads();
  const double covered = detail::choose_verticals(p, h, s.slash.residual, s.bits, s.work);
  const detail::diagonal_range locals = detail::local_diagonal_range(p);
  double key[Items];
  index_t diagonal[Items];
  for (int k = 0; k < Items; ++k) {  // the padding sorts last, with the local diagonals
    diagonal[k] = static_cast<index_t>(threadIdx.x) * Items + k;
    key[k] = diagonal[k] < p.diagonals ? detail::slash_key(locals, diagonal[k], s.slash.residual[diagonal[k]]) : -1.0;
  }
  __syncthreads();  // the residuals' storage becomes the sort's
  typename storage::by_residual(s.slash.sort).StableSort(key, diagonal, [](double a, double b) { return a > b; });
  __syncthreads();
  for (int k = 0; k < Items; ++k) {
    s.slash.sorted.mass[threadIdx.x * Items + k] = float(key[k]);  // the host's mass_in_order
    s.slash.sorted.diagonal[threadIdx.x * Items + k] = diagonal[k];
  }
  __syncthreads();
  detail::choose_slashes(p, h, [&](index_t i) { return s.slash.sorted.mass[i]; }, s.slash.sorted.diagonal, covered, s.flag, s.work.count);
  detail::write_lists(p, h, s.bits, s.flag, s.work.lists);
}

/// Multi-launch path, step 1 (grid: heads): select_head's verticals over global memory; leaves
/// the sort keys and values of each head's diagonals for CUB's segmented sort.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) select_verticals(selection_params p, selection_scratch x) {
  __shared__ union {
    detail::count_storage count;
    detail::subtract_storage subtract;
  } s;
  const index_t h = blockIdx.x;
  const std::int64_t row = static_cast<std::int64_t>(h) * p.diagonals;
  double* residual = x.residual + row;
  detail::start_head(p, h, residual, x.vertical_bits + static_cast<std::int64_t>(h) * p.num_blocks);
  __syncthreads();
  const double covered = detail::choose_verticals(p, h, residual, x.vertical_bits + static_cast<std::int64_t>(h) * p.num_blocks, s);
  if (threadIdx.x == 0) x.covered[h] = covered;
  const detail::diagonal_range locals = detail::local_diagonal_range(p);
  for (index_t i = threadIdx.x; i < p.diagonals; i += blockDim.x) {
    residual[i] = detail::slash_key(locals, i, residual[i]);
    x.diagonal[row + i] = i;
  }
}

/// Multi-launch path, step 2 (grid: heads), after each head's diagonals were sorted by key,
/// descending and stable: select_head's slashes and finish_head's lists.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) select_slashes(selection_params p, selection_scratch x) {
  __shared__ union {
    detail::count_storage count;
    detail::list_storage lists;
  } s;
  const index_t h = blockIdx.x;
  const std::int64_t row = static_cast<std::int64_t>(h) * p.diagonals;
  const double* sorted = x.sorted_residual + row;
  detail::choose_slashes(p, h, [&](index_t i) { return float(sorted[i]); }, x.sorted_diagonal + row, x.covered[h], x.slash_flag + row, s.count);
  detail::write_lists(p, h, x.vertical_bits + static_cast<std::int64_t>(h) * p.num_blocks, x.slash_flag + row, s.lists);
}

/// The per-head rows into device_selection's CSR lists (grid: heads); the offsets are the sums
/// of the earlier heads' counts. No explicit tiles: tile_ptr is all zeros.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads)
    gather_lists(selection_params p, index_t* __restrict__ vertical_ptr, index_t* __restrict__ slash_ptr, index_t* __restrict__ tile_ptr,
                 index_t* __restrict__ vertical, index_t* __restrict__ vertical_head, index_t* __restrict__ slash) {
  using reduce = cub::BlockReduce<index_t, select_threads>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ index_t offsets[2];
  const index_t h = blockIdx.x;
  index_t tokens = 0, deltas = 0;
  for (index_t g = threadIdx.x; g < h; g += blockDim.x) {
    tokens += p.counts[g];
    deltas += p.counts[p.heads + g];
  }
  tokens = reduce(temp).Sum(tokens);
  __syncthreads();
  deltas = reduce(temp).Sum(deltas);
  const index_t token_count = p.counts[h], delta_count = p.counts[p.heads + h];
  if (threadIdx.x == 0) {
    offsets[0] = tokens;
    offsets[1] = deltas;
    vertical_ptr[h] = tokens;
    slash_ptr[h] = deltas;
    tile_ptr[h] = 0;
    if (h == p.heads - 1) {
      vertical_ptr[p.heads] = tokens + token_count;
      slash_ptr[p.heads] = deltas + delta_count;
      tile_ptr[p.heads] = 0;
    }
  }
  __syncthreads();
  const index_t* token_row = p.vertical_rows + static_cast<std::int64_t>(h) * p.vertical_row;
  const index_t* delta_row = p.slash_rows + static_cast<std::int64_t>(h) * p.slash_row;
  for (index_t i = threadIdx.x; i < token_count; i += blockDim.x) {
    vertical[offsets[0] + i] = token_row[i];
    vertical_head[offsets[0] + i] = h;
  }
  for (index_t i = threadIdx.x; i < delta_count; i += blockDim.x) slash[offsets[1] + i] = delta_row[i];
}

}  // namespace stria::kernel
