// SPDX-License-Identifier: Apache-2.0
// The quickstart's command line, shared by its host path (quickstart.cpp) and GPU path
// (quickstart_gpu.cu). Sizes left at 0 take the chosen backend's default: the GPU runs the
// Qwen2.5-3B attention shape at 128K over 8 ranks; the host a 4K problem over 4 ranks.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include <stria/core/config.hpp>
#include <stria/core/error.hpp>

#include "../common/cli.hpp"

namespace quickstart {

enum class backend_choice { automatic, host, gpu };

struct options {
  stria::index_t seq_len = 0;
  stria::index_t world = 0;
  stria::index_t nodes = 1;
  stria::index_t heads_q = 0;
  stria::index_t heads_kv = 0;
  stria::index_t head_dim = 128;
  double sparsity = 0;
  unsigned long long seed = 1;
  int repeats = 3;  // GPU: timed layers after one warm-up
  bool repeats_given = false;
  backend_choice backend = backend_choice::automatic;
  bool use_nccl = false;  // one rank per GPU over NCCL: the default with several GPUs, or --nccl
};

inline constexpr const char* usage =
    "quickstart [--host | --gpu] [--nccl] [--seq-len N] [--world W] [--nodes N] [--heads-q H] [--heads-kv H]\n"
    "           [--head-dim 64|128] [--sparsity X] [--seed S] [--repeats R]\n"
    "  --host: the host backend even where a GPU is present; --gpu: the GPU or exit 77.\n"
    "  With several GPUs: one rank per GPU over NCCL; with one: --world ranks share it (--nccl: one NCCL rank).\n"
    "Defaults, GPU: --seq-len 131072 --world 8 (or the GPU count over NCCL) --heads-q 16 --heads-kv 2\n"
    "  --sparsity 0.95 --repeats 3 (timed layers after one warm-up);\n"
    "  host: --seq-len 4096 --world 4 --heads-q 8 --heads-kv 2 --sparsity 0.9 (one layer, checked in fp64).\n"
    "  Both: --nodes 1 (a flat ring; N > 1: the hierarchical ring of N nodes), --head-dim 128, --seed 1.\n"
    "  --sparsity: the synthetic pattern's share of causal entries left out (a target: the run prints the\n"
    "  density reached).";

inline options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&] { return stria::cli::option_value(argc, argv, i); };
    // Sizes start at 1: 0 is what the options hold for "the backend's default", never a user's value.
    auto size = [&] { return stria::cli::parse_integer<stria::index_t>(arg, value(), 1); };
    if (arg == "--seq-len") o.seq_len = size();
    else if (arg == "--world") o.world = size();
    else if (arg == "--nodes") o.nodes = size();
    else if (arg == "--heads-q") o.heads_q = size();
    else if (arg == "--heads-kv") o.heads_kv = size();
    else if (arg == "--head-dim") o.head_dim = size();
    else if (arg == "--sparsity") o.sparsity = stria::cli::parse_real(arg, value(), 1e-6, 1.0 - 1e-6);
    else if (arg == "--seed") o.seed = stria::cli::parse_integer<unsigned long long>(arg, value());
    else if (arg == "--repeats") o.repeats = stria::cli::parse_integer<int>(arg, value(), 1, 1000000), o.repeats_given = true;
    else if (arg == "--host" || arg == "--gpu") {
      const backend_choice chosen = arg == "--host" ? backend_choice::host : backend_choice::gpu;
      if (o.backend != backend_choice::automatic && o.backend != chosen)
        throw stria::invalid_argument(arg, "with " + std::string(arg == "--host" ? "--gpu" : "--host"), "choose one backend");
      o.backend = chosen;
    }
    else if (arg == "--nccl") o.use_nccl = true;
    else if (arg == "--help") {
      std::puts(usage);
      std::exit(0);
    } else throw stria::invalid_argument("command-line option", arg, "is not known (see --help)");
  }
  return o;
}

/// Fills what was left at 0 with the backend's defaults and checks the combination. `gpus`: the
/// devices present (several: one NCCL rank per GPU).
inline void apply_defaults(options& o, bool gpu, int gpus) {
  if (gpu && gpus > 1) o.use_nccl = true;
  if (o.use_nccl && !gpu) throw stria::invalid_argument("--nccl", "(no GPU)", "needs at least one usable GPU");
  if (o.use_nccl && o.world != 0 && o.world != gpus)
    throw stria::invalid_argument("--world", o.world, "must equal the number of GPUs (" + std::to_string(gpus) + ") with one NCCL rank per GPU");
  if (o.seq_len == 0) o.seq_len = gpu ? 131072 : 4096;
  if (o.world == 0) o.world = o.use_nccl ? gpus : gpu ? 8 : 4;
  if (o.heads_q == 0) o.heads_q = gpu ? 16 : 8;
  if (o.heads_kv == 0) o.heads_kv = 2;
  if (o.sparsity == 0) o.sparsity = gpu ? 0.95 : 0.9;
  if (o.nodes < 1 || o.world % o.nodes != 0)
    throw stria::invalid_argument("--nodes", o.nodes, "must divide --world " + std::to_string(o.world));
  if (o.repeats < 1) throw stria::invalid_argument("--repeats", o.repeats, "must be at least 1");
  if (!gpu && o.repeats_given && o.backend == backend_choice::host)
    throw stria::invalid_argument("--repeats", o.repeats, "times the GPU path only (the host backend runs one layer and checks it)");
  if (gpu && o.head_dim != 64 && o.head_dim != 128)
    throw stria::invalid_argument("--head-dim", o.head_dim, "must be 64 or 128 (the kernels' head dims)");
}

}  // namespace quickstart
