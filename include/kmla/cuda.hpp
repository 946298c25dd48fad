// The CUDA backend's public API (no CUDA headers: streams are passed as the opaque
// cudaStream_t they are). Hopper (sm_90a) first; other GPUs of compute capability >= 8.0
// take the portable tensor-core path, which LayerOptions::portable forces anywhere.
//
// The contract every call keeps: an explicit stream; no device synchronization and no
// allocation inside run(); errors on bad input are kmla::Error thrown before anything
// is written; kernels additionally guard every cache write and raise a device error flag.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/rope.hpp"
#include "kmla/tensor.hpp"
#include "kmla/weights.hpp"

struct CUstream_st;

namespace kmla::cuda {

using Stream = CUstream_st*;  // a cudaStream_t; nullptr is the legacy default stream

// True when this build has the CUDA backend and a usable GPU is present.
bool available();

struct DeviceInfo {
  std::string name;
  int sm_count = 0;
  int major = 0, minor = 0;
  size_t memory_bytes = 0;
  size_t l2_bytes = 0;
};
DeviceInfo device_info();  // the current device; throws without one

// Owning device memory (cudaMalloc). Moves, never copies.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  // A device view of (the start of) this buffer; throws if it does not fit.
  TensorView view(DType dtype, std::initializer_list<int64_t> dims) const;

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Asynchronous copies between a host view and a device view of the same dtype and size.
// The host side must stay alive until the stream reaches the copy.
void copy_to_device(const TensorView& host, const TensorView& device, Stream stream);
void copy_to_host(const TensorView& device, const TensorView& host, Stream stream);

// A latent cache in device memory owned by kmla (zero-filled), with the same geometry
// rules as LatentCache::allocate.
struct DeviceCache {
  DeviceBuffer memory;
  LatentCache cache;
  static DeviceCache allocate(CacheFormat format, int block_size, int64_t num_blocks,
                              float k_scale = 1.0f, TileScaleRule rule = TileScaleRule::power_of_two);
};

struct LayerOptions {
  DType activation = DType::bf16;  // bf16 or f16; weights must match
  bool fp8_prefill = false;        // as kmla::LayerOptions::fp8_prefill
  bool partial_output = false;     // as kmla::LayerOptions::partial_output
  // Sums `out` across tensor-parallel ranks in place on `stream` (tp_size > 1 only).
  std::function<void(const TensorView& out, Stream stream)> all_reduce;
  // Run the portable (sm_80) kernels even on Hopper.
  bool portable = false;
  // Decode attention splits each request's keys by its own length only (and always
  // combines), so a request's attention output is bitwise the same whatever else is in the
  // batch. Costs some speed on large batches of short requests.
  bool batch_invariant = false;
  // An auxiliary stream (caller-owned, may be shared by all layers) on which a g_proj of its
  // own (fp8 weights; 16-bit ones are part of the front GEMM) runs concurrently with attention
  // for batches below kAuxStreamMaxRows rows. nullptr: one stream.
  Stream aux_stream = nullptr;
  // forward() runs as tune() (Layer::tune): a GEMM shape new to the device is tuned on first
  // use, and that call synchronizes; later calls of known shapes cost what run() costs.
  // run() and capture are unaffected (call tune() yourself before capturing).
  bool tune_gemms = false;
};

// Batches with fewer rows than this run g_proj on the auxiliary stream (fp8 weights; measured:
// above it the GEMMs fill the GPU alone and the overlap stops paying) or inside the front GEMM
// (16-bit weights; measured: one wide GEMM pays for 128 rows, costs 1.7 % at 8k).
inline constexpr int64_t kAuxStreamMaxRows = 512;

// For CUDA graphs: the fixed shape a captured decode step is planned against. Every batch
// replayed through the graph must be decode-only, have the captured number of rows, at most
// max_requests requests of at most max_query_len query tokens and max_blocks blocks each.
struct DecodeShape {
  int max_requests = 0;
  int max_query_len = 1;
  int max_blocks = 0;
  int64_t max_seq_len = 0;  // sizes the KV split only; longer sequences stay correct
};

class Layer;

// A planned batch: launch configuration, workspace size and the device metadata image.
class Plan {
 public:
  size_t workspace_bytes() const;
  int64_t num_rows() const;
  bool graph_safe() const;  // planned against a DecodeShape
  struct Data;
  std::shared_ptr<const Data> data;
};

class Layer {
 public:
  // Uploads the weights to the current device (synchronously: construction time).
  Layer(const MlaConfig& cfg, const MlaWeights& weights, LayerOptions options = {},
        std::shared_ptr<const RopeTable> rope = nullptr);
  ~Layer();
  Layer(Layer&&) noexcept;
  Layer& operator=(Layer&&) noexcept;

  const MlaConfig& config() const;
  const LayerOptions& options() const;

  // Host-side planning: validates md against the cache geometry (the same checks and
  // messages as the CPU backend) and sizes the workspace. With `shape`, the plan's launch
  // configuration depends only on the shape and md.num_rows, so a graph captured with one
  // such plan replays any other batch planned against the same shape.
  Plan plan(const BatchMetadata& md, const LatentCache& cache, const DecodeShape* shape = nullptr) const;

