// The benchmark cases of `kmla bench` and the formulas every figure comes from (SPEC §4's
// measuring conventions). Host-only: the timing and the device work live in bench.cu.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/weights.hpp"

namespace kmla::bench {

// ---- the measuring conventions -----------------------------------------------------------

// Decode attention FLOPs, as FlashMLA / FlashInfer count them: per (query row, head, key) a
// 576-wide QK dot product and a 512-wide PV product, 2 FLOPs per multiply-add:
// 2 * B * q * H * S * (576 + 512). Keys that a causal multi-token block masks are not subtracted.
double decode_flops(int64_t batch, int64_t q_len, int64_t heads, int64_t seq);

// Decode attention bytes: each request's cache rows read once (V is the first 512 columns of
// K, so it costs nothing extra): B * S * (bf16 1152, fp8 576, fp8_ds_mla 656). Queries and
// outputs are left out.
double decode_bytes(int64_t batch, int64_t seq, CacheFormat format);

// (query, key) pairs one sequence of `tokens` queries over the same `tokens` keys attends:
// T(T+1)/2 causal, T^2 otherwise.
double prefill_pairs(int64_t tokens, bool causal);

// Prefill attention FLOPs: a 192-wide QK and a 128-wide PV product per pair and head,
// 2 * H * (192 + 128) * pairs.
double prefill_flops(int64_t heads, double pairs);

// FLOPs of the layer's projections for `rows` tokens, 2 * rows * in * out per GEMM: the front
// end (fused hidden -> [q_c | kv_c | k_pe] and q_b, or q_proj and kv_a), g_proj, o_proj, and
// kv_b (prefill) or, when `absorbed` (decode), q_nope . W_UK_T (128 -> 512 per head) and
// latent . W_UV (512 -> 128 per head). Attention is not included.
double layer_projection_flops(const MlaConfig& c, int64_t rows, bool absorbed);

// Bytes of every weight tensor of the layer (what a decode step must read at least once).
double weight_bytes(const MlaWeights& w);

// ---- cases -------------------------------------------------------------------------------

enum class Kind { decode, prefill, layer_decode, layer_prefill };
const char* kind_name(Kind k);

struct Case {
  std::string name;  // unique; --only filters on it
  Kind kind = Kind::decode;
  int batch = 0, heads = 0, seq = 0, q_len = 1, tokens = 0, block_size = 64;
  CacheFormat format = CacheFormat::bf16;
  bool causal = true;
  std::string model;  // layer kinds: the preset
  int tp = 1;         // layer kinds: rank 0 of this tensor-parallel world (heads = preset / tp)
};

Case decode_case(int batch, int heads, int seq, int q_len, CacheFormat f = CacheFormat::bf16,
                 int block_size = 64, bool causal = true);
Case prefill_case(int tokens, int heads, bool causal = true);
Case layer_case(Kind kind, const std::string& model, int tp, int batch, int seq, int q_len,
                int tokens, int block_size = 64, CacheFormat f = CacheFormat::bf16);

// The layer a layer case runs: the preset sliced to rank 0 of c.tp.
MlaConfig layer_config(const Case& c);

// The default list: SPEC §4's targets and the shapes users ask about.
std::vector<Case> standard_cases();

// The one case of a custom shape (options.kind non-empty). Throws kmla::Error naming a bad
// or missing field.
Case custom_case(const BenchOptions& options);

// `requests` x `blocks_each` block ids: a random permutation of all of them, so no request
// reads contiguous memory. Deterministic in `seed`.
std::vector<int32_t> random_block_tables(int requests, int64_t blocks_each, uint64_t seed);

}  // namespace kmla::bench
