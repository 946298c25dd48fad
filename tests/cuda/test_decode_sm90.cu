// The Hopper wgmma decode kernel (src/cuda/decode_sm90.cu), reached through decode_attention
// exactly as callers reach it, against the CPU backend's cpu::decode_attention_f32 on the same
// cache bytes and block tables; plus a probe of its building blocks (swizzled tiles, wgmma
// descriptors, accumulator mappings) against fp64 loops, and the dispatch decision.
//
// The cases go through the adversarial harness of decode_harness.hpp (random block
// permutation, garbage table entries, 0xFF = NaN in every unused cache byte, padded request
// slots, NaN query rows between requests, out / lse / workspace poisoned before each call).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/decode_sm90.cuh"
#include "decode_harness.hpp"

namespace kmla::cuda {
namespace {

// Whether the current GPU is an sm_90 one, where the wgmma kernel must be chosen.
bool expect_sm90() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return false;
  return major == 9;
}

// run_case (decode_harness.hpp) under every speed variant of the kernel
// (DecodeSm90Options), which must all give the same answers; on an sm_90 GPU every plan must
// take the wgmma kernel, and the TMA variant must really copy by TMA where the block size
// allows it (on other GPUs the same cases test the mma.sync kernel). `min_rows`:
// DecodeSm90Options::min_rows in every variant.
void run_case_sm90(const DecodeCase& c, const std::vector<PlanTweak>& tweaks,
                   int min_rows = DecodeSm90Options{}.min_rows) {
  const DecodeSm90Options saved = decode_sm90_options();
  struct Variant {
    const char* name;
    DecodeSm90Options opt;
  };
  // TMA copies only for block sizes that are multiples of 8 (100 stays on cp.async).
  std::vector<Variant> variants = {{"tma, wide S", {}}};
  if (expect_sm90()) {
    variants.push_back(
        {"tma, narrow S, no rescale skip", {.skip_rescale = false, .wide_s = false}});
    variants.push_back({"tma, a copy per panel", {.one_copy = false}});
    variants.push_back({"tma, P in one part", {.split_p = false}});
    variants.push_back({"tma, no thin tiles", {.thin_rows = 0}});
    variants.push_back({"tma, thin tiles of 16 rows only", {.thin_rows = 16}});
    variants.push_back({"cp.async", {.tma = false, .wide_s = false}});
    variants.push_back(
        {"cp.async, wide S, no rescale skip", {.skip_rescale = false, .tma = false}});
  }
  for (Variant& v : variants) {
    v.opt.min_rows = min_rows;
    decode_sm90_set_options(v.opt);
    CaseHooks hooks;
    hooks.label = v.name;
    hooks.check_plan = [&](const DecodeParams& p, const DecodePlan& plan) {
      if (!expect_sm90()) return;
      EXPECT_TRUE(decode_sm90_supports(p, plan)) << "not the sm90 kernel";
      int want = 0;  // the largest of 64, 32, 16, 8 keys dividing the block size
      for (int g = 64; v.opt.tma && g >= 8 && want == 0; g /= 2)
        if (p.cache.block_size % g == 0) want = g;
      bool one_copy = false;
      EXPECT_EQ(decode_sm90_tma_keys(p, &one_copy), want) << v.name;
      EXPECT_EQ(one_copy, want == 64 && v.opt.one_copy) << v.name;
    };
    run_case(c, tweaks, hooks);
  }
  decode_sm90_set_options(saved);
}

// Splits: the plan's choice, one (direct output), a few, and more than a short request has
// 64-key tiles (empty splits write LSE -inf only); the balanced walk in pass order, on the
// plan's workers and on 7 (pieces cut across passes), and in request order. rows_per_cta
// stays 64: the wgmma tile.
const std::vector<PlanTweak> kSm90Tweaks = {{0, 0},  {1, 0},         {3, 0},
                                            {40, 0}, {.workers = 7}, {.request_order = true}};

TEST(CudaDecodeSm90, Bf16Heads128MixedLengths) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 128;
  c.block_size = 64;
  c.seq_lens = {1, 63, 900, 64, 65, 1000, 4100};
  c.query_lens = {1, 1, 0, 1, 1, 1, 1};
  c.seed = 11;
  run_case_sm90(c, kSm90Tweaks);
}

