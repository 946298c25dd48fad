// MlaLayer on the GPU: the CPU backend's algorithm (src/cpu/layer.cpp) step for step, with
// cuBLASLt projections and our kernels, planned on the host and run without allocation or
// synchronization.
//
// Plan / run. plan() validates the batch on the host, lays out the workspace and writes the
// device metadata (block tables, lengths, slots, prefill offsets) into a host image;
// upload() copies that image to the front of the workspace; run() only launches. A plan made
// against a DecodeShape takes every launch dimension from the shape and the row count, and
// every length from the device metadata, so one captured graph replays any batch of that
// shape: kernels skip padded request slots (query_len 0) and the rows past the device's
// num_tokens come out zero (the gate zeroes o_proj's input rows, or a last kernel the output).
//
// Workspace (256-byte aligned regions, sizes in rows of the plan's launch_rows):
//   metadata image | x8 + scales (W8A8 hidden) | front [rows, front_width (+ H*128: g_proj's
//   output, small batches)] | q [rows, H*192] | k_rope [rows, 64] | fp32 rope copies (plain fp8
//   + RoPE) | decode: mqa, q8, latent, lse, split partials | attn [rows, H*128] | g [rows, H*128]
//   (unless in front) | attn8 + scales (W8A8 o_proj)
//   | prefill: kv [keys, hg*256] (+ W8A8 latents), new/ctx/chunk LSEs and outputs, gather rows.
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_set>

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/gemm.cuh"
#include "cuda/kernels.cuh"
#include "kmla/cuda.hpp"

namespace kmla::cuda {

namespace {

// Prefill keys and values of one head group are materialised per call ([keys, hg, 256] in
// act); head groups keep that under 1 GiB however long the prefill or context chunk is.
constexpr int64_t kPrefillKvBudgetBytes = int64_t(1) << 30;

struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
};

cudaStream_t raw(Stream s) { return reinterpret_cast<cudaStream_t>(s); }

// A bump allocator over the workspace: plan() records offsets, run() adds the base.
struct Layout {
  size_t size = 0;
  size_t take(size_t bytes) {
    const size_t at = size;
    size = (size + bytes + 255) & ~size_t(255);
    return at;
  }
};

template <class T>
void append_array(std::vector<std::byte>& image, size_t offset, const std::vector<T>& v) {
  if (!v.empty()) std::memcpy(image.data() + offset, v.data(), v.size() * sizeof(T));
}

// A projection weight on the device: 16-bit [n, k] or fp8 codes + block scales.
struct Projection {
  DeviceBuffer values;  // act [n, k] or e4m3 codes [n, k]
  DeviceBuffer scales;  // fp8 only
  bool fp8 = false;
  Fp8Weight f8;
  int64_t n = 0, k = 0;
};

DeviceBuffer upload_host(const void* src, size_t bytes) {
  DeviceBuffer b(bytes);
  if (bytes) KMLA_CUDA_CHECK(cudaMemcpy(b.data(), src, bytes, cudaMemcpyHostToDevice));
  return b;
}

Projection make_projection(const MlaWeights& w, const char* name, const HostTensor& t) {
  Projection p;
  const auto it = w.fp8.find(name);
  if (it == w.fp8.end()) {
    p.n = t.dim(0);
    p.k = t.dim(1);
    p.values = upload_host(t.data<std::byte>(), t.bytes());
    return p;
  }
  const Fp8BlockWeight& f = it->second;
  p.fp8 = true;
  p.n = f.codes.dim(0);
  p.k = f.codes.dim(1);
  p.values = upload_host(f.codes.data<std::byte>(), f.codes.bytes());
  p.scales = upload_host(f.scale_inv.data<std::byte>(), f.scale_inv.bytes());
  p.f8.codes = static_cast<const uint8_t*>(p.values.data());
  p.f8.scales = static_cast<const float*>(p.scales.data());
  p.f8.n = p.n;
  p.f8.k = p.k;
  p.f8.scale_cols = f.scale_inv.dim(1);
  p.f8.row_offset = f.row_offset;
  p.f8.col_offset = f.col_offset;
  return p;
}

// Rows [r0, r0 + n) of an fp8 weight (row_offset keeps the block scales right).
Fp8Weight fp8_rows(const Fp8Weight& w, int64_t r0, int64_t n) {
  Fp8Weight s = w;
  s.codes = w.codes + r0 * w.k;
  s.n = n;
  s.row_offset = int(w.row_offset + r0);
  return s;
}

// Device copies of RoPE tables, shared by every layer built on the same host table.
std::shared_ptr<DeviceBuffer> device_rope(const std::shared_ptr<const RopeTable>& table) {
  static std::mutex mu;
  static std::map<const RopeTable*, std::pair<std::weak_ptr<const RopeTable>, std::weak_ptr<DeviceBuffer>>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& entry = cache[table.get()];
  if (auto host = entry.first.lock(); host == table)
    if (auto dev = entry.second.lock()) return dev;
  auto dev = std::make_shared<DeviceBuffer>(
      upload_host(table->row(0), size_t(table->rows()) * kRopeDim * sizeof(float)));
  entry.first = table;
  entry.second = dev;
  return dev;
}

// cuBLASLt handles and workspaces, one pair (main, auxiliary stream) per device, shared by
// all layers: layers of one model run one after another on one stream (plus the aux stream),
// so they never use a workspace concurrently.
struct BlasPair {
  Blas main, aux;
};
BlasPair& blas_for_current_device() {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<BlasPair>> pairs;
  int dev = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto& p = pairs[dev];
  if (!p) p = std::make_unique<BlasPair>();
  return *p;
}

}  // namespace

// ---- the plan ------------------------------------------------------------------------------

struct Plan::Data {
  CacheGeometry geo;
  bool graph_safe = false;
  bool g_in_front = false;  // g_proj inside the front GEMM (stacked weight, a small batch)
  int64_t rows = 0;         // md.num_rows
  int64_t tokens = 0;       // md.num_tokens
  int64_t launch_rows = 0;  // rows every row-wise kernel and GEMM covers
  int64_t decode_rows = 0;  // rows the decode path covers (launch_rows when graph-safe)
  int decode_requests = 0;  // request slots the decode kernel covers
  int64_t Td = 0, Tp = 0, Tc = 0;
  int num_decodes = 0, num_context = 0, num_requests = 0;
  bool causal_decode = true;
  int max_blocks = 0;
  DecodePlan decode;
  // Decode-only batches: combine, W_UV and the gate as the decode's epilogue launch
  // (decode_attention_uv), W_UV[h] fetched once per head by multicast where it can be.
  bool decode_uv = false, decode_uv_multicast = true;
  // Prefill (eager plans only).
  int num_prefills = 0;
  int max_new_len = 0, max_ctx_q_len = 0;
  struct Chunk {
    int64_t start = 0, total = 0;
    int max_len = 0;
    size_t cu_off = 0;
  };
  std::vector<Chunk> chunks;
  int head_group = 1;
  int64_t max_keys = 0;  // rows of the kv buffer
  int64_t max_chunk = 0;

