// The serving engine: block manager units, scheduler invariants over randomized traces (with a
// simulated cache that checks every context a request attends to), trace generation and
// parsing, and end-to-end runs of a small two-layer stack against each other and the oracle.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <unordered_map>

#include "core/random.hpp"
#include "engine/block_manager.hpp"
#include "engine/scheduler.hpp"
#include "kmla/engine.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"

namespace kmla::engine {
namespace {

// Runs f, which must throw a kmla::Error whose message contains every needle.
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected a kmla::Error";
  } catch (const Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "'" << e.what() << "' does not name '" << n << "'";
  }
}

std::vector<int32_t> iota_tokens(int n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[size_t(i)] = first + i;
  return t;
}

// ---- block manager -----------------------------------------------------------------------

TEST(BlockManager, AllocatesUntilEmptyAndCountsReferences) {
  BlockManager bm(3, 4, true);
  EXPECT_EQ(bm.num_free(), 3);
  const int32_t a = bm.allocate(), b = bm.allocate(), c = bm.allocate();
  EXPECT_EQ(bm.allocate(), -1);  // nothing free, nothing cached
  EXPECT_EQ(bm.num_used(), 3);
  EXPECT_EQ(bm.ref_count(a), 1);
  bm.release(b);
  EXPECT_EQ(bm.num_free(), 1);
  EXPECT_EQ(bm.allocate(), b);
  bm.release(a);
  bm.release(b);
  bm.release(c);
  EXPECT_EQ(bm.num_free(), 3);
  EXPECT_EQ(bm.num_used(), 0);
  expect_error([&] { bm.release(a); }, {"block", "no reference"});
  bm.check_invariants();
}

TEST(BlockManager, SharesFullBlocksByChainHash) {
  BlockManager bm(8, 4, true);
  const std::vector<int32_t> seq = iota_tokens(10, 100);  // 2 full blocks + 2 tokens
  const int32_t b0 = bm.allocate(), b1 = bm.allocate();
  EXPECT_TRUE(bm.publish(b0, BlockManager::kRootHash, seq.data()));
  const uint64_t h0 = BlockManager::chain_hash(BlockManager::kRootHash, seq.data(), 4);
  EXPECT_TRUE(bm.publish(b1, h0, seq.data() + 4));
  // Another request with the same first 8 tokens finds both blocks, in order.
  std::vector<int32_t> other = seq;
  other[9] = 7;
  EXPECT_EQ(bm.match_prefix(other, 100), (std::vector<int32_t>{b0, b1}));
  EXPECT_EQ(bm.match_prefix(other, 1), (std::vector<int32_t>{b0}));  // capped
  bm.acquire(b0);
  EXPECT_EQ(bm.ref_count(b0), 2);
  // Same tokens in block 1 but a different block 0: the chain hash differs, no match past 0.
  std::vector<int32_t> forked = seq;
  forked[0] = 1;
  EXPECT_TRUE(bm.match_prefix(forked, 100).empty());
  std::vector<int32_t> tail_only = seq;
  tail_only[3] = 1;
  EXPECT_TRUE(bm.match_prefix(tail_only, 100).empty());
  // Released twice: cached (evictable), still matchable; acquiring takes it off the LRU.
  bm.release(b0);
  bm.release(b0);
  bm.release(b1);
  EXPECT_EQ(bm.num_cached(), 2);
  EXPECT_EQ(bm.num_used(), 0);
  EXPECT_EQ(bm.match_prefix(seq, 100).size(), 2u);
  bm.acquire(b1);
  EXPECT_EQ(bm.num_cached(), 1);
  bm.release(b1);
  bm.check_invariants();
}

TEST(BlockManager, EvictsLeastRecentlyUsedCachedBlockFirst) {
  BlockManager bm(3, 2, true);
  const std::vector<int32_t> x = {1, 2}, y = {3, 4}, z = {5, 6};
  const int32_t a = bm.allocate(), b = bm.allocate(), c = bm.allocate();
  bm.publish(a, BlockManager::kRootHash, x.data());
  bm.publish(b, BlockManager::kRootHash, y.data());
  bm.publish(c, BlockManager::kRootHash, z.data());
  bm.release(b);  // least recently used
  bm.release(a);
  bm.release(c);
  EXPECT_EQ(bm.num_free(), 0);
  EXPECT_EQ(bm.num_cached(), 3);
  // A hit refreshes a: after acquire + release it is the most recent.
  bm.acquire(a);
  bm.release(a);
  EXPECT_EQ(bm.allocate(), b);  // b evicted first
  EXPECT_TRUE(bm.match_prefix(y, 1).empty());
  EXPECT_EQ(bm.allocate(), c);  // then c (a was refreshed)
  EXPECT_EQ(bm.match_prefix(x, 1), (std::vector<int32_t>{a}));
  EXPECT_EQ(bm.allocate(), a);
  EXPECT_EQ(bm.allocate(), -1);
  EXPECT_EQ(bm.evictions(), 3);
  EXPECT_FALSE(bm.is_published(a));
  bm.check_invariants();
}

