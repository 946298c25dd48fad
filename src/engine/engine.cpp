// The serving engine: a trace served through a stack of MLA layers (CPU backend) by the
// scheduler and block manager, then the oracle check.
//
// The model around the layers (kmla implements attention only, so the rest is the smallest
// honest stand-in):
//  * Embedding: token t -> a row of hidden_size values uniform in [-sqrt(3), sqrt(3)] (unit
//    variance) from a splitmix stream seeded by (seed, t), rounded to the activation dtype.
//    Rows are generated on the fly; no table.
//  * Stack: x_{l+1} = act(x_l + layer_l(act(rmsnorm(x_l)))), a pre-norm residual block with a
//    weightless fp32 RMSNorm (eps from the config). Layer l has weights
//    MlaWeights::random(config, seed + l) and its own LatentCache; all caches share the
//    geometry and the block ids, so one block table per request serves every layer.
//  * Output: the final x of a row is that row's hidden output; the row at position p of a
//    request "produces" its token p + 1 (teacher-forced: scheduler.hpp, generated_token).
//
// Timing: one run clock, std::chrono::steady_clock from the start of run(). A request is
// admitted only once the clock has passed its arrival. When nothing is running or waiting,
// the clock jumps to the next arrival instead of sleeping (the skipped time is added, so all
// times in the result - arrivals, first tokens, finishes, step starts, wall_s - are on that
// one clock).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <thread>

#include "core/random.hpp"
#include "engine/scheduler.hpp"
#include "kmla/engine.hpp"
#ifdef KMLA_HAVE_CUDA
#include "kmla/cuda.hpp"
#endif
#include "kmla/error.hpp"
#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "kmla/rope.hpp"

namespace kmla::engine {

// ---- the oracle bound ---------------------------------------------------------------------
// Fixed here, before any run. The check compares the engine's final hidden states with an fp64
// stack (exact oracle layers, fp64 norm and residual) recomputing the request as one fresh
// prefill, and measures rel = max|engine - oracle| / max|oracle|.
//
// The final stream is the embedding plus L layer outputs; here each output is about as large
// as the embedding (max|y| ~ 0.6 max|x_L|), so every layer's error carries into max|x_L| at
// about its own relative size. Per layer, with a 16-bit cache:
//  * the layer itself: SPEC 1b allows twice a plain same-precision implementation's error
//    plus one activation ulp, a few bf16 ulps (2^-8 each) of the layer output;
//  * the residual add's rounding: half an ulp of x, at most 2^-8 of max|x|;
//  * the next layer reads an input off by the above and carries it on with a gain of about
//    one (pre-norm: the norm removes scale, the residual keeps the error).
// That is about 2^-7 of max|x_L| per layer for bf16; the bound takes 2^-6 per layer (2x),
// L * 2^-6 (2^-5 for the default 2 layers). fp16 has 3 more mantissa bits: L * 2^-9.
// fp8 and fp8_ds_mla caches: decode and context rows read e4m3 keys and values (and, for plain
// fp8, an e4m3 decode query), each element within e4m3's half ulp, 2^-4, while the oracle's
// fresh prefill attends to unquantized keys. Softmax weights sum to one, so the attended
// latent errs by at most ~2^-4 of its size, and the layer output (at most ~0.6 max|x_L|) by
// ~2^-4.7 of max|x_L|; with the 16-bit share that is under 2^-4 per layer: L * 2^-4.
// Measured with 2 layers (the kimi-k3 TP-8 slice and the test configs): bf16 4.7e-3 to 6.1e-3
// against 3.1e-2; fp16 5.6e-4 to 8.0e-4 against 3.9e-3; fp8 and fp8_ds_mla 6.8e-3 to 2.1e-2
// against 0.125.
double oracle_bound(CacheFormat format, int num_layers) {
  KMLA_CHECK(num_layers >= 1, "num_layers must be >= 1, got ", num_layers);
  double per_layer = 0;
  switch (format) {
    case CacheFormat::bf16: per_layer = 0x1p-6; break;
    case CacheFormat::fp16: per_layer = 0x1p-9; break;
    case CacheFormat::fp8:
    case CacheFormat::fp8_ds_mla: per_layer = 0x1p-4; break;
  }
  return per_layer * num_layers;
}

namespace {

using Clock = std::chrono::steady_clock;

uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr uint64_t kEmbedSalt = 0x656d626564ull;  // "embed"

DType activation_for(CacheFormat f) { return f == CacheFormat::fp16 ? DType::f16 : DType::bf16; }

uint16_t to_act(float x, DType act) { return act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x); }
float from_act(uint16_t x, DType act) { return act == DType::bf16 ? bf16_to_float(x) : fp16_to_float(x); }

// The embedding row of a token (see the top of the file).
void embed(uint64_t seed, int32_t token, DType act, int64_t n, uint16_t* out) {
  Random g(mix64(mix64(seed ^ kEmbedSalt) + uint64_t(uint32_t(token))));
  constexpr double kHalfWidth = 1.7320508075688772;  // sqrt(3): unit variance
  for (int64_t i = 0; i < n; ++i) out[i] = to_act(float((2 * g.uniform() - 1) * kHalfWidth), act);
}

// Weightless RMSNorm in fp32, one rounding to act: rows of n values.
void rms_norm_rows(const uint16_t* x, int64_t rows, int64_t n, float eps, DType act, uint16_t* out) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t t = 0; t < rows; ++t) {
    float ss = 0;
    for (int64_t i = 0; i < n; ++i) {
      v[size_t(i)] = from_act(x[t * n + i], act);
      ss += v[size_t(i)] * v[size_t(i)];
    }
    const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[t * n + i] = to_act(v[size_t(i)] * inv, act);
  }
}

