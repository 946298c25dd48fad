// Batch planning: layout order, permutation, positions, slot mapping (derived and from
// the caller), padding, validation errors and the chunked-context plan. Expected values
// are worked out by hand in the comments.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "kmla/batch.hpp"
#include "kmla/error.hpp"
#include "test_util.hpp"

using namespace kmla;

namespace {

using kmla::testing_util::expect_error_naming;

CacheGeometry geometry(int block_size, int64_t num_blocks) {
  CacheGeometry g;
  g.format = CacheFormat::bf16;
  g.block_size = block_size;
  g.num_blocks = num_blocks;
  g.block_stride = int64_t(block_size) * int64_t(g.entry_bytes());
  return g;
}

RequestSpec req(int32_t q, int32_t ctx, std::vector<int32_t> table) {
  return RequestSpec{q, ctx, std::move(table)};
}

// Six requests in scrambled order, block size 4, 32 blocks:
//   0: fresh prefill   q=3 ctx=0 table [5]         seq 3  -> 1 block
//   1: decode          q=1 ctx=6 table [1, 7]      seq 7  -> 2 blocks
//   2: context prefill q=5 ctx=2 table [9, 2]      seq 7  -> 2 blocks
//   3: decode          q=1 ctx=3 table [4]         seq 4  -> 1 block
//   4: fresh prefill   q=2 ctx=0 table [11, 30]    seq 2  -> 1 block (extra entry unused)
//   5: context prefill q=2 ctx=8 table [12, 13, 14] seq 10 -> 3 blocks
// Caller rows: req0 0..2, req1 3, req2 4..8, req3 9, req4 10..11, req5 12..13.
// Layout: decodes [1, 3], context prefills [2, 5], fresh [0, 4].
std::vector<RequestSpec> scrambled() {
  return {req(3, 0, {5}),      req(1, 6, {1, 7}), req(5, 2, {9, 2}),
          req(1, 3, {4}),      req(2, 0, {11, 30}), req(2, 8, {12, 13, 14})};
}

}  // namespace

TEST(Batch, ScrambledRequestsGetTheLayout) {
  const BatchMetadata md = plan_batch(scrambled(), geometry(4, 32));
  EXPECT_EQ(md.num_requests, 6);
  EXPECT_EQ(md.num_decodes, 2);
  EXPECT_EQ(md.num_context_prefills, 2);
  EXPECT_EQ(md.num_fresh_prefills, 2);
  EXPECT_EQ(md.num_tokens, 14);
  EXPECT_EQ(md.num_rows, 14);
  EXPECT_EQ(md.num_decode_tokens, 2);
  EXPECT_EQ(md.prefill_tokens_with_context, 7);
  EXPECT_EQ(md.max_query_len, 5);
  EXPECT_EQ(md.max_decode_query_len, 1);
  EXPECT_EQ(md.request_order, (std::vector<int32_t>{1, 3, 2, 5, 0, 4}));
  EXPECT_EQ(md.query_lens, (std::vector<int32_t>{1, 1, 5, 2, 3, 2}));
  EXPECT_EQ(md.context_lens, (std::vector<int32_t>{6, 3, 2, 8, 0, 0}));
  EXPECT_EQ(md.seq_lens, (std::vector<int64_t>{7, 4, 7, 10, 3, 2}));
  EXPECT_EQ(md.query_start, (std::vector<int64_t>{0, 1, 2, 7, 9, 12, 14}));
  EXPECT_EQ(md.row_order, (std::vector<int64_t>{3, 9, 4, 5, 6, 7, 8, 12, 13, 0, 1, 2, 10, 11}));
  EXPECT_EQ(md.positions, (std::vector<int64_t>{6, 3, 2, 3, 4, 5, 6, 8, 9, 0, 1, 2, 0, 1}));
  // Slots = table[pos / 4] * 4 + pos % 4:
  //   req1 pos 6 -> block 7: 30; req3 pos 3 -> block 4: 19;
  //   req2 pos 2,3 -> block 9: 38, 39; pos 4,5,6 -> block 2: 8, 9, 10;
  //   req5 pos 8,9 -> block 14: 56, 57; req0 -> block 5: 20..22; req4 -> block 11: 44, 45.
  EXPECT_EQ(md.slot_mapping,
            (std::vector<int64_t>{30, 19, 38, 39, 8, 9, 10, 56, 57, 20, 21, 22, 44, 45}));
  // Block tables in layout order, padded with -1 to the widest (3).
  EXPECT_EQ(md.max_blocks_per_request, 3);
  EXPECT_EQ(md.block_tables, (std::vector<int32_t>{1, 7, -1, 4, -1, -1, 9, 2, -1, 12, 13, 14, 5, -1, -1,
                                                    11, -1, -1}));
  EXPECT_EQ(md.kind(0), RequestKind::decode);
  EXPECT_EQ(md.kind(1), RequestKind::decode);
  EXPECT_EQ(md.kind(2), RequestKind::context_prefill);
  EXPECT_EQ(md.kind(3), RequestKind::context_prefill);
  EXPECT_EQ(md.kind(4), RequestKind::fresh_prefill);
  EXPECT_EQ(md.kind(5), RequestKind::fresh_prefill);
  EXPECT_EQ(md.slot_of(3, 9), 57);
  EXPECT_EQ(md.block_table(2)[1], 2);
}

