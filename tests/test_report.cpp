// The report of `kmla run` on a hand-built RunResult whose rates and percentiles are worked out
// below, so that every number the user sees is pinned without running the engine.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/chart.hpp"
#include "kmla/engine.hpp"

namespace kmla::engine {
namespace {

using nlohmann::json;

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + what.size())) ++n;
  return n;
}

StepRecord step(double start, double dur, int64_t prefill, int64_t decode, int64_t used,
                int64_t cached) {
  StepRecord s;
  s.start_s = start;
  s.duration_s = dur;
  s.prefill_tokens = prefill;
  s.prefill_requests = prefill > 0;
  s.decode_tokens = decode;
  s.decode_requests = int(decode);
  s.blocks_used = used;
  s.blocks_cached = cached;
  s.running = 2;
  return s;
}

RequestRecord request(int64_t id, int32_t prompt, int32_t out, double arrival, double first,
                      double finish) {
  RequestRecord q;
  q.id = id;
  q.prompt_len = prompt;
  q.output_len = out;
  q.arrival_s = arrival;
  q.first_token_s = first;
  q.finish_s = finish;
  q.computed_tokens = prompt + out - 1;
  return q;
}

// Five steps, three requests, two checks:
//   prefill: 300 + 100 tokens in steps of 0.10 + 0.05 s      -> 400 / 0.15 = 2666.67 tok/s
//   decode:  2 + 2 + 2 + 1 tokens in 0.05 + 0.02 + 0.02 + 0.01 s -> 7 / 0.10 = 70 tok/s
//   step ms sorted 10, 20, 20, 50, 100: p50 = 20, p99 at rank 3.96 = 50 + 0.96 * 50 = 98
//   TTFT ms 100, 150, 130 -> p50 130, p99 at rank 1.98 = 130 + 0.98 * 20 = 149.6
//   TPOT ms (0.19 - 0.10) / 3 = 30 and (0.20 - 0.15) / 2 = 25 (request 2 has one output token)
//        -> p50 27.5, p99 at rank 0.99 = 25 + 0.99 * 5 = 29.95
RunResult synthetic() {
  RunResult r;
  r.options.config = MlaConfig::preset("kimi-k3").tp_slice(0, 8);
  r.options.num_layers = 2;
  r.options.cache_format = CacheFormat::bf16;
  r.options.block_size = 16;
  r.options.num_blocks = 64;
  r.model = "kimi-k3";
  r.wall_s = 0.2;
  r.prompt_tokens = 400;
  r.generated_tokens = 8;
  r.prefill_tokens_computed = 400;
  r.decode_tokens_computed = 7;
  r.prefix_hit_tokens = 100;
  r.preemptions = 1;
  r.total_blocks = 64;
  r.peak_blocks = 20;
  r.peak_cache_bytes = 20 * 16 * 1152 * 2;
  r.steps = {step(0.00, 0.10, 300, 0, 19, 0), step(0.10, 0.05, 100, 2, 20, 0),
             step(0.15, 0.02, 0, 2, 20, 0), step(0.17, 0.02, 0, 2, 14, 6),
             step(0.19, 0.01, 0, 1, 8, 12)};
  r.requests = {request(0, 200, 4, 0.00, 0.10, 0.19), request(1, 100, 3, 0.00, 0.15, 0.20),
                request(2, 100, 1, 0.02, 0.15, 0.15)};
  r.requests[1].prefix_hit_tokens = 100;
  r.requests[1].preemptions = 1;
  r.checks = {{0, 203, 2.0, 0.002, 1e-3, 1e-2, true}, {2, 100, 1.5, 0.006, 4e-3, 1e-2, true}};
  r.all_finished = true;
  return r;
}

