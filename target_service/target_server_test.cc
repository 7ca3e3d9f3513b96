#include "target_service/target_server.h"
#include "common/service/service_test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/service/grpc_util.h"
#include "common/speculation/draft_session.h"
#include "common/speculation/target_session.h"
#include "common/engine/test_util.h"
#include "common/tokenizer/tokenizer.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace specserve {
namespace {

using testing_util::GreedyReference;
using testing_util::LoadBundled;

const std::vector<int> kPrompt = {1, 403, 407, 261, 378, 432, 383, 286, 261,
                                  376, 400, 428, 395};

// Drafts for the next round, given the tokens the target emitted in the
// previous one (empty before the first round).
using DraftFn = std::function<std::vector<DraftToken>(const std::vector<int>&)>;

DraftFn NoDrafts() {
  return [](const std::vector<int>&) { return std::vector<DraftToken>(); };
}

// Proposes up to k drafts from an in-process DraftSession that has already
// prefilled the full prompt.
DraftFn FromDraftSession(DraftSession* session, int k) {
  return [session, k](const std::vector<int>& emitted) {
    auto d = session->Draft(emitted, k);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *d : std::vector<DraftToken>();
  };
}

void ToProto(const std::vector<DraftToken>& in,
             google::protobuf::RepeatedPtrField<v1::DraftToken>* out) {
  for (const DraftToken& d : in) {
    v1::DraftToken* p = out->Add();
    p->set_id(d.id);
    for (const auto& [id, prob] : d.q) {
      v1::TokenProb* tp = p->add_q();
      tp->set_id(id);
      tp->set_prob(prob);
    }
  }
}

v1::Prefill MakePrefill(const std::vector<int>& ids, int max_new) {
  v1::Prefill p;
  for (size_t i = 0; i < ids.size(); ++i) {
    p.add_token_ids(ids[i]);
    p.add_position_ids(static_cast<int>(i));
  }
  p.set_next_position(static_cast<int>(ids.size()));
  p.mutable_stop()->set_max_new_tokens(max_new);
  return p;
}

struct StreamResult {
  std::vector<int> tokens;
  std::vector<v1::GenerateResponse> responses;
  grpc::Status status;
};

std::unique_ptr<grpc::ClientContext> NewContext() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  return ctx;
}

// Drives one Generate stream the way the router does: prefill (+ first
// drafts), then one drafts message per response until finish_reason is set,
// then WritesDone + Finish.
StreamResult RunStream(v1::Target::Stub* stub, v1::Prefill prefill,
                       const DraftFn& drafts) {
  auto ctx = NewContext();
  auto rw = stub->Generate(ctx.get());
  v1::GenerateRequest req;
  *req.mutable_prefill() = std::move(prefill);
  ToProto(drafts({}), req.mutable_prefill()->mutable_drafts());
  StreamResult out;
  bool ok = rw->Write(req);
  v1::GenerateResponse resp;
  while (ok && rw->Read(&resp)) {
    out.responses.push_back(resp);
    std::vector<int> emitted(resp.token_ids().begin(), resp.token_ids().end());
    out.tokens.insert(out.tokens.end(), emitted.begin(), emitted.end());
    if (!resp.finish_reason().empty()) break;
    v1::GenerateRequest next;
    ToProto(drafts(emitted), next.mutable_drafts()->mutable_drafts());
    ok = rw->Write(next);
  }
  rw->WritesDone();
  out.status = rw->Finish();
  return out;
}

// The same request run through TargetSession in-process.
std::vector<int> RunInProcess(ModelRunner& model, TargetRequest r,
                              const DraftFn& drafts) {
  auto s = TargetSession::Create(&model, std::move(r));
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return {};
  std::vector<DraftToken> d = drafts({});
  while (!(*s)->finished()) {
    auto round = (*s)->Step(d);
    EXPECT_TRUE(round.ok()) << round.status();
    if (!round.ok()) break;
    if ((*s)->finished()) break;
    d = drafts(round->tokens);
  }
  return (*s)->output();
}

TargetRequest MakeRequest(const std::vector<int>& ids, int max_new) {
  TargetRequest r;
  r.token_ids = ids;
  r.position_ids.resize(ids.size());
  std::iota(r.position_ids.begin(), r.position_ids.end(), 0);
  r.next_position = static_cast<int>(ids.size());
  r.stop.max_new_tokens = max_new;
  return r;
}

// Value of the sample line `key value` in the Prometheus text rendering
// (key includes labels, e.g. name{position="0"}); -1 if absent.
double Metric(const TargetServer& server, const std::string& key) {
  const std::string text =
      prometheus::TextSerializer().Serialize(server.registry()->Collect());
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    if (line.rfind(key + " ", 0) == 0) {
      return std::stod(line.substr(key.size() + 1));
    }
    at = end + 1;
  }
  return -1;
}

bool WaitFor(const std::function<bool()>& pred) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!pred()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

class TargetServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { EnableHealthAndReflection(); }

  void SetUp() override {
    server_ = StartServer({});
    ASSERT_NE(server_, nullptr);
    stub_ = NewStub(*server_);
    target_w_ = LoadBundled("stories260K");
    draft_w_ = LoadBundled("stories260K-draft");
    ASSERT_NE(target_w_, nullptr);
    ASSERT_NE(draft_w_, nullptr);
    target_ = testing_util::MakeCpuRunner(target_w_);
    draft_ = testing_util::MakeCpuRunner(draft_w_);
  }

  static std::unique_ptr<TargetServer> StartServer(TargetServerOptions o) {
    o.model_dir = "models/stories260K";
    o.host = "127.0.0.1";
    o.runner.device = "cpu";  // compared with the CPU engine in-process
    auto server = TargetServer::Create(o);
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    absl::Status s = (*server)->Start(0);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_GT((*server)->port(), 0);
    return s.ok() ? *std::move(server) : nullptr;
  }

  static std::unique_ptr<v1::Target::Stub> NewStub(const TargetServer& s) {
    return v1::Target::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", s.port()),
                            grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<DraftSession> NewDraftSession(const SamplingParams& p) {
    auto ds = DraftSession::Create(draft_.get(), 512, p);
    EXPECT_TRUE(ds.ok()) << ds.status();
    ScoreOptions drafting_only;  // the prompt scored, no look-ahead
    drafting_only.look_ahead = 0;
    EXPECT_TRUE((*ds)->Score(kPrompt, drafting_only).ok());
    return *std::move(ds);
  }

  std::unique_ptr<TargetServer> server_;
  std::unique_ptr<v1::Target::Stub> stub_;
  std::shared_ptr<const ModelWeights> target_w_, draft_w_;
  std::unique_ptr<CpuModelRunner> target_, draft_;
};

