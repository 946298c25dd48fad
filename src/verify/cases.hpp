// Named end-to-end cases: a model shape, a cache format and a batch that mixes every
// kind of request, with adversarial data (permuted block tables, NaN-poisoned unused
// cache bytes, lengths just off block boundaries). One definition serves `kmla verify`,
// the test suite and (later) `kmla bench`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/weights.hpp"

namespace kmla::verify {

struct RequestShape {
  int32_t query_len = 1;
  int32_t context_len = 0;
};

struct Case {
  std::string name;
  MlaConfig config;  // the layer as one rank sees it
  DType activation = DType::bf16;
  CacheFormat format = CacheFormat::bf16;
  TileScaleRule tile_rule = TileScaleRule::power_of_two;
  float k_scale = 1.0f;
  float q_scale = 1.0f;
  bool fp8_prefill = false;
  // Simulate an fp8 checkpoint: every projection of the config that is not fp8 yet becomes
  // an fp8 block weight (MlaWeights::to_fp8_blocks) and runs as W8A8.
  bool fp8_weights = false;
  int block_size = 16;
  int decode_threshold = 1;
  int64_t workspace_tokens = 65536;
  int padding_rows = 0;
  std::vector<RequestShape> requests;  // in the caller's order (shuffled against the layout)
  uint64_t seed = 1;
  int64_t rope_rows = 0;  // 0: the config's full table
  // Weights to use instead of random ones (e.g. loaded from a checkpoint).
  std::shared_ptr<const MlaWeights> weights;

  // FLOPs and cache bytes read by the attention of this batch (for bench and reports).
  double attention_flops() const;
};

struct Report {
  double max_ref = 0;         // max |exact oracle output|
  double err_backend = 0;     // max |backend - exact oracle|
  double err_baseline = 0;    // max |seed-rounding oracle - exact oracle|
  double bound = 0;           // what err_backend must not exceed
  double cache_err = 0;       // worst relative difference of newly written cache rows
  double cache_bound = 0;
  bool nonfinite_mismatch = false;  // a NaN/inf where the oracle has a finite value (or vice versa)
  bool untouched_ok = true;         // bytes of slots not written this step are unchanged
  bool pass = false;
  std::string detail;         // first problem found, for messages
  double rel_err() const { return max_ref > 0 ? err_backend / max_ref : err_backend; }
};

// A shape of the named model (a preset), shrunk so the oracle is quick: `heads` local heads
// and, when `small` is set, hidden size 256 and q-LoRA rank 96. Everything else (q-LoRA on or
// off, gate, RoPE type and parameters, eps, non-causal decode) is the preset's.
MlaConfig small_model(const std::string& preset, int heads, bool small = true);

// The standard mixed batch for a config: single-token decodes, a multi-token decode block,
// prefills whose context spans several workspace chunks and ends just off a block boundary,
// a fresh prefill and padding rows.
Case mixed_case(const std::string& preset, CacheFormat format, int block_size, uint64_t seed = 1,
                int heads = 3, bool small = true);
// The same batch for any config (e.g. one read from a checkpoint).
Case mixed_case(const MlaConfig& config, CacheFormat format, int block_size, uint64_t seed = 1);

// The grid the test suite and `kmla verify --all` run.
std::vector<Case> standard_cases();

// Everything one forward call of a case needs: random weights, a cache poisoned with NaN
// and holding the requests' context rows at permuted blocks, the planned batch (requests
// in shuffled caller order), and hidden states and positions in the batch's layout.
struct Inputs {
  MlaWeights weights;
  LatentCache cache;
  BatchMetadata md;
  HostTensor positions;  // i64 [rows]
  HostTensor hidden;     // activation [rows, hidden]
};
Inputs make_inputs(const Case& c);

// Runs a backend (CPU; CUDA, or its portable sm_80 path, on the current GPU) and the oracle (exact and seed rounding) on the case and applies the
// tolerance rule: the backend may err at most twice the seed-rounding oracle (a plain
// same-precision implementation), plus one activation ulp of the largest output.
enum class Backend : uint8_t { cpu, cuda, cuda_portable };
Report run_case(const Case& c, Backend backend = Backend::cpu);

}  // namespace kmla::verify
