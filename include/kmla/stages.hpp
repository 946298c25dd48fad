// The layer's stages as public calls, for engines that own their GEMMs and
// collectives. Activations are bf16 or f16 ([rows, ...] row-major). LSEs are fp32,
// natural log, laid out [tokens, heads]; a row that sees no keys gets zeros and -inf.
#pragma once

#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/rope.hpp"

namespace kmla {

// Writes [kv_c_normed | rope(k_pe)] to `cache` for every token with slot >= 0.
// kv_c_normed [T, 512], k_pe [T, 64] (un-rotated), positions i64 [T] (ignored when
// rope == nullptr), slot_mapping i64 [T]. All slots are checked before any write.
void cache_insert(const TensorView& kv_c_normed, const TensorView& k_pe,
                  const TensorView& positions, const RopeTable* rope,
                  const TensorView& slot_mapping, LatentCache& cache);

// The same for several layers at once (the DSpark draft's context path): kv_c_normed
// [T, L, 512], k_pe [T, L, 64], one cache per layer (all with the same block size).
void cache_insert_layers(const TensorView& kv_c_normed, const TensorView& k_pe,
                         const TensorView& positions, const RopeTable* rope,
                         const TensorView& slot_mapping, const std::vector<LatentCache*>& caches);

// Absorbed MQA over the latent cache for the decode rows of `md` (the first
// md.num_decode_tokens rows). q [Td, H, 576] = [ql_nope | q_pe] in the activation dtype,
// or e4m3 (dtype e4m3) dequantized with q_scale (plain fp8 cache). out [Td, H, 512] in the
// activation dtype given by `out`; lse f32 [Td, H].
void decode_attention(const TensorView& q, float q_scale, const LatentCache& cache,
                      const BatchMetadata& md, double softmax_scale, const TensorView& out,
                      const TensorView& lse);

// Variable-length attention with qk head 192 and v head 128: sequence s has queries
// [cu_q[s], cu_q[s+1]) and keys [cu_k[s], cu_k[s+1]). causal: bottom-right aligned
// (query i of n sees keys [0, m - n + i]). q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128]
// (activation dtype, or all e4m3 for the fp8 prefill mode); out [Tq, H, 128] in the
// activation dtype; lse f32 [Tq, H].
void prefill_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k,
                       bool causal, double softmax_scale, const TensorView& out,
                       const TensorView& lse);

// Merges two partial attention results by their LSEs. Rows >= rows_with_prefix take the
// suffix unchanged. +-inf LSEs count as -inf (empty); both empty gives the prefix output
// (zeros) and -inf. out_lse may be empty (data == nullptr).
void merge_attn_states(const TensorView& prefix_out, const TensorView& prefix_lse,
                       const TensorView& suffix_out, const TensorView& suffix_lse,
                       int64_t rows_with_prefix, const TensorView& out,
                       const TensorView& out_lse);

}  // namespace kmla