TEST_F(TargetServerTest, GreedyWithDraftModelDraftsEqualsPlainGreedy) {
  const int kNew = 60;
  const std::vector<int> want =
      RunInProcess(*target_, MakeRequest(kPrompt, kNew), NoDrafts());
  ASSERT_EQ(want.size(), size_t(kNew));
  EXPECT_EQ(want, GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew));

  auto ds = NewDraftSession({});
  const StreamResult got =
      RunStream(stub_.get(), MakePrefill(kPrompt, kNew),
                FromDraftSession(ds.get(), 4));
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want);

  int drafts = 0, accepted = 0, at_pos0 = 0, at_pos3 = 0;
  for (size_t i = 0; i < got.responses.size(); ++i) {
    const v1::GenerateResponse& r = got.responses[i];
    drafts += r.num_drafts();
    accepted += r.num_accepted();
    at_pos0 += r.num_accepted() >= 1;
    at_pos3 += r.num_accepted() >= 4;
    EXPECT_EQ(r.timings().prefill_ns() > 0, i == 0);
    EXPECT_EQ(r.timings().verify_ns() > 0, i > 0);
    EXPECT_EQ(r.finish_reason().empty(), i + 1 < got.responses.size());
  }
  EXPECT_EQ(got.responses.back().finish_reason(), "length");
  EXPECT_EQ(got.responses.back().num_generated(), kNew);
  EXPECT_GT(accepted, 0);
  EXPECT_LT(got.responses.size(), size_t(kNew));  // speculation paid off

  // Counters advance exactly as the responses say (fresh registry).
  const TargetServer& s = *server_;
  EXPECT_EQ(Metric(s, "specserve_target_draft_tokens_total"), drafts);
  EXPECT_EQ(Metric(s, "specserve_target_accepted_tokens_total"), accepted);
  EXPECT_EQ(Metric(s, "specserve_target_emitted_tokens_total"), kNew);
  EXPECT_EQ(Metric(s, "specserve_target_prefill_tokens_total"),
            kPrompt.size());
  EXPECT_EQ(Metric(s, "specserve_target_accepted_tokens_per_pos_total{"
                      "position=\"0\"}"),
            at_pos0);
  EXPECT_EQ(Metric(s, "specserve_target_accepted_tokens_per_pos_total{"
                      "position=\"3\"}"),
            at_pos3);
  EXPECT_EQ(Metric(s, "specserve_target_prefill_seconds_count"), 1);
  EXPECT_EQ(Metric(s, "specserve_target_requests_total{status=\"OK\"}"), 1);
  EXPECT_EQ(Metric(s, "specserve_target_active_sessions"), 0);
  EXPECT_EQ(Metric(s, "specserve_target_kv_cache_bytes"), 0);
}

// Prefill.continuous: one message, then rounds of one token each to the
// greedy reference, a response carrying one round or (GenerateResponse.
// rounds) those that ended while the previous one was written; a message
// sent meanwhile is read after the last round (FAILED_PRECONDITION, as
// after any finish); a cancellation mid-way frees the session.
TEST_F(TargetServerTest, ContinuousStreamsDecodeWithoutMessages) {
  const int kNew = 40;
  const std::vector<int> want =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  v1::GenerateRequest req;
  *req.mutable_prefill() = MakePrefill(kPrompt, kNew);
  req.mutable_prefill()->set_continuous(true);
  {
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    ASSERT_TRUE(rw->Write(req));
    std::vector<int> got;
    v1::GenerateResponse resp;
    int responses = 0, rounds = 0;
    while (rw->Read(&resp)) {
      ++responses;
      const int n = std::max(1, resp.rounds_size());
      rounds += n;
      EXPECT_EQ(resp.token_ids_size(), n);  // a token per round
      EXPECT_NE(resp.rounds_size(), 1);     // listed only when several
      for (const v1::RoundCounts& r : resp.rounds()) {
        EXPECT_EQ(r.num_tokens(), 1);
        EXPECT_EQ(r.num_drafts(), 0);
      }
      EXPECT_EQ(resp.num_generated(), static_cast<int>(got.size()) + n);
      got.insert(got.end(), resp.token_ids().begin(), resp.token_ids().end());
      if (!resp.finish_reason().empty()) break;
    }
    EXPECT_EQ(resp.finish_reason(), "length");
    EXPECT_EQ(rounds, kNew);
    EXPECT_LE(responses, kNew);
    EXPECT_EQ(got, want);
    rw->WritesDone();
    EXPECT_TRUE(rw->Finish().ok());
  }
  {  // A drafts message meanwhile: every round still runs, then the error.
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    v1::GenerateRequest drafts;
    drafts.mutable_drafts();
    *req.mutable_prefill() = MakePrefill(kPrompt, 3);
    req.mutable_prefill()->set_continuous(true);
    ASSERT_TRUE(rw->Write(req));
    rw->Write(drafts);
    v1::GenerateResponse resp;
    int tokens = 0;
    while (rw->Read(&resp)) tokens += resp.token_ids_size();
    EXPECT_EQ(tokens, 3);
    EXPECT_EQ(rw->Finish().error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  {  // Cancelled mid-way: the session is freed.
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    *req.mutable_prefill() = MakePrefill(kPrompt, 400);
    req.mutable_prefill()->set_continuous(true);
    ASSERT_TRUE(rw->Write(req));
    v1::GenerateResponse resp;
    ASSERT_TRUE(rw->Read(&resp));
    ASSERT_TRUE(rw->Read(&resp));
    ctx->TryCancel();
    while (rw->Read(&resp)) {
    }
    EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
    ASSERT_TRUE(WaitFor([&] { return server_->active_sessions() == 0; }));
    EXPECT_EQ(server_->kv_used_bytes(), 0);
  }
}

// Prefill.prompt_lookup: the target drafts each later round itself by
// n-gram lookup over the prompt and its output. On a prompt that holds its
// own greedy continuation, rounds accept drafts and the output is still
// exactly greedy decoding; a bad lookup is INVALID_ARGUMENT.
TEST_F(TargetServerTest, PromptLookupInTheTargetDraftsItsOwnRounds) {
  const int kNew = 40;
  const std::vector<int> once =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  std::vector<int> prompt = kPrompt;
  prompt.insert(prompt.end(), once.begin(), once.end());
  prompt.insert(prompt.end(), kPrompt.begin(), kPrompt.end());
  const std::vector<int> want =
      GreedyReference(*target_, prompt, {}, prompt.size(), kNew);
  for (float temperature : {0.f, 0.8f}) {
    SCOPED_TRACE(temperature);
    v1::GenerateRequest req;
    *req.mutable_prefill() = MakePrefill(prompt, kNew);
    req.mutable_prefill()->set_continuous(true);
    req.mutable_prefill()->mutable_sampling()->set_temperature(temperature);
    req.mutable_prefill()->mutable_sampling()->set_seed(7);
    v1::PromptLookup* l = req.mutable_prefill()->mutable_prompt_lookup();
    l->set_min_n(2);
    l->set_max_n(5);
    l->set_num_draft_tokens(4);
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    ASSERT_TRUE(rw->Write(req));
    std::vector<int> got;
    v1::GenerateResponse resp;
    int rounds = 0, drafts = 0, accepted = 0;
    while (rw->Read(&resp)) {
      // One round, or several listed with their counts (their sums above).
      std::vector<v1::RoundCounts> listed(resp.rounds().begin(),
                                          resp.rounds().end());
      if (listed.empty()) {
        listed.emplace_back();
        listed[0].set_num_drafts(resp.num_drafts());
        listed[0].set_num_accepted(resp.num_accepted());
        listed[0].set_num_tokens(resp.token_ids_size());
      }
      int sum_drafts = 0, sum_accepted = 0, sum_tokens = 0;
      for (const v1::RoundCounts& r : listed) {
        ++rounds;
        EXPECT_LE(r.num_drafts(), 4);
        EXPECT_EQ(r.num_tokens(), r.num_accepted() + 1);
        sum_drafts += r.num_drafts();
        sum_accepted += r.num_accepted();
        sum_tokens += r.num_tokens();
      }
      EXPECT_EQ(resp.num_drafts(), sum_drafts);
      EXPECT_EQ(resp.num_accepted(), sum_accepted);
      EXPECT_EQ(resp.token_ids_size(), sum_tokens);
      drafts += sum_drafts;
      accepted += sum_accepted;
      got.insert(got.end(), resp.token_ids().begin(), resp.token_ids().end());
      if (!resp.finish_reason().empty()) break;
    }
    rw->WritesDone();
    EXPECT_TRUE(rw->Finish().ok());
    ASSERT_EQ(got.size(), static_cast<size_t>(kNew));
    EXPECT_EQ(accepted, kNew - rounds);
    if (temperature == 0.f) {
      EXPECT_EQ(got, want);
      EXPECT_GT(accepted, kNew / 4) << drafts << " drafts";
    }
  }
  const auto status_of = [&](auto edit) {
    v1::GenerateRequest req;
    *req.mutable_prefill() = MakePrefill(kPrompt, 4);
    req.mutable_prefill()->set_continuous(true);
    v1::PromptLookup* l = req.mutable_prefill()->mutable_prompt_lookup();
    l->set_min_n(2);
    l->set_max_n(5);
    l->set_num_draft_tokens(4);
    edit(req.mutable_prefill());
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    rw->Write(req);
    v1::GenerateResponse resp;
    while (rw->Read(&resp)) {
    }
    return rw->Finish().error_code();
  };
  EXPECT_EQ(status_of([](v1::Prefill* p) { p->set_continuous(false); }),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status_of([](v1::Prefill* p) {
              p->mutable_prompt_lookup()->set_min_n(0);
            }),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status_of([](v1::Prefill* p) {
              p->mutable_prompt_lookup()->set_max_n(17);
            }),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status_of([](v1::Prefill* p) {
              p->mutable_prompt_lookup()->set_num_draft_tokens(65);
            }),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(server_->active_sessions(), 0);
}

TEST_F(TargetServerTest, ConcurrentStreamsAreIndependent) {
  const int kNew = 30;
  const std::vector<int> want =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  constexpr int kStreams = 4;
  std::vector<std::unique_ptr<DraftSession>> drafters;
  for (int i = 0; i < kStreams; ++i) drafters.push_back(NewDraftSession({}));
  std::vector<StreamResult> results(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      results[i] = RunStream(stub_.get(), MakePrefill(kPrompt, kNew),
                             FromDraftSession(drafters[i].get(), 1 + i));
    });
  }
  for (auto& t : threads) t.join();
  for (const StreamResult& r : results) {
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, want);
  }
  EXPECT_EQ(Metric(*server_, "specserve_target_emitted_tokens_total"),
            kStreams * kNew);
  EXPECT_EQ(server_->active_sessions(), 0);
}

