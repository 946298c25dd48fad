// The CPU layer against the fp64 oracle on the standard grid, plus the properties a
// shared misreading cannot fake: absorption (decode path == prefill path), independence
// from the context chunk size, padding rows, tensor-parallel sharding, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "verify/cases.hpp"

namespace kmla {
namespace {

using verify::Case;

class StandardCase : public ::testing::TestWithParam<Case> {};

TEST_P(StandardCase, CpuMatchesOracle) {
  const verify::Report r = verify::run_case(GetParam());
  EXPECT_TRUE(r.pass) << r.detail << " (err " << r.err_backend << ", baseline " << r.err_baseline
                      << ", bound " << r.bound << ", cache " << r.cache_err << ")";
  // A tolerance that is never approached proves little; a zero baseline would mean the
  // seed-rounding oracle rounds nothing, which is a defect of the test itself.
  EXPECT_GT(r.err_baseline, 0.0);
  EXPECT_GT(r.max_ref, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Grid, StandardCase, ::testing::ValuesIn(verify::standard_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n = info.param.name;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

struct LayerRun {
  HostTensor out;
  LatentCache cache;
};

LayerRun run_layer(const Case& c, const verify::Inputs& in, LayerOptions lo = {}) {
  std::shared_ptr<const RopeTable> rope;
  if (c.config.use_rope) rope = RopeTable::build(c.config, c.rope_rows);
  lo.activation = c.activation;
  lo.fp8_prefill = c.fp8_prefill;
  MlaLayer layer(c.config, in.weights, lo, rope);
  LayerRun r{HostTensor(c.activation, {in.md.num_rows, c.config.hidden_size}), in.cache.clone()};
  layer.forward(in.positions.view(), in.hidden.view(), &in.md, r.cache, r.out.view());
  return r;
}

float act(const HostTensor& t, int64_t i) { return bf16_to_float(t.data<uint16_t>()[i]); }

double max_abs(const HostTensor& t, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, double(std::fabs(act(t, i))));
  return m;
}

// The same two-token request through the prefill path (threshold 1) and through the
// absorbed decode path (threshold 2): the rows agree. With a bf16 cache both paths see the
// same key values; they differ only in where bf16 rounding happens (ql_nope and the latent
// on one side, k_nope and v on the other), a few ulps of the output at most.
TEST(Layer, AbsorbedDecodeMatchesPrefillPath) {
  Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 21);
  c.requests = {{2, 40}, {2, 17}};
  c.padding_rows = 0;
  c.decode_threshold = 1;
  const verify::Inputs as_prefill = verify::make_inputs(c);
  c.decode_threshold = 2;
  const verify::Inputs as_decode = verify::make_inputs(c);
  ASSERT_EQ(as_prefill.md.num_decodes, 0);
  ASSERT_EQ(as_decode.md.num_decodes, 2);
  const LayerRun a = run_layer(c, as_prefill), b = run_layer(c, as_decode);
  // Rows are laid out differently: both are in layout order of their own plan.
  const int64_t hid = c.config.hidden_size;
  double m = 0, d = 0;
  for (int64_t row = 0; row < as_prefill.md.num_tokens; ++row) {
    const int64_t caller = as_prefill.md.row_order[row];
    int64_t other = 0;
    while (as_decode.md.row_order[other] != caller) ++other;
    for (int64_t j = 0; j < hid; ++j) {
      m = std::max(m, double(std::fabs(act(a.out, row * hid + j))));
      d = std::max(d, double(std::fabs(act(a.out, row * hid + j) - act(b.out, other * hid + j))));
    }
  }
  EXPECT_GT(m, 0.0);
  EXPECT_LE(d, 0x1p-6 * m);
}

// The context chunk size changes only the order of LSE merges.
TEST(Layer, ContextChunkSizeDoesNotMatter) {
  Case c = verify::mixed_case("kimi-k3-dspark", CacheFormat::fp8_ds_mla, 16, 22);
  c.workspace_tokens = 16;  // many chunks
  const verify::Inputs small = verify::make_inputs(c);
  c.workspace_tokens = 1 << 16;  // one chunk
  const verify::Inputs big = verify::make_inputs(c);
  ASSERT_GT(small.md.context_chunks.size(), 3u);
  ASSERT_EQ(big.md.context_chunks.size(), 1u);
  const LayerRun a = run_layer(c, small), b = run_layer(c, big);
  const int64_t n = small.md.num_tokens * c.config.hidden_size;
  const double m = max_abs(b.out, n);
  double d = 0;
  for (int64_t i = 0; i < n; ++i) d = std::max(d, double(std::fabs(act(a.out, i) - act(b.out, i))));
  // Each extra merge rounds the attention output to bf16 once more (2^-9 relative); a few
  // of those, carried through o_proj, stay well under 2^-6 of the largest output.
  EXPECT_LE(d, 0x1p-6 * m);
  EXPECT_EQ(std::memcmp(a.cache.base(), b.cache.base(), a.cache.geometry().block_stride * a.cache.num_blocks()), 0);
}

// Padding rows (junk hidden states, slot -1) change nothing in the real rows and get zeros.
TEST(Layer, PaddingRowsChangeNothing) {
  Case c = verify::mixed_case("kimi-linear-48b", CacheFormat::fp8, 16, 23);
  c.padding_rows = 0;
  const verify::Inputs plain = verify::make_inputs(c);
  c.padding_rows = 5;
  const verify::Inputs padded = verify::make_inputs(c);
  const LayerRun a = run_layer(c, plain), b = run_layer(c, padded);
  const int64_t n = plain.md.num_tokens * c.config.hidden_size;
  EXPECT_EQ(std::memcmp(a.out.data<void>(), b.out.data<void>(), n * 2), 0);
  for (int64_t i = n; i < b.out.numel(); ++i) ASSERT_EQ(b.out.data<uint16_t>()[i] & 0x7fff, 0);
  EXPECT_EQ(std::memcmp(a.cache.base(), b.cache.base(), a.cache.geometry().block_stride * a.cache.num_blocks()), 0);
}

// A memory-profiling run (no metadata) returns zeros and leaves the cache alone.
TEST(Layer, NoMetadataGivesZeros) {
  Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 24);
  const verify::Inputs in = verify::make_inputs(c);
  MlaLayer layer(c.config, in.weights);
  LatentCache cache = in.cache.clone();
  HostTensor out(DType::bf16, {in.md.num_rows, c.config.hidden_size});
  std::memset(out.data<void>(), 0x5a, out.bytes());
  layer.forward(in.positions.view(), in.hidden.view(), nullptr, cache, out.view());
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.data<uint16_t>()[i], 0);
  EXPECT_EQ(std::memcmp(cache.base(), in.cache.base(), cache.geometry().block_stride * cache.num_blocks()), 0);
}

// Tensor parallelism: the ranks' partial o_proj sums add up to the unsharded layer. In the
// exact oracle this holds to fp64 rounding (it tests the sharding itself); the CPU partials
// add up within the usual rule.
TEST(Layer, TensorParallelSlicesSumToFullLayer) {
  for (int world : {2, 4}) {
    Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 25, 4);
    const verify::Inputs in = verify::make_inputs(c);
    reference::Options ro;
    LatentCache full_cache = in.cache.clone();
    const auto full = reference::forward(c.config, in.weights, nullptr, in.positions.view(), in.hidden.view(),
                                         &in.md, full_cache, ro);
    std::vector<double> sum_exact(full.out.size(), 0.0), sum_cpu(full.out.size(), 0.0);
    for (int rank = 0; rank < world; ++rank) {
      const MlaConfig local = c.config.tp_slice(rank, world);
      const MlaWeights w = in.weights.tp_slice(c.config, rank, world);
      LatentCache cache = in.cache.clone();
      const auto part = reference::forward(local, w, nullptr, in.positions.view(), in.hidden.view(), &in.md,
                                           cache, ro);
      for (size_t i = 0; i < part.out.size(); ++i) sum_exact[i] += part.out[i];
      LayerOptions lo;
      lo.partial_output = true;
      MlaLayer layer(local, w, lo);
      HostTensor out(DType::bf16, {in.md.num_rows, c.config.hidden_size});
      LatentCache cache2 = in.cache.clone();
      layer.forward(in.positions.view(), in.hidden.view(), &in.md, cache2, out.view());
      for (size_t i = 0; i < sum_cpu.size(); ++i) sum_cpu[i] += act(out, int64_t(i));
      // Every rank writes the same latent rows (they are replicated).
      EXPECT_EQ(std::memcmp(cache.base(), full_cache.base(), cache.geometry().block_stride * cache.num_blocks()), 0);
    }
    double m = 0, d_exact = 0, d_cpu = 0;
    for (size_t i = 0; i < full.out.size(); ++i) {
      m = std::max(m, std::fabs(full.out[i]));
      d_exact = std::max(d_exact, std::fabs(sum_exact[i] - full.out[i]));
      d_cpu = std::max(d_cpu, std::fabs(sum_cpu[i] - full.out[i]));
    }
    EXPECT_LE(d_exact, 1e-12 * m) << "world " << world;
    // Each partial carries its own bf16 rounding (half an ulp of a partial, which is at most
    // the size of the full output) plus the per-rank attention error.
    EXPECT_LE(d_cpu, world * 0x1p-6 * m) << "world " << world;
  }
}

