// The multi-process launcher and the file rendezvous, on the CPU: no GPU, no NCCL. Children
// that fail, hang, ignore SIGTERM or die by a signal must end the whole launch with the
// failing rank named, and the survivors must be stopped (sleep-forever children prove it).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "kmla/dist.hpp"
#include "kmla/error.hpp"

namespace kmla::dist {
namespace {

[[noreturn]] void sleep_forever() {
  for (;;) pause();
}

TEST(DistLauncher, AllRanksSucceedAndTheirOutputIsKept) {
  const LaunchResult r = launch(3, [](int rank) {
    std::printf("hello from rank %d\n", rank);
    std::fprintf(stderr, "stderr of rank %d\n", rank);
    return 0;
  });
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_EQ(r.ranks.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(r.ranks[size_t(k)].exit_code, 0);
    EXPECT_NE(r.ranks[size_t(k)].output.find("hello from rank " + std::to_string(k)), std::string::npos);
    EXPECT_NE(r.ranks[size_t(k)].output.find("stderr of rank " + std::to_string(k)), std::string::npos);
  }
  EXPECT_NO_THROW(throw_if_failed(r));
}

TEST(DistLauncher, AFailingRankIsNamedAndTheSleepersAreStopped) {
  const auto t0 = std::chrono::steady_clock::now();
  const LaunchResult r = launch(4, [](int rank) -> int {
    if (rank == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::fprintf(stderr, "rank 2 says boom\n");
      return 3;
    }
    sleep_forever();
  });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failed_rank, 2);
  EXPECT_EQ(r.ranks[2].exit_code, 3);
  EXPECT_FALSE(r.ranks[2].stopped);
  for (int k : {0, 1, 3}) {
    EXPECT_TRUE(r.ranks[size_t(k)].stopped) << "rank " << k;
    EXPECT_EQ(r.ranks[size_t(k)].signal, SIGTERM) << "rank " << k;
  }
  EXPECT_NE(r.error.find("rank 2 of 4 failed: exit status 3"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("rank 2 says boom"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("3 other ranks stopped"), std::string::npos) << r.error;
  // SIGTERM ends a sleeper at once; well under the 3 s grace.
  EXPECT_LT(wall, 2.5);
  try {
    throw_if_failed(r);
    ADD_FAILURE() << "throw_if_failed did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 of 4"), std::string::npos);
  }
}

TEST(DistLauncher, AnExceptionIsAFailureAndSigtermIgnorersGetSigkill) {
  LaunchOptions o;
  o.grace_s = 0.3;
  const LaunchResult r = launch(2, [](int rank) -> int {
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      KMLA_CHECK(false, "bad input on purpose, value ", 42);
    }
    signal(SIGTERM, SIG_IGN);
    sleep_forever();
  }, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.ranks[0].exit_code, 2);
  EXPECT_NE(r.error.find("kmla: rank 0: error: bad input on purpose, value 42"), std::string::npos) << r.error;
  EXPECT_EQ(r.ranks[1].signal, SIGKILL);
  EXPECT_TRUE(r.ranks[1].stopped);
}

