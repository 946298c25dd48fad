// The scheduler: continuous batching of a request trace under a per-step token budget, over
// the block manager. Pure bookkeeping (no arithmetic): the engine asks for a step plan, runs
// the layer stack on it and reports back. Tests drive it without layers.
//
// A request's life:
//   pending -> waiting (arrived) -> running (holds blocks) -> finished
//                       ^                |
//                       +-- preempted ---+   (blocks released; recomputed from scratch later)
// A running request is in its prefill phase until `prefill_target` tokens (its whole sequence
// at admission: the prompt, plus the tokens it had generated before a preemption) are valid
// in the cache; the last of them produces the next token. Then it decodes: each step runs its
// last token (plus draft tokens with speculative decoding), and every row that stays valid
// produces one more token. The generated tokens are teacher-forced (generated_token), so the
// outputs of two schedules of one trace are comparable row by row.
//
// One step (schedule()):
//   1. decodes of running requests, in admission order: 1 token, or 1 + k drafts;
//   2. the next prefill chunk of running requests still in their prefill phase;
//   3. admission of waiting requests (FCFS, preempted ones first) while fewer than
//      max_num_seqs run: a prefix-cache hit becomes context, the rest is chunked.
//   Steps 1-3 share the token budget; a chunk gets what is left, so a long prompt runs as a
//   fresh prefill followed by prefills with context. A decode or chunk that needs a block when
//   none is free or cached preempts the most recently admitted running request (possibly
//   itself). Admission never preempts: a request waits until its first chunk fits.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "engine/block_manager.hpp"
#include "kmla/engine.hpp"

namespace kmla::engine {

// Generated token ids lie in [0, kGeneratedVocab) (the default trace's vocabulary).
inline constexpr int32_t kGeneratedVocab = 32000;

// The token produced at output step j of request `request_id`: a deterministic function of
// (seed, request id, j), so every schedule of a trace generates the same tokens.
int32_t generated_token(uint64_t seed, int64_t request_id, int64_t j);

struct SchedulerOptions {
  int block_size = 16;
  int64_t num_blocks = 0;
  int64_t token_budget = 512;
  int max_num_seqs = 32;
  bool prefix_caching = true;
  int spec_tokens = 0;
  double spec_accept_rate = 0.7;
  // The layer's multi-token decode blocks are non-causal (the DSpark draft). With drafts,
  // prefill chunks with context are then kept longer than the decode threshold (else the
  // planner would classify them as non-causal decode blocks), and only rows computed by
  // prefill are published to the prefix cache (decode rows depend on the drafts after them).
  bool non_causal_decode = false;
  uint64_t seed = 1;
};

struct ScheduledChunk {
  int request = 0;              // index into the trace
  int64_t context_len = 0;      // rows already valid in the cache
  std::vector<int32_t> tokens;  // ids of the rows computed now, positions context_len...
  int32_t kept = 0;             // leading rows that stay valid (the rest are rejected drafts)
  bool decode = false;          // decode phase: the last token, plus drafts
  bool admitted = false;        // the first chunk since the request was (re)admitted
  int64_t prefill_target = 0;   // rows this admission runs as prefill (hit + chunks)
  std::vector<int32_t> block_table;  // covers context_len + tokens.size() rows
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // decodes first, then prefill chunks
  int preempted = 0;                   // requests preempted while planning this step
  int64_t num_tokens() const;
};

class Scheduler {
 public:
  // Throws kmla::Error for bad options, a malformed trace, or a request that could never fit
  // the cache (naming it).
  Scheduler(const Trace& trace, const SchedulerOptions& options);

  // Blocks a request holds at its longest: prompt + output - 1 rows (the last generated
  // token is never run), drafts included (they are capped by the tokens still to generate).
  static int64_t blocks_needed(const TraceRequest& r, int block_size);

  bool done() const { return finished_ == int(reqs_.size()); }
  // The earliest arrival that schedule() has not yet seen; +inf when all have arrived.
  double next_arrival() const;
  // Whether a step at time `now` would have anything to do.
  bool has_work(double now) const;
  StepPlan schedule(double now);
  // After the layers ran the plan: rows become valid, tokens are generated, blocks are
  // published, finished requests release their blocks. `now` stamps first tokens and finishes.
  void complete(const StepPlan& plan, double now);

  const BlockManager& blocks() const { return bm_; }
  const std::vector<RequestRecord>& records() const { return records_; }
  const std::vector<int32_t>& sequence(int request) const { return reqs_[size_t(request)].seq; }
  int64_t computed(int request) const { return reqs_[size_t(request)].computed; }
  int32_t generated(int request) const { return reqs_[size_t(request)].generated; }
  const std::vector<int32_t>& block_table(int request) const { return reqs_[size_t(request)].blocks; }
  int num_running() const { return int(running_.size()); }
  int num_waiting(double now) const;  // arrived by `now`, not running, not finished
  int num_finished() const { return finished_; }
  int preemptions() const { return preemptions_; }
  int decode_threshold() const { return 1 + opt_.spec_tokens; }

 private:
  enum class State : uint8_t { pending, waiting, running, finished };
  struct Req {
    const TraceRequest* tr = nullptr;
    std::vector<int32_t> seq;  // prompt + generated tokens
    int32_t generated = 0;
    int64_t computed = 0;        // valid rows in the cache
    int64_t prefill_target = 0;  // seq.size() at admission
    std::vector<int32_t> blocks;
    std::vector<uint64_t> hashes;  // chain hashes of the full valid blocks handled so far
    State state = State::pending;
    bool preempted_now = false;    // preempted while planning the current step
  };

  bool noncausal_drafts() const { return opt_.non_causal_decode && opt_.spec_tokens > 0; }
  int64_t chunk_len(int64_t remaining, int64_t budget, int64_t context) const;
  bool ensure_blocks(int idx, int64_t rows, StepPlan& plan, int64_t& budget);
  void preempt(int idx, StepPlan& plan, int64_t& budget);
  void release_all(Req& r);
  void publish_full_blocks(Req& r);
  ScheduledChunk make_chunk(int idx, int64_t n) const;
  ScheduledChunk make_decode(int idx) const;

  SchedulerOptions opt_;
  BlockManager bm_;
  std::vector<Req> reqs_;
  std::vector<RequestRecord> records_;
  std::vector<int> by_arrival_;  // request indices sorted by arrival (stable)
  size_t next_pending_ = 0;      // into by_arrival_
  std::deque<int> waiting_;      // preempted requests first, then arrivals in order
  std::vector<int> running_;     // admission order
  int finished_ = 0;
  int preemptions_ = 0;
};

}  // namespace kmla::engine
