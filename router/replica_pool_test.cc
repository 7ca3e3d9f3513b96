// ReplicaPool: replica-list parsing and DNS expansion, round-robin over
// healthy replicas (real target servers on loopback), dead replicas,
// compatibility verdicts, and reconnect re-checks.

#include "router/replica_pool.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "router/request_runner.h"
#include "router/test_env.h"
#include "router/target_client.h"

namespace specserve {
namespace {

using namespace router_test;  // NOLINT: test helpers

TEST(ParseReplicaListTest, AcceptsHostPortsAndDnsNames) {
  auto r = ParseReplicaList(
      " 127.0.0.1:50051, localhost:1,[::1]:65535,dns:///svc.local:80,dns:h:2,",
      "--target");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<std::string>{"127.0.0.1:50051", "localhost:1",
                                          "[::1]:65535", "dns:///svc.local:80",
                                          "dns:h:2"}));
  EXPECT_TRUE(ParseReplicaList("", "--speculator")->empty());
  for (const char* bad : {"localhost", ":80", "h:0", "h:65536", "h:x",
                          "dns:///name", "[::1:80", "a:1,b"}) {
    auto s = ParseReplicaList(bad, "--target");
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << bad;
    EXPECT_NE(s.status().message().find("--target"), std::string::npos);
  }
}

TEST(ResolveReplicaEntryTest, ExpandsDnsNamesOnly) {
  EXPECT_EQ(*ResolveReplicaEntry("localhost:7"),
            std::vector<std::string>{"localhost:7"});
  auto r = ResolveReplicaEntry("dns:///localhost:7");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_FALSE(r->empty());
  for (const std::string& a : *r) {
    EXPECT_TRUE(a == "127.0.0.1:7" || a == "[::1]:7") << a;
  }
  r = ResolveReplicaEntry("dns:127.0.0.1:9");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, std::vector<std::string>{"127.0.0.1:9"});
}

class ReplicaPoolTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { SetEngineThreads(1); }

  std::unique_ptr<ReplicaPool> MakePool(const std::string& list,
                                        ReplicaPool::CheckFn check = nullptr) {
    ReplicaPoolOptions o;
    o.service = "target";
    o.health_period = absl::Milliseconds(50);
    auto p = ReplicaPool::Create(list, "--target", o, TargetInfoFn(),
                                 std::move(check));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
};

// A replica going down is logged once, whether a health check or a failed
// request notices first, as its coming up is (the router used to log only
// "healthy").
TEST_F(ReplicaPoolTest, LogsEachHealthTransitionOnce) {
  for (bool reported : {false, true}) {
    auto t = StartTarget();
    ASSERT_NE(t, nullptr);
    const std::string addr = Addr(t->port());
    absl::Mutex mu;
    std::vector<std::string> lines;
    ReplicaPoolOptions o;
    o.service = "target";
    o.health_period = absl::Milliseconds(50);
    o.log = [&](const std::string& line) {
      absl::MutexLock lock(&mu);
      lines.push_back(line);
    };
    auto pool = ReplicaPool::Create(addr, "--target", o, TargetInfoFn(), nullptr);
    ASSERT_TRUE(pool.ok()) << pool.status();
    (*pool)->Start();
    ASSERT_EQ((*pool)->num_healthy(), 1);
    t->Shutdown(absl::ZeroDuration());
    t.reset();
    if (reported) (*pool)->ReportFailure(addr);  // a request saw it first
    ASSERT_TRUE(Eventually([&] { return (*pool)->num_healthy() == 0; }));
    absl::SleepFor(absl::Milliseconds(400));  // several more checks
    absl::MutexLock lock(&mu);
    ASSERT_EQ(lines.size(), 2u) << absl::StrJoin(lines, "\n");
    EXPECT_EQ(lines[0], absl::StrCat("router: target replica ", addr,
                                     " is healthy"));
    EXPECT_TRUE(absl::StartsWith(
        lines[1],
        absl::StrCat("router: target replica ", addr, " is unreachable")))
        << lines[1];
  }
}

// A replica that stops answering while its connection stays up (gRPC keeps
// the channel READY: a frozen process, a node gone without a reset) is
// asked again every recheck_period and leaves the pool; it comes back when
// it answers again. Simulated by an Info call that times out while the
// channel to the live server stays READY.
TEST_F(ReplicaPoolTest, SilentReplicaOnAReadyChannelLeavesThePool) {
  auto t = StartTarget();
  ASSERT_NE(t, nullptr);
  std::atomic<bool> silent{false};
  const ReplicaPool::InfoFn real = TargetInfoFn();
  ReplicaPoolOptions o;
  o.service = "target";
  o.health_period = absl::Milliseconds(20);
  o.recheck_period = absl::Milliseconds(200);
  o.log = [](const std::string&) {};
  auto pool = ReplicaPool::Create(
      Addr(t->port()), "--target", o,
      [&](const std::shared_ptr<grpc::Channel>& channel, absl::Time deadline,
          v1::ModelInfo* info) {
        if (silent) {
          return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "silent");
        }
        return real(channel, deadline, info);
      },
      nullptr);
  ASSERT_TRUE(pool.ok()) << pool.status();
  (*pool)->Start();
  ASSERT_EQ((*pool)->num_healthy(), 1);
  silent = true;
  ASSERT_TRUE(Eventually([&] { return (*pool)->num_healthy() == 0; }));
  silent = false;
  ASSERT_TRUE(Eventually([&] { return (*pool)->num_healthy() == 1; }));
}

