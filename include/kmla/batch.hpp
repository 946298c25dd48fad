// Batch metadata: from per-request lengths and block tables (in any order) to the
// layout attention needs — decodes, then prefills with cached context, then fresh
// prefills — with slot mapping, padding rows and the chunked-context plan. All of it is
// validated here, on the host, before anything touches a cache.
#pragma once

#include <cstdint>
#include <vector>

#include "kmla/cache.hpp"

namespace kmla {

struct RequestSpec {
  int32_t query_len = 0;             // new tokens of this step
  int32_t context_len = 0;           // tokens already in the cache
  std::vector<int32_t> block_table;  // at least ceil((context+query)/block_size) ids

  int64_t seq_len() const { return int64_t(context_len) + query_len; }
  // For callers that think in (query_len, seq_len): throws if query_len > seq_len.
  static RequestSpec from_seq_len(int32_t query_len, int64_t seq_len, std::vector<int32_t> table);
};

struct BatchOptions {
  // Requests with 1 <= query_len <= decode_threshold and cached context take the
  // absorbed decode path (1..128; FlashMLA-style engines use up to 128).
  int decode_threshold = 1;
  // DSpark draft layers: every token of a multi-token decode block sees the whole
  // sequence. Otherwise decode blocks are causal, bottom-right aligned.
  bool non_causal_decode = false;
  // Use the caller's request order as is; it must already be decode -> prefill with
  // context -> fresh prefill, or planning throws.
  bool keep_order = false;
  // Rows of the batch including padding (CUDA graphs); 0 means exactly the real tokens.
  int64_t num_rows = 0;
  // Upper bound on context rows gathered per chunk (summed over requests).
  int64_t workspace_tokens = 65536;
  // Optional caller slot mapping, one per real token in the caller's order (requests as
  // given, their tokens consecutive); -1 = do not write. Empty: derived from the tables.
  std::vector<int64_t> slot_mapping;
};

enum class RequestKind : uint8_t { decode, context_prefill, fresh_prefill };

// One context chunk: for each prefill-with-context request (in layout order, index j),
// the context rows [start, start + len[j]) are attended in this chunk.
struct ContextChunk {
  int64_t start = 0;
  std::vector<int32_t> len;      // [num_context_prefills]
  std::vector<int64_t> cu_len;   // [num_context_prefills + 1]
  int64_t total() const { return cu_len.empty() ? 0 : cu_len.back(); }
};

struct BatchMetadata {
  int num_requests = 0;
  int num_decodes = 0;
  int num_context_prefills = 0;
  int num_fresh_prefills = 0;
  int64_t num_tokens = 0;         // real tokens
  int64_t num_rows = 0;           // rows including padding
  int64_t num_decode_tokens = 0;  // the first rows
  int64_t prefill_tokens_with_context = 0;  // leading rows of the prefill slice with context
  int decode_threshold = 1;
  bool causal_decode = true;
  int max_query_len = 0;
  int max_decode_query_len = 0;

  int block_size = 0;
  int64_t num_cache_blocks = 0;

  // Layout order (index r = position in the layout):
  std::vector<int32_t> request_order;  // [R] layout -> caller request index
  std::vector<int64_t> row_order;      // [num_tokens] layout row -> caller row
  std::vector<int32_t> query_lens, context_lens;  // [R]
  std::vector<int64_t> seq_lens;                  // [R]
  std::vector<int64_t> query_start;               // [R + 1]
  int max_blocks_per_request = 0;
  std::vector<int32_t> block_tables;  // [R, max_blocks_per_request], unused entries -1
  std::vector<int64_t> slot_mapping;  // [num_rows], -1 on padding rows
  std::vector<int64_t> positions;     // [num_rows]: context_len + i, 0 on padding rows

  // Chunked context for the prefills with context.
  int64_t context_chunk_tokens = 0;  // per-request rows per chunk
  std::vector<ContextChunk> context_chunks;

  RequestKind kind(int r) const {
    return r < num_decodes ? RequestKind::decode
           : r < num_decodes + num_context_prefills ? RequestKind::context_prefill
                                                     : RequestKind::fresh_prefill;
  }
  const int32_t* block_table(int r) const {
    return block_tables.data() + int64_t(r) * max_blocks_per_request;
  }
  // Cache slot of token position `pos` of request r (through its block table).
  int64_t slot_of(int r, int64_t pos) const {
    return int64_t(block_table(r)[pos / block_size]) * block_size + pos % block_size;
  }
  // Keys visible to query token i (0-based within its request) of decode request r.
  int64_t decode_key_count(int r, int i) const {
    if (!causal_decode) return seq_lens[r];
    return seq_lens[r] - (query_lens[r] - 1 - i);
  }
};

// Plans a batch against a cache geometry. Throws kmla::Error naming the bad value.
BatchMetadata plan_batch(const std::vector<RequestSpec>& requests, const CacheGeometry& cache,
                         const BatchOptions& options = {});

// Checks that metadata (planned here, or built or modified by a caller) is consistent in
// itself and with the cache geometry: counts, per-request lengths and kinds, block tables
// inside the cache, decode/prefill splits, and context chunks tiling every context exactly.
// Backends call it before touching a cache. Throws kmla::Error naming the inconsistency.
void validate_batch(const BatchMetadata& md, const CacheGeometry& cache);

// Reorders rows between the caller's order and the layout (rows are `width` elements of
// `elem_bytes` each). to_layout: dst[layout row] = src[caller row]; else the inverse.
void permute_rows(const BatchMetadata& md, const void* src, void* dst, int64_t width,
                  size_t elem_bytes, bool to_layout);

}  // namespace kmla
