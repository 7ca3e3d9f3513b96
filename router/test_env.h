#ifndef SPECSERVE_ROUTER_TEST_ENV_H_
#define SPECSERVE_ROUTER_TEST_ENV_H_

// Test helpers for the router: the bundled speculator/target pair served
// in-process on 127.0.0.1:0, the plain greedy reference, polling with a
// deadline, and Prometheus text lookups.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/speculation/test_util.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "speculator_service/speculator_server.h"
#include "target_service/target_server.h"

namespace specserve {
namespace router_test {

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
  auto s = SpeculatorServer::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok() || !(*s)->Start(0).ok()) return nullptr;
  return *std::move(s);
}

inline std::unique_ptr<TargetServer> StartTarget() {
  TargetServerOptions o;
  o.model_dir = kTargetModel;
  o.host = "127.0.0.1";
  auto s = TargetServer::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok() || !(*s)->Start(0).ok()) return nullptr;
  return *std::move(s);
}

inline std::string Addr(int port) { return absl::StrCat("127.0.0.1:", port); }

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
inline std::vector<int> Reference(const Transformer& model,
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

/// Polls `cond` for up to 10 s (cleanup on the services is asynchronous).
inline bool Eventually(const std::function<bool()>& cond) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return cond();
}

/// The value of the Prometheus text-format series `name` whose labels
/// contain every string in `labels`; NaN if absent.
inline double MetricValue(const std::string& text, const std::string& name,
                          const std::vector<std::string>& labels = {}) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.rfind(name, 0) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : ' ';
    if (next != ' ' && next != '{') continue;
    bool all = true;
    for (const auto& l : labels) all &= line.find(l) != std::string::npos;
    if (all) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return std::nan("");
}

/// A raw unary call through the generic stub (no generated health /
/// reflection stubs in the system headers): one request, half-close, one
/// response; `request` and the result are serialized messages.
inline absl::StatusOr<std::string> RawCall(
    const std::shared_ptr<grpc::Channel>& ch, const std::string& method,
    const std::string& request) {
  grpc::GenericStub stub(ch);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto call = stub.PrepareCall(&ctx, method, &cq);
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::Status status;
  bool got = false;
  auto step = [&](intptr_t tag) {
    void* t;
    bool ok = false;
    cq.Next(&t, &ok);  // every op completes by the context deadline
    return ok && t == reinterpret_cast<void*>(tag);
  };
  call->StartCall(reinterpret_cast<void*>(1));
  if (step(1)) {
    call->Write(req, reinterpret_cast<void*>(2));
    step(2);
    call->WritesDone(reinterpret_cast<void*>(3));
    step(3);
    call->Read(&resp, reinterpret_cast<void*>(4));
    got = step(4);
  }
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  }
  if (!got) return absl::InternalError("no response");
  std::vector<grpc::Slice> slices;
  resp.Dump(&slices);
  std::string out;
  for (const auto& sl : slices) {
    out.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return out;
}

/// GET http://127.0.0.1:`port``path` with a raw socket (5 s timeouts);
/// the whole HTTP response, or "" on failure.
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        "GET " + path + " HTTP/1.0\r\nConnection: close\r\n\r\n";
    if (send(fd, req.data(), req.size(), 0) == ssize_t(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

}  // namespace router_test
}  // namespace specserve

#endif  // SPECSERVE_ROUTER_TEST_ENV_H_
