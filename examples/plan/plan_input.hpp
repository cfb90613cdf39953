// SPDX-License-Identifier: Apache-2.0
// What the planner reads: its command line and recorded selection files (JSON through
// nlohmann/json), apart from plan.cpp so that the fuzz test drives the same code.
#pragma once

#include <stria/index/global_selection.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <istream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../common/cli.hpp"

namespace plan_input {

inline constexpr const char* usage =
    "plan: worker- and step-level imbalance of each sharding x ring topology on a Vertical-Slash pattern\n"
    "\n"
    "  --seq-len N      global sequence length (default 131072)\n"
    "  --world W        context-parallel ranks (default 8)\n"
    "  --nodes N        nodes for the hierarchical ring, W / N cards each (default 1: flat ring only)\n"
    "  --sparsity X     fraction of causal entries left out by the synthetic pattern (default 0.95)\n"
    "  --heads-q H      query heads (default 16)\n"
    "  --heads-kv H     KV heads (default 2)\n"
    "  --head-dim D     64 or 128 (default 128)\n"
    "  --rope-theta T   RoPE base of the synthetic input (default 1e6)\n"
    "  --seed S         seed of the synthetic input (default 1)\n"
    "  --estimate       run the online estimator (vertical_slash_top_p, default settings) on the\n"
    "                   synthetic Q/K over --world simulated ranks and plan its selection; adds\n"
    "                   recall_mean and recall_min (exact attention, when --seq-len <= 16384)\n"
    "  --selection F    plan a recorded selection instead: JSON {\"seq_len\": S, \"causal\": true,\n"
    "                   \"heads\": [{\"vertical\": [token, ...], \"slash_blocks\": [delta, ...]}, ...]}\n"
    "  --solver M       also plan the dynamic solver (sequential sharding, M chunks per rank): its\n"
    "                   busiest rank against the mean and its volume against the flat ring's\n"
    "  --volume-cap X   with --solver: a plan may move X times the flat ring's volume (default 1)\n"
    "  --json           print one JSON object instead of the table\n"
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
  unsigned long long seed = 1;
  std::string selection_file;
  bool estimate = false;
  bool json = false;
  stria::index_t solver_chunks = 0;  // 0: no solver plan
  double volume_cap = 1.0;
};

inline options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&] { return stria::cli::option_value(argc, argv, i); };
    auto size = [&] { return stria::cli::parse_integer<stria::index_t>(arg, next(), 1); };
    if (arg == "--seq-len") o.seq_len = size();
    else if (arg == "--world") o.world = size();
    else if (arg == "--nodes") o.nodes = size();
    else if (arg == "--sparsity") o.sparsity = stria::cli::parse_real(arg, next(), 0.0, 1.0 - 1e-9);
    else if (arg == "--heads-q") o.heads_q = size();
    else if (arg == "--heads-kv") o.heads_kv = size();
    else if (arg == "--head-dim") o.head_dim = size();
    else if (arg == "--rope-theta") o.rope_theta = stria::cli::parse_real(arg, next(), std::numeric_limits<double>::min(), std::numeric_limits<double>::max());
    else if (arg == "--seed") o.seed = stria::cli::parse_integer<unsigned long long>(arg, next());
    else if (arg == "--selection") o.selection_file = next();
    else if (arg == "--json") o.json = true;
    else if (arg == "--solver") o.solver_chunks = size();
    else if (arg == "--volume-cap") o.volume_cap = stria::cli::parse_real(arg, next(), std::numeric_limits<double>::min(), std::numeric_limits<double>::max());
    else if (arg == "--estimate") o.estimate = true;
    else if (arg == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else throw stria::invalid_argument("command-line option", arg, "is not known (see --help)");
  }
  if (o.world < 1) throw stria::invalid_argument("--world", o.world, "must be at least 1");
  if (o.solver_chunks < 0) throw stria::invalid_argument("--solver", o.solver_chunks, "must be at least 1 chunk per rank");
  if (o.nodes < 1 || o.world % o.nodes != 0)
    throw stria::invalid_argument("--nodes", o.nodes, "must divide --world " + std::to_string(o.world));
  if (!(o.sparsity >= 0.0 && o.sparsity < 1.0)) throw stria::invalid_argument("--sparsity", o.sparsity, "must lie in [0, 1)");
  if (o.estimate && !o.selection_file.empty())
    throw stria::invalid_argument("--estimate", "with --selection", "choose one: estimate on the synthetic input, or plan a recorded selection");
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
  g.validate();
  return g;
}

inline stria::global_selection read_selection(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw stria::invalid_argument("--selection", path, "cannot be opened");
  return parse_selection(in, path);
}

}  // namespace plan_input
