// SPDX-License-Identifier: Apache-2.0
// What the planner reads: its command line and recorded selection files (JSON through
// nlohmann/json), apart from plan.cpp so that the fuzz test drives the same code.
#pragma once

#include <stria/estimator/vertical_slash_top_p.hpp>
#include <stria/host/synthetic_vs.hpp>
#include <stria/index/cost_model.hpp>
#include <stria/index/global_selection.hpp>
#include <stria/sharding/striped.hpp>
#include <stria/topology/flat_ring.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../common/cli.hpp"

namespace plan_input {

inline constexpr const char* usage =
    "plan: worker- and step-level imbalance of each sharding x ring topology on a Vertical-Slash pattern\n"
    "(shardings: sequential, zigzag, striped<64>, and placed_stripes: 64-token stripes placed for the\n"
    "selection by balance_stripes, up to 1024 ranks)\n"
    "\n"
    "  --seq-len N      global sequence length (default 131072)\n"
    "  --world W        context-parallel ranks (default 8)\n"
    "  --nodes N        nodes for the hierarchical ring, W / N cards each (default 1: flat ring only)\n"
    "  --sparsity X     fraction of causal entries the synthetic pattern leaves out (default 0.95): a\n"
    "                   target, met within a point or so from 0.8 up; below, the planted lines overlap\n"
    "                   and the pattern keeps fewer entries than asked (the header prints the density)\n"
    "  --heads-q H      query heads (default 16)\n"
    "  --heads-kv H     KV heads (default 2)\n"
    "  --head-dim D     64 or 128 (default 128)\n"
    "  --rope-theta T   RoPE base of the synthetic input (default 1e6)\n"
    "  --token-noise X  per-element standard deviation of the synthetic Q's and K's token noise, in\n"
    "                   [0, 1000] (default 0.5; 0: every score is its expected value)\n"
    "  --seed S         seed of the synthetic input (default 1)\n"
    "  --estimate       run the online estimator (vertical_slash_top_p, default settings) on the\n"
    "                   synthetic Q/K over --world simulated ranks and plan its selection; adds\n"
    "                   recall_mean and recall_min (exact attention, when --seq-len <= 16384 or with\n"
    "                   --recall-stride), and the oracle's: the same rule on statistics of the exact\n"
    "                   attention of all rows, at the estimate's density per head (oracle_*) and with\n"
    "                   the estimate's top-p (oracle_top_p_*); and the best mean recall of a selection\n"
    "                   of any shape, at the estimate's density and at 10% (any_shape_recall_mean*)\n"
    "  --recall-stride N   recall and oracle over the rows of every N-th query block (default 1)\n"
    "  --vertical-max N, --slash-max N, --local-diagonals N, --sink-tokens N, --p X,\n"
    "  --p-vertical X, --p-slash X\n"
    "                   the estimator's settings (defaults: vertical_slash_top_p's: vertical cap\n"
    "                   S / 32 tokens in [128, 8192], slash cap 1/32 of the block diagonals in\n"
    "                   [4, 512], 3 local diagonals, 64 sink tokens, p_vertical 0.99, p_slash\n"
    "                   0.9; --p sets both goals, --p-vertical and --p-slash each one, over --p\n"
    "                   in any order)\n"
    "  --pattern P      synthetic family: rope (default), power_law_slash, periodic_slash,\n"
    "                   clustered_vertical, mixture (stria/host/synthetic_vs.hpp)\n"
    "  --selection F    plan a recorded selection instead: JSON {\"seq_len\": S, \"causal\": true,\n"
    "                   \"heads\": [{\"vertical\": [token, ...], \"slash_blocks\": [delta, ...]}, ...]}\n"
    "  --solver M       also plan the dynamic solver (sequential sharding, M chunks per rank): its\n"
    "                   busiest rank against the mean and its volume against the flat ring's\n"
    "  --volume-cap X   with --solver: a plan may move X times the flat ring's volume (default 1)\n"
    "  --json           print one JSON object instead of the table\n"
    "  --svg FILE       also draw the plan into FILE (SVG): each sharding x topology's active entries per\n"
    "                   rank and ring step on one colour scale, and head 0's block pattern\n"
    "\n"
    "Scale on paper (a cost model of one layer, include/stria/index/cost_model.hpp):\n"
    "  --cluster NxG[,NxG...]  predict forward and backward time per layer on N nodes x G GPUs\n"
    "                   (one rank per GPU) for every sharding x ring (and --solver M), ranked;\n"
    "                   replaces --world and --nodes; --seq-len may then be a list (524288,1048576)\n"
    "  --intra-gbps X   GPU-to-GPU bandwidth within a node, Gb/s per direction (default 1904:\n"
    "                   238 GB/s, NCCL send/recv measured on H200 NVLink)\n"
    "  --inter-gbps X   between nodes, Gb/s per direction per GPU (default 400: InfiniBand NDR)\n"
    "  --intra-latency-us X, --inter-latency-us X   per message (defaults 10 and 20)\n"
    "  --throughput F[,F...]  kernel speed from attention_bench JSON files (tests/bench/results/\n"
    "                   attention_h200.json): their vs95 rows fitted, and each row's speed kept as a\n"
    "                   point of the speed curve by tiles per row (default, built in: the fit of\n"
    "                   attention_lengths_h200.json,attention_h200.json)\n"
    "  --kernel-scale X kernel speed relative to the table: throughput x X, row times / X, call cost kept (e.g. an\n"
    "                   A100 as 312 / 989 = 0.3155, the dense bf16 peaks of A100 and H200; default 1)\n"
    "  --memory-gbs X   device memory bandwidth, GB/s, at which a ring's forward reads its fp32 running\n"
    "                   state (default 4200: the H200's copy ceiling; an A100 80GB about 1900)\n"
    "  --outer-stream   the hierarchical ring's outer transfers on a stream of their own, as the\n"
    "                   design has it (the device engine of this version puts each rank's transfers\n"
    "                   on one stream)\n"
    "  --help           this text\n";

struct options {
  stria::index_t seq_len = 131072;
  stria::index_t world = 8;
  stria::index_t nodes = 1;
  double sparsity = 0.95;
  stria::index_t heads_q = 16;
  stria::index_t heads_kv = 2;
  stria::index_t head_dim = 128;
  double rope_theta = 1e6;
  double token_noise = 0.5;
  unsigned long long seed = 1;
  std::string selection_file;
  bool estimate = false;
  bool json = false;
  std::string svg_file;  // --svg: the picture of the plan
  stria::index_t recall_stride = 0;  // 0: not given (recall only up to 16384 tokens, every row)
  stria::index_t vertical_max = 0, slash_max = 0;  // 0: the default caps
  stria::index_t local_diagonals = stria::estimator::vertical_slash_top_p{}.local_diagonals;
  stria::index_t sink_tokens = stria::estimator::vertical_slash_top_p{}.sink_tokens;
  double p = 0, p_vertical = 0, p_slash = 0;  // 0: not given; --p sets both goals, --p-vertical / --p-slash one
  std::string pattern = "rope";
  stria::index_t solver_chunks = 0;  // 0: no solver plan
  double volume_cap = 1.0;
  // --cluster: the cost model's mode
  std::vector<std::pair<stria::index_t, stria::index_t>> clusters;  // (nodes, GPUs per node)
  std::vector<stria::index_t> seq_lens{131072};
  double intra_gbps = stria::cost::h200_nvlink.gbytes_per_s * 8;
  double inter_gbps = stria::cost::infiniband_400g.gbytes_per_s * 8;
  double intra_latency_us = stria::cost::h200_nvlink.latency_us;
  double inter_latency_us = stria::cost::infiniband_400g.latency_us;
  std::string throughput_file;  // --throughput: one or more paths, comma-separated
  bool outer_stream = false;
  double kernel_scale = 1.0;
  double memory_gbs = stria::cost::kernel_throughput{}.memory_gbytes_per_s;
};

/// "NxG" (nodes x GPUs per node), both in [1, max_world_size], at most max_world_size GPUs in all.
inline std::pair<stria::index_t, stria::index_t> parse_cluster(std::string_view text) {
  const std::string rule = "must be NODESxGPUS: two integers >= 1 with at most " + std::to_string(stria::max_world_size) + " GPUs in all (e.g. 4x8)";
  const std::size_t x = text.find('x');
  if (x == std::string_view::npos) throw stria::invalid_argument("--cluster", text, rule);
  stria::index_t nodes = 0, gpus = 0;
  try {
    nodes = stria::cli::parse_integer<stria::index_t>("--cluster", text.substr(0, x), 1, stria::max_world_size);
    gpus = stria::cli::parse_integer<stria::index_t>("--cluster", text.substr(x + 1), 1, stria::max_world_size);
  } catch (const stria::invalid_argument&) {
    throw stria::invalid_argument("--cluster", text, rule);
  }
  if (std::int64_t{nodes} * gpus > stria::max_world_size) throw stria::invalid_argument("--cluster", text, rule);
  return {nodes, gpus};
}

/// Options that only one mode reads (`mode`: the option that turns it on): given without it, a plan
/// would silently ignore them.
struct mode_option {
  std::string_view option, mode;
};
inline constexpr mode_option mode_options[] = {
    {"--intra-gbps", "--cluster"},    {"--inter-gbps", "--cluster"},   {"--intra-latency-us", "--cluster"}, {"--inter-latency-us", "--cluster"},
    {"--throughput", "--cluster"},    {"--kernel-scale", "--cluster"}, {"--memory-gbs", "--cluster"},       {"--outer-stream", "--cluster"},
    {"--recall-stride", "--estimate"}, {"--vertical-max", "--estimate"}, {"--slash-max", "--estimate"},     {"--local-diagonals", "--estimate"},
    {"--sink-tokens", "--estimate"},  {"--p", "--estimate"},           {"--p-vertical", "--estimate"},
    {"--p-slash", "--estimate"},      {"--volume-cap", "--solver"}};
/// What only the synthetic input reads: a recorded selection sets the length and the heads itself.
inline constexpr std::string_view synthetic_only[] = {"--seq-len", "--sparsity", "--heads-q", "--rope-theta", "--token-noise", "--seed", "--pattern"};

inline options parse(int argc, char** argv) {
  options o;
  std::vector<std::pair<std::string, std::string>> given;  // (option, its text; "(set)" for a flag), as typed
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      std::string text = stria::cli::option_value(argc, argv, i);
      given.emplace_back(arg, text);
      return text;
    };
    auto size = [&] { return stria::cli::parse_integer<stria::index_t>(arg, next(), 1); };
    if (arg == "--seq-len") {
      o.seq_lens = stria::cli::parse_integer_list<stria::index_t>(arg, next(), 1);
      o.seq_len = o.seq_lens.front();
    } else if (arg == "--cluster") {
      const std::string list = next();
      o.clusters.clear();
      for (std::size_t start = 0;;) {
        const std::size_t comma = list.find(',', start);
        o.clusters.push_back(parse_cluster(std::string_view(list).substr(start, comma == std::string::npos ? std::string::npos : comma - start)));
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (arg == "--intra-gbps") o.intra_gbps = stria::cli::parse_real(arg, next(), 1e-3, 1e6);
    else if (arg == "--inter-gbps") o.inter_gbps = stria::cli::parse_real(arg, next(), 1e-3, 1e6);
    else if (arg == "--intra-latency-us") o.intra_latency_us = stria::cli::parse_real(arg, next(), 0.0, 1e6);
    else if (arg == "--inter-latency-us") o.inter_latency_us = stria::cli::parse_real(arg, next(), 0.0, 1e6);
    else if (arg == "--throughput") o.throughput_file = next();
    else if (arg == "--outer-stream") o.outer_stream = true, given.emplace_back(arg, "(set)");
    else if (arg == "--kernel-scale") o.kernel_scale = stria::cli::parse_real(arg, next(), 1e-3, 1e3);
    else if (arg == "--memory-gbs") o.memory_gbs = stria::cli::parse_real(arg, next(), 1.0, 1e6);
    else if (arg == "--world") o.world = size();
    else if (arg == "--nodes") o.nodes = size();
    else if (arg == "--sparsity")  // its rule, [0, 1), is checked below for every value
      o.sparsity = stria::cli::parse_real(arg, next(), -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity());
    else if (arg == "--heads-q") o.heads_q = size();
    else if (arg == "--heads-kv") o.heads_kv = size();
    else if (arg == "--head-dim") o.head_dim = size();
    else if (arg == "--rope-theta") o.rope_theta = stria::cli::parse_real_above(arg, next(), 1.0);
    else if (arg == "--token-noise") o.token_noise = stria::cli::parse_real(arg, next(), 0.0, 1000.0);
    else if (arg == "--seed") o.seed = stria::cli::parse_integer<unsigned long long>(arg, next());
    else if (arg == "--selection") o.selection_file = next();
    else if (arg == "--json") o.json = true;
    else if (arg == "--svg") o.svg_file = next();
    else if (arg == "--solver") o.solver_chunks = size();
    else if (arg == "--volume-cap") o.volume_cap = stria::cli::parse_real_above(arg, next(), 0.0);
    else if (arg == "--estimate") o.estimate = true;
    else if (arg == "--recall-stride") o.recall_stride = size();
    else if (arg == "--vertical-max") o.vertical_max = size();
    else if (arg == "--slash-max") o.slash_max = size();
    else if (arg == "--local-diagonals") o.local_diagonals = size();
    else if (arg == "--sink-tokens") o.sink_tokens = stria::cli::parse_integer<stria::index_t>(arg, next(), 0);
    else if (arg == "--p") o.p = stria::cli::parse_real(arg, next(), 1e-9, 1.0);
    else if (arg == "--p-vertical") o.p_vertical = stria::cli::parse_real(arg, next(), 1e-9, 1.0);
    else if (arg == "--p-slash") o.p_slash = stria::cli::parse_real(arg, next(), 1e-9, 1.0);
    else if (arg == "--pattern") {
      o.pattern = next();
      if (o.pattern != "rope" && o.pattern != "power_law_slash" && o.pattern != "periodic_slash" && o.pattern != "clustered_vertical" &&
          o.pattern != "mixture")
        throw stria::invalid_argument("--pattern", o.pattern, "must be rope, power_law_slash, periodic_slash, clustered_vertical or mixture");
    }
    else if (arg == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else throw stria::invalid_argument("command-line option", arg, "is not known (see --help)");
  }
  // The option's text as typed, or null where it was not given.
  auto given_value = [&](std::string_view name) -> const std::string* {
    for (const auto& [option, text] : given)
      if (option == name) return &text;
    return nullptr;
  };
  if (o.clusters.empty() && o.seq_lens.size() > 1)
    throw stria::invalid_argument("--seq-len", std::to_string(o.seq_lens.size()) + " lengths", "a list of lengths needs --cluster");
  if (!o.clusters.empty()) {
    if (given_value("--world") || given_value("--nodes"))
      throw stria::invalid_argument("--cluster", "with --world or --nodes", "choose one: --cluster sets the world and the nodes");
    if (!o.selection_file.empty() || o.estimate)
      throw stria::invalid_argument("--cluster", "with --selection or --estimate", "the cost model plans the synthetic pattern at each --seq-len");
    if (!o.svg_file.empty()) throw stria::invalid_argument("--svg", "with --cluster", "the picture shows a plan's ring workloads; --cluster predicts times");
    for (const auto& [nodes, gpus] : o.clusters)
      for (const stria::index_t s : o.seq_lens)
        if (s % (128 * std::int64_t{nodes} * gpus) != 0)  // zigzag's rule, which covers sequential and striped<64>
          throw stria::invalid_argument("--seq-len", s, "must be divisible by 128 x " + std::to_string(nodes) + " x " + std::to_string(gpus) +
                                                             " GPUs = " + std::to_string(128 * std::int64_t{nodes} * gpus) + " (zigzag's 2W chunks of whole blocks)");
    o.world = o.clusters.front().first * o.clusters.front().second;
    o.nodes = o.clusters.front().first;
  }
  if (o.world < 1) throw stria::invalid_argument("--world", o.world, "must be at least 1");
  if (o.solver_chunks < 0) throw stria::invalid_argument("--solver", o.solver_chunks, "must be at least 1 chunk per rank");
  if (o.nodes < 1 || o.world % o.nodes != 0)
    throw stria::invalid_argument("--nodes", o.nodes, "must divide --world " + std::to_string(o.world));
  if (!(o.sparsity >= 0.0 && o.sparsity < 1.0)) throw stria::invalid_argument("--sparsity", o.sparsity, "must lie in [0, 1)");
  if (o.estimate && !o.selection_file.empty())
    throw stria::invalid_argument("--estimate", "with --selection", "choose one: estimate on the synthetic input, or plan a recorded selection");
  // What a mode reads, refused without it: a plan that dropped an option would answer another question.
  for (const mode_option& m : mode_options) {
    const bool on = m.mode == "--cluster" ? !o.clusters.empty() : m.mode == "--estimate" ? o.estimate : o.solver_chunks > 0;
    if (const std::string* text = given_value(m.option); text && !on)
      throw stria::invalid_argument(m.option, *text, "applies only with " + std::string(m.mode) + " (without it nothing reads it)");
  }
  if (!o.selection_file.empty()) {
    for (const std::string_view name : synthetic_only)
      if (const std::string* text = given_value(name))
        throw stria::invalid_argument(std::string(name), *text, "shapes the synthetic input; with --selection the file sets the length and the heads");
    if (const std::string* text = given_value("--heads-kv"); text && o.solver_chunks == 0)
      throw stria::invalid_argument("--heads-kv", *text, "with --selection only the solver's problem reads it: applies only with --solver");
  }
  if (o.head_dim != 64 && o.head_dim != 128) throw stria::invalid_argument("--head-dim", o.head_dim, "must be 64 or 128 (the kernels' head dims)");
  return o;
}

/// The deepest nesting a selection file may have: its format needs 3 (the object, "heads", a head's
/// lists); the limit keeps a hostile file from costing memory or time.
inline constexpr int selection_max_depth = 8;

/// A JSON value as an error message shows it: at most 40 characters, invalid UTF-8 replaced.
inline std::string shown(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).substr(0, 40);
}

/// A JSON integer at `where` in [min, max]: an integer literal (not 1.0, not true), no narrowing.
inline stria::index_t selection_integer(const nlohmann::json& value, const std::string& where, std::int64_t min, std::int64_t max) {
  if (!value.is_number_integer()) throw stria::invalid_argument(where, shown(value), "must be an integer");
  // Unsigned values past INT64_MAX compare as unsigned; the rest as signed.
  const bool in_range = value.is_number_unsigned() ? value.get<std::uint64_t>() <= static_cast<std::uint64_t>(max) && value.get<std::uint64_t>() >= static_cast<std::uint64_t>(std::max<std::int64_t>(min, 0))
                                                   : value.get<std::int64_t>() >= min && value.get<std::int64_t>() <= max;
  if (!in_range) throw stria::invalid_argument(where, shown(value), "must lie in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  return static_cast<stria::index_t>(value.get<std::int64_t>());
}

/// Parses a recorded selection: {"seq_len": S, "causal": true, "heads": [{"vertical": [...], "slash_blocks": [...]}, ...]}
/// from `in`, named `path` in errors. Every value is type- and range-checked; an error names the file
/// and the key path (parse errors: the line and column).
inline stria::global_selection parse_selection(std::istream& in, const std::string& path) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(in, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > selection_max_depth)
        throw stria::invalid_argument("--selection", path, "nests deeper than " + std::to_string(selection_max_depth) + " levels");
      return true;
    });
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number past double's range
    throw stria::invalid_argument("--selection", path, std::string("is not valid JSON: ") + e.what());
  }
  const std::string file = "selection " + path;
  if (!root.is_object()) throw stria::invalid_argument(file, root.type_name(), "must be a JSON object");
  for (const auto& [key, value] : root.items())
    if (key != "seq_len" && key != "causal" && key != "heads")
      throw stria::invalid_argument(file + ": key", key, "is not known (seq_len, causal, heads)");
  if (!root.contains("seq_len")) throw stria::invalid_argument(file, "(no seq_len)", "needs \"seq_len\"");
  stria::global_selection g;
  g.seq_len = selection_integer(root["seq_len"], file + ": seq_len", 1, std::numeric_limits<stria::index_t>::max());
  if (root.contains("causal")) {
    if (!root["causal"].is_boolean()) throw stria::invalid_argument(file + ": causal", shown(root["causal"]), "must be true or false");
    g.causal = root["causal"].get<bool>();
  }
  if (!root.contains("heads") || !root["heads"].is_array() || root["heads"].empty())
    throw stria::invalid_argument(file + ": heads", root.contains("heads") ? shown(root["heads"]) : "(missing)",
                                  "must be a non-empty array of heads");
  const nlohmann::json& heads = root["heads"];
  const std::int64_t blocks = (std::int64_t{g.seq_len} + 63) / 64;
  auto integers = [&](const nlohmann::json& head, const char* key, const std::string& where, std::int64_t max) {
    std::vector<stria::index_t> out;
    if (!head.contains(key)) return out;
    const nlohmann::json& list = head[key];
    if (!list.is_array()) throw stria::invalid_argument(where, shown(list), "must be an array of integers");
    for (std::size_t i = 0; i < list.size(); ++i) out.push_back(selection_integer(list[i], where + "[" + std::to_string(i) + "]", 0, max));
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  };
  for (std::size_t h = 0; h < heads.size(); ++h) {
    const std::string where = file + ": heads[" + std::to_string(h) + "]";
    const nlohmann::json& entry = heads[h];
    if (!entry.is_object()) throw stria::invalid_argument(where, shown(entry), "must be an object {vertical, slash_blocks}");
    for (const auto& [key, value] : entry.items())
      if (key != "vertical" && key != "slash_blocks") throw stria::invalid_argument(where + ": key", key, "is not known (vertical, slash_blocks)");
    stria::head_selection head;
    head.vertical_tokens = integers(entry, "vertical", where + ".vertical", std::int64_t{g.seq_len} - 1);
    head.slash_deltas = integers(entry, "slash_blocks", where + ".slash_blocks", blocks - 1);
    // Diagonal 0 keeps every causal row non-empty, as every stria estimator guarantees.
    if (g.causal && !std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), 0))
      head.slash_deltas.insert(head.slash_deltas.begin(), 0);
    g.heads.push_back(std::move(head));
  }
  try {
    g.validate();
  } catch (const stria::invalid_argument& e) {  // the selection's own rules, with the file named
    throw stria::invalid_argument(file + ": " + e.argument(), e.value(), e.rule());
  }
  return g;
}