// An output pointer that is 8-byte but not 16-byte aligned: the direct rows, staged in shared
// memory, go out 4 bytes at a time instead of 16 (write_staged_rows), and nothing before the
// pointer is written. One split (every piece direct) and the plan's own (partials and the
// combine's 8-byte stores). Below 8 bytes decode refuses the pointer.
TEST(CudaDecodeSm90, OutputNotSixteenByteAligned) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 128;
  c.block_size = 64;
  c.seq_lens = {65, 1000, 7, 300};
  c.query_lens = {1, 1, 1, 1};
  c.out_offset = 4;
  c.seed = 27;
  run_case_sm90(c, {{1, 0}, {0, 0}});

  DecodeParams p;  // no requests: only the checks run
  p.heads = 128;
  p.cache.block_size = 64;
  const DecodePlan plan = plan_decode(1, 128, 1, 1024, false);
  alignas(16) static uint16_t out[8];
  p.out = out + 2;  // 4-byte aligned
  EXPECT_THROW(decode_attention(p, plan, nullptr, nullptr), Error);
  p.out = out + 4;
  EXPECT_NO_THROW(decode_attention(p, plan, nullptr, nullptr));
}

// Sharp attention: Q's code part x 24 spreads a row's scores over tens of binades, so its
// running max keeps rising by more than 2^8 well after the first tile (on random data of
// amplitude 1 it settles there), and the O rescales run on later tiles: both warpgroups' in
// the 64-row tile (128 heads), and the thin tile's (12 heads x 2 causal tokens = 24 rows).
TEST(CudaDecodeSm90, SharpScoresRescaleLate) {
  KMLA_REQUIRE_GPU();
  for (const int heads : {128, 12}) {
    DecodeCase c;
    c.heads = heads;
    c.block_size = 64;
    c.seq_lens = {4100, 777, 64, 1, 2000};
    const int qlen = heads == 12 ? 2 : 1;
    c.query_lens.assign(c.seq_lens.size(), qlen);
    c.q_code_amp = 24.0f;
    c.seed = 28 + heads;
    run_case_sm90(c, {{0, 0}, {1, 0}, {3, 0}});
  }
}

// q = 2 causal with 64 heads: 128 rows = two CTAs per request, token 0 sees one key less (and
// none at seq_len 1); block size 16 so a 64-key tile gathers from 4+ permuted blocks.
TEST(CudaDecodeSm90, Bf16Heads64TwoTokensCausal) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 64;
  c.block_size = 16;
  c.seq_lens = {2, 1, 63, 64, 65, 1000, 0, 4100};
  c.query_lens = {2, 2, 2, 2, 2, 2, 0, 2};
  c.seed = 12;
  run_case_sm90(c, kSm90Tweaks);
}

// q = 4 non-causal, 64 heads (256 rows: 4 CTAs), blocks of 256 keys, f16.
TEST(CudaDecodeSm90, F16Heads64FourTokensNonCausal) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp16;
  c.act = DType::f16;
  c.heads = 64;
  c.block_size = 256;
  c.causal = false;
  c.seq_lens = {4, 63, 65, 1000, 0, 4100, 0};
  c.query_lens = {4, 4, 3, 4, 0, 1, 2};  // the last request has no keys: zeros and -inf
  c.seed = 13;
  run_case_sm90(c, kSm90Tweaks);
}

// Partial row tiles: 100 heads x 1 token (64 + 36 rows) and 48 heads x 3 tokens causal
// (144 rows = 64 + 64 + 16; rows of one token straddle CTAs), odd block size.
TEST(CudaDecodeSm90, OddHeadCountsPartialTiles) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 100;
  c.block_size = 100;
  c.seq_lens = {1, 64, 65, 1000, 130};
  c.query_lens = {1, 1, 0, 1, 1};
  c.seed = 14;
  run_case_sm90(c, kSm90Tweaks);
  c.heads = 48;
  c.block_size = 16;
  c.seq_lens = {3, 4, 63, 65, 1000};
  c.query_lens = {3, 3, 3, 2, 3};
  c.seed = 15;
  run_case_sm90(c, kSm90Tweaks);
}