TEST(Report, JsonSummaryMatchesHandComputedNumbers) {
  const json j = json::parse(to_json(synthetic()));
  const json& s = j.at("summary");
  EXPECT_EQ(s.at("requests"), 3);
  EXPECT_EQ(s.at("finished"), 3);
  EXPECT_EQ(s.at("steps"), 5);
  EXPECT_NEAR(s.at("prefill_tok_s").get<double>(), 400 / 0.15, 1e-9);
  EXPECT_NEAR(s.at("decode_tok_s").get<double>(), 70, 1e-9);
  EXPECT_NEAR(s.at("output_tok_s").get<double>(), 40, 1e-9);
  EXPECT_NEAR(s.at("step_ms").at("p50").get<double>(), 20, 1e-9);
  EXPECT_NEAR(s.at("step_ms").at("p99").get<double>(), 98, 1e-9);
  EXPECT_NEAR(s.at("step_ms").at("max").get<double>(), 100, 1e-9);
  EXPECT_NEAR(s.at("ttft_ms").at("p50").get<double>(), 130, 1e-9);
  EXPECT_NEAR(s.at("ttft_ms").at("p99").get<double>(), 149.6, 1e-9);
  EXPECT_EQ(s.at("tpot_ms").at("count"), 2);
  EXPECT_NEAR(s.at("tpot_ms").at("p50").get<double>(), 27.5, 1e-9);
  EXPECT_NEAR(s.at("tpot_ms").at("p99").get<double>(), 29.95, 1e-9);
  EXPECT_NEAR(s.at("prefix_hit_rate").get<double>(), 0.25, 1e-12);
  EXPECT_NEAR(s.at("peak_block_fraction").get<double>(), 20.0 / 64, 1e-12);
  EXPECT_EQ(s.at("total_cache_bytes"), 64 * 16 * 1152 * 2);
  EXPECT_EQ(s.at("check").at("checked"), 2);
  EXPECT_EQ(s.at("check").at("pass"), true);
  EXPECT_DOUBLE_EQ(s.at("check").at("worst_rel_err").get<double>(), 4e-3);
}

TEST(Report, JsonRoundTripsTheRecords) {
  const RunResult r = synthetic();
  const json j = json::parse(to_json(r));
  EXPECT_EQ(j.at("model"), "kimi-k3");
  EXPECT_EQ(j.at("options").at("config").at("local_heads"), 12);
  EXPECT_EQ(j.at("options").at("cache_format"), "bf16");
  EXPECT_EQ(j.at("totals").at("peak_cache_bytes"), r.peak_cache_bytes);
  ASSERT_EQ(j.at("steps").size(), r.steps.size());
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const json& s = j["steps"][i];
    EXPECT_EQ(s.at("start_s").get<double>(), r.steps[i].start_s);
    EXPECT_EQ(s.at("duration_s").get<double>(), r.steps[i].duration_s);
    EXPECT_EQ(s.at("prefill_tokens"), r.steps[i].prefill_tokens);
    EXPECT_EQ(s.at("decode_tokens"), r.steps[i].decode_tokens);
    EXPECT_EQ(s.at("blocks_cached"), r.steps[i].blocks_cached);
  }
  ASSERT_EQ(j.at("requests").size(), r.requests.size());
  for (size_t i = 0; i < r.requests.size(); ++i) {
    const json& q = j["requests"][i];
    EXPECT_EQ(q.at("id"), r.requests[i].id);
    EXPECT_EQ(q.at("first_token_s").get<double>(), r.requests[i].first_token_s);
    EXPECT_EQ(q.at("finish_s").get<double>(), r.requests[i].finish_s);
    EXPECT_EQ(q.at("prefix_hit_tokens"), r.requests[i].prefix_hit_tokens);
  }
  EXPECT_TRUE(j["requests"][2].at("tpot_s").is_null());  // one output token: no TPOT
  ASSERT_EQ(j.at("checks").size(), 2u);
  EXPECT_EQ(j["checks"][1].at("request_id"), 2);
  EXPECT_EQ(j["checks"][1].at("rel_err").get<double>(), 4e-3);
  EXPECT_EQ(j["checks"][1].at("bound").get<double>(), 1e-2);
  EXPECT_EQ(j["checks"][1].at("pass"), true);
}

