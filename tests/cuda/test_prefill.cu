// Prefill attention (cuda::prefill_attention) against the CPU backend's fp32
// prefill_attention_f32 on the same act-rounded inputs: bf16 and f16, causal and not, odd
// lengths, several sequences per call (some empty), more keys than queries and fewer, shared
// and per-head k_rope, and the layer's strided operands. Outputs are poisoned before each
// call so every unwritten element and every write outside the sequences is caught. Every case
// runs both tilings of the mma.sync kernel (64 and 128 query rows per CTA, through
// prefill_attention_rows), the public entry point (whatever kernel and tiling it picks) and,
// on sm_90 GPUs, the wgmma kernel (prefill_attention_sm90).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "core/random.hpp"
#include "cpu/kernels.hpp"
#include "cuda/attention.cuh"
#include "cuda/gpu.hpp"
#include "cuda/prefill_attention.cuh"
#include "cuda/prefill_layout.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"

namespace kmla {
namespace {

using test::DevBuf;
using test::seq_offsets;

constexpr int kQk = 192, kNope = 128, kRope = 64, kV = 128;
constexpr int kPadRows =
    64;  // NaN rows past the last token of every input, poisoned rows of outputs

float act_value(uint16_t code, DType act) {
  return act == DType::bf16 ? bf16_to_float(code) : fp16_to_float(code);
}
uint16_t act_code(float x, DType act) {
  return act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
}
uint16_t act_nan(DType act) { return act == DType::bf16 ? 0x7fc0 : 0x7e00; }

using HostOperand = test::PrefillOperand<uint16_t>;

// Fills rows [first, rows) of `o` with act-rounded N(0, gain^2) values (a shared operand,
// head_stride 0, is filled once).
void fill_random(const HostOperand& o, int64_t first, int64_t rows, int heads, float gain,
                 DType act, Random& rng) {
  const int hs = o.head_stride == 0 ? 1 : heads;
  for (int64_t t = first; t < rows; ++t)
    for (int h = 0; h < hs; ++h)
      for (int d = 0; d < o.width; ++d)
        (*o.buf)[size_t(o.at(t, h, d))] = act_code(float(rng.normal()) * gain, act);
}

struct Case {
  DType act = DType::bf16;
  bool causal = true;
  int heads = 3;
  std::vector<int> q_lens;
  std::vector<int> k_lens;     // empty: the same as q_lens
  bool shared_rope = true;     // k_rope head_stride 0
  bool layer_strides = false;  // the layer's operand layout (see below) instead of dense ones
  int extra_max_q = 0;         // max_q_len passed = longest query run + this (a loose bound)
  int lead_rows = 0;           // NaN rows before the first sequence (cu_q[0] = cu_k[0] = this)
  int64_t total_q = -1;        // PrefillParams::total_q: -1 the exact sum of q_lens, else this
  uint64_t seed = 1;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << dtype_name(c.act) << (c.causal ? " causal" : " non-causal") << " heads " << c.heads
    << (c.shared_rope ? " shared-rope" : " per-head-rope")
    << (c.layer_strides ? " layer-strides" : "") << " q_lens";
  for (int n : c.q_lens) s << ' ' << n;
  s << " k_lens";
  for (int n : (c.k_lens.empty() ? c.q_lens : c.k_lens)) s << ' ' << n;
  return s.str();
}

void check_result(const Case& c, const std::vector<int32_t>& cu_q, const std::vector<uint16_t>& out,
                  const std::vector<float>& lse, const std::vector<float>& ref,
                  const std::vector<float>& ref_mag, const std::vector<float>& ref_lse,
                  int64_t out_row_stride, int64_t out_head_stride, int64_t lse_row_stride);

// The wgmma kernel's variants that run_case runs (variant -1 .. -7), each one of both
// producers (TMA for whole boxes, the default; or cp.async throughout) and of both grids for
// several sequences (the compact 1-D grid, the default, or the 3-D grid), so that all stay
// covered: -1 the defaults (TMA, compact); -2 in order with round 1's CTA order, 3-D grid;
// -3 ping-pong with head groups of 3 (a partial last group for most head counts), 7 CTAs; -4
// ping-pong without the early rescale in groups of 1 (heads-major order), cp.async, 3 CTAs;
// -5 round 1's kernel (no ping-pong, late rescale, head after head), cp.async, 3-D grid; -6
// the defaults with cp.async; -7 in order, cp.async, 3-D grid; -8 in order, 2 CTAs. All but
// -6 run with a work counter (run_case), so with a few CTAs every CTA of a compact grid takes
// many items from it, which exercises the barrier phases carried from item to item, the
// hand-over of Q and the counter's reset; -6 runs one CTA per item (no counter).
cuda::Sm90Options sm90_variant(int variant) {
  cuda::Sm90Options o;  // -1: the defaults
  if (variant == -2) {
    o.overlap = false;
    o.head_group = 0;
    o.compact = false;
  } else if (variant == -3) {
    o.pingpong = true;
    o.head_group = 3;
    o.ctas = 7;
  } else if (variant == -4) {
    o.pingpong = true;
    o.early_rescale = false;
    o.head_group = 1;
    o.tma = false;
    o.ctas = 3;
  } else if (variant == -5) {
    o.pingpong = false;
    o.early_rescale = false;
    o.head_group = 0;
    o.tma = false;
    o.compact = false;
  } else if (variant == -6) {
    o.tma = false;
  } else if (variant == -7) {
    o.overlap = false;
    o.tma = false;
    o.compact = false;
  } else if (variant == -8) {
    o.overlap = false;
    o.ctas = 2;
  }
  return o;
}

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  const int H = c.heads;
  const std::vector<int>& k_lens = c.k_lens.empty() ? c.q_lens : c.k_lens;
  ASSERT_EQ(k_lens.size(), c.q_lens.size());
  std::vector<int32_t> cu_q = seq_offsets(c.q_lens), cu_k = seq_offsets(k_lens);
  for (int32_t& x : cu_q) x += c.lead_rows;
  for (int32_t& x : cu_k) x += c.lead_rows;
  const int64_t Tq = cu_q.back(), Tk = cu_k.back();
  const int64_t q_rows = Tq + kPadRows, k_rows = Tk + kPadRows;

