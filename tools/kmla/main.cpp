// kmla: the command-line tool. `info` describes a layer, `verify` runs named cases through
// a backend and the fp64 oracle. Only this file turns kmla::Error into exit codes.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "kmla/cache.hpp"
#include "kmla/checkpoint.hpp"
#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/hf_config.hpp"
#include "kmla/weights.hpp"
#include "verify/cases.hpp"

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

int run_verify(const std::vector<kmla::verify::Case>& cases, bool as_json) {
  json rows = json::array();
  int failed = 0;
  if (!as_json)
    std::printf("%-44s %11s %11s %11s %9s %s\n", "case", "max|ref|", "err", "bound", "cache", "result");
  for (const auto& c : cases) {
    const kmla::verify::Report r = kmla::verify::run_case(c);
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
  verify->add_option("--device", device, "backend")->check(CLI::IsMember({"cpu", "cuda"}));
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*info) return run_info(info_model, batch, context, block_size, workspace, info_json);
    if (*inspect) return run_inspect(ck_dir, inspect_json);
    if (*verify) {
      KMLA_CHECK(device == "cpu", "device '", device, "': this build has only the CPU backend");
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
      return run_verify(cases, v_json);
    }
  } catch (const kmla::Error& e) {
    std::fprintf(stderr, "kmla: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
