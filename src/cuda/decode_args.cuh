// The flattened launch arguments of the decode kernels (decode_attention.cu's mma.sync
// kernel and combine, decode_sm90.cu's wgmma kernel): one plain struct built on the host
// from DecodeParams / DecodePlan and passed by value to every decode kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"
#include "kmla/config.hpp"

namespace kmla::cuda {

// What the kernel needs, flattened from DecodeParams / DecodePlan on the host.
struct DecodeArgs {
  const void* q;  // [rows, heads, 576] T, or e4m3 codes when q_fp8
  bool q_fp8;
  const std::byte* cache_base;  // block b at cache_base + b * block_stride
  int64_t block_stride;         // bytes
  int64_t num_blocks;
  int block_size;
  int entry_bytes;  // 1152, 576 or 656
  CacheFormat format;
  const int32_t* block_tables;  // [num_requests, max_blocks]
  const int32_t* seq_lens;      // [num_requests]
  const int32_t* query_lens;    // [num_requests]
  const int32_t* query_start;   // [num_requests + 1]
  int max_blocks;
  int num_requests;
  int heads;
  bool causal;
  float score_scale_log2;  // softmax_scale (* q_scale * k_scale on plain fp8) * log2(e)
  float v_scale;           // k_scale on the plain fp8 cache, else 1
  void* out;               // [rows, heads, 512] T
  float* lse;              // [rows, heads]
  int* error_flag;
  int num_splits;
  bool batch_invariant;  // split boundaries from each request's own length
  bool direct_out;       // one split and not invariant: write out / lse, skip the combine
  int max_rows;   // plan.max_query_len * heads: workspace rows per request
  float* ws_o;    // [num_requests, max_rows, num_splits, 512] fp32 (normalised partials)
  float* ws_lse;  // [num_requests, max_rows, num_splits] natural log, -inf = empty
};

}  // namespace kmla::cuda
