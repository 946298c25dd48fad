// The case list of `kmla bench` and its FLOP / byte formulas (see cases.hpp).
#include "bench/cases.hpp"

#include <algorithm>
#include <cmath>
#include <random>

namespace kmla::bench {
namespace {

std::string decode_name(int b, int h, int s, int q, int bs, CacheFormat f, bool causal) {
  std::string n = "decode/" + std::string(cache_format_name(f)) + "/b" + std::to_string(b) + "_h" +
                  std::to_string(h) + "_s" + std::to_string(s) + "_q" + std::to_string(q) + "_bs" +
                  std::to_string(bs);
  if (q > 1 && !causal) n += "_noncausal";
  return n;
}

CacheFormat bench_format(const std::string& s) {
  const CacheFormat f = parse_cache_format(s);
  KMLA_CHECK(f == CacheFormat::bf16 || f == CacheFormat::fp8 || f == CacheFormat::fp8_ds_mla,
             "bench cache format '", s, "': use bf16, fp8 or fp8_ds_mla");
  return f;
}

}  // namespace

double decode_flops(int64_t batch, int64_t q_len, int64_t heads, int64_t seq) {
  return 2.0 * double(batch) * double(q_len) * double(heads) * double(seq) *
         double(kLatentDim + kKvLoraRank);
}

double decode_bytes(int64_t batch, int64_t seq, CacheFormat format) {
  return double(batch) * double(seq) * double(cache_entry_bytes(format));
}

double prefill_pairs(int64_t tokens, bool causal) {
  const double t = double(tokens);
  return causal ? t * (t + 1) / 2 : t * t;
}

int tokens_with_pairs(double pairs, bool causal) {
  // Causal: T (T + 1) / 2 = pairs at T = (sqrt(8 pairs + 1) - 1) / 2; otherwise T = sqrt(pairs).
  const double t = causal ? (std::sqrt(8.0 * pairs + 1.0) - 1.0) / 2.0 : std::sqrt(pairs);
  return std::max(1, int(std::lround(t)));
}

double prefill_flops(int64_t heads, double pairs) {
  return 2.0 * double(heads) * double(kQkHeadDim + kVDim) * pairs;
}

double layer_projection_flops(const MlaConfig& c, int64_t rows, bool absorbed) {
  const double m = double(rows), hid = c.hidden_size, h = c.local_heads();
  double f = 0;
  if (c.q_lora_rank) {
    const double r = *c.q_lora_rank;
    f += 2 * m * hid * (r + kLatentDim);  // fused front end hidden -> [q_c | kv_c | k_pe]
    f += 2 * m * r * h * kQkHeadDim;      // q_b
  } else {
    f += 2 * m * hid * h * kQkHeadDim;  // q_proj
    f += 2 * m * hid * kLatentDim;      // kv_a_proj_with_mqa
  }
  if (absorbed) {
    f += 2 * m * h * kNopeDim * kKvLoraRank;  // q_nope . W_UK_T
    f += 2 * m * h * kKvLoraRank * kVDim;     // latent . W_UV
  } else {
    f += 2 * m * kKvLoraRank * h * kKvBOut;  // kv_b
  }
  if (c.use_output_gate) f += 2 * m * hid * h * kVDim;  // g_proj
  f += 2 * m * h * kVDim * hid;                          // o_proj
  return f;
}

double weight_bytes(const MlaWeights& w) {
  double b = 0;
  for (const HostTensor* t : {&w.q_a_proj, &w.q_a_layernorm, &w.q_b_proj, &w.q_proj,
                              &w.kv_a_proj_with_mqa, &w.kv_a_layernorm, &w.kv_b_proj, &w.g_proj,
                              &w.o_proj})
    if (!t->empty()) b += double(t->bytes());
  return b;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::decode: return "decode";
    case Kind::prefill: return "prefill";
    case Kind::layer_decode: return "layer-decode";
    case Kind::layer_prefill: return "layer-prefill";
    case Kind::chunked_prefill: return "chunked-prefill";
    case Kind::gemm:
      return "gemm";
  }
  return "?";
}