TEST(BlockManager, NeverSharesAPartialBlock) {
  BlockManager bm(4, 4, true);
  const std::vector<int32_t> seq = iota_tokens(7, 0);  // 1 full block + 3 tokens
  const int32_t b0 = bm.allocate(), b1 = bm.allocate();
  bm.publish(b0, BlockManager::kRootHash, seq.data());
  // The partial block is never published by the scheduler; match_prefix only walks full
  // blocks of the query, so even 7 matching tokens give one block.
  EXPECT_EQ(bm.match_prefix(seq, 100), (std::vector<int32_t>{b0}));
  std::vector<int32_t> longer = iota_tokens(8, 0);
  EXPECT_EQ(bm.match_prefix(longer, 100).size(), 1u);
  expect_error([&] { bm.acquire(b1); }, {"holds no published prefix"});
  bm.release(b0);
  bm.release(b1);
  bm.check_invariants();
}

TEST(BlockManager, PrefixCachingOffKeepsNothing) {
  BlockManager bm(2, 2, false);
  const std::vector<int32_t> x = {1, 2};
  const int32_t a = bm.allocate();
  EXPECT_FALSE(bm.publish(a, BlockManager::kRootHash, x.data()));
  bm.release(a);
  EXPECT_EQ(bm.num_cached(), 0);
  EXPECT_EQ(bm.num_free(), 2);
  EXPECT_TRUE(bm.match_prefix(x, 1).empty());
}

TEST(BlockManager, DuplicateContentStaysPrivate) {
  // Two requests computed the same block at once: the first publication wins, the second
  // block is freed (not cached) when its owner lets go.
  BlockManager bm(2, 2, true);
  const std::vector<int32_t> x = {1, 2};
  const int32_t a = bm.allocate(), b = bm.allocate();
  EXPECT_TRUE(bm.publish(a, BlockManager::kRootHash, x.data()));
  EXPECT_FALSE(bm.publish(b, BlockManager::kRootHash, x.data()));
  bm.release(b);
  EXPECT_EQ(bm.num_free(), 1);
  bm.release(a);
  EXPECT_EQ(bm.num_cached(), 1);
  bm.check_invariants();
}

// ---- scheduler, driven without layers ------------------------------------------------------

uint64_t mix(uint64_t h, int32_t token) {
  uint64_t z = h ^ (uint64_t(uint32_t(token)) * 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 29);
}

Trace small_trace(uint64_t seed, int n, int prompt_mean = 40, int prompt_max = 120, int out_mean = 8,
                  int out_max = 20, double rate = 0) {
  TraceOptions t;
  t.num_requests = n;
  t.arrival_rate = rate;
  t.prompt_len_mean = prompt_mean;
  t.prompt_len_min = 2;
  t.prompt_len_max = prompt_max;
  t.output_len_mean = out_mean;
  t.output_len_min = 1;
  t.output_len_max = out_max;
  t.num_prefix_groups = 2;
  t.prefix_len = 24;
  t.shared_prefix_fraction = 0.6;
  t.vocab_size = 500;
  t.seed = seed;
  return default_trace(t);
}

struct SimStats {
  int preemptions = 0;
  int64_t hits = 0, rejected = 0, evictions = 0;
};

