// Cache row codecs (pinned bytes for hand-built rows, error bounds, NaN/inf rules) and
// the paged LatentCache (owned and caller-owned memory, addressing, errors).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "core_reference.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "test_util.hpp"
#include "kmla/numeric.hpp"

using namespace kmla;

namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

using Row = std::vector<float>;
using Bytes = std::vector<uint8_t>;

Bytes encode(const RowCodec& c, const Row& x) {
  Bytes b(cache_entry_bytes(c.format), 0xcd);
  c.encode(x.data(), reinterpret_cast<std::byte*>(b.data()));
  return b;
}

Row decode(const RowCodec& c, const Bytes& b) {
  Row x(kLatentDim);
  c.decode(reinterpret_cast<const std::byte*>(b.data()), x.data());
  return x;
}

uint16_t le16(const Bytes& b, size_t off) { return uint16_t(b[off] | (b[off + 1] << 8)); }
uint32_t le32(const Bytes& b, size_t off) {
  return uint32_t(b[off]) | uint32_t(b[off + 1]) << 8 | uint32_t(b[off + 2]) << 16 |
         uint32_t(b[off + 3]) << 24;
}

RowCodec codec(CacheFormat f, float k_scale = 1.0f, TileScaleRule r = TileScaleRule::power_of_two) {
  RowCodec c;
  c.format = f;
  c.k_scale = k_scale;
  c.tile_rule = r;
  return c;
}

// Every error must name the offending value.
using kmla::testing_util::expect_error_naming;

// `n` bytes that end exactly at an inaccessible page, so reading one byte past the end
// faults even without AddressSanitizer.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t n) : n_(n) {
    page_ = size_t(sysconf(_SC_PAGESIZE));
    span_ = (n + page_ - 1) / page_ * page_ + page_;
    void* p = mmap(nullptr, span_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    map_ = static_cast<uint8_t*>(p);
    mprotect(map_ + span_ - page_, page_, PROT_NONE);
  }
  ~GuardedBuffer() { munmap(map_, span_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  uint8_t* data() const { return map_ + span_ - page_ - n_; }
  uint8_t& operator[](size_t i) const { return data()[i]; }

 private:
  size_t n_, page_, span_;
  uint8_t* map_;
};

}  // namespace

// ---- formats -----------------------------------------------------------------------

TEST(CacheFormat, EntryBytes) {
  EXPECT_EQ(cache_entry_bytes(CacheFormat::bf16), 1152u);
  EXPECT_EQ(cache_entry_bytes(CacheFormat::fp16), 1152u);
  EXPECT_EQ(cache_entry_bytes(CacheFormat::fp8), 576u);
  EXPECT_EQ(cache_entry_bytes(CacheFormat::fp8_ds_mla), 656u);
  // 656 = 512 codes + 4 fp32 scales + 64 bf16 rope values.
  EXPECT_EQ(kDsMlaScaleOffset, 512u);
  EXPECT_EQ(kDsMlaRopeOffset, 528u);
}

TEST(CacheFormat, Parse) {
  EXPECT_EQ(parse_cache_format("bf16"), CacheFormat::bf16);
  EXPECT_EQ(parse_cache_format("bfloat16"), CacheFormat::bf16);
  EXPECT_EQ(parse_cache_format("fp16"), CacheFormat::fp16);
  EXPECT_EQ(parse_cache_format("float16"), CacheFormat::fp16);
  EXPECT_EQ(parse_cache_format("fp8"), CacheFormat::fp8);
  EXPECT_EQ(parse_cache_format("fp8_e4m3"), CacheFormat::fp8);
  EXPECT_EQ(parse_cache_format("fp8_ds_mla"), CacheFormat::fp8_ds_mla);
  EXPECT_EQ(parse_cache_format("auto", DType::bf16), CacheFormat::bf16);
  EXPECT_EQ(parse_cache_format("auto", DType::f16), CacheFormat::fp16);
  expect_error_naming([] { parse_cache_format("auto", DType::f32); }, {"f32"});
  expect_error_naming([] { parse_cache_format("fp4_nvfp4"); }, {"fp4_nvfp4"});
  expect_error_naming([] { parse_cache_format(""); }, {"''"});
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp16, CacheFormat::fp8, CacheFormat::fp8_ds_mla})
    EXPECT_EQ(parse_cache_format(cache_format_name(f)), f);
}