Case decode_case(int b, int h, int s, int q, CacheFormat f, int bs, bool causal) {
  Case c;
  c.kind = Kind::decode;
  c.batch = b, c.heads = h, c.seq = s, c.q_len = q, c.block_size = bs, c.format = f;
  c.causal = causal;
  c.name = decode_name(b, h, s, q, bs, f, causal);
  return c;
}

Case prefill_case(int tokens, int heads, bool causal) {
  Case c;
  c.kind = Kind::prefill;
  c.tokens = tokens, c.heads = heads, c.causal = causal;
  c.name = "prefill/t" + std::to_string(tokens) + "_h" + std::to_string(heads) +
           (causal ? "_causal" : "_noncausal");
  return c;
}

Case prefill_fp8_case(int tokens, int heads, bool causal) {
  Case c = prefill_case(tokens, heads, causal);
  c.fp8 = true;
  c.name = "prefill/fp8_t" + std::to_string(tokens) + "_h" + std::to_string(heads) +
           (causal ? "_causal" : "_noncausal");
  return c;
}

Case gemm_case(int batch, int tokens, int n, int k, bool n_major) {
  Case c;
  c.kind = Kind::gemm;
  c.batch = batch, c.tokens = tokens, c.gemm_n = n, c.gemm_k = k, c.gemm_n_major = n_major;
  c.name = (batch > 1 ? "gemm/batched" + std::to_string(batch) : std::string("gemm/linear")) +
           "_m" + std::to_string(tokens) + "_n" + std::to_string(n) + "_k" + std::to_string(k);
  return c;
}

Case mixed_decode_case(int b, int h, int s, int q) {
  Case c = decode_case(b, h, s, q);
  c.mixed = true;
  c.name += "_mixed";
  return c;
}

Case varlen_prefill_case(const std::vector<int>& lengths, int heads) {
  Case c;
  c.kind = Kind::prefill;
  c.lengths = lengths;
  c.heads = heads;
  for (int n : lengths) c.tokens += n;
  c.name = "prefill/varlen" + std::to_string(lengths.size()) + "_t" + std::to_string(c.tokens) +
           "_h" + std::to_string(heads) + "_causal";
  return c;
}

Case chunked_prefill_case(const std::string& model, int tp, int tokens, int context, int chunks) {
  Case c = layer_case(Kind::layer_prefill, model, tp, 0, 0, 0, tokens);
  c.kind = Kind::chunked_prefill;
  c.context = context, c.chunks = chunks;
  c.name = std::string(kind_name(c.kind)) + "/" + model + "_tp" + std::to_string(tp) + "_h" +
           std::to_string(c.heads) + "/t" + std::to_string(tokens) + "_ctx" + std::to_string(context) +
           "_chunks" + std::to_string(chunks);
  return c;
}

std::vector<int32_t> mixed_lengths(int n, int mean) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int32_t& len : v) {  // xorshift64: the same spread on every machine
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    len = std::max<int32_t>(1, int32_t(mean / 2 + int64_t(x % uint64_t(mean + 1))));
  }
  return v;
}

MlaConfig layer_config(const Case& c) { return MlaConfig::preset(c.model).tp_slice(c.rank, c.tp); }

Case layer_case(Kind kind, const std::string& model, int tp, int batch, int seq, int q_len, int tokens,
                int bs, CacheFormat f) {
  Case c;
  c.kind = kind;
  c.model = model, c.tp = tp, c.batch = batch, c.seq = seq, c.q_len = q_len, c.tokens = tokens;
  c.block_size = bs, c.format = f;
  const MlaConfig cfg = layer_config(c);
  c.heads = cfg.local_heads();
  c.causal = !cfg.non_causal_multi_token_decode;
  c.name = std::string(kind_name(kind)) + "/" + model + "_tp" + std::to_string(tp) + "_h" +
           std::to_string(c.heads) + "/";
  if (kind == Kind::layer_decode)
    c.name += "b" + std::to_string(batch) + "_s" + std::to_string(seq) + "_q" +
              std::to_string(q_len) + "_bs" + std::to_string(bs) + "_" + cache_format_name(f);
  else
    c.name += "t" + std::to_string(tokens) + "_" + cache_format_name(f);
  return c;
}