// Serves `trace` with the scheduler alone. The "cache" stores, per slot, an identity of the
// token sequence up to and including that row; before every chunk the test checks that each
// context row the request will attend to holds exactly its own prefix (whoever computed it),
// and that every row it writes lies in a block nobody else holds or publishes.
SimStats simulate(const Trace& trace, const SchedulerOptions& so) {
  Scheduler s(trace, so);
  std::unordered_map<int64_t, uint64_t> slots;
  const int bs = so.block_size;
  const int T = s.decode_threshold();
  double now = 0;
  int64_t steps = 0;
  while (!s.done()) {
    if (!s.has_work(now)) now = s.next_arrival();
    const StepPlan plan = s.schedule(now);
    EXPECT_FALSE(plan.chunks.empty());
    EXPECT_LE(plan.num_tokens(), so.token_budget);
    EXPECT_LE(s.num_running(), so.max_num_seqs);
    bool seen_prefill = false;
    for (const ScheduledChunk& c : plan.chunks) {
      const TraceRequest& tr = trace.requests[size_t(c.request)];
      EXPECT_LE(tr.arrival_s, now);
      const std::vector<int32_t>& seq = s.sequence(c.request);
      const int64_t q = int64_t(c.tokens.size());
      EXPECT_GE(c.kept, 1);
      EXPECT_LE(c.kept, q);
      EXPECT_GE(int64_t(c.block_table.size()) * bs, c.context_len + q);
      EXPECT_TRUE(!c.decode || !seen_prefill) << "decodes come first";
      seen_prefill |= !c.decode;
      if (c.decode) {
        EXPECT_EQ(c.context_len, int64_t(seq.size()) - 1);
        EXPECT_EQ(c.tokens[0], seq.back());
        EXPECT_LE(q, T);
      } else {
        EXPECT_TRUE(std::equal(c.tokens.begin(), c.tokens.end(), seq.begin() + c.context_len));
        EXPECT_EQ(c.kept, q);
        if (so.non_causal_decode && so.spec_tokens > 0 && c.context_len > 0) {
          EXPECT_GT(q, T) << "a prefill with context would be planned as a non-causal decode block"
                          << " (request " << tr.id << ", context " << c.context_len << ", target "
                          << c.prefill_target << ", admitted " << c.admitted << ", budget " << so.token_budget
                          << ", block size " << bs << ")";
        }
      }
      uint64_t id = 0x1234;
      for (int64_t p = 0; p < c.context_len; ++p) {
        id = mix(id, seq[size_t(p)]);
        const int64_t slot = int64_t(c.block_table[size_t(p / bs)]) * bs + p % bs;
        const auto it = slots.find(slot);
        if (it == slots.end() || it->second != id) {
          ADD_FAILURE() << "request " << tr.id << " context row " << p << " does not hold its own prefix";
          return {};
        }
      }
      for (int64_t p = c.context_len; p < c.context_len + q; ++p) {
        const int32_t block = c.block_table[size_t(p / bs)];
        EXPECT_EQ(s.blocks().ref_count(block), 1) << "a shared block is written";
        EXPECT_FALSE(s.blocks().is_published(block)) << "a published block is written";
        id = mix(id, c.tokens[size_t(p - c.context_len)]);
        slots[int64_t(block) * bs + p % bs] = id;
      }
    }
    now += 0.01;
    s.complete(plan, now);
    s.blocks().check_invariants();
    ++steps;
    if (steps > 100000) {
      ADD_FAILURE() << "no progress";
      break;
    }
  }
  SimStats st;
  for (size_t i = 0; i < trace.requests.size(); ++i) {
    const RequestRecord& r = s.records()[i];
    EXPECT_EQ(s.generated(int(i)), r.output_len) << "request " << r.id;
    EXPECT_EQ(int64_t(s.sequence(int(i)).size()), int64_t(r.prompt_len) + r.output_len);
    EXPECT_EQ(r.computed_tokens + r.prefix_hit_tokens,
              int64_t(r.prompt_len) + r.output_len - 1 + r.recomputed_tokens + r.rejected_tokens)
        << "request " << r.id;
    EXPECT_GE(r.first_token_s, r.arrival_s);
    EXPECT_GE(r.finish_s, r.first_token_s);
    if (r.preemptions == 0) { EXPECT_EQ(r.recomputed_tokens, 0); }
    if (so.spec_tokens == 0) { EXPECT_EQ(r.rejected_tokens, 0); }
    if (!so.prefix_caching) { EXPECT_EQ(r.prefix_hit_tokens, 0); }
    // The generated tokens are the teacher-forced ones, whatever the schedule.
    for (int32_t j = 0; j < r.output_len; ++j)
      EXPECT_EQ(s.sequence(int(i))[size_t(r.prompt_len + j)], generated_token(so.seed, r.id, j));
    st.hits += r.prefix_hit_tokens;
    st.rejected += r.rejected_tokens;
  }
  EXPECT_EQ(s.blocks().num_used(), 0);
  EXPECT_EQ(s.blocks().num_free() + s.blocks().num_cached(), so.num_blocks);
  st.preemptions = s.preemptions();
  st.evictions = s.blocks().evictions();
  return st;
}

TEST(Scheduler, RandomTracesKeepEveryInvariant) {
  SimStats total;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    Random g(seed * 7919);
    const Trace trace = small_trace(seed, 4 + int(g.below(14)), 10 + int(g.below(60)), 150, 6, 24,
                                    g.below(2) ? 0.0 : 50.0);
    SchedulerOptions so;
    so.block_size = int(1 + g.below(16));
    so.prefix_caching = g.below(4) != 0;
    so.spec_tokens = g.below(3) == 0 ? int(1 + g.below(4)) : 0;
    so.spec_accept_rate = 0.6;
    so.non_causal_decode = g.below(2) != 0;
    so.max_num_seqs = int(1 + g.below(8));
    so.token_budget = int64_t(so.spec_tokens + 2 + g.below(100));
    so.seed = seed;
    int64_t longest = 0;
    for (const TraceRequest& r : trace.requests) longest = std::max(longest, Scheduler::blocks_needed(r, so.block_size));
    so.num_blocks = longest + int64_t(g.below(uint64_t(2 * longest + 1)));  // often too small: preemptions
    SCOPED_TRACE("seed " + std::to_string(seed));
    const SimStats st = simulate(trace, so);
    total.preemptions += st.preemptions;
    total.hits += st.hits;
    total.rejected += st.rejected;
    total.evictions += st.evictions;
  }
  // The randomized options do reach every mechanism.
  EXPECT_GT(total.preemptions, 0);
  EXPECT_GT(total.hits, 0);
  EXPECT_GT(total.rejected, 0);
  EXPECT_GT(total.evictions, 0);
}

