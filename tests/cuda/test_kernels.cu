// The elementwise CUDA kernels (src/cuda/kernels.cu) against host references built from the
// CPU backend's code paths: RowCodec via a host LatentCache of the same geometry,
// RopeTable::rotate, cpu::merge_attn_f32, cpu::e4m3_roundtrip, and the formulas of
// rms_norm_rows and the gate written out below. Bit-exact wherever the CPU is exact fp32;
// ulp-level where the GPU sums in another order (RMSNorm) or uses CUDA's expf/logf.
// Outputs are poisoned before each call so unwritten elements show up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/kernels.hpp"
#include "cuda/gpu.hpp"
#include "cuda/kernels.cuh"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/numeric.hpp"
#include "kmla/rope.hpp"

namespace kmla {
namespace {

namespace cu = kmla::cuda;
using test::DevBuf;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- act codes on the host ---------------------------------------------------------------
uint16_t to_act(float x, DType act) {
  return act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
}
float from_act(uint16_t c, DType act) {
  return act == DType::bf16 ? bf16_to_float(c) : fp16_to_float(c);
}
bool act_is_nan(uint16_t c, DType act) { return std::isnan(from_act(c, act)); }

// Distance in representable values between two codes (sign-magnitude -> ordered integers);
// 0 when both are NaN.
int act_ulps(uint16_t a, uint16_t b, DType act) {
  if (act_is_nan(a, act) || act_is_nan(b, act))
    return act_is_nan(a, act) && act_is_nan(b, act) ? 0 : 1 << 20;
  auto ordered = [](uint16_t c) { return c & 0x8000 ? -int(c & 0x7fff) : int(c & 0x7fff); };
  return std::abs(ordered(a) - ordered(b));
}

// Same value: equal codes, or both NaN (payloads may differ between conversion routes).
bool same_act(uint16_t a, uint16_t b, DType act) { return act_ulps(a, b, act) == 0; }

std::vector<uint16_t> random_act(size_t n, std::mt19937& rng, float lo, float hi, DType act) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_act(d(rng), act);
  return v;
}

uint32_t bits(float f) { return float_bits(f); }

void sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

// ---- RMSNorm ------------------------------------------------------------------------------

// rms_norm_rows of src/cpu/layer.cpp on act codes (sequential fp32 sum).
void rms_norm_ref(uint16_t* x, int64_t rows, int64_t stride, int n, const uint16_t* w, float eps,
                  DType act) {
  for (int64_t t = 0; t < rows; ++t) {
    uint16_t* r = x + t * stride;
    float ss = 0.0f;
    for (int i = 0; i < n; ++i) ss += from_act(r[i], act) * from_act(r[i], act);
    const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
    for (int i = 0; i < n; ++i) r[i] = to_act(from_act(r[i], act) * inv * from_act(w[i], act), act);
  }
}

TEST(CudaKernels, RmsNormTwoSegmentsInOneLaunch) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(11);
  const int64_t rows = 37;  // odd: the last block has 5 of its 8 warps idle
  const float eps = 1e-6f;
  struct Case {
    DType act;
    int64_t stride, b_offset;
    int a_n, b_n;
  };
  // [q_c 1536 | kv_c 512 | k_pe 64 | spare]: the first case is 16-byte aligned (the register
  // path: 6 and 2 chunks per lane), the second puts kv_c one element off and the stride odd
  // (scalar path for both), the third skips segment b (n = 0) and must leave it untouched, the
  // fourth has a row too long for registers (2312 = 9 chunks x 256 + 8: the two-pass vector
  // path) and a b of 392 (49 chunks at 2 per lane: lane 24 has one, lanes 25-31 none).
  for (const Case c :
       {Case{DType::bf16, 2120, 1536, 1536, 512}, Case{DType::f16, 2121, 1537, 1536, 512},
        Case{DType::bf16, 2120, 1536, 1536, 0}, Case{DType::bf16, 2720, 2320, 2312, 392}}) {
    SCOPED_TRACE(testing::Message()
                 << "stride " << c.stride << " a_n " << c.a_n << " b_n " << c.b_n);
    std::vector<uint16_t> x = random_act(size_t(rows * c.stride), rng, -3.0f, 3.0f, c.act);
    const std::vector<uint16_t> wa = random_act(size_t(c.a_n), rng, 0.5f, 1.5f, c.act);
    const std::vector<uint16_t> wb = random_act(512, rng, 0.5f, 1.5f, c.act);
    DevBuf<uint16_t> dx(x), dwa(wa), dwb(wb);
    cu::NormSegment a{dx.ptr, c.stride, c.a_n, dwa.ptr};
    cu::NormSegment b{dx.ptr + c.b_offset, c.stride, c.b_n, dwb.ptr};
    cu::rms_norm(a, b, rows, eps, c.act, nullptr);
    sync();
    const std::vector<uint16_t> got = dx.download();
    rms_norm_ref(x.data(), rows, c.stride, c.a_n, wa.data(), eps, c.act);
    if (c.b_n) rms_norm_ref(x.data() + c.b_offset, rows, c.stride, c.b_n, wb.data(), eps, c.act);
    int worst = 0, differing = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const int64_t col = int64_t(i) % c.stride;
      const bool normed = col < c.a_n || (col >= c.b_offset && col < c.b_offset + c.b_n);
      const int d = act_ulps(got[i], x[i], c.act);
      if (!normed) ASSERT_EQ(got[i], x[i]) << "column " << col << " outside both segments";
      worst = std::max(worst, d);
      differing += d != 0;
    }
    // The warp sums sum(x^2) in another order than the CPU's left-to-right loop: 1/rms moves
    // by a few fp32 ulps, which can flip the final act rounding by one ulp, never more.
    EXPECT_LE(worst, 1);
    // A wrong formula differs almost everywhere; the order effect touches a few percent.
    EXPECT_LT(differing, int(x.size() / 20));
  }
}

