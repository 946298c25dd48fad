// The elementwise and data-movement kernels (see kernels.cuh for the contract of each).
//
// All of them are memory-bound and small next to the GEMMs and attention, so they are
// written for clarity: one warp per row (or per row and head), 16-byte loads and stores
// where the pointers and strides allow it, and the scalar arithmetic of the CPU backend
// spelled out with explicit rounding intrinsics (__fmul_rn & co.) wherever nvcc would
// otherwise be free to contract a multiply and an add into an FMA, which the CPU backend
// (built for baseline x86-64, no FMA) never does. The bit-level conversions to the cache
// formats are the shared host/device functions of kmla/numeric.hpp, so the codes are the
// CPU's by construction (NaN payloads included).
//
// Block shape: every row kernel runs 256 threads = 8 warps = 8 rows (items) per block, no
// shared memory; a warp's lanes own fixed columns of its row, so in-place updates never
// race. Registers are a few dozen per thread (the widest is 16 values per lane).
#include <algorithm>
#include <cfloat>

#include "cuda/kernels.cuh"
#include "kmla/config.hpp"

namespace kmla::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarp * kWarpsPerBlock;
constexpr unsigned kFullMask = 0xffffffffu;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Blocks for `items` warp-sized work items, 8 per block.
unsigned warp_blocks(int64_t items) { return unsigned(ceil_div(items, kWarpsPerBlock)); }

// Blocks of a grid-stride loop over `n` units of work, one per thread: enough blocks to
// fill the GPU several times over, never more than the work needs.
unsigned stride_blocks(int64_t n) {
  return unsigned(std::min<int64_t>(ceil_div(n, kThreads), int64_t(1) << 16));
}

__device__ __forceinline__ int lane_id() { return int(threadIdx.x) % kWarp; }
__device__ __forceinline__ int64_t warp_item() {
  return int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
}

// ---- 8 act values <-> fp32, one 16-byte access when `vec` (p 16-byte aligned) -----------
template <class T>
__device__ __forceinline__ void load8(const T* p, bool vec, float (&v)[8]) {
  if (vec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = to_float(e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = to_float(p[k]);
  }
}

template <class T>
__device__ __forceinline__ void store8(T* p, bool vec, const float (&v)[8]) {
  if (vec) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = from_float<T>(v[k]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) p[k] = from_float<T>(v[k]);
  }
}

// 16 bytes given as 4 little-endian words, one 16-byte store when `vec`.
__device__ __forceinline__ void store16_bytes(uint8_t* p, bool vec, const uint32_t (&w)[4]) {
  if (vec) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int k = 0; k < 16; ++k) p[k] = uint8_t(w[k / 4] >> (8 * (k % 4)));
  }
}

// Four e4m3 codes (or two 16-bit codes) packed little-endian, as memcpy of the array lays
// them out.
__device__ __forceinline__ uint32_t pack4(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  return uint32_t(a) | uint32_t(b) << 8 | uint32_t(c) << 16 | uint32_t(d) << 24;
}
__device__ __forceinline__ uint32_t pack2(uint16_t a, uint16_t b) {
  return uint32_t(a) | uint32_t(b) << 16;
}

// ---- RoPE -------------------------------------------------------------------------------
// The rotation of RopeTable::rotate: two products and a difference (sum), each rounded, no
// FMA.
struct Rotated {
  float even, odd;
};
__device__ __forceinline__ Rotated rotate_pair(float a, float b, float c, float s) {
  return {__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)), __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c))};
}

// One warp per (row, item): items 0..heads-1 are q heads, item `heads` (when k_pe is
// given) the shared k_pe. Lane i rotates pair i (32 pairs = 64 rope dims).
template <class T>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p, int q_items, int items) {
  const int64_t work = warp_item();
  if (work >= p.rows * items) return;
  const int64_t t = work / items;
  const int item = int(work % items);
  const int lane = lane_id();
  int64_t pos = p.positions[t];
  if (pos < 0 || pos >= p.table_rows) {
    if (lane == 0) raise_error(p.error_flag, kErrBadPosition);
    pos = 0;  // never read outside the table
  }
  const float c = p.table[pos * kRopeDim + lane];
  const float s = p.table[pos * kRopeDim + kRopeDim / 2 + lane];
  if (item < q_items) {
    T* x = static_cast<T*>(p.q) + t * p.q_stride + int64_t(item) * kQkHeadDim + kNopeDim + 2 * lane;
    const Rotated r = rotate_pair(to_float(x[0]), to_float(x[1]), c, s);
    x[0] = from_float<T>(r.even);
    x[1] = from_float<T>(r.odd);
    if (t < p.q_f32_rows) {
      float* f = p.q_f32 + (t * p.heads + item) * kRopeDim + 2 * lane;
      f[0] = r.even;
      f[1] = r.odd;
    }
  } else {
    const T* x = static_cast<const T*>(p.k_pe) + t * p.k_stride + 2 * lane;
    const Rotated r = rotate_pair(to_float(x[0]), to_float(x[1]), c, s);
    T* k = static_cast<T*>(p.k_act) + t * kRopeDim + 2 * lane;
    k[0] = from_float<T>(r.even);
    k[1] = from_float<T>(r.odd);
    if (p.k_f32) {
      p.k_f32[t * kRopeDim + 2 * lane] = r.even;
      p.k_f32[t * kRopeDim + 2 * lane + 1] = r.odd;
    }
  }
}

