// fp8 (e4m3) prefill attention (PrefillParams::fp8, the Hopper kernel of prefill_fp8_sm90.cu)
// against an fp64 CPU reference on the dequantised inputs. Every input buffer is NaN (code
// 0x7F) wherever it is not an operand element, including rows past the last token, so a load
// outside a sequence poisons the result; out and lse are poisoned before each run so missing
// and stray writes are caught. Each case runs the public entry point with and without a work
// counter and seven non-default variants of the kernel (ping-pong, head groups of 3,
// head-major CTA order, the rescale at every new max, 2, 3 and 7 persistent CTAs, one CTA per
// item).
//
// Two kinds of data:
// * exact: every query row is one-hot (code 1 at a random one of the 192 dims) and the keys
//   are small integers, with softmax_scale = ln 2: then every score is an integer, every p a
//   power of two, 256 p an exact e4m3 code, and the only rounding left is the fp32/tensor-core
//   accumulation of P.V and the output's. A key read from the wrong smem position (Q or K
//   descriptor, the relabelled key order of V^T, a masked key) changes the result by far more
//   than the 2^-9 tolerance.
// * random: Gaussian codes with per-tensor scales, tolerance from the e4m3 rounding of P.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

#include "core/random.hpp"
#include "cuda/attention.cuh"
#include "cuda/gpu.hpp"
#include "cuda/prefill_attention.cuh"
#include "cuda/prefill_fp8_sm90.cuh"
#include "cuda/prefill_layout.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"

namespace kmla {
namespace {

using test::DevBuf;
using test::seq_offsets;

constexpr int kQk = 192, kNope = 128, kRope = 64, kV = 128;
constexpr int kPadRows = 64;        // NaN rows after the last token of every input
constexpr uint8_t kNanCode = 0x7F;  // e4m3fn NaN

struct Case {
  DType act = DType::bf16;
  bool causal = true;
  int heads = 3;
  std::vector<int> q_lens, k_lens;  // k_lens empty: = q_lens
  bool shared_rope = true;
  bool strided = false;  // layer-like strides and offsets instead of dense operands
  bool exact = false;    // one-hot q, integer k (see the top of the file)
  // Per-tensor scales, and the standard deviation of the random codes (random data only).
  float q_scale = 1.f / 64, k_scale = 1.f / 16, v_scale = 1.f / 8;
  float q_code_std = 128.f, k_code_std = 16.f, v_code_std = 8.f;
  int extra_max_q = 0;
  uint64_t seed = 1;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << dtype_name(c.act) << (c.causal ? " causal" : " non-causal") << " heads " << c.heads
    << (c.shared_rope ? " shared-rope" : " per-head-rope") << (c.strided ? " strided" : "")
    << (c.exact ? " exact" : " random") << " scales " << c.q_scale << ' ' << c.k_scale << ' '
    << c.v_scale << " q_lens";
  for (int n : c.q_lens) s << ' ' << n;
  s << " k_lens";
  for (int n : (c.k_lens.empty() ? c.q_lens : c.k_lens)) s << ' ' << n;
  return s.str();
}

float act_value(uint16_t code, DType act) {
  return act == DType::bf16 ? bf16_to_float(code) : fp16_to_float(code);
}

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  const int H = c.heads;
  const std::vector<int>& k_lens = c.k_lens.empty() ? c.q_lens : c.k_lens;
  ASSERT_EQ(k_lens.size(), c.q_lens.size());
  const int S = int(c.q_lens.size());
  const std::vector<int32_t> cu_q = seq_offsets(c.q_lens), cu_k = seq_offsets(k_lens);
  const int64_t Tq = cu_q.back(), Tk = cu_k.back();
  const int64_t q_rows = Tq + kPadRows, k_rows = Tk + kPadRows;

  // Dense or layer-strided operands, NaN everywhere else (tests/cuda/prefill_layout.hpp).
  test::PrefillLayout<uint8_t> lay(H, c.strided, c.shared_rope, q_rows, k_rows, kNanCode);
  const test::PrefillOperand<uint8_t>&q = lay.q, &k_nope = lay.k_nope, &v = lay.v,
        &k_rope = lay.k_rope;
  std::vector<uint8_t>&q_buf = lay.q_buf, &kv_buf = lay.kv_buf, &rope_buf = lay.rope_buf;

