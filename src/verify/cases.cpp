#include "verify/cases.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <sstream>
#include <utility>

#include "core/random.hpp"
#include "kmla/layer.hpp"
#ifdef KMLA_HAVE_CUDA
#include "kmla/cuda.hpp"
#endif
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"

namespace kmla::verify {

double Case::attention_flops() const {
  // 2 * heads * (192 + 128) per (query, key) pair, counted from the request shapes.
  double pairs = 0;
  for (const RequestShape& r : requests) {
    const double ctx = r.context_len, q = r.query_len;
    pairs += q * ctx + q * (q + 1) / 2;
  }
  return 2.0 * config.local_heads() * (kQkHeadDim + kVDim) * pairs;
}

MlaConfig small_model(const std::string& preset, int heads, bool small) {
  MlaConfig c = MlaConfig::preset(preset);
  c.name = preset + (small ? "~small" : "");
  if (small) {
    c.hidden_size = 256;
    if (c.q_lora_rank) c.q_lora_rank = 96;
  }
  c.num_heads = heads;
  c.tp_rank = 0;
  c.tp_size = 1;
  c.validate();
  return c;
}

Case mixed_case(const std::string& preset, CacheFormat format, int block_size, uint64_t seed,
                int heads, bool small) {
  return mixed_case(small_model(preset, heads, small), format, block_size, seed);
}

Case mixed_case(const MlaConfig& config, CacheFormat format, int block_size, uint64_t seed) {
  Case c;
  c.config = config;
  c.format = format;
  c.block_size = block_size;
  c.seed = seed;
  if (format == CacheFormat::fp8) {
    // Non-unit scales so a missing descale cannot hide.
    c.k_scale = 0.5f;
    c.q_scale = 0.25f;
  }
  // Decode blocks of 3 tokens (speculative / DSpark-style) next to single-token decodes.
  c.decode_threshold = 3;
  // Contexts end just off block boundaries, and the workspace forces several chunks.
  const int32_t b = block_size;
  const int32_t ctx_a = std::max(2 * b + 1, 37);
  const int32_t ctx_b = std::max(b - 1, 21);
  c.requests = {{9, 0}, {1, ctx_b}, {5, ctx_a}, {3, b + 1}, {1, 2 * b - 1}, {7, ctx_b + 2}, {2, 1}};
  c.workspace_tokens = std::max<int64_t>(2 * b, 24);
  c.padding_rows = 2;
  c.rope_rows = 0;
  if (c.config.use_rope) c.rope_rows = 4096;  // small table; positions stay far below it
  std::ostringstream name;
  name << c.config.name << "/" << cache_format_name(format) << "/bs" << block_size;
  c.name = name.str();
  return c;
}

std::vector<Case> standard_cases() {
  const std::vector<std::string> models = {"kimi-k3", "kimi-k3-dspark", "kimi-linear-48b", "kimi-k2"};
  const std::vector<CacheFormat> formats = {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla};
  const int block_sizes[] = {1, 16, 64, 256};
  std::vector<Case> cases;
  int k = 0;
  for (size_t m = 0; m < models.size(); ++m)
    for (size_t f = 0; f < formats.size(); ++f, ++k)
      cases.push_back(mixed_case(models[m], formats[f], block_sizes[k % 4], 100 + k, 2 + int(m % 2)));
  // Variants: fp16 activations (auto cache), the amax tile rule, the fp8 prefill mode, odd heads.
  Case fp16 = mixed_case("kimi-k3", CacheFormat::fp16, 16, 7);
  fp16.activation = DType::f16;
  fp16.name += "/f16";
  cases.push_back(fp16);
  Case amax = mixed_case("kimi-k3-dspark", CacheFormat::fp8_ds_mla, 64, 8);
  amax.tile_rule = TileScaleRule::amax_448;
  amax.name += "/amax-rule";
  cases.push_back(amax);
  Case fp8p = mixed_case("kimi-k3", CacheFormat::fp8, 16, 9);
  fp8p.fp8_prefill = true;
  fp8p.name += "/fp8-prefill";
  cases.push_back(fp8p);
  // A prefill of more than kAuxStreamMaxRows (512) rows: the CUDA layer's gated front end
  // then runs as two GEMMs over its stacked weight.
  Case longp = mixed_case("kimi-k3", CacheFormat::bf16, 64, 14);
  longp.requests = {{1, 70}, {3, 129}, {600, 0}};
  longp.name += "/long-prefill";
  cases.push_back(longp);
  Case yarn = mixed_case("kimi-k3-dspark-yarn", CacheFormat::bf16, 16, 10, 5);
  cases.push_back(yarn);
  Case v2 = mixed_case("deepseek-v2-lite", CacheFormat::bf16, 64, 11, 1);
  cases.push_back(v2);
  // fp8 block-quantized checkpoints (W8A8 projections): DeepSeek-V3 (yarn) and Kimi-K2.
  Case dsv3 = mixed_case("deepseek-v3", CacheFormat::bf16, 16, 12);
  dsv3.fp8_weights = true;
  dsv3.name += "/fp8-weights";
  cases.push_back(dsv3);
  Case k2 = mixed_case("kimi-k2", CacheFormat::fp8_ds_mla, 64, 13, 2);
  k2.fp8_weights = true;
  k2.name += "/fp8-weights";
  cases.push_back(k2);
  return cases;
}

namespace {

uint16_t to_act(double x, DType t) {
  return t == DType::bf16 ? float_to_bf16(float(x)) : float_to_fp16(float(x));
}
double from_act(uint16_t v, DType t) { return t == DType::bf16 ? bf16_to_float(v) : fp16_to_float(v); }

}  // namespace

Inputs make_inputs(const Case& c) {
  const MlaConfig& cfg = c.config;
  Random rng(c.seed);
  Inputs s;
  s.weights = c.weights ? *c.weights : MlaWeights::random(cfg, c.seed, c.activation);
  if (c.fp8_weights) {
    const std::pair<const char*, const HostTensor*> projections[] = {
        {"q_a_proj", &s.weights.q_a_proj},   {"q_b_proj", &s.weights.q_b_proj},
        {"q_proj", &s.weights.q_proj},       {"kv_a_proj_with_mqa", &s.weights.kv_a_proj_with_mqa},
        {"kv_b_proj", &s.weights.kv_b_proj}, {"g_proj", &s.weights.g_proj},
        {"o_proj", &s.weights.o_proj}};
    std::vector<std::string> names;
    for (const auto& [name, t] : projections)
      if (!t->empty() && s.weights.fp8.count(name) == 0) names.push_back(name);
    s.weights = s.weights.to_fp8_blocks(names);
  }
  s.weights.k_scale = c.k_scale;
  s.weights.q_scale = c.q_scale;

  // Blocks: what the requests need plus spares, handed out in a random permutation.
  std::vector<RequestSpec> reqs;
  int64_t blocks = 3;
  for (const RequestShape& r : c.requests) blocks += (int64_t(r.context_len) + r.query_len + c.block_size - 1) / c.block_size;
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  for (int64_t i = blocks - 1; i > 0; --i) std::swap(ids[i], ids[rng.below(i + 1)]);
  int64_t next = 0;
  for (const RequestShape& r : c.requests) {
    RequestSpec q{r.query_len, r.context_len, {}};
    const int64_t need = (q.seq_len() + c.block_size - 1) / c.block_size;
    for (int64_t b = 0; b < need; ++b) q.block_table.push_back(ids[next++]);
    q.block_table.push_back(-7);  // garbage past the needed entries must be ignored
    reqs.push_back(std::move(q));
  }

  // Poison every byte (NaN in every format), then write the cached context rows.
  s.cache = LatentCache::allocate(c.format, c.block_size, blocks, c.k_scale, c.tile_rule);
  std::memset(s.cache.base(), 0xff, size_t(s.cache.geometry().block_stride) * blocks);
  float row[kLatentDim];
  for (const RequestSpec& q : reqs) {
    for (int32_t p = 0; p < q.context_len; ++p) {
      for (int i = 0; i < kLatentDim; ++i) row[i] = float(from_act(to_act(rng.normal(), c.activation), c.activation));
      const int64_t slot = int64_t(q.block_table[p / c.block_size]) * c.block_size + p % c.block_size;
      s.cache.write_row(slot, row);
    }
  }

  BatchOptions opt;
  opt.decode_threshold = c.decode_threshold;
  opt.non_causal_decode = cfg.non_causal_multi_token_decode;
  opt.workspace_tokens = c.workspace_tokens;
  int64_t tokens = 0;
  for (const RequestSpec& q : reqs) tokens += q.query_len;
  opt.num_rows = tokens + c.padding_rows;
  s.md = plan_batch(reqs, s.cache.geometry(), opt);

  // Hidden states in the caller's order, then permuted into the layout.
  HostTensor caller(c.activation, {tokens, cfg.hidden_size});
  for (int64_t i = 0; i < caller.numel(); ++i) caller.data<uint16_t>()[i] = to_act(rng.normal(), c.activation);
  s.hidden = HostTensor(c.activation, {s.md.num_rows, cfg.hidden_size});
  for (int64_t i = tokens * cfg.hidden_size; i < s.hidden.numel(); ++i)
    s.hidden.data<uint16_t>()[i] = to_act(rng.normal(), c.activation);  // padding rows: junk
  permute_rows(s.md, caller.data<void>(), s.hidden.data<void>(), cfg.hidden_size, 2, true);
  s.positions = HostTensor(DType::i64, {s.md.num_rows});
  std::copy(s.md.positions.begin(), s.md.positions.end(), s.positions.data<int64_t>());
  return s;
}

namespace {

// Worst relative difference between the decoded rows of two caches at `slots`.
double cache_row_error(const LatentCache& a, const LatentCache& b, const std::vector<int64_t>& slots) {
  double worst = 0;
  float ra[kLatentDim], rb[kLatentDim];
  for (int64_t slot : slots) {
    a.read_row(slot, ra);
    b.read_row(slot, rb);
    double m = 0, d = 0;
    for (int i = 0; i < kLatentDim; ++i) {
      m = std::max(m, std::fabs(double(rb[i])));
      d = std::max(d, std::fabs(double(ra[i]) - double(rb[i])));
      if (std::isnan(ra[i]) != std::isnan(rb[i])) return INFINITY;
    }
    worst = std::max(worst, m > 0 ? d / m : d);
  }
  return worst;
}

// The case on the CUDA backend: the same poisoned cache and inputs on the device, the
// output and the cache bytes read back into `out` / `cache`.
void run_cuda(const Case& c, const Inputs& s, const std::shared_ptr<const RopeTable>& rope,
              bool portable, LatentCache& cache, HostTensor& out) {
#ifdef KMLA_HAVE_CUDA
  const MlaConfig& cfg = c.config;
  cuda::LayerOptions lo;
  lo.activation = c.activation;
  lo.fp8_prefill = c.fp8_prefill;
  lo.partial_output = cfg.tp_size > 1;
  lo.portable = portable;
  cuda::Layer layer(cfg, s.weights, lo, rope);
  const CacheGeometry& geo = s.cache.geometry();
  cuda::DeviceCache dc = cuda::DeviceCache::allocate(geo.format, geo.block_size, geo.num_blocks, c.k_scale, c.tile_rule);
  const int64_t cache_bytes = geo.block_stride * geo.num_blocks;
  const TensorView host_bytes(s.cache.base(), DType::u8, {cache_bytes});
  const TensorView dev_bytes = dc.memory.view(DType::u8, {cache_bytes});
  cuda::DeviceBuffer hidden(s.hidden.bytes()), positions(s.positions.bytes()), dout(out.bytes());
  const TensorView hv = hidden.view(c.activation, {s.hidden.dim(0), s.hidden.dim(1)});
  const TensorView pv = positions.view(DType::i64, {s.positions.dim(0)});
  const TensorView ov = dout.view(c.activation, {out.dim(0), out.dim(1)});
  cuda::Stream stream = nullptr;
  cuda::copy_to_device(host_bytes, dev_bytes, stream);
  cuda::copy_to_device(s.hidden.view(), hv, stream);
  cuda::copy_to_device(s.positions.view(), pv, stream);
  layer.forward(pv, hv, &s.md, dc.cache, ov, stream);
  cuda::copy_to_host(ov, out.view(), stream);
  cuda::copy_to_host(dev_bytes, TensorView(cache.base(), DType::u8, {cache_bytes}), stream);
  layer.check_errors(stream);  // synchronizes
#else
  KMLA_CHECK(false, "this build has no CUDA backend (case '", c.name, "', portable ", portable, ")");
  (void)s, (void)rope, (void)cache, (void)out;
#endif
}

}  // namespace

Report run_case(const Case& c, Backend backend) {
  Inputs s = make_inputs(c);
  const MlaConfig& cfg = c.config;
  std::shared_ptr<const RopeTable> rope;
  if (cfg.use_rope) rope = RopeTable::build(cfg, c.rope_rows);

  LatentCache cache_backend = s.cache.clone();
  LatentCache cache_exact = s.cache.clone();
  LatentCache cache_seed = s.cache.clone();
  HostTensor out(c.activation, {s.md.num_rows, cfg.hidden_size});
  if (backend == Backend::cpu) {
    LayerOptions lo;
    lo.activation = c.activation;
    lo.fp8_prefill = c.fp8_prefill;
    lo.partial_output = cfg.tp_size > 1;  // a rank's partial sum, compared with the oracle's
    MlaLayer layer(cfg, s.weights, lo, rope);
    layer.forward(s.positions.view(), s.hidden.view(), &s.md, cache_backend, out.view());
  } else {
    run_cuda(c, s, rope, backend == Backend::cuda_portable, cache_backend, out);
  }

  reference::Options ro;
  ro.activation = c.activation;
  ro.fp8_prefill = c.fp8_prefill;
  ro.rounding = reference::Rounding::exact;
  const reference::Result exact =
      reference::forward(cfg, s.weights, rope.get(), s.positions.view(), s.hidden.view(), &s.md, cache_exact, ro);
  ro.rounding = reference::Rounding::seed;
  const reference::Result seed =
      reference::forward(cfg, s.weights, rope.get(), s.positions.view(), s.hidden.view(), &s.md, cache_seed, ro);

  Report r;
  std::ostringstream why;
  for (size_t i = 0; i < exact.out.size(); ++i) {
    const double ref = exact.out[i];
    const double got = from_act(out.data<uint16_t>()[i], c.activation);
    if (std::isfinite(ref) != std::isfinite(got)) {
      if (!r.nonfinite_mismatch) why << "output " << i << " is " << got << ", oracle " << ref << "; ";
      r.nonfinite_mismatch = true;
      continue;
    }
    r.max_ref = std::max(r.max_ref, std::fabs(ref));
    r.err_backend = std::max(r.err_backend, std::fabs(got - ref));
    r.err_baseline = std::max(r.err_baseline, std::fabs(seed.out[i] - ref));
  }
  // Padding rows must be exactly zero.
  for (int64_t i = s.md.num_tokens * cfg.hidden_size; i < out.numel(); ++i)
    if (out.data<uint16_t>()[i] & 0x7fff) {
      r.nonfinite_mismatch = true;
      why << "padding row output " << i << " is not zero; ";
      break;
    }
  // The tolerance rule (SPEC 1b): at most twice the error of a plain same-precision
  // implementation, plus one activation ulp at the largest output, which the final
  // rounding of o_proj alone can contribute.
  const double ulp = c.activation == DType::bf16 ? 0x1p-8 : 0x1p-11;
  r.bound = 2.0 * r.err_baseline + ulp * r.max_ref;

  // New cache rows: within one storage step of the seed-rounding oracle's rows (the
  // latents may differ by an ulp, which can flip a 16-bit value by one ulp or an e4m3
  // code by one step: 2^-3 relative to the row's largest value).
  std::vector<int64_t> written;
  std::set<int64_t> written_set;
  for (int64_t row = 0; row < s.md.num_tokens; ++row)
    if (s.md.slot_mapping[row] >= 0) {
      written.push_back(s.md.slot_mapping[row]);
      written_set.insert(s.md.slot_mapping[row]);
    }
  r.cache_err = cache_row_error(cache_backend, cache_seed, written);
  const bool fp8 = c.format == CacheFormat::fp8 || c.format == CacheFormat::fp8_ds_mla;
  r.cache_bound = fp8 ? 0x1p-3 : 0x1p-7;
  const size_t entry = s.cache.geometry().entry_bytes();
  for (int64_t slot = 0; slot < s.cache.geometry().num_slots(); ++slot) {
    if (written_set.count(slot)) continue;
    if (std::memcmp(cache_backend.slot_ptr(slot), s.cache.slot_ptr(slot), entry) != 0) {
      r.untouched_ok = false;
      why << "cache slot " << slot << " changed but was not written this step; ";
      break;
    }
  }
  if (r.err_backend > r.bound) why << "error " << r.err_backend << " exceeds bound " << r.bound << "; ";
  if (r.cache_err > r.cache_bound) why << "cache row error " << r.cache_err << " exceeds " << r.cache_bound << "; ";
  r.pass = !r.nonfinite_mismatch && r.untouched_ok && r.err_backend <= r.bound && r.cache_err <= r.cache_bound;
  r.detail = why.str();
  return r;
}

}  // namespace kmla::verify
