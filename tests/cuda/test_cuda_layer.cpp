// The CUDA layer against the fp64 oracle: every case of the CPU grid on the Hopper path and
// on the portable (sm_80) path, a decode step captured in a CUDA graph (global capture mode,
// with the auxiliary g_proj stream) and replayed with other lengths and fewer requests, and
// bad input giving the CPU backend's errors. Without a GPU every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kmla/cuda.hpp"
#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "kmla/stages.hpp"
#include "verify/cases.hpp"

namespace kmla {
namespace {

using verify::Case;

#define REQUIRE_GPU()                                           \
  do {                                                          \
    if (!cuda::available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
#define CUDA_EXPECT(expr) EXPECT_EQ((expr), cudaSuccess) << #expr

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.name;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

class CudaCase : public ::testing::TestWithParam<Case> {};

TEST_P(CudaCase, HopperPathMatchesOracle) {
  REQUIRE_GPU();
  const verify::Report r = verify::run_case(GetParam(), verify::Backend::cuda);
  EXPECT_TRUE(r.pass) << r.detail << " (err " << r.err_backend << ", baseline " << r.err_baseline
                      << ", bound " << r.bound << ", cache " << r.cache_err << ")";
  EXPECT_GT(r.err_baseline, 0.0);  // the rule's baseline must be a real rounding error
}

TEST_P(CudaCase, PortablePathMatchesOracle) {
  REQUIRE_GPU();
  const verify::Report r = verify::run_case(GetParam(), verify::Backend::cuda_portable);
  EXPECT_TRUE(r.pass) << r.detail << " (err " << r.err_backend << ", baseline " << r.err_baseline
                      << ", bound " << r.bound << ", cache " << r.cache_err << ")";
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaCase, ::testing::ValuesIn(verify::standard_cases()), case_name);

// ---- the oracle rule for one host output ----------------------------------------------------

double act_value(const HostTensor& t, int64_t i) {
  const uint16_t v = t.data<uint16_t>()[i];
  return t.dtype() == DType::bf16 ? bf16_to_float(v) : fp16_to_float(v);
}

// out must be within 2x the seed-rounding oracle's error (+1 act ulp of the largest value)
// of the exact oracle, on the real rows; padding rows exactly zero.
void expect_matches_oracle(const MlaConfig& cfg, const MlaWeights& w, const RopeTable* rope,
                           const HostTensor& positions, const HostTensor& hidden,
                           const BatchMetadata& md, const LatentCache& cache_before,
                           const HostTensor& out, const char* what) {
  LatentCache exact_cache = cache_before.clone(), seed_cache = cache_before.clone();
  reference::Options ro;
  ro.activation = out.dtype();
  ro.rounding = reference::Rounding::exact;
  const auto exact = reference::forward(cfg, w, rope, positions.view(), hidden.view(), &md, exact_cache, ro);
  ro.rounding = reference::Rounding::seed;
  const auto seed = reference::forward(cfg, w, rope, positions.view(), hidden.view(), &md, seed_cache, ro);
  double max_ref = 0, err = 0, base = 0;
  const int64_t real = md.num_tokens * cfg.hidden_size;
  for (int64_t i = 0; i < real; ++i) {
    ASSERT_TRUE(std::isfinite(act_value(out, i))) << what << ": output " << i;
    max_ref = std::max(max_ref, std::fabs(exact.out[size_t(i)]));
    err = std::max(err, std::fabs(act_value(out, i) - exact.out[size_t(i)]));
    base = std::max(base, std::fabs(seed.out[size_t(i)] - exact.out[size_t(i)]));
  }
  for (int64_t i = real; i < out.numel(); ++i) ASSERT_EQ(act_value(out, i), 0.0) << what << ": padding " << i;
  const double ulp = out.dtype() == DType::bf16 ? 0x1p-8 : 0x1p-11;
  EXPECT_LE(err, 2 * base + ulp * max_ref) << what << " (baseline " << base << ", max " << max_ref << ")";
  EXPECT_GT(max_ref, 0.0) << what;
}

// ---- CUDA graphs -------------------------------------------------------------------------------

struct DeviceInputs {
  cuda::DeviceBuffer hidden, positions, out;
  TensorView hv, pv, ov;
  DeviceInputs(const HostTensor& hidden_h, const HostTensor& pos_h, cudaStream_t s)
      : hidden(hidden_h.bytes()), positions(pos_h.bytes()), out(hidden_h.bytes()) {
    hv = hidden.view(hidden_h.dtype(), {hidden_h.dim(0), hidden_h.dim(1)});
    pv = positions.view(DType::i64, {pos_h.dim(0)});
    ov = out.view(hidden_h.dtype(), {hidden_h.dim(0), hidden_h.dim(1)});
    cuda::copy_to_device(hidden_h.view(), hv, s);
    cuda::copy_to_device(pos_h.view(), pv, s);
  }
};

// A decode step captured once (batch A) and replayed for batch A and for batch B (other
// lengths, fewer requests, more padding rows). Replays equal an eager run of the same plan
// bit for bit, and both pass the oracle rule. With 16-bit weights g_proj is part of the front
// GEMM and the gate zeroes the padding rows; with fp8 weights it runs on the aux stream.
// tuned: Layer::tune runs batch A eagerly first (after refusing a capturing stream), so the
// graph and the eager runs use the tuned GEMMs.
void decode_step_replays_other_batches(bool fp8_weights, bool tuned = false) {
  Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 41, 3);
  c.fp8_weights = fp8_weights;
  c.requests = {{1, 37}, {1, 16}, {1, 129}, {1, 1}, {1, 64}, {1, 250}};
  c.padding_rows = 2;
  const verify::Inputs a = verify::make_inputs(c);
  ASSERT_EQ(a.md.num_decodes, 6);
  const MlaConfig& cfg = c.config;
  ASSERT_TRUE(cfg.use_output_gate);

  // Batch B: four of A's requests with shorter contexts, same rows (4 real + 4 padding).
  std::vector<RequestSpec> reqs;
  for (int r : {2, 0, 5, 4}) {
    const int32_t ctx = std::max(1, a.md.context_lens[size_t(r)] / 2 - 3);
    RequestSpec q{1, ctx, std::vector<int32_t>(a.md.block_table(r), a.md.block_table(r) + a.md.max_blocks_per_request)};
    reqs.push_back(q);
  }
  BatchOptions bo;
  bo.num_rows = a.md.num_rows;
  const BatchMetadata md_b = plan_batch(reqs, a.cache.geometry(), bo);
  HostTensor hidden_b(DType::bf16, {md_b.num_rows, cfg.hidden_size}), pos_b(DType::i64, {md_b.num_rows});
  for (int64_t i = 0; i < hidden_b.numel(); ++i)
    hidden_b.data<uint16_t>()[i] = float_to_bf16(float(std::sin(0.37 * double(i)) * 1.5));
  std::copy(md_b.positions.begin(), md_b.positions.end(), pos_b.data<int64_t>());

  cudaStream_t s = nullptr, aux = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&aux, cudaStreamNonBlocking));
  cuda::LayerOptions lo;
  lo.aux_stream = reinterpret_cast<cuda::Stream>(aux);
  cuda::Layer layer(cfg, a.weights, lo);
  const CacheGeometry& geo = a.cache.geometry();
  cuda::DeviceCache dc = cuda::DeviceCache::allocate(geo.format, geo.block_size, geo.num_blocks);
  const int64_t cache_bytes = geo.block_stride * geo.num_blocks;
  const TensorView dev_bytes = dc.memory.view(DType::u8, {cache_bytes});
  auto reset_cache = [&] {
    cuda::copy_to_device(TensorView(a.cache.base(), DType::u8, {cache_bytes}), dev_bytes,
                         reinterpret_cast<cuda::Stream>(s));
  };
  auto st = reinterpret_cast<cuda::Stream>(s);

