// The serving engine behind `kmla run`: a request trace served through a stack of MLA
// layers with a paged, prefix-cached latent cache, continuous batching under a token budget,
// chunked prefill, optional speculative blocks and preemption by recompute.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/cuda.hpp"

namespace kmla::engine {

// ---- workloads ---------------------------------------------------------------------
struct TraceRequest {
  int64_t id = 0;
  double arrival_s = 0;             // seconds after the start of the run
  std::vector<int32_t> prompt;      // token ids (prefix caching hashes them)
  int32_t output_len = 1;           // tokens to generate
};

struct Trace {
  std::vector<TraceRequest> requests;  // sorted by arrival
};

// The defaults are sized so that `kmla run` on the kimi-k3 TP-8 slice (2 layers, bf16 cache)
// finishes in well under a minute on a 2-core machine, oracle check included: about 4k
// tokens through the stack at ~160 MFLOP each (measured 27-35 s on the shared 2-core box).
struct TraceOptions {
  int num_requests = 20;
  double arrival_rate = 0;        // requests per second (Poisson); 0 = all arrive at once
  int prompt_len_mean = 256;      // log-normal prompt lengths, clamped to [min, max]
  int prompt_len_min = 16;
  int prompt_len_max = 768;
  int output_len_mean = 24;       // log-normal output lengths, clamped to [min, max]
  int output_len_min = 4;
  int output_len_max = 64;
  double shared_prefix_fraction = 0.5;  // requests that start with one of a few shared prefixes
  int num_prefix_groups = 3;
  int prefix_len = 192;                 // tokens of each shared prefix (a "system prompt")
  int vocab_size = 32000;
  uint64_t seed = 1;
};

// The built-in default trace: realistic length distributions with shared prefixes.
Trace default_trace(const TraceOptions& options);
// JSON lines, one request each: {"prompt_len": N} or {"prompt": [ids...]}, optional
// "output_len" (default 16), "arrival_s" (default 0), "prefix_group" (requests of one group
// share their first "prefix_len" tokens), "id". Errors name the file and line.
// Details (src/engine/trace.cpp): blank lines are skipped; unknown keys are errors;
// "prefix_group" (an integer or a string) needs "prefix_len" (1..prompt_len) and a
// "prompt_len" line; tokens not given are pseudo-random from (seed, group or line); "id"
// defaults to the request's index in the file and must be unique; requests are sorted by
// arrival (stable).
Trace load_trace_jsonl(const std::string& path, int vocab_size = 32000, uint64_t seed = 1);

// ---- the engine ----------------------------------------------------------------------
struct EngineOptions {
  MlaConfig config;                 // one rank's layer (e.g. kimi-k3 at its TP-8 slice); with
                                    // tp_size > 1 each layer returns the rank's partial o_proj sum
  // The activation (and weight) dtype follows the cache: f16 for an fp16 cache, else bf16.
  int num_layers = 2;               // MLA layers in the stack, each with its own weights/cache
  CacheFormat cache_format = CacheFormat::bf16;
  int block_size = 16;
  int64_t num_blocks = 0;           // per layer; 0: sized from the trace (3/4 of what max_num_seqs
                                    // of its longest requests need, at least 2x the longest)
  int64_t token_budget = 512;       // tokens per step (decodes first, then prefill chunks)
  int max_num_seqs = 32;            // running requests at most
  bool prefix_caching = true;
  int spec_tokens = 0;              // >0: each decode step verifies this many draft tokens causally
                                    // (or, for a non-causal draft layer, runs a non-causal block)
  double spec_accept_rate = 0.7;    // deterministic pseudo-random acceptance per draft token
  int64_t workspace_tokens = 4096;  // context chunk workspace
  uint64_t seed = 1;
  int num_threads = 0;              // CPU backend threads (0 = all)
  bool cuda = false;                // run the layers on the GPU (builds with the CUDA backend)
  int check_requests = 2;           // the shortest requests, recomputed by the fp64 oracle after the run
  // Keep every request's output rows in RequestRecord::outputs (tests compare schedules).
  bool record_outputs = false;
  // Tensor parallelism across processes (cuda only, config.tp_size > 1): each layer ends in
  // this all-reduce (e.g. dist::Communicator::layer_all_reduce), so every rank's outputs are
  // the whole layer's. The weights are then the full model's, drawn from the seed and sliced
  // to the rank (so the ranks agree), and the oracle check recomputes the unsharded layer.
  // Every rank must see the same schedule: with arrivals after 0, agree_clock must be set.
  std::function<void(const TensorView& out, cuda::Stream stream)> all_reduce;
  // Tensor parallelism: maps this rank's clock to one every rank shares (e.g. the largest,
  // dist::Communicator::max_across_ranks), read once per step, so that every rank admits the
  // same requests and plans the same steps. Empty: the local clock.
  std::function<double(double now_s)> agree_clock;
};

struct StepRecord {
  double start_s = 0;      // since the run started
  double duration_s = 0;
  int decode_requests = 0;
  int64_t decode_tokens = 0;
  int prefill_requests = 0;
  int64_t prefill_tokens = 0;
  int running = 0;         // requests holding cache blocks after the step
  int waiting = 0;         // arrived, not running, not finished
  int64_t blocks_used = 0;     // referenced blocks
  int64_t blocks_cached = 0;   // unreferenced blocks kept for prefix reuse
  int preempted = 0;           // requests preempted in this step
};

struct RequestRecord {
  int64_t id = 0;
  int32_t prompt_len = 0;
  int32_t output_len = 0;
  double arrival_s = 0;
  double first_token_s = -1;  // when the first generated token was produced
  double finish_s = -1;
  int preemptions = 0;
  int64_t prefix_hit_tokens = 0;   // tokens served from the prefix cache instead of computed
  int64_t computed_tokens = 0;     // tokens this request ran through the layers (recompute included)
  // computed_tokens + prefix_hit_tokens == prompt_len + output_len - 1 + recomputed_tokens
  // + rejected_tokens (prefix hits count on every admission, a re-admission included).
  int64_t recomputed_tokens = 0;   // rows valid when the request was preempted (made valid again)
  int64_t rejected_tokens = 0;     // draft tokens run and rolled back
  // With EngineOptions::record_outputs: the final hidden states (bits of the activation dtype)
  // of the rows that produce the generated tokens, positions prompt_len - 1 ...
  // prompt_len + output_len - 2: [output_len, hidden_size].
  std::vector<uint16_t> outputs;
};

struct CheckResult {
  int64_t request_id = 0;
  int64_t tokens = 0;      // rows compared (the request's prefix-cache hits were computed elsewhere)
  double max_ref = 0;
  double max_err = 0;
  double rel_err = 0;      // max_err / max_ref over the request's final hidden states
  double bound = 0;        // fixed in the code before the run, per cache format
  bool pass = false;
};

struct RunResult {
  EngineOptions options;
  std::string model;       // preset / config name
  double wall_s = 0;       // the run clock at the end (steps + idle gaps jumped over)
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t prefill_tokens_computed = 0;
  int64_t decode_tokens_computed = 0;
  int64_t prefix_hit_tokens = 0;
  int preemptions = 0;
  int64_t total_blocks = 0;
  int64_t peak_blocks = 0;        // most blocks referenced at once (during a step)
  int64_t peak_cache_bytes = 0;   // over all layers
  int64_t evicted_blocks = 0;     // cached prefix blocks reclaimed for new content
  std::vector<StepRecord> steps;
  std::vector<RequestRecord> requests;
  std::vector<CheckResult> checks;
  bool all_finished = false;
};

struct Progress {
  int finished = 0;
  int total = 0;
  int64_t step = 0;
  const StepRecord* last = nullptr;
};

class Engine {
 public:
  explicit Engine(EngineOptions options);
  ~Engine();
  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;
  // Serves the trace to completion. on_step is called after every step (progress display).
  // All times are on one run clock: real time since the start, except that when nothing is
  // running or waiting the clock jumps to the next arrival instead of sleeping. Throws
  // kmla::Error for a request that could never fit the cache, naming it.
  RunResult run(const Trace& trace, const std::function<void(const Progress&)>& on_step = {});

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The oracle check's bound on max|engine - oracle| / max|oracle| over a request's final hidden
// states: a constant per cache format and stack depth, fixed before any run (see engine.cpp).
double oracle_bound(CacheFormat format, int num_layers);

// ---- what the user sees (src/engine/report.cpp) ---------------------------------------
std::string summary_text(const RunResult& r);
std::string to_json(const RunResult& r);         // the whole result, machine-readable
std::string html_report(const RunResult& r);      // self-contained page with SVG charts
// A progress line ("[=====>    ] 12/24 requests, step 40, 1234 tok/s") for a terminal.
std::string progress_line(const Progress& p, double elapsed_s, int width = 40);

}  // namespace kmla::engine