// 33-63 rows per request: one 64-row tile with its last rows masked. The speculative K3
// shape (12 heads x 4 causal tokens = 48 rows: token i sees seq - 3 + i keys, so the four
// tokens of a tile end on different keys, some just off a 64-key tile or 16-key block
// boundary), with shorter query blocks mixed in and lengths below the query length.
TEST(CudaDecodeSm90, SpeculativeCausal48Rows) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 12;
  c.block_size = 16;
  c.seq_lens = {1, 3, 4, 5, 63, 64, 65, 66, 67, 0, 129, 1000, 4100};
  c.query_lens = {4, 4, 4, 4, 4, 4, 4, 4, 3, 0, 2, 4, 4};
  c.seed = 31;
  run_case_sm90(c, kSm90Tweaks);
  c.block_size = 256;  // the same shape from large blocks, f16
  c.format = CacheFormat::fp16;
  c.act = DType::f16;
  c.seed = 32;
  run_case_sm90(c, kSm90Tweaks);
}

// The least rows the kernel takes (33: one token of 33 heads, 31 rows masked; block size 64)
// and an odd 55-row tile (11 heads x 5 causal tokens; block size 8).
TEST(CudaDecodeSm90, FewRowsOddHeads) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 33;
  c.block_size = 64;
  c.seq_lens = {1, 64, 65, 700, 2049};
  c.query_lens = {1, 1, 1, 1, 1};
  c.seed = 33;
  run_case_sm90(c, kSm90Tweaks);
  c.heads = 11;
  c.block_size = 8;  // TMA groups of 8 keys, 8 blocks per 64-key tile
  c.seq_lens = {5, 6, 64, 68, 0, 1500};
  c.query_lens = {5, 5, 5, 4, 0, 5};
  c.seed = 34;
  run_case_sm90(c, kSm90Tweaks);
}

// 32 rows or fewer on the 64-row tile, most of it masked: 12 heads x 2 causal tokens (24 rows,
// the K3 shape with one draft token, on the wgmma kernel by default), 16 x 2 (32) with
// shorter queries mixed in, and under min_rows 0 one token of 16, 5 and 1 heads (16, 5 and 1
// rows); lengths just off the tile and block ends, blocks of 16 and 64 keys.
TEST(CudaDecodeSm90, FewRowsOnTheWideTile) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 12;
  c.block_size = 16;
  c.seq_lens = {1, 2, 63, 64, 65, 0, 129, 1000, 4100};
  c.query_lens = {2, 2, 2, 2, 2, 0, 1, 2, 2};
  c.seed = 41;
  run_case_sm90(c, kSm90Tweaks);
  c.heads = 16;
  c.block_size = 64;
  c.seq_lens = {2, 64, 65, 700, 3000, 1};
  c.query_lens = {2, 1, 2, 2, 2, 1};
  c.seed = 42;
  run_case_sm90(c, kSm90Tweaks);
  for (const int heads : {16, 5, 1}) {
    c.heads = heads;
    c.block_size = 64;
    c.seq_lens = {1, 63, 64, 65, 0, 2049};
    c.query_lens = {1, 1, 1, 1, 0, 1};
    c.seed = 43 + uint64_t(heads);
    run_case_sm90(c, kSm90Tweaks, 0);
  }
}

