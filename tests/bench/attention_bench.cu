// SPDX-License-Identifier: Apache-2.0
// Benchmark (a program, not a test): the sparse attention kernels on one GPU, one step covering the
// whole sequence. Qwen2.5-3B shape (Hq 16, Hkv 2, D 128; --head-dim 64 for D 64, --heads-kv for other GQA ratios), bf16,
// causal; patterns: dense causal, the generator's Vertical-Slash selection at 90% and 95% sparsity, and its slash-only block
// patterns. Forward and backward (atomic and
// deterministic; the mma.sync kernels beside the Hopper ones) medians of CUDA-event timings after warm-up, random non-zero inputs,
// outputs poisoned before a checked run; effective TFLOPS count the active entries only (4 D per entry forward, 2.5x that backward,
// ANCHORS.md). --front adds, for each pattern, the same selection through the front template stria::sparse_attention with one
// rank (comm::local_device): the layer a user runs, with its output cast, delta and gradient casts, timed in turns with the bare
// kernels (row `_front_w1_bare`), so that both are measured at the same clocks. --host-times prints the host side of one forward and
// one backward call (checks, allocations, launches), an upper bound on what a timed single call holds the GPU idle for (only the
// part before its first launch does), and the runtime calls that side is made of. Each pattern's row is followed by the forward's
// K and V tile loads (bytes its CTAs draw from L2 and the rate at the forward's time: compare l2_bench's ceiling). --ring-steps
// also times the same forward call as a ring's later steps make it: merging into the fp32 running state (a middle step) and merging
// with the output written in T (the last step), against the first step's overwrite in the row above. --launch-orders times the
// forward, and the atomic backward (its Hopper dQ passes), with the CTAs launched in each order (device::launch_order) in turns
// with query blocks inner, and checks that they write the same bits (the backward: dq); --launch-order picks the order of the
// forward and backward rows (device::launch_order's names). On Hopper, where the backward stores dS over two or more KV heads,
// the atomic backward is also timed with backward_options::overlap_passes (its default) in turns with it off (rows `X_overlap`
// and `X_overlap_serial`).
//   attention_bench [--seq-len 16384,65536,131072] [--repeats N] [--patterns dense,vs90,vs95,slash90,slash95]
//                   [--head-dim 128|64] [--heads-kv 1|2|4|8|16] [--forward-only] [--front] [--host-times] [--ring-steps] [--launch-orders] [--launch-order NAME] [--dq-source automatic|stored|recomputed] [--pattern-dir DIR]   (writes each pattern as JSON for
//                   tests/bench/compare_flex.py) [--json FILE --commit SHA]   (the rows, as tests/bench/results/attention_h200.json)
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/numeric.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/index/local_index.cuh"
#include "stria/sharding/sequential.hpp"
#include "stria/sparse_attention.cuh"
#include "../../examples/common/progress.hpp"
#include "args.hpp"
#include "timing.cuh"

using namespace stria;
using T = __nv_bfloat16;
using bench::median_ms;
using bench::random_buffer;

namespace {

/// device::launch_order's values by name (--launch-order).
constexpr const char* launch_order_names[] = {"automatic", "query_blocks_inner", "kv_group_inner", "heads_inner"};
/// device::dq_source's values by name (--dq-source).
constexpr const char* dq_source_names[] = {"automatic", "stored", "recomputed"};

/// Counts entries that are NaN, or infinite where `allow_neg_inf` is false (-inf marks an empty LSE row).
__global__ void count_bad(const float* x, std::int64_t n, bool allow_neg_inf, unsigned long long* bad) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    if (isnan(v) || (isinf(v) && !(allow_neg_inf && v < 0))) atomicAdd(bad, 1ULL);
  }
}

std::uint64_t non_finite(const device_buffer<float>& x, bool allow_neg_inf) {
  device_buffer<unsigned long long> bad(1);
  bad.fill_bytes(0);
  count_bad<<<1024, 256>>>(x.data(), static_cast<std::int64_t>(x.size()), allow_neg_inf, bad.data());
  STRIA_CUDA_CHECK_LAUNCH("count_bad");
  return bad.download()[0];
}

