// SPDX-License-Identifier: Apache-2.0
// Quickstart: sparse attention on a Vertical-Slash index with the host reference backend, forward and
// backward, checked against the same computation in double precision.
//
// Usage: quickstart [--seq-len N] [--heads-q H] [--heads-kv H] [--head-dim 64|128] [--seed S]
#include <stria/stria.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct options {
  stria::index_t seq_len = 2048;
  stria::index_t heads_q = 8;
  stria::index_t heads_kv = 2;
  stria::index_t head_dim = 128;
  unsigned seed = 1;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> long {
      if (i + 1 >= argc) throw stria::invalid_argument(arg, "(missing)", "needs a value");
      return std::strtol(argv[++i], nullptr, 10);
    };
    if (arg == "--seq-len") o.seq_len = static_cast<stria::index_t>(value());
    else if (arg == "--heads-q") o.heads_q = static_cast<stria::index_t>(value());
    else if (arg == "--heads-kv") o.heads_kv = static_cast<stria::index_t>(value());
    else if (arg == "--head-dim") o.head_dim = static_cast<stria::index_t>(value());
    else if (arg == "--seed") o.seed = static_cast<unsigned>(value());
    else if (arg == "--help") {
      std::puts("quickstart [--seq-len N] [--heads-q H] [--heads-kv H] [--head-dim 64|128] [--seed S]");
      std::exit(0);
    } else throw stria::invalid_argument("command-line option", arg, "is not known (see --help)");
  }
  return o;
}

