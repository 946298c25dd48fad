// Decode attention (absorbed MQA over the paged latent cache) against the CPU backend's
// cpu::decode_attention_f32 on the same cache bytes and block tables, through the adversarial
// harness in decode_harness.hpp: every cache format and activation dtype on the mma.sync
// kernel, split counts and row tiles, the balanced scheduler (and its host-side walk on the
// CPU), the batch-invariant mode and the fp8 fragment path.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/decode_sched.cuh"
#include "cuda/decode_sm90.cuh"
#include "decode_harness.hpp"

namespace kmla::cuda {
namespace {

// Splits: what the plan picks, one, and several (beyond the sequence's tiles for short ones);
// the deep pipeline (not the plan's choice today) is forced too.
const std::vector<PlanTweak> kSplitTweaks = {{0, 0}, {1, 0}, {5, 0}, {0, 0, true}, {3, 0, true}};

TEST(CudaDecode, Bf16CacheMixedLengths) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 16;
  c.block_size = 64;
  c.seq_lens = {1, 63, 900, 64, 65, 1000, 5000};
  c.query_lens = {1, 1, 0, 1, 1, 1, 1};
  run_case(c, kSplitTweaks);
}

TEST(CudaDecode, Fp16CacheOddHeadsMultiToken) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp16;
  c.act = DType::f16;
  c.heads = 3;
  c.block_size = 16;
  c.seq_lens = {4, 63, 64, 65, 500, 1000, 2};
  c.query_lens = {4, 2, 3, 1, 0, 4, 2};
  c.seed = 2;
  // rows = 4 x 3 = 12: every row tile size, so 16 / 32 / 64-row CTAs see partial tiles.
  run_case(c, {{0, 0}, {1, 32}, {3, 64}, {7, 16}, {7, 16, true}});
}

TEST(CudaDecode, Fp16CacheNonCausal) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp16;
  c.act = DType::f16;
  c.heads = 16;
  c.block_size = 100;  // not a power of two
  c.causal = false;
  c.seq_lens = {3, 63, 0, 65, 1000, 0};  // the last request has no keys: zeros and -inf
  c.query_lens = {3, 2, 0, 4, 2, 1};
  c.seed = 3;
  run_case(c, kSplitTweaks);
}

TEST(CudaDecode, Fp8CacheFp8Queries) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp8;
  c.q_fp8 = true;
  c.q_scale = 0.5f;
  c.k_scale = 2.0f;
  c.heads = 16;
  c.block_size = 64;
  c.causal = false;
  c.seq_lens = {2, 64, 65, 1000, 0, 5000};
  c.query_lens = {2, 1, 2, 1, 0, 2};
  c.seed = 4;
  run_case(c, kSplitTweaks);
  // The default plan puts the 32-row requests on two 16-row tiles of the fragment path (in
  // lockstep sections); per request with 3 splits, and on the 32-row conversion pass, which
  // portable plans keep.
  c.seed = 5;
  run_case(c, {{3, 16}, {.rows_per_cta = 16, .workers = 40}, {.rows_per_cta = 32}});
}

TEST(CudaDecode, Fp8CacheActQueries) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp8;
  c.act = DType::f16;
  c.k_scale = 2.0f;
  c.heads = 1;
  c.block_size = 1;
  c.seq_lens = {1, 63, 64, 65, 1000};
  c.query_lens = {1, 3, 0, 1, 4};
  c.seed = 5;
  run_case(c, {{0, 0}, {1, 0}, {4, 0}, {2, 64}, {1, 0, true}});
}

TEST(CudaDecode, DsMlaCache128Heads) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp8_ds_mla;
  c.heads = 128;
  c.block_size = 64;
  c.seq_lens = {65, 1, 0, 1000, 2};
  c.query_lens = {1, 1, 0, 2, 2};
  c.seed = 6;
  run_case(c, kSplitTweaks);
}

TEST(CudaDecode, DsMlaCacheF16LargeBlocks) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp8_ds_mla;
  c.act = DType::f16;
  c.heads = 16;
  c.block_size = 1024;
  c.seq_lens = {63, 1025, 0, 5000};
  c.query_lens = {1, 3, 0, 2};
  c.seed = 7;
  run_case(c, kSplitTweaks);
}

// Every block size through every cache format's load path (the fp8 formats go through the
// raw-tile conversion, which differs between the 16-row kernel and the 32 / 64-row ones),
// alternating bf16 and f16 activations.
TEST(CudaDecode, EveryBlockSizeEveryFormat) {
  KMLA_REQUIRE_GPU();
  for (CacheFormat format : {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    for (int bs : {1, 16, 64, 100, 1024}) {
      DecodeCase c;
      c.act = bs == 16 || bs == 100 ? DType::f16 : DType::bf16;
      c.format = format == CacheFormat::bf16 && c.act == DType::f16 ? CacheFormat::fp16 : format;
      SCOPED_TRACE(::testing::Message()
                   << "block size " << bs << ", cache " << cache_format_name(c.format) << ", act "
                   << dtype_name(c.act));
      c.k_scale = 0.5f;  // plain fp8 only
      c.heads = 3;
      c.block_size = bs;
      c.seq_lens = {1, 63, 64, 0, 65, 1000};
      c.query_lens = {1, 1, 2, 0, 1, 3};
      c.seed = 100 + bs + 7 * int(format);
      run_case(c, {{0, 0}, {3, 0}, {2, 32}, {5, 64}, {0, 0, true}});
    }
  }
}

// Hundreds of splits (up to the 1024 maximum) over sequences from 1 to 100K keys, so most
// splits of the short requests are empty and the combine sees up to 1024 partials per row,
// many of them NaN-poisoned workspace that must be skipped.
TEST(CudaDecode, HundredsOfSplitsLongMixed) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 4;
  c.block_size = 256;
  c.seq_lens = {1, 63, 0, 257, 4097, 40000, 100000};
  c.query_lens = {1, 2, 0, 1, 3, 1, 1};
  c.seed = 11;
  run_case(c, {{0, 0}, {257, 0}, {600, 0}, {1024, 0}, {300, 32}});
}

TEST(CudaDecode, HundredsOfSplitsDsMlaAndFp8) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.format = CacheFormat::fp8_ds_mla;
  c.heads = 12;
  c.block_size = 64;
  c.causal = false;
  c.seq_lens = {30000, 1, 5000};
  c.query_lens = {1, 1, 2};
  c.seed = 12;
  run_case(c, {{0, 0}, {300, 0}, {117, 64}, {300, 0, true}});
  c.format = CacheFormat::fp8;
  c.q_fp8 = true;
  c.q_scale = 0.25f;
  c.k_scale = 4.0f;
  c.seed = 13;
  run_case(c, {{0, 0}, {300, 0}});
}

TEST(CudaDecode, BadBlockIdRaisesFlag) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 16;
  c.block_size = 16;
  c.seq_lens = {100, 40, 0, 16};
  c.query_lens = {1, 1, 0, 1};
  c.bad_block_request = 0;  // keys [96, 100) become invisible
  run_case(c, {{0, 0}, {1, 0}, {4, 0}});
  c.bad_block_request = 3;  // the only block: no visible key, zeros and -inf
  c.seed = 9;
  run_case(c, {{0, 0}, {2, 0}});
}

TEST(CudaDecode, PlanPicksSplitsAndTiles) {
  KMLA_REQUIRE_GPU();
  // Few requests and long sequences: split to fill the GPU; short ones: never below the
  // minimum keys per split.
  const DecodePlan few = plan_decode(2, 16, 1, 8192, false);
  EXPECT_GT(few.num_splits, 1);
  EXPECT_GT(few.workspace_bytes, 0u);
  EXPECT_EQ(few.rows_per_cta, 16);
  const DecodePlan shorts = plan_decode(2, 16, 1, 200, false);
  EXPECT_EQ(shorts.num_splits, 1);
  // Balanced plans always have a workspace (two slots per worker and the pair table); the
  // per-request schedule with one split writes out directly and needs none.
  if (!schedule_forced()) EXPECT_EQ(shorts.schedule, DecodeSchedule::balanced);
  EXPECT_EQ(shorts.workspace_bytes, decode_workspace_bytes(shorts, 2, 16));
  EXPECT_GE(shorts.workspace_bytes,
            size_t(2) * shorts.num_workers * 16 * (kKvLoraRank + 1) * sizeof(float));
  DecodePlan per = shorts;
  per.schedule = DecodeSchedule::per_request;
  EXPECT_EQ(decode_workspace_bytes(per, 2, 16), 0u);
  // One or four long requests: far more than the old cap of 32 splits (264 CTA slots on an
  // H200; any GPU with >= 34 SMs gives > 32), each of >= 256 keys, workspace for all.
  const DecodePlan one_long = plan_decode(1, 12, 1, int64_t(1) << 20, false);
  EXPECT_GT(one_long.num_splits, 32);
  EXPECT_LE(one_long.num_splits, 1024);
  EXPECT_GE(one_long.workspace_bytes, size_t(12) * one_long.num_splits * 513 * sizeof(float));
  const DecodePlan short_one = plan_decode(1, 12, 1, 65536, false);
  EXPECT_GT(short_one.num_splits, 32);
  EXPECT_LE(short_one.num_splits, 65536 / 256);
  EXPECT_GT(plan_decode(4, 12, 1, 262144, false).num_splits, 8);
  EXPECT_EQ(plan_decode(4, 16, 2, 100, true).rows_per_cta, 32);
  EXPECT_EQ(plan_decode(4, 128, 1, 100, false).rows_per_cta, 64);
  // The deep pipeline is never the plan's choice (measured slower); tests force it.
  EXPECT_FALSE(few.deep_pipeline);
  EXPECT_FALSE(plan_decode(2, 16, 1, 8192, true).deep_pipeline);
  EXPECT_FALSE(plan_decode(4, 128, 1, 100, false).deep_pipeline);
  EXPECT_THROW(plan_decode(4, 0, 1, 100, false), Error);
  EXPECT_THROW(plan_decode(4, 16, 129, 100, false), Error);
  // The balanced schedule: one wave of workers; the per-request grid for batch-invariant
  // plans, one request and above kDecodeBalancedMaxRequests requests.
  if (!schedule_forced()) {
    EXPECT_EQ(few.schedule, DecodeSchedule::balanced);
    EXPECT_GE(few.num_workers, 2);
    EXPECT_LE(few.num_workers, 1024);
    EXPECT_EQ(plan_decode(kDecodeBalancedMaxRequests + 1, 16, 1, 100, false).schedule,
              DecodeSchedule::per_request);
    EXPECT_EQ(one_long.schedule, DecodeSchedule::per_request);  // one request: equal splits
  }
  EXPECT_EQ(plan_decode(2, 16, 1, 8192, false, true).schedule, DecodeSchedule::per_request);
  // Balanced workers: a multiple of the requests just below the slots, for every tile height.
  if (!schedule_forced() && std::getenv("KMLA_DECODE_WORKERS") == nullptr) {
    int device = 0, sms = 0;
    ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
    const DecodePlan rows16 = plan_decode(48, 12, 1, 8192, false);  // (< small_min_requests)
    const DecodePlan rows64 = plan_decode(64, 128, 1, 8192, false);
    ASSERT_EQ(rows16.rows_per_cta, 16);
    ASSERT_EQ(rows64.rows_per_cta, 64);
    EXPECT_EQ(rows16.num_workers, decode_balanced_workers(2 * int64_t(sms), 48));
    EXPECT_EQ(rows64.num_workers, decode_balanced_workers(sms, 64));
    // The combine of 64-row balanced plans is a programmatic dependent on sm_90; 16-row ones
    // launch it plainly.
    int major = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
              cudaSuccess);
    if (!std::getenv("KMLA_DECODE_PDL")) {
      EXPECT_EQ(rows64.programmatic_combine, major >= 9);
      EXPECT_FALSE(rows16.programmatic_combine);
    }
    // Balanced plans merge their cut pairs in the split kernel (but see below); per-request
    // ones launch the combine.
    if (!std::getenv("KMLA_DECODE_FUSED")) {
      EXPECT_TRUE(rows64.fused_combine);
      EXPECT_TRUE(rows16.fused_combine);
      // 64-row tiles with fewer pairs than workers (every pair of a uniform batch cut): the
      // combine kernel. 16 requests of 2 row tiles; the DSpark draft's 64 of one.
      EXPECT_FALSE(plan_decode(16, 128, 1, 4096, false).fused_combine);
      EXPECT_FALSE(plan_decode(64, 8, 8, 8192, false).fused_combine);
      EXPECT_TRUE(plan_decode(128, 12, 4, 8192, false).fused_combine);  // q 4: none cut
      EXPECT_FALSE(plan_decode(1, 12, 1, 65536, false).fused_combine);
      // A few long requests (~66 pieces a row): the combine kernel's CTA-per-row form.
      const DecodePlan few_long = plan_decode(4, 12, 1, 262144, false);
      EXPECT_EQ(few_long.schedule, DecodeSchedule::balanced);
      EXPECT_FALSE(few_long.fused_combine);
      EXPECT_FALSE(plan_decode(2, 16, 1, 8192, false, true).fused_combine);  // invariant
    }
  }
}

// ---- the balanced scheduler ----------------------------------------------------------
// Balanced plans cut the batch's key tiles into equal worker shares, so pieces start and
// end anywhere in a request, and several pieces run one after the other in one CTA. The
// tweaks force few and many workers, cutting every pair (nosplit 0, no start-up charge,
// tiny shares), 16-row tiles so a request has several pairs, and the per-request grid.
const std::vector<PlanTweak> kSchedTweaks = {
    {0, 0},                              // the plan's choice
    {0, 0, false, 1},                    // one worker runs every piece in turn
    {0, 0, false, 3},                    // few workers: long shares, many whole pairs each
    {0, 0, false, 7, 0, 0, 0},           // everything cut, no charge
    {0, 0, false, 1000, 0, 0, 0},        // more workers than tiles: 1-tile shares
    {0, 0, false, 264, 32, 0, 64},       // every pair cut, 1-tile minimum share
    {0, 16, false, 100, 0, 0, 0},        // 16-row tiles: several pairs per request
    {2, 0},                              // the per-request grid, for comparison
    {.pdl = true, .fused = 0},           // the combine kernel launched early (PDL)
    {5, 0, false, 0, -1, -1, -1, true},  // per-request splits with PDL
    // Balanced plans merge their cut pairs in the split kernel by default (the fused
    // combine); these add 64-row tiles with every pair cut, more 64-row workers than fit at
    // once (the launch falls back to the combine kernel), the fused merge forced on rows of
    // well over 32 partials (a warp walks them), and the combine kernel for the plan's choice.
    {0, 64, false, 100, 0, 0, 0},
    {0, 64, false, 300, 0, 0, 0},
    {.workers = 264, .min_keys = 0, .nosplit_keys = 0, .pair_keys = 0, .fused = 1},
    {.fused = 0},
};

