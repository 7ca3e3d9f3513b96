#include "common/service/server_main.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "common/service/grpc_util.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

// A thread started before BlockStopSignals (as OpenBLAS starts its pool
// when MaybeReexecForAvx512 loads it) does not block SIGTERM, so the
// kernel hands it the signal while the serving thread is busy. It must
// reach the serving thread's sigwait, not kill the process (before, the
// services died with -15 instead of draining).
TEST(BlockStopSignalsTest, SignalTakenByAnEarlierThreadReachesSigwait) {
  std::atomic<bool> done{false};
  std::thread early([&] {
    while (!done.load()) usleep(1000);
  });
  const sigset_t stop = BlockStopSignals();
  // Only `early` can take it now: this thread blocks it and is not waiting.
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  usleep(100 * 1000);
  timespec timeout = {5, 0};
  siginfo_t info;
  EXPECT_EQ(sigtimedwait(&stop, &info, &timeout), SIGTERM);
  done = true;
  early.join();
}

// The local address of the listening TCP socket on `port`, as
// /proc/net/tcp writes it (hex, network order: "0100007F" = 127.0.0.1), or
// "" if none.
std::string ListeningAddress(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    char local[64] = {0};
    unsigned p = 0, state = 0;
    if (std::sscanf(line.c_str(), " %*d: %63[0-9A-Fa-f]:%X %*[0-9A-Fa-f]:%*X %X",
                    local, &p, &state) == 3 &&
        static_cast<int>(p) == port && state == 0x0A /* LISTEN */) {
      return local;
    }
  }
  return "";
}

// The metrics port binds the service's --host, not every interface: a
// service on loopback does not publish /metrics on the network.
TEST(StartMetricsExposerTest, BindsTheGivenHost) {
  auto registry = std::make_shared<prometheus::Registry>();
  int port = 0;
  auto loopback = StartMetricsExposer("127.0.0.1", 0, registry, &port);
  ASSERT_TRUE(loopback.ok()) << loopback.status();
  ASSERT_GT(port, 0);
  EXPECT_EQ(ListeningAddress(port), "0100007F");
  int any_port = 0;
  auto any = StartMetricsExposer("0.0.0.0", 0, registry, &any_port);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(ListeningAddress(any_port), "00000000");
  EXPECT_EQ(StartMetricsExposer("127.0.0.1", port, registry, nullptr)
                .status()
                .code(),
            absl::StatusCode::kUnavailable);  // taken
}

}  // namespace
}  // namespace specserve
