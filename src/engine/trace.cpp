// Request traces: the built-in default workload and JSON-lines files.
//
// Lengths are log-normal (most requests short, a long tail), the usual shape of chat and
// agent traffic, with the median set so the mean before clamping equals the requested mean.
// A fraction of the requests starts with one of a few shared "system prompts", which is what
// the prefix cache is for.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/random.hpp"
#include "kmla/engine.hpp"
#include "kmla/error.hpp"

namespace kmla::engine {

namespace {

// Spread of ln(length): 0.8 for prompts, 0.6 for outputs (a ratio p90/p50 of about 2.8 and 2.2).
constexpr double kPromptSigma = 0.8;
constexpr double kOutputSigma = 0.6;

uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int log_normal_len(Random& g, double mean, double sigma, int lo, int hi) {
  const double mu = std::log(mean) - 0.5 * sigma * sigma;
  const double x = std::exp(mu + sigma * g.normal());
  return int(std::clamp<double>(std::round(x), lo, hi));
}

void append_tokens(Random& g, int n, int vocab, std::vector<int32_t>& out) {
  for (int i = 0; i < n; ++i) out.push_back(int32_t(g.below(uint64_t(vocab))));
}

void sort_by_arrival(Trace& t) {
  std::stable_sort(t.requests.begin(), t.requests.end(),
                   [](const TraceRequest& a, const TraceRequest& b) { return a.arrival_s < b.arrival_s; });
}

}  // namespace

Trace default_trace(const TraceOptions& o) {
  KMLA_CHECK(o.num_requests >= 1, "num_requests must be >= 1, got ", o.num_requests);
  KMLA_CHECK(o.arrival_rate >= 0 && std::isfinite(o.arrival_rate), "arrival_rate must be >= 0, got ",
             o.arrival_rate);
  KMLA_CHECK(o.prompt_len_min >= 1 && o.prompt_len_min <= o.prompt_len_max,
             "prompt lengths need 1 <= min <= max, got [", o.prompt_len_min, ", ", o.prompt_len_max, "]");
  KMLA_CHECK(o.output_len_min >= 1 && o.output_len_min <= o.output_len_max,
             "output lengths need 1 <= min <= max, got [", o.output_len_min, ", ", o.output_len_max, "]");
  KMLA_CHECK(o.prompt_len_mean >= 1 && o.output_len_mean >= 1, "mean lengths must be >= 1, got ",
             o.prompt_len_mean, " and ", o.output_len_mean);
  KMLA_CHECK(o.shared_prefix_fraction >= 0 && o.shared_prefix_fraction <= 1,
             "shared_prefix_fraction must be in [0, 1], got ", o.shared_prefix_fraction);
  KMLA_CHECK(o.num_prefix_groups >= 0 && o.prefix_len >= 0, "prefix groups and length must be >= 0, got ",
             o.num_prefix_groups, " and ", o.prefix_len);
  KMLA_CHECK(o.vocab_size >= 2, "vocab_size must be >= 2, got ", o.vocab_size);

  Random g(o.seed);
  const bool sharing = o.shared_prefix_fraction > 0 && o.num_prefix_groups > 0 && o.prefix_len > 0;
  std::vector<std::vector<int32_t>> prefixes(sharing ? size_t(o.num_prefix_groups) : 0);
  for (auto& p : prefixes) append_tokens(g, o.prefix_len, o.vocab_size, p);

  Trace t;
  double clock = 0;
  for (int i = 0; i < o.num_requests; ++i) {
    TraceRequest r;
    r.id = i;
    if (o.arrival_rate > 0) clock += -std::log(g.uniform()) / o.arrival_rate;  // Poisson arrivals
    r.arrival_s = clock;
    int len = log_normal_len(g, o.prompt_len_mean, kPromptSigma, o.prompt_len_min, o.prompt_len_max);
    r.output_len = log_normal_len(g, o.output_len_mean, kOutputSigma, o.output_len_min, o.output_len_max);
    if (sharing && g.uniform() < o.shared_prefix_fraction) {
      // A shared system prompt, then at least prompt_len_min tokens of the request's own
      // (as far as prompt_len_max allows; the last token is always the request's own).
      const auto& p = prefixes[g.below(uint64_t(o.num_prefix_groups))];
      len = std::min(o.prompt_len_max, std::max(len, o.prefix_len + o.prompt_len_min));
      const int shared = std::min(o.prefix_len, len - 1);
      r.prompt.assign(p.begin(), p.begin() + shared);
    }
    append_tokens(g, len - int(r.prompt.size()), o.vocab_size, r.prompt);
    t.requests.push_back(std::move(r));
  }
  sort_by_arrival(t);
  return t;
}

Trace load_trace_jsonl(const std::string& path, int vocab_size, uint64_t seed) {
  using nlohmann::json;
  KMLA_CHECK(vocab_size >= 2, "vocab_size must be >= 2, got ", vocab_size);
  std::ifstream in(path);
  KMLA_CHECK(in.good(), "cannot open trace file '", path, "'");

  // Each group's tokens are one pseudo-random stream, extended as longer prefixes ask.
  std::map<std::string, std::pair<Random, std::vector<int32_t>>> groups;
  auto group_tokens = [&](const std::string& key, int n) -> const std::vector<int32_t>& {
    auto it = groups.find(key);
    if (it == groups.end()) {
      uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a: the same on every platform
      for (unsigned char ch : key) h = (h ^ ch) * 0x100000001b3ull;
      it = groups.emplace(key, std::make_pair(Random(mix64(seed ^ mix64(h + 0x67726f7570ull))),
                                              std::vector<int32_t>{})).first;
    }
    auto& [g, tokens] = it->second;
    if (int(tokens.size()) < n) append_tokens(g, n - int(tokens.size()), vocab_size, tokens);
    return tokens;
  };

  static const std::unordered_set<std::string> kKeys = {"id", "prompt", "prompt_len", "output_len",
                                                       "arrival_s", "prefix_group", "prefix_len"};
  Trace t;
  std::unordered_set<int64_t> ids;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no) + ": ";
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      KMLA_CHECK(false, where, "not valid JSON (", e.what(), ")");
    }
    KMLA_CHECK(j.is_object(), where, "each line must be a JSON object");
    for (const auto& [key, value] : j.items())
      KMLA_CHECK(kKeys.count(key), where, "unknown key \"", key,
                 "\" (known: id, prompt, prompt_len, output_len, arrival_s, prefix_group, prefix_len)");
    auto integer = [&](const char* key, int64_t lo, int64_t hi, int64_t fallback) {
      if (!j.contains(key)) return fallback;
      const json& v = j[key];
      KMLA_CHECK(v.is_number_integer(), where, "\"", key, "\" must be an integer");
      const int64_t x = v.get<int64_t>();
      KMLA_CHECK(x >= lo && x <= hi, where, "\"", key, "\" = ", x, " is outside [", lo, ", ", hi, "]");
      return x;
    };

    TraceRequest r;
    const int64_t index = int64_t(t.requests.size());
    r.id = integer("id", 0, INT64_MAX, index);
    KMLA_CHECK(ids.insert(r.id).second, where, "request id ", r.id, " appears twice");
    r.output_len = int32_t(integer("output_len", 1, INT32_MAX / 2, 16));
    if (j.contains("arrival_s")) {
      KMLA_CHECK(j["arrival_s"].is_number(), where, "\"arrival_s\" must be a number");
      r.arrival_s = j["arrival_s"].get<double>();
      KMLA_CHECK(std::isfinite(r.arrival_s) && r.arrival_s >= 0, where, "\"arrival_s\" = ", r.arrival_s,
                 " must be finite and >= 0");
    }
    const bool has_prompt = j.contains("prompt"), has_len = j.contains("prompt_len");
    KMLA_CHECK(has_prompt != has_len, where, "give exactly one of \"prompt\" and \"prompt_len\"");
    if (has_prompt) {
      KMLA_CHECK(!j.contains("prefix_group") && !j.contains("prefix_len"), where,
                 "\"prefix_group\" goes with \"prompt_len\", not with explicit \"prompt\" tokens");
      const json& p = j["prompt"];
      KMLA_CHECK(p.is_array() && !p.empty(), where, "\"prompt\" must be a non-empty array of token ids");
      for (const json& v : p) {
        KMLA_CHECK(v.is_number_integer(), where, "\"prompt\" holds a non-integer token");
        const int64_t id = v.get<int64_t>();
        KMLA_CHECK(id >= 0 && id < vocab_size, where, "token id ", id, " is outside [0, ", vocab_size, ")");
        r.prompt.push_back(int32_t(id));
      }
    } else {
      const int len = int(integer("prompt_len", 1, INT32_MAX / 2, 0));
      if (j.contains("prefix_group")) {
        const json& gv = j["prefix_group"];
        KMLA_CHECK(gv.is_number_integer() || gv.is_string(), where,
                   "\"prefix_group\" must be an integer or a string");
        KMLA_CHECK(j.contains("prefix_len"), where, "\"prefix_group\" needs \"prefix_len\"");
        const int shared = int(integer("prefix_len", 1, len, 0));
        const std::string key = gv.is_string() ? "s:" + gv.get<std::string>() : "i:" + gv.dump();
        const std::vector<int32_t>& p = group_tokens(key, shared);
        r.prompt.assign(p.begin(), p.begin() + shared);
      } else {
        KMLA_CHECK(!j.contains("prefix_len"), where, "\"prefix_len\" needs \"prefix_group\"");
      }
      Random g(mix64(seed ^ mix64(uint64_t(line_no) + 0x6c696e65ull)));
      append_tokens(g, len - int(r.prompt.size()), vocab_size, r.prompt);
    }
    t.requests.push_back(std::move(r));
  }
  KMLA_CHECK(!in.bad(), "error reading trace file '", path, "'");
  KMLA_CHECK(!t.requests.empty(), "trace file '", path, "' holds no requests");
  sort_by_arrival(t);
  return t;
}

}  // namespace kmla::engine
