// Parallelism without NCCL: the pieces each rank computes, combined on the host, must equal
// the single-device result. Tensor parallelism: per-rank partial outputs of head-sharded
// layers sum to the full layer. Decode context parallelism: per-rank attention over the
// rank's slice of every sequence's tokens, in the rank's own cache, merged by LSE, equals
// attention over the whole cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "kmla/context_parallel.hpp"
#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "kmla/stages.hpp"
#include "verify/cases.hpp"

namespace kmla {
namespace {

float bf16_at(const HostTensor& t, int64_t i) { return bf16_to_float(t.data<uint16_t>()[i]); }

// ---- tensor parallelism ----------------------------------------------------------------

// World sizes 2, 4 and 8 on a 16-head model (2 local heads at world 8), the mixed batch
// (decodes, a 3-token decode block, chunked prefills, padding rows).
TEST(Parallel, TensorParallelPartialsSumToFullLayerUpToWorld8) {
  for (int world : {2, 4, 8}) {
    verify::Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 40 + world, 16);
    const verify::Inputs in = verify::make_inputs(c);
    reference::Options ro;
    LatentCache full_cache = in.cache.clone();
    const auto full = reference::forward(c.config, in.weights, nullptr, in.positions.view(),
                                         in.hidden.view(), &in.md, full_cache, ro);
    std::vector<double> sum_exact(full.out.size(), 0.0), sum_cpu(full.out.size(), 0.0);
    LatentCache rank0_cpu_cache;
    for (int rank = 0; rank < world; ++rank) {
      const MlaConfig local = c.config.tp_slice(rank, world);
      ASSERT_EQ(local.local_heads(), 16 / world);
      const MlaWeights w = in.weights.tp_slice(c.config, rank, world);
      LatentCache cache = in.cache.clone();
      const auto part = reference::forward(local, w, nullptr, in.positions.view(),
                                           in.hidden.view(), &in.md, cache, ro);
      for (size_t i = 0; i < part.out.size(); ++i) sum_exact[i] += part.out[i];
      LayerOptions lo;
      lo.partial_output = true;
      MlaLayer layer(local, w, lo);
      HostTensor out(DType::bf16, {in.md.num_rows, c.config.hidden_size});
      LatentCache cache2 = in.cache.clone();
      layer.forward(in.positions.view(), in.hidden.view(), &in.md, cache2, out.view());
      for (size_t i = 0; i < sum_cpu.size(); ++i) sum_cpu[i] += bf16_at(out, int64_t(i));
      // The latent cache is replicated under tensor parallelism: every rank writes the
      // same rows, the oracle's as the full oracle's, the CPU layer's as rank 0's.
      const size_t cache_bytes = size_t(cache.geometry().block_stride * cache.num_blocks());
      EXPECT_EQ(std::memcmp(cache.base(), full_cache.base(), cache_bytes), 0) << "rank " << rank;
      if (rank == 0) rank0_cpu_cache = cache2.clone();
      EXPECT_EQ(std::memcmp(cache2.base(), rank0_cpu_cache.base(), cache_bytes), 0) << "rank " << rank;
    }
    double m = 0, d_exact = 0, d_cpu = 0;
    for (size_t i = 0; i < full.out.size(); ++i) {
      m = std::max(m, std::fabs(full.out[i]));
      d_exact = std::max(d_exact, std::fabs(sum_exact[i] - full.out[i]));
      d_cpu = std::max(d_cpu, std::fabs(sum_cpu[i] - full.out[i]));
    }
    ASSERT_GT(m, 0.0);
    // fp64 partials differ from the full sum only by summation order.
    EXPECT_LE(d_exact, 1e-12 * m) << "world " << world;
    // Each bf16 partial carries its own rounding (half an ulp of a partial, at most the size
    // of the full output) plus the per-rank attention error.
    EXPECT_LE(d_cpu, world * 0x1p-6 * m) << "world " << world;
  }
}

// ---- decode context parallelism ------------------------------------------------------

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

void poison(const LatentCache& cache) {
  std::vector<float> nan_row(kLatentDim, kNaN);
  for (int64_t s = 0; s < cache.geometry().num_slots(); ++s) cache.write_row(s, nan_row.data());
}

std::vector<int32_t> permuted_ids(int64_t n, std::mt19937_64& rng) {
  std::vector<int32_t> ids(size_t(n), 0);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

struct CpCase {
  bool causal = true;
  int query_len = 1;
  int block_size = 16;
  int world = 2;
  uint64_t seed = 1;
  std::string name() const {
    return std::string(causal ? "causal" : "non-causal") + " q" + std::to_string(query_len) +
           " block " + std::to_string(block_size) + " world " + std::to_string(world);
  }
};

void run_cp_case(const CpCase& cc) {
  SCOPED_TRACE(cc.name());
  std::mt19937_64 rng(cc.seed);
  const int H = 5;                   // odd head count
  const double scale = 0.0721688;    // kimi-k3's 1/sqrt(192)
  const int bs = cc.block_size, q = cc.query_len;
  // Around block boundaries, one long sequence, and several shorter than world blocks (so
  // some ranks own nothing). A decode needs cached context, hence at least q + 1 tokens.
  std::vector<int64_t> lens;
  for (int64_t L : {1, 15, 16, 17, 300, 1000, 2 * bs + 1})
    lens.push_back(std::max<int64_t>(L, q + 1));

  int64_t full_blocks = 3;  // spare, never referenced: NaN
  for (int64_t L : lens) full_blocks += (L + bs - 1) / bs;
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, bs, full_blocks);
  poison(cache);
  const std::vector<int32_t> ids = permuted_ids(full_blocks, rng);
  std::vector<RequestSpec> reqs;
  size_t next = 0;
  for (int64_t L : lens) {
    std::vector<int32_t> table(ids.begin() + int64_t(next),
                               ids.begin() + int64_t(next) + (L + bs - 1) / bs);
    next += table.size();
    reqs.push_back(RequestSpec::from_seq_len(q, L, table));
  }
  std::shuffle(reqs.begin(), reqs.end(), rng);  // the layout order is not the caller's
  BatchOptions opt;
  opt.decode_threshold = std::max(q, 1);
  opt.non_causal_decode = !cc.causal;
  const BatchMetadata md = plan_batch(reqs, cache.geometry(), opt);
  ASSERT_EQ(md.num_decodes, md.num_requests);
  const int R = md.num_requests;
  const int64_t Td = md.num_decode_tokens;

  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> row(kLatentDim);
  for (int r = 0; r < R; ++r)
    for (int64_t p = 0; p < md.seq_lens[size_t(r)]; ++p) {
      for (float& x : row) x = uni(rng);
      cache.write_row(md.slot_of(r, p), row.data());
    }
  HostTensor qt(DType::f32, {Td, H, kLatentDim});
  for (int64_t i = 0; i < qt.numel(); ++i) qt.data<float>()[i] = normal(rng);

  HostTensor ref_out(DType::f32, {Td, H, kKvLoraRank}), ref_lse(DType::f32, {Td, H});
  decode_attention(qt.view(), 1.0f, cache, md, scale, ref_out.view(), ref_lse.view());

  const int W = cc.world;
  std::vector<HostTensor> part_out, part_lse;
  std::vector<TensorView> out_views, lse_views;
  int empty_ranges = 0;
  std::vector<int64_t> covered(size_t(R), 0);  // ranges must tile each sequence in order
  for (int rank = 0; rank < W; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const bool tail = rank == W - 1;
    // The rank's own cache: only its ranges, at permuted blocks, the rest NaN.
    std::vector<CpRange> ranges(static_cast<size_t>(R));
    int64_t rank_blocks = 2;
    for (int r = 0; r < R; ++r) {
      ranges[size_t(r)] = cp_range(md.seq_lens[size_t(r)], md.query_lens[size_t(r)], bs, rank, W);
      const CpRange g = ranges[size_t(r)];
      EXPECT_EQ(g.start, covered[size_t(r)]) << "request " << r;
      covered[size_t(r)] = g.end;
      EXPECT_EQ(g.start % bs, 0) << "request " << r;
      if (!tail) {
        EXPECT_EQ(g.end % bs, 0) << "request " << r;
        EXPECT_TRUE(g.empty() || g.size() >= q) << "request " << r << " size " << g.size();
        EXPECT_LE(g.end, md.context_lens[size_t(r)]) << "request " << r;
      } else {
        EXPECT_EQ(g.end, md.seq_lens[size_t(r)]);
        EXPECT_GE(g.size(), q);
      }
      empty_ranges += g.empty();
      rank_blocks += (g.size() + bs - 1) / bs;
    }
    LatentCache rc = LatentCache::allocate(CacheFormat::bf16, bs, rank_blocks);
    poison(rc);
    const std::vector<int32_t> rids = permuted_ids(rank_blocks, rng);
    std::vector<std::vector<int32_t>> tables(static_cast<size_t>(R));
    size_t used = 0;
    for (int r = 0; r < R; ++r) {
      const CpRange g = ranges[size_t(r)];
      const int64_t need = (g.size() + bs - 1) / bs;
      tables[size_t(r)].assign(rids.begin() + int64_t(used), rids.begin() + int64_t(used + need));
      used += size_t(need);
      for (int64_t j = 0; j < g.size(); ++j)
        std::memcpy(rc.slot_ptr(int64_t(tables[size_t(r)][size_t(j / bs)]) * bs + j % bs),
                    cache.slot_ptr(md.slot_of(r, g.start + j)), cache.geometry().entry_bytes());
    }

    const CpShard shard = cp_shard(md, tables, rc.geometry(), rank, W);
    EXPECT_EQ(shard.md.causal_decode, cc.causal && tail);
    const int64_t Ts = shard.md.num_decode_tokens;
    ASSERT_EQ(int64_t(shard.rows.size()), Ts);
    for (int i = 0; i < shard.md.num_requests; ++i) {
      const int r = shard.requests[size_t(i)];
      EXPECT_EQ(shard.md.seq_lens[size_t(i)], ranges[size_t(r)].size());
      // Only the tail rank stores the new tokens, at the end of its range.
      for (int64_t t = shard.md.query_start[size_t(i)]; t < shard.md.query_start[size_t(i) + 1]; ++t)
        EXPECT_EQ(shard.md.slot_mapping[size_t(t)] >= 0, tail);
    }

    part_out.emplace_back(DType::f32, std::initializer_list<int64_t>{Td, H, kKvLoraRank});
    part_lse.emplace_back(DType::f32, std::initializer_list<int64_t>{Td, H});
    HostTensor so, sl;
    if (Ts > 0) {
      HostTensor qs(DType::f32, {Ts, H, kLatentDim});
      cp_gather_rows(shard, qt.data<float>(), qs.data<float>(), size_t(H) * kLatentDim * 4);
      so = HostTensor(DType::f32, {Ts, H, kKvLoraRank});
      sl = HostTensor(DType::f32, {Ts, H});
      decode_attention(qs.view(), 1.0f, rc, shard.md, scale, so.view(), sl.view());
    }
    cp_scatter_partial(shard, so.view(), sl.view(), part_out.back().view(), part_lse.back().view());

    // -inf exactly on the rows that see none of this rank's keys; finite elsewhere.
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < md.query_lens[size_t(r)]; ++i) {
        const int64_t t = md.query_start[size_t(r)] + i;
        const CpRange g = ranges[size_t(r)];
        const int64_t visible =
            std::clamp<int64_t>(md.decode_key_count(r, i) - g.start, 0, g.size());
        for (int h = 0; h < H; ++h) {
          const float l = part_lse.back().data<float>()[t * H + h];
          if (visible == 0) {
            EXPECT_EQ(l, -std::numeric_limits<float>::infinity()) << "request " << r << " row " << i;
          } else {
            ASSERT_TRUE(std::isfinite(l)) << "request " << r << " row " << i << " lse " << l;
            const float* o = part_out.back().data<float>() + (t * H + h) * kKvLoraRank;
            for (int d = 0; d < kKvLoraRank; ++d)
              ASSERT_TRUE(std::isfinite(o[d])) << "request " << r << " row " << i << " d " << d;
          }
        }
      }
    out_views.push_back(part_out.back().view());
    lse_views.push_back(part_lse.back().view());
  }
  for (int r = 0; r < R; ++r) EXPECT_EQ(covered[size_t(r)], md.seq_lens[size_t(r)]);
  // The case must exercise ranks that own nothing of a request.
  EXPECT_GT(empty_ranges, 0);