TEST(Scheduler, ChunksLongPromptsAndHonoursArrivals) {
  Trace t;
  t.requests.push_back({0, 0.0, iota_tokens(50, 1), 3});
  t.requests.push_back({1, 2.5, iota_tokens(5, 100), 2});
  SchedulerOptions so;
  so.block_size = 4;
  so.num_blocks = 64;
  so.token_budget = 16;
  Scheduler s(t, so);
  StepPlan p = s.schedule(0);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].tokens.size(), 16u);  // a fresh prefill of one budget
  EXPECT_EQ(p.chunks[0].context_len, 0);
  s.complete(p, 0.1);
  p = s.schedule(0.1);
  EXPECT_EQ(p.chunks[0].context_len, 16);  // then prefills with context
  s.complete(p, 0.2);
  EXPECT_EQ(s.num_waiting(2.0), 0);
  EXPECT_EQ(s.num_waiting(3.0), 1);  // arrived, not yet scheduled
  double now = 0.2;
  while (!s.done()) {
    if (!s.has_work(now)) now = s.next_arrival();
    p = s.schedule(now);
    for (const ScheduledChunk& c : p.chunks)
      if (c.request == 1) { EXPECT_GE(now, 2.5); }
    now += 0.1;
    s.complete(p, now);
  }
  EXPECT_GE(s.records()[1].first_token_s, 2.5);
}

TEST(Scheduler, ARequestThatCanNeverFitIsAnError) {
  Trace t;
  t.requests.push_back({0, 0, iota_tokens(10, 1), 2});
  t.requests.push_back({7, 0, iota_tokens(100, 1), 20});
  SchedulerOptions so;
  so.block_size = 16;
  so.num_blocks = 7;  // request 7 needs ceil(119 / 16) = 8
  expect_error([&] { Scheduler s(t, so); }, {"request 7", "needs 8 blocks", "has 7"});
  so.num_blocks = 8;
  Scheduler ok(t, so);
  t.requests[1].id = 0;
  expect_error([&] { Scheduler s(t, so); }, {"request id 0 appears twice"});
}

TEST(Scheduler, GeneratedTokensAreDeterministic) {
  EXPECT_EQ(generated_token(1, 5, 3), generated_token(1, 5, 3));
  int differ = 0;
  for (int j = 0; j < 20; ++j) {
    differ += generated_token(1, 5, j) != generated_token(2, 5, j);
    EXPECT_GE(generated_token(1, 5, j), 0);
    EXPECT_LT(generated_token(1, 5, j), kGeneratedVocab);
  }
  EXPECT_GT(differ, 15);
}

// ---- traces --------------------------------------------------------------------------------

