// The benchmark harness behind `kmla bench`: decode and prefill attention kernels on their
// own, and the whole layer (a CUDA-graph decode step and a prefill), timed with CUDA events
// after an L2 flush and reported against the device copy bandwidth measured in the same
// process (SPEC §4 gives the conventions).
#pragma once

#include <functional>
#include <ostream>
#include <string>

#include "kmla/cuda.hpp"
#include "kmla/dist.hpp"
#include "kmla/tensor.hpp"

namespace kmla::bench {

struct BenchOptions {
  std::string only;  // run only the cases whose name contains one of these (comma-separated)
  int iters = 20;    // timed runs per case (the median is reported)
  int warmup = 3;    // untimed runs before them
  bool json = false; // one JSON document instead of the table

  // A custom shape instead of the standard list: kind is "decode", "prefill",
  // "layer-decode" or "layer-prefill"; "" runs the standard list.
  std::string kind;
  int batch = 0;       // requests (decode, layer-decode)
  int heads = 0;       // local heads (layer kinds: the tensor-parallel slice giving them)
  int seq = 0;         // keys per request (decode, layer-decode)
  int q_len = 1;       // query tokens per decode request
  int tokens = 0;      // prefill tokens (prefill, layer-prefill; one causal sequence)
  int block_size = 64;
  std::string cache_format = "bf16";  // bf16, fp8, fp8_ds_mla
  bool causal = true;                 // multi-token decode blocks / prefill masking
  std::string model = "kimi-k3";      // preset of the layer kinds
  bool portable = false;              // force the sm_80 kernels
  bool sequential_blocks = false;     // cache blocks in order instead of a random permutation
  bool write_flush = false;           // flush L2 before each run by a memset, not by reading
  // Tensor parallelism (kmla bench --tp N): tp > 0 replaces the standard list by the K3 layer
  // cases at world tp, run as rank tp_rank; with all_reduce (an NCCL communicator's) each
  // layer ends in it inside the timed (graphed) step, otherwise it returns the partial sum.
  int tp = 0;
  int tp_rank = 0;
  std::function<void(const TensorView& out, cuda::Stream stream)> all_reduce;
  // Decode context parallelism (kmla bench --cp N): cp > 0 replaces the standard list by
  // long-context decode cases in which this rank holds 1/cp of every sequence's keys; with
  // `comm`, the all-gather and LSE merge of the partials are inside each timed run.
  int cp = 0;
  int cp_rank = 0;
  dist::Communicator* comm = nullptr;
};

// Runs the cases and writes the table (or JSON) to `out`. Returns 0 when every case ran,
// 1 when any case failed (its error is reported in its row). Throws kmla::Error for bad
// options or when no GPU is present.
int run_bench(const BenchOptions& options, std::ostream& out);

}  // namespace kmla::bench
