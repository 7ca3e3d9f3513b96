#include "router/request_runner.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "common/decoding/ngram_proposer.h"
#include "common/tokenizer/tokenizer.h"
#include "protos/speculator.grpc.pb.h"
#include "protos/target.grpc.pb.h"
#include "router/draft_proposer.h"
#include "router/metrics.h"
#include "router/output_processor.h"
#include "router/replica_pool.h"
#include "router/speculator_client.h"
#include "router/target_client.h"

namespace specserve {
namespace {

using GenerateStream =
    grpc::ClientReaderWriter<v1::GenerateRequest, v1::GenerateResponse>;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// Whether the speculator model proposes the request's drafts ("draft",
// "draft_tree"), as opposed to prompt lookup in the router ("ngram").
bool ModelDrafts(const ResolvedOptions& opts) {
  return opts.spec_decode &&
         opts.spec_decode_method != SpecDecodeMethod::kNgram;
}

}  // namespace

// The downstream calls of one request, cancellable from any thread.
class RequestRunner::Calls {
 public:
  // Cancels `ctx` now if the request is already cancelled.
  void Add(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    contexts_.push_back(ctx);
    if (cancelled_) ctx->TryCancel();
  }
  void Remove(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    contexts_.erase(std::remove(contexts_.begin(), contexts_.end(), ctx),
                    contexts_.end());
  }
  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (grpc::ClientContext* ctx : contexts_) ctx->TryCancel();
  }
  bool cancelled() const {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
};

RequestRunner::RequestRunner(const RouterBackends* backends)
    : backends_(backends), calls_(std::make_unique<Calls>()) {}

RequestRunner::~RequestRunner() = default;

void RequestRunner::Cancel() { calls_->Cancel(); }

// What the speculator contributed to a request: the target's prefill
// (kept ids, their positions, look-ahead drafts) and the session to draft
// from, or the reason it could not help.
struct RequestRunner::Plan {
  v1::Prefill prefill;  // empty token_ids = prefill the whole prompt
  std::optional<Replica> speculator;
  std::string session_id;  // "" = no session to draft from or release
  std::string fallback;
  double speculate_s = 0;
  v1::ScoreTimings timings;  // the speculator's own, when it answered
};

absl::Status RequestRunner::Speculate(const ResolvedOptions& opts,
                                      const std::vector<int>& prompt,
                                      absl::Time deadline, Plan* plan) {
  const RouterBackends& b = *backends_;
  auto picked = b.speculator->Pick();
  if (!picked.ok()) {
    if (absl::IsFailedPrecondition(picked.status())) return picked.status();
    plan->fallback = "speculator_unavailable";
    return absl::OkStatus();
  }
  v1::ScoreRequest req;
  req.mutable_token_ids()->Add(prompt.begin(), prompt.end());
  *req.mutable_options() = opts.prefill;
  // Drafting alone: the speculator still prefills the prompt (keeping
  // everything) and its look-ahead tokens are the first drafts.
  if (!opts.spec_prefill) {
    req.mutable_options()->set_keep_ratio(1.f);
    req.mutable_options()->set_keep_mass(0.f);
  }
  // Prompt lookup drafts in the router: no session to keep.
  req.set_keep_session(ModelDrafts(opts));
  *req.mutable_sampling() = opts.sampling;
  const absl::Time t0 = absl::Now();
  std::shared_ptr<ScoreCall> call = ScoreCall::Start(
      picked->channel, req,
      std::min(deadline,
               t0 + std::max(b.speculator_deadline, kAbandonedCallDeadline)));
  calls_->Add(call->context());
  absl::StatusOr<v1::ScoreResponse> answer =
      call->Wait(std::min(deadline, t0 + b.speculator_deadline) - t0);
  calls_->Remove(call->context());
  plan->speculate_s = Seconds(absl::Now() - t0);
  if (calls_->cancelled()) {
    if (answer.ok() && !answer->session_id().empty()) {
      ReleaseSessionAsync(picked->channel, answer->session_id());
    }
    return absl::CancelledError("cancelled");
  }
  const absl::Status st = answer.status();
  if (!st.ok()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "request deadline passed during Speculator.Score");
    }
    if (absl::IsUnavailable(st)) b.speculator->ReportFailure(picked->address);
    plan->fallback = FallbackReason(st);
    return absl::OkStatus();
  }
  const v1::ScoreResponse& resp = *answer;
  plan->timings = resp.timings();
  plan->speculator = *picked;
  plan->session_id = resp.session_id();  // released even if unusable
  // Trust but verify: the kept indices must be a sorted subset.
  const auto& kept = resp.kept_indices();
  const int n = static_cast<int>(prompt.size());
  bool valid = !kept.empty();
  for (int i = 0; valid && i < kept.size(); ++i) {
    valid = kept[i] >= 0 && kept[i] < n && (i == 0 || kept[i] > kept[i - 1]);
  }
  if (!valid) {
    plan->fallback = "speculator_bad_response: kept_indices";
    return absl::OkStatus();
  }
  if (opts.spec_prefill) {
    for (int k : kept) {
      plan->prefill.add_token_ids(prompt[k]);
      plan->prefill.add_position_ids(k);
    }
  }
  if (ModelDrafts(opts)) {
    // Greedy look-ahead is deterministic: q is a point mass, which keeps
    // rejection sampling lossless for sampled requests.
    AddPointMassDrafts({resp.look_ahead_token_ids().begin(),
                        resp.look_ahead_token_ids().end()},
                       opts.sampling.temperature() == 0.f,
                       plan->prefill.mutable_drafts());
  }
  return absl::OkStatus();
}