TEST(Trace, DefaultIsDeterministicAndShaped) {
  TraceOptions o;
  const Trace a = default_trace(o), b = default_trace(o);
  ASSERT_EQ(a.requests.size(), size_t(o.num_requests));
  std::map<std::vector<int32_t>, int> prefixes;
  for (size_t i = 0; i < a.requests.size(); ++i) {
    const TraceRequest& r = a.requests[i];
    EXPECT_EQ(r.prompt, b.requests[i].prompt);
    EXPECT_EQ(r.output_len, b.requests[i].output_len);
    EXPECT_GE(int(r.prompt.size()), o.prompt_len_min);
    EXPECT_LE(int(r.prompt.size()), o.prompt_len_max);
    EXPECT_GE(r.output_len, o.output_len_min);
    EXPECT_LE(r.output_len, o.output_len_max);
    EXPECT_EQ(r.arrival_s, 0);
    for (int32_t t : r.prompt) EXPECT_TRUE(t >= 0 && t < o.vocab_size);
    if (int(r.prompt.size()) > o.prefix_len)
      prefixes[std::vector<int32_t>(r.prompt.begin(), r.prompt.begin() + o.prefix_len)]++;
  }
  // Some requests share one of the prefixes.
  int shared = 0;
  for (const auto& [p, n] : prefixes)
    if (n > 1) shared += n;
  EXPECT_GE(shared, 4);
  TraceOptions o2 = o;
  o2.seed = 2;
  EXPECT_NE(default_trace(o2).requests[0].prompt, a.requests[0].prompt);
  o2.arrival_rate = 10;
  const Trace c = default_trace(o2);
  for (size_t i = 1; i < c.requests.size(); ++i) EXPECT_GT(c.requests[i].arrival_s, c.requests[i - 1].arrival_s);
  o2.prompt_len_min = 0;
  expect_error([&] { default_trace(o2); }, {"prompt lengths"});
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

TEST(Trace, JsonlParses) {
  const std::string path = write_file("kmla_trace_ok.jsonl",
                                      "{\"prompt_len\": 40, \"output_len\": 5, \"arrival_s\": 1.5, \"prefix_group\": 1, \"prefix_len\": 30}\n"
                                      "\n"
                                      "{\"prompt\": [1, 2, 3]}\n"
                                      "{\"prompt_len\": 20, \"prefix_group\": 1, \"prefix_len\": 10, \"id\": 42, \"arrival_s\": 0.5}\n"
                                      "{\"prompt_len\": 35, \"prefix_group\": \"sys\", \"prefix_len\": 30}\n");
  const Trace t = load_trace_jsonl(path, 1000, 3);
  ASSERT_EQ(t.requests.size(), 4u);
  // Sorted by arrival: ids 1 (0 s), 3 (0 s), 42 (0.5 s), 0 (1.5 s).
  EXPECT_EQ(t.requests[0].id, 1);
  EXPECT_EQ(t.requests[0].prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(t.requests[0].output_len, 16);
  EXPECT_EQ(t.requests[1].id, 3);
  EXPECT_EQ(t.requests[2].id, 42);
  EXPECT_EQ(t.requests[3].id, 0);
  EXPECT_EQ(t.requests[3].output_len, 5);
  EXPECT_DOUBLE_EQ(t.requests[3].arrival_s, 1.5);
  const auto& g1a = t.requests[3].prompt;  // group 1, 30 shared
  const auto& g1b = t.requests[2].prompt;  // group 1, 10 shared
  const auto& gs = t.requests[1].prompt;   // group "sys", 30 shared
  EXPECT_EQ(g1a.size(), 40u);
  EXPECT_EQ(g1b.size(), 20u);
  EXPECT_TRUE(std::equal(g1b.begin(), g1b.begin() + 10, g1a.begin()));
  EXPECT_NE(g1a[10], g1b[10]);  // past the shorter shared prefix: their own tokens
  EXPECT_NE(std::vector<int32_t>(gs.begin(), gs.begin() + 30), std::vector<int32_t>(g1a.begin(), g1a.begin() + 30));
  for (const TraceRequest& r : t.requests)
    for (int32_t x : r.prompt) EXPECT_TRUE(x >= 0 && x < 1000);
  // Deterministic in the seed.
  EXPECT_EQ(load_trace_jsonl(path, 1000, 3).requests[3].prompt, g1a);
  EXPECT_NE(load_trace_jsonl(path, 1000, 4).requests[3].prompt, g1a);
}

TEST(Trace, JsonlErrorsNameTheLine) {
  struct Case {
    const char* text;
    const char* needle;
  };
  const Case cases[] = {
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{oops\n", "not valid JSON"},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"output_len\": 3}\n", "exactly one of"},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"prompt_len\": 4, \"output_len\": 0}\n", "\"output_len\" = 0"},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"prompt\": [1, 5000]}\n", "token id 5000"},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"prompt_len\": 4, \"outptu_len\": 3}\n", "unknown key \"outptu_len\""},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"prompt_len\": 4, \"id\": 1}\n", "request id 1 appears twice"},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"prompt_len\": 4, \"prefix_group\": 2}\n", "needs \"prefix_len\""},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"prompt_len\": 4, \"prefix_group\": 2, \"prefix_len\": 9}\n", "\"prefix_len\" = 9"},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n[1, 2]\n", "JSON object"},
      {"{\"prompt_len\": 4}\n{\"prompt_len\": 4}\n{\"prompt_len\": 4, \"arrival_s\": -1}\n", "\"arrival_s\""},
  };
  int k = 0;
  for (const Case& c : cases) {
    const std::string path = write_file("kmla_trace_bad" + std::to_string(k++) + ".jsonl", c.text);
    expect_error([&] { load_trace_jsonl(path, 1000); }, {path + ":3: ", c.needle});
  }
  expect_error([&] { load_trace_jsonl(::testing::TempDir() + "kmla_no_such_trace.jsonl"); }, {"cannot open", "kmla_no_such_trace.jsonl"});
  const std::string empty = write_file("kmla_trace_empty.jsonl", "\n\n");
  expect_error([&] { load_trace_jsonl(empty); }, {"holds no requests"});
}

// ---- the engine on a small stack ----------------------------------------------------------

// kimi-k3's layer at test size: q-LoRA, gate, NoPE; 3 heads, hidden 256.
MlaConfig small_config() {
  MlaConfig c;
  c.name = "small-k3";
  c.hidden_size = 256;
  c.num_heads = 3;
  c.q_lora_rank = 96;
  c.use_output_gate = true;
  return c;
}

// The DSpark draft's layer at test size: RoPE, non-causal multi-token decode, no gate.
MlaConfig small_draft_config() {
  MlaConfig c = small_config();
  c.name = "small-dspark";
  c.num_heads = 2;
  c.use_output_gate = false;
  c.use_rope = true;
  c.rope.theta = 50000;
  c.non_causal_multi_token_decode = true;
  c.max_position_embeddings = 4096;
  return c;
}

EngineOptions small_options() {
  EngineOptions o;
  o.config = small_config();
  o.num_layers = 2;
  o.block_size = 8;
  o.num_blocks = 256;
  o.token_budget = 48;
  o.max_num_seqs = 6;
  o.workspace_tokens = 40;  // small: contexts run in several chunks
  o.check_requests = 0;
  o.record_outputs = true;
  o.num_threads = 1;  // ctest runs two tests at once on two cores
  return o;
}

