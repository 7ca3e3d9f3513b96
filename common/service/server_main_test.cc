#include "common/service/server_main.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <thread>

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

}  // namespace
}  // namespace specserve