  // Device metadata image (offsets into the workspace == offsets into image).
  std::vector<std::byte> image;
  size_t off_tables = 0, off_seq = 0, off_qlen = 0, off_qstart = 0, off_ntok = 0, off_slots = 0,
         off_cu_new = 0, off_cu_ctx = 0, off_prefill_counter = 0;
  // The decode's balanced walk starts (decode_walk_table) and their key tile (0: none).
  size_t off_walk = 0;
  int walk_key_tile = 0;
  // Scratch regions.
  size_t off_x8 = 0, off_x8s = 0, off_front = 0, off_q = 0, off_krope = 0, off_kf32 = 0,
         off_qf32 = 0, off_mqa = 0, off_q8 = 0, off_latent = 0, off_dlse = 0, off_dwork = 0,
         off_attn = 0, off_g = 0, off_qc8 = 0, off_qc8s = 0, off_o8 = 0, off_o8s = 0,
         off_kv = 0, off_lat8 = 0, off_lat8s = 0, off_new_lse = 0, off_ctx_out = 0, off_ctx_lse = 0, off_chunk_out = 0,
         off_chunk_lse = 0, off_gather = 0;
  size_t workspace = 0;
};

size_t Plan::workspace_bytes() const { return data ? data->workspace : 0; }
int64_t Plan::num_rows() const { return data ? data->rows : 0; }
bool Plan::graph_safe() const { return data && data->graph_safe; }

// ---- the layer -------------------------------------------------------------------------

struct Layer::Impl {
  MlaConfig cfg;
  LayerOptions options;
  std::shared_ptr<const RopeTable> rope;
  std::shared_ptr<DeviceBuffer> rope_dev;
  int heads = 0;
  int64_t q_width = 0, attn_width = 0, kv_offset = 0, front_width = 0;
  float k_scale = 1.0f, q_scale = 1.0f;

  Projection q_first, kv_a, front;  // front: fused [q_first; kv_a (; g)] when all are 16-bit
  bool fused_front = false;
  bool g_stacked = false;  // g_proj's rows follow [q_first; kv_a] in `front`
  Projection q_b, kv_b, g, o;
  DeviceBuffer q_norm, kv_norm, w_uk_q, w_uv;
  bool any_hidden_fp8 = false;
  DeviceBuffer error_flag;
  cudaEvent_t fork = nullptr, join = nullptr;
  DeviceBuffer owned_workspace;  // forward() only

  Impl(const MlaConfig& c, const MlaWeights& w, LayerOptions opts, std::shared_ptr<const RopeTable> r);
  ~Impl();
  Plan plan(const BatchMetadata& md, const LatentCache& cache, const DecodeShape* shape) const;
  void run(const Plan& plan, const TensorView& positions, const TensorView& hidden,
           LatentCache& cache, const TensorView& out, void* workspace, Stream stream) const;
  void project(const Projection& w, int64_t M, const void* A, int64_t lda, const uint8_t* a8,
               const float* a8s, void* C, int64_t ldc, const Blas& blas, cudaStream_t s) const;
};

Layer::Impl::Impl(const MlaConfig& c, const MlaWeights& w, LayerOptions opts,
                  std::shared_ptr<const RopeTable> r)
    : cfg(c), options(std::move(opts)), rope(std::move(r)) {
  const DType act = options.activation;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16,
             "the activation dtype must be bf16 or f16, got ", dtype_name(act));
  w.validate(cfg);
  KMLA_CHECK(w.dtype() == act, "weights are ", dtype_name(w.dtype()), " but the activation dtype is ",
             dtype_name(act));
  KMLA_CHECK(cfg.tp_size == 1 || options.partial_output || options.all_reduce,
             "tensor-parallel world size ", cfg.tp_size,
             " needs LayerOptions::partial_output or an all_reduce callback");
  if (cfg.use_rope) {
    if (!rope) rope = RopeTable::build(cfg);
    KMLA_CHECK(rope->type() == cfg.rope.type, "RoPE table is of type ", rope_type_name(rope->type()),
               ", config '", cfg.name, "' uses ", rope_type_name(cfg.rope.type));
    rope_dev = device_rope(rope);
  } else {
    KMLA_CHECK(!rope, "a RoPE table was given but config '", cfg.name, "' has use_rope = false");
  }
  heads = cfg.local_heads();
  q_width = int64_t(heads) * kQkHeadDim;
  attn_width = int64_t(heads) * kVDim;
  k_scale = w.k_scale;
  q_scale = w.q_scale;

  const char* q_first_name = cfg.q_lora_rank ? "q_a_proj" : "q_proj";
  const HostTensor& q_first_t = cfg.q_lora_rank ? w.q_a_proj : w.q_proj;
  kv_offset = q_first_t.dim(0);
  front_width = kv_offset + kLatentDim;
  const bool q_first_fp8 = w.fp8.count(q_first_name) != 0;
  const bool kv_a_fp8 = w.fp8.count("kv_a_proj_with_mqa") != 0;
  fused_front = !q_first_fp8 && !kv_a_fp8;
  if (fused_front && cfg.use_output_gate && w.fp8.count("g_proj") == 0) {
    g_stacked = true;  // g_proj reads the same hidden states: one GEMM for small batches
  }
  if (fused_front) {  // one GEMM: [q_first; kv_a (; g_proj)] stacked rows
    HostTensor stacked(act, {front_width + (g_stacked ? attn_width : 0), int64_t(cfg.hidden_size)});
    std::byte* at = stacked.data<std::byte>();
    for (const HostTensor* t : {&q_first_t, &w.kv_a_proj_with_mqa, &w.g_proj}) {
      if (t == &w.g_proj && !g_stacked) break;
      std::memcpy(at, t->data<std::byte>(), t->bytes());
      at += t->bytes();
    }
    front = make_projection(w, "front", stacked);
  } else {
    q_first = make_projection(w, q_first_name, q_first_t);
    kv_a = make_projection(w, "kv_a_proj_with_mqa", w.kv_a_proj_with_mqa);
  }
  if (cfg.q_lora_rank) {
    q_b = make_projection(w, "q_b_proj", w.q_b_proj);
    q_norm = upload_host(w.q_a_layernorm.data<std::byte>(), w.q_a_layernorm.bytes());
  }
  kv_norm = upload_host(w.kv_a_layernorm.data<std::byte>(), w.kv_a_layernorm.bytes());
  kv_b = make_projection(w, "kv_b_proj", w.kv_b_proj);
  const AbsorbedWeights absorbed = absorb_kv_b(w.kv_b_proj, heads);
  // W_UK extended to the whole query head: [H, 192, 576] = [[W_UK^T, 0], [0, I_64]], so one
  // batched GEMM writes the decode query [q_nope W_UK^T | q_pe] (the pe columns are 1 x q_pe
  // plus exact zeros: a copy; the latent columns add exact zeros to the same products).
  {
    HostTensor uk(act, {heads, kQkHeadDim, kLatentDim});
    std::memset(uk.data<std::byte>(), 0, uk.bytes());
    const uint16_t one = act == DType::bf16 ? float_to_bf16(1.0f) : float_to_fp16(1.0f);
    const auto* src = absorbed.w_uk_t.data<uint16_t>();
    auto* dst = uk.data<uint16_t>();
    for (int h = 0; h < heads; ++h) {
      uint16_t* blk = dst + int64_t(h) * kQkHeadDim * kLatentDim;
      for (int p = 0; p < kNopeDim; ++p)
        std::memcpy(blk + int64_t(p) * kLatentDim, src + (int64_t(h) * kNopeDim + p) * kKvLoraRank,
                    size_t(kKvLoraRank) * 2);
      for (int j = 0; j < kRopeDim; ++j)
        blk[int64_t(kNopeDim + j) * kLatentDim + kKvLoraRank + j] = one;
    }
    w_uk_q = upload_host(uk.data<std::byte>(), uk.bytes());
  }
  w_uv = upload_host(absorbed.w_uv.data<std::byte>(), absorbed.w_uv.bytes());
  if (cfg.use_output_gate && !g_stacked) g = make_projection(w, "g_proj", w.g_proj);
  o = make_projection(w, "o_proj", w.o_proj);
  any_hidden_fp8 = q_first_fp8 || kv_a_fp8 || g.fp8;

  error_flag = DeviceBuffer(sizeof(int));
  KMLA_CUDA_CHECK(cudaMemset(error_flag.data(), 0, sizeof(int)));
  KMLA_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  KMLA_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  blas_for_current_device();  // create the handles now, not inside a capture
}