// ---- RoPE -------------------------------------------------------------------------------

TEST(CudaKernels, RopeMatchesRopeTableRotate) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(12);
  const MlaConfig cfg = MlaConfig::preset("deepseek-v3");  // YaRN: cos/sin carry the mscale
  const auto table = RopeTable::build(cfg, 4096);
  DevBuf<float> dtable(std::vector<float>(table->row(0), table->row(0) + 4096 * kRopeDim));
  const int64_t rows = 9, q_f32_rows = 4;
  const int heads = 3;
  const int64_t q_stride = heads * kQkHeadDim + 8, k_stride = kRopeDim + 8;
  for (const bool bad : {false, true}) {
    const DType act = bad ? DType::f16 : DType::bf16;
    SCOPED_TRACE(testing::Message() << "bad positions " << bad);
    std::vector<int64_t> pos(rows);
    for (auto& p : pos) p = std::uniform_int_distribution<int64_t>(0, 4095)(rng);
    if (bad) pos[5] = 4096, pos[7] = -1;  // both rotate by row 0 and raise the flag
    const std::vector<uint16_t> q = random_act(size_t(rows * q_stride), rng, -2, 2, act);
    const std::vector<uint16_t> k_pe = random_act(size_t(rows * k_stride), rng, -2, 2, act);
    DevBuf<int64_t> dpos(pos);
    DevBuf<uint16_t> dq(q), dk_pe(k_pe), dk_act(size_t(rows * kRopeDim));
    DevBuf<float> dq_f32(size_t(rows * heads * kRopeDim)), dk_f32(size_t(rows * kRopeDim));
    DevBuf<int> flag(1);
    dk_act.fill_bytes(0xFF);
    dq_f32.fill_bytes(0xFF);
    dk_f32.fill_bytes(0xFF);
    flag.fill_bytes(0);
    cu::RopeParams p;
    p.table = dtable.ptr;
    p.table_rows = 4096;
    p.positions = dpos.ptr;
    p.rows = rows;
    p.q = dq.ptr;
    p.q_stride = q_stride;
    p.heads = heads;
    p.q_f32 = dq_f32.ptr;
    p.q_f32_rows = q_f32_rows;
    p.k_pe = dk_pe.ptr;
    p.k_stride = k_stride;
    p.k_act = dk_act.ptr;
    p.k_f32 = dk_f32.ptr;
    p.act = act;
    p.error_flag = flag.ptr;
    cu::rope(p, nullptr);
    sync();

    std::vector<uint16_t> q_ref = q, k_act_ref(size_t(rows * kRopeDim));
    std::vector<float> q_f32_ref(size_t(rows * heads * kRopeDim), bits_float(0xffffffffu));
    std::vector<float> k_f32_ref(size_t(rows * kRopeDim));
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t p_t = pos[t] >= 0 && pos[t] < 4096 ? pos[t] : 0;
      float x[kRopeDim];
      for (int h = 0; h < heads; ++h) {
        uint16_t* qr = q_ref.data() + t * q_stride + h * kQkHeadDim + kNopeDim;
        for (int j = 0; j < kRopeDim; ++j) x[j] = from_act(qr[j], act);
        table->rotate(x, p_t);
        for (int j = 0; j < kRopeDim; ++j) qr[j] = to_act(x[j], act);
        if (t < q_f32_rows)
          std::copy(x, x + kRopeDim, q_f32_ref.begin() + (t * heads + h) * kRopeDim);
      }
      for (int j = 0; j < kRopeDim; ++j) x[j] = from_act(k_pe[size_t(t * k_stride + j)], act);
      table->rotate(x, p_t);
      for (int j = 0; j < kRopeDim; ++j) {
        k_act_ref[size_t(t * kRopeDim + j)] = to_act(x[j], act);
        k_f32_ref[size_t(t * kRopeDim + j)] = x[j];
      }
    }
    // All bit-exact: the same fp32 products and differences (no FMA) of the same inputs.
    EXPECT_EQ(dq.download(), q_ref);  // nope parts and padding untouched, rope parts rotated
    EXPECT_EQ(dk_pe.download(), k_pe);
    EXPECT_EQ(dk_act.download(), k_act_ref);
    const std::vector<float> q_f32 = dq_f32.download(), k_f32 = dk_f32.download();
    for (size_t i = 0; i < q_f32.size(); ++i)
      ASSERT_EQ(bits(q_f32[i]), bits(q_f32_ref[i])) << "q_f32 " << i;  // rows >= 4 stay poisoned
    for (size_t i = 0; i < k_f32.size(); ++i)
      ASSERT_EQ(bits(k_f32[i]), bits(k_f32_ref[i])) << "k_f32 " << i;
    EXPECT_EQ(flag.download()[0], bad ? int(cu::kErrBadPosition) : 0);
  }
}