// SPEC §4's targets and the shapes users ask about: TP 1..8 head counts, MTP / DSpark
// multi-token blocks, long single sequences, fp8 caches, block sizes. With iters = 20 the list
// runs in well under two minutes on an H200.
std::vector<Case> standard_cases() {
  using F = CacheFormat;
  std::vector<Case> v = {
      decode_case(128, 16, 4096, 1),  // memory-bound, TP8 of a 128-head model
      decode_case(128, 12, 8192, 1),  // memory-bound, K3 at TP8
      decode_case(128, 8, 8192, 1),
      decode_case(128, 6, 8192, 1),
      decode_case(32, 12, 32768, 1),
      decode_case(4, 12, 262144, 1),
      decode_case(1, 12, 1048576, 1),  // one 1M-token sequence (1.2 GB of bf16 cache)
      decode_case(1, 12, 65536, 1),    // one long sequence: the split-KV target
      decode_case(128, 12, 512, 1),    // short contexts: what a call costs besides its stream
      decode_case(128, 128, 4096, 1),  // compute-bound (heads x q_len >= 128)
      decode_case(64, 128, 8192, 1),
      decode_case(64, 64, 8192, 2),
      decode_case(16, 128, 4096, 1),
      decode_case(128, 12, 8192, 4),                    // MTP: causal 4-token blocks
      decode_case(64, 8, 8192, 8, F::bf16, 64, false),  // DSpark draft: non-causal 8-token blocks
      decode_case(128, 16, 4096, 1, F::fp8_ds_mla),
      decode_case(128, 12, 8192, 1, F::fp8_ds_mla),
      decode_case(128, 16, 4096, 1, F::fp8),
      decode_case(128, 12, 8192, 1, F::fp8),
      decode_case(128, 12, 8192, 1, F::bf16, 16),
      decode_case(128, 12, 8192, 1, F::bf16, 256),
      prefill_case(8192, 64),
      prefill_case(8192, 16),
      prefill_case(32768, 16),
      prefill_fp8_case(8192, 64),
      prefill_fp8_case(8192, 16),
      layer_case(Kind::layer_decode, "kimi-k3", 8, 128, 8192, 1, 0),
      layer_case(Kind::layer_prefill, "kimi-k3", 8, 0, 0, 0, 8192),
      // Mixed batches against the uniform ones above (same mean bytes / FLOPs).
      mixed_decode_case(128, 12, 8192, 1),
      mixed_decode_case(128, 12, 8192, 4),
      // 16 sequences of 1..8192 tokens (32k in all) against one sequence of the same FLOPs.
      varlen_prefill_case(
          {8192, 5000, 4096, 3333, 2500, 2048, 1800, 1500, 1200, 1025, 1000, 513, 300, 255, 3, 1},
          16),
      chunked_prefill_case("kimi-k3", 6, 8192, 24576, 4),
      // The K3 decode step's projections at 12 heads, 128 tokens: [q_a; kv_a; g], q_b, the
      // absorbed W_UK_T (with the rope identity) and W_UV, o_proj.
      gemm_case(1, 128, 3648, 7168, false),
      gemm_case(1, 128, 2304, 1536, false),
      gemm_case(12, 128, 576, 192, true),
      gemm_case(12, 128, 128, 512, true),
      gemm_case(1, 128, 7168, 1536, false),
  };
  return v;
}