// Continuous streams run their next forward while a response is being
// written. Eight at once, every other one cancelled after a few messages
// (a forward and a write may both be outstanding then): the others still
// get exactly the greedy reference, the cancelled ones end CANCELLED, and
// every session and KV block is freed.
TEST_F(TargetServerTest, ConcurrentContinuousStreamsSurviveCancellation) {
  const int kNew = 60;
  const std::vector<int> want =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  constexpr int kStreams = 8;
  std::vector<std::vector<int>> got(kStreams);
  std::vector<grpc::StatusCode> codes(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest req;
      *req.mutable_prefill() = MakePrefill(kPrompt, kNew);
      req.mutable_prefill()->set_continuous(true);
      auto ctx = NewContext();
      auto rw = stub_->Generate(ctx.get());
      if (!rw->Write(req)) {
        codes[i] = rw->Finish().error_code();
        return;
      }
      v1::GenerateResponse resp;
      int messages = 0;
      while (rw->Read(&resp)) {
        got[i].insert(got[i].end(), resp.token_ids().begin(),
                      resp.token_ids().end());
        if (i % 2 == 1 && ++messages == 1 + i / 2) ctx->TryCancel();
        if (!resp.finish_reason().empty()) break;
      }
      rw->WritesDone();
      codes[i] = rw->Finish().error_code();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    SCOPED_TRACE(i);
    if (i % 2 == 0) {
      EXPECT_EQ(codes[i], grpc::StatusCode::OK);
      EXPECT_EQ(got[i], want);
    } else {
      // A cancellation may lose the race with the last write.
      EXPECT_TRUE(codes[i] == grpc::StatusCode::CANCELLED ||
                  (codes[i] == grpc::StatusCode::OK && got[i] == want))
          << codes[i];
      EXPECT_LE(got[i].size(), want.size());
      EXPECT_TRUE(std::equal(got[i].begin(), got[i].end(), want.begin()));
    }
  }
  ASSERT_TRUE(WaitFor([&] { return server_->active_sessions() == 0; }));
  EXPECT_EQ(server_->kv_used_bytes(), 0);
}

TEST_F(TargetServerTest, PerfectDraftsAreAllAccepted) {
  const int kNew = 21;
  const std::vector<int> want =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  size_t at = 0;  // drafts = the reference continuation
  DraftFn oracle = [&](const std::vector<int>& emitted) {
    at += emitted.size();
    std::vector<DraftToken> d;
    for (size_t j = at; j < want.size() && d.size() < 4; ++j) {
      d.push_back({want[j], {}});
    }
    return d;
  };
  const StreamResult got =
      RunStream(stub_.get(), MakePrefill(kPrompt, kNew), oracle);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want);
  for (const auto& r : got.responses) {
    EXPECT_EQ(r.num_accepted(), r.num_drafts());
  }
  // Four rounds of 4 drafts + bonus; the fifth has budget for one token,
  // so its drafts are clipped to none.
  ASSERT_EQ(got.responses.size(), 5u);
  EXPECT_EQ(got.responses.back().num_drafts(), 0);
  EXPECT_EQ(Metric(*server_, "specserve_target_verify_rounds_total"), 4);
  EXPECT_EQ(Metric(*server_, "specserve_target_accepted_tokens_per_pos_total{"
                             "position=\"3\"}"),
            4);
}