// ---- bf16 / fp16 rows ------------------------------------------------------------------

TEST(CacheCodec, Bf16PinnedBytes) {
  Row x(kLatentDim, 0.0f);
  x[0] = 1.0f;          // 0x3f80
  x[1] = -2.0f;         // 0xc000
  x[2] = 1.00390625f;   // 1 + 2^-8: tie, rounds to even 0x3f80
  x[3] = 1.01171875f;   // 1 + 3*2^-8: tie, rounds up to 0x3f82
  x[4] = -0.0f;         // 0x8000
  x[511] = 0.5f;        // 0x3f00, last kv element
  x[512] = 3.0f;        // 0x4040, first rope element
  x[575] = -kInf;       // 0xff80
  const Bytes b = encode(codec(CacheFormat::bf16), x);
  ASSERT_EQ(b.size(), 1152u);
  EXPECT_EQ(b[0], 0x80);  // little-endian
  EXPECT_EQ(b[1], 0x3f);
  EXPECT_EQ(le16(b, 2), 0xc000);
  EXPECT_EQ(le16(b, 4), 0x3f80);
  EXPECT_EQ(le16(b, 6), 0x3f82);
  EXPECT_EQ(le16(b, 8), 0x8000);
  EXPECT_EQ(le16(b, 10), 0x0000);
  EXPECT_EQ(le16(b, 1022), 0x3f00);
  EXPECT_EQ(le16(b, 1024), 0x4040);
  EXPECT_EQ(le16(b, 1150), 0xff80);
  const Row y = decode(codec(CacheFormat::bf16), b);
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[3], 1.015625f);
  EXPECT_TRUE(std::signbit(y[4]));
  EXPECT_EQ(y[512], 3.0f);
  EXPECT_EQ(y[575], -kInf);
}

TEST(CacheCodec, Fp16PinnedBytes) {
  Row x(kLatentDim, 0.0f);
  x[0] = 1.0f;       // 0x3c00
  x[1] = 65504.0f;   // 0x7bff
  x[2] = 65520.0f;   // overflow -> 0x7c00
  x[3] = -0.5f;      // 0xb800
  x[570] = std::ldexp(1.0f, -24);  // rope element 58: smallest subnormal 0x0001
  const Bytes b = encode(codec(CacheFormat::fp16), x);
  EXPECT_EQ(le16(b, 0), 0x3c00);
  EXPECT_EQ(le16(b, 2), 0x7bff);
  EXPECT_EQ(le16(b, 4), 0x7c00);
  EXPECT_EQ(le16(b, 6), 0xb800);
  EXPECT_EQ(le16(b, 2 * 570), 0x0001);
  const Row y = decode(codec(CacheFormat::fp16), b);
  EXPECT_EQ(y[1], 65504.0f);
  EXPECT_EQ(y[2], kInf);
  EXPECT_EQ(y[570], std::ldexp(1.0f, -24));
}

TEST(CacheCodec, Bf16Fp16NaNStaysNaN) {
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp16}) {
    Row x(kLatentDim, 1.0f);
    x[7] = kNaN;
    x[520] = kNaN;
    const Row y = decode(codec(f), encode(codec(f), x));
    EXPECT_TRUE(std::isnan(y[7]));
    EXPECT_TRUE(std::isnan(y[520]));
    EXPECT_EQ(y[8], 1.0f);
  }
}

// ---- plain fp8 ------------------------------------------------------------------------

