// RequestRunner against the bundled pair served in-process over loopback:
// losslessness (greedy output token-identical to the target alone) under
// every speculation setting, Speculative Prefill's kept tokens at their
// original positions, fallbacks, cancellation, stop strings, validation.

#include "router/request_runner.h"

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/speculation/target_session.h"
#include "common/tokenizer/tokenizer.h"
#include "common/decoding/json_grammar.h"
#include "common/tokenizer/token_bytes.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "protos/speculator.grpc.pb.h"
#include "router/metrics.h"
#include "router/prompt_limits.h"
#include "router/test_env.h"
#include "router/output_processor.h"
#include "router/speculator_client.h"
#include "router/target_client.h"

namespace specserve {
namespace {

using namespace router_test;  // NOLINT: test helpers

struct Outcome {
  absl::Status status;
  v1::GenerateTextResponse response;
  int chunks = 0;
};

class RequestRunnerTest : public ServicesTest {
 protected:
  void SetUp() override {
    ServicesTest::SetUp();
    if (HasFatalFailure()) return;
    Connect(Addr(speculator_->port()), Addr(target_->port()));
  }

  // (Re)builds the backends for these replica lists.
  void Connect(const std::string& spec, const std::string& target) {
    ReplicaPoolOptions po;
    po.health_period = absl::Milliseconds(100);
    po.service = "speculator";
    auto s = ReplicaPool::Create(spec, "--speculator", po, SpeculatorInfoFn(),
                                 nullptr);
    ASSERT_TRUE(s.ok()) << s.status();
    po.service = "target";
    auto t =
        ReplicaPool::Create(target, "--target", po, TargetInfoFn(), nullptr);
    ASSERT_TRUE(t.ok()) << t.status();
    spec_pool_ = *std::move(s);
    target_pool_ = *std::move(t);
    spec_pool_->Start();
    target_pool_->Start();
    backends_.tokenizer = tokenizer_;
    backends_.speculator = spec_pool_.get();
    backends_.target = target_pool_.get();
    backends_.metrics = &metrics_;
  }

  // Runs `req`; `on_chunk` sees every chunk (and may cancel the runner).
  Outcome Run(const v1::GenerateTextRequest& req,
              std::function<void(const v1::GenerateTextChunk&, RequestRunner*)>
                  on_chunk = {}) {
    RequestRunner runner(&backends_);
    Outcome out;
    out.status = runner.Run(req, absl::Now(), absl::Now() + absl::Seconds(30),
                            [&](const v1::GenerateTextChunk& c) {
                              ++out.chunks;
                              AppendChunk(c, &out.response);
                              if (on_chunk) on_chunk(c, &runner);
                            });
    return out;
  }

  static v1::GenerateTextRequest Request(const std::string& text, int max_new,
                                         float keep_ratio, bool spec_decode) {
    v1::GenerateTextRequest r;
    r.set_text(text);
    r.mutable_sampling()->set_max_new_tokens(max_new);
    r.mutable_speculative_prefill()->set_enabled(true);
    r.mutable_speculative_prefill()->set_keep_ratio(keep_ratio);
    r.mutable_speculative_decoding()->set_enabled(spec_decode);
    return r;
  }