// ---- cache rows -----------------------------------------------------------------------
// ds_mla_tile_scale on the device. The power-of-two rule: v >= 1e-4 is a positive normal
// float, so it is a power of two iff its mantissa bits are zero, and otherwise the next
// power of two is 2^(its exponent + 1), which is what frexp/ldexp give on the CPU (an
// exponent carry to 255 is +inf, as ldexp overflows to inf).
__device__ __forceinline__ float tile_scale(float amax, TileScaleRule rule) {
  if (rule == TileScaleRule::amax_448) return fmaxf(__fdiv_rn(amax, kFp8Max), FLT_MIN);
  const float v = fmaxf(__fdiv_rn(amax, kFp8Max), 1e-4f);
  if (!isfinite(v)) return v;
  const uint32_t u = float_bits(v);
  if ((u & 0x7fffffu) == 0) return v;
  return bits_float(((u >> 23) + 1) << 23);
}

struct InsertArgs {
  CacheInsertParams p;
  bool kv_vec = false;       // kv 16-byte aligned and kv_stride a multiple of 8
  float k_scale_inv = 1.0f;  // plain fp8: 1 / k_scale, computed on the host in fp32
};

// One warp per token row. Lane l owns kv values [16 l, 16 l + 16) — so the 8 lanes
// 8k..8k+7 hold ds_mla tile k and its amax is a 3-step shuffle — and rope values 2l, 2l+1.
// Stores: fp8 and ds_mla codes one 16-byte store per lane; bf16/fp16 two. Rows start on
// 16-byte boundaries (the launcher checks the cache base and block stride, and every
// entry size is a multiple of 16).
// What row t's insert reads besides its latent values: the slot and the lane's two rope
// values. Loaded first, so that their round trip overlaps the latent's (the norm kernel).
struct InsertSource {
  int64_t slot = -1;
  float r[2] = {0.0f, 0.0f};
};
template <class T>
__device__ __forceinline__ InsertSource insert_source(const InsertArgs& args, int64_t t, int lane) {
  const CacheInsertParams& p = args.p;
  InsertSource src;
  src.slot = p.slots[t];
  if (p.rope_f32) {
    const float* rope = static_cast<const float*>(p.rope) + t * p.rope_stride + 2 * lane;
    src.r[0] = rope[0], src.r[1] = rope[1];
  } else {
    const T* rope = static_cast<const T*>(p.rope) + t * p.rope_stride + 2 * lane;
    src.r[0] = to_float(rope[0]), src.r[1] = to_float(rope[1]);
  }
  return src;
}