Trace engine_trace(uint64_t seed, int n = 8) { return small_trace(seed, n, 36, 90, 6, 14); }

double to_double(uint16_t x, CacheFormat f) { return f == CacheFormat::fp16 ? fp16_to_float(x) : bf16_to_float(x); }

// max|a - b| / max|b| over rows [row0, rows) of [rows, width] activations.
double rel_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t width, CacheFormat f,
                int64_t row0 = 0) {
  double err = 0, ref = 0;
  for (size_t i = size_t(row0 * width); i < b.size(); ++i) {
    err = std::max(err, std::fabs(to_double(a[i], f) - to_double(b[i], f)));
    ref = std::max(ref, std::fabs(to_double(b[i], f)));
  }
  return ref > 0 ? err / ref : err;
}

// Every request finished with its tokens, the accounting adds up, every block came back.
void expect_complete(const RunResult& r, const Trace& t, const EngineOptions& o) {
  EXPECT_TRUE(r.all_finished);
  ASSERT_EQ(r.requests.size(), t.requests.size());
  int64_t prompt = 0, out = 0, computed = 0;
  for (size_t i = 0; i < t.requests.size(); ++i) {
    const RequestRecord& q = r.requests[i];
    EXPECT_EQ(q.id, t.requests[i].id);
    EXPECT_EQ(q.outputs.size(), size_t(q.output_len) * size_t(o.config.hidden_size));
    EXPECT_EQ(q.computed_tokens + q.prefix_hit_tokens,
              int64_t(q.prompt_len) + q.output_len - 1 + q.recomputed_tokens + q.rejected_tokens);
    EXPECT_GE(q.finish_s, q.first_token_s);
    EXPECT_GE(q.first_token_s, q.arrival_s);
    prompt += q.prompt_len;
    out += q.output_len;
    computed += q.computed_tokens;
  }
  EXPECT_EQ(r.prompt_tokens, prompt);
  EXPECT_EQ(r.generated_tokens, out);
  EXPECT_EQ(r.prefill_tokens_computed + r.decode_tokens_computed, computed);
  ASSERT_FALSE(r.steps.empty());
  EXPECT_EQ(r.steps.back().blocks_used, 0);
  EXPECT_EQ(r.steps.back().running, 0);
  for (const StepRecord& s : r.steps) {
    EXPECT_LE(s.prefill_tokens + s.decode_tokens, o.token_budget);
    EXPECT_LE(s.blocks_used + s.blocks_cached, r.total_blocks);
  }
  EXPECT_LE(r.peak_blocks, r.total_blocks);
  for (const CheckResult& c : r.checks) {
    EXPECT_TRUE(c.pass) << "request " << c.request_id << " rel err " << c.rel_err << " bound " << c.bound;
    EXPECT_GT(c.tokens, 0);
  }
}

TEST(Engine, RandomTracesRunToCompletion) {
  for (uint64_t seed : {1, 2, 3}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    EngineOptions o = small_options();
    o.seed = seed;
    o.num_blocks = 30 + int64_t(seed) * 10;
    o.check_requests = 1;
    const Trace t = engine_trace(seed, 8);
    const RunResult r = Engine(o).run(t);
    expect_complete(r, t, o);
    EXPECT_EQ(r.checks.size(), 1u);
  }
}

// A tensor-parallel rank plans its steps on the clock every rank agrees on
// (EngineOptions::agree_clock); here a peer that is always 2 ms ahead. Every step must start
// at an agreed time, and requests arriving over time still run to completion.
TEST(Engine, SharedClockDrivesTheSchedule) {
  EngineOptions o = small_options();
  std::vector<double> agreed;
  o.agree_clock = [&](double now_s) {
    agreed.push_back(now_s + 0.002);
    return agreed.back();
  };
  Trace t = engine_trace(4, 6);
  for (size_t i = 0; i < t.requests.size(); ++i) t.requests[i].arrival_s = 0.003 * double(i);
  const RunResult r = Engine(o).run(t);
  expect_complete(r, t, o);
  ASSERT_GE(agreed.size(), r.steps.size());
  for (const StepRecord& st : r.steps)
    EXPECT_NE(std::find(agreed.begin(), agreed.end(), st.start_s), agreed.end()) << st.start_s;
}