// ---- cache insert -----------------------------------------------------------------------

struct FormatCase {
  CacheFormat format;
  TileScaleRule rule;
  DType act;
  float k_scale;
  bool rope_f32;  // the plain fp8 path writes the unrounded fp32 rotation
  const char* name;
};
const FormatCase kFormats[] = {
    {CacheFormat::bf16, TileScaleRule::power_of_two, DType::bf16, 1.0f, false, "bf16"},
    {CacheFormat::fp16, TileScaleRule::power_of_two, DType::f16, 1.0f, false, "fp16"},
    {CacheFormat::fp8, TileScaleRule::power_of_two, DType::bf16, 0.75f, true, "fp8"},
    {CacheFormat::fp8_ds_mla, TileScaleRule::power_of_two, DType::bf16, 1.0f, false, "ds_mla pow2"},
    {CacheFormat::fp8_ds_mla, TileScaleRule::amax_448, DType::bf16, 1.0f, false, "ds_mla amax"},
};

// Index of the first differing byte, or -1.
int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return int64_t(i);
  return -1;
}

TEST(CudaKernels, CacheInsertEncodesLikeRowCodec) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(13);
  const int64_t T = 21;
  for (const FormatCase& f : kFormats) {
    for (const int bs : {1, 16, 64, 100}) {
      SCOPED_TRACE(testing::Message() << f.name << " block size " << bs);
      const DType act = f.act;
      const int64_t nb = std::max<int64_t>(2, 64 / bs + 1), slots = nb * bs;
      const int64_t entry = int64_t(cache_entry_bytes(f.format));
      const int64_t stride = bs * entry + 32;  // a gap between blocks that must stay untouched
      std::vector<uint8_t> poison(size_t(nb * stride));
      for (auto& b : poison) b = uint8_t(rng());

      // kv rows as the fused front end lays them out ([kv_c | k_pe | spare] per row); the
      // block size 100 case starts one element in (the scalar load path).
      const int64_t kv_stride = kLatentDim + 8, kv_off = bs == 100 ? 1 : 0;
      std::vector<uint16_t> kv = random_act(size_t(T * kv_stride + 1), rng, -4, 4, act);
      uint16_t* k0 = kv.data() + kv_off;
      const float huge = act == DType::f16 ? 60000.0f : 3e38f;
      for (int i = 128; i < 256; ++i) k0[i] = to_act(0.0f, act);  // row 0, tile 1: amax 0
      k0[kv_stride + 300] = to_act(kNaN, act);                    // row 1: NaN
      k0[2 * kv_stride + 5] = to_act(huge, act);                  // row 2: saturates
      k0[3 * kv_stride + 400] = to_act(kInf, act);                // row 3: inf
      for (int i = 0; i < kKvLoraRank; ++i)                       // row 5: below the 1e-4 floor
        k0[5 * kv_stride + i] = to_act(1e-6f * float(i % 7 - 3), act);
      for (int i = 256; i < 384; ++i)  // row 6, tile 2: amax 224 = 448 / 2, an exact power of two
        k0[6 * kv_stride + i] = to_act(i == 300 ? -224.0f : float(i % 5), act);
      const int64_t rope_stride = f.rope_f32 ? kRopeDim : kRopeDim + 8;
      std::vector<float> rope_f(size_t(T * rope_stride));
      std::uniform_real_distribution<float> ud(-3, 3);
      for (auto& r : rope_f) r = ud(rng);
      rope_f[size_t(rope_stride + 10)] = kNaN;  // row 1 rope
      std::vector<uint16_t> rope_a(rope_f.size());
      for (size_t i = 0; i < rope_f.size(); ++i) rope_a[i] = to_act(rope_f[i], act);

      std::vector<int64_t> slot(static_cast<size_t>(slots));
      std::iota(slot.begin(), slot.end(), 0);
      std::shuffle(slot.begin(), slot.end(), rng);
      slot.resize(size_t(T));
      slot[4] = -1;
      slot[9] = -1;
      slot[13] = slots;  // one past the end: flag, no write
      slot[20] = slots - 1;
      if (std::count(slot.begin(), slot.begin() + 20, slots - 1)) slot[20] = -1;

      DevBuf<uint8_t> dcache(poison);
      DevBuf<uint16_t> dkv(kv), drope_a(rope_a);
      DevBuf<float> drope_f(rope_f);
      DevBuf<int64_t> dslots(slot);
      DevBuf<int> flag(1);
      flag.fill_bytes(0);
      const LatentCache dev = LatentCache::borrow(dcache.ptr, Device::cuda, f.format, bs, nb,
                                                  stride, f.k_scale, f.rule);
      cu::CacheInsertParams p;
      p.kv = dkv.ptr + kv_off;
      p.kv_stride = kv_stride;
      p.rope = f.rope_f32 ? static_cast<const void*>(drope_f.ptr) : drope_a.ptr;
      p.rope_stride = rope_stride;
      p.rope_f32 = f.rope_f32;
      p.act = act;
      p.slots = dslots.ptr;
      p.rows = T;
      p.cache = cu::cache_ref(dev);
      p.error_flag = flag.ptr;
      cu::cache_insert(p, nullptr);
      sync();

      std::vector<uint8_t> expect = poison;
      const LatentCache host = LatentCache::borrow(expect.data(), Device::cpu, f.format, bs, nb,
                                                   stride, f.k_scale, f.rule);
      for (int64_t t = 0; t < T; ++t) {
        if (slot[size_t(t)] < 0 || slot[size_t(t)] >= slots) continue;
        float row[kLatentDim];
        for (int i = 0; i < kKvLoraRank; ++i) row[i] = from_act(k0[t * kv_stride + i], act);
        for (int j = 0; j < kRopeDim; ++j)
          row[kKvLoraRank + j] = f.rope_f32 ? rope_f[size_t(t * rope_stride + j)]
                                            : from_act(rope_a[size_t(t * rope_stride + j)], act);
        host.write_row(slot[size_t(t)], row);
      }
      // Bit-exact: every byte of the cache, gaps and unwritten rows included.
      const int64_t at = first_difference(dcache.download(), expect);
      EXPECT_EQ(at, -1) << "block " << at / stride << " row " << at % stride / entry << " byte "
                        << at % stride % entry;
      EXPECT_EQ(flag.download()[0], int(cu::kErrBadSlot));
    }
  }
}