TEST_F(TargetServerTest, PrunedPrefillMatchesInProcessSession) {
  const std::vector<int> kept = {0, 1, 2, 5, 6, 9, 10, 11, 12};
  const int kNew = 24;
  TargetRequest r;
  v1::Prefill p;
  for (int i : kept) {
    r.token_ids.push_back(kPrompt[i]);
    r.position_ids.push_back(i);
    p.add_token_ids(kPrompt[i]);
    p.add_position_ids(i);
  }
  r.next_position = static_cast<int>(kPrompt.size());
  p.set_next_position(r.next_position);
  r.stop.max_new_tokens = kNew;
  p.mutable_stop()->set_max_new_tokens(kNew);

  const std::vector<int> want = RunInProcess(*target_, r, NoDrafts());
  EXPECT_EQ(want, GreedyReference(*target_, r.token_ids, r.position_ids,
                                  r.next_position, kNew));
  // The pruned continuation really depends on the positions: decoding at
  // kept_count + i instead gives something else.
  EXPECT_NE(want, GreedyReference(*target_, r.token_ids, r.position_ids,
                                  kept.size(), kNew));
  const StreamResult plain = RunStream(stub_.get(), p, NoDrafts());
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  EXPECT_EQ(plain.tokens, want);
  EXPECT_EQ(plain.responses.size(), size_t(kNew));

  auto ds = NewDraftSession({});
  const StreamResult spec =
      RunStream(stub_.get(), p, FromDraftSession(ds.get(), 3));
  ASSERT_TRUE(spec.status.ok()) << spec.status.error_message();
  EXPECT_EQ(spec.tokens, want);
}

TEST_F(TargetServerTest, SampledGenerationIsReproducible) {
  const int kNew = 40;
  SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 40;
  sp.seed = 7;
  auto run = [&](uint64_t seed) {
    SamplingParams draft_sp = sp;
    draft_sp.seed = 3;
    auto ds = NewDraftSession(draft_sp);
    v1::Prefill p = MakePrefill(kPrompt, kNew);
    p.mutable_sampling()->set_temperature(sp.temperature);
    p.mutable_sampling()->set_top_k(sp.top_k);
    p.mutable_sampling()->set_seed(seed);
    return RunStream(stub_.get(), p, FromDraftSession(ds.get(), 4));
  };
  const StreamResult a = run(7), b = run(7), c = run(8);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  EXPECT_EQ(a.tokens.size(), size_t(kNew));
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_NE(a.tokens, c.tokens);

  // Same seeds in-process (draft session seeded alike) -> same tokens.
  SamplingParams draft_sp = sp;
  draft_sp.seed = 3;
  auto ds = NewDraftSession(draft_sp);
  TargetRequest r = MakeRequest(kPrompt, kNew);
  r.sampling = sp;
  EXPECT_EQ(RunInProcess(*target_, r, FromDraftSession(ds.get(), 4)),
            a.tokens);
}

TEST_F(TargetServerTest, DefaultMaxNewTokensAppliesToZero) {
  TargetServerOptions o;
  o.default_max_new_tokens = 5;
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = NewStub(*server);
  const StreamResult got =
      RunStream(stub.get(), MakePrefill(kPrompt, 0), NoDrafts());
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens.size(), 5u);
  EXPECT_EQ(got.responses.back().finish_reason(), "length");
}

// Sends `first` (and `second` if set after reading one response) and returns
// the stream's final status.
grpc::Status SendAndFinish(v1::Target::Stub* stub,
                           const v1::GenerateRequest& first,
                           const v1::GenerateRequest* second = nullptr) {
  auto ctx = NewContext();
  auto rw = stub->Generate(ctx.get());
  v1::GenerateResponse resp;
  if (rw->Write(first) && second != nullptr && rw->Read(&resp)) {
    rw->Write(*second);
  }
  while (rw->Read(&resp)) {
  }
  return rw->Finish();
}

