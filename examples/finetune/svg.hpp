// SPDX-License-Identifier: MIT OR Apache-2.0
// A loss curve as a self-contained SVG (training and validation loss against the step).
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace finetune {

using Series = std::vector<std::pair<int, double>>;

inline void write_loss_svg(const std::string& path, const Series& train, const Series& valid) {
  const double W = 720, H = 400, L = 60, R = 20, T = 30, Bm = 45;
  double xmax = 1, ymin = INFINITY, ymax = -INFINITY;
  for (const Series* s : {&train, &valid})
    for (auto [x, y] : *s) {
      xmax = std::max(xmax, static_cast<double>(x));
      ymin = std::min(ymin, y);
      ymax = std::max(ymax, y);
    }
  if (!std::isfinite(ymin)) ymin = 0, ymax = 1;
  if (ymax - ymin < 1e-9) ymax = ymin + 1;
  auto px = [&](double x) { return L + (W - L - R) * x / xmax; };
  auto py = [&](double y) { return T + (H - T - Bm) * (ymax - y) / (ymax - ymin); };
  auto line = [&](const Series& s, const char* color, const char* label, double ly) {
    std::string d;
    for (auto [x, y] : s) d += (d.empty() ? "M" : " L") + std::to_string(px(x)) + "," + std::to_string(py(y));
    std::string out = "<path d=\"" + d + "\" fill=\"none\" stroke=\"" + color + "\" stroke-width=\"2\"/>\n";
    for (auto [x, y] : s)
      if (s.size() < 60) out += "<circle cx=\"" + std::to_string(px(x)) + "\" cy=\"" + std::to_string(py(y)) + "\" r=\"2.5\" fill=\"" + color + "\"/>\n";
    out += "<text x=\"" + std::to_string(W - R - 150) + "\" y=\"" + std::to_string(ly) + "\" fill=\"" + color + "\" font-size=\"13\">" + label + "</text>\n";
    return out;
  };
  std::ofstream f(path);
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" font-family=\"sans-serif\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<line x1=\"" << L << "\" y1=\"" << H - Bm << "\" x2=\"" << W - R << "\" y2=\"" << H - Bm << "\" stroke=\"black\"/>\n"
    << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - Bm << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double y = ymin + (ymax - ymin) * i / 4;
    f << "<text x=\"" << L - 8 << "\" y=\"" << py(y) + 4 << "\" font-size=\"11\" text-anchor=\"end\">" << std::round(y * 1000) / 1000
      << "</text>\n";
    const double x = xmax * i / 4;
    f << "<text x=\"" << px(x) << "\" y=\"" << H - Bm + 16 << "\" font-size=\"11\" text-anchor=\"middle\">" << static_cast<int>(x)
      << "</text>\n";
  }
  f << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 8 << "\" font-size=\"12\" text-anchor=\"middle\">step</text>\n"
    << "<text x=\"" << L << "\" y=\"" << T - 10 << "\" font-size=\"12\">loss</text>\n"
    << line(train, "#1f77b4", "training loss", T + 10) << line(valid, "#d62728", "validation loss", T + 28) << "</svg>\n";
}

}  // namespace finetune