// The default cache size when EngineOptions::num_blocks is 0 (see default_num_blocks).
constexpr int64_t kDefaultCacheNum = 3, kDefaultCacheDen = 4;

// One oracle step: a request's rows [context, context + tokens) run as one layer call.
struct OracleStep {
  int64_t context = 0;
  std::vector<int32_t> tokens;
  int32_t kept = 0;
};

// What the engine keeps of a request chosen for the oracle check.
struct CheckRecord {
  int index = 0;                  // into the trace
  std::vector<uint16_t> hidden;   // [rows, hidden]: the last valid computation of each row
  std::vector<char> have;         // [rows]: computed by this request (not a prefix hit)
  int64_t prefill_len = 0;        // non-causal drafts: the last admission's prefill rows
  std::vector<OracleStep> decodes;  // non-causal drafts: the last admission's decode blocks
};

}  // namespace

struct Engine::Impl {
  EngineOptions opt;
  MlaConfig cfg;
  DType act = DType::bf16;
  std::vector<MlaWeights> weights;
  // With opt.all_reduce: the unsharded layer the ranks compute together, for the oracle.
  MlaConfig oracle_cfg;
  std::vector<MlaWeights> full_weights;
  std::vector<MlaLayer> layers;
#ifdef KMLA_HAVE_CUDA
  std::vector<cuda::Layer> gpu_layers;  // opt.cuda: the same layers on the GPU
#endif
  std::shared_ptr<const RopeTable> rope;

  explicit Impl(EngineOptions o);
  void build_layers(int64_t positions_needed);
  int64_t default_num_blocks(const Trace& trace) const;
  CheckResult oracle_check(const Trace& trace, const CheckRecord& rec, bool replay) const;
  RunResult run(const Trace& trace, const std::function<void(const Progress&)>& on_step);
};