  cuda::DecodeShape shape;
  shape.max_requests = 6;
  shape.max_query_len = 1;
  shape.max_blocks = a.md.max_blocks_per_request;
  shape.max_seq_len = 251;
  const cuda::Plan plan_a = layer.plan(a.md, dc.cache, &shape);
  const cuda::Plan plan_b = layer.plan(md_b, dc.cache, &shape);
  ASSERT_TRUE(plan_a.graph_safe());
  ASSERT_EQ(plan_a.workspace_bytes(), plan_b.workspace_bytes());
  cuda::DeviceBuffer ws(plan_a.workspace_bytes());

  DeviceInputs in_a(a.hidden, a.positions, s);
  // One device input buffer for the graph: batch B's inputs are copied into it.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  layer.upload(plan_a, ws.data(), st);
  CUDA_OK(cudaStreamSynchronize(s));
  if (tuned) {
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    EXPECT_THROW(layer.tune(plan_a, in_a.pv, in_a.hv, dc.cache, in_a.ov, ws.data(), st), Error);
    cudaGraph_t none = nullptr;
    CUDA_OK(cudaStreamEndCapture(s, &none));
    if (none) {
      CUDA_OK(cudaGraphDestroy(none));
    }
    reset_cache();
    layer.tune(plan_a, in_a.pv, in_a.hv, dc.cache, in_a.ov, ws.data(), st);
    CUDA_OK(cudaStreamSynchronize(s));
  }
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  layer.run(plan_a, in_a.pv, in_a.hv, dc.cache, in_a.ov, ws.data(), st);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  auto replay = [&](const cuda::Plan& p, const HostTensor& hidden, const HostTensor& pos, bool graphed) {
    reset_cache();
    cuda::copy_to_device(hidden.view(), in_a.hv, st);
    cuda::copy_to_device(pos.view(), in_a.pv, st);
    CUDA_EXPECT(cudaMemsetAsync(in_a.out.data(), 0xff, in_a.out.bytes(), s));  // poison
    layer.upload(p, ws.data(), st);
    if (graphed)
      CUDA_EXPECT(cudaGraphLaunch(exec, s));
    else
      layer.run(p, in_a.pv, in_a.hv, dc.cache, in_a.ov, ws.data(), st);
    HostTensor out(DType::bf16, {hidden.dim(0), hidden.dim(1)});
    LatentCache cache = a.cache.clone();
    cuda::copy_to_host(in_a.ov, out.view(), st);
    cuda::copy_to_host(dev_bytes, TensorView(cache.base(), DType::u8, {cache_bytes}), st);
    layer.check_errors(st);
    return std::make_pair(std::move(out), std::move(cache));
  };

