// What the user sees of `kmla run`: the text summary, the JSON result, the HTML report and the
// progress line. Every number the three outputs share comes from one place, compute_stats().
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/chart.hpp"
#include "kmla/engine.hpp"

namespace kmla::engine {

namespace {

using nlohmann::json;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strf(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// p50 / p99 interpolate linearly between the two nearest ranks of the sorted samples
// (position q * (n - 1)), so p50 of an even count is the mean of the middle two.
double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return kNaN;
  const double pos = q * double(sorted.size() - 1);
  const size_t lo = size_t(pos);
  if (lo + 1 >= sorted.size()) return sorted.back();
  return sorted[lo] + (pos - double(lo)) * (sorted[lo + 1] - sorted[lo]);
}

struct Dist {
  size_t n = 0;
  double p50 = kNaN, p99 = kNaN, mean = kNaN, max = kNaN;
};

Dist distribution(std::vector<double> v) {
  Dist d;
  d.n = v.size();
  if (v.empty()) return d;
  std::sort(v.begin(), v.end());
  d.p50 = percentile(v, 0.50);
  d.p99 = percentile(v, 0.99);
  double sum = 0;
  for (double x : v) sum += x;
  d.mean = sum / double(v.size());
  d.max = v.back();
  return d;
}

double ttft_s(const RequestRecord& q) {
  return q.first_token_s >= 0 ? q.first_token_s - q.arrival_s : kNaN;
}

// Time per output token after the first; undefined for one-token outputs and unfinished requests.
double tpot_s(const RequestRecord& q) {
  if (q.first_token_s < 0 || q.finish_s < 0 || q.output_len < 2) return kNaN;
  return (q.finish_s - q.first_token_s) / double(q.output_len - 1);
}

struct Stats {
  int requests = 0, finished = 0;
  double step_time_s = 0;                         // sum of step durations
  int64_t prefill_tokens = 0, decode_tokens = 0;  // summed over the steps
  double prefill_time_s = 0, decode_time_s = 0;   // steps that ran any prefill / decode tokens
  double prefill_tok_s = 0, decode_tok_s = 0;     // tokens over those times
  double output_tok_s = 0;                        // generated tokens over wall time
  Dist step_ms, ttft_ms, tpot_ms, e2e_ms;
  int64_t total_cache_bytes = 0;
  double peak_block_fraction = 0;
  double prefix_hit_rate = 0;
  int checked = 0, check_failed = 0;
  double worst_rel_err = kNaN;
  double worst_bound = kNaN;  // the bound of the request with the worst error
  bool check_pass = true;     // no failed check (vacuously true without checks)
};

Stats compute_stats(const RunResult& r) {
  Stats s;
  s.requests = int(r.requests.size());
  std::vector<double> step_ms, ttft, tpot, e2e;
  for (const StepRecord& st : r.steps) {
    s.step_time_s += st.duration_s;
    step_ms.push_back(st.duration_s * 1e3);
    if (st.prefill_tokens > 0)
      s.prefill_tokens += st.prefill_tokens, s.prefill_time_s += st.duration_s;
    if (st.decode_tokens > 0) s.decode_tokens += st.decode_tokens, s.decode_time_s += st.duration_s;
  }
  if (s.prefill_time_s > 0) s.prefill_tok_s = double(s.prefill_tokens) / s.prefill_time_s;
  if (s.decode_time_s > 0) s.decode_tok_s = double(s.decode_tokens) / s.decode_time_s;
  if (r.wall_s > 0) s.output_tok_s = double(r.generated_tokens) / r.wall_s;
  for (const RequestRecord& q : r.requests) {
    s.finished += q.finish_s >= 0;
    if (std::isfinite(ttft_s(q))) ttft.push_back(ttft_s(q) * 1e3);
    if (std::isfinite(tpot_s(q))) tpot.push_back(tpot_s(q) * 1e3);
    if (q.finish_s >= 0) e2e.push_back((q.finish_s - q.arrival_s) * 1e3);
  }
  s.step_ms = distribution(step_ms);
  s.ttft_ms = distribution(ttft);
  s.tpot_ms = distribution(tpot);
  s.e2e_ms = distribution(e2e);
  s.total_cache_bytes = int64_t(cache_entry_bytes(r.options.cache_format)) * r.options.block_size *
                        r.total_blocks * r.options.num_layers;
  if (r.total_blocks > 0) s.peak_block_fraction = double(r.peak_blocks) / double(r.total_blocks);
  if (r.prompt_tokens > 0)
    s.prefix_hit_rate = double(r.prefix_hit_tokens) / double(r.prompt_tokens);
  bool nan_seen = false;
  for (const CheckResult& c : r.checks) {
    ++s.checked;
    s.check_failed += !c.pass;
    if (std::isnan(c.rel_err)) {
      nan_seen = true;
      s.worst_rel_err = c.rel_err, s.worst_bound = c.bound;
    } else if (!nan_seen && !(c.rel_err <= s.worst_rel_err)) {
      s.worst_rel_err = c.rel_err, s.worst_bound = c.bound;
    }
  }
  s.check_pass = s.check_failed == 0;
  return s;
}

// ---- formatting ----------------------------------------------------------------------
// Milliseconds with three significant digits, or seconds (asked for, or from ten seconds on).
std::string ms(double v, bool seconds = false) {
  if (!std::isfinite(v)) return "-";
  if (seconds || v >= 10000)
    return strf(v >= 10000 ? "%.1f s" : v >= 1000 ? "%.2f s" : "%.3f s", v / 1e3);
  return strf(v >= 100 ? "%.0f ms" : v >= 10 ? "%.1f ms" : "%.2f ms", v);
}

// "p50, p99" style pairs share one unit: seconds when the larger reaches ten seconds.
std::string ms_pair(double a, double b, const char* sep) {
  const bool seconds = std::max(std::isfinite(a) ? a : 0, std::isfinite(b) ? b : 0) >= 10000;
  return ms(a, seconds) + sep + ms(b, seconds);
}

std::string rate(double tok_s) { return strf(tok_s >= 100 ? "%.0f tok/s" : "%.1f tok/s", tok_s); }

std::string bytes(int64_t b) {
  const double v = double(b);
  if (v >= 1024.0 * 1024 * 1024) return strf("%.2f GiB", v / (1024.0 * 1024 * 1024));
  if (v >= 1024.0 * 1024) return strf("%.1f MiB", v / (1024.0 * 1024));
  if (v >= 1024.0) return strf("%.1f KiB", v / 1024.0);
  return strf("%lld B", (long long)b);
}

std::string percent(double f) { return strf("%.1f%%", 100 * f); }

std::string shape(const RunResult& r) {
  const EngineOptions& o = r.options;
  const MlaConfig& c = o.config;
  std::string s =
      strf("%d layer%s x %d local heads (rank %d of TP %d), hidden %d, %s cache, block %d",
           o.num_layers, o.num_layers == 1 ? "" : "s", c.local_heads(), c.tp_rank, c.tp_size,
           c.hidden_size, cache_format_name(o.cache_format), o.block_size);
  if (o.spec_tokens > 0) s += strf(", %d speculative tokens", o.spec_tokens);
  if (!o.prefix_caching) s += ", prefix caching off";
  return s;
}

// What the numbers mean, shown under the text summary and on the page.
struct Definition {
  const char* term;
  const char* text;
};
const Definition kDefinitions[] = {
    {"prefill/decode tok/s",
     "tokens computed / summed duration of the steps that computed any;\n"
     "a step doing both counts in both"},
    {"TTFT", "first token - arrival"},
    {"TPOT", "(finish - first token) / (output_len - 1), over requests with output_len > 1"},
    {"p50/p99", "linear interpolation between the nearest ranks"},
    {"rel err",
     "max |out - ref| / max |ref| over a request's final hidden states, ref = fp64 oracle"},
};

json dist_json(const Dist& d) {
  auto n = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
  return {
      {"count", d.n}, {"p50", n(d.p50)}, {"p99", n(d.p99)}, {"mean", n(d.mean)}, {"max", n(d.max)}};
}

json finite_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

}  // namespace

// ---- text ----------------------------------------------------------------------------
std::string summary_text(const RunResult& r) {
  const Stats s = compute_stats(r);
  std::string t;
  t += "kmla run: " + r.model + ", " + shape(r) + "\n";
  t += strf("requests        %d (%d finished%s)\n", s.requests, s.finished,
            r.all_finished ? "" : ", NOT ALL FINISHED");
  t += strf("tokens          prompt %lld, generated %lld\n", (long long)r.prompt_tokens,
            (long long)r.generated_tokens);
  t += strf("computed        prefill %lld, decode %lld (recomputation included)\n",
            (long long)r.prefill_tokens_computed, (long long)r.decode_tokens_computed);
  t += strf("steps           %zu, %.3f s of step time, %.3f s wall\n", r.steps.size(),
            s.step_time_s, r.wall_s);
  t += "throughput      prefill " + rate(s.prefill_tok_s) + ", decode " + rate(s.decode_tok_s) +
       ", output " + rate(s.output_tok_s) + " (generated / wall)\n";
  t += "step latency    p50 " + ms_pair(s.step_ms.p50, s.step_ms.p99, ", p99 ") + "\n";
  t += "TTFT            p50 " + ms_pair(s.ttft_ms.p50, s.ttft_ms.p99, ", p99 ") + "\n";
  t += "TPOT            p50 " + ms_pair(s.tpot_ms.p50, s.tpot_ms.p99, ", p99 ") + "\n";
  t += strf("cache           peak %lld of %lld blocks (%s), ", (long long)r.peak_blocks,
            (long long)r.total_blocks, percent(s.peak_block_fraction).c_str()) +
       bytes(r.peak_cache_bytes) + " of " + bytes(s.total_cache_bytes) + " over all layers\n";
  if (r.options.prefix_caching)
    t += strf("prefix cache    %lld of %lld prompt tokens hit (%s)\n",
              (long long)r.prefix_hit_tokens, (long long)r.prompt_tokens,
              percent(s.prefix_hit_rate).c_str());
  else
    t += "prefix cache    off\n";
  t += strf("preemptions     %d\n", r.preemptions);
  t += "definitions:\n";
  for (const Definition& d : kDefinitions) {
    std::string text = d.text;
    for (size_t p = text.find('\n'); p != std::string::npos; p = text.find('\n', p + 1))
      text.insert(p + 1, 24, ' ');
    t += strf("  %-22s%s\n", d.term, text.c_str());
  }

  if (r.checks.empty()) {
    t += "check: none (no request was recomputed by the oracle)\n";
    return t;
  }
  t += "correctness vs the fp64 oracle:\n";
  t += strf("  %10s %8s %11s %11s %11s  %s\n", "request", "tokens", "max|ref|", "rel err", "bound",
            "result");
  for (const CheckResult& c : r.checks)
    t += strf("  %10lld %8lld %11.3e %11.3e %11.3e  %s\n", (long long)c.request_id,
              (long long)c.tokens, c.max_ref, c.rel_err, c.bound, c.pass ? "ok" : "FAIL");
  t += strf("check: %s  %d of %d requests within bound, worst relative error %.3e (bound %.3e)\n",
            s.check_pass ? "PASS" : "FAIL", s.checked - s.check_failed, s.checked, s.worst_rel_err,
            s.worst_bound);
  return t;
}

// ---- JSON ----------------------------------------------------------------------------
// The keys, all stable (times in seconds unless the key ends in _ms; undefined values are null):
//   model, all_finished, wall_s
//   options:  config{name, hidden_size, num_heads, local_heads, tp_rank, tp_size, q_lora_rank,
//             use_rope, use_output_gate, non_causal_multi_token_decode}, num_layers, cache_format,
//             block_size, num_blocks, token_budget, max_num_seqs, prefix_caching, spec_tokens,
//             spec_accept_rate, workspace_tokens, seed, num_threads, check_requests
//   totals:   the RunResult counters as they are (prompt_tokens, generated_tokens,
//             prefill_tokens_computed, decode_tokens_computed, prefix_hit_tokens, preemptions,
//             total_blocks, peak_blocks, peak_cache_bytes)
//   summary:  requests, finished, steps, step_time_s, prefill_tok_s, decode_tok_s, output_tok_s,
//             step_ms / ttft_ms / tpot_ms / e2e_ms {count, p50, p99, mean, max},
//             total_cache_bytes, peak_block_fraction, prefix_hit_rate,
//             check{checked, failed, pass, worst_rel_err, worst_bound}
//   steps[]:    the StepRecord fields under their C++ names
//   requests[]: the RequestRecord fields under their C++ names (-1 = never), plus ttft_s, tpot_s
//   checks[]:   the CheckResult fields under their C++ names
std::string to_json(const RunResult& r) {
  const Stats s = compute_stats(r);
  const EngineOptions& o = r.options;
  const MlaConfig& c = o.config;
  json j;
  j["model"] = r.model;
  j["all_finished"] = r.all_finished;
  j["wall_s"] = r.wall_s;
  j["options"] = {{"config",
                   {{"name", c.name},
                    {"hidden_size", c.hidden_size},
                    {"num_heads", c.num_heads},
                    {"local_heads", c.local_heads()},
                    {"tp_rank", c.tp_rank},
                    {"tp_size", c.tp_size},
                    {"q_lora_rank", c.q_lora_rank ? json(*c.q_lora_rank) : json(nullptr)},
                    {"use_rope", c.use_rope},
                    {"use_output_gate", c.use_output_gate},
                    {"non_causal_multi_token_decode", c.non_causal_multi_token_decode}}},
                  {"num_layers", o.num_layers},
                  {"cache_format", cache_format_name(o.cache_format)},
                  {"block_size", o.block_size},
                  {"num_blocks", o.num_blocks},
                  {"token_budget", o.token_budget},
                  {"max_num_seqs", o.max_num_seqs},
                  {"prefix_caching", o.prefix_caching},
                  {"spec_tokens", o.spec_tokens},
                  {"spec_accept_rate", o.spec_accept_rate},
                  {"workspace_tokens", o.workspace_tokens},
                  {"seed", o.seed},
                  {"num_threads", o.num_threads},
                  {"check_requests", o.check_requests}};
  j["totals"] = {{"prompt_tokens", r.prompt_tokens},
                 {"generated_tokens", r.generated_tokens},
                 {"prefill_tokens_computed", r.prefill_tokens_computed},
                 {"decode_tokens_computed", r.decode_tokens_computed},
                 {"prefix_hit_tokens", r.prefix_hit_tokens},
                 {"preemptions", r.preemptions},
                 {"total_blocks", r.total_blocks},
                 {"peak_blocks", r.peak_blocks},
                 {"peak_cache_bytes", r.peak_cache_bytes}};
  j["summary"] = {{"requests", s.requests},
                  {"finished", s.finished},
                  {"steps", r.steps.size()},
                  {"step_time_s", s.step_time_s},
                  {"prefill_tok_s", s.prefill_tok_s},
                  {"decode_tok_s", s.decode_tok_s},
                  {"output_tok_s", s.output_tok_s},
                  {"step_ms", dist_json(s.step_ms)},
                  {"ttft_ms", dist_json(s.ttft_ms)},
                  {"tpot_ms", dist_json(s.tpot_ms)},
                  {"e2e_ms", dist_json(s.e2e_ms)},
                  {"total_cache_bytes", s.total_cache_bytes},
                  {"peak_block_fraction", s.peak_block_fraction},
                  {"prefix_hit_rate", s.prefix_hit_rate},
                  {"check",
                   {{"checked", s.checked},
                    {"failed", s.check_failed},
                    {"pass", s.check_pass},
                    {"worst_rel_err", finite_or_null(s.worst_rel_err)},
                    {"worst_bound", finite_or_null(s.worst_bound)}}}};
  json steps = json::array();
  for (const StepRecord& st : r.steps)
    steps.push_back({{"start_s", st.start_s},
                     {"duration_s", st.duration_s},
                     {"decode_requests", st.decode_requests},
                     {"decode_tokens", st.decode_tokens},
                     {"prefill_requests", st.prefill_requests},
                     {"prefill_tokens", st.prefill_tokens},
                     {"running", st.running},
                     {"waiting", st.waiting},
                     {"blocks_used", st.blocks_used},
                     {"blocks_cached", st.blocks_cached},
                     {"preempted", st.preempted}});
  j["steps"] = std::move(steps);
  json requests = json::array();
  for (const RequestRecord& q : r.requests)
    requests.push_back({{"id", q.id},
                        {"prompt_len", q.prompt_len},
                        {"output_len", q.output_len},
                        {"arrival_s", q.arrival_s},
                        {"first_token_s", q.first_token_s},
                        {"finish_s", q.finish_s},
                        {"preemptions", q.preemptions},
                        {"prefix_hit_tokens", q.prefix_hit_tokens},
                        {"computed_tokens", q.computed_tokens},
                        {"ttft_s", finite_or_null(ttft_s(q))},
                        {"tpot_s", finite_or_null(tpot_s(q))}});
  j["requests"] = std::move(requests);
  json checks = json::array();
  for (const CheckResult& ch : r.checks)
    checks.push_back({{"request_id", ch.request_id},
                      {"tokens", ch.tokens},
                      {"max_ref", finite_or_null(ch.max_ref)},
                      {"max_err", finite_or_null(ch.max_err)},
                      {"rel_err", finite_or_null(ch.rel_err)},
                      {"bound", ch.bound},
                      {"pass", ch.pass}});
  j["checks"] = std::move(checks);
  return j.dump(2) + "\n";
}

// ---- HTML ----------------------------------------------------------------------------
namespace {

using chart::escape;

constexpr const char* kCss = R"(
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2430;
  max-width:1160px;margin:24px auto;padding:0 16px;background:#f7f8fa}
h1{font-size:22px;margin:0 0 2px}
h2{font-size:16px;margin:26px 0 10px}
.sub{color:#5b6573;margin:0 0 14px}
.verdict{display:inline-block;padding:2px 10px;border-radius:12px;font-size:14px;margin-left:10px;
  vertical-align:middle}
.verdict.pass{background:#e3f4e8;color:#17803d}.verdict.fail{background:#fde8e6;color:#c0392b}
.summary{display:grid;grid-template-columns:repeat(auto-fit,minmax(320px,1fr));gap:14px;align-items:start}
.summary table{width:100%;font-size:13px}
.summary th{white-space:normal}
table{border-collapse:collapse;background:#fff;border:1px solid #e3e7ee;border-radius:6px}
th,td{padding:4px 10px;text-align:left;border-bottom:1px solid #edf0f4}
th{font-weight:600;color:#3c4654;background:#f0f2f6;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
caption{text-align:left;font-weight:600;padding:0 0 4px}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(440px,1fr));gap:14px}
figure{margin:0;background:#fff;border:1px solid #e3e7ee;border-radius:6px;padding:8px 8px 6px}
figcaption{font-size:12px;color:#5b6573;margin:2px 4px 0}
svg.chart{display:block;width:100%;height:auto}
svg .title{font-size:14px;font-weight:600;fill:#1d2430}
svg .tick{font-size:11px;fill:#5b6573}
svg .label,svg .legend{font-size:12px;fill:#1d2430}
svg .grid{stroke:#e8ebf0}svg .axis{stroke:#8a94a3}
svg .marker{stroke:#c0392b;stroke-dasharray:4 3}
svg .marker-label{font-size:11px;fill:#c0392b;paint-order:stroke;stroke:#fff;stroke-width:3px}
.ok{color:#17803d;font-weight:600}.bad{color:#c0392b;font-weight:600}
ul.defs{color:#5b6573;font-size:13px;padding-left:18px}
details{margin-top:16px}summary{cursor:pointer;font-weight:600}
)";

const char* kBlue = "#2f6fdb";
const char* kOrange = "#e8772e";
const char* kGreen = "#2a9d5b";
const char* kGray = "#8a94a3";
const char* kPurple = "#7b4fc9";

std::string row(const std::string& key, const std::string& value) {
  return "<tr><th>" + escape(key) + "</th><td class=\"n\">" + escape(value) + "</td></tr>\n";
}

std::string table(const std::string& caption, const std::string& rows) {
  return "<table><caption>" + escape(caption) + "</caption>\n" + rows + "</table>\n";
}

std::string figure(const std::string& svg, const std::string& caption) {
  return "<figure>\n" + svg + "<figcaption>" + escape(caption) + "</figcaption>\n</figure>\n";
}

// Step throughput, prefill and decode: tokens / duration per step, or per time window when there
// are more steps than a chart can show (tokens in the window / step time in the window).
std::string throughput_chart(const RunResult& r, std::string& caption) {
  constexpr size_t kMaxPoints = 80;
  chart::Series pre{"prefill", kBlue}, dec{"decode", kOrange};
  const auto& steps = r.steps;
  if (steps.size() <= kMaxPoints) {
    for (const StepRecord& st : steps) {
      if (st.duration_s <= 0) continue;
      const double t = st.start_s + st.duration_s;
      pre.x.push_back(t), pre.y.push_back(st.prefill_tokens / st.duration_s);
      dec.x.push_back(t), dec.y.push_back(st.decode_tokens / st.duration_s);
    }
    caption = "Each point is one step: the tokens it computed over its duration.";
  } else {
    const double t0 = steps.front().start_s;
    const double t1 = steps.back().start_s + steps.back().duration_s;
    const double window = std::max(1e-9, (t1 - t0) / kMaxPoints);
    std::vector<double> ptok(kMaxPoints, 0), dtok(kMaxPoints, 0), dur(kMaxPoints, 0);
    for (const StepRecord& st : steps) {
      const size_t b = std::min(kMaxPoints - 1, size_t((st.start_s + st.duration_s - t0) / window));
      ptok[b] += double(st.prefill_tokens), dtok[b] += double(st.decode_tokens);
      dur[b] += st.duration_s;
    }
    for (size_t b = 0; b < kMaxPoints; ++b) {
      if (dur[b] <= 0) continue;
      const double t = t0 + (b + 1) * window;
      pre.x.push_back(t), pre.y.push_back(ptok[b] / dur[b]);
      dec.x.push_back(t), dec.y.push_back(dtok[b] / dur[b]);
    }
    caption = strf(
        "%zu steps in %.3g s windows: the tokens computed in a window over the step time "
        "in it.",
        steps.size(), window);
  }
  return chart::line_chart({"Throughput over time", "time (s)", "tokens / s of step time", 0.0},
                           {pre, dec});
}

std::string cache_chart(const RunResult& r) {
  chart::Series used{"used", kBlue}, cached{"used + cached", kGreen}, total{"total", kGray};
  used.area = true;
  total.dashed = true;
  for (const StepRecord& st : r.steps) {
    const double t = st.start_s + st.duration_s;
    used.x.push_back(t), used.y.push_back(double(st.blocks_used));
    cached.x.push_back(t), cached.y.push_back(double(st.blocks_used + st.blocks_cached));
  }
  if (!r.steps.empty()) {
    total.x = {0.0, used.x.back()};
    total.y = {double(r.total_blocks), double(r.total_blocks)};
  }
  std::vector<chart::Series> series{used, cached, total};
  if (!r.options.prefix_caching) series = {used, total};
  return chart::line_chart({"Cache occupancy", "time (s)", "blocks (per layer)", 0.0}, series);
}

std::string batch_chart(const RunResult& r) {
  chart::Series running{"running", kPurple}, waiting{"waiting", kOrange};
  for (const StepRecord& st : r.steps) {
    const double t = st.start_s + st.duration_s;
    running.x.push_back(t), running.y.push_back(st.running);
    waiting.x.push_back(t), waiting.y.push_back(st.waiting);
  }
  return chart::line_chart({"Requests in the engine", "time (s)", "requests", 0.0},
                           {running, waiting});
}

// A histogram of times given in ms, drawn in seconds when the slowest reaches ten seconds,
// with the p50 and p99 marked.
std::string latency_histogram(const std::string& title, const std::string& what,
                              std::vector<double> values_ms, int bins, const char* color,
                              const Dist& d) {
  const bool seconds = d.n > 0 && d.max >= 10000;
  const double k = seconds ? 1e-3 : 1;
  for (double& v : values_ms) v *= k;
  std::vector<chart::Marker> markers;
  if (d.n > 0)
    markers = {{"p50 " + ms(d.p50, seconds), d.p50 * k}, {"p99 " + ms(d.p99, seconds), d.p99 * k}};
  const std::string unit = seconds ? "s" : "ms";
  return chart::histogram({title, unit, what}, values_ms, bins, color, unit, markers);
}

}  // namespace

std::string html_report(const RunResult& r) {
  const Stats s = compute_stats(r);
  const bool ok = s.check_pass && r.all_finished;
  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  h += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  h += "<title>kmla run: " + escape(r.model) + "</title>\n<style>" + kCss +
       "</style>\n</head>\n<body>\n";
  h += "<h1>kmla run: " + escape(r.model) + "<span class=\"verdict " + (ok ? "pass" : "fail") +
       "\">" +
       (s.checked == 0   ? (r.all_finished ? "finished, not checked" : "NOT ALL FINISHED")
        : !s.check_pass  ? "check FAIL"
        : r.all_finished ? "check PASS"
                         : "check PASS, NOT ALL FINISHED") +
       "</span></h1>\n";
  h += "<p class=\"sub\">" + escape(shape(r)) + "</p>\n";

  // Summary tables.
  std::string work, speed, cache;
  work += row("requests", strf("%d (%d finished)", s.requests, s.finished));
  work += row("prompt tokens", std::to_string(r.prompt_tokens));
  work += row("generated tokens", std::to_string(r.generated_tokens));
  work += row("prefill tokens computed", std::to_string(r.prefill_tokens_computed));
  work += row("decode tokens computed", std::to_string(r.decode_tokens_computed));
  work += row("steps", std::to_string(r.steps.size()));
  work += row("step time / wall", strf("%.3f s / %.3f s", s.step_time_s, r.wall_s));
  speed += row("prefill", rate(s.prefill_tok_s));
  speed += row("decode", rate(s.decode_tok_s));
  speed += row("output (generated / wall)", rate(s.output_tok_s));
  speed += row("step latency p50 / p99", ms_pair(s.step_ms.p50, s.step_ms.p99, " / "));
  speed += row("TTFT p50 / p99", ms_pair(s.ttft_ms.p50, s.ttft_ms.p99, " / "));
  speed += row("TPOT p50 / p99", ms_pair(s.tpot_ms.p50, s.tpot_ms.p99, " / "));
  speed += row("end-to-end p50 / p99", ms_pair(s.e2e_ms.p50, s.e2e_ms.p99, " / "));
  cache +=
      row("peak blocks", strf("%lld of %lld (%s)", (long long)r.peak_blocks,
                              (long long)r.total_blocks, percent(s.peak_block_fraction).c_str()));
  cache += row("peak cache bytes", bytes(r.peak_cache_bytes) + " of " + bytes(s.total_cache_bytes));
  cache += row("prefix cache hits", r.options.prefix_caching
                                        ? strf("%lld tokens (%s)", (long long)r.prefix_hit_tokens,
                                               percent(s.prefix_hit_rate).c_str())
                                        : std::string("off"));
  cache += row("preemptions", std::to_string(r.preemptions));
  cache += row("token budget / max seqs",
               strf("%lld / %d", (long long)r.options.token_budget, r.options.max_num_seqs));
  cache += row("speculative tokens", std::to_string(r.options.spec_tokens));
  h += "<div class=\"summary\">\n" + table("Workload", work) + table("Speed", speed) +
       table("Cache", cache) + "</div>\n";

  // Charts.
  std::string tcap;
  const std::string tput = throughput_chart(r, tcap);
  std::vector<double> step_ms, ttft, tpot;
  for (const StepRecord& st : r.steps) step_ms.push_back(st.duration_s * 1e3);
  for (const RequestRecord& q : r.requests) {
    ttft.push_back(ttft_s(q) * 1e3);
    tpot.push_back(tpot_s(q) * 1e3);
  }
  h += "<h2>Charts</h2>\n<div class=\"charts\">\n";
  h += figure(tput, tcap);
  h += figure(
      cache_chart(r),
      strf("Blocks held after each step, of %lld per layer. Cached blocks are free but keep a "
           "prefix for reuse.",
           (long long)r.total_blocks));
  h += figure(batch_chart(r),
              "Requests holding cache blocks (running) and queued (waiting) after each step.");
  h += figure(latency_histogram("Step latency", "steps", step_ms, 24, kBlue, s.step_ms),
              "Duration of each engine step (all layers, all requests in the step).");
  h += figure(latency_histogram("Time to first token", "requests", ttft, 20, kGreen, s.ttft_ms),
              "First generated token - arrival, per request.");
  h += figure(latency_histogram("Time per output token", "requests", tpot, 20, kPurple, s.tpot_ms),
              "(finish - first token) / (output_len - 1), per request with output_len > 1.");
  h += "</div>\n";

  // Correctness.
  h += "<h2>Correctness against the fp64 oracle</h2>\n";
  if (r.checks.empty()) {
    h += "<p>No request was recomputed by the oracle (check_requests = " +
         std::to_string(r.options.check_requests) + ").</p>\n";
  } else {
    h += "<table>\n<tr><th>request</th><th>tokens</th><th>max |ref|</th><th>max |err|</th>"
         "<th>rel err</th><th>bound</th><th>result</th></tr>\n";
    for (const CheckResult& c : r.checks)
      h += strf(
          "<tr><td class=\"n\">%lld</td><td class=\"n\">%lld</td><td class=\"n\">%.3e</td>"
          "<td class=\"n\">%.3e</td><td class=\"n\">%.3e</td><td class=\"n\">%.3e</td>"
          "<td class=\"%s\">%s</td></tr>\n",
          (long long)c.request_id, (long long)c.tokens, c.max_ref, c.max_err, c.rel_err, c.bound,
          c.pass ? "ok" : "bad", c.pass ? "ok" : "FAIL");
    h += "</table>\n";
    h += strf(
        "<p class=\"%s\">%s: %d of %d requests within bound, worst relative error %.3e "
        "(bound %.3e)</p>\n",
        s.check_pass ? "ok" : "bad", s.check_pass ? "PASS" : "FAIL", s.checked - s.check_failed,
        s.checked, s.worst_rel_err, s.worst_bound);
  }
  h += "<h2>Definitions</h2>\n<ul class=\"defs\">\n";
  for (const Definition& d : kDefinitions)
    h += "<li><b>" + escape(d.term) + "</b>: " + escape(d.text) + "</li>\n";
  h += "</ul>\n";

  // Per-request detail, folded away (a <details> element needs no script).
  h += strf("<details>\n<summary>Requests (%zu)</summary>\n", r.requests.size());
  h +=
      "<table>\n<tr><th>id</th><th>prompt</th><th>output</th><th>arrival s</th><th>TTFT</th>"
      "<th>TPOT</th><th>finish s</th><th>prefix hit</th><th>computed</th><th>preempted</th></tr>\n";
  for (const RequestRecord& q : r.requests)
    h += strf(
        "<tr><td class=\"n\">%lld</td><td class=\"n\">%d</td><td class=\"n\">%d</td>"
        "<td class=\"n\">%.3f</td><td class=\"n\">%s</td><td class=\"n\">%s</td>"
        "<td class=\"n\">%.3f</td><td class=\"n\">%lld</td><td class=\"n\">%lld</td>"
        "<td class=\"n\">%d</td></tr>\n",
        (long long)q.id, q.prompt_len, q.output_len, q.arrival_s, ms(ttft_s(q) * 1e3).c_str(),
        ms(tpot_s(q) * 1e3).c_str(), q.finish_s, (long long)q.prefix_hit_tokens,
        (long long)q.computed_tokens, q.preemptions);
  h += "</table>\n</details>\n</body>\n</html>\n";
  return h;
}

// ---- progress ------------------------------------------------------------------------
std::string progress_line(const Progress& p, double elapsed_s, int width) {
  if (width <= 0) return {};
  // The counts and the rate are padded so that the bar keeps its length while they grow.
  std::string rate_text = "   - tok/s";
  if (p.last && p.last->duration_s > 0)
    rate_text = strf("%4.0f tok/s",
                     double(p.last->prefill_tokens + p.last->decode_tokens) / p.last->duration_s);
  const int digits = int(std::to_string(p.total).size());
  const std::string count = strf(" %*d/%d", digits, p.finished, p.total);
  // The longest tail that leaves a bar of at least 10 cells; shorter ones for narrow terminals.
  const std::string tails[] = {
      strf("%s requests  step %lld  %s  %.1f s", count.c_str(), (long long)p.step,
           rate_text.c_str(), elapsed_s),
      strf("%s  step %lld  %.1f s", count.c_str(), (long long)p.step, elapsed_s), count};
  std::string tail;
  int bar = 0;
  for (const std::string& t : tails) {
    tail = t;
    bar = width - int(t.size()) - 2;
    if (bar >= 10) break;
  }
  std::string line;
  if (bar >= 1) {
    const double frac = p.total > 0 ? std::clamp(double(p.finished) / p.total, 0.0, 1.0) : 0.0;
    const int full = int(frac * bar);
    line = "[" + std::string(full, '=');
    if (full < bar) line += ">" + std::string(bar - full - 1, ' ');
    line += "]";
  }
  line += tail;
  line.resize(width, ' ');  // exactly `width`: a redraw with '\r' overwrites the previous line
  return line;
}

}  // namespace kmla::engine