  HostTensor out(DType::f32, {Td, H, kKvLoraRank}), lse(DType::f32, {Td, H});
  cp_merge(out_views, lse_views, out.view(), lse.view());
  double m = 0, d_out = 0, d_lse = 0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    ASSERT_FALSE(std::isnan(out.data<float>()[i])) << "element " << i;
    m = std::max(m, double(std::fabs(ref_out.data<float>()[i])));
    d_out = std::max(d_out, double(std::fabs(out.data<float>()[i] - ref_out.data<float>()[i])));
  }
  for (int64_t i = 0; i < lse.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(ref_lse.data<float>()[i]));
    d_lse = std::max(d_lse, double(std::fabs(lse.data<float>()[i] - ref_lse.data<float>()[i])));
  }
  ASSERT_GT(m, 0.0);
  // Both sides are fp32 attention over the same keys, summed in a different order: a few
  // ulps of the largest output. A wrong range, causality or block mapping moves whole
  // softmax weights, far above this.
  EXPECT_LE(d_out, 1e-5 * m);
  // LSEs are O(1..10) here; fp32 log/exp in a different order stays far below 1e-5.
  EXPECT_LE(d_lse, 1e-5);

  // The W-way merge agrees with folding the CPU backend's pairwise merge over the ranks.
  HostTensor acc(DType::f32, {Td, H, kKvLoraRank}), acc_lse(DType::f32, {Td, H});
  std::memcpy(acc.data<float>(), out_views[0].data, acc.bytes());
  std::memcpy(acc_lse.data<float>(), lse_views[0].data, acc_lse.bytes());
  for (int k = 1; k < W; ++k)
    merge_attn_states(acc.view(), acc_lse.view(), out_views[size_t(k)], lse_views[size_t(k)], Td,
                      acc.view(), acc_lse.view());
  double d_fold = 0;
  for (int64_t i = 0; i < out.numel(); ++i)
    d_fold = std::max(d_fold, double(std::fabs(out.data<float>()[i] - acc.data<float>()[i])));
  // Different rounding order of the same weights (the fold renormalises world-1 times).
  EXPECT_LE(d_fold, 1e-5 * m);
}

