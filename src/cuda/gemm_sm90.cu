// The few-token GEMM of gemm_sm90.cuh: TMA-fed wgmma, a stream-K split of (tile, k block)
// units over the SMs, partial tiles summed in CTA order by a second kernel.
//
// CTA: a producer warpgroup (one thread issues the copies) and two consumer warpgroups. A tile is
// 256 outputs (n) by all M <= 128 tokens; warpgroup wg owns outputs [128 wg, 128 wg + 128) and
// computes them as the wgmma N dimension against the tokens as its M dimension (one or two m64
// halves, kMTiles): acc[mt] is m64n128, so the weight slice is wgmma's B operand (K-major for a [N,
// K] weight, N-major for a [K, N] one) and the activation rows its A operand.
//
// Stage s (kStages of them): the weight tile, 256 outputs x 64 k (32 KB: one box of 256
// K-major rows, or four N-major 64-output panels of 64 k rows), then the activation tile,
// 64 kMTiles tokens x 64 k (8 KB per m64 half; rows past M and k past K are the bulk copy's
// zero fill). full[s] completes when both land; empty[s] when both warpgroups' MMAs that
// read them are done.
//
// Work split: unit u = tile * kb + k block, units [u0(g), u0(g + 1)) to CTA g with
// u0(g) = g * units / ctas. A CTA's range is a sequence of segments, each the part of one
// tile in it. A segment covering its whole tile stores C directly. Otherwise the segment
// stores its fp32 partial to slot g + tile (the (tile, CTA) pairs of the segments form a
// staircase, so g + tile is unique), and a second kernel over all SMs adds each split tile's
// partials in CTA order and stores C. (Summing them in the CTA that finishes a tile last
// leaves one SM reading every partial of the tile at the end: at 128 tokens a partial is as
// large as 4 k blocks of weights.)
#include <cuda.h>

#include <algorithm>

#include "cuda/gemm_sm90.cuh"
#include "cuda/sm90.cuh"