// rms_norm with a cache insert writes what a norm launch followed by cache_insert writes: the
// same normalised rows in place and the same cache bytes, in every format, with a padded
// slot, a bad slot (flag, no write) and a NaN row. The latent one element off (not 16-byte
// aligned) takes the fallback, two launches inside rms_norm, and must agree too.
TEST(CudaKernels, RmsNormWithCacheInsertMatchesTwoLaunches) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(19);
  const int64_t T = 13, ql = 256, row_stride = ql + kLatentDim + 8;  // [q_c | kv_c | k_pe | spare]
  const float eps = 1e-6f;
  const int bs = 16, nb = 4;
  for (const FormatCase& f : kFormats) {
    for (const int64_t off : {0, 1}) {
      SCOPED_TRACE(testing::Message() << f.name << " offset " << off);
      const DType act = f.act;
      const int64_t slots = int64_t(nb) * bs, entry = int64_t(cache_entry_bytes(f.format));
      const int64_t stride = bs * entry + 32;
      std::vector<uint8_t> poison(size_t(nb * stride));
      for (auto& b : poison) b = uint8_t(rng());
      std::vector<uint16_t> x = random_act(size_t(T * row_stride + 1), rng, -3.0f, 3.0f, act);
      x[size_t(off + 2 * row_stride + ql + 17)] = to_act(kNaN, act);  // row 2's latent
      const std::vector<uint16_t> wq = random_act(size_t(ql), rng, 0.5f, 1.5f, act);
      const std::vector<uint16_t> wkv = random_act(kKvLoraRank, rng, 0.5f, 1.5f, act);
      std::vector<int64_t> slot(static_cast<size_t>(slots));
      std::iota(slot.begin(), slot.end(), 0);
      std::shuffle(slot.begin(), slot.end(), rng);
      slot.resize(size_t(T));
      slot[3] = -1;
      slot[7] = slots;  // one past the end
      DevBuf<uint16_t> dwq(wq), dwkv(wkv);
      DevBuf<int64_t> dslots(slot);
      auto run = [&](bool fused) {
        DevBuf<uint16_t> dx(x);
        DevBuf<uint8_t> dcache(poison);
        DevBuf<int> flag(1);
        flag.fill_bytes(0);
        const LatentCache dev = LatentCache::borrow(dcache.ptr, Device::cuda, f.format, bs, nb,
                                                    stride, f.k_scale, f.rule);
        const cu::NormSegment kv{dx.ptr + off + ql, row_stride, kKvLoraRank, dwkv.ptr};
        const cu::NormSegment q{dx.ptr + off, row_stride, int(ql), dwq.ptr};
        cu::CacheInsertParams p;
        p.kv = kv.x;
        p.kv_stride = row_stride;
        p.rope = dx.ptr + off + ql + kKvLoraRank;
        p.rope_stride = row_stride;
        p.act = act;
        p.slots = dslots.ptr;
        p.rows = T;
        p.cache = cu::cache_ref(dev);
        p.error_flag = flag.ptr;
        if (fused) {
          cu::rms_norm(kv, q, T, eps, act, nullptr, &p);
        } else {
          cu::rms_norm(kv, q, T, eps, act, nullptr);
          cu::cache_insert(p, nullptr);
        }
        sync();
        EXPECT_EQ(flag.download()[0], int(cu::kErrBadSlot));
        return std::make_pair(dx.download(), dcache.download());
      };
      const auto two = run(false), one = run(true);
      EXPECT_EQ(one.first, two.first);
      EXPECT_EQ(first_difference(one.second, two.second), -1);
      EXPECT_NE(first_difference(two.second, poison), -1);  // rows were inserted at all
    }
  }
}

