// The NCCL communicator: non-blocking, so that a dead peer or a broken network turns into
// a kmla::Error on every rank instead of a hang. Every NCCL call is followed by wait_ready(),
// which polls ncclCommGetAsyncError until the call is no longer in progress; kernels a
// collective enqueued are never waited for here, so a step stays asynchronous and
// graph-capturable. check() is the one place that waits for the device.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "kmla/dist.hpp"
#include "kmla/error.hpp"

namespace kmla::dist {
namespace {

using Clock = std::chrono::steady_clock;

cudaStream_t raw(cuda::Stream s) { return reinterpret_cast<cudaStream_t>(s); }

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::f32: return ncclFloat32;
    default: KMLA_CHECK(false, "NCCL collectives take bf16, f16 or f32 tensors, got ", dtype_name(t));
  }
}

void check_device_tensor(const TensorView& t, const char* what) {
  KMLA_CHECK(t.device == Device::cuda, what, " must be in device memory");
  KMLA_CHECK(t.numel() == 0 || t.data != nullptr, what, " has no data");
}

}  // namespace

bool nccl_built() { return true; }

UniqueId exchange_unique_id(const std::string& path, int rank, double timeout_s) {
  static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId), "an ncclUniqueId is 128 bytes");
  UniqueId id{};
  if (rank == 0) {
    ncclUniqueId nid;
    const ncclResult_t r = ncclGetUniqueId(&nid);
    KMLA_CHECK(r == ncclSuccess, "ncclGetUniqueId: ", ncclGetErrorString(r));
    std::memcpy(id.data(), &nid, sizeof nid);
    write_file_atomic(path, id.data(), id.size());
  } else {
    const std::vector<char> bytes = wait_for_file(path, id.size(), timeout_s);
    std::memcpy(id.data(), bytes.data(), id.size());
  }
  return id;
}

