#ifndef SPECSERVE_ROUTER_TEST_ENV_H_
#define SPECSERVE_ROUTER_TEST_ENV_H_

// Test helpers for the router: the bundled speculator/target pair served
// in-process on 127.0.0.1:0, the plain greedy reference, polling with a
// deadline, and Prometheus text lookups.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/service/grpc_util.h"
#include "common/service/service_test_util.h"
#include "common/engine/test_util.h"
#include "common/tokenizer/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "speculator_service/speculator_server.h"
#include "target_service/target_server.h"

namespace specserve {
namespace router_test {

using service_test::Eventually;
using service_test::HttpGet;
using service_test::MetricValue;
using service_test::RawCall;

inline constexpr char kDraftModel[] = "models/stories260K-draft";
inline constexpr char kTargetModel[] = "models/stories260K";
inline constexpr int kEos = 2;

/// A story prompt of roughly `sentences` * 12 tokens (up to 12 distinct
/// sentences, then repeating).
inline std::string StoryPrompt(int sentences) {
  static const char* kSentences[] = {
      "Once upon a time, there was a little girl named Lily.",
      " She loved to play outside with her dog Max.",
      " One day, they found a big red ball in the park.",
      " Lily was very happy and she wanted to share it with her friends.",
      " Her mom said that sharing is a good thing to do.",
      " Then a bird flew down from a tall tree and sang a song.",
      " Tom the cat was hungry, so he looked for some milk.",
      " The sun was hot and the sky was blue.",
      " Ben had a toy car that could go very fast.",
      " They all went home and ate a big cake together.",
      " The old man smiled and gave the boy a shiny coin.",
      " It started to rain, and the frog jumped into the pond.",
  };
  std::string s;
  for (int i = 0; i < sentences; ++i) s += kSentences[i % 12];
  return s;
}

inline std::unique_ptr<SpeculatorServer> StartSpeculator() {
  SpeculatorServerOptions o;
  o.model_dir = kDraftModel;
  o.host = "127.0.0.1";
  o.runner.device = "cpu";  // references come from the CPU engine
  auto s = SpeculatorServer::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok() || !(*s)->Start(0).ok()) return nullptr;
  return *std::move(s);
}

inline std::unique_ptr<TargetServer> StartTarget() {
  TargetServerOptions o;
  o.model_dir = kTargetModel;
  o.host = "127.0.0.1";
  o.runner.device = "cpu";
  auto s = TargetServer::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok() || !(*s)->Start(0).ok()) return nullptr;
  return *std::move(s);
}

inline std::string Addr(int port) { return absl::StrCat("127.0.0.1:", port); }

/// Serves `service` (a fake speculator or target) on 127.0.0.1:0 and writes
/// the port it got.
inline std::unique_ptr<grpc::Server> Serve(grpc::Service* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

/// A loopback port nothing listens on (bound, then closed).
inline int DeadPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(fd, reinterpret_cast<sockaddr*>(&a), len);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

/// The target's plain greedy continuation of `tokens` at `positions`
/// (default 0..n-1), decoding from `next_position`, cut before the first
/// EOS the way the target stops.
inline std::vector<int> Reference(ModelRunner& model,
                                  const std::vector<int>& tokens,
                                  const std::vector<int>& positions,
                                  int next_position, int n) {
  std::vector<int> out =
      testing_util::GreedyReference(model, tokens, positions, next_position, n);
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == kEos) out.resize(i);
  }
  return out;
}





/// Base fixture: the target model and tokenizer loaded once per suite (for
/// references), and fresh in-process speculator and target services on
/// 127.0.0.1:0 for every test.
class ServicesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    SetEngineThreads(1);
    EnableHealthAndReflection();
    model_ = testing_util::MakeCpuRunner(testing_util::LoadBundled("stories260K"))
                 .release();
    auto tok = LoadTokenizer(kTargetModel);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = tok->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tokenizer_;
    model_ = nullptr;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    speculator_ = StartSpeculator();
    target_ = StartTarget();
    ASSERT_NE(speculator_, nullptr);
    ASSERT_NE(target_, nullptr);
  }

  static inline CpuModelRunner* model_ = nullptr;
  static inline Tokenizer* tokenizer_ = nullptr;
  std::unique_ptr<SpeculatorServer> speculator_;
  std::unique_ptr<TargetServer> target_;
};

}  // namespace router_test
}  // namespace specserve

#endif  // SPECSERVE_ROUTER_TEST_ENV_H_
