// `kmla bench`: times the decode and prefill attention kernels and the whole layer on the
// current GPU. Every case allocates and random-fills its own buffers, times `iters` runs with
// CUDA events (each after an L2 flush, outside the timed region) and reports the median
// against the device-to-device copy bandwidth measured first, in this process.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench.hpp"
#include "bench/cases.hpp"
#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/gemm.cuh"
#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/cuda.hpp"
#include "kmla/weights.hpp"

namespace kmla::bench {
namespace {

using cuda::DeviceBuffer;
using nlohmann::json;

// ---- random device data -------------------------------------------------------------------

enum class Fill : int {
  bf16,         // bf16 values uniform in [-amp, amp]
  e4m3,         // e4m3 codes of values uniform in [-amp, amp] (saturating: never NaN)
  ds_mla_rows,  // whole 656-byte fp8_ds_mla rows: codes, power-of-two tile scales, bf16 rope
};

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform value in [-1, 1) for element i of stream `seed`.
__device__ __forceinline__ float uniform_pm1(uint64_t seed, uint64_t i) {
  const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + i);
  return float(h >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__device__ __forceinline__ uint32_t bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ __forceinline__ uint32_t e4m3_bits(float x) {
  return uint32_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// One thread per 32-bit word, grid-stride. A ds_mla row is 164 words: 128 of codes (4 each),
// 4 fp32 tile scales, 32 of rope (2 bf16 each).
__global__ void fill_random_words(uint32_t* words, int64_t num_words, Fill kind, uint64_t seed,
                                  float amp) {
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < num_words;
       w += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t e = uint64_t(w) * 4;  // an element index with room for 4 per word
    uint32_t bits = 0;
    Fill k = kind;
    if (kind == Fill::ds_mla_rows) {
      const int in_row = int(w % 164);
      if (in_row >= 128 && in_row < 132) {
        // A valid power-of-two tile scale, 2^-7 .. 2^-10: decoded values stay O(1).
        bits = __float_as_uint(exp2f(-7.0f - float(mix64(seed + e) & 3)));
        words[w] = bits;
        continue;
      }
      k = in_row < 128 ? Fill::e4m3 : Fill::bf16;
      amp = in_row < 128 ? 448.0f : 1.0f;
    }
    if (k == Fill::bf16) {
      bits = bf16_bits(amp * uniform_pm1(seed, e)) | (bf16_bits(amp * uniform_pm1(seed, e + 1)) << 16);
    } else {
      for (int j = 0; j < 4; ++j) bits |= e4m3_bits(amp * uniform_pm1(seed, e + j)) << (8 * j);
    }
    words[w] = bits;
  }
}

void fill_random(void* ptr, size_t bytes, Fill kind, uint64_t seed, float amp, cudaStream_t s) {
  KMLA_CHECK(bytes % 4 == 0, "random fill of ", bytes, " bytes: not a whole number of words");
  KMLA_CHECK(kind != Fill::ds_mla_rows || bytes % 656 == 0, "fp8_ds_mla fill of ", bytes,
             " bytes: not whole rows");
  const int64_t words = int64_t(bytes / 4);
  if (words == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(cuda::ceil_div(words, threads), 16384);
  fill_random_words<<<unsigned(blocks), threads, 0, s>>>(static_cast<uint32_t*>(ptr), words, kind,
                                                         seed, amp);
  KMLA_LAUNCH_CHECK();
}

// Cache rows of `format`, random and valid (never zeros, never NaN).
void fill_cache(void* base, int64_t rows, CacheFormat format, uint64_t seed, cudaStream_t s) {
  const size_t bytes = size_t(rows) * cache_entry_bytes(format);
  switch (format) {
    case CacheFormat::bf16: fill_random(base, bytes, Fill::bf16, seed, 1.0f, s); break;
    case CacheFormat::fp8: fill_random(base, bytes, Fill::e4m3, seed, 2.0f, s); break;
    case CacheFormat::fp8_ds_mla: fill_random(base, bytes, Fill::ds_mla_rows, seed, 0.0f, s); break;
    default: KMLA_CHECK(false, "bench caches are bf16, fp8 or fp8_ds_mla, got ", cache_format_name(format));
  }
}

// ---- small RAII helpers -------------------------------------------------------------------

DeviceBuffer device_alloc(size_t bytes) { return DeviceBuffer(std::max<size_t>(bytes, 256)); }

template <class T>
DeviceBuffer to_device(const std::vector<T>& v, cudaStream_t s) {
  DeviceBuffer b = device_alloc(v.size() * sizeof(T));
  if (!v.empty()) {
    KMLA_CUDA_CHECK(cudaMemcpyAsync(b.data(), v.data(), v.size() * sizeof(T),
                                    cudaMemcpyHostToDevice, s));
    KMLA_CUDA_CHECK(cudaStreamSynchronize(s));  // v may die right after
  }
  return b;
}

struct StreamHandle {
  cudaStream_t s = nullptr;
  StreamHandle() { KMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~StreamHandle() { cudaStreamDestroy(s); }
  StreamHandle(const StreamHandle&) = delete;
  StreamHandle& operator=(const StreamHandle&) = delete;
};

struct GraphHandle {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  GraphHandle() = default;
  ~GraphHandle() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
  GraphHandle(const GraphHandle&) = delete;
  GraphHandle& operator=(const GraphHandle&) = delete;
};

// Read-only stream: each thread keeps 8 independent 16-byte loads in flight (grid-stride,
// read-only path), folds them into one word and stores it only if it equals a value the fill
// never produces, so the loads cannot be dropped and nothing is written. In a standalone probe
// on two H200s this form read 4.48-4.60 TB/s, as fast as bulk (TMA) copies into shared memory
// (4.55-4.65); streaming loads (ld.global.cs) reached 4.45 and the L2 256-byte hint 4.26.
__global__ void read_stream_kernel(const uint4* __restrict__ src, size_t n, uint4* sink) {
  constexpr int kUnroll = 8;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = i + u * stride < n ? __ldg(src + i + u * stride) : uint4{};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x5a5a5a5au) sink[0] = uint4{acc, acc, acc, acc};
}

// Times `body` (work enqueued on the stream) with CUDA events. Each timed run is preceded by
// an L2 flush through a buffer twice the L2 size, so no run finds the previous one's data in
// L2; the flush is stream-ordered before the start event and so not timed. By default the
// flush reads the buffer, which leaves L2 full of clean lines, as a serving step's weight
// reads do. The other form (write_flush) memsets it, which leaves a whole L2 of dirty lines
// that the timed kernel then writes back to DRAM while it reads: on the H200 that cost the
// memory-bound decode shapes 6-12 us each ((1, 12, 64k) 38.2 against 31.4 us, (128, 12, 8k)
// 322 against 310), an artefact of the flush that no serving step has.
class Timer {
 public:
  Timer(cudaStream_t stream, size_t l2_bytes, int sms, bool write_flush)
      : stream_(stream),
        flush_(device_alloc(std::max<size_t>(2 * l2_bytes, size_t(64) << 20))),
        sms_(sms),
        write_flush_(write_flush) {
    KMLA_CUDA_CHECK(cudaEventCreate(&start_));
    KMLA_CUDA_CHECK(cudaEventCreate(&stop_));
    // Words of 0x01010101: their xor is never read_stream_kernel's sink value.
    KMLA_CUDA_CHECK(cudaMemsetAsync(flush_.data(), 1, flush_.bytes(), stream_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  double median_us(const std::function<void()>& body, int warmup, int iters) {
    // Let the device settle first: right after cudaFree of large buffers (the previous case's)
    // and new allocations, reads ran up to 12 % slower for ~10-20 ms on the H200 (a read probe
    // after freeing 4 GiB: median 4.31-4.37 TB/s in its first 12 runs, 4.48 after), which made
    // every case's numbers depend on what the one before it freed.
    KMLA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::this_thread::sleep_for(std::chrono::milliseconds(kSettleMs));
    for (int i = 0; i < warmup; ++i) body();
    std::vector<double> us;
    for (int i = 0; i < std::max(iters, 1); ++i) {
      if (write_flush_) {
        KMLA_CUDA_CHECK(cudaMemsetAsync(flush_.data(), 1, flush_.bytes(), stream_));
      } else {
        read_stream_kernel<<<8 * sms_, 256, 0, stream_>>>(static_cast<const uint4*>(flush_.data()),
                                                          flush_.bytes() / sizeof(uint4),
                                                          static_cast<uint4*>(flush_.data()));
        KMLA_CUDA_CHECK(cudaGetLastError());
      }
      KMLA_CUDA_CHECK(cudaEventRecord(start_, stream_));
      body();
      KMLA_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      KMLA_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      KMLA_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      us.push_back(double(ms) * 1e3);
    }
    std::sort(us.begin(), us.end());
    const size_t n = us.size();
    return n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  }

 private:
  static constexpr int kSettleMs = 100;
  cudaStream_t stream_;
  DeviceBuffer flush_;
  int sms_;
  bool write_flush_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Device-to-device copy bandwidth in GB/s: a 2 GiB cudaMemcpyAsync, bytes read + written,
// median of 10 runs.
double measure_copy_gb_s(Timer& timer, cudaStream_t s) {
  const size_t bytes = size_t(2) << 30;
  DeviceBuffer src = device_alloc(bytes), dst = device_alloc(bytes);
  KMLA_CUDA_CHECK(cudaMemsetAsync(src.data(), 1, bytes, s));  // map the pages before timing
  KMLA_CUDA_CHECK(cudaMemsetAsync(dst.data(), 2, bytes, s));
  const double us = timer.median_us(
      [&] {
        KMLA_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, s));
      },
      2, 10);
  return 2.0 * double(bytes) / (us * 1e-6) / 1e9;
}

// Read-only bandwidth in GB/s: 4 GiB read once per run (no writes), median of 10. The ceiling
// of a kernel that only streams its input (decode), next to the copy bandwidth the report's
// "copy" column divides by.
double measure_read_gb_s(Timer& timer, int sms, cudaStream_t s) {
  const size_t bytes = size_t(4) << 30;
  DeviceBuffer src = device_alloc(bytes), sink = device_alloc(sizeof(uint4));
  KMLA_CUDA_CHECK(cudaMemsetAsync(src.data(), 1, bytes, s));  // words of 0x01010101: xor != sink value
  const size_t n = bytes / sizeof(uint4);
  const double us = timer.median_us(
      [&] {
        read_stream_kernel<<<8 * sms, 256, 0, s>>>(static_cast<const uint4*>(src.data()), n,
                                                     static_cast<uint4*>(sink.data()));
        KMLA_CUDA_CHECK(cudaGetLastError());
      },
      2, 10);
  return double(bytes) / (us * 1e-6) / 1e9;
}

// ---- cases --------------------------------------------------------------------------------

struct Result {
  double us = 0;
  double bytes = 0;     // 0 where bandwidth is not the measure (prefill)
  double flops = 0;
  double floor_us = 0;  // layer decode: (weights + cache bytes) / copy bandwidth
  const char* floor_name = "floor";  // what floor_us is (chunked prefill: a reference time)
  std::string error;
};

struct Context {
  cudaStream_t stream;
  cudaStream_t aux_stream;
  Timer& timer;
  int warmup, iters;
  bool portable;
  bool sequential_blocks;
  double copy_gb_s;
  std::function<void(const TensorView&, cuda::Stream)> all_reduce = {};  // kmla bench --tp N
  dist::Communicator* comm = nullptr;                                     // kmla bench --cp N
};

cuda::CacheRef device_cache_ref(void* base, CacheFormat f, int block_size, int64_t num_blocks) {
  cuda::CacheRef r;
  r.base = static_cast<std::byte*>(base);
  r.block_stride = int64_t(block_size) * int64_t(cache_entry_bytes(f));
  r.block_size = block_size;
  r.num_blocks = num_blocks;
  r.format = f;
  return r;
}

int read_error_flag(const DeviceBuffer& flag, cudaStream_t s) {
  int v = 0;
  KMLA_CUDA_CHECK(cudaMemcpyAsync(&v, flag.data(), sizeof(int), cudaMemcpyDeviceToHost, s));
  KMLA_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

TensorView device_view(const DeviceBuffer& b, DType t, std::initializer_list<int64_t> dims) {
  return TensorView(b.data(), t, dims, Device::cuda);
}

// Decode attention alone: plan_decode + decode_attention on a random cache of B * S rows in
// randomly permuted blocks, every request with seq keys and q_len query rows.
Result run_decode(const Case& c, Context& ctx) {
  // A mixed batch's target is the uniform batch's rate for the same bytes: time the uniform
  // case right before, so that both see the same clocks (they move with power and heat).
  Result uniform;
  if (c.mixed) {
    Case ref = c;
    ref.mixed = false;
    uniform = run_decode(ref, ctx);
  }
  const cudaStream_t s = ctx.stream;
  // Context parallel: this rank holds seq / cp keys of every request, rounded up to whole
  // blocks (cp_range's shares differ by at most a unit; the bench times equal shares).
  const int seq = c.cp > 1 ? int(cuda::ceil_div(cuda::ceil_div(c.seq, c.cp), c.block_size) * c.block_size) : c.seq;
  const auto B = size_t(c.batch);
  std::vector<int32_t> seq_lens(B, seq), q_lens(B, c.q_len);
  if (c.mixed) {
    seq_lens = mixed_lengths(c.batch, seq);
    if (c.q_len > 1) q_lens = mixed_lengths(c.batch, c.q_len);
  }
  std::vector<int32_t> query_start(B + 1, 0);
  for (size_t r = 0; r < B; ++r) query_start[r + 1] = query_start[r] + q_lens[r];
  const int max_seq = *std::max_element(seq_lens.begin(), seq_lens.end());
  const int max_q = *std::max_element(q_lens.begin(), q_lens.end());
  const int64_t blocks_each = cuda::ceil_div(max_seq, c.block_size);
  const int64_t num_blocks = int64_t(c.batch) * blocks_each;
  const int64_t rows = query_start[B];
  const size_t entry = cache_entry_bytes(c.format);
  const bool q_fp8 = c.format == CacheFormat::fp8;  // plain fp8: fp8 x fp8 with q_scale

  DeviceBuffer cache = device_alloc(size_t(num_blocks) * c.block_size * entry);
  fill_cache(cache.data(), num_blocks * c.block_size, c.format, 11, s);
  const size_t q_bytes = size_t(rows) * c.heads * kLatentDim * (q_fp8 ? 1 : 2);
  DeviceBuffer q = device_alloc(q_bytes);
  fill_random(q.data(), q_bytes, q_fp8 ? Fill::e4m3 : Fill::bf16, 12, q_fp8 ? 2.0f : 1.0f, s);
  DeviceBuffer out = device_alloc(size_t(rows) * c.heads * kKvLoraRank * 2);
  DeviceBuffer lse = device_alloc(size_t(rows) * c.heads * sizeof(float));
  DeviceBuffer flag = device_alloc(sizeof(int));
  KMLA_CUDA_CHECK(cudaMemsetAsync(flag.data(), 0, sizeof(int), s));

  DeviceBuffer d_tables = to_device(block_tables(c.batch, blocks_each, 13, !ctx.sequential_blocks), s);
  DeviceBuffer d_seq = to_device(seq_lens, s);
  DeviceBuffer d_qlen = to_device(q_lens, s);
  DeviceBuffer d_qstart = to_device(query_start, s);
  DeviceBuffer d_slots = to_device(std::vector<int64_t>(size_t(rows), -1), s);  // unused
  DeviceBuffer d_tokens = to_device(std::vector<int32_t>{int32_t(rows)}, s);

  cuda::DecodeParams p;
  p.q = q.data();
  p.q_fp8 = q_fp8;
  p.q_scale = 1.0f;
  p.cache = device_cache_ref(cache.data(), c.format, c.block_size, num_blocks);
  p.batch.block_tables = static_cast<const int32_t*>(d_tables.data());
  p.batch.seq_lens = static_cast<const int32_t*>(d_seq.data());
  p.batch.query_lens = static_cast<const int32_t*>(d_qlen.data());
  p.batch.query_start = static_cast<const int32_t*>(d_qstart.data());
  p.batch.slot_mapping = static_cast<const int64_t*>(d_slots.data());
  p.batch.num_tokens = static_cast<const int32_t*>(d_tokens.data());
  p.batch.num_requests = c.batch;
  p.batch.max_blocks = int(blocks_each);
  p.batch.num_rows = rows;
  p.heads = c.heads;
  p.causal = c.causal;
  p.softmax_scale = float(1.0 / std::sqrt(double(kQkHeadDim)));
  p.act = DType::bf16;
  p.out = out.data();
  p.lse = static_cast<float*>(lse.data());
  p.error_flag = static_cast<int*>(flag.data());

  const cuda::DecodePlan plan =
      cuda::plan_decode(c.batch, c.heads, max_q, max_seq, ctx.portable, false, c.format);
  DeviceBuffer ws = device_alloc(plan.workspace_bytes);
  // The balanced walk's starts, made on the host from the lengths as the layer and the
  // DecodeAttention stage make them (uploaded once: every timed run has the same batch).
  DeviceBuffer walk;
  if (const size_t walk_bytes = cuda::decode_walk_table_bytes(plan, c.batch); walk_bytes > 0) {
    std::vector<std::byte> table(walk_bytes);
    p.walk_key_tile = cuda::decode_walk_table(plan, c.heads, c.causal, c.format, c.batch,
                                              seq_lens.data(), q_lens.data(), table.data());
    walk = to_device(table, s);
    p.walk_table = walk.data();
  }

  // Across ranks: the partial spread to f32 (every row is this rank's, the identity map), the
  // NCCL all-gather of the partials and the LSE merge, all inside the timed run.
  const int64_t H = c.heads;
  DeviceBuffer cp_rows, cp_out, cp_lse, cp_merged, cp_merged_lse, cp_ws;
  if (c.cp > 1) {
    KMLA_CHECK(ctx.comm && ctx.comm->world() == c.cp, "context-parallel case ", c.name,
               " needs a communicator of ", c.cp, " ranks (kmla bench --cp ", c.cp, ")");
    std::vector<int64_t> identity(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) identity[size_t(i)] = i;
    cp_rows = to_device(identity, s);
    cp_out = device_alloc(size_t(rows * H) * kKvLoraRank * sizeof(float));
    cp_lse = device_alloc(size_t(rows * H) * sizeof(float));
    cp_merged = device_alloc(size_t(rows * H) * kKvLoraRank * 2);
    cp_merged_lse = device_alloc(size_t(rows * H) * sizeof(float));
    cp_ws = device_alloc(dist::cp_gather_workspace_bytes(c.cp, rows, int(H), kKvLoraRank));
  }
  KMLA_CUDA_CHECK(cudaStreamSynchronize(s));
  auto step = [&] {
    cuda::decode_attention(p, plan, ws.data(), s);
    if (c.cp <= 1) return;
    const auto st = reinterpret_cast<cuda::Stream>(s);
    const TensorView part = device_view(cp_out, DType::f32, {rows, H, kKvLoraRank});
    const TensorView part_lse = device_view(cp_lse, DType::f32, {rows, H});
    dist::cp_scatter_partial(device_view(cp_rows, DType::i64, {rows}), device_view(out, DType::bf16, {rows, H, kKvLoraRank}),
                             device_view(lse, DType::f32, {rows, H}), part, part_lse, st);
    dist::cp_all_gather_merge(*ctx.comm, part, part_lse, cp_ws.data(),
                              device_view(cp_merged, DType::bf16, {rows, H, kKvLoraRank}),
                              device_view(cp_merged_lse, DType::f32, {rows, H}), st);
  };

  Result r;
  r.us = ctx.timer.median_us(step, ctx.warmup, ctx.iters);
  const int err = read_error_flag(flag, s);
  KMLA_CHECK(err == 0, "decode attention raised device error flag ", err, " (harness bug?)");
  for (size_t i = 0; i < B; ++i) {
    r.bytes += decode_bytes(1, seq_lens[i], c.format);
    r.flops += decode_flops(1, q_lens[i], c.heads, seq_lens[i]);
  }
  if (c.mixed) {
    r.floor_us = r.bytes / (uniform.bytes / uniform.us);
    r.floor_name = "uniform rate";
  }
  return r;
}

// Prefill attention alone, one sequence of T tokens, laid out as the layer has them: q
// [T, H, 192]; k_nope and v the two halves of kv_b's output [T, H, 256]; k_rope [T, 64]
// shared by every head.
// fp8 cases (c.fp8): the same layout in e4m3 codes of values uniform in [-8, 8] with scales
// 1/8, and the bf16 case of the same shape timed right before as the report's reference.
Result run_prefill(const Case& c, Context& ctx) {
  const cudaStream_t s = ctx.stream;
  const int64_t t = c.tokens, h = c.heads;
  // The reference timed right before, in the same clock state: the bf16 kernel of the same
  // shape (fp8), or one sequence with the batch's (query, key) pairs (variable lengths).
  Result ref;
  if (c.fp8) {
    Case bf16 = c;
    bf16.fp8 = false;
    ref = run_prefill(bf16, ctx);
  } else if (!c.lengths.empty()) {
    double batch_pairs = 0;
    for (int n : c.lengths) batch_pairs += prefill_pairs(n, c.causal);
    ref = run_prefill(prefill_case(tokens_with_pairs(batch_pairs, c.causal), c.heads, c.causal), ctx);
  }
  const size_t el = c.fp8 ? 1 : 2;  // input element bytes
  const Fill fill = c.fp8 ? Fill::e4m3 : Fill::bf16;
  const float amp = c.fp8 ? 8.0f : 1.0f;
  DeviceBuffer q = device_alloc(size_t(t * h * kQkHeadDim) * el);
  DeviceBuffer kv = device_alloc(size_t(t * h * kKvBOut) * el);
  DeviceBuffer k_rope = device_alloc(size_t(t * kRopeDim) * el);
  DeviceBuffer out = device_alloc(size_t(t * h * kVDim) * 2);
  DeviceBuffer lse = device_alloc(size_t(t * h) * sizeof(float));
  fill_random(q.data(), size_t(t * h * kQkHeadDim) * el, fill, 21, amp, s);
  fill_random(kv.data(), size_t(t * h * kKvBOut) * el, fill, 22, amp, s);
  fill_random(k_rope.data(), size_t(t * kRopeDim) * el, fill, 23, amp, s);
  DeviceBuffer scales = to_device(std::vector<float>{0.125f, 0.125f, 0.125f}, s);
  // One sequence, or the case's variable-length batch packed back to back.
  const std::vector<int> lengths = c.lengths.empty() ? std::vector<int>{int(t)} : c.lengths;
  std::vector<int32_t> cu_len(lengths.size() + 1, 0);
  double pairs = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    cu_len[i + 1] = cu_len[i] + lengths[i];
    pairs += prefill_pairs(lengths[i], c.causal);
  }
  KMLA_CHECK(cu_len.back() == t, "prefill case ", c.name, ": lengths sum to ", cu_len.back(),
             ", not ", t, " tokens");
  DeviceBuffer cu = to_device(cu_len, s);
  DeviceBuffer counter = to_device(std::vector<int32_t>{0, 0}, s);  // the layer keeps one too

  const auto* kv_base = static_cast<const std::byte*>(kv.data());
  cuda::PrefillParams p;
  p.q = {q.data(), h * kQkHeadDim, kQkHeadDim};
  p.k_nope = {kv_base, h * kKvBOut, kKvBOut};
  p.v = {kv_base + kNopeDim * el, h * kKvBOut, kKvBOut};
  p.k_rope = {k_rope.data(), kRopeDim, 0};
  p.out = out.data();
  p.out_row_stride = h * kVDim;
  p.out_head_stride = kVDim;
  p.lse = static_cast<float*>(lse.data());
  p.lse_row_stride = h;
  p.heads = c.heads;
  p.cu_q = static_cast<const int32_t*>(cu.data());
  p.cu_k = p.cu_q;
  p.num_seqs = int(lengths.size());
  p.max_q_len = *std::max_element(lengths.begin(), lengths.end());
  p.total_q = t;
  p.work_counter = static_cast<int32_t*>(counter.data());
  p.causal = c.causal;
  p.softmax_scale = float(1.0 / std::sqrt(double(kQkHeadDim)));
  p.act = DType::bf16;
  p.portable = ctx.portable;
  if (c.fp8) {
    p.fp8 = true;
    p.q_scale = static_cast<const float*>(scales.data());
    p.k_scale = p.q_scale + 1;
    p.v_scale = p.q_scale + 2;
  }
  KMLA_CUDA_CHECK(cudaStreamSynchronize(s));

  Result r;
  r.us = ctx.timer.median_us([&] { cuda::prefill_attention(p, s); }, ctx.warmup, ctx.iters);
  r.flops = prefill_flops(h, pairs);
  if (c.fp8) {
    // The note then reads "bf16 <us>, <fp8 time / bf16 time>x": 0.625x is 1.6x the rate.
    r.floor_us = ref.us;
    r.floor_name = "bf16";
  } else if (!c.lengths.empty()) {
    // "single-sequence rate <us>, <ratio>x": the batch's FLOPs at the single sequence's rate;
    // issue 7's >= 90 % of that rate is a ratio <= 1.111x.
    r.floor_us = r.flops / (ref.flops / ref.us);
    r.floor_name = "single-sequence rate";
  }
  return r;
}

// Everything one layer call needs in device memory: a random cache in permuted blocks, the
// planned batch, positions, hidden states and the output.
struct LayerInputs {
  BatchMetadata md;
  DeviceBuffer cache_memory;
  LatentCache cache;
  DeviceBuffer positions, hidden, out;
};

LayerInputs make_layer_inputs(const Case& c, const MlaConfig& cfg, std::vector<RequestSpec> reqs,
                              int64_t num_blocks, int decode_threshold, cudaStream_t s,
                              int64_t workspace_tokens = BatchOptions{}.workspace_tokens) {
  LayerInputs in;
  const size_t entry = cache_entry_bytes(c.format);
  in.cache_memory = device_alloc(size_t(num_blocks) * c.block_size * entry);
  fill_cache(in.cache_memory.data(), num_blocks * c.block_size, c.format, 31, s);
  in.cache = LatentCache::borrow(in.cache_memory.data(), Device::cuda, c.format, c.block_size,
                                 num_blocks, int64_t(c.block_size) * int64_t(entry));
  BatchOptions bo;
  bo.decode_threshold = decode_threshold;
  bo.non_causal_decode = cfg.non_causal_multi_token_decode;
  bo.workspace_tokens = workspace_tokens;
  in.md = plan_batch(reqs, in.cache.geometry(), bo);
  const int64_t rows = in.md.num_rows;
  in.positions = to_device(in.md.positions, s);
  in.hidden = device_alloc(size_t(rows) * cfg.hidden_size * 2);
  fill_random(in.hidden.data(), size_t(rows) * cfg.hidden_size * 2, Fill::bf16, 32, 1.0f, s);
  in.out = device_alloc(size_t(rows) * cfg.hidden_size * 2);
  KMLA_CUDA_CHECK(cudaStreamSynchronize(s));
  return in;
}

// The layer of the whole-layer cases: one rank of the TP group returns its partial o_proj sum
// (no all-reduce); g_proj on the context's auxiliary stream.
// Under `kmla bench --tp N` with NCCL the layer ends in the communicator's all-reduce instead.
cuda::Layer make_layer(const MlaConfig& cfg, const MlaWeights& weights, const Context& ctx) {
  cuda::LayerOptions lo;
  lo.portable = ctx.portable;
  lo.aux_stream = ctx.aux_stream;
  if (cfg.tp_size > 1 && ctx.all_reduce) lo.all_reduce = ctx.all_reduce;
  else lo.partial_output = cfg.tp_size > 1;
  return cuda::Layer(cfg, weights, lo);
}

// A whole-layer decode step of B requests of seq keys (the last q_len of them new), planned
// against a DecodeShape, captured once in a CUDA graph and timed as graph replays.
Result run_layer_decode(const Case& c, Context& ctx) {
  const cudaStream_t s = ctx.stream;
  const MlaConfig cfg = layer_config(c);
  const MlaWeights weights = MlaWeights::random(cfg, 41);
  const cuda::Layer layer = make_layer(cfg, weights, ctx);

  const int64_t blocks_each = cuda::ceil_div(c.seq, c.block_size);
  const std::vector<int32_t> ids = block_tables(c.batch, blocks_each, 42, !ctx.sequential_blocks);
  std::vector<RequestSpec> reqs(size_t(c.batch));
  for (int r = 0; r < c.batch; ++r) {
    reqs[size_t(r)].query_len = c.q_len;
    reqs[size_t(r)].context_len = c.seq - c.q_len;
    reqs[size_t(r)].block_table.assign(ids.begin() + r * blocks_each, ids.begin() + (r + 1) * blocks_each);
  }
  LayerInputs in = make_layer_inputs(c, cfg, reqs, int64_t(c.batch) * blocks_each, c.q_len, s);
  const int64_t rows = in.md.num_rows;

  cuda::DecodeShape shape;
  shape.max_requests = c.batch;
  shape.max_query_len = c.q_len;
  shape.max_blocks = int(blocks_each);
  shape.max_seq_len = c.seq;
  const cuda::Plan plan = layer.plan(in.md, in.cache, &shape);
  KMLA_CHECK(plan.graph_safe(), "the layer's decode plan is not graph-safe");
  DeviceBuffer ws = device_alloc(plan.workspace_bytes());
  layer.upload(plan, ws.data(), s);
  const TensorView positions = device_view(in.positions, DType::i64, {rows});
  const TensorView hidden = device_view(in.hidden, DType::bf16, {rows, cfg.hidden_size});
  const TensorView out = device_view(in.out, DType::bf16, {rows, cfg.hidden_size});

  // One eager run first, which tunes the GEMMs: lazy initialization (cuBLASLt heuristics,
  // tuning) must not happen during capture.
  layer.tune(plan, positions, hidden, in.cache, out, ws.data(), s);
  KMLA_CUDA_CHECK(cudaStreamSynchronize(s));

  GraphHandle g;
  KMLA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  try {
    layer.run(plan, positions, hidden, in.cache, out, ws.data(), s);
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(s, &broken);  // leave the stream usable for the next case
    if (broken) cudaGraphDestroy(broken);
    throw;
  }
  KMLA_CUDA_CHECK(cudaStreamEndCapture(s, &g.graph));
  KMLA_CUDA_CHECK(cudaGraphInstantiate(&g.exec, g.graph, 0));
  KMLA_CUDA_CHECK(cudaGraphUpload(g.exec, s));

  Result r;
  r.us = ctx.timer.median_us([&] { KMLA_CUDA_CHECK(cudaGraphLaunch(g.exec, s)); }, ctx.warmup,
                             ctx.iters);
  layer.check_errors(s);
  const double cache_bytes = decode_bytes(c.batch, c.seq, c.format);
  r.bytes = weight_bytes(weights) + cache_bytes;
  r.floor_us = r.bytes / (ctx.copy_gb_s * 1e9) * 1e6;
  r.flops = layer_projection_flops(cfg, rows, true) +
            decode_flops(c.batch, c.q_len, cfg.local_heads(), c.seq);
  return r;
}

// A whole-layer prefill of one request of T new tokens over c.context cached ones (gathered
// in c.chunks chunks), timed as plain runs.
Result run_layer_prefill(const Case& c, Context& ctx) {
  const cudaStream_t s = ctx.stream;
  const MlaConfig cfg = layer_config(c);
  const MlaWeights weights = MlaWeights::random(cfg, 51);
  const cuda::Layer layer = make_layer(cfg, weights, ctx);

  const int64_t blocks = cuda::ceil_div(int64_t(c.context) + c.tokens, c.block_size);
  std::vector<RequestSpec> reqs(1);
  reqs[0].query_len = c.tokens;
  reqs[0].context_len = c.context;
  const std::vector<int32_t> ids = block_tables(1, blocks, 52, !ctx.sequential_blocks);
  reqs[0].block_table = ids;
  const int64_t chunk_tokens = c.context > 0 ? cuda::ceil_div(c.context, c.chunks) : BatchOptions{}.workspace_tokens;
  LayerInputs in = make_layer_inputs(c, cfg, reqs, blocks, 1, s, chunk_tokens);
  KMLA_CHECK(c.context == 0 || int64_t(in.md.context_chunks.size()) == c.chunks, "case ", c.name,
             ": planned ", in.md.context_chunks.size(), " context chunks, not ", c.chunks);
  const int64_t rows = in.md.num_rows;

  const cuda::Plan plan = layer.plan(in.md, in.cache);
  DeviceBuffer ws = device_alloc(plan.workspace_bytes());
  layer.upload(plan, ws.data(), s);
  const TensorView positions = device_view(in.positions, DType::i64, {rows});
  const TensorView hidden = device_view(in.hidden, DType::bf16, {rows, cfg.hidden_size});
  const TensorView out = device_view(in.out, DType::bf16, {rows, cfg.hidden_size});

  layer.tune(plan, positions, hidden, in.cache, out, ws.data(), s);
  Result r;
  r.us = ctx.timer.median_us(
      [&] { layer.run(plan, positions, hidden, in.cache, out, ws.data(), s); }, ctx.warmup, ctx.iters);
  layer.check_errors(s);
  r.flops = layer_projection_flops(cfg, rows, false) +
            prefill_flops(cfg.local_heads(), prefill_pairs(c.tokens, true) + double(c.tokens) * c.context);
  return r;
}

// Chunked context (SPEC's target): what c.context cached tokens add to a layer prefill of
// c.tokens new ones (the difference of two whole-layer runs: gather, kv_b over the context,
// attention over it, merges) plus the attention over the new tokens alone, against the time
// all those (query, key) pairs take at the single-sequence rate of the same attention kernel.
// `floor_us` carries that reference time, so the report's ratio is the target's measure.
Result run_chunked_prefill(const Case& c, Context& ctx) {
  Case layer_with = c, layer_without = c;
  layer_with.kind = layer_without.kind = Kind::layer_prefill;
  layer_without.context = 0;
  const Result with_ctx = run_layer_prefill(layer_with, ctx);
  const Result without_ctx = run_layer_prefill(layer_without, ctx);
  const Result new_attn = run_prefill(prefill_case(c.tokens, c.heads, true), ctx);

  Result r;
  r.us = with_ctx.us - without_ctx.us + new_attn.us;
  r.flops = prefill_flops(c.heads, prefill_pairs(c.tokens, true) + double(c.tokens) * c.context);
  r.floor_us = r.flops / (new_attn.flops / new_attn.us);
  r.floor_name = "single-sequence rate";
  return r;
}

// One projection alone, as the layer's decode step runs it: cuBLASLt through Blas, tuned as
// Layer::tune tunes it (unless KMLA_GEMM_TUNE=0); the heuristic's untuned choice is the
// reference (floor_us). The activations sit like the layer's (A_b at b * k in rows of
// batch * k, C_b at b * n in rows of batch * n). Bytes: the weights, which a projection must
// read; the activations (L2-sized) and outputs are left out.
Result run_gemm(const Case& c, Context& ctx) {
  const cudaStream_t s = ctx.stream;
  const int64_t m = c.tokens, n = c.gemm_n, k = c.gemm_k, b = c.batch;
  DeviceBuffer a = device_alloc(size_t(m * b * k) * 2), w = device_alloc(size_t(b * n * k) * 2),
               out = device_alloc(size_t(m * b * n) * 2);
  fill_random(a.data(), a.bytes(), Fill::bf16, 61, 1.0f, s);
  fill_random(w.data(), w.bytes(), Fill::bf16, 62, 0.05f, s);
  auto call = [&](const cuda::Blas& blas) {
    if (c.gemm_n_major)
      blas.batched_nn(int(b), m, n, k, a.data(), b * k, k, w.data(), n, k * n, out.data(), b * n, n,
                      DType::bf16, s);
    else
      blas.linear(m, n, k, a.data(), k, w.data(), out.data(), n, DType::bf16, s);
  };
  cuda::Blas tuned, heuristic;
  tuned.set_tuning(true);
  call(tuned);  // times the candidates (synchronizes s)
  tuned.set_tuning(false);
  Result r;
  r.us = ctx.timer.median_us([&] { call(tuned); }, ctx.warmup, ctx.iters);
  r.floor_us = ctx.timer.median_us([&] { call(heuristic); }, ctx.warmup, ctx.iters);
  r.floor_name = "untuned";
  r.bytes = double(b * n * k) * 2;
  r.flops = 2.0 * double(b * m * n * k);
  return r;
}

Result run_case(const Case& c, Context& ctx) {
  Result r;
  try {
    switch (c.kind) {
      case Kind::decode: r = run_decode(c, ctx); break;
      case Kind::prefill: r = run_prefill(c, ctx); break;
      case Kind::layer_decode: r = run_layer_decode(c, ctx); break;
      case Kind::layer_prefill: r = run_layer_prefill(c, ctx); break;
      case Kind::chunked_prefill: r = run_chunked_prefill(c, ctx); break;
      case Kind::gemm:
        r = run_gemm(c, ctx);
        break;
    }
    KMLA_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));  // late faults belong to this case
  } catch (const std::exception& e) {
    r = Result{};
    r.error = e.what();
  }
  return r;
}

// ---- reporting ----------------------------------------------------------------------------

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

double tb_s(const Result& r) { return r.bytes > 0 && r.us > 0 ? r.bytes / (r.us * 1e-6) / 1e12 : 0; }
double tflops(const Result& r) { return r.flops > 0 && r.us > 0 ? r.flops / (r.us * 1e-6) / 1e12 : 0; }

json case_json(const Case& c, const Result& r, double copy_gb_s) {
  json j;
  j["name"] = c.name;
  j["kind"] = kind_name(c.kind);
  if (c.kind == Kind::decode || c.kind == Kind::layer_decode) {
    j["batch"] = c.batch;
    j["seq"] = c.seq;
    j["q_len"] = c.q_len;
    j["block_size"] = c.block_size;
  } else {
    j["tokens"] = c.tokens;
  }
  if (c.kind == Kind::gemm) {
    j["batch"] = c.batch;
    j["n"] = c.gemm_n;
    j["k"] = c.gemm_k;
    j["w_n_major"] = c.gemm_n_major;
  }
  if (c.kind != Kind::prefill) j["cache_format"] = cache_format_name(c.format);
  if (c.cp > 1) j["cp"] = c.cp;
  j["heads"] = c.heads;
  j["causal"] = c.causal;
  if (c.mixed) j["mixed"] = true;
  if (!c.lengths.empty()) j["lengths"] = c.lengths;
  if (c.context > 0) {
    j["context"] = c.context;
    j["chunks"] = c.chunks;
  }
  if (c.kind == Kind::layer_decode || c.kind == Kind::layer_prefill || c.kind == Kind::chunked_prefill) {
    j["model"] = c.model;
    j["tp"] = c.tp;
    j["rank"] = c.rank;
  }
  if (!r.error.empty()) {
    j["error"] = r.error;
    return j;
  }
  j["us"] = r.us;
  j["flops"] = r.flops;
  j["tflops"] = tflops(r);
  if (r.bytes > 0) {
    j["bytes"] = r.bytes;
    j["tb_s"] = tb_s(r);
    j["frac_copy_bw"] = tb_s(r) * 1e3 / copy_gb_s;
  } else {
    j["tb_s"] = nullptr;
    j["frac_copy_bw"] = nullptr;
  }
  if (r.floor_us > 0) {
    j["floor_us"] = r.floor_us;
    j["floor_ratio"] = r.us / r.floor_us;
    j["floor_name"] = r.floor_name;
  }
  return j;
}

void print_row(std::ostream& out, const Case& c, const Result& r, double copy_gb_s) {
  char buf[512];
  if (!r.error.empty()) {
    std::snprintf(buf, sizeof buf, "%-56s  FAILED: %s\n", c.name.c_str(), r.error.c_str());
  } else {
    char bw[16] = "      -", frac[16] = "     -", note[96] = "";
    if (r.bytes > 0) {
      std::snprintf(bw, sizeof bw, "%7.3f", tb_s(r));
      std::snprintf(frac, sizeof frac, "%5.1f%%", 100.0 * tb_s(r) * 1e3 / copy_gb_s);
    }
    if (r.floor_us > 0)
      std::snprintf(note, sizeof note, "%s %.1f us, %.3fx", r.floor_name, r.floor_us, r.us / r.floor_us);
    std::snprintf(buf, sizeof buf, "%-56s %10.1f %s %8.1f  %s  %s\n", c.name.c_str(), r.us, bw,
                  tflops(r), frac, note);
  }
  out << buf << std::flush;
}

}  // namespace

int run_bench(const BenchOptions& o, std::ostream& out) {
  KMLA_CHECK(o.iters >= 1, "bench iters ", o.iters, " < 1");
  KMLA_CHECK(o.warmup >= 0, "bench warmup ", o.warmup, " < 0");
  KMLA_CHECK(o.tp == 0 || o.cp == 0, "bench: --tp and --cp are separate runs");
  std::vector<Case> cases = !o.kind.empty() ? std::vector<Case>{custom_case(o)}
                            : o.tp > 0      ? tp_cases(o.tp, o.tp_rank)
                            : o.cp > 0      ? cp_cases(o.cp)
                                            : standard_cases();
  if (o.tp > 0 && !o.kind.empty()) {
    KMLA_CHECK(cases[0].kind == Kind::layer_decode || cases[0].kind == Kind::layer_prefill,
               "--tp applies to the layer kinds (layer-decode, layer-prefill), not '", o.kind, "'");
    const Case c = cases[0];  // its name and heads follow --tp, not --heads
    cases[0] = layer_case(c.kind, c.model, o.tp, c.batch, c.seq, c.q_len, c.tokens, c.block_size, c.format);
    cases[0].rank = o.tp_rank;
  }
  if (!o.only.empty()) {
    // A comma-separated list: keep the cases whose name contains any of the parts.
    std::vector<std::string> parts;
    for (size_t at = 0; at <= o.only.size();) {
      const size_t comma = std::min(o.only.find(',', at), o.only.size());
      if (comma > at) parts.push_back(o.only.substr(at, comma - at));
      at = comma + 1;
    }
    std::erase_if(cases, [&](const Case& c) {
      return std::none_of(parts.begin(), parts.end(),
                          [&](const std::string& part) { return c.name.find(part) != std::string::npos; });
    });
  }
  KMLA_CHECK(!cases.empty(), "no bench case matches '", o.only, "'");

  int device = 0, count = 0;
  KMLA_CHECK(cudaGetDeviceCount(&count) == cudaSuccess && count > 0, "kmla bench needs a CUDA GPU");
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  KMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));

