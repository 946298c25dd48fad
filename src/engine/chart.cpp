#include "engine/chart.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace kmla::engine::chart {

namespace {

// Plot-area margins in SVG units: the title and the legend sit above the plot, the y tick
// labels (up to ~7 characters at 11 px) to its left, the x tick labels and x label below.
constexpr double kLeft = 62, kRight = 18, kTop = 54, kBottom = 46;
// An average glyph advance of the 11-12 px sans-serif text, to lay out legends and labels.
constexpr double kCharWidth = 6.6;
// Above this many points a series is drawn without dots.
constexpr size_t kMaxDots = 60;

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

struct Axes {
  double x0, x1, y0, y1;  // data ranges
  double left, top, pw, ph;
  double sx(double x) const { return left + (x - x0) / (x1 - x0) * pw; }
  double sy(double y) const { return top + ph - (y - y0) / (y1 - y0) * ph; }
};

Axes make_axes(const Frame& f, double x0, double x1, double y0, double y1) {
  return {x0, x1, y0, y1, kLeft, kTop, f.width - kLeft - kRight, f.height - kTop - kBottom};
}

std::string open_svg(const Frame& f) {
  // Inline SVG in HTML needs no xmlns (and the page then holds no URL at all).
  std::string s = "<svg class=\"chart\" viewBox=\"0 0 " + std::to_string(f.width) + " " +
                  std::to_string(f.height) + "\" role=\"img\" " + "aria-label=\"" +
                  escape(f.title) + "\">\n";
  s += "<text class=\"title\" x=\"" + num(f.width / 2.0) + "\" y=\"20\" text-anchor=\"middle\">" +
       escape(f.title) + "</text>\n";
  return s;
}

// Grid lines, both axes with ticks and tick labels, and the axis labels.
std::string axes_svg(const Frame& f, const Axes& a, const std::vector<double>& xticks,
                     const std::vector<double>& yticks) {
  std::string s;
  const double bottom = a.top + a.ph, right = a.left + a.pw;
  auto largest = [](const std::vector<double>& t) {
    return std::max(std::abs(t.front()), std::abs(t.back()));
  };
  const double ystep = yticks.size() > 1 ? yticks[1] - yticks[0] : 1;
  for (double t : yticks) {
    const double y = a.sy(t);
    s += "<line class=\"grid\" x1=\"" + num(a.left) + "\" y1=\"" + num(y) + "\" x2=\"" +
         num(right) + "\" y2=\"" + num(y) + "\"/>\n";
    s += "<text class=\"tick\" x=\"" + num(a.left - 6) + "\" y=\"" + num(y) +
         "\" dy=\"0.32em\" text-anchor=\"end\">" + tick_label(t, ystep, largest(yticks)) +
         "</text>\n";
  }
  const double xstep = xticks.size() > 1 ? xticks[1] - xticks[0] : 1;
  for (double t : xticks) {
    const double x = a.sx(t);
    s += "<line class=\"axis\" x1=\"" + num(x) + "\" y1=\"" + num(bottom) + "\" x2=\"" + num(x) +
         "\" y2=\"" + num(bottom + 4) + "\"/>\n";
    s += "<text class=\"tick\" x=\"" + num(x) + "\" y=\"" + num(bottom + 17) +
         "\" text-anchor=\"middle\">" + tick_label(t, xstep, largest(xticks)) + "</text>\n";
  }
  s += "<line class=\"axis\" x1=\"" + num(a.left) + "\" y1=\"" + num(bottom) + "\" x2=\"" +
       num(right) + "\" y2=\"" + num(bottom) + "\"/>\n";
  s += "<line class=\"axis\" x1=\"" + num(a.left) + "\" y1=\"" + num(a.top) + "\" x2=\"" +
       num(a.left) + "\" y2=\"" + num(bottom) + "\"/>\n";
  s += "<text class=\"label\" x=\"" + num(a.left + a.pw / 2) + "\" y=\"" + num(f.height - 8.0) +
       "\" text-anchor=\"middle\">" + escape(f.x_label) + "</text>\n";
  s += "<text class=\"label\" transform=\"translate(14 " + num(a.top + a.ph / 2) +
       ") rotate(-90)\" text-anchor=\"middle\">" + escape(f.y_label) + "</text>\n";
  return s;
}

std::string no_data(const Frame& f) {
  return "<text class=\"label\" x=\"" + num(f.width / 2.0) + "\" y=\"" + num(f.height / 2.0) +
         "\" text-anchor=\"middle\">no data</text>\n</svg>\n";
}

// Ticks inside [lo, hi] only (the x axis spans exactly the data).
std::vector<double> inner_ticks(double lo, double hi, int target) {
  std::vector<double> all = nice_ticks(lo, hi, target), in;
  const double eps = (hi - lo) * 1e-9;
  for (double t : all)
    if (t >= lo - eps && t <= hi + eps) in.push_back(t);
  if (in.size() < 2) return {lo, hi};
  return in;
}

}  // namespace