  // Dense or layer-strided operands, NaN everywhere else (tests/cuda/prefill_layout.hpp).
  test::PrefillLayout<uint16_t> lay(H, c.layer_strides, c.shared_rope, q_rows, k_rows,
                                    act_nan(c.act));
  const HostOperand &q = lay.q, &k_nope = lay.k_nope, &v = lay.v, &k_rope = lay.k_rope;

  Random rng(c.seed);
  // q twice as large as k spreads the scaled scores (std ~2) so the softmax is far from flat
  // and the running max changes from tile to tile.
  fill_random(q, c.lead_rows, Tq, H, 2.0f, c.act, rng);
  fill_random(k_nope, c.lead_rows, Tk, H, 1.0f, c.act, rng);
  fill_random(k_rope, c.lead_rows, Tk, H, 1.0f, c.act, rng);
  fill_random(v, c.lead_rows, Tk, H, 1.0f, c.act, rng);

  // The reference's dense fp32 operands (the same act values), and |v| for the error bound.
  std::vector<float> qf(size_t(Tq * H * kQk)), kf(size_t(Tk * H * kQk));
  std::vector<float> vf(size_t(Tk * H * kV)), vabs(vf.size());
  for (int64_t t = 0; t < Tq; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < kQk; ++d)
        qf[size_t((t * H + h) * kQk + d)] = act_value(lay.q_buf[size_t(q.at(t, h, d))], c.act);
  for (int64_t t = 0; t < Tk; ++t)
    for (int h = 0; h < H; ++h) {
      for (int d = 0; d < kNope; ++d)
        kf[size_t((t * H + h) * kQk + d)] =
            act_value(lay.kv_buf[size_t(k_nope.at(t, h, d))], c.act);
      for (int d = 0; d < kRope; ++d)
        kf[size_t((t * H + h) * kQk + kNope + d)] =
            act_value(lay.rope_buf[size_t(k_rope.at(t, h, d))], c.act);
      for (int d = 0; d < kV; ++d) {
        const float x = act_value((*v.buf)[size_t(v.at(t, h, d))], c.act);
        vf[size_t((t * H + h) * kV + d)] = x;
        vabs[size_t((t * H + h) * kV + d)] = std::fabs(x);
      }
    }
  const float scale = 1.0f / std::sqrt(float(kQk));
  std::vector<int64_t> cu_q64(cu_q.begin(), cu_q.end()), cu_k64(cu_k.begin(), cu_k.end());
  std::vector<float> ref(size_t(Tq * H * kV)), ref_mag(ref.size()), ref_lse(size_t(Tq * H));
  std::vector<float> mag_lse(ref_lse.size());
  cpu::PrefillProblem prob;
  prob.q = {qf.data(), int64_t(H) * kQk, kQk};
  prob.k = {kf.data(), int64_t(H) * kQk, kQk};
  prob.v = {vf.data(), int64_t(H) * kV, kV};
  prob.out = ref.data();
  prob.out_row_stride = int64_t(H) * kV;
  prob.out_head_stride = kV;
  prob.lse = ref_lse.data();
  prob.lse_row_stride = H;
  prob.heads = H;
  prob.cu_q = &cu_q64;
  prob.cu_k = &cu_k64;
  prob.causal = c.causal;
  prob.scale = scale;
  cpu::prefill_attention_f32(prob, 4);
  // mag = sum_j p_j |v_j| / l: bounds the effect of rounding P to act (see the tolerance).
  prob.v.ptr = vabs.data();
  prob.out = ref_mag.data();
  prob.lse = mag_lse.data();
  cpu::prefill_attention_f32(prob, 4);

