// The public stages on device tensors: thin checks over the kernels in kernels.cu.
#include "cuda/common.cuh"
#include "cuda/kernels.cuh"
#include "kmla/cuda.hpp"

namespace kmla::cuda {

// The rotated rope part: act-rounded [T, 64] (what the rope kernel always writes) and, for the
// plain fp8 cache, the unrounded fp32 rotation [T, 64] after it.
size_t cache_insert_workspace_bytes(int64_t tokens) {
  return size_t(tokens) * kRopeDim * (sizeof(float) + sizeof(uint16_t));
}

void cache_insert(const TensorView& kv_c_normed, const TensorView& k_pe, const TensorView& positions,
                  const float* rope_table_device, int64_t rope_rows, const TensorView& slot_mapping,
                  LatentCache& cache, void* workspace, int* error_flag, Stream stream) {
  const DType act = kv_c_normed.dtype;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16, "kv_c_normed must be bf16 or f16, got ", dtype_name(act));
  check_tensor(kv_c_normed, "kv_c_normed", act, {-1, kKvLoraRank}, Device::cuda);
  const int64_t T = kv_c_normed.dim(0);
  check_tensor(k_pe, "k_pe", act, {T, kRopeDim}, Device::cuda);
  check_tensor(slot_mapping, "slot_mapping", DType::i64, {T}, Device::cuda);
  const CacheRef cref = cache_ref(cache);
  if (T == 0) return;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  CacheInsertParams ci;
  ci.kv = kv_c_normed.data;
  ci.kv_stride = kKvLoraRank;
  ci.rope = k_pe.data;
  ci.rope_stride = kRopeDim;
  ci.act = act;
  if (rope_table_device) {
    // Rotate into the workspace: fp32 for the plain fp8 cache (the seed's writer encodes the
    // unrounded rotation), act-rounded otherwise.
    check_tensor(positions, "positions", DType::i64, {T}, Device::cuda);
    KMLA_CHECK(workspace, "cache_insert with RoPE needs cache_insert_workspace_bytes(", T, ") of workspace");
    const bool f32 = cache.format() == CacheFormat::fp8;
    RopeParams rp;
    rp.table = rope_table_device;
    rp.table_rows = rope_rows;
    rp.positions = positions.as<const int64_t>();
    rp.rows = T;
    rp.k_pe = k_pe.data;
    rp.k_stride = kRopeDim;
    auto* f32_part = reinterpret_cast<float*>(static_cast<std::byte*>(workspace) + T * kRopeDim * 2);
    rp.k_act = workspace;
    rp.k_f32 = f32 ? f32_part : nullptr;
    rp.act = act;
    rp.error_flag = error_flag;
    rope(rp, s);
    ci.rope = f32 ? static_cast<void*>(f32_part) : workspace;
    ci.rope_f32 = f32;
  }
  ci.slots = slot_mapping.as<const int64_t>();
  ci.rows = T;
  ci.cache = cref;
  ci.error_flag = error_flag;
  cache_insert(ci, s);
}

void merge_attn_states(const TensorView& prefix_out, const TensorView& prefix_lse,
                       const TensorView& suffix_out, const TensorView& suffix_lse,
                       int64_t rows_with_prefix, const TensorView& out, const TensorView& out_lse,
                       Stream stream) {
  const DType act = prefix_out.dtype;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16, "prefix_out must be bf16 or f16, got ", dtype_name(act));
  check_tensor(prefix_out, "prefix_out", act, {-1, -1, -1}, Device::cuda);
  const int64_t rows = prefix_out.dim(0), H = prefix_out.dim(1), D = prefix_out.dim(2);
  check_tensor(prefix_lse, "prefix_lse", DType::f32, {rows, H}, Device::cuda);
  check_tensor(suffix_out, "suffix_out", act, {rows, H, D}, Device::cuda);
  check_tensor(suffix_lse, "suffix_lse", DType::f32, {rows, H}, Device::cuda);
  check_tensor(out, "out", act, {rows, H, D}, Device::cuda);
  if (out_lse.data) check_tensor(out_lse, "out_lse", DType::f32, {rows, H}, Device::cuda);
  KMLA_CHECK(rows_with_prefix >= 0 && rows_with_prefix <= rows, "rows_with_prefix ", rows_with_prefix,
             " is outside [0, ", rows, "]");
  MergeParams mp;
  mp.prefix = prefix_out.data;
  mp.prefix_lse = prefix_lse.as<const float>();
  mp.suffix = suffix_out.data;
  mp.suffix_lse = suffix_lse.as<const float>();
  mp.rows = rows;
  mp.rows_with_prefix = rows_with_prefix;
  mp.heads = int(H);
  mp.dim = int(D);
  mp.out = out.data;
  mp.out_lse = out_lse.data ? out_lse.as<float>() : nullptr;
  mp.act = act;
  merge_states(mp, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace kmla::cuda