  Random rng(c.seed);
  auto code = [&](float std_codes) { return float_to_e4m3_sat(float(rng.normal()) * std_codes); };
  const int rope_heads = c.shared_rope ? 1 : H;
  float softmax_scale;
  if (c.exact) {
    // scale * q_scale * k_scale = ln 2: the kernel's base-2 exponent is the integer score.
    softmax_scale = float(std::log(2.0) / (double(c.q_scale) * c.k_scale));
    for (int64_t t = 0; t < Tq; ++t)
      for (int h = 0; h < H; ++h) {
        const int hot = int(rng.below(kQk));
        for (int d = 0; d < kQk; ++d) q_buf[size_t(q.at(t, h, d))] = float_to_e4m3_sat(d == hot);
      }
    // Keys 0, -1 .. -6 (exact e4m3 codes): p spans 2^0 .. 2^-12 between keys.
    auto key_code = [&] { return float_to_e4m3_sat(-float(rng.below(7))); };
    for (int64_t t = 0; t < Tk; ++t) {
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < kNope; ++d) kv_buf[size_t(k_nope.at(t, h, d))] = key_code();
      for (int h = 0; h < rope_heads; ++h)
        for (int d = 0; d < kRope; ++d) rope_buf[size_t(k_rope.at(t, h, d))] = key_code();
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < kV; ++d) (*v.buf)[size_t(v.at(t, h, d))] = code(c.v_code_std);
    }
  } else {
    softmax_scale = 1.0f / std::sqrt(float(kQk));
    for (int64_t t = 0; t < Tq; ++t)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < kQk; ++d) q_buf[size_t(q.at(t, h, d))] = code(c.q_code_std);
    for (int64_t t = 0; t < Tk; ++t) {
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < kNope; ++d) kv_buf[size_t(k_nope.at(t, h, d))] = code(c.k_code_std);
      for (int h = 0; h < rope_heads; ++h)
        for (int d = 0; d < kRope; ++d) rope_buf[size_t(k_rope.at(t, h, d))] = code(c.k_code_std);
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < kV; ++d) (*v.buf)[size_t(v.at(t, h, d))] = code(c.v_code_std);
    }
  }

  // fp64 reference on the dequantised values: out = sum p v / l, mag = sum p |v| / l (the
  // scale of P's rounding error), vsum = sum |v| / l (bounds the subnormal part), lse.
  std::vector<double> ref(size_t(Tq * H * kV)), mag(ref.size()), vsum(size_t(Tq * H));
  std::vector<double> ref_lse(size_t(Tq * H));
  {
    std::vector<double> kd(size_t(Tk * H * kQk)), vd(size_t(Tk * H * kV));
    for (int64_t t = 0; t < Tk; ++t)
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < kNope; ++d)
          kd[size_t((t * H + h) * kQk + d)] =
              double(e4m3_to_float(kv_buf[size_t(k_nope.at(t, h, d))])) * c.k_scale;
        for (int d = 0; d < kRope; ++d)
          kd[size_t((t * H + h) * kQk + kNope + d)] =
              double(e4m3_to_float(rope_buf[size_t(k_rope.at(t, c.shared_rope ? 0 : h, d))])) *
              c.k_scale;
        for (int d = 0; d < kV; ++d)
          vd[size_t((t * H + h) * kV + d)] =
              double(e4m3_to_float((*v.buf)[size_t(v.at(t, h, d))])) * c.v_scale;
      }
    std::vector<double> qd(kQk), sc;
    for (int s = 0; s < S; ++s) {
      const int n = c.q_lens[size_t(s)], m = k_lens[size_t(s)];
      for (int i = 0; i < n; ++i) {
        const int64_t t = cu_q[size_t(s)] + i;
        const int visible = c.causal ? std::clamp(m - n + i + 1, 0, m) : m;
        for (int h = 0; h < H; ++h) {
          const size_t r = size_t(t * H + h);
          for (int d = 0; d < kQk; ++d)
            qd[size_t(d)] = double(e4m3_to_float(q_buf[size_t(q.at(t, h, d))])) * c.q_scale;
          if (visible == 0) {
            ref_lse[r] = -INFINITY;
            continue;
          }
          sc.assign(size_t(visible), 0.0);
          double mx = -INFINITY;
          for (int j = 0; j < visible; ++j) {
            const double* kr = &kd[size_t(((cu_k[size_t(s)] + j) * H + h) * kQk)];
            double acc = 0;
            for (int d = 0; d < kQk; ++d) acc += qd[size_t(d)] * kr[d];
            sc[size_t(j)] = acc * softmax_scale;
            mx = std::max(mx, sc[size_t(j)]);
          }
          double l = 0;
          for (int j = 0; j < visible; ++j) l += (sc[size_t(j)] = std::exp(sc[size_t(j)] - mx));
          ref_lse[r] = mx + std::log(l);
          double vs = 0;
          for (int j = 0; j < visible; ++j) {
            const double pj = sc[size_t(j)] / l;
            const double* vr = &vd[size_t(((cu_k[size_t(s)] + j) * H + h) * kV)];
            for (int d = 0; d < kV; ++d) {
              ref[r * kV + size_t(d)] += pj * vr[d];
              mag[r * kV + size_t(d)] += pj * std::fabs(vr[d]);
              vs = std::max(vs, std::fabs(vr[d]));
            }
          }
          vsum[r] = vs * visible / l;
        }
      }
    }
  }

  test::PrefillBuffers<uint8_t> dev(lay, H, cu_q, cu_k, q_rows);
  DevBuf<float> d_scales(std::vector<float>{c.q_scale, c.k_scale, c.v_scale});
  cuda::PrefillParams& p = dev.params;
  p.max_q_len = *std::max_element(c.q_lens.begin(), c.q_lens.end()) + c.extra_max_q;
  p.causal = c.causal;
  p.softmax_scale = softmax_scale;
  p.act = c.act;
  p.fp8 = true;
  p.q_scale = d_scales.ptr;
  p.k_scale = d_scales.ptr + 1;
  p.v_scale = d_scales.ptr + 2;

  // Tolerance on out, per element:
  // * random data: P is rounded to e4m3 (3 mantissa bits: relative error <= 2^-4 for 256 p in
  //   the normal range, p >= 2^-14 at the running max) before P.V, so |error| <= 2^-4 * mag;
  //   below that 256 p is subnormal with absolute error <= 2^-10, i.e. 2^-18 in p, summed over
  //   at most all keys: 2^-18 * vsum. The lazy rescale (the default) stores 128 p against a max
  //   that may lag the true one: absolute error 2^-17 in p at most, so 2^-17 * vsum. Then the
  //   output's rounding to act (u |out|) and the tensor cores' fp8 accumulation (~2^-13
  //   relative, inside the P term's slack).
  // * exact data: 256 p is exact, so only the accumulation and the output rounding remain:
  //   2^-9 * mag.
  const double ulp1 = c.act == DType::bf16 ? 0x1p-7 : 0x1p-10;
  auto tolerance = [&](size_t r, size_t i) {
    const double p_term = c.exact ? 0x1p-9 * mag[i] : 0x1p-4 * mag[i] + 0x1p-17 * vsum[r];
    return p_term + ulp1 * std::fabs(ref[i]) + 1e-6 * (mag[i] + 1e-30);
  };

  // Every variant but one runs with a work counter: persistent CTAs taking items in turn
  // (one per SM, or 2, 3 and 7 of them so that each CTA runs many items and the rings'
  // phases carry across items); the counter must be back at zero after every launch.
  struct Variant {
    const char* name;
    bool public_entry;
    cuda::Fp8PrefillOptions opt;
    bool counter = true;
  };
  const Variant variants[] = {
      {"public entry point", true, {}},
      {"public entry point, no work counter (one CTA per item)", true, {}, false},
      {"pingpong, head groups of 3, 2 CTAs", false, {true, 3, true, 2}},
      {"head-major order, 3 CTAs", false, {false, 0, true, 3}},
      {"pingpong", false, {true}},
      {"7 CTAs", false, {false, 8, true, 7}},
      {"pingpong, one CTA per item", false, {true, 8, true, -1}},
      {"rescale at every new max, 3 CTAs", false, {false, 8, false, 3}},
      {"pingpong, rescale at every new max, 2 CTAs", false, {true, 8, false, 2}}};
  DevBuf<int32_t> counter(std::vector<int32_t>{0, 0});
  for (const Variant& var : variants) {
    SCOPED_TRACE(var.name);
    dev.out.fill_bytes(0xFF);
    dev.lse.fill_bytes(0xFF);
    p.work_counter = var.counter ? counter.ptr : nullptr;
    if (var.public_entry)
      cuda::prefill_attention(p, nullptr);
    else
      cuda::prefill_attention_fp8(p, nullptr, var.opt);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(counter.download(), (std::vector<int32_t>{0, 0})) << "work counter not reset";
    const std::vector<uint16_t> out = dev.out.download();
    const std::vector<float> lse = dev.lse.download();
    std::vector<char> out_seen(out.size(), 0), lse_seen(lse.size(), 0);
    int bad = 0;
    double worst = 0;
    auto report = [&](const std::string& what) {
      if (++bad <= 8) ADD_FAILURE() << what;
    };
    for (int s = 0; s < S; ++s)
      for (int64_t t = cu_q[size_t(s)]; t < cu_q[size_t(s) + 1]; ++t)
        for (int h = 0; h < H; ++h) {
          const size_t r = size_t(t * H + h);
          const int64_t li = t * lay.lse_row_stride + h;
          lse_seen[size_t(li)] = 1;
          const double want_lse = ref_lse[r], got_lse = lse[size_t(li)];
          // LSE = max + ln l in fp32 (ex2.approx, fp32 sums): ~1e-6 relative; 1e-3 is loose.
          const bool lse_ok = std::isinf(want_lse) ? (std::isinf(got_lse) && got_lse < 0)
                                                   : std::fabs(got_lse - want_lse) <=
                                                         1e-3 * (1 + std::fabs(want_lse));
          if (!lse_ok) {
            std::ostringstream m;
            m << "lse seq " << s << " row " << t << " head " << h << ": got " << got_lse << " want "
              << want_lse;
            report(m.str());
          }
          for (int d = 0; d < kV; ++d) {
            const int64_t oi = t * lay.out_row_stride + h * lay.out_head_stride + d;
            out_seen[size_t(oi)] = 1;
            const size_t i = r * kV + size_t(d);
            const double got = act_value(out[size_t(oi)], c.act), want = ref[i];
            const double tol = tolerance(r, i), err = std::fabs(got - want);
            if (!(err <= tol)) {  // NaN fails here
              std::ostringstream m;
              m << "out seq " << s << " row " << t << " head " << h << " dim " << d << ": got "
                << got << " want " << want << " tol " << tol;
              report(m.str());
            }
            worst = std::max(worst, err / tol);
          }
        }
    for (size_t i = 0; i < out.size(); ++i)
      if (!out_seen[i] && out[i] != 0xFFFF) report("out element " + std::to_string(i) + " written");
    for (size_t i = 0; i < lse.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &lse[i], 4);
      if (!lse_seen[i] && bits != 0xFFFFFFFFu)
        report("lse element " + std::to_string(i) + " written");
    }
    EXPECT_EQ(bad, 0) << "mismatches; worst error / tolerance " << worst;
    std::printf("[fp8 prefill] %s | %s: worst error / tolerance %.3g\n", describe(c).c_str(),
                var.name, worst);
  }
}