  test::PrefillBuffers<uint16_t> dev(lay, H, cu_q, cu_k, q_rows);
  cuda::PrefillParams& p = dev.params;
  p.max_q_len = *std::max_element(c.q_lens.begin(), c.q_lens.end()) + c.extra_max_q;
  p.total_q = c.total_q < 0 ? Tq - c.lead_rows : c.total_q;
  p.causal = c.causal;
  p.softmax_scale = scale;
  p.act = c.act;
  // rows_per_cta 64 / 128: the mma.sync kernel's tilings; 0: the public prefill_attention
  // (its own choice of kernel and tiling); -1..-8: the wgmma kernel's variants (sm90_variant;
  // sm_90 GPUs only).
  const bool sm90 = cuda::prefill_sm90_supported(p);
  DevBuf<int32_t> counter(std::vector<int32_t>{0, 0});
  for (int rows_per_cta : {64, 128, 0, -1, -2, -3, -4, -5, -6, -7, -8}) {
    if (rows_per_cta < 0 && !sm90) continue;
    const cuda::Sm90Options opt = sm90_variant(rows_per_cta);
    SCOPED_TRACE(rows_per_cta == 0 ? std::string("public entry point")
                 : rows_per_cta < 0
                     ? "wgmma kernel (sm90) overlap " + std::to_string(opt.overlap) + " pingpong " +
                           std::to_string(opt.pingpong) + " early_rescale " +
                           std::to_string(opt.early_rescale) + " head_group " +
                           std::to_string(opt.head_group) + " tma " + std::to_string(opt.tma) +
                           " compact " + std::to_string(opt.compact) + " ctas " +
                           std::to_string(opt.ctas)
                     : "rows_per_cta " + std::to_string(rows_per_cta));
    dev.out.fill_bytes(0xFF);
    dev.lse.fill_bytes(0xFF);
    p.work_counter = rows_per_cta == -6 ? nullptr : counter.ptr;
    if (rows_per_cta == 0)
      cuda::prefill_attention(p, nullptr);
    else if (rows_per_cta < 0)
      cuda::prefill_attention_sm90(p, nullptr, opt);
    else
      cuda::prefill_attention_rows(p, rows_per_cta, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    check_result(c, cu_q, dev.out.download(), dev.lse.download(), ref, ref_mag, ref_lse,
                 lay.out_row_stride, lay.out_head_stride, lay.lse_row_stride);
    EXPECT_EQ(counter.download(), (std::vector<int32_t>{0, 0})) << "work counter not reset";
  }
}

// Compares one kernel run's out and lse with the reference, and checks that nothing outside
// the sequences' rows was written.
void check_result(const Case& c, const std::vector<int32_t>& cu_q, const std::vector<uint16_t>& out,
                  const std::vector<float>& lse, const std::vector<float>& ref,
                  const std::vector<float>& ref_mag, const std::vector<float>& ref_lse,
                  int64_t out_row_stride, int64_t out_head_stride, int64_t lse_row_stride) {
  const int H = c.heads;
  const int num_seqs = int(cu_q.size()) - 1;

  // Tolerance. The kernel differs from the fp32 reference by (a) P rounded to act before
  // P.V: |error| <= u * sum_j p_j |v_j| / l = u * mag (u = half an ulp at 1, relative), and
  // (b) one rounding of the output: <= u * |out| <= u * mag; fp32 effects (accumulation
  // order, ex2.approx) are ~1e-6 relative. So |error| <= 2u * mag = 1 ulp(1) * mag; we allow
  // 2 ulp(1) * mag, plus 1e-5 absolute for f16 subnormal P and the fp32 noise at tiny mag.
  const float ulp1 = c.act == DType::bf16 ? 0x1p-7f : 0x1p-10f;
  std::vector<char> out_written(out.size(), 0), lse_written(lse.size(), 0);
  int bad = 0;
  double worst = 0;  // largest |error| / tolerance seen
  auto report = [&](const std::string& what) {
    if (++bad <= 8) ADD_FAILURE() << what;
  };
  for (int s = 0; s < num_seqs; ++s) {
    for (int64_t t = cu_q[size_t(s)]; t < cu_q[size_t(s) + 1]; ++t) {
      for (int h = 0; h < H; ++h) {
        const int64_t li = t * lse_row_stride + h;
        lse_written[size_t(li)] = 1;
        const float want_lse = ref_lse[size_t(t * H + h)], got_lse = lse[size_t(li)];
        const bool lse_ok = std::isinf(want_lse)
                                ? (std::isinf(got_lse) && got_lse < 0)
                                // LSE = max + log(l): fp32 noise ~1e-6; 1e-3 is a loose cap.
                                : std::fabs(got_lse - want_lse) <= 1e-3f;
        if (!lse_ok) {
          std::ostringstream m;
          m << "lse seq " << s << " row " << t << " head " << h << ": got " << got_lse << " want "
            << want_lse;
          report(m.str());
        }
        for (int d = 0; d < kV; ++d) {
          const int64_t oi = t * out_row_stride + h * out_head_stride + d;
          out_written[size_t(oi)] = 1;
          const float got = act_value(out[size_t(oi)], c.act);
          const float want = ref[size_t((t * H + h) * kV + d)];
          const float tol = 2.0f * ulp1 * ref_mag[size_t((t * H + h) * kV + d)] + 1e-5f;
          const float err = std::fabs(got - want);
          if (!(err <= tol)) {  // NaN fails here
            std::ostringstream m;
            m << "out seq " << s << " row " << t << " head " << h << " dim " << d << ": got " << got
              << " want " << want << " tol " << tol;
            report(m.str());
          }
          worst = std::max(worst, double(err) / tol);
        }
      }
    }
  }
  for (size_t i = 0; i < out.size(); ++i)
    if (!out_written[i] && out[i] != 0xFFFF)
      report("out element " + std::to_string(i) + " written");
  for (size_t i = 0; i < lse.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &lse[i], 4);
    if (!lse_written[i] && bits != 0xFFFFFFFFu)
      report("lse element " + std::to_string(i) + " written");
  }
  EXPECT_EQ(bad, 0) << "mismatches; worst error / tolerance " << worst;
}

TEST(CudaPrefill, SingleSequenceLengths) {
  KMLA_REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType act : {DType::bf16, DType::f16})
    for (bool causal : {true, false})
      for (int len : {1, 63, 64, 65, 127, 128, 129, 200}) {
        Case c;
        c.act = act;
        c.causal = causal;
        c.heads = 3;
        c.q_lens = {len};
        c.shared_rope = (len % 2) == 1;
        c.seed = ++seed;
        run_case(c);
      }
}

