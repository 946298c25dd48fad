#include "kmla/cache.hpp"

#include <cfloat>
#include <cmath>
#include <cstring>

#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"

namespace kmla {

size_t cache_entry_bytes(CacheFormat f) {
  switch (f) {
    case CacheFormat::bf16:
    case CacheFormat::fp16: return kLatentDim * 2;
    case CacheFormat::fp8: return kLatentDim;
    case CacheFormat::fp8_ds_mla: return 656;
  }
  return 0;
}

const char* cache_format_name(CacheFormat f) {
  switch (f) {
    case CacheFormat::bf16: return "bf16";
    case CacheFormat::fp16: return "fp16";
    case CacheFormat::fp8: return "fp8";
    case CacheFormat::fp8_ds_mla: return "fp8_ds_mla";
  }
  return "?";
}

CacheFormat parse_cache_format(std::string_view s, DType activation) {
  if (s == "auto") {
    KMLA_CHECK(activation == DType::bf16 || activation == DType::f16,
               "cache dtype 'auto' needs a bf16 or f16 activation dtype, got ", dtype_name(activation));
    return activation == DType::bf16 ? CacheFormat::bf16 : CacheFormat::fp16;
  }
  if (s == "bf16" || s == "bfloat16") return CacheFormat::bf16;
  if (s == "fp16" || s == "float16" || s == "half") return CacheFormat::fp16;
  if (s == "fp8" || s == "fp8_e4m3") return CacheFormat::fp8;
  if (s == "fp8_ds_mla") return CacheFormat::fp8_ds_mla;
  KMLA_CHECK(false, "unknown cache dtype '", s, "' (auto, bf16, fp16, fp8, fp8_e4m3, fp8_ds_mla)");
  return CacheFormat::bf16;
}

float ds_mla_tile_scale(float amax, TileScaleRule rule) {
  if (rule == TileScaleRule::amax_448) return std::fmax(amax / kFp8Max, FLT_MIN);
  const float v = std::fmax(amax / kFp8Max, 1e-4f);
  if (!std::isfinite(v)) return v;
  // Smallest power of two >= v, computed exactly (vLLM writes exp2f(ceilf(log2f(v)))).
  int e;
  const float m = std::frexp(v, &e);  // v = m * 2^e, m in [0.5, 1)
  return m == 0.5f ? v : std::ldexp(1.0f, e);
}

void RowCodec::encode(const float* x, std::byte* dst) const {
  switch (format) {
    case CacheFormat::bf16:
    case CacheFormat::fp16: {
      uint16_t v[kLatentDim];
      for (int i = 0; i < kLatentDim; ++i)
        v[i] = format == CacheFormat::bf16 ? float_to_bf16(x[i]) : float_to_fp16(x[i]);
      std::memcpy(dst, v, sizeof v);
      return;
    }
    case CacheFormat::fp8: {
      const float inv = 1.0f / k_scale;  // the seed's kernels multiply by a precomputed reciprocal
      auto* out = reinterpret_cast<uint8_t*>(dst);
      for (int i = 0; i < kLatentDim; ++i) out[i] = e4m3_scaled_clamped(x[i], inv);
      return;
    }
    case CacheFormat::fp8_ds_mla: {
      auto* out = reinterpret_cast<uint8_t*>(dst);
      float scales[kDsMlaTiles];
      for (int t = 0; t < kDsMlaTiles; ++t) {
        float amax = 0.0f;
        for (int i = 0; i < kDsMlaTile; ++i) amax = std::fmax(amax, std::fabs(x[t * kDsMlaTile + i]));
        scales[t] = ds_mla_tile_scale(amax, tile_rule);
        for (int i = 0; i < kDsMlaTile; ++i) {
          const int j = t * kDsMlaTile + i;
          out[j] = float_to_e4m3_sat(x[j] / scales[t]);  // IEEE divide, as vLLM's writer
        }
      }
      std::memcpy(dst + kDsMlaScaleOffset, scales, sizeof scales);
      uint16_t rope[kRopeDim];
      for (int i = 0; i < kRopeDim; ++i) rope[i] = float_to_bf16(x[kKvLoraRank + i]);
      std::memcpy(dst + kDsMlaRopeOffset, rope, sizeof rope);
      return;
    }
  }
}

void RowCodec::decode(const std::byte* src, float* x) const {
  switch (format) {
    case CacheFormat::bf16:
    case CacheFormat::fp16: {
      uint16_t v[kLatentDim];
      std::memcpy(v, src, sizeof v);
      for (int i = 0; i < kLatentDim; ++i)
        x[i] = format == CacheFormat::bf16 ? bf16_to_float(v[i]) : fp16_to_float(v[i]);
      return;
    }
    case CacheFormat::fp8: {
      const auto* in = reinterpret_cast<const uint8_t*>(src);
      for (int i = 0; i < kLatentDim; ++i) x[i] = e4m3_to_float(in[i]) * k_scale;
      return;
    }
    case CacheFormat::fp8_ds_mla: {
      const auto* in = reinterpret_cast<const uint8_t*>(src);
      float scales[kDsMlaTiles];
      std::memcpy(scales, src + kDsMlaScaleOffset, sizeof scales);
      for (int i = 0; i < kKvLoraRank; ++i)
        x[i] = round_bf16(e4m3_to_float(in[i]) * scales[i / kDsMlaTile]);
      uint16_t rope[kRopeDim];
      std::memcpy(rope, src + kDsMlaRopeOffset, sizeof rope);
      for (int i = 0; i < kRopeDim; ++i) x[kKvLoraRank + i] = bf16_to_float(rope[i]);
      return;
    }
  }
}

void CacheGeometry::validate() const {
  KMLA_CHECK(block_size >= 1 && block_size <= 1024, "cache block size must be in [1, 1024], got ",
             block_size);
  KMLA_CHECK(num_blocks >= 1, "cache must have at least one block, got ", num_blocks);
  const int64_t dense = int64_t(block_size) * int64_t(entry_bytes());
  KMLA_CHECK(block_stride >= dense, "cache block stride ", block_stride,
             " bytes is smaller than one block (", dense, " bytes)");
}

LatentCache LatentCache::allocate(CacheFormat format, int block_size, int64_t num_blocks,
                                  float k_scale, TileScaleRule rule) {
  LatentCache c;
  c.geo_ = {format, block_size, num_blocks, int64_t(block_size) * int64_t(cache_entry_bytes(format))};
  c.geo_.validate();
  c.set_k_scale(k_scale);
  c.codec_.format = format;
  c.codec_.tile_rule = rule;
  const size_t bytes = size_t(c.geo_.block_stride) * size_t(num_blocks);
  c.owned_ = std::shared_ptr<std::byte[]>(new std::byte[bytes]());
  c.base_ = c.owned_.get();
  return c;
}

LatentCache LatentCache::borrow(void* base, Device device, CacheFormat format, int block_size,
                                int64_t num_blocks, int64_t block_stride, float k_scale,
                                TileScaleRule rule) {
  KMLA_CHECK(base != nullptr, "borrowed cache memory is null");
  LatentCache c;
  c.geo_ = {format, block_size, num_blocks, block_stride};
  c.geo_.validate();
  c.set_k_scale(k_scale);
  c.codec_.format = format;
  c.codec_.tile_rule = rule;
  c.device_ = device;
  c.base_ = static_cast<std::byte*>(base);
  return c;
}

void LatentCache::set_k_scale(float s) {
  KMLA_CHECK(std::isfinite(s) && s > 0, "cache k_scale must be finite and positive, got ", s);
  codec_.k_scale = s;
}

std::byte* LatentCache::slot_ptr(int64_t slot) const {
  KMLA_CHECK(device_ == Device::cpu, "cache rows can only be addressed on the host");
  KMLA_CHECK(slot >= 0 && slot < geo_.num_slots(), "cache slot ", slot, " is outside [0, ",
             geo_.num_slots(), ")");
  return base_ + (slot / geo_.block_size) * geo_.block_stride +
         (slot % geo_.block_size) * int64_t(geo_.entry_bytes());
}

LatentCache LatentCache::clone() const {
  KMLA_CHECK(device_ == Device::cpu, "only host caches can be cloned");
  LatentCache c = *this;
  // Only the span the rows occupy: a borrowed cache need not own the gap after its last
  // block (the stride may interleave other layers' blocks), so stride * num_blocks could
  // read past the caller's memory.
  const size_t bytes = size_t(geo_.block_stride) * size_t(geo_.num_blocks - 1) +
                       size_t(geo_.block_size) * geo_.entry_bytes();
  c.owned_ = std::shared_ptr<std::byte[]>(new std::byte[bytes]);
  std::memcpy(c.owned_.get(), base_, bytes);
  c.base_ = c.owned_.get();
  return c;
}

}  // namespace kmla
