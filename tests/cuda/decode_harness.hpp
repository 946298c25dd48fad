// The adversarial decode harness shared by test_decode.cu (the mma.sync kernel, the
// scheduler) and test_decode_sm90.cu (the wgmma kernel): run_case builds a paged cache and
// batch from a DecodeCase, runs decode_attention under each PlanTweak and compares every row
// with the CPU backend's cpu::decode_attention_f32 on the same cache bytes and block tables.
//
// Every case is adversarial: block ids are a random permutation of the cache, unused
// block-table entries hold garbage (huge and negative ids), every unused cache byte is 0xFF
// (NaN in all four formats), a padded request slot (query_len 0, nonzero seq_len, a table of
// garbage) sits between real requests, the query rows between and after the requests are
// NaN, and out / lse start as NaN so unwritten rows are caught; rows that belong to no
// request must still be NaN afterwards, and the error flag must stay 0.
//
// The reference metadata is built by hand (not with plan_batch) because the cases need
// what plan_batch does not produce: seq_len 1 (no context), seq_len 0, garbage table
// entries and padded slots with gaps in the row layout.
//
// Test hook: after plan_decode a caller may overwrite the schedule, num_splits (1..1024),
// num_workers (1..1024), the scheduler costs and rows_per_cta (16, 32, 64) as long as
// workspace_bytes covers decode_workspace_bytes; the tests force the per-request schedule
// with 1, several and hundreds of splits, the balanced one with 1 to 1000 workers, and
// every row tile size this way.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/kernels.hpp"
#include "cuda/attention.cuh"
#include "cuda/decode_sched.cuh"
#include "gpu.hpp"
#include "kmla/config.hpp"
#include "kmla/numeric.hpp"

namespace kmla::cuda {

using test::DevBuf;

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
  // > 0: cache row element k of position pos is scaled by 2^(spread * ((k / 128 + pos) % 4)),
  // so fp8_ds_mla tile scales differ between the column groups of a row and between keys.
  float column_spread = 0.0f;
  TileScaleRule tile_rule = TileScaleRule::power_of_two;  // fp8_ds_mla tile scales
  // fp8_ds_mla, lo < hi: every written row's 4 tile scales are replaced by 2^e, e uniform in
  // [lo, hi] per key and group (the codes stay, so the values become code * 2^e; the writer
  // itself never goes below 2^-13).
  int ds_scale_exp_lo = 0, ds_scale_exp_hi = 0;
  float q_code_amp = 1.0f;  // q's 512 code-part columns are scaled by this (RoPE part not)
  // p.out this many elements into its buffer (4: 8-byte aligned, not 16); the elements
  // before it must stay poisoned.
  int out_offset = 0;
  uint64_t seed = 1;
};

// Overrides applied to the plan (0 / -1 = keep plan_decode's choice).
struct PlanTweak {
  int num_splits = 0;  // > 0: the per-request schedule with this many splits
  int rows_per_cta = 0;
  bool deep = false;  // force the deep pipeline for 16-row tiles (where the GPU fits it)
  int workers = 0;    // > 0: the balanced schedule with this many workers
  int min_keys = -1;  // balanced: DecodePlan::sched_min_keys
  int nosplit_keys = -1;
  int pair_keys = -1;
  bool pdl = false;  // launch the combine as a programmatic dependent (sm_90)
  int fp8_ctas = 0;  // > 0: DecodePlan::fp8_ctas_per_sm (the fp8 formats' 16-row kernels)
  bool request_order = false;  // DecodePlan::pass_major off (the default walk is in pass order)
  int fused =
      -1;  // 0 / 1: DecodePlan::fused_combine (balanced plans merge cut pairs in the split kernel)
};

// Whether this GPU fits the deep pipeline's ~210 KB CTA (Hopper: 227 KB per block).
inline bool gpu_fits_deep_pipeline() {
  int device = 0, optin = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
            cudaSuccess);
  return optin >= 227 * 1024;
}

// Spacing of representable act values at |x| (normal range), for the tolerance.
inline float act_ulp(DType act, float x) {
  const int mantissa_bits = act == DType::bf16 ? 7 : 10;
  if (!(x > 0.0f)) return 0.0f;
  return std::ldexp(1.0f, std::ilogb(x) - mantissa_bits);
}

inline float act_to_float(DType act, uint16_t v) {
  return act == DType::bf16 ? bf16_to_float(v) : fp16_to_float(v);
}