  for (int which = 0; which < 2; ++which) {
    const cuda::Plan& p = which ? plan_b : plan_a;
    const BatchMetadata& md = which ? md_b : a.md;
    const HostTensor& hidden = which ? hidden_b : a.hidden;
    const HostTensor& pos = which ? pos_b : a.positions;
    auto [g_out, g_cache] = replay(p, hidden, pos, true);
    auto [e_out, e_cache] = replay(p, hidden, pos, false);
    const char* what = which ? "batch B" : "batch A";
    EXPECT_EQ(std::memcmp(g_out.data<void>(), e_out.data<void>(), g_out.bytes()), 0) << what << ": replay != eager";
    EXPECT_EQ(std::memcmp(g_cache.base(), e_cache.base(), size_t(cache_bytes)), 0) << what << ": caches differ";
    expect_matches_oracle(cfg, a.weights, nullptr, pos, hidden, md, a.cache, g_out, what);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(aux));
  CUDA_OK(cudaStreamDestroy(s));
}

TEST(CudaGraph, DecodeStepReplaysOtherBatches) {
  REQUIRE_GPU();
  decode_step_replays_other_batches(false);
}

TEST(CudaGraph, DecodeStepReplaysOtherBatchesFp8Weights) {
  REQUIRE_GPU();
  decode_step_replays_other_batches(true);
}

TEST(CudaGraph, DecodeStepReplaysOtherBatchesTuned) {
  REQUIRE_GPU();
  decode_step_replays_other_batches(false, true);
}

// LayerOptions::tune_gemms: forward() tunes each GEMM shape it meets first (Layer::tune) before
// running it, so its first call and a second one run the same algorithms (equal bits, the
// cache restored in between) and both pass the oracle.
TEST(CudaLayer, ForwardTunesGemmsWhenAsked) {
  REQUIRE_GPU();
  const Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 52, 3);
  const verify::Inputs in = verify::make_inputs(c);
  cuda::LayerOptions lo;
  lo.tune_gemms = true;
  cuda::Layer layer(c.config, in.weights, lo);
  const CacheGeometry& geo = in.cache.geometry();
  cuda::DeviceCache dc = cuda::DeviceCache::allocate(geo.format, geo.block_size, geo.num_blocks);
  const int64_t cache_bytes = geo.block_stride * geo.num_blocks;
  const TensorView dev_bytes = dc.memory.view(DType::u8, {cache_bytes});
  DeviceInputs d(in.hidden, in.positions, nullptr);
  HostTensor first(DType::bf16, {in.md.num_rows, c.config.hidden_size});
  HostTensor second(DType::bf16, {in.md.num_rows, c.config.hidden_size});
  for (HostTensor* out : {&first, &second}) {
    cuda::copy_to_device(TensorView(in.cache.base(), DType::u8, {cache_bytes}), dev_bytes, nullptr);
    layer.forward(d.pv, d.hv, &in.md, dc.cache, d.ov, nullptr);
    cuda::copy_to_host(d.ov, out->view(), nullptr);
    layer.check_errors(nullptr);  // (waits for the copy)
  }
  EXPECT_EQ(std::memcmp(first.data<void>(), second.data<void>(), first.bytes()), 0)
      << "the second forward ran other algorithms";
  expect_matches_oracle(c.config, in.weights, nullptr, in.positions, in.hidden, in.md, in.cache,
                        first, "forward with tuned GEMMs");
}

