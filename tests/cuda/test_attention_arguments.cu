// SPDX-License-Identifier: Apache-2.0
// The sparse attention launchers reject bad arguments before any CUDA call, naming the argument, the
// value and the rule (DESIGN 11). No GPU is needed: these run in CI on the host.
#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "stria/device/sparse_attention_step.cuh"

using namespace stria;
using T = __nv_bfloat16;

namespace {

/// The message of the invalid_argument `call` throws ("no error" if none; a CUDA error is reported
/// as such, since these checks must come before any CUDA call).
template <class Call>
std::string message(Call&& call) {
  try {
    call();
  } catch (const invalid_argument& e) {
    return e.what();
  } catch (const cuda_error& e) {
    return std::string("cuda_error before the argument checks: ") + e.what();
  }
  return "no error";
}

bool contains(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("sparse attention launchers name the argument, the value and the rule") {
  const index_t sq = 128, hq = 4, hkv = 2, dim = 64;
  std::vector<T> q_host(static_cast<std::size_t>(sq) * hq * 128 + 64), kv_host(static_cast<std::size_t>(sq) * hkv * 128 + 64);
  std::vector<float> out_host(static_cast<std::size_t>(sq) * hq * dim + 8), lse_host(static_cast<std::size_t>(hq) * sq + 8);
  device_step_index index;  // only its shape is read before the CUDA calls
  index.shape = {hq, sq / block_tokens, sq / block_tokens, true};

  const tensor_view<const T, 3> q(q_host.data(), {sq, hq, dim}), k(kv_host.data(), {sq, hkv, dim});
  const tensor_view<float, 3> out(out_host.data(), {sq, hq, dim});
  const tensor_view<float, 2> lse(lse_host.data(), {hq, sq});
  auto forward = [&](tensor_view<const T, 3> qv, tensor_view<const T, 3> kv, double scale, tensor_view<float, 3> o) {
    return message([&] {
      device::sparse_forward<T>(index, {.q = qv, .k = kv, .v = kv, .out = o, .lse = lse}, scale, nullptr, {.state = device::running_state::overwrite});
    });
  };

  CHECK(contains(forward(tensor_view<const T, 3>(q_host.data(), {sq, hq, 96}), tensor_view<const T, 3>(kv_host.data(), {sq, hkv, 96}), 0.1, out),
                 "q.extent(2) (head_dim) = 96: unsupported head dim"));
  CHECK(contains(forward(tensor_view<const T, 3>(q_host.data(), {sq, 3, dim}), k, 0.1, out), "q.extent(1) (query heads) = 3: must be a multiple"));
  CHECK(contains(forward(tensor_view<const T, 3>(q_host.data() + 1, {sq, hq, dim}), k, 0.1, out), "must be aligned to 16 bytes"));
  const tensor_view<const T, 3> strided(q_host.data(), {sq, hq, dim}, {static_cast<std::int64_t>(hq) * 128, 128, 1});
  CHECK(contains(forward(strided, k, 0.1, out), "q.stride(0)"));
  CHECK(contains(forward(q, k, 0.0, out), "softmax_scale = 0: must be positive and finite"));
  CHECK(contains(forward(q, k, NAN, out), "softmax_scale"));
  CHECK(contains(forward(q, k, 0.1, tensor_view<float, 3>(out_host.data(), {sq, hq, dim / 2})), "out.extent(2)"));
  CHECK(contains(forward(q, k, 0.1, tensor_view<float, 3>(out_host.data() + 1, {sq, hq, dim})), "out.data()"));
  const tensor_view<const T, 3> short_kv(kv_host.data(), {sq / 2, hkv, dim});
  CHECK(contains(forward(q, short_kv, 0.1, out), "index.shape.num_kv_blocks = 2: the index was built for another configuration"));
  // forward_options' state has no default: left out, it is named instead of overwriting a ring's
  // earlier steps.
  CHECK(contains(message([&] { device::sparse_forward<T>(index, {.q = q, .k = k, .v = k, .out = out, .lse = lse}, 0.1, nullptr, {}); }),
                 "options.state = 0: must be running_state::overwrite (a layer's first step) or running_state::merge"));
  CHECK(contains(message([&] {
                   device::sparse_forward<T>(index, {.q = q, .k = k, .v = k, .out = out, .lse = lse}, 0.1, nullptr,
                                             {.state = device::running_state::overwrite, .order = static_cast<device::launch_order>(9)});
                 }),
                 "options.order = 9: must be launch_order::automatic, query_blocks_inner, kv_group_inner or heads_inner"));

  // Backward: the gradient tensors are checked the same way.
  std::vector<float> grad_q(out_host.size()), grad_kv(static_cast<std::size_t>(sq) * hkv * dim + 8);
  auto backward = [&](tensor_view<float, 3> dq, tensor_view<float, 3> dk) {
    return message([&] {
      device::sparse_backward<T>(index, {.q = q, .k = k, .v = k, .d_out = q, .lse = lse, .delta = lse, .dq = dq, .dk = dk, .dv = dk}, 0.1, nullptr,
                                 {.mode = device::determinism::deterministic});
    });
  };
  CHECK(contains(backward(tensor_view<float, 3>(grad_q.data(), {sq, hq, dim + 64}), tensor_view<float, 3>(grad_kv.data(), {sq, hkv, dim})),
                 "dq.extent(2)"));
  CHECK(contains(backward(tensor_view<float, 3>(grad_q.data(), {sq, hq, dim}), tensor_view<float, 3>(grad_kv.data(), {sq, hq, dim})),
                 "dk.extent(1)"));
  // The dQ passes' launch order is the forward's, refused the same way.
  CHECK(contains(message([&] {
                   const tensor_view<float, 3> dq(grad_q.data(), {sq, hq, dim}), dk(grad_kv.data(), {sq, hkv, dim});
                   device::sparse_backward<T>(index, {.q = q, .k = k, .v = k, .d_out = q, .lse = lse, .delta = lse, .dq = dq, .dk = dk, .dv = dk},
                                              0.1, nullptr, {.order = static_cast<device::launch_order>(9)});
                 }),
                 "options.order = 9: must be launch_order::automatic, query_blocks_inner, kv_group_inner or heads_inner"));
  // With dq_out (dQ written out in T) the fp32 dq is not used: any view, an empty one too, passes its
  // checks; without dq_out an empty dq is named.
  const tensor_view<float, 3> grad_k(grad_kv.data(), {sq, hkv, dim});
  auto backward_without_dq = [&](T* dq_out) {
    return message([&] {
      device::sparse_backward<T>(
          index, {.q = q, .k = k, .v = k, .d_out = q, .lse = lse, .delta = lse, .dq = {}, .dk = grad_k, .dv = grad_k, .dq_out = dq_out}, 0.1,
          nullptr);
    });
  };
  const std::string with_dq_out = backward_without_dq(q_host.data());
  CHECK_MESSAGE((!contains(with_dq_out, "dq.") && !contains(with_dq_out, "dq =")), with_dq_out);
  CHECK(contains(backward_without_dq(nullptr), "dq.data() = nullptr: must point to memory"));
  // Launchers instantiated for one Tile (the front template's) take that head dim only.
  CHECK(contains(message([&] {
                   device::sparse_forward<T, 128>(index, {.q = q, .k = k, .v = k, .out = out, .lse = lse}, 0.1, nullptr,
                                                  {.state = device::running_state::overwrite});
                 }),
                 "q.extent(2) (head_dim) = 64: must be 128: this launcher is instantiated for head_dim 128 alone"));
  CHECK(contains(message([&] {
                   device::sparse_backward<T, 128>(index,
                                                   {.q = q,
                                                    .k = k,
                                                    .v = k,
                                                    .d_out = q,
                                                    .lse = lse,
                                                    .delta = lse,
                                                    .dq = tensor_view<float, 3>(grad_q.data(), {sq, hq, dim}),
                                                    .dk = tensor_view<float, 3>(grad_kv.data(), {sq, hkv, dim}),
                                                    .dv = tensor_view<float, 3>(grad_kv.data(), {sq, hkv, dim})},
                                                   0.1, nullptr);
                 }),
                 "q.extent(2) (head_dim) = 64: must be 128"));
  // The final cast and delta check their extents against each other.
  CHECK(contains(message([&] { device::write_output<T>(out, tensor_view<T, 3>(q_host.data(), {sq, hq, dim / 2}), nullptr); }),
                 "out.extent(2)"));
  CHECK(contains(message([&] { device::backward_delta<T>(q, k, tensor_view<float, 2>(lse_host.data(), {hq, sq}), nullptr); }),
                 "d_out.extent(1)"));
}

// The forward's launch orders (device::launch_order): the grid the launcher builds and the kernels'
// reading of it (kernel::detail::row_unit_of, the arithmetic of launched_row_unit) cover every
// (query block, head) once, in the order asked, as the hardware hands out blocks (x fastest, then y,
// then z). Host-only: the GPU tests check that every order writes the same bits.
TEST_CASE("the forward's launch orders cover every query block and head once, in the order asked") {
  struct heads {
    index_t q, kv;
  };
  for (const heads h : {heads{16, 2}, heads{16, 16}, heads{4, 2}, heads{6, 3}, heads{8, 1}})
    for (const index_t units : {1, 7, 300})
      for (const device::launch_order order : {device::launch_order::automatic, device::launch_order::query_blocks_inner,
                                               device::launch_order::kv_group_inner, device::launch_order::heads_inner})
        for (const bool complete : {false, true}) {
          CAPTURE(h.q);
          CAPTURE(h.kv);
          CAPTURE(units);
          CAPTURE(static_cast<int>(order));
          CAPTURE(complete);
          const attention_shape shape{64 * units, 64 * units, h.q, h.kv, 128};
          const index_t section = device::detail::launched_heads(order, complete, units, shape);
          const index_t expected_section = order == device::launch_order::heads_inner ? h.q
                                           : order == device::launch_order::kv_group_inner ||
                                                   (order == device::launch_order::automatic && !complete)
                                               ? h.q / h.kv
                                               : 1;
          CHECK(section == expected_section);
          const dim3 grid = device::detail::forward_grid(section, units, h.q);
          REQUIRE(std::int64_t{grid.x} * grid.y * grid.z == std::int64_t{units} * h.q);
          CHECK((grid.y <= 65535 && grid.z <= 65535));
          const bool grouped = device::detail::grouped_launch(section);  // the launcher's choice of kernel
          std::vector<kernel::detail::launched_unit> launched;
          for (unsigned z = 0; z < grid.z; ++z)
            for (unsigned y = 0; y < grid.y; ++y)
              for (unsigned x = 0; x < grid.x; ++x)
                launched.push_back(grouped ? kernel::detail::row_unit_of<true>(x, y, z, grid.x, grid.y)
                                           : kernel::detail::row_unit_of<false>(x, y, z, grid.x, grid.y));
          std::vector<int> seen(static_cast<std::size_t>(units * h.q), 0);
          for (const auto& [unit, head] : launched) {
            REQUIRE((unit >= 0 && unit < units && head >= 0 && head < h.q));
            ++seen[static_cast<std::size_t>(head * units + unit)];
          }
          CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<std::ptrdiff_t>(seen.size()));
          // The order: within a section of `section` heads the last unit first, its heads together;
          // sections (one head each where section is 1) one after another.
          for (std::size_t i = 0; i < launched.size(); ++i) {
            const auto s = static_cast<index_t>(i) / (units * section), within = static_cast<index_t>(i) % (units * section);
            CHECK(launched[i].unit == units - 1 - within / section);
            CHECK(launched[i].head == s * section + within % section);
          }
        }
  // Grouped, the query blocks are the grid's y dimension: a named grouped order is refused past it,
  // automatic falls back to a head's query blocks one after another.
  const attention_shape shape{64 * 65536, 64 * 65536, 16, 2, 128};
  using device::launch_order;
  CHECK(device::detail::launched_heads(launch_order::kv_group_inner, false, 65535, shape) == 8);
  CHECK(device::detail::launched_heads(launch_order::automatic, false, 65535, shape) == 8);
  CHECK(device::detail::launched_heads(launch_order::automatic, false, 65536, shape) == 1);
  CHECK(device::detail::launched_heads(launch_order::query_blocks_inner, false, 65536, shape) == 1);
  CHECK(contains(message([&] { static_cast<void>(device::detail::launched_heads(launch_order::kv_group_inner, false, 65536, shape)); }),
                 "options.order = launch_order::kv_group_inner: needs at most 65535 local query blocks (index.shape.num_query_blocks, a "
                 "grid dimension); the call has 65536"));
  CHECK(contains(message([&] { static_cast<void>(device::detail::launched_heads(launch_order::heads_inner, false, 65536, shape)); }),
                 "options.order = launch_order::heads_inner: needs at most 65535"));
  // A named order whose sections hold one head each (Hq = Hkv) launches ungrouped: nothing to refuse.
  const attention_shape mha{64 * 65536, 64 * 65536, 4, 4, 128};
  CHECK(device::detail::launched_heads(launch_order::kv_group_inner, false, 65536, mha) == 1);
}

// The Hopper dQ passes launch in the forward's order over the heads a pass covers: the stored-dS pass
// over a range of heads [first, first + count) keeps the sections where they divide both, else the
// largest sections inside them that tile the range, and covers exactly the range's (query block,
// head) pairs once (the kernel adds backward_params::head_begin).
TEST_CASE("the dQ passes' launch covers a range of heads once, in sections where the range allows") {
  using device::detail::dq_section_heads;
  CHECK(dq_section_heads(8, 0, 16) == 8);
  CHECK(dq_section_heads(8, 8, 8) == 8);
  CHECK(dq_section_heads(8, 0, 4) == 4);    // a range inside a section
  CHECK(dq_section_heads(8, 4, 8) == 4);    // a range across two sections
  CHECK(dq_section_heads(16, 8, 8) == 8);   // heads_inner over half of the heads (backward_options::overlap_passes)
  CHECK(dq_section_heads(16, 0, 8) == 8);
  CHECK(dq_section_heads(2, 2, 6) == 2);
  CHECK(dq_section_heads(8, 3, 5) == 1);
  CHECK(dq_section_heads(1, 3, 5) == 1);
  const index_t units = 7;
  for (const index_t section_heads : {1, 2, 8, 16})
    for (const auto& [first, count] : {std::pair<index_t, index_t>{0, 16}, {8, 8}, {2, 6}, {3, 5}, {4, 8}, {0, 8}, {6, 6}}) {
      CAPTURE(section_heads);
      CAPTURE(first);
      CAPTURE(count);
      const index_t section = dq_section_heads(section_heads, first, count);
      const dim3 grid = device::detail::forward_grid(section, units, count);
      REQUIRE(std::int64_t{grid.x} * grid.y * grid.z == std::int64_t{units} * count);
      std::vector<int> seen(static_cast<std::size_t>(units * count), 0);
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            const kernel::detail::launched_unit u = device::detail::grouped_launch(section)
                                                        ? kernel::detail::row_unit_of<true>(x, y, z, grid.x, grid.y)
                                                        : kernel::detail::row_unit_of<false>(x, y, z, grid.x, grid.y);
            REQUIRE((u.unit >= 0 && u.unit < units && u.head >= 0 && u.head < count));  // head first + u.head in the kernel
            ++seen[static_cast<std::size_t>(u.head * units + u.unit)];
            if (section > 1) CHECK((first + u.head) / section_heads == (first + (u.head / section) * section) / section_heads);
          }
      CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<std::ptrdiff_t>(seen.size()));
    }
}

