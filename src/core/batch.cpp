#include "kmla/batch.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "kmla/error.hpp"

namespace kmla {

RequestSpec RequestSpec::from_seq_len(int32_t query_len, int64_t seq_len, std::vector<int32_t> table) {
  KMLA_CHECK(query_len >= 0, "query length must be >= 0, got ", query_len);
  KMLA_CHECK(seq_len >= query_len, "query length ", query_len, " is larger than the sequence length ",
             seq_len);
  KMLA_CHECK(seq_len <= INT32_MAX, "sequence length ", seq_len, " exceeds 2^31-1");
  return RequestSpec{query_len, int32_t(seq_len - query_len), std::move(table)};
}

namespace {

RequestKind classify(const RequestSpec& r, int threshold) {
  if (r.query_len <= threshold && (r.context_len > 0 || r.query_len == 0)) return RequestKind::decode;
  return r.context_len > 0 ? RequestKind::context_prefill : RequestKind::fresh_prefill;
}

const char* kind_name(RequestKind k) {
  switch (k) {
    case RequestKind::decode: return "decode";
    case RequestKind::context_prefill: return "prefill with context";
    case RequestKind::fresh_prefill: return "fresh prefill";
  }
  return "?";
}

}  // namespace

BatchMetadata plan_batch(const std::vector<RequestSpec>& reqs, const CacheGeometry& cache,
                         const BatchOptions& opt) {
  cache.validate();
  KMLA_CHECK(opt.decode_threshold >= 1 && opt.decode_threshold <= 128,
             "decode threshold must be in [1, 128], got ", opt.decode_threshold);
  KMLA_CHECK(opt.workspace_tokens >= 1, "context workspace must hold at least one token, got ",
             opt.workspace_tokens);
  KMLA_CHECK(reqs.size() <= size_t(INT32_MAX), "too many requests: ", reqs.size());

  const int R = int(reqs.size());
  const int bs = cache.block_size;
  BatchMetadata md;
  md.num_requests = R;
  md.decode_threshold = opt.decode_threshold;
  md.causal_decode = !opt.non_causal_decode;
  md.block_size = bs;
  md.num_cache_blocks = cache.num_blocks;

  // Validate every request, and find the caller-order token offsets.
  std::vector<int64_t> caller_start(R + 1, 0);
  for (int i = 0; i < R; ++i) {
    const RequestSpec& r = reqs[i];
    KMLA_CHECK(r.query_len >= 0, "request ", i, ": query length must be >= 0, got ", r.query_len);
    KMLA_CHECK(r.context_len >= 0, "request ", i, ": context length must be >= 0, got ", r.context_len);
    KMLA_CHECK(r.seq_len() <= INT32_MAX, "request ", i, ": sequence length ", r.seq_len(),
               " exceeds 2^31-1");
    const int64_t need = (r.seq_len() + bs - 1) / bs;
    KMLA_CHECK(int64_t(r.block_table.size()) >= need, "request ", i, ": block table has ",
               r.block_table.size(), " entries, sequence length ", r.seq_len(), " needs ", need,
               " blocks of ", bs);
    for (int64_t b = 0; b < need; ++b) {
      const int32_t id = r.block_table[b];
      KMLA_CHECK(id >= 0 && id < cache.num_blocks, "request ", i, ": block table entry ", b, " = ", id,
                 " is outside the cache's blocks [0, ", cache.num_blocks, ")");
    }
    caller_start[i + 1] = caller_start[i] + r.query_len;
    md.max_blocks_per_request = std::max<int>(md.max_blocks_per_request, int(need));
  }
  md.num_tokens = caller_start[R];
  KMLA_CHECK(opt.num_rows >= 0, "batch rows must be >= 0 (0 = the real tokens), got ", opt.num_rows);
  md.num_rows = opt.num_rows == 0 ? md.num_tokens : opt.num_rows;
  KMLA_CHECK(md.num_rows >= md.num_tokens, "batch rows ", md.num_rows, " are fewer than its ",
             md.num_tokens, " real tokens");
  KMLA_CHECK(opt.slot_mapping.empty() || int64_t(opt.slot_mapping.size()) == md.num_tokens,
             "slot mapping has ", opt.slot_mapping.size(), " entries for ", md.num_tokens, " tokens");

  // Layout order: a stable partition decode -> context prefill -> fresh prefill.
  std::vector<RequestKind> kinds(R);
  for (int i = 0; i < R; ++i) kinds[i] = classify(reqs[i], opt.decode_threshold);
  if (opt.keep_order) {
    // Requests without tokens (engines pad batches with them) own no rows, so they may
    // stand anywhere; every other request must not come after a later kind.
    int last = -1;
    for (int i = 0; i < R; ++i) {
      if (reqs[i].query_len == 0) continue;
      KMLA_CHECK(last < 0 || kinds[i] >= kinds[last], "request order: request ", i, " (",
                 kind_name(kinds[i]), ") follows a ", kind_name(kinds[last]),
                 "; the layout must be decodes, then prefills with context, then fresh prefills");
      last = i;
    }
  }
  for (int k = 0; k < 3; ++k)
    for (int i = 0; i < R; ++i)
      if (int(kinds[i]) == k) md.request_order.push_back(i);

  md.query_lens.resize(R);
  md.context_lens.resize(R);
  md.seq_lens.resize(R);
  md.query_start.assign(R + 1, 0);
  md.block_tables.assign(size_t(R) * md.max_blocks_per_request, -1);
  md.slot_mapping.assign(md.num_rows, -1);
  md.positions.assign(md.num_rows, 0);
  md.row_order.resize(md.num_tokens);
  std::unordered_set<int64_t> written;
  for (int r = 0; r < R; ++r) {
    const int src = md.request_order[r];
    const RequestSpec& q = reqs[src];
    const RequestKind kind = kinds[src];
    md.query_lens[r] = q.query_len;
    md.context_lens[r] = q.context_len;
    md.seq_lens[r] = q.seq_len();
    md.query_start[r + 1] = md.query_start[r] + q.query_len;
    md.max_query_len = std::max(md.max_query_len, q.query_len);
    if (kind == RequestKind::decode) {
      md.num_decodes++;
      md.max_decode_query_len = std::max(md.max_decode_query_len, q.query_len);
    } else if (kind == RequestKind::context_prefill) {
      md.num_context_prefills++;
    } else {
      md.num_fresh_prefills++;
    }
    const int64_t need = (q.seq_len() + bs - 1) / bs;
    std::copy_n(q.block_table.begin(), need, md.block_tables.begin() + int64_t(r) * md.max_blocks_per_request);
    for (int32_t i = 0; i < q.query_len; ++i) {
      const int64_t row = md.query_start[r] + i;
      const int64_t caller_row = caller_start[src] + i;
      const int64_t pos = int64_t(q.context_len) + i;
      md.row_order[row] = caller_row;
      md.positions[row] = pos;
      int64_t slot = md.slot_of(r, pos);
      if (!opt.slot_mapping.empty()) {
        slot = opt.slot_mapping[caller_row];
        if (slot >= 0) {
          const int64_t blk = slot / bs;
          const bool owned =
              std::find(q.block_table.begin(), q.block_table.begin() + need, int32_t(blk)) !=
              q.block_table.begin() + need;
          KMLA_CHECK(blk < cache.num_blocks && owned, "slot mapping: token ", caller_row, " (request ",
                     src, ") has slot ", slot, ", which is not in the request's blocks");
        } else {
          KMLA_CHECK(slot == -1, "slot mapping: token ", caller_row, " has slot ", slot,
                     "; only -1 means 'do not write'");
        }
      }
      if (slot >= 0)
        KMLA_CHECK(written.insert(slot).second, "slot mapping: slot ", slot,
                   " is written by two tokens of this batch (token ", caller_row, ")");
      md.slot_mapping[row] = slot;
    }
  }
  md.num_decode_tokens = md.query_start[md.num_decodes];
  md.prefill_tokens_with_context =
      md.query_start[md.num_decodes + md.num_context_prefills] - md.num_decode_tokens;

  // Chunked context: each chunk gathers up to `chunk` rows per request with context so
  // that the whole chunk fits the workspace. Rounded down to whole blocks when possible.
  if (md.num_context_prefills > 0) {
    // Every chunk gathers rows of all these requests at once, so each needs at least one
    // workspace row; a smaller workspace could only be honoured by overflowing it.
    KMLA_CHECK(opt.workspace_tokens >= md.num_context_prefills, "context workspace of ",
               opt.workspace_tokens, " tokens cannot hold one row for each of the ",
               md.num_context_prefills, " prefills with context");
    int64_t chunk = opt.workspace_tokens / md.num_context_prefills;
    if (chunk >= bs) chunk = chunk / bs * bs;
    md.context_chunk_tokens = chunk;
    int64_t max_ctx = 0;
    for (int j = 0; j < md.num_context_prefills; ++j)
      max_ctx = std::max<int64_t>(max_ctx, md.context_lens[md.num_decodes + j]);
    const int64_t n_chunks = (max_ctx + chunk - 1) / chunk;
    for (int64_t c = 0; c < n_chunks; ++c) {
      ContextChunk ch;
      ch.start = c * chunk;
      ch.cu_len.push_back(0);
      for (int j = 0; j < md.num_context_prefills; ++j) {
        const int64_t ctx = md.context_lens[md.num_decodes + j];
        const int64_t len = std::clamp<int64_t>(ctx - ch.start, 0, chunk);
        ch.len.push_back(int32_t(len));
        ch.cu_len.push_back(ch.cu_len.back() + len);
      }
      md.context_chunks.push_back(std::move(ch));
    }
  }
  return md;
}

void validate_batch(const BatchMetadata& md, const CacheGeometry& cache) {
  KMLA_CHECK(md.block_size == cache.block_size, "metadata was planned for block size ",
             md.block_size, ", the cache has block size ", cache.block_size);
  KMLA_CHECK(md.num_cache_blocks <= cache.num_blocks, "metadata was planned for ",
             md.num_cache_blocks, " cache blocks, the cache has only ", cache.num_blocks);
  const int R = md.num_requests;
  KMLA_CHECK(R >= 0 && md.num_decodes >= 0 && md.num_context_prefills >= 0 &&
                 md.num_fresh_prefills >= 0 &&
                 md.num_decodes + md.num_context_prefills + md.num_fresh_prefills == R,
             "metadata request counts (", md.num_decodes, " decode, ", md.num_context_prefills,
             " with context, ", md.num_fresh_prefills, " fresh) do not add up to ", R, " requests");
  KMLA_CHECK(md.query_lens.size() == size_t(R) && md.context_lens.size() == size_t(R) &&
                 md.seq_lens.size() == size_t(R) && md.query_start.size() == size_t(R) + 1,
             "metadata per-request arrays do not have ", R, " entries");
  KMLA_CHECK(md.max_blocks_per_request >= 0 &&
                 md.block_tables.size() == size_t(R) * size_t(md.max_blocks_per_request),
             "metadata block tables have ", md.block_tables.size(), " entries, expected ", R, " x ",
             md.max_blocks_per_request);
  KMLA_CHECK(md.num_tokens >= 0 && md.num_tokens <= md.num_rows, "metadata has ", md.num_tokens,
             " real tokens in ", md.num_rows, " rows");
  KMLA_CHECK(md.query_start[0] == 0 && md.query_start[size_t(R)] == md.num_tokens,
             "metadata query starts do not cover its ", md.num_tokens, " real tokens");
  KMLA_CHECK(md.max_decode_query_len <= md.decode_threshold, "metadata's longest decode query (",
             md.max_decode_query_len, ") exceeds its decode threshold ", md.decode_threshold);
  for (int r = 0; r < R; ++r) {
    KMLA_CHECK(md.query_lens[r] >= 0 && md.context_lens[r] >= 0 &&
                   md.seq_lens[r] == int64_t(md.context_lens[r]) + md.query_lens[r] &&
                   md.query_start[r + 1] - md.query_start[r] == md.query_lens[r],
               "metadata request ", r, " has inconsistent lengths (query ", md.query_lens[r],
               ", context ", md.context_lens[r], ", sequence ", md.seq_lens[r], ")");
    const RequestKind kind = md.kind(r);
    if (kind == RequestKind::decode)
      KMLA_CHECK(
          md.query_lens[r] <= md.decode_threshold && md.query_lens[r] <= md.max_decode_query_len,
          "metadata request ", r, " is a decode with ", md.query_lens[r],
          " query tokens, above the decode threshold ", md.decode_threshold);
    else if (kind == RequestKind::context_prefill)
      KMLA_CHECK(md.context_lens[r] > 0, "metadata request ", r, " is a ", kind_name(kind),
                 " without context");
    else
      KMLA_CHECK(md.context_lens[r] == 0, "metadata request ", r, " is a ", kind_name(kind),
                 " but has ", md.context_lens[r], " context tokens");
    const int64_t need = (md.seq_lens[r] + md.block_size - 1) / md.block_size;
    KMLA_CHECK(need <= md.max_blocks_per_request, "metadata request ", r, " needs ", need,
               " blocks, its block table has ", md.max_blocks_per_request);
    const int32_t* table = md.block_table(r);
    for (int64_t b = 0; b < need; ++b)
      KMLA_CHECK(table[b] >= 0 && table[b] < cache.num_blocks, "metadata request ", r,
                 ": block table entry ", b, " = ", table[b], " is outside the cache's blocks [0, ",
                 cache.num_blocks, ")");
  }
  KMLA_CHECK(md.num_decode_tokens == md.query_start[size_t(md.num_decodes)], "metadata has ",
             md.num_decode_tokens, " decode tokens, its decodes hold ",
             md.query_start[size_t(md.num_decodes)]);
  KMLA_CHECK(
      md.prefill_tokens_with_context ==
          md.query_start[size_t(md.num_decodes + md.num_context_prefills)] - md.num_decode_tokens,
      "metadata prefill_tokens_with_context ", md.prefill_tokens_with_context,
      " does not match its prefills with context");

  // Context chunks: for every prefill with context j, the chunks' ranges
  // [start, start + len[j]) must tile [0, context_len) in order.
  const int nc = md.num_context_prefills;
  std::vector<int64_t> covered(size_t(nc), 0);
  for (size_t c = 0; c < md.context_chunks.size(); ++c) {
    const ContextChunk& ch = md.context_chunks[c];
    KMLA_CHECK(
        ch.len.size() == size_t(nc) && ch.cu_len.size() == size_t(nc) + 1 && ch.cu_len[0] == 0,
        "metadata context chunk ", c, " does not have ", nc, " request lengths");
    for (int j = 0; j < nc; ++j) {
      KMLA_CHECK(ch.len[size_t(j)] >= 0 &&
                     ch.cu_len[size_t(j) + 1] == ch.cu_len[size_t(j)] + ch.len[size_t(j)],
                 "metadata context chunk ", c, " has inconsistent lengths at request ", j);
      if (ch.len[size_t(j)] == 0) continue;
      KMLA_CHECK(ch.start == covered[size_t(j)], "metadata context chunk ", c, " starts at ",
                 ch.start, " for request ", md.num_decodes + j, ", whose context is covered up to ",
                 covered[size_t(j)]);
      covered[size_t(j)] += ch.len[size_t(j)];
    }
  }
  for (int j = 0; j < nc; ++j)
    KMLA_CHECK(covered[size_t(j)] == md.context_lens[size_t(md.num_decodes + j)],
               "metadata context chunks cover ", covered[size_t(j)], " of the ",
               md.context_lens[size_t(md.num_decodes + j)], " context tokens of request ",
               md.num_decodes + j);
}

void permute_rows(const BatchMetadata& md, const void* src, void* dst, int64_t width,
                  size_t elem_bytes, bool to_layout) {
  const size_t row_bytes = size_t(width) * elem_bytes;
  const auto* s = static_cast<const std::byte*>(src);
  auto* d = static_cast<std::byte*>(dst);
  for (int64_t row = 0; row < md.num_tokens; ++row) {
    const int64_t caller = md.row_order[row];
    if (to_layout)
      std::memcpy(d + row * row_bytes, s + caller * row_bytes, row_bytes);
    else
      std::memcpy(d + caller * row_bytes, s + row * row_bytes, row_bytes);
  }
}

}  // namespace kmla
