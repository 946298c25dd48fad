// The whole MLA layer: forward(positions, hidden_states, metadata, cache), as the seed
// computes it, on a backend chosen at construction (the CPU today).
#pragma once

#include <functional>
#include <memory>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/rope.hpp"
#include "kmla/weights.hpp"

namespace kmla {

struct LayerOptions {
  DType activation = DType::bf16;  // bf16 or f16; weights must match
  // The seed's fp8 prefill: prefill q, k, v (new tokens and context) are cast unscaled
  // to e4m3 (clamped to +-448) before attention. Any cache format.
  bool fp8_prefill = false;
  // Return this rank's partial o_proj sum without the all-reduce (the DSpark draft fuses
  // it elsewhere). With tp_size > 1 either this is set or `all_reduce` is given.
  bool partial_output = false;
  // Sums `out` across tensor-parallel ranks in place (tp_size > 1 only).
  std::function<void(const TensorView& out)> all_reduce;
  // CPU backend: worker threads, 0 = all hardware threads. The backend parallelises its
  // GEMMs itself, so it sets OpenBLAS to one thread, once, for the whole process (its own
  // pool competing with ours was ~10x slower); other OpenBLAS users in the process see that.
  int num_threads = 0;
};

class MlaLayer {
 public:
  // `rope` may be shared by all layers of a model; null builds the table when cfg.use_rope.
  MlaLayer(const MlaConfig& cfg, MlaWeights weights, LayerOptions options = {},
           std::shared_ptr<const RopeTable> rope = nullptr);
  ~MlaLayer();
  MlaLayer(MlaLayer&&) noexcept;
  MlaLayer& operator=(MlaLayer&&) noexcept;

  const MlaConfig& config() const;
  const MlaWeights& weights() const;
  const LayerOptions& options() const;
  const std::shared_ptr<const RopeTable>& rope() const;

  // positions: i64 [rows]; hidden: [rows, hidden_size]; out: [rows, hidden_size], both in
  // the activation dtype. Rows follow md's layout; rows past md->num_tokens are padding
  // and get zeros. md == nullptr is a memory-profiling run: out is zeroed and the cache is
  // not touched. Everything is validated before the cache is written.
  void forward(const TensorView& positions, const TensorView& hidden, const BatchMetadata* md,
               LatentCache& cache, const TensorView& out) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kmla
