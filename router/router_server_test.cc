// The router over real loopback gRPC (port 0) in front of the bundled pair
// served in-process: unary vs. streaming, Info / health / reflection,
// validation, tokenizer mismatch, dead or hanging targets (deadlines), the
// concurrency limit, client cancellation, many mixed concurrent clients, and
// metrics (in process and over HTTP).

#include "router/router_server.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/service/grpc_util.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "protos/router.grpc.pb.h"
#include "protos/speculator.grpc.pb.h"
#include "protos/target.grpc.pb.h"
#include "router/test_env.h"
#include "router/target_client.h"
#include "router/speculator_client.h"

namespace specserve {
namespace {

using namespace router_test;  // NOLINT: test helpers

std::unique_ptr<grpc::ClientContext> Context(
    absl::Duration timeout = absl::Seconds(20)) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return ctx;
}

std::vector<int> Ids(const google::protobuf::RepeatedField<int32_t>& r) {
  return {r.begin(), r.end()};
}

// A Target that accepts the prefill and then answers nothing until released
// or cancelled: holds requests in flight deterministically.
class HangingTarget final : public v1::Target::Service {
 public:
  explicit HangingTarget(v1::ModelInfo info) : info_(std::move(info)) {}

  grpc::Status Info(grpc::ServerContext*, const v1::InfoRequest*,
                    v1::ModelInfo* out) override {
    *out = info_;
    return grpc::Status::OK;
  }
  grpc::Status Generate(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::GenerateResponse, v1::GenerateRequest>* s)
      override {
    v1::GenerateRequest req;
    if (!s->Read(&req)) return grpc::Status::CANCELLED;
    absl::MutexLock lock(&mu_);
    ++started_;
    while (!released_ && !ctx->IsCancelled()) {
      mu_.AwaitWithTimeout(absl::Condition(&released_), absl::Milliseconds(5));
    }
    if (!released_) {
      ++cancelled_;
      return grpc::Status::CANCELLED;
    }
    v1::GenerateResponse r;
    r.add_token_ids(400);
    r.set_finish_reason("length");
    s->Write(r);
    s->Read(&req);  // the half-close
    return grpc::Status::OK;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }
  int started() {
    absl::MutexLock lock(&mu_);
    return started_;
  }
  int cancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

 private:
  const v1::ModelInfo info_;
  absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  int cancelled_ ABSL_GUARDED_BY(mu_) = 0;
};

class RouterServerTest : public ServicesTest {
 protected:
  void TearDown() override {
    if (router_) router_->Shutdown();
    if (hanging_server_) hanging_server_->Shutdown();
  }

