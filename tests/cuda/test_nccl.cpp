// Several GPUs through NCCL, and the device half of decode context parallelism.
//
// Single-GPU tests (run everywhere there is a GPU): a world-1 communicator's collectives are
// the identity, the device CP scatter/merge equal the host ones, and CP decode simulated on
// one GPU (every rank's shard in turn, merged on the device) equals the unsharded decode.
//
// Multi-GPU tests (skipped below the GPU count they need): the test process starts one
// process per GPU by re-running itself (fork + exec, so no CUDA state crosses the fork) with
// this test as the only filter and the rank in KMLA_NCCL_TEST_RANK; each rank runs the body
// and reports through its exit status. Tensor parallelism at world 2/4/8 equals the TP=1
// layer, context parallelism equals the single-GPU decode, and a rank that dies ends the
// others with an error instead of a hang.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda/gpu.hpp"
#include "kmla/context_parallel.hpp"
#include "kmla/cuda.hpp"
#include "kmla/dist.hpp"
#include "kmla/numeric.hpp"
#include "kmla/rope.hpp"
#include "verify/cases.hpp"

namespace kmla {
namespace {

using dist::Communicator;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// ---- running a test body on N ranks ---------------------------------------------------------

struct RankEnv {
  int rank = 0;
  int world = 1;
  std::string dir;  // the run's private directory (the NCCL id file)
};

// Set in the rank processes only.
std::optional<RankEnv> rank_env() {
  const char* r = std::getenv("KMLA_NCCL_TEST_RANK");
  if (!r) return std::nullopt;
  return RankEnv{std::atoi(r), std::atoi(std::getenv("KMLA_NCCL_TEST_WORLD")), std::getenv("KMLA_NCCL_TEST_DIR")};
}

int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// In the test process: starts `world` ranks running this test and returns how they ended.
// Skips (returns nullopt) without NCCL or with fewer GPUs than ranks.
std::optional<dist::LaunchResult> launch_this_test(int world, double timeout_s = 240,
                                                   const std::string& mode = "") {
  const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter = std::string("--gtest_filter=") + t->test_suite_name() + "." + t->name();
  const std::string dir = dist::make_private_dir("nccl-test");
  dist::LaunchOptions o;
  o.timeout_s = timeout_s;
  dist::LaunchResult r = dist::launch(world, [&](int rank) -> int {
    dist::exec_with_env({"/proc/self/exe", filter, "--gtest_brief=1"},
                        {"KMLA_NCCL_TEST_RANK=" + std::to_string(rank), "KMLA_NCCL_TEST_WORLD=" + std::to_string(world),
                         "KMLA_NCCL_TEST_DIR=" + dir, "KMLA_NCCL_TEST_MODE=" + mode});
  }, o);
  dist::remove_private_dir(dir);
  return r;
}

#define KMLA_REQUIRE_GPUS(n)                                                                  \
  do {                                                                                        \
    if (!dist::nccl_built()) GTEST_SKIP() << "this build has no NCCL";                        \
    if (gpu_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, " << gpu_count() << " visible"; \
  } while (0)

void expect_all_ranks_ok(const dist::LaunchResult& r) {
  EXPECT_TRUE(r.ok()) << r.error;
  if (!r.ok())
    for (const dist::RankStatus& s : r.ranks)
      ADD_FAILURE() << "rank " << s.rank << " (" << s.describe() << ") output:\n" << s.output;
}

// In a rank process: its GPU and the communicator.
std::unique_ptr<Communicator> join(const RankEnv& env, double timeout_s = 120) {
  dist::select_device(env.rank);
  const dist::UniqueId id = dist::exchange_unique_id(env.dir + "/nccl-id", env.rank, 60);
  return std::make_unique<Communicator>(env.rank, env.world, id, timeout_s);
}

// ---- world 1 on one GPU ----------------------------------------------------------------------

TEST(NcclComm, WorldOneCollectivesAreTheIdentity) {
  KMLA_REQUIRE_GPU();
  if (!dist::nccl_built()) GTEST_SKIP() << "this build has no NCCL";
  const std::string dir = dist::make_private_dir("nccl-test");
  const dist::UniqueId id = dist::exchange_unique_id(dir + "/id", 0, 5);
  dist::remove_private_dir(dir);
  Communicator comm(0, 1, id, 60);
  EXPECT_EQ(comm.world(), 1);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  const auto stream = reinterpret_cast<cuda::Stream>(s);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0, 3);
  const int64_t n = 1001;  // odd: no vector width divides it
  for (DType t : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(dtype_name(t));
    std::vector<uint32_t> host(static_cast<size_t>(n));
    for (auto& v : host) {
      const float x = normal(rng);
      v = t == DType::f32 ? float_bits(x) : t == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
    }
    const size_t es = dtype_size(t);
    std::vector<uint8_t> packed(size_t(n) * es), back(packed.size(), 0);
    for (int64_t i = 0; i < n; ++i) std::memcpy(packed.data() + i * es, &host[size_t(i)], es);
    test::DevBuf<uint8_t> d(packed);
    comm.all_reduce_sum(TensorView(d.ptr, t, {n}, Device::cuda), stream);
    comm.check(stream, 30);
    EXPECT_EQ(d.download(), packed);
  }
  // all_gather at world 1 is a copy; a wrong output size is refused before anything runs.
  std::vector<float> src(777);
  for (float& x : src) x = normal(rng);
  test::DevBuf<float> din(src), dout(src.size());
  dout.fill_bytes(0xFF);
  comm.all_gather(TensorView(din.ptr, DType::f32, {777}, Device::cuda),
                  TensorView(dout.ptr, DType::f32, {777}, Device::cuda), stream);
  comm.check(stream, 30);
  EXPECT_EQ(dout.download(), src);
  EXPECT_THROW(comm.all_gather(TensorView(din.ptr, DType::f32, {777}, Device::cuda),
                               TensorView(dout.ptr, DType::f32, {776}, Device::cuda), stream),
               Error);
  EXPECT_THROW(comm.all_reduce_sum(TensorView(src.data(), DType::f32, {777}), stream), Error);  // host memory
  EXPECT_THROW(comm.all_reduce_sum(TensorView(din.ptr, DType::i32, {777}, Device::cuda), stream), Error);

  // The CP step at world 1: the merge of one partial is the partial (weight exactly 1), and a
  // row no rank saw becomes zeros with LSE -inf even when its output holds NaN.
  const int64_t Td = 3, H = 2, D = 512;
  std::vector<float> po(size_t(Td * H * D)), pl(size_t(Td * H));
  for (float& x : po) x = normal(rng);
  for (float& x : pl) x = normal(rng);
  pl[3] = -kInf;
  std::fill_n(po.begin() + 3 * D, D, kNaN);
  test::DevBuf<float> dpo(po), dpl(pl), mo(po.size()), ml(pl.size());
  mo.fill_bytes(0xFF);
  ml.fill_bytes(0xFF);
  test::DevBuf<uint8_t> ws(dist::cp_gather_workspace_bytes(1, Td, int(H), int(D)));
  dist::cp_all_gather_merge(comm, TensorView(dpo.ptr, DType::f32, {Td, H, D}, Device::cuda),
                            TensorView(dpl.ptr, DType::f32, {Td, H}, Device::cuda), ws.ptr,
                            TensorView(mo.ptr, DType::f32, {Td, H, D}, Device::cuda),
                            TensorView(ml.ptr, DType::f32, {Td, H}, Device::cuda), stream);
  comm.check(stream, 30);
  const std::vector<float> got = mo.download(), got_l = ml.download();
  for (int64_t r = 0; r < Td * H; ++r) {
    EXPECT_EQ(got_l[size_t(r)], pl[size_t(r)]) << "row " << r;
    for (int64_t d = 0; d < D; ++d)
      ASSERT_EQ(got[size_t(r * D + d)], r == 3 ? 0.0f : po[size_t(r * D + d)]) << "row " << r << " d " << d;
  }

  comm.abort();
  EXPECT_TRUE(comm.aborted());
  try {
    comm.all_reduce_sum(TensorView(din.ptr, DType::f32, {777}, Device::cuda), stream);
    ADD_FAILURE() << "a collective on an aborted communicator did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
  }
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- the device CP pieces against the host ones ----------------------------------------------

TEST(NcclCp, DeviceScatterAndMergeMatchTheHost) {
  KMLA_REQUIRE_GPU();
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0, 1);
  const int W = 3;
  const int64_t Td = 7, H = 5, D = 512, Ts = 4;
  const std::vector<int64_t> rows = {5, 0, 3, 6};  // not in order; rows 1, 2, 4 absent

  // Scatter: a bf16 shard result onto NaN-poisoned full rows.
  std::vector<uint16_t> so(size_t(Ts * H * D));
  for (auto& v : so) v = float_to_bf16(normal(rng));
  std::vector<float> sl(size_t(Ts * H));
  for (float& x : sl) x = normal(rng);
  test::DevBuf<int64_t> drows(rows);
  test::DevBuf<uint16_t> dso(so);
  test::DevBuf<float> dsl(sl), fo(size_t(Td * H * D)), fl(size_t(Td * H));
  fo.fill_bytes(0xFF);
  fl.fill_bytes(0xFF);
  dist::cp_scatter_partial(TensorView(drows.ptr, DType::i64, {Ts}, Device::cuda),
                           TensorView(dso.ptr, DType::bf16, {Ts, H, D}, Device::cuda),
                           TensorView(dsl.ptr, DType::f32, {Ts, H}, Device::cuda),
                           TensorView(fo.ptr, DType::f32, {Td, H, D}, Device::cuda),
                           TensorView(fl.ptr, DType::f32, {Td, H}, Device::cuda), nullptr);
  const std::vector<float> got_o = fo.download(), got_l = fl.download();
  for (int64_t t = 0; t < Td; ++t) {
    const auto it = std::find(rows.begin(), rows.end(), t);
    const int64_t i = it == rows.end() ? -1 : it - rows.begin();
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(got_l[size_t(t * H + h)], i < 0 ? -kInf : sl[size_t(i * H + h)]) << "row " << t;
      for (int64_t d = 0; d < D; ++d)
        ASSERT_EQ(got_o[size_t((t * H + h) * D + d)], i < 0 ? 0.0f : bf16_to_float(so[size_t((i * H + h) * D + d)]))
            << "row " << t << " head " << h << " d " << d;
    }
  }
  // An empty shard: every row empty.
  dist::cp_scatter_partial(TensorView(drows.ptr, DType::i64, {0}, Device::cuda),
                           TensorView(dso.ptr, DType::bf16, {0, H, D}, Device::cuda),
                           TensorView(dsl.ptr, DType::f32, {0, H}, Device::cuda),
                           TensorView(fo.ptr, DType::f32, {Td, H, D}, Device::cuda),
                           TensorView(fl.ptr, DType::f32, {Td, H}, Device::cuda), nullptr);
  for (float l : fl.download()) EXPECT_EQ(l, -kInf);
  EXPECT_THROW(dist::cp_scatter_partial(TensorView(drows.ptr, DType::i64, {Ts}, Device::cuda),
                                        TensorView(dso.ptr, DType::bf16, {Ts, H, D}, Device::cuda),
                                        TensorView(dsl.ptr, DType::f32, {Ts, H}, Device::cuda),
                                        TensorView(fo.ptr, DType::f32, {Td, H + 1, D}, Device::cuda),
                                        TensorView(fl.ptr, DType::f32, {Td, H + 1}, Device::cuda), nullptr),
               Error);

  // Merge: W partials with empty rows (-inf or +inf LSE, NaN outputs), one row empty on every
  // rank, LSEs far apart (one partial dominates) and close together.
  std::vector<float> go(size_t(W * Td * H * D)), gl(size_t(W * Td * H));
  for (float& x : go) x = normal(rng);
  for (float& x : gl) x = 4 * normal(rng);
  auto empty = [&](int k, int64_t r, float l) {
    gl[size_t(k * Td * H + r)] = l;
    std::fill_n(go.begin() + (k * Td * H + r) * D, D, kNaN);
  };
  empty(0, 2, -kInf);
  empty(1, 2, kInf);
  for (int k = 0; k < W; ++k) empty(k, 9, -kInf);
  gl[size_t(0 * Td * H + 11)] = 80.0f;  // dominates rank 1 and 2 by e^-70
  std::vector<TensorView> ho, hl;
  for (int k = 0; k < W; ++k) {
    ho.emplace_back(go.data() + k * Td * H * D, DType::f32, std::initializer_list<int64_t>{Td, H, D});
    hl.emplace_back(gl.data() + k * Td * H, DType::f32, std::initializer_list<int64_t>{Td, H});
  }
  HostTensor ref_o(DType::f32, {Td, H, D}), ref_l(DType::f32, {Td, H});
  cp_merge(ho, hl, ref_o.view(), ref_l.view());
  test::DevBuf<float> dgo(go), dgl(gl), mo(size_t(Td * H * D)), ml(size_t(Td * H));
  test::DevBuf<uint16_t> mo16(size_t(Td * H * D));
  mo.fill_bytes(0xFF);
  mo16.fill_bytes(0xFF);
  ml.fill_bytes(0xFF);
  const TensorView vgo(dgo.ptr, DType::f32, {W, Td, H, D}, Device::cuda), vgl(dgl.ptr, DType::f32, {W, Td, H}, Device::cuda);
  dist::cp_merge_partials(vgo, vgl, TensorView(mo.ptr, DType::f32, {Td, H, D}, Device::cuda),
                          TensorView(ml.ptr, DType::f32, {Td, H}, Device::cuda), nullptr);
  const std::vector<float> mf = mo.download(), mlse = ml.download();
  dist::cp_merge_partials(vgo, vgl, TensorView(mo16.ptr, DType::bf16, {Td, H, D}, Device::cuda),
                          TensorView(ml.ptr, DType::f32, {Td, H}, Device::cuda), nullptr);
  const std::vector<uint16_t> m16 = mo16.download();
  for (int64_t r = 0; r < Td * H; ++r) {
    const float rl = ref_l.data<float>()[r];
    if (r == 9) EXPECT_EQ(mlse[size_t(r)], -kInf);
    else EXPECT_NEAR(mlse[size_t(r)], rl, 1e-5f * std::max(1.0f, std::fabs(rl))) << "row " << r;  // fp32 exp/log
    for (int64_t d = 0; d < D; ++d) {
      const float ref = ref_o.data<float>()[r * D + d];
      ASSERT_FALSE(std::isnan(mf[size_t(r * D + d)])) << "row " << r << " d " << d;
      // The same fp32 weights and sums as the host, up to expf/logf ulps: |out| <~ 4 here.
      ASSERT_NEAR(mf[size_t(r * D + d)], ref, 1e-5f) << "row " << r << " d " << d;
      // One bf16 rounding of the fp32 result (half an ulp) plus the fp32 difference.
      ASSERT_NEAR(bf16_to_float(m16[size_t(r * D + d)]), ref, std::fabs(ref) * 0x1p-8f + 1e-5f)
          << "row " << r << " d " << d;
    }
  }
}

// ---- CP decode: shards of one case, each rank's cache on its own ----------------------------

struct CpSetup {
  int world = 1;
  int heads = 5;            // odd
  double scale = 0.0721688;
  LatentCache full;         // host, NaN in unused slots
  BatchMetadata md;
  HostTensor q;             // bf16 [Td, H, 576]
  std::vector<LatentCache> rank_cache;
  std::vector<CpShard> shard;
};

void poison(const LatentCache& cache) {
  std::vector<float> nan_row(kLatentDim, kNaN);
  for (int64_t s = 0; s < cache.geometry().num_slots(); ++s) cache.write_row(s, nan_row.data());
}

std::vector<int32_t> permuted(int64_t n, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

// The same in every rank process (deterministic in the seed): lengths around block edges,
// one long sequence, a 3-token causal decode block, some ranks owning nothing of a request.
CpSetup make_cp(int world, int query_len, uint64_t seed) {
  CpSetup s;
  s.world = world;
  std::mt19937_64 rng(seed);
  const int bs = 16, q = query_len, H = s.heads;
  std::vector<int64_t> lens;
  for (int64_t L : {2, 16, 17, 63, 64, 65, 700, 2 * bs + 1}) lens.push_back(std::max<int64_t>(L, q + 1));
  int64_t nb = 3;
  for (int64_t L : lens) nb += (L + bs - 1) / bs;
  s.full = LatentCache::allocate(CacheFormat::bf16, bs, nb);
  poison(s.full);
  const std::vector<int32_t> ids = permuted(nb, rng);
  std::vector<RequestSpec> reqs;
  size_t next = 0;
  for (int64_t L : lens) {
    const size_t need = size_t((L + bs - 1) / bs);
    reqs.push_back(RequestSpec::from_seq_len(q, L, std::vector<int32_t>(ids.begin() + long(next), ids.begin() + long(next + need))));
    next += need;
  }
  std::shuffle(reqs.begin(), reqs.end(), rng);
  BatchOptions bo;
  bo.decode_threshold = q;
  s.md = plan_batch(reqs, s.full.geometry(), bo);
  std::uniform_real_distribution<float> uni(-1, 1);
  std::vector<float> row(kLatentDim);
  for (int r = 0; r < s.md.num_requests; ++r)
    for (int64_t p = 0; p < s.md.seq_lens[size_t(r)]; ++p) {
      for (float& x : row) x = uni(rng);
      s.full.write_row(s.md.slot_of(r, p), row.data());
    }
  const int64_t Td = s.md.num_decode_tokens;
  s.q = HostTensor(DType::bf16, {Td, H, kLatentDim});
  std::normal_distribution<float> normal(0, 1);
  for (int64_t i = 0; i < s.q.numel(); ++i) s.q.data<uint16_t>()[i] = float_to_bf16(normal(rng));
  for (int rank = 0; rank < world; ++rank) {
    std::vector<CpRange> ranges;
    int64_t rb = 2;
    for (int r = 0; r < s.md.num_requests; ++r) {
      ranges.push_back(cp_range(s.md.seq_lens[size_t(r)], s.md.query_lens[size_t(r)], bs, rank, world));
      rb += (ranges.back().size() + bs - 1) / bs;
    }
    LatentCache rc = LatentCache::allocate(CacheFormat::bf16, bs, rb);
    poison(rc);
    const std::vector<int32_t> rids = permuted(rb, rng);
    std::vector<std::vector<int32_t>> tables;
    size_t used = 0;
    for (int r = 0; r < s.md.num_requests; ++r) {
      const CpRange g = ranges[size_t(r)];
      const size_t need = size_t((g.size() + bs - 1) / bs);
      tables.emplace_back(rids.begin() + long(used), rids.begin() + long(used + need));
      used += need;
      for (int64_t j = 0; j < g.size(); ++j)
        std::memcpy(rc.slot_ptr(int64_t(tables.back()[size_t(j / bs)]) * bs + j % bs),
                    s.full.slot_ptr(s.md.slot_of(r, g.start + j)), s.full.geometry().entry_bytes());
    }
    s.shard.push_back(cp_shard(s.md, tables, rc.geometry(), rank, world));
    s.rank_cache.push_back(std::move(rc));
  }
  return s;
}

// A host cache's bytes in a fresh device cache.
cuda::DeviceCache upload(const LatentCache& host) {
  const CacheGeometry& g = host.geometry();
  cuda::DeviceCache dc = cuda::DeviceCache::allocate(g.format, g.block_size, g.num_blocks);
  const int64_t bytes = g.block_stride * g.num_blocks;
  cuda::copy_to_device(TensorView(host.base(), DType::u8, {bytes}), dc.memory.view(DType::u8, {bytes}), nullptr);
  return dc;
}

struct DecodeResult {
  std::vector<uint16_t> out;  // bf16 [Td, H, 512]
  std::vector<float> lse;     // [Td, H]
};

// The unsharded decode on this GPU.
DecodeResult full_decode(const CpSetup& s) {
  const int64_t Td = s.md.num_decode_tokens, H = s.heads;
  cuda::DeviceCache dc = upload(s.full);
  cuda::DecodeAttention da(s.md, dc.cache, int(H));
  test::DevBuf<uint8_t> ws(da.workspace_bytes());
  std::vector<uint8_t> qbytes(s.q.bytes());
  std::memcpy(qbytes.data(), s.q.data<uint8_t>(), qbytes.size());
  test::DevBuf<uint8_t> dq(qbytes);
  test::DevBuf<uint16_t> out(size_t(Td * H * kKvLoraRank));
  test::DevBuf<float> lse(size_t(Td * H));
  out.fill_bytes(0xFF);
  da.upload(ws.ptr, nullptr);
  da.run(TensorView(dq.ptr, DType::bf16, {Td, H, kLatentDim}, Device::cuda), 1.0f, dc.cache, s.scale,
         TensorView(out.ptr, DType::bf16, {Td, H, kKvLoraRank}, Device::cuda),
         TensorView(lse.ptr, DType::f32, {Td, H}, Device::cuda), ws.ptr, nullptr, nullptr);
  return {out.download(), lse.download()};
}

// Rank `rank`'s decode over its own cache, spread onto the full rows (f32 partial + LSE) at
// full_out / full_lse (device).
void rank_partial(const CpSetup& s, int rank, float* full_out, float* full_lse) {
  const CpShard& sh = s.shard[size_t(rank)];
  const int64_t Td = s.md.num_decode_tokens, H = s.heads, Ts = sh.md.num_decode_tokens;
  cuda::DeviceCache dc = upload(s.rank_cache[size_t(rank)]);
  test::DevBuf<int64_t> rows(sh.rows);
  test::DevBuf<uint16_t> out(size_t(std::max<int64_t>(Ts, 1) * H * kKvLoraRank));
  test::DevBuf<float> lse(size_t(std::max<int64_t>(Ts, 1) * H));
  if (Ts > 0) {
    std::vector<uint8_t> qs(size_t(Ts * H * kLatentDim * 2));
    cp_gather_rows(sh, s.q.data<uint8_t>(), qs.data(), size_t(H) * kLatentDim * 2);
    test::DevBuf<uint8_t> dq(qs);
    cuda::DecodeAttention da(sh.md, dc.cache, int(H));
    test::DevBuf<uint8_t> ws(da.workspace_bytes());
    da.upload(ws.ptr, nullptr);
    da.run(TensorView(dq.ptr, DType::bf16, {Ts, H, kLatentDim}, Device::cuda), 1.0f, dc.cache, s.scale,
           TensorView(out.ptr, DType::bf16, {Ts, H, kKvLoraRank}, Device::cuda),
           TensorView(lse.ptr, DType::f32, {Ts, H}, Device::cuda), ws.ptr, nullptr, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the test's buffers die at scope end
  }
  dist::cp_scatter_partial(TensorView(rows.ptr, DType::i64, {Ts}, Device::cuda),
                           TensorView(out.ptr, DType::bf16, {Ts, H, kKvLoraRank}, Device::cuda),
                           TensorView(lse.ptr, DType::f32, {Ts, H}, Device::cuda),
                           TensorView(full_out, DType::f32, {Td, H, kKvLoraRank}, Device::cuda),
                           TensorView(full_lse, DType::f32, {Td, H}, Device::cuda), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

void expect_matches_full(const CpSetup& s, const std::vector<uint16_t>& out, const std::vector<float>& lse) {
  const DecodeResult ref = full_decode(s);
  double m = 0, d = 0, dl = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const float a = bf16_to_float(out[i]), b = bf16_to_float(ref.out[i]);
    ASSERT_TRUE(std::isfinite(a)) << "element " << i;
    ASSERT_TRUE(std::isfinite(b)) << "element " << i;
    m = std::max(m, double(std::fabs(b)));
    d = std::max(d, double(std::fabs(a - b)));
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    ASSERT_TRUE(std::isfinite(lse[i])) << "row " << i;
    dl = std::max(dl, double(std::fabs(lse[i] - ref.lse[i])));
  }
  ASSERT_GT(m, 0.0);
  // Half a bf16 ulp for each rounding: every rank's partial (a partial can be ~2x the merged
  // value where partials cancel), the merge's output and the reference's, about 2^-7 of the
  // largest output; 2^-6 leaves room for fp32 order. A wrong shard, causality or block mapping
  // moves whole softmax weights (the short sequences here have 2..65 keys), far above this.
  EXPECT_LE(d, 0x1p-6 * m);
  // LSEs are O(1..10): fp32 exp/log in another order stays far below 1e-3.
  EXPECT_LE(dl, 1e-3);
}

// Every rank of a world simulated in turn on one GPU, merged by cp_merge_partials.
TEST(NcclCp, ShardedDecodeOnOneGpuMergesToTheFullDecode) {
  KMLA_REQUIRE_GPU();
  for (int world : {1, 2, 4})
    for (int q : {1, 3}) {
      SCOPED_TRACE("world " + std::to_string(world) + " q " + std::to_string(q));
      const CpSetup s = make_cp(world, q, 70 + uint64_t(world * 10 + q));
      const int64_t Td = s.md.num_decode_tokens, H = s.heads, D = kKvLoraRank;
      test::DevBuf<float> go(size_t(world * Td * H * D)), gl(size_t(world * Td * H));
      go.fill_bytes(0xFF);
      gl.fill_bytes(0xFF);
      for (int rank = 0; rank < world; ++rank)
        rank_partial(s, rank, go.ptr + rank * Td * H * D, gl.ptr + rank * Td * H);
      test::DevBuf<uint16_t> out(size_t(Td * H * D));
      test::DevBuf<float> lse(size_t(Td * H));
      out.fill_bytes(0xFF);
      dist::cp_merge_partials(TensorView(go.ptr, DType::f32, {world, Td, H, D}, Device::cuda),
                              TensorView(gl.ptr, DType::f32, {world, Td, H}, Device::cuda),
                              TensorView(out.ptr, DType::bf16, {Td, H, D}, Device::cuda),
                              TensorView(lse.ptr, DType::f32, {Td, H}, Device::cuda), nullptr);
      expect_matches_full(s, out.download(), lse.download());
    }
}

// The same through NCCL: each rank its own GPU, partials all-gathered and merged everywhere.
void cp_rank_body(const RankEnv& env) {
  std::unique_ptr<Communicator> comm = join(env);
  const CpSetup s = make_cp(env.world, 3, 500 + uint64_t(env.world));
  const int64_t Td = s.md.num_decode_tokens, H = s.heads, D = kKvLoraRank;
  test::DevBuf<float> po(size_t(Td * H * D)), pl(size_t(Td * H)), mo(size_t(Td * H * D)), ml(size_t(Td * H));
  rank_partial(s, env.rank, po.ptr, pl.ptr);
  test::DevBuf<uint8_t> ws(dist::cp_gather_workspace_bytes(env.world, Td, int(H), int(D)));
  test::DevBuf<uint16_t> out(size_t(Td * H * D));
  out.fill_bytes(0xFF);
  dist::cp_all_gather_merge(*comm, TensorView(po.ptr, DType::f32, {Td, H, D}, Device::cuda),
                            TensorView(pl.ptr, DType::f32, {Td, H}, Device::cuda), ws.ptr,
                            TensorView(out.ptr, DType::bf16, {Td, H, D}, Device::cuda),
                            TensorView(ml.ptr, DType::f32, {Td, H}, Device::cuda), nullptr);
  comm->check(nullptr, 60);
  expect_matches_full(s, out.download(), ml.download());
}

#define KMLA_MULTI_RANK_TEST(Suite, Name, world, body)            \
  TEST(Suite, Name) {                                              \
    if (const auto env = rank_env()) return body(*env);            \
    KMLA_REQUIRE_GPUS(world);                                      \
    const auto r = launch_this_test(world);                        \
    expect_all_ranks_ok(*r);                                       \
  }

KMLA_MULTI_RANK_TEST(NcclCp, World2MatchesSingleGpuDecode, 2, cp_rank_body)
KMLA_MULTI_RANK_TEST(NcclCp, World4MatchesSingleGpuDecode, 4, cp_rank_body)
KMLA_MULTI_RANK_TEST(NcclCp, World8MatchesSingleGpuDecode, 8, cp_rank_body)

// ---- tensor parallelism: the layer at world N against the layer at TP=1 ----------------------

struct LayerRun {
  std::vector<uint16_t> out;   // activation bits [rows, hidden]
  std::vector<uint8_t> cache;  // the cache's bytes after the call
};

LayerRun run_layer(const verify::Case& c, const verify::Inputs& in, const MlaConfig& cfg, const MlaWeights& w,
                   Communicator* comm) {
  std::shared_ptr<const RopeTable> rope;
  if (cfg.use_rope) rope = RopeTable::build(c.config, c.rope_rows);
  cuda::LayerOptions lo;
  lo.activation = c.activation;
  if (comm) lo.all_reduce = comm->layer_all_reduce();
  cuda::Layer layer(cfg, w, lo, rope);
  cuda::DeviceCache dc = upload(in.cache);
  const int64_t rows = in.hidden.dim(0), hs = in.hidden.dim(1);
  cuda::DeviceBuffer hidden(in.hidden.bytes()), pos(in.positions.bytes()), out(in.hidden.bytes());
  const TensorView hv = hidden.view(c.activation, {rows, hs}), pv = pos.view(DType::i64, {rows}),
                   ov = out.view(c.activation, {rows, hs});
  EXPECT_EQ(cudaMemset(out.data(), 0xFF, out.bytes()), cudaSuccess);
  cuda::copy_to_device(in.hidden.view(), hv, nullptr);
  cuda::copy_to_device(in.positions.view(), pv, nullptr);
  layer.forward(pv, hv, &in.md, dc.cache, ov, nullptr);
  if (comm) comm->check(nullptr, 60);
  LayerRun r;
  r.out.resize(size_t(rows * hs));
  const CacheGeometry& g = in.cache.geometry();
  r.cache.resize(size_t(g.block_stride * g.num_blocks));
  cuda::copy_to_host(ov, TensorView(r.out.data(), c.activation, {rows, hs}), nullptr);
  cuda::copy_to_host(dc.memory.view(DType::u8, {int64_t(r.cache.size())}),
                     TensorView(r.cache.data(), DType::u8, {int64_t(r.cache.size())}), nullptr);
  layer.check_errors(nullptr);
  return r;
}

void tp_rank_body(const RankEnv& env) {
  std::unique_ptr<Communicator> comm = join(env);
  // 8 heads (1 per rank at world 8), the K3 geometry shrunk; a mixed batch with decodes,
  // a decode block, chunked prefills and padding rows, NaN in unused cache slots.
  const verify::Case c = verify::mixed_case("kimi-k3", CacheFormat::bf16, 16, 900 + uint64_t(env.world), 8);
  const verify::Inputs in = verify::make_inputs(c);
  const MlaConfig local = c.config.tp_slice(env.rank, env.world);
  const MlaWeights w = in.weights.tp_slice(c.config, env.rank, env.world);
  const LayerRun tp = run_layer(c, in, local, w, comm.get());
  const LayerRun one = run_layer(c, in, c.config, in.weights, nullptr);
  // The latent cache is replicated: every rank writes the TP=1 layer's bytes.
  EXPECT_EQ(tp.cache, one.cache);
  double m = 0, d = 0;
  for (size_t i = 0; i < tp.out.size(); ++i) {
    const float a = bf16_to_float(tp.out[i]), b = bf16_to_float(one.out[i]);
    ASSERT_FALSE(std::isnan(a)) << "element " << i;
    m = std::max(m, double(std::fabs(b)));
    d = std::max(d, double(std::fabs(a - b)));
  }
  ASSERT_GT(m, 0.0);
  // Each rank's bf16 partial carries half an ulp of at most the full output, the bf16 all-reduce
  // rounds once per hop, and the TP=1 output rounds once: (world + 2) bf16 ulps of the largest.
  EXPECT_LE(d, (env.world + 2) * 0x1p-8 * m) << "world " << env.world;
  // Every rank holds the same reduced output (NCCL reduces each chunk once, then copies it).
  const int64_t n = int64_t(tp.out.size());
  test::DevBuf<uint16_t> mine(tp.out), all(size_t(n * env.world));
  comm->all_gather(TensorView(mine.ptr, DType::bf16, {n}, Device::cuda),
                   TensorView(all.ptr, DType::bf16, {n * env.world}, Device::cuda), nullptr);
  comm->check(nullptr, 60);
  const std::vector<uint16_t> every = all.download();
  for (int k = 0; k < env.world; ++k)
    EXPECT_TRUE(std::equal(tp.out.begin(), tp.out.end(), every.begin() + k * n)) << "rank " << k << " differs";
}

KMLA_MULTI_RANK_TEST(NcclTp, World2MatchesTp1, 2, tp_rank_body)
KMLA_MULTI_RANK_TEST(NcclTp, World4MatchesTp1, 4, tp_rank_body)
KMLA_MULTI_RANK_TEST(NcclTp, World8MatchesTp1, 8, tp_rank_body)

// ---- a rank that fails -----------------------------------------------------------------------

// Mode "vanish": rank 1 joins and exits at once (status 0, so the launcher keeps rank 0
// running): rank 0's all-reduce can never complete, and check() must abort and throw within
// its timeout instead of hanging. Mode "kill": rank 1 dies by SIGKILL; the launcher names it
// and stops rank 0.
void failing_rank_body(const RankEnv& env) {
  const std::string mode = std::getenv("KMLA_NCCL_TEST_MODE");
  if (env.rank == 1) {
    std::unique_ptr<Communicator> comm = join(env);
    if (mode == "kill") raise(SIGKILL);
    std::fflush(stdout);
    _exit(0);
  }
  // Rank 0 may already see the loss while joining: that is the same error.
  std::unique_ptr<Communicator> comm;
  test::DevBuf<float> buf(size_t(1) << 20);
  buf.fill_bytes(0);
  try {
    comm = join(env, 20);  // an NCCL call in progress for 20 s fails
    for (int i = 0; i < 1000; ++i) {
      comm->all_reduce_sum(TensorView(buf.ptr, DType::f32, {int64_t(1) << 20}, Device::cuda), nullptr);
      comm->check(nullptr, 5);
    }
    ADD_FAILURE() << "rank 0's all-reduces completed without its peer";
  } catch (const Error& e) {
    std::printf("rank 0 stopped with: %s\n", e.what());
    EXPECT_TRUE(!comm || comm->aborted());
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2"), std::string::npos) << e.what();
  }
}

TEST(NcclFail, ALostPeerEndsTheOtherRankWithAnError) {
  if (const auto env = rank_env()) return failing_rank_body(*env);
  KMLA_REQUIRE_GPUS(2);
  const auto vanish = launch_this_test(2, 120, "vanish");
  expect_all_ranks_ok(*vanish);
  EXPECT_NE(vanish->ranks[0].output.find("rank 0 stopped with: rank 0 of 2"), std::string::npos)
      << vanish->ranks[0].output;
  EXPECT_LT(vanish->wall_s, 90);

  const auto killed = launch_this_test(2, 120, "kill");
  EXPECT_EQ(killed->failed_rank, 1) << killed->error;
  EXPECT_EQ(killed->ranks[1].signal, SIGKILL);
  EXPECT_NE(killed->error.find("rank 1 of 2 failed: killed by signal 9"), std::string::npos) << killed->error;
  EXPECT_TRUE(killed->ranks[0].stopped || !killed->ranks[0].ok()) << "rank 0 was neither stopped nor failed";
  EXPECT_LT(killed->wall_s, 90);
}

}  // namespace
}  // namespace kmla