TEST_F(TargetServerTest, BadInputIsInvalidArgumentNamingTheField) {
  using Mutate = std::function<void(v1::Prefill*)>;
  auto q = [](v1::DraftToken* d, std::vector<std::pair<int, float>> probs) {
    for (auto [id, p] : probs) {
      v1::TokenProb* tp = d->add_q();
      tp->set_id(id);
      tp->set_prob(p);
    }
  };
  auto sampled = [](v1::Prefill* p) {
    p->mutable_sampling()->set_temperature(1.f);
  };
  struct Case {
    const char* name;
    Mutate mutate;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"empty prompt", [](v1::Prefill* p) { p->clear_token_ids(); },
       "token_ids"},
      {"token id >= vocab", [](v1::Prefill* p) { p->set_token_ids(3, 512); },
       "token_ids[3]"},
      {"negative token id", [](v1::Prefill* p) { p->set_token_ids(0, -1); },
       "token_ids[0]"},
      {"positions not increasing",
       [](v1::Prefill* p) { p->set_position_ids(4, 3); }, "position_ids"},
      {"position at max context",
       [](v1::Prefill* p) { p->set_position_ids(12, 512); }, "position_ids"},
      {"positions length mismatch",
       [](v1::Prefill* p) { p->mutable_position_ids()->RemoveLast(); },
       "position_ids"},
      {"next_position <= last position",
       [](v1::Prefill* p) { p->set_next_position(12); }, "next_position"},
      {"next_position at max context",
       [](v1::Prefill* p) { p->set_next_position(512); }, "next_position"},
      {"too many drafts",
       [](v1::Prefill* p) {
         for (int i = 0; i < 65; ++i) p->add_drafts()->set_id(5);
       },
       "drafts"},
      {"draft id outside vocab",
       [](v1::Prefill* p) { p->add_drafts()->set_id(600); }, "drafts[0].id"},
      {"negative q",
       [&](v1::Prefill* p) {
         sampled(p);
         v1::DraftToken* d = p->add_drafts();
         d->set_id(5);
         q(d, {{5, 1.5f}, {6, -0.5f}});
       },
       "drafts[0].q[1].prob"},
      {"q id outside vocab",
       [&](v1::Prefill* p) {
         sampled(p);
         v1::DraftToken* d = p->add_drafts();
         d->set_id(5);
         q(d, {{5, 0.5f}, {900, 0.5f}});
       },
       "drafts[0].q[1].id"},
      {"q sum far from 1",
       [&](v1::Prefill* p) {
         sampled(p);
         v1::DraftToken* d = p->add_drafts();
         d->set_id(5);
         q(d, {{5, 0.5f}, {6, 0.2f}});
       },
       "drafts[0].q sums to"},
      {"negative temperature",
       [](v1::Prefill* p) { p->mutable_sampling()->set_temperature(-1.f); },
       "temperature"},
      {"NaN temperature",
       [](v1::Prefill* p) {
         p->mutable_sampling()->set_temperature(std::nanf(""));
       },
       "temperature"},
      {"top_p > 1",
       [](v1::Prefill* p) { p->mutable_sampling()->set_top_p(1.5f); },
       "top_p"},
      {"negative top_k",
       [](v1::Prefill* p) { p->mutable_sampling()->set_top_k(-2); }, "top_k"},
      {"negative max_new_tokens",
       [](v1::Prefill* p) { p->mutable_stop()->set_max_new_tokens(-1); },
       "max_new_tokens"},
      {"stop id outside vocab",
       [](v1::Prefill* p) { p->mutable_stop()->add_stop_token_ids(512); },
       "stop_token_ids[0]"},
      {"top_logprobs > 20",
       [](v1::Prefill* p) {
         p->set_logprobs(true);
         p->set_top_logprobs(21);
       },
       "top_logprobs"},
      {"negative top_logprobs",
       [](v1::Prefill* p) {
         p->set_logprobs(true);
         p->set_top_logprobs(-1);
       },
       "top_logprobs"},
      {"top_logprobs without logprobs",
       [](v1::Prefill* p) { p->set_top_logprobs(2); }, "top_logprobs"},
      {"prompt_logprobs > 20",
       [](v1::Prefill* p) { p->set_prompt_logprobs(21); }, "prompt_logprobs"},
      {"prompt_logprobs of a pruned prompt",
       [](v1::Prefill* p) {
         p->set_prompt_logprobs(1);
         for (int i = 0; i < p->position_ids_size(); ++i) {
           p->set_position_ids(i, 2 * i);
         }
         p->set_next_position(2 * p->position_ids_size());
       },
       "prompt_logprobs"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::GenerateRequest req;
    *req.mutable_prefill() = MakePrefill(kPrompt, 8);
    c.mutate(req.mutable_prefill());
    const grpc::Status s = SendAndFinish(stub_.get(), req);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find(c.field), std::string::npos)
        << s.error_message();
  }
  // Bad drafts in a later message end the stream the same way.
  v1::GenerateRequest first, bad;
  *first.mutable_prefill() = MakePrefill(kPrompt, 8);
  bad.mutable_drafts()->add_drafts()->set_id(512);
  grpc::Status s = SendAndFinish(stub_.get(), first, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("drafts[0].id"), std::string::npos);
  EXPECT_EQ(server_->active_sessions(), 0);
  EXPECT_EQ(server_->kv_used_bytes(), 0);
  EXPECT_EQ(Metric(*server_,
                   "specserve_target_requests_total{status=\"INVALID_ARGUMENT\"}"),
            cases.size() + 1);
}

// Prefill.logprobs: every response carries one logprob per token id, in
// order, also when a continuous stream's message coalesces rounds, and the
// values (greedy: with the speculator's drafts or without) are the
// in-process session's without drafts, i.e. the raw distribution's.
TEST_F(TargetServerTest, LogprobsAreAlignedWithTokenIds) {
  const int kNew = 40;
  TargetRequest r = MakeRequest(kPrompt, kNew);
  r.logprobs = true;
  r.top_logprobs = 4;
  auto session = TargetSession::Create(target_.get(), r);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<int> want;
  std::vector<TokenLogprobs> want_lp;
  while (!(*session)->finished()) {
    auto round = (*session)->Step({});
    ASSERT_TRUE(round.ok()) << round.status();
    want.insert(want.end(), round->tokens.begin(), round->tokens.end());
    want_lp.insert(want_lp.end(), round->logprobs.begin(),
                   round->logprobs.end());
  }
  ASSERT_EQ(want_lp.size(), static_cast<size_t>(kNew));
  auto check = [&](const std::vector<v1::GenerateResponse>& responses) {
    std::vector<int> tokens;
    std::vector<v1::TokenLogprob> lps;
    for (const v1::GenerateResponse& resp : responses) {
      EXPECT_EQ(resp.logprobs_size(), resp.token_ids_size());
      tokens.insert(tokens.end(), resp.token_ids().begin(),
                    resp.token_ids().end());
      lps.insert(lps.end(), resp.logprobs().begin(), resp.logprobs().end());
    }
    ASSERT_EQ(tokens, want);
    ASSERT_EQ(lps.size(), want_lp.size());
    for (size_t i = 0; i < lps.size(); ++i) {
      EXPECT_NEAR(lps[i].logprob(), want_lp[i].logprob, 1e-4);
      ASSERT_EQ(lps[i].top_size(), 4);
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(lps[i].top(j).id(), want_lp[i].top[j].first);
        EXPECT_NEAR(lps[i].top(j).logprob(), want_lp[i].top[j].second, 1e-4);
      }
    }
  };
  v1::Prefill prefill = MakePrefill(kPrompt, kNew);
  prefill.set_logprobs(true);
  prefill.set_top_logprobs(4);
  {  // Drafted by the speculator model, one message per round.
    auto ds = NewDraftSession({});
    const StreamResult got =
        RunStream(stub_.get(), prefill, FromDraftSession(ds.get(), 4));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    check(got.responses);
    int accepted = 0;
    for (const auto& resp : got.responses) accepted += resp.num_accepted();
    EXPECT_GT(accepted, 0);
  }
  {  // Continuous (rounds coalesced while a write is in flight).
    v1::GenerateRequest req;
    *req.mutable_prefill() = prefill;
    req.mutable_prefill()->set_continuous(true);
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    ASSERT_TRUE(rw->Write(req));
    std::vector<v1::GenerateResponse> responses;
    v1::GenerateResponse resp;
    while (rw->Read(&resp)) {
      responses.push_back(resp);
      if (!resp.finish_reason().empty()) break;
    }
    rw->WritesDone();
    EXPECT_TRUE(rw->Finish().ok());
    check(responses);
  }
  {  // Without logprobs: none.
    const StreamResult got =
        RunStream(stub_.get(), MakePrefill(kPrompt, 8), NoDrafts());
    ASSERT_TRUE(got.status.ok());
    for (const auto& resp : got.responses) {
      EXPECT_EQ(resp.logprobs_size(), 0);
      EXPECT_EQ(resp.prompt_logprobs_size(), 0);
    }
  }
}