TEST(Batch, PermuteRowsRoundTrip) {
  const BatchMetadata md = plan_batch(scrambled(), geometry(4, 32));
  const int64_t width = 3;
  std::vector<int32_t> caller(14 * width), layout(14 * width, -1), back(14 * width, -1);
  for (int r = 0; r < 14; ++r)
    for (int k = 0; k < width; ++k) caller[r * width + k] = r * 10 + k;
  permute_rows(md, caller.data(), layout.data(), width, sizeof(int32_t), true);
  // Layout row 0 is caller row 3 (request 1's only token), row 1 is caller row 9, ...
  EXPECT_EQ(layout[0], 30);
  EXPECT_EQ(layout[1 * width + 2], 92);
  EXPECT_EQ(layout[9 * width], 0);
  for (int r = 0; r < 14; ++r)
    for (int k = 0; k < width; ++k) ASSERT_EQ(layout[r * width + k], md.row_order[r] * 10 + k);
  permute_rows(md, layout.data(), back.data(), width, sizeof(int32_t), false);
  EXPECT_EQ(back, caller);
  // row_order is a permutation.
  std::vector<int64_t> sorted = md.row_order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> iota(14);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);
}

TEST(Batch, CallerSlotMapping) {
  // Caller order: the derived slots, except token 4 (req2 pos 2) -> 37 (same block 9),
  // token 12 (req5 pos 8) -> -1, token 0 (req0 pos 0) -> 23 (same block 5).
  BatchOptions opt;
  opt.slot_mapping = {23, 21, 22, 30, 37, 39, 8, 9, 10, 19, 44, 45, -1, 57};
  const BatchMetadata md = plan_batch(scrambled(), geometry(4, 32), opt);
  EXPECT_EQ(md.slot_mapping,
            (std::vector<int64_t>{30, 19, 37, 39, 8, 9, 10, -1, 57, 23, 21, 22, 44, 45}));
  // Positions still come from the lengths.
  EXPECT_EQ(md.positions[7], 8);
}

