#include "kmla/context_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kmla/error.hpp"

namespace kmla {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_world(int rank, int world) {
  KMLA_CHECK(world >= 1, "context-parallel world size must be >= 1, got ", world);
  KMLA_CHECK(rank >= 0 && rank < world, "context-parallel rank ", rank, " is outside [0, ", world,
             ")");
}

}  // namespace

CpRange cp_range(int64_t seq_len, int32_t query_len, int block_size, int rank, int world) {
  check_world(rank, world);
  KMLA_CHECK(block_size >= 1, "block size must be >= 1, got ", block_size);
  KMLA_CHECK(query_len >= 0 && int64_t(query_len) <= seq_len, "query length ", query_len,
             " is outside [0, ", seq_len, "] (the sequence length)");
  // A unit holds at least query_len tokens, so a non-empty non-tail range does too, and is
  // whole blocks, so no block straddles ranks.
  const int64_t bs = block_size;
  const int64_t unit = bs * std::max<int64_t>(1, (int64_t(query_len) + bs - 1) / bs);
  const int64_t units = (seq_len + unit - 1) / unit;
  // Cuts never pass the last unit boundary inside the cached context: the tail owns every
  // new token and at least query_len tokens.
  const int64_t cap = (seq_len - query_len) / unit * unit;
  auto cut = [&](int k) -> int64_t {
    if (k == 0) return 0;
    if (k == world) return seq_len;
    return std::min(int64_t(k) * units / world * unit, cap);
  };
  return {cut(rank), cut(rank + 1)};
}

CpShard cp_shard(const BatchMetadata& md, const std::vector<std::vector<int32_t>>& rank_tables,
                 const CacheGeometry& rank_cache, int rank, int world) {
  check_world(rank, world);
  KMLA_CHECK(md.num_requests == md.num_decodes, "context parallelism splits decode-only batches; ",
             "this one has ", md.num_context_prefills, " prefills with context and ",
             md.num_fresh_prefills, " fresh prefills next to ", md.num_decodes, " decodes");
  KMLA_CHECK(rank_tables.size() == size_t(md.num_requests), "rank ", rank, " has ",
             rank_tables.size(), " block tables for ", md.num_requests, " requests");
  KMLA_CHECK(rank_cache.block_size == md.block_size, "rank ", rank, "'s cache has block size ",
             rank_cache.block_size, ", the batch was planned for ", md.block_size);
  KMLA_CHECK(md.seq_lens.size() == size_t(md.num_requests) &&
                 md.query_lens.size() == size_t(md.num_requests) &&
                 md.query_start.size() == size_t(md.num_requests) + 1,
             "batch metadata per-request arrays do not have ", md.num_requests, " entries");
  const bool tail = rank == world - 1;
  const int64_t bs = md.block_size;

  CpShard s;
  s.rank = rank;
  s.world = world;
  BatchMetadata& o = s.md;
  o.decode_threshold = md.decode_threshold;
  o.causal_decode = md.causal_decode && tail;
  o.block_size = md.block_size;
  o.num_cache_blocks = rank_cache.num_blocks;
  o.context_chunk_tokens = 0;

  s.ranges.resize(size_t(md.num_requests));
  int max_blocks = 0;
  for (int r = 0; r < md.num_requests; ++r) {
    const int32_t q = md.query_lens[size_t(r)];
    const CpRange range = cp_range(md.seq_lens[size_t(r)], q, md.block_size, rank, world);
    s.ranges[size_t(r)] = range;
    const int64_t need = (range.size() + bs - 1) / bs;
    KMLA_CHECK(int64_t(rank_tables[size_t(r)].size()) >= need, "rank ", rank,
               "'s block table for request ", r, " has ", rank_tables[size_t(r)].size(),
               " entries, its range [", range.start, ", ", range.end, ") needs ", need);
    // A request without keys here, or without query rows, gives this rank no work.
    if (range.empty() || q == 0) continue;
    s.requests.push_back(r);
    max_blocks = std::max(max_blocks, int(need));
  }

  const int R = int(s.requests.size());
  o.num_requests = o.num_decodes = R;
  o.max_blocks_per_request = max_blocks;
  o.block_tables.assign(size_t(R) * size_t(max_blocks), -1);
  o.query_start.assign(1, 0);
  for (int i = 0; i < R; ++i) {
    const int r = s.requests[size_t(i)];
    const CpRange range = s.ranges[size_t(r)];
    const int32_t q = md.query_lens[size_t(r)];
    o.request_order.push_back(i);
    o.query_lens.push_back(q);
    o.seq_lens.push_back(range.size());
    o.context_lens.push_back(int32_t(range.size() - q));
    o.query_start.push_back(o.query_start.back() + q);
    o.max_query_len = std::max(o.max_query_len, int(q));
    o.max_decode_query_len = std::max(o.max_decode_query_len, int(q));
    const int64_t need = (range.size() + bs - 1) / bs;
    std::copy_n(rank_tables[size_t(r)].begin(), need,
                o.block_tables.begin() + int64_t(i) * max_blocks);
    // The request's rows in the full batch, and their local positions and slots (only
    // the tail holds the new tokens; its range ends at the sequence's end).
    for (int32_t j = 0; j < q; ++j) {
      s.rows.push_back(md.query_start[size_t(r)] + j);
      const int64_t pos = range.size() - q + j;
      o.positions.push_back(pos);
      o.slot_mapping.push_back(tail ? o.slot_of(i, pos) : -1);
    }
  }
  o.num_tokens = o.num_rows = o.num_decode_tokens = o.query_start.back();
  o.prefill_tokens_with_context = 0;
  o.row_order.resize(size_t(o.num_tokens));
  for (int64_t i = 0; i < o.num_tokens; ++i) o.row_order[size_t(i)] = i;
  validate_batch(o, rank_cache);
  return s;
}

