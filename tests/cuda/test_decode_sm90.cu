// The Hopper wgmma decode kernel (src/cuda/decode_sm90.cu), reached through decode_attention
// exactly as callers reach it, against the CPU backend's cpu::decode_attention_f32 on the same
// cache bytes and block tables; plus a probe of its building blocks (swizzled tiles, wgmma
// descriptors, accumulator mappings) against fp64 loops, and the dispatch decision.
//
// run_case below is test_decode.cu's adversarial harness (random block permutation, garbage
// table entries, 0xFF = NaN in every unused cache byte, padded request slots, NaN query rows
// between requests, out / lse / workspace poisoned before each call), copied so the two files
// can change independently; here it also checks that every plan takes the wgmma kernel when
// the GPU is an sm_90 one (on other GPUs the same cases test the mma.sync kernel).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/kernels.hpp"
#include "cuda/attention.cuh"
#include "cuda/decode_sm90.cuh"
#include "gpu.hpp"
#include "kmla/config.hpp"
#include "kmla/numeric.hpp"

namespace kmla::cuda {
namespace {

using test::DevBuf;

// Whether the current GPU is an sm_90 one, where the wgmma kernel must be chosen.
bool expect_sm90() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return false;
  return major == 9;
}

struct DecodeCase {
  CacheFormat format = CacheFormat::bf16;
  DType act = DType::bf16;
  int heads = 16;
  int block_size = 64;
  bool causal = true;
  bool q_fp8 = false;
  float q_scale = 1.0f;
  float k_scale = 1.0f;
  // Per request slot; query_len 0 makes a padded slot.
  std::vector<int> seq_lens;
  std::vector<int> query_lens;
  // Request slot whose last used block id is replaced by an id outside the cache (-1: none).
  int bad_block_request = -1;
  bool batch_invariant = false;  // plan in batch-invariant mode
  uint64_t seed = 1;
};

// Overrides applied to the plan (0 = keep plan_decode's choice).
struct PlanTweak {
  int num_splits = 0;
  int rows_per_cta = 0;
  bool shallow = false;  // force the 2-stage pipeline (two CTAs per SM) for 16-row tiles
};

// Spacing of representable act values at |x| (normal range), for the tolerance.
float act_ulp(DType act, float x) {
  const int mantissa_bits = act == DType::bf16 ? 7 : 10;
  if (!(x > 0.0f)) return 0.0f;
  return std::ldexp(1.0f, std::ilogb(x) - mantissa_bits);
}

float act_to_float(DType act, uint16_t v) {
  return act == DType::bf16 ? bf16_to_float(v) : fp16_to_float(v);
}

void run_case(const DecodeCase& c, const std::vector<PlanTweak>& tweaks) {
  ASSERT_EQ(c.seq_lens.size(), c.query_lens.size());
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const int R = int(c.seq_lens.size());
  const int H = c.heads, bs = c.block_size;

  // ---- block tables: a random permutation of the cache's blocks, garbage elsewhere ----
  std::vector<int> nblocks(R, 0);
  int used_blocks = 0, max_blocks = 1;
  for (int r = 0; r < R; ++r) {
    if (c.query_lens[r] == 0) continue;
    nblocks[r] = (c.seq_lens[r] + bs - 1) / bs;
    used_blocks += nblocks[r];
    max_blocks = std::max(max_blocks, nblocks[r] + 2);
  }
  const int num_blocks = used_blocks + 3;  // a few never-used (poisoned) blocks
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tables(size_t(R) * max_blocks);
  for (size_t i = 0; i < tables.size(); ++i)
    tables[i] = i % 2 ? int32_t(0x7fff0000 + int(i)) : -1000 - int(i);  // garbage
  int next = 0;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < nblocks[r]; ++b) tables[size_t(r) * max_blocks + b] = perm[next++];

  // ---- the host cache: all bytes 0xFF (NaN), then the used rows ----
  LatentCache cache = LatentCache::allocate(c.format, bs, num_blocks, c.k_scale);
  const size_t cache_bytes = size_t(cache.geometry().block_stride) * size_t(num_blocks);
  std::memset(cache.base(), 0xFF, cache_bytes);
  std::vector<float> row(kLatentDim);
  for (int r = 0; r < R; ++r) {
    if (c.query_lens[r] == 0) continue;
    for (int pos = 0; pos < c.seq_lens[r]; ++pos) {
      // Plain fp8: values up to 2 * k_scale so the codes span a few binades.
      const float amp = c.format == CacheFormat::fp8 ? 2.0f * c.k_scale : 1.0f;
      for (float& x : row) x = amp * uni(rng);
      const int32_t block = tables[size_t(r) * max_blocks + pos / bs];
      cache.write_row(int64_t(block) * bs + pos % bs, row.data());
    }
  }