TEST(CacheCodec, Fp8PinnedBytesWithKScale) {
  // k_scale 0.5: stored = x * (1/0.5) = 2x.
  Row x(kLatentDim, 0.0f);
  x[0] = 1.0f;      // 2.0  -> 0x40
  x[1] = -0.25f;    // -0.5 -> 0xb0
  x[2] = 300.0f;    // 600 saturates -> 0x7e
  x[3] = kNaN;      // -> -448 = 0xfe
  x[4] = kInf;      // -> 0x7e
  x[5] = -kInf;     // -> 0xfe
  x[6] = 168.0f;    // 336: tie between 320 and 352 -> 320 = 0x7a
  x[7] = -0.0f;     // 0x80
  x[575] = 0.0078125f;  // rope: 2^-7 * 2 = 2^-6 = 0x08
  const RowCodec c = codec(CacheFormat::fp8, 0.5f);
  const Bytes b = encode(c, x);
  ASSERT_EQ(b.size(), 576u);
  const uint8_t want[] = {0x40, 0xb0, 0x7e, 0xfe, 0x7e, 0xfe, 0x7a, 0x80};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(b[i], want[i]) << i;
  EXPECT_EQ(b[8], 0x00);
  EXPECT_EQ(b[575], 0x08);
  const Row y = decode(c, b);
  EXPECT_EQ(y[0], 1.0f);       // 2 * 0.5
  EXPECT_EQ(y[1], -0.25f);
  EXPECT_EQ(y[2], 224.0f);     // 448 * 0.5
  EXPECT_EQ(y[3], -224.0f);    // NaN came back as -448 * 0.5
  EXPECT_EQ(y[6], 160.0f);
  EXPECT_EQ(y[575], 0.0078125f);
}

TEST(CacheCodec, Fp8MultipliesByReciprocal) {
  // The writer multiplies by fp32(1/k_scale) (the seed's fused kernel); a divide would
  // give a different code for some inputs. Find such inputs and check the product rule.
  const auto ref = kmla_test::ref_e4m3();
  const float k_scale = 0.3f;
  const float inv = 1.0f / k_scale;
  const RowCodec c = codec(CacheFormat::fp8, k_scale);
  int differing = 0;
  Row x(kLatentDim);
  for (int start = 0; start < 6; ++start) {
    for (int i = 0; i < kLatentDim; ++i) {
      // Inputs a few ulps around k_scale * (midpoint between two e4m3 codes), where the
      // last bit of the scaled value decides the rounding.
      const uint32_t lo = uint32_t(i / 9 + start * 64) % 0x7e;
      const double mid = 0.5 * (ref.mags[lo] + ref.mags[lo + 1]);
      float v = float(mid * k_scale);
      const int steps = i % 9 - 4;
      for (int k = 0; k < std::abs(steps); ++k) v = std::nextafter(v, steps > 0 ? kInf : 0.0f);
      x[i] = (start & 1) ? -v : v;
    }
    const Bytes b = encode(c, x);
    for (int i = 0; i < kLatentDim; ++i) {
      const uint32_t by_mul = kmla_test::ref_round(ref, x[i] * inv);
      const uint32_t by_div = kmla_test::ref_round(ref, x[i] / k_scale);
      ASSERT_EQ(b[i], by_mul) << i;
      differing += by_mul != by_div;
    }
  }
  EXPECT_GT(differing, 0) << "no input separates multiply from divide";
}

// ---- fp8_ds_mla --------------------------------------------------------------------------

