// SPDX-License-Identifier: Apache-2.0
// plan --svg: one self-contained SVG picture of a plan: per sharding x topology, a heatmap of the
// active entries each rank computes at each ring step (one shared colour scale, so panels compare),
// and the block pattern of one head's selection. Written by hand: no dependency beyond the library.
#pragma once

#include <stria/index/global_selection.hpp>
#include <stria/index/workload.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace plan_svg {

/// One heatmap: the workload of a sharding x topology, with its imbalance degrees for the caption.
struct panel {
  std::string title;
  stria::ring_workload workload;
  stria::imbalance_degrees imbalance;
};

/// Text as SVG character data or an attribute value: the five XML specials escaped.
inline std::string escaped(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

/// A colour for t in [0, 1]: white (no work) through blue to near black (the most work), as "#rrggbb".
inline std::string colour(double t) {
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0);
  constexpr std::array<std::array<double, 3>, 3> stops{{{255, 255, 255}, {49, 130, 189}, {8, 29, 88}}};
  const double x = t * 2.0;
  const int i = x >= 1.0 ? 1 : 0;
  const double f = x - i;
  char text[8];
  std::snprintf(text, sizeof text, "#%02x%02x%02x", static_cast<int>(std::lround(stops[i][0] + f * (stops[i + 1][0] - stops[i][0]))),
                static_cast<int>(std::lround(stops[i][1] + f * (stops[i + 1][1] - stops[i][1]))),
                static_cast<int>(std::lround(stops[i][2] + f * (stops[i + 1][2] - stops[i][2]))));
  return text;
}

/// Density of head h's selection over a cells x cells grid of its causal block map: per cell, the
/// share of its causal entries that are active. A block on a selected diagonal is active whole; on
/// another block, each vertical token in the key block makes one column of 64 entries active. The
/// diagonal blocks' causal triangle is counted as whole blocks (a picture, not a count).
inline std::vector<double> pattern_density(const stria::global_selection& g, stria::index_t h, int cells) {
  const stria::index_t nb = g.num_blocks();
  const stria::head_selection& head = g.heads.at(static_cast<std::size_t>(h));
  std::vector<double> verticals_in_block(static_cast<std::size_t>(nb), 0.0);
  for (const stria::index_t token : head.vertical_tokens) verticals_in_block[static_cast<std::size_t>(token / stria::block_tokens)] += 1.0;
  std::vector<char> slash(static_cast<std::size_t>(2 * nb), 0);  // delta + nb - 1
  for (const stria::index_t delta : head.slash_deltas) slash[static_cast<std::size_t>(delta + nb - 1)] = 1;
  std::vector<double> active(static_cast<std::size_t>(cells) * cells, 0.0), blocks(active.size(), 0.0);
  auto cell_of = [&](stria::index_t block) { return static_cast<int>(static_cast<std::int64_t>(block) * cells / nb); };
  for (stria::index_t q = 0; q < nb; ++q)
    for (stria::index_t k = 0; k <= (g.causal ? q : nb - 1); ++k) {
      const std::size_t at = static_cast<std::size_t>(cell_of(q)) * cells + static_cast<std::size_t>(cell_of(k));
      const double density = slash[static_cast<std::size_t>(q - k + nb - 1)] ? 1.0 : std::min(1.0, verticals_in_block[static_cast<std::size_t>(k)] / stria::block_tokens);
      active[at] += density;
      blocks[at] += 1.0;
    }
  for (std::size_t i = 0; i < active.size(); ++i) active[i] = blocks[i] > 0 ? active[i] / blocks[i] : -1.0;  // -1: no causal block
  return active;
}