TEST(Report, SummaryTextShowsTheNumbers) {
  const std::string t = summary_text(synthetic());
  EXPECT_NE(t.find("12 local heads"), std::string::npos) << t;
  EXPECT_NE(t.find("bf16 cache, block 16"), std::string::npos) << t;
  EXPECT_NE(t.find("prefill 2667 tok/s, decode 70.0 tok/s"), std::string::npos) << t;
  EXPECT_NE(t.find("step latency    p50 20.0 ms, p99 98.0 ms"), std::string::npos) << t;
  EXPECT_NE(t.find("TTFT            p50 130 ms, p99 150 ms"), std::string::npos) << t;
  EXPECT_NE(t.find("TPOT            p50 27.5 ms, p99 "), std::string::npos) << t;  // p99 29.95
  EXPECT_NE(t.find("peak 20 of 64 blocks (31.2%), 720.0 KiB of 2.2 MiB"), std::string::npos) << t;
  EXPECT_NE(t.find("100 of 400 prompt tokens hit (25.0%)"), std::string::npos) << t;
  EXPECT_NE(t.find("preemptions     1"), std::string::npos) << t;
  EXPECT_NE(t.find("check: PASS  2 of 2 requests within bound, worst relative error 4.000e-03"),
            std::string::npos)
      << t;
}

TEST(Report, LongTimesInSecondsWithOneUnitPerPair) {
  RunResult r = synthetic();
  r.requests[0].first_token_s = 12.0;  // TTFT ms 12000, 150, 130: p99 at rank 1.98 = 11763
  r.requests[0].finish_s = 12.09;
  const std::string t = summary_text(r);
  EXPECT_NE(t.find("TTFT            p50 0.150 s, p99 11.8 s"), std::string::npos) << t;
  EXPECT_NE(html_report(r).find("0.150 s / 11.8 s"), std::string::npos);
}

TEST(Report, FailedOrNanCheckFails) {
  RunResult r = synthetic();
  r.checks[0].rel_err = 0.5;
  r.checks[0].pass = false;
  std::string t = summary_text(r);
  EXPECT_NE(t.find("check: FAIL  1 of 2 requests within bound, worst relative error 5.000e-01"),
            std::string::npos)
      << t;
  r.checks[0].rel_err = std::nan("");
  t = summary_text(r);
  EXPECT_NE(t.find("check: FAIL"), std::string::npos);
  EXPECT_NE(t.find("worst relative error nan"), std::string::npos) << t;
  const json j = json::parse(to_json(r));
  EXPECT_EQ(j["summary"]["check"]["pass"], false);
  EXPECT_TRUE(j["checks"][0]["rel_err"].is_null());
}