  std::vector<int> Encode(const std::string& text) {
    auto ids = tokenizer_->Encode(text, true);
    EXPECT_TRUE(ids.ok());
    return ids.ok() ? *ids : std::vector<int>();
  }
  std::vector<int> FullReference(const std::string& text, int max_new) {
    const std::vector<int> p = Encode(text);
    return Reference(*model_, p, {}, static_cast<int>(p.size()), max_new);
  }
  // What the speculator keeps of `prompt` at keep 0.3, chunk 8 (Score is
  // deterministic): what a request with those options sends the target.
  std::vector<int> KeptIndices(const std::vector<int>& prompt) {
    v1::ScoreRequest sreq;
    sreq.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    sreq.mutable_options()->set_keep_ratio(0.3f);
    sreq.mutable_options()->set_chunk_size(8);
    v1::ScoreResponse sresp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    const grpc::Status st =
        v1::Speculator::NewStub(
            grpc::CreateChannel(Addr(speculator_->port()),
                                grpc::InsecureChannelCredentials()))
            ->Score(&ctx, sreq, &sresp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return {sresp.kept_indices().begin(), sresp.kept_indices().end()};
  }
  static std::vector<int> Ids(const v1::GenerateTextResponse& r) {
    return {r.token_ids().begin(), r.token_ids().end()};
  }
  std::string Decode(const std::vector<int>& ids) {
    auto t = tokenizer_->Decode(ids);
    EXPECT_TRUE(t.ok());
    return t.ok() ? *t : "";
  }

  std::shared_ptr<prometheus::Registry> registry_ =
      std::make_shared<prometheus::Registry>();
  RouterMetrics metrics_{*registry_};
  std::unique_ptr<ReplicaPool> spec_pool_;
  std::unique_ptr<ReplicaPool> target_pool_;
  RouterBackends backends_;
};


TEST_F(RequestRunnerTest, GreedyWithSpeculationIsTokenIdenticalToTarget) {
  const std::string text = StoryPrompt(2);
  const int kNew = 48;
  const std::vector<int> want = FullReference(text, kNew);
  for (bool spec_decode : {true, false}) {
    SCOPED_TRACE(spec_decode);
    Outcome o = Run(Request(text, kNew, 1.f, spec_decode));
    ASSERT_TRUE(o.status.ok()) << o.status;
    const v1::GenerateTextResponse& r = o.response;
    EXPECT_EQ(Ids(r), want);
    EXPECT_EQ(r.text(), Decode(want));
    EXPECT_EQ(r.finish_reason(), want.size() == kNew ? "length" : "eos");
    EXPECT_EQ(r.usage().prompt_tokens(), int(Encode(text).size()));
    EXPECT_EQ(r.usage().kept_prompt_tokens(), r.usage().prompt_tokens());
    EXPECT_EQ(r.usage().completion_tokens(), int(want.size()));
    const v1::GenerationStats& s = r.stats();
    EXPECT_EQ(s.fallback_reason(), "");
    EXPECT_EQ(s.spec_decode_method(), spec_decode ? "draft" : "");
    // One chunk per target forward (the prefill's included); without
    // drafts (a continuous stream) one forward per token, and a chunk may
    // carry the rounds that ended while the previous one was written.
    if (spec_decode) {
      EXPECT_EQ(s.num_target_forwards(), o.chunks);
    } else {
      EXPECT_EQ(s.num_target_forwards(), int(want.size()));
      EXPECT_LE(o.chunks, s.num_target_forwards());
    }
    EXPECT_DOUBLE_EQ(s.tokens_per_target_forward(),
                     double(want.size()) / s.num_target_forwards());
    EXPECT_FLOAT_EQ(s.keep_ratio(), 1.f);
    EXPECT_GT(s.ttft_s(), 0);
    EXPECT_GE(s.total_s(), s.ttft_s());
    EXPECT_GT(s.speculate_s(), 0);
    EXPECT_GT(s.target_prefill_s(), 0);
    // The speculator's own phases: inside its whole time, which is inside
    // the router's round trip.
    EXPECT_GT(s.score_prefill_s(), 0);
    EXPECT_GT(s.score_look_ahead_s(), 0);
    EXPECT_GT(s.score_select_s(), 0);
    EXPECT_LE(s.score_prefill_s() + s.score_look_ahead_s() +
                  s.score_select_s(),
              s.score_total_s() + 1e-6);
    EXPECT_LE(s.score_total_s(), s.speculate_s());
    if (!spec_decode) {
      EXPECT_EQ(s.num_drafts(), 0);
      EXPECT_EQ(s.accepted_per_position_size(), 0);
      continue;
    }
    EXPECT_GT(s.num_drafts(), 0);
    EXPECT_GE(s.num_draft_tokens(), s.num_drafts());
    EXPECT_LE(s.num_accepted_tokens(), s.num_draft_tokens());
    EXPECT_GT(s.num_accepted_tokens(), 0);  // the draft model is decent
    EXPECT_DOUBLE_EQ(s.mean_acceptance_length(),
                     1.0 + double(s.num_accepted_tokens()) / s.num_drafts());
    int sum = 0;
    for (int i = 0; i < s.accepted_per_position_size(); ++i) {
      sum += s.accepted_per_position(i);
      if (i > 0) {  // accepting position i needs i-1 accepted
        EXPECT_LE(s.accepted_per_position(i), s.accepted_per_position(i - 1));
      }
    }
    EXPECT_EQ(sum, s.num_accepted_tokens());
    // Fewer target rounds than tokens: drafts were accepted.
    EXPECT_LT(o.chunks, int(want.size()));
  }
  // Both sessions are gone once the request returns.
  EXPECT_EQ(speculator_->sessions().num_sessions(), 0);
  EXPECT_TRUE(Eventually([&] { return target_->active_sessions() == 0; }));
}

TEST(DraftTokensUnderLoadTest, FullThenLinearlyFewerThenNone) {
  EXPECT_EQ(DraftTokensUnderLoad(4, 1000, 0), 4);  // rule off
  EXPECT_EQ(DraftTokensUnderLoad(4, 0, 16), 4);
  EXPECT_EQ(DraftTokensUnderLoad(4, 8, 16), 4);    // up to half
  EXPECT_EQ(DraftTokensUnderLoad(4, 12, 16), 2);
  EXPECT_EQ(DraftTokensUnderLoad(4, 15, 16), 1);   // never 0 below it
  EXPECT_EQ(DraftTokensUnderLoad(4, 16, 16), 0);
  EXPECT_EQ(DraftTokensUnderLoad(8, 40, 16), 0);
  int prev = 8;
  for (int running = 0; running <= 32; ++running) {
    const int k = DraftTokensUnderLoad(8, running, 32);
    EXPECT_LE(k, prev) << running;  // monotone in the load
    prev = k;
  }
}

// Rounds that sit out drafting (the load rule) still tell the speculator
// every emitted token: the output stays the target's own greedy tokens and
// the stats count the limited rounds.
TEST_F(RequestRunnerTest, DraftingBacksOffUnderLoadAndStaysLossless) {
  const std::string text = StoryPrompt(2);
  const int kNew = 40;
  const std::vector<int> want = FullReference(text, kNew);
  int calls = 0;
  backends_.spec_decode_disable_by_batch_size = 8;
  // The load swings: 0, 6 (fewer drafts), 8 (none), 0, ...
  backends_.running_requests = [&calls] {
    const int load[] = {0, 6, 8, 8, 0};
    return load[calls++ % 5];
  };
  Outcome o = Run(Request(text, kNew, 1.f, /*spec_decode=*/true));
  backends_.running_requests = nullptr;
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(Ids(o.response), want);
  const v1::GenerationStats& s = o.response.stats();
  EXPECT_GT(s.num_rounds_drafting_disabled(), 0);
  EXPECT_GT(s.num_rounds_drafts_reduced(), 0);
  EXPECT_GT(s.num_drafts(), 0);
  EXPECT_GT(s.num_accepted_tokens(), 0);
}

TEST_F(RequestRunnerTest, DraftingWithoutPruningAndPlainServingAreLossless) {
  const std::string text = StoryPrompt(3);
  const std::vector<int> want = FullReference(text, 40);
  for (auto [prefill, decode] :
       {std::pair{false, true}, std::pair{false, false}}) {
    v1::GenerateTextRequest req = Request(text, 40, 0.1f, decode);
    req.mutable_speculative_prefill()->set_enabled(prefill);
    Outcome o = Run(req);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(Ids(o.response), want);
    EXPECT_EQ(o.response.usage().kept_prompt_tokens(),
              o.response.usage().prompt_tokens());
    EXPECT_EQ(o.response.stats().num_drafts() > 0, decode);
    EXPECT_EQ(o.response.stats().speculate_s() > 0, decode);
  }
}

// sampling.prompt_logprobs: the whole prompt goes to the target although
// the defaults prune (kept = prompt tokens), the output is the full-prompt
// greedy continuation, and the response carries the prompt's ids and one
// logprob per prompt token after the first, the target model's
// log-softmax of the row before it; streamed, only the first chunk has
// them. Enabling Speculative Prefill with it is refused.
TEST_F(RequestRunnerTest, PromptLogprobsComeWithTheWholePrompt) {
  const std::string text = StoryPrompt(4);
  const std::vector<int> prompt = Encode(text);
  const int n = static_cast<int>(prompt.size());
  const int vocab = model_->config().vocab_size;
  std::vector<float> rows;
  {
    auto kv = *model_->NewSequence(n);
    ForwardInput in;
    in.token_ids = prompt;
    std::vector<int> pos(n);
    for (int i = 0; i < n; ++i) pos[i] = i;
    in.position_ids = pos;
    for (int r = 0; r < n; ++r) in.logit_rows.push_back(r);
    ForwardOutput out;
    ASSERT_TRUE(model_->Forward(in, kv.get(), &out).ok());
    rows = out.logits;
  }
  v1::GenerateTextRequest req = Request(text, 12, 0.3f, true);
  req.mutable_speculative_prefill()->clear_enabled();
  backends_.defaults.spec_prefill = true;
  req.mutable_sampling()->set_prompt_logprobs(2);
  int with_prompt = 0;
  Outcome o = Run(req, [&](const v1::GenerateTextChunk& c, RequestRunner*) {
    if (c.prompt_logprobs_size() > 0) ++with_prompt;
  });
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(with_prompt, 1);
  EXPECT_EQ(Ids(o.response), FullReference(text, 12));
  EXPECT_EQ(o.response.usage().kept_prompt_tokens(), n);
  ASSERT_EQ(std::vector<int>(o.response.prompt_token_ids().begin(),
                             o.response.prompt_token_ids().end()),
            prompt);
  ASSERT_EQ(o.response.prompt_logprobs_size(), n - 1);
  for (int i = 0; i + 1 < n; ++i) {
    const TokenLogprobs want = ComputeTokenLogprobs(
        absl::MakeConstSpan(rows.data() + static_cast<size_t>(i) * vocab,
                            vocab),
        prompt[i + 1], 2);
    const v1::TokenLogprob& got = o.response.prompt_logprobs(i);
    EXPECT_NEAR(got.logprob(), want.logprob, 1e-4) << i;
    ASSERT_EQ(got.top_size(), 2) << i;
    EXPECT_EQ(got.top(0).id(), want.top[0].first) << i;
  }
  req.mutable_speculative_prefill()->set_enabled(true);
  Outcome refused = Run(req);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status)) << refused.status;
  EXPECT_NE(refused.status.message().find("prompt_logprobs"),
            std::string::npos);
}

TEST_F(RequestRunnerTest, PrunedPrefillKeepsOriginalPositions) {
  const std::string text = StoryPrompt(15);
  const std::vector<int> prompt = Encode(text);
  const int n = static_cast<int>(prompt.size());
  ASSERT_GT(n, 150);
  const std::vector<int> kept = KeptIndices(prompt);
  ASSERT_LT(kept.size(), prompt.size() / 2);
  std::vector<int> kept_ids;
  for (int k : kept) kept_ids.push_back(prompt[k]);
  const std::vector<int> want = Reference(*model_, kept_ids, kept, n, 32);

  for (bool spec_decode : {false, true}) {
    SCOPED_TRACE(spec_decode);
    v1::GenerateTextRequest req = Request(text, 32, 0.3f, spec_decode);
    req.mutable_speculative_prefill()->set_chunk_size(8);
    Outcome o = Run(req);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.response.usage().prompt_tokens(), n);
    EXPECT_EQ(o.response.usage().kept_prompt_tokens(), int(kept.size()));
    EXPECT_FLOAT_EQ(o.response.stats().keep_ratio(), float(kept.size()) / n);
    EXPECT_EQ(Ids(o.response), want);
  }
  // The plain full-prompt continuation differs (pruning is visible).
  EXPECT_NE(want, FullReference(text, 32));
}