TEST(Batch, CallerSlotMappingErrors) {
  const auto reqs = scrambled();
  const std::vector<int64_t> good = {20, 21, 22, 30, 38, 39, 8, 9, 10, 19, 44, 45, 56, 57};
  EXPECT_NO_THROW(plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = good}));
  // Token 9 (request 3, table [4]) given slot 100 = block 25: not its block.
  {
    auto s = good;
    s[9] = 100;
    expect_error_naming([&] { plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = s}); },
                        {"token 9", "request 3", "100"});
  }
  // A block the request owns only past its needed blocks (req4's unused entry 30) is not its.
  {
    auto s = good;
    s[10] = 30 * 4;
    expect_error_naming([&] { plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = s}); },
                        {"120"});
  }
  // Past the cache.
  {
    auto s = good;
    s[0] = 32 * 4;
    expect_error_naming([&] { plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = s}); },
                        {"128"});
  }
  // Negative other than -1.
  {
    auto s = good;
    s[5] = -2;
    expect_error_naming([&] { plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = s}); },
                        {"-2"});
  }
  // Duplicate: token 5 writes 38 as token 4 does.
  {
    auto s = good;
    s[5] = 38;
    expect_error_naming([&] { plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = s}); },
                        {"slot 38"});
  }
  // Wrong length.
  {
    auto s = good;
    s.pop_back();
    expect_error_naming([&] { plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = s}); },
                        {"13", "14"});
  }
  // Two -1 entries are fine (no write, no duplicate).
  {
    auto s = good;
    s[0] = -1;
    s[1] = -1;
    EXPECT_NO_THROW(plan_batch(reqs, geometry(4, 32), BatchOptions{.slot_mapping = s}));
  }
}

TEST(Batch, DerivedSlotsMustNotCollide) {
  // Two requests whose new tokens map to the same cache row through shared blocks.
  const std::vector<RequestSpec> r = {req(2, 0, {3}), req(1, 1, {3})};
  expect_error_naming([&] { plan_batch(r, geometry(4, 8)); }, {"slot 13"});
}

TEST(Batch, KeepOrder) {
  BatchOptions opt;
  opt.keep_order = true;
  // decode, decode, context prefill, fresh prefill: valid as is.
  const std::vector<RequestSpec> ok = {req(1, 6, {1, 7}), req(1, 3, {4}), req(5, 2, {9, 2}), req(3, 0, {5})};
  const BatchMetadata md = plan_batch(ok, geometry(4, 32), opt);
  EXPECT_EQ(md.request_order, (std::vector<int32_t>{0, 1, 2, 3}));
  std::vector<int64_t> iota(md.num_tokens);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(md.row_order, iota);
  // A fresh prefill before a decode is refused, naming the request.
  expect_error_naming([&] { plan_batch(scrambled(), geometry(4, 32), opt); }, {"request 1", "decode"});
  // A context prefill after a fresh one too.
  const std::vector<RequestSpec> bad = {req(1, 6, {1, 7}), req(3, 0, {5}), req(5, 2, {9, 2})};
  expect_error_naming([&] { plan_batch(bad, geometry(4, 32), opt); }, {"request 2"});
}

