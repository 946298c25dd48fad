// The process launcher and the file rendezvous: plain POSIX, no CUDA, so that the parent of
// a multi-GPU run can fork its ranks before anything creates a CUDA context.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <filesystem>
#include <iostream>
#include <thread>

#include "kmla/dist.hpp"
#include "kmla/error.hpp"

extern char** environ;

namespace kmla::dist {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxOutput = size_t(1) << 20;  // the tail of each rank's output we keep

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string last_line(const std::string& s) {
  size_t end = s.find_last_not_of("\n\r ");
  if (end == std::string::npos) return "";
  const size_t start = s.rfind('\n', end);
  return s.substr(start == std::string::npos ? 0 : start + 1, end + 1 - (start == std::string::npos ? 0 : start + 1));
}

struct Child {
  pid_t pid = -1;
  int fd = -1;  // read end of the child's stdout + stderr
  bool reaped = false;
};

// The child's side of launch(): its own process group, death with the parent, output into
// the pipe, then body(rank). Never returns.
[[noreturn]] void run_child(int rank, int write_fd, const std::function<int(int)>& body) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  signal(SIGTERM, SIG_DFL);
  dup2(write_fd, STDOUT_FILENO);
  dup2(write_fd, STDERR_FILENO);
  close(write_fd);
  int code = 2;
  try {
    code = body(rank);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kmla: rank %d: error: %s\n", rank, e.what());
  } catch (...) {
    std::fprintf(stderr, "kmla: rank %d: error: an unknown exception\n", rank);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::cout.flush();
  _exit(code);
}

void drain(int fd, std::string& out) {
  char buf[8192];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) return;
    out.append(buf, size_t(n));
    if (out.size() > 2 * kMaxOutput) out.erase(0, out.size() - kMaxOutput);
  }
}

}  // namespace

std::string RankStatus::describe() const {
  if (timed_out) return "timed out";
  if (signal) return "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  return "exit status " + std::to_string(exit_code);
}

LaunchResult launch(int world, const std::function<int(int)>& body, const LaunchOptions& options) {
  KMLA_CHECK(world >= 1, "the launcher needs world >= 1 ranks, got ", world);
  KMLA_CHECK(options.timeout_s >= 0, "launch timeout must be >= 0 s, got ", options.timeout_s);
  LaunchResult res;
  res.ranks.resize(size_t(world));
  std::vector<Child> kids(static_cast<size_t>(world));
  std::fflush(stdout);
  std::fflush(stderr);
  std::cout.flush();
  const Clock::time_point t0 = Clock::now();

  // Stops every child still running: SIGTERM to its group now, SIGKILL after the grace.
  auto stop_all = [&](bool mark_stopped) {
    for (int r = 0; r < world; ++r)
      if (kids[size_t(r)].pid > 0 && !kids[size_t(r)].reaped) {
        kill(-kids[size_t(r)].pid, SIGTERM);
        if (mark_stopped) res.ranks[size_t(r)].stopped = true;
      }
  };
  double kill_at = -1;  // seconds since t0 at which survivors get SIGKILL

  for (int r = 0; r < world; ++r) {
    res.ranks[size_t(r)].rank = r;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
      const int err = errno;
      stop_all(true);
      for (Child& k : kids)
        if (k.pid > 0) waitpid(k.pid, nullptr, 0);
      KMLA_CHECK(false, "pipe for rank ", r, " failed: ", std::strerror(err));
    }
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      // The write end must survive an exec in the body: dup2 in run_child clears CLOEXEC.
      run_child(r, fds[1], body);
    }
    close(fds[1]);
    if (pid < 0) {
      const int err = errno;
      close(fds[0]);
      stop_all(true);
      for (Child& k : kids)
        if (k.pid > 0) waitpid(k.pid, nullptr, 0);
      KMLA_CHECK(false, "fork for rank ", r, " failed: ", std::strerror(err));
    }
    setpgid(pid, pid);  // also here: no race with the child's own setpgid
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    kids[size_t(r)] = Child{pid, fds[0], false};
  }

  int alive = world;
  while (alive > 0) {
    std::vector<pollfd> pfds;
    for (const Child& k : kids)
      if (k.fd >= 0) pfds.push_back({k.fd, POLLIN, 0});
    if (!pfds.empty()) poll(pfds.data(), nfds_t(pfds.size()), 20);
    else std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int r = 0; r < world; ++r)
      if (kids[size_t(r)].fd >= 0) drain(kids[size_t(r)].fd, res.ranks[size_t(r)].output);

    for (int r = 0; r < world; ++r) {
      Child& k = kids[size_t(r)];
      if (k.reaped) continue;
      int st = 0;
      const pid_t w = waitpid(k.pid, &st, WNOHANG);
      if (w != k.pid) continue;
      k.reaped = true;
      --alive;
      RankStatus& rs = res.ranks[size_t(r)];
      if (WIFEXITED(st)) rs.exit_code = WEXITSTATUS(st);
      if (WIFSIGNALED(st)) rs.signal = WTERMSIG(st);
      // Its output may still sit in the pipe (or in a grandchild's copy of it): read what is
      // there now, then stop listening so a lingering writer cannot keep us waiting.
      drain(k.fd, rs.output);
      close(k.fd);
      k.fd = -1;
      if (!rs.ok() && !rs.stopped && res.failed_rank < 0) {
        res.failed_rank = r;
        stop_all(true);
        kill_at = seconds_since(t0) + options.grace_s;
      }
    }
    const double now = seconds_since(t0);
    if (options.timeout_s > 0 && now > options.timeout_s && kill_at < 0 && alive > 0) {
      for (int r = 0; r < world; ++r)
        if (!kids[size_t(r)].reaped) {
          res.ranks[size_t(r)].timed_out = true;
          if (res.failed_rank < 0) res.failed_rank = r;
        }
      stop_all(false);
      kill_at = now + options.grace_s;
    }
    if (kill_at >= 0 && now > kill_at)
      for (const Child& k : kids)
        if (!k.reaped) kill(-k.pid, SIGKILL);
  }
  res.wall_s = seconds_since(t0);
  if (res.failed_rank >= 0) {
    const RankStatus& f = res.ranks[size_t(res.failed_rank)];
    res.error = "rank " + std::to_string(f.rank) + " of " + std::to_string(world) + " failed: " + f.describe();
    if (f.timed_out) res.error += " after " + std::to_string(options.timeout_s) + " s";
    const std::string line = last_line(f.output);
    if (!line.empty()) res.error += "; its last output: " + line;
    int stopped = 0;
    for (const RankStatus& rs : res.ranks) stopped += rs.stopped;
    if (stopped) res.error += " (" + std::to_string(stopped) + " other rank" + (stopped == 1 ? "" : "s") + " stopped)";
  }
  return res;
}