global_selection make_pattern(const std::string& name, index_t seq_len, index_t heads_q, index_t heads_kv, index_t dim) {
  if (name == "dense") {
    global_selection g{seq_len, true, {}};
    head_selection all;
    for (index_t delta = 0; delta < seq_len / block_tokens; ++delta) all.slash_deltas.push_back(delta);
    g.heads.assign(static_cast<std::size_t>(heads_q), all);
    return g;
  }
  // vs90/vs95: the generator's Vertical-Slash selection (60% of the entries on slash diagonals, the
  // rest on vertical tokens); slash90/slash95: all on slash diagonals plus the 4 sink tokens, a
  // block pattern that block-sparse kernels (FlexAttention) can run without wasted work.
  host::synthetic_vs_options o;
  o.seq_len = seq_len;
  o.heads_q = heads_q;
  o.heads_kv = heads_kv;
  o.head_dim = dim;
  o.density = name.ends_with("90") ? 0.10 : 0.05;
  if (name.starts_with("slash")) o.slash_share = 1.0;
  else if (!name.starts_with("vs")) throw invalid_argument("--patterns", name, "must be dense, vs90, vs95, slash90 or slash95");
  return host::plant_vs_selection(o);
}

void write_pattern(const std::string& path, const global_selection& g, std::int64_t active_entries) {
  std::ofstream out(path);
  out << "{\"seq_len\": " << g.seq_len << ", \"active_entries\": " << active_entries << ", \"heads\": [";
  for (std::size_t h = 0; h < g.heads.size(); ++h) {
    auto list = [&](const std::vector<index_t>& v) {
      std::ostringstream s;
      for (std::size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
      return s.str();
    };
    out << (h ? ", " : "") << "{\"slash\": [" << list(g.heads[h].slash_deltas) << "], \"vertical\": [" << list(g.heads[h].vertical_tokens)
        << "]}";
  }
  out << "]}\n";
}

/// One row of the JSON file (tests/bench/results/attention_h200.json): times in ms, effective TFLOPS.
struct json_row {
  std::string name;
  index_t seq_len, head_dim, heads_q, heads_kv;
  double density, fwd_ms, bwd_ms;
  std::int64_t entries;
};

std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.4f", x);
  return buffer;
}

void write_json(const std::string& path, const std::string& commit, const std::string& gpu, const std::vector<json_row>& rows) {
  std::ofstream out(path);
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  out << "{\"commit\": \"" << commit << "\", \"date\": \"" << date << "\", \"gpu\": \"" << gpu << "\", \"rows\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const json_row& r = rows[i];
    const double flops = 4.0 * double(r.entries) * r.head_dim;
    out << (i ? "," : "") << "\n  {\"name\": \"" << r.name << "\", \"seq_len\": " << r.seq_len << ", \"head_dim\": " << r.head_dim
        << ", \"heads_q\": " << r.heads_q << ", \"heads_kv\": " << r.heads_kv << ", \"density\": " << json_number(r.density)
        << ", \"fwd_ms\": " << json_number(r.fwd_ms) << ", \"bwd_ms\": " << json_number(r.bwd_ms)
        << ", \"fwd_tflops\": " << json_number(flops / r.fwd_ms * 1e-9) << ", \"bwd_tflops\": " << json_number(2.5 * flops / r.bwd_ms * 1e-9)
        << "}";
  }
  out << "\n]}\n";
  if (!out) throw invalid_argument("--json", path, "could not be written");
}