// The stored dS's workspace limit where backward_options gives none: automatic takes a quarter of the
// device and at most half of what is available; stored what is available less a sixteenth of the
// device (so that a workspace past it goes by ranges of heads instead of failing to allocate), and
// nothing where less than that is available (then a head's dS is refused by name, not allocated).
TEST_CASE("the stored dS's default workspace limit, by dq_source") {
  using device::dq_source;
  using device::detail::default_ds_workspace_limit;
  constexpr std::size_t gib = std::size_t{1} << 30, total = 80 * gib;
  CHECK(default_ds_workspace_limit(dq_source::automatic, 70 * gib, total) == 20 * gib);  // a quarter of the device
  CHECK(default_ds_workspace_limit(dq_source::automatic, 30 * gib, total) == 15 * gib);  // half of what is available
  CHECK(default_ds_workspace_limit(dq_source::recomputed, 30 * gib, total) == 15 * gib);  // read only by automatic and stored
  CHECK(default_ds_workspace_limit(dq_source::stored, 70 * gib, total) == 65 * gib);
  CHECK(default_ds_workspace_limit(dq_source::stored, 5 * gib, total) == 0);
  CHECK(default_ds_workspace_limit(dq_source::stored, 4 * gib, total) == 0);  // less than the sixteenth held back: no underflow
  CHECK(default_ds_workspace_limit(dq_source::stored, 6 * gib, total) == gib);
  static_assert(default_ds_workspace_limit(dq_source::stored, 0, 0) == 0);
}

