// SPDX-License-Identifier: Apache-2.0
// Shared by the benchmarks' command lines: a comma-separated list of integers ("8,16,32").
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "stria/core/config.hpp"

namespace stria::bench {

inline std::vector<index_t> parse_list(const std::string& text) {
  std::vector<index_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(static_cast<index_t>(std::stoll(item)));
  return out;
}

}  // namespace stria::bench
