// Internals of cuda::prefill_attention (declared in cuda/attention.cuh) that the tests and
// the benchmark reach past the public entry point: the choice of tiling, and a launch with a
// given tiling so that tests cover both without environment variables.
#pragma once

#include "cuda/attention.cuh"

namespace kmla::cuda {

// Query rows per CTA that prefill_attention uses for `p` on the current device: 64 or 128.
// The environment variable KMLA_PREFILL_ROWS=64|128, read once per process, overrides the
// heuristic (for A/B timing with `kmla bench --only prefill`).
int prefill_rows_per_cta(const PrefillParams& p);

// prefill_attention with the tiling fixed: rows_per_cta 64 (4 warps, 2 CTAs per SM) or 128
// (8 warps, 1 CTA per SM); any other value throws. Same contract otherwise.
void prefill_attention_rows(const PrefillParams& p, int rows_per_cta, cudaStream_t stream);

}  // namespace kmla::cuda