// ---- bad input ---------------------------------------------------------------------------------

// The CPU and CUDA layers reject the same bad calls with the same messages (host checks), and
// what only the device can see (positions past the RoPE table) raises the error flag.
TEST(CudaLayer, BadInputGetsTheCpuErrors) {
  REQUIRE_GPU();
  Case c = verify::mixed_case("kimi-k3-dspark", CacheFormat::bf16, 16, 27);
  c.rope_rows = 16;  // a short table: the batch's positions run past it
  const verify::Inputs in = verify::make_inputs(c);
  auto rope = RopeTable::build(c.config, c.rope_rows);
  MlaLayer cpu_layer(c.config, in.weights, {}, rope);
  cuda::Layer gpu_layer(c.config, in.weights, {}, rope);
  const CacheGeometry& geo = in.cache.geometry();
  cuda::DeviceCache dc = cuda::DeviceCache::allocate(geo.format, geo.block_size, geo.num_blocks);
  HostTensor out(DType::bf16, {in.md.num_rows, c.config.hidden_size});
  DeviceInputs d(in.hidden, in.positions, nullptr);

  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      std::string m = e.what();
      return m.substr(0, m.find(" ["));  // drop the file:line part
    }
    return "(no error)";
  };
  // Metadata planned causal for the non-causal draft layer.
  BatchMetadata causal = in.md;
  causal.causal_decode = true;
  LatentCache host_cache = in.cache.clone();
  EXPECT_EQ(message([&] { cpu_layer.forward(in.positions.view(), in.hidden.view(), &causal, host_cache, out.view()); }),
            message([&] { gpu_layer.forward(d.pv, d.hv, &causal, dc.cache, d.ov, nullptr); }));
  // A slot outside the cache.
  BatchMetadata bad_slot = in.md;
  bad_slot.slot_mapping[0] = geo.num_slots();
  const std::string slot_msg =
      message([&] { gpu_layer.forward(d.pv, d.hv, &bad_slot, dc.cache, d.ov, nullptr); });
  EXPECT_NE(slot_msg.find("outside the cache's slots"), std::string::npos) << slot_msg;
  EXPECT_EQ(slot_msg, message([&] { cpu_layer.forward(in.positions.view(), in.hidden.view(), &bad_slot, host_cache, out.view()); }));
  // A block table entry outside the cache.
  BatchMetadata bad_block = in.md;
  bad_block.block_tables[0] = int32_t(geo.num_blocks + 5);
  EXPECT_EQ(message([&] { cpu_layer.forward(in.positions.view(), in.hidden.view(), &bad_block, host_cache, out.view()); }),
            message([&] { gpu_layer.forward(d.pv, d.hv, &bad_block, dc.cache, d.ov, nullptr); }));
  // Host tensors given to the device layer.
  EXPECT_NE(message([&] { gpu_layer.forward(in.positions.view(), in.hidden.view(), &in.md, dc.cache, d.ov, nullptr); })
                .find("is on cpu, expected cuda"),
            std::string::npos);
  // A host cache given to the device layer.
  EXPECT_NE(message([&] { gpu_layer.forward(d.pv, d.hv, &in.md, host_cache, d.ov, nullptr); }).find("cache"),
            std::string::npos);
  // Positions past the RoPE table: the CPU refuses on the host, the GPU flags it.
  EXPECT_NE(message([&] { cpu_layer.forward(in.positions.view(), in.hidden.view(), &in.md, host_cache, out.view()); })
                .find("position"),
            std::string::npos);
  gpu_layer.forward(d.pv, d.hv, &in.md, dc.cache, d.ov, nullptr);
  EXPECT_NE(message([&] { gpu_layer.check_errors(nullptr); }).find("position outside the RoPE table"),
            std::string::npos);
  EXPECT_NO_THROW(gpu_layer.check_errors(nullptr));  // reading the flag clears it
}