// Penalties reach the target, with the whole prompt when it was pruned:
// the router's output is the target's penalized greedy decoding of the kept
// tokens at their original positions, its repetition penalty reading the
// ids pruning dropped too, with and without drafts.
TEST_F(RequestRunnerTest, PenaltiesReachTheTargetWithTheWholePrompt) {
  const std::string text = StoryPrompt(15);
  const std::vector<int> prompt = Encode(text);
  const int n = static_cast<int>(prompt.size());
  const std::vector<int> kept = KeptIndices(prompt);
  ASSERT_LT(kept.size(), prompt.size() / 2);
  TargetRequest tr;
  for (int k : kept) tr.token_ids.push_back(prompt[k]);
  tr.position_ids = kept;
  tr.next_position = n;
  tr.stop.max_new_tokens = 32;
  tr.sampling.presence_penalty = 0.5f;
  tr.sampling.frequency_penalty = 0.5f;
  tr.sampling.repetition_penalty = 1.3f;
  const auto decode = [&](const TargetRequest& r) {
    auto s = TargetSession::Create(model_, r);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return std::vector<int>();
    while (!(*s)->finished()) {
      if (!(*s)->Step({}).ok()) break;
    }
    return (*s)->output();
  };
  const std::vector<int> kept_only = decode(tr);
  tr.penalty_prompt_ids = prompt;
  const std::vector<int> want = decode(tr);
  ASSERT_FALSE(want.empty());
  // The dropped ids matter, and so do the penalties.
  EXPECT_NE(want, kept_only);
  EXPECT_NE(want, Reference(*model_, tr.token_ids, kept, n, 32));
  for (bool spec_decode : {false, true}) {
    SCOPED_TRACE(spec_decode);
    v1::GenerateTextRequest req = Request(text, 32, 0.3f, spec_decode);
    req.mutable_speculative_prefill()->set_chunk_size(8);
    req.mutable_sampling()->set_presence_penalty(0.5f);
    req.mutable_sampling()->set_frequency_penalty(0.5f);
    req.mutable_sampling()->set_repetition_penalty(1.3f);
    Outcome o = Run(req);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.response.usage().kept_prompt_tokens(), int(kept.size()));
    EXPECT_EQ(Ids(o.response), want);
  }
}

// keep_mass reaches the speculator: the router keeps exactly what a Score
// with the same options keeps, never more than keep_ratio allows, and a
// smaller mass keeps fewer tokens.
TEST_F(RequestRunnerTest, KeepMassIsForwardedAndCappedByKeepRatio) {
  const std::string text = StoryPrompt(15);
  const std::vector<int> prompt = Encode(text);
  const int n = static_cast<int>(prompt.size());
  auto score_kept = [&](float ratio, float mass) {
    v1::ScoreRequest sreq;
    sreq.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    sreq.mutable_options()->set_keep_ratio(ratio);
    sreq.mutable_options()->set_keep_mass(mass);
    sreq.mutable_options()->set_chunk_size(8);
    v1::ScoreResponse sresp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    EXPECT_TRUE(v1::Speculator::NewStub(
                    grpc::CreateChannel(Addr(speculator_->port()),
                                        grpc::InsecureChannelCredentials()))
                    ->Score(&ctx, sreq, &sresp)
                    .ok());
    return sresp.kept_indices_size();
  };
  const int ceiling = score_kept(0.5f, 0.f);
  const int low = score_kept(0.5f, 0.2f);
  const int high = score_kept(1.0f, 0.9f);
  EXPECT_LT(low, ceiling);
  EXPECT_LE(low, high);
  for (float mass : {0.2f, 0.9f}) {
    SCOPED_TRACE(mass);
    v1::GenerateTextRequest req = Request(text, 4, mass < 0.5f ? 0.5f : 1.f,
                                          false);
    req.mutable_speculative_prefill()->set_chunk_size(8);
    req.mutable_speculative_prefill()->set_keep_mass(mass);
    Outcome o = Run(req);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.response.usage().kept_prompt_tokens(),
              mass < 0.5f ? low : high);
    EXPECT_LE(o.response.usage().kept_prompt_tokens(), n);
  }
}

