// Decode context parallelism: the latent cache of each decode request split along its
// tokens across `world` ranks, every rank attending only to the tokens it owns, and the
// per-rank partial results combined by their LSEs. This file is the planning and the
// merge; it is backend-agnostic (the attention itself is kmla::decode_attention or the
// CUDA decode on each rank, and moving partials between ranks is the caller's collective).
//
// The split. For a request of seq_len tokens whose last query_len are new:
//  * non-tail ranks (0 .. world-2) own whole units of u = block_size * ceil(query_len /
//    block_size) tokens of the cached context only, so a cache block never straddles two
//    ranks and a non-tail rank owns either nothing or at least query_len tokens;
//  * the positions are cut into `world` nearly equal runs of units; every cut is capped at
//    the last unit boundary <= context_len, so the tail rank (world-1) owns the rest,
//    which always includes every new token (and at least query_len tokens).
//
// Causality follows: a non-tail rank holds only keys that every query row of the request
// sees (non-causal), and the tail rank's keys are seen causally, bottom-right aligned
// (row i of n sees local keys [0, local_len - (n-1-i))), exactly what a BatchMetadata
// with causal_decode expresses. A rank is uniformly tail or non-tail for every request,
// so the batch-wide BatchMetadata::causal_decode is the per-rank flag: cp_shard sets it to
// md.causal_decode && rank == world-1.
#pragma once

#include <cstdint>
#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/tensor.hpp"

namespace kmla {

// Token positions [start, end) of a sequence owned by one rank.
struct CpRange {
  int64_t start = 0;
  int64_t end = 0;
  int64_t size() const { return end - start; }
  bool empty() const { return end == start; }
};

// The positions rank `rank` of `world` owns of a sequence of seq_len tokens whose last
// query_len are new (see the split above). The ranges of ranks 0 .. world-1 tile
// [0, seq_len) in order. Throws kmla::Error naming the bad value.
CpRange cp_range(int64_t seq_len, int32_t query_len, int block_size, int rank, int world);

// One rank's share of a decode batch.
//
// BatchMetadata requires seq_len >= query_len for every request, which a rank owning
// nothing of a request cannot satisfy while keeping the request's query rows. So the
// shard holds only the requests the rank owns tokens of (and that have query rows), in
// the full batch's layout order, and says which full-batch rows its rows are:
//   q_shard[i] = q_full[rows[i]]   (cp_gather_rows)
//   partial_full[rows[i]] = out_shard[i], every other row 0 with LSE -inf
//                                  (cp_scatter_partial)
// When a rank owns tokens of every request, `rows` is 0 .. Td-1 and both are plain copies.
struct CpShard {
  int rank = 0;
  int world = 1;
  // Decode batch over the rank's own cache: lengths, block tables and positions are local
  // (position 0 = the range's start). Context_len is local_len - query_len. Only the tail
  // rank stores the new tokens (slot_mapping >= 0); on other ranks slot_mapping is -1.
  // `positions` index the rank's cache, they are not RoPE positions: rotate with the full
  // batch's positions.
  BatchMetadata md;
  std::vector<int32_t> requests;  // [md.num_requests] full-batch layout index of each request
  std::vector<CpRange> ranges;    // [full md.num_requests] this rank's range of every request
  std::vector<int64_t> rows;      // [md.num_decode_tokens] full-batch row of each shard row
};

// Plans rank `rank`'s share of a decode-only batch `md` (md.num_requests == md.num_decodes;
// throws otherwise). rank_tables[r] is the rank's own block table for full-batch request
// r (layout order, as md's), covering only the rank's range: local block b holds positions
// range.start + b*block_size ... of the request; it needs at least
// ceil(range.size() / block_size) entries (none for an empty range) inside rank_cache.
// The rank's cache must have md's block size. Validates the result against rank_cache.
CpShard cp_shard(const BatchMetadata& md, const std::vector<std::vector<int32_t>>& rank_tables,
                 const CacheGeometry& rank_cache, int rank, int world);

// Copies the shard's rows of a full-batch tensor (rows of row_bytes bytes, host memory):
// dst[i] = src[shard.rows[i]].
void cp_gather_rows(const CpShard& shard, const void* src, void* dst, size_t row_bytes);

// Expands a shard's decode result (f32 host, out [Ts, H, D], lse [Ts, H]) to the full
// batch's decode rows (out [Td, H, D], lse [Td, H]): rows the shard does not hold get
// zeros and -inf, the partial of a rank that sees no key of them.
void cp_scatter_partial(const CpShard& shard, const TensorView& shard_out,
                        const TensorView& shard_lse, const TensorView& out, const TensorView& lse);

// Merges the world ranks' partial results (f32 host, out [Td, H, D], lse [Td, H] each, in
// any order) by the LSE rule: out = sum_k exp(lse_k - lse) out_k with lse = log sum_k
// exp(lse_k). +-inf LSEs count as empty (-inf); a row empty on every rank gets zeros and
// -inf. The result is the same as folding kmla::merge_attn_states over the partials (up to
// fp32 rounding order). out/lse may alias the first partial.
void cp_merge(const std::vector<TensorView>& partial_out, const std::vector<TensorView>& partial_lse,
              const TensorView& out, const TensorView& lse);

}  // namespace kmla