/// Forward and backward medians of the selection through the front template with one rank, each
/// timed in turns with the bare kernels' run on the same selection (`bare_forward`, `bare_backward`,
/// on the default stream), so that the two are compared at the same clocks.
struct front_times {
  double forward_ms, backward_ms, bare_forward_ms, bare_backward_ms;
};
template <int D, class BareForward, class BareBackward>
front_times front_template_ms(const global_selection& g, const device_buffer<T>& q, const device_buffer<T>& k, const device_buffer<T>& v,
                              const device_buffer<T>& d_out, index_t hq, index_t hkv, int repeats, BareForward bare_forward,
                              BareBackward bare_backward, std::uint64_t& bad) {
  using attention = sparse_attention<estimator::vertical_slash_top_p, sharding::sequential, topology::flat_ring, tile<64, 64, D>>;
  const index_t s = g.seq_len;
  front_times ms{NAN, NAN, NAN, NAN};
  comm::local_device_world ranks(1);
  ranks.run([&](comm::local_device& c) {
    const cuda_stream stream;
    const cudaStream_t st = stream.get();
    attention layer({}, {}, topology::flat_ring(1), {s, hq, hkv});
    layer.use_selection(c, g, st);
    device_buffer<T> out(q.size(), st), dq(q.size(), st), dk(k.size(), st), dv(v.size(), st);
    device_buffer<float> lse(std::size_t(hq) * s, st);
    for (auto* b : {&out, &dq, &dk, &dv}) b->fill_bytes(0xff, st);  // NaN until written
    lse.fill_bytes(0xff, st);
    const auto in = [&](const device_buffer<T>& b, index_t heads) { return tensor_view<const T, 3>(b.data(), {s, heads, D}); };
    const auto to = [&](device_buffer<T>& b, index_t heads) { return tensor_view<T, 3>(b.data(), {s, heads, D}); };
    auto forward = [&] { layer.forward(c, in(q, hq), in(k, hkv), in(v, hkv), to(out, hq), tensor_view<float, 2>(lse.data(), {hq, s}), st); };
    auto backward = [&] {
      layer.backward(c, in(q, hq), in(k, hkv), in(v, hkv), in(out, hq), in(d_out, hq), tensor_view<const float, 2>(lse.data(), {hq, s}),
                     to(dq, hq), to(dk, hkv), to(dv, hkv), st);
    };
    std::tie(ms.forward_ms, ms.bare_forward_ms) = bench::median_ms_alternating(repeats, forward, st, bare_forward, nullptr);
    std::tie(ms.backward_ms, ms.bare_backward_ms) = bench::median_ms_alternating(repeats, backward, st, bare_backward, nullptr);
    stream.synchronize();
    for (const auto* b : {&out, &dq, &dk, &dv})
      for (const T x : b->download()) bad += std::isfinite(to_float(x)) ? 0 : 1;
  });
  return ms;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> lengths = bench::split_list("16384,65536,131072"), patterns = bench::split_list("dense,vs90,vs95,slash90,slash95");
  std::string pattern_dir, json_path, commit = "unknown";
  int repeats = 10;
  index_t dim = 128, hkv = 2;
  bool with_backward = true, with_front = false, host_times = false, ring_steps = false, launch_orders = false;
  device::dq_source main_source = device::dq_source::automatic;  // of every backward row but the recomputed one
  device::launch_order main_order = device::launch_order::automatic;  // of the forward and backward rows
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--forward-only" || flag == "--front" || flag == "--host-times" || flag == "--ring-steps" ||
        flag == "--launch-orders") {  // flags without a value
      if (flag == "--front") with_front = true;
      else if (flag == "--launch-orders") launch_orders = true;
      else if (flag == "--host-times") host_times = true;
      else if (flag == "--ring-steps") ring_steps = true;
      else with_backward = false;
      --i;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", flag.c_str());
      return 2;
    }
    const std::string value = argv[i + 1];
    if (flag == "--seq-len") lengths = bench::split_list(value);
    else if (flag == "--patterns") patterns = bench::split_list(value);
    else if (flag == "--repeats") repeats = cli::parse_integer<int>(flag, value, 1);
    else if (flag == "--pattern-dir") pattern_dir = value;
    else if (flag == "--json") json_path = value;
    else if (flag == "--dq-source") {
      const auto found = std::find(std::begin(dq_source_names), std::end(dq_source_names), value);
      if (found == std::end(dq_source_names)) {
        std::fprintf(stderr, "--dq-source = %s: must be automatic, stored or recomputed\n", value.c_str());
        return 2;
      }
      main_source = static_cast<device::dq_source>(found - std::begin(dq_source_names));
    }
    else if (flag == "--launch-order") {
      const auto found = std::find(std::begin(launch_order_names), std::end(launch_order_names), value);
      if (found == std::end(launch_order_names)) {
        std::fprintf(stderr, "--launch-order = %s: must be automatic, query_blocks_inner, kv_group_inner or heads_inner\n", value.c_str());
        return 2;
      }
      main_order = static_cast<device::launch_order>(found - std::begin(launch_order_names));
    }
    else if (flag == "--commit") commit = value;
    else if (flag == "--heads-kv") {
      if (value != "1" && value != "2" && value != "4" && value != "8" && value != "16") {
        std::fprintf(stderr, "--heads-kv = %s: must divide the 16 query heads (1, 2, 4, 8 or 16)\n", value.c_str());
        return 2;
      }
      hkv = cli::parse_integer<index_t>(flag, value, 1);
    } else if (flag == "--head-dim") {
      if (value != "64" && value != "128") {
        std::fprintf(stderr, "--head-dim = %s: must be 64 or 128\n", value.c_str());
        return 2;
      }
      dim = cli::parse_integer<index_t>(flag, value, 1);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (with_front && main_order != device::launch_order::automatic) {
    std::fprintf(stderr, "--launch-order with --front: the front template launches in the automatic order, and its bare twin must too\n");
    return 2;
  }
  const index_t hq = 16;
  const double scale = 1.0 / std::sqrt(double(dim));
  cudaDeviceProp prop{};
  STRIA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("attention_bench on %s: Hq %d, Hkv %d, D %d, bf16, causal, one step over the whole sequence, median of %d\n", prop.name, hq, hkv,
              dim, repeats);
  std::printf("forward: %s kernel (mma.sync column: the sm80 kernel on the same input), launch order %s\n",
              device::hopper_kernels_available() ? "wgmma" : "mma.sync", launch_order_names[static_cast<int>(main_order)]);
  std::printf("backward: %s kernels in the atomic mode (mma bwd column: the mma.sync passes on the same input); det: deterministic\n",
              device::hopper_kernels_available() ? "wgmma" : "mma.sync");
  std::printf("%-8s %-6s %8s %10s %9s %9s %10s %9s %10s %9s %9s %9s %9s %9s %s\n", "S", "pattern", "density", "fwd ms", "fwd TF", "bwd ms",
              "bwd TF", "det ms", "det TF", "mma ms", "mma TF", "mma bwd", "mma bTF", "index ms", "check");
  std::vector<json_row> rows;
  cli::progress progress;  // on stderr, when it is a terminal
  const long long measurements = static_cast<long long>(lengths.size() * patterns.size());
  long long measured = 0;
  for (const std::string& length : lengths) {
    const index_t s = cli::parse_integer<index_t>("--seq-len", length, 1);
    const std::int64_t q_elements = std::int64_t{s} * hq * dim, kv_elements = std::int64_t{s} * hkv * dim;
    device_buffer<T> q = random_buffer(static_cast<std::size_t>(q_elements), 1, 2.0f);
    device_buffer<T> k = random_buffer(static_cast<std::size_t>(kv_elements), 2, 2.0f);
    device_buffer<T> v = random_buffer(static_cast<std::size_t>(kv_elements), 3, 1.0f);
    device_buffer<T> d_out = random_buffer(static_cast<std::size_t>(q_elements), 4, 1.0f);
    device_buffer<float> out(static_cast<std::size_t>(q_elements)), lse(static_cast<std::size_t>(hq) * s), delta(static_cast<std::size_t>(hq) * s);
    device_buffer<float> dq(static_cast<std::size_t>(q_elements)), dk(static_cast<std::size_t>(kv_elements)), dv(static_cast<std::size_t>(kv_elements));
    device_buffer<T> out_t(static_cast<std::size_t>(q_elements));
    const tensor_view<const T, 3> qv(q.data(), {s, hq, dim}), kv(k.data(), {s, hkv, dim}), vv(v.data(), {s, hkv, dim}),
        dov(d_out.data(), {s, hq, dim});
    const tensor_view<float, 3> out_view(out.data(), {s, hq, dim}), dq_view(dq.data(), {s, hq, dim}), dk_view(dk.data(), {s, hkv, dim}),
        dv_view(dv.data(), {s, hkv, dim});
    const tensor_view<float, 2> lse_view(lse.data(), {hq, s}), delta_view(delta.data(), {hq, s});

    for (const std::string& name : patterns) {
      progress.step("patterns measured (" + name + " at " + length + " next)", measured++, measurements);
      const global_selection g = make_pattern(name, s, hq, hkv, dim);
      const device_selection selection(g);
      const auto build_start = std::chrono::steady_clock::now();
      const device_step_index index = build_local_index_device(selection, sharding::sequential{}, 1, 0, 0, {});
      STRIA_CUDA_CHECK(cudaDeviceSynchronize());
      const double index_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - build_start).count();
      const step_index host_index = index.to_host();
      const std::int64_t entries = host_index.active_entries();
      // The forward's K and V tiles as its CTAs load them (one query block per CTA: every row loads
      // its own; the paired kernel, on complete indices, loads the later row of each pair for both).
      std::int64_t row_tiles = 0, paired_tiles = 0;
      for (index_t r = 0; r < host_index.shape.num_rows(); ++r) {
        const index_t tiles = host_index.block_ptr[r + 1] - host_index.block_ptr[r] +
                              (host_index.col_ptr[r + 1] - host_index.col_ptr[r] + block_tokens - 1) / block_tokens;
        row_tiles += tiles;
        const index_t q = r % host_index.shape.num_query_blocks;
        if (q % 2 == 1 || q + 1 == host_index.shape.num_query_blocks) paired_tiles += tiles;
      }
      const std::int64_t loaded_tiles = index.complete && dim == 128 && device::hopper_kernels_available() ? paired_tiles : row_tiles;
      const double load_bytes = double(loaded_tiles) * 2.0 * block_tokens * dim * sizeof(T);
      const double causal_entries = double(s) * (double(s) + 1) / 2 * hq;
      if (!pattern_dir.empty()) write_pattern(pattern_dir + "/" + name + "_" + length + ".json", g, entries);

      const device::step_forward_tensors<T> operands{.q = qv, .k = kv, .v = vv, .out = out_view, .lse = lse_view};
      auto forward = [&](device::forward_kernel which) {
        return [&, which] {
          device::sparse_forward<T>(index, operands, scale, nullptr, {.state = device::running_state::overwrite, .which = which, .order = main_order});
        };
      };
      std::uint64_t bad = 0;
      bool orders_differ = false;  // --launch-orders: an order wrote other bits
      for (auto which : {device::forward_kernel::mma_sync, device::forward_kernel::automatic}) {
        out.fill_bytes(0xff);
        lse.fill_bytes(0xff);
        forward(which)();
        bad += non_finite(out, false) + non_finite(lse, true);
      }
      const double mma_ms = median_ms(repeats, forward(device::forward_kernel::mma_sync));
      const double fwd_ms = median_ms(repeats, forward(device::forward_kernel::automatic));
      // --launch-orders: a call in each launch order, after `prepare`, with what it wrote (`written`) compared bit for bit with
      // query blocks inner's, and timed in turns with query blocks inner (`run(order)`: the call in that order).
      auto compare_orders = [&](const std::string& what, const char* compared, double flops, auto prepare, auto run, auto written) {
        const device::launch_order orders[] = {device::launch_order::query_blocks_inner, device::launch_order::kv_group_inner,
                                               device::launch_order::heads_inner};
        std::vector<std::vector<float>> results;
        for (auto order : orders) {
          prepare();
          run(order)();
          results.push_back(written());
        }
        for (std::size_t i = 1; i < std::size(orders); ++i) {
          const bool same = results[i].size() == results[0].size() &&
                            std::memcmp(results[i].data(), results[0].data(), results[0].size() * sizeof(float)) == 0;
          const auto [base_ms, order_ms] = bench::median_ms_alternating(repeats, run(orders[0]), nullptr, run(orders[i]), nullptr);
          std::printf("%-8d %-6s %s launch order, in turns: %s %.3f ms (%.1f TF), %s %.3f ms (%.1f TF, %+.1f%%) %s %s\n", s, name.c_str(),
                      what.c_str(), launch_order_names[static_cast<int>(orders[0])], base_ms, flops / base_ms * 1e-9,
                      launch_order_names[static_cast<int>(orders[i])], order_ms, flops / order_ms * 1e-9, 100.0 * (base_ms / order_ms - 1.0),
                      compared, same ? "identical" : "DIFFER");
          std::fflush(stdout);
          if (!same) orders_differ = true;
        }
      };
      if (launch_orders)  // the automatic forward
        compare_orders(
            "forward", "outputs", 4.0 * double(entries) * dim,
            [&] {
              out.fill_bytes(0xff);
              lse.fill_bytes(0xff);
            },
            [&](device::launch_order order) {
              return [&, order] {
                device::sparse_forward<T>(index, operands, scale, nullptr, {.state = device::running_state::overwrite, .order = order});
              };
            },
            [&] {
              bad += non_finite(out, false) + non_finite(lse, true);
              std::vector<float> written = out.download();
              const std::vector<float> l = lse.download();
              written.insert(written.end(), l.begin(), l.end());
              return written;
            });

      device::write_output<T>(out_view, tensor_view<T, 3>(out_t.data(), {s, hq, dim}), nullptr);
      device::backward_delta<T>(tensor_view<const T, 3>(out_t.data(), {s, hq, dim}), dov, delta_view, nullptr);
      const device::step_backward_tensors<T> gradients{
          .q = qv, .k = kv, .v = vv, .d_out = dov, .lse = lse_view, .delta = delta_view, .dq = dq_view, .dk = dk_view, .dv = dv_view};
      auto backward = [&](device::determinism mode, device::backward_kernel which = device::backward_kernel::automatic,
                          device::dq_source requested = device::dq_source::automatic, bool overlap = true) {
        const device::dq_source source = requested == device::dq_source::automatic ? main_source : requested;
        return [&, mode, which, source, overlap] {
          device::sparse_backward<T>(index, gradients, scale, nullptr,
                                     {.mode = mode, .which = which, .source = source, .order = main_order, .overlap_passes = overlap});
        };
      };
      // On Hopper the automatic backward stores dS where the workspace fits; the recomputing dQ pass
      // is measured beside it.
      const bool hopper = device::hopper_kernels_available();
      // The main rows' dS source stores it (dq_source::automatic does at D 128).
      const bool main_rows_store_ds = main_source == device::dq_source::stored || (main_source == device::dq_source::automatic && dim == 128);
      double bwd_ms = NAN, det_ms = NAN, mma_bwd_ms = NAN, recomputed_ms = NAN;
      if (with_backward) {
        for (auto source : {device::dq_source::automatic, device::dq_source::recomputed})
          for (auto which : {device::backward_kernel::mma_sync, device::backward_kernel::automatic}) {
            dq.fill_bytes(0);
            dk.fill_bytes(0);
            dv.fill_bytes(0);
            backward(device::determinism::atomic, which, source)();
            bad += non_finite(dq, false) + non_finite(dk, false) + non_finite(dv, false);
          }
        bwd_ms = median_ms(repeats, backward(device::determinism::atomic));
        mma_bwd_ms = median_ms(repeats, backward(device::determinism::atomic, device::backward_kernel::mma_sync));
        det_ms = median_ms(repeats, backward(device::determinism::deterministic));
        if (hopper)
          recomputed_ms = median_ms(repeats, backward(device::determinism::atomic, device::backward_kernel::automatic, device::dq_source::recomputed));
      }
      // backward_options::overlap_passes (on by default) in turns with the same backward without it: the atomic backward where it
      // stores dS over two or more KV heads (one range of heads at these lengths), the case the option runs side by side.
      double serial_ms = NAN, overlap_ms = NAN;
      if (with_backward && hopper && main_rows_store_ds && hkv > 1) {
        auto atomic = [&](bool overlap) { return backward(device::determinism::atomic, device::backward_kernel::automatic, main_source, overlap); };
        std::tie(serial_ms, overlap_ms) = bench::median_ms_alternating(repeats, atomic(false), nullptr, atomic(true), nullptr);
      }
      if (with_backward && hopper && launch_orders) {
        // The atomic backward with its dQ passes in each order (stored and recomputed dS; at D 64 automatic recomputes: one
        // source). Each dq row has one writer, so dq must agree bit for bit.
        std::vector<device::dq_source> sources{device::dq_source::recomputed};
        if (main_rows_store_ds) sources.insert(sources.begin(), main_source);
        for (auto source : sources)
          compare_orders(
              std::string("backward (dS ") + dq_source_names[static_cast<int>(source)] + ") dQ", "dq", 10.0 * double(entries) * dim,
              [&] {
                dq.fill_bytes(0);
                dk.fill_bytes(0);
                dv.fill_bytes(0);
              },
              [&, source](device::launch_order order) {
                return [&, order, source] { device::sparse_backward<T>(index, gradients, scale, nullptr, {.source = source, .order = order}); };
              },
              [&] {
                bad += non_finite(dq, false) + non_finite(dk, false) + non_finite(dv, false);
                return dq.download();
              });
      }

      const double fwd_flops = 4.0 * double(entries) * dim, bwd_flops = 2.5 * fwd_flops;
      const double density = double(entries) / causal_entries;
      std::printf("%-8d %-6s %7.2f%% %10.3f %9.1f %9.3f %10.1f %9.3f %10.1f %9.3f %9.1f %9.3f %9.1f %9.2f %s\n", s, name.c_str(),
                  100.0 * density, fwd_ms, fwd_flops / fwd_ms * 1e-9, bwd_ms, bwd_flops / bwd_ms * 1e-9, det_ms, bwd_flops / det_ms * 1e-9,
                  mma_ms, fwd_flops / mma_ms * 1e-9, mma_bwd_ms, bwd_flops / mma_bwd_ms * 1e-9, index_ms, bad == 0 ? "ok" : "NON-FINITE");
      std::printf("%-8d %-6s forward K/V tile loads: %lld tiles of K and of V, %.1f GB, %.2f TB/s from L2 at the forward's time\n", s,
                  name.c_str(), static_cast<long long>(loaded_tiles), load_bytes * 1e-9, load_bytes / (fwd_ms * 1e-3) * 1e-12);
      if (ring_steps) {  // the running state as step 0 left it; each timed call merges this step in again
        const device::step_forward_tensors<T> last_step{.q = qv, .k = kv, .v = vv, .out = out_view, .lse = lse_view,
                                                        .final_out = tensor_view<T, 3>(out_t.data(), {s, hq, dim})};
        auto merged = [&](const device::step_forward_tensors<T>& tensors) {
          forward(device::forward_kernel::automatic)();
          return median_ms(repeats, [&] {
            device::sparse_forward<T>(index, tensors, scale, nullptr, {.state = device::running_state::merge, .order = main_order});
          });
        };
        const double middle_ms = merged(operands);
        const std::uint64_t merged_bad = non_finite(out, false) + non_finite(lse, true);  // the running state after the middle steps
        const double last_ms = merged(last_step);
        std::printf("%-8d %-6s forward as a ring step: first (overwrite) %.3f ms, middle (merge into fp32) %.3f ms, last (merge, out in T) %.3f ms %s\n",
                    s, name.c_str(), fwd_ms, middle_ms, last_ms, merged_bad == 0 ? "ok" : "NON-FINITE");
      }
      std::fflush(stdout);
      rows.push_back({name, s, dim, hq, hkv, density, fwd_ms, bwd_ms, entries});
      rows.push_back({name + "_deterministic", s, dim, hq, hkv, density, fwd_ms, det_ms, entries});
      rows.push_back({name + "_mma_sync", s, dim, hq, hkv, density, mma_ms, mma_bwd_ms, entries});
      if (with_backward && hopper) {
        std::printf("%-8d %-6s %7.2f%% %10s %9s %9.3f %10.1f   (backward with the dQ pass recomputing dS)\n", s, (name + "_recomputed_dq").c_str(),
                    100.0 * density, "-", "-", recomputed_ms, bwd_flops / recomputed_ms * 1e-9);
        rows.push_back({name + "_recomputed_dq", s, dim, hq, hkv, density, fwd_ms, recomputed_ms, entries});
      }
      if (!std::isnan(overlap_ms)) {  // row `X_overlap`, and `X_overlap_serial` timed in turns with it
        std::printf("%-8d %-6s atomic backward in turns: overlap_passes off %.3f ms (%.1f TF), on %.3f ms (%.1f TF, %+.1f%%)\n", s,
                    (name + "_overlap").c_str(), serial_ms, bwd_flops / serial_ms * 1e-9, overlap_ms, bwd_flops / overlap_ms * 1e-9,
                    100.0 * (serial_ms / overlap_ms - 1.0));
        rows.push_back({name + "_overlap", s, dim, hq, hkv, density, fwd_ms, overlap_ms, entries});
        rows.push_back({name + "_overlap_serial", s, dim, hq, hkv, density, fwd_ms, serial_ms, entries});
      }
      if (host_times) {
        const double fwd_host = bench::median_host_us(repeats, forward(device::forward_kernel::automatic));
        std::printf("%-8d %-6s host time of one call (GPU idle at its start): forward %.1f us", s, name.c_str(), fwd_host);
        if (with_backward) std::printf(", backward %.1f us", bench::median_host_us(repeats, backward(device::determinism::atomic)));
        std::printf("\n");
        // What that host side is made of: a backward call asks cudaPointerGetAttributes for each of its 8-9 tensors, allocates and
        // frees 4 buffers from the pool, and computes the stored dS's workspace limit once (cudaMemGetInfo and two pool queries).
        std::size_t free_bytes = 0, total_bytes = 0;
        cudaPointerAttributes attributes{};
        const double mem_info = bench::median_host_us(repeats, [&] { STRIA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes)); });
        const double pointer = bench::median_host_us(repeats, [&] { STRIA_CUDA_CHECK(cudaPointerGetAttributes(&attributes, q.data())); });
        const double limit = bench::median_host_us(repeats, [&] { static_cast<void>(device::detail::device_ds_workspace_limit(device::dq_source::automatic)); });
        const double allocation = bench::median_host_us(repeats, [&] { device_buffer<float> x(std::size_t{1} << 20, nullptr); });
        std::printf("%-8d %-6s host time of a runtime call: cudaMemGetInfo %.1f us, cudaPointerGetAttributes %.1f us, the stored dS's "
                    "workspace limit %.1f us, a 4 MiB pool allocation and free %.1f us\n",
                    s, name.c_str(), mem_info, pointer, limit, allocation);
        std::fflush(stdout);
      }
      if (with_front && with_backward) {
        std::uint64_t front_bad = 0;
        const auto bare_forward = forward(device::forward_kernel::automatic);
        const auto bare_backward = backward(device::determinism::atomic);
        const front_times f = dim == 64 ? front_template_ms<64>(g, q, k, v, d_out, hq, hkv, repeats, bare_forward, bare_backward, front_bad)
                                        : front_template_ms<128>(g, q, k, v, d_out, hq, hkv, repeats, bare_forward, bare_backward, front_bad);
        std::printf("%-8d %-6s %7.2f%% %10.3f %9.1f %9.3f %10.1f   (front template, one rank: fwd and bwd of the layer) %s\n", s,
                    (name + "_front_w1").c_str(), 100.0 * density, f.forward_ms, fwd_flops / f.forward_ms * 1e-9, f.backward_ms,
                    bwd_flops / f.backward_ms * 1e-9, front_bad == 0 ? "ok" : "NON-FINITE");
        std::printf("%-8d %-6s %7.2f%% %10.3f %9.1f %9.3f %10.1f   (the bare kernels, timed in turns with the front: it takes %+.1f%% / %+.1f%%)\n",
                    s, (name + "_front_w1_bare").c_str(), 100.0 * density, f.bare_forward_ms, fwd_flops / f.bare_forward_ms * 1e-9,
                    f.bare_backward_ms, bwd_flops / f.bare_backward_ms * 1e-9, 100.0 * (f.forward_ms / f.bare_forward_ms - 1.0),
                    100.0 * (f.backward_ms / f.bare_backward_ms - 1.0));
        std::fflush(stdout);
        rows.push_back({name + "_front_w1", s, dim, hq, hkv, density, f.forward_ms, f.backward_ms, entries});
        rows.push_back({name + "_front_w1_bare", s, dim, hq, hkv, density, f.bare_forward_ms, f.bare_backward_ms, entries});
        bad += front_bad;
      }
      if (bad != 0 || orders_differ) return 1;
    }
  }
  progress.step("patterns measured", measured, measurements);
  if (!json_path.empty()) write_json(json_path, commit, prop.name, rows);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
