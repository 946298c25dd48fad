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
// The length of the one sequence whose prefill_pairs is nearest `pairs` (the single-sequence
// reference of a variable-length batch with the same FLOPs).
int tokens_with_pairs(double pairs, bool causal);

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

enum class Kind { decode, prefill, layer_decode, layer_prefill, chunked_prefill, gemm };
const char* kind_name(Kind k);

struct Case {
  std::string name;  // unique; --only filters on it
  Kind kind = Kind::decode;
  int batch = 0, heads = 0, seq = 0, q_len = 1, tokens = 0, block_size = 64;
  CacheFormat format = CacheFormat::bf16;
  bool causal = true;
  bool fp8 = false;   // prefill: e4m3 inputs (the Hopper fp8 kernel), timed against bf16
  std::string model;  // layer kinds: the preset
  int tp = 1;         // layer kinds: a rank of this tensor-parallel world (heads = preset / tp)
  int rank = 0;       // layer kinds: which rank
  int cp = 1;         // decode: context-parallel world (each rank holds seq / cp keys)
  // decode: request r has mixed_lengths(batch, seq)[r] keys (mean seq) and, when q_len > 1,
  // mixed_lengths(batch, q_len)[r] query tokens, instead of seq and q_len each.
  bool mixed = false;
  std::vector<int> lengths;  // prefill: the sequences of a variable-length batch
  // layer-prefill, chunked-prefill: tokens already cached before the `tokens` new ones, and
  // the number of context chunks the layer gathers them in.
  int context = 0, chunks = 1;
  // gemm: `batch` products C_b[tokens, gemm_n] = A_b[tokens, gemm_k] . W_b with W_b [gemm_n,
  // gemm_k] (Blas::linear, batch 1) or [gemm_k, gemm_n] (Blas::batched_nn, gemm_n_major).
  int gemm_n = 0, gemm_k = 0;
  bool gemm_n_major = false;
};

Case decode_case(int batch, int heads, int seq, int q_len, CacheFormat f = CacheFormat::bf16,
                 int block_size = 64, bool causal = true);
Case prefill_case(int tokens, int heads, bool causal = true);
// prefill_case with e4m3 inputs ("prefill/fp8_t..."): its report line also gives the bf16
// kernel's time for the same shape, measured in the same run, and the ratio of the two.
Case prefill_fp8_case(int tokens, int heads, bool causal = true);
Case layer_case(Kind kind, const std::string& model, int tp, int batch, int seq, int q_len,
                int tokens, int block_size = 64, CacheFormat f = CacheFormat::bf16);

// decode_case with mixed lengths (see Case::mixed); named like it with a "_mixed" suffix. Its
// report line gives the uniform case's rate, timed right before, applied to its bytes.
Case mixed_decode_case(int batch, int heads, int seq, int q_len);
// One variable-length prefill batch of `lengths` sequences (causal), `heads` heads. Its report
// line gives the time of its FLOPs at the rate of one sequence with the same (query, key)
// pairs, timed right before.
Case varlen_prefill_case(const std::vector<int>& lengths, int heads);
// SPEC's chunked-context prefill: `tokens` new tokens of one request over `context` cached
// ones gathered in `chunks` chunks, on the preset's tp slice. Its time is everything the
// context adds to the layer (gather, kv_b over the context, attention, merges) plus the
// attention over the new tokens, against the time the same (query, key) pairs take at the
// single-sequence prefill rate (bench.cu: run_chunked_prefill).
Case chunked_prefill_case(const std::string& model, int tp, int tokens, int context, int chunks);

// One projection of the decode step alone ("gemm/..."), through Blas tuned as the layer's
// GEMMs are; its report line gives the weight bytes against the copy bandwidth and the
// untuned heuristic's time, measured in the same run, as the reference.
Case gemm_case(int batch, int tokens, int n, int k, bool n_major);

// `n` lengths in [mean / 2, 3 mean / 2], at least 1, deterministic: a spread that averages
// about `mean` and puts most requests off block boundaries.
std::vector<int32_t> mixed_lengths(int n, int mean);

// The layer a layer case runs: the preset sliced to rank c.rank of c.tp.
MlaConfig layer_config(const Case& c);

// The default list: SPEC §4's targets and the shapes users ask about.
std::vector<Case> standard_cases();

// `kmla bench --tp N`: the K3 whole-layer cases (decode steps, a prefill) as rank `rank` of
// world `tp` (tp = 1: the unsharded layer).
std::vector<Case> tp_cases(int tp, int rank);
// `kmla bench --cp N`: K3 (12 heads) decode over long contexts split along the tokens.
std::vector<Case> cp_cases(int cp);

// The one case of a custom shape (options.kind non-empty). Throws kmla::Error naming a bad
// or missing field.
Case custom_case(const BenchOptions& options);

// `requests` x `blocks_each` block ids: a random permutation of all of them, so no request
// reads contiguous memory (deterministic in `seed`), or with `shuffle` false the ids in order
// (`kmla bench --sequential-blocks`: what scattered blocks cost).
std::vector<int32_t> block_tables(int requests, int64_t blocks_each, uint64_t seed, bool shuffle);

}  // namespace kmla::bench
