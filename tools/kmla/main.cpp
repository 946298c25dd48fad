// kmla: the command-line tool. `info` describes a layer, `verify` runs named cases through
// a backend and the fp64 oracle. Only this file turns kmla::Error into exit codes.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/hf_config.hpp"
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*info) return run_info(info_model, batch, context, block_size, workspace, info_json);
    if (*verify) {
      KMLA_CHECK(device == "cpu", "device '", device, "': this build has only the CPU backend");
      std::vector<kmla::verify::Case> cases;
      if (v_all) cases = kmla::verify::standard_cases();
      else cases.push_back(kmla::verify::mixed_case(v_model, kmla::parse_cache_format(v_format), v_block, v_seed,
                                                    v_heads, !v_full));
      return run_verify(cases, v_json);
    }
  } catch (const kmla::Error& e) {
    std::fprintf(stderr, "kmla: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