TEST(Parallel, ContextParallelDecodeMergesToFullAttention) {
  uint64_t seed = 100;
  for (int world : {2, 4, 8})
    for (int block_size : {16, 2})  // 2: a block smaller than the 3-token decode block
      for (const auto& [causal, q] : {std::pair{true, 1}, std::pair{true, 3}, std::pair{false, 3}})
        run_cp_case({causal, q, block_size, world, seed++});
}

// The DSpark draft preset is the non-causal decode model: the batch planned from its
// config's flag, q_len 3, world 4.
TEST(Parallel, ContextParallelDSparkPresetIsNonCausalOnEveryRank) {
  const MlaConfig cfg = verify::small_model("kimi-k3-dspark", 4);
  ASSERT_TRUE(cfg.non_causal_multi_token_decode);
  run_cp_case({!cfg.non_causal_multi_token_decode, 3, 16, 4, 7});
}

TEST(Parallel, ContextParallelRangesSplitALongSequenceEvenly) {
  // 1M tokens over 8 ranks in blocks of 64: every rank within a block of seq/8.
  const int64_t S = 1 << 20;
  for (int rank = 0; rank < 8; ++rank) {
    const CpRange g = cp_range(S, 1, 64, rank, 8);
    EXPECT_LE(std::abs(g.size() - S / 8), 64) << "rank " << rank;
  }
  // World 1 owns everything.
  const CpRange all = cp_range(1000, 3, 16, 0, 1);
  EXPECT_EQ(all.start, 0);
  EXPECT_EQ(all.end, 1000);
}