TEST(CacheCodec, DsMlaTileScaleRules) {
  const auto p2 = TileScaleRule::power_of_two;
  const auto am = TileScaleRule::amax_448;
  EXPECT_EQ(ds_mla_tile_scale(336.0f, p2), 1.0f);   // 336/448 = 0.75 -> 1
  EXPECT_EQ(ds_mla_tile_scale(448.0f, p2), 1.0f);   // exactly 1 stays 1
  EXPECT_EQ(ds_mla_tile_scale(449.0f, p2), 2.0f);
  EXPECT_EQ(ds_mla_tile_scale(0.0f, p2), std::ldexp(1.0f, -13));  // floor 1e-4 -> 2^-13
  EXPECT_EQ(ds_mla_tile_scale(448.0f * 1e-4f, p2), std::ldexp(1.0f, -13));
  EXPECT_EQ(ds_mla_tile_scale(448.0f * 1024.0f, p2), 1024.0f);
  EXPECT_EQ(ds_mla_tile_scale(std::nextafter(448.0f * 1024.0f, kInf), p2), 2048.0f);
  EXPECT_EQ(ds_mla_tile_scale(336.0f, am), 0.75f);
  EXPECT_EQ(ds_mla_tile_scale(0.0f, am), FLT_MIN);
  EXPECT_EQ(ds_mla_tile_scale(449.0f, am), 449.0f / 448.0f);
  // The power-of-two rule is the smallest power of two >= max(amax/448, 1e-4) for any amax.
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    const float amax = std::ldexp(float(rng() % 1000000 + 1) / 1e6f, int(rng() % 60) - 30);
    const double v = std::max(double(amax / 448.0f), double(1e-4f));
    const float s = ds_mla_tile_scale(amax, p2);
    int e;
    ASSERT_EQ(std::frexp(s, &e), 0.5f) << "not a power of two: " << s;
    ASSERT_GE(double(s), v) << amax;
    ASSERT_LT(double(s) / 2, v) << amax;
  }
}

TEST(CacheCodec, DsMlaPinnedLayout) {
  Row x(kLatentDim, 0.0f);
  // Tile 0: amax 336 -> scale 1.0 (pow2). 336 itself is a tie -> 320 (0x7a).
  x[0] = 336.0f;
  x[1] = -1.0f;    // 0xb8
  x[127] = 0.5f;   // 0x30
  // Tile 1: amax 448 -> 1.0.
  x[128] = -448.0f;  // 0xfe
  x[129] = 3.0f;     // 0x44
  // Tile 2: amax 449 -> 2.0; 449/2 = 224.5 -> 224 (0x76); 3/2 = 1.5 (0x3c).
  x[256] = 449.0f;
  x[300] = 3.0f;
  // Tile 3: all zero -> 2^-13.
  // Rope (bf16 passthrough).
  x[512] = 1.0f;    // 0x3f80
  x[513] = -1.5f;   // 0xbfc0
  x[575] = 0.1f;    // bf16(0.1) = 0x3dcd
  const RowCodec c = codec(CacheFormat::fp8_ds_mla);
  const Bytes b = encode(c, x);
  ASSERT_EQ(b.size(), 656u);
  EXPECT_EQ(b[0], 0x7a);
  EXPECT_EQ(b[1], 0xb8);
  EXPECT_EQ(b[2], 0x00);
  EXPECT_EQ(b[127], 0x30);
  EXPECT_EQ(b[128], 0xfe);
  EXPECT_EQ(b[129], 0x44);
  EXPECT_EQ(b[256], 0x76);
  EXPECT_EQ(b[300], 0x3c);
  for (int i = 384; i < 512; ++i) ASSERT_EQ(b[i], 0x00) << i;
  // Scales: 4 x fp32 little-endian at byte 512.
  EXPECT_EQ(le32(b, 512), 0x3f800000u);  // 1.0
  EXPECT_EQ(le32(b, 516), 0x3f800000u);  // 1.0
  EXPECT_EQ(le32(b, 520), 0x40000000u);  // 2.0
  EXPECT_EQ(le32(b, 524), 0x39000000u);  // 2^-13
  EXPECT_EQ(b[512], 0x00);
  EXPECT_EQ(b[515], 0x3f);
  // Rope: 64 x bf16 at byte 528.
  EXPECT_EQ(le16(b, 528), 0x3f80);
  EXPECT_EQ(le16(b, 530), 0xbfc0);
  EXPECT_EQ(le16(b, 654), 0x3dcd);
  EXPECT_EQ(le16(b, 532), 0x0000);

  const Row y = decode(c, b);
  EXPECT_EQ(y[0], 320.0f);
  EXPECT_EQ(y[128], -448.0f);
  EXPECT_EQ(y[256], 448.0f);   // 224 * 2
  EXPECT_EQ(y[300], 3.0f);
  EXPECT_EQ(y[400], 0.0f);
  EXPECT_EQ(y[513], -1.5f);
  EXPECT_EQ(y[575], bf16_to_float(0x3dcd));
}