/// A single-rank step index from a Vertical-Slash selection: for each query block, the tiles on the
/// selected block diagonals, plus the vertical tokens that lie in earlier blocks not already covered.
stria::step_index single_rank_index(const stria::global_selection& selection) {
  const stria::index_t nb = selection.num_blocks();
  const stria::index_t heads = selection.num_heads();
  std::vector<stria::index_t> global(static_cast<std::size_t>(nb));
  for (stria::index_t b = 0; b < nb; ++b) global[static_cast<std::size_t>(b)] = b;
  std::vector<std::vector<stria::index_t>> blocks(static_cast<std::size_t>(heads * nb)), tokens(blocks.size());
  for (stria::index_t h = 0; h < heads; ++h) {
    const stria::head_selection& head = selection.heads[static_cast<std::size_t>(h)];
    for (stria::index_t q = 0; q < nb; ++q) {
      auto& row_blocks = blocks[static_cast<std::size_t>(h * nb + q)];
      for (const stria::index_t delta : head.slash_deltas)
        if (q - delta >= 0) row_blocks.push_back(q - delta);
      std::sort(row_blocks.begin(), row_blocks.end());
      for (const stria::index_t t : head.vertical_tokens) {
        const stria::index_t k = t / stria::block_tokens;
        if (k < q && !std::binary_search(row_blocks.begin(), row_blocks.end(), k))
          tokens[static_cast<std::size_t>(h * nb + q)].push_back(t);
      }
    }
  }
  return stria::build_step_index({heads, nb, nb, true}, {selection.seq_len, 1, 0, 0, 0}, global, global, blocks, tokens);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace stria;
  const options o = parse(argc, argv);
  const attention_shape shape{o.seq_len, o.seq_len, o.heads_q, o.heads_kv, o.head_dim};
  shape.validate();

  // A Vertical-Slash selection: local diagonals, a few far slash lines, sink and scattered vertical tokens.
  std::mt19937 rng(o.seed);
  const index_t nb = o.seq_len / block_tokens;
  global_selection selection{o.seq_len, true, {}};
  for (index_t h = 0; h < o.heads_q; ++h) {
    head_selection head;
    head.slash_deltas = {0, 1, 2};
    for (index_t far = 5; far < nb; far *= 3) head.slash_deltas.push_back(far + static_cast<index_t>(rng() % 2));
    std::sort(head.slash_deltas.begin(), head.slash_deltas.end());
    head.slash_deltas.erase(std::unique(head.slash_deltas.begin(), head.slash_deltas.end()), head.slash_deltas.end());
    for (index_t t = 0; t < 4; ++t) head.vertical_tokens.push_back(t);  // attention sinks
    for (int i = 0; i < 28; ++i) head.vertical_tokens.push_back(4 + static_cast<index_t>(rng() % static_cast<unsigned>(o.seq_len - 4)));
    std::sort(head.vertical_tokens.begin(), head.vertical_tokens.end());
    head.vertical_tokens.erase(std::unique(head.vertical_tokens.begin(), head.vertical_tokens.end()), head.vertical_tokens.end());
    selection.heads.push_back(std::move(head));
  }
  selection.validate();
  const step_index index = single_rank_index(selection);
  index.validate();

  const auto q_elems = static_cast<std::size_t>(o.seq_len) * o.heads_q * o.head_dim;
  const auto kv_elems = static_cast<std::size_t>(o.seq_len) * o.heads_kv * o.head_dim;
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto random = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = dist(rng);
    return x;
  };
  const std::vector<float> q = random(q_elems), k = random(kv_elems), v = random(kv_elems), d_out = random(q_elems);
  const double scale = 1.0 / std::sqrt(double(o.head_dim));
  const std::int64_t causal_entries = std::int64_t{o.seq_len} * (o.seq_len + 1) / 2 * o.heads_q;
  const std::int64_t active = index.active_entries();

  std::printf("stria %d.%d.%d quickstart: host reference backend, one rank\n", version_major, version_minor, version_patch);
  std::printf("  seq_len %d, heads %d/%d (GQA %d), head_dim %d, causal\n", o.seq_len, o.heads_q, o.heads_kv,
              shape.group_size(), o.head_dim);
  std::printf("  index: %d active 64x64 tiles, %d vertical entries, density %.2f%% of causal entries\n",
              index.num_active_blocks(), index.num_vertical_entries(), 100.0 * double(active) / double(causal_entries));

  auto view_q = [&](const std::vector<float>& x) { return tensor_view<const float, 3>(x.data(), {o.seq_len, o.heads_q, o.head_dim}); };
  auto view_kv = [&](const std::vector<float>& x) { return tensor_view<const float, 3>(x.data(), {o.seq_len, o.heads_kv, o.head_dim}); };

  // Forward and backward with fp32 accumulation (what the kernels do), then in double as the check.
  std::vector<float> out(q_elems), lse(static_cast<std::size_t>(o.heads_q) * o.seq_len);
  std::vector<double> out64(q_elems), lse64(lse.size());
  auto start = std::chrono::steady_clock::now();
  host::reference_forward<float>(view_q(q), view_kv(k), view_kv(v), index.view(), scale,
                                 tensor_view<float, 3>(out.data(), {o.seq_len, o.heads_q, o.head_dim}),
                                 tensor_view<float, 2>(lse.data(), {o.heads_q, o.seq_len}));
  const double forward_s = seconds_since(start);
  host::reference_forward<double>(view_q(q), view_kv(k), view_kv(v), index.view(), scale,
                                  tensor_view<double, 3>(out64.data(), {o.seq_len, o.heads_q, o.head_dim}),
                                  tensor_view<double, 2>(lse64.data(), {o.heads_q, o.seq_len}));

  std::vector<float> dq(q_elems, 0.0f), dk(kv_elems, 0.0f), dv(kv_elems, 0.0f);
  std::vector<double> dq64(q_elems, 0.0), dk64(kv_elems, 0.0), dv64(kv_elems, 0.0);
  start = std::chrono::steady_clock::now();
  host::reference_backward<float>(view_q(q), view_kv(k), view_kv(v), view_q(out), view_q(d_out),
                                  tensor_view<const float, 2>(lse.data(), {o.heads_q, o.seq_len}), index.view(), scale,
                                  tensor_view<float, 3>(dq.data(), {o.seq_len, o.heads_q, o.head_dim}),
                                  tensor_view<float, 3>(dk.data(), {o.seq_len, o.heads_kv, o.head_dim}),
                                  tensor_view<float, 3>(dv.data(), {o.seq_len, o.heads_kv, o.head_dim}));
  const double backward_s = seconds_since(start);
  host::reference_backward<double>(view_q(q), view_kv(k), view_kv(v), view_q(out), view_q(d_out),
                                   tensor_view<const float, 2>(lse.data(), {o.heads_q, o.seq_len}), index.view(), scale,
                                   tensor_view<double, 3>(dq64.data(), {o.seq_len, o.heads_q, o.head_dim}),
                                   tensor_view<double, 3>(dk64.data(), {o.seq_len, o.heads_kv, o.head_dim}),
                                   tensor_view<double, 3>(dv64.data(), {o.seq_len, o.heads_kv, o.head_dim}));

  const double flops = 4.0 * double(active) * o.head_dim;
  std::printf("  forward  %8.3f s  (%.2f GFLOP/s on the host)   rel. error vs fp64: out %.1e, lse %.1e\n", forward_s,
              flops / forward_s * 1e-9, relative_error(out, out64), relative_error(lse, lse64));
  std::printf("  backward %8.3f s  (%.2f GFLOP/s on the host)   rel. error vs fp64: dq %.1e, dk %.1e, dv %.1e\n", backward_s,
              2.5 * flops / backward_s * 1e-9, relative_error(dq, dq64), relative_error(dk, dk64), relative_error(dv, dv64));
  const bool ok = relative_error(out, out64) < 1e-5 && relative_error(dq, dq64) < 1e-4 && relative_error(dk, dk64) < 1e-4 &&
                  relative_error(dv, dv64) < 1e-4;
  std::printf("%s\n", ok ? "ok" : "FAILED: fp32 result differs from fp64 beyond 1e-5 (out) / 1e-4 (gradients)");
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
