#include "common/engine/thread_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
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
          EXPECT_LE(e, n);
          for (int i = b; i < e; ++i) hits[i]++;
        });
      }
      for (int i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 20) << i;
    }
  }
}

// A slow chunk (as when the OS deschedules the thread running it) must not
// keep the other thread from claiming the remaining chunks: every index is
// still covered exactly once.
TEST(ThreadPoolTest, UnevenChunksStillCoverEverything) {
  ThreadPool pool(2);
  std::vector<std::atomic<int>> hits(64);
  pool.ParallelFor(64, 1, [&](int b, int e) {
    if (b == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int i = b; i < e; ++i) hits[i]++;
  });
  for (int i = 0; i < 64; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
}

// Back-to-back jobs (as in a decode step): a worker that wakes late must
// never run a chunk twice or a chunk of the wrong job.
TEST(ThreadPoolTest, ManyBackToBackJobsRunEachChunkOnce) {
  ThreadPool pool(2);
  for (int job = 0; job < 20000; ++job) {
    std::vector<int> hits(37, 0);
    pool.ParallelFor(37, 1, [&](int b, int e) {
      for (int i = b; i < e; ++i) hits[i] += job + 1;  // disjoint ranges
    });
    for (int i = 0; i < 37; ++i) ASSERT_EQ(hits[i], job + 1) << job << " " << i;
  }
}

// Wake() publishes an empty job: interleaved with real jobs, from sleeping
// and from spinning workers, it never makes a chunk run twice or not at
// all, and on a one-thread pool it does nothing.
TEST(ThreadPoolTest, WakeBetweenJobsKeepsEveryChunkRunOnce) {
  ThreadPool single(1);
  single.Wake();
  int calls = 0;
  single.ParallelFor(8, 1, [&](int b, int e) { calls += e - b; });
  EXPECT_EQ(calls, 8);

  ThreadPool pool(2);
  for (int job = 0; job < 2000; ++job) {
    if (job % 100 == 0) {
      // Long enough for the worker to stop spinning and block.
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
    if (job % 3 != 0) pool.Wake();
    if (job % 7 == 0) pool.Wake();
    std::vector<int> hits(19, 0);
    pool.ParallelFor(19, 1, [&](int b, int e) {
      for (int i = b; i < e; ++i) hits[i] += job + 1;
    });
    for (int i = 0; i < 19; ++i) {
      ASSERT_EQ(hits[i], job + 1) << job << " " << i;
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