// The ranges of query heads whose dS a backward stores at once (device::detail::ds_head_ranges), on
// made-up row pointers (`pointers`: each head's entries, summed) and dS rows of 128 bytes (64 bf16
// values). A head of the even set holds 10 block tiles and 64 vertical entries: 704 rows, 90112 bytes.
TEST_CASE("the stored dS's ranges of query heads: within the limit, on whole GQA groups, of equal size where no limit is given") {
  using device::dq_source;
  using device::detail::ds_head_range;
  constexpr std::size_t row_bytes = 128, head_bytes = 704 * row_bytes;
  auto pointers = [](const std::vector<index_t>& counts) {
    std::vector<index_t> at(counts.size() + 1, 0);
    for (std::size_t h = 0; h < counts.size(); ++h) at[h + 1] = at[h] + counts[h];
    return at;
  };
  const std::vector<index_t> block_at = pointers(std::vector<index_t>(8, 10)), vertical_at = pointers(std::vector<index_t>(8, 64));
  auto heads_of = [](const std::vector<ds_head_range>& ranges) {
    std::vector<std::pair<index_t, index_t>> h;
    for (const ds_head_range& r : ranges) h.emplace_back(r.begin, r.end);
    return h;
  };
  using pairs = std::vector<std::pair<index_t, index_t>>;
  auto ranges = [&](index_t group, dq_source source, bool given, std::size_t limit) {
    return device::detail::ds_head_ranges(block_at, vertical_at, group, row_bytes, source, given, limit);
  };
  // A given limit, or automatic's: filled greedily, ending on a group of 4 where one fits, else splitting it.
  CHECK(heads_of(ranges(4, dq_source::stored, true, 5 * head_bytes)) == pairs{{0, 4}, {4, 8}});
  CHECK(heads_of(ranges(4, dq_source::automatic, true, 3 * head_bytes)) == pairs{{0, 3}, {3, 4}, {4, 7}, {7, 8}});
  CHECK(heads_of(ranges(1, dq_source::stored, true, 5 * head_bytes)) == pairs{{0, 5}, {5, 8}});
  CHECK(heads_of(ranges(1, dq_source::automatic, false, 5 * head_bytes)) == pairs{{0, 5}, {5, 8}});
  // stored with no limit given: ranges filled to about whole / ceil(whole / limit).
  CHECK(heads_of(ranges(1, dq_source::stored, false, 5 * head_bytes)) == pairs{{0, 4}, {4, 8}});
  CHECK(heads_of(ranges(1, dq_source::stored, false, 8 * head_bytes)) == pairs{{0, 8}});
  // ... where a head past that fill but within the limit runs alone, not refused.
  CHECK(heads_of(device::detail::ds_head_ranges(pointers({1, 1, 1, 1, 1, 1, 1, 10}), pointers(std::vector<index_t>(8, 0)), 1, row_bytes,
                                                dq_source::stored, false, 10 * 64 * row_bytes)) == pairs{{0, 7}, {7, 8}});
  // Each range's first entries and rows.
  const std::vector<ds_head_range> r = ranges(4, dq_source::stored, true, 4 * head_bytes);
  REQUIRE(r.size() == 2);
  CHECK(r[1].first_block == 40);
  CHECK(r[1].first_vertical == 256);
  CHECK(r[1].block_rows == 40 * 64);
  CHECK(r[1].rows == 40 * 64 + 256);
  // Heads of unequal size: the ranges cover every head once, each within the limit.
  const std::vector<index_t> uneven_blocks = pointers({1, 30, 2, 2, 25, 3, 9, 14}), uneven_verticals = pointers({0, 5, 900, 1, 0, 64, 7, 3});
  for (const std::size_t limit : {40 * 64 * row_bytes, 60 * 64 * row_bytes}) {
    for (const bool given : {true, false}) {
      CAPTURE(limit);
      CAPTURE(given);
      const std::vector<ds_head_range> u =
          device::detail::ds_head_ranges(uneven_blocks, uneven_verticals, 2, row_bytes, dq_source::stored, given, limit);
      index_t next = 0;
      for (const ds_head_range& range : u) {
        CHECK(range.begin == next);
        CHECK(range.rows * row_bytes <= limit);
        next = range.end;
      }
      CHECK(next == 8);
    }
  }
  // A head alone past the limit: automatic recomputes dS (no range); stored is refused, naming the
  // option that set the limit.
  CHECK(ranges(4, dq_source::automatic, false, head_bytes - 1).empty());
  const std::string given = message([&] { ranges(4, dq_source::stored, true, head_bytes - 1); });
  CHECK(contains(given, "options.ds_workspace_limit"));
  CHECK(contains(given, "query head 0's stored dS (90112 bytes)"));
  const std::string available = message([&] { ranges(4, dq_source::stored, false, head_bytes - 1); });
  CHECK(contains(available, "options.dq_source"));
  CHECK(contains(available, "less a sixteenth of its memory"));
}