TEST(CudaPrefill, MixedSequencesWithEmptyOnes) {
  KMLA_REQUIRE_GPU();
  for (bool causal : {true, false}) {
    Case c;
    c.causal = causal;
    c.heads = 16;
    c.q_lens = {0, 5, 130, 0, 64, 1, 257, 0};
    c.extra_max_q = 200;  // CTAs of query blocks past every sequence must exit cleanly
    c.seed = causal ? 7 : 8;
    run_case(c);
  }
}

TEST(CudaPrefill, MoreKeysThanQueries) {
  KMLA_REQUIRE_GPU();
  // Context chunks: m > n (bottom-right causal: the first query already sees m - n + 1 keys).
  uint64_t seed = 20;
  for (DType act : {DType::bf16, DType::f16})
    for (bool causal : {true, false})
      for (int heads : {1, 3}) {
        Case c;
        c.act = act;
        c.causal = causal;
        c.heads = heads;
        c.q_lens = {1, 37, 128, 65, 3, 0};
        c.k_lens = {70, 137, 300, 129, 3, 50};
        c.shared_rope = heads == 1;
        c.seed = ++seed;
        run_case(c);
      }
}

TEST(CudaPrefill, FewerKeysThanQueriesAndNoKeys) {
  KMLA_REQUIRE_GPU();
  // m < n: with causal the first n - m rows see nothing (zeros, -inf); m = 0 rows see nothing
  // either way.
  for (bool causal : {true, false}) {
    Case c;
    c.causal = causal;
    c.heads = 3;
    c.q_lens = {3, 4, 150, 9};
    c.k_lens = {0, 2, 70, 9};
    c.shared_rope = false;
    c.seed = causal ? 31 : 32;
    run_case(c);
  }
}