// Thin tiles (DecodeSm90Options::thin_rows, keys in the MMAs' M): launches of at most 32 rows
// per request, 7 heads x 4 causal tokens (28 rows, N = 32; the tokens end on different keys) in
// f16 from blocks of 32, 9 heads x 3 non-causal (27) from blocks of 100 (cp.async), and under
// min_rows 0 5 heads x 3 causal (15 rows, N = 16) from blocks of 64 and 24 and 16 heads x 1;
// then 16-row thin pieces next to 64-row ones in the wide kernel: one-token requests (12 and 16
// rows) among 12 heads x 6 causal tokens (64 + 8 rows, the last 8 on a masked 64-row tile) and
// 16 x 5 non-causal (64 + 16). Lengths below the query length and just off the tile and block
// ends.
// FewRowsOnTheWideTile runs 24 and 32 rows, OddHeadCountsPartialTiles 48 heads x 3.
TEST(CudaDecodeSm90, ThinTiles) {
  EXPECT_EQ(decode_sm90_thin_tile(28), 32);
  EXPECT_EQ(decode_sm90_thin_tile(32), 32);
  EXPECT_EQ(decode_sm90_thin_tile(15), 16);
  EXPECT_EQ(decode_sm90_thin_tile(33), 0);
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 7;
  c.format = CacheFormat::fp16;
  c.act = DType::f16;
  c.block_size = 32;
  c.seq_lens = {3, 4, 5, 63, 64, 65, 66, 0, 129, 1000, 4100};
  c.query_lens = {3, 4, 4, 4, 4, 4, 4, 0, 2, 4, 4};
  c.seed = 51;
  run_case_sm90(c, kSm90Tweaks);
  c.heads = 9;
  c.format = CacheFormat::bf16;
  c.act = DType::bf16;
  c.block_size = 100;
  c.causal = false;
  c.seq_lens = {3, 99, 100, 101, 0, 2049};
  c.query_lens = {3, 3, 2, 3, 0, 3};
  c.seed = 52;
  run_case_sm90(c, kSm90Tweaks);
  c.causal = true;
  c.seq_lens = {3, 4, 63, 64, 65, 0, 2049};
  // (Block size 24: groups of 8 keys, 72 copies a tile, spread over three rounds of the lanes.)
  for (const auto& [heads, block_size] : {std::pair{5, 64}, {16, 64}, {5, 24}}) {
    c.heads = heads;
    c.block_size = block_size;
    c.query_lens = {3, 3, 3, 3, 2, 0, 3};
    if (heads == 16) c.query_lens = {1, 1, 1, 1, 1, 0, 1};
    c.seed = 53 + uint64_t(heads);
    run_case_sm90(c, kSm90Tweaks, 0);
  }
  c.heads = 12;
  c.block_size = 16;
  c.seq_lens = {6, 7, 63, 64, 65, 70, 0, 129, 1000, 4100};
  c.query_lens = {6, 1, 6, 5, 1, 6, 0, 2, 6, 1};
  c.seed = 71;
  run_case_sm90(c, kSm90Tweaks);
  c.heads = 16;
  c.block_size = 64;
  c.causal = false;
  c.seq_lens = {5, 64, 65, 0, 700, 2049};
  c.query_lens = {5, 1, 4, 0, 5, 1};
  c.seed = 72;
  run_case_sm90(c, kSm90Tweaks);
}

// The DSpark draft: 8 heads x 8 non-causal tokens = one full 64-row tile per request, every
// token sees the whole sequence; lengths just off the tile boundaries, block sizes 64, 32.
TEST(CudaDecodeSm90, DraftNonCausal64Rows) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 8;
  c.block_size = 64;
  c.causal = false;
  c.seq_lens = {8, 63, 64, 65, 127, 128, 129, 3000};
  c.query_lens = {8, 8, 8, 8, 8, 8, 8, 8};
  c.seed = 35;
  run_case_sm90(c, kSm90Tweaks);
  c.block_size = 32;  // TMA groups of 32 keys
  c.seed = 36;
  run_case_sm90(c, kSm90Tweaks);
}

// A bad block id: the keys behind it are masked (never read) and the error flag is raised.
TEST(CudaDecodeSm90, BadBlockIdRaisesFlag) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 64;
  c.block_size = 64;
  c.seq_lens = {300, 1000};
  c.query_lens = {1, 1};
  c.bad_block_request = 1;
  c.seed = 16;
  run_case_sm90(c, {{0, 0}, {1, 0}, {4, 0}});
}

