#include "common/engine/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int n : {0, 1, 5, 16, 17, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      for (int rep = 0; rep < 20; ++rep) {
        pool.ParallelFor(n, 4, [&](int b, int e) {
          EXPECT_EQ(b % 4, 0);
          for (int i = b; i < e; ++i) hits[i]++;
        });
      }
      for (int i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 20) << i;
    }
  }
}

TEST(ThreadPoolTest, DefaultPoolIsResizable) {
  ThreadPool::SetDefaultThreads(3);
  EXPECT_EQ(ThreadPool::Default().num_threads(), 3);
  ThreadPool::SetDefaultThreads(2);
  EXPECT_EQ(ThreadPool::Default().num_threads(), 2);
}

}  // namespace
}  // namespace specserve