TEST(CudaPrefill, LayerStrides) {
  KMLA_REQUIRE_GPU();
  uint64_t seed = 40;
  for (DType act : {DType::bf16, DType::f16})
    for (bool causal : {true, false})
      for (bool shared_rope : {true, false}) {
        Case c;
        c.act = act;
        c.causal = causal;
        c.heads = 16;
        c.q_lens = {200, 65};
        c.k_lens = {200, 321};
        c.shared_rope = shared_rope;
        c.layer_strides = true;
        c.seed = ++seed;
        run_case(c);
      }
}

TEST(CudaPrefill, LongerSequence) {
  KMLA_REQUIRE_GPU();
  // Many key tiles (both smem stages reused many times) and several query blocks.
  Case c;
  c.heads = 4;
  c.q_lens = {777};
  c.k_lens = {1000};
  c.layer_strides = true;
  c.seed = 50;
  run_case(c);
  c.act = DType::f16;
  c.causal = false;
  c.k_lens = {777};
  c.seed = 51;
  run_case(c);
}

TEST(CudaPrefill, LongCausalSequences) {
  KMLA_REQUIRE_GPU();
  // Many 128-key stages of the wgmma kernel's ring (each reused 4+ times), query blocks whose
  // two warpgroups stop at different tiles, and a context chunk in front (m > n).
  Case c;
  c.heads = 2;
  c.q_lens = {1000, 130};
  c.k_lens = {1000, 1100};
  c.shared_rope = false;
  c.seed = 60;
  run_case(c);
}

TEST(CudaPrefill, ManyShortSequences) {
  KMLA_REQUIRE_GPU();
  // A varlen batch of 24 sequences of 1..300 queries (1..3 query blocks, so most CTAs of the
  // grid's longest-first order exit at once), some with context in front, at 5 and 11 heads:
  // the wgmma kernel's head groups of 8 and 3 then end in partial groups, and its two
  // consumers take turns over 0..3 tiles with every difference in their tile counts.
  uint64_t seed = 70;
  for (int heads : {5, 11})
    for (bool causal : {true, false}) {
      Random rng(++seed);
      Case c;
      c.causal = causal;
      c.heads = heads;
      for (int s = 0; s < 24; ++s) {
        const int n = 1 + int(rng.below(300));
        c.q_lens.push_back(n);
        c.k_lens.push_back(n + (s % 3 == 0 ? int(rng.below(200)) : 0));
      }
      c.shared_rope = heads == 11;
      c.seed = ++seed;
      run_case(c);
    }
}