bool fp8_gpu() {
  if (!test::have_gpu()) return false;
  return cuda::prefill_fp8_supported();
}
#define KMLA_REQUIRE_FP8_GPU()                      \
  do {                                              \
    if (!fp8_gpu()) GTEST_SKIP() << "no sm_90 GPU"; \
  } while (0)

// Query lengths on and just off the 64-row warpgroup and 128-row block boundaries, and (as key
// lengths, equal to them in these cases) just off the 160-key tile boundary.
const std::vector<int> kOddLengths = {1, 63, 65, 127, 129, 159, 161, 1000};

TEST(CudaPrefillFp8, ExactPowersOfTwo) {
  KMLA_REQUIRE_FP8_GPU();
  uint64_t seed = 300;
  for (bool causal : {true, false}) {
    Case c;
    c.exact = true;
    c.causal = causal;
    c.heads = 3;
    c.shared_rope = false;
    c.q_scale = 1.f, c.k_scale = 1.f, c.v_scale = 1.f / 8;
    c.q_lens = kOddLengths;
    c.seed = ++seed;
    run_case(c);
    // Context chunks in front (m > n) and no keys at all.
    c.q_lens = {1, 37, 128, 65, 3, 0, 5};
    c.k_lens = {70, 137, 300, 129, 3, 50, 0};
    c.shared_rope = true;
    c.extra_max_q = 100;
    c.seed = ++seed;
    run_case(c);
  }
}