// Lengths 0, 1 and around block (64) and tile (32) boundaries, padded slots between real
// requests, and one long request among them.
TEST(CudaDecodeSched, MixedLengthsAndPaddedSlots) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 16;
  c.block_size = 64;
  c.seq_lens = {0, 1, 63, 64, 65, 0, 31, 32, 33, 127, 128, 129, 4000, 9000, 2, 700};
  c.query_lens = {1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0};
  c.seed = 41;
  run_case(c, kSchedTweaks);
}

// One 64K-key request among many short ones: the long one is cut over most workers, the
// short ones stay whole; odd head count and block size.
TEST(CudaDecodeSched, OneLongRequestAmongShortOnes) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 5;
  c.block_size = 100;
  std::mt19937 rng(7);
  for (int i = 0; i < 150; ++i) {
    c.seq_lens.push_back(i == 77 ? 65536 : int(rng() % 300));
    c.query_lens.push_back(i % 37 == 5 ? 0 : 1);
  }
  c.seed = 42;
  run_case(c, {{0, 0}, {0, 0, false, 17}, {0, 0, false, 1000, 0, 0, 0}, {4, 0}});
}

// Causal multi-token rows: 3 to 5 tokens x 12 heads, so the tiles of a request see
// different key counts (the last row of each tile sets its range), with 16, 32 and 64-row
// tiles; the same non-causal; and fp8_ds_mla through the raw-tile conversion.
TEST(CudaDecodeSched, MultiTokenRows) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 12;
  c.block_size = 16;
  c.seq_lens = {5, 64, 65, 0, 3000, 1, 700, 12000};
  c.query_lens = {5, 3, 4, 0, 5, 1, 2, 3};
  c.seed = 43;
  run_case(c, {{0, 0},
               {0, 16, false, 50},
               {0, 32, false, 9, 0, 0, 0},
               {0, 64, false, 200, 0, 0, 0},
               {.rows_per_cta = 16, .workers = 50, .request_order = true},
               {.rows_per_cta = 32,
                .workers = 9,
                .min_keys = 0,
                .nosplit_keys = 0,
                .pair_keys = 0,
                .request_order = true}});
  c.causal = false;
  c.seed = 44;
  run_case(c, {{0, 0}, {0, 16, false, 31, 0, 0, 0}});
  c.causal = true;
  c.format = CacheFormat::fp8_ds_mla;
  c.act = DType::f16;
  c.seed = 45;
  run_case(c, {{0, 0}, {0, 0, false, 77, 0, 0, 0}, {0, 0, true, 40, 0, 0, 0}});
}

// 64 heads: 64-row tiles, which on sm_90 run the wgmma kernel (64-key tiles, the same
// scheduler), balanced and per request.
TEST(CudaDecodeSched, SixtyFourHeads) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 64;
  c.block_size = 64;
  c.seq_lens = {1, 0, 64, 65, 5000, 129, 20000};
  c.query_lens = {1, 1, 1, 0, 2, 1, 1};
  c.seed = 46;
  run_case(
      c,
      {{0, 0},
       {0, 0, false, 5},
       {0, 0, false, 300, 0, 0, 0},
       {3, 0},
       {.workers = 5, .request_order = true},
       {.workers = 300, .min_keys = 0, .nosplit_keys = 0, .pair_keys = 0, .request_order = true}});
}

// ---- the scheduler's arithmetic on the CPU ------------------------------------------------
// balanced_walk replayed for every worker of random batches (the device prologue's prefix
// sum done here by a plain loop): every live (request, row tile) pair's keys [0, kmax) are
// covered by its pieces exactly once, in order, tile aligned; a pair has one direct piece
// or n >= 2 pieces in the slots balanced_slot names, no slot used twice; the pair table
// matches; and no worker gets more than its share plus the pairs it may not cut.
struct HostSchedCase {
  int heads = 8, max_qlen = 1, rows = 16, key_tile = 32, grid = 264;
  bool causal = true;
  bool pass_major = false;  // DecodeArgs::pass_major
  int pair_keys = 32, min_keys = 256, nosplit_keys = 512;
  std::vector<int32_t> seq, qlen;
};

// `requests` requests of `heads` x `qlen` rows on a 132-CTA grid (one 64-row CTA per SM of an
// H100 / H200) in pass order; the lengths are the caller's.
HostSchedCase pass_order_case(int requests, int heads, int qlen) {
  HostSchedCase c;
  c.heads = heads;
  c.max_qlen = qlen;
  c.grid = 132;
  c.pass_major = true;
  c.qlen.assign(size_t(requests), qlen);
  return c;
}

// The requests' first units in request order (off[R] = the total).
template <int ROWS, int KEY_TILE>
std::vector<int64_t> request_offsets(const DecodeArgs& a, const SchedUnits& u) {
  std::vector<int64_t> off(size_t(a.num_requests) + 1, 0);
  for (int r = 0; r < a.num_requests; ++r)
    off[size_t(r) + 1] = off[size_t(r)] + request_units(a, ROWS, KEY_TILE, u, r);
  return off;
}

// Whether the walk takes pass order for this batch: pass_order over the requests' row tile
// counts (the device prologue reduces the same fewest / most across its threads).
bool host_pass_order(const DecodeArgs& a, int rows) {
  int fewest = std::numeric_limits<int>::max(), most = 0;
  for (int r = 0; r < a.num_requests; ++r) {
    const int n = live_row_tiles(a, rows, r);
    if (n > 0) fewest = std::min(fewest, n), most = std::max(most, n);
  }
  return pass_order(a, fewest, most);
}

// Every piece of worker w, as the device walks them (off: the requests' first units). The
// start is found as the device prologue finds it: the request holding the share's first
// unit, or in pass order the pair holding it (a plain loop over the list here).
template <int ROWS, int KEY_TILE>
WalkState host_start(const DecodeArgs& a, const SchedUnits& u, int w, int workers, int64_t total,
                     const std::vector<int64_t>& off) {
  const int64_t lo = share_begin(w, total, workers);
  const int R = a.num_requests;
  if (!host_pass_order(a, ROWS)) {
    const int r0 = int(std::upper_bound(off.begin(), off.end(), lo) - off.begin()) - 1;
    return start_walk(u, w, 0, workers, total, r0, R, off[size_t(r0)], 0, kWalkRequests, nullptr);
  }
  int64_t x = 0;
  for (int t = 0; t < a.row_tiles; ++t)
    for (int r = 0; r < R; ++r) {
      const int64_t units = pair_units(a, ROWS, KEY_TILE, u, r, t);
      if (lo < x + units)
        return start_walk(u, w, 0, workers, total, r, R, x, t, kWalkAllPasses, nullptr);
      x += units;
    }
  ADD_FAILURE() << "worker " << w << ": no pair holds unit " << lo;
  return start_walk(u, w, 0, workers, total, R, R, total, 0, kWalkRequests, nullptr);  // (nothing)
}

template <int ROWS, int KEY_TILE, class F>
void walk_worker(const DecodeArgs& a, const SchedUnits& u, int w, int workers, int64_t total,
                 const std::vector<int64_t>& off, bool write_table, F&& f) {
  WalkState st = host_start<ROWS, KEY_TILE>(a, u, w, workers, total, off);
  DecodeWork p;
  while (next_piece<ROWS, KEY_TILE>(a, st, write_table, p)) f(p);
}

// The kernel arguments the balanced walk reads, for case c with ROWS-row tiles (no pair table).
DecodeArgs host_sched_args(const HostSchedCase& c, int rows) {
  DecodeArgs a{};
  a.seq_lens = c.seq.data();
  a.query_lens = c.qlen.data();
  a.num_requests = int(c.seq.size());
  a.heads = c.heads;
  a.causal = c.causal;
  a.max_rows = c.max_qlen * c.heads;
  a.balanced = true;
  a.num_workers = c.grid;
  a.rows_per_cta = rows;
  a.row_tiles = (a.max_rows + rows - 1) / rows;
  a.sched_pair_keys = c.pair_keys;
  a.sched_min_keys = c.min_keys;
  a.sched_nosplit_keys = c.nosplit_keys;
  a.pass_major = c.pass_major;
  return a;
}

// The worker count the device prologue takes for this batch: from its total units and its
// live pairs (the prologue's two scans, a plain loop here).
int host_workers(const DecodeArgs& a, int rows, int64_t total, int grid, const SchedUnits& u) {
  int64_t pairs = 0;
  for (int r = 0; r < a.num_requests; ++r) pairs += live_row_tiles(a, rows, r);
  return balanced_workers(total, pairs, grid, u.min_worker);
}

// The walk table the layer uploads for case a on a `grid`-CTA launch (balanced_walk_table).
template <int ROWS, int KEY_TILE>
std::vector<std::byte> host_walk_table(const DecodeArgs& a, int grid, int lockstep = kLockstepAll) {
  std::vector<std::byte> walk(walk_table_bytes(grid, a.num_requests));
  balanced_walk_table(a, ROWS, KEY_TILE, grid, walk.data(), lockstep);
  return walk;
}
const WalkTableHead& table_head(const std::vector<std::byte>& walk) {
  return *reinterpret_cast<const WalkTableHead*>(walk.data());
}
// The table's count of cut pieces (WalkStart::cuts, the same in every entry).
int table_cut_pieces(const std::vector<std::byte>& walk) {
  return reinterpret_cast<const WalkStart*>(&table_head(walk) + 1)->cuts;
}

// Every worker of a walk (start(w, st): false when worker w has no share) covers the keys of
// every live pair exactly once with the pieces and partial slots the combine expects, and no
// worker runs more than its share plus the pairs it may not cut. Counts the pieces of cut
// pairs into *cuts.
template <int ROWS, int KEY_TILE, class Start>
void check_walks(const HostSchedCase& c, DecodeArgs a, int grid, Start&& start, int* cuts) {
  const int R = int(c.seq.size());
  std::vector<int2> table(size_t(R) * a.row_tiles, make_int2(-1, -1));
  a.pair_table = table.data();
  const SchedUnits u = sched_units(a, KEY_TILE);
  struct Piece {
    int worker, key0, key1;
    bool direct;
    int64_t part;
    int w0, pieces, piece;  // what the fused combine merges (merge_cut_piece)
  };
  std::vector<std::vector<Piece>> pieces(table.size());
  std::vector<int> slot_uses(size_t(2) * grid, 0), worker_uses(size_t(grid), 0);
  for (int cta = 0; cta < grid; ++cta) {
    WalkState st;
    if (!start(cta, st)) continue;
    // The CTA's worker id (the table may place a section's workers on other CTAs): what its
    // share, its partial slots and the pair table count in.
    const int w = st.worker;
    ASSERT_TRUE(w >= 0 && w < grid) << "CTA " << cta;
    EXPECT_EQ(++worker_uses[size_t(w)], 1) << "two CTAs run worker " << w;
    const int64_t lo = st.lo, hi = st.hi;
    ASSERT_LT(lo, hi) << "worker " << w << " has an empty share";
    // Cut-free pairs: at most nosplit tiles, or an eighth of a share.
    const int64_t max_cut_free = std::max<int64_t>(u.nosplit + u.pair, (st.total / st.workers) / 8);
    int64_t tiles_done = 0;
    int cut = 0;  // pieces of cut pairs: the fused combine keeps room for two per worker
    DecodeWork p;
    while (next_piece<ROWS, KEY_TILE>(a, st, true, p)) {
      const size_t pair = size_t(p.r) * a.row_tiles + p.row0 / ROWS;
      pieces[pair].push_back({w, p.key0, p.key1, p.direct, p.part, p.w0, p.pieces, p.piece});
      tiles_done += (p.key1 - p.key0 + KEY_TILE - 1) / KEY_TILE;
      if (!p.direct) {
        ASSERT_EQ(p.part % ROWS, 0);
        ASSERT_EQ(p.part_stride, 1);
        ++slot_uses[size_t(p.part / ROWS)];
        ++cut;
        ++*cuts;
      }
    }
    EXPECT_LE(cut, 2) << "worker " << w << " ran more than two pieces of cut pairs";
    EXPECT_LE(tiles_done, hi - lo + 2 * max_cut_free + 1) << "worker " << w << " overloaded";
  }
  for (int uses : slot_uses) EXPECT_LE(uses, 1) << "a partial slot used twice";

  for (int r = 0; r < R; ++r) {
    const int nrows = std::min(c.qlen[r] * c.heads, a.max_rows);
    for (int t = 0; t < a.row_tiles; ++t) {
      const size_t pair = size_t(r) * a.row_tiles + t;
      const auto& ps = pieces[pair];
      if (t * ROWS >= nrows) {
        EXPECT_TRUE(ps.empty()) << "pieces for a tile without rows";
        continue;
      }
      SCOPED_TRACE(::testing::Message() << "request " << r << " (seq " << c.seq[r] << ", qlen "
                                        << c.qlen[r] << ") tile " << t);
      const int last = std::min(nrows, (t + 1) * ROWS) - 1;
      const int kmax = std::max(0, c.causal ? c.seq[r] - (c.qlen[r] - 1 - last / c.heads) : c.seq[r]);
      ASSERT_FALSE(ps.empty()) << "a live tile got no piece";
      const int2 info = table[pair];
      ASSERT_EQ(info.y, int(ps.size()));
      int next = 0;
      for (size_t s = 0; s < ps.size(); ++s) {
        EXPECT_EQ(ps[s].key0 % KEY_TILE, 0);
        if (ps[s].key1 > ps[s].key0) {
          EXPECT_EQ(ps[s].key0, next) << "piece " << s << " leaves a gap or overlaps";
          next = ps[s].key1;
        }
        EXPECT_EQ(ps[s].direct, ps.size() == 1);
        if (ps.size() > 1) {
          // Where the piece writes its rows is where the combine reads them, and the pieces
          // know their pair's pieces as the table does (the fused merge reads no table).
          EXPECT_EQ(ps[s].worker, info.x + int(s));
          for (int row = 0; row < ROWS; ++row)
            EXPECT_EQ(ps[s].part + row, balanced_partial(info.x, info.y, int(s), ROWS, row));
          EXPECT_EQ(ps[s].w0, info.x);
          EXPECT_EQ(ps[s].pieces, info.y);
          EXPECT_EQ(ps[s].piece, int(s));
        }
      }
      EXPECT_EQ(next, kmax) << "keys not covered to the end";
    }
  }
}