// Prefill.prompt_logprobs: the first response carries one logprob per
// prompt token after the first, the in-process session's; no other does.
TEST_F(TargetServerTest, PromptLogprobsComeInTheFirstResponse) {
  TargetRequest r = MakeRequest(kPrompt, 6);
  r.prompt_logprobs = 2;
  auto session = TargetSession::Create(target_.get(), r);
  ASSERT_TRUE(session.ok()) << session.status();
  auto first = (*session)->Step({});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->prompt_logprobs.size(), kPrompt.size() - 1);
  v1::Prefill prefill = MakePrefill(kPrompt, 6);
  prefill.set_prompt_logprobs(2);
  auto ds = NewDraftSession({});
  const StreamResult got =
      RunStream(stub_.get(), prefill, FromDraftSession(ds.get(), 4));
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_FALSE(got.responses.empty());
  const v1::GenerateResponse& resp = got.responses[0];
  ASSERT_EQ(resp.prompt_logprobs_size(), static_cast<int>(kPrompt.size()) - 1);
  for (int i = 0; i < resp.prompt_logprobs_size(); ++i) {
    const v1::TokenLogprob& lp = resp.prompt_logprobs(i);
    EXPECT_NEAR(lp.logprob(), first->prompt_logprobs[i].logprob, 1e-5) << i;
    ASSERT_EQ(lp.top_size(), 2) << i;
    EXPECT_EQ(lp.top(0).id(), first->prompt_logprobs[i].top[0].first) << i;
  }
  for (size_t i = 1; i < got.responses.size(); ++i) {
    EXPECT_EQ(got.responses[i].prompt_logprobs_size(), 0) << i;
  }
}

// Token trees over the stream (Drafts.parents), drafted by the speculator
// model: greedy output equals plain greedy decoding, more than one draft
// is accepted per round on average, and bad parents end the stream with
// INVALID_ARGUMENT naming them.
TEST_F(TargetServerTest, GreedyDraftTreesEqualPlainGreedy) {
  const int kNew = 48;
  const std::vector<int> want =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  auto ds = NewDraftSession({});
  auto ctx = NewContext();
  auto rw = stub_->Generate(ctx.get());
  v1::GenerateRequest req;
  *req.mutable_prefill() = MakePrefill(kPrompt, kNew);
  ASSERT_TRUE(rw->Write(req));
  std::vector<int> got;
  int rounds = 0, accepted = 0, nodes = 0;
  v1::GenerateResponse resp;
  while (rw->Read(&resp)) {
    got.insert(got.end(), resp.token_ids().begin(), resp.token_ids().end());
    accepted += resp.num_accepted();
    nodes += resp.num_drafts();
    ++rounds;
    if (!resp.finish_reason().empty()) break;
    std::vector<int> emitted(resp.token_ids().begin(), resp.token_ids().end());
    std::vector<int> parents;
    auto tree = ds->DraftTree(emitted, DraftTreeShape{{3, 2, 2, 1, 1}, 16},
                              &parents);
    ASSERT_TRUE(tree.ok()) << tree.status();
    v1::GenerateRequest next;
    ToProto(*tree, next.mutable_drafts()->mutable_drafts());
    next.mutable_drafts()->mutable_parents()->Add(parents.begin(),
                                                  parents.end());
    ASSERT_TRUE(rw->Write(next));
  }
  rw->WritesDone();
  ASSERT_TRUE(rw->Finish().ok());
  EXPECT_EQ(got, want);
  EXPECT_GT(nodes, rounds);
  EXPECT_GT(accepted, rounds - 1);  // > 1 accepted per verify round
  EXPECT_EQ(server_->active_sessions(), 0);

  v1::GenerateRequest first, bad;
  *first.mutable_prefill() = MakePrefill(kPrompt, 8);
  bad.mutable_drafts()->add_drafts()->set_id(5);
  bad.mutable_drafts()->add_drafts()->set_id(6);
  bad.mutable_drafts()->add_parents(-1);
  bad.mutable_drafts()->add_parents(1);
  grpc::Status s = SendAndFinish(stub_.get(), first, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("parents[1] = 1"), std::string::npos)
      << s.error_message();
}

TEST_F(TargetServerTest, ProtocolErrors) {
  v1::GenerateRequest prefill, drafts;
  *prefill.mutable_prefill() = MakePrefill(kPrompt, 1);
  drafts.mutable_drafts();
  // Drafts before the prefill.
  grpc::Status s = SendAndFinish(stub_.get(), drafts);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("prefill"), std::string::npos);
  // A message after the finish (max_new_tokens 1 finishes in round one).
  s = SendAndFinish(stub_.get(), prefill, &drafts);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // A second prefill.
  *prefill.mutable_prefill() = MakePrefill(kPrompt, 8);
  s = SendAndFinish(stub_.get(), prefill, &prefill);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("prefill"), std::string::npos);
  {  // Closed before any message.
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    rw->WritesDone();
    s = rw->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // Half-closed mid-generation: CANCELLED, session freed.
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    v1::GenerateResponse resp;
    ASSERT_TRUE(rw->Write(prefill));
    ASSERT_TRUE(rw->Read(&resp));
    rw->WritesDone();
    EXPECT_FALSE(rw->Read(&resp));
    EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_EQ(server_->active_sessions(), 0);
}