void expect_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(Parallel, ContextParallelBadInputThrows) {
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 16, 16);
  // A decode (context 20, one new token) and a fresh prefill.
  const BatchMetadata mixed = plan_batch({RequestSpec{1, 20, {0, 1}}, RequestSpec{5, 0, {2}}},
                                         cache.geometry());
  ASSERT_EQ(mixed.num_fresh_prefills, 1);
  expect_error([&] { cp_shard(mixed, {{0, 1}, {}}, cache.geometry(), 0, 2); }, "1 fresh prefills");

  const BatchMetadata md = plan_batch({RequestSpec{1, 40, {0, 1, 2}}}, cache.geometry());
  expect_error([&] { cp_shard(md, {{0}}, cache.geometry(), 4, 4); }, "rank 4 is outside [0, 4)");
  expect_error([&] { cp_shard(md, {{0}}, cache.geometry(), -1, 4); }, "rank -1 is outside");
  expect_error([&] { cp_shard(md, {{0}}, cache.geometry(), 0, 0); }, "world size must be >= 1, got 0");
  expect_error([&] { cp_range(100, 1, 16, 0, -2); }, "got -2");
  expect_error([&] { cp_range(100, 1, 16, 2, 2); }, "rank 2");
  expect_error([&] { cp_range(10, 11, 16, 0, 2); }, "query length 11");
  expect_error([&] { cp_range(10, 1, 0, 0, 2); }, "block size must be >= 1, got 0");
  // Rank 1 of 2 owns [16, 41): two blocks, one given.
  expect_error([&] { cp_shard(md, {{0}}, cache.geometry(), 1, 2); }, "needs 2");
  expect_error([&] { cp_shard(md, {}, cache.geometry(), 1, 2); }, "0 block tables for 1");
  LatentCache other = LatentCache::allocate(CacheFormat::bf16, 32, 4);
  expect_error([&] { cp_shard(md, {{0}}, other.geometry(), 0, 2); }, "block size 32");
  // A block id outside the rank's cache is caught by validation.
  expect_error([&] { cp_shard(md, {{0, 99}}, cache.geometry(), 1, 2); }, "99");
  HostTensor a(DType::f32, {2, 3, 8}), la(DType::f32, {2, 3}), lb(DType::f32, {2, 4});
  expect_error([&] { cp_merge({a.view()}, {}, a.view(), la.view()); }, "1 partial outputs and 0");
  expect_error([&] { cp_merge({a.view()}, {lb.view()}, a.view(), la.view()); }, "partial lse");
}

}  // namespace
}  // namespace kmla