TEST(DistLauncher, ARankKilledByASignalIsReportedAsSuch) {
  const LaunchResult r = launch(3, [](int rank) -> int {
    if (rank == 1) raise(SIGKILL);
    sleep_forever();
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.ranks[1].signal, SIGKILL);
  EXPECT_NE(r.error.find("rank 1 of 3 failed: killed by signal 9"), std::string::npos) << r.error;
}

TEST(DistLauncher, HangingRanksTimeOut) {
  LaunchOptions o;
  o.timeout_s = 0.4;
  o.grace_s = 0.2;
  const auto t0 = std::chrono::steady_clock::now();
  const LaunchResult r = launch(2, [](int rank) -> int {
    if (rank == 1) signal(SIGTERM, SIG_IGN);  // needs the SIGKILL after the grace
    sleep_forever();
  }, o);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_TRUE(r.ranks[0].timed_out);
  EXPECT_TRUE(r.ranks[1].timed_out);
  EXPECT_EQ(r.ranks[1].signal, SIGKILL);
  EXPECT_NE(r.error.find("timed out"), std::string::npos) << r.error;
  EXPECT_GE(wall, 0.4);
  EXPECT_LT(wall, 2.0);
}

TEST(DistLauncher, OutputLargerThanAPipeDoesNotBlock) {
  const LaunchResult r = launch(2, [](int rank) {
    const std::string line(999, char('a' + rank));
    for (int i = 0; i < 400; ++i) std::printf("%s\n", line.c_str());  // 400 KB
    std::printf("END %d\n", rank);
    return 0;
  });
  ASSERT_TRUE(r.ok()) << r.error;
  for (int k = 0; k < 2; ++k) {
    EXPECT_GE(r.ranks[size_t(k)].output.size(), 400000u);
    EXPECT_NE(r.ranks[size_t(k)].output.find("END " + std::to_string(k)), std::string::npos);
  }
}

TEST(DistLauncher, ExecWithEnvRunsAFreshProgram) {
  const LaunchResult r = launch(2, [](int rank) -> int {
    // Rank 1 fails 0.3 s after rank 0 has certainly finished (else it would be stopped early).
    exec_with_env({"/bin/sh", "-c", "echo value=$KMLA_TEST_VALUE; sleep $KMLA_TEST_SLEEP; exit $KMLA_TEST_CODE"},
                  {"KMLA_TEST_VALUE=v" + std::to_string(rank), "KMLA_TEST_CODE=" + std::to_string(rank * 5),
                   std::string("KMLA_TEST_SLEEP=") + (rank ? "0.3" : "0")});
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.ranks[1].exit_code, 5);
  EXPECT_NE(r.ranks[1].output.find("value=v1"), std::string::npos);
  EXPECT_NE(r.ranks[0].output.find("value=v0"), std::string::npos);
}

TEST(DistLauncher, BadWorldThrows) {
  try {
    launch(0, [](int) { return 0; });
    ADD_FAILURE() << "world 0 did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("world >= 1 ranks, got 0"), std::string::npos) << e.what();
  }
}

// ---- the rendezvous --------------------------------------------------------------------------

TEST(DistRendezvous, RankZeroWritesAndEveryOtherRankReadsTheSameBytes) {
  const std::string dir = make_private_dir("test");
  EXPECT_EQ(std::filesystem::status(dir).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_all);
  const std::string path = dir + "/id";
  const LaunchResult r = launch(4, [&](int rank) -> int {
    UniqueId id{};
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the readers poll first
      for (size_t i = 0; i < id.size(); ++i) id[i] = char(i * 7 + 3);
      write_file_atomic(path, id.data(), id.size());
      return 0;
    }
    const std::vector<char> got = wait_for_file(path, id.size(), 10.0);
    for (size_t i = 0; i < id.size(); ++i)
      if (got[i] != char(i * 7 + 3)) return 10 + rank;
    return 0;
  });
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  remove_private_dir(dir);
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(DistRendezvous, AMissingWriterTimesOut) {
  const std::string dir = make_private_dir("test");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    wait_for_file(dir + "/never", 128, 0.3);
    ADD_FAILURE() << "no timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out after 0.3 s"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir + "/never"), std::string::npos) << e.what();
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(wall, 0.3);
  EXPECT_LT(wall, 2.0);
  // A file of the wrong size is somebody else's: an error, not a truncated id.
  const char bytes[5] = {1, 2, 3, 4, 5};
  write_file_atomic(dir + "/short", bytes, 5);
  EXPECT_THROW(wait_for_file(dir + "/short", 128, 1.0), Error);
  const std::vector<char> ok = wait_for_file(dir + "/short", 5, 1.0);
  EXPECT_EQ(ok[4], 5);
  remove_private_dir(dir);
}

TEST(DistNccl, BuildWithoutNcclSaysSo) {
  if (nccl_built()) GTEST_SKIP() << "this build has NCCL (tests/cuda/test_nccl.cpp covers it)";
  try {
    Communicator c(0, 2, UniqueId{});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no NCCL"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kmla::dist