// The compact grid's adversarial batch: sequences of 0, 1, 2, 127, 128, 129, 255 and 1025
// queries (around the 128-row block and key tile) in a random order (empty sequences
// between others, whose scan entries are 0); some with context in front (m > n); NaN rows in
// front of the first sequence (cu_q[0] > 0) and after the last; 3 and 16 heads (a partial
// head group of 3 heads for the default groups of 8, and two whole groups). At 3 heads
// total_q exact, loose (CTAs past the items must leave without writing) and unknown (0:
// sized from max_q_len); at 16 heads exact only (the CPU reference dominates the run time).
TEST(CudaPrefill, CompactGridVarlen) {
  KMLA_REQUIRE_GPU();
  uint64_t seed = 300;
  for (int heads : {3, 16})
    for (bool causal : {true, false}) {
      Random rng(++seed);
      std::vector<int> lens = {0, 1, 2, 127, 128, 129, 255, 1025};
      for (size_t i = lens.size() - 1; i > 0; --i)
        std::swap(lens[i], lens[size_t(rng.below(uint64_t(i + 1)))]);
      Case c;
      c.causal = causal;
      c.heads = heads;
      c.q_lens = lens;
      for (size_t i = 0; i < lens.size(); ++i)
        c.k_lens.push_back(lens[i] + (i % 3 == 1 ? 1 + int(rng.below(300)) : 0));
      c.lead_rows = 37;
      c.shared_rope = heads == 3;
      c.seed = ++seed;
      for (int64_t total_q : {int64_t(-1), int64_t(4000), int64_t(0)}) {
        if (heads == 16 && total_q != -1) continue;
        c.total_q = total_q;
        SCOPED_TRACE("total_q " + std::to_string(total_q));
        run_case(c);
      }
    }
}

// A batch whose query blocks fill the compact grid's bound exactly (every length 1 mod 128,
// so sum ceil(n / 128) = floor((total + 127 num_seqs) / 128)): the grid's last CTA holds a
// real item, and an off-by-one in either the bound or the item order loses a block.
TEST(CudaPrefill, CompactGridFullBound) {
  KMLA_REQUIRE_GPU();
  for (bool causal : {true, false}) {
    Case c;
    c.causal = causal;
    c.heads = 5;
    c.q_lens = {129, 1, 1025, 257};
    c.k_lens = {129, 130, 1025, 257};
    c.seed = causal ? 401 : 402;
    run_case(c);
  }
}

// The compact grid's size is host arithmetic on the plan (no GPU): the bound, its exact hit,
// the max_q_len bound when that is tighter or total_q unknown, and the 2^31 limit.
TEST(CudaPrefill, CompactGridSize) {
  cuda::PrefillParams p;
  p.heads = 5;
  p.num_seqs = 4;
  p.max_q_len = 1025;
  p.total_q = 129 + 1 + 1025 + 257;  // blocks 2 + 1 + 9 + 3 = 15 = (1412 + 4 * 127) / 128
  EXPECT_EQ(cuda::prefill_sm90_compact_items(p), 5 * 15);
  p.total_q = 0;  // unknown: 4 sequences x 9 blocks
  EXPECT_EQ(cuda::prefill_sm90_compact_items(p), 5 * 36);
  p.total_q = 4 * 1025 + 1000;  // a loose total: max_q_len's bound is the tighter one
  EXPECT_EQ(cuda::prefill_sm90_compact_items(p), 5 * 36);
  p.num_seqs = 1;  // one sequence: the 3-D grid's CTAs exactly
  p.max_q_len = 8192;
  p.total_q = 8192;
  EXPECT_EQ(cuda::prefill_sm90_compact_items(p), 5 * 64);
  // Random batches: the bound covers every real item and exceeds them by less than one
  // block per sequence and head.
  Random rng(500);
  for (int trial = 0; trial < 200; ++trial) {
    p.heads = 1 + int(rng.below(128));
    p.num_seqs = 1 + int(rng.below(40));
    int64_t total = 0, blocks = 0;
    int longest = 0;
    for (int s = 0; s < p.num_seqs; ++s) {
      const int n = rng.below(4) == 0 ? int(rng.below(3)) : int(rng.below(5000));
      total += n;
      blocks += (n + 127) / 128;
      longest = std::max(longest, n);
    }
    p.max_q_len = longest + int(rng.below(2)) * int(rng.below(300));  // exact or loose
    p.total_q = total;
    const int64_t items = cuda::prefill_sm90_compact_items(p), real = blocks * p.heads;
    EXPECT_GE(items, real) << "trial " << trial;
    EXPECT_LT(items, real + int64_t(p.num_seqs) * p.heads) << "trial " << trial;
  }
  p.heads = 128;
  p.num_seqs = 65535;
  p.max_q_len = 1 << 20;
  p.total_q = 0;
  try {
    (void)cuda::prefill_sm90_compact_items(p);
    ADD_FAILURE() << "no error for a compact grid above 2^31 - 1 CTAs";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("compact grid"), std::string::npos) << e.what();
  }
}