// A full server queues new streams (first come, first served) instead of
// rejecting them; past max_waiting_requests it says RESOURCE_EXHAUSTED; a
// cancelled waiting stream leaves the queue; queued streams run to the same
// tokens once admitted.
TEST_F(TargetServerTest, FullServerQueuesStreams) {
  TargetServerOptions o;
  o.max_sessions = 1;
  o.max_waiting_requests = 2;
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = NewStub(*server);
  const int kNew = 6;
  const std::vector<int> want = RunInProcess(
      *target_, MakeRequest(kPrompt, kNew), NoDrafts());
  v1::GenerateRequest req;
  *req.mutable_prefill() = MakePrefill(kPrompt, kNew);
  auto ctx = NewContext();
  auto held = stub->Generate(ctx.get());
  v1::GenerateResponse resp;
  ASSERT_TRUE(held->Write(req));
  ASSERT_TRUE(held->Read(&resp));
  ASSERT_EQ(server->active_sessions(), 1);

  // A waiting stream that is cancelled leaves the queue.
  {
    auto cctx = NewContext();
    auto cancelled = stub->Generate(cctx.get());
    ASSERT_TRUE(cancelled->Write(req));
    ASSERT_TRUE(WaitFor([&] { return server->waiting_requests() == 1; }));
    cctx->TryCancel();
    EXPECT_EQ(cancelled->Finish().error_code(), grpc::StatusCode::CANCELLED);
    ASSERT_TRUE(WaitFor([&] { return server->waiting_requests() == 0; }));
  }
  // Two streams wait; a third finds the queue full.
  StreamResult r1, r2;
  std::thread t1([&] {
    r1 = RunStream(stub.get(), MakePrefill(kPrompt, kNew), NoDrafts());
  });
  ASSERT_TRUE(WaitFor([&] { return server->waiting_requests() == 1; }));
  std::thread t2([&] {
    r2 = RunStream(stub.get(), MakePrefill(kPrompt, kNew), NoDrafts());
  });
  ASSERT_TRUE(WaitFor([&] { return server->waiting_requests() == 2; }));
  EXPECT_EQ(Metric(*server, "specserve_target_num_requests_waiting"), 2);
  grpc::Status s = SendAndFinish(stub.get(), req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_waiting_requests"), std::string::npos)
      << s.error_message();
  // Finishing the held stream admits the waiting ones, one at a time.
  v1::GenerateRequest none;
  none.mutable_drafts();
  while (resp.finish_reason().empty()) {
    ASSERT_TRUE(held->Write(none));
    ASSERT_TRUE(held->Read(&resp));
  }
  held->WritesDone();
  EXPECT_TRUE(held->Finish().ok());
  t1.join();
  t2.join();
  EXPECT_TRUE(r1.status.ok()) << r1.status.error_message();
  EXPECT_TRUE(r2.status.ok()) << r2.status.error_message();
  EXPECT_EQ(r1.tokens, want);
  EXPECT_EQ(r2.tokens, want);
  EXPECT_EQ(Metric(*server, "specserve_target_num_requests_waiting"), 0);
  EXPECT_EQ(Metric(*server, "specserve_target_request_queue_time_seconds_count"),
            2);
  ASSERT_TRUE(WaitFor([&] { return server->active_sessions() == 0; }));
}

// With prefix caching on, a second stream with the same prompt attaches
// the first one's blocks (counted by the hit metric) and emits the same
// tokens.
TEST_F(TargetServerTest, PrefixCachingServesRepeatedPrompts) {
  TargetServerOptions o;
  o.runner.kv_cache.prefix_caching = true;
  o.runner.kv_cache.block_size = 4;
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = NewStub(*server);
  const StreamResult a =
      RunStream(stub.get(), MakePrefill(kPrompt, 8), NoDrafts());
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(Metric(*server, "specserve_target_prefix_cache_hits_total"), 0);
  const StreamResult b =
      RunStream(stub.get(), MakePrefill(kPrompt, 8), NoDrafts());
  ASSERT_TRUE(b.status.ok());
  EXPECT_EQ(b.tokens, a.tokens);
  // kPrompt's 13 tokens: 3 whole blocks of 4 (the last token always runs).
  EXPECT_EQ(Metric(*server, "specserve_target_prefix_cache_hits_total"), 12);
  EXPECT_EQ(Metric(*server, "specserve_target_prefix_cache_queries_total"),
            2 * static_cast<double>(kPrompt.size()));
}

TEST_F(TargetServerTest, CapacityIsResourceExhausted) {
  const ModelConfig& config = target_->config();
  TargetRequest probe = MakeRequest(kPrompt, 10);
  probe.max_drafts = TargetServerOptions().max_drafts;
  const int64_t small = static_cast<int64_t>(
      target_->kv_cache().bytes_per_block() *
      PagedKvCache::BlocksForTokens(TargetSession::CapacityFor(config, probe),
                                    target_->kv_cache().block_size()));
  // A pool that holds one such request at its largest, and no waiting
  // queue: a request that could outgrow the whole pool is refused at once.
  TargetServerOptions o;
  o.kv_budget_bytes = small;
  o.max_waiting_requests = 0;
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = NewStub(*server);
  v1::GenerateRequest big;
  *big.mutable_prefill() = MakePrefill(kPrompt, 200);
  grpc::Status s = SendAndFinish(stub.get(), big);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("kv_budget_bytes"), std::string::npos);

  // KV memory is not reserved up front: a second request runs beside one
  // that holds the pool's worth of reservation.
  v1::GenerateRequest req;
  *req.mutable_prefill() = MakePrefill(kPrompt, 10);
  auto ctx = NewContext();
  auto held = stub->Generate(ctx.get());
  v1::GenerateResponse resp;
  ASSERT_TRUE(held->Write(req));
  ASSERT_TRUE(held->Read(&resp));
  EXPECT_GT(server->kv_used_bytes(), 0);
  EXPECT_LT(server->kv_used_bytes(), small);
  EXPECT_TRUE(RunStream(stub.get(), req.prefill(), NoDrafts()).status.ok());
  held->WritesDone();
  held->Finish();
  ASSERT_TRUE(WaitFor([&] { return server->active_sessions() == 0; }));
  EXPECT_EQ(server->kv_used_bytes(), 0);

  // max_sessions: one stream at a time.
  o = TargetServerOptions();
  o.max_sessions = 1;
  o.max_waiting_requests = 0;
  auto one = StartServer(o);
  ASSERT_NE(one, nullptr);
  auto stub1 = NewStub(*one);
  auto ctx1 = NewContext();
  auto held1 = stub1->Generate(ctx1.get());
  ASSERT_TRUE(held1->Write(req));
  ASSERT_TRUE(held1->Read(&resp));
  s = SendAndFinish(stub1.get(), req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_sessions"), std::string::npos);
  EXPECT_EQ(Metric(*one, "specserve_target_requests_total{"
                         "status=\"RESOURCE_EXHAUSTED\"}"),
            1);
  EXPECT_EQ(one->active_sessions(), 1);
  // Finish the held stream properly; the slot is free again.
  v1::GenerateRequest none;
  none.mutable_drafts();
  while (resp.finish_reason().empty()) {
    ASSERT_TRUE(held1->Write(none));
    ASSERT_TRUE(held1->Read(&resp));
  }
  held1->WritesDone();
  EXPECT_TRUE(held1->Finish().ok());
  EXPECT_EQ(one->active_sessions(), 0);
  EXPECT_TRUE(RunStream(stub1.get(), req.prefill(), NoDrafts()).status.ok());
}

// More concurrent streams than the KV pool holds at their full length
// (vLLM's preemption by recomputation): the newest sessions are preempted,
// freed and recomputed later; every stream still completes with exactly
// the tokens it gets alone, drafts verified as usual.
TEST_F(TargetServerTest, KvPressurePreemptsAndRecomputes) {
  const ModelConfig& config = target_->config();
  constexpr int kNew = 40;
  constexpr int kStreams = 8;
  TargetRequest probe = MakeRequest(kPrompt, kNew);
  probe.max_drafts = 4;
  TargetServerOptions o;
  o.max_drafts = 4;
  // One request at its largest fits; eight at their full length do not.
  o.kv_budget_bytes = static_cast<int64_t>(
      target_->kv_cache().bytes_per_block() *
      PagedKvCache::BlocksForTokens(TargetSession::CapacityFor(config, probe),
                                    target_->kv_cache().block_size()));
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = NewStub(*server);
  const std::vector<int> want =
      GreedyReference(*target_, kPrompt, {}, kPrompt.size(), kNew);
  std::vector<std::unique_ptr<DraftSession>> drafters;
  for (int i = 0; i < kStreams; ++i) drafters.push_back(NewDraftSession({}));
  std::vector<StreamResult> results(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      results[i] = RunStream(stub.get(), MakePrefill(kPrompt, kNew),
                             FromDraftSession(drafters[i].get(), 1 + i % 4));
    });
  }
  for (auto& t : threads) t.join();
  for (const StreamResult& r : results) {
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, want);
  }
  EXPECT_GT(Metric(*server, "specserve_target_num_preemptions_total"), 0);
  EXPECT_EQ(Metric(*server, "specserve_target_requests_total{status=\"OK\"}"),
            kStreams);
  ASSERT_TRUE(WaitFor([&] { return server->active_sessions() == 0; }));
  EXPECT_EQ(server->kv_used_bytes(), 0);
}