// ---- public stages on the device ------------------------------------------------------------

uint16_t random_bf16(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  const double u = double(state >> 11) * 0x1p-53;  // [0, 1)
  return float_to_bf16(float((u - 0.5) * 6.0));
}

// cuda::cache_insert writes the same bytes as kmla::cache_insert (RoPE and every format), and
// touches nothing else; slots of -1 are skipped.
TEST(CudaStages, CacheInsertMatchesCpuStage) {
  REQUIRE_GPU();
  const MlaConfig cfg = verify::small_model("kimi-k3-dspark", 3);
  auto rope = RopeTable::build(cfg, 4096);
  cuda::DeviceBuffer table(size_t(rope->rows()) * kRopeDim * sizeof(float));
  cuda::copy_to_device(TensorView(const_cast<float*>(rope->row(0)), DType::f32, {rope->rows() * kRopeDim}),
                       table.view(DType::f32, {rope->rows() * kRopeDim}), nullptr);
  const int64_t T = 37;
  uint64_t st = 5;
  HostTensor kv(DType::bf16, {T, kKvLoraRank}), pe(DType::bf16, {T, kRopeDim}), pos(DType::i64, {T}),
      slots(DType::i64, {T});
  for (int64_t i = 0; i < kv.numel(); ++i) kv.data<uint16_t>()[i] = random_bf16(st);
  for (int64_t i = 0; i < pe.numel(); ++i) pe.data<uint16_t>()[i] = random_bf16(st);
  for (int64_t t = 0; t < T; ++t) {
    pos.data<int64_t>()[t] = (t * 97) % 4096;
    slots.data<int64_t>()[t] = t % 5 == 3 ? -1 : (t * 7) % 80;  // distinct (7 is coprime to 80)
  }
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    LatentCache host = LatentCache::allocate(f, 16, 5, 0.75f);
    std::memset(host.base(), 0xa5, size_t(host.geometry().block_stride * 5));
    LatentCache before = host.clone();
    cache_insert(kv.view(), pe.view(), pos.view(), rope.get(), slots.view(), host);
    cuda::DeviceCache dc = cuda::DeviceCache::allocate(f, 16, 5, 0.75f);
    const int64_t bytes = host.geometry().block_stride * 5;
    cuda::copy_to_device(TensorView(before.base(), DType::u8, {bytes}), dc.memory.view(DType::u8, {bytes}), nullptr);
    cuda::DeviceBuffer dkv(kv.bytes()), dpe(pe.bytes()), dpos(pos.bytes()), dslots(slots.bytes()),
        ws(cuda::cache_insert_workspace_bytes(T)), flag(sizeof(int));
    const TensorView vkv = dkv.view(DType::bf16, {T, kKvLoraRank}), vpe = dpe.view(DType::bf16, {T, kRopeDim}),
                     vpos = dpos.view(DType::i64, {T}), vslots = dslots.view(DType::i64, {T});
    cuda::copy_to_device(kv.view(), vkv, nullptr);
    cuda::copy_to_device(pe.view(), vpe, nullptr);
    cuda::copy_to_device(pos.view(), vpos, nullptr);
    cuda::copy_to_device(slots.view(), vslots, nullptr);
    CUDA_OK(cudaMemset(flag.data(), 0, sizeof(int)));
    cuda::cache_insert(vkv, vpe, vpos, static_cast<const float*>(table.data()), rope->rows(), vslots, dc.cache,
                       ws.data(), static_cast<int*>(flag.data()), nullptr);
    LatentCache got = before.clone();
    int flag_h = -1;
    cuda::copy_to_host(dc.memory.view(DType::u8, {bytes}), TensorView(got.base(), DType::u8, {bytes}), nullptr);
    CUDA_OK(cudaMemcpy(&flag_h, flag.data(), sizeof(int), cudaMemcpyDeviceToHost));
    EXPECT_EQ(flag_h, 0);
    EXPECT_EQ(std::memcmp(got.base(), host.base(), size_t(bytes)), 0) << cache_format_name(f);
  }
}