TEST(Engine, PreemptedRequestsFinishWithTheSameOutputs) {
  const Trace t = engine_trace(11, 8);
  EngineOptions o = small_options();
  const RunResult roomy = Engine(o).run(t);
  int64_t longest = 0;
  for (const TraceRequest& q : t.requests) longest = std::max(longest, Scheduler::blocks_needed(q, o.block_size));
  o.num_blocks = longest + 2;  // one long request and little else: preemption by recompute
  o.check_requests = 2;
  const RunResult tight = Engine(o).run(t);
  expect_complete(roomy, t, small_options());
  expect_complete(tight, t, o);
  EXPECT_EQ(roomy.preemptions, 0);
  ASSERT_GT(tight.preemptions, 0);
  // Both runs approximate the same exact values; they differ only in how the rows were
  // batched and chunked. The tolerance is the oracle bound (fixed in engine.cpp).
  const double tol = oracle_bound(o.cache_format, o.num_layers);
  double worst = 0;
  int preempted = 0;
  for (size_t i = 0; i < t.requests.size(); ++i) {
    const double d = rel_diff(tight.requests[i].outputs, roomy.requests[i].outputs, o.config.hidden_size, o.cache_format);
    worst = std::max(worst, d);
    preempted += tight.requests[i].preemptions > 0;
    if (tight.requests[i].preemptions > 0)
      EXPECT_GT(tight.requests[i].recomputed_tokens, 0);
    else
      EXPECT_EQ(tight.requests[i].recomputed_tokens, 0);
    EXPECT_LE(d, tol) << "request " << t.requests[i].id;
  }
  EXPECT_GT(preempted, 0);
  std::printf("preemption: %d preemptions over %d requests, worst relative difference %.3e (tolerance %.3e)\n",
              tight.preemptions, preempted, worst, tol);
}

TEST(Engine, PrefixCachingOnAndOffGiveTheSameOutputs) {
  const Trace t = engine_trace(5, 10);
  for (int layers : {2, 1}) {
    SCOPED_TRACE(std::to_string(layers) + " layers");
    EngineOptions on = small_options();
    on.num_layers = layers;
    EngineOptions off = on;
    off.prefix_caching = false;
    const RunResult a = Engine(on).run(t), b = Engine(off).run(t);
    expect_complete(a, t, on);
    expect_complete(b, t, off);
    ASSERT_GT(a.prefix_hit_tokens, 0);
    EXPECT_EQ(b.prefix_hit_tokens, 0);
    const double tol = oracle_bound(on.cache_format, layers);
    double worst = 0;
    int bitwise_decodes = 0, hit_requests = 0;
    const int64_t hs = on.config.hidden_size;
    for (size_t i = 0; i < t.requests.size(); ++i) {
      const RequestRecord& qa = a.requests[i];
      const double d = rel_diff(qa.outputs, b.requests[i].outputs, hs, on.cache_format);
      worst = std::max(worst, d);
      EXPECT_LE(d, tol) << "request " << qa.id;
      if (qa.prefix_hit_tokens == 0 || qa.output_len < 2) continue;
      ++hit_requests;
      // Row 0 of the outputs is the last prompt token, computed as a prefill with the hit as
      // context (or as part of a full prefill without caching): different arithmetic. The
      // decode rows read the cache; with one layer its rows depend only on the embeddings,
      // so the two runs store the same bits and the decode rows agree bitwise.
      const bool same = std::equal(qa.outputs.begin() + hs, qa.outputs.end(), b.requests[i].outputs.begin() + hs);
      bitwise_decodes += same;
      if (layers == 1) { EXPECT_TRUE(same) << "request " << qa.id << ": decode rows differ with one layer"; }
    }
    EXPECT_GT(hit_requests, 0);
    std::printf("prefix caching (%d layers): %lld hit tokens, worst relative difference %.3e (tolerance %.3e), "
                "decode rows bitwise equal in %d of %d requests with hits\n",
                layers, (long long)a.prefix_hit_tokens, worst, tol, bitwise_decodes, hit_requests);
  }
}

TEST(Engine, SpeculativeDecodingMatchesPlainDecoding) {
  const Trace t = engine_trace(7, 8);
  EngineOptions plain = small_options();
  EngineOptions spec = plain;
  spec.spec_tokens = 3;
  spec.spec_accept_rate = 0.6;
  spec.check_requests = 1;
  const RunResult a = Engine(plain).run(t), b = Engine(spec).run(t);
  expect_complete(a, t, plain);
  expect_complete(b, t, spec);
  int64_t rejected = 0;
  for (const RequestRecord& q : b.requests) rejected += q.rejected_tokens;
  EXPECT_GT(rejected, 0);
  EXPECT_LT(b.steps.size(), a.steps.size());  // several tokens per decode step
  // Causal verification computes the same function as one token at a time.
  const double tol = oracle_bound(plain.cache_format, plain.num_layers);
  for (size_t i = 0; i < t.requests.size(); ++i)
    EXPECT_LE(rel_diff(b.requests[i].outputs, a.requests[i].outputs, plain.config.hidden_size, plain.cache_format), tol);
}

TEST(Engine, NonCausalDraftBlocksRunAndPassTheOracle) {
  const Trace t = engine_trace(9, 8);
  for (int spec : {0, 3}) {
    SCOPED_TRACE("spec " + std::to_string(spec));
    EngineOptions o = small_options();
    o.config = small_draft_config();
    o.spec_tokens = spec;
    o.num_blocks = 60;  // some preemption too
    o.check_requests = 2;
    const RunResult r = Engine(o).run(t);
    expect_complete(r, t, o);
    EXPECT_EQ(r.checks.size(), 2u);
    if (spec > 0) {
      int64_t rejected = 0;
      for (const RequestRecord& q : r.requests) rejected += q.rejected_tokens;
      EXPECT_GT(rejected, 0);
    }
  }
}