  // Copies the plan's metadata into the workspace on `stream` (from host memory the plan
  // owns). Call it before run(); for graph replays, call it (outside the graph) before each
  // replay with the new batch's plan.
  void upload(const Plan& plan, void* workspace, Stream stream) const;

  // The forward pass of the planned batch: positions i64 [rows], hidden and out
  // [rows, hidden_size] in the activation dtype, all in device memory. Allocates nothing and
  // never synchronizes; a graph-safe plan can be captured (global capture mode).
  void run(const Plan& plan, const TensorView& positions, const TensorView& hidden,
           LatentCache& cache, const TensorView& out, void* workspace, Stream stream) const;

  // run() that also tunes the GEMMs: each projection shape not tuned yet on this device
  // (layers of one device share the tuning) has cuBLASLt's candidate algorithms timed from a
  // cold L2 and the fastest kept for every later run and capture (cuda::Blas::set_tuning).
  // Call it once per batch shape before capturing or timing; it synchronizes the device,
  // allocates a buffer of twice the L2 for the duration, and refuses a capturing stream. Its
  // outputs are those of run(). KMLA_GEMM_TUNE=0 makes it a plain run() (A/B timings).
  void tune(const Plan& plan, const TensorView& positions, const TensorView& hidden,
            LatentCache& cache, const TensorView& out, void* workspace, Stream stream) const;

  // plan + upload + run with a workspace the layer owns and grows (so not for capture).
  // md == nullptr is a memory-profiling run: out is zeroed.
  void forward(const TensorView& positions, const TensorView& hidden, const BatchMetadata* md,
               LatentCache& cache, const TensorView& out, Stream stream);

  // The device error flag kernels raise (see check_errors); shared by the layer's calls.
  int* error_flag() const;
  // Waits for `stream`, reads and clears the flag, and throws kmla::Error naming what the
  // kernels refused (slot, block id or position out of range). Synchronizes: call it when
  // you choose to (tests, debugging, after a step).
  void check_errors(Stream stream) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ---- public stages on the device ------------------------------------------------------
// As kmla::cache_insert, with every tensor in device memory. rope_table_device is a device
// copy of RopeTable rows ([rope_rows, 64] fp32) or nullptr (k_pe stored as given); with RoPE
// the call needs cache_insert_workspace_bytes(T) of workspace. Slots and positions are checked
// on the device: a bad one raises *error_flag (may be null) and writes nothing for that row.
size_t cache_insert_workspace_bytes(int64_t tokens);
void cache_insert(const TensorView& kv_c_normed, const TensorView& k_pe, const TensorView& positions,
                  const float* rope_table_device, int64_t rope_rows, const TensorView& slot_mapping,
                  LatentCache& cache, void* workspace, int* error_flag, Stream stream);

// As kmla::prefill_attention on device tensors: q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128]
// and out [Tq, H, 128] in one activation dtype (bf16/f16; the fp8 prefill mode casts its inputs
// to e4m3 values first, which 16-bit types hold exactly), lse f32 [Tq, H]; cu_q / cu_k device
// int32 [S + 1]; max_q_len bounds every sequence's query count (the grid is sized from it).
void prefill_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& cu_q, const TensorView& cu_k, int max_q_len, bool causal,
                       double softmax_scale, const TensorView& out, const TensorView& lse,
                       Stream stream);

// As kmla::decode_attention on device tensors, planned once per batch (host only), its
// metadata uploaded into a caller-owned workspace, then run without allocation or sync.
class DecodeAttention {
 public:
  // The decode requests of md (its first md.num_decodes) over `cache`, `heads` heads.
  // batch_invariant: as LayerOptions::batch_invariant.
  DecodeAttention(const BatchMetadata& md, const LatentCache& cache, int heads, bool portable = false,
                  bool batch_invariant = false);
  ~DecodeAttention();
  DecodeAttention(DecodeAttention&&) noexcept;
  DecodeAttention& operator=(DecodeAttention&&) noexcept;

  size_t workspace_bytes() const;
  void upload(void* workspace, Stream stream) const;
  // q [Td, H, 576]: the activation dtype, or e4m3 (plain fp8 cache) dequantized with q_scale;
  // out [Td, H, 512] in the activation dtype; lse f32 [Td, H]. error_flag (may be null) is
  // raised for a block id outside the cache.
  void run(const TensorView& q, float q_scale, const LatentCache& cache, double softmax_scale,
           const TensorView& out, const TensorView& lse, void* workspace, int* error_flag,
           Stream stream) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// As kmla::merge_attn_states on device tensors (outputs in the activation dtype).
void merge_attn_states(const TensorView& prefix_out, const TensorView& prefix_lse,
                       const TensorView& suffix_out, const TensorView& suffix_lse,
                       int64_t rows_with_prefix, const TensorView& out, const TensorView& out_lse,
                       Stream stream);

}  // namespace kmla::cuda