// Row t's insert once its 512 latent values are in registers (lane l holds [16 l, 16 l + 16)):
// the slot checks, the codes.
template <class T>
__device__ __forceinline__ void insert_row(const InsertArgs& args, const InsertSource& src,
                                           const float (&v)[16], int lane) {
  const CacheInsertParams& p = args.p;
  const int64_t slot = src.slot;
  if (slot < 0) return;
  if (slot >= p.cache.num_slots()) {
    if (lane == 0) raise_error(p.error_flag, kErrBadSlot);
    return;
  }
  const float (&r)[2] = src.r;
  auto* dst = reinterpret_cast<uint8_t*>(p.cache.row(slot));
  switch (p.cache.format) {
    case CacheFormat::bf16:
    case CacheFormat::fp16: {
      const bool bf = p.cache.format == CacheFormat::bf16;
      auto code = [bf](float x) { return bf ? float_to_bf16(x) : float_to_fp16(x); };
      uint32_t w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = pack2(code(v[2 * k]), code(v[2 * k + 1]));
      auto* kv_dst = reinterpret_cast<uint4*>(dst + lane * 32);
      kv_dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
      kv_dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
      *reinterpret_cast<uint32_t*>(dst + 2 * kKvLoraRank + 4 * lane) =
          pack2(code(r[0]), code(r[1]));
      break;
    }
    case CacheFormat::fp8: {
      const float inv = args.k_scale_inv;
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] =
            pack4(e4m3_scaled_clamped(v[4 * k], inv), e4m3_scaled_clamped(v[4 * k + 1], inv),
                  e4m3_scaled_clamped(v[4 * k + 2], inv), e4m3_scaled_clamped(v[4 * k + 3], inv));
      store16_bytes(dst + lane * 16, true, w);
      *reinterpret_cast<uint16_t*>(dst + kKvLoraRank + 2 * lane) =
          uint16_t(e4m3_scaled_clamped(r[0], inv) | e4m3_scaled_clamped(r[1], inv) << 8);
      break;
    }
    case CacheFormat::fp8_ds_mla: {
      float amax = 0.0f;  // fmaxf skips NaN, as std::fmax on the CPU
#pragma unroll
      for (int k = 0; k < 16; ++k) amax = fmaxf(amax, fabsf(v[k]));
#pragma unroll
      for (int off = 4; off > 0; off /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
      const float scale = tile_scale(amax, p.cache.tile_rule);
      uint8_t c[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) c[k] = float_to_e4m3_sat(__fdiv_rn(v[k], scale));
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) w[k] = pack4(c[4 * k], c[4 * k + 1], c[4 * k + 2], c[4 * k + 3]);
      store16_bytes(dst + lane * 16, true, w);
      if (lane % 8 == 0)
        *reinterpret_cast<float*>(dst + kDsMlaScaleOffset + 4 * (lane / 8)) = scale;
      *reinterpret_cast<uint32_t*>(dst + kDsMlaRopeOffset + 4 * lane) =
          pack2(float_to_bf16(r[0]), float_to_bf16(r[1]));
      break;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) cache_insert_kernel(InsertArgs args) {
  const CacheInsertParams& p = args.p;
  const int64_t t = warp_item();
  if (t >= p.rows) return;
  const int lane = lane_id();
  const InsertSource src = insert_source<T>(args, t, lane);
  if (src.slot < 0) return;
  float v[16];
  const T* kv = static_cast<const T*>(p.kv) + t * p.kv_stride + lane * 16;
  float lo[8], hi[8];
  load8(kv, args.kv_vec, lo);
  load8(kv + 8, args.kv_vec, hi);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = lo[k], v[8 + k] = hi[k];
  insert_row<T>(args, src, v, lane);
}

// ---- RMSNorm (and the fused cache insert) --------------------------------------------
// Rows of at most kNormChunks x 256 values on the vector path stay in registers: lane l owns
// the `chunks` 8-value chunks [l * chunks, (l + 1) * chunks), loads them all at once (one
// memory round trip instead of one per 256 columns and pass), then the weights (L2 hits),
// and writes them back scaled; 116 registers, two blocks per SM. Longer or unaligned rows take two
// passes over the row (the second hits L1/L2): lane l owns columns {l*8 + 256k} (vec) or {l + 32k}.
// Either way a lane reads and writes only its own columns, so the in-place update is race-free.
constexpr int kNormChunks = 8;

struct NormArgs {
  void* x = nullptr;  // [rows, stride] (act), normalised in place over the first n columns
  int64_t stride = 0;
  int n = 0;
  const void* w = nullptr;  // [n] (act)
  bool vec = false;         // x, w 16-byte aligned, stride and n multiples of 8
  int chunks = 0;           // > 0: the register path, this many chunks per lane
};

// Grid (row blocks, 2 segments); one warp per row. The sum of x^2 is summed per lane then
// across the warp, not left to right as on the CPU: the only place these kernels differ
// from the CPU arithmetic (a few fp32 ulps in 1/rms). With `insert`, segment a is the
// 512-wide latent on the register path (2 chunks: lane l holds [16 l, 16 l + 16), the
// layout of insert_row) and its rounded, normalised values also go into the cache.
template <class T>
__global__ void __launch_bounds__(kThreads, 2)  // <= 128 registers: 16 rows per SM in flight
    rms_norm_kernel(NormArgs a, NormArgs b, int64_t rows, float eps, InsertArgs ins, bool insert) {
  const NormArgs s = blockIdx.y == 0 ? a : b;
  const int64_t row = warp_item();
  if (s.n == 0 || row >= rows) return;
  const int lane = lane_id();
  T* x = static_cast<T*>(s.x) + row * s.stride;
  const T* w = static_cast<const T*>(s.w);
  // 1 / sqrt(mean + eps) with IEEE divide and sqrt, as the CPU computes it.
  auto inv_rms = [&](float ss) {
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) ss += __shfl_xor_sync(kFullMask, ss, off);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, float(s.n)), eps)));
  };
  if (s.chunks > 0) {
    float v[kNormChunks][8];
    const int c0 = lane * s.chunks;
    auto mine = [&](int k) { return k < s.chunks && (c0 + k) * 8 < s.n; };
    // With the insert (the 512-wide latent, 2 chunks), its slot and rope values and the
    // weights load with the row: one round trip before the stores instead of three.
    const bool fused_insert = insert && blockIdx.y == 0;
    InsertSource src;
    if (fused_insert) src = insert_source<T>(ins, row, lane);
    float g_early[2][8];
    const bool early = s.chunks <= 2;
#pragma unroll
    for (int k = 0; k < kNormChunks; ++k) {
      if (mine(k)) load8(x + (c0 + k) * 8, true, v[k]);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
      if (early && mine(k)) load8(w + (c0 + k) * 8, true, g_early[k]);
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kNormChunks; ++k) {
      if (mine(k)) {
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += v[k][e] * v[k][e];
      }
    }
    const float inv = inv_rms(ss);
#pragma unroll
    for (int k = 0; k < kNormChunks; ++k) {
      if (mine(k)) {
        // Longer rows take the weights (L2 hits after the first rows) in this second pass.
        float g[8];
        if (early && k < 2) {
#pragma unroll
          for (int e = 0; e < 8; ++e) g[e] = g_early[k < 2 ? k : 0][e];
        } else {
          load8(w + (c0 + k) * 8, true, g);
        }
#pragma unroll  // the act value itself: the cache insert encodes what the row now holds
        for (int e = 0; e < 8; ++e)
          v[k][e] = to_float(from_float<T>(__fmul_rn(__fmul_rn(v[k][e], inv), g[e])));
        store8(x + (c0 + k) * 8, true, v[k]);
      }
    }
    if (fused_insert) {
      float r[16];
#pragma unroll
      for (int e = 0; e < 8; ++e) r[e] = v[0][e], r[8 + e] = v[1][e];
      insert_row<T>(ins, src, r, lane);
    }
    return;
  }
  float ss = 0.0f;
  if (s.vec) {
    for (int i = lane * 8; i < s.n; i += kWarp * 8) {
      float v[8];
      load8(x + i, true, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
    }
  } else {
    for (int i = lane; i < s.n; i += kWarp) {
      const float v = to_float(x[i]);
      ss += v * v;
    }
  }
  const float inv = inv_rms(ss);
  if (s.vec) {
    for (int i = lane * 8; i < s.n; i += kWarp * 8) {
      float v[8], g[8];
      load8(x + i, true, v);
      load8(w + i, true, g);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = __fmul_rn(__fmul_rn(v[k], inv), g[k]);
      store8(x + i, true, v);
    }
  } else {
    for (int i = lane; i < s.n; i += kWarp)
      x[i] = from_float<T>(__fmul_rn(__fmul_rn(to_float(x[i]), inv), to_float(w[i])));
  }
}