TEST(Engine, OracleCheckPassesAndItsBoundIsAConstant) {
  // The bound is fixed before any run: a constant per cache format, times the stack depth.
  EXPECT_EQ(oracle_bound(CacheFormat::bf16, 2), 0x1p-5);
  EXPECT_EQ(oracle_bound(CacheFormat::fp16, 2), 0x1p-8);
  EXPECT_EQ(oracle_bound(CacheFormat::fp8, 2), 0x1p-3);
  EXPECT_EQ(oracle_bound(CacheFormat::fp8_ds_mla, 3), 3 * 0x1p-4);
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    SCOPED_TRACE(cache_format_name(f));
    // Two different runs (bf16), one each for the other formats: the same bound every time.
    for (uint64_t seed : {21, 22}) {
      if (seed == 22 && f != CacheFormat::bf16) continue;
      EngineOptions o = small_options();
      o.cache_format = f;
      o.seed = seed;
      o.check_requests = 2;
      const Trace t = engine_trace(seed, 6);
      const RunResult r = Engine(o).run(t);
      expect_complete(r, t, o);
      ASSERT_EQ(r.checks.size(), 2u);
      for (const CheckResult& c : r.checks) {
        EXPECT_EQ(c.bound, oracle_bound(f, o.num_layers));
        EXPECT_TRUE(c.pass);
        EXPECT_LT(c.rel_err, c.bound / 2) << "the real error should sit well below the bound";
        EXPECT_GT(c.max_ref, 0);
        std::printf("oracle %-10s seed %llu request %lld: %lld rows, rel err %.3e (bound %.3e)\n",
                    cache_format_name(f), (unsigned long long)seed, (long long)c.request_id, (long long)c.tokens,
                    c.rel_err, c.bound);
      }
      // The shortest requests were checked.
      std::vector<int64_t> rows;
      for (const TraceRequest& q : t.requests) rows.push_back(int64_t(q.prompt.size()) + q.output_len);
      std::sort(rows.begin(), rows.end());
      for (const CheckResult& c : r.checks)
        for (const TraceRequest& q : t.requests)
          if (q.id == c.request_id) { EXPECT_LE(int64_t(q.prompt.size()) + q.output_len, rows[1]); }
    }
  }
}

TEST(Engine, HonoursArrivalsAndReportsProgress) {
  Trace t;
  t.requests.push_back({0, 0.0, iota_tokens(20, 1), 4});
  t.requests.push_back({1, 0.2, iota_tokens(12, 50), 3});
  t.requests.push_back({2, 30.0, iota_tokens(9, 90), 2});  // long idle gap: the clock jumps
  EngineOptions o = small_options();
  int calls = 0, last_finished = 0;
  const RunResult r = Engine(o).run(t, [&](const Progress& p) {
    ++calls;
    EXPECT_EQ(p.total, 3);
    EXPECT_GE(p.finished, last_finished);
    EXPECT_EQ(p.step, calls);
    ASSERT_NE(p.last, nullptr);
    EXPECT_GT(p.last->prefill_tokens + p.last->decode_tokens, 0);
    last_finished = p.finished;
  });
  expect_complete(r, t, o);
  EXPECT_EQ(calls, int(r.steps.size()));
  EXPECT_EQ(last_finished, 3);
  EXPECT_GE(r.requests[2].first_token_s, 30.0);
  EXPECT_GE(r.wall_s, 30.0);
  for (size_t i = 1; i < r.steps.size(); ++i) EXPECT_GE(r.steps[i].start_s, r.steps[i - 1].start_s + r.steps[i - 1].duration_s);
}

TEST(Engine, BadInputIsAnError) {
  Trace t;
  t.requests.push_back({3, 0, iota_tokens(200, 1), 10});
  EngineOptions o = small_options();
  o.num_blocks = 20;  // request 3 needs ceil(209 / 8) = 27
  expect_error([&] { Engine(o).run(t); }, {"request 3", "never fit", "needs 27 blocks"});
  o = small_options();
  o.num_layers = 0;
  expect_error([&] { Engine e(o); }, {"num_layers"});
  o = small_options();
  o.workspace_tokens = 2;
  expect_error([&] { Engine e(o); }, {"workspace_tokens"});
  o = small_options();
  o.spec_tokens = 4;
  o.token_budget = 4;
  expect_error([&] { Engine(o).run(t); }, {"token_budget 4"});
  o = small_options();
  o.config = small_draft_config();
  o.config.max_position_embeddings = 100;
  o.num_blocks = 64;
  expect_error([&] { Engine(o).run(t); }, {"RoPE table"});
  // An empty trace is served at once.
  const RunResult r = Engine(small_options()).run(Trace{});
  EXPECT_TRUE(r.all_finished);
  EXPECT_TRUE(r.steps.empty());
}

}  // namespace
}  // namespace kmla::engine