Layer::Impl::~Impl() {
  if (fork) cudaEventDestroy(fork);
  if (join) cudaEventDestroy(join);
}

void Layer::Impl::project(const Projection& w, int64_t M, const void* A, int64_t lda,
                          const uint8_t* a8, const float* a8s, void* C, int64_t ldc,
                          const Blas& blas, cudaStream_t s) const {
  if (w.fp8)
    blas.linear_fp8(M, a8, a8s, w.f8, C, ldc, options.activation, s);
  else
    blas.linear(M, w.n, w.k, A, lda, w.values.data(), C, ldc, options.activation, s);
}

Plan Layer::Impl::plan(const BatchMetadata& md, const LatentCache& cache, const DecodeShape* shape) const {
  KMLA_CHECK(cache.device() == Device::cuda, "the CUDA layer needs a cache in device memory, got a ",
             device_name(cache.device()), " cache");
  validate_batch(md, cache.geometry());
  const int64_t num_slots = cache.geometry().num_slots();
  for (int64_t t = 0; t < md.num_tokens; ++t)
    KMLA_CHECK(md.slot_mapping[size_t(t)] < num_slots, "slot ", md.slot_mapping[size_t(t)], " of token ",
               t, " is outside the cache's slots [0, ", num_slots, ")");
  const CacheFormat f = cache.format();
  KMLA_CHECK((f != CacheFormat::bf16 || options.activation == DType::bf16) &&
                 (f != CacheFormat::fp16 || options.activation == DType::f16),
             "the CUDA backend reads a ", cache_format_name(f), " cache only with ",
             cache_format_name(f), " activations, got ", dtype_name(options.activation),
             " (use the cache format 'auto')");
  KMLA_CHECK(cache.format() != CacheFormat::fp8 || cache.k_scale() == k_scale, "the fp8 cache's k_scale ",
             cache.k_scale(), " differs from the layer's k_scale ", k_scale,
             " (set both from the checkpoint's k_scale)");
  if (!md.causal_decode)
    KMLA_CHECK(cfg.non_causal_multi_token_decode, "metadata asks for non-causal multi-token decode "
               "but config '", cfg.name, "' does not set non_causal_multi_token_decode");
  if (cfg.non_causal_multi_token_decode)
    KMLA_CHECK(!md.causal_decode, "config '", cfg.name, "' sets non_causal_multi_token_decode but "
               "the metadata was planned causal (plan it with BatchOptions::non_causal_decode)");

  auto d = std::make_shared<Plan::Data>();
  d->geo = cache.geometry();
  d->rows = md.num_rows;
  d->tokens = md.num_tokens;
  d->Td = md.num_decode_tokens;
  d->Tp = md.num_tokens - md.num_decode_tokens;
  d->Tc = md.prefill_tokens_with_context;
  d->num_decodes = md.num_decodes;
  d->num_context = md.num_context_prefills;
  d->num_requests = md.num_requests;
  d->causal_decode = md.causal_decode;
  int requests = md.num_requests;  // request slots in the device arrays
  d->max_blocks = md.max_blocks_per_request;
  int max_qlen = std::max(1, md.max_decode_query_len);
  int64_t max_seq = 0;
  for (int r = 0; r < md.num_decodes; ++r) max_seq = std::max(max_seq, md.seq_lens[size_t(r)]);
  if (shape) {
    KMLA_CHECK(md.num_requests == md.num_decodes, "a graph-safe plan takes decode-only batches; this one has ",
               md.num_requests - md.num_decodes, " prefill requests");
    KMLA_CHECK(md.num_decodes <= shape->max_requests, "batch has ", md.num_decodes,
               " decode requests, the decode shape allows ", shape->max_requests);
    KMLA_CHECK(md.max_decode_query_len <= shape->max_query_len, "batch has a decode query of ",
               md.max_decode_query_len, " tokens, the decode shape allows ", shape->max_query_len);
    KMLA_CHECK(md.max_blocks_per_request <= shape->max_blocks, "batch needs ", md.max_blocks_per_request,
               " blocks per request, the decode shape allows ", shape->max_blocks);
    d->graph_safe = true;
    requests = shape->max_requests;
    d->max_blocks = shape->max_blocks;
    max_qlen = shape->max_query_len;
    max_seq = std::max(max_seq, shape->max_seq_len);
    d->launch_rows = md.num_rows;
    d->decode_rows = md.num_rows;
    d->decode_requests = shape->max_requests;
  } else {
    d->launch_rows = md.num_tokens;
    d->decode_rows = md.num_decode_tokens;
    d->decode_requests = md.num_decodes;
  }
  if (d->decode_requests > 0) {
    d->decode = plan_decode(d->decode_requests, heads, max_qlen, max_seq, options.portable,
                            options.batch_invariant, f);
    // KMLA_DECODE_UV=0 keeps the combine, batched W_UV and gate launches, and
    // KMLA_DECODE_UV_MULTICAST=0 the epilogue's unclustered form (A/B runs).
    d->decode_uv = d->Tp == 0 && env_switch("KMLA_DECODE_UV", true) && decode_uv_fits();
    d->decode_uv_multicast = env_switch("KMLA_DECODE_UV_MULTICAST", true);
  }

  // ---- metadata image -------------------------------------------------------------------
  Layout L;
  const int R = md.num_requests;
  d->off_tables = L.take(size_t(requests) * size_t(std::max(d->max_blocks, 1)) * 4);
  d->off_seq = L.take(size_t(requests) * 4);
  d->off_qlen = L.take(size_t(requests) * 4);
  d->off_qstart = L.take(size_t(requests + 1) * 4);
  d->off_ntok = L.take(4);
  d->off_slots = L.take(size_t(std::max<int64_t>(md.num_rows, 1)) * 8);
  // Prefill offsets: new tokens per prefill request, context rows per context request.
  d->num_prefills = R - md.num_decodes;
  std::vector<int32_t> cu_new(size_t(d->num_prefills) + 1), cu_ctx(size_t(d->num_context) + 1);
  for (int r = md.num_decodes; r <= R; ++r)
    cu_new[size_t(r - md.num_decodes)] = int32_t(md.query_start[size_t(r)] - md.num_decode_tokens);
  for (int j = 0; j <= d->num_context; ++j)
    cu_ctx[size_t(j)] = int32_t(md.query_start[size_t(md.num_decodes + j)] - md.num_decode_tokens);
  for (int r = md.num_decodes; r < R; ++r) d->max_new_len = std::max(d->max_new_len, md.query_lens[size_t(r)]);
  for (int j = 0; j < d->num_context; ++j)
    d->max_ctx_q_len = std::max(d->max_ctx_q_len, md.query_lens[size_t(md.num_decodes + j)]);
  d->off_cu_new = L.take(cu_new.size() * 4);
  d->off_cu_ctx = L.take(cu_ctx.size() * 4);
  // The wgmma prefill's work counter (PrefillParams::work_counter): zero in the image, and
  // every prefill launch of the step (in stream order) leaves it zero.
  d->off_prefill_counter = L.take(8);
  d->off_walk = L.take(decode_walk_table_bytes(d->decode, d->decode_requests));
  for (const ContextChunk& ch : md.context_chunks) {
    Plan::Data::Chunk c;
    c.start = ch.start;
    c.total = ch.total();
    for (int32_t len : ch.len) c.max_len = std::max(c.max_len, len);
    c.cu_off = L.take(ch.cu_len.size() * 4);
    d->chunks.push_back(c);
    d->max_chunk = std::max(d->max_chunk, c.total);
  }
  d->image.assign(L.size, std::byte{0});
  {
    std::vector<int32_t> tables(size_t(requests) * size_t(std::max(d->max_blocks, 1)), -1);
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < md.max_blocks_per_request; ++b)
        tables[size_t(r) * size_t(d->max_blocks) + size_t(b)] = md.block_table(r)[b];
    std::vector<int32_t> seq(size_t(requests), 0), qlen(size_t(requests), 0), qstart(size_t(requests) + 1);
    for (int r = 0; r < R; ++r) {
      KMLA_CHECK(md.seq_lens[size_t(r)] <= INT32_MAX, "sequence length ", md.seq_lens[size_t(r)],
                 " of request ", r, " does not fit the CUDA backend's int32 lengths");
      seq[size_t(r)] = int32_t(md.seq_lens[size_t(r)]);
      qlen[size_t(r)] = md.query_lens[size_t(r)];
    }
    for (int r = 0; r <= requests; ++r)
      qstart[size_t(r)] = int32_t(md.query_start[size_t(std::min(r, R))]);
    // Two tokens writing one slot: the later wins, as on the CPU (earlier writes dropped).
    std::vector<int64_t> slots(size_t(std::max<int64_t>(md.num_rows, 1)), -1);
    std::unordered_set<int64_t> seen;
    for (int64_t t = md.num_tokens - 1; t >= 0; --t) {
      const int64_t s = md.slot_mapping[size_t(t)];
      if (s >= 0 && seen.insert(s).second) slots[size_t(t)] = s;
    }
    const int32_t ntok = int32_t(md.num_tokens);
    append_array(d->image, d->off_tables, tables);
    append_array(d->image, d->off_seq, seq);
    append_array(d->image, d->off_qlen, qlen);
    append_array(d->image, d->off_qstart, qstart);
    std::memcpy(d->image.data() + d->off_ntok, &ntok, 4);
    append_array(d->image, d->off_slots, slots);
    append_array(d->image, d->off_cu_new, cu_new);
    append_array(d->image, d->off_cu_ctx, cu_ctx);
    d->walk_key_tile = decode_walk_table(d->decode, heads, d->causal_decode, f, d->decode_requests,
                                         seq.data(), qlen.data(), d->image.data() + d->off_walk);
    for (size_t c = 0; c < d->chunks.size(); ++c) {
      std::vector<int32_t> cu(md.context_chunks[c].cu_len.begin(), md.context_chunks[c].cu_len.end());
      append_array(d->image, d->chunks[c].cu_off, cu);
    }
  }

  // ---- scratch ----------------------------------------------------------------------------
  const size_t as = dtype_size(options.activation);
  const int64_t rows = std::max<int64_t>(d->launch_rows, 1);
  const int64_t hs = cfg.hidden_size;
  const int H = heads;
  if (any_hidden_fp8) {
    d->off_x8 = L.take(size_t(rows * hs));
    d->off_x8s = L.take(act_scale_elems(rows, hs) * 4);
  }
  // Batches under kAuxStreamMaxRows rows run the stacked g_proj inside the front GEMM (its
  // output [rows, attn_width] right of the front end's); larger ones keep it a GEMM of its own.
  d->g_in_front = g_stacked && rows < kAuxStreamMaxRows;
  d->off_front = L.take(size_t(rows * (front_width + (d->g_in_front ? attn_width : 0))) * as);
  if (cfg.q_lora_rank) {
    d->off_q = L.take(size_t(rows * q_width) * as);
    if (q_b.fp8) {  // W8A8 q_b: q_c quantized per 128
      d->off_qc8 = L.take(size_t(rows * *cfg.q_lora_rank));
      d->off_qc8s = L.take(act_scale_elems(rows, *cfg.q_lora_rank) * 4);
    }
  }
  d->off_krope = L.take(size_t(rows) * kRopeDim * as);
  const bool keep_f32 = cfg.use_rope && cache.format() == CacheFormat::fp8;
  const int64_t drows = std::max<int64_t>(d->decode_rows, 1);
  if (keep_f32) {
    d->off_kf32 = L.take(size_t(rows) * kRopeDim * 4);
    d->off_qf32 = L.take(size_t(drows) * H * kRopeDim * 4);
  }
  if (d->decode_rows > 0) {
    d->off_mqa = L.take(size_t(drows) * H * kLatentDim * as);
    if (cache.format() == CacheFormat::fp8) d->off_q8 = L.take(size_t(drows) * H * kLatentDim);
    d->off_latent = L.take(size_t(drows) * H * kKvLoraRank * as);
    d->off_dlse = L.take(size_t(drows) * H * 4);
    d->off_dwork = L.take(d->decode.workspace_bytes);
  }
  d->off_attn = L.take(size_t(rows * attn_width) * as);
  if (cfg.use_output_gate && !d->g_in_front) d->off_g = L.take(size_t(rows * attn_width) * as);
  if (o.fp8) {  // W8A8 o_proj: the gated attention output quantized per 128
    d->off_o8 = L.take(size_t(rows * attn_width));
    d->off_o8s = L.take(act_scale_elems(rows, attn_width) * 4);
  }
  if (d->Tp > 0) {
    d->max_keys = std::max(d->Tp, d->max_chunk);
    d->head_group = int(std::clamp<int64_t>(
        kPrefillKvBudgetBytes / (d->max_keys * kKvBOut * int64_t(as)), 1, H));
    d->off_kv = L.take(size_t(d->max_keys) * size_t(d->head_group) * kKvBOut * as);
    if (kv_b.fp8) {  // W8A8 kv_b: the latents (new tokens or a context chunk) quantized per 128
      d->off_lat8 = L.take(size_t(d->max_keys) * kKvLoraRank);
      d->off_lat8s = L.take(act_scale_elems(d->max_keys, kKvLoraRank) * 4);
    }
    d->off_new_lse = L.take(size_t(d->Tp) * H * 4);
    if (d->Tc > 0 && !d->chunks.empty()) {
      d->off_ctx_out = L.take(size_t(d->Tc * attn_width) * as);
      d->off_ctx_lse = L.take(size_t(d->Tc) * H * 4);
      d->off_chunk_out = L.take(size_t(d->Tc * attn_width) * as);
      d->off_chunk_lse = L.take(size_t(d->Tc) * H * 4);
      d->off_gather = L.take(size_t(d->max_chunk) * kLatentDim * as);
    }
  }
  d->workspace = L.size;
  Plan p;
  p.data = d;
  return p;
}