TEST(CudaPrefillFp8, RandomLengths) {
  KMLA_REQUIRE_FP8_GPU();
  uint64_t seed = 400;
  for (DType act : {DType::bf16, DType::f16})
    for (bool causal : {true, false}) {
      Case c;
      c.act = act;
      c.causal = causal;
      c.heads = 5;
      c.q_lens = kOddLengths;
      c.shared_rope = causal;
      c.seed = ++seed;
      run_case(c);
    }
}

TEST(CudaPrefillFp8, MoreKeysThanQueriesAndFewer) {
  KMLA_REQUIRE_FP8_GPU();
  uint64_t seed = 500;
  for (bool causal : {true, false}) {
    Case c;
    c.causal = causal;
    c.heads = 3;
    c.q_lens = {1, 37, 128, 65, 3, 0, 150, 9};
    c.k_lens = {70, 137, 300, 129, 3, 50, 70, 0};
    c.shared_rope = false;
    c.extra_max_q = 200;  // CTAs past every sequence's queries must leave cleanly
    c.seed = ++seed;
    run_case(c);
  }
}

TEST(CudaPrefillFp8, ExtremeScales) {
  KMLA_REQUIRE_FP8_GPU();
  // Tiny q scale on large codes, a huge k scale on small (partly subnormal) codes, a huge v
  // scale: the product of the scales, not the codes, sets the scores; out ~ 1e3.
  Case c;
  c.heads = 1;
  c.q_lens = {129, 300};
  c.k_lens = {129, 700};
  c.q_scale = 1e-4f, c.q_code_std = 200.f;
  c.k_scale = 2048.f, c.k_code_std = 0.02f;
  c.v_scale = 1e4f, c.v_code_std = 0.2f;
  c.seed = 600;
  run_case(c);
  c.causal = false;
  c.act = DType::f16;
  c.v_scale = 100.f;  // f16 output: keep out far below 65504
  c.seed = 601;
  run_case(c);
}