// The read-ahead of the stored-dS dQ pass (kernel::detail::token_plan): for every thread of the
// warpgroup and every pass of its copies, the lane it takes its token from read the token of exactly
// the row it copies (tile_copy_plan's row0 + pass x rows_per_pass), and every row of the tile is read
// by some lane. Host-only: the GPU tests check the pass's dQ against the reference.
template <int D>
void check_token_plan() {
  using plan = kernel::detail::tile_copy_plan<T, D>;
  using tokens = kernel::detail::token_plan<T, D>;
  std::vector<int> read(block_tokens, 0);
  for (int thread = 0; thread < kernel::attention_threads; ++thread) {
    const int lane = thread % 32, warp = thread / 32, row0 = thread / plan::chunks;
    ++read[static_cast<std::size_t>(tokens::row_read(lane, warp))];
    for (int pass = 0; pass < plan::passes; ++pass) {
      CAPTURE(thread);
      CAPTURE(pass);
      const int source = tokens::source_lane(lane, pass);
      REQUIRE((source >= 0 && source < 32));
      CHECK(tokens::row_read(source, warp) == row0 + pass * plan::rows_per_pass);
    }
  }
  // Each row read by two lanes (L and L + 16) of the warp that copies it.
  CHECK(std::count(read.begin(), read.end(), 2) == block_tokens);
}

TEST_CASE("the dQ pass's read-ahead hands every copy the token of its own row (head dims 64 and 128)") {
  check_token_plan<64>();
  check_token_plan<128>();
}
