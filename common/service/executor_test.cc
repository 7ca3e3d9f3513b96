#include "common/service/executor.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(ExecutorTest, RunsEveryTaskAndDrainsOnDestruction) {
  std::atomic<int> count{0};
  {
    Executor ex(2);
    for (int i = 0; i < 1000; ++i) ex.Submit([&] { count++; });
  }
  EXPECT_EQ(count.load(), 1000);
}

TEST(ExecutorTest, TasksRunOffTheCallingThread) {
  Executor ex(1);
  absl::Notification done;
  std::thread::id ran_on;
  ex.Submit([&] {
    ran_on = std::this_thread::get_id();
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

}  // namespace
}  // namespace specserve