// The issue-6 shapes' plans pick the wgmma kernel on sm_90 (also for 33-63 rows), and only
// where it applies.
TEST(CudaDecodeSm90, DispatchPicksWgmmaFor128Heads) {
  KMLA_REQUIRE_GPU();
  const bool sm90 = expect_sm90();
  DecodeParams p;
  p.heads = 128;
  p.cache.format = CacheFormat::bf16;
  p.act = DType::bf16;
  DecodePlan plan = plan_decode(128, 128, 1, 4096, false);
  EXPECT_EQ(plan.rows_per_cta, 64);
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  p.heads = 64;  // 64 heads x 2 tokens (causal MTP): 128 rows per request
  plan = plan_decode(64, 64, 2, 8192, false);
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  p.heads = 128;
  plan = plan_decode(16, 128, 1, 4096, false);
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  // Not the wgmma kernel: portable, batch invariant, fp8 caches, 32 rows or fewer.
  EXPECT_FALSE(decode_sm90_supports(p, plan_decode(16, 128, 1, 4096, true)));
  EXPECT_FALSE(decode_sm90_supports(p, plan_decode(16, 128, 1, 4096, false, true)));
  DecodeParams fp8 = p;
  fp8.cache.format = CacheFormat::fp8;
  EXPECT_FALSE(decode_sm90_supports(fp8, plan));
  fp8.cache.format = CacheFormat::fp8_ds_mla;
  EXPECT_FALSE(decode_sm90_supports(fp8, plan));
  // 17-32 rows: the 64-row tile too (DecodeSm90Options::min_rows, 16 by default); 16 or
  // fewer keep the 16-row mma.sync kernel, and so do 17-32 under min_rows 32.
  p.heads = 16;
  plan = plan_decode(16, 16, 2, 4096, false);  // 32 rows
  EXPECT_EQ(plan.rows_per_cta, sm90 ? 64 : 32);
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  EXPECT_EQ(plan_decode(16, 16, 2, 4096, false, false, CacheFormat::fp8).rows_per_cta, 16);
  EXPECT_EQ(plan_decode(16, 16, 2, 4096, false, false, CacheFormat::fp8_ds_mla).rows_per_cta, 16);
  plan = plan_decode(16, 16, 1, 4096, false);  // 16 rows
  EXPECT_EQ(plan.rows_per_cta, 16);
  EXPECT_FALSE(decode_sm90_supports(p, plan));
  // ... but thin tiles in batches of at least small_min_requests (64) requests, of at most
  // small_max_keys (2048) keys on GPUs with fast DRAM (an H200), of any length on others.
  plan = plan_decode(64, 16, 1, 2048, false);
  EXPECT_EQ(plan.rows_per_cta, sm90 ? 64 : 16);
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  EXPECT_EQ(plan_decode(63, 16, 1, 2048, false).rows_per_cta, 16);
  const int64_t max_keys = decode_sm90_small_max_keys();
  EXPECT_TRUE(max_keys == 2048 || max_keys == std::numeric_limits<int64_t>::max()) << max_keys;
  const bool long_thin = sm90 && max_keys > 8192;
  EXPECT_EQ(plan_decode(64, 16, 1, 2049, false).rows_per_cta, long_thin ? 64 : 16);
  EXPECT_EQ(plan_decode(128, 12, 1, 8192, false).rows_per_cta, long_thin ? 64 : 16);
  EXPECT_EQ(plan_decode(128, 12, 1, 8192, false, false, CacheFormat::fp8).rows_per_cta, 16);
  const DecodeSm90Options saved = decode_sm90_options();
  DecodeSm90Options o = saved;
  o.min_rows = 32;
  decode_sm90_set_options(o);
  plan = plan_decode(16, 16, 2, 4096, false);
  EXPECT_EQ(plan.rows_per_cta, 32);
  EXPECT_FALSE(decode_sm90_supports(p, plan));
  o.small_min_requests = 0;
  decode_sm90_set_options(o);
  EXPECT_EQ(plan_decode(128, 16, 1, 1024, false).rows_per_cta, 16);
  o.min_rows = 0;
  decode_sm90_set_options(o);
  plan = plan_decode(16, 16, 1, 4096, false);
  EXPECT_EQ(plan.rows_per_cta, sm90 ? 64 : 16);
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  decode_sm90_set_options(saved);
  plan = plan_decode(16, 16, 4, 4096, false);  // 64 rows
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  // 33-63 rows: one masked 64-row tile (the speculative K3 shape: 12 heads x 4 tokens).
  p.heads = 12;
  plan = plan_decode(128, 12, 4, 8192, false);
  EXPECT_EQ(plan.rows_per_cta, 64);
  EXPECT_EQ(decode_sm90_supports(p, plan), sm90);
  p.heads = 33;
  EXPECT_EQ(decode_sm90_supports(p, plan_decode(8, 33, 1, 4096, false)), sm90);
}

