// A small fork-join parallel_for on std::thread for the CPU backend. Tasks are handed out
// dynamically (an atomic counter), so uneven tasks (long and short sequences) balance on
// their own. The first exception a task throws stops the hand-out and is rethrown on the
// calling thread after every worker has joined.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace kmla::cpu {

// 0 = all hardware threads.
inline int resolve_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : int(hw);
}

// Runs fn(task, worker) for task in [0, n) on up to `threads` threads (the caller is worker
// 0). `worker` is in [0, threads) and lets a task reuse that worker's scratch buffers.
template <class Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
  if (n <= 0) return;
  const int workers = int(std::min<int64_t>(std::max(threads, 1), n));
  if (workers == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mu;
  auto body = [&](int worker) {
    for (;;) {
      if (failed.load(std::memory_order_relaxed)) return;
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      try {
        fn(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        failed.store(true);
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(workers - 1));
  for (int w = 1; w < workers; ++w) {
    try {
      pool.emplace_back(body, w);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones we have (and the caller) do the rest
    }
  }
  body(0);
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// Runs fn(begin, end) over [0, n) in ranges of `grain` items (the last one shorter):
// for cheap elementwise loops over rows, where one item per task would cost more in
// hand-out than in work.
template <class Fn>
void parallel_ranges(int64_t n, int64_t grain, int threads, Fn&& fn) {
  grain = std::max<int64_t>(grain, 1);
  parallel_for((n + grain - 1) / grain, threads,
               [&](int64_t task, int) { fn(task * grain, std::min(n, (task + 1) * grain)); });
}

}  // namespace kmla::cpu