// cuda::merge_attn_states equals the CPU stage on rows with and without a prefix, including
// empty (-inf) states on either side.
TEST(CudaStages, MergeMatchesCpuStage) {
  REQUIRE_GPU();
  const int64_t rows = 9, H = 3, D = 128, with_prefix = 6;
  uint64_t st = 11;
  HostTensor po(DType::bf16, {rows, H, D}), so(DType::bf16, {rows, H, D}), pl(DType::f32, {rows, H}),
      sl(DType::f32, {rows, H}), out(DType::bf16, {rows, H, D}), ol(DType::f32, {rows, H});
  for (int64_t i = 0; i < po.numel(); ++i) po.data<uint16_t>()[i] = random_bf16(st);
  for (int64_t i = 0; i < so.numel(); ++i) so.data<uint16_t>()[i] = random_bf16(st);
  for (int64_t i = 0; i < pl.numel(); ++i) {
    pl.data<float>()[i] = i % 7 == 2 ? -INFINITY : float(i % 5) - 2.0f;
    sl.data<float>()[i] = i % 11 == 4 ? -INFINITY : float(i % 3) - 1.0f;
  }
  merge_attn_states(po.view(), pl.view(), so.view(), sl.view(), with_prefix, out.view(), ol.view());
  cuda::DeviceBuffer dpo(po.bytes()), dso(so.bytes()), dpl(pl.bytes()), dsl(sl.bytes()), dout(out.bytes()),
      dol(ol.bytes());
  auto v3 = [&](cuda::DeviceBuffer& b) { return b.view(DType::bf16, {rows, H, D}); };
  auto v2 = [&](cuda::DeviceBuffer& b) { return b.view(DType::f32, {rows, H}); };
  cuda::copy_to_device(po.view(), v3(dpo), nullptr);
  cuda::copy_to_device(so.view(), v3(dso), nullptr);
  cuda::copy_to_device(pl.view(), v2(dpl), nullptr);
  cuda::copy_to_device(sl.view(), v2(dsl), nullptr);
  cuda::merge_attn_states(v3(dpo), v2(dpl), v3(dso), v2(dsl), with_prefix, v3(dout), v2(dol), nullptr);
  HostTensor got(DType::bf16, {rows, H, D}), got_l(DType::f32, {rows, H});
  cuda::copy_to_host(v3(dout), got.view(), nullptr);
  cuda::copy_to_host(v2(dol), got_l.view(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  // expf/logf on the GPU differ from glibc by an fp32 ulp or two: one bf16 ulp on the output.
  for (int64_t i = 0; i < out.numel(); ++i)
    EXPECT_NEAR(bf16_to_float(got.data<uint16_t>()[i]), bf16_to_float(out.data<uint16_t>()[i]),
                0x1p-7 * std::fabs(bf16_to_float(out.data<uint16_t>()[i])) + 1e-6) << i;
  for (int64_t i = 0; i < ol.numel(); ++i) {
    if (std::isinf(ol.data<float>()[i])) {
      EXPECT_EQ(got_l.data<float>()[i], ol.data<float>()[i]) << i;
    } else {
      EXPECT_NEAR(got_l.data<float>()[i], ol.data<float>()[i], 1e-5) << i;
    }
  }
  // Bad input: a row count beyond the tensors.
  EXPECT_THROW(cuda::merge_attn_states(v3(dpo), v2(dpl), v3(dso), v2(dsl), rows + 1, v3(dout), v2(dol), nullptr),
               Error);
}

// Device output vs the CPU stage's: within two act ulps of the largest |value| (the kernels
// round P and the output to bf16; the CPU stage keeps fp32 until its one rounding), LSEs within
// 1e-3 and -inf exactly where the CPU has it.
void expect_close_to_cpu(const HostTensor& got, const HostTensor& want, const HostTensor& got_lse,
                         const HostTensor& want_lse, const char* what) {
  double max_ref = 0, err = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double w = bf16_to_float(want.data<uint16_t>()[i]), g = bf16_to_float(got.data<uint16_t>()[i]);
    ASSERT_TRUE(std::isfinite(g)) << what << " output " << i;
    max_ref = std::max(max_ref, std::fabs(w));
    err = std::max(err, std::fabs(g - w));
  }
  EXPECT_LE(err, 0x1p-7 * max_ref) << what;
  EXPECT_GT(max_ref, 0.0) << what;
  for (int64_t i = 0; i < want_lse.numel(); ++i) {
    const float w = want_lse.data<float>()[i], g = got_lse.data<float>()[i];
    if (std::isinf(w)) EXPECT_EQ(g, w) << what << " lse " << i;
    else EXPECT_NEAR(g, w, 1e-3) << what << " lse " << i;
  }
}

// A device copy of a host tensor; `view` describes it.
cuda::DeviceBuffer to_device(const HostTensor& h, TensorView& view) {
  cuda::DeviceBuffer b(h.bytes());
  view = h.view();
  view.data = b.data();
  view.device = Device::cuda;
  cuda::copy_to_device(h.view(), view, nullptr);
  return b;
}

// cuda::DecodeAttention equals kmla::decode_attention on the mixed batch's decode rows (single
// tokens and a multi-token block, permuted tables, NaN-poisoned cache), for every cache format;
// the plain fp8 cache with an e4m3 query and q_scale.
TEST(CudaStages, DecodeAttentionMatchesCpuStage) {
  REQUIRE_GPU();
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    Case c = verify::mixed_case("kimi-k3-dspark", f, 16, 19, 3);
    c.k_scale = 0.5f;
    const verify::Inputs in = verify::make_inputs(c);
    const int H = 3;
    const int64_t Td = in.md.num_decode_tokens;
    ASSERT_GT(Td, 1);
    const bool q8 = f == CacheFormat::fp8;
    HostTensor q(q8 ? DType::e4m3 : DType::bf16, {Td, H, kLatentDim});
    uint64_t st = 3;
    for (int64_t i = 0; i < q.numel(); ++i) {
      const uint16_t b = random_bf16(st);
      if (q8) q.data<uint8_t>()[i] = float_to_e4m3_sat(bf16_to_float(b) * 4.0f);
      else q.data<uint16_t>()[i] = b;
    }
    const float q_scale = 0.25f;
    // The decode tokens' own rows (which the layer inserts before attention) hold NaN in the
    // poisoned cache: write them first, so every visible key is a real one.
    LatentCache cache = in.cache.clone();
    float row[kLatentDim];
    for (int r = 0; r < in.md.num_decodes; ++r)
      for (int64_t pos = in.md.context_lens[size_t(r)]; pos < in.md.seq_lens[size_t(r)]; ++pos) {
        for (float& x : row) x = bf16_to_float(random_bf16(st));
        cache.write_row(in.md.slot_of(r, pos), row);
      }
    const double scale = c.config.softmax_scale();
    HostTensor out(DType::bf16, {Td, H, kKvLoraRank}), lse(DType::f32, {Td, H});
    decode_attention(q.view(), q_scale, cache, in.md, scale, out.view(), lse.view());

    const CacheGeometry& geo = cache.geometry();
    cuda::DeviceCache dc = cuda::DeviceCache::allocate(f, geo.block_size, geo.num_blocks, c.k_scale);
    const int64_t bytes = geo.block_stride * geo.num_blocks;
    cuda::copy_to_device(TensorView(cache.base(), DType::u8, {bytes}), dc.memory.view(DType::u8, {bytes}), nullptr);
    TensorView dq, dout, dlse;
    HostTensor gout(DType::bf16, {Td, H, kKvLoraRank}), glse(DType::f32, {Td, H});
    cuda::DeviceBuffer bq = to_device(q, dq), bo = to_device(gout, dout),
                       bl = to_device(glse, dlse);
    // Default and batch-invariant plans (the latter always combines its splits).
    for (const bool invariant : {false, true}) {
      const cuda::DecodeAttention da(in.md, dc.cache, H, false, invariant);
      cuda::DeviceBuffer ws(da.workspace_bytes()), flag(sizeof(int));
      CUDA_OK(cudaMemset(flag.data(), 0, sizeof(int)));
      CUDA_OK(cudaMemset(dout.data, 0xFF, size_t(Td) * H * kKvLoraRank * 2));
      da.upload(ws.data(), nullptr);
      da.run(dq, q_scale, dc.cache, scale, dout, dlse, ws.data(), static_cast<int*>(flag.data()), nullptr);
      cuda::copy_to_host(dout, gout.view(), nullptr);
      cuda::copy_to_host(dlse, glse.view(), nullptr);
      int flag_h = -1;
      CUDA_OK(cudaMemcpy(&flag_h, flag.data(), sizeof(int), cudaMemcpyDeviceToHost));
      EXPECT_EQ(flag_h, 0);
      const std::string what = std::string(cache_format_name(f)) + (invariant ? ", invariant" : "");
      expect_close_to_cpu(gout, out, glse, lse, what.c_str());
    }
  }
}