/// Opens `path` for `option`: a file that can be read (a pipe or /dev/stdin too), not a directory,
/// or an error naming both.
inline std::ifstream open_input(const char* option, const std::string& path) {
  std::error_code error;  // pipes and /dev/stdin are read as files; a directory is not
  if (std::filesystem::is_directory(path, error)) throw stria::invalid_argument(option, path, "must name a file, not a directory");
  std::ifstream in(path);
  if (!in) throw stria::invalid_argument(option, path, "cannot be opened");
  return in;
}

inline stria::global_selection read_selection(const std::string& path) {
  std::ifstream in = open_input("--selection", path);
  return parse_selection(in, path);
}

/// The gathered vertical tiles' padding of attention_bench's vs95 selection on one rank.
inline std::int64_t bench_vertical_padding(double seq_len, double heads_q, double heads_kv, stria::index_t head_dim, const std::string& where) {
  // The selection is planted here, so the row's shape is bounded to what a benchmark row can be.
  if (seq_len != std::floor(seq_len) || seq_len < stria::block_tokens || seq_len > double(1 << 21) || std::fmod(seq_len, stria::block_tokens) != 0)
    throw stria::invalid_argument(where + ".seq_len", seq_len, "must be a multiple of 64 of at most 2097152 (a benchmark row's length)");
  for (const auto& [key, heads] : {std::pair{".heads_q", heads_q}, std::pair{".heads_kv", heads_kv}})
    if (heads != std::floor(heads) || heads > 256) throw stria::invalid_argument(where + key, heads, "must be an integer of at most 256");
  if (std::fmod(heads_q, heads_kv) != 0) throw stria::invalid_argument(where + ".heads_kv", heads_kv, "must divide heads_q = " + std::to_string(static_cast<long long>(heads_q)));
  stria::host::synthetic_vs_options o;
  o.seq_len = static_cast<stria::index_t>(seq_len);
  o.heads_q = static_cast<stria::index_t>(heads_q);
  o.heads_kv = static_cast<stria::index_t>(heads_kv);
  o.head_dim = head_dim;
  o.density = 0.05;
  const stria::global_selection g = stria::host::plant_vs_selection(o);
  return stria::cost::count_ring_vertical_padding(g, stria::sharding::striped<64>{}, stria::topology::flat_ring(1)).total();
}