TEST(Layer, AllReduceCallbackRunsWithTensorParallelism) {
  Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 26, 4);
  const verify::Inputs in = verify::make_inputs(c);
  const MlaConfig local = c.config.tp_slice(1, 2);
  const MlaWeights w = in.weights.tp_slice(c.config, 1, 2);
  EXPECT_THROW(MlaLayer(local, w), Error);  // neither partial_output nor all_reduce
  int calls = 0;
  LayerOptions lo;
  lo.all_reduce = [&](const TensorView& out) {
    ++calls;
    EXPECT_EQ(out.dim(0), in.md.num_rows);
  };
  MlaLayer layer(local, w, lo);
  HostTensor out(DType::bf16, {in.md.num_rows, c.config.hidden_size});
  LatentCache cache = in.cache.clone();
  layer.forward(in.positions.view(), in.hidden.view(), &in.md, cache, out.view());
  EXPECT_EQ(calls, 1);
}

// Bad input gets a kmla::Error naming the problem, and the cache is untouched.
TEST(Layer, BadInputThrowsAndLeavesCacheAlone) {
  Case c = verify::mixed_case("kimi-k3-dspark", CacheFormat::bf16, 16, 27);
  c.rope_rows = 16;  // a short table: the batch's positions run past it
  const verify::Inputs in = verify::make_inputs(c);
  MlaLayer layer(c.config, in.weights, {}, RopeTable::build(c.config, c.rope_rows));
  HostTensor out(DType::bf16, {in.md.num_rows, c.config.hidden_size});
  auto expect_error = [&](auto&& call, const std::string& fragment) {
    LatentCache cache = in.cache.clone();
    try {
      call(cache);
      ADD_FAILURE() << "no error; expected one mentioning '" << fragment << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    EXPECT_EQ(std::memcmp(cache.base(), in.cache.base(), cache.geometry().block_stride * cache.num_blocks()), 0)
        << fragment;
  };
  // Positions past the RoPE table (the mixed batch has contexts beyond 64 tokens).
  expect_error([&](LatentCache& cache) { layer.forward(in.positions.view(), in.hidden.view(), &in.md, cache, out.view()); },
               "position");
  // Hidden states of the wrong width.
  HostTensor narrow(DType::bf16, {in.md.num_rows, c.config.hidden_size - 1});
  expect_error([&](LatentCache& cache) { layer.forward(in.positions.view(), narrow.view(), &in.md, cache, out.view()); },
               "hidden");
  // Wrong activation dtype.
  HostTensor f16(DType::f16, {in.md.num_rows, c.config.hidden_size});
  expect_error([&](LatentCache& cache) { layer.forward(in.positions.view(), f16.view(), &in.md, cache, out.view()); },
               "dtype");
  // Metadata planned for another block size.
  LatentCache other = LatentCache::allocate(CacheFormat::bf16, 32, in.cache.num_blocks());
  expect_error([&](LatentCache& cache) { layer.forward(in.positions.view(), in.hidden.view(), &in.md, other, out.view()); (void)cache; },
               "block size");
  // Causal metadata for a non-causal (draft) layer.
  BatchMetadata causal = in.md;
  causal.causal_decode = true;
  expect_error([&](LatentCache& cache) { layer.forward(in.positions.view(), in.hidden.view(), &causal, cache, out.view()); },
               "non_causal");
  // Weights in another dtype than the activations.
  LayerOptions lo;
  lo.activation = DType::f16;
  EXPECT_THROW(MlaLayer(c.config, in.weights, lo), Error);
}

}  // namespace
}  // namespace kmla