TEST_F(RequestRunnerTest, SampledRequestsAreReproducibleBySeed) {
  v1::GenerateTextRequest req = Request(StoryPrompt(2), 40, 1.f, true);
  req.mutable_sampling()->set_temperature(0.8f);
  req.mutable_sampling()->set_top_p(0.9f);
  req.mutable_sampling()->set_seed(7);
  Outcome a = Run(req), b = Run(req);
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(Ids(a.response), Ids(b.response));
  EXPECT_GT(a.response.stats().num_drafts(), 0);
  for (int id : a.response.token_ids()) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 512);
  }
  req.mutable_sampling()->set_seed(8);
  Outcome c = Run(req);
  ASSERT_TRUE(c.status.ok());
  EXPECT_NE(Ids(a.response), Ids(c.response));
}

TEST_F(RequestRunnerTest, SpeculatorDownBeforeTheRequestFallsBack) {
  const std::string text = StoryPrompt(2);
  speculator_->Shutdown(absl::ZeroDuration());
  for (int i = 0; i < 2; ++i) {  // known-bad on the second request
    Outcome o = Run(Request(text, 24, 0.3f, true));
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.response.stats().fallback_reason(), "speculator_unavailable");
    EXPECT_EQ(Ids(o.response), FullReference(text, 24));
    EXPECT_EQ(o.response.usage().kept_prompt_tokens(),
              o.response.usage().prompt_tokens());
    EXPECT_EQ(o.response.stats().num_drafts(), 0);
    EXPECT_EQ(o.response.stats().spec_decode_method(), "");  // none drafted
  }
  const std::string m =
      prometheus::TextSerializer().Serialize(registry_->Collect());
  EXPECT_EQ(MetricValue(m, "specserve_router_fallbacks_total",
                        {"speculator_unavailable"}),
            2);
}

// The fake speculators below use the callback API, as the services do: in
// CI (ASan), a sync-API fake shut down with a deadline once left a gRPC
// 1.51 worker thread that freed a completion queue twice, in the next test.

// A unary reactor that answers only when the caller gives up (deadline,
// cancel or server shutdown).
class UntilCancelled final : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override { Finish(grpc::Status::CANCELLED); }
  void OnDone() override { delete this; }
};

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx,
                                 const grpc::Status& status) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(status);
  return r;
}

// A Speculator whose Score never answers (until cancelled).
class HangingSpeculator final : public v1::Speculator::CallbackService {
 public:
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx,
                                 const v1::InfoRequest*,
                                 v1::ModelInfo* out) override {
    out->set_vocab_size(512);
    return Answer(ctx, grpc::Status::OK);
  }
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext*,
                                  const v1::ScoreRequest*,
                                  v1::ScoreResponse*) override {
    return new UntilCancelled();
  }
};

TEST_F(RequestRunnerTest, SpeculatorPastItsDeadlineFallsBack) {
  HangingSpeculator hanging;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&hanging, &port);
  Connect(Addr(port), Addr(target_->port()));
  backends_.speculator_deadline = absl::Milliseconds(100);
  const std::string text = StoryPrompt(2);
  const absl::Time t0 = absl::Now();
  Outcome o = Run(Request(text, 16, 0.3f, true));
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.response.stats().fallback_reason(), "speculator_deadline");
  EXPECT_EQ(Ids(o.response), FullReference(text, 16));
  EXPECT_GE(took, absl::Milliseconds(100));
  EXPECT_LT(took, absl::Seconds(3));
  server->Shutdown(absl::ToChronoTime(absl::Now()));
}

// Drafting without pruning: the target's prefill does not wait for
// Speculator.Score (both prefill at once). With Score hanging, the target
// holds the request's session well before the speculator's deadline; the
// request then falls back and stays exact.
TEST_F(RequestRunnerTest, TargetPrefillsWhileTheSpeculatorScores) {
  HangingSpeculator hanging;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&hanging, &port);
  Connect(Addr(port), Addr(target_->port()));
  backends_.speculator_deadline = absl::Milliseconds(1500);
  const std::string text = StoryPrompt(2);
  v1::GenerateTextRequest req = Request(text, 16, 1.f, true);
  req.mutable_speculative_prefill()->set_enabled(false);
  const absl::Time t0 = absl::Now();
  absl::Time target_started = absl::InfiniteFuture();
  std::thread watch([&] {
    while (absl::Now() - t0 < absl::Seconds(5)) {
      if (target_->active_sessions() > 0) {
        target_started = absl::Now();
        return;
      }
      absl::SleepFor(absl::Microseconds(200));
    }
  });
  Outcome o = Run(req);
  watch.join();
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.response.stats().fallback_reason(), "speculator_deadline");
  EXPECT_EQ(Ids(o.response), FullReference(text, 16));
  EXPECT_LT(target_started - t0, absl::Milliseconds(1000));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(1500));
  server->Shutdown(absl::ToChronoTime(absl::Now()));
}

// A Speculator that answers Score after `score_delay` even if the caller
// gave up meanwhile (what a frozen process does when it resumes: it sees
// the call's deadline later than the caller), opening a session each time,
// and takes `release_delay` to get to a ReleaseSession, which it applies
// only if the caller is still waiting (a frozen process drops cancelled
// calls). Before, both leaked sessions until their TTL.
class SlowSpeculator final : public v1::Speculator::CallbackService {
 public:
  SlowSpeculator(absl::Duration score_delay, absl::Duration release_delay)
      : score_delay_(score_delay), release_delay_(release_delay) {}
  // After the server's shutdown, which waits for every answer.
  ~SlowSpeculator() override {
    std::vector<std::thread> later;
    {
      absl::MutexLock lock(&mu_);
      later.swap(later_);
    }
    for (std::thread& t : later) t.join();
  }

  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx,
                                 const v1::InfoRequest*,
                                 v1::ModelInfo* out) override {
    out->set_vocab_size(512);
    return Answer(ctx, grpc::Status::OK);
  }
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx,
                                  const v1::ScoreRequest* req,
                                  v1::ScoreResponse* resp) override {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    Later(score_delay_, [this, r, req, resp] {
      for (int i = 0; i < req->token_ids_size(); ++i) {
        resp->add_kept_indices(i);
        resp->add_position_ids(i);
      }
      resp->set_next_position(req->token_ids_size());
      {
        absl::MutexLock lock(&mu_);
        resp->set_session_id(absl::StrCat("s", ++opened_));
      }
      r->Finish(grpc::Status::OK);
    });
    return r;
  }
  grpc::ServerUnaryReactor* ReleaseSession(
      grpc::CallbackServerContext* ctx, const v1::ReleaseSessionRequest*,
      v1::ReleaseSessionResponse*) override {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    Later(release_delay_, [this, r, ctx] {
      if (ctx->IsCancelled()) {
        r->Finish(grpc::Status::CANCELLED);
        return;
      }
      {
        absl::MutexLock lock(&mu_);
        ++released_;
      }
      r->Finish(grpc::Status::OK);
    });
    return r;
  }
  int open_sessions() {
    absl::MutexLock lock(&mu_);
    return opened_ - released_;
  }
  int opened() {
    absl::MutexLock lock(&mu_);
    return opened_;
  }

 private:
  // Runs `f` after `delay` on a thread of its own: a callback handler must
  // not block gRPC's threads.
  void Later(absl::Duration delay, std::function<void()> f) {
    absl::MutexLock lock(&mu_);
    later_.emplace_back([delay, f = std::move(f)] {
      absl::SleepFor(delay);
      f();
    });
  }

  const absl::Duration score_delay_, release_delay_;
  absl::Mutex mu_;
  int opened_ ABSL_GUARDED_BY(mu_) = 0;
  int released_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> later_ ABSL_GUARDED_BY(mu_);
};