// The building blocks alone: S = q k^T through the two 32-key halves and O = round(p) v with
// v = k[:, :512] read MN-major, each element compared with an fp64 dot product. A wrong
// swizzle, descriptor offset or accumulator mapping moves whole 16-byte chunks, rows or
// columns, which shows as errors of the order of the values themselves.
TEST(CudaDecodeSm90, ProbeBuildingBlocks) {
  KMLA_REQUIRE_GPU();
  if (!expect_sm90()) GTEST_SKIP() << "not an sm_90 GPU";
  constexpr int keys = 64;
  for (DType act : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(act));
    std::mt19937_64 rng(act == DType::bf16 ? 21 : 22);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f), unit(0.0f, 1.0f);
    const auto to_act = [&](float x) {
      return act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
    };
    std::vector<uint16_t> q(64 * kLatentDim), k(64 * kLatentDim);
    std::vector<float> qf(q.size()), kf(k.size()), p(size_t(64 * keys)), pr(p.size());
    for (size_t i = 0; i < q.size(); ++i) {
      q[i] = to_act(uni(rng));
      k[i] = to_act(uni(rng));
      qf[i] = act_to_float(act, q[i]);
      kf[i] = act_to_float(act, k[i]);
    }
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] = unit(rng);
      pr[i] = act_to_float(act, to_act(p[i]));  // the kernel rounds P to act
    }
    DevBuf<uint16_t> d_q(q), d_k(k);
    DevBuf<float> d_p(p), d_s(size_t(64 * keys)), d_o(64 * kKvLoraRank);
    d_s.fill_bytes(0xFF);
    d_o.fill_bytes(0xFF);
    decode_sm90_probe(act, d_q.ptr, d_k.ptr, d_p.ptr, d_s.ptr, d_o.ptr, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> s = d_s.download(), o = d_o.download();
    int bad = 0;
    // got against sum_x a[x * sa] b[x * sb] over n terms in fp64: fp32 accumulation of exact
    // products is off by a few 2^-24 of the magnitude sum; 1e-4 leaves room for the tensor
    // cores' internal alignment and order, and is still ~100x below what one misplaced
    // 8-element chunk or row changes.
    auto check = [&](float got, const float* x, int sx, const float* y, int sy, int n,
                     const std::string& what) {
      double ref = 0.0, mag = 0.0;
      for (int d = 0; d < n; ++d) {
        ref += double(x[d * sx]) * y[d * sy];
        mag += std::fabs(double(x[d * sx]) * y[d * sy]);
      }
      if (!(std::fabs(got - ref) <= 1e-4 * mag + 1e-6) && ++bad <= 10)
        ADD_FAILURE() << what << " = " << got << ", want " << ref;
    };
    for (int i = 0; i < 64; ++i)
      for (int j = 0; j < keys; ++j)
        check(s[i * keys + j], &qf[i * kLatentDim], 1, &kf[j * kLatentDim], 1, kLatentDim,
              "S[" + std::to_string(i) + "][" + std::to_string(j) + "]");
    for (int i = 0; i < 64; ++i)
      for (int c = 0; c < kKvLoraRank; ++c)
        check(o[i * kKvLoraRank + c], &pr[i * keys], 1, &kf[c], kLatentDim, keys,
              "O[" + std::to_string(i) + "][" + std::to_string(c) + "]");
    EXPECT_EQ(bad, 0);
  }
}

}  // namespace
}  // namespace kmla::cuda