void Layer::Impl::run(const Plan& plan, const TensorView& positions, const TensorView& hidden,
                      LatentCache& cache, const TensorView& out, void* workspace,
                      Stream stream_) const {
  KMLA_CHECK(plan.data, "run() needs a plan from Layer::plan");
  const Plan::Data& d = *plan.data;
  const DType act = options.activation;
  const int64_t hs = cfg.hidden_size;
  check_tensor(hidden, "hidden_states", act, {d.rows, hs}, Device::cuda);
  check_tensor(out, "out", act, {d.rows, hs}, Device::cuda);
  check_tensor(positions, "positions", DType::i64, {d.rows}, Device::cuda);
  KMLA_CHECK(cache.device() == Device::cuda, "the CUDA layer needs a cache in device memory");
  const CacheGeometry& geo = cache.geometry();
  KMLA_CHECK(geo.format == d.geo.format && geo.block_size == d.geo.block_size &&
                 geo.num_blocks == d.geo.num_blocks && geo.block_stride == d.geo.block_stride,
             "the cache differs from the one the batch was planned against");
  KMLA_CHECK(workspace != nullptr || d.workspace == 0, "run() needs a workspace of ", d.workspace, " bytes");
  const bool reduce = cfg.tp_size > 1 && !options.partial_output;
  cudaStream_t s = raw(stream_);
  NvtxRange whole("kmla::Layer::run");

  auto* ws = static_cast<std::byte*>(workspace);
  auto at = [&](size_t off) { return static_cast<void*>(ws + off); };
  const size_t as = dtype_size(act);
  const int H = heads;
  const int64_t rows = d.launch_rows;
  const int64_t fw = d.g_in_front ? front_width + attn_width : front_width;  // front row stride
  DeviceBatch batch;
  batch.block_tables = static_cast<const int32_t*>(at(d.off_tables));
  batch.seq_lens = static_cast<const int32_t*>(at(d.off_seq));
  batch.query_lens = static_cast<const int32_t*>(at(d.off_qlen));
  batch.query_start = static_cast<const int32_t*>(at(d.off_qstart));
  batch.slot_mapping = static_cast<const int64_t*>(at(d.off_slots));
  batch.num_tokens = static_cast<const int32_t*>(at(d.off_ntok));
  batch.num_requests = d.num_requests;
  batch.max_blocks = d.max_blocks;
  batch.num_rows = d.rows;
  int* flag = static_cast<int*>(error_flag.data());
  const CacheRef cref = cache_ref(cache);
  const bool plain_fp8 = cache.format() == CacheFormat::fp8;
  const bool keep_f32 = cfg.use_rope && plain_fp8;
  BlasPair& blas = blas_for_current_device();

  if (rows > 0) {
    // ---- 1. front end ----------------------------------------------------------------------
    NvtxRange r("front end");
    auto* x8 = static_cast<uint8_t*>(at(d.off_x8));
    auto* x8s = static_cast<float*>(at(d.off_x8s));
    if (any_hidden_fp8) quantize_act_fp8(hidden.data, hs, rows, hs, act, x8, x8s, s);
    void* front_out = at(d.off_front);
    if (g_stacked && !d.g_in_front) {
      // Large batches: the stacked weight as two GEMMs, g_proj's into its own buffer (one GEMM
      // into the wide front buffer measured 1.7 % slower on the 8k-token K3 prefill).
      const auto* wg = static_cast<const std::byte*>(front.values.data()) + fw * hs * int64_t(as);
      blas.main.linear(rows, fw, hs, hidden.data, hs, front.values.data(), front_out, fw, act, s);
      blas.main.linear(rows, attn_width, hs, hidden.data, hs, wg, at(d.off_g), attn_width, act, s);
    } else if (fused_front) {
      project(front, rows, hidden.data, hs, nullptr, nullptr, front_out, fw, blas.main, s);
    } else {
      project(q_first, rows, hidden.data, hs, x8, x8s, front_out, fw, blas.main, s);
      project(kv_a, rows, hidden.data, hs, x8, x8s,
              static_cast<std::byte*>(front_out) + kv_offset * as, fw, blas.main, s);
    }
  }
  // A g_proj of its own (fp8 weights) depends only on the hidden states: on the auxiliary
  // stream for small batches.
  const bool own_g = cfg.use_output_gate && !g_stacked;
  const bool use_aux = own_g && options.aux_stream && rows > 0 && rows < kAuxStreamMaxRows;
  if (own_g && rows > 0) {
    cudaStream_t gs = use_aux ? raw(options.aux_stream) : s;
    if (use_aux) {
      KMLA_CUDA_CHECK(cudaEventRecord(fork, s));
      KMLA_CUDA_CHECK(cudaStreamWaitEvent(gs, fork, 0));
    }
    NvtxRange r("g_proj");
    project(g, rows, hidden.data, hs, static_cast<uint8_t*>(at(d.off_x8)), static_cast<float*>(at(d.off_x8s)),
            at(d.off_g), attn_width, use_aux ? blas.aux : blas.main, gs);
    if (use_aux) KMLA_CUDA_CHECK(cudaEventRecord(join, gs));
  }

  auto* front_out = static_cast<std::byte*>(at(d.off_front));
  std::byte* kv_c = front_out + kv_offset * as;   // [rows, 512] at stride fw
  std::byte* k_pe = kv_c + kKvLoraRank * as;      // [rows, 64] at stride fw
  std::byte* q = front_out;                       // [rows, H*192] at stride q_stride
  int64_t q_stride = fw;
  const std::byte* k_rope = k_pe;  // the rotated key rope part, act
  int64_t k_rope_stride = fw;
  if (rows > 0) {
    NvtxRange r("norms, q_b, rope, cache insert");
    NormSegment qn, kvn;
    kvn.x = kv_c;
    kvn.stride = fw;
    kvn.n = kKvLoraRank;
    kvn.weight = kv_norm.data();
    if (cfg.q_lora_rank) {
      qn.x = front_out;
      qn.stride = fw;
      qn.n = *cfg.q_lora_rank;
      qn.weight = q_norm.data();
    }
    CacheInsertParams ci;  // without RoPE the keys are final here: the norm's launch inserts them
    ci.kv = kv_c;
    ci.kv_stride = fw;
    ci.rope = k_pe;
    ci.rope_stride = fw;
    ci.act = act;
    ci.slots = batch.slot_mapping;
    ci.rows = rows;
    ci.cache = cref;
    ci.error_flag = flag;
    rms_norm(kvn, qn, rows, float(cfg.rms_norm_eps), act, s, cfg.use_rope ? nullptr : &ci);
    if (cfg.q_lora_rank) {
      const int64_t ql = *cfg.q_lora_rank;
      auto* qc8 = static_cast<uint8_t*>(at(d.off_qc8));
      auto* qc8s = static_cast<float*>(at(d.off_qc8s));
      if (q_b.fp8) quantize_act_fp8(front_out, fw, rows, ql, act, qc8, qc8s, s);
      project(q_b, rows, front_out, fw, qc8, qc8s, at(d.off_q), q_width, blas.main, s);
      q = static_cast<std::byte*>(at(d.off_q));
      q_stride = q_width;
    }
    if (cfg.use_rope) {
      RopeParams rp;
      rp.table = static_cast<const float*>(rope_dev->data());
      rp.table_rows = rope->rows();
      rp.positions = positions.as<const int64_t>();
      rp.rows = rows;
      rp.q = q;
      rp.q_stride = q_stride;
      rp.heads = H;
      rp.q_f32 = keep_f32 ? static_cast<float*>(at(d.off_qf32)) : nullptr;
      rp.q_f32_rows = keep_f32 ? d.decode_rows : 0;
      rp.k_pe = k_pe;
      rp.k_stride = fw;
      rp.k_act = at(d.off_krope);
      rp.k_f32 = keep_f32 ? static_cast<float*>(at(d.off_kf32)) : nullptr;
      rp.act = act;
      rp.error_flag = flag;
      ::kmla::cuda::rope(rp, s);
      k_rope = static_cast<const std::byte*>(at(d.off_krope));
      k_rope_stride = kRopeDim;
      ci.rope = keep_f32 ? at(d.off_kf32) : static_cast<const void*>(k_rope);
      ci.rope_stride = keep_f32 ? kRopeDim : k_rope_stride;
      ci.rope_f32 = keep_f32;
      cache_insert(ci, s);
    }
  }

  auto* attn = static_cast<std::byte*>(at(d.off_attn));  // [rows, H*128]
  const float scale = float(cfg.softmax_scale());
  // The gate's input. Padding rows (past *num_tokens) of out must be zero: when o_proj covers
  // every row of out from 16-bit inputs, the gate zeroes those rows of its input instead of
  // a kernel after it.
  const void* gate_in =
      d.g_in_front ? static_cast<const void*>(front_out + front_width * as) : at(d.off_g);
  const int64_t gate_stride = d.g_in_front ? fw : attn_width;
  const bool gate_zeroes = cfg.use_output_gate && rows == d.rows && !o.fp8;

  // ---- 4. decode rows: absorbed MQA over the cache ------------------------------------------
  if (d.decode_rows > 0) {
    NvtxRange r("decode attention");
    const int64_t Td = d.decode_rows;
    void* mqa = at(d.off_mqa);
    blas.main.batched_nn(H, Td, kLatentDim, kQkHeadDim, q, q_stride, kQkHeadDim, w_uk_q.data(),
                         kLatentDim, int64_t(kQkHeadDim) * kLatentDim, mqa, int64_t(H) * kLatentDim,
                         kLatentDim, act, s);
    if (plain_fp8) {  // the e4m3 query (its rope part from the unrounded fp32 rotation)
      DecodeQueryParams dq;
      dq.mqa = mqa;
      dq.rows = Td;
      dq.heads = H;
      dq.q = q;
      dq.q_stride = q_stride;
      dq.q_rope_f32 = keep_f32 ? static_cast<const float*>(at(d.off_qf32)) : nullptr;
      dq.q8 = static_cast<uint8_t*>(at(d.off_q8));
      dq.q_scale = q_scale;
      dq.act = act;
      decode_query(dq, s);
    }
    DecodeParams dp;
    dp.q = plain_fp8 ? at(d.off_q8) : mqa;
    dp.q_fp8 = plain_fp8;
    dp.q_scale = q_scale;
    dp.cache = cref;
    dp.batch = batch;
    dp.batch.num_requests = d.decode_requests;
    dp.heads = H;
    dp.causal = d.causal_decode;
    if (d.walk_key_tile > 0) {
      dp.walk_table = at(d.off_walk);
      dp.walk_key_tile = d.walk_key_tile;
    }
    dp.softmax_scale = scale;
    dp.act = act;
    dp.out = at(d.off_latent);
    dp.lse = static_cast<float*>(at(d.off_dlse));
    dp.error_flag = flag;
    if (d.decode_uv) {  // every row is a decode row: W_UV and the gate in the epilogue
      DecodeUvParams uv;
      uv.w_uv = w_uv.data();
      uv.attn = attn;
      uv.attn_stride = attn_width;
      if (cfg.use_output_gate) {
        if (use_aux) KMLA_CUDA_CHECK(cudaStreamWaitEvent(s, join, 0));
        uv.g = gate_in;
        uv.g_stride = gate_stride;
      }
      uv.rows = Td;
      uv.num_tokens = gate_zeroes ? batch.num_tokens : nullptr;
      uv.multicast = d.decode_uv_multicast;
      decode_attention_uv(dp, d.decode, at(d.off_dwork), uv, s);
    } else {
      decode_attention(dp, d.decode, at(d.off_dwork), s);
      blas.main.batched_nn(H, Td, kVDim, kKvLoraRank, at(d.off_latent), int64_t(H) * kKvLoraRank,
                           kKvLoraRank, w_uv.data(), kVDim, int64_t(kKvLoraRank) * kVDim, attn,
                           attn_width, kVDim, act, s);
    }
  }

  // ---- 5. prefill rows: MHA over the new tokens, then the cached context ----------------------
  if (d.Tp > 0) {
    NvtxRange r("prefill attention");
    const int64_t Td = d.Td, Tp = d.Tp;
    std::byte* qp = q + Td * q_stride * as;
    if (options.fp8_prefill) e4m3_roundtrip(qp, Tp, q_width, q_stride, act, s);
    auto* kv = static_cast<std::byte*>(at(d.off_kv));
    const int hg_max = d.head_group;
    // Attention of query rows `qrows` against keys from latents (kv_c rows at `latent`) and
    // rope keys (`rope_keys`), per head group; out/lse at [*, H*128] / [*, H].
    auto attend = [&](int64_t nkeys, const std::byte* latent, int64_t latent_stride,
                      std::byte* rope_keys, int64_t rope_stride, const int32_t* cu_q,
                      const int32_t* cu_k, int nseq, int max_q, bool causal, std::byte* o, float* lse) {
      const uint8_t* lat8 = nullptr;
      const float* lat8s = nullptr;
      if (kv_b.fp8) {
        quantize_act_fp8(latent, latent_stride, nkeys, kKvLoraRank, act, static_cast<uint8_t*>(at(d.off_lat8)),
                         static_cast<float*>(at(d.off_lat8s)), s);
        lat8 = static_cast<const uint8_t*>(at(d.off_lat8));
        lat8s = static_cast<const float*>(at(d.off_lat8s));
      }
      if (options.fp8_prefill) e4m3_roundtrip(rope_keys, nkeys, kRopeDim, rope_stride, act, s);
      for (int h0 = 0; h0 < H; h0 += hg_max) {
        const int hg = std::min(hg_max, H - h0);
        const int64_t kv_width = int64_t(hg) * kKvBOut;
        if (kv_b.fp8) {
          blas.main.linear_fp8(nkeys, lat8, lat8s, fp8_rows(kv_b.f8, int64_t(h0) * kKvBOut, kv_width), kv,
                               kv_width, act, s);
        } else {
          blas.main.linear(nkeys, kv_width, kKvLoraRank, latent, latent_stride,
                           static_cast<const std::byte*>(kv_b.values.data()) + int64_t(h0) * kKvBOut * kKvLoraRank * as,
                           kv, kv_width, act, s);
        }
        if (options.fp8_prefill) e4m3_roundtrip(kv, nkeys, kv_width, kv_width, act, s);
        PrefillParams pp;
        pp.q = {qp + int64_t(h0) * kQkHeadDim * as, q_stride, kQkHeadDim};
        pp.k_nope = {kv, kv_width, kKvBOut};
        pp.k_rope = {rope_keys, rope_stride, 0};
        pp.v = {kv + kNopeDim * as, kv_width, kKvBOut};
        pp.out = o + int64_t(h0) * kVDim * as;
        pp.out_row_stride = attn_width;
        pp.out_head_stride = kVDim;
        pp.lse = lse + h0;
        pp.lse_row_stride = H;
        pp.heads = hg;
        pp.cu_q = cu_q;
        pp.cu_k = cu_k;
        pp.num_seqs = nseq;
        pp.max_q_len = max_q;
        pp.total_q = Tp;  // new tokens and context chunks both query prefill rows
        pp.work_counter = static_cast<int32_t*>(at(d.off_prefill_counter));
        pp.causal = causal;
        pp.softmax_scale = scale;
        pp.act = act;
        pp.portable = options.portable;
        prefill_attention(pp, s);
      }
    };
    // New tokens, causal within each request: the suffix of the final merge. In the fp8
    // prefill mode the rope keys are cast in place (the cache already has them).
    std::byte* new_out = attn + Td * attn_width * as;
    auto* new_lse = static_cast<float*>(at(d.off_new_lse));
    const auto* cu_new = static_cast<const int32_t*>(at(d.off_cu_new));
    attend(Tp, kv_c + Td * fw * as, fw, const_cast<std::byte*>(k_rope) + Td * k_rope_stride * as,
           k_rope_stride, cu_new, cu_new, d.num_prefills, d.max_new_len, true, new_out, new_lse);

    // Cached context, chunk by chunk, merged left to right into the prefix.
    if (d.num_context > 0 && d.Tc > 0 && !d.chunks.empty()) {
      auto* ctx_out = static_cast<std::byte*>(at(d.off_ctx_out));
      auto* ctx_lse = static_cast<float*>(at(d.off_ctx_lse));
      auto* chunk_out = static_cast<std::byte*>(at(d.off_chunk_out));
      auto* chunk_lse = static_cast<float*>(at(d.off_chunk_lse));
      auto* gathered = static_cast<std::byte*>(at(d.off_gather));
      const auto* cu_ctx = static_cast<const int32_t*>(at(d.off_cu_ctx));
      // Merges `suffix` into the context prefix (ctx_out / ctx_lse) by LSE, into `o` / `o_lse`.
      auto merge = [&](const std::byte* suffix, const float* suffix_lse, int64_t rows_, int64_t with_prefix,
                       std::byte* o, float* o_lse) {
        MergeParams mp;
        mp.prefix = ctx_out;
        mp.prefix_lse = ctx_lse;
        mp.suffix = suffix;
        mp.suffix_lse = suffix_lse;
        mp.rows = rows_;
        mp.rows_with_prefix = with_prefix;
        mp.heads = H;
        mp.dim = kVDim;
        mp.out = o;
        mp.out_lse = o_lse;
        mp.act = act;
        merge_states(mp, s);
      };
      bool have_prefix = false;
      for (const Plan::Data::Chunk& ch : d.chunks) {
        if (ch.total == 0) continue;
        GatherParams gp;
        gp.cache = cref;
        gp.batch = batch;
        gp.first_request = d.num_decodes;
        gp.cu_len = static_cast<const int32_t*>(at(ch.cu_off));
        gp.num_requests = d.num_context;
        gp.start = ch.start;
        gp.total_rows = ch.total;
        gp.out = gathered;
        gp.act = act;
        gp.error_flag = flag;
        gather_context(gp, s);
        std::byte* dst = have_prefix ? chunk_out : ctx_out;
        float* dst_lse = have_prefix ? chunk_lse : ctx_lse;
        attend(ch.total, gathered, kLatentDim, gathered + kKvLoraRank * as, kLatentDim, cu_ctx,
               gp.cu_len, d.num_context, d.max_ctx_q_len, false, dst, dst_lse);
        if (have_prefix) merge(chunk_out, chunk_lse, d.Tc, d.Tc, ctx_out, ctx_lse);
        have_prefix = true;
      }
      // final = merge(prefix = context, suffix = new tokens)
      if (have_prefix) merge(new_out, new_lse, Tp, d.Tc, new_out, nullptr);
    }
  }

  // ---- 6. gate and o_proj ---------------------------------------------------------------
  if (rows > 0) {
    NvtxRange r("gate, o_proj");
    if (cfg.use_output_gate && !(d.decode_uv && d.decode_rows > 0)) {
      if (use_aux) KMLA_CUDA_CHECK(cudaStreamWaitEvent(s, join, 0));
      gate(attn, gate_in, gate_stride, rows, attn_width, act, s,
           gate_zeroes ? batch.num_tokens : nullptr);
    }
    auto* o8 = static_cast<uint8_t*>(at(d.off_o8));
    auto* o8s = static_cast<float*>(at(d.off_o8s));
    if (o.fp8) quantize_act_fp8(attn, attn_width, rows, attn_width, act, o8, o8s, s);
    project(o, rows, attn, attn_width, o8, o8s, out.data, hs, blas.main, s);
  }
  if (d.rows > 0 && !gate_zeroes)
    zero_padding_rows(out.data, d.rows, hs * int64_t(as), batch.num_tokens, s);
  if (reduce) options.all_reduce(out, stream_);
}