std::string escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    if (lo == 0)
      hi = 1;
    else
      lo -= pad, hi += pad;
  }
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double r = raw / mag;
  const double step = (r <= 1 ? 1 : r <= 2 ? 2 : r <= 5 ? 5 : 10) * mag;
  const double first = std::floor(lo / step + 1e-9) * step;
  const double last = std::ceil(hi / step - 1e-9) * step;
  std::vector<double> ticks;
  for (int k = 0; k < 200; ++k) {
    const double t = first + k * step;
    if (t > last + step * 1e-6) break;
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  }
  if (ticks.size() < 2) ticks.push_back(first + step);
  return ticks;
}

std::string tick_label(double v, double step, double axis_max) {
  const char* suffix = "";
  const double big = std::max(std::abs(axis_max), std::abs(step));
  if (big >= 1e6 && step >= 1e5) {
    v /= 1e6, step /= 1e6, suffix = "M";
  } else if (big >= 1e4 && step >= 100) {
    v /= 1e3, step /= 1e3, suffix = "k";
  }
  const int decimals = step >= 1 ? 0 : std::min(6, int(std::ceil(-std::log10(step) - 1e-9)));
  if (std::abs(v) < std::abs(step) * 1e-9) v = 0;
  char b[48];
  std::snprintf(b, sizeof b, "%.*f%s", decimals, v, suffix);
  return b;
}

std::string line_chart(const Frame& f, const std::vector<Series>& series) {
  std::string s = open_svg(f);
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const Series& se : series)
    for (size_t i = 0; i < std::min(se.x.size(), se.y.size()); ++i) {
      if (!std::isfinite(se.x[i]) || !std::isfinite(se.y[i])) continue;
      x0 = std::min(x0, se.x[i]), x1 = std::max(x1, se.x[i]);
      y0 = std::min(y0, se.y[i]), y1 = std::max(y1, se.y[i]);
    }
  if (!(x1 >= x0)) return s + no_data(f);
  if (f.x_min != kAuto && f.x_min <= x0) x0 = f.x_min;
  if (y0 >= 0) y0 = 0;
  if (!(x1 > x0)) x1 = x0 + 1;
  const int xtarget = std::max(2, int((f.width - kLeft - kRight) / 80));
  const std::vector<double> yt = nice_ticks(y0, y1, 5);
  const std::vector<double> xt = inner_ticks(x0, x1, xtarget);
  const Axes a = make_axes(f, x0, x1, yt.front(), yt.back());
  s += axes_svg(f, a, xt, yt);

  // Legend: one row above the plot, left-aligned with it.
  double lx = a.left;
  for (const Series& se : series) {
    s += "<line x1=\"" + num(lx) + "\" y1=\"40\" x2=\"" + num(lx + 18) + "\" y2=\"40\" stroke=\"" +
         escape(se.color) + "\" stroke-width=\"2.5\"" +
         (se.dashed ? " stroke-dasharray=\"5 3\"" : "") + "/>\n";
    s += "<text class=\"legend\" x=\"" + num(lx + 23) + "\" y=\"40\" dy=\"0.32em\">" +
         escape(se.name) + "</text>\n";
    lx += 23 + se.name.size() * kCharWidth + 16;
  }

  for (const Series& se : series) {
    std::string pts;
    size_t n = 0;
    double first_x = 0, last_x = 0;
    for (size_t i = 0; i < std::min(se.x.size(), se.y.size()); ++i) {
      if (!std::isfinite(se.x[i]) || !std::isfinite(se.y[i])) continue;
      if (n == 0) first_x = a.sx(se.x[i]);
      last_x = a.sx(se.x[i]);
      pts += num(a.sx(se.x[i])) + "," + num(a.sy(se.y[i])) + " ";
      ++n;
    }
    if (n == 0) continue;
    const std::string color = escape(se.color);
    if (se.area && n > 1) {
      const std::string base = num(a.sy(std::max(0.0, a.y0)));
      s += "<polygon points=\"" + num(first_x) + "," + base + " " + pts + num(last_x) + "," + base +
           "\" fill=\"" + color + "\" fill-opacity=\"0.15\" stroke=\"none\"/>\n";
    }
    s += "<polyline points=\"" + pts + "\" fill=\"none\" stroke=\"" + color +
         "\" stroke-width=\"1.8\" stroke-linejoin=\"round\"" +
         (se.dashed ? " stroke-dasharray=\"5 3\"" : "") + "><title>" + escape(se.name) +
         "</title></polyline>\n";
    if (n <= kMaxDots && !se.dashed)
      for (size_t i = 0; i < std::min(se.x.size(), se.y.size()); ++i) {
        if (!std::isfinite(se.x[i]) || !std::isfinite(se.y[i])) continue;
        char tip[96];
        std::snprintf(tip, sizeof tip, "%.4g, %.4g", se.x[i], se.y[i]);
        s += "<circle cx=\"" + num(a.sx(se.x[i])) + "\" cy=\"" + num(a.sy(se.y[i])) +
             "\" r=\"2.5\" fill=\"" + color + "\"><title>" + escape(se.name) + ": " + tip +
             "</title></circle>\n";
      }
  }
  return s + "</svg>\n";
}