// The device prologue's walk and the walk table's (made under `lockstep`, a LockstepRule):
// both cover every key once (check_walks); a table without sections starts every worker where
// the prologue does, and one with lockstep sections is made only for batches in pass order,
// of mixed row tile counts unless kLockstepAll.
template <int ROWS, int KEY_TILE>
void check_host_schedule(const HostSchedCase& c, int lockstep = kLockstepAll) {
  const int R = int(c.seq.size());
  const DecodeArgs a = host_sched_args(c, ROWS);
  const SchedUnits u = sched_units(a, KEY_TILE);
  const std::vector<int64_t> off = request_offsets<ROWS, KEY_TILE>(a, u);
  const int64_t total = off[size_t(R)];
  if (total == 0) return;
  const int workers = host_workers(a, ROWS, total, c.grid, u);
  ASSERT_GE(workers, 1);
  ASSERT_LE(workers, c.grid);
  const std::vector<std::byte> walk = host_walk_table<ROWS, KEY_TILE>(a, c.grid, lockstep);
  const WalkTableHead& head = table_head(walk);
  EXPECT_EQ(head.rows, ROWS);
  EXPECT_EQ(head.key_tile, KEY_TILE);
  ASSERT_EQ(head.workers, workers);
  ASSERT_EQ(head.total, total);
  auto from_table = [&](int w, WalkState& st) { return table_walk(walk.data(), c.grid, w, u, st); };
  int table_cuts = -1;  // the table walk's pieces of cut pairs
  if (head.sections == 0) {
    for (int w = 0; w < c.grid; ++w) {
      WalkState st;
      ASSERT_EQ(from_table(w, st), w < workers) << "worker " << w;
      if (w >= workers) continue;
      const WalkState want = host_start<ROWS, KEY_TILE>(a, u, w, workers, total, off);
      EXPECT_EQ(st.worker, w);
      EXPECT_EQ(st.r, want.r) << "worker " << w;
      EXPECT_EQ(st.tile, want.tile) << "worker " << w;
      EXPECT_EQ(st.off, want.off) << "worker " << w;
      EXPECT_EQ(st.mode, want.mode) << "worker " << w;
      EXPECT_EQ(st.lo, want.lo) << "worker " << w;
      EXPECT_EQ(st.hi, want.hi) << "worker " << w;
      EXPECT_EQ(st.order, nullptr) << "worker " << w;
    }
  } else {
    EXPECT_TRUE(a.pass_major);
    EXPECT_NE(lockstep, kLockstepOff);
    if (lockstep != kLockstepAll) EXPECT_FALSE(host_pass_order(a, ROWS));
    SCOPED_TRACE("the walk table's lockstep sections");
    int cuts = 0;
    check_walks<ROWS, KEY_TILE>(c, a, c.grid, from_table, &cuts);
    table_cuts = cuts;
  }
  int cuts = 0;
  check_walks<ROWS, KEY_TILE>(
      c, a, c.grid,
      [&](int w, WalkState& st) {
        if (w >= workers) return false;
        st = host_start<ROWS, KEY_TILE>(a, u, w, workers, total, off);
        return true;
      },
      &cuts);
  if (head.sections == 0) table_cuts = cuts;  // the same walk
  // Every CTA's entry gives the walk's count of cut pieces (0: the fused merge skips its
  // grid barrier), also those of CTAs without a share.
  for (int b = 0; b < c.grid; ++b) {
    WalkState st;
    int entry = -1;
    table_walk(walk.data(), c.grid, b, u, st, &entry);
    ASSERT_EQ(entry, table_cuts) << "CTA " << b;
  }
}