TEST_F(RequestRunnerTest, LateScoreAnswerAfterFallbackIsReleased) {
  SlowSpeculator slow(absl::Milliseconds(600), absl::ZeroDuration());
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&slow, &port);
  Connect(Addr(port), Addr(target_->port()));
  backends_.speculator_deadline = absl::Milliseconds(100);
  const std::string text = StoryPrompt(2);
  const absl::Time t0 = absl::Now();
  Outcome o = Run(Request(text, 8, 0.3f, true));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.response.stats().fallback_reason(), "speculator_deadline");
  EXPECT_EQ(Ids(o.response), FullReference(text, 8));
  EXPECT_LT(o.response.stats().speculate_s(), 0.5);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // The session the late answer opened is released when it arrives.
  EXPECT_TRUE(Eventually([&] { return slow.opened() == 1; }));
  EXPECT_TRUE(Eventually([&] { return slow.open_sessions() == 0; }))
      << slow.open_sessions();
  server->Shutdown(absl::ToChronoTime(absl::Now()));
}

TEST_F(RequestRunnerTest,
       ReleaseReachesASlowSpeculatorWithoutHoldingTheRequest) {
  SlowSpeculator slow(absl::ZeroDuration(), absl::Milliseconds(1500));
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&slow, &port);
  Connect(Addr(port), Addr(target_->port()));
  backends_.speculator_deadline = absl::Milliseconds(200);
  const std::string text = StoryPrompt(2);
  const absl::Time t0 = absl::Now();
  Outcome o = Run(Request(text, 8, 1.f, /*spec_decode=*/false));
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.response.stats().fallback_reason(), "");
  EXPECT_EQ(Ids(o.response), FullReference(text, 8));
  EXPECT_LT(took, absl::Milliseconds(1500));  // did not wait for the release
  EXPECT_EQ(slow.opened(), 1);
  EXPECT_TRUE(Eventually([&] { return slow.open_sessions() == 0; }))
      << slow.open_sessions();
  server->Shutdown(absl::ToChronoTime(absl::Now()));
}

TEST_F(RequestRunnerTest, SpeculatorKilledMidGenerationStillCompletes) {
  const std::string text = StoryPrompt(2);
  const int kNew = 60;
  Outcome o = Run(Request(text, kNew, 1.f, true),
                  [&](const v1::GenerateTextChunk&, RequestRunner*) {
                    // Between the first verify round and the next Draft.
                    if (speculator_ != nullptr) {
                      speculator_->Shutdown(absl::ZeroDuration());
                    }
                  });
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(Ids(o.response), FullReference(text, kNew));
  EXPECT_EQ(o.response.stats().fallback_reason().rfind(
                "speculator_failed_mid_generation: ", 0),
            0u)
      << o.response.stats().fallback_reason();
  EXPECT_EQ(o.response.stats().num_drafts(), 1);  // only the look-ahead
  EXPECT_TRUE(Eventually([&] { return target_->active_sessions() == 0; }));
}

// Regression (UBSan under --config=asan): a cancel landing between draft
// rounds let gRPC finish and free the Draft call while the next round was
// starting a write on it. Repeated so the interleaving is likely.
TEST_F(RequestRunnerTest, CancelsBetweenDraftRoundsNeverTouchAFinishedCall) {
  for (int i = 0; i < 8; ++i) {
    Outcome o = Run(Request(StoryPrompt(2), 400, 1.f, true),
                    [&](const v1::GenerateTextChunk&, RequestRunner* r) {
                      r->Cancel();
                    });
    EXPECT_TRUE(absl::IsCancelled(o.status)) << o.status;
    EXPECT_TRUE(Eventually([&] {
      return speculator_->sessions().num_sessions() == 0 &&
             target_->active_sessions() == 0;
    }));
  }
}

TEST_F(RequestRunnerTest, CancelFreesBothSessions) {
  Outcome o = Run(Request(StoryPrompt(2), 400, 1.f, true),
                  [&](const v1::GenerateTextChunk&, RequestRunner* r) {
                    EXPECT_EQ(speculator_->sessions().num_sessions(), 1);
                    EXPECT_EQ(target_->active_sessions(), 1);
                    r->Cancel();
                  });
  EXPECT_TRUE(absl::IsCancelled(o.status)) << o.status;
  EXPECT_EQ(o.chunks, 1);
  EXPECT_TRUE(Eventually([&] {
    return speculator_->sessions().num_sessions() == 0 &&
           target_->active_sessions() == 0;
  }));
}

TEST_F(RequestRunnerTest, StopStringsCutTheText) {
  const std::string text = StoryPrompt(1);
  const std::vector<int> ids = FullReference(text, 60);
  const std::string full = Decode(ids);
  ASSERT_GT(full.size(), 60u);
  // A stop string spanning a token boundary in the middle of the output.
  const std::string stop = full.substr(30, 7);
  const size_t at = full.find(stop);
  v1::GenerateTextRequest req = Request(text, 60, 1.f, true);
  req.mutable_sampling()->add_stop("never appears \x01");
  req.mutable_sampling()->add_stop(stop);
  std::string streamed;
  Outcome o = Run(req, [&](const v1::GenerateTextChunk& c, RequestRunner*) {
    streamed += c.text();
    // Held back: nothing past the stop string's start is ever sent.
    EXPECT_LE(streamed.size(), at);
  });
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.response.text(), full.substr(0, at));
  EXPECT_EQ(o.response.finish_reason(), "stop");
  // Token ids up to the one completing the match, a prefix of the output.
  const std::vector<int> got = Ids(o.response);
  ASSERT_LT(got.size(), ids.size());
  EXPECT_EQ(got, std::vector<int>(ids.begin(), ids.begin() + got.size()));
  EXPECT_NE(Decode(got).find(stop), std::string::npos);
  EXPECT_EQ(o.response.usage().completion_tokens(), int(got.size()));
  EXPECT_TRUE(Eventually([&] {
    return speculator_->sessions().num_sessions() == 0 &&
           target_->active_sessions() == 0;
  }));
}