TEST(Report, HtmlIsSelfContainedWithOneSvgPerChart) {
  const std::string h = html_report(synthetic());
  EXPECT_EQ(h.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(h.find("http://"), std::string::npos);
  EXPECT_EQ(h.find("https://"), std::string::npos);
  EXPECT_EQ(h.find("<script"), std::string::npos);
  EXPECT_EQ(h.find("<link"), std::string::npos);
  // Throughput, cache occupancy, requests; step latency, TTFT and TPOT histograms.
  EXPECT_EQ(count(h, "<svg"), 6u);
  EXPECT_EQ(count(h, "</svg>"), 6u);
  EXPECT_NE(h.find("Throughput over time"), std::string::npos);
  EXPECT_NE(h.find("Cache occupancy"), std::string::npos);
  EXPECT_NE(h.find("Step latency"), std::string::npos);
  EXPECT_NE(h.find("Time to first token"), std::string::npos);
  EXPECT_NE(h.find("<polyline"), std::string::npos);
  EXPECT_NE(h.find("<rect"), std::string::npos);
  EXPECT_EQ(h.find("no data"), std::string::npos);
  EXPECT_NE(h.find("4.000e-03"), std::string::npos);  // the check table
}

TEST(Report, HtmlEscapesText) {
  RunResult r = synthetic();
  r.model = "m<&>\"x";
  const std::string h = html_report(r);
  EXPECT_EQ(h.find("m<&>"), std::string::npos);
  EXPECT_NE(h.find("kmla run: m&lt;&amp;&gt;&quot;x"), std::string::npos);
}

TEST(Report, EmptyResultStillRenders) {
  RunResult r;
  r.model = "empty";
  EXPECT_NO_THROW(json::parse(to_json(r)));
  const std::string h = html_report(r);
  EXPECT_EQ(count(h, "<svg"), 6u);
  EXPECT_NE(h.find("no data"), std::string::npos);
  const std::string t = summary_text(r);
  EXPECT_NE(t.find("check: none"), std::string::npos) << t;
  EXPECT_NE(t.find("p50 -, p99 -"), std::string::npos) << t;
}

TEST(Report, ProgressLineHasTheRequestedWidth) {
  StepRecord last;
  last.duration_s = 0.5;
  last.prefill_tokens = 600;
  last.decode_tokens = 17;
  Progress p{12, 24, 40, &last};
  for (int w : {1, 5, 12, 20, 40, 60, 80, 120, 200}) {
    const std::string line = progress_line(p, 3.2, w);
    EXPECT_EQ(line.size(), size_t(w)) << "'" << line << "'";
    EXPECT_EQ(line.find('\n'), std::string::npos);
  }
  const std::string line = progress_line(p, 3.21, 80);
  EXPECT_EQ(line.front(), '[');
  EXPECT_NE(line.find("] 12/24 requests  step 40  1234 tok/s  3.2 s"), std::string::npos) << line;
  // Half done: half of the bar's cells are '=' and the head '>' follows them.
  const size_t bar = line.find(']') - 1;
  EXPECT_EQ(count(line, "="), bar / 2) << line;
  EXPECT_EQ(line[1 + bar / 2], '>');
  // The bar keeps its length as the counts grow (padded to the total's digits).
  EXPECT_EQ(progress_line(Progress{3, 24, 40, &last}, 3.2, 80).find(']'), line.find(']'));
  p.finished = 24;
  const std::string done = progress_line(p, 3.2, 80);
  EXPECT_EQ(count(done, "="), done.find(']') - 1) << done;
  EXPECT_EQ(progress_line(Progress{0, 24, 0, nullptr}, 0, 60).find("- tok/s") != std::string::npos,
            true);
  EXPECT_EQ(progress_line(p, 3.2, 0), "");
}

TEST(Chart, NiceTicksAndLabels) {
  EXPECT_EQ(chart::nice_ticks(0, 97), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  const auto unit = chart::nice_ticks(0, 0);  // all zeros: the axis becomes [0, 1]
  EXPECT_EQ(unit.front(), 0);
  EXPECT_NEAR(unit.back(), 1, 1e-12);
  const auto t = chart::nice_ticks(12.3, 12.3);  // widened around the value
  EXPECT_LE(t.front(), 12.3);
  EXPECT_GE(t.back(), 12.3);
  EXPECT_GE(t.size(), 2u);
  EXPECT_EQ(chart::tick_label(12000, 2000, 20000), "12k");
  EXPECT_EQ(chart::tick_label(2500000, 500000, 3000000), "2.5M");
  EXPECT_EQ(chart::tick_label(5000, 5000, 30000), "5k");  // the axis decides the suffix
  EXPECT_EQ(chart::tick_label(5000, 1000, 5000), "5000");
  EXPECT_EQ(chart::tick_label(0.4, 0.2, 1), "0.4");
  EXPECT_EQ(chart::tick_label(-1e-17, 0.2, 1), "0.0");
  EXPECT_EQ(chart::tick_label(40, 20, 100), "40");
  EXPECT_EQ(chart::escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&#39;");
}

TEST(Chart, EmptyAndDegenerateInputs) {
  EXPECT_NE(chart::line_chart({"t", "x", "y"}, {}).find("no data"), std::string::npos);
  EXPECT_NE(chart::histogram({"t", "x", "y"}, {}, 10, "red", "ms").find("no data"),
            std::string::npos);
  // One point, all-equal values, NaNs: still a chart with axes.
  const std::string one = chart::line_chart({"t", "x", "y"}, {{"s", "red", {1.0}, {5.0}}});
  EXPECT_NE(one.find("<circle"), std::string::npos);
  const std::string same =
      chart::histogram({"t", "x", "y"}, {3, 3, 3, std::nan("")}, 10, "red", "ms");
  EXPECT_NE(same.find("n = 3"), std::string::npos);
  EXPECT_NE(same.find(": 3</title>"), std::string::npos) << same;
}

}  // namespace
}  // namespace kmla::engine