// ---- decode query ---------------------------------------------------------------------
// One warp per (row, head) of mqa. Lane l owns latent columns [16 l, 16 l + 16) (only read,
// for q8) and rope columns 512 + 2l, 2l + 1.
struct QueryArgs {
  DecodeQueryParams p;
  bool mqa_vec = false;  // mqa 16-byte aligned
  bool q8_vec = false;   // q8 16-byte aligned
  float q_scale_inv = 1.0f;
};

template <class T>
__global__ void __launch_bounds__(kThreads) decode_query_kernel(QueryArgs args) {
  const DecodeQueryParams& p = args.p;
  const int64_t item = warp_item();
  if (item >= p.rows * p.heads) return;
  const int lane = lane_id();
  const int64_t t = item / p.heads;
  const int h = int(item % p.heads);
  T* row = static_cast<T*>(p.mqa) + item * kLatentDim;
  float r[2];  // the rope values as the fp8 query sees them (unrounded when from fp32)
  if (p.q_rope_f32) {
    const float* src = p.q_rope_f32 + item * kRopeDim + 2 * lane;
    r[0] = src[0], r[1] = src[1];
  } else {
    const T* src =
        static_cast<const T*>(p.q) + t * p.q_stride + int64_t(h) * kQkHeadDim + kNopeDim + 2 * lane;
    r[0] = to_float(src[0]), r[1] = to_float(src[1]);
  }
  row[kKvLoraRank + 2 * lane] = from_float<T>(r[0]);
  row[kKvLoraRank + 2 * lane + 1] = from_float<T>(r[1]);
  if (p.q8 == nullptr) return;
  const float inv = args.q_scale_inv;
  float lo[8], hi[8];
  load8(row + lane * 16, args.mqa_vec, lo);
  load8(row + lane * 16 + 8, args.mqa_vec, hi);
  uint32_t w[4];
  w[0] = pack4(e4m3_scaled_clamped(lo[0], inv), e4m3_scaled_clamped(lo[1], inv),
               e4m3_scaled_clamped(lo[2], inv), e4m3_scaled_clamped(lo[3], inv));
  w[1] = pack4(e4m3_scaled_clamped(lo[4], inv), e4m3_scaled_clamped(lo[5], inv),
               e4m3_scaled_clamped(lo[6], inv), e4m3_scaled_clamped(lo[7], inv));
  w[2] = pack4(e4m3_scaled_clamped(hi[0], inv), e4m3_scaled_clamped(hi[1], inv),
               e4m3_scaled_clamped(hi[2], inv), e4m3_scaled_clamped(hi[3], inv));
  w[3] = pack4(e4m3_scaled_clamped(hi[4], inv), e4m3_scaled_clamped(hi[5], inv),
               e4m3_scaled_clamped(hi[6], inv), e4m3_scaled_clamped(hi[7], inv));
  uint8_t* q8 = p.q8 + item * kLatentDim;
  store16_bytes(q8 + lane * 16, args.q8_vec, w);
  q8[kKvLoraRank + 2 * lane] = e4m3_scaled_clamped(r[0], inv);
  q8[kKvLoraRank + 2 * lane + 1] = e4m3_scaled_clamped(r[1], inv);
}