Engine::Impl::Impl(EngineOptions o) : opt(std::move(o)), cfg(opt.config) {
  cfg.validate();
  KMLA_CHECK(opt.num_layers >= 1, "num_layers must be >= 1, got ", opt.num_layers);
  KMLA_CHECK(opt.block_size >= 1 && opt.block_size <= 1024, "block_size must be in [1, 1024], got ",
             opt.block_size);
  KMLA_CHECK(opt.num_blocks >= 0, "num_blocks must be >= 0 (0 = sized from the trace), got ", opt.num_blocks);
  KMLA_CHECK(opt.token_budget >= 1, "token_budget must be >= 1, got ", opt.token_budget);
  KMLA_CHECK(opt.max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", opt.max_num_seqs);
  KMLA_CHECK(opt.spec_tokens >= 0 && opt.spec_tokens <= 127, "spec_tokens must be in [0, 127], got ",
             opt.spec_tokens);
  // Every prefill with context needs one workspace row per chunk (plan_batch).
  KMLA_CHECK(opt.workspace_tokens >= opt.max_num_seqs, "workspace_tokens ", opt.workspace_tokens,
             " must be >= max_num_seqs ", opt.max_num_seqs);
  KMLA_CHECK(opt.check_requests >= 0, "check_requests must be >= 0, got ", opt.check_requests);
  KMLA_CHECK(opt.num_threads >= 0, "num_threads must be >= 0 (0 = all), got ", opt.num_threads);
#ifdef KMLA_HAVE_CUDA
  KMLA_CHECK(!opt.cuda || cuda::available(), "the engine was asked to run on the GPU, but no CUDA GPU is present");
#else
  KMLA_CHECK(!opt.cuda, "the engine was asked to run on the GPU, but this build has no CUDA backend");
#endif
  act = activation_for(opt.cache_format);
  oracle_cfg = cfg;
  if (opt.all_reduce && cfg.tp_size > 1) {
    KMLA_CHECK(opt.cuda, "a tensor-parallel all-reduce needs the CUDA backend (--cuda)");
    oracle_cfg.tp_rank = 0;
    oracle_cfg.tp_size = 1;
    for (int l = 0; l < opt.num_layers; ++l) {
      full_weights.push_back(MlaWeights::random(oracle_cfg, opt.seed + uint64_t(l), act));
      weights.push_back(full_weights.back().tp_slice(oracle_cfg, cfg.tp_rank, cfg.tp_size));
    }
    return;
  }
  for (int l = 0; l < opt.num_layers; ++l) weights.push_back(MlaWeights::random(cfg, opt.seed + uint64_t(l), act));
}

// Layers are built on the first run, and again when a trace needs more RoPE rows than the
// table has (the table is cut to the trace: kimi-k3's default table would have 2^20 rows).
void Engine::Impl::build_layers(int64_t positions_needed) {
  if (cfg.use_rope) {
    KMLA_CHECK(positions_needed <= cfg.rope_table_rows(), "the trace needs positions up to ",
               positions_needed - 1, ", the RoPE table of '", cfg.name, "' has ", cfg.rope_table_rows(), " rows");
    if (!layers.empty() && rope->rows() >= positions_needed) return;
    rope = RopeTable::build(cfg, std::max<int64_t>(positions_needed, 1));
  } else if (!layers.empty()) {
    return;
  }
  layers.clear();
  LayerOptions lo;
  lo.activation = act;
  lo.num_threads = opt.num_threads;
  lo.partial_output = cfg.tp_size > 1;  // one rank of the group: its partial o_proj sum
  for (int l = 0; l < opt.num_layers; ++l) layers.emplace_back(cfg, weights[size_t(l)], lo, rope);
#ifdef KMLA_HAVE_CUDA
  gpu_layers.clear();
  if (opt.cuda) {
    cuda::LayerOptions clo;
    clo.activation = act;
    clo.partial_output = lo.partial_output && !opt.all_reduce;
    if (cfg.tp_size > 1) clo.all_reduce = opt.all_reduce;
    for (int l = 0; l < opt.num_layers; ++l) gpu_layers.emplace_back(cfg, weights[size_t(l)], clo, rope);
  }
#endif
}

// Without an explicit num_blocks the cache holds 3/4 of what max_num_seqs of the trace's
// longest requests need at their longest, and at least twice the longest request. So:
//  * no deadlock: the oldest running request can always grow (it fits alone, the others
//    are preempted for it), and a second request fits beside the longest;
//  * some pressure: when the trace has about max_num_seqs requests or more, not all of them
//    fit at their longest at once, so finished requests' cached prefix blocks are evicted
//    and now and then a running request is preempted, as in a real deployment that sizes
//    its cache to memory rather than to the workload.
int64_t Engine::Impl::default_num_blocks(const Trace& trace) const {
  std::vector<int64_t> need;
  for (const TraceRequest& r : trace.requests) need.push_back(Scheduler::blocks_needed(r, opt.block_size));
  std::sort(need.rbegin(), need.rend());
  int64_t longest = need.empty() ? 1 : need.front(), top = 0;
  for (size_t i = 0; i < need.size() && i < size_t(opt.max_num_seqs); ++i) top += need[i];
  return std::max<int64_t>(2 * longest, (top * kDefaultCacheNum + kDefaultCacheDen - 1) / kDefaultCacheDen);
}

// Recomputes a checked request through an fp64 stack: the oracle layers (exact rounding,
// the same weights, a fresh cache of the same format), an fp64 RMSNorm whose output is
// rounded to act (the oracle takes act inputs) and an fp64 residual. Causal layers: the whole
// sequence (prompt + generated tokens but the last) as one fresh prefill, an independent
// check of every path the engine took (decode, chunked context, prefix hits, recompute).
// With non-causal drafts a decode row depends on the drafts beside it, so the oracle replays
// the last admission: its prefill rows as one fresh prefill, then its decode blocks as run.
CheckResult Engine::Impl::oracle_check(const Trace& trace, const CheckRecord& rec, bool replay) const {
  const TraceRequest& tr = trace.requests[size_t(rec.index)];
  const int64_t rows = int64_t(tr.prompt.size()) + tr.output_len - 1;
  const int64_t hs = cfg.hidden_size;
  std::vector<int32_t> seq = tr.prompt;
  for (int32_t j = 0; int64_t(seq.size()) < rows; ++j) seq.push_back(generated_token(opt.seed, tr.id, j));

  std::vector<OracleStep> steps;
  if (!replay) {
    steps.push_back({0, seq, int32_t(rows)});
  } else {
    steps.push_back({0, std::vector<int32_t>(seq.begin(), seq.begin() + rec.prefill_len), int32_t(rec.prefill_len)});
    steps.insert(steps.end(), rec.decodes.begin(), rec.decodes.end());
  }
  int64_t max_rows = 0;
  for (const OracleStep& s : steps) max_rows = std::max<int64_t>(max_rows, s.context + int64_t(s.tokens.size()));
  const int bs = opt.block_size;
  const int64_t nb = (max_rows + bs - 1) / bs;
  std::vector<int32_t> table(static_cast<size_t>(nb));
  for (int64_t b = 0; b < nb; ++b) table[size_t(b)] = int32_t(b);
  std::vector<LatentCache> caches;
  for (int l = 0; l < opt.num_layers; ++l)
    caches.push_back(LatentCache::allocate(opt.cache_format, bs, nb, weights[size_t(l)].k_scale));
  BatchOptions bo;
  bo.decode_threshold = 1 + opt.spec_tokens;
  bo.non_causal_decode = cfg.non_causal_multi_token_decode;
  bo.workspace_tokens = std::max<int64_t>(max_rows, 1);  // one context chunk: no merge needed

  std::vector<double> final_x(size_t(rows * hs), 0.0);
  std::vector<char> have(size_t(rows), 0);
  reference::Options ro;
  ro.rounding = reference::Rounding::exact;
  ro.activation = act;
  for (const OracleStep& s : steps) {
    const int64_t q = int64_t(s.tokens.size());
    const BatchMetadata md = plan_batch({RequestSpec{int32_t(q), int32_t(s.context), table}}, caches[0].geometry(), bo);
    HostTensor pos(DType::i64, {q});
    std::copy(md.positions.begin(), md.positions.end(), pos.data<int64_t>());
    std::vector<double> x(size_t(q * hs));
    std::vector<uint16_t> row(static_cast<size_t>(hs));
    for (int64_t t = 0; t < q; ++t) {
      embed(opt.seed, s.tokens[size_t(t)], act, hs, row.data());
      for (int64_t i = 0; i < hs; ++i) x[size_t(t * hs + i)] = from_act(row[size_t(i)], act);
    }
    HostTensor in(act, {q, hs});
    for (int l = 0; l < opt.num_layers; ++l) {
      for (int64_t t = 0; t < q; ++t) {
        const double* xt = x.data() + t * hs;
        double ss = 0;
        for (int64_t i = 0; i < hs; ++i) ss += xt[i] * xt[i];
        const double inv = 1.0 / std::sqrt(ss / double(hs) + cfg.rms_norm_eps);
        for (int64_t i = 0; i < hs; ++i) in.data<uint16_t>()[t * hs + i] = to_act(float(xt[i] * inv), act);
      }
      const MlaWeights& w = full_weights.empty() ? weights[size_t(l)] : full_weights[size_t(l)];
      const reference::Result res = reference::forward(oracle_cfg, w, rope.get(), pos.view(), in.view(), &md,
                                                       caches[size_t(l)], ro);
      for (size_t i = 0; i < x.size(); ++i) x[i] += res.out[i];
    }
    for (int64_t t = 0; t < s.kept; ++t) {
      const int64_t p = s.context + t;
      std::copy(x.begin() + t * hs, x.begin() + (t + 1) * hs, final_x.begin() + p * hs);
      have[size_t(p)] = 1;
    }
  }

  CheckResult c;
  c.request_id = tr.id;
  c.bound = oracle_bound(opt.cache_format, opt.num_layers);
  bool finite = true;
  for (int64_t p = 0; p < rows; ++p) {
    if (!rec.have[size_t(p)]) continue;  // a prefix hit: computed by another request
    KMLA_CHECK(have[size_t(p)], "internal: the oracle did not compute row ", p, " of request ", tr.id);
    c.tokens++;
    for (int64_t i = 0; i < hs; ++i) {
      const double ref = final_x[size_t(p * hs + i)];
      const double eng = from_act(rec.hidden[size_t(p * hs + i)], act);
      if (!std::isfinite(ref) || !std::isfinite(eng)) finite = false;
      c.max_ref = std::max(c.max_ref, std::fabs(ref));
      c.max_err = std::max(c.max_err, std::fabs(eng - ref));
    }
  }
  c.rel_err = c.max_ref > 0 ? c.max_err / c.max_ref : (c.max_err > 0 ? INFINITY : 0.0);
  c.pass = finite && c.tokens > 0 && c.rel_err <= c.bound;
  return c;
}

RunResult Engine::Impl::run(const Trace& trace, const std::function<void(const Progress&)>& on_step) {
  RunResult res;
  res.options = opt;
  res.model = cfg.name;
  const int N = int(trace.requests.size());
  const int64_t hs = cfg.hidden_size;

  // Tensor-parallel ranks must plan the same steps (and so issue the same collectives): with
  // requests arriving over time they need one clock (agree_clock), else only a trace that
  // arrives all at once is safe.
  if (opt.all_reduce && !opt.agree_clock)
    for (const TraceRequest& r : trace.requests)
      KMLA_CHECK(r.arrival_s == 0, "request ", r.id, " arrives at ", r.arrival_s,
                 " s: a tensor-parallel run without a shared clock needs every request to arrive at 0");
  int64_t longest_rows = 1;
  for (const TraceRequest& r : trace.requests)
    longest_rows = std::max<int64_t>(longest_rows, int64_t(r.prompt.size()) + r.output_len - 1);
  build_layers(longest_rows);

  SchedulerOptions so;
  so.block_size = opt.block_size;
  so.num_blocks = opt.num_blocks > 0 ? opt.num_blocks : default_num_blocks(trace);
  so.token_budget = opt.token_budget;
  so.max_num_seqs = opt.max_num_seqs;
  so.prefix_caching = opt.prefix_caching;
  so.spec_tokens = opt.spec_tokens;
  so.spec_accept_rate = opt.spec_accept_rate;
  so.non_causal_decode = cfg.non_causal_multi_token_decode;
  so.seed = opt.seed;
  Scheduler sched(trace, so);  // validates the trace and that every request fits
  res.options.num_blocks = so.num_blocks;
  res.total_blocks = so.num_blocks;

  std::vector<LatentCache> caches;
#ifdef KMLA_HAVE_CUDA
  std::vector<cuda::DeviceCache> gpu_caches;
#endif
  for (int l = 0; l < opt.num_layers; ++l) {
#ifdef KMLA_HAVE_CUDA
    if (opt.cuda) {
      gpu_caches.push_back(cuda::DeviceCache::allocate(opt.cache_format, opt.block_size, so.num_blocks,
                                                       weights[size_t(l)].k_scale));
      caches.push_back(gpu_caches.back().cache);
      continue;
    }
#endif
    caches.push_back(LatentCache::allocate(opt.cache_format, opt.block_size, so.num_blocks, weights[size_t(l)].k_scale));
  }

  // The requests the oracle checks: the shortest (fewest rows), chosen before the run.
  const bool replay = cfg.non_causal_multi_token_decode && opt.spec_tokens > 0;
  std::vector<CheckRecord> checks;
  std::vector<int> check_of(size_t(N), -1);
  {
    std::vector<int> order(static_cast<size_t>(N));
    for (int i = 0; i < N; ++i) order[size_t(i)] = i;
    auto rows_of = [&](int i) {
      return int64_t(trace.requests[size_t(i)].prompt.size()) + trace.requests[size_t(i)].output_len;
    };
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rows_of(a) < rows_of(b); });
    for (int k = 0; k < std::min(N, opt.check_requests); ++k) {
      CheckRecord c;
      c.index = order[size_t(k)];
      const int64_t rows = rows_of(c.index) - 1;
      c.hidden.assign(size_t(rows * hs), 0);
      c.have.assign(size_t(rows), 0);
      check_of[size_t(c.index)] = int(checks.size());
      checks.push_back(std::move(c));
    }
  }
  std::vector<std::vector<uint16_t>> outputs(opt.record_outputs ? size_t(N) : 0);
  for (int i = 0; i < int(outputs.size()); ++i)
    outputs[size_t(i)].assign(size_t(trace.requests[size_t(i)].output_len * hs), 0);

  BatchOptions bo;
  bo.decode_threshold = sched.decode_threshold();
  bo.non_causal_decode = cfg.non_causal_multi_token_decode;
  bo.workspace_tokens = opt.workspace_tokens;
  const CacheGeometry geo = caches[0].geometry();
  const float eps = float(cfg.rms_norm_eps);

  const Clock::time_point t0 = Clock::now();
  double skipped = 0;
  auto now_s = [&] { return std::chrono::duration<double>(Clock::now() - t0).count() + skipped; };

  std::vector<uint16_t> x_caller, x, normed, y;
  while (!sched.done()) {
    const double start = opt.agree_clock ? opt.agree_clock(now_s()) : now_s();
    if (!sched.has_work(start)) {  // idle: jump to the next arrival
      skipped += sched.next_arrival() - start;
      continue;
    }
    StepPlan plan = sched.schedule(start);
    KMLA_CHECK(!plan.chunks.empty(), "internal: the scheduler planned an empty step with work pending");
    res.peak_blocks = std::max(res.peak_blocks, sched.blocks().num_used());

    // The batch in the scheduler's order (decodes, then prefill chunks), then the layout.
    std::vector<RequestSpec> specs;
    for (const ScheduledChunk& c : plan.chunks)
      specs.push_back(RequestSpec{int32_t(c.tokens.size()), int32_t(c.context_len), c.block_table});
    const BatchMetadata md = plan_batch(specs, geo, bo);
    const int64_t T = md.num_tokens;
    x_caller.resize(size_t(T * hs));
    {
      int64_t row = 0;
      for (const ScheduledChunk& c : plan.chunks)
        for (int32_t tok : c.tokens) embed(opt.seed, tok, act, hs, x_caller.data() + (row++) * hs);
    }
    x.resize(x_caller.size());
    normed.resize(x_caller.size());
    y.resize(x_caller.size());
    permute_rows(md, x_caller.data(), x.data(), hs, sizeof(uint16_t), true);
    HostTensor pos(DType::i64, {T});
    std::copy(md.positions.begin(), md.positions.end(), pos.data<int64_t>());
    const TensorView in_view(normed.data(), act, {T, hs}), out_view(y.data(), act, {T, hs});
#ifdef KMLA_HAVE_CUDA
    // On the GPU: the step's activations and positions in device buffers; the residual
    // stream stays on the host, as on the CPU path, so both paths share everything else.
    cuda::DeviceBuffer d_in, d_out, d_pos;
    TensorView din, dout, dpos;
    if (opt.cuda) {
      d_in = cuda::DeviceBuffer(in_view.bytes());
      d_out = cuda::DeviceBuffer(out_view.bytes());
      d_pos = cuda::DeviceBuffer(pos.bytes());
      din = d_in.view(act, {T, hs});
      dout = d_out.view(act, {T, hs});
      dpos = d_pos.view(DType::i64, {T});
      cuda::copy_to_device(pos.view(), dpos, nullptr);
    }
#endif
    for (int l = 0; l < opt.num_layers; ++l) {
      rms_norm_rows(x.data(), T, hs, eps, act, normed.data());
#ifdef KMLA_HAVE_CUDA
      if (opt.cuda) {
        cuda::copy_to_device(in_view, din, nullptr);
        gpu_layers[size_t(l)].forward(dpos, din, &md, caches[size_t(l)], dout, nullptr);
        cuda::copy_to_host(dout, out_view, nullptr);
        gpu_layers[size_t(l)].check_errors(nullptr);  // waits for the copy; throws if a kernel refused
      } else
#endif
      layers[size_t(l)].forward(pos.view(), in_view, &md, caches[size_t(l)], out_view);
      for (size_t i = 0; i < x.size(); ++i) x[i] = to_act(from_act(x[i], act) + from_act(y[i], act), act);
    }
    permute_rows(md, x.data(), x_caller.data(), hs, sizeof(uint16_t), false);

    // Keep the rows somebody will look at: outputs (rows producing tokens) and checked requests.
    {
      int64_t row = 0;
      for (const ScheduledChunk& c : plan.chunks) {
        const TraceRequest& tr = trace.requests[size_t(c.request)];
        const int64_t first_out = int64_t(tr.prompt.size()) - 1;
        const int ci = check_of[size_t(c.request)];
        CheckRecord* cr = ci >= 0 ? &checks[size_t(ci)] : nullptr;
        if (cr && replay) {
          if (c.admitted) {
            cr->prefill_len = c.prefill_target;
            cr->decodes.clear();
          }
          if (c.decode) cr->decodes.push_back({c.context_len, c.tokens, c.kept});
        }
        for (int32_t t = 0; t < c.kept; ++t) {
          const int64_t p = c.context_len + t;
          const uint16_t* src = x_caller.data() + (row + t) * hs;
          if (cr) {
            std::copy(src, src + hs, cr->hidden.begin() + p * hs);
            cr->have[size_t(p)] = 1;
          }
          if (!outputs.empty() && p >= first_out)
            std::copy(src, src + hs, outputs[size_t(c.request)].begin() + (p - first_out) * hs);
        }
        row += int64_t(c.tokens.size());
      }
    }

    const double end = now_s();
    sched.complete(plan, end);
    StepRecord st;
    st.start_s = start;
    st.duration_s = end - start;
    for (const ScheduledChunk& c : plan.chunks) {
      if (c.decode) {
        st.decode_requests++;
        st.decode_tokens += int64_t(c.tokens.size());
      } else {
        st.prefill_requests++;
        st.prefill_tokens += int64_t(c.tokens.size());
      }
    }
    st.running = sched.num_running();
    st.waiting = sched.num_waiting(end);
    st.blocks_used = sched.blocks().num_used();
    st.blocks_cached = sched.blocks().num_cached();
    st.preempted = plan.preempted;
    res.decode_tokens_computed += st.decode_tokens;
    res.prefill_tokens_computed += st.prefill_tokens;
    res.steps.push_back(st);
    if (on_step) on_step(Progress{sched.num_finished(), N, int64_t(res.steps.size()), &res.steps.back()});
  }
  res.wall_s = now_s();

  // The run's own accounting, checked: nothing lost, every block back.
  const BlockManager& bm = sched.blocks();
  bm.check_invariants();
  KMLA_CHECK(bm.num_used() == 0, "internal: ", bm.num_used(), " blocks still in use after the run");
  res.requests = sched.records();
  for (int i = 0; i < N; ++i) {
    RequestRecord& q = res.requests[size_t(i)];
    KMLA_CHECK(sched.generated(i) == q.output_len, "internal: request ", q.id, " generated ",
               sched.generated(i), " of ", q.output_len, " tokens");
    KMLA_CHECK(q.computed_tokens + q.prefix_hit_tokens ==
                   int64_t(q.prompt_len) + q.output_len - 1 + q.recomputed_tokens + q.rejected_tokens,
               "internal: request ", q.id, "'s token accounting does not add up");
    res.prompt_tokens += q.prompt_len;
    res.generated_tokens += q.output_len;
    res.prefix_hit_tokens += q.prefix_hit_tokens;
    if (!outputs.empty()) q.outputs = std::move(outputs[size_t(i)]);
  }
  res.preemptions = sched.preemptions();
  res.evicted_blocks = bm.evictions();
  res.peak_cache_bytes = res.peak_blocks * opt.block_size * int64_t(cache_entry_bytes(opt.cache_format)) *
                         opt.num_layers;
  res.all_finished = sched.done();

  // The oracle checks, one thread each (they are independent and single-threaded).
  res.checks.resize(checks.size());
  std::vector<std::exception_ptr> errors(checks.size());
  const int threads = std::max(1, opt.num_threads > 0 ? opt.num_threads : int(std::thread::hardware_concurrency()));
  for (size_t k0 = 0; k0 < checks.size(); k0 += size_t(threads)) {
    std::vector<std::thread> pool;
    for (size_t k = k0; k < std::min(checks.size(), k0 + size_t(threads)); ++k)
      pool.emplace_back([&, k] {
        try {
          res.checks[k] = oracle_check(trace, checks[k], replay);
        } catch (...) {
          errors[k] = std::current_exception();
        }
      });
    for (std::thread& t : pool) t.join();
  }
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return res;
}

Engine::Engine(EngineOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Engine::~Engine() = default;
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;

RunResult Engine::run(const Trace& trace, const std::function<void(const Progress&)>& on_step) {
  return impl_->run(trace, on_step);
}

}  // namespace kmla::engine
