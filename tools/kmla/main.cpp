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
#include <nlohmann/json.hpp>
#include <string>

#include "kmla/cache.hpp"
#include "kmla/checkpoint.hpp"
#include "kmla/config.hpp"
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
  eng::EngineOptions engine;  // layers, block size, budgets, seed, threads, checks
  eng::TraceOptions workload;
};

void add_run_args(CLI::App* app, RunArgs& a) {
  eng::EngineOptions& e = a.engine;
  eng::TraceOptions& w = a.workload;
  app->add_option("--model", a.model, "model preset")
      ->check(CLI::IsMember(MlaConfig::preset_names()))
      ->capture_default_str();
  app->add_option("--tp", a.tp, "tensor-parallel world size; the run serves rank 0's slice")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
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
  if (a.tp > 1) e.config = e.config.tp_slice(0, a.tp);
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
  bench->add_option("--only", bo.only, "run the standard cases whose name contains this");
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
    if (*run) return run_serve(run_args);
#ifdef KMLA_HAVE_CUDA
    if (*bench) {
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
