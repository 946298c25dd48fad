#include "engine/scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "core/random.hpp"
#include "kmla/error.hpp"

namespace kmla::engine {

namespace {

uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A seed for one purpose (`salt`) of one request at one output step.
uint64_t stream_seed(uint64_t seed, uint64_t salt, int64_t request_id, int64_t j) {
  return mix64(mix64(mix64(seed ^ salt) + uint64_t(request_id)) + uint64_t(j));
}

constexpr uint64_t kTokenSalt = 0x746f6b656eull;  // "token"
constexpr uint64_t kDraftSalt = 0x6472616674ull;  // "draft"

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int32_t generated_token(uint64_t seed, int64_t request_id, int64_t j) {
  Random g(stream_seed(seed, kTokenSalt, request_id, j));
  return int32_t(g.below(uint64_t(kGeneratedVocab)));
}

int64_t StepPlan::num_tokens() const {
  int64_t n = 0;
  for (const ScheduledChunk& c : chunks) n += int64_t(c.tokens.size());
  return n;
}

int64_t Scheduler::blocks_needed(const TraceRequest& r, int block_size) {
  return ceil_div(int64_t(r.prompt.size()) + r.output_len - 1, block_size);
}

Scheduler::Scheduler(const Trace& trace, const SchedulerOptions& o)
    : opt_(o), bm_(o.num_blocks, o.block_size, o.prefix_caching) {
  KMLA_CHECK(o.spec_tokens >= 0 && o.spec_tokens <= 127, "spec_tokens must be in [0, 127], got ",
             o.spec_tokens);
  KMLA_CHECK(o.spec_accept_rate >= 0 && o.spec_accept_rate <= 1,
             "spec_accept_rate must be in [0, 1], got ", o.spec_accept_rate);
  KMLA_CHECK(o.max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", o.max_num_seqs);
  // A decode block must fit the budget; with non-causal drafts a prefill chunk with context
  // must be longer than a decode block, so the budget must hold one such chunk too.
  const int64_t min_budget = decode_threshold() + (noncausal_drafts() ? 1 : 0);
  KMLA_CHECK(o.token_budget >= min_budget, "token_budget ", o.token_budget, " is smaller than ",
             min_budget, " (one decode block of 1 + spec_tokens",
             noncausal_drafts() ? ", plus one: non-causal drafts" : "", ")");

  const size_t n = trace.requests.size();
  KMLA_CHECK(n <= size_t(INT32_MAX), "too many requests: ", n);
  reqs_.resize(n);
  records_.resize(n);
  std::unordered_set<int64_t> ids;
  for (size_t i = 0; i < n; ++i) {
    const TraceRequest& t = trace.requests[i];
    KMLA_CHECK(ids.insert(t.id).second, "request id ", t.id, " appears twice in the trace");
    KMLA_CHECK(!t.prompt.empty(), "request ", t.id, " has an empty prompt");
    KMLA_CHECK(t.output_len >= 1, "request ", t.id, ": output_len must be >= 1, got ", t.output_len);
    KMLA_CHECK(std::isfinite(t.arrival_s) && t.arrival_s >= 0, "request ", t.id,
               ": arrival_s must be finite and >= 0, got ", t.arrival_s);
    KMLA_CHECK(int64_t(t.prompt.size()) + t.output_len <= INT32_MAX, "request ", t.id, " is too long");
    const int64_t need = blocks_needed(t, o.block_size);
    KMLA_CHECK(need <= o.num_blocks, "request ", t.id, " can never fit the cache: it needs ", need,
               " blocks of ", o.block_size, " tokens (prompt ", t.prompt.size(), " + output ",
               t.output_len, " - 1), the cache has ", o.num_blocks);
    Req& r = reqs_[i];
    r.tr = &t;
    r.seq = t.prompt;
    RequestRecord& rec = records_[i];
    rec.id = t.id;
    rec.prompt_len = int32_t(t.prompt.size());
    rec.output_len = t.output_len;
    rec.arrival_s = t.arrival_s;
    by_arrival_.push_back(int(i));
  }
  std::stable_sort(by_arrival_.begin(), by_arrival_.end(), [&](int a, int b) {
    return trace.requests[size_t(a)].arrival_s < trace.requests[size_t(b)].arrival_s;
  });
}

double Scheduler::next_arrival() const {
  if (next_pending_ >= by_arrival_.size()) return std::numeric_limits<double>::infinity();
  return reqs_[size_t(by_arrival_[next_pending_])].tr->arrival_s;
}

bool Scheduler::has_work(double now) const {
  return !running_.empty() || !waiting_.empty() || next_arrival() <= now;
}

int Scheduler::num_waiting(double now) const {
  int n = int(waiting_.size());
  for (size_t i = next_pending_; i < by_arrival_.size(); ++i) {
    if (reqs_[size_t(by_arrival_[i])].tr->arrival_s > now) break;
    ++n;
  }
  return n;
}

// Tokens of a prefill chunk: what is left, up to the budget. With non-causal drafts a chunk
// with context must be longer than the decode threshold T (else the planner would run it as a
// non-causal decode block), so no chunk with context is that short and no chunk leaves 1..T
// tokens behind: it shrinks, possibly to nothing this step. A full budget (>= T + 1, checked
// at construction) always makes progress.
int64_t Scheduler::chunk_len(int64_t remaining, int64_t budget, int64_t context) const {
  int64_t n = std::min(remaining, budget);
  if (!noncausal_drafts()) return n;
  const int64_t T = decode_threshold();
  if (n < remaining && remaining - n <= T) n = remaining - T - 1;
  if (context > 0 && n <= T) n = 0;
  return std::max<int64_t>(n, 0);
}

void Scheduler::release_all(Req& r) {
  // Tail first: the blocks nearer the start of a sequence (more likely a shared prefix)
  // become the more recently used, so the LRU evicts tails first.
  for (auto it = r.blocks.rbegin(); it != r.blocks.rend(); ++it) bm_.release(*it);
  r.blocks.clear();
  r.hashes.clear();
}

void Scheduler::preempt(int idx, StepPlan& plan, int64_t& budget) {
  Req& r = reqs_[size_t(idx)];
  for (auto it = plan.chunks.begin(); it != plan.chunks.end(); ++it)
    if (it->request == idx) {
      budget += int64_t(it->tokens.size());
      plan.chunks.erase(it);
      break;
    }
  release_all(r);
  RequestRecord& rec = records_[size_t(idx)];
  rec.recomputed_tokens += r.computed;
  rec.preemptions++;
  r.computed = 0;
  r.prefill_target = 0;
  r.state = State::waiting;
  r.preempted_now = true;
  running_.erase(std::find(running_.begin(), running_.end(), idx));
  waiting_.push_front(idx);  // victims go most recent first, so the oldest ends up in front
  plan.preempted++;
  preemptions_++;
}

// Gives request idx blocks for `rows` rows, preempting the most recently admitted running
// request while none is free or cached. False when idx itself was preempted.
bool Scheduler::ensure_blocks(int idx, int64_t rows, StepPlan& plan, int64_t& budget) {
  Req& r = reqs_[size_t(idx)];
  const int64_t need = ceil_div(rows, opt_.block_size);
  while (int64_t(r.blocks.size()) < need) {
    const int32_t b = bm_.allocate();
    if (b >= 0) {
      r.blocks.push_back(b);
      continue;
    }
    const int victim = running_.back();
    preempt(victim, plan, budget);
    if (victim == idx) return false;
  }
  return true;
}

ScheduledChunk Scheduler::make_chunk(int idx, int64_t n) const {
  const Req& r = reqs_[size_t(idx)];
  ScheduledChunk c;
  c.request = idx;
  c.context_len = r.computed;
  c.tokens.assign(r.seq.begin() + r.computed, r.seq.begin() + r.computed + n);
  c.kept = int32_t(n);
  c.prefill_target = r.prefill_target;
  c.block_table = r.blocks;
  return c;
}

// The decode block of a request: its last token and k drafts, k = spec_tokens capped so the
// block never produces more than the tokens still to generate. Draft i (1-based) proposes the
// token of output step j - 1 + i; the number accepted, a, is deterministic in (seed, request,
// j): each draft is accepted with probability spec_accept_rate until the first rejection.
// Accepted drafts are the true tokens, the first rejected one a different token, the rest
// arbitrary. Rows [0, 1 + a) stay valid; each produces one token.
ScheduledChunk Scheduler::make_decode(int idx) const {
  const Req& r = reqs_[size_t(idx)];
  const int64_t id = r.tr->id;
  const int32_t j = r.generated;
  const int k = std::min<int>(opt_.spec_tokens, r.tr->output_len - j - 1);
  Random g(stream_seed(opt_.seed, kDraftSalt, id, j));
  int a = 0;
  while (a < k && g.uniform() < opt_.spec_accept_rate) ++a;
  ScheduledChunk c;
  c.request = idx;
  c.context_len = r.computed;
  c.decode = true;
  c.prefill_target = r.prefill_target;
  c.tokens.push_back(r.seq.back());
  for (int i = 1; i <= k; ++i) {
    const int32_t truth = generated_token(opt_.seed, id, j - 1 + i);
    if (i <= a)
      c.tokens.push_back(truth);
    else if (i == a + 1)
      c.tokens.push_back(int32_t((truth + 1 + int64_t(g.below(kGeneratedVocab - 1))) % kGeneratedVocab));
    else
      c.tokens.push_back(int32_t(g.below(kGeneratedVocab)));
  }
  c.kept = 1 + a;
  c.block_table = r.blocks;
  return c;
}

StepPlan Scheduler::schedule(double now) {
  while (next_pending_ < by_arrival_.size() &&
         reqs_[size_t(by_arrival_[next_pending_])].tr->arrival_s <= now) {
    const int idx = by_arrival_[next_pending_++];
    reqs_[size_t(idx)].state = State::waiting;
    waiting_.push_back(idx);
  }
  for (Req& r : reqs_) r.preempted_now = false;

  StepPlan plan;
  int64_t budget = opt_.token_budget;
  const std::vector<int> order = running_;  // preemption edits running_ while we walk

  // 1. Decodes first.
  for (int idx : order) {
    Req& r = reqs_[size_t(idx)];
    if (r.state != State::running || r.computed < r.prefill_target) continue;
    const int64_t q = 1 + std::min<int64_t>(opt_.spec_tokens, r.tr->output_len - r.generated - 1);
    if (q > budget) continue;
    if (!ensure_blocks(idx, r.computed + q, plan, budget)) continue;
    plan.chunks.push_back(make_decode(idx));
    budget -= q;
  }
  // 2. The next chunk of prefills in progress.
  for (int idx : order) {
    Req& r = reqs_[size_t(idx)];
    if (r.state != State::running || r.computed >= r.prefill_target) continue;
    const int64_t n = chunk_len(r.prefill_target - r.computed, budget, r.computed);
    if (n == 0) continue;
    if (!ensure_blocks(idx, r.computed + n, plan, budget)) continue;
    plan.chunks.push_back(make_chunk(idx, n));
    budget -= n;
  }
  // 3. Admissions.
  const int64_t bs = opt_.block_size;
  while (!waiting_.empty() && int(running_.size()) < opt_.max_num_seqs && budget > 0) {
    const int idx = waiting_.front();
    Req& r = reqs_[size_t(idx)];
    if (r.preempted_now) break;  // not back in the step that preempted it
    const int64_t target = int64_t(r.seq.size());
    // Never reuse the block holding the last token: at least that token is computed (its
    // row produces the next token).
    std::vector<int32_t> hits = bm_.match_prefix(r.seq, (target - 1) / bs);
    if (noncausal_drafts())
      while (!hits.empty() && target - int64_t(hits.size()) * bs <= decode_threshold()) hits.pop_back();
    const int64_t ctx = int64_t(hits.size()) * bs;
    const int64_t n = chunk_len(target - ctx, budget, ctx);
    if (n == 0) break;
    const int64_t fresh = ceil_div(ctx + n, bs) - int64_t(hits.size());
    int64_t hits_cached = 0;
    for (int32_t b : hits) hits_cached += bm_.ref_count(b) == 0 ? 1 : 0;
    if (bm_.num_available() - hits_cached < fresh) break;  // FCFS: wait for blocks

    waiting_.pop_front();
    for (int32_t b : hits) bm_.acquire(b);
    r.blocks = hits;
    for (int64_t i = 0; i < fresh; ++i) {
      const int32_t b = bm_.allocate();
      KMLA_CHECK(b >= 0, "internal: block allocation failed after the availability check");
      r.blocks.push_back(b);
    }
    uint64_t parent = BlockManager::kRootHash;
    r.hashes.clear();
    for (size_t b = 0; b < hits.size(); ++b) {
      parent = BlockManager::chain_hash(parent, r.seq.data() + int64_t(b) * bs, int(bs));
      r.hashes.push_back(parent);
    }
    r.state = State::running;
    r.computed = ctx;
    r.prefill_target = target;
    records_[size_t(idx)].prefix_hit_tokens += ctx;
    running_.push_back(idx);
    ScheduledChunk c = make_chunk(idx, n);
    c.admitted = true;
    plan.chunks.push_back(std::move(c));
    budget -= n;
  }
  return plan;
}

void Scheduler::publish_full_blocks(Req& r) {
  // Rows computed by a non-causal decode block depend on the drafts that followed them, so
  // with non-causal drafts only the rows of this admission's prefill are shared.
  const int64_t bs = opt_.block_size;
  const int64_t limit = noncausal_drafts() ? std::min(r.computed, r.prefill_target) : r.computed;
  const int64_t full = limit / bs;
  for (int64_t b = int64_t(r.hashes.size()); b < full; ++b) {
    const uint64_t parent = b == 0 ? BlockManager::kRootHash : r.hashes[size_t(b - 1)];
    const int32_t* tokens = r.seq.data() + b * bs;
    bm_.publish(r.blocks[size_t(b)], parent, tokens);
    r.hashes.push_back(BlockManager::chain_hash(parent, tokens, int(bs)));
  }
}

void Scheduler::complete(const StepPlan& plan, double now) {
  const int64_t bs = opt_.block_size;
  for (const ScheduledChunk& c : plan.chunks) {
    const int idx = c.request;
    Req& r = reqs_[size_t(idx)];
    RequestRecord& rec = records_[size_t(idx)];
    KMLA_CHECK(r.state == State::running && c.context_len == r.computed,
               "internal: a completed chunk of request ", r.tr->id, " does not match its state");
    r.computed = c.context_len + c.kept;
    rec.computed_tokens += int64_t(c.tokens.size());
    rec.rejected_tokens += int64_t(c.tokens.size()) - c.kept;
    // Every valid row at or past the last prompt token produces one token.
    const int64_t produced = c.decode ? c.kept : (r.computed == r.prefill_target ? 1 : 0);
    for (int64_t i = 0; i < produced; ++i) {
      r.seq.push_back(generated_token(opt_.seed, r.tr->id, r.generated));
      r.generated++;
    }
    if (r.generated > 0 && rec.first_token_s < 0) rec.first_token_s = now;
    // Rejected drafts' rows are rolled back: blocks past the valid rows hold nothing.
    while (int64_t(r.blocks.size()) > ceil_div(r.computed, bs)) {
      bm_.release(r.blocks.back());
      r.blocks.pop_back();
    }
    publish_full_blocks(r);
    if (r.generated == r.tr->output_len) {
      release_all(r);
      r.state = State::finished;
      rec.finish_s = now;
      running_.erase(std::find(running_.begin(), running_.end(), idx));
      finished_++;
    }
  }
}

}  // namespace kmla::engine