std::string histogram(const Frame& f, const std::vector<double>& values, int bins,
                      const std::string& color, const std::string& unit,
                      const std::vector<Marker>& markers) {
  std::string s = open_svg(f);
  std::vector<double> v;
  for (double x : values)
    if (std::isfinite(x)) v.push_back(x);
  if (v.empty()) return s + no_data(f);
  const auto [mn, mx] = std::minmax_element(v.begin(), v.end());
  const int xtarget = std::max(2, int((f.width - kLeft - kRight) / 80));
  const std::vector<double> xt = nice_ticks(*mn, *mx, xtarget);
  // Bins align with the ticks: a whole number of bins per tick interval.
  const int intervals = int(xt.size()) - 1;
  const int per = std::max(1, int(std::lround(double(std::max(1, bins)) / intervals)));
  const int nb = per * intervals;
  const double lo = xt.front(), hi = xt.back(), width = (hi - lo) / nb;
  std::vector<int64_t> count(nb, 0);
  for (double x : v) count[std::clamp(int((x - lo) / width), 0, nb - 1)]++;
  const int64_t top = std::max<int64_t>(1, *std::max_element(count.begin(), count.end()));
  // Headroom above the tallest bar keeps the marker labels clear of the bars.
  std::vector<double> yt = nice_ticks(0, double(top) * 1.15 + 0.5, 5);
  if (yt[1] - yt[0] < 1) {  // counts: integer ticks only
    yt.clear();
    for (int64_t k = 0; k <= top; ++k) yt.push_back(double(k));
  }
  const Axes a = make_axes(f, lo, hi, yt.front(), yt.back());
  s += axes_svg(f, a, xt, yt);

  char b[160];
  std::snprintf(b, sizeof b, "n = %zu", v.size());
  s += "<text class=\"legend\" x=\"" + num(a.left + a.pw) + "\" y=\"40\" dy=\"0.32em\" " +
       "text-anchor=\"end\">" + b + "</text>\n";
  const double bw = a.pw / nb;
  for (int i = 0; i < nb; ++i) {
    if (count[i] == 0) continue;
    const double y = a.sy(double(count[i]));
    std::snprintf(b, sizeof b, "%.4g to %.4g %s: %lld", lo + i * width, lo + (i + 1) * width,
                  unit.c_str(), (long long)count[i]);
    s += "<rect x=\"" + num(a.left + i * bw + 0.5) + "\" y=\"" + num(y) + "\" width=\"" +
         num(std::max(1.0, bw - 1)) + "\" height=\"" + num(a.top + a.ph - y) + "\" fill=\"" +
         escape(color) + "\"><title>" + escape(b) + "</title></rect>\n";
  }
  // Marker labels are staggered downwards so that close markers do not overwrite each other.
  for (size_t i = 0; i < markers.size(); ++i) {
    const Marker& m = markers[i];
    if (!std::isfinite(m.x)) continue;
    const double x = a.sx(std::clamp(m.x, lo, hi));
    const double ty = a.top + 10 + 13.0 * i;
    const bool flip = x + 4 + m.label.size() * kCharWidth > a.left + a.pw;
    s += "<line class=\"marker\" x1=\"" + num(x) + "\" y1=\"" + num(a.top) + "\" x2=\"" + num(x) +
         "\" y2=\"" + num(a.top + a.ph) + "\"/>\n";
    s += "<text class=\"marker-label\" x=\"" + num(flip ? x - 4 : x + 4) + "\" y=\"" + num(ty) +
         "\"" + (flip ? " text-anchor=\"end\"" : "") + ">" + escape(m.label) + "</text>\n";
  }
  return s + "</svg>\n";
}

}  // namespace kmla::engine::chart