namespace kmla::cuda {

namespace {

using namespace sm90;

constexpr int kTileN = 256;  // outputs per tile
constexpr int kWgN = 128;    // outputs per consumer warpgroup
constexpr int kKBlock = 64;  // k per stage (one 128-byte panel row)
constexpr int kStages = 4;
constexpr int kConsumers = 256;  // two warpgroups
constexpr int kThreads = 128 + kConsumers;
// Registers (65536 per SM, one CTA of 384 threads, <= 168 each at launch): the producer
// warpgroup gives back to 40, the consumers take 232 (128 accumulators at M > 64, the
// partial sums, addresses): 128 x 40 + 256 x 232 = 64512.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(128 * kProducerRegs + kConsumers * kConsumerRegs <= kThreads * 168);
constexpr int kPanelBytes = 64 * kPanelRowBytes;  // 64 rows of one 128-byte panel
constexpr int kWBytes = kTileN * kPanelRowBytes;  // 32 KB
constexpr int kXHalfBytes = 64 * kPanelRowBytes;  // one m64 half of the activation tile
constexpr int kStageBytes = kWBytes + 2 * kXHalfBytes;
constexpr int kSmemAlloc = kSwizzleAtomBytes + kStages * kStageBytes + 2 * kStages * 8 + 16;
static_assert(kSmemAlloc <= 227 * 1024);

// float4s of one partial: every consumer thread's accumulators.
__host__ __device__ constexpr int64_t slot_vecs(int m_tiles) {
  return int64_t(kConsumers) * 16 * m_tiles;
}

struct SkinnyParams {
  void* c;
  int64_t ldc, stride_c;
  int M, N;
  int kb;       // k blocks per tile
  int tiles_n;  // tiles per batch entry
  int units;    // batch * tiles_n * kb
  int ctas;
  float* partials;
};

// The first unit of CTA g, and the CTA whose range holds unit u (the largest g with
// unit_begin(g) <= u). 32-bit: skinny_refusal keeps units * ctas below 2^31, and a 64-bit
// division would be a call that spills the accumulators around it.
__device__ __forceinline__ int unit_begin(const SkinnyParams& p, int g) {
  return g * p.units / p.ctas;
}
__device__ __forceinline__ int unit_owner(const SkinnyParams& p, int u) {
  return ((u + 1) * p.ctas - 1) / p.units;
}

// Stores float4 j of consumer thread ct's accumulators for tile t: thread (warpgroup wg,
// warp wq, lane 4 gr + tq) holds in it, with half mt = j / 16 and block i = j % 16, tokens
// 64 mt + 16 wq + gr (.x, .y) and + 8 (.z, .w) at outputs 8 i + 2 tq (+ 1) of the
// warpgroup's 128: two adjacent outputs per store.
template <class T>
__device__ __forceinline__ void store_c(const SkinnyParams& p, int t, int j, int ct, float4 v) {
  const int b = t / p.tiles_n, n0 = (t - b * p.tiles_n) * kTileN;
  const int wg = ct / 128, wq = ct / 32 % 4, gr = ct % 32 / 4, tq = ct % 4;
  const int token = 64 * (j / 16) + 16 * wq + gr, n = n0 + wg * kWgN + 8 * (j % 16) + 2 * tq;
  if (n >= p.N) return;
  T* c = static_cast<T*>(p.c) + int64_t(b) * p.stride_c + n;
  if (token < p.M) *reinterpret_cast<uint32_t*>(c + int64_t(token) * p.ldc) = pack2<T>(v.x, v.y);
  if (token + 8 < p.M)
    *reinterpret_cast<uint32_t*>(c + int64_t(token + 8) * p.ldc) = pack2<T>(v.z, v.w);
}

template <class T, int kMTiles, bool kWNMajor>
__global__ void __launch_bounds__(kThreads, 1)
    skinny_gemm_kernel(const SkinnyParams p, const __grid_constant__ CUtensorMap wmap,
                       const __grid_constant__ CUtensorMap xmap) {
#if KMLA_SM90A
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  auto* full = reinterpret_cast<uint64_t*>(smem_raw + (base - raw) + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 2);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  // The reduction kernel may be scheduled now: it waits for this whole grid (griddepcontrol
  // .wait) and only takes SMs this grid has left.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int g = blockIdx.x;
  const int u_begin = unit_begin(p, g), u_end = unit_begin(p, g + 1);
  constexpr uint32_t kTxBytes = kWBytes + kMTiles * kXHalfBytes;

  if (warp < 4) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (threadIdx.x != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int u = u_begin; u < u_end; ++u) {
      const int t = u / p.kb, k0 = (u - t * p.kb) * kKBlock;
      const int b = t / p.tiles_n, n0 = (t - b * p.tiles_n) * kTileN;
      mbar_wait(smem_u32(empty + stage), phase ^ 1);
      mbar_arrive_expect_tx(full + stage, kTxBytes);
      const uint32_t st = base + stage * kStageBytes;
      if constexpr (kWNMajor) {
#pragma unroll
        for (int q = 0; q < kTileN / 64; ++q)
          tma_load_3d(st + q * kPanelBytes, &wmap, n0 + 64 * q, k0, b, full + stage);
      } else {
        tma_load_3d(st, &wmap, k0, n0, b, full + stage);
      }
      tma_load_3d(st + kWBytes, &xmap, k0, 0, b, full + stage);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    return;
  }

  // ---- consumers -------------------------------------------------------------------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int wg = warp / 4 - 1;
  const int ct = threadIdx.x - 128;
  const bool wg_leader = ct % 128 == 0;
  constexpr uint32_t kDescHi = desc_hi(kSwizzleAtomBytes, 1);
  float acc[kMTiles][64];
  int stage = 0;
  uint32_t phase = 0;
  for (int u = u_begin; u < u_end;) {
    const int t = u / p.kb;
    const int seg_end = min(u_end, (t + 1) * p.kb);
    int prev = -1;
    // Zeroed here rather than by the first MMA's scale-d: the MMAs read their accumulators as
    // far as the compiler knows, so this is what frees the registers for the epilogue.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 64; ++r) acc[mt][r] = 0.0f;
    for (int i = 0; i < seg_end - u; ++i) {
      mbar_wait(smem_u32(full + stage), phase);
      const uint32_t st = base + stage * kStageBytes;
      // A: token rows of half mt, +32 B per 16 k. B: this warpgroup's 128 outputs.
      const uint32_t x_lo = desc_lo(st + kWBytes, 16);
      const uint32_t w_lo = kWNMajor ? desc_lo(st + 2 * wg * kPanelBytes, kPanelBytes)
                                     : desc_lo(st + wg * kWgN * kPanelRowBytes, 16);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kKBlock / 16; ++ks) {
        const uint32_t w_step = kWNMajor ? (ks * 16 * kPanelRowBytes) >> 4 : (ks * 32) >> 4;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
          wgmma_ss_m64n128k16<T, kWNMajor>(
              acc[mt], make_desc_halves(x_lo + ((mt * kXHalfBytes + ks * 32) >> 4), kDescHi),
              make_desc_halves(w_lo + w_step, kDescHi), true);
      }
      wgmma_commit();
      wgmma_wait<1>();
      if (prev >= 0 && wg_leader) mbar_arrive(smem_u32(empty + prev));
      prev = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) fence_regs(acc[mt]);
    if (wg_leader) mbar_arrive(smem_u32(empty + prev));

    const bool whole = u == t * p.kb && seg_end == (t + 1) * p.kb;
    u = seg_end;
    constexpr int kVecs = 16 * kMTiles;  // float4s per thread
    if (whole) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const float* a = &acc[j / 16][4 * (j % 16)];
        store_c<T>(p, t, j, ct, make_float4(a[0], a[1], a[2], a[3]));
      }
    } else {  // a split tile: the partial to slot g + t, summed by skinny_reduce_kernel
      float4* mine =
          reinterpret_cast<float4*>(p.partials) + (int64_t(g) + t) * slot_vecs(kMTiles) + ct;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const float* a = &acc[j / 16][4 * (j % 16)];
        __stcg(mine + j * kConsumers, make_float4(a[0], a[1], a[2], a[3]));
      }
    }
  }