absl::Status RequestRunner::Run(const v1::GenerateTextRequest& request,
                                absl::Time start, absl::Time deadline,
                                const Sink& sink) {
  const RouterBackends& b = *backends_;
  auto opts_or = ResolveOptions(request, b.defaults);
  if (!opts_or.ok()) return opts_or.status();
  ResolvedOptions& opts = *opts_or;
  if (!opts.has_seed && opts.sampling.temperature() > 0.f) {
    absl::BitGen gen;
    opts.sampling.set_seed(absl::Uniform<uint64_t>(gen));
  }
  // "ngram" needs the speculator only to prune the prompt.
  const bool use_speculator = b.speculator != nullptr &&
                              !b.speculator->empty() &&
                              (opts.spec_prefill || ModelDrafts(opts));
  if (b.speculator != nullptr) {
    if (absl::Status s = b.speculator->compatibility(); !s.ok()) return s;
  }
  auto target = b.target->Pick();
  if (!target.ok()) return target.status();
  const std::optional<v1::ModelInfo> info = b.target->model_info();
  const int vocab =
      info ? info->vocab_size() : (b.tokenizer ? b.tokenizer->vocab_size() : 0);
  auto prompt_or =
      ResolvePrompt(request, b.tokenizer, b.max_bytes_per_token, vocab,
                info ? info->max_context() : 0);
  if (!prompt_or.ok()) return prompt_or.status();
  const std::vector<int>& prompt = *prompt_or;
  const int n = static_cast<int>(prompt.size());
  for (const auto& [id, bias] : opts.sampling.logit_bias()) {
    if (vocab > 0 && id >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.logit_bias id ", id,
                       " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  for (size_t i = 0; i < opts.stop_token_ids.size(); ++i) {
    if (vocab > 0 && opts.stop_token_ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.stop_token_ids[", i, "] = ", opts.stop_token_ids[i],
          " is outside the vocabulary [0, ", vocab, ")"));
    }
  }

  // --- Speculator: Score (prefill + look-ahead + selection). Without
  // pruning the target needs nothing from it to start: both prefill at
  // once (Score runs after the target's prefill is sent), and its
  // look-ahead drafts wait for the first round instead of riding along.
  const bool overlap = use_speculator && !opts.spec_prefill;
  Plan plan;
  if (use_speculator && !overlap) {
    if (absl::Status s = Speculate(opts, prompt, deadline, &plan); !s.ok()) {
      return s;
    }
  }
  std::string fallback = plan.fallback;
  const auto set_fallback = [&](std::string reason) {
    if (fallback.empty()) fallback = std::move(reason);
  };
  OutputProcessor output(b.tokenizer, opts.stop, start, b.metrics,
                         opts.min_tokens, opts.include_stop_str);
  v1::GenerationStats& stats = *output.mutable_stats();
  const auto set_score_stats = [&stats](const Plan& p) {
    stats.set_speculate_s(p.speculate_s);
    stats.set_score_prefill_s(p.timings.prefill_ns() * 1e-9);
    stats.set_score_look_ahead_s(p.timings.look_ahead_ns() * 1e-9);
    stats.set_score_select_s(p.timings.score_ns() * 1e-9);
    stats.set_score_total_s(p.timings.total_ns() * 1e-9);
  };
  set_score_stats(plan);
  v1::Prefill& prefill = plan.prefill;
  const std::string& session_id = plan.session_id;
  // Cleanup of the speculator session on every path out of here.
  std::unique_ptr<DraftStream> draft;
  // Drafts from the speculator's session ("draft", "draft_tree") while it
  // serves, or from prompt lookup over the full prompt and every emitted
  // token ("ngram": no speculator, so a speculator fallback does not stop
  // it).
  bool draft_alive =
      ModelDrafts(opts) && !session_id.empty() && fallback.empty();
  std::optional<NgramProposer> ngram;
  if (opts.spec_decode && !ModelDrafts(opts)) {
    ngram.emplace(opts.prompt_lookup_min, opts.prompt_lookup_max);
    ngram->Append(prompt);
  }
  const bool greedy = opts.sampling.temperature() == 0.f;
  // The method that drafts this request ("" = none: speculative decoding
  // off, or its speculator unavailable from the start).
  const auto set_method = [&] {
    output.SetSpecDecodeMethod(
        draft_alive || ngram
            ? std::string(SpecDecodeMethodName(opts.spec_decode_method))
            : "");
  };
  set_method();
  // Draft tokens for the next round under the load rule (--spec_decode_
  // disable_by_batch_size): fewer or none, counted in the stats.
  const auto draft_budget = [&]() {
    const int running = b.running_requests ? b.running_requests() : 0;
    const int k = DraftTokensUnderLoad(opts.num_draft_tokens, running,
                                       b.spec_decode_disable_by_batch_size);
    if (k == 0) {
      stats.set_num_rounds_drafting_disabled(
          stats.num_rounds_drafting_disabled() + 1);
    } else if (k < opts.num_draft_tokens) {
      stats.set_num_rounds_drafts_reduced(stats.num_rounds_drafts_reduced() +
                                          1);
    }
    if (b.metrics != nullptr && k < opts.num_draft_tokens) {
      b.metrics->CountLoadLimitedRound(k == 0);
    }
    return k;
  };
  auto release = absl::MakeCleanup([&] {
    if (draft != nullptr) {
      calls_->Remove(draft->context());
      draft->Close(b.speculator_deadline);
      draft.reset();
    }
    if (session_id.empty()) return;
    // Always: a half-closed stream keeps the session, and a stream cancelled
    // before its first message never bound it. Idempotent on the speculator.
    ReleaseSessionAsync(plan.speculator->channel, session_id);
  });
  const bool pruned = !prefill.token_ids().empty();
  if (!pruned) {
    prefill.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    for (int i = 0; i < n; ++i) prefill.add_position_ids(i);
  } else if (const float r = opts.sampling.repetition_penalty();
             r != 0.f && r != 1.f) {
    // The repetition penalty covers the ids pruning dropped too.
    prefill.mutable_penalty_prompt_ids()->Add(prompt.begin(), prompt.end());
  }
  if (!draft_alive) prefill.clear_drafts();
  // Prompt lookup's first drafts are verified in the prefill forward.
  const int lookup_k = ngram ? draft_budget() : 0;
  if (ngram) AddPointMassDrafts(ngram->Propose(lookup_k), greedy,
                                prefill.mutable_drafts());
  const int kept_count = prefill.token_ids_size();
  prefill.set_next_position(n);
  // Over a whole prompt, prompt lookup runs in the target itself
  // (Prefill.prompt_lookup), with this request's draft budget from now on.
  const bool target_lookup = ngram && !pruned;
  if (target_lookup && lookup_k > 0) {
    v1::PromptLookup* l = prefill.mutable_prompt_lookup();
    l->set_min_n(opts.prompt_lookup_min);
    l->set_max_n(opts.prompt_lookup_max);
    l->set_num_draft_tokens(lookup_k);
  }
  // Nothing here drafts for this request: the target decodes round after
  // round without a message from here per round.
  const bool continuous =
      !overlap && !draft_alive && (!ngram || target_lookup);
  prefill.set_continuous(continuous);
  *prefill.mutable_sampling() = opts.sampling;
  v1::StopConditions* stop = prefill.mutable_stop();
  stop->set_max_new_tokens(opts.max_new_tokens);
  stop->mutable_stop_token_ids()->Add(opts.stop_token_ids.begin(),
                                      opts.stop_token_ids.end());
  stop->set_ignore_eos(opts.ignore_eos);
  stop->set_min_new_tokens(opts.min_tokens);
  prefill.set_logprobs(opts.logprobs);
  prefill.set_top_logprobs(opts.top_logprobs);
  if (opts.prompt_logprobs >= 0) {
    prefill.set_prompt_logprobs(opts.prompt_logprobs);
  }

  // --- Target: prefill, then verify rounds.
  grpc::ClientContext tctx;
  tctx.set_deadline(absl::ToChronoTime(deadline));
  calls_->Add(&tctx);
  auto remove_tctx = absl::MakeCleanup([&] { calls_->Remove(&tctx); });
  std::unique_ptr<v1::Target::Stub> tstub =
      v1::Target::NewStub(target->channel);
  std::unique_ptr<GenerateStream> stream = tstub->Generate(&tctx);
  bool stream_finished = false;
  // Early returns end the stream too (the target frees its session).
  auto end_stream = absl::MakeCleanup([&] {
    if (stream_finished) return;
    tctx.TryCancel();
    stream->Finish();
  });
  const auto fail = [&]() -> absl::Status {
    stream_finished = true;
    const grpc::Status g = stream->Finish();
    if (calls_->cancelled()) return absl::CancelledError("cancelled");
    return TargetError(g, *target, b.target);
  };
  {
    v1::GenerateRequest greq;
    *greq.mutable_prefill() = std::move(prefill);
    if (!stream->Write(greq)) return fail();
  }
  const absl::Time prefill_sent = absl::Now();
  if (overlap) {  // the speculator's prefill while the target's runs
    if (absl::Status s = Speculate(opts, prompt, deadline, &plan); !s.ok()) {
      return s;
    }
    fallback = plan.fallback;
    set_score_stats(plan);
    draft_alive = ModelDrafts(opts) && !session_id.empty() && fallback.empty();
    set_method();
  }
  std::vector<int> unsent_emitted;  // emitted, not yet sent to the speculator
  v1::GenerateTextChunk chunk;
  v1::GenerateResponse resp;
  for (int round = 0;; ++round) {
    if (!stream->Read(&resp)) return fail();
    const absl::Time now = absl::Now();
    if (round == 0) stats.set_target_prefill_s(Seconds(now - prefill_sent));
    if (absl::Status s = output.AddRound(resp, now, &chunk); !s.ok()) return s;
    if (round == 0 && opts.prompt_logprobs >= 0) {
      if (resp.prompt_logprobs_size() != std::max(n - 1, 0)) {
        return absl::InternalError(absl::StrCat(
            "the target returned ", resp.prompt_logprobs_size(),
            " prompt logprobs for a prompt of ", n, " tokens"));
      }
      chunk.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
      *chunk.mutable_prompt_logprobs() = resp.prompt_logprobs();
    }
    if (output.finished()) break;
    sink(chunk);
    if (continuous) continue;
    // Next drafts. Prompt lookup reads the emitted tokens itself; the
    // speculator gets them in its next round (it rolls back its rejected
    // drafts and proposes more). Both learn every emitted token, also
    // those of rounds without drafts.
    v1::GenerateRequest greq;
    v1::Drafts* drafts = greq.mutable_drafts();
    const int k = draft_alive || ngram ? draft_budget() : 0;
    if (ngram) {
      ngram->Append(absl::MakeConstSpan(resp.token_ids().data(),
                                        resp.token_ids_size()));
      // No match: an empty Drafts, i.e. a plain decode round.
      AddPointMassDrafts(ngram->Propose(k), greedy, drafts->mutable_drafts());
    }
    unsent_emitted.insert(unsent_emitted.end(), resp.token_ids().begin(),
                          resp.token_ids().end());
    if (draft_alive && k > 0) {
      if (draft == nullptr) {
        draft =
            std::make_unique<DraftStream>(plan.speculator->channel, deadline);
        calls_->Add(draft->context());
      }
      const v1::DraftRequest dreq = MakeDraftRequest(
          opts, session_id, unsent_emitted, k,
          b.running_requests ? b.running_requests() : 1);
      unsent_emitted.clear();
      auto proposed = draft->Round(dreq, b.speculator_deadline);
      if (calls_->cancelled()) return absl::CancelledError("cancelled");
      absl::Status st = proposed.status();
      if (st.ok()) {
        st = ToTargetDrafts(*proposed, dreq.has_tree(), drafts);
        if (!st.ok()) {
          set_fallback(absl::StrCat("speculator_bad_response: ",
                                    st.message()));
        }
      } else {
        if (absl::IsUnavailable(st)) {
          b.speculator->ReportFailure(plan.speculator->address);
        }
        set_fallback(absl::StrCat("speculator_failed_mid_generation: ",
                                  absl::StatusCodeToString(st.code())));
      }
      // Keep generating on the target alone.
      if (!st.ok()) draft_alive = false;
    }
    if (!stream->Write(greq)) return fail();
  }
  // --- Finish: close the target stream, then the speculator session (the
  // cleanup above), then the final chunk.
  if (!output.stopped_by_string()) {  // else cancelled: the target frees it
    stream->WritesDone();
    stream->Finish();
    stream_finished = true;
  }
  std::move(end_stream).Invoke();
  std::move(release).Invoke();
  output.Finish(n, kept_count, fallback, absl::Now(), &chunk);
  sink(chunk);
  return absl::OkStatus();
}

int DraftTokensUnderLoad(int k, int running, int disable_at) {
  if (disable_at <= 0 || k <= 0) return k;
  if (running >= disable_at) return 0;
  const int half = disable_at / 2;
  if (running <= half) return k;
  // Linear from k at `half` running to 1 just below `disable_at`.
  const int span = disable_at - half;
  const int left = disable_at - running;  // in [1, span)
  return std::max(1, (k * left + span - 1) / span);
}

}  // namespace specserve