// Cancellations racing with the server's reads of the next message (the
// session may be freed between the read and its round): many streams,
// cancelled right after sending a message, concurrently. Regression: a
// round was once submitted for an already freed session (a crash).
TEST_F(TargetServerTest, CancellationsRacingWithMessagesAreSafe) {
  v1::GenerateRequest req, none;
  *req.mutable_prefill() = MakePrefill(kPrompt, 200);
  none.mutable_drafts();
  std::vector<std::thread> clients;
  for (int c = 0; c < 8; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < 25; ++i) {
        auto ctx = NewContext();
        auto rw = stub_->Generate(ctx.get());
        v1::GenerateResponse resp;
        if (!rw->Write(req) || !rw->Read(&resp)) continue;
        for (int r = 0; r < (c + i) % 4; ++r) {
          if (!rw->Write(none) || !rw->Read(&resp)) break;
        }
        rw->Write(none);
        ctx->TryCancel();
        rw->Finish();
      }
    });
  }
  for (auto& t : clients) t.join();
  ASSERT_TRUE(WaitFor([&] { return server_->active_sessions() == 0; }));
  EXPECT_EQ(server_->kv_used_bytes(), 0);
  // The server still serves.
  EXPECT_TRUE(RunStream(stub_.get(), MakePrefill(kPrompt, 4), NoDrafts())
                  .status.ok());
}

TEST_F(TargetServerTest, ClientCancelFreesTheSession) {
  v1::GenerateRequest req, none;
  *req.mutable_prefill() = MakePrefill(kPrompt, 200);
  none.mutable_drafts();
  {  // Cancelled while the server waits for the next message.
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    v1::GenerateResponse resp;
    ASSERT_TRUE(rw->Write(req));
    ASSERT_TRUE(rw->Read(&resp));
    EXPECT_EQ(server_->active_sessions(), 1);
    EXPECT_EQ(Metric(*server_, "specserve_target_active_sessions"), 1);
    EXPECT_GT(Metric(*server_, "specserve_target_kv_cache_bytes"), 0);
    EXPECT_GT(Metric(*server_, "specserve_target_kv_cache_usage_perc"), 0);
    ctx->TryCancel();
    EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
    ASSERT_TRUE(WaitFor([&] { return server_->active_sessions() == 0; }));
    // Every gauge is back at its idle value with no step after the end.
    EXPECT_EQ(Metric(*server_, "specserve_target_active_sessions"), 0);
    EXPECT_EQ(Metric(*server_, "specserve_target_kv_cache_bytes"), 0);
    EXPECT_EQ(Metric(*server_, "specserve_target_kv_cache_usage_perc"), 0);
    EXPECT_EQ(Metric(*server_, "specserve_target_num_requests_waiting"), 0);
  }
  {  // Cancelled with rounds possibly in flight.
    auto ctx = NewContext();
    auto rw = stub_->Generate(ctx.get());
    v1::GenerateResponse resp;
    ASSERT_TRUE(rw->Write(req));
    ASSERT_TRUE(rw->Read(&resp));
    rw->Write(none);
    ctx->TryCancel();
    rw->Finish();
    ASSERT_TRUE(WaitFor([&] { return server_->active_sessions() == 0; }));
    EXPECT_EQ(server_->kv_used_bytes(), 0);
  }
  EXPECT_TRUE(WaitFor([&] {
    return Metric(*server_,
                  "specserve_target_requests_total{status=\"CANCELLED\"}") ==
           2;
  }));
}

TEST_F(TargetServerTest, ShutdownEndsOpenStreams) {
  auto server = StartServer({});
  ASSERT_NE(server, nullptr);
  auto stub = NewStub(*server);
  v1::GenerateRequest req;
  *req.mutable_prefill() = MakePrefill(kPrompt, 100);
  auto ctx = NewContext();
  auto rw = stub->Generate(ctx.get());
  v1::GenerateResponse resp;
  ASSERT_TRUE(rw->Write(req));
  ASSERT_TRUE(rw->Read(&resp));
  server->Shutdown();  // must not wait for the client
  EXPECT_EQ(server->active_sessions(), 0);
  EXPECT_FALSE(rw->Finish().ok());
}

TEST_F(TargetServerTest, InfoDescribesTheModel) {
  auto ctx = NewContext();
  v1::ModelInfo info;
  ASSERT_TRUE(stub_->Info(ctx.get(), v1::InfoRequest(), &info).ok());
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.max_context(), 512);
  EXPECT_EQ(info.model_id(), "stories260K");
  EXPECT_EQ(info.bos_token_id(), 1);
  EXPECT_FALSE(info.tokenizer_fingerprint().empty());
  EXPECT_EQ(info.tokenizer_fingerprint(), (*tok)->Fingerprint());
}

TEST_F(TargetServerTest, HealthServiceAnswersServing) {
  grpc::GenericStub generic(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                          grpc::InsecureChannelCredentials()));
  auto ctx = NewContext();
  grpc::ByteBuffer request, response;  // HealthCheckRequest{} = no bytes
  grpc::Slice empty("");
  request = grpc::ByteBuffer(&empty, 1);
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(ctx.get(), "/grpc.health.v1.Health/Check",
                    grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const auto& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));  // status: SERVING
}

using service_test::HttpGet;

TEST_F(TargetServerTest, MetricsAreServedOverHttp) {
  ASSERT_TRUE(
      RunStream(stub_.get(), MakePrefill(kPrompt, 3), NoDrafts()).status.ok());
  int port = 0;
  auto exposer = StartMetricsExposer("127.0.0.1", 0, server_->registry(), &port);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  ASSERT_GT(port, 0);
  const std::string body = HttpGet(port, "/metrics");
  EXPECT_NE(body.find("200 OK"), std::string::npos) << body;
  EXPECT_NE(body.find("specserve_target_emitted_tokens_total 3"),
            std::string::npos)
      << body;
  EXPECT_NE(body.find("specserve_target_time_per_output_token_seconds_bucket"),
            std::string::npos);
}

}  // namespace
}  // namespace specserve