// --- Prompt lookup ("ngram").

// A story told twice and begun a third time: the greedy continuation
// copies spans of the prompt (and the tiny model's own loops), which
// prompt lookup proposes.
std::string RepeatingPrompt() { return StoryPrompt(4) + StoryPrompt(4) +
                                       StoryPrompt(2); }

v1::GenerateTextRequest NgramRequest(const std::string& text, int max_new,
                                     bool spec_prefill) {
  v1::GenerateTextRequest r;
  r.set_text(text);
  r.mutable_sampling()->set_max_new_tokens(max_new);
  r.mutable_speculative_prefill()->set_enabled(spec_prefill);
  r.mutable_speculative_decoding()->set_enabled(true);
  r.mutable_speculative_decoding()->set_method("ngram");
  r.mutable_speculative_decoding()->set_num_draft_tokens(4);
  r.mutable_speculative_decoding()->set_prompt_lookup_min(2);
  r.mutable_speculative_decoding()->set_prompt_lookup_max(4);
  return r;
}

TEST_F(RequestRunnerTest, NgramOnARepeatingPromptIsLosslessAndAccepts) {
  const std::string text = RepeatingPrompt();
  const int kNew = 48;
  const std::vector<int> want = FullReference(text, kNew);
  Outcome o = Run(NgramRequest(text, kNew, /*spec_prefill=*/false));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(Ids(o.response), want);
  const v1::GenerationStats& s = o.response.stats();
  EXPECT_EQ(s.spec_decode_method(), "ngram");
  EXPECT_EQ(s.fallback_reason(), "");
  EXPECT_EQ(s.speculate_s(), 0);  // the speculator was never called
  EXPECT_GT(s.num_drafts(), 0);
  EXPECT_GT(s.num_accepted_tokens(), 0);
  EXPECT_LE(s.num_accepted_tokens(), s.num_draft_tokens());
  // The lookup runs in the target on a continuous stream: a chunk carries
  // one or more rounds, each round one drafted round or a plain one.
  EXPECT_LE(o.chunks, s.num_target_forwards());
  // Each round emits its accepted drafts and one token (the last round's
  // may be cut by max_new_tokens).
  EXPECT_GE(s.num_target_forwards(),
            int(want.size()) - s.num_accepted_tokens());
  EXPECT_GT(s.tokens_per_target_forward(), 1.0);
  EXPECT_DOUBLE_EQ(s.tokens_per_target_forward(),
                   double(want.size()) / s.num_target_forwards());
  const std::string m =
      prometheus::TextSerializer().Serialize(registry_->Collect());
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_spec_decode_num_accepted_tokens_total",
                        {"method=\"ngram\""}),
            s.num_accepted_tokens());
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_spec_decode_num_target_forwards_total",
                        {"method=\"ngram\""}),
            s.num_target_forwards());
  EXPECT_EQ(speculator_->sessions().num_sessions(), 0);
  EXPECT_TRUE(Eventually([&] { return target_->active_sessions() == 0; }));
}

// With Speculative Prefill the speculator only prunes (no session), and the
// drafts still come from the full prompt.
TEST_F(RequestRunnerTest, NgramWithPruningKeepsNoSpeculatorSession) {
  const std::string text = RepeatingPrompt();
  v1::GenerateTextRequest req = NgramRequest(text, 32, /*spec_prefill=*/true);
  req.mutable_speculative_prefill()->set_keep_ratio(0.5f);
  Outcome o = Run(req);
  ASSERT_TRUE(o.status.ok()) << o.status;
  const v1::GenerationStats& s = o.response.stats();
  EXPECT_EQ(s.spec_decode_method(), "ngram");
  EXPECT_EQ(s.fallback_reason(), "");
  EXPECT_GT(s.speculate_s(), 0);
  EXPECT_LT(o.response.usage().kept_prompt_tokens(),
            o.response.usage().prompt_tokens());
  EXPECT_GT(s.num_drafts(), 0);
  EXPECT_EQ(speculator_->sessions().num_sessions(), 0);
}

TEST_F(RequestRunnerTest, NgramDraftsWithTheSpeculatorDown) {
  const std::string text = RepeatingPrompt();
  const int kNew = 40;
  const std::vector<int> want = FullReference(text, kNew);
  speculator_->Shutdown(absl::ZeroDuration());
  for (bool spec_prefill : {true, false}) {
    SCOPED_TRACE(spec_prefill);
    Outcome o = Run(NgramRequest(text, kNew, spec_prefill));
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(Ids(o.response), want);
    const v1::GenerationStats& s = o.response.stats();
    // Pruning fell back; drafting did not need the speculator.
    EXPECT_EQ(s.fallback_reason(),
              spec_prefill ? "speculator_unavailable" : "");
    EXPECT_EQ(o.response.usage().kept_prompt_tokens(),
              o.response.usage().prompt_tokens());
    EXPECT_EQ(s.spec_decode_method(), "ngram");
    EXPECT_GT(s.num_drafts(), 0);
    EXPECT_GT(s.num_accepted_tokens(), 0);
  }
}

TEST_F(RequestRunnerTest, NgramWithoutAMatchIsPlainDecoding) {
  // No 16-gram of this prompt repeats, and 8 new tokens cannot make one.
  const std::string text = StoryPrompt(2);
  const int kNew = 8;
  const std::vector<int> want = FullReference(text, kNew);
  v1::GenerateTextRequest req = NgramRequest(text, kNew, false);
  req.mutable_speculative_decoding()->set_prompt_lookup_min(16);
  req.mutable_speculative_decoding()->set_prompt_lookup_max(16);
  Outcome o = Run(req);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(Ids(o.response), want);
  const v1::GenerationStats& s = o.response.stats();
  EXPECT_EQ(s.spec_decode_method(), "ngram");
  EXPECT_EQ(s.num_drafts(), 0);
  EXPECT_EQ(s.num_draft_tokens(), 0);
  EXPECT_EQ(s.num_target_forwards(), int(want.size()));  // one token each
  EXPECT_DOUBLE_EQ(s.tokens_per_target_forward(), 1.0);
}

// Sampled requests send point-mass q: the target's speculative sampling
// takes them, and a seed reproduces the output.
TEST_F(RequestRunnerTest, NgramSampledIsReproducibleBySeed) {
  v1::GenerateTextRequest req = NgramRequest(RepeatingPrompt(), 32, false);
  req.mutable_sampling()->set_temperature(0.5f);
  req.mutable_sampling()->set_seed(11);
  Outcome a = Run(req);
  Outcome b = Run(req);
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(Ids(a.response), Ids(b.response));
  EXPECT_EQ(a.response.usage().completion_tokens(), 32);
  EXPECT_GT(a.response.stats().num_drafts(), 0);
}

// --- Token trees ("draft_tree").

