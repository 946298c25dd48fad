// Running the layer on several GPUs: a process launcher (one process per GPU, started by
// fork before any CUDA call), a file rendezvous for the NCCL unique id, the NCCL
// communicator that LayerOptions::all_reduce plugs into, and the device half of decode
// context parallelism (gather the ranks' partials, merge them by LSE).
//
// No NCCL or CUDA header here. A build without NCCL (KMLA_NCCL=OFF) still has the launcher
// and the rendezvous; Communicator's constructor then throws kmla::Error saying so.
// docs/ARCHITECTURE.md ("Several GPUs") describes the design, also across hosts.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kmla/cuda.hpp"
#include "kmla/tensor.hpp"

namespace kmla::dist {

// ---- the launcher (POSIX only, never touches CUDA) ---------------------------------------
struct RankStatus {
  int rank = 0;
  int exit_code = -1;        // the exit status when the process exited, else -1
  int signal = 0;            // the signal that ended it, else 0
  bool timed_out = false;    // still running at the launch's deadline
  bool stopped = false;      // ended by the launcher because another rank failed
  std::string output;        // what it wrote to stdout and stderr (the last 1 MiB)
  bool ok() const { return exit_code == 0 && signal == 0 && !timed_out; }
  // "exit status 2", "killed by signal 9 (Killed)", "timed out"
  std::string describe() const;
};

struct LaunchOptions {
  double timeout_s = 0;  // the whole launch; 0: no limit
  double grace_s = 3;    // after SIGTERM, the others get this long before SIGKILL
};

struct LaunchResult {
  std::vector<RankStatus> ranks;
  int failed_rank = -1;  // the first rank seen failing (-1: all succeeded)
  std::string error;     // "rank 1 of 4 failed: killed by signal 9 (Killed); last output: ..."
  double wall_s = 0;
  bool ok() const { return failed_rank < 0; }
};

// Forks `world` children; child r runs body(r) and exits with its return value (an
// exception becomes "kmla: rank r: error: <what>" on stderr and exit status 2). Each child is
// in its own process group, dies with the parent (PR_SET_PDEATHSIG) and has its stdout and
// stderr captured. The first child to fail (non-zero exit, a signal) or the deadline ends
// the others: SIGTERM to their process groups, SIGKILL after grace_s. Returns once every
// child is reaped. Call it before the parent touches CUDA (a forked child cannot use a
// CUDA context of its parent); a body that execs a fresh program has no such limit.
LaunchResult launch(int world, const std::function<int(int rank)>& body, const LaunchOptions& options = {});

// Throws kmla::Error with result.error unless every rank succeeded.
void throw_if_failed(const LaunchResult& result);

// Replaces the calling process by `argv` (argv[0] a path) with `env` ("NAME=value") added to
// the environment. Never returns (exits 127 with a message when exec fails).
[[noreturn]] void exec_with_env(const std::vector<std::string>& argv, const std::vector<std::string>& env);

// ---- the rendezvous ----------------------------------------------------------------------
// A fresh directory only this user can enter (mkdtemp under $TMPDIR or /tmp).
std::string make_private_dir(const std::string& tag);
// Removes the files directly inside `dir`, then `dir` (a best effort; never throws).
void remove_private_dir(const std::string& dir);
// Writes the bytes to path + ".tmp", then renames it onto path: readers see all or nothing.
void write_file_atomic(const std::string& path, const void* data, size_t bytes);
// Polls for `path` until it exists with exactly `bytes` bytes, or throws kmla::Error naming
// the file and the timeout.
std::vector<char> wait_for_file(const std::string& path, size_t bytes, double timeout_s);

// ---- NCCL ----------------------------------------------------------------------------------
// True when this build has NCCL.
bool nccl_built();
// CUDA devices visible, counted in a forked child so that the caller stays CUDA-free (0 when
// there is no driver or no CUDA backend).
int count_gpus_in_child();
// Makes device `index` current for this process (throws naming it if it does not exist).
void select_device(int index);

using UniqueId = std::array<char, 128>;  // an ncclUniqueId's bytes
// Rank 0 creates the id (ncclGetUniqueId) and writes it to `path` atomically; every other
// rank polls for the file. Throws on timeout (rank 0 never wrote it).
UniqueId exchange_unique_id(const std::string& path, int rank, double timeout_s);

// One rank's NCCL communicator, non-blocking (ncclConfig_t::blocking = 0) so that no call
// can hang the host: every NCCL call that reports "in progress" is waited on by polling
// ncclCommGetAsyncError against a deadline. Collectives are enqueued on the caller's stream,
// never synchronize it, and are graph-capturable.
class Communicator {
 public:
  // Joins the communicator on the current device; throws (after aborting) if the peers do not
  // all join within timeout_s or NCCL reports an error. Any later NCCL call that stays "in
  // progress" (the first collective connects the peers) for timeout_s fails the same way.
  Communicator(int rank, int world, const UniqueId& id, double timeout_s = 120);
  ~Communicator();  // ncclCommFinalize + destroy; abort when broken
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int world() const;