// ---- context gather ---------------------------------------------------------------------
// A cache row is read as 72 chunks of 8 values (bf16/fp16: 16 bytes; fp8 and the ds_mla
// codes: 8 bytes; the ds_mla rope: 16 bytes); chunk c lands at out columns [8c, 8c + 8).
constexpr int kChunks = kLatentDim / 8;

__device__ __forceinline__ void decode_chunk(const CacheRef& cache, const uint8_t* src, int c,
                                             float (&v)[8]) {
  switch (cache.format) {
    case CacheFormat::bf16:
    case CacheFormat::fp16: {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + c * 16);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      const bool bf = cache.format == CacheFormat::bf16;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint16_t code = uint16_t(w[k / 2] >> (16 * (k % 2)));
        v[k] = bf ? bf16_to_float(code) : fp16_to_float(code);
      }
      return;
    }
    case CacheFormat::fp8: {
      const uint2 raw = *reinterpret_cast<const uint2*>(src + c * 8);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        v[k] =
            __fmul_rn(e4m3_value(uint8_t((k < 4 ? raw.x : raw.y) >> (8 * (k % 4)))), cache.k_scale);
      return;
    }
    case CacheFormat::fp8_ds_mla: {
      if (c < kKvLoraRank / 8) {
        const uint2 raw = *reinterpret_cast<const uint2*>(src + c * 8);
        const float scale =
            *reinterpret_cast<const float*>(src + kDsMlaScaleOffset + 4 * (c * 8 / kDsMlaTile));
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint8_t code = uint8_t((k < 4 ? raw.x : raw.y) >> (8 * (k % 4)));
          v[k] = round_bf16(__fmul_rn(e4m3_value(code), scale));
        }
      } else {
        const uint4 raw =
            *reinterpret_cast<const uint4*>(src + kDsMlaRopeOffset + (c - kKvLoraRank / 8) * 16);
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = bf16_to_float(uint16_t(w[k / 2] >> (16 * (k % 2))));
      }
      return;
    }
  }
}

// One warp per output row; lane l decodes chunks l, l + 32, l + 64 (< 72). The row's
// request is found by binary search over cu_len (the largest j with cu_len[j] <= r, so
// empty requests are skipped).
template <class T>
__global__ void __launch_bounds__(kThreads) gather_context_kernel(GatherParams p, bool out_vec) {
  const int64_t r = warp_item();
  if (r >= p.total_rows) return;
  const int lane = lane_id();
  int lo = 0, hi = p.num_requests;  // invariant: cu_len[lo] <= r (cu_len[0] = 0)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.cu_len[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  T* out = static_cast<T*>(p.out) + r * kLatentDim;
  const uint8_t* src = nullptr;
  if (lo < p.num_requests) {  // else r is past cu_len[num_requests]: a zero row
    const int64_t pos = p.start + (r - p.cu_len[lo]);
    const int64_t req = int64_t(p.first_request) + lo;
    const int64_t block = pos / p.cache.block_size;
    const int64_t id = block < p.batch.max_blocks
                           ? int64_t(p.batch.block_tables[req * p.batch.max_blocks + block])
                           : -1;
    if (id >= 0 && id < p.cache.num_blocks) {
      src = reinterpret_cast<const uint8_t*>(
          p.cache.row(id * p.cache.block_size + pos % p.cache.block_size));
    } else if (lane == 0) {
      raise_error(p.error_flag, kErrBadBlockId);
    }
  }
  for (int c = lane; c < kChunks; c += kWarp) {
    float v[8] = {};
    if (src) decode_chunk(p.cache, src, c, v);
    store8(out + c * 8, out_vec, v);
  }
}

// ---- gate ---------------------------------------------------------------------------------
// Grid-stride over groups of 8 values (vec: 16-byte accesses) or single values.
template <class T>
__global__ void __launch_bounds__(kThreads)
    gate_kernel(T* attn, const T* g, int64_t g_stride, int64_t rows, int64_t width, bool vec,
                const int32_t* num_tokens) {
  const int group = vec ? 8 : 1;
  const int64_t per_row = width / group;
  const int64_t n = rows * per_row;
  const int64_t real = num_tokens ? int64_t(*num_tokens) : rows;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / per_row, col = (i % per_row) * group;
    T* a = attn + t * width + col;
    const T* gp = g + t * g_stride + col;
    if (t >= real) {
      if (vec)
        *reinterpret_cast<uint4*>(a) = make_uint4(0, 0, 0, 0);
      else
        *a = from_float<T>(0.0f);
    } else if (vec) {
      float av[8], gv[8];
      load8(a, true, av);
      load8(gp, true, gv);
#pragma unroll
      for (int k = 0; k < 8; ++k) av[k] = gated(av[k], gv[k]);
      store8(a, true, av);
    } else {
      *a = from_float<T>(gated(to_float(*a), to_float(*gp)));
    }
  }
}