// ---- decode query ---------------------------------------------------------------------

TEST(CudaKernels, DecodeQueryRopeAndFp8) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(14);
  const int64_t rows = 5;
  const int heads = 3;
  const int64_t q_stride = heads * kQkHeadDim + 8, items = rows * heads;
  const float q_scale = 0.37f;
  struct Case {
    DType act;
    bool rope_f32, q8;
  };
  for (const Case c : {Case{DType::bf16, false, false}, Case{DType::bf16, true, true},
                       Case{DType::f16, false, true}}) {
    SCOPED_TRACE(testing::Message() << "rope_f32 " << c.rope_f32 << " q8 " << c.q8);
    const DType act = c.act;
    const std::vector<uint16_t> q = random_act(size_t(rows * q_stride), rng, -3, 3, act);
    // ql_nope up to +-200: x / q_scale passes 448 (saturation) for a sixth of them.
    std::vector<uint16_t> mqa = random_act(size_t(items * kLatentDim), rng, -200, 200, act);
    for (int64_t i = 0; i < items; ++i)
      std::fill_n(mqa.begin() + i * kLatentDim + kKvLoraRank, kRopeDim, uint16_t(0xFFFF));
    mqa[7] = to_act(kNaN, act);  // e4m3_scaled_clamped: NaN -> -448
    std::vector<float> rope_f32(size_t(items * kRopeDim));
    std::uniform_real_distribution<float> ud(-300, 300);
    for (auto& r : rope_f32) r = ud(rng);
    DevBuf<uint16_t> dq(q), dmqa(mqa);
    DevBuf<float> drope(rope_f32);
    DevBuf<uint8_t> dq8(size_t(items * kLatentDim + 16));  // 16 spare bytes stay poisoned
    dq8.fill_bytes(0xFF);
    cu::DecodeQueryParams p;
    p.mqa = dmqa.ptr;
    p.rows = rows;
    p.heads = heads;
    p.q = dq.ptr;
    p.q_stride = q_stride;
    p.q_rope_f32 = c.rope_f32 ? drope.ptr : nullptr;
    p.q8 = c.q8 ? dq8.ptr : nullptr;
    p.q_scale = q_scale;
    p.act = act;
    cu::decode_query(p, nullptr);
    sync();

    std::vector<uint16_t> mqa_ref = mqa;
    std::vector<uint8_t> q8_ref(dq8.n, 0xFF);
    const float inv = 1.0f / q_scale;
    for (int64_t i = 0; i < items; ++i) {
      const int64_t t = i / heads, h = i % heads;
      float x[kLatentDim];
      for (int j = 0; j < kKvLoraRank; ++j) x[j] = from_act(mqa[size_t(i * kLatentDim + j)], act);
      for (int j = 0; j < kRopeDim; ++j)
        x[kKvLoraRank + j] =
            c.rope_f32 ? rope_f32[size_t(i * kRopeDim + j)]
                       : from_act(q[size_t(t * q_stride + h * kQkHeadDim + kNopeDim + j)], act);
      for (int j = 0; j < kRopeDim; ++j)
        mqa_ref[size_t(i * kLatentDim + kKvLoraRank + j)] = to_act(x[kKvLoraRank + j], act);
      if (c.q8)
        for (int j = 0; j < kLatentDim; ++j)
          q8_ref[size_t(i * kLatentDim + j)] = e4m3_scaled_clamped(x[j], inv);
    }
    const std::vector<uint16_t> got = dmqa.download();
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(same_act(got[i], mqa_ref[i], act)) << "mqa " << i;
    // Bit-exact codes from the same fp32 product, clamp and conversion as the CPU.
    EXPECT_EQ(first_difference(dq8.download(), q8_ref), -1);
  }
}

// ---- context gather ---------------------------------------------------------------------