  // ---- row layouts: compact for the reference, with gaps and padding on the device ----
  std::vector<int32_t> dev_start(R + 1), dev_qlens(c.query_lens.begin(), c.query_lens.end());
  std::vector<int32_t> dev_seq(c.seq_lens.begin(), c.seq_lens.end());
  std::vector<int64_t> ref_start(1, 0);
  int dev_rows = 0;
  for (int r = 0; r < R; ++r) {
    dev_start[r] = dev_rows;
    dev_rows += c.query_lens[r];
    if (c.query_lens[r] == 0) {
      dev_rows += 2;    // rows that belong to no request
      dev_seq[r] = 77;  // a padded slot with a length: must still be ignored
    } else {
      ref_start.push_back(ref_start.back() + c.query_lens[r]);
    }
  }
  dev_start[R] = dev_rows;
  dev_rows += 3;  // trailing padding rows (graph capacity)
  const int ref_rows = int(ref_start.back());

  // ---- q: random act values (or e4m3 codes); NaN on rows of no request ----
  const size_t q_elem = c.q_fp8 ? 1 : 2;
  std::vector<uint8_t> q_dev(size_t(dev_rows) * H * kLatentDim * q_elem, 0xFF);
  std::vector<float> q_ref(size_t(ref_rows) * H * kLatentDim);
  for (int r = 0, rr = 0; r < R; ++r) {
    if (c.query_lens[r] == 0) continue;
    for (int i = 0; i < c.query_lens[r]; ++i) {
      for (int64_t k = 0; k < int64_t(H) * kLatentDim; ++k) {
        const int64_t d = (int64_t(dev_start[r]) + i) * H * kLatentDim + k;
        const int64_t f = (ref_start[rr] + i) * H * kLatentDim + k;
        if (c.q_fp8) {
          const uint8_t code = float_to_e4m3_sat(4.0f * uni(rng));
          q_dev[size_t(d)] = code;
          q_ref[size_t(f)] = e4m3_to_float(code) * c.q_scale;
        } else {
          const float x = uni(rng);
          const uint16_t v = c.act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
          std::memcpy(&q_dev[size_t(d) * 2], &v, 2);
          q_ref[size_t(f)] = act_to_float(c.act, v);
        }
      }
    }
    ++rr;
  }