// ---- merge --------------------------------------------------------------------------------
// One warp per (row, head). Every lane reads both LSEs and owns columns {8l + 256k} (vec) or
// {l + 32k}; out may alias an input because each element is read and written by one lane.
// out_lse is written by lane 0 after a __syncwarp, so an aliased LSE is read by all lanes
// first.
template <class T>
__global__ void __launch_bounds__(kThreads) merge_kernel(MergeParams p, bool vec) {
  const int64_t i = warp_item();
  if (i >= p.rows * p.heads) return;
  const int lane = lane_id();
  const int64_t t = i / p.heads;
  const T* so = static_cast<const T*>(p.suffix) + i * p.dim;
  const T* po = static_cast<const T*>(p.prefix) + i * p.dim;
  T* o = static_cast<T*>(p.out) + i * p.dim;
  const float s_raw = p.suffix_lse[i];
  // The three cases: copy the suffix, copy the prefix (both empty), or the weighted sum.
  const T* copy_from = nullptr;
  float out_lse = s_raw, pw = 0.0f, sw = 0.0f;
  if (t >= p.rows_with_prefix) {
    copy_from = so;
  } else {
    float p_lse = p.prefix_lse[i], s_lse = s_raw;
    if (isinf(p_lse)) p_lse = -INFINITY;  // +-inf both mean "no keys"
    if (isinf(s_lse)) s_lse = -INFINITY;
    const float mx = fmaxf(p_lse, s_lse);
    if (mx == -INFINITY) {
      copy_from = po;
      out_lse = -INFINITY;
    } else {
      const float pe = expf(__fsub_rn(p_lse, mx)), se = expf(__fsub_rn(s_lse, mx));
      const float sum = __fadd_rn(pe, se);
      pw = __fdiv_rn(pe, sum);
      sw = __fdiv_rn(se, sum);
      out_lse = __fadd_rn(logf(sum), mx);
    }
  }
  if (copy_from) {
    if (copy_from != o) {
      if (vec) {
        for (int d = lane * 8; d < p.dim; d += kWarp * 8)
          *reinterpret_cast<uint4*>(o + d) = *reinterpret_cast<const uint4*>(copy_from + d);
      } else {
        for (int d = lane; d < p.dim; d += kWarp) o[d] = copy_from[d];
      }
    }
  } else if (vec) {
    for (int d = lane * 8; d < p.dim; d += kWarp * 8) {
      float a[8], b[8];
      load8(po + d, true, a);
      load8(so + d, true, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] = __fadd_rn(__fmul_rn(a[k], pw), __fmul_rn(b[k], sw));
      store8(o + d, true, a);
    }
  } else {
    for (int d = lane; d < p.dim; d += kWarp)
      o[d] =
          from_float<T>(__fadd_rn(__fmul_rn(to_float(po[d]), pw), __fmul_rn(to_float(so[d]), sw)));
  }
  if (p.out_lse) {
    __syncwarp();
    if (lane == 0) p.out_lse[i] = out_lse;
  }
}

// ---- small helpers ----------------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(kThreads)
    e4m3_roundtrip_kernel(T* x, int64_t rows, int64_t width, int64_t stride, bool vec) {
  const int group = vec ? 8 : 1;
  const int64_t per_row = width / group;
  const int64_t n = rows * per_row;
  auto cast = [](float v) { return e4m3_value(e4m3_scaled_clamped(v, 1.0f)); };
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    T* p = x + (i / per_row) * stride + (i % per_row) * group;
    if (vec) {
      float v[8];
      load8(p, true, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = cast(v[k]);
      store8(p, true, v);
    } else {
      *p = from_float<T>(cast(to_float(*p)));
    }
  }
}

// Grid-stride over the whole buffer's 16-byte words (vec) or bytes; only those at or past
// row *num_tokens are written.
__global__ void __launch_bounds__(kThreads)
    zero_padding_kernel(uint8_t* x, int64_t num_rows, int64_t row_bytes, const int32_t* num_tokens,
                        bool vec) {
  const int64_t first = min(max(int64_t(*num_tokens), int64_t(0)), num_rows);
  const int64_t begin = first * row_bytes, end = num_rows * row_bytes;
  const int unit = vec ? 16 : 1;
  for (int64_t i = begin / unit + int64_t(blockIdx.x) * kThreads + threadIdx.x; i < end / unit;
       i += int64_t(gridDim.x) * kThreads) {
    if (vec)
      reinterpret_cast<uint4*>(x)[i] = make_uint4(0, 0, 0, 0);
    else
      x[i] = 0;
  }
}