TEST(DecodeSched, BalancedWalkCoversEveryKeyOnce) {
  std::mt19937 rng(5);
  int pass_walks = 0;     // trials whose walk ran in pass order
  int section_walks = 0;  // trials whose walk table has lockstep sections
  for (int trial = 0; trial < 300; ++trial) {
    HostSchedCase c;
    const int R = 1 + int(rng() % (trial % 3 == 0 ? 300 : 20));
    c.heads = 1 + int(rng() % 20);
    c.max_qlen = 1 + int(rng() % 4);
    c.causal = rng() % 4 != 0;
    c.grid = 1 + int(rng() % (trial % 2 ? 264 : 1024));
    c.pair_keys = int(rng() % 3) * 32;
    c.min_keys = int(rng() % 3) * 256;
    c.nosplit_keys = int(rng() % 3) * 512;
    for (int r = 0; r < R; ++r) {
      const int kind = int(rng() % 10);
      c.seq.push_back(kind == 0 ? 0 : kind == 1 ? 1 + int(rng() % 3) * 32 - int(rng() % 2)
                      : kind == 2 ? 20000 + int(rng() % 50000) : int(rng() % 3000));
      c.qlen.push_back(kind == 3 ? 0 : 1 + int(rng() % c.max_qlen));
    }
    // Request order; pass order asked for (mostly mixed row tile counts: request order
    // again); and pass order on the same lengths with every request's query at the longest
    // (one row tile count for all requests with rows, so the pass order runs).
    HostSchedCase uniform = c;
    for (int32_t& q : uniform.qlen) q = q > 0 ? c.max_qlen : 0;
    for (int variant = 0; variant < 3; ++variant) {
      if (variant == 2) c = uniform;
      c.pass_major = variant > 0;
      SCOPED_TRACE(::testing::Message() << "trial " << trial << ": " << R << " requests, "
                                        << c.heads << " heads, grid " << c.grid
                                        << (variant == 0   ? ", request order"
                                            : variant == 1 ? ", pass order asked"
                                                           : ", pass order, uniform queries"));
      const int rows = trial % 4 == 3 ? 64 : trial % 4 == 2 ? 16 : 32;
      const DecodeArgs a = host_sched_args(c, rows);
      // The default sections (kLockstepAll), and every other trial the other rules: mixed
      // batches only, interleaved or on runs of CTAs, and none (the device's own order).
      const int lockstep = trial % 2 ? kLockstepAll : (variant + trial / 2) % 3;
      int sections = 0;
      if (rows == 64) {
        check_host_schedule<64, 64>(c, lockstep);  // the wgmma kernel's tiles
        sections = table_head(host_walk_table<64, 64>(a, c.grid, lockstep)).sections;
      } else if (rows == 16) {
        check_host_schedule<16, 32>(c, lockstep);
        sections = table_head(host_walk_table<16, 32>(a, c.grid, lockstep)).sections;
      } else {
        check_host_schedule<32, 32>(c, lockstep);
        sections = table_head(host_walk_table<32, 32>(a, c.grid, lockstep)).sections;
      }
      if (host_pass_order(a, rows)) ++pass_walks;
      if (sections > 0) ++section_walks;
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GE(pass_walks, 50) << "too few trials ran the walk in pass order";
  EXPECT_GE(section_walks, 50) << "too few trials made lockstep sections";
}

// The balanced plan's worker count: a multiple of the requests when that idles at most 1/32
// of the slots (both sides of the limit), else every slot; and a uniform batch on the
// aligned count gives every worker exactly one whole piece.
TEST(DecodeSched, WorkersAlignToTheRequests) {
  EXPECT_EQ(decode_balanced_workers(264, 128), 256);  // 8 idle <= 8.25
  EXPECT_EQ(decode_balanced_workers(264, 32), 256);
  EXPECT_EQ(decode_balanced_workers(264, 4), 264);    // 66 each already
  EXPECT_EQ(decode_balanced_workers(264, 100), 264);  // 200 would idle 64
  EXPECT_EQ(decode_balanced_workers(264, 131), 262);  // 2 idle
  EXPECT_EQ(decode_balanced_workers(264, 85), 264);   // 255 would idle 9 > 8.25
  EXPECT_EQ(decode_balanced_workers(396, 128), 384);  // 12 idle <= 12.375
  EXPECT_EQ(decode_balanced_workers(132, 64), 128);   // 4 idle <= 4.125
  EXPECT_EQ(decode_balanced_workers(132, 65), 130);
  EXPECT_EQ(decode_balanced_workers(128, 33), 128);   // 99 would idle 29
  EXPECT_EQ(decode_balanced_workers(264, 265), 264);  // more requests than slots
  EXPECT_EQ(decode_balanced_workers(264, 0), 264);
  HostSchedCase c;
  c.heads = 16;
  c.seq.assign(128, 4096);
  c.qlen.assign(128, 1);
  c.grid = int(decode_balanced_workers(264, 128));
  check_host_schedule<16, 32>(c);
  const DecodeArgs a = host_sched_args(c, 16);
  const SchedUnits u = sched_units(a, 32);
  const std::vector<int64_t> off = request_offsets<16, 32>(a, u);
  const int workers = host_workers(a, 16, off[128], c.grid, u);
  ASSERT_EQ(workers, 256);
  // Every request in two halves: 256 pieces of cut pairs, which the fused merge joins after
  // its grid barrier.
  EXPECT_EQ(table_cut_pieces(host_walk_table<16, 32>(a, c.grid)), 256);
  for (int w = 0; w < workers; ++w) {
    int pieces = 0;
    walk_worker<16, 32>(a, u, w, workers, off[128], off, false, [&](const DecodeWork& piece) {
      ++pieces;
      EXPECT_EQ(piece.r, w / 2) << "worker " << w;
      EXPECT_EQ(piece.key1 - piece.key0, 2048) << "worker " << w;
    });
    EXPECT_EQ(pieces, 1) << "worker " << w;
  }
}

// Short requests: the shares would fall below sched_min_keys, but the worker count stays at
// least the live pair count, so a batch of short pairs (never cut) runs at most one pair per
// worker instead of two or three in a row on a third of the workers (128 x 64 keys: 48
// workers before).
// Uniform batches of 16 / 64-row tiles, lengths from one key to just under the never-cut
// limit, some just off a tile end; and a batch with padded slots (no query rows), whose pairs
// are not counted.
TEST(DecodeSched, ShortRequestsGetAWorkerEach) {
  for (const int seq : {1, 31, 33, 64, 100, 255, 257, 480}) {
    for (const int q : {1, 4}) {
      SCOPED_TRACE(::testing::Message()
                   << "128 requests x 12 heads x " << q << " tokens, " << seq << " keys");
      HostSchedCase c;
      c.heads = 12;
      c.max_qlen = q;
      c.grid = q == 1 ? 256 : 128;
      c.seq.assign(128, seq + q);
      c.qlen.assign(128, q);
      for (int r = 5; r < 128; r += 9) c.qlen[size_t(r)] = 0;  // padded slots
      const int live = int(std::count(c.qlen.begin(), c.qlen.end(), q));
      auto check = [&]<int ROWS, int KEY_TILE>() {
        check_host_schedule<ROWS, KEY_TILE>(c);
        const DecodeArgs a = host_sched_args(c, ROWS);
        const SchedUnits u = sched_units(a, KEY_TILE);
        const std::vector<int64_t> off = request_offsets<ROWS, KEY_TILE>(a, u);
        const int workers = host_workers(a, ROWS, off.back(), c.grid, u);
        EXPECT_GE(workers, live);
        std::vector<int> runs(size_t(c.seq.size()), 0);
        for (int w = 0; w < workers; ++w) {
          int pieces = 0;
          walk_worker<ROWS, KEY_TILE>(a, u, w, workers, off.back(), off, false,
                                      [&](const DecodeWork& p) {
                                        ++pieces;
                                        ++runs[size_t(p.r)];
                                        EXPECT_TRUE(p.direct) << "worker " << w;
                                      });
          EXPECT_LE(pieces, 1) << "worker " << w;
        }
        for (size_t r = 0; r < runs.size(); ++r) EXPECT_EQ(runs[r], c.qlen[r] > 0 ? 1 : 0);
        // Nothing cut: the fused merge skips its grid barrier.
        EXPECT_EQ(table_cut_pieces(host_walk_table<ROWS, KEY_TILE>(a, c.grid)), 0);
      };
      if (q == 1)
        check.template operator()<16, 32>();
      else
        check.template operator()<64, 64>();
    }
  }
}

// Small uniform batches whose shares the minimum share limits (256 keys: 4 tiles of the 64-row
// kernel) on a 132-CTA grid: the worker count is a multiple of the pairs, so every worker of
// the walk table runs one piece of one pair, all of them of the same tiles. Before,
// 2 x 128 heads x 4K keys took 65 workers (one ran two pieces), 4 x 12 heads x 8K x 4 tokens
// 129 (two ran two). Rounding stops where it would idle more than 1/8 of the workers, and the
// grid's own count is never rounded (decode_balanced_workers aligns it to the requests).
TEST(DecodeSched, SmallUniformBatchesGiveEachWorkerOnePiece) {
  struct Shape {
    int requests, heads, qlen, seq;
  };
  for (const Shape s : {Shape{2, 128, 1, 4096}, Shape{4, 128, 1, 4096}, Shape{4, 12, 4, 8192},
                        Shape{4, 64, 1, 8192}, Shape{3, 8, 8, 8192}, Shape{5, 16, 4, 2000}}) {
    SCOPED_TRACE(::testing::Message() << s.requests << " x " << s.heads << " heads x " << s.qlen
                                      << " tokens, " << s.seq << " keys");
    HostSchedCase c = pass_order_case(s.requests, s.heads, s.qlen);
    c.seq.assign(size_t(s.requests), s.seq);
    check_host_schedule<64, 64>(c);
    const DecodeArgs a = host_sched_args(c, 64);
    const SchedUnits u = sched_units(a, 64);
    const int pairs = s.requests * a.row_tiles;
    const std::vector<std::byte> walk = host_walk_table<64, 64>(a, c.grid);
    const int workers = table_head(walk).workers;
    EXPECT_LT(workers, c.grid);
    EXPECT_EQ(workers % pairs, 0) << workers << " workers";
    int fewest = std::numeric_limits<int>::max(), most = 0;
    for (int b = 0; b < c.grid; ++b) {
      WalkState st;
      if (!table_walk(walk.data(), c.grid, b, u, st)) continue;
      int pieces = 0;
      DecodeWork p;
      while (next_piece<64, 64>(a, st, false, p)) {
        ++pieces;
        const int tiles = (p.key1 - p.key0 + 63) / 64;
        fewest = std::min(fewest, tiles);
        most = std::max(most, tiles);
      }
      EXPECT_EQ(pieces, 1) << "CTA " << b;
    }
    EXPECT_EQ(most, fewest);
  }
  // 16-row tiles at one-tile shares: 8 x 4K keys on 128 workers, 129 units a pair, in 16
  // pieces of 8 tiles each (the rounded ends gave 7 to 9).
  HostSchedCase c;
  c.heads = 12;
  c.grid = 128;
  c.min_keys = 32;
  c.seq.assign(8, 4096);
  c.qlen.assign(8, 1);
  check_host_schedule<16, 32>(c);
  const DecodeArgs a = host_sched_args(c, 16);
  const SchedUnits u = sched_units(a, 32);
  const std::vector<std::byte> walk = host_walk_table<16, 32>(a, c.grid);
  ASSERT_EQ(table_head(walk).workers, 128);
  for (int b = 0; b < c.grid; ++b) {
    WalkState st;
    ASSERT_TRUE(table_walk(walk.data(), c.grid, b, u, st));
    DecodeWork p;
    ASSERT_TRUE((next_piece<16, 32>(a, st, false, p)));
    EXPECT_EQ(p.key1 - p.key0, 256) << "CTA " << b;
    EXPECT_FALSE((next_piece<16, 32>(a, st, false, p))) << "CTA " << b;
  }
  EXPECT_EQ(balanced_workers(260, 4, 132, 4), 64);     // 65 -> 64
  EXPECT_EQ(balanced_workers(516, 4, 132, 4), 128);    // 129 -> 128
  EXPECT_EQ(balanced_workers(280, 40, 132, 4), 70);    // 40 would idle 30 of 70
  EXPECT_EQ(balanced_workers(100, 100, 132, 4), 100);  // one per pair
  EXPECT_EQ(balanced_workers(2000, 5, 132, 4), 132);   // the grid's count
}

// The mixed-length bench batch (lengths 4096..12288, mean 8192, as src/bench/cases.cpp's
// mixed_lengths) on 264 workers: no worker above 1.1x the mean share, where the
// per-request grid's longest CTA is ~1.5x (a request of 12288 keys in 2 splits against a
// mean of 4096 per CTA).
TEST(DecodeSched, MixedBenchBatchIsBalanced) {
  HostSchedCase c;
  c.heads = 12;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 128; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c.seq.push_back(std::max<int32_t>(1, int32_t(4096 + int64_t(x % 8193))));
    c.qlen.push_back(1);
  }
  check_host_schedule<16, 32>(c);
  const DecodeArgs a = host_sched_args(c, 16);
  const SchedUnits u = sched_units(a, 32);
  const std::vector<int64_t> off = request_offsets<16, 32>(a, u);
  const int64_t total = off[128];
  const int workers = host_workers(a, 16, total, 264, u);
  EXPECT_EQ(workers, 264);
  int64_t most = 0, sum = 0;
  for (int w = 0; w < workers; ++w) {
    int64_t tiles = 0;
    walk_worker<16, 32>(a, u, w, workers, total, off, false, [&](const DecodeWork& p) {
      tiles += (p.key1 - p.key0 + 31) / 32 + u.pair;  // each piece pays a start-up
    });
    most = std::max(most, tiles);
    sum += tiles;
  }
  EXPECT_LE(double(most), 1.1 * double(sum) / workers);
}

// Pass order on uniform batches of two or three 64-row tiles per request, with the worker
// count a multiple of the tiles (132 on H200: 128 heads x 1 token, 64 heads x 2 causal, 64 x 3):
// worker w + k W / tiles walks exactly worker w's pieces (same request, same keys) on row
// tile k, so the CTAs that read a key tile for the request's row tiles run at the same time.
// Request order puts the second row tile a pair later instead: on the same worker 65 tiles
// on, or on the next worker a few tiles apart. With one token per request the passes cost
// the same whatever the lengths, so mixed lengths (4096..12288) line up too. A batch whose
// requests have different row tile counts keeps request order.
struct WalkPiece {
  int r, row0, key0, key1;
};

TEST(DecodeSched, PassOrderPutsRowTilesInStep) {
  struct Shape {
    int requests, heads, qlen, seq;
    bool mixed_lengths = false;
  };
  for (const Shape& sh :
       {Shape{64, 128, 1, 8192}, Shape{128, 128, 1, 4096}, Shape{16, 128, 1, 4096},
        Shape{64, 64, 2, 8192}, Shape{8, 64, 3, 3000}, Shape{128, 128, 1, 8192, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << sh.requests << " x " << sh.heads << " heads x " << sh.qlen << " tokens, "
                 << sh.seq << " keys" << (sh.mixed_lengths ? " on average" : ""));
    HostSchedCase c = pass_order_case(sh.requests, sh.heads, sh.qlen);
    std::mt19937 rng(7);
    for (int r = 0; r < sh.requests; ++r)
      c.seq.push_back(sh.mixed_lengths ? sh.seq / 2 + int(rng() % uint32_t(sh.seq)) : sh.seq);
    check_host_schedule<64, 64>(c);
    check_host_schedule<64, 64>(c, kLockstepOff);
    const DecodeArgs a = host_sched_args(c, 64);
    ASSERT_TRUE(host_pass_order(a, 64));
    // The walk table runs the passes as lockstep sections on interleaved CTAs instead (the
    // device's own walk above is what a launch without a table gets).
    EXPECT_EQ(table_head(host_walk_table<64, 64>(a, c.grid)).sections, a.row_tiles);
    const SchedUnits u = sched_units(a, 64);
    const std::vector<int64_t> off = request_offsets<64, 64>(a, u);
    const int64_t total = off.back();
    const int workers = host_workers(a, 64, total, c.grid, u);
    ASSERT_EQ(workers % a.row_tiles, 0);
    const int group = workers / a.row_tiles;
    std::vector<std::vector<WalkPiece>> walks(static_cast<size_t>(workers));
    for (int w = 0; w < workers; ++w)
      walk_worker<64, 64>(a, u, w, workers, total, off, false, [&](const DecodeWork& p) {
        walks[size_t(w)].push_back({p.r, p.row0, p.key0, p.key1});
      });
    for (int w = 0; w < group; ++w) {
      ASSERT_FALSE(walks[size_t(w)].empty()) << "worker " << w;
      for (int t = 1; t < a.row_tiles; ++t) {
        const auto& lead = walks[size_t(w)];
        const auto& mate = walks[size_t(w + t * group)];
        ASSERT_EQ(mate.size(), lead.size()) << "workers " << w << " and " << w + t * group;
        for (size_t i = 0; i < lead.size(); ++i) {
          EXPECT_EQ(lead[i].row0, 0);
          EXPECT_EQ(mate[i].row0, 64 * t);
          EXPECT_EQ(mate[i].r, lead[i].r) << "worker " << w << " piece " << i;
          EXPECT_EQ(mate[i].key0, lead[i].key0) << "worker " << w << " piece " << i;
          // Causal rows of a later token see one key more: at most one tile apart.
          EXPECT_LE(std::abs(mate[i].key1 - lead[i].key1), 64) << "worker " << w << " piece " << i;
        }
      }
    }
  }
  // One request of three tokens among one-token ones (64 heads: 3 row tiles against 1): the
  // passes would hold mostly empty pairs, so the walk stays in request order.
  HostSchedCase c;
  c.heads = 64;
  c.max_qlen = 3;
  c.pass_major = true;
  c.grid = 132;
  c.seq.assign(40, 2000);
  c.qlen.assign(40, 1);
  c.qlen[7] = 3;
  const DecodeArgs a = host_sched_args(c, 64);
  EXPECT_FALSE(host_pass_order(a, 64));
  check_host_schedule<64, 64>(c);
}

// The walk table's lockstep sections on the mixed-query bench batch (128 requests x 12 heads,
// lengths 4096..12288 and 2..6 tokens as src/bench/cases.cpp's mixed_lengths, 64-row tiles
// on 128 workers): the 72-row requests (6 tokens) get two passes of m workers each, and
// worker w0 + m + j walks worker w0 + j's pieces on row tile 1 (same request, same keys), so
// the second read of a key tile comes from L2; no share exceeds 17/16 of the mean. The same
// batch without sections (pass order off, or the device's own walk) keeps request order,
// where a request's second row tile lands on another worker at another time.
TEST(DecodeSched, LockstepSectionsForMixedQueries) {
  HostSchedCase c;
  c.heads = 12;
  c.max_qlen = 6;
  c.grid = 128;
  c.pass_major = true;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto next = [&](int mean) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return std::max<int32_t>(1, int32_t(mean / 2 + int64_t(x % uint64_t(mean + 1))));
  };
  for (int i = 0; i < 128; ++i) c.seq.push_back(next(8192));
  x = 0x9e3779b97f4a7c15ull;  // each list from the seed, as the bench makes them
  for (int i = 0; i < 128; ++i) c.qlen.push_back(next(4));
  check_host_schedule<64, 64>(c);
  const DecodeArgs a = host_sched_args(c, 64);
  const SchedUnits u = sched_units(a, 64);
  const std::vector<std::byte> walk = host_walk_table<64, 64>(a, c.grid);
  const WalkTableHead& head = table_head(walk);
  ASSERT_EQ(head.sections, 3);  // two passes of the 6-token requests, then the rest
  // By worker id (the CTA running worker w is cta[w]).
  std::vector<std::vector<WalkPiece>> walks(size_t(c.grid));
  std::vector<WalkState> starts(size_t(c.grid));
  std::vector<int> cta(size_t(c.grid), -1);
  int64_t most = 0;
  for (int b = 0; b < c.grid; ++b) {
    WalkState st;
    if (!table_walk(walk.data(), c.grid, b, u, st)) continue;
    const int w = st.worker;
    starts[size_t(w)] = st;
    cta[size_t(w)] = b;
    most = std::max(most, st.hi - st.lo);
    WalkState cur = st;
    DecodeWork p;
    while (next_piece<64, 64>(a, cur, false, p))
      walks[size_t(w)].push_back({p.r, p.row0, p.key0, p.key1});
  }
  EXPECT_LE(16 * most * head.workers, 17 * head.total);
  const WalkState& lead0 = starts[0];
  ASSERT_EQ(lead0.mode, kWalkPass);
  const int m = lead0.workers;
  EXPECT_GE(m, 16);  // ~26 of the 128 requests have 6 tokens
  int two_tile = 0;
  for (int i = 0; i < 128; ++i) two_tile += c.qlen[size_t(i)] * 12 > 64;
  int paired = 0;
  for (int j = 0; j < m; ++j) {
    const auto& lead = walks[size_t(j)];
    const auto& mate = walks[size_t(m + j)];
    EXPECT_EQ(starts[size_t(m + j)].w0, m);
    EXPECT_EQ(cta[size_t(j)], 2 * j);  // the two passes on neighbouring CTAs
    EXPECT_EQ(cta[size_t(m + j)], 2 * j + 1);
    ASSERT_EQ(mate.size(), lead.size()) << "workers " << j << " and " << m + j;
    for (size_t i = 0; i < lead.size(); ++i) {
      EXPECT_EQ(lead[i].row0, 0);
      EXPECT_EQ(mate[i].row0, 64);
      EXPECT_EQ(mate[i].r, lead[i].r);
      EXPECT_EQ(c.qlen[size_t(lead[i].r)], 6);
      EXPECT_EQ(mate[i].key0, lead[i].key0);
      EXPECT_EQ(mate[i].key1, lead[i].key1);  // both tiles end on the last token's keys
      paired += lead[i].key0 == 0;
    }
  }
  EXPECT_EQ(paired, two_tile) << "every 6-token request starts in both passes";
  for (int w = 2 * m; w < head.workers; ++w) {
    EXPECT_EQ(starts[size_t(w)].mode, kWalkRequests);
    for (const WalkPiece& p : walks[size_t(w)]) EXPECT_LT(c.qlen[size_t(p.r)], 6);
  }
  // Passes on runs of CTAs: worker w on CTA w.
  const std::vector<std::byte> runs = host_walk_table<64, 64>(a, c.grid, kLockstepMixedRuns);
  for (int b = 0; b < head.workers; ++b) {
    WalkState st;
    ASSERT_TRUE(table_walk(runs.data(), c.grid, b, u, st));
    EXPECT_EQ(st.worker, b);
  }
  check_host_schedule<64, 64>(c, kLockstepMixedRuns);
  c.pass_major = false;  // request order asked: no sections
  EXPECT_EQ(table_head(host_walk_table<64, 64>(host_sched_args(c, 64), c.grid)).sections, 0);
  check_host_schedule<64, 64>(c);
}

// ---- batch invariance ------------------------------------------------------------------
// A target request of fixed content (cache rows and query rows) runs alone and inside
// batches of random batchmates: more or fewer requests (around the GPU's CTA slots), longer
// and shorter sequences (the split heuristics' length limits), query lengths 1..4 (every
// row tile size of the default plan), a padded slot, the target anywhere in the batch. In
// batch-invariant mode its output and LSE must be bitwise those of the lone run. The same
// batches in the default mode must change them at least once (so the experiment can see a
// difference), and must have reached several split counts and every row tile size.
struct InvarianceWorld {
  CacheFormat format = CacheFormat::bf16;
  DType act = DType::bf16;
  int heads = 16;
  int block_size = 64;
  bool q_fp8 = false;
  int target_seq = 1500;  // > kInvariantMinKeys: several invariant splits
  int target_qlen = 1;
  int pool_blocks = 48;  // random blocks the batchmates read (shared between them)
};

struct Batchmates {
  int count = 0;
  int max_len = 0;   // lengths uniform in [0, max_len]
  int max_qlen = 1;  // query lengths uniform in [1, max_qlen]
  int long_len = 0;  // > 0: one batchmate has this many keys
};

struct TargetResult {
  std::vector<uint16_t> out;  // [target_qlen * heads * 512] act bits
  std::vector<float> lse;     // [target_qlen * heads]
  DecodePlan plan;
};

class InvarianceExperiment {
 public:
  InvarianceExperiment(const InvarianceWorld& w, uint64_t seed) : w_(w), rng_(seed) {
    const int bs = w.block_size;
    target_blocks_ = (w.target_seq + bs - 1) / bs;
    num_blocks_ = w.pool_blocks + target_blocks_;
    // The target's blocks are the last ids, in a random order.
    target_table_.resize(size_t(target_blocks_));
    std::iota(target_table_.begin(), target_table_.end(), w.pool_blocks);
    std::shuffle(target_table_.begin(), target_table_.end(), rng_);

    cache_ = LatentCache::allocate(w.format, bs, num_blocks_, w.format == CacheFormat::fp8 ? 0.5f : 1.0f);
    const CacheGeometry& g = cache_.geometry();
    const size_t bytes = size_t(g.block_stride) * size_t(num_blocks_);
    std::memset(cache_.base(), 0xFF, bytes);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::vector<float> row(kLatentDim);
    for (int64_t slot = 0; slot < int64_t(num_blocks_) * bs; ++slot) {
      const int block = int(slot / bs);
      // Slots past the target's length keep their 0xFF (NaN) bytes.
      if (block >= w.pool_blocks) {
        const int j = int(std::find(target_table_.begin(), target_table_.end(), block) -
                          target_table_.begin());
        if (int64_t(j) * bs + slot % bs >= w.target_seq) continue;
      }
      for (float& x : row) x = uni(rng_);
      cache_.write_row(slot, row.data());
    }
    d_cache_ = std::make_unique<DevBuf<uint8_t>>(bytes);
    EXPECT_EQ(cudaMemcpy(d_cache_->ptr, cache_.base(), bytes, cudaMemcpyHostToDevice), cudaSuccess);

    // Query rows: the target's, and a pool the batchmates draw from.
    target_q_ = random_rows(w.target_qlen);
    pool_q_ = random_rows(kPoolRows);
  }

  TargetResult run(const Batchmates& m, bool invariant, uint64_t batch_seed) {
    std::mt19937_64 rng(batch_seed);  // the same batch in both modes
    const int H = w_.heads, bs = w_.block_size;
    // Slots in batch order: the batchmates, a padded slot (query_len 0) after the first of
    // them, and the target at a random place.
    enum Slot { kMate, kPad, kTarget };
    std::vector<Slot> slots(size_t(m.count), kMate);
    if (m.count >= 2) slots.insert(slots.begin() + 1, kPad);
    slots.insert(slots.begin() + ptrdiff_t(rng() % (slots.size() + 1)), kTarget);
    const int R = int(slots.size());
    int target = 0;
    std::vector<int> seq(R), qlen(R);
    std::vector<std::vector<int32_t>> tables(R);
    for (int r = 0, mate = 0; r < R; ++r) {
      if (slots[r] == kPad) {
        seq[r] = 77;  // a padded slot with a length: must be ignored
        qlen[r] = 0;
      } else if (slots[r] == kTarget) {
        target = r;
        seq[r] = w_.target_seq;
        qlen[r] = w_.target_qlen;
        tables[r] = target_table_;
      } else {
        seq[r] = mate++ == 0 && m.long_len > 0 ? m.long_len : int(rng() % uint64_t(m.max_len + 1));
        qlen[r] = 1 + int(rng() % uint64_t(m.max_qlen));
        for (int b = 0; b < (seq[r] + bs - 1) / bs; ++b)
          tables[r].push_back(int32_t(rng() % uint64_t(w_.pool_blocks)));
      }
    }
    int max_blocks = 1, max_qlen = 1, max_seq = 0, rows = 0;
    std::vector<int32_t> start(R + 1);
    for (int r = 0; r < R; ++r) {
      max_blocks = std::max(max_blocks, int(tables[r].size()));
      max_qlen = std::max(max_qlen, qlen[r]);
      max_seq = std::max(max_seq, seq[r]);
      start[r] = rows;
      rows += qlen[r];
    }
    start[R] = rows;
    std::vector<int32_t> table(size_t(R) * max_blocks);
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < max_blocks; ++b)
        table[size_t(r) * max_blocks + b] =
            b < int(tables[r].size()) ? tables[r][b] : int32_t(-1000 - b);  // garbage
    const size_t row_bytes = size_t(H) * kLatentDim * q_elem();
    std::vector<uint8_t> q(size_t(rows) * row_bytes);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < qlen[r]; ++i) {
        const uint8_t* src = r == target ? &target_q_[size_t(i) * row_bytes]
                                         : &pool_q_[size_t(rng() % kPoolRows) * row_bytes];
        std::memcpy(&q[size_t(start[r] + i) * row_bytes], src, row_bytes);
      }

    DevBuf<uint8_t> d_q(q);
    DevBuf<int32_t> d_table(table), d_seq(std::vector<int32_t>(seq.begin(), seq.end())),
        d_qlen(std::vector<int32_t>(qlen.begin(), qlen.end())), d_start(start);
    DevBuf<uint16_t> d_out(size_t(rows) * H * kKvLoraRank);
    DevBuf<float> d_lse(size_t(rows) * H);
    DevBuf<int> d_flag(1);
    d_out.fill_bytes(0xFF);
    d_lse.fill_bytes(0xFF);
    d_flag.fill_bytes(0);
    DecodeParams p;
    p.q = d_q.ptr;
    p.q_fp8 = w_.q_fp8;
    p.q_scale = 0.25f;
    const CacheGeometry& g = cache_.geometry();
    p.cache.base = reinterpret_cast<std::byte*>(d_cache_->ptr);
    p.cache.block_stride = g.block_stride;
    p.cache.block_size = bs;
    p.cache.num_blocks = num_blocks_;
    p.cache.format = w_.format;
    p.cache.k_scale = cache_.k_scale();
    p.batch.block_tables = d_table.ptr;
    p.batch.seq_lens = d_seq.ptr;
    p.batch.query_lens = d_qlen.ptr;
    p.batch.query_start = d_start.ptr;
    p.batch.num_requests = R;
    p.batch.max_blocks = max_blocks;
    p.batch.num_rows = rows;
    p.heads = H;
    p.causal = true;
    p.softmax_scale = 1.0f / std::sqrt(192.0f);
    p.act = w_.act;
    p.out = d_out.ptr;
    p.lse = d_lse.ptr;
    p.error_flag = d_flag.ptr;
    TargetResult res;
    res.plan = plan_decode(R, H, max_qlen, max_seq, false, invariant);
    EXPECT_EQ(res.plan.batch_invariant, invariant);
    DevBuf<uint8_t> d_ws(std::max<size_t>(res.plan.workspace_bytes, 1));
    d_ws.fill_bytes(0xFF);
    decode_attention(p, res.plan, d_ws.ptr, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d_flag.download()[0], 0);
    const size_t n = size_t(w_.target_qlen) * H;
    res.out.resize(n * kKvLoraRank);
    res.lse.resize(n);
    EXPECT_EQ(cudaMemcpy(res.out.data(), d_out.ptr + size_t(start[target]) * H * kKvLoraRank,
                         res.out.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(res.lse.data(), d_lse.ptr + size_t(start[target]) * H, n * 4,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return res;
  }

 private:
  static constexpr int kPoolRows = 61;
  size_t q_elem() const { return w_.q_fp8 ? 1 : 2; }
  std::vector<uint8_t> random_rows(int n) {
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    const size_t elems = size_t(n) * w_.heads * kLatentDim;
    std::vector<uint8_t> q(elems * q_elem());
    for (size_t k = 0; k < elems; ++k) {
      if (w_.q_fp8) {
        q[k] = float_to_e4m3_sat(4.0f * uni(rng_));
      } else {
        const float x = uni(rng_);
        const uint16_t v = w_.act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
        std::memcpy(&q[2 * k], &v, 2);
      }
    }
    return q;
  }

  InvarianceWorld w_;
  std::mt19937_64 rng_;
  int target_blocks_ = 0, num_blocks_ = 0;
  std::vector<int32_t> target_table_;
  LatentCache cache_;
  std::unique_ptr<DevBuf<uint8_t>> d_cache_;
  std::vector<uint8_t> target_q_, pool_q_;
};

bool same_bits(const TargetResult& a, const TargetResult& b) {
  return a.out == b.out && a.lse.size() == b.lse.size() &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

// Batchmate mixes. On an H200 (132 SMs x 2 CTA slots of 16 rows) the counts straddle the
// slot count (263 / 264 / 265 requests with the target) and the lengths straddle the
// 256-key split minimum and the 512-key invariant split size; one long batchmate makes
// the invariant grid wider than the target needs (empty splits, LSE -inf).
const std::vector<Batchmates> kBatchmates = {
    {1, 100, 1, 0},    {1, 3000, 4, 20000}, {2, 700, 2, 0},    {5, 3000, 3, 0},
    {17, 255, 1, 0},   {40, 5000, 4, 8000}, {131, 600, 2, 0},  {262, 300, 1, 0},
    {263, 300, 1, 0},  {264, 300, 1, 0},    {400, 1000, 1, 0}, {60, 513, 2, 0},
};

void check_batch_invariance(const InvarianceWorld& w, uint64_t seed, bool every_tiling,
                            const std::vector<Batchmates>& batches = kBatchmates) {
  InvarianceExperiment x(w, seed);
  const TargetResult alone_inv = x.run({}, true, seed), alone_def = x.run({}, false, seed);
  EXPECT_EQ(alone_inv.plan.rows_per_cta, w.heads <= 16 ? 16 : w.heads <= 32 ? 32 : 64);
  int default_differs = 0;
  std::vector<int> splits_seen, rows_seen;
  for (size_t i = 0; i < batches.size(); ++i) {
    const Batchmates& m = batches[i];
    SCOPED_TRACE(::testing::Message() << "batchmates " << m.count << " (len <= " << m.max_len
                                      << ", qlen <= " << m.max_qlen << ", long " << m.long_len
                                      << ")");
    const TargetResult inv = x.run(m, true, seed + 1 + i), def = x.run(m, false, seed + 1 + i);
    EXPECT_TRUE(same_bits(inv, alone_inv))
        << "batch-invariant output changed with the batch (grid splits " << inv.plan.num_splits
        << " vs " << alone_inv.plan.num_splits << " alone)";
    EXPECT_EQ(inv.plan.rows_per_cta, alone_inv.plan.rows_per_cta);
    default_differs += !same_bits(def, alone_def);
    splits_seen.push_back(def.plan.num_splits);
    rows_seen.push_back(def.plan.rows_per_cta);
  }
  // The experiment can fail: the default mode's splits follow the batch, and so do its bits.
  EXPECT_GT(default_differs, 0) << "the default mode never differed: the test sees nothing";
  std::sort(splits_seen.begin(), splits_seen.end());
  splits_seen.erase(std::unique(splits_seen.begin(), splits_seen.end()), splits_seen.end());
  EXPECT_GE(splits_seen.size(), 3u) << "the batches reached too few default split counts";
  if (every_tiling) {
    std::sort(rows_seen.begin(), rows_seen.end());
    rows_seen.erase(std::unique(rows_seen.begin(), rows_seen.end()), rows_seen.end());
    // The tiles the default plans pick for 16, 32 and 64 rows of this format (on sm_90 a
    // 16-bit cache's 32 rows take the 64-row tile, an fp8 format's two 16-row ones).
    std::vector<int> tiles;
    for (const int q : {1, 2, 4})
      tiles.push_back(plan_decode(2, 16, q, 1000, false, false, w.format).rows_per_cta);
    std::sort(tiles.begin(), tiles.end());
    tiles.erase(std::unique(tiles.begin(), tiles.end()), tiles.end());
    EXPECT_EQ(rows_seen, tiles) << "not every default row tile was used";
  }
}

TEST(CudaDecodeInvariant, Bf16OneTokenTarget) {
  KMLA_REQUIRE_GPU();
  InvarianceWorld w;
  check_batch_invariance(w, 21, true);
}

// Three causal query tokens of 12 heads: 36 rows in three 16-row tiles that straddle tokens,
// each tile with its own key range; fp8_ds_mla goes through the raw-tile conversion.
TEST(CudaDecodeInvariant, DsMlaMultiTokenTarget) {
  KMLA_REQUIRE_GPU();
  InvarianceWorld w;
  w.format = CacheFormat::fp8_ds_mla;
  w.heads = 12;
  w.block_size = 16;
  w.target_seq = 2100;
  w.target_qlen = 3;
  check_batch_invariance(w, 22, false);
}

// Plain fp8 cache with fp8 queries, a long target (many invariant splits: the combine's
// lanes and the 64-row tile of 128 heads' tiling).
TEST(CudaDecodeInvariant, Fp8LongTarget128Heads) {
  KMLA_REQUIRE_GPU();
  InvarianceWorld w;
  w.format = CacheFormat::fp8;
  w.q_fp8 = true;
  w.heads = 128;
  w.block_size = 256;
  w.target_seq = 9000;
  w.pool_blocks = 8;
  // Fewer and smaller batches: 128 heads make every row's workspace 128 x larger. 66
  // requests of two 64-row tiles fill 132 SMs of one 64-row CTA each.
  check_batch_invariance(w, 23, false,
                         {{1, 100, 1, 0}, {1, 3000, 2, 20000}, {5, 3000, 2, 0},
                          {64, 300, 1, 0}, {65, 300, 1, 0}, {66, 300, 1, 0}, {20, 600, 2, 0}});
}

// Invariant mode is still exact: the reference comparisons of run_case, including plans
// whose grid has fewer splits than a request's length asks for (the fallback spreads its
// keys over the grid) and far more (empty splits), and forced row tiles.
TEST(CudaDecodeInvariant, MatchesReference) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.batch_invariant = true;
  c.heads = 4;
  c.block_size = 256;
  c.seq_lens = {1, 63, 0, 257, 4097, 40000, 100000};
  c.query_lens = {1, 2, 0, 1, 3, 1, 1};
  c.seed = 31;
  run_case(c, {{0, 0}, {1, 0}, {3, 0}, {1024, 0}, {0, 64}});
  c.format = CacheFormat::fp8_ds_mla;
  c.act = DType::f16;
  c.heads = 16;
  c.block_size = 64;
  c.seq_lens = {65, 1, 0, 1000, 3000};
  c.query_lens = {1, 4, 0, 2, 2};
  c.seed = 32;
  run_case(c, {{0, 0}, {2, 0}, {0, 32}});
  c.format = CacheFormat::fp8;
  c.act = DType::bf16;
  c.q_fp8 = true;
  c.q_scale = 0.5f;
  c.k_scale = 2.0f;
  c.causal = false;
  c.seed = 33;
  run_case(c, {{0, 0}});
}

TEST(CudaDecodeInvariant, PlanDependsOnHeadsAndLengthOnly) {
  KMLA_REQUIRE_GPU();
  // Row tile from the heads alone; the grid splits cover the longest sequence in 512-key
  // parts (capped at 1024); the workspace exists even for one split (the combine runs).
  const DecodePlan one = plan_decode(3, 16, 4, 100, false, true);
  EXPECT_TRUE(one.batch_invariant);
  EXPECT_EQ(one.rows_per_cta, 16);
  EXPECT_EQ(one.num_splits, 1);
  EXPECT_GE(one.workspace_bytes, size_t(3) * 4 * 16 * 513 * sizeof(float));
  EXPECT_EQ(plan_decode(300, 16, 1, 4096, false, true).num_splits, 8);
  EXPECT_EQ(plan_decode(1, 16, 1, 4096, false, true).num_splits, 8);
  EXPECT_EQ(plan_decode(1, 16, 1, 4097, false, true).num_splits, 9);
  EXPECT_EQ(plan_decode(1, 12, 1, int64_t(1) << 20, false, true).num_splits, 1024);
  EXPECT_EQ(plan_decode(1, 12, 1, int64_t(1) << 24, false, true).num_splits, 1024);
  EXPECT_EQ(plan_decode(2, 128, 2, 100, false, true).rows_per_cta, 64);
  EXPECT_EQ(plan_decode(2, 20, 1, 100, false, true).rows_per_cta, 32);
}

// The fp8 formats' 16-row kernel reads the raw tiles straight into mma fragments (swizzled
// raw rows, a permuted depth order, the scales of two keys paired in one P V fragment):
// every block size, odd head counts, lengths around the 32-key tile and the 4-tile ring,
// several causal query tokens, 1 / several splits, and magnitudes that change per key and
// per 128-column group, so a fp8_ds_mla scale taken from the wrong key or group shows.
TEST(CudaDecode, Fp8FragmentPathShapes) {
  KMLA_REQUIRE_GPU();
  uint64_t seed = 200;
  for (CacheFormat format : {CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    for (int bs : {16, 64, 256}) {
      for (int heads : {1, 3, 12, 16}) {
        DecodeCase c;
        c.format = format;
        c.act = (heads + bs / 16) % 2 ? DType::f16 : DType::bf16;
        c.q_fp8 = format == CacheFormat::fp8 && heads < 12;
        c.q_scale = 0.5f;
        c.k_scale = 0.75f;  // plain fp8 only
        c.column_spread = 1.0f;
        c.heads = heads;
        c.block_size = bs;
        const int q = std::max(1, std::min(4, 16 / heads));  // q x heads <= 16: 16-row tiles
        c.seq_lens = {31, 32, 33, 0, 97, 128, 129, 1000};
        c.query_lens = {1, q, 1, 0, q, 1, q, q};
        c.seed = seed++;
        SCOPED_TRACE(::testing::Message() << cache_format_name(format) << ", block size " << bs
                                          << ", heads " << heads << ", act "
                                          << dtype_name(c.act));
        run_case(c, {{0, 0}, {1, 16}, {3, 16}, {7, 16}});
      }
    }
  }
}

// Sets (or, with nullptr, unsets) an environment variable for one scope (plan_decode reads
// KMLA_FP8_CTAS and the launch KMLA_FP8_DSFOLD at every call), restoring the old value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// The 16-row plans the fp8 fragment-path tests run at each CTA count per SM: the plan's own
// split, 3 per-request splits, and the balanced schedule over 300 workers.
std::vector<PlanTweak> fp8_cta_tweaks(const std::vector<int>& ctas_per_sm) {
  std::vector<PlanTweak> tweaks;
  for (int ctas : ctas_per_sm) {
    PlanTweak plan, split, balanced;
    plan.fp8_ctas = split.fp8_ctas = balanced.fp8_ctas = ctas;
    split.num_splits = 3;
    balanced.workers = 300;
    plan.rows_per_cta = split.rows_per_cta = balanced.rows_per_cta = 16;
    tweaks.insert(tweaks.end(), {plan, split, balanced});
  }
  return tweaks;
}

// Every fragment-path kernel under bf16 activations, on the same cases: plain fp8 (f16 mma),
// fp8_ds_mla at two and three CTAs per SM (DecodePlan::fp8_ctas_per_sm; three: 3 raw
// stages, P V converting its codes a second time from the raw tile), with its scales folded
// into S and P on f16 mma (the default for power-of-two scales) and not (KMLA_FP8_DSFOLD=0:
// the kernels amax-rule scales always take). Block sizes 16 / 64 / 256 with head counts
// rotating through 1, 3, 12, 16, lengths around the 32-key tile and the 3- and 4-tile rings,
// plain fp8 k_scale 2^-20 and 8, fp8_ds_mla tile scales up to 2^6 apart inside a row and
// between keys, and amax-rule scales (not powers of two: these must not be folded, the fold
// would round the keys differently), so a code pair
// in the wrong k-index, a stage of the smaller ring read too early, a scale on the wrong key
// or group (in S or in P), or a partial S from the wrong warp shows. The plans also go
// through the per-request splits and the balanced schedule with hundreds of workers, so a
// CTA runs several pieces back to back over the ring.
TEST(CudaDecode, Fp8FragmentPathVariants) {
  KMLA_REQUIRE_GPU();
  uint64_t seed = 400;
  for (const char* fold : {"1", "0"}) {
    ScopedEnv fold_env("KMLA_FP8_DSFOLD", fold);
    for (CacheFormat format : {CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
      if (fold[0] == '0' && format == CacheFormat::fp8) continue;  // fp8_ds_mla only
      for (int i = 0; i < 5; ++i) {
        const int bs = i >= 3 ? 64 : 16 << (2 * i);
        const int heads = i == 3 ? 12 : std::array<int, 4>{1, 3, 12, 16}[(i + int(format)) % 4];
        DecodeCase c;
        c.format = format;
        c.act = DType::bf16;
        c.q_fp8 = format == CacheFormat::fp8 && heads < 12;
        c.q_scale = 0.5f;
        // (larger scales would make the fp32 logits themselves too coarse for the reference)
        c.k_scale = bs == 16 ? 0.75f : bs == 64 ? std::ldexp(1.0f, -20) : 8.0f;
        c.column_spread = format == CacheFormat::fp8_ds_mla && bs != 16 ? 2.0f : 1.0f;
        if (i == 4) c.tile_rule = TileScaleRule::amax_448;
        c.heads = heads;
        c.block_size = bs;
        const int q = std::max(1, std::min(4, 16 / heads));
        c.seq_lens = {31, 32, 33, 0, 95, 96, 97, 128, 129, 160, 161, 1000};
        c.query_lens = {1, q, 1, 0, q, 1, q, 1, q, 1, q, q};
        c.seed = seed++;
        SCOPED_TRACE(::testing::Message()
                     << cache_format_name(format) << ", fold " << fold << ", block size " << bs
                     << ", heads " << heads << (i == 4 ? ", amax scales" : ""));
        // (plain fp8 has no 3-CTA kernel)
        run_case(c, fp8_cta_tweaks(format == CacheFormat::fp8 ? std::vector<int>{2}
                                                               : std::vector<int>{2, 3}));
      }
    }
  }
}

// fp8_ds_mla's folded kernels (f16 mma) where f16's range matters, and the unfolded ones
// (KMLA_FP8_DSFOLD=0) on the same data: tile scales replaced by 2^e, e uniform in [-20, 10] per
// key and group (the writer never goes below 2^-13), so inside one warp's group p * scale
// spans 30 binades and P' = bf16(p * scale) * 2^c meets both ends of f16 (2^15 at the top,
// subnormals and zero at the bottom, where the analysis in decode_fp8_tiles bounds the loss
// by 2^-25 of the row's largest p * scale: the harness's tolerance, 2 ulps of the row's
// largest |output|, is kept); only small scales ([-20, -10]: c must rise above 15); and large ones
// with the code part of q small, so that the logits stay where fp32 can hold the LSE to 1e-3
// (~10 and ~100). 12 and 16 heads, 2-token queries, lengths just off the 32-key tile and
// the blocks, two and three CTAs per SM, per-request splits and the balanced schedule.
TEST(CudaDecode, DsMlaF16WideScales) {
  KMLA_REQUIRE_GPU();
  struct Wide {
    int lo, hi;
    float q_code_amp;
    int heads, block_size, q;
  };
  const Wide wides[] = {{-20, 10, 0x1p-14f, 12, 64, 2},
                        {-20, 10, 0x1p-11f, 16, 16, 1},
                        {-20, -10, 1.0f, 12, 256, 1},
                        {0, 10, 0x1p-16f, 16, 64, 1}};
  uint64_t seed = 500;
  for (const char* fold : {"1", "0"}) {
    ScopedEnv fold_env("KMLA_FP8_DSFOLD", fold);
    for (const Wide& w : wides) {
      DecodeCase c;
      c.format = CacheFormat::fp8_ds_mla;
      c.act = DType::bf16;
      c.ds_scale_exp_lo = w.lo;
      c.ds_scale_exp_hi = w.hi;
      c.q_code_amp = w.q_code_amp;
      c.heads = w.heads;
      c.block_size = w.block_size;
      c.seq_lens = {31, 33, 0, 63, 65, 97, 255, 257, 1000, 2049};
      c.query_lens = {1, w.q, 0, w.q, 1, w.q, 1, w.q, w.q, 1};
      c.seed = seed++;
      SCOPED_TRACE(::testing::Message()
                   << "fold " << fold << ", scales 2^[" << w.lo << ", " << w.hi
                   << "], q code part x " << w.q_code_amp << ", heads " << w.heads);
      run_case(c, fp8_cta_tweaks({2, 3}));
    }
  }
}

// Plans made for fp8_ds_mla with 16-row tiles get three CTAs per SM (where they fit) and
// 1.5 times the balanced workers unless KMLA_FP8_CTAS=2; every other plan keeps two; bad
// values are errors.
TEST(CudaDecode, PlanFp8CtasPerSm) {
  KMLA_REQUIRE_GPU();
  int device = 0, smem_per_sm = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                   device),
            cudaSuccess);
  const bool fits = smem_per_sm >= 3 * (75872 + 1024);  // the 3-CTA fp8_ds_mla kernel
  const CacheFormat ds = CacheFormat::fp8_ds_mla;
  const DecodePlan ref = [&] {
    ScopedEnv two("KMLA_FP8_CTAS", "2");
    return plan_decode(128, 12, 1, 8192, false, false, ds);
  }();
  EXPECT_EQ(ref.fp8_ctas_per_sm, 2);
  ASSERT_EQ(ref.schedule, DecodeSchedule::balanced);
  for (const char* env : {static_cast<const char*>(nullptr), "3"}) {
    ScopedEnv ctas("KMLA_FP8_CTAS", env);
    const DecodePlan p = plan_decode(128, 12, 1, 8192, false, false, ds);
    EXPECT_EQ(p.fp8_ctas_per_sm, fits ? 3 : 2);
    int sms = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
    EXPECT_EQ(ref.num_workers, decode_balanced_workers(2 * sms, 128));
    EXPECT_EQ(p.num_workers, decode_balanced_workers((fits ? 3 : 2) * sms, 128));
    EXPECT_GE(p.workspace_bytes, decode_workspace_bytes(p, 128, 12));
    for (CacheFormat other : {CacheFormat::fp8, CacheFormat::bf16}) {
      const DecodePlan o = plan_decode(128, 12, 1, 8192, false, false, other);
      EXPECT_EQ(o.fp8_ctas_per_sm, 2);
      // (bf16's 12 rows in a batch of 128: thin wgmma tiles, one CTA per SM.)
      if (o.rows_per_cta == 16) EXPECT_EQ(o.num_workers, ref.num_workers);
    }
    EXPECT_EQ(plan_decode(128, 12, 1, 8192, false, false).fp8_ctas_per_sm, 2);  // no format
    EXPECT_EQ(plan_decode(128, 12, 1, 8192, true, false, ds).fp8_ctas_per_sm, 2);  // portable
    EXPECT_EQ(plan_decode(128, 12, 1, 8192, false, true, ds).fp8_ctas_per_sm, 2);  // invariant
    EXPECT_EQ(plan_decode(128, 32, 1, 8192, true, false, ds).fp8_ctas_per_sm, 2);  // 32 rows
    // 17-32 rows of the fp8 caches: two 16-row tiles (fp8_ds_mla's of the three-CTA kernel).
    const DecodePlan two_tiles = plan_decode(128, 16, 2, 8192, false, false, ds);
    EXPECT_EQ(two_tiles.rows_per_cta, 16);
    EXPECT_EQ(two_tiles.fp8_ctas_per_sm, fits ? 3 : 2);
    EXPECT_EQ(plan_decode(128, 12, 2, 8192, false, false, CacheFormat::fp8).rows_per_cta, 16);
    EXPECT_EQ(plan_decode(128, 12, 2, 8192, true, false, CacheFormat::fp8).rows_per_cta, 32);
  }
  {
    ScopedEnv bad("KMLA_FP8_CTAS", "4");
    EXPECT_THROW(plan_decode(128, 12, 1, 8192, false, false, ds), Error);
  }
  DecodeParams p;
  p.heads = 12;
  p.cache.format = ds;
  p.cache.block_size = 64;
  DecodePlan bad = ref;
  bad.fp8_ctas_per_sm = 1;
  EXPECT_THROW(decode_attention(p, bad, nullptr, nullptr), Error);
  bad.fp8_ctas_per_sm = 3;
  EXPECT_NO_THROW(decode_attention(p, bad, nullptr, nullptr));  // no requests: nothing runs
}

// A block id outside the cache on the fragment path: flagged, its keys invisible.
TEST(CudaDecode, Fp8FragmentPathBadBlock) {
  KMLA_REQUIRE_GPU();
  for (CacheFormat format : {CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    DecodeCase c;
    c.format = format;
    c.heads = 12;
    c.block_size = 16;
    c.seq_lens = {100, 40, 0, 16};
    c.query_lens = {1, 1, 0, 1};
    c.bad_block_request = 0;  // keys [96, 100) become invisible
    c.seed = 300 + int(format);
    run_case(c, {{0, 16}, {2, 16}});
  }
}

// ---- the 16-row 16-bit kernel's warp-own form (DecodePlan::row16_warp_own) ---------------
// Each warp copies the key columns it reads and waits for its own copies; S is split by
// depth and its four partials are added in warp order, so the bits differ from the
// shared-loader form's and the oracle's tolerance is what holds it (the harness compares
// every row). The hook runs the shared-loader 2-stage kernel first (the same plan with the
// field off) and then the plan itself, which the harness checks and repeats (same bits
// twice: no copy read before it landed, no partial-S buffer reused too early). Across a test
// some bits must differ: if none did, the form was never launched (another kernel ran).
CaseHooks warp_own_hooks(const std::string& label, size_t* differ) {
  CaseHooks h;
  h.label = label;
  h.check_plan = [](const DecodeParams&, const DecodePlan& plan) {
    EXPECT_EQ(plan.rows_per_cta, 16);
    EXPECT_FALSE(plan.deep_pipeline);
    EXPECT_TRUE(plan.row16_warp_own);
  };
  h.run = [differ](const DecodeParams& p, const DecodePlan& plan, void* workspace) {
    const size_t rows = size_t(p.batch.num_rows) * size_t(p.heads);
    std::vector<uint16_t> out_def(rows * kKvLoraRank), out(rows * kKvLoraRank);
    std::vector<float> lse_def(rows), lse(rows);
    for (bool own : {false, true}) {
      DecodePlan q = plan;
      q.row16_warp_own = own;
      ASSERT_EQ(cudaMemset(p.out, 0xFF, out.size() * 2), cudaSuccess);
      ASSERT_EQ(cudaMemset(p.lse, 0xFF, lse.size() * 4), cudaSuccess);
      decode_attention(p, q, workspace, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint16_t>& o = own ? out : out_def;
      std::vector<float>& l = own ? lse : lse_def;
      ASSERT_EQ(cudaMemcpy(o.data(), p.out, o.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(l.data(), p.lse, l.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    for (size_t i = 0; i < out.size(); ++i) *differ += out[i] != out_def[i];
    for (size_t i = 0; i < lse.size(); ++i) *differ += std::memcmp(&lse[i], &lse_def[i], 4) != 0;
  };
  return h;
}

// Lengths just off the 32-key tile, 64 keys and the block ends (block sizes 16 / 64 / 256),
// 1 to 8 tiles (both stages and their refills) and long ones; 12 and 16 heads with one or
// two tokens (24 / 32 rows in 16-row tiles: a second tile that starts at row 16, partly
// past the request) and 5 heads with up to 3 causal tokens; a padded slot. Plans: the
// balanced schedule as planned, one CTA running every piece in turn, 300 workers with every
// pair cut (pieces back to back in one CTA: the next piece's Q over the last partial S),
// and the per-request grid with 1 split (direct output) and 3. An fp16 cache (f16
// activations: the form's other instantiation) at block size 64.
TEST(CudaDecodeWarpOwn, Shapes) {
  KMLA_REQUIRE_GPU();
  size_t differ = 0;
  uint64_t seed = 800;
  for (int bs_code : {16, 64, 256, -64}) {  // negative: an fp16 cache, block size -bs_code
    for (int heads : {12, 16, 5}) {
      DecodeCase c;
      if (bs_code < 0) {
        c.format = CacheFormat::fp16;
        c.act = DType::f16;
      }
      const int bs = std::abs(bs_code);
      c.heads = heads;
      c.block_size = bs;
      c.seq_lens = {15, 16,  17,  31,  32,  33,  47,  49,  63,  64,  65, 0,    95,
                    97, 127, 129, 159, 161, 191, 193, 225, 255, 257, 1,  1000, 5000};
      c.query_lens.assign(c.seq_lens.size(), 1);
      c.query_lens[11] = 0;  // a padded slot
      for (size_t i = 0; i < c.query_lens.size(); ++i)
        if (c.query_lens[i] && c.seq_lens[i] >= 3)
          c.query_lens[i] = heads == 5 ? 1 + int(i % 3) : 1 + int(i % 2);
      c.seed = seed++;
      SCOPED_TRACE(::testing::Message()
                   << cache_format_name(c.format) << ", block size " << bs << ", heads " << heads);
      run_case(c, {{0, 16}, {0, 16, false, 1}, {0, 16, false, 300, 0, 0, 0}, {1, 16}, {3, 16}},
               warp_own_hooks("warp-own form", &differ));
    }
  }
  EXPECT_GT(differ, 0u) << "the warp-own form gave the default form's bits everywhere";
}

// A block id outside the cache (flagged by the lookup, its keys masked through the warps'
// own key flags), and one long request over hundreds of splits and over a few.
TEST(CudaDecodeWarpOwn, BadBlockAndLongRequest) {
  KMLA_REQUIRE_GPU();
  size_t differ = 0;
  DecodeCase c;
  c.heads = 16;
  c.block_size = 16;
  c.seq_lens = {100, 40, 0, 16, 177};
  c.query_lens = {1, 2, 0, 1, 2};
  c.bad_block_request = 0;  // keys [96, 100) become invisible
  c.seed = 820;
  run_case(c, {{0, 16}, {1, 16}, {4, 16}, {0, 16, false, 200, 0, 0, 0}},
           warp_own_hooks("bad block", &differ));
  DecodeCase l;
  l.heads = 12;
  l.block_size = 64;
  l.seq_lens = {100001};
  l.query_lens = {1};
  l.seed = 821;
  run_case(l, {{0, 16}, {1024, 16}, {7, 16}}, warp_own_hooks("one long request", &differ));
  EXPECT_GT(differ, 0u) << "the warp-own form gave the default form's bits everywhere";
}

// plan_decode picks the warp-own form for every non-portable plan over a 16-bit cache
// (unset or KMLA_DECODE_WARP_OWN=1), never for fp8 caches or the portable path; =0 keeps the
// shared loader with the same grid and workspace; any other value is an error.
TEST(CudaDecodeWarpOwn, PlanChoosesTheForm) {
  KMLA_REQUIRE_GPU();
  struct Shape {
    int requests, heads, qlen;
    int64_t seq;
    bool invariant;
  };
  const Shape shapes[] = {{128, 12, 1, 8192, false}, {1, 12, 1, 65536, false},
                          {128, 16, 1, 4096, false}, {1, 12, 1, int64_t(1) << 20, false},
                          {4, 5, 3, 1000, false},    {3, 12, 1, 100000, true}};
  for (const char* on : {static_cast<const char*>(nullptr), "1"}) {
    ScopedEnv env("KMLA_DECODE_WARP_OWN", on);
    for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp16}) {
      for (const Shape& s : shapes) {
        SCOPED_TRACE(::testing::Message() << cache_format_name(f) << ", " << s.requests << " x "
                                          << s.heads << " heads x " << s.qlen << " x " << s.seq
                                          << " keys, KMLA_DECODE_WARP_OWN=" << (on ? on : ""));
        EXPECT_TRUE(
            plan_decode(s.requests, s.heads, s.qlen, s.seq, false, s.invariant, f).row16_warp_own);
      }
    }
    for (CacheFormat f : {CacheFormat::fp8, CacheFormat::fp8_ds_mla})
      EXPECT_FALSE(plan_decode(1, 12, 1, 65536, false, false, f).row16_warp_own)
          << cache_format_name(f);
    EXPECT_FALSE(plan_decode(1, 12, 1, 65536, true, false).row16_warp_own);  // portable
  }
  for (const Shape& s : shapes) {
    DecodePlan on, off;
    {
      ScopedEnv env("KMLA_DECODE_WARP_OWN", "1");
      on = plan_decode(s.requests, s.heads, s.qlen, s.seq, false, s.invariant);
    }
    {
      ScopedEnv env("KMLA_DECODE_WARP_OWN", "0");
      off = plan_decode(s.requests, s.heads, s.qlen, s.seq, false, s.invariant);
    }
    SCOPED_TRACE(::testing::Message() << s.requests << " x " << s.heads << " heads");
    EXPECT_FALSE(off.row16_warp_own);
    EXPECT_EQ(on.schedule, off.schedule);
    EXPECT_EQ(on.num_splits, off.num_splits);
    EXPECT_EQ(on.num_workers, off.num_workers);
    EXPECT_EQ(on.workspace_bytes, off.workspace_bytes);
  }
  for (const char* bad : {"2", "31", "-1"}) {
    ScopedEnv env("KMLA_DECODE_WARP_OWN", bad);
    EXPECT_THROW(plan_decode(128, 16, 1, 4096, false), Error) << bad;
  }
}

// ---- the combine's two forms -------------------------------------------------------------
// One 64K-key request: hundreds of per-request splits go to the CTA-per-(row, chunk) form
// (decode_combine_rows_kernel), in every chunk count it may use and with the most splits
// (1024: four LSEs per thread); next to a short multi-token request the rows are many
// enough for the warp-per-task form, under both schedules.
TEST(CudaDecodeCombine, OneLongRequestManySplits) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 12;
  c.block_size = 64;
  c.seq_lens = {65536};
  c.query_lens = {1};
  c.seed = 65;
  for (const char* chunks : {"", "4", "8", "32"}) {
    SCOPED_TRACE(::testing::Message() << "KMLA_DECODE_COMBINE_CHUNKS=" << chunks);
    setenv("KMLA_DECODE_COMBINE_CHUNKS", chunks, 1);
    run_case(c, {{0, 0}, {1024, 0}, {3, 0}});
  }
  unsetenv("KMLA_DECODE_COMBINE_CHUNKS");
  c.heads = 5;  // odd: rows 5 and 10 per request
  c.seq_lens = {65535, 0, 700};
  c.query_lens = {1, 0, 2};
  c.seed = 66;
  // Balanced plans with the combine kernel (fused off) and merging in the split kernel: one
  // long request cut over 264 workers, a warp merging rows of ~200 partials.
  run_case(c, {{0, 0},
               {0, 0, false, 264},
               {.workers = 264, .fused = 0},
               {0, 0, false, 1000, 0, 0, 0},
               {.workers = 1000, .min_keys = 0, .nosplit_keys = 0, .pair_keys = 0, .fused = 0},
               {247, 0}});
}

// The fused merge in batches of at most KMLA_DECODE_MERGE_ROWS partial rows: one item a
// batch (2), a few (5: a piece of more partials than that goes to the warp-per-row merge
// next to one that does not), and pieces of many partials; 16 and 64-row tiles, every
// pair cut, mixed lengths with empty and one-key requests.
TEST(CudaDecodeCombine, FusedMergeInSmallBatches) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 5;
  c.block_size = 64;
  c.seq_lens = {0, 1, 63, 9000, 65, 129, 31, 4000, 2, 700};
  c.query_lens = {1, 1, 1, 3, 1, 2, 1, 1, 0, 4};
  c.seed = 71;
  for (const char* rows : {"2", "5", "40"}) {
    SCOPED_TRACE(::testing::Message() << "KMLA_DECODE_MERGE_ROWS=" << rows);
    ScopedEnv env("KMLA_DECODE_MERGE_ROWS", rows);
    run_case(c, {{.workers = 100, .min_keys = 0, .nosplit_keys = 0, .pair_keys = 0, .fused = 1},
                 {.rows_per_cta = 64,
                  .workers = 37,
                  .min_keys = 0,
                  .nosplit_keys = 0,
                  .pair_keys = 0,
                  .fused = 1},
                 {.workers = 7, .fused = 1}});
  }
}

// A CUDA graph of decode_attention (the split kernel and the combine) replayed first with
// every length cut to a third (another batch of the same shape), then with the real ones,
// which run_case checks.
void run_in_graph(const DecodeParams& p, const DecodePlan& plan, void* workspace) {
  // The harness's fills ran on the legacy stream, which a non-blocking stream ignores.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  decode_attention(p, plan, workspace, s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const int R = p.batch.num_requests;
  std::vector<int32_t> seq(static_cast<size_t>(R)), cut(static_cast<size_t>(R));
  int32_t* d_seq = const_cast<int32_t*>(p.batch.seq_lens);
  ASSERT_EQ(cudaMemcpy(seq.data(), d_seq, seq.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int r = 0; r < R; ++r) cut[size_t(r)] = seq[size_t(r)] / 3;
  ASSERT_EQ(cudaMemcpy(d_seq, cut.data(), cut.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_seq, seq.data(), seq.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

TEST(CudaDecodeCombine, GraphReplayOtherLengths) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 12;
  c.block_size = 32;
  c.seq_lens = {5000, 1, 0, 3000, 65, 20000, 900};
  c.query_lens = {1, 1, 0, 2, 1, 1, 1};
  c.seed = 67;
  CaseHooks hooks;
  hooks.label = "graph";
  hooks.run = run_in_graph;
  // Balanced plans in a graph: the fused combine (a cooperative kernel node), also on 64-row
  // tiles with every pair cut, and the combine kernel after the split kernel.
  run_case(c,
           {{0, 0},
            {0, 0, false, 50},
            {4, 0},
            {300, 0},
            {0, 64, false, 40, 0, 0, 0},
            {.workers = 50, .fused = 0}},
           hooks);
  c.seq_lens = {30000};  // one request: the many-partials form
  c.query_lens = {1};
  c.seed = 68;
  run_case(c, {{0, 0}, {2, 0}}, hooks);
}

// One long request on a one-wave grid: no split is left without keys (equal tile ranges of
// ceil(tiles / splits) tiles), and on sm_90 the combine is launched early (PDL).
TEST(CudaDecodeCombine, OneWavePlanHasEvenSplits) {
  KMLA_REQUIRE_GPU();
  int device = 0, major = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  for (int64_t seq : {int64_t(65536), int64_t(1) << 20, int64_t(100000)}) {
    SCOPED_TRACE(::testing::Message() << "seq " << seq);
    const DecodePlan plan = plan_decode(1, 12, 1, seq, false);
    const int64_t tiles = (seq + 31) / 32, per = (tiles + plan.num_splits - 1) / plan.num_splits;
    if (!std::getenv("KMLA_DECODE_EVEN_SPLITS") && !std::getenv("KMLA_DECODE_SPLITS"))
      EXPECT_LT((plan.num_splits - 1) * per, tiles) << plan.num_splits << " splits";
    if (!std::getenv("KMLA_DECODE_PDL") && !schedule_forced())
      EXPECT_EQ(plan.programmatic_combine, major >= 9);
  }
  // On the 16-row kernels a request takes one split per SM, of as few tiles as that takes,
  // while that is at most 64 tiles (16-bit cache) or 8 (fp8); beyond, splits of at least 8
  // tiles, more than one per SM. The 64-row kernel never goes below 8 tiles a split.
  if (std::getenv("KMLA_DECODE_EVEN_SPLITS") || std::getenv("KMLA_DECODE_SM_SPLIT_TILES") ||
      std::getenv("KMLA_DECODE_SPLITS") || schedule_forced())
    return;
  for (int64_t seq : {int64_t(4096), int64_t(8192), int64_t(16385), int64_t(65536), int64_t(262144),
                      int64_t(1) << 20}) {
    SCOPED_TRACE(::testing::Message() << "seq " << seq);
    const int64_t tiles = (seq + 31) / 32, per_sm = (tiles + sms - 1) / sms;
    const auto expect = [&](const DecodePlan& plan, int64_t most_tiles) {
      if (per_sm <= most_tiles) {
        EXPECT_EQ(plan.num_splits, (tiles + per_sm - 1) / per_sm);
      } else {
        EXPECT_LE(plan.num_splits, (tiles + 7) / 8);  // at least 8 tiles a split
        EXPECT_GT(plan.num_splits, sms);              // and more than one CTA per SM
      }
    };
    expect(plan_decode(1, 12, 1, seq, false), 64);
    expect(plan_decode(1, 12, 1, seq, false, false, CacheFormat::fp8), 8);
    expect(plan_decode(1, 12, 1, seq, false, false, CacheFormat::fp8_ds_mla), 8);
    EXPECT_LE(plan_decode(1, 128, 1, seq, false).num_splits, (tiles + 7) / 8);
  }
  EXPECT_EQ(plan_decode(1, 12, 1, 256, false).num_splits, 1);  // 8 tiles: no split
}

// Small balanced batches on the 16-row kernels: shares of one key tile at least, and one
// worker per SM (a multiple of the requests) with the combine launched early while a worker
// then holds at most 64 key tiles (16-bit cache) or 8 (fp8), every pair counted at the longest
// length; beyond, the CTA slots' workers (two or three per SM) and no early combine. The
// 64-row kernel and the portable plans keep shares of at least 8 tiles.
TEST(CudaDecodeCombine, SmallBalancedBatchesTakeOneWorkerPerSm) {
  KMLA_REQUIRE_GPU();
  for (const char* env : {"KMLA_DECODE_WORKERS", "KMLA_DECODE_MIN_KEYS", "KMLA_DECODE_PDL",
                          "KMLA_DECODE_SM_SPLIT_TILES"})
    if (std::getenv(env)) GTEST_SKIP() << env << " set";
  if (schedule_forced()) GTEST_SKIP() << "schedule forced";
  int device = 0, major = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  // (Fewer than 64 requests: 12 heads stay on the 16-row kernels, decode_sm90_takes_rows.)
  for (const int requests : {2, 3, 8, 16, 40}) {
    for (const int64_t seq : {int64_t(4096), int64_t(8193), int64_t(16384), int64_t(65536)}) {
      for (const CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
        SCOPED_TRACE(::testing::Message() << requests << " requests of " << seq << " keys, "
                                          << cache_format_name(f));
        const DecodePlan plan = plan_decode(requests, 12, 1, seq, false, false, f);
        ASSERT_EQ(plan.schedule, DecodeSchedule::balanced);
        ASSERT_EQ(plan.rows_per_cta, 16);
        EXPECT_EQ(plan.sched_min_keys, 32);
        const int64_t most = f == CacheFormat::bf16 ? 64 : 8;
        const bool one = requests * ((seq + 31) / 32) <= most * sms;
        if (one) {
          EXPECT_EQ(plan.num_workers, decode_balanced_workers(sms, requests));
        } else {
          EXPECT_GT(plan.num_workers, sms);
        }
        EXPECT_EQ(plan.programmatic_combine, one && major >= 9);
      }
    }
  }
  // 64-row tiles: workers a multiple of the (request, row tile) pairs where that idles at most
  // 1/8 of the slots while the pairs hold at most 40 tiles of 64 keys a slot (the GPUs with
  // 132 SMs, H100 and H200: one 64-row CTA per SM).
  if (sms == 132) {
    EXPECT_EQ(plan_decode(12, 128, 1, 4096, false).num_workers, 120);   // 24 pairs
    EXPECT_EQ(plan_decode(7, 128, 1, 16384, false).num_workers, 126);   // 14 pairs, 27 tiles
    EXPECT_EQ(plan_decode(40, 64, 1, 8192, false).num_workers, 120);    // 39 tiles
    EXPECT_EQ(plan_decode(12, 128, 1, 16384, false).num_workers, 132);  // 47 tiles
    EXPECT_EQ(plan_decode(19, 128, 1, 4096, false).num_workers, 132);   // 114 would idle 18
  }
  // 2 x 4K keys at 128 heads (64-row tiles) and on the portable kernels: 8-tile shares.
  const DecodePlan wide = plan_decode(2, 128, 1, 4096, false);
  EXPECT_EQ(wide.rows_per_cta, 64);
  EXPECT_EQ(wide.sched_min_keys, 256);
  const DecodePlan portable = plan_decode(2, 12, 1, 4096, true);
  EXPECT_EQ(portable.sched_min_keys, 256);
  EXPECT_FALSE(portable.programmatic_combine);
}

// ---- the wgmma kernel's copy issue (DecodeSm90Options::issue_wg1, early_issue) ------------
// The other tests run the defaults (warp 4 issues the TMA copies, tile t + 1 before the wait
// for tile t); these run the three other combinations: 128 heads with mixed lengths and
// lengths off the tile and block ends, the speculative 12 x 4 causal rows with block size 16
// (4 key groups per tile, so several lanes issue), the balanced walk cutting every request,
// per-request splits, and a bad block id (its group is never copied; the V rows are zeroed).
void run_copy_issue_variants(const DecodeCase& c, const std::vector<PlanTweak>& tweaks) {
  const DecodeSm90Options saved = decode_sm90_options();
  for (const int variant : {0, 1, 2}) {
    DecodeSm90Options opt = saved;
    opt.tma = true;
    opt.wide_s = true;
    opt.issue_wg1 = variant == 1;
    opt.early_issue = variant == 2;
    decode_sm90_set_options(opt);
    CaseHooks hooks;
    hooks.label = variant == 0 ? "warp 0 issues, late" : variant == 1 ? "warp 4 issues, late"
                                                                        : "warp 0 issues, early";
    run_case(c, tweaks, hooks);
  }
  decode_sm90_set_options(saved);
}

TEST(CudaDecode, Sm90CopyIssueVariants) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 128;
  c.block_size = 64;
  c.seq_lens = {1, 63, 900, 64, 65, 127, 128, 129, 1000, 4100};
  c.query_lens = {1, 1, 0, 1, 1, 1, 1, 1, 1, 1};
  c.seed = 81;
  run_copy_issue_variants(c, {{0, 0}, {1, 0}, {3, 0}, {0, 0, false, 300, 0, 0, 0}});
  c.heads = 12;
  c.block_size = 16;
  c.seq_lens = {1, 3, 4, 5, 63, 64, 65, 66, 0, 129, 4100};
  c.query_lens = {4, 4, 4, 4, 4, 4, 4, 3, 0, 2, 4};
  c.seed = 82;
  run_copy_issue_variants(c, {{0, 0}, {1, 0}, {40, 0}});
  c.heads = 64;
  c.block_size = 64;
  c.seq_lens = {300, 1000};
  c.query_lens = {1, 1};
  c.bad_block_request = 1;
  c.seed = 83;
  run_copy_issue_variants(c, {{0, 0}, {1, 0}, {4, 0}});
}

// ---- the W_UV epilogue (decode_attention_uv) -----------------------------------------------
// decode_attention_uv against the latent decode_attention writes (downloaded), times random
// W_UV and gated by random g on the host: every schedule and tile form the harness runs
// (balanced, per-request splits, one split's direct rows, the wgmma tiles, fp8 caches), rows
// of no request and past num_tokens (zero), the output poisoned with NaN beforehand so that
// every row must be written. With and without the gate, with and without PDL.
// Tolerance per element, before the gate: two act ulps of the result (its rounding and fp32
// accumulation over 512 terms, ~2^-15 relative) plus one act ulp flip of every latent value
// (the epilogue merges partials itself, in another order than the combine, so a value may
// round the other way): eps * sum_k |latent_k W_kn|, eps = 2^-7 (bf16) or 2^-10 (f16), the
// largest relative spacing. The gate scales both by sigmoid(g) < 1 and adds its own rounding.
TEST(CudaDecodeUv, MatchesLatentTimesWuvGated) {
  KMLA_REQUIRE_GPU();
  if (!decode_uv_fits()) GTEST_SKIP() << "the epilogue's shared memory does not fit this GPU";
  // (gate, multicast): the multicast form where the GPU has clusters (sm_90).
  std::vector<std::array<bool, 2>> forms = {{true, false}, {false, false}};
  if (decode_uv_multicast_supported())
    forms.push_back({true, true}), forms.push_back({false, true});
  for (const auto& [with_gate, multicast] : forms) {
    {
      int64_t checked = 0;
      CaseHooks hooks;
      hooks.label = std::string(with_gate ? "gate" : "no gate") + (multicast ? ", multicast" : "");
      hooks.run = [&](const DecodeParams& p, const DecodePlan& plan, void* ws) {
        const int H = p.heads, R = p.batch.num_requests;
        const int64_t rows = p.batch.num_rows;
        const int64_t astride = int64_t(H) * kVDim + 8, gstride = int64_t(H) * kVDim + 24;
        std::mt19937 rng(uint32_t(rows * 31 + H));
        std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
        auto act_bits = [&](float x) {
          return p.act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
        };
        std::vector<uint16_t> w(size_t(H) * kKvLoraRank * kVDim), g(size_t(rows * gstride));
        for (auto& x : w) x = act_bits(0.1f * uni(rng));
        for (auto& x : g) x = act_bits(3.0f * uni(rng));
        std::vector<int32_t> qs(size_t(R) + 1, 0), ql(size_t(R), 0);
        ASSERT_EQ(cudaMemcpy(qs.data(), p.batch.query_start, qs.size() * 4, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(ql.data(), p.batch.query_lens, ql.size() * 4, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        const int32_t real = qs[size_t(R)];
        DevBuf<uint16_t> d_w(w), d_g(g), d_attn(size_t(rows * astride));
        DevBuf<int32_t> d_real(std::vector<int32_t>{real});
        d_attn.fill_bytes(0xFF);
        DecodeUvParams uv;
        uv.w_uv = d_w.ptr;
        uv.attn = d_attn.ptr;
        uv.attn_stride = astride;
        uv.g = with_gate ? d_g.ptr : nullptr;
        uv.g_stride = gstride;
        uv.rows = rows;
        uv.num_tokens = with_gate ? d_real.ptr : nullptr;
        uv.multicast = multicast;
        decode_attention_uv(p, plan, ws, uv, nullptr);
        std::vector<uint16_t> attn = d_attn.download();  // (synchronizes)
        decode_attention(p, plan, ws, nullptr);          // the whole latent, for run_case too
        std::vector<uint16_t> latent(size_t(rows) * H * kKvLoraRank);
        ASSERT_EQ(cudaMemcpy(latent.data(), p.out, latent.size() * 2, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        auto val = [&](uint16_t v) { return double(act_to_float(p.act, v)); };
        auto round_act = [&](double x) { return double(act_to_float(p.act, act_bits(float(x)))); };
        const double eps = p.act == DType::bf16 ? 0x1p-7 : 0x1p-10;
        for (int64_t t = 0; t < rows; ++t) {
          const int r = int(std::upper_bound(qs.begin(), qs.end(), int32_t(t)) - qs.begin()) - 1;
          const bool live = r >= 0 && r < R && t < qs[size_t(r)] + ql[size_t(r)];  // request r's
          for (int h = 0; h < H; ++h) {
            for (int n = 0; n < kVDim; ++n) {
              const double got = val(attn[size_t(t * astride + h * kVDim + n)]);
              SCOPED_TRACE(::testing::Message()
                           << "token " << t << " head " << h << " column " << n);
              if (!live || (with_gate && t >= real)) {
                ASSERT_EQ(got, 0.0);
                continue;
              }
              double dot = 0.0, mag = 0.0;
              for (int k = 0; k < kKvLoraRank; ++k) {
                const double x = val(latent[size_t((t * H + h) * kKvLoraRank + k)]) *
                                 val(w[size_t((int64_t(h) * kKvLoraRank + k) * kVDim + n)]);
                dot += x;
                mag += std::abs(x);
              }
              double want = round_act(dot);
              double tol = 2.0 * act_ulp(p.act, float(std::abs(dot))) + eps * mag;
              if (with_gate) {
                const double sig =
                    1.0 / (1.0 + std::exp(-val(g[size_t(t * gstride + h * kVDim + n)])));
                want = round_act(want * sig);
                tol = tol * sig + act_ulp(p.act, float(std::abs(want)));
              }
              ASSERT_NEAR(got, want, tol);
              ++checked;
            }
          }
        }
      };
      DecodeCase c;  // 16-row tiles, padded slots, a bad block
      c.heads = 12;
      c.block_size = 16;
      c.seq_lens = {1000, 63, 65, 900, 4097, 1, 2000};
      c.query_lens = {1, 1, 1, 0, 1, 1, 1};
      c.bad_block_request = 2;
      c.seed = 101;
      run_case(c, {{0, 0}, {1, 0}, {3, 0}}, hooks);
      c = DecodeCase{};  // wgmma tiles (64 heads), two tokens, fp16
      c.act = DType::f16;
      c.format = CacheFormat::fp16;
      c.heads = 64;
      c.block_size = 64;
      c.seq_lens = {3000, 129, 64, 700};
      c.query_lens = {2, 2, 1, 2};
      c.seed = 102;
      run_case(c, {{0, 0}, {2, 0}}, hooks);
      c = DecodeCase{};  // fp8_ds_mla, odd heads, three tokens
      c.format = CacheFormat::fp8_ds_mla;
      c.heads = 7;
      c.block_size = 64;
      c.seq_lens = {5000, 257, 3};
      c.query_lens = {3, 1, 2};
      c.seed = 103;
      run_case(c, {{0, 0}, {4, 0}}, hooks);
      EXPECT_GT(checked, 0);
    }
  }
}

}  // namespace
}  // namespace kmla::cuda