TEST_F(ReplicaPoolTest, RoundRobinsOverHealthyReplicasAndSkipsDeadOnes) {
  auto a = StartTarget(), b = StartTarget();
  const std::string dead = Addr(DeadPort());
  auto pool =
      MakePool(absl::StrCat(Addr(a->port()), ",", dead, ",", Addr(b->port())));
  pool->Start();
  EXPECT_EQ(pool->num_healthy(), 2);
  EXPECT_EQ(pool->endpoints().size(), 3u);
  ASSERT_TRUE(pool->model_info().has_value());
  EXPECT_EQ(pool->model_info()->model_id(), "stories260K");
  std::map<std::string, int> picks;
  for (int i = 0; i < 10; ++i) {
    auto r = pool->Pick();
    ASSERT_TRUE(r.ok()) << r.status();
    ++picks[r->address];
  }
  EXPECT_EQ(picks[Addr(a->port())], 5);
  EXPECT_EQ(picks[Addr(b->port())], 5);
  EXPECT_EQ(picks.count(dead), 0u);

  // A replica reported down is skipped at once; the checker confirms it.
  b->Shutdown();
  pool->ReportFailure(Addr(b->port()));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(pool->Pick()->address, Addr(a->port()));
  EXPECT_TRUE(Eventually([&] { return pool->num_healthy() == 1; }));
  a->Shutdown();
  EXPECT_TRUE(Eventually([&] { return pool->num_healthy() == 0; }));
  auto none = pool->Pick();
  EXPECT_TRUE(absl::IsUnavailable(none.status())) << none.status();
  EXPECT_NE(none.status().message().find(dead), std::string::npos);
  // Each address says why its last check failed (e.g. a TLS handshake).
  EXPECT_NE(none.status().message().find(dead + ": UNAVAILABLE: "),
            std::string::npos)
      << none.status();
}

TEST_F(ReplicaPoolTest, IncompatibleReplicasBlockServing) {
  auto t = StartTarget();
  std::atomic<bool> accept{false};
  std::atomic<int> checks{0};
  auto pool = MakePool(Addr(t->port()), [&](const std::string& address,
                                            const v1::ModelInfo& info) {
    ++checks;
    if (accept) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("mismatch at ", address, " ", info.model_id()));
  });
  pool->Start();
  EXPECT_EQ(checks, 1);
  auto r = pool->Pick();
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status()));
  EXPECT_NE(r.status().message().find("stories260K"), std::string::npos);
  EXPECT_TRUE(absl::IsFailedPrecondition(pool->compatibility()));
  // A verdict is re-evaluated when the replica is re-checked (reconnect).
  accept = true;
  pool->ReportFailure(Addr(t->port()));
  EXPECT_TRUE(Eventually([&] { return pool->compatibility().ok(); }));
  EXPECT_TRUE(pool->Pick().ok());
}

TEST_F(ReplicaPoolTest, PicksUpAReplicaThatStartsLate) {
  const int port = DeadPort();
  auto pool = MakePool(Addr(port));
  pool->Start();
  EXPECT_TRUE(absl::IsUnavailable(pool->Pick().status()));
  TargetServerOptions o;
  o.model_dir = kTargetModel;
  o.host = "127.0.0.1";
  auto t = TargetServer::Create(o);
  ASSERT_TRUE(t.ok());
  if (!(*t)->Start(port).ok()) GTEST_SKIP() << "port " << port << " taken";
  EXPECT_TRUE(Eventually([&] { return pool->Pick().ok(); }));
}

TEST_F(ReplicaPoolTest, DnsEntriesExpandToReplicas) {
  auto t = StartTarget();
  auto pool = MakePool(absl::StrCat("dns:///localhost:", t->port()));
  pool->Start();
  // localhost may resolve to ::1 too, where nothing listens.
  const auto eps = pool->endpoints();
  EXPECT_NE(std::find(eps.begin(), eps.end(), Addr(t->port())), eps.end());
  EXPECT_EQ(pool->num_healthy(), 1);
  EXPECT_EQ(pool->Pick()->address, Addr(t->port()));
}

}  // namespace
}  // namespace specserve