  // ---- the reference ----
  BatchMetadata md;
  md.block_size = bs;
  md.num_cache_blocks = num_blocks;
  md.causal_decode = c.causal;
  md.max_blocks_per_request = max_blocks;
  md.query_start = ref_start;
  for (int r = 0; r < R; ++r) {
    if (c.query_lens[r] == 0) continue;
    int64_t seq = c.seq_lens[r];
    // The kernel must treat the keys of a bad block as invisible; the bad block is the
    // request's last one, so with one query row that is the same as a shorter sequence.
    if (r == c.bad_block_request) seq = int64_t(nblocks[r] - 1) * bs;
    md.seq_lens.push_back(seq);
    md.query_lens.push_back(c.query_lens[r]);
    md.context_lens.push_back(int32_t(seq - c.query_lens[r]));
    md.block_tables.insert(md.block_tables.end(), tables.begin() + size_t(r) * max_blocks,
                           tables.begin() + size_t(r + 1) * max_blocks);
  }
  md.num_requests = md.num_decodes = int(md.seq_lens.size());
  const float softmax_scale = 1.0f / std::sqrt(192.0f);
  std::vector<float> out_ref(size_t(ref_rows) * H * kKvLoraRank), lse_ref(size_t(ref_rows) * H);
  const int threads = int(std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  cpu::decode_attention_f32(q_ref.data(), H, cache, md, softmax_scale, out_ref.data(),
                            lse_ref.data(), threads);

  if (c.bad_block_request >= 0) {
    const int r = c.bad_block_request;
    ASSERT_EQ(c.query_lens[r], 1) << "the bad-block reference needs one query row";
    tables[size_t(r) * max_blocks + nblocks[r] - 1] = num_blocks + 1000;
  }

  // ---- device inputs ----
  DevBuf<uint8_t> d_cache(cache_bytes);
  EXPECT_EQ(cudaMemcpy(d_cache.ptr, cache.base(), cache_bytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  DevBuf<uint8_t> d_q(q_dev);
  DevBuf<int32_t> d_tables(tables), d_seq(dev_seq), d_qlens(dev_qlens), d_start(dev_start);
  DevBuf<uint16_t> d_out(size_t(dev_rows) * H * kKvLoraRank);
  DevBuf<float> d_lse(size_t(dev_rows) * H);
  DevBuf<int> d_flag(1);

  DecodeParams p;
  p.q = d_q.ptr;
  p.q_fp8 = c.q_fp8;
  p.q_scale = c.q_scale;
  p.cache.base = reinterpret_cast<std::byte*>(d_cache.ptr);
  p.cache.block_stride = cache.geometry().block_stride;
  p.cache.block_size = bs;
  p.cache.num_blocks = num_blocks;
  p.cache.format = c.format;
  p.cache.k_scale = c.k_scale;
  p.batch.block_tables = d_tables.ptr;
  p.batch.seq_lens = d_seq.ptr;
  p.batch.query_lens = d_qlens.ptr;
  p.batch.query_start = d_start.ptr;
  p.batch.num_requests = R;
  p.batch.max_blocks = max_blocks;
  p.batch.num_rows = dev_rows;
  p.heads = H;
  p.causal = c.causal;
  p.softmax_scale = softmax_scale;
  p.act = c.act;
  p.out = d_out.ptr;
  p.lse = d_lse.ptr;
  p.error_flag = d_flag.ptr;

  const int max_qlen = *std::max_element(c.query_lens.begin(), c.query_lens.end());
  const int max_seq = *std::max_element(dev_seq.begin(), dev_seq.end());
  const int expected_flag = c.bad_block_request >= 0 ? kErrBadBlockId : 0;

  // Every speed variant of the kernel must give the same answers (DecodeSm90Options).
  const DecodeSm90Options saved = decode_sm90_options();
  struct Variant {
    const char* name;
    DecodeSm90Options opt;
  };
  // TMA copies only for block sizes that are multiples of 8 (100 stays on cp.async).
  std::vector<Variant> variants = {{"tma", {true, true, false}}};
  if (expect_sm90()) {
    variants.push_back({"cp.async", {true, false, false}});
    variants.push_back({"tma, no rescale skip", {false, true, false}});
    variants.push_back({"tma, wide S", {true, true, true}});
    variants.push_back({"cp.async, wide S, no rescale skip", {false, false, true}});
  }
  std::vector<std::pair<Variant, PlanTweak>> runs;
  for (const Variant& v : variants)
    for (const PlanTweak& t : tweaks) runs.emplace_back(v, t);
  for (const auto& [variant, tweak] : runs) {
    decode_sm90_set_options(variant.opt);
    DecodePlan plan = plan_decode(R, H, max_qlen, max_seq, false, c.batch_invariant);
    if (tweak.num_splits) plan.num_splits = tweak.num_splits;
    if (tweak.rows_per_cta) plan.rows_per_cta = tweak.rows_per_cta;
    if (tweak.shallow) plan.deep_pipeline = false;
    // The documented workspace layout: fp32 partial outputs and LSEs, 256-byte aligned parts.
    plan.workspace_bytes = std::max(
        plan.workspace_bytes,
        size_t(R) * max_qlen * H * plan.num_splits * (kKvLoraRank + 1) * sizeof(float) + 512);
    // The point of this file: these plans must take the wgmma kernel on an sm_90 GPU, and
    // the TMA variant must really copy by TMA where the block size allows it.
    if (expect_sm90()) {
      EXPECT_TRUE(decode_sm90_supports(p, plan)) << "not the sm90 kernel";
      int want = 0;  // the largest of 64, 32, 16, 8 keys dividing the block size
      for (int g = 64; variant.opt.tma && g >= 8 && want == 0; g /= 2)
        if (bs % g == 0) want = g;
      EXPECT_EQ(decode_sm90_tma_keys(p), want) << variant.name;
    }
    SCOPED_TRACE(::testing::Message() << variant.name << ", splits " << plan.num_splits
                                      << ", rows_per_cta "
                                      << plan.rows_per_cta << (plan.deep_pipeline ? ", deep" : "")
                                      << (c.batch_invariant ? ", invariant" : ""));
    DevBuf<uint8_t> d_ws(plan.workspace_bytes);
    d_ws.fill_bytes(0xFF);  // NaN partials: a split marked empty must not be read
    d_out.fill_bytes(0xFF);
    d_lse.fill_bytes(0xFF);
    d_flag.fill_bytes(0);
    decode_attention(p, plan, d_ws.ptr, nullptr);
    decode_sm90_set_options(saved);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> out = d_out.download();
    const std::vector<float> lse = d_lse.download();
    EXPECT_EQ(d_flag.download()[0], expected_flag);

    // Rows of no request stay poisoned.
    std::vector<bool> owned(size_t(dev_rows), false);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < c.query_lens[r]; ++i) owned[size_t(dev_start[r] + i)] = true;
    int poisoned_bad = 0;
    for (int t = 0; t < dev_rows; ++t) {
      if (owned[size_t(t)]) continue;
      for (int64_t k = 0; k < int64_t(H) * kKvLoraRank; ++k)
        poisoned_bad += out[size_t(int64_t(t) * H * kKvLoraRank + k)] != 0xFFFF;
      for (int h = 0; h < H; ++h) {
        uint32_t bits;
        std::memcpy(&bits, &lse[size_t(t) * H + h], 4);
        poisoned_bad += bits != 0xFFFFFFFFu;
      }
    }
    EXPECT_EQ(poisoned_bad, 0) << "elements written on rows of no request";

    int failures = 0;
    double worst = 0.0;
    for (int r = 0, rr = 0; r < R; ++r) {
      if (c.query_lens[r] == 0) continue;
      for (int i = 0; i < c.query_lens[r]; ++i) {
        for (int h = 0; h < H; ++h) {
          const int64_t d = (int64_t(dev_start[r]) + i) * H + h;
          const int64_t f = (ref_start[rr] + i) * H + h;
          const float* ref = &out_ref[size_t(f) * kKvLoraRank];
          const float lr = lse_ref[size_t(f)], lg = lse[size_t(d)];
          // LSE: -inf exactly where the reference has no keys; else 1e-3 absolute (fp32
          // sums in another order plus the hardware exp2/log2: ~1e-6 relative).
          const bool lse_ok = std::isinf(lr) ? (std::isinf(lg) && lg < 0)
                                             : (std::isfinite(lg) && std::fabs(lg - lr) <= 1e-3f);
          // Output: the kernel rounds P to act before P V (relative error <= 2^-9 bf16 /
          // 2^-12 f16 per probability, so at most that fraction of the row's magnitude after
          // averaging) and the output once (half an ulp); 2 ulps of the row's largest
          // |value| covers both with a margin. Rows without keys must be exactly 0.
          float amax = 0.0f;
          for (int k = 0; k < kKvLoraRank; ++k) amax = std::max(amax, std::fabs(ref[k]));
          const float tol = 2.0f * act_ulp(c.act, amax);
          bool out_ok = true;
          for (int k = 0; k < kKvLoraRank; ++k) {
            const float g = act_to_float(c.act, out[size_t(d * kKvLoraRank + k)]);
            const double err = std::fabs(double(g) - ref[k]);
            if (!std::isfinite(g) || err > tol) out_ok = false;
            if (amax > 0) worst = std::max(worst, err / amax);
          }
          if ((!lse_ok || !out_ok) && ++failures <= 5) {
            ADD_FAILURE() << "request " << r << " token " << i << " head " << h << ": lse " << lg
                          << " vs " << lr << ", out[0] "
                          << act_to_float(c.act, out[size_t(d * kKvLoraRank)]) << " vs " << ref[0]
                          << " (tol " << tol << ")";
          }
        }
      }
      ++rr;
    }
    EXPECT_EQ(failures, 0) << "worst error / row magnitude " << worst;
  }
}

// Splits: the plan's choice, one (direct output), a few, and more than a short request has
// 64-key tiles (empty splits write LSE -inf only). rows_per_cta stays 64: the wgmma tile.
const std::vector<PlanTweak> kSm90Tweaks = {{0, 0}, {1, 0}, {3, 0}, {40, 0}};

TEST(CudaDecodeSm90, Bf16Heads128MixedLengths) {
  KMLA_REQUIRE_GPU();
  DecodeCase c;
  c.heads = 128;
  c.block_size = 64;
  c.seq_lens = {1, 63, 900, 64, 65, 1000, 4100};
  c.query_lens = {1, 1, 0, 1, 1, 1, 1};
  c.seed = 11;
  run_case(c, kSm90Tweaks);
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
  run_case(c, kSm90Tweaks);
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
  run_case(c, kSm90Tweaks);
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
  run_case(c, kSm90Tweaks);
  c.heads = 48;
  c.block_size = 16;
  c.seq_lens = {3, 4, 63, 65, 1000};
  c.query_lens = {3, 3, 3, 2, 3};
  c.seed = 15;
  run_case(c, kSm90Tweaks);
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
  run_case(c, kSm90Tweaks);
  c.block_size = 256;  // the same shape from large blocks, f16
  c.format = CacheFormat::fp16;
  c.act = DType::f16;
  c.seed = 32;
  run_case(c, kSm90Tweaks);
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
  run_case(c, kSm90Tweaks);
  c.heads = 11;
  c.block_size = 8;  // TMA groups of 8 keys, 8 blocks per 64-key tile
  c.seq_lens = {5, 6, 64, 68, 0, 1500};
  c.query_lens = {5, 5, 5, 4, 0, 5};
  c.seed = 34;
  run_case(c, kSm90Tweaks);
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
  run_case(c, kSm90Tweaks);
  c.block_size = 32;  // TMA groups of 32 keys
  c.seed = 36;
  run_case(c, kSm90Tweaks);
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
  run_case(c, {{0, 0}, {1, 0}, {4, 0}});
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
  p.heads = 16;
  plan = plan_decode(16, 16, 2, 4096, false);  // 32 rows
  EXPECT_FALSE(decode_sm90_supports(p, plan));
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
  for (DType act : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(act));
    std::mt19937_64 rng(act == DType::bf16 ? 21 : 22);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f), unit(0.0f, 1.0f);
    const auto to_act = [&](float x) {
      return act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
    };
    std::vector<uint16_t> q(64 * kLatentDim), k(64 * kLatentDim);
    std::vector<float> qf(q.size()), kf(k.size()), p(64 * 64), pr(p.size());
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
    DevBuf<float> d_p(p), d_s(64 * 64), d_o(64 * kKvLoraRank);
    d_s.fill_bytes(0xFF);
    d_o.fill_bytes(0xFF);
    decode_sm90_probe(act, d_q.ptr, d_k.ptr, d_p.ptr, d_s.ptr, d_o.ptr, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> s = d_s.download(), o = d_o.download();
    int bad = 0;
    for (int i = 0; i < 64; ++i) {
      for (int j = 0; j < 64; ++j) {
        double ref = 0.0, mag = 0.0;
        for (int d = 0; d < kLatentDim; ++d) {
          ref += double(qf[i * kLatentDim + d]) * kf[j * kLatentDim + d];
          mag += std::fabs(double(qf[i * kLatentDim + d]) * kf[j * kLatentDim + d]);
        }
        // fp32 accumulation of 576 exact products: a few 2^-24 of the magnitude sum; 1e-4
        // leaves room for the tensor cores' internal alignment and order, and is still ~100x
        // below what one misplaced 8-element chunk or row changes.
        const float got = s[i * 64 + j];
        if (!(std::fabs(got - ref) <= 1e-4 * mag + 1e-6) && ++bad <= 5)
          ADD_FAILURE() << "S[" << i << "][" << j << "] = " << got << ", want " << ref;
      }
    }
    for (int i = 0; i < 64; ++i) {
      for (int c = 0; c < kKvLoraRank; ++c) {
        double ref = 0.0, mag = 0.0;
        for (int j = 0; j < 64; ++j) {
          ref += double(pr[i * 64 + j]) * kf[j * kLatentDim + c];
          mag += std::fabs(double(pr[i * 64 + j]) * kf[j * kLatentDim + c]);
        }
        const float got = o[i * kKvLoraRank + c];  // same fp32 accumulation bound as S
        if (!(std::fabs(got - ref) <= 1e-4 * mag + 1e-6) && ++bad <= 10)
          ADD_FAILURE() << "O[" << i << "][" << c << "] = " << got << ", want " << ref;
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

}  // namespace
}  // namespace kmla::cuda
