// The fp64 oracle: scalar, un-absorbed MHA for every token, reading the same paged
// cache through the same block tables. Small and slow on purpose; every other path is
// tested against it.
#pragma once

#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/rope.hpp"
#include "kmla/weights.hpp"

namespace kmla::reference {

enum class Rounding : uint8_t {
  exact,  // fp64 everywhere; only what is stored (the cache, fp8 casts) is quantized
  seed,   // rounds to the activation dtype where the seed does (the tolerance baseline)
};

struct Options {
  Rounding rounding = Rounding::exact;
  DType activation = DType::bf16;
  bool fp8_prefill = false;
};

struct Result {
  std::vector<double> out;       // [rows, hidden]: o_proj output (this rank's partial sum)
  std::vector<double> attn_out;  // [rows, H * 128]: attention output before the gate
};

// Runs the layer. Writes the new tokens' rows into `cache` first (through its codec),
// exactly as the layer does. md == nullptr returns zeros and leaves the cache alone.
Result forward(const MlaConfig& cfg, const MlaWeights& w, const RopeTable* rope,
               const TensorView& positions, const TensorView& hidden, const BatchMetadata* md,
               LatentCache& cache, const Options& options = {});

}  // namespace kmla::reference