TEST(CudaKernels, GatherContextDequantizesThroughBlockTables) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(15);
  const int bs = 16;
  const int64_t nb = 12;
  const int total_requests = 5, max_blocks = 6, first_request = 1;
  const std::vector<int32_t> cu_len = {0, 17, 18, 40};  // 3 requests: 17, 1 and 22 rows
  const int64_t start = 20, rows = 40;
  for (FormatCase f : kFormats) {
    if (f.format == CacheFormat::fp8) f.k_scale = 2.0f;  // dequantized values up to 896
    for (const bool bad_block : {false, true}) {
      if (bad_block && f.format != CacheFormat::bf16) continue;
      SCOPED_TRACE(testing::Message() << f.name << " bad block " << bad_block);
      const DType act = f.act;
      const int64_t entry = int64_t(cache_entry_bytes(f.format)), stride = bs * entry + 16;
      std::vector<uint8_t> bytes(size_t(nb * stride), 0xEE);
      const LatentCache host = LatentCache::borrow(bytes.data(), Device::cpu, f.format, bs, nb,
                                                   stride, f.k_scale, f.rule);
      std::normal_distribution<float> nd(0.0f, 2.0f);
      for (int64_t s = 0; s < nb * bs; ++s) {
        float row[kLatentDim];
        for (float& x : row) x = round_bf16(nd(rng) * (s % 5 == 0 ? 300.0f : 1.0f));
        if (s == 7) row[100] = kNaN;
        host.write_row(s, row);
      }
      // Block tables: every entry garbage, then the three requests' first four blocks a
      // permutation of the cache's blocks.
      std::vector<int32_t> tables(size_t(total_requests * max_blocks), 1000);
      for (size_t i = 0; i < tables.size(); i += 2) tables[i] = -7;
      std::vector<int32_t> perm(static_cast<size_t>(nb));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < 3; ++j)
        for (int b = 0; b < 4; ++b)
          tables[size_t((first_request + j) * max_blocks + b)] = perm[size_t(j * 4 + b)];
      // Request 3's block 2 (positions 32..47, its rows 30..39) points past the cache.
      if (bad_block) tables[size_t((first_request + 2) * max_blocks + 2)] = int32_t(nb);

      DevBuf<uint8_t> dcache(bytes);
      DevBuf<int32_t> dtables(tables), dcu(cu_len);
      DevBuf<uint16_t> dout(size_t((rows + 2) * kLatentDim));  // 2 spare rows stay poisoned
      DevBuf<int> flag(1);
      dout.fill_bytes(0xFF);
      flag.fill_bytes(0);
      const LatentCache dev = LatentCache::borrow(dcache.ptr, Device::cuda, f.format, bs, nb,
                                                  stride, f.k_scale, f.rule);
      cu::GatherParams p;
      p.cache = cu::cache_ref(dev);
      p.batch.block_tables = dtables.ptr;
      p.batch.num_requests = total_requests;
      p.batch.max_blocks = max_blocks;
      p.first_request = first_request;
      p.cu_len = dcu.ptr;
      p.num_requests = 3;
      p.start = start;
      p.total_rows = rows;
      p.out = dout.ptr;
      p.act = act;
      p.error_flag = flag.ptr;
      cu::gather_context(p, nullptr);
      sync();

      const std::vector<uint16_t> got = dout.download();
      for (int64_t r = 0; r < rows + 2; ++r) {
        float ref[kLatentDim];
        if (r >= rows) {
          std::fill_n(ref, kLatentDim, bits_float(0xffffffffu));
        } else {
          const int j =
              int(std::upper_bound(cu_len.begin(), cu_len.end(), int32_t(r)) - cu_len.begin()) - 1;
          const int64_t pos = start + (r - cu_len[size_t(j)]);
          const int32_t id = tables[size_t((first_request + j) * max_blocks + pos / bs)];
          if (id < 0 || id >= nb)
            std::fill_n(ref, kLatentDim, 0.0f);
          else
            host.read_row(id * bs + pos % bs, ref);
        }
        for (int i = 0; i < kLatentDim; ++i) {
          // Bit-exact: RowCodec::decode's fp32 product (and bf16 rounding), then act rounding.
          const uint16_t want = r >= rows ? uint16_t(0xFFFF) : to_act(ref[i], act);
          ASSERT_TRUE(same_act(got[size_t(r * kLatentDim + i)], want, act))
              << "row " << r << " col " << i << " got " << got[size_t(r * kLatentDim + i)]
              << " want " << want;
        }
      }
      EXPECT_EQ(flag.download()[0], bad_block ? int(cu::kErrBadBlockId) : 0);
    }
  }
}

// ---- gate -------------------------------------------------------------------------------

