// Checks tsan_grpc_sync.cc from both sides under --config=tsan: a gRPC
// callback reactor that hands its state from the thread that starts an
// operation to the reaction on a gRPC thread correctly is not reported
// (without the modeled edges it is), and one that touches that state after
// starting the operation still is (the edges must not hide our races).
// Without TSan only the first test runs, as a plain bidi stream test.

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "protos/speculator.grpc.pb.h"

namespace specserve {
namespace {

// Echoes num_draft_tokens back as draft_ns. Each reply is produced on a
// worker thread, as our services do on their schedulers: the worker sets
// value_ and starts the write; OnWriteDone, on a gRPC thread, reads value_.
// (A first version kept the worker in a std::thread member assigned after
// the worker started, and TSan duly reported the next OnReadDone's access.)
// `racy`: the worker sets value_ only after StartWrite, which nothing
// orders before OnWriteDone.
class EchoReactor final
    : public grpc::ServerBidiReactor<v1::DraftRequest, v1::DraftResponse> {
 public:
  explicit EchoReactor(bool racy) : racy_(racy) { StartRead(&req_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    std::thread worker([this] {
      resp_.set_draft_ns(req_.num_draft_tokens());
      if (racy_) {
        StartWrite(&resp_);
        value_ = req_.num_draft_tokens();  // after the hand-off: a race
      } else {
        value_ = req_.num_draft_tokens();
        StartWrite(&resp_);
      }
    });
    // The worker may already have started the write: reactor members it
    // uses are not touched here any more, the thread list has its own lock.
    absl::MutexLock lock(&mu_);
    workers_.push_back(std::move(worker));
  }

  void OnWriteDone(bool ok) override {
    last_value_ = value_;
    if (ok) StartRead(&req_);
  }

  void OnDone() override {
    std::vector<std::thread> workers;
    {
      absl::MutexLock lock(&mu_);
      workers.swap(workers_);
    }
    for (std::thread& w : workers) w.join();
    delete this;
  }

 private:
  const bool racy_;
  v1::DraftRequest req_;
  v1::DraftResponse resp_;
  int value_ = 0;
  int last_value_ = 0;
  absl::Mutex mu_;
  std::vector<std::thread> workers_ ABSL_GUARDED_BY(mu_);
};

class EchoService final : public v1::Speculator::CallbackService {
 public:
  explicit EchoService(bool racy) : racy_(racy) {}

  grpc::ServerBidiReactor<v1::DraftRequest, v1::DraftResponse>* Draft(
      grpc::CallbackServerContext* /*ctx*/) override {
    return new EchoReactor(racy_);
  }

 private:
  const bool racy_;
};

// Serves EchoService in process and streams `n` messages through it;
// returns whether every reply echoed its request.
bool RunStreams(bool racy, int n) {
  EchoService service(racy);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return false;
  auto stub = v1::Speculator::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                          grpc::InsecureChannelCredentials()));
  bool echoed = true;
  grpc::ClientContext ctx;
  auto stream = stub->Draft(&ctx);
  for (int i = 1; i <= n; ++i) {
    v1::DraftRequest req;
    req.set_num_draft_tokens(i);
    v1::DraftResponse resp;
    echoed = echoed && stream->Write(req) && stream->Read(&resp) &&
             resp.draft_ns() == i;
  }
  stream->WritesDone();
  echoed = echoed && stream->Finish().ok();
  server->Shutdown();
  return echoed;
}

TEST(TsanGrpcSyncTest, HandOffThroughAnOperationIsOrdered) {
  EXPECT_TRUE(RunStreams(/*racy=*/false, 50));
}

#if defined(__SANITIZE_THREAD__)
TEST(TsanGrpcSyncDeathTest, StateTouchedAfterStartWriteIsReported) {
  // TSan exits the (re-executed) child with a report.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(RunStreams(/*racy=*/true, 50),
               "ThreadSanitizer: data race");
}
#endif

}  // namespace
}  // namespace specserve