// Greedy trees end to end: the speculator drafts trees, the target
// verifies them with a tree mask; the output is the target's greedy
// decoding, and more tokens are accepted per round than a chain of the
// same speculator gets. Sampled trees reproduce by seed.
TEST_F(RequestRunnerTest, DraftTreesAreLosslessAndAcceptMoreThanChains) {
  const std::string text = StoryPrompt(3);
  const int kNew = 48;
  const std::vector<int> want = FullReference(text, kNew);
  auto request = [&](const std::string& method) {
    v1::GenerateTextRequest r;
    r.set_text(text);
    r.mutable_sampling()->set_max_new_tokens(kNew);
    r.mutable_speculative_prefill()->set_enabled(false);
    r.mutable_speculative_decoding()->set_enabled(true);
    r.mutable_speculative_decoding()->set_method(method);
    r.mutable_speculative_decoding()->set_num_draft_tokens(4);
    return r;
  };
  Outcome chain = Run(request("draft"));
  Outcome tree = Run(request("draft_tree"));
  ASSERT_TRUE(chain.status.ok()) << chain.status;
  ASSERT_TRUE(tree.status.ok()) << tree.status;
  EXPECT_EQ(Ids(chain.response), want);
  EXPECT_EQ(Ids(tree.response), want);
  const v1::GenerationStats& c = chain.response.stats();
  const v1::GenerationStats& t = tree.response.stats();
  EXPECT_EQ(t.spec_decode_method(), "draft_tree");
  EXPECT_EQ(t.fallback_reason(), "");
  EXPECT_GT(t.num_draft_tokens(), t.num_drafts());  // several nodes a round
  EXPECT_GT(t.tokens_per_target_forward(), c.tokens_per_target_forward());
  const std::string m =
      prometheus::TextSerializer().Serialize(registry_->Collect());
  EXPECT_EQ(MetricValue(m,
                        "specserve_router_spec_decode_num_accepted_tokens_total",
                        {"method=\"draft_tree\""}),
            t.num_accepted_tokens());

  // A confidence-sized tree (min_path_prob) is as lossless, with fewer
  // nodes a round.
  v1::GenerateTextRequest sized = request("draft_tree");
  sized.mutable_speculative_decoding()->set_tree_min_path_prob(0.05);
  Outcome s = Run(sized);
  ASSERT_TRUE(s.status.ok()) << s.status;
  EXPECT_EQ(Ids(s.response), want);
  const v1::GenerationStats& st = s.response.stats();
  EXPECT_LT(double(st.num_draft_tokens()) / st.num_drafts(),
            double(t.num_draft_tokens()) / t.num_drafts());
  EXPECT_GT(st.num_accepted_tokens(), 0);

  v1::GenerateTextRequest sampled = request("draft_tree");
  sampled.mutable_sampling()->set_temperature(0.8f);
  sampled.mutable_sampling()->set_seed(5);
  sampled.mutable_speculative_decoding()->set_tree_min_path_prob(0.02);
  Outcome a = Run(sampled);
  Outcome b = Run(sampled);
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(Ids(a.response), Ids(b.response));
  EXPECT_EQ(a.response.usage().completion_tokens(), kNew);
  EXPECT_GT(a.response.stats().num_accepted_tokens(), 0);
  // Sessions are released in the background.
  EXPECT_TRUE(
      Eventually([&] { return speculator_->sessions().num_sessions() == 0; }));
  EXPECT_TRUE(Eventually([&] { return target_->active_sessions() == 0; }));
}

// JSON mode through the real services with every drafting method: greedy
// output is the same without drafts, with chains, n-gram drafts and trees
// (lossless under the mask), and sampled chains and trees (a sampled tree
// is decided on the host with the same mask) write only valid prefixes of
// a JSON object.
TEST_F(RequestRunnerTest, JsonModeWithEveryDraftingMethod) {
  const std::string text = StoryPrompt(3);
  absl::StatusOr<TokenByteTable> table = BuildTokenByteTable(*tokenizer_);
  ASSERT_TRUE(table.ok()) << table.status();
  const auto valid = [&](const v1::GenerateTextResponse& r) {
    JsonMatcher m;
    for (int id : r.token_ids()) {
      if (!m.Advance(table->bytes[id])) return false;
    }
    return true;
  };
  auto request = [&](const std::string& method) {
    v1::GenerateTextRequest r;
    r.set_text(text);
    r.mutable_sampling()->set_max_new_tokens(32);
    r.mutable_sampling()->set_json_object(true);
    r.mutable_speculative_prefill()->set_enabled(false);
    r.mutable_speculative_decoding()->set_enabled(!method.empty());
    if (!method.empty()) {
      r.mutable_speculative_decoding()->set_method(method);
      r.mutable_speculative_decoding()->set_num_draft_tokens(4);
    }
    return r;
  };
  Outcome plain = Run(request(""));
  ASSERT_TRUE(plain.status.ok()) << plain.status;
  EXPECT_TRUE(valid(plain.response));
  EXPECT_EQ(plain.response.usage().completion_tokens(), 32);
  for (const char* method : {"draft", "ngram", "draft_tree"}) {
    SCOPED_TRACE(method);
    Outcome o = Run(request(method));
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(Ids(o.response), Ids(plain.response));
  }
  for (const char* method : {"draft", "draft_tree"}) {
    for (int seed = 0; seed < 3; ++seed) {
      SCOPED_TRACE(absl::StrCat(method, " seed ", seed));
      v1::GenerateTextRequest r = request(method);
      r.mutable_sampling()->set_temperature(1.0f);
      r.mutable_sampling()->set_seed(seed);
      Outcome o = Run(r);
      ASSERT_TRUE(o.status.ok()) << o.status;
      EXPECT_TRUE(valid(o.response)) << o.response.text();
    }
  }
}

TEST(ResolveOptionsTest, AppliesDefaults) {
  RequestDefaults d;
  d.max_new_tokens = 7;
  d.prefill.keep_ratio = 0.5f;
  d.num_draft_tokens = 3;
  d.spec_decode = false;
  auto r = ResolveOptions(v1::GenerateTextRequest(), d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->max_new_tokens, 7);
  EXPECT_FLOAT_EQ(r->prefill.keep_ratio(), 0.5f);
  EXPECT_EQ(r->prefill.chunk_size(), 32);
  EXPECT_EQ(r->prefill.look_ahead(), 8);
  EXPECT_EQ(r->num_draft_tokens, 3);
  EXPECT_TRUE(r->spec_prefill);
  EXPECT_FALSE(r->spec_decode);
  EXPECT_FLOAT_EQ(r->sampling.top_p(), 1.f);
  EXPECT_FALSE(r->has_seed);
  d.top_p = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateDefaults(d)));
}

