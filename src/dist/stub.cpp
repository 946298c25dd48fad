// What a build without NCCL (or without CUDA) offers of kmla/dist.hpp: the same functions,
// each throwing kmla::Error that says what the build lacks (the launcher always exists).
#include "kmla/dist.hpp"
#include "kmla/error.hpp"

namespace kmla::dist {

#if !KMLA_DIST_NCCL
namespace {
[[noreturn]] void no_nccl(const char* what) {
  throw Error(std::string(what) + ": this build of kmla has no NCCL (configure with KMLA_NCCL=ON and NCCL "
              "installed), so it cannot run more than one tensor-parallel rank");
}
}  // namespace

bool nccl_built() { return false; }
UniqueId exchange_unique_id(const std::string&, int, double) { no_nccl("exchange_unique_id"); }

struct Communicator::Impl {};
Communicator::Communicator(int, int, const UniqueId&, double) { no_nccl("Communicator"); }
Communicator::~Communicator() = default;
int Communicator::rank() const { return 0; }
int Communicator::world() const { return 1; }
void Communicator::all_reduce_sum(const TensorView&, cuda::Stream) { no_nccl("all_reduce_sum"); }
void Communicator::all_gather(const TensorView&, const TensorView&, cuda::Stream) { no_nccl("all_gather"); }
void Communicator::poll() {}
double Communicator::max_across_ranks(double, double) { no_nccl("max_across_ranks"); }
void Communicator::check(cuda::Stream, double) {}
void Communicator::abort() {}
bool Communicator::aborted() const { return true; }
std::function<void(const TensorView&, cuda::Stream)> Communicator::layer_all_reduce() { no_nccl("layer_all_reduce"); }
#endif

#if !KMLA_HAVE_CUDA
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(std::string(what) + ": this build of kmla has no CUDA backend");
}
}  // namespace

int count_gpus_in_child() { return 0; }
void select_device(int) { no_cuda("select_device"); }
void cp_scatter_partial(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                        const TensorView&, cuda::Stream) {
  no_cuda("cp_scatter_partial");
}
void cp_merge_partials(const TensorView&, const TensorView&, const TensorView&, const TensorView&, cuda::Stream) {
  no_cuda("cp_merge_partials");
}
size_t cp_gather_workspace_bytes(int world, int64_t rows, int heads, int dim) {
  return size_t(world) * size_t(rows) * size_t(heads) * size_t(dim + 1) * sizeof(float);
}
void cp_all_gather_merge(Communicator&, const TensorView&, const TensorView&, void*, const TensorView&,
                         const TensorView&, cuda::Stream) {
  no_cuda("cp_all_gather_merge");
}
#endif

}  // namespace kmla::dist