/// Writes the picture: the panels' heatmaps (rows ranks, columns ring steps), a colour key, and
/// head `pattern_head`'s block pattern (at most `pattern_cells` cells a side; cells with no active
/// entry are left out, white on white). `heading` names the run.
inline void write(std::ostream& out, const std::string& heading, const std::vector<panel>& panels, const stria::global_selection& g,
                  stria::index_t pattern_head, int pattern_cells = 64) {
  constexpr int margin = 20, heading_height = 24, caption = 34, cell_max = 24, panel_size = 240, key_height = 14;
  std::int64_t most = 1;
  for (const panel& p : panels) most = std::max(most, *std::max_element(p.workload.entries.begin(), p.workload.entries.end()));

  const int columns = 3;  // panels per row
  const int rows_of_panels = static_cast<int>((panels.size() + columns - 1) / columns);
  const int cells = static_cast<int>(std::min<std::int64_t>(pattern_cells, g.num_blocks()));
  const int px = std::max(2, 256 / cells);  // whole pixels per pattern cell
  const int pattern_px = px * cells;
  const int width = 2 * margin + columns * (panel_size + margin);
  const int pattern_top = margin + heading_height + caption + rows_of_panels * (panel_size + caption + margin) + 2 * key_height + margin;
  const int height = pattern_top + caption + pattern_px + margin;

  out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height << "\" viewBox=\"0 0 " << width << ' ' << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"" << width << "\" height=\"" << height << "\" fill=\"white\"/>\n"
      << "<text x=\"" << margin << "\" y=\"" << margin + 12 << "\" font-size=\"14\">" << escaped(heading) << "</text>\n";

  for (std::size_t i = 0; i < panels.size(); ++i) {
    const panel& p = panels[i];
    const stria::index_t ranks = p.workload.world_size, steps = p.workload.num_steps;
    const int cell_w = std::max(1, std::min(cell_max, panel_size / static_cast<int>(std::max<stria::index_t>(steps, 1))));
    const int cell_h = std::max(1, std::min(cell_max, panel_size / static_cast<int>(std::max<stria::index_t>(ranks, 1))));
    const int x0 = margin + static_cast<int>(i % columns) * (panel_size + margin);
    const int y0 = margin + heading_height + caption + static_cast<int>(i / columns) * (panel_size + caption + margin);
    char degrees[96];
    std::snprintf(degrees, sizeof degrees, "imbalance: worker %.3f, step %.3f", p.imbalance.worker_mean, p.imbalance.step_mean);
    out << "<g>\n<text x=\"" << x0 << "\" y=\"" << y0 - 18 << "\">" << escaped(p.title) << "</text>\n"
        << "<text x=\"" << x0 << "\" y=\"" << y0 - 5 << "\" font-size=\"10\">" << degrees << "</text>\n";
    for (stria::index_t r = 0; r < ranks; ++r)
      for (stria::index_t s = 0; s < steps; ++s) {
        const std::int64_t entries = p.workload.at(r, s);
        out << "<rect x=\"" << x0 + s * cell_w << "\" y=\"" << y0 + r * cell_h << "\" width=\"" << cell_w << "\" height=\"" << cell_h << "\" stroke=\"#dddddd\" fill=\""
            << colour(static_cast<double>(entries) / static_cast<double>(most)) << "\"><title>rank " << r << ", step " << s << ": " << entries
            << " active entries</title></rect>\n";
      }
    out << "</g>\n";
  }

  // The colour key, shared by every panel.
  const int key_top = margin + heading_height + caption + rows_of_panels * (panel_size + caption + margin);
  const int key_steps = 20, key_w = 12;
  out << "<g>\n";
  for (int k = 0; k < key_steps; ++k)
    out << "<rect x=\"" << margin + k * key_w << "\" y=\"" << key_top << "\" width=\"" << key_w << "\" height=\"" << key_height << "\" fill=\""
        << colour(static_cast<double>(k) / (key_steps - 1)) << "\"/>\n";
  out << "<text x=\"" << margin + key_steps * key_w + 8 << "\" y=\"" << key_top + 11 << "\">0 to " << most
      << " active entries per rank (down) and ring step (across), all panels</text>\n</g>\n";

  // One head's pattern: query blocks down, key blocks across.
  const std::vector<double> density = pattern_density(g, pattern_head, cells);
  out << "<g>\n<text x=\"" << margin << "\" y=\"" << pattern_top + 2 << "\">head " << pattern_head << ": "
      << g.heads.at(static_cast<std::size_t>(pattern_head)).slash_deltas.size() << " block diagonals, "
      << g.heads.at(static_cast<std::size_t>(pattern_head)).vertical_tokens.size() << " vertical tokens</text>\n"
      << "<text x=\"" << margin << "\" y=\"" << pattern_top + 16 << "\" font-size=\"10\">" << g.num_blocks() << " x " << g.num_blocks()
      << " blocks as " << cells << " x " << cells << " cells, query blocks down, key blocks across; colour: square root of the active share</text>\n";
  char number[32];
  for (int q = 0; q < cells; ++q)
    for (int k = 0; k < cells; ++k) {
      const double d = density[static_cast<std::size_t>(q) * cells + k];
      if (d <= 0) continue;  // no active entry, or above the causal diagonal
      std::snprintf(number, sizeof number, "%.3f", d);
      out << "<rect x=\"" << margin + k * px << "\" y=\"" << pattern_top + caption + q * px << "\" width=\"" << px << "\" height=\"" << px
          << "\" fill=\"" << colour(std::sqrt(d)) << "\"><title>" << number << "</title></rect>\n";  // sqrt: single verticals show
    }
  out << "</g>\n</svg>\n";
}

}  // namespace plan_svg
