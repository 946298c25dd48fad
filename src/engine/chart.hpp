// Small SVG charts for the HTML report: a line chart and a histogram, each one self-contained
// <svg> element with a title, axes with tick labels, axis labels and a legend. No scripts, no
// external resources; tooltips are plain SVG <title> elements.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kmla::engine::chart {

// &, <, >, " and ' as entities: safe in text and in attribute values.
std::string escape(std::string_view s);

// "Nice" axis ticks (1, 2 or 5 times a power of ten) covering [lo, hi], about `target` of them.
// The first tick is <= lo and the last >= hi; hi <= lo is widened first.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);
// A tick label: as few decimals as the tick step needs; "k" / "M" when the axis reaches 1e4 / 1e6
// (decided by the axis' largest |tick|, so one axis never mixes "5000" and "10k").
std::string tick_label(double v, double step, double axis_max);

inline constexpr double kAuto = -1e300;

struct Frame {
  std::string title;
  std::string x_label;
  std::string y_label;
  double x_min = kAuto;  // where the x axis starts (e.g. 0 for time); kAuto: the smallest x
  int width = 560;       // SVG user units (the page scales the chart to its column)
  int height = 300;
};

struct Series {
  std::string name;   // legend text
  std::string color;  // any CSS colour
  std::vector<double> x{}, y{};
  bool dashed = false;
  bool area = false;  // fill the area under the line, lightly
};

struct Marker {  // a labelled vertical line (e.g. p50, p99)
  std::string label;
  double x = 0;
};

// Series share the axes; y starts at zero when every value is >= 0. An empty chart says so.
std::string line_chart(const Frame& f, const std::vector<Series>& series);

// Counts of `values` in `bins` equal bins over a nice range; `unit` goes into the tooltips.
std::string histogram(const Frame& f, const std::vector<double>& values, int bins,
                      const std::string& color, const std::string& unit,
                      const std::vector<Marker>& markers = {});

}  // namespace kmla::engine::chart