TEST(CacheCodec, DsMlaAmaxRule) {
  Row x(kLatentDim, 0.0f);
  std::mt19937 rng(3);
  for (int i = 0; i < 128; ++i) x[i] = round_bf16(float(int(rng() % 600) - 300) / 7.0f);
  x[5] = 336.0f;  // tile 0 amax 336 -> scale 0.75
  x[6] = 1.0f;    // 1/0.75 = 1.333.. -> nearest e4m3 1.375 (0x3b)
  x[200] = 448.0f;  // tile 1 amax 448 -> scale 1.0
  const RowCodec c = codec(CacheFormat::fp8_ds_mla, 1.0f, TileScaleRule::amax_448);
  const Bytes b = encode(c, x);
  EXPECT_EQ(le32(b, 512), float_bits(0.75f));
  EXPECT_EQ(le32(b, 516), float_bits(1.0f));
  EXPECT_EQ(le32(b, 520), float_bits(FLT_MIN));  // all-zero tiles
  EXPECT_EQ(le32(b, 524), float_bits(FLT_MIN));
  EXPECT_EQ(b[5], 0x7e);  // 336 / 0.75 = 448
  EXPECT_EQ(b[6], 0x3b);
  const auto ref = kmla_test::ref_e4m3();
  // codes = e4m3(x / 0.75) with an IEEE divide.
  for (int i = 0; i < 128; ++i) ASSERT_EQ(b[i], kmla_test::ref_round(ref, x[i] / 0.75f)) << i;
  const Row y = decode(c, b);
  // Read back: bf16(code * 0.75).
  for (int i = 0; i < 128; ++i)
    ASSERT_EQ(y[i], round_bf16(float(ref.mags[b[i] & 0x7f] * ((b[i] & 0x80) ? -1 : 1)) * 0.75f)) << i;
  EXPECT_EQ(y[5], 336.0f);
}

TEST(CacheCodec, DsMlaCodesAreIeeeDivideByScale) {
  // Under the amax rule the scale is not a power of two, so x / s and x * (1/s) can round
  // differently; the ds_mla writer divides (vLLM's scaled_convert).
  const auto ref = kmla_test::ref_e4m3();
  Row x(kLatentDim, 0.0f);
  std::mt19937 rng(11);
  x[0] = 300.0f;  // tile amax -> scale 300/448
  const float s = ds_mla_tile_scale(300.0f, TileScaleRule::amax_448);
  for (int i = 1; i < 128; ++i) {
    // Values whose quotient lands near a rounding midpoint.
    const uint32_t lo = 32 + rng() % 80;
    const double mid = 0.5 * (ref.mags[lo] + ref.mags[lo + 1]);
    float v = float(mid * s);
    const int steps = int(rng() % 7) - 3;
    for (int k = 0; k < std::abs(steps); ++k) v = std::nextafter(v, steps > 0 ? kInf : 0.0f);
    x[i] = v;
  }
  const Bytes b = encode(codec(CacheFormat::fp8_ds_mla, 1.0f, TileScaleRule::amax_448), x);
  ASSERT_EQ(le32(b, 512), float_bits(s));
  for (int i = 0; i < 128; ++i) ASSERT_EQ(b[i], kmla_test::ref_round(ref, x[i] / s)) << i;
  // Read back: the fp32 product code * s (24 significant bits here) rounded to bf16.
  const Row y = decode(codec(CacheFormat::fp8_ds_mla, 1.0f, TileScaleRule::amax_448), b);
  int rounded = 0;
  for (int i = 0; i < 128; ++i) {
    const float prod = float(ref.mags[b[i] & 0x7f]) * s;
    ASSERT_EQ(y[i], round_bf16(prod)) << i;
    rounded += y[i] != prod;
  }
  EXPECT_GT(rounded, 0);
}