TEST(Batch, DecodeThreshold) {
  // Threshold 2: q=2 with context is a decode, q=3 is not; q=1 without context is fresh.
  const std::vector<RequestSpec> r = {req(3, 5, {0, 1}), req(2, 5, {2, 3}), req(1, 0, {4}), req(1, 9, {5, 6, 7})};
  BatchOptions opt;
  opt.decode_threshold = 2;
  const BatchMetadata md = plan_batch(r, geometry(4, 16), opt);
  EXPECT_EQ(md.request_order, (std::vector<int32_t>{1, 3, 0, 2}));
  EXPECT_EQ(md.num_decodes, 2);
  EXPECT_EQ(md.num_decode_tokens, 3);
  EXPECT_EQ(md.max_decode_query_len, 2);
  EXPECT_EQ(md.num_context_prefills, 1);
  EXPECT_EQ(md.num_fresh_prefills, 1);
  // Default threshold 1: request 1 becomes a context prefill.
  const BatchMetadata d1 = plan_batch(r, geometry(4, 16));
  EXPECT_EQ(d1.request_order, (std::vector<int32_t>{3, 0, 1, 2}));
  // 128: a 128-token block with context decodes, 129 does not.
  std::vector<int32_t> table(70);
  std::iota(table.begin(), table.end(), 0);
  std::vector<int32_t> table2(70);
  std::iota(table2.begin(), table2.end(), 70);
  const std::vector<RequestSpec> big = {req(129, 1, table), req(128, 1, table2)};
  opt.decode_threshold = 128;
  const BatchMetadata d128 = plan_batch(big, geometry(4, 140), opt);
  EXPECT_EQ(d128.request_order, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(d128.num_decodes, 1);
  EXPECT_EQ(d128.max_decode_query_len, 128);
  // Out of range.
  opt.decode_threshold = 0;
  expect_error_naming([&] { plan_batch(r, geometry(4, 16), opt); }, {"got 0"});
  opt.decode_threshold = 129;
  expect_error_naming([&] { plan_batch(r, geometry(4, 16), opt); }, {"129"});
}

TEST(Batch, ZeroLengthRequests) {
  // A zero-query request with context counts as a decode and owns no rows.
  const std::vector<RequestSpec> r = {req(3, 0, {0}), req(0, 5, {1, 2}), req(1, 2, {3})};
  const BatchMetadata md = plan_batch(r, geometry(4, 8));
  EXPECT_EQ(md.request_order, (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ(md.query_start, (std::vector<int64_t>{0, 0, 1, 4}));
  EXPECT_EQ(md.row_order, (std::vector<int64_t>{3, 0, 1, 2}));
  EXPECT_EQ(md.slot_mapping, (std::vector<int64_t>{14, 0, 1, 2}));
  // With keep_order, trailing zero-length padding requests (as engines add) are accepted
  // after prefills; a real decode after a prefill is not.
  BatchOptions keep;
  keep.keep_order = true;
  const std::vector<RequestSpec> padded = {req(1, 2, {3}), req(3, 0, {0}), req(0, 0, {}), req(0, 5, {1, 2})};
  const BatchMetadata p = plan_batch(padded, geometry(4, 8), keep);
  EXPECT_EQ(p.row_order, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(p.num_tokens, 4);
  EXPECT_THROW(plan_batch({req(3, 0, {0}), req(1, 2, {3})}, geometry(4, 8), keep), Error);
  // An empty batch plans to nothing.
  const BatchMetadata e = plan_batch({}, geometry(4, 8));
  EXPECT_EQ(e.num_tokens, 0);
  EXPECT_TRUE(e.slot_mapping.empty());
}

TEST(Batch, PaddingRows) {
  BatchOptions opt;
  opt.num_rows = 20;
  const BatchMetadata md = plan_batch(scrambled(), geometry(4, 32), opt);
  EXPECT_EQ(md.num_rows, 20);
  EXPECT_EQ(md.num_tokens, 14);
  ASSERT_EQ(md.slot_mapping.size(), 20u);
  ASSERT_EQ(md.positions.size(), 20u);
  for (int i = 14; i < 20; ++i) {
    EXPECT_EQ(md.slot_mapping[i], -1) << i;
    EXPECT_EQ(md.positions[i], 0) << i;
  }
  EXPECT_EQ(md.slot_mapping[13], 45);
  opt.num_rows = 13;
  expect_error_naming([&] { plan_batch(scrambled(), geometry(4, 32), opt); }, {"13", "14"});
  opt.num_rows = -4;
  expect_error_naming([&] { plan_batch(scrambled(), geometry(4, 32), opt); }, {"-4"});
  opt.num_rows = -4;
  expect_error_naming([&] { plan_batch({}, geometry(4, 32), opt); }, {"-4"});
}

TEST(Batch, BlockTableErrors) {
  auto r = scrambled();
  r[2].block_table = {9};  // seq 7 needs 2 blocks of 4
  expect_error_naming([&] { plan_batch(r, geometry(4, 32)); }, {"request 2", "1 entries", "7"});
  r = scrambled();
  r[1].block_table = {1, -3};
  expect_error_naming([&] { plan_batch(r, geometry(4, 32)); }, {"request 1", "-3"});
  r = scrambled();
  r[5].block_table = {12, 32, 14};  // 32 == num_blocks
  expect_error_naming([&] { plan_batch(r, geometry(4, 32)); }, {"request 5", "= 32"});
  // Garbage past the needed entries is ignored (req4 seq 2 needs 1 block).
  r = scrambled();
  r[4].block_table = {11, -77, 1 << 30};
  EXPECT_NO_THROW(plan_batch(r, geometry(4, 32)));
  // Negative lengths.
  r = scrambled();
  r[3].context_len = -1;
  expect_error_naming([&] { plan_batch(r, geometry(4, 32)); }, {"request 3", "-1"});
  // The cache geometry itself is checked.
  expect_error_naming([&] { plan_batch(scrambled(), geometry(0, 32)); }, {"got 0"});
}

TEST(Batch, FromSeqLen) {
  const RequestSpec r = RequestSpec::from_seq_len(2, 7, {1, 2});
  EXPECT_EQ(r.query_len, 2);
  EXPECT_EQ(r.context_len, 5);
  EXPECT_EQ(r.seq_len(), 7);
  EXPECT_EQ(r.block_table, (std::vector<int32_t>{1, 2}));
  expect_error_naming([] { RequestSpec::from_seq_len(5, 3, {}); }, {"5", "3"});
  expect_error_naming([] { RequestSpec::from_seq_len(-1, 3, {}); }, {"-1"});
}

TEST(Batch, ChunkedContextPlan) {
  // Block 64; contexts 63, 64, 65 (just around a block boundary) and 130, each with 2 new
  // tokens (threshold 1 -> prefills with context), plus a decode and a fresh prefill.
  const int bs = 64;
  const int64_t ctx[] = {63, 64, 65, 130};
  std::vector<RequestSpec> r;
  int32_t next_block = 0;
  auto table = [&](int64_t seq) {
    std::vector<int32_t> t;
    for (int64_t i = 0; i < (seq + bs - 1) / bs; ++i) t.push_back(next_block++);
    return t;
  };
  r.push_back(req(4, 0, table(4)));  // fresh, caller 0
  for (int64_t c : ctx) r.push_back(req(2, int32_t(c), table(c + 2)));  // caller 1..4
  r.push_back(req(1, 10, table(11)));  // decode, caller 5
  BatchOptions opt;
  // 4 context prefills share 266 rows: 66 each, rounded down to whole blocks: 64.
  opt.workspace_tokens = 4 * 64 + 10;
  const BatchMetadata md = plan_batch(r, geometry(bs, 64), opt);
  ASSERT_EQ(md.num_context_prefills, 4);
  EXPECT_EQ(md.request_order, (std::vector<int32_t>{5, 1, 2, 3, 4, 0}));
  EXPECT_EQ(md.context_chunk_tokens, 64);
  ASSERT_EQ(md.context_chunks.size(), 3u);  // ceil(130 / 64)
  EXPECT_EQ(md.context_chunks[0].start, 0);
  EXPECT_EQ(md.context_chunks[1].start, 64);
  EXPECT_EQ(md.context_chunks[2].start, 128);
  EXPECT_EQ(md.context_chunks[0].len, (std::vector<int32_t>{63, 64, 64, 64}));
  EXPECT_EQ(md.context_chunks[1].len, (std::vector<int32_t>{0, 0, 1, 64}));
  EXPECT_EQ(md.context_chunks[2].len, (std::vector<int32_t>{0, 0, 0, 2}));
  EXPECT_EQ(md.context_chunks[0].cu_len, (std::vector<int64_t>{0, 63, 127, 191, 255}));
  EXPECT_EQ(md.context_chunks[1].cu_len, (std::vector<int64_t>{0, 0, 0, 1, 65}));
  EXPECT_EQ(md.context_chunks[2].total(), 2);
  // Every context row of every request is covered exactly once, and no chunk overflows
  // the workspace.
  for (int j = 0; j < 4; ++j) {
    std::vector<int> cover(ctx[j], 0);
    for (const ContextChunk& ch : md.context_chunks) {
      for (int64_t p = ch.start; p < ch.start + ch.len[j]; ++p) {
        ASSERT_LT(p, ctx[j]);
        cover[p]++;
      }
    }
    for (int64_t p = 0; p < ctx[j]; ++p) ASSERT_EQ(cover[p], 1) << "request " << j << " row " << p;
  }
  for (const ContextChunk& ch : md.context_chunks) EXPECT_LE(ch.total(), opt.workspace_tokens);
}

TEST(Batch, ChunkedContextRandomCoverage) {
  // Many (contexts, workspace, block size) combinations: coverage exactly once, chunk
  // totals within the workspace, chunk size a whole number of blocks when it can be.
  uint32_t s = 1;
  auto rnd = [&](uint32_t n) { s = s * 1664525u + 1013904223u; return (s >> 8) % n; };
  for (int trial = 0; trial < 200; ++trial) {
    const int bs = 1 << rnd(7);
    const int n = 1 + int(rnd(5));
    std::vector<RequestSpec> r;
    std::vector<int64_t> ctx;
    int32_t nb = 0;
    for (int j = 0; j < n; ++j) {
      const int64_t c = 1 + rnd(600);
      ctx.push_back(c);
      std::vector<int32_t> t;
      for (int64_t i = 0; i < (c + 2 + bs - 1) / bs; ++i) t.push_back(nb++);
      r.push_back(req(2, int32_t(c), t));
    }
    BatchOptions opt;
    opt.workspace_tokens = n + rnd(900);
    const BatchMetadata md = plan_batch(r, geometry(bs, nb), opt);
    const int64_t per = opt.workspace_tokens / n;
    EXPECT_EQ(md.context_chunk_tokens, per >= bs ? per / bs * bs : per);
    for (int j = 0; j < n; ++j) {
      int64_t covered = 0, expect_start = 0;
      for (const ContextChunk& ch : md.context_chunks) {
        if (ch.len[j] == 0) continue;
        ASSERT_EQ(ch.start, expect_start);  // consecutive, no gap, no overlap
        expect_start += ch.len[j];
        covered += ch.len[j];
      }
      ASSERT_EQ(covered, ctx[j]);
    }
    for (const ContextChunk& ch : md.context_chunks) ASSERT_LE(ch.total(), opt.workspace_tokens);
  }
}

TEST(Batch, WorkspaceTooSmallForTheContextPrefills) {
  // Three requests with context need at least one workspace row each per chunk.
  const std::vector<RequestSpec> r = {req(2, 5, {0, 1}), req(2, 5, {2, 3}), req(2, 5, {4, 5})};
  BatchOptions opt;
  opt.workspace_tokens = 2;
  expect_error_naming([&] { plan_batch(r, geometry(4, 8), opt); }, {"2", "3"});
  opt.workspace_tokens = 3;
  const BatchMetadata md = plan_batch(r, geometry(4, 8), opt);
  EXPECT_EQ(md.context_chunk_tokens, 1);
  EXPECT_EQ(md.context_chunks.size(), 5u);
  opt.workspace_tokens = 0;
  expect_error_naming([&] { plan_batch(r, geometry(4, 8), opt); }, {"got 0"});
}

TEST(Batch, DecodeKeyCount) {
  // A 3-token decode block on 5 cached tokens (seq 8), threshold 4.
  const std::vector<RequestSpec> r = {req(3, 5, {0, 1})};
  BatchOptions opt;
  opt.decode_threshold = 4;
  const BatchMetadata c = plan_batch(r, geometry(4, 4), opt);
  ASSERT_EQ(c.num_decodes, 1);
  EXPECT_TRUE(c.causal_decode);
  // Bottom-right causal: token i sees seq - (q - 1 - i) keys.
  EXPECT_EQ(c.decode_key_count(0, 0), 6);
  EXPECT_EQ(c.decode_key_count(0, 1), 7);
  EXPECT_EQ(c.decode_key_count(0, 2), 8);
  EXPECT_EQ(c.positions, (std::vector<int64_t>{5, 6, 7}));
  opt.non_causal_decode = true;
  const BatchMetadata n = plan_batch(r, geometry(4, 4), opt);
  EXPECT_FALSE(n.causal_decode);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(n.decode_key_count(0, i), 8);
}