// The cache pointer rules every cache kernel relies on (16-byte aligned rows).
void check_cache(const CacheRef& c) {
  KMLA_CHECK(c.base != nullptr, "the device cache has no memory");
  KMLA_CHECK(c.block_size >= 1 && c.num_blocks >= 1, "device cache geometry: block size ",
             c.block_size, ", ", c.num_blocks, " blocks");
  KMLA_CHECK(aligned16(c.base) && c.block_stride % 16 == 0,
             "the CUDA kernels need a 16-byte aligned cache base and block stride, got stride ",
             c.block_stride);
}

InsertArgs insert_args(const CacheInsertParams& p) {
  check_cache(p.cache);
  KMLA_CHECK(p.kv && p.rope && p.slots, "cache_insert has a null kv, rope or slots pointer");
  InsertArgs args;
  args.p = p;
  args.kv_vec = aligned16(p.kv) && p.kv_stride % 8 == 0;
  args.k_scale_inv = 1.0f / p.cache.k_scale;  // as RowCodec::encode: the fp32 reciprocal
  return args;
}

}  // namespace

void rms_norm(const NormSegment& a, const NormSegment& b, int64_t rows, float eps, DType act,
              cudaStream_t stream, const CacheInsertParams* insert) {
  KMLA_CHECK(rows >= 0, "rms_norm rows must be >= 0, got ", rows);
  if (insert) {
    KMLA_CHECK(a.n == kKvLoraRank && insert->kv == a.x && insert->kv_stride == a.stride &&
                   insert->rows == rows && insert->act == act,
               "rms_norm's cache insert takes segment a's rows: a 512-wide latent (n = ", a.n,
               ") at the insert's kv, stride and row count");
  }
  if (rows == 0 || (a.n == 0 && b.n == 0)) return;
  auto args = [](const NormSegment& s, const char* name) {
    KMLA_CHECK(s.n >= 0, "rms_norm segment ", name, " has n = ", s.n);
    NormArgs r;
    if (s.n == 0) return r;
    KMLA_CHECK(s.x && s.weight, "rms_norm segment ", name, " has a null pointer");
    KMLA_CHECK(s.stride >= s.n, "rms_norm segment ", name, " stride ", s.stride, " < n ", s.n);
    r.x = s.x;
    r.stride = s.stride;
    r.n = s.n;
    r.w = s.weight;
    r.vec = aligned16(s.x) && aligned16(s.weight) && s.stride % 8 == 0 && s.n % 8 == 0;
    if (r.vec && s.n <= kNormChunks * kWarp * 8) r.chunks = int(ceil_div(s.n, kWarp * 8));
    return r;
  };
  const NormArgs na = args(a, "a"), nb = args(b, "b");
  // The insert rides along when segment a is on the register path with 2 chunks per lane.
  const bool fused = insert && na.chunks == 2;
  const InsertArgs ins = fused ? insert_args(*insert) : InsertArgs{};
  dispatch_act(act, [&]<class T>() {
    rms_norm_kernel<T>
        <<<dim3(warp_blocks(rows), 2), kThreads, 0, stream>>>(na, nb, rows, eps, ins, fused);
    KMLA_LAUNCH_CHECK();
  });
  if (insert && !fused) cache_insert(*insert, stream);
}

void rope(const RopeParams& p, cudaStream_t stream) {
  KMLA_CHECK(p.rows >= 0 && p.heads >= 0, "rope rows ", p.rows, " heads ", p.heads);
  const int q_items = p.q ? p.heads : 0;
  const int items = q_items + (p.k_pe ? 1 : 0);
  if (p.rows == 0 || items == 0) return;
  KMLA_CHECK(p.table && p.table_rows >= 1 && p.positions, "rope needs a table and positions");
  KMLA_CHECK(!p.k_pe || p.k_act, "rope: k_pe given without k_act");
  KMLA_CHECK(p.q_f32_rows <= 0 || (p.q && p.q_f32), "rope: q_f32_rows ", p.q_f32_rows,
             " without q and q_f32");
  dispatch_act(p.act, [&]<class T>() {
    rope_kernel<T><<<warp_blocks(p.rows * items), kThreads, 0, stream>>>(p, q_items, items);
    KMLA_LAUNCH_CHECK();
  });
}

void cache_insert(const CacheInsertParams& p, cudaStream_t stream) {
  KMLA_CHECK(p.rows >= 0, "cache_insert rows must be >= 0, got ", p.rows);
  if (p.rows == 0) return;
  const InsertArgs args = insert_args(p);
  dispatch_act(p.act, [&]<class T>() {
    cache_insert_kernel<T><<<warp_blocks(p.rows), kThreads, 0, stream>>>(args);
    KMLA_LAUNCH_CHECK();
  });
}

void decode_query(const DecodeQueryParams& p, cudaStream_t stream) {
  KMLA_CHECK(p.rows >= 0 && p.heads >= 0, "decode_query rows ", p.rows, " heads ", p.heads);
  if (p.rows == 0 || p.heads == 0) return;
  KMLA_CHECK(p.mqa && (p.q_rope_f32 || p.q), "decode_query needs mqa and a rope source");
  QueryArgs args;
  args.p = p;
  args.mqa_vec = aligned16(p.mqa);
  args.q8_vec = aligned16(p.q8);
  args.q_scale_inv = 1.0f / p.q_scale;  // the CPU's precomputed reciprocal
  dispatch_act(p.act, [&]<class T>() {
    decode_query_kernel<T><<<warp_blocks(p.rows * p.heads), kThreads, 0, stream>>>(args);
    KMLA_LAUNCH_CHECK();
  });
}