TEST(CacheCodec, DsMlaNaNAndInf) {
  const RowCodec c = codec(CacheFormat::fp8_ds_mla);
  Row x(kLatentDim, 0.0f);
  // Tile 0: a NaN is ignored by the amax (336 -> scale 1) and encodes as 0x7F.
  x[0] = 336.0f;
  x[1] = kNaN;
  x[2] = 2.0f;
  // Tile 1: an inf makes the amax and scale inf: finite values -> zero codes,
  // inf / inf -> NaN code, and the whole tile reads back as NaN (0 * inf).
  x[128] = kInf;
  x[129] = 5.0f;
  // Tile 2 stays finite and is unaffected.
  x[256] = 1.0f;
  const Bytes b = encode(c, x);
  EXPECT_EQ(le32(b, 512), float_bits(1.0f));
  EXPECT_EQ(b[1], 0x7f);
  EXPECT_EQ(b[2], 0x40);
  EXPECT_EQ(le32(b, 516), float_bits(kInf));
  EXPECT_EQ(b[128] & 0x7f, 0x7f);
  EXPECT_EQ(b[129], 0x00);
  const Row y = decode(c, b);
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_EQ(y[2], 2.0f);
  for (int i = 128; i < 256; ++i) ASSERT_TRUE(std::isnan(y[i])) << i;
  EXPECT_EQ(y[256], 1.0f);
  EXPECT_EQ(y[257], 0.0f);
}

TEST(CacheCodec, RoundTripErrorBounds) {
  // Random rows spanning many magnitudes (bf16 values, as the writers see them).
  std::mt19937 rng(2024);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  double worst[4] = {0, 0, 0, 0};
  for (int trial = 0; trial < 40; ++trial) {
    Row x(kLatentDim);
    for (int i = 0; i < kLatentDim; ++i) x[i] = round_bf16(nd(rng) * std::ldexp(1.0f, int(rng() % 24) - 12));
    // bf16: exact for bf16 inputs.
    {
      const Row y = decode(codec(CacheFormat::bf16), encode(codec(CacheFormat::bf16), x));
      for (int i = 0; i < kLatentDim; ++i) ASSERT_EQ(y[i], x[i]) << i;
    }
    // fp16: unit roundoff 2^-11 in the normal range, absolute 2^-25 below 2^-14, no overflow here.
    {
      const Row y = decode(codec(CacheFormat::fp16), encode(codec(CacheFormat::fp16), x));
      for (int i = 0; i < kLatentDim; ++i) {
        const double err = std::fabs(double(y[i]) - x[i]);
        ASSERT_LE(err, std::ldexp(std::fabs(x[i]), -11) + std::ldexp(1.0, -25)) << i << " " << x[i];
        worst[1] = std::max(worst[1], err / std::max(std::fabs(double(x[i])), 1e-30));
      }
    }
    // fp8 with k_scale s: |x/s| <= 448 here (k_scale 16, |x| < 2^12*~4), e4m3 unit roundoff
    // 2^-4 (normal) or absolute 2^-10 (subnormal, scaled by s), plus ~1 fp32 ulp from the
    // reciprocal multiply and one from the read-back product.
    {
      const float s = 16.0f;
      const Row y = decode(codec(CacheFormat::fp8, s), encode(codec(CacheFormat::fp8, s), x));
      for (int i = 0; i < kLatentDim; ++i) {
        if (std::fabs(x[i] / s) > 448) continue;
        const double err = std::fabs(double(y[i]) - x[i]);
        ASSERT_LE(err, std::fabs(x[i]) * (std::ldexp(1.0, -4) + std::ldexp(1.0, -21)) +
                           std::ldexp(1.0, -10) * s) << i << " " << x[i];
      }
    }
    // fp8_ds_mla: code error 2^-4 relative (or 2^-10 * scale absolute), then bf16 rounding
    // of the product (2^-8 relative); rope exact.
    for (TileScaleRule rule : {TileScaleRule::power_of_two, TileScaleRule::amax_448}) {
      const RowCodec c = codec(CacheFormat::fp8_ds_mla, 1.0f, rule);
      const Bytes b = encode(c, x);
      const Row y = decode(c, b);
      for (int i = 0; i < kLatentDim; ++i) {
        if (i >= kKvLoraRank) {
          ASSERT_EQ(y[i], x[i]) << i;
          continue;
        }
        float scale;
        std::memcpy(&scale, b.data() + 512 + 4 * (i / 128), 4);
        const double err = std::fabs(double(y[i]) - x[i]);
        // (+2^-20 for the fp32 divide and product roundings.)
        const double rel = std::ldexp(1.0, -4) + std::ldexp(1.0, -8) + std::ldexp(1.0, -12) +
                           std::ldexp(1.0, -20);
        ASSERT_LE(err, std::fabs(x[i]) * rel + std::ldexp(1.0, -10) * scale * 1.01) << i << " " << x[i];
        worst[3] = std::max(worst[3], err / std::max(std::fabs(double(x[i])), 1e-30));
      }
    }
  }
  // The bounds are not vacuous: the lossy formats do lose precision on these rows.
  EXPECT_GT(worst[1], 0.0);
  EXPECT_GT(worst[3], std::ldexp(1.0, -6));
}