void throw_if_failed(const LaunchResult& result) {
  if (!result.ok()) throw Error(result.error);
}

void exec_with_env(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  for (const std::string& e : env) {
    const size_t eq = e.find('=');
    if (eq != std::string::npos) setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  if (!args.empty() && args[0]) execv(args[0], args.data());
  std::fprintf(stderr, "kmla: exec %s failed: %s\n", argv.empty() ? "(nothing)" : argv[0].c_str(),
               std::strerror(errno));
  std::fflush(stderr);
  _exit(127);
}

// ---- the rendezvous ----------------------------------------------------------------------
std::string make_private_dir(const std::string& tag) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/kmla-" + tag + "-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  KMLA_CHECK(mkdtemp(buf.data()) != nullptr, "cannot create a private directory ", templ, ": ",
             std::strerror(errno));
  return std::string(buf.data());  // mkdtemp makes it 0700
}

void remove_private_dir(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) std::filesystem::remove(e.path(), ec);
  std::filesystem::remove(dir, ec);
}

void write_file_atomic(const std::string& path, const void* data, size_t bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  KMLA_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = write(fd, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      KMLA_CHECK(false, "cannot write ", tmp, ": ", std::strerror(err));
    }
    done += size_t(n);
  }
  KMLA_CHECK(fsync(fd) == 0 || errno == EINVAL, "cannot sync ", tmp, ": ", std::strerror(errno));
  close(fd);
  KMLA_CHECK(rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path, ": ",
             std::strerror(errno));
}

std::vector<char> wait_for_file(const std::string& path, size_t bytes, double timeout_s) {
  const Clock::time_point t0 = Clock::now();
  for (;;) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      std::vector<char> buf(bytes + 1);
      size_t got = 0;
      ssize_t n;
      while ((n = read(fd, buf.data() + got, buf.size() - got)) > 0) got += size_t(n);
      close(fd);
      // The file appears only by rename, so it is complete; a wrong size is somebody else's file.
      KMLA_CHECK(got == bytes, "rendezvous file ", path, " has ", got, " bytes, expected ", bytes);
      buf.resize(bytes);
      return buf;
    }
    KMLA_CHECK(seconds_since(t0) < timeout_s, "timed out after ", timeout_s, " s waiting for the rendezvous file ",
               path, " (did rank 0 start?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace kmla::dist