#else
  (void)p, (void)wmap, (void)xmap;
  __trap();
#endif
}

// The split tiles' partials summed in CTA order and stored: one float4 (j, ct) of one tile per
// thread, consecutive threads on consecutive ct (coalesced slot reads). Tiles done whole by one
// CTA are skipped.
template <class T, int kMTiles>
__global__ void __launch_bounds__(256) skinny_reduce_kernel(const SkinnyParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the GEMM (skinny_gemm): wait for all of it.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  constexpr int64_t kSlotVecs = slot_vecs(kMTiles);
  const int64_t total = int64_t(p.units / p.kb) * kSlotVecs;
  const float4* slots = reinterpret_cast<const float4*>(p.partials);
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int t = int(e / kSlotVecs), v = int(e % kSlotVecs);
    const int first = unit_owner(p, t * p.kb), last = unit_owner(p, t * p.kb + p.kb - 1);
    if (first == last) continue;
    const float4* part = slots + (int64_t(first) + t) * kSlotVecs + v;
    float4 sum = __ldcg(part);
    for (int o = 1; o <= last - first; ++o) {
      const float4 x = __ldcg(part + o * kSlotVecs);
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
    store_c<T>(p, t, v / kConsumers, v % kConsumers, sum);
  }
}

int m_tiles_of(const SkinnyGemm& g) { return g.M <= 64 ? 1 : 2; }
int64_t tiles_of(const SkinnyGemm& g) { return g.batch * ceil_div(g.N, kTileN); }
int64_t units_of(const SkinnyGemm& g) { return tiles_of(g) * ceil_div(g.K, kKBlock); }

bool sm90_kernel_runs_on(int device) {
  static std::atomic<int> answers[kMaxSm90Devices] = {};
  return sm90a_kernel_runs_on(
      device, reinterpret_cast<const void*>(skinny_gemm_kernel<bf16, 1, false>), answers);
}