TEST(CudaKernels, GateMatchesSigmoidFormula) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(16);
  struct Case {
    DType act;
    int64_t rows, width, g_stride;
  };
  // 16-byte path (width 384, g padded to 392), then the scalar path (odd width and stride);
  // each also with a device token count that makes the last rows padding (+0 there, also
  // where attn is NaN: row 4).
  for (const Case c : {Case{DType::bf16, 7, 384, 392}, Case{DType::f16, 5, 100, 101}})
    for (const int32_t real : {-1, 3}) {
      SCOPED_TRACE(testing::Message() << "width " << c.width << " real rows " << real);
      std::vector<uint16_t> attn = random_act(size_t(c.rows * c.width), rng, -4, 4, c.act);
      const std::vector<uint16_t> g = random_act(size_t(c.rows * c.g_stride), rng, -8, 8, c.act);
      attn[size_t(4 * c.width + 1)] = to_act(kNaN, c.act);
      DevBuf<uint16_t> dattn(attn), dg(g);
      DevBuf<int32_t> dreal(std::vector<int32_t>{real});
      cu::gate(dattn.ptr, dg.ptr, c.g_stride, c.rows, c.width, c.act, nullptr,
               real < 0 ? nullptr : dreal.ptr);
      sync();
      const std::vector<uint16_t> got = dattn.download();
      int worst = 0, differing = 0;
      for (int64_t t = 0; t < c.rows; ++t)
        for (int64_t i = 0; i < c.width; ++i) {
          if (real >= 0 && t >= real) {
            ASSERT_EQ(got[size_t(t * c.width + i)], 0) << "padding row " << t;
            continue;
          }
          const float gv = from_act(g[size_t(t * c.g_stride + i)], c.act);
          const float a = from_act(attn[size_t(t * c.width + i)], c.act);
          const uint16_t want = to_act(a * (1.0f / (1.0f + std::exp(-gv))), c.act);
          const int d = act_ulps(got[size_t(t * c.width + i)], want, c.act);
          worst = std::max(worst, d);
          differing += d != 0;
        }
      // CUDA's expf is within 2 fp32 ulps of glibc's: after one rounding to act the result can
      // move by one act ulp at a rounding boundary, and rarely does.
      EXPECT_LE(worst, 1);
      EXPECT_LT(differing, int(c.rows * c.width / 50));
      EXPECT_EQ(dg.download(), g);
    }
}

// ---- merge --------------------------------------------------------------------------------

TEST(CudaKernels, MergeStatesMatchesCpuMerge) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(17);
  const int64_t rows = 9, with_prefix = 6;
  const int heads = 3;
  enum Alias { kNone, kOutIsPrefix, kOutIsSuffix };
  struct Case {
    DType act;
    int dim;
    Alias alias;
  };
  for (const Case c : {Case{DType::bf16, 128, kNone}, Case{DType::f16, 36, kOutIsPrefix},
                       Case{DType::bf16, 128, kOutIsSuffix}}) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " alias " << int(c.alias));
    const DType act = c.act;
    const int64_t n = rows * heads * c.dim;
    // The prefix has all `rows` rows so that out can alias it; only the first 6 are read.
    const std::vector<uint16_t> prefix = random_act(size_t(n), rng, -2, 2, act);
    const std::vector<uint16_t> suffix = random_act(size_t(n), rng, -2, 2, act);
    std::vector<float> plse(size_t(rows * heads)), slse(size_t(rows * heads));
    std::uniform_real_distribution<float> ud(-6, 6);
    for (auto& x : plse) x = ud(rng);
    for (auto& x : slse) x = ud(rng);
    plse[0] = -kInf;                   // prefix empty
    slse[1] = kInf;                    // suffix empty, reported as +inf
    plse[3] = -kInf, slse[3] = -kInf;  // both empty
    plse[4] = kInf, slse[4] = -kInf;   // both empty, mixed signs
    slse[7 * heads] = kInf;            // a suffix-only row passes its LSE through raw
    DevBuf<uint16_t> dprefix(prefix), dsuffix(suffix), dout(static_cast<size_t>(n));
    DevBuf<float> dplse(plse), dslse(slse), dout_lse(size_t(rows * heads));
    dout.fill_bytes(0xFF);
    dout_lse.fill_bytes(0xFF);
    cu::MergeParams p;
    p.prefix = dprefix.ptr;
    p.prefix_lse = dplse.ptr;
    p.suffix = dsuffix.ptr;
    p.suffix_lse = dslse.ptr;
    p.rows = rows;
    p.rows_with_prefix = with_prefix;
    p.heads = heads;
    p.dim = c.dim;
    p.act = act;
    p.out = c.alias == kOutIsPrefix   ? dprefix.ptr
            : c.alias == kOutIsSuffix ? dsuffix.ptr
                                      : dout.ptr;
    p.out_lse = c.alias == kOutIsPrefix   ? dplse.ptr
                : c.alias == kOutIsSuffix ? nullptr
                                          : dout_lse.ptr;
    cu::merge_states(p, nullptr);
    sync();
    const std::vector<uint16_t> got = c.alias == kOutIsPrefix   ? dprefix.download()
                                      : c.alias == kOutIsSuffix ? dsuffix.download()
                                                                : dout.download();
    const std::vector<float> got_lse =
        c.alias == kOutIsPrefix ? dplse.download() : dout_lse.download();

    std::vector<float> pf(static_cast<size_t>(n)), sf(static_cast<size_t>(n)),
        of(static_cast<size_t>(n)), olse(size_t(rows * heads));
    for (int64_t i = 0; i < n; ++i) pf[size_t(i)] = from_act(prefix[size_t(i)], act);
    for (int64_t i = 0; i < n; ++i) sf[size_t(i)] = from_act(suffix[size_t(i)], act);
    cpu::merge_attn_f32(pf.data(), plse.data(), sf.data(), slse.data(), rows, with_prefix, heads,
                        c.dim, of.data(), olse.data(), act);
    for (int64_t i = 0; i < rows * heads; ++i) {
      const bool mixed = i / heads < with_prefix && std::isfinite(plse[size_t(i)]) &&
                         std::isfinite(slse[size_t(i)]);
      for (int d = 0; d < c.dim; ++d) {
        const size_t e = size_t(i * c.dim + d);
        const uint16_t want = to_act(of[e], act);
        const float g = from_act(got[e], act), w = from_act(want, act);
        if (!mixed) {  // copies and both-empty rows are exact
          ASSERT_TRUE(same_act(got[e], want, act)) << "row-head " << i << " d " << d;
          continue;
        }
        // The weights use CUDA's expf (within ~3 fp32 ulps of glibc's after the divide): one
        // act ulp at a rounding boundary, or a few fp32 ulps of the terms when p*pw and s*sw
        // nearly cancel (twice that after both act roundings); a wrong formula is off by 1e-2.
        const float slack = 2e-6f * (std::fabs(pf[e]) + std::fabs(sf[e]));
        ASSERT_TRUE(act_ulps(got[e], want, act) <= 1 || std::fabs(g - w) <= slack)
            << "row-head " << i << " d " << d << " got " << g << " want " << w;
      }
      if (c.alias == kOutIsSuffix) continue;  // out_lse = nullptr
      const float gl = got_lse[size_t(i)], wl = olse[size_t(i)];
      if (std::isinf(wl)) {
        EXPECT_EQ(bits(gl), bits(wl)) << "lse " << i;
      } else {
        // log(sum) + max with CUDA's logf/expf: a few fp32 ulps of log(sum) <= log 2, plus
        // the final add's rounding of |lse|.
        EXPECT_NEAR(gl, wl, 1e-6f * (std::fabs(wl) + 1.0f)) << "lse " << i;
      }
    }
  }
}