void cp_gather_rows(const CpShard& shard, const void* src, void* dst, size_t row_bytes) {
  const auto* from = static_cast<const std::byte*>(src);
  auto* to = static_cast<std::byte*>(dst);
  for (size_t i = 0; i < shard.rows.size(); ++i)
    std::memcpy(to + i * row_bytes, from + size_t(shard.rows[i]) * row_bytes, row_bytes);
}

void cp_scatter_partial(const CpShard& shard, const TensorView& shard_out,
                        const TensorView& shard_lse, const TensorView& out, const TensorView& lse) {
  const int64_t Ts = int64_t(shard.rows.size());
  check_tensor(out, "context-parallel partial output", DType::f32, {-1, -1, -1});
  const int64_t Td = out.dim(0), H = out.dim(1), D = out.dim(2);
  check_tensor(lse, "context-parallel partial lse", DType::f32, {Td, H});
  if (Ts > 0) {
    check_tensor(shard_out, "shard output", DType::f32, {Ts, H, D});
    check_tensor(shard_lse, "shard lse", DType::f32, {Ts, H});
  }
  std::fill_n(out.as<float>(), Td * H * D, 0.0f);
  std::fill_n(lse.as<float>(), Td * H, kNegInf);
  for (int64_t i = 0; i < Ts; ++i) {
    const int64_t row = shard.rows[size_t(i)];
    KMLA_CHECK(row >= 0 && row < Td, "shard row ", i, " maps to row ", row, ", outside [0, ", Td,
               ")");
    std::memcpy(out.as<float>() + row * H * D, shard_out.as<const float>() + i * H * D,
                size_t(H * D) * sizeof(float));
    std::memcpy(lse.as<float>() + row * H, shard_lse.as<const float>() + i * H,
                size_t(H) * sizeof(float));
  }
}

void cp_merge(const std::vector<TensorView>& partial_out, const std::vector<TensorView>& partial_lse,
              const TensorView& out, const TensorView& lse) {
  const size_t W = partial_out.size();
  KMLA_CHECK(W >= 1 && partial_lse.size() == W, "context-parallel merge got ", W,
             " partial outputs and ", partial_lse.size(), " partial LSEs");
  check_tensor(out, "merged output", DType::f32, {-1, -1, -1});
  const int64_t T = out.dim(0), H = out.dim(1), D = out.dim(2);
  check_tensor(lse, "merged lse", DType::f32, {T, H});
  for (size_t k = 0; k < W; ++k) {
    check_tensor(partial_out[k], "partial output", DType::f32, {T, H, D});
    check_tensor(partial_lse[k], "partial lse", DType::f32, {T, H});
  }
  // One pass per row: the largest LSE, then every partial weighted relative to it, so no
  // exp overflows and a single normalisation ends the row (a fold of pairwise merges
  // would renormalise world-1 times). kmla_core cannot call the CPU backend's pairwise
  // merge (kmla_cpu sits above it); the rules are merge_attn_f32's.
  std::vector<float> weight(W);
  for (int64_t i = 0; i < T * H; ++i) {
    float M = kNegInf;
    for (size_t k = 0; k < W; ++k) {
      const float l = partial_lse[k].as<const float>()[i];
      weight[k] = std::isinf(l) ? kNegInf : l;
      M = std::fmax(M, weight[k]);
    }
    float* o = out.as<float>() + i * D;
    if (M == kNegInf) {
      std::fill_n(o, D, 0.0f);
      lse.as<float>()[i] = kNegInf;
      continue;
    }
    float sum = 0.0f;
    for (size_t k = 0; k < W; ++k) {
      weight[k] = weight[k] == kNegInf ? 0.0f : std::exp(weight[k] - M);
      sum += weight[k];
    }
    for (size_t k = 0; k < W; ++k) weight[k] /= sum;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (size_t k = 0; k < W; ++k)
        if (weight[k] != 0.0f) acc += weight[k] * partial_out[k].as<const float>()[i * D + d];
      o[d] = acc;
    }
    lse.as<float>()[i] = M + std::log(sum);
  }
}

}  // namespace kmla