  // Starts a router in front of the in-process services (unless `tweak`
  // points it elsewhere).
  void StartRouter(std::function<void(RouterServerOptions*)> tweak = {}) {
    RouterServerOptions o;
    o.host = "127.0.0.1";
    o.speculator = Addr(speculator_->port());
    o.target = Addr(target_->port());
    o.tokenizer_dir = kTargetModel;
    o.pool.health_period = absl::Milliseconds(100);
    if (tweak) tweak(&o);
    auto r = RouterServer::Create(o);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = *std::move(r);
    ASSERT_TRUE(router_->Start(0).ok());
    channel_ = grpc::CreateChannel(Addr(router_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Router::NewStub(channel_);
  }

  // Serves a HangingTarget that reports the stories260K vocabulary.
  std::string StartHangingTarget() {
    v1::ModelInfo info;
    info.set_model_id("hanging");
    info.set_vocab_size(512);
    info.set_max_context(512);
    info.set_tokenizer_fingerprint(tokenizer_->Fingerprint());
    hanging_ = std::make_unique<HangingTarget>(info);
    int port = 0;
    hanging_server_ = Serve(hanging_.get(), &port);
    return Addr(port);
  }

  static v1::GenerateTextRequest Request(const std::string& text, int max_new) {
    v1::GenerateTextRequest r;
    r.set_text(text);
    r.mutable_sampling()->set_max_new_tokens(max_new);
    return r;
  }
  grpc::Status Generate(const v1::GenerateTextRequest& req,
                        v1::GenerateTextResponse* resp,
                        absl::Duration timeout = absl::Seconds(20)) {
    auto ctx = Context(timeout);
    return stub_->Generate(ctx.get(), req, resp);
  }
  // GenerateStream folded into one response; `chunks` counts messages.
  grpc::Status Stream(const v1::GenerateTextRequest& req,
                      v1::GenerateTextResponse* resp, int* chunks,
                      bool* only_last_has_finish) {
    auto ctx = Context();
    auto reader = stub_->GenerateStream(ctx.get(), req);
    v1::GenerateTextChunk c;
    *chunks = 0;
    *only_last_has_finish = true;
    bool finished = false;
    while (reader->Read(&c)) {
      ++*chunks;
      if (finished) *only_last_has_finish = false;
      finished = !c.finish_reason().empty();
      v1::GenerateTextResponse* r = resp;
      r->mutable_text()->append(c.text());
      r->mutable_token_ids()->Add(c.token_ids().begin(), c.token_ids().end());
      if (finished) {
        r->set_finish_reason(c.finish_reason());
        *r->mutable_usage() = c.usage();
        *r->mutable_stats() = c.stats();
      }
    }
    if (!finished) *only_last_has_finish = false;
    return reader->Finish();
  }
  std::vector<int> FullReference(const std::string& text, int max_new) {
    auto p = tokenizer_->Encode(text, true);
    EXPECT_TRUE(p.ok());
    return Reference(*model_, *p, {}, static_cast<int>(p->size()), max_new);
  }
  std::string Metrics() {
    return prometheus::TextSerializer().Serialize(
        router_->registry()->Collect());
  }

  std::unique_ptr<HangingTarget> hanging_;
  std::unique_ptr<grpc::Server> hanging_server_;
  std::unique_ptr<RouterServer> router_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Router::Stub> stub_;
};


TEST_F(RouterServerTest, StreamingAndUnaryGiveTheTargetsText) {
  StartRouter();
  const std::string text = StoryPrompt(2);
  const int kNew = 40;
  const std::vector<int> want = FullReference(text, kNew);
  v1::GenerateTextRequest req = Request(text, kNew);
  req.mutable_speculative_prefill()->set_keep_ratio(1.f);
  v1::GenerateTextResponse unary, streamed;
  ASSERT_TRUE(Generate(req, &unary).ok());
  int chunks = 0;
  bool last_only = false;
  grpc::Status s = Stream(req, &streamed, &chunks, &last_only);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Ids(unary.token_ids()), want);
  EXPECT_EQ(unary.text(), *tokenizer_->Decode(want));
  EXPECT_EQ(streamed.text(), unary.text());
  EXPECT_EQ(Ids(streamed.token_ids()), want);
  EXPECT_EQ(streamed.finish_reason(), unary.finish_reason());
  EXPECT_EQ(streamed.usage().completion_tokens(), int(want.size()));
  EXPECT_GT(chunks, 1);
  EXPECT_TRUE(last_only);
  EXPECT_GT(unary.stats().num_drafts(), 0);  // flag defaults: spec decode on
  EXPECT_EQ(unary.stats().fallback_reason(), "");
}

TEST_F(RouterServerTest, InfoHealthAndReflection) {
  StartRouter();
  v1::RouterInfo info;
  auto ctx = Context();
  ASSERT_TRUE(stub_->Info(ctx.get(), v1::InfoRequest(), &info).ok());
  EXPECT_EQ(info.target().model_id(), "stories260K");
  EXPECT_EQ(info.speculator().model_id(), "stories260K-draft");
  EXPECT_EQ(info.target().tokenizer_fingerprint(), tokenizer_->Fingerprint());
  ASSERT_EQ(info.target_endpoints_size(), 1);
  EXPECT_EQ(info.target_endpoints(0), Addr(target_->port()));
  EXPECT_EQ(info.speculator_endpoints(0), Addr(speculator_->port()));
  // HealthCheckResponse{status: SERVING(1)}, then NOT_SERVING(2) once the
  // target is gone.
  EXPECT_EQ(*RawCall(channel_, "/grpc.health.v1.Health/Check", ""),
            std::string("\x08\x01", 2));
  auto refl = RawCall(channel_,
                      "/grpc.reflection.v1alpha.ServerReflection/"
                      "ServerReflectionInfo",
                      std::string("\x3a\x00", 2));
  ASSERT_TRUE(refl.ok()) << refl.status();
  EXPECT_NE(refl->find("specserve.v1.Router"), std::string::npos);
  target_->Shutdown();
  EXPECT_TRUE(Eventually([&] {
    auto h = RawCall(channel_, "/grpc.health.v1.Health/Check", "");
    return h.ok() && *h == std::string("\x08\x02", 2);
  }));
}

// --api_key guards the gRPC door as it guards HTTP's: the metadata
// "authorization: Bearer <key>" (scheme in any case); health stays open.
TEST_F(RouterServerTest, ApiKeyGuardsTheGrpcApi) {
  StartRouter([](RouterServerOptions* o) { o->api_key = "s3cret"; });
  v1::GenerateTextRequest req;
  req.set_text("Once upon a time");
  req.mutable_sampling()->set_max_new_tokens(2);
  v1::GenerateTextResponse resp;
  {
    auto ctx = Context();
    const grpc::Status st = stub_->Generate(ctx.get(), req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_NE(st.error_message().find("authorization"), std::string::npos)
        << st.error_message();
  }
  {
    auto ctx = Context();
    ctx->AddMetadata("authorization", "Bearer wrong");
    auto reader = stub_->GenerateStream(ctx.get(), req);
    v1::GenerateTextChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    auto ctx = Context();
    v1::RouterInfo info;
    EXPECT_EQ(stub_->Info(ctx.get(), v1::InfoRequest(), &info).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  for (const char* auth : {"Bearer s3cret", "bearer s3cret"}) {
    auto ctx = Context();
    ctx->AddMetadata("authorization", auth);
    const grpc::Status st = stub_->Generate(ctx.get(), req, &resp);
    EXPECT_TRUE(st.ok()) << auth << ": " << st.error_message();
  }
  EXPECT_EQ(*RawCall(channel_, "/grpc.health.v1.Health/Check", ""),
            std::string("\x08\x01", 2));
}

TEST_F(RouterServerTest, BadRequestsAreInvalidArgumentNamingTheField) {
  StartRouter();
  struct Case {
    std::function<void(v1::GenerateTextRequest*)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](auto* r) { r->clear_text(); }, "prompt"},
      {[](auto* r) { r->set_text(""); }, "text"},
      {[](auto* r) { r->mutable_token_ids()->add_ids(-1); }, "token_ids"},
      {[](auto* r) { r->mutable_token_ids()->add_ids(512); }, "token_ids"},
      {[](auto* r) {
         for (int i = 0; i < 600; ++i) r->mutable_token_ids()->add_ids(9);
       },
       "max context"},
      {[](auto* r) { r->mutable_sampling()->set_max_new_tokens(0); },
       "max_new_tokens"},
      {[](auto* r) { r->mutable_sampling()->set_temperature(-0.5f); },
       "temperature"},
      {[](auto* r) { r->mutable_sampling()->set_top_k(-2); }, "top_k"},
      {[](auto* r) { r->mutable_sampling()->set_top_p(0); }, "top_p"},
      {[](auto* r) { r->mutable_sampling()->add_stop_token_ids(512); },
       "stop_token_ids"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_keep_ratio(0); },
       "keep_ratio"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_chunk_size(0); },
       "chunk_size"},
      {[](auto* r) {
         r->mutable_speculative_prefill()->set_pool_kernel_size(2);
       },
       "pool_kernel_size"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_look_ahead(-1); },
       "look_ahead"},
      {[](auto* r) {
         r->mutable_speculative_decoding()->set_num_draft_tokens(100);
       },
       "num_draft_tokens"},
      {[](auto* r) {
         r->mutable_sampling()->set_logprobs(true);
         r->mutable_sampling()->set_top_logprobs(21);
       },
       "top_logprobs"},
      {[](auto* r) {
         r->mutable_sampling()->set_logprobs(true);
         r->mutable_sampling()->set_top_logprobs(-3);
       },
       "top_logprobs"},
      {[](auto* r) { r->mutable_sampling()->set_top_logprobs(1); },
       "top_logprobs"},
  };
  for (const Case& c : cases) {
    v1::GenerateTextRequest req = Request("Once upon a time", 8);
    c.edit(&req);
    v1::GenerateTextResponse resp;
    grpc::Status s = Generate(req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_NE(s.error_message().find(c.field), std::string::npos)
        << c.field << ": " << s.error_message();
  }
  EXPECT_EQ(MetricValue(Metrics(), "specserve_router_requests_total",
                        {"INVALID_ARGUMENT"}),
            cases.size());
}

TEST_F(RouterServerTest, TokenizerMismatchIsFailedPreconditionNamingBoth) {
  StartRouter([](RouterServerOptions* o) {
    o->tokenizer_dir = "models/tinystories-656K";
  });
  auto other = LoadTokenizer("models/tinystories-656K");
  ASSERT_TRUE(other.ok());
  v1::GenerateTextResponse resp;
  grpc::Status s = Generate(Request("Once upon a time", 8), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find(tokenizer_->Fingerprint()),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find((*other)->Fingerprint()), std::string::npos)
      << s.error_message();
  // The health status follows the replica checks on the router's health
  // period, so it may take one period to turn NOT_SERVING.
  EXPECT_TRUE(Eventually([&] {
    auto h = RawCall(channel_, "/grpc.health.v1.Health/Check", "");
    return h.ok() && *h == std::string("\x08\x02", 2);  // NOT_SERVING
  }));
}

// Same-family pairs pass (equal fingerprints, padded model vocabularies as
// Qwen's), cross-family ones do not.
TEST(VocabulariesMatchTest, SameFamilyWithPaddingPassesCrossFamilyFails) {
  // Router tokenizer (151,665 tokens) vs Qwen2.5-0.5B (151,936 rows).
  EXPECT_TRUE(VocabulariesMatch("aaaa", 151665, "aaaa", 151936, true));
  // A model smaller than the tokenizer cannot hold its ids.
  EXPECT_FALSE(VocabulariesMatch("aaaa", 151665, "aaaa", 151000, true));
  // Speculator 0.5B (151,936) vs target 7B (152,064), same tokenizer.
  EXPECT_TRUE(VocabulariesMatch("aaaa", 152064, "aaaa", 151936, false));
  // Llama 3 vs Qwen: different tokenizers.
  EXPECT_FALSE(VocabulariesMatch("aaaa", 128256, "bbbb", 151936, false));
  EXPECT_FALSE(VocabulariesMatch("aaaa", 151936, "bbbb", 151936, true));
  // No fingerprint: sizes must be equal.
  EXPECT_TRUE(VocabulariesMatch("", 512, "aaaa", 512, false));
  EXPECT_FALSE(VocabulariesMatch("", 512, "", 2048, false));
}

TEST_F(RouterServerTest, TargetDownIsUnavailableWithoutHanging) {
  StartRouter([](RouterServerOptions* o) { o->target = Addr(DeadPort()); });
  const absl::Time t0 = absl::Now();
  v1::GenerateTextResponse resp;
  grpc::Status s = Generate(Request("Once upon a time", 8), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  router_->Shutdown();

  // Killed after the router saw it healthy.
  StartRouter();
  ASSERT_TRUE(Generate(Request("Once upon a time", 4), &resp).ok());
  target_->Shutdown();
  const absl::Time t1 = absl::Now();
  s = Generate(Request("Once upon a time", 8), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(absl::Now() - t1, absl::Seconds(3));
}

TEST_F(RouterServerTest, SpeculatorDownFallsBackToTheTarget) {
  StartRouter();
  speculator_->Shutdown(absl::ZeroDuration());
  const std::string text = StoryPrompt(2);
  v1::GenerateTextResponse resp;
  ASSERT_TRUE(Generate(Request(text, 20), &resp).ok());
  EXPECT_EQ(resp.stats().fallback_reason(), "speculator_unavailable");
  EXPECT_EQ(Ids(resp.token_ids()), FullReference(text, 20));
  EXPECT_EQ(MetricValue(Metrics(), "specserve_router_fallbacks_total",
                        {"speculator_unavailable"}),
            1);
}

TEST_F(RouterServerTest, ClientDeadlineReachesTheTarget) {
  const std::string hanging = StartHangingTarget();
  StartRouter([&](RouterServerOptions* o) { o->target = hanging; });
  const absl::Time t0 = absl::Now();
  v1::GenerateTextResponse resp;
  grpc::Status s =
      Generate(Request("Once upon a time", 8), &resp, absl::Milliseconds(300));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  EXPECT_TRUE(Eventually([&] { return hanging_->cancelled() == 1; }));
  EXPECT_TRUE(Eventually([&] {
    return router_->in_flight() == 0 &&
           speculator_->sessions().num_sessions() == 0;
  }));
}

TEST_F(RouterServerTest, MaxConcurrentRequestsIsResourceExhausted) {
  StartRouter([](RouterServerOptions* o) { o->max_concurrent_requests = 0; });
  v1::GenerateTextResponse resp;
  EXPECT_EQ(Generate(Request("Once", 4), &resp).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  router_->Shutdown();

  const std::string hanging = StartHangingTarget();
  StartRouter([&](RouterServerOptions* o) {
    o->target = hanging;
    o->max_concurrent_requests = 1;
  });
  grpc::Status first;
  v1::GenerateTextResponse first_resp;
  std::thread held(
      [&] { first = Generate(Request("Once upon a time", 4), &first_resp); });
  ASSERT_TRUE(Eventually([&] { return hanging_->started() == 1; }));
  EXPECT_EQ(router_->in_flight(), 1);
  grpc::Status s = Generate(Request("Once", 4), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_concurrent_requests"),
            std::string::npos);
  hanging_->Release();
  held.join();
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_EQ(Ids(first_resp.token_ids()), std::vector<int>{400});
  EXPECT_TRUE(Eventually([&] { return router_->in_flight() == 0; }));
  EXPECT_TRUE(Generate(Request("Once", 4), &resp).ok());
  const std::string m = Metrics();
  EXPECT_EQ(
      MetricValue(m, "specserve_router_requests_total", {"RESOURCE_EXHAUSTED"}),
      1);
  EXPECT_EQ(MetricValue(m, "specserve_router_requests_total", {"\"OK\""}), 2);
  EXPECT_EQ(MetricValue(m, "specserve_router_in_flight_requests"), 0);
}

TEST_F(RouterServerTest, ClientCancelFreesBothSessions) {
  StartRouter();
  v1::GenerateTextRequest req = Request(StoryPrompt(2), 450);
  req.mutable_sampling()->set_ignore_eos(true);
  auto ctx = Context();
  auto reader = stub_->GenerateStream(ctx.get(), req);
  v1::GenerateTextChunk c;
  ASSERT_TRUE(reader->Read(&c));
  ctx->TryCancel();
  while (reader->Read(&c)) {
  }
  reader->Finish();
  EXPECT_TRUE(Eventually([&] {
    return speculator_->sessions().num_sessions() == 0 &&
           target_->active_sessions() == 0 && router_->in_flight() == 0;
  }));
}

TEST_F(RouterServerTest, ManyConcurrentClientsWithMixedSettings) {
  StartRouter();
  const std::string text = StoryPrompt(12);
  auto prompt = tokenizer_->Encode(text, true);
  ASSERT_TRUE(prompt.ok());
  const int n = static_cast<int>(prompt->size());
  const int kNew = 32;
  const std::vector<int> full = FullReference(text, kNew);
  // The pruned prefill's reference: what the speculator keeps at 0.3.
  v1::ScoreRequest sreq;
  sreq.mutable_token_ids()->Add(prompt->begin(), prompt->end());
  sreq.mutable_options()->set_keep_ratio(0.3f);
  sreq.mutable_options()->set_chunk_size(8);
  v1::ScoreResponse sresp;
  auto sctx = Context();
  ASSERT_TRUE(v1::Speculator::NewStub(
                  grpc::CreateChannel(Addr(speculator_->port()),
                                      grpc::InsecureChannelCredentials()))
                  ->Score(sctx.get(), sreq, &sresp)
                  .ok());
  std::vector<int> kept(sresp.kept_indices().begin(),
                        sresp.kept_indices().end()),
      kept_ids;
  for (int k : kept) kept_ids.push_back((*prompt)[k]);
  const std::vector<int> pruned = Reference(*model_, kept_ids, kept, n, kNew);

  constexpr int kClients = 12;
  std::vector<v1::GenerateTextRequest> reqs(kClients);
  std::vector<std::vector<int>> want(kClients);
  for (int i = 0; i < kClients; ++i) {
    v1::GenerateTextRequest& r = reqs[i];
    r = Request(text, kNew);
    auto* sp = r.mutable_speculative_prefill();
    sp->set_chunk_size(8);
    r.mutable_speculative_decoding()->set_num_draft_tokens(1 + i % 8);
    r.mutable_speculative_decoding()->set_enabled(i % 3 != 2);
    switch (i % 4) {
      case 0:
        sp->set_keep_ratio(1.f);
        want[i] = full;
        break;
      case 1:
        sp->set_keep_ratio(0.3f);
        want[i] = pruned;
        break;
      case 2:
        sp->set_enabled(false);
        want[i] = full;
        break;
      case 3:  // sampled: checked against the same request run alone
        sp->set_keep_ratio(0.5f);
        r.mutable_sampling()->set_temperature(0.9f);
        r.mutable_sampling()->set_seed(100 + i);
        break;
    }
  }
  for (int i = 3; i < kClients; i += 4) {
    v1::GenerateTextResponse alone;
    ASSERT_TRUE(Generate(reqs[i], &alone).ok());
    want[i] = Ids(alone.token_ids());
  }
  std::vector<v1::GenerateTextResponse> got(kClients);
  std::vector<grpc::Status> status(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      if (i % 2 == 0) {
        status[i] = Generate(reqs[i], &got[i]);
      } else {
        int chunks;
        bool last_only;
        status[i] = Stream(reqs[i], &got[i], &chunks, &last_only);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(status[i].ok()) << status[i].error_message();
    EXPECT_EQ(Ids(got[i].token_ids()), want[i]);
    EXPECT_EQ(got[i].text(), *tokenizer_->Decode(want[i]));
    EXPECT_EQ(got[i].stats().fallback_reason(), "");
  }
  EXPECT_TRUE(Eventually([&] {
    return speculator_->sessions().num_sessions() == 0 &&
           target_->active_sessions() == 0;
  }));
}

TEST_F(RouterServerTest, MetricsCountRequestsTokensAndDrafts) {
  StartRouter();
  v1::GenerateTextRequest req = Request(StoryPrompt(2), 30);
  req.mutable_speculative_prefill()->set_keep_ratio(1.f);
  v1::GenerateTextResponse a, b;
  ASSERT_TRUE(Generate(req, &a).ok());
  req.mutable_speculative_decoding()->set_num_draft_tokens(6);
  ASSERT_TRUE(Generate(req, &b).ok());
  const std::string m = Metrics();
  const auto stat = [&](auto f) { return double(f(a) + f(b)); };
  EXPECT_EQ(MetricValue(m, "specserve_router_requests_total", {"\"OK\""}), 2);
  EXPECT_EQ(MetricValue(m, "specserve_router_ttft_seconds_count"), 2);
  EXPECT_EQ(MetricValue(m, "specserve_router_e2e_latency_seconds_count"), 2);
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_time_per_output_token_seconds_"
                        "count"),
            2);
  EXPECT_EQ(MetricValue(m, "specserve_router_keep_ratio_count"), 2);
  EXPECT_EQ(MetricValue(m, "specserve_router_prompt_tokens_total"),
            stat([](auto& r) { return r.usage().prompt_tokens(); }));
  EXPECT_EQ(MetricValue(m, "specserve_router_kept_prompt_tokens_total"),
            stat([](auto& r) { return r.usage().kept_prompt_tokens(); }));
  EXPECT_EQ(MetricValue(m, "specserve_router_completion_tokens_total"), 60);
  const std::string draft = "method=\"draft\"";
  EXPECT_EQ(
      MetricValue(m, "specserve_router_spec_decode_num_drafts_total", {draft}),
      stat([](auto& r) { return r.stats().num_drafts(); }));
  EXPECT_EQ(MetricValue(m, "specserve_router_spec_decode_num_draft_tokens_total",
                        {draft}),
            stat([](auto& r) { return r.stats().num_draft_tokens(); }));
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_spec_decode_num_accepted_tokens_total",
                        {draft}),
            stat([](auto& r) { return r.stats().num_accepted_tokens(); }));
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_spec_decode_num_accepted_tokens_per_"
                        "pos_total",
                        {draft, "position=\"0\""}),
            stat([](auto& r) { return r.stats().accepted_per_position(0); }));
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_spec_decode_num_target_forwards_total",
                        {draft}),
            stat([](auto& r) { return r.stats().num_target_forwards(); }));
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_spec_decode_num_emitted_tokens_total",
                        {draft}),
            60);
  EXPECT_EQ(MetricValue(m, "specserve_router_in_flight_requests"), 0);

  int port = 0;
  auto exposer = StartMetricsExposer("127.0.0.1", 0, router_->registry(), &port);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  const std::string http = HttpGet(port, "/metrics");
  EXPECT_NE(http.find("200 OK"), std::string::npos) << http.substr(0, 200);
  EXPECT_NE(http.find("specserve_router_completion_tokens_total 60"),
            std::string::npos);
}

}  // namespace
}  // namespace specserve