// ---- Layer ----------------------------------------------------------------------------------

Layer::Layer(const MlaConfig& cfg, const MlaWeights& weights, LayerOptions options,
             std::shared_ptr<const RopeTable> rope)
    : impl_(std::make_unique<Impl>(cfg, weights, std::move(options), std::move(rope))) {}
Layer::~Layer() = default;
Layer::Layer(Layer&&) noexcept = default;
Layer& Layer::operator=(Layer&&) noexcept = default;

const MlaConfig& Layer::config() const { return impl_->cfg; }
const LayerOptions& Layer::options() const { return impl_->options; }

Plan Layer::plan(const BatchMetadata& md, const LatentCache& cache, const DecodeShape* shape) const {
  return impl_->plan(md, cache, shape);
}

void Layer::upload(const Plan& plan, void* workspace, Stream stream) const {
  KMLA_CHECK(plan.data, "upload() needs a plan from Layer::plan");
  const auto& image = plan.data->image;
  if (!image.empty())
    KMLA_CUDA_CHECK(cudaMemcpyAsync(workspace, image.data(), image.size(), cudaMemcpyHostToDevice, raw(stream)));
}

void Layer::run(const Plan& plan, const TensorView& positions, const TensorView& hidden,
                LatentCache& cache, const TensorView& out, void* workspace, Stream stream) const {
  impl_->run(plan, positions, hidden, cache, out, workspace, stream);
}