  StreamHandle stream, aux;
  Timer timer(stream.s, size_t(prop.l2CacheSize), prop.multiProcessorCount, o.write_flush);
  const double copy_gb_s = measure_copy_gb_s(timer, stream.s);
  const double read_gb_s = measure_read_gb_s(timer, prop.multiProcessorCount, stream.s);
  Context ctx{stream.s, aux.s, timer, o.warmup, o.iters, o.portable, o.sequential_blocks, copy_gb_s};
  ctx.all_reduce = o.all_reduce;
  ctx.comm = o.comm;
  const std::string date = utc_now();
  // The layer cases tune their GEMMs before timing (Layer::tune) unless KMLA_GEMM_TUNE=0.
  const char* tune_env = std::getenv("KMLA_GEMM_TUNE");
  const bool gemm_tuning = tune_env == nullptr || std::strcmp(tune_env, "0") != 0;

  if (!o.json) {
    char head[512];
    std::snprintf(head, sizeof head,
                  "kmla bench: %s, %d SMs, %s; copy bandwidth %.1f GB/s (2 GiB D2D, read+write, "
                  "median of 10), read-only %.1f GB/s (%.3f of copy); median of %d runs, L2 "
                  "flushed by %s%s%s%s\n",
                  prop.name, prop.multiProcessorCount, date.c_str(), copy_gb_s, read_gb_s,
                  read_gb_s / copy_gb_s, o.iters, o.write_flush ? "writing" : "reading",
                  o.portable ? "; portable kernels" : "",
                  o.sequential_blocks ? "; sequential blocks" : "",
                  gemm_tuning ? "" : "; GEMM tuning off");
    out << head;
    std::snprintf(head, sizeof head, "%-56s %10s %7s %8s  %6s  %s\n", "case", "us", "TB/s",
                  "TFLOP/s", "copy", "");
    out << head << std::flush;
  }

