// The paged latent cache: one 576-wide row per token ([kv_c_normed 512 | k_pe 64]),
// stored in one of three formats, in blocks of block_size rows. The memory is owned by
// kmla or borrowed from the caller (base pointer + block stride in bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kmla/tensor.hpp"

namespace kmla {

enum class CacheFormat : uint8_t {
  bf16,        // 576 x bf16 = 1152 B
  fp16,        // 576 x fp16 = 1152 B (the "auto" cache of an fp16 model)
  fp8,         // 576 x e4m3 with one per-tensor scale (k_scale) = 576 B
  fp8_ds_mla,  // 512 e4m3 in 4 tiles | 4 fp32 tile scales | 64 bf16 rope = 656 B
};

// How fp8_ds_mla picks a tile's scale.
enum class TileScaleRule : uint8_t {
  power_of_two,  // smallest power of two >= max(amax/448, 1e-4) (current vLLM/FlashMLA)
  amax_448,      // max(amax/448, FLT_MIN) (older vLLM)
};

inline constexpr int kDsMlaTile = 128;
inline constexpr int kDsMlaTiles = 4;
inline constexpr size_t kDsMlaScaleOffset = 512;  // bytes
inline constexpr size_t kDsMlaRopeOffset = 528;   // bytes

size_t cache_entry_bytes(CacheFormat f);
const char* cache_format_name(CacheFormat f);
// Accepts bf16, bfloat16, fp16, float16, fp8, fp8_e4m3, fp8_ds_mla, and "auto"
// (the activation dtype: bf16 or f16).
CacheFormat parse_cache_format(std::string_view s, DType activation = DType::bf16);

// ---- row codecs ------------------------------------------------------------------
// Encoding takes the row as fp32 values: kv part exactly as the writer sees it (bf16
// values for a bf16 model), rope part as rotated (already bf16-rounded on the bf16 and
// fp8_ds_mla paths, raw fp32 on the plain-fp8 path, as the seed's kernels do).
//
// NaN and infinity:
//  * bf16/fp16: NaN stays NaN; overflow becomes inf.
//  * fp8: x * k_scale_inv is clamped with fmaxf/fminf first, so NaN -> -448 and
//    +-inf -> +-448, exactly as the seed's fused writer does.
//  * fp8_ds_mla: the tile amax ignores NaN (fmaxf); NaN elements encode as 0x7F (NaN).
//    An infinite element makes the tile's amax and scale inf: finite elements encode as
//    zero, the inf as NaN (inf/inf), and the whole tile decodes to NaN (code * inf).
//    Other tiles and the rope part are unaffected. Garbage in stays visibly garbage.
struct RowCodec {
  CacheFormat format = CacheFormat::bf16;
  float k_scale = 1.0f;  // plain fp8 only: stored value = x / k_scale
  TileScaleRule tile_rule = TileScaleRule::power_of_two;

  void encode(const float* row576, std::byte* dst) const;
  // Dequantizes to fp32: bf16/fp16 exact; fp8: float(code)*k_scale; fp8_ds_mla:
  // bf16(float(code)*tile_scale) for the kv part (the gather's rounding), rope as stored.
  void decode(const std::byte* src, float* row576) const;
};

// fp8_ds_mla tile scale from a tile's amax under a rule.
float ds_mla_tile_scale(float amax, TileScaleRule rule);

// ---- the cache -----------------------------------------------------------------
struct CacheGeometry {
  CacheFormat format = CacheFormat::bf16;
  int block_size = 64;         // 1..1024 rows per block
  int64_t num_blocks = 0;
  int64_t block_stride = 0;    // bytes between blocks (>= block_size * entry bytes)
  size_t entry_bytes() const { return cache_entry_bytes(format); }
  int64_t num_slots() const { return num_blocks * block_size; }
  void validate() const;
};

class LatentCache {
 public:
  LatentCache() = default;
  // kmla-owned host memory, zero-filled, dense blocks.
  static LatentCache allocate(CacheFormat format, int block_size, int64_t num_blocks,
                              float k_scale = 1.0f,
                              TileScaleRule rule = TileScaleRule::power_of_two);
  // Caller-owned memory: `base` holds num_blocks blocks, block i at base + i*block_stride.
  // (num_blocks - 1) * block_stride + block_size * entry bytes from base must be valid;
  // kmla writes only the rows (clone() also copies the gaps between blocks).
  static LatentCache borrow(void* base, Device device, CacheFormat format, int block_size,
                            int64_t num_blocks, int64_t block_stride, float k_scale = 1.0f,
                            TileScaleRule rule = TileScaleRule::power_of_two);

  const CacheGeometry& geometry() const { return geo_; }
  CacheFormat format() const { return geo_.format; }
  int block_size() const { return geo_.block_size; }
  int64_t num_blocks() const { return geo_.num_blocks; }
  Device device() const { return device_; }
  bool owns_memory() const { return owned_ != nullptr; }
  std::byte* base() const { return base_; }
  RowCodec codec() const { return codec_; }
  float k_scale() const { return codec_.k_scale; }
  void set_k_scale(float s);

  // Address of the row for `slot` (= block_id * block_size + offset). Host memory only.
  std::byte* slot_ptr(int64_t slot) const;
  void write_row(int64_t slot, const float* row576) const { codec_.encode(row576, slot_ptr(slot)); }
  void read_row(int64_t slot, float* row576) const { codec_.decode(slot_ptr(slot), row576); }

  // A deep copy into kmla-owned host memory with the same geometry (tests use it).
  LatentCache clone() const;

 private:
  CacheGeometry geo_;
  RowCodec codec_;
  Device device_ = Device::cpu;
  std::byte* base_ = nullptr;
  std::shared_ptr<std::byte[]> owned_;
};

}  // namespace kmla
