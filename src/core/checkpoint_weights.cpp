// Mapping a checkpoint's attention tensors onto MlaWeights.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kmla/checkpoint.hpp"
#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"
#include "kmla/weights.hpp"

namespace kmla {

const std::vector<std::string>& mla_projection_names() {
  static const std::vector<std::string> names = {"q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj",
                                                 "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                                 "g_proj", "o_proj"};
  return names;
}

namespace {

float element(const StTensor& t, int64_t i) {
  switch (t.dtype) {
    case StDType::BF16: { uint16_t v; std::memcpy(&v, t.data + 2 * i, 2); return bf16_to_float(v); }
    case StDType::F16: { uint16_t v; std::memcpy(&v, t.data + 2 * i, 2); return fp16_to_float(v); }
    case StDType::F32: { float v; std::memcpy(&v, t.data + 4 * i, 4); return v; }
    default: return NAN;
  }
}

// A 16-bit or f32 tensor converted to the activation dtype (one rounding).
HostTensor convert(const Checkpoint& ck, const StTensor& t, DType act) {
  KMLA_CHECK(t.dtype == StDType::BF16 || t.dtype == StDType::F16 || t.dtype == StDType::F32, ck.file_of(t.name),
             ": tensor '", t.name, "' has dtype ", st_dtype_name(t.dtype), "; expected BF16, F16, F32 or F8_E4M3");
  HostTensor h(act, t.shape);
  auto* o = h.data<uint16_t>();
  const bool same = (t.dtype == StDType::BF16 && act == DType::bf16) || (t.dtype == StDType::F16 && act == DType::f16);
  if (same) {
    std::memcpy(o, t.data, t.bytes);
    return h;
  }
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = element(t, i);
    o[i] = act == DType::bf16 ? float_to_bf16(v) : float_to_fp16(v);
  }
  return h;
}

void check_shape(const Checkpoint& ck, const StTensor& t, std::vector<int64_t> want) {
  if (t.shape == want) return;
  auto str = [](const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
  };
  KMLA_CHECK(false, ck.file_of(t.name), ": tensor '", t.name, "' has shape ", str(t.shape), ", the config needs ",
             str(want));
}

float scalar(const Checkpoint& ck, const StTensor& t) {
  KMLA_CHECK(t.numel() == 1 && t.dtype == StDType::F32, ck.file_of(t.name), ": '", t.name,
             "' must be one F32 value, got ", st_dtype_name(t.dtype), " with ", t.numel(), " elements");
  const float v = element(t, 0);
  KMLA_CHECK(std::isfinite(v) && v > 0, ck.file_of(t.name), ": '", t.name, "' = ", v, " is not a positive scale");
  return v;
}

struct Slot {
  const char* name;
  HostTensor MlaWeights::*field;
  bool needed;
  std::vector<int64_t> shape;
};

// The tensors a layer of `full` (an unsliced config) has, with their shapes.
std::vector<Slot> layer_slots(const MlaConfig& full) {
  const int64_t H = full.num_heads, hid = full.hidden_size, ql = full.q_lora_rank.value_or(0);
  const bool lora = full.q_lora_rank.has_value();
  return {
      {"q_a_proj", &MlaWeights::q_a_proj, lora, {ql, hid}},
      {"q_a_layernorm", &MlaWeights::q_a_layernorm, lora, {ql}},
      {"q_b_proj", &MlaWeights::q_b_proj, lora, {H * kQkHeadDim, ql}},
      {"q_proj", &MlaWeights::q_proj, !lora, {H * kQkHeadDim, hid}},
      {"kv_a_proj_with_mqa", &MlaWeights::kv_a_proj_with_mqa, true, {kLatentDim, hid}},
      {"kv_a_layernorm", &MlaWeights::kv_a_layernorm, true, {kKvLoraRank}},
      {"kv_b_proj", &MlaWeights::kv_b_proj, true, {H * kKvBOut, kKvLoraRank}},
      {"g_proj", &MlaWeights::g_proj, full.use_output_gate, {H * kVDim, hid}},
      {"o_proj", &MlaWeights::o_proj, true, {hid, H * kVDim}},
  };
}

MlaConfig unsliced(const MlaConfig& cfg) {
  MlaConfig full = cfg;
  full.tp_rank = 0;
  full.tp_size = 1;
  full.validate();
  return full;
}

}  // namespace

std::vector<std::string> check_layer_tensors(const Checkpoint& ck, int layer, const MlaConfig& cfg) {
  std::vector<std::string> problems;
  std::string prefix;
  try {
    prefix = ck.attention_prefix(layer);
    const MlaConfig full = unsliced(cfg);
    for (const Slot& s : layer_slots(full)) {
      const std::string name = prefix + s.name + ".weight";
      try {
        if (!s.needed) {
          KMLA_CHECK(!ck.has(name), ck.file_of(name), ": tensor '", name, "' exists but the config does not use it");
          continue;
        }
        KMLA_CHECK(ck.has(name), ck.dir(), ": missing tensor '", name, "'");
        const StTensor& t = ck.tensor(name);
        check_shape(ck, t, s.shape);
        if (t.dtype == StDType::F8_E4M3) {
          const std::string sname = prefix + s.name + ".weight_scale_inv";
          KMLA_CHECK(ck.has(sname), ck.dir(), ": tensor '", name, "' is F8_E4M3 but '", sname, "' is missing");
        } else {
          KMLA_CHECK(t.dtype == StDType::BF16 || t.dtype == StDType::F16 || t.dtype == StDType::F32,
                     ck.file_of(name), ": tensor '", name, "' has unsupported dtype ", st_dtype_name(t.dtype));
        }
      } catch (const Error& e) {
        problems.push_back(e.what());
      }
    }
  } catch (const Error& e) {
    problems.push_back(e.what());
  }
  return problems;
}

std::vector<int> extra_attention_layers(const Checkpoint& ck) {
  std::vector<int> extra;
  const auto& mla = ck.config().mla_layers;
  for (const std::string& name : ck.names()) {
    const std::string key = "model.layers.";
    size_t at = name.find(key);
    if (at == std::string::npos || (at != 0 && name.compare(0, at, "language_model.") != 0)) continue;
    at += key.size();
    const size_t dot = name.find('.', at);
    // Only layers with an MLA projection count: Kimi's KDA layers keep other tensors under
    // self_attn (A_log, dt_bias, ...) and are not attention layers of this kind.
    if (dot == std::string::npos || name.compare(dot, 11, ".self_attn.") != 0 ||
        name.find(".self_attn.kv_a_proj_with_mqa.") == std::string::npos)
      continue;
    const int layer = std::atoi(name.substr(at, dot - at).c_str());
    if (std::find(mla.begin(), mla.end(), layer) == mla.end() &&
        std::find(extra.begin(), extra.end(), layer) == extra.end())
      extra.push_back(layer);
  }
  std::sort(extra.begin(), extra.end());
  return extra;
}

MlaWeights load_layer_weights(const Checkpoint& ck, int layer, const MlaConfig& cfg, DType act) {
  KMLA_CHECK(act == DType::bf16 || act == DType::f16, "activation dtype must be bf16 or f16, got ", dtype_name(act));
  const MlaConfig full = unsliced(cfg);
  const std::string prefix = ck.attention_prefix(layer);
  const std::vector<Slot> slots = layer_slots(full);
  MlaWeights w;
  for (const Slot& s : slots) {
    const std::string name = prefix + s.name + ".weight";
    if (!s.needed) {
      KMLA_CHECK(!ck.has(name), ck.file_of(name), ": tensor '", name, "' exists but the config (",
                 cfg.name, ") does not use it");
      continue;
    }
    KMLA_CHECK(ck.has(name), ck.dir(), ": missing tensor '", name, "' (layer ", layer, ")");
    const StTensor& t = ck.tensor(name);
    check_shape(ck, t, s.shape);
    if (t.dtype != StDType::F8_E4M3) {
      w.*s.field = convert(ck, t, act);
      continue;
    }
    const std::string sname = prefix + s.name + ".weight_scale_inv";
    const auto& block = ck.config().weight_block_size;
    KMLA_CHECK(block.empty() || block == std::vector<int>({128, 128}), ck.dir(), ": tensor '", name,
               "' is F8_E4M3 but quantization_config.weight_block_size is not [128, 128]; kmla supports 128x128 blocks");
    KMLA_CHECK(s.shape.size() == 2, ck.file_of(name), ": tensor '", name, "' is F8_E4M3 but is not a matrix");
    KMLA_CHECK(ck.has(sname), ck.dir(), ": tensor '", name, "' is F8_E4M3 but '", sname, "' is missing");
    const StTensor& st = ck.tensor(sname);
    KMLA_CHECK(st.dtype == StDType::F32, ck.file_of(sname), ": tensor '", sname, "' has dtype ",
               st_dtype_name(st.dtype), ", expected F32");
    const int64_t B = Fp8BlockWeight::kBlock;
    check_shape(ck, st, {(s.shape[0] + B - 1) / B, (s.shape[1] + B - 1) / B});
    Fp8BlockWeight f;
    f.codes = HostTensor(DType::e4m3, t.shape);
    std::memcpy(f.codes.data<void>(), t.data, t.bytes);
    f.scale_inv = HostTensor(DType::f32, st.shape);
    std::memcpy(f.scale_inv.data<void>(), st.data, st.bytes);
    for (int64_t i = 0; i < f.scale_inv.numel(); ++i) {
      const float v = f.scale_inv.data<float>()[i];
      KMLA_CHECK(std::isfinite(v) && v > 0, ck.file_of(sname), ": tensor '", sname, "' entry ", i, " = ", v,
                 " is not a positive finite scale");
    }
    w.*s.field = f.dequantize(act);
    w.fp8[s.name] = std::move(f);
  }
  // Per-tensor cache scales, under the names engines use for them.
  for (const char* n : {"k_scale", "attn.k_scale", "mla_attn.k_scale", "kv_scale", "attn.kv_scale"})
    if (ck.has(prefix + n)) w.k_scale = scalar(ck, ck.tensor(prefix + n));
  for (const char* n : {"q_scale", "attn.q_scale", "mla_attn.q_scale"})
    if (ck.has(prefix + n)) w.q_scale = scalar(ck, ck.tensor(prefix + n));
  w.validate(full);
  if (cfg.tp_size > 1) w = w.tp_slice(full, cfg.tp_rank, cfg.tp_size);
  return w;
}

}  // namespace kmla
