// Device selection and counting for the ranks of a multi-GPU run (CUDA runtime only).
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kmla/dist.hpp"
#include "kmla/error.hpp"

namespace kmla::dist {

int count_gpus_in_child() {
  int fds[2];
  KMLA_CHECK(pipe(fds) == 0, "pipe failed: ", std::strerror(errno));
  const pid_t pid = fork();
  KMLA_CHECK(pid >= 0, "fork failed: ", std::strerror(errno));
  if (pid == 0) {
    close(fds[0]);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    (void)!write(fds[1], &n, sizeof n);
    _exit(0);
  }
  close(fds[1]);
  int n = 0;
  const ssize_t got = read(fds[0], &n, sizeof n);
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  return got == ssize_t(sizeof n) ? n : 0;
}

void select_device(int index) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  KMLA_CHECK(index >= 0 && index < n, "GPU ", index, " does not exist (", n, " visible)");
  const cudaError_t e = cudaSetDevice(index);
  KMLA_CHECK(e == cudaSuccess, "cudaSetDevice(", index, "): ", cudaGetErrorString(e));
}

}  // namespace kmla::dist