  // In place: buf = sum over ranks of buf (bf16, f16 or f32; contiguous device memory).
  void all_reduce_sum(const TensorView& buf, cuda::Stream stream);
  // out = the ranks' `in` concatenated in rank order (out.numel() == world * in.numel()).
  void all_gather(const TensorView& in, const TensorView& out, cuda::Stream stream);

  // Throws (after aborting the communicator) if NCCL reports an asynchronous error, e.g. a
  // peer that died or a network failure. Does not wait for anything.
  void poll();
  // Waits for `stream` by polling (cudaStreamQuery, ncclCommGetAsyncError) until it is done,
  // NCCL reports an error or timeout_s pass; the last two abort the communicator (which
  // also releases the kernels waiting on a dead peer) and throw kmla::Error naming the rank
  // and the cause. For after a step, outside any graph capture.
  void check(cuda::Stream stream, double timeout_s);
  // ncclCommAbort: ends every outstanding operation; later calls throw.
  void abort();
  bool aborted() const;

  // The largest of every rank's `value`, on every rank: a host-level agreement (e.g. on the
  // serving clock, so that every rank schedules the same steps). It waits for the result
  // (polling, timeout_s as in check()), so it is not for graph capture or a step's hot path.
  double max_across_ranks(double value, double timeout_s);

  // For cuda::LayerOptions::all_reduce: all_reduce_sum on this communicator. The
  // communicator must outlive the layers.
  std::function<void(const TensorView&, cuda::Stream)> layer_all_reduce();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ---- decode context parallelism on the device ---------------------------------------------
// Expands a shard's decode result to the full batch's decode rows, on the device:
// full_out[rows[i]] = shard_out[i] and full_lse[rows[i]] = shard_lse[i], every other row 0
// and -inf (the partial of a rank that sees no key of it). shard_out [Ts, H, D] in bf16, f16
// or f32, shard_lse f32 [Ts, H]; rows device i64 [Ts] (CpShard::rows, uploaded); full_out f32
// [Td, H, D], full_lse f32 [Td, H]. Ts may be 0.
void cp_scatter_partial(const TensorView& rows, const TensorView& shard_out, const TensorView& shard_lse,
                        const TensorView& full_out, const TensorView& full_lse, cuda::Stream stream);

// Merges `world` partials stacked along dim 0 (gathered_out f32 [W, Td, H, D],
// gathered_lse f32 [W, Td, H]) by the LSE rule of kmla::cp_merge: out [Td, H, D] (bf16, f16
// or f32), lse f32 [Td, H]. A row empty on every rank gets zeros and -inf.
void cp_merge_partials(const TensorView& gathered_out, const TensorView& gathered_lse, const TensorView& out,
                       const TensorView& lse, cuda::Stream stream);

// Workspace of cp_all_gather_merge: the gathered partials, f32.
size_t cp_gather_workspace_bytes(int world, int64_t rows, int heads, int dim);
// The NCCL step of context-parallel decode: all-gathers every rank's full-row partial
// (partial_out f32 [Td, H, D], partial_lse f32 [Td, H], from cp_scatter_partial) into
// `workspace` and merges them (cp_merge_partials) into out / lse, on every rank.
void cp_all_gather_merge(Communicator& comm, const TensorView& partial_out, const TensorView& partial_lse,
                         void* workspace, const TensorView& out, const TensorView& lse, cuda::Stream stream);

}  // namespace kmla::dist