// ---- LatentCache ---------------------------------------------------------------------------

TEST(LatentCache, AllocateDense) {
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    const LatentCache c = LatentCache::allocate(f, 16, 3);
    EXPECT_TRUE(c.owns_memory());
    EXPECT_EQ(c.geometry().block_stride, int64_t(16 * cache_entry_bytes(f)));
    EXPECT_EQ(c.geometry().num_slots(), 48);
    EXPECT_EQ(c.slot_ptr(17) - c.base(), int64_t(cache_entry_bytes(f)) * 17);
    // Zero-filled.
    const auto* p = reinterpret_cast<const uint8_t*>(c.base());
    for (size_t i = 0; i < 48 * cache_entry_bytes(f); ++i) ASSERT_EQ(p[i], 0) << i;
  }
}

TEST(LatentCache, BlockSizeLimits) {
  EXPECT_NO_THROW(LatentCache::allocate(CacheFormat::bf16, 1, 2));
  EXPECT_NO_THROW(LatentCache::allocate(CacheFormat::fp8, 1024, 2));
  expect_error_naming([] { LatentCache::allocate(CacheFormat::bf16, 0, 2); }, {"got 0"});
  expect_error_naming([] { LatentCache::allocate(CacheFormat::bf16, 1025, 2); }, {"1025"});
  expect_error_naming([] { LatentCache::allocate(CacheFormat::bf16, 64, 0); }, {"got 0"});
  std::vector<uint8_t> mem(4096);
  expect_error_naming([&] { LatentCache::borrow(mem.data(), Device::cpu, CacheFormat::fp8, 4, 1, 2303); },
                      {"2303"});
  expect_error_naming([] { LatentCache::borrow(nullptr, Device::cpu, CacheFormat::fp8, 4, 1, 4096); },
                      {"null"});
}

TEST(LatentCache, BorrowedMemoryWithGaps) {
  // Caller-owned blocks with a 100-byte gap between them; the buffer ends right after
  // the last block's rows (no trailing gap), as an engine that interleaves layers would.
  const int bs = 4;
  const int64_t nb = 3;
  const size_t entry = cache_entry_bytes(CacheFormat::bf16);
  const int64_t stride = int64_t(bs * entry) + 100;
  const size_t total = size_t(stride) * (nb - 1) + bs * entry;
  GuardedBuffer mem(total);
  std::memset(mem.data(), 0xab, total);
  const LatentCache c = LatentCache::borrow(mem.data(), Device::cpu, CacheFormat::bf16, bs, nb, stride);
  EXPECT_FALSE(c.owns_memory());
  Row x(kLatentDim);
  for (int i = 0; i < kLatentDim; ++i) x[i] = float(i % 200) - 100.0f;  // exact in bf16
  const int64_t slot = 2 * bs + 3;                                   // block 2, offset 3
  auto* want = reinterpret_cast<std::byte*>(mem.data()) + 2 * stride + 3 * entry;
  ASSERT_EQ(c.slot_ptr(slot), want);
  c.write_row(slot, x.data());
  const Bytes enc = encode(codec(CacheFormat::bf16), x);
  for (size_t i = 0; i < total; ++i) {
    const size_t off = size_t(want - reinterpret_cast<std::byte*>(mem.data()));
    if (i >= off && i < off + entry)
      ASSERT_EQ(mem[i], enc[i - off]) << i;
    else
      ASSERT_EQ(mem[i], 0xab) << "byte " << i << " outside the row was touched";
  }
  Row y(kLatentDim);
  c.read_row(slot, y.data());
  EXPECT_EQ(y, x);
  // slot 1 of block 1 sits after the first gap.
  EXPECT_EQ(c.slot_ptr(bs + 1) - c.base(), stride + int64_t(entry));
  // A clone reads exactly the borrowed span (the guard page faults on an over-read) and
  // keeps the layout.
  const LatentCache k = c.clone();
  EXPECT_TRUE(k.owns_memory());
  EXPECT_EQ(k.geometry().block_stride, stride);
  Row z(kLatentDim);
  k.read_row(slot, z.data());
  EXPECT_EQ(z, x);
}