// cuda::prefill_attention equals kmla::prefill_attention: causal over new tokens (with an empty
// sequence) and non-causal against more keys than queries.
TEST(CudaStages, PrefillAttentionMatchesCpuStage) {
  REQUIRE_GPU();
  const int64_t H = 3;
  for (bool causal : {true, false}) {
    const std::vector<int64_t> cu_q = {0, 5, 5, 70, 200};
    const std::vector<int64_t> cu_k = causal ? cu_q : std::vector<int64_t>{0, 9, 30, 100, 260};
    const int64_t Tq = cu_q.back(), Tk = cu_k.back();
    HostTensor q(DType::bf16, {Tq, H, kQkHeadDim}), k(DType::bf16, {Tk, H, kQkHeadDim}), v(DType::bf16, {Tk, H, kVDim});
    uint64_t st = causal ? 7 : 8;
    for (HostTensor* t : {&q, &k, &v})
      for (int64_t i = 0; i < t->numel(); ++i) t->data<uint16_t>()[i] = random_bf16(st);
    const double scale = std::pow(192.0, -0.5);
    HostTensor out(DType::bf16, {Tq, H, kVDim}), lse(DType::f32, {Tq, H});
    prefill_attention(q.view(), k.view(), v.view(), cu_q, cu_k, causal, scale, out.view(), lse.view());

    HostTensor cq(DType::i32, {int64_t(cu_q.size())}), ck(DType::i32, {int64_t(cu_k.size())});
    for (size_t i = 0; i < cu_q.size(); ++i) {
      cq.data<int32_t>()[i] = int32_t(cu_q[i]);
      ck.data<int32_t>()[i] = int32_t(cu_k[i]);
    }
    HostTensor gout(DType::bf16, {Tq, H, kVDim}), glse(DType::f32, {Tq, H});
    TensorView dq, dk, dv, dcq, dck, dout, dlse;
    cuda::DeviceBuffer b1 = to_device(q, dq), b2 = to_device(k, dk), b3 = to_device(v, dv),
                       b4 = to_device(cq, dcq), b5 = to_device(ck, dck),
                       b6 = to_device(gout, dout), b7 = to_device(glse, dlse);
    cuda::prefill_attention(dq, dk, dv, dcq, dck, 130, causal, scale, dout, dlse, nullptr);
    cuda::copy_to_host(dout, gout.view(), nullptr);
    cuda::copy_to_host(dlse, glse.view(), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    expect_close_to_cpu(gout, out, glse, lse, causal ? "causal" : "non-causal");
  }
}

}  // namespace
}  // namespace kmla