// The K3 decode step the PERF table tracks at TP 1/2/4/8 (128 requests x 8k), a long-context
// step (32 x 32k) and an 8k prefill.
std::vector<Case> tp_cases(int tp, int rank) {
  KMLA_CHECK(tp >= 1 && rank >= 0 && rank < tp, "bench rank ", rank, " outside [0, ", tp, ")");
  std::vector<Case> v = {
      layer_case(Kind::layer_decode, "kimi-k3", tp, 128, 8192, 1, 0),
      layer_case(Kind::layer_decode, "kimi-k3", tp, 32, 32768, 1, 0),
      layer_case(Kind::layer_prefill, "kimi-k3", tp, 0, 0, 0, 8192),
  };
  for (Case& c : v) c.rank = rank;
  return v;
}

// One 1M-token sequence, 4 x 256k and 128 x 8k, at K3's 12 heads per GPU.
std::vector<Case> cp_cases(int cp) {
  KMLA_CHECK(cp >= 1, "context-parallel world must be >= 1, got ", cp);
  std::vector<Case> v = {decode_case(1, 12, 1048576, 1), decode_case(4, 12, 262144, 1), decode_case(128, 12, 8192, 1)};
  for (Case& c : v) {
    c.cp = cp;
    c.name += "_cp" + std::to_string(cp);
  }
  return v;
}

Case custom_case(const BenchOptions& o) {
  const CacheFormat f = bench_format(o.cache_format);
  KMLA_CHECK(o.block_size >= 1 && o.block_size <= 1024, "block size ", o.block_size, " outside 1..1024");
  if (o.kind == "decode") {
    KMLA_CHECK(o.batch > 0 && o.heads > 0 && o.seq > 0, "decode needs --batch, --heads and --seq > 0, got ",
               o.batch, ", ", o.heads, ", ", o.seq);
    KMLA_CHECK(o.q_len >= 1 && o.q_len <= o.seq, "q_len ", o.q_len, " outside 1..seq");
    return decode_case(o.batch, o.heads, o.seq, o.q_len, f, o.block_size, o.causal);
  }
  if (o.kind == "prefill") {
    const int t = o.tokens > 0 ? o.tokens : o.seq;
    KMLA_CHECK(t > 0 && o.heads > 0, "prefill needs --tokens and --heads > 0, got ", t, ", ", o.heads);
    return prefill_case(t, o.heads, o.causal);
  }
  KMLA_CHECK(o.kind == "layer-decode" || o.kind == "layer-prefill", "bench kind '", o.kind,
             "': use decode, prefill, layer-decode or layer-prefill");
  const MlaConfig full = MlaConfig::preset(o.model);
  int tp = full.num_heads % 8 == 0 ? 8 : 1;
  if (o.heads > 0) {
    KMLA_CHECK(full.num_heads % o.heads == 0, o.model, " has ", full.num_heads,
               " heads: no tensor-parallel slice gives ", o.heads);
    tp = full.num_heads / o.heads;
  }
  if (o.kind == "layer-decode") {
    KMLA_CHECK(o.batch > 0 && o.seq > 0, "layer-decode needs --batch and --seq > 0");
    // A decode request needs cached context: q_len < seq.
    KMLA_CHECK(o.q_len >= 1 && o.q_len <= 128 && o.q_len < o.seq, "q_len ", o.q_len,
               " outside 1..min(128, seq - 1)");
    return layer_case(Kind::layer_decode, o.model, tp, o.batch, o.seq, o.q_len, 0, o.block_size, f);
  }
  const int t = o.tokens > 0 ? o.tokens : o.seq;
  KMLA_CHECK(t > 0, "layer-prefill needs --tokens > 0");
  return layer_case(Kind::layer_prefill, o.model, tp, 0, 0, 0, t, o.block_size, f);
}

std::vector<int32_t> block_tables(int requests, int64_t blocks_each, uint64_t seed, bool shuffle) {
  std::vector<int32_t> ids(size_t(requests * blocks_each));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
  if (shuffle) std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  return ids;
}

}  // namespace kmla::bench