// A 3-D tensor map of T: dims innermost first, strides of dims 1 and 2 in bytes.
bool encode_map(CUtensorMap& map, DType act, const void* base, const cuuint64_t (&dims)[3],
                const cuuint64_t (&strides)[2], const cuuint32_t (&box)[3]) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode(&map,
                act == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                3, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

const char* skinny_refusal(const SkinnyGemm& g) {
  if (g.act != DType::bf16 && g.act != DType::f16) return "not bf16/f16";
  if (g.batch < 1 || g.M < 1 || g.M > 128) return "M outside 1..128";
  if (g.N < 1 || g.K < 1) return "empty";
  const auto aligned = [](const void* p, int64_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0;
  };
  // Bulk copies: 16-byte aligned bases and strides (8 elements).
  if (!aligned(g.A, 16) || !aligned(g.W, 16) || g.lda % 8 || g.ldw % 8 ||
      (g.batch > 1 && (g.stride_a % 8 || g.stride_w % 8)))
    return "A or W not 16-byte aligned";
  if (g.batch > 1 && (g.stride_a <= 0 || g.stride_w <= 0)) return "a zero batch stride";
  if (!aligned(g.C, 4) || g.N % 2 || g.ldc % 2 || (g.batch > 1 && g.stride_c % 2))
    return "C not 4-byte aligned";
  // The kernel's unit arithmetic is 32-bit: units * CTAs (at most one per SM) < 2^31.
  if (tiles_of(g) > kSkinnyMaxTiles || units_of(g) * kSkinnyMaxCtas >= (int64_t(1) << 31))
    return "too many tiles";
  int device = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  if (!sm90_kernel_runs_on(device)) return "no sm_90a";
  return nullptr;
}

int skinny_ctas(const SkinnyGemm& g, int sms, int min_units, size_t workspace_bytes) {
  const int64_t units = units_of(g), tiles = tiles_of(g);
  int64_t ctas = std::min<int64_t>(
      {sms, kSkinnyMaxCtas, std::max<int64_t>(1, units / std::max(min_units, 1))});
  // Partial slots g + tile < ctas + tiles - 1 (a CTA count that cuts no tile needs none, but
  // the bound keeps the rule simple).
  const int64_t slots = int64_t(workspace_bytes / (slot_vecs(m_tiles_of(g)) * sizeof(float4)));
  ctas = std::min(ctas, slots - tiles + 1);
  return ctas < 1 ? 0 : int(ctas);
}

bool skinny_gemm(const SkinnyGemm& g, int ctas, void* workspace, cudaStream_t stream, bool pdl) {
  const int64_t e = int64_t(dtype_size(g.act));
  const int m_tiles = m_tiles_of(g);
  const cuuint64_t batch = cuuint64_t(g.batch);
  // Strides of a batch of one are never used; any legal value will do.
  const int64_t sa = g.batch > 1 ? g.stride_a : g.lda * g.M;
  const int64_t sw = g.batch > 1 ? g.stride_w : g.ldw * (g.w_n_major ? g.K : g.N);
  CUtensorMap wmap{}, xmap{};
  const bool ok =
      encode_map(xmap, g.act, g.A, {cuuint64_t(g.K), cuuint64_t(g.M), batch},
                 {cuuint64_t(g.lda * e), cuuint64_t(sa * e)},
                 {kKBlock, cuuint32_t(64 * m_tiles), 1}) &&
      (g.w_n_major ? encode_map(wmap, g.act, g.W, {cuuint64_t(g.N), cuuint64_t(g.K), batch},
                                {cuuint64_t(g.ldw * e), cuuint64_t(sw * e)}, {64, kKBlock, 1})
                   : encode_map(wmap, g.act, g.W, {cuuint64_t(g.K), cuuint64_t(g.N), batch},
                                {cuuint64_t(g.ldw * e), cuuint64_t(sw * e)}, {kKBlock, kTileN, 1}));
  if (!ok) return false;
  SkinnyParams p;
  p.c = g.C;
  p.ldc = g.ldc;
  p.stride_c = g.stride_c;
  p.M = int(g.M);
  p.N = int(g.N);
  p.kb = int(ceil_div(g.K, kKBlock));
  p.tiles_n = int(ceil_div(g.N, kTileN));
  p.units = int(units_of(g));
  p.ctas = ctas;
  p.partials = static_cast<float*>(workspace);
  // Whether some tile spans two CTAs (the owner rule of unit_owner, on the host).
  bool split = false;
  for (int64_t t = 0; t < p.units / p.kb && !split; ++t)
    split = ((t * p.kb + 1) * ctas - 1) / p.units != (((t + 1) * p.kb) * ctas - 1) / p.units;
  dispatch_act(g.act, [&]<class T>() {
    auto launch = [&](auto* kernel, auto* reduce) {
      // A host-side attribute (no sync, allowed during capture), set for whichever device is
      // current.
      KMLA_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemAlloc));
      kernel<<<ctas, kThreads, kSmemAlloc, stream>>>(p, wmap, xmap);
      KMLA_LAUNCH_CHECK();
      if (!split) return;
      const int64_t vecs = int64_t(p.units / p.kb) * slot_vecs(m_tiles);
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(unsigned(std::min<int64_t>(ceil_div(vecs, 256), 4096)));
      cfg.blockDim = dim3(256);
      cfg.stream = stream;
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr.val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = &attr;
      cfg.numAttrs = pdl ? 1 : 0;
      KMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, reduce, p));
    };
    if (g.w_n_major)
      m_tiles == 1 ? launch(skinny_gemm_kernel<T, 1, true>, skinny_reduce_kernel<T, 1>)
                   : launch(skinny_gemm_kernel<T, 2, true>, skinny_reduce_kernel<T, 2>);
    else
      m_tiles == 1 ? launch(skinny_gemm_kernel<T, 1, false>, skinny_reduce_kernel<T, 1>)
                   : launch(skinny_gemm_kernel<T, 2, false>, skinny_reduce_kernel<T, 2>);
  });
  return true;
}

}  // namespace kmla::cuda