TEST(CudaPrefillFp8, LayerStrides) {
  KMLA_REQUIRE_FP8_GPU();
  uint64_t seed = 700;
  for (bool causal : {true, false})
    for (bool shared_rope : {true, false}) {
      Case c;
      c.causal = causal;
      c.heads = 16;
      c.q_lens = {200, 65};
      c.k_lens = {200, 321};
      c.shared_rope = shared_rope;
      c.strided = true;
      c.exact = !shared_rope;
      if (c.exact) c.q_scale = 0.5f, c.k_scale = 2.f;
      c.seed = ++seed;
      run_case(c);
    }
}

// The building blocks alone (prefill_fp8_probe), with small integers so that everything is
// exact: S = q k^T checks the Q and K layouts and both descriptors (SW128 nope, SW64 rope);
// O = e4m3(S) v checks the P fragment against the transposed, relabelled V^T.
TEST(CudaPrefillFp8, ProbeBuildingBlocks) {
  KMLA_REQUIRE_FP8_GPU();
  constexpr int kKeys = 160;  // one key tile: keys 128..159 sit in V^T's second panel
  Random rng(800);
  // q: one-hot rows (a random dim each), k: integers -3..3, so s = k[key][dim of the row] is
  // an integer in -3..3 (exact in e4m3); v: integers -4..4. O's sums stay far below 2^11.
  std::vector<uint8_t> q(64 * kQk), k(kKeys * kQk), v(kKeys * kV);
  std::vector<int> hot(64);
  for (int r = 0; r < 64; ++r) {
    hot[size_t(r)] = int(rng.below(kQk));
    for (int d = 0; d < kQk; ++d) q[size_t(r * kQk + d)] = float_to_e4m3_sat(d == hot[size_t(r)]);
  }
  for (auto& x : k) x = float_to_e4m3_sat(float(int(rng.below(7)) - 3));
  for (auto& x : v) x = float_to_e4m3_sat(float(int(rng.below(9)) - 4));
  DevBuf<uint8_t> dq(q), dk(k), dv(v);
  DevBuf<float> ds(64 * kKeys), dout(64 * 128);
  ds.fill_bytes(0xFF);  // NaN: an element the probe did not write fails
  dout.fill_bytes(0xFF);
  cuda::prefill_fp8_probe(dq.ptr, dk.ptr, dv.ptr, ds.ptr, dout.ptr, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> s = ds.download(), o = dout.download();
  int bad_s = 0, bad_o = 0;
  for (int r = 0; r < 64; ++r)
    for (int j = 0; j < kKeys; ++j) {
      const float want = e4m3_to_float(k[size_t(j * kQk + hot[size_t(r)])]);
      const float got = s[size_t(r * kKeys + j)];
      if (got != want && ++bad_s <= 8)
        ADD_FAILURE() << "S row " << r << " key " << j << " (q dim " << hot[size_t(r)] << "): got "
                      << got << " want " << want;
    }
  for (int r = 0; r < 64; ++r)
    for (int d = 0; d < kV; ++d) {
      double want = 0;
      for (int j = 0; j < kKeys; ++j)
        want += double(e4m3_to_float(k[size_t(j * kQk + hot[size_t(r)])])) *
                e4m3_to_float(v[size_t(j * kV + d)]);
      const float got = o[size_t(r * kV + d)];
      if (double(got) != want && ++bad_o <= 8)
        ADD_FAILURE() << "O row " << r << " dim " << d << ": got " << got << " want " << want;
    }
  EXPECT_EQ(bad_s, 0) << "S mismatches (Q/K layouts or descriptors)";
  EXPECT_EQ(bad_o, 0) << "O mismatches (P fragment or V^T layout)";
}

// Host-side validation: runs without a GPU (the checks come before any CUDA call).
// Variant options out of range are errors naming them, raised before any launch.
TEST(CudaPrefillFp8, RejectsBadOptions) {
  KMLA_REQUIRE_FP8_GPU();
  const int H = 3, n = 130;
  const std::vector<int32_t> cu = seq_offsets({n});
  test::PrefillLayout<uint8_t> lay(H, false, true, n + kPadRows, n + kPadRows, kNanCode);
  test::PrefillBuffers<uint8_t> dev(lay, H, cu, cu, n + kPadRows);
  DevBuf<float> scales(std::vector<float>{1.f, 1.f, 1.f});
  DevBuf<int32_t> counter(std::vector<int32_t>{0, 0});
  cuda::PrefillParams& p = dev.params;
  p.max_q_len = n;
  p.fp8 = true;
  p.q_scale = scales.ptr;
  p.k_scale = scales.ptr + 1;
  p.v_scale = scales.ptr + 2;
  p.work_counter = counter.ptr;
  auto expect_error = [&](const cuda::Fp8PrefillOptions& opt, const std::string& needle) {
    try {
      cuda::prefill_attention_fp8(p, nullptr, opt);
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  cuda::Fp8PrefillOptions opt;
  opt.ctas = -2;
  expect_error(opt, "ctas must be -1, 0 or positive, got -2");
  opt = {};
  opt.head_group = 129;
  expect_error(opt, "head_group must be in [0, 128], got 129");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(counter.download(), (std::vector<int32_t>{0, 0}));
}

TEST(CudaPrefillFp8, RejectsBadParams) {
  alignas(16) static uint8_t buf[1024];
  static float scales[3];
  static int32_t cu[2];
  cuda::PrefillParams p;
  p.q = {buf, 384, 192};
  p.k_nope = {buf, 256, 128};
  p.k_rope = {buf, 64, 0};
  p.v = {buf, 256, 128};
  p.out = buf;
  p.out_row_stride = 256;
  p.out_head_stride = 128;
  p.lse = scales;
  p.lse_row_stride = 2;
  p.heads = 2;
  p.cu_q = cu;
  p.cu_k = cu;
  p.num_seqs = 1;
  p.max_q_len = 1;
  p.fp8 = true;
  p.q_scale = p.k_scale = p.v_scale = scales;
  auto expect_error = [&](const cuda::PrefillParams& bad, const std::string& needle) {
    try {
      cuda::prefill_attention(bad, nullptr);
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  cuda::PrefillParams bad = p;
  bad.portable = true;
  expect_error(bad, "portable");
  bad = p;
  bad.k_nope.row_stride = 264;  // 16-bit rule (8 elements) but not 16 bytes
  expect_error(bad, "k_nope.row_stride");
  bad = p;
  bad.v.head_stride = 0;  // only k_rope may be shared
  expect_error(bad, "v.head_stride");
  bad = p;
  bad.q.row_stride = -384;
  expect_error(bad, "q.row_stride");
  bad = p;
  bad.v_scale = nullptr;
  expect_error(bad, "v_scale");
  bad = p;
  bad.k_rope.ptr = buf + 8;
  expect_error(bad, "k_rope.ptr");
  // The 16-bit kernels refuse fp8 inputs outright.
  try {
    cuda::prefill_attention_rows(p, 128, nullptr);
    ADD_FAILURE() << "prefill_attention_rows took fp8 inputs";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kmla