  json results = json::array();
  bool all_ok = true;
  for (const Case& c : cases) {
    const Result r = run_case(c, ctx);
    // With collectives a rank that skips a case would leave its peers waiting in the next
    // all-reduce: a failed case ends this rank (and through the launcher, the others).
    KMLA_CHECK(r.error.empty() || (!o.all_reduce && !o.comm), "bench case ", c.name, " failed on rank ",
               o.comm ? o.cp_rank : o.tp_rank, ": ", r.error);
    all_ok = all_ok && r.error.empty();
    if (o.json) results.push_back(case_json(c, r, copy_gb_s));
    else print_row(out, c, r, copy_gb_s);
  }

  if (o.json) {
    json doc;
    doc["device"] = prop.name;
    doc["sm_count"] = prop.multiProcessorCount;
    doc["compute_capability"] = std::to_string(prop.major) + "." + std::to_string(prop.minor);
    doc["date"] = date;
    doc["copy_bandwidth_gb_s"] = copy_gb_s;
    doc["read_bandwidth_gb_s"] = read_gb_s;
    doc["iters"] = o.iters;
    doc["warmup"] = o.warmup;
    doc["portable"] = o.portable;
    doc["sequential_blocks"] = o.sequential_blocks;
    doc["l2_flush"] = o.write_flush ? "write" : "read";
    doc["gemm_tuning"] = gemm_tuning;
    doc["cases"] = std::move(results);
    out << doc.dump(2) << "\n";
  }
  return all_ok ? 0 : 1;
}

}  // namespace kmla::bench