TEST(LatentCache, SlotRangeErrors) {
  const LatentCache c = LatentCache::allocate(CacheFormat::fp8, 8, 2);
  EXPECT_NO_THROW(c.slot_ptr(0));
  EXPECT_NO_THROW(c.slot_ptr(15));
  expect_error_naming([&] { c.slot_ptr(16); }, {"slot 16"});
  expect_error_naming([&] { c.slot_ptr(-1); }, {"slot -1"});
  // Device memory cannot be addressed from the host.
  std::vector<uint8_t> mem(8 * 576);
  const LatentCache d = LatentCache::borrow(mem.data(), Device::cuda, CacheFormat::fp8, 8, 1, 8 * 576);
  EXPECT_THROW(d.slot_ptr(0), Error);
  EXPECT_THROW(d.clone(), Error);
}

TEST(LatentCache, CloneIsIndependent) {
  LatentCache a = LatentCache::allocate(CacheFormat::fp8_ds_mla, 2, 2);
  Row x(kLatentDim, 1.0f), y(kLatentDim, -2.0f), r(kLatentDim);
  a.write_row(1, x.data());
  LatentCache b = a.clone();
  EXPECT_NE(a.base(), b.base());
  b.write_row(1, y.data());
  b.write_row(2, y.data());
  a.read_row(1, r.data());
  EXPECT_EQ(r, x);
  a.read_row(2, r.data());
  EXPECT_EQ(r, Row(kLatentDim, 0.0f));
  b.read_row(1, r.data());
  EXPECT_EQ(r, y);
}

TEST(LatentCache, CodecSettingsReachTheRows) {
  LatentCache f8 = LatentCache::allocate(CacheFormat::fp8, 4, 1, 0.5f);
  Row x(kLatentDim, 1.0f), r(kLatentDim);
  f8.write_row(0, x.data());
  EXPECT_EQ(uint8_t(f8.slot_ptr(0)[0]), 0x40);  // 1.0 / 0.5 = 2.0
  f8.set_k_scale(0.25f);
  f8.write_row(1, x.data());
  EXPECT_EQ(uint8_t(f8.slot_ptr(1)[0]), 0x48);  // 4.0
  f8.read_row(1, r.data());
  EXPECT_EQ(r[0], 1.0f);
  expect_error_naming([&] { f8.set_k_scale(0.0f); }, {"0"});
  expect_error_naming([&] { f8.set_k_scale(-1.0f); }, {"-1"});
  EXPECT_THROW(f8.set_k_scale(kInf), Error);
  EXPECT_THROW(f8.set_k_scale(kNaN), Error);
  EXPECT_THROW(LatentCache::allocate(CacheFormat::fp8, 4, 1, 0.0f), Error);

  LatentCache ds = LatentCache::allocate(CacheFormat::fp8_ds_mla, 4, 1, 1.0f, TileScaleRule::amax_448);
  Row t(kLatentDim, 0.0f);
  t[0] = 336.0f;
  ds.write_row(3, t.data());
  float s;
  std::memcpy(&s, ds.slot_ptr(3) + kDsMlaScaleOffset, 4);
  EXPECT_EQ(s, 0.75f);
}