// Whether KMLA_DECODE_SCHEDULE overrides plan_decode's choice (an A/B run of the tests).
inline bool schedule_forced() {
  const char* v = std::getenv("KMLA_DECODE_SCHEDULE");
  return v && *v;
}

// What a caller adds to run_case: a label for its failure messages and a check of every
// plan (after the tweaks) before it runs.
// `run`, when set, replaces the plain decode_attention call (e.g. a graph replay); it must
// leave the result of `p` in p.out / p.lse and may use the workspace as it likes.
struct CaseHooks {
  std::string label;
  std::function<void(const DecodeParams&, const DecodePlan&)> check_plan;
  std::function<void(const DecodeParams&, const DecodePlan&, void* workspace)> run;
};

inline void run_case(const DecodeCase& c, const std::vector<PlanTweak>& tweaks,
                     const CaseHooks& hooks = {}) {
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
  LatentCache cache = LatentCache::allocate(c.format, bs, num_blocks, c.k_scale, c.tile_rule);
  const size_t cache_bytes = size_t(cache.geometry().block_stride) * size_t(num_blocks);
  std::memset(cache.base(), 0xFF, cache_bytes);
  std::vector<float> row(kLatentDim);
  for (int r = 0; r < R; ++r) {
    if (c.query_lens[r] == 0) continue;
    for (int pos = 0; pos < c.seq_lens[r]; ++pos) {
      // Plain fp8: values up to 2 * k_scale so the codes span a few binades.
      const float amp = c.format == CacheFormat::fp8 ? 2.0f * c.k_scale : 1.0f;
      for (float& x : row) x = amp * uni(rng);
      if (c.column_spread > 0.0f)
        for (int k = 0; k < kLatentDim; ++k)
          row[size_t(k)] *= std::exp2(c.column_spread * float((k / 128 + pos) % 4));
      const int32_t block = tables[size_t(r) * max_blocks + pos / bs];
      cache.write_row(int64_t(block) * bs + pos % bs, row.data());
      if (c.format == CacheFormat::fp8_ds_mla && c.ds_scale_exp_lo < c.ds_scale_exp_hi) {
        std::uniform_int_distribution<int> exp(c.ds_scale_exp_lo, c.ds_scale_exp_hi);
        float scales[kDsMlaTiles];
        for (float& sc : scales) sc = std::ldexp(1.0f, exp(rng));
        std::memcpy(cache.slot_ptr(int64_t(block) * bs + pos % bs) + kDsMlaScaleOffset, scales,
                    sizeof scales);
      }
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
          const float x = uni(rng) * (k % kLatentDim < kKvLoraRank ? c.q_code_amp : 1.0f);
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
  DevBuf<uint16_t> d_out(size_t(dev_rows) * H * kKvLoraRank + c.out_offset);
  // The output rows (past the offset); the elements before them untouched.
  auto download_out = [&] {
    std::vector<uint16_t> out = d_out.download();
    for (int i = 0; i < c.out_offset; ++i)
      EXPECT_EQ(out[size_t(i)], 0xFFFF) << "written before the output, element " << i;
    out.erase(out.begin(), out.begin() + c.out_offset);
    return out;
  };
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
  p.cache.tile_rule = c.tile_rule;
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
  p.out = d_out.ptr + c.out_offset;
  p.lse = d_lse.ptr;
  p.error_flag = d_flag.ptr;

  const int max_qlen = *std::max_element(c.query_lens.begin(), c.query_lens.end());
  const int max_seq = *std::max_element(dev_seq.begin(), dev_seq.end());
  const int expected_flag = c.bad_block_request >= 0 ? kErrBadBlockId : 0;

  // The checks of one run: rows of no request untouched, every row against the oracle.
  auto verify = [&](const std::vector<uint16_t>& out, const std::vector<float>& lse) {
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
  };

  for (const PlanTweak& tweak : tweaks) {
    DecodePlan plan = plan_decode(R, H, max_qlen, max_seq, false, c.batch_invariant, c.format);
    if (!c.batch_invariant && !schedule_forced())  // what plan_decode picks here
      EXPECT_EQ(plan.schedule, R > 1 ? DecodeSchedule::balanced : DecodeSchedule::per_request);
    if (tweak.num_splits) {
      plan.schedule = DecodeSchedule::per_request;
      plan.num_splits = tweak.num_splits;
    }
    if (tweak.workers) {
      plan.schedule = DecodeSchedule::balanced;
      plan.num_workers = tweak.workers;
    }
    if (tweak.min_keys >= 0) plan.sched_min_keys = tweak.min_keys;
    if (tweak.nosplit_keys >= 0) plan.sched_nosplit_keys = tweak.nosplit_keys;
    if (tweak.pair_keys >= 0) plan.sched_pair_keys = tweak.pair_keys;
    if (tweak.rows_per_cta) plan.rows_per_cta = tweak.rows_per_cta;
    if (tweak.pdl) plan.programmatic_combine = true;
    if (tweak.fp8_ctas) plan.fp8_ctas_per_sm = tweak.fp8_ctas;
    if (tweak.request_order) plan.pass_major = false;
    if (tweak.fused >= 0) plan.fused_combine = tweak.fused != 0;
    if (tweak.deep) {
      if (!gpu_fits_deep_pipeline()) continue;
      plan.deep_pipeline = true;
    }
    plan.workspace_bytes = decode_workspace_bytes(plan, R, H);
    if (hooks.check_plan) hooks.check_plan(p, plan);
    const bool balanced = plan.schedule == DecodeSchedule::balanced;
    SCOPED_TRACE(::testing::Message()
                 << hooks.label << (hooks.label.empty() ? "" : ", ")
                 << (balanced ? "balanced, workers " : "per request, splits ")
                 << (balanced ? plan.num_workers : plan.num_splits) << " (min "
                 << plan.sched_min_keys << ", nosplit " << plan.sched_nosplit_keys << ", pair "
                 << plan.sched_pair_keys << " keys), rows_per_cta " << plan.rows_per_cta
                 << (plan.deep_pipeline ? ", deep" : "") << (c.batch_invariant ? ", invariant" : "")
                 << ", fp8 CTAs/SM " << plan.fp8_ctas_per_sm
                 << (plan.pass_major ? "" : ", request order")
                 << (plan.fused_combine ? ", fused combine" : ""));
    DevBuf<uint8_t> d_ws(plan.workspace_bytes);
    d_ws.fill_bytes(0xFF);  // NaN partials: a split marked empty must not be read
    d_out.fill_bytes(0xFF);
    d_lse.fill_bytes(0xFF);
    d_flag.fill_bytes(0);
    // Balanced plans: the walk's starts made on the host, as the layer and the stage make
    // them; the repeat below finds them on the device instead and must give the same bits.
    DecodeParams pt = p;
    std::vector<uint8_t> walk(decode_walk_table_bytes(plan, R));  // none for per-request plans
    pt.walk_key_tile = decode_walk_table(plan, H, c.causal, c.format, R, dev_seq.data(),
                                         dev_qlens.data(), walk.data());
    DevBuf<uint8_t> d_walk(walk);
    pt.walk_table = d_walk.ptr;  // (ignored with key tile 0)
    if (hooks.run)
      hooks.run(pt, plan, d_ws.ptr);
    else
      decode_attention(pt, plan, d_ws.ptr, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> out = download_out();
    const std::vector<float> lse = d_lse.download();
    EXPECT_EQ(d_flag.download()[0], expected_flag);
    // Again on the same workspace (what the first run left there), the walk's starts found
    // on the device: the kernels are deterministic and the starts the same, so the bits must
    // repeat. A table with lockstep sections (mixed row tile counts, decode_sched.cuh) walks
    // in another order than the device's own walk: then the oracle checks both runs.
    const bool sectioned =
        pt.walk_key_tile != 0 && reinterpret_cast<const WalkTableHead*>(walk.data())->sections > 0;
    d_out.fill_bytes(0xFF);
    d_lse.fill_bytes(0xFF);
    decode_attention(p, plan, d_ws.ptr, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> out2 = download_out();
    const std::vector<float> lse2 = d_lse.download();
    if (!sectioned)
      EXPECT_TRUE(out2 == out &&
                  std::memcmp(lse2.data(), lse.data(), lse.size() * sizeof(float)) == 0)
          << "a second run on the same workspace gave other bits";
    verify(out, lse);
    if (sectioned) {
      SCOPED_TRACE("the device's own walk (no table)");
      verify(out2, lse2);
    }
  }
}

}  // namespace kmla::cuda
