// kmla: the command-line tool. `info` describes a layer, `verify` runs named cases through
// a backend and the fp64 oracle, `inspect` lists a checkpoint, `run` serves a request trace
// through the engine. Only this file turns kmla::Error into exit codes.
#include <CLI/CLI.hpp>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>

#include "kmla/cache.hpp"
#include "kmla/checkpoint.hpp"
#include "kmla/config.hpp"
#include "kmla/dist.hpp"
#include "kmla/engine.hpp"
#include "kmla/error.hpp"
#include "kmla/hf_config.hpp"
#include "kmla/weights.hpp"
#include "verify/cases.hpp"
#ifdef KMLA_HAVE_CUDA
#include "bench/bench.hpp"
#include "kmla/cuda.hpp"
#endif


// Exit status of a GPU command on a machine without a GPU (CTest's SKIP_RETURN_CODE).
constexpr int kExitNoGpu = 77;

namespace {

using kmla::CacheFormat;
using kmla::MlaConfig;
using nlohmann::json;

struct ModelArgs {
  std::string model = "kimi-k3";
  std::string config_path;
  int tp = 1;
  int rank = 0;
};

void add_model_args(CLI::App* app, ModelArgs& a) {
  app->add_option("--model", a.model, "model preset")->check(CLI::IsMember(MlaConfig::preset_names()));
  app->add_option("--config", a.config_path, "a Hugging Face config.json (or its directory) instead of a preset");
  app->add_option("--tp", a.tp, "tensor-parallel world size")->check(CLI::PositiveNumber);
  app->add_option("--rank", a.rank, "tensor-parallel rank")->check(CLI::NonNegativeNumber);
}

MlaConfig resolve(const ModelArgs& a) {
  MlaConfig c = a.config_path.empty() ? MlaConfig::preset(a.model) : kmla::load_hf_config(a.config_path).mla;
  if (a.tp > 1 || a.rank > 0) c = c.tp_slice(a.rank, a.tp);
  c.validate();
  return c;
}

const CacheFormat kFormats[] = {CacheFormat::bf16, CacheFormat::fp16, CacheFormat::fp8, CacheFormat::fp8_ds_mla};

// Weight bytes of one layer on one rank (16-bit weights).
int64_t weight_bytes(const MlaConfig& c) {
  const int64_t H = c.local_heads(), hid = c.hidden_size;
  int64_t n = int64_t(kmla::kLatentDim) * hid + kmla::kKvLoraRank;           // kv_a + norm
  if (c.q_lora_rank) n += int64_t(*c.q_lora_rank) * (hid + 1 + H * kmla::kQkHeadDim);
  else n += H * kmla::kQkHeadDim * hid;
  n += H * kmla::kKvBOut * kmla::kKvLoraRank;                                  // kv_b
  if (c.use_output_gate) n += H * kmla::kVDim * hid;                           // g_proj
  n += hid * H * kmla::kVDim;                                                  // o_proj
  return 2 * n;
}

int run_info(const ModelArgs& a, int64_t batch, int64_t context, int block_size, int64_t workspace, bool as_json) {
  const MlaConfig c = resolve(a);
  const int64_t blocks_per_seq = (context + block_size - 1) / block_size;
  json j;
  j["model"] = c.name;
  j["hidden_size"] = c.hidden_size;
  j["num_heads"] = c.num_heads;
  j["local_heads"] = c.local_heads();
  j["tp"] = {{"rank", c.tp_rank}, {"world_size", c.tp_size}};
  j["q_lora_rank"] = c.q_lora_rank ? json(*c.q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  j["latent_dim"] = MlaConfig::latent_dim();
  j["qk_head_dim"] = MlaConfig::qk_head_dim();
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope"] = c.use_rope ? json{{"type", kmla::rope_type_name(c.rope.type)}, {"theta", c.rope.theta},
                                {"factor", c.rope.factor}, {"table_rows", c.rope_table_rows()}}
                         : json(nullptr);
  j["output_gate"] = c.use_output_gate;
  j["non_causal_multi_token_decode"] = c.non_causal_multi_token_decode;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["softmax_scale"] = c.softmax_scale();
  j["weight_bytes_per_layer"] = weight_bytes(c);
  j["workload"] = {{"batch", batch}, {"context", context}, {"block_size", block_size},
                   {"blocks", batch * blocks_per_seq}};
  for (CacheFormat f : kFormats) {
    const int64_t per_token = int64_t(kmla::cache_entry_bytes(f));
    j["cache"][kmla::cache_format_name(f)] = {
        {"bytes_per_token", per_token},
        {"bytes_per_layer", batch * blocks_per_seq * block_size * per_token}};
  }
  // The context workspace holds gathered rows as 576 activations (bf16) per token.
  j["context_workspace_bytes"] = workspace * int64_t(kmla::kLatentDim) * 2;
  // What one GPU of the tensor-parallel group holds: its heads' weights (the latent
  // projections replicated) and the whole latent cache (every rank keeps all of it).
  json per_gpu = {{"gpus", c.tp_size}, {"heads", c.local_heads()}, {"weight_bytes_per_layer", weight_bytes(c)}};
  int64_t group_weights = 0;
  for (int r = 0; r < c.tp_size; ++r) {
    MlaConfig full = c;
    full.tp_rank = 0, full.tp_size = 1;
    group_weights += weight_bytes(c.tp_size > 1 ? full.tp_slice(r, c.tp_size) : full);
  }
  per_gpu["group_weight_bytes_per_layer"] = group_weights;
  for (CacheFormat f : kFormats)
    per_gpu["cache_bytes_per_layer"][kmla::cache_format_name(f)] = j["cache"][kmla::cache_format_name(f)]["bytes_per_layer"];
  j["per_gpu"] = per_gpu;
  if (as_json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("model                %s\n", c.name.c_str());
  std::printf("hidden size          %d\n", c.hidden_size);
  std::printf("heads                %d (local %d, tp rank %d of %d)\n", c.num_heads, c.local_heads(), c.tp_rank, c.tp_size);
  if (c.q_lora_rank) std::printf("q-LoRA rank          %d\n", *c.q_lora_rank);
  else std::printf("q-LoRA rank          none (q_proj)\n");
  std::printf("kv_lora / nope / rope / v   %d / %d / %d / %d\n", c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim);
  std::printf("latent row / qk head %d / %d\n", MlaConfig::latent_dim(), MlaConfig::qk_head_dim());
  std::printf("RMSNorm eps          %g\n", c.rms_norm_eps);
  if (c.use_rope)
    std::printf("RoPE                 %s, theta %g, factor %g, %lld table rows\n", kmla::rope_type_name(c.rope.type),
                c.rope.theta, c.rope.factor, (long long)c.rope_table_rows());
  else
    std::printf("RoPE                 off (NoPE)\n");
  std::printf("output gate          %s\n", c.use_output_gate ? "on" : "off");
  std::printf("multi-token decode   %s\n", c.non_causal_multi_token_decode ? "non-causal (draft)" : "causal");
  std::printf("max positions        %lld\n", (long long)c.max_position_embeddings);
  std::printf("softmax scale        %.6g\n", c.softmax_scale());
  std::printf("weights per layer    %.2f MiB (16-bit)\n", weight_bytes(c) / 1048576.0);
  std::printf("cache bytes/token    ");
  for (CacheFormat f : kFormats) std::printf("%s %zu  ", kmla::cache_format_name(f), kmla::cache_entry_bytes(f));
  std::printf("\n");
  std::printf("for %lld requests x %lld tokens (block %d, %lld blocks): cache per layer\n", (long long)batch,
              (long long)context, block_size, (long long)(batch * blocks_per_seq));
  for (CacheFormat f : kFormats)
    std::printf("  %-12s %10.2f MiB\n", kmla::cache_format_name(f),
                j["cache"][kmla::cache_format_name(f)]["bytes_per_layer"].get<int64_t>() / 1048576.0);
  std::printf("context workspace    %lld tokens, %.2f MiB\n", (long long)workspace,
              j["context_workspace_bytes"].get<int64_t>() / 1048576.0);
  std::printf("per GPU (tp %d)       %d heads, weights %.2f MiB/layer, cache %.2f MiB/layer bf16 (replicated on every rank)\n",
              c.tp_size, c.local_heads(), weight_bytes(c) / 1048576.0,
              j["cache"]["bf16"]["bytes_per_layer"].get<int64_t>() / 1048576.0);
  std::printf("whole group          %d GPUs, weights %.2f MiB/layer in all\n", c.tp_size,
              group_weights / 1048576.0);
  return 0;
}

int run_verify(const std::vector<kmla::verify::Case>& cases, kmla::verify::Backend backend, bool as_json) {
  json rows = json::array();
  int failed = 0;
  if (!as_json)
    std::printf("%-44s %11s %11s %11s %9s %s\n", "case", "max|ref|", "err", "bound", "cache", "result");
  for (const auto& c : cases) {
    const kmla::verify::Report r = kmla::verify::run_case(c, backend);
    failed += !r.pass;
    if (as_json) {
      rows.push_back({{"case", c.name}, {"max_ref", r.max_ref}, {"err", r.err_backend},
                      {"baseline", r.err_baseline}, {"bound", r.bound}, {"rel_err", r.rel_err()},
                      {"cache_err", r.cache_err}, {"pass", r.pass}, {"detail", r.detail}});
    } else {
      std::printf("%-44s %11.4g %11.4g %11.4g %9.3g %s %s\n", c.name.c_str(), r.max_ref, r.err_backend, r.bound,
                  r.cache_err, r.pass ? "ok" : "FAIL", r.detail.c_str());
    }
  }
  if (as_json) std::cout << rows.dump(2) << "\n";
  else std::printf("%zu passed, %d failed\n", cases.size() - failed, failed);
  return failed ? 1 : 0;
}

// Lists a checkpoint's MLA layers and their tensors; reports what is missing or malformed.
int run_inspect(const std::string& dir, bool as_json) {
  const kmla::Checkpoint ck = kmla::Checkpoint::open(dir);
  const kmla::HfModelConfig& hf = ck.config();
  json j;
  j["dir"] = dir;
  j["model_type"] = hf.model_type;
  j["mla_layers"] = hf.mla_layers;
  j["extra_attention_layers"] = kmla::extra_attention_layers(ck);
  int problems = 0;
  for (int layer : hf.mla_layers) {
    json l;
    l["layer"] = layer;
    const auto issues = kmla::check_layer_tensors(ck, layer, hf.mla);
    problems += int(issues.size());
    l["problems"] = issues;
    std::string prefix;
    try {
      prefix = ck.attention_prefix(layer);
    } catch (const kmla::Error&) {
    }
    json tensors = json::array();
    int64_t bytes = 0;
    if (!prefix.empty())
      for (const std::string& name : ck.names()) {
        if (name.compare(0, prefix.size(), prefix) != 0) continue;
        const kmla::StTensor& t = ck.tensor(name);
        tensors.push_back({{"name", name}, {"dtype", kmla::st_dtype_name(t.dtype)}, {"shape", t.shape},
                           {"bytes", t.bytes}, {"file", ck.file_of(name)}});
        bytes += int64_t(t.bytes);
      }
    l["tensors"] = tensors;
    l["bytes"] = bytes;
    j["layers"].push_back(l);
  }
  j["problems"] = problems;
  if (as_json) {
    std::cout << j.dump(2) << "\n";
    return problems ? 1 : 0;
  }
  const MlaConfig& c = hf.mla;
  std::printf("%s (%s): hidden %d, %d heads, q-LoRA %s, RoPE %s, gate %s\n", dir.c_str(), hf.model_type.c_str(),
              c.hidden_size, c.num_heads, c.q_lora_rank ? std::to_string(*c.q_lora_rank).c_str() : "none",
              c.use_rope ? kmla::rope_type_name(c.rope.type) : "off", c.use_output_gate ? "on" : "off");
  std::printf("%zu MLA layers of %d\n", hf.mla_layers.size(), hf.num_hidden_layers);
  for (const json& l : j["layers"]) {
    std::printf("layer %d  (%.2f MiB)\n", l["layer"].get<int>(), l["bytes"].get<int64_t>() / 1048576.0);
    for (const json& t : l["tensors"]) {
      std::string shape;
      for (const auto& d : t["shape"]) shape += (shape.empty() ? "" : "x") + std::to_string(d.get<int64_t>());
      std::printf("  %-60s %-8s %-14s %12lld B\n", t["name"].get<std::string>().c_str(),
                  t["dtype"].get<std::string>().c_str(), shape.c_str(), (long long)t["bytes"].get<int64_t>());
    }
    for (const json& p : l["problems"]) std::printf("  PROBLEM: %s\n", p.get<std::string>().c_str());
  }
  for (int e : j["extra_attention_layers"])
    std::printf("layer %d has attention tensors but is not an MLA layer of this model (e.g. an MTP layer)\n", e);
  std::printf("%d problem%s\n", problems, problems == 1 ? "" : "s");
  return problems ? 1 : 0;
}

// ---- kmla run ------------------------------------------------------------------------------
namespace eng = kmla::engine;

struct RunArgs {
  std::string model = "kimi-k3";
  int tp = 8;  // the K3 8-GPU slice: rank 0 of 8, 12 local heads
  std::string cache_format = "bf16";
  std::string trace;
  std::string report;
  bool no_prefix_caching = false;
  bool json = false;
  bool quiet = false;
  int rank = -1;              // >= 0: serve only this rank's slice, in this process
  double timeout_s = 0;       // --tp N: the whole multi-process run (0: none)
  eng::EngineOptions engine;  // layers, block size, budgets, seed, threads, checks
  eng::TraceOptions workload;
};

void add_run_args(CLI::App* app, RunArgs& a) {
  eng::EngineOptions& e = a.engine;
  eng::TraceOptions& w = a.workload;
  app->add_option("--model", a.model, "model preset")
      ->check(CLI::IsMember(MlaConfig::preset_names()))
      ->capture_default_str();
  app->add_option("--tp", a.tp,
                  "tensor-parallel world size; with --cuda and no --rank, one process per GPU "
                  "through NCCL, else one rank's slice here")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--rank", a.rank, "serve only this rank's slice in this process (its partial o_proj sum)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--timeout", a.timeout_s, "--tp N: stop every rank after this many seconds (0: never)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--layers", e.num_layers, "MLA layers in the stack")
      ->check(CLI::Range(1, 128))
      ->capture_default_str();
  app->add_option("--cache-format", a.cache_format, "bf16, fp16, fp8, fp8_ds_mla")
      ->capture_default_str();
  app->add_option("--block-size", e.block_size, "cache block size")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_option("--blocks", e.num_blocks, "cache blocks per layer (0: enough for the trace)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--token-budget", e.token_budget, "tokens per step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--max-seqs", e.max_num_seqs, "running requests at most")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_flag("--no-prefix-caching", a.no_prefix_caching, "do not reuse cached prompt prefixes");
  app->add_option("--spec-tokens", e.spec_tokens, "draft tokens verified per decode step")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  CLI::Option* trace =
      app->add_option("--trace", a.trace, "a JSON-lines request trace instead of the built-in one");
  // The built-in trace; each option excludes --trace.
  for (CLI::Option* o :
       {app->add_option("--requests", w.num_requests, "requests in the built-in trace")
            ->check(CLI::PositiveNumber)
            ->capture_default_str(),
        app->add_option("--arrival-rate", w.arrival_rate,
                        "requests per second, Poisson (0: all at once)")
            ->check(CLI::NonNegativeNumber)
            ->capture_default_str(),
        app->add_option("--prompt-len", w.prompt_len_mean, "mean prompt length")
            ->check(CLI::PositiveNumber)
            ->capture_default_str(),
        app->add_option("--output-len", w.output_len_mean, "mean output length")
            ->check(CLI::PositiveNumber)
            ->capture_default_str()})
    o->excludes(trace);
  app->add_option("--seed", e.seed, "seed of the trace, the weights and the draft acceptance")
      ->capture_default_str();
  app->add_flag("--cuda", e.cuda, "run the layers on the GPU (the CUDA backend)");
  app->add_option("--threads", e.num_threads, "CPU threads (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--check-requests", e.check_requests, "requests recomputed by the fp64 oracle")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_flag("--json", a.json, "print the whole result as JSON instead of the summary");
  app->add_option("--report", a.report, "write a self-contained HTML report to this file");
  app->add_flag("--quiet", a.quiet, "no progress on stderr");
}

// A mean other than the default keeps the default trace's shape: its bounds and the shared
// prefix scale with the mean, so `--prompt-len 48` gives short prompts with short prefixes.
eng::TraceOptions scaled_workload(eng::TraceOptions w) {
  const eng::TraceOptions d;
  if (w.prompt_len_mean != d.prompt_len_mean) {
    const double k = double(w.prompt_len_mean) / d.prompt_len_mean;
    w.prompt_len_min = std::max(1, int(std::lround(d.prompt_len_min * k)));
    w.prompt_len_max = std::max(w.prompt_len_min, int(std::lround(d.prompt_len_max * k)));
    w.prefix_len = std::max(1, int(std::lround(d.prefix_len * k)));
  }
  if (w.output_len_mean != d.output_len_mean) {
    const double k = double(w.output_len_mean) / d.output_len_mean;
    w.output_len_min = std::max(1, int(std::lround(d.output_len_min * k)));
    w.output_len_max = std::max(w.output_len_min, int(std::lround(d.output_len_max * k)));
  }
  return w;
}

int terminal_width() {
  winsize ws{};
  if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
    return std::clamp(ws.ws_col - 1, 20, 100);
  return 80;
}

int run_serve(RunArgs a) {
  eng::EngineOptions& e = a.engine;
#ifdef KMLA_HAVE_CUDA
  if (e.cuda && !kmla::cuda::available()) {
    std::fprintf(stderr, "kmla: run --cuda: no CUDA GPU is present (skipped)\n");
    return kExitNoGpu;
  }
#endif
  e.config = MlaConfig::preset(a.model);
  if (a.tp > 1 || a.rank > 0) e.config = e.config.tp_slice(std::max(a.rank, 0), a.tp);
  e.config.validate();
  e.cache_format = kmla::parse_cache_format(a.cache_format);
  e.prefix_caching = !a.no_prefix_caching;
  a.workload.seed = e.seed;
  const eng::Trace trace = a.trace.empty()
                               ? eng::default_trace(scaled_workload(a.workload))
                               : eng::load_trace_jsonl(a.trace, a.workload.vocab_size, e.seed);

  // Progress on stderr: a redrawn bar on a terminal (at most ~20 redraws a second, and whenever a
  // request finishes), otherwise a plain line each time another tenth of the requests finish.
  const bool tty = !a.quiet && isatty(STDERR_FILENO);
  const int width = tty ? terminal_width() : 80;
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double last_draw = -1;
  int last_finished = -1, tenths_shown = 0;
  eng::StepRecord last_step;
  eng::Progress last{};
  auto on_step = [&](const eng::Progress& p) {
    if (a.quiet) return;
    last = p;
    if (p.last) last_step = *p.last, last.last = &last_step;
    const double t = elapsed();
    if (tty) {
      if (p.finished == last_finished && t - last_draw < 0.05) return;
      std::fprintf(stderr, "\r%s", eng::progress_line(last, t, width).c_str());
      std::fflush(stderr);
      last_draw = t, last_finished = p.finished;
    } else if (p.total > 0 && p.finished * 10 >= (tenths_shown + 1) * p.total) {
      while (p.finished * 10 >= (tenths_shown + 1) * p.total) ++tenths_shown;
      std::fprintf(stderr, "kmla run: %d/%d requests finished, step %lld, %.1f s\n", p.finished,
                   p.total, (long long)p.step, t);
    }
  };

  eng::Engine engine(e);
  const eng::RunResult r = engine.run(trace, on_step);
  if (tty) std::fprintf(stderr, "\r%s\n", eng::progress_line(last, elapsed(), width).c_str());

  if (a.json)
    std::cout << eng::to_json(r);
  else
    std::cout << eng::summary_text(r);
  std::cout.flush();
  if (!a.report.empty()) {
    std::ofstream f(a.report, std::ios::binary);
    KMLA_CHECK(f.good(), "cannot open the report file ", a.report);
    f << eng::html_report(r);
    f.close();
    KMLA_CHECK(f.good(), "cannot write the report file ", a.report);
    if (!a.quiet) std::fprintf(stderr, "kmla run: report written to %s\n", a.report.c_str());
  }
  const bool check_pass = std::all_of(r.checks.begin(), r.checks.end(),
                                      [](const eng::CheckResult& c) { return c.pass; });
  if (!r.all_finished) std::fprintf(stderr, "kmla run: not every request finished\n");
  if (!check_pass) std::fprintf(stderr, "kmla run: the correctness check FAILED\n");
  return r.all_finished && check_pass ? 0 : 1;
}

// ---- several GPUs: one process per rank ------------------------------------------------------
#ifdef KMLA_HAVE_CUDA
namespace dist = kmla::dist;

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KMLA_CHECK(f.good(), "cannot read ", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  dist::write_file_atomic(path, text.data(), text.size());
}

// Checks what a launch of `world` ranks needs, in the parent and without touching CUDA.
// Returns false (after saying so) without enough GPUs: the caller exits kExitNoGpu.
// `what` is the command and flag, e.g. "bench --cp".
bool ranks_possible(const char* what, int world) {
  KMLA_CHECK(dist::nccl_built(), what, " ", world, " starts ", world,
             " processes joined through NCCL, but this build has no NCCL");
  const int gpus = dist::count_gpus_in_child();
  if (gpus == 0) {
    std::fprintf(stderr, "kmla: %s %d: no CUDA GPU is present (skipped)\n", what, world);
    return false;
  }
  // Too few GPUs is an error, with the "no GPU" status so that CTest skips such a test.
  if (world > gpus) {
    std::fprintf(stderr, "kmla: error: %s %d needs %d GPUs (one process each), %d visible\n", what, world,
                 world, gpus);
    return false;
  }
  return true;
}

// A failed launch: which rank, why, and the end of its output.
int report_launch_failure(const char* what, const dist::LaunchResult& lr) {
  std::fprintf(stderr, "kmla %s: error: %s\n", what, lr.error.c_str());
  const std::string& out = lr.ranks[size_t(lr.failed_rank)].output;
  size_t from = out.size(), lines = 0;
  while (from > 0 && lines < 15) {
    from = out.rfind('\n', from - 1);
    if (from == std::string::npos) {
      from = 0;
      break;
    }
    ++lines;
  }
  if (!out.empty())
    std::fprintf(stderr, "--- the end of rank %d's output ---\n%s\n", lr.failed_rank, out.substr(from).c_str());
  return 1;
}

// kmla run --cuda --tp N: N processes, rank r on GPU r with its head slice of the same seeded
// weights; every layer ends in the NCCL all-reduce, so every rank computes the whole layer's
// outputs and rank 0's are checked against the unsharded oracle.
int run_serve_ranks(RunArgs a) {
  if (!ranks_possible("run --tp", a.tp)) return kExitNoGpu;
  const MlaConfig full = MlaConfig::preset(a.model);
  full.tp_slice(0, a.tp).validate();
  const kmla::CacheFormat format = kmla::parse_cache_format(a.cache_format);
  a.workload.seed = a.engine.seed;
  const eng::Trace trace = a.trace.empty() ? eng::default_trace(scaled_workload(a.workload))
                                           : eng::load_trace_jsonl(a.trace, a.workload.vocab_size, a.engine.seed);
  const std::string dir = dist::make_private_dir("run");
  if (!a.quiet)
    std::fprintf(stderr, "kmla run: %d ranks, one process per GPU, NCCL all-reduce after every layer\n", a.tp);
  dist::LaunchOptions lo;
  lo.timeout_s = a.timeout_s;
  const dist::LaunchResult lr = dist::launch(a.tp, [&](int rank) -> int {
    dist::select_device(rank);
    const dist::UniqueId id = dist::exchange_unique_id(dir + "/nccl-id", rank, 300);
    dist::Communicator comm(rank, a.tp, id, 300);
    eng::EngineOptions e = a.engine;
    e.config = full.tp_slice(rank, a.tp);
    e.cache_format = format;
    e.prefix_caching = !a.no_prefix_caching;
    e.all_reduce = comm.layer_all_reduce();
    e.agree_clock = [&comm](double now_s) { return comm.max_across_ranks(now_s, 300); };
    if (rank != 0) e.check_requests = 0;  // rank 0's outputs are every rank's
    eng::Engine engine(e);
    const eng::RunResult r = engine.run(trace);
    comm.check(nullptr, 120);
    int64_t steps = int64_t(r.steps.size());
    const bool check_pass = std::all_of(r.checks.begin(), r.checks.end(), [](const eng::CheckResult& c) { return c.pass; });
    const json j = {{"rank", rank},
                    {"device", kmla::cuda::device_info().name},
                    {"heads", e.config.local_heads()},
                    {"wall_s", r.wall_s},
                    {"steps", steps},
                    {"generated_tokens", r.generated_tokens},
                    {"tokens_computed", r.prefill_tokens_computed + r.decode_tokens_computed},
                    {"all_finished", r.all_finished},
                    {"checks", int(r.checks.size())},
                    {"checks_pass", check_pass}};
    if (rank == 0) {
      write_text(dir + "/summary", a.json ? eng::to_json(r) : eng::summary_text(r));
      if (!a.report.empty()) write_text(a.report, eng::html_report(r));
    }
    write_text(dir + "/rank" + std::to_string(rank) + ".json", j.dump());
    return 0;
  }, lo);
  if (!lr.ok()) {
    dist::remove_private_dir(dir);
    return report_launch_failure("run", lr);
  }
  std::vector<json> ranks;
  for (int r = 0; r < a.tp; ++r) ranks.push_back(json::parse(read_text(dir + "/rank" + std::to_string(r) + ".json")));
  const std::string summary = read_text(dir + "/summary");
  dist::remove_private_dir(dir);
  double wall = 0;
  for (const json& r : ranks) wall = std::max(wall, r["wall_s"].get<double>());
  const json& r0 = ranks[0];
  const bool ok = r0["all_finished"].get<bool>() && r0["checks_pass"].get<bool>();
  if (a.json) {
    json doc = {{"tp", a.tp}, {"ranks", ranks}, {"wall_s_max", wall}, {"rank0", json::parse(summary)}};
    std::cout << doc.dump(2) << "\n";
  } else {
    std::cout << summary;
    std::printf("\ntensor parallel: %d ranks (one process per GPU)\n", a.tp);
    std::printf("%4s  %-24s %5s %9s %7s %12s  %s\n", "rank", "device", "heads", "wall s", "steps", "gen tok/s", "check");
    for (const json& r : ranks) {
      const double w = r["wall_s"].get<double>();
      std::string check = r["checks"].get<int>() == 0 ? "-" : r["checks_pass"].get<bool>() ? "PASS" : "FAIL";
      std::printf("%4d  %-24s %5d %9.2f %7lld %12.1f  %s\n", r["rank"].get<int>(),
                  r["device"].get<std::string>().c_str(), r["heads"].get<int>(), w,
                  (long long)r["steps"].get<int64_t>(), w > 0 ? r["generated_tokens"].get<int64_t>() / w : 0.0,
                  check.c_str());
    }
    std::printf("total: %d GPUs, slowest rank %.2f s, %.1f generated tokens/s for the group\n", a.tp, wall,
                wall > 0 ? r0["generated_tokens"].get<int64_t>() / wall : 0.0);
  }
  std::cout.flush();
  if (!ok) std::fprintf(stderr, "kmla run: %s\n", r0["all_finished"].get<bool>() ? "the correctness check FAILED" : "not every request finished");
  return ok ? 0 : 1;
}

// kmla bench --tp N: the K3 layer cases on N processes, each timing its rank with the
// all-reduce inside the graphed step. --cp N: long-context decode with each rank holding 1/N of
// the keys, the all-gather and LSE merge inside each timed run. Per-rank times and their
// maximum (the step takes as long as its slowest rank).
int run_bench_ranks(kmla::bench::BenchOptions bo, int world, bool context_parallel) {
  if (!ranks_possible(context_parallel ? "bench --cp" : "bench --tp", world)) return kExitNoGpu;
  const std::string dir = dist::make_private_dir("bench");
  const dist::LaunchResult lr = dist::launch(world, [&](int rank) -> int {
    dist::select_device(rank);
    const dist::UniqueId id = dist::exchange_unique_id(dir + "/nccl-id", rank, 300);
    dist::Communicator comm(rank, world, id, 300);
    kmla::bench::BenchOptions b = bo;
    if (context_parallel) {
      b.cp = world;
      b.cp_rank = rank;
      b.comm = &comm;
    } else {
      b.tp = world;
      b.tp_rank = rank;
      b.all_reduce = comm.layer_all_reduce();
    }
    b.json = true;
    std::ostringstream os;
    const int rc = kmla::bench::run_bench(b, os);
    comm.check(nullptr, 120);
    write_text(dir + "/rank" + std::to_string(rank) + ".json", os.str());
    return rc;
  });
  if (!lr.ok()) {
    dist::remove_private_dir(dir);
    return report_launch_failure("bench", lr);
  }
  std::vector<json> docs;
  for (int r = 0; r < world; ++r) docs.push_back(json::parse(read_text(dir + "/rank" + std::to_string(r) + ".json")));
  dist::remove_private_dir(dir);
  json cases = json::array();
  const json& first = docs[0]["cases"];
  for (size_t k = 0; k < first.size(); ++k) {
    json us = json::array();
    double mx = 0;
    for (const json& d : docs) {
      const double u = d["cases"][k].value("us", 0.0);
      us.push_back(u);
      mx = std::max(mx, u);
    }
    cases.push_back({{"name", first[k]["name"]}, {context_parallel ? "cp" : "tp", world}, {"us_per_rank", us}, {"us", mx},
                     {"heads", first[k]["heads"]}});
  }
  if (bo.json) {
    std::cout << json({{context_parallel ? "cp" : "tp", world}, {"device", docs[0]["device"]}, {"cases", cases},
                       {"ranks", docs}}).dump(2)
              << "\n";
    return 0;
  }
  std::printf("kmla bench --%s %d: %s x %d, one process per GPU, %s inside each timed run;\n"
              "median of %d runs per rank; the step takes as long as its slowest rank\n",
              context_parallel ? "cp" : "tp", world, docs[0]["device"].get<std::string>().c_str(), world,
              context_parallel ? "the NCCL all-gather and LSE merge" : "the NCCL all-reduce", bo.iters);
  std::printf("%-56s %10s  %s\n", "case", "max us", "per rank us");
  for (const json& c : cases) {
    std::string per;
    for (const json& u : c["us_per_rank"]) {
      char b[32];
      std::snprintf(b, sizeof b, "%s%.1f", per.empty() ? "" : " ", u.get<double>());
      per += b;
    }
    std::printf("%-56s %10.1f  %s\n", c["name"].get<std::string>().c_str(), c["us"].get<double>(), per.c_str());
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kmla: the Kimi-K3 Multi-head Latent Attention layer"};
  app.require_subcommand(1);

  ModelArgs info_model;
  int64_t batch = 128, context = 8192, workspace = 65536;
  int block_size = 64;
  bool info_json = false;
  CLI::App* info = app.add_subcommand("info", "geometry, softmax scale, cache and workspace sizes of a layer");
  add_model_args(info, info_model);
  info->add_option("--batch", batch, "requests")->check(CLI::PositiveNumber);
  info->add_option("--context", context, "tokens per request")->check(CLI::PositiveNumber);
  info->add_option("--block-size", block_size, "cache block size")->check(CLI::Range(1, 1024));
  info->add_option("--workspace", workspace, "context workspace tokens")->check(CLI::PositiveNumber);
  info->add_flag("--json", info_json, "machine-readable output");

  std::string v_model = "kimi-k3", v_format = "bf16", device = "cpu";
  int v_block = 16, v_heads = 3;
  uint64_t v_seed = 1;
  bool v_all = false, v_full = false, v_json = false;
  CLI::App* verify = app.add_subcommand("verify", "run a case through a backend and the fp64 oracle");
  verify->add_option("--model", v_model, "model preset")->check(CLI::IsMember(MlaConfig::preset_names()));
  verify->add_option("--cache-format", v_format, "bf16, fp16, fp8, fp8_ds_mla");
  verify->add_option("--block-size", v_block, "cache block size")->check(CLI::Range(1, 1024));
  verify->add_option("--heads", v_heads, "local heads")->check(CLI::Range(1, 128));
  verify->add_option("--seed", v_seed, "random seed");
  verify->add_option("--device", device, "backend: cpu, cuda, or cuda-portable (the sm_80 kernels)")
      ->check(CLI::IsMember({"cpu", "cuda", "cuda-portable"}));
  verify->add_flag("--full", v_full, "use the model's real hidden size and q-LoRA rank (slow)");
  verify->add_flag("--all", v_all, "run the whole standard grid");
  verify->add_flag("--json", v_json, "machine-readable output");

  std::string ck_dir;
  bool inspect_json = false;
  CLI::App* inspect = app.add_subcommand("inspect", "list a checkpoint's MLA layers and tensors, report problems");
  inspect->add_option("dir", ck_dir, "Hugging Face model directory")->required();
  inspect->add_flag("--json", inspect_json, "machine-readable output");

  std::string v_checkpoint;
  int v_layer = -1, v_tp = 1, v_rank = 0;
  verify->add_option("--checkpoint", v_checkpoint, "verify a layer of this model directory");
  verify->add_option("--layer", v_layer, "layer index (default: the first MLA layer)");
  verify->add_option("--tp", v_tp, "tensor-parallel world size for the checkpoint layer")->check(CLI::PositiveNumber);
  verify->add_option("--rank", v_rank, "tensor-parallel rank")->check(CLI::NonNegativeNumber);

#ifdef KMLA_HAVE_CUDA
  kmla::bench::BenchOptions bo;
  CLI::App* bench = app.add_subcommand("bench", "time decode, prefill and the whole layer on the GPU (SPEC section 4)");
  bench->add_option("--only", bo.only, "run the standard cases whose name contains this (or any of a comma-separated list)");
  bench->add_option("--iters", bo.iters, "timed runs per case (median reported)")->check(CLI::PositiveNumber);
  bench->add_option("--warmup", bo.warmup, "untimed runs per case")->check(CLI::NonNegativeNumber);
  bench->add_flag("--json", bo.json, "one JSON document");
  bench->add_option("--kind", bo.kind, "a custom shape: decode, prefill, layer-decode, layer-prefill")
      ->check(CLI::IsMember({"decode", "prefill", "layer-decode", "layer-prefill"}));
  bench->add_option("--batch", bo.batch, "requests")->check(CLI::PositiveNumber);
  bench->add_option("--heads", bo.heads, "local heads")->check(CLI::Range(1, 128));
  bench->add_option("--seq", bo.seq, "keys per decode request")->check(CLI::PositiveNumber);
  bench->add_option("--q-len", bo.q_len, "query tokens per decode request")->check(CLI::Range(1, 128));
  bench->add_option("--tokens", bo.tokens, "prefill tokens")->check(CLI::PositiveNumber);
  bench->add_option("--block-size", bo.block_size, "cache block size")->check(CLI::Range(1, 1024));
  bench->add_option("--cache-format", bo.cache_format, "bf16, fp8, fp8_ds_mla");
  bool bench_non_causal = false;
  bench->add_flag("--non-causal", bench_non_causal, "non-causal multi-token decode / prefill");
  bench->add_option("--model", bo.model, "model preset of the layer cases")->check(CLI::IsMember(MlaConfig::preset_names()));
  bench->add_flag("--portable", bo.portable, "force the portable sm_80 kernels");
  bench->add_flag("--sequential-blocks", bo.sequential_blocks,
                  "give each request's cache blocks in order (default: a random permutation of all blocks)");
  bench->add_flag("--write-flush", bo.write_flush,
                  "flush L2 before each timed run by writing a buffer (leaves dirty lines the run "
                  "writes back; default: by reading it)");
  int bench_tp = 0, bench_cp = 0;
  bench->add_option("--tp", bench_tp,
                    "the K3 layer cases at this tensor-parallel world, one process per GPU through NCCL "
                    "(1: the unsharded layer here)")
      ->check(CLI::PositiveNumber);
  bench->add_option("--cp", bench_cp,
                    "long-context K3 decode split along the tokens over this many GPUs, merged through "
                    "NCCL (1: one GPU, no merge)")
      ->check(CLI::PositiveNumber)
      ->excludes("--tp");
#endif

  RunArgs run_args;
  CLI::App* run = app.add_subcommand("run", "serve a request trace through the engine; summary, JSON or HTML report");
  add_run_args(run, run_args);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*info) return run_info(info_model, batch, context, block_size, workspace, info_json);
    if (*inspect) return run_inspect(ck_dir, inspect_json);
    // Several ranks: fork them before this process touches CUDA (run_serve would).
    if (*run && run_args.engine.cuda && run_args.tp > 1 && run_args.rank < 0) {
#ifdef KMLA_HAVE_CUDA
      return run_serve_ranks(run_args);
#endif
    }
    if (*run) return run_serve(run_args);
#ifdef KMLA_HAVE_CUDA
    if (*bench && (bench_tp > 1 || bench_cp > 1)) {
      bo.causal = !bench_non_causal;
      return run_bench_ranks(bo, std::max(bench_tp, bench_cp), bench_cp > 1);
    }
    if (*bench) {
      bo.tp = bench_tp;
      bo.cp = bench_cp;
      if (!kmla::cuda::available()) {
        std::fprintf(stderr, "kmla: bench needs a CUDA GPU (skipped)\n");
        return kExitNoGpu;
      }
      bo.causal = !bench_non_causal;
      return kmla::bench::run_bench(bo, std::cout);
    }
#endif
    if (*verify) {
      const kmla::verify::Backend backend = device == "cpu"    ? kmla::verify::Backend::cpu
                                            : device == "cuda" ? kmla::verify::Backend::cuda
                                                               : kmla::verify::Backend::cuda_portable;
#ifdef KMLA_HAVE_CUDA
      if (device != "cpu" && !kmla::cuda::available()) {
        std::fprintf(stderr, "kmla: device '%s': no CUDA GPU is present (skipped)\n", device.c_str());
        return kExitNoGpu;
      }
#else
      KMLA_CHECK(device == "cpu", "device '", device, "': this build has only the CPU backend");
#endif
      std::vector<kmla::verify::Case> cases;
      if (!v_checkpoint.empty()) {
        const kmla::Checkpoint ck = kmla::Checkpoint::open(v_checkpoint);
        MlaConfig cfg = ck.config().mla;
        KMLA_CHECK(!ck.config().mla_layers.empty(), v_checkpoint, ": the config lists no MLA layers");
        const int layer = v_layer >= 0 ? v_layer : ck.config().mla_layers.front();
        const auto& mla = ck.config().mla_layers;
        KMLA_CHECK(std::find(mla.begin(), mla.end(), layer) != mla.end(), "layer ", layer,
                   " is not an MLA layer of ", v_checkpoint);
        if (v_tp > 1 || v_rank > 0) cfg = cfg.tp_slice(v_rank, v_tp);
        auto w = std::make_shared<kmla::MlaWeights>(kmla::load_layer_weights(ck, layer, cfg, kmla::DType::bf16));
        kmla::verify::Case c = kmla::verify::mixed_case(cfg, kmla::parse_cache_format(v_format), v_block, v_seed);
        c.name = v_checkpoint + "/layer" + std::to_string(layer) + "/" + v_format;
        c.weights = w;
        c.k_scale = w->k_scale;
        c.q_scale = w->q_scale;
        cases.push_back(c);
      } else if (v_all) {
        cases = kmla::verify::standard_cases();
      } else {
        cases.push_back(kmla::verify::mixed_case(v_model, kmla::parse_cache_format(v_format), v_block, v_seed,
                                                    v_heads, !v_full));
      }
      return run_verify(cases, backend, v_json);
    }
  } catch (const kmla::Error& e) {
    std::fprintf(stderr, "kmla: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