/// The kernels' speed for `head_dim` fitted (stria::cost::fit_kernel_speed) to the rows named
/// "vs95" of attention_bench results files (tests/bench/results/attention_h200.json), `paths`
/// comma-separated, their rows pooled: per row seq_len, head_dim, heads_q, heads_kv, fwd_ms, bwd_ms,
/// fwd_tflops, bwd_tflops. The executed entries add the padding of the gathered vertical tiles,
/// counted on the selection attention_bench ran (the planted pattern at 5% density,
/// host::plant_vs_selection).
inline stria::cost::kernel_throughput read_throughput(const std::string& paths, stria::index_t head_dim) {
  std::vector<stria::cost::kernel_sample> forward, backward;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = paths.find(',', start);
    const std::string path = paths.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (path.empty()) throw stria::invalid_argument("--throughput", paths, "must be one or more file names, comma-separated");
    std::ifstream in = open_input("--throughput", path);
    nlohmann::json root;
    try {
      root = nlohmann::json::parse(in, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > selection_max_depth) throw stria::invalid_argument("--throughput", path, "nests deeper than " + std::to_string(selection_max_depth) + " levels");
        return true;
      });
    } catch (const nlohmann::json::exception& e) {
      throw stria::invalid_argument("--throughput", path, std::string("is not valid JSON: ") + e.what());
    }
    const std::string file = "throughput " + path;
    if (!root.is_object() || !root.contains("rows") || !root["rows"].is_array())
      throw stria::invalid_argument(file, root.type_name(), "must be an object with an array \"rows\"");
    const nlohmann::json& rows = root["rows"];
    auto number = [&](const nlohmann::json& row, const char* key, const std::string& where) {
      if (!row.contains(key) || !row[key].is_number() || !(row[key].get<double>() > 0) || !std::isfinite(row[key].get<double>()))
        throw stria::invalid_argument(where + "." + key, row.contains(key) ? shown(row[key]) : "(missing)", "must be a positive finite number");
      return row[key].get<double>();
    };
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const nlohmann::json& row = rows[i];
      const std::string where = file + ": rows[" + std::to_string(i) + "]";
      if (!row.is_object()) throw stria::invalid_argument(where, shown(row), "must be an object");
      if (!row.contains("name") || row["name"] != "vs95" || !row.contains("head_dim") || row["head_dim"] != head_dim) continue;
      const double tokens = number(row, "seq_len", where), heads = number(row, "heads_q", where);
      const double rows_active = tokens / stria::block_tokens * heads;
      const double forward_flops = number(row, "fwd_tflops", where) * 1e12 * number(row, "fwd_ms", where) * 1e-3;
      const double backward_flops = number(row, "bwd_tflops", where) * 1e12 * number(row, "bwd_ms", where) * 1e-3;
      const double padding = double(bench_vertical_padding(tokens, heads, number(row, "heads_kv", where), head_dim, where));
      forward.push_back({forward_flops + stria::cost::entry_flops(head_dim, false) * padding, rows_active, number(row, "fwd_ms", where) * 1e-3});
      backward.push_back({backward_flops + stria::cost::entry_flops(head_dim, true) * padding, rows_active, number(row, "bwd_ms", where) * 1e-3});
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (forward.empty()) throw stria::invalid_argument("throughput " + paths, head_dim, "has no \"vs95\" row for this head_dim");
  return {.head_dim = head_dim, .forward = stria::cost::fit_kernel_speed(forward), .backward = stria::cost::fit_kernel_speed(backward)};
}

}  // namespace plan_input