struct Communicator::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int world = 1;
  bool aborted = false;
  double call_timeout_s = 120;  // how long one NCCL call may stay "in progress" (the init timeout)
  // Collectives asked for on the legacy default stream run on this private stream instead,
  // ordered by events both ways (NCCL's copy-engine paths refuse the null stream in some
  // releases). Created on first use; a real stream is used as given (and can be captured).
  cudaStream_t side = nullptr;
  cudaEvent_t before = nullptr, after = nullptr;
  double* scalar = nullptr;  // max_across_ranks' device value, allocated on first use

  ~Impl() {
    if (scalar) cudaFree(scalar);
    if (side) cudaStreamDestroy(side);
    if (before) cudaEventDestroy(before);
    if (after) cudaEventDestroy(after);
  }
  // The stream to enqueue a collective on; pair it with finish(stream).
  cudaStream_t begin(cudaStream_t stream) {
    if (stream != nullptr) return stream;
    auto ok = [](cudaError_t e, const char* what) {
      KMLA_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e));
    };
    if (!side) {
      ok(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      ok(cudaEventCreateWithFlags(&before, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      ok(cudaEventCreateWithFlags(&after, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
    ok(cudaEventRecord(before, stream), "cudaEventRecord");
    ok(cudaStreamWaitEvent(side, before, 0), "cudaStreamWaitEvent");
    return side;
  }
  void finish(cudaStream_t stream) {
    if (stream != nullptr) return;
    KMLA_CHECK(cudaEventRecord(after, side) == cudaSuccess, "cudaEventRecord failed");
    KMLA_CHECK(cudaStreamWaitEvent(stream, after, 0) == cudaSuccess, "cudaStreamWaitEvent failed");
  }

  [[noreturn]] void fail(const std::string& cause) {
    abort_comm();
    throw Error("rank " + std::to_string(rank) + " of " + std::to_string(world) + ": " + cause +
                "; the NCCL communicator was aborted");
  }
  void abort_comm() {
    if (comm && !aborted) ncclCommAbort(comm);
    aborted = true;
  }
  void require_usable(const char* op) {
    KMLA_CHECK(!aborted, "rank ", rank, ": ", op, " on an aborted NCCL communicator");
  }
  // After an NCCL call: wait (polling) until it is no longer in progress.
  void wait_ready(ncclResult_t r, const char* op, double timeout_s) {
    const Clock::time_point t0 = Clock::now();
    while (r == ncclInProgress) {
      if (std::chrono::duration<double>(Clock::now() - t0).count() > timeout_s)
        fail(std::string(op) + " still in progress after " + std::to_string(timeout_s) + " s");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      const ncclResult_t q = ncclCommGetAsyncError(comm, &r);
      if (q != ncclSuccess) r = q;
    }
    if (r != ncclSuccess)
      fail(std::string(op) + ": " + ncclGetErrorString(r) + " (" + ncclGetLastError(comm) + ")");
  }
};

Communicator::Communicator(int rank, int world, const UniqueId& id, double init_timeout_s)
    : impl_(std::make_unique<Impl>()) {
  KMLA_CHECK(world >= 1, "NCCL world size must be >= 1, got ", world);
  KMLA_CHECK(rank >= 0 && rank < world, "NCCL rank ", rank, " is outside [0, ", world, ")");
  KMLA_CHECK(init_timeout_s > 0, "init timeout must be > 0 s, got ", init_timeout_s);
  impl_->rank = rank;
  impl_->world = world;
  impl_->call_timeout_s = init_timeout_s;
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), sizeof nid);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&impl_->comm, world, nid, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (impl_->comm) ncclCommAbort(impl_->comm);
    impl_->comm = nullptr;
    KMLA_CHECK(false, "rank ", rank, " of ", world, ": ncclCommInitRankConfig: ", ncclGetErrorString(r), " (",
               ncclGetLastError(nullptr), ")");
  }
  impl_->wait_ready(r == ncclInProgress ? ncclInProgress : ncclSuccess, "joining the NCCL communicator",
                    init_timeout_s);
}

Communicator::~Communicator() {
  if (!impl_ || !impl_->comm) return;
  if (!impl_->aborted) {
    // Finalize flushes outstanding work; if it fails or hangs, abort instead.
    ncclResult_t r = ncclCommFinalize(impl_->comm);
    const Clock::time_point t0 = Clock::now();
    while (r == ncclInProgress && std::chrono::duration<double>(Clock::now() - t0).count() < 10) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (ncclCommGetAsyncError(impl_->comm, &r) != ncclSuccess) r = ncclInternalError;
    }
    if (r != ncclSuccess) {
      ncclCommAbort(impl_->comm);
      return;
    }
    ncclCommDestroy(impl_->comm);
  } else {
    // ncclCommAbort already freed the communicator.
  }
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::world() const { return impl_->world; }
bool Communicator::aborted() const { return impl_->aborted; }

void Communicator::all_reduce_sum(const TensorView& buf, cuda::Stream stream) {
  impl_->require_usable("all_reduce_sum");
  check_device_tensor(buf, "all_reduce_sum buffer");
  if (buf.numel() == 0) return;
  const ncclDataType_t type = nccl_type(buf.dtype);
  const cudaStream_t s = impl_->begin(raw(stream));
  const ncclResult_t r = ncclAllReduce(buf.data, buf.data, size_t(buf.numel()), type, ncclSum, impl_->comm, s);
  impl_->wait_ready(r, "ncclAllReduce", impl_->call_timeout_s);
  impl_->finish(raw(stream));
}

void Communicator::all_gather(const TensorView& in, const TensorView& out, cuda::Stream stream) {
  impl_->require_usable("all_gather");
  check_device_tensor(in, "all_gather input");
  check_device_tensor(out, "all_gather output");
  KMLA_CHECK(in.dtype == out.dtype, "all_gather: input ", dtype_name(in.dtype), " and output ",
             dtype_name(out.dtype), " differ");
  KMLA_CHECK(out.numel() == in.numel() * impl_->world, "all_gather: output has ", out.numel(),
             " elements, expected world ", impl_->world, " x ", in.numel());
  if (in.numel() == 0) return;
  const ncclDataType_t type = nccl_type(in.dtype);
  const cudaStream_t s = impl_->begin(raw(stream));
  const ncclResult_t r = ncclAllGather(in.data, out.data, size_t(in.numel()), type, impl_->comm, s);
  impl_->wait_ready(r, "ncclAllGather", impl_->call_timeout_s);
  impl_->finish(raw(stream));
}

void Communicator::poll() {
  impl_->require_usable("poll");
  ncclResult_t a = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(impl_->comm, &a);
  if (q != ncclSuccess) a = q;
  if (a != ncclSuccess && a != ncclInProgress)
    impl_->fail(std::string("NCCL reported an asynchronous error: ") + ncclGetErrorString(a) + " (" +
                ncclGetLastError(impl_->comm) + ")");
}

void Communicator::check(cuda::Stream stream, double timeout_s) {
  impl_->require_usable("check");
  KMLA_CHECK(timeout_s > 0, "check timeout must be > 0 s, got ", timeout_s);
  const Clock::time_point t0 = Clock::now();
  for (;;) {
    poll();
    const cudaError_t e = cudaStreamQuery(raw(stream));
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady)
      impl_->fail(std::string("the stream failed: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
    if (std::chrono::duration<double>(Clock::now() - t0).count() > timeout_s)
      impl_->fail("the stream did not finish within " + std::to_string(timeout_s) +
                  " s (a peer stopped taking part in a collective?)");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

double Communicator::max_across_ranks(double value, double timeout_s) {
  impl_->require_usable("max_across_ranks");
  if (!impl_->scalar)
    KMLA_CHECK(cudaMalloc(&impl_->scalar, sizeof(double)) == cudaSuccess, "rank ", impl_->rank,
               ": cudaMalloc of max_across_ranks' value failed");
  const cudaStream_t s = impl_->begin(nullptr);  // the private stream
  KMLA_CHECK(cudaMemcpyAsync(impl_->scalar, &value, sizeof value, cudaMemcpyHostToDevice, s) == cudaSuccess,
             "max_across_ranks: cudaMemcpyAsync to the device failed");
  const ncclResult_t r = ncclAllReduce(impl_->scalar, impl_->scalar, 1, ncclFloat64, ncclMax, impl_->comm, s);
  impl_->wait_ready(r, "ncclAllReduce (max)", impl_->call_timeout_s);
  double result = 0;
  KMLA_CHECK(cudaMemcpyAsync(&result, impl_->scalar, sizeof result, cudaMemcpyDeviceToHost, s) == cudaSuccess,
             "max_across_ranks: cudaMemcpyAsync to the host failed");
  check(reinterpret_cast<cuda::Stream>(s), timeout_s);
  return result;
}

void Communicator::abort() { impl_->abort_comm(); }

std::function<void(const TensorView&, cuda::Stream)> Communicator::layer_all_reduce() {
  return [this](const TensorView& t, cuda::Stream s) { all_reduce_sum(t, s); };
}

}  // namespace kmla::dist