void gather_context(const GatherParams& p, cudaStream_t stream) {
  KMLA_CHECK(p.total_rows >= 0 && p.num_requests >= 0 && p.start >= 0, "gather_context rows ",
             p.total_rows, " requests ", p.num_requests, " start ", p.start);
  if (p.total_rows == 0) return;
  check_cache(p.cache);
  KMLA_CHECK(p.num_requests >= 1 && p.cu_len && p.out && p.batch.block_tables,
             "gather_context needs requests, cu_len, out and block tables");
  dispatch_act(p.act, [&]<class T>() {
    gather_context_kernel<T>
        <<<warp_blocks(p.total_rows), kThreads, 0, stream>>>(p, aligned16(p.out));
    KMLA_LAUNCH_CHECK();
  });
}

void gate(void* attn, const void* g, int64_t g_stride, int64_t rows, int64_t width, DType act,
          cudaStream_t stream, const int32_t* num_tokens) {
  KMLA_CHECK(rows >= 0 && width >= 0 && g_stride >= width, "gate rows ", rows, " width ", width,
             " g_stride ", g_stride);
  if (rows == 0 || width == 0) return;
  const bool vec = aligned16(attn) && aligned16(g) && width % 8 == 0 && g_stride % 8 == 0;
  const int64_t units = rows * width / (vec ? 8 : 1);
  dispatch_act(act, [&]<class T>() {
    gate_kernel<T><<<stride_blocks(units), kThreads, 0, stream>>>(
        static_cast<T*>(attn), static_cast<const T*>(g), g_stride, rows, width, vec, num_tokens);
    KMLA_LAUNCH_CHECK();
  });
}

void merge_states(const MergeParams& p, cudaStream_t stream) {
  KMLA_CHECK(p.rows >= 0 && p.heads >= 0 && p.dim >= 0, "merge rows ", p.rows, " heads ", p.heads,
             " dim ", p.dim);
  KMLA_CHECK(p.rows_with_prefix >= 0 && p.rows_with_prefix <= p.rows, "rows_with_prefix ",
             p.rows_with_prefix, " is outside [0, ", p.rows, "]");
  if (p.rows == 0 || p.heads == 0) return;
  KMLA_CHECK(p.suffix && p.suffix_lse && p.out, "merge needs suffix, suffix_lse and out");
  KMLA_CHECK(p.rows_with_prefix == 0 || (p.prefix && p.prefix_lse), "merge needs the prefix");
  const bool vec = aligned16(p.out) && aligned16(p.suffix) &&
                   (p.rows_with_prefix == 0 || aligned16(p.prefix)) && p.dim % 8 == 0;
  dispatch_act(p.act, [&]<class T>() {
    merge_kernel<T><<<warp_blocks(p.rows * p.heads), kThreads, 0, stream>>>(p, vec);
    KMLA_LAUNCH_CHECK();
  });
}

void e4m3_roundtrip(void* x, int64_t rows, int64_t width, int64_t stride, DType act,
                    cudaStream_t stream) {
  KMLA_CHECK(rows >= 0 && width >= 0 && stride >= width, "e4m3_roundtrip rows ", rows, " width ",
             width, " stride ", stride);
  if (rows == 0 || width == 0) return;
  const bool vec = aligned16(x) && width % 8 == 0 && stride % 8 == 0;
  const int64_t units = rows * width / (vec ? 8 : 1);
  dispatch_act(act, [&]<class T>() {
    e4m3_roundtrip_kernel<T><<<stride_blocks(units), kThreads, 0, stream>>>(
        static_cast<T*>(x), rows, width, stride, vec);
    KMLA_LAUNCH_CHECK();
  });
}

void zero_padding_rows(void* x, int64_t num_rows, int64_t row_bytes, const int32_t* num_tokens,
                       cudaStream_t stream) {
  KMLA_CHECK(num_rows >= 0 && row_bytes >= 0, "zero_padding_rows rows ", num_rows, " bytes ",
             row_bytes);
  if (num_rows == 0 || row_bytes == 0) return;
  KMLA_CHECK(x && num_tokens, "zero_padding_rows needs a buffer and num_tokens");
  const bool vec = aligned16(x) && row_bytes % 16 == 0;
  const int64_t units = num_rows * row_bytes / (vec ? 16 : 1);
  zero_padding_kernel<<<stride_blocks(units), kThreads, 0, stream>>>(
      static_cast<uint8_t*>(x), num_rows, row_bytes, num_tokens, vec);
  KMLA_LAUNCH_CHECK();
}

}  // namespace kmla::cuda