void Layer::tune(const Plan& plan, const TensorView& positions, const TensorView& hidden,
                 LatentCache& cache, const TensorView& out, void* workspace, Stream stream) const {
  KMLA_CHECK(
      !stream_capturing(raw(stream)),
      "Layer::tune: the stream is capturing a graph; tune with an eager call before the capture");
  BlasPair& blas = blas_for_current_device();
  // Both handles tune while the run is in flight; set_tuning(false) frees the flush buffer,
  // which waits for the device.
  struct Tuning {
    Blas& b;
    explicit Tuning(Blas& blas) : b(blas) { b.set_tuning(true); }
    ~Tuning() { b.set_tuning(false); }
    Tuning(const Tuning&) = delete;
    Tuning& operator=(const Tuning&) = delete;
  } main_on(blas.main), aux_on(blas.aux);
  impl_->run(plan, positions, hidden, cache, out, workspace, stream);
}

void Layer::forward(const TensorView& positions, const TensorView& hidden, const BatchMetadata* md,
                    LatentCache& cache, const TensorView& out, Stream stream) {
  const DType act = impl_->options.activation;
  check_tensor(hidden, "hidden_states", act, {-1, int64_t(impl_->cfg.hidden_size)}, Device::cuda);
  check_tensor(out, "out", act, {hidden.dim(0), int64_t(impl_->cfg.hidden_size)}, Device::cuda);
  if (md == nullptr) {  // memory-profiling run: zeros, no cache access
    if (out.bytes()) KMLA_CUDA_CHECK(cudaMemsetAsync(out.data, 0, out.bytes(), raw(stream)));
    if (impl_->cfg.tp_size > 1 && !impl_->options.partial_output) impl_->options.all_reduce(out, stream);
    return;
  }
  KMLA_CHECK(md->num_rows == hidden.dim(0), "metadata has ", md->num_rows, " rows, hidden_states has ",
             hidden.dim(0));
  const Plan p = plan(*md, cache);
  if (impl_->owned_workspace.bytes() < p.workspace_bytes()) {
    // The old workspace may still be in use by queued work on `stream`.
    KMLA_CUDA_CHECK(cudaStreamSynchronize(raw(stream)));
    impl_->owned_workspace = DeviceBuffer(p.workspace_bytes());
  }
  upload(p, impl_->owned_workspace.data(), stream);
  if (impl_->options.tune_gemms)
    tune(p, positions, hidden, cache, out, impl_->owned_workspace.data(), stream);
  else
    run(p, positions, hidden, cache, out, impl_->owned_workspace.data(), stream);
}

int* Layer::error_flag() const { return static_cast<int*>(impl_->error_flag.data()); }

void Layer::check_errors(Stream stream) const {
  int flag = 0;
  KMLA_CUDA_CHECK(cudaMemcpyAsync(&flag, impl_->error_flag.data(), sizeof(int), cudaMemcpyDeviceToHost, raw(stream)));
  KMLA_CUDA_CHECK(cudaStreamSynchronize(raw(stream)));
  if (flag == 0) return;
  KMLA_CUDA_CHECK(cudaMemsetAsync(impl_->error_flag.data(), 0, sizeof(int), raw(stream)));
  KMLA_CHECK(false, "CUDA kernels refused input (flag ", flag, "):",
             (flag & kErrBadSlot) ? " a cache slot outside the cache;" : "",
             (flag & kErrBadBlockId) ? " a block id outside the cache;" : "",
             (flag & kErrBadPosition) ? " a position outside the RoPE table;" : "",
             " the offending rows were not written");
}

}  // namespace kmla::cuda