TEST(ResolveOptionsTest, RejectsBadFieldsNamingThem) {
  struct Case {
    std::function<void(v1::GenerateTextRequest*)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](auto* r) { r->mutable_sampling()->set_max_new_tokens(0); },
       "sampling.max_new_tokens"},
      {[](auto* r) { r->mutable_sampling()->set_temperature(-1); },
       "temperature"},
      {[](auto* r) { r->mutable_sampling()->set_top_k(-1); }, "top_k"},
      {[](auto* r) { r->mutable_sampling()->set_top_p(0); }, "sampling.top_p"},
      {[](auto* r) { r->mutable_sampling()->set_top_p(1.5f); },
       "sampling.top_p"},
      {[](auto* r) { r->mutable_sampling()->add_stop(""); },
       "sampling.stop[0]"},
      {[](auto* r) { r->mutable_sampling()->add_stop_token_ids(-3); },
       "sampling.stop_token_ids[0]"},
      // Bounded: 200,000 stop strings used to be accepted.
      {[](auto* r) {
         for (int i = 0; i <= kMaxStopStrings; ++i) {
           r->mutable_sampling()->add_stop(std::to_string(i));
         }
       },
       "sampling.stop has 17"},
      {[](auto* r) {
         r->mutable_sampling()->add_stop(
             std::string(kMaxStopStringBytes + 1, 'x'));
       },
       "sampling.stop[0] has 257"},
      {[](auto* r) {
         for (int i = 0; i <= kMaxStopTokenIds; ++i) {
           r->mutable_sampling()->add_stop_token_ids(i);
         }
       },
       "sampling.stop_token_ids has 65"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_keep_ratio(0); },
       "speculative_prefill.keep_ratio"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_keep_ratio(1.1f); },
       "speculative_prefill.keep_ratio"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_keep_mass(-0.1f); },
       "speculative_prefill.keep_mass"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_keep_mass(1.5f); },
       "speculative_prefill.keep_mass"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_chunk_size(0); },
       "speculative_prefill.chunk_size"},
      {[](auto* r) {
         r->mutable_speculative_prefill()->set_pool_kernel_size(4);
       },
       "speculative_prefill.pool_kernel_size"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_look_ahead(65); },
       "speculative_prefill.look_ahead"},
      {[](auto* r) { r->mutable_speculative_prefill()->set_keep_first(-1); },
       "speculative_prefill.keep_first"},
      {[](auto* r) {
         r->mutable_speculative_decoding()->set_num_draft_tokens(0);
       },
       "speculative_decoding.num_draft_tokens"},
      {[](auto* r) {
         r->mutable_speculative_decoding()->set_num_draft_tokens(65);
       },
       "speculative_decoding.num_draft_tokens"},
  };
  for (const Case& c : cases) {
    v1::GenerateTextRequest req;
    c.edit(&req);
    auto r = ResolveOptions(req, RequestDefaults());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << c.field;
    EXPECT_NE(r.status().message().find(c.field), absl::string_view::npos)
        << r.status();
  }
}

TEST_F(RequestRunnerTest, RejectsBadPrompts) {
  v1::GenerateTextRequest req;
  EXPECT_TRUE(absl::IsInvalidArgument(Run(req).status));  // no prompt
  req.set_text("");
  EXPECT_TRUE(absl::IsInvalidArgument(Run(req).status));
  req.mutable_token_ids();
  EXPECT_TRUE(absl::IsInvalidArgument(Run(req).status));
  req.mutable_token_ids()->add_ids(1);
  req.mutable_token_ids()->add_ids(512);
  Outcome o = Run(req);
  EXPECT_TRUE(absl::IsInvalidArgument(o.status));
  EXPECT_NE(o.status.message().find("token_ids.ids[1]"), std::string::npos);
  req.mutable_token_ids()->clear_ids();
  for (int i = 0; i < 512; ++i) req.mutable_token_ids()->add_ids(5);
  o = Run(req);
  EXPECT_TRUE(absl::IsInvalidArgument(o.status));
  EXPECT_NE(o.status.message().find("max context"), std::string::npos);
  // A text that cannot fit the context is refused before it is tokenized
  // (an 8 MB prompt took 45 s of tokenizing to be refused).
  backends_.max_bytes_per_token = MaxBytesPerToken(*tokenizer_);
  req.set_text(std::string(8 << 20, 'a'));
  o = Run(req);
  EXPECT_TRUE(absl::IsInvalidArgument(o.status));
  EXPECT_NE(o.status.message().find("refused before tokenizing"),
            std::string::npos)
      << o.status;
  // One that fits the bytes but not the tokens is still refused after.
  req.set_text(StoryPrompt(12) + StoryPrompt(12) + StoryPrompt(12) +
               StoryPrompt(12));
  o = Run(req);
  EXPECT_TRUE(absl::IsInvalidArgument(o.status));
  EXPECT_NE(o.status.message().find("max context"), std::string::npos)
      << o.status;
  req.set_text("hello");
  req.mutable_sampling()->add_stop_token_ids(600);
  EXPECT_TRUE(absl::IsInvalidArgument(Run(req).status));
  req.mutable_sampling()->clear_stop_token_ids();
  (*req.mutable_sampling()->mutable_logit_bias())[512] = 1.f;
  o = Run(req);
  EXPECT_TRUE(absl::IsInvalidArgument(o.status));
  EXPECT_NE(o.status.message().find("sampling.logit_bias id 512"),
            std::string::npos)
      << o.status;
  req.mutable_sampling()->clear_logit_bias();
  backends_.tokenizer = nullptr;
  req.mutable_sampling()->clear_stop_token_ids();
  EXPECT_TRUE(absl::IsInvalidArgument(Run(req).status));
}

TEST_F(RequestRunnerTest, TokenIdPromptsAreUsedAsGiven) {
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 432, 383, 286};
  v1::GenerateTextRequest req;
  req.mutable_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  req.mutable_sampling()->set_max_new_tokens(20);
  backends_.tokenizer = nullptr;  // ids in, ids out
  Outcome o = Run(req);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(Ids(o.response), Reference(*model_, prompt, {}, 8, 20));
  EXPECT_EQ(o.response.text(), "");
}

TEST_F(RequestRunnerTest, TargetDownIsUnavailableQuickly) {
  target_->Shutdown();
  const absl::Time t0 = absl::Now();
  Outcome o = Run(Request(StoryPrompt(1), 8, 0.3f, true));
  EXPECT_TRUE(absl::IsUnavailable(o.status)) << o.status;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  Connect(Addr(speculator_->port()), Addr(DeadPort()));
  o = Run(Request(StoryPrompt(1), 8, 0.3f, true));
  EXPECT_TRUE(absl::IsUnavailable(o.status)) << o.status;
  EXPECT_NE(o.status.message().find("target"), std::string::npos);
}

}  // namespace
}  // namespace specserve