// ---- small helpers ------------------------------------------------------------------------

TEST(CudaKernels, E4m3RoundtripMatchesCpu) {
  KMLA_REQUIRE_GPU();
  std::mt19937 rng(18);
  struct Case {
    DType act;
    int64_t rows, width, stride;
  };
  for (const Case c : {Case{DType::bf16, 5, 256, 264}, Case{DType::f16, 3, 200, 203}}) {
    SCOPED_TRACE(testing::Message() << "width " << c.width << " stride " << c.stride);
    std::vector<uint16_t> x = random_act(size_t(c.rows * c.stride), rng, -600, 600, c.act);
    const float special[] = {kNaN, kInf, -kInf, 448, 464, -465, 1e-3f, -2e-3f, 0.0f, 6e4f};
    for (size_t i = 0; i < std::size(special); ++i) x[i * 3 + 1] = to_act(special[i], c.act);
    DevBuf<uint16_t> dx(x);
    cu::e4m3_roundtrip(dx.ptr, c.rows, c.width, c.stride, c.act, nullptr);
    sync();
    std::vector<uint16_t> want = x;
    for (int64_t t = 0; t < c.rows; ++t) {
      std::vector<float> row(size_t(c.width));
      for (int64_t i = 0; i < c.width; ++i)
        row[size_t(i)] = from_act(x[size_t(t * c.stride + i)], c.act);
      cpu::e4m3_roundtrip(row.data(), c.width);
      for (int64_t i = 0; i < c.width; ++i)
        want[size_t(t * c.stride + i)] = to_act(row[size_t(i)], c.act);
    }
    // Bit-exact (NaN becomes -448, so no NaN survives); columns past width untouched.
    EXPECT_EQ(dx.download(), want);
  }
}

TEST(CudaKernels, ZeroPaddingRowsFromDeviceCount) {
  KMLA_REQUIRE_GPU();
  for (const int64_t row_bytes : {48, 37}) {  // 16-byte path, byte path
    for (const int32_t tokens : {6, 10, 0, 13}) {
      SCOPED_TRACE(testing::Message() << "row bytes " << row_bytes << " tokens " << tokens);
      const int64_t rows = 10;
      DevBuf<uint8_t> x(size_t(rows * row_bytes + 16));  // 16 bytes past the end stay 0x5A
      DevBuf<int32_t> n(std::vector<int32_t>{tokens});
      x.fill_bytes(0x5A);
      cu::zero_padding_rows(x.ptr, rows, row_bytes, n.ptr, nullptr);
      sync();
      std::vector<uint8_t> want(x.n, 0x5A);
      const int64_t first = std::min<int64_t>(tokens, rows);
      std::fill(want.begin() + first * row_bytes, want.begin() + rows * row_bytes, 0);
      EXPECT_EQ(x.download(), want);
    }
  }
}

}  // namespace
}  // namespace kmla
