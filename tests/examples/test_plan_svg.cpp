// SPDX-License-Identifier: Apache-2.0
// plan --svg's picture (examples/plan/plan_svg.hpp): well-formed XML, one cell per rank and step of
// every panel on a shared colour scale, one head's pattern, and text escaped.
#include <doctest/doctest.h>

#include <stria/host/synthetic_vs.hpp>
#include <stria/sharding/striped.hpp>
#include <stria/sharding/zigzag.hpp>
#include <stria/topology/flat_ring.hpp>

#include <algorithm>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

#include "../../examples/plan/plan_svg.hpp"

using namespace stria;

namespace {

/// Whether `xml` is well formed in the subset the writer uses: one prolog, elements properly
/// nested, attributes quoted, character data free of raw '<' and of '&' outside the five entities.
/// Returns the number of elements, or -1 where it is not.
long count_elements_if_well_formed(const std::string& xml) {
  std::size_t i = 0;
  if (xml.rfind("<?xml", 0) == 0) i = xml.find("?>") + 2;
  std::vector<std::string> open;
  long elements = 0;
  bool root_done = false;
  while (i < xml.size()) {
    if (xml[i] != '<') {
      if (xml[i] == '&') {
        const std::size_t end = xml.find(';', i);
        if (end == std::string::npos) return -1;
        const std::string entity = xml.substr(i, end - i + 1);
        if (entity != "&amp;" && entity != "&lt;" && entity != "&gt;" && entity != "&quot;" && entity != "&apos;") return -1;
        i = end + 1;
        continue;
      }
      if (root_done && xml[i] != '\n' && xml[i] != ' ') return -1;  // text after the root
      ++i;
      continue;
    }
    const std::size_t end = xml.find('>', i);
    if (end == std::string::npos) return -1;
    std::string tag = xml.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.empty()) return -1;
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return -1;
      open.pop_back();
      if (open.empty()) root_done = true;
      continue;
    }
    if (root_done) return -1;  // a second root
    const bool empty = tag.back() == '/';
    if (empty) tag.pop_back();
    const std::string name = tag.substr(0, tag.find(' '));
    // Attributes: name="value" pairs, values without '<' or a raw '"'.
    for (std::size_t a = name.size(); a < tag.size();) {
      if (tag[a] == ' ') {
        ++a;
        continue;
      }
      const std::size_t eq = tag.find('=', a);
      if (eq == std::string::npos || eq + 1 >= tag.size() || tag[eq + 1] != '"') return -1;
      const std::size_t close = tag.find('"', eq + 2);
      if (close == std::string::npos || tag.substr(eq + 2, close - eq - 2).find('<') != std::string::npos) return -1;
      a = close + 1;
    }
    ++elements;
    if (!empty) open.push_back(name);
    else if (open.empty()) root_done = true;
  }
  return open.empty() && root_done ? elements : -1;
}

long occurrences(const std::string& text, const std::string& what) {
  long n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("the XML checker itself refuses what is not well formed") {
  CHECK(count_elements_if_well_formed("<svg><g><rect x=\"1\"/></g></svg>") == 3);
  CHECK(count_elements_if_well_formed("<svg><g></svg></g>") == -1);
  CHECK(count_elements_if_well_formed("<svg><text>a < b</text></svg>") == -1);
  CHECK(count_elements_if_well_formed("<svg><text>a & b</text></svg>") == -1);
  CHECK(count_elements_if_well_formed("<svg x=1></svg>") == -1);
  CHECK(count_elements_if_well_formed("<svg></svg><svg></svg>") == -1);
  CHECK(count_elements_if_well_formed("<svg>") == -1);
}

TEST_CASE("plan --svg draws every rank and step of every panel on one scale, and one head's pattern") {
  host::synthetic_vs_options s;
  s.seq_len = 4096;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.head_dim = 64;
  s.density = 0.1;
  const global_selection g = host::plant_vs_selection(s);
  const index_t world = 4;
  const ring_workload striped = count_ring_workload(g, sharding::striped<64>{}, topology::flat_ring(world));
  const ring_workload zigzag = count_ring_workload(g, sharding::zigzag{}, topology::flat_ring(world));
  const std::vector<plan_svg::panel> panels{{"striped, flat_ring", striped, measure_imbalance(striped)},
                                            {"zigzag & co <flat>", zigzag, measure_imbalance(zigzag)}};
  std::ostringstream out;
  plan_svg::write(out, "a \"test\" plan", panels, g, 1, 32);
  const std::string svg = out.str();

  REQUIRE(count_elements_if_well_formed(svg) > 0);
  CHECK(svg.find("zigzag &amp; co &lt;flat&gt;") != std::string::npos);
  CHECK(svg.find("a &quot;test&quot; plan") != std::string::npos);
  // One titled cell per (rank, step) of each panel, and one per cell of the 32 x 32 pattern (4096
  // tokens = 64 blocks, two a side per cell) that holds any active entry.
  CHECK(occurrences(svg, " active entries</title></rect>") == 2 * world * world);
  const std::vector<double> cells = plan_svg::pattern_density(g, 1, 32);
  const long drawn = std::count_if(cells.begin(), cells.end(), [](double d) { return d > 0; });
  CHECK(drawn >= 32);  // at least the diagonal
  CHECK(std::count(cells.begin(), cells.end(), -1.0) == 32 * 31 / 2);  // above the causal diagonal
  CHECK(occurrences(svg, "\"><title>0.") + occurrences(svg, "\"><title>1.") == drawn);
  // The shared scale: the busiest (rank, step) of both panels is the darkest colour, and the key says its count.
  std::int64_t most = 0;
  for (const ring_workload* w : {&striped, &zigzag})
    for (const std::int64_t e : w->entries) most = std::max(most, e);
  CHECK(svg.find("0 to " + std::to_string(most) + " active entries") != std::string::npos);
  CHECK(svg.find(plan_svg::colour(1.0)) != std::string::npos);
  CHECK(plan_svg::colour(0.0) == "#ffffff");
  CHECK(plan_svg::colour(2.0) == plan_svg::colour(1.0));  // clamped
  // Head 1's pattern at one block per cell: the diagonal is block diagonal 0, always selected, so
  // fully active; above it no causal block (-1).
  const std::vector<double> blocks = plan_svg::pattern_density(g, 1, 64);
  for (int b = 0; b < 64; ++b) CHECK(blocks[static_cast<std::size_t>(b) * 64 + b] == 1.0);
  CHECK(blocks[1] == -1.0);
}