// The public entry point's kernel and tiling (printed so that a benchmark log says which ran).
TEST(CudaPrefill, TilingChoice) {
  KMLA_REQUIRE_GPU();
  cuda::PrefillParams p;
  const int rows = cuda::prefill_rows_per_cta(p);
  if (cuda::prefill_uses_sm90(p))
    std::printf("prefill_attention uses the wgmma kernel (sm90, 128 query rows per CTA)\n");
  else
    std::printf("prefill_attention uses the mma.sync kernel, %d query rows per CTA\n", rows);
  EXPECT_TRUE(rows == 64 || rows == 128) << rows;
  p.portable = true;
  EXPECT_FALSE(cuda::prefill_uses_sm90(p)) << "portable must keep the mma.sync kernel";
}

// Host-side validation happens before any CUDA call, so this runs without a GPU too.
TEST(CudaPrefill, RejectsBadArguments) {
  alignas(16) static uint16_t dummy[1024];
  static int32_t cu[2] = {0, 1};
  auto valid = [&] {
    cuda::PrefillParams p;
    p.q = {dummy, 3 * 192, 192};
    p.k_nope = {dummy, 3 * 256, 256};
    p.k_rope = {dummy, 64, 0};
    p.v = {dummy + 128, 3 * 256, 256};
    p.out = dummy;
    p.out_row_stride = 3 * 128;
    p.out_head_stride = 128;
    p.lse = reinterpret_cast<float*>(dummy);
    p.lse_row_stride = 3;
    p.heads = 3;
    p.cu_q = cu;
    p.cu_k = cu;
    p.num_seqs = 1;
    p.max_q_len = 1;
    p.softmax_scale = 0.1f;
    return p;
  };
  auto expect_error = [&](cuda::PrefillParams p, const char* needle) {
    try {
      cuda::prefill_attention(p, nullptr);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  cuda::PrefillParams p = valid();
  p.q.row_stride += 4;  // 8 bytes: not a multiple of 16
  expect_error(p, "q.row_stride");
  p = valid();
  p.v.head_stride = 260;
  expect_error(p, "v.head_stride");
  p = valid();
  p.k_rope.ptr = dummy + 4;
  expect_error(p, "k_rope.ptr");
  p = valid();
  p.out_head_stride = 130;
  expect_error(p, "out.head_stride");
  p = valid();
  p.heads = 0;
  expect_error(p, "heads");
  p = valid();
  p.heads = 129;
  expect_error(p, "heads");
  p = valid();
  p.softmax_scale = 0.0f;
  expect_error(p, "softmax_scale");
  p = valid();
  p.act = DType::f32;
  expect_error(p, "bf16 or f16");
  p = valid();
  p.total_q = -1;
  expect_error(p, "total_q");
  try {
    cuda::prefill_attention_rows(valid(), 96, nullptr);
    ADD_FAILURE() << "no error for rows_per_cta 96";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows_per_cta"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kmla
