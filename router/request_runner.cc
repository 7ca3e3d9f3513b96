#include "router/request_runner.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "common/service/grpc_util.h"
#include "common/tokenizer/tokenizer.h"
#include "protos/speculator.grpc.pb.h"
#include "protos/target.grpc.pb.h"
#include "router/metrics.h"
#include "router/prompt_limits.h"
#include "router/replica_pool.h"
#include "speculator_service/request_options.h"

namespace specserve {
namespace {

using GenerateStream =
    grpc::ClientReaderWriter<v1::GenerateRequest, v1::GenerateResponse>;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

absl::Status Bad(absl::string_view field, absl::string_view rule, double got) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be ", rule, ", got ", got));
}

// Holds one Speculator.Draft stream (callback API) so that each round can
// wait with a timeout (--speculator_deadline_ms), which a blocking stream
// cannot. Round() and Close() are called from one thread; the reactions
// run on gRPC threads. Close() must be called before destruction: it
// returns only after OnDone.
class DraftStream final
    : public grpc::ClientBidiReactor<v1::DraftRequest, v1::DraftResponse> {
 public:
  DraftStream(const std::shared_ptr<grpc::Channel>& channel,
              absl::Time deadline)
      : stub_(v1::Speculator::NewStub(channel)) {
    ctx_.set_deadline(absl::ToChronoTime(deadline));
    stub_->async()->Draft(&ctx_, this);
    // Round() starts operations from outside the reactions; without a hold
    // a cancel between rounds lets gRPC run OnDone and free the call, and
    // the next StartWrite uses it after free (UBSan, request_runner_test).
    AddHold();
    StartCall();
  }

  grpc::ClientContext* context() { return &ctx_; }

  // Sends `req` and waits up to `timeout` for its drafts.
  absl::StatusOr<std::vector<v1::DraftToken>> Round(const v1::DraftRequest& req,
                                                    absl::Duration timeout) {
    {
      absl::MutexLock lock(&mu_);
      if (broken_) return FailureLocked();
      write_pending_ = read_pending_ = true;
    }
    req_ = req;
    StartWrite(&req_);
    StartRead(&resp_);
    absl::MutexLock lock(&mu_);
    auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return broken_ || (!write_pending_ && !read_pending_);
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&settled), timeout)) {
      broken_ = timed_out_ = true;
      mu_.Unlock();
      ctx_.TryCancel();
      mu_.Lock();
      return absl::DeadlineExceededError("Draft round timed out");
    }
    if (broken_) {
      // No more operations on a broken stream: let OnDone run. The final
      // status follows the failed read/write shortly.
      mu_.Unlock();
      ReleaseHold();
      mu_.Lock();
      mu_.AwaitWithTimeout(absl::Condition(&done_), absl::Seconds(1));
      return FailureLocked();
    }
    return std::vector<v1::DraftToken>(resp_.drafts().begin(),
                                       resp_.drafts().end());
  }

  // Half-closes a healthy stream (the speculator keeps the session for
  // ReleaseSession) or cancels a broken one, and waits for the end (at most
  // `timeout`, then cancels). True if the stream ended cleanly.
  bool Close(absl::Duration timeout) {
    bool clean;
    {
      absl::MutexLock lock(&mu_);
      clean = !broken_ && !done_;
    }
    if (clean) {
      StartWritesDone();
    } else {
      ctx_.TryCancel();
    }
    ReleaseHold();
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) {
      clean = false;
      mu_.Unlock();
      ctx_.TryCancel();
      mu_.Lock();
      mu_.Await(absl::Condition(&done_));  // guaranteed after a cancel
    }
    return clean && status_.ok();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    write_pending_ = false;
    if (!ok) broken_ = true;
  }
  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    read_pending_ = false;
    if (!ok) broken_ = true;
  }
  void OnDone(const grpc::Status& s) override {
    absl::MutexLock lock(&mu_);
    status_ = s;
    done_ = true;
  }

 private:
  // Drops the constructor's hold once no operation will be started any
  // more (never with mu_ held: OnDone may run inline and takes it).
  void ReleaseHold() {
    if (hold_released_) return;
    hold_released_ = true;
    RemoveHold();
  }

  absl::Status FailureLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (timed_out_) return absl::DeadlineExceededError("Draft timed out");
    if (done_ && !status_.ok()) return FromGrpcStatus(status_);
    return absl::UnavailableError("Draft stream broke");
  }

  std::unique_ptr<v1::Speculator::Stub> stub_;
  grpc::ClientContext ctx_;
  v1::DraftRequest req_;
  v1::DraftResponse resp_;
  absl::Mutex mu_;
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool read_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  bool hold_released_ = false;  // Round/Close thread only
};

// The fallback reason for a failed speculator call: one of
// RouterMetrics::kFallbackReasons, then the status code when that says more.
std::string FallbackReason(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
      return "speculator_unavailable";
    case absl::StatusCode::kDeadlineExceeded:
      return "speculator_deadline";
    case absl::StatusCode::kResourceExhausted:
      // At its session or queue limit: load, not a fault.
      return "speculator_busy";
    default:
      return absl::StrCat("speculator_error: ",
                          absl::StatusCodeToString(s.code()));
  }
}

// How long a speculator call the request no longer waits for may live: a
// ReleaseSession, or a Score past --speculator_deadline_ms. Generous: such
// a call holds no request, and a speculator that is frozen or overloaded
// for a while (issue 17: SIGSTOP for 10 s) must still deliver its answer
// when it catches up, or the session it opens stays until its TTL.
constexpr absl::Duration kAbandonedCallDeadline = absl::Seconds(30);

// Releases speculator session `id` in the background: fire and forget, the
// call frees itself when it ends (answered, failed or past the deadline).
void ReleaseSessionAsync(std::shared_ptr<grpc::Channel> channel,
                         const std::string& id) {
  struct Call {
    std::unique_ptr<v1::Speculator::Stub> stub;
    grpc::ClientContext ctx;
    v1::ReleaseSessionRequest req;
    v1::ReleaseSessionResponse resp;
  };
  auto* call = new Call;
  call->stub = v1::Speculator::NewStub(std::move(channel));
  call->req.set_session_id(id);
  call->ctx.set_deadline(
      absl::ToChronoTime(absl::Now() + kAbandonedCallDeadline));
  call->stub->async()->ReleaseSession(&call->ctx, &call->req, &call->resp,
                                      [call](grpc::Status) { delete call; });
}

// One Speculator.Score call that the request waits for at most a timeout
// (--speculator_deadline_ms) but does not cancel when it stops waiting:
// a cancelled Score races with its answer (a speculator that was frozen
// sees the call's deadline later than the router and may answer after the
// router gave up, keeping a session nobody knows), so an abandoned call
// runs on to its answer and a session it opened is released at once. The
// state is shared with the gRPC callback, so it outlives the request.
class ScoreCall {
 public:
  // Starts `req` on `channel`; the call's own deadline is `deadline`.
  static std::shared_ptr<ScoreCall> Start(
      std::shared_ptr<grpc::Channel> channel, const v1::ScoreRequest& req,
      absl::Time deadline) {
    std::shared_ptr<ScoreCall> call(new ScoreCall(std::move(channel)));
    call->req_ = req;
    call->ctx_.set_deadline(absl::ToChronoTime(deadline));
    call->stub_->async()->Score(
        &call->ctx_, &call->req_, &call->resp_,
        [self = call](grpc::Status s) { self->OnDone(std::move(s)); });
    return call;
  }

  grpc::ClientContext* context() { return &ctx_; }

  // Waits up to `timeout` for the answer: the response, the call's error,
  // or DEADLINE_EXCEEDED (then the call is abandoned, see above).
  absl::StatusOr<v1::ScoreResponse> Wait(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) {
      abandoned_ = true;
      return absl::DeadlineExceededError(
          "Speculator.Score past --speculator_deadline_ms");
    }
    if (!status_.ok()) return FromGrpcStatus(status_);
    return resp_;
  }

 private:
  explicit ScoreCall(std::shared_ptr<grpc::Channel> channel)
      : channel_(std::move(channel)),
        stub_(v1::Speculator::NewStub(channel_)) {}

  void OnDone(grpc::Status s) {
    absl::MutexLock lock(&mu_);
    status_ = std::move(s);
    done_ = true;
    if (abandoned_ && status_.ok() && !resp_.session_id().empty()) {
      ReleaseSessionAsync(channel_, resp_.session_id());
    }
  }

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Speculator::Stub> stub_;
  grpc::ClientContext ctx_;
  v1::ScoreRequest req_;
  v1::ScoreResponse resp_;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// A target call's status as the client should see it.
absl::Status TargetError(const grpc::Status& g, const Replica& replica,
                         ReplicaPool* pool) {
  absl::Status s = FromGrpcStatus(g);
  if (absl::IsUnavailable(s)) {
    pool->ReportFailure(replica.address);
    return absl::UnavailableError(absl::StrCat(
        "target replica ", replica.address, " unavailable: ", s.message()));
  }
  if (s.ok()) {
    return absl::InternalError(absl::StrCat("target replica ", replica.address,
                                            " ended the stream early"));
  }
  return s;
}

// The prompt: text through the tokenizer (BOS prepended) or ids as given,
// checked against the target's vocabulary and context (0 = unknown).
absl::StatusOr<std::vector<int>> PromptIds(
    const v1::GenerateTextRequest& request, const Tokenizer* tokenizer,
    int max_bytes_per_token, int vocab, int max_context) {
  std::vector<int> prompt;
  if (request.has_token_ids()) {
    const auto& ids = request.token_ids().ids();
    if (ids.empty()) {
      return absl::InvalidArgumentError("token_ids.ids is empty");
    }
    for (int i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || (vocab > 0 && ids[i] >= vocab)) {
        return absl::InvalidArgumentError(
            absl::StrCat("token_ids.ids[", i, "] = ", ids[i],
                         " is outside the vocabulary [0, ", vocab, ")"));
      }
    }
    prompt.assign(ids.begin(), ids.end());
  } else if (request.has_text()) {
    if (request.text().empty()) {
      return absl::InvalidArgumentError("text is empty");
    }
    if (tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "text prompts need the router's --tokenizer; send token_ids");
    }
    // Bounded before tokenizing: the work (and memory) of tokenizing grows
    // with the text, and a text this long cannot fit anyway.
    const int64_t max_bytes = MaxPromptBytes(max_context, max_bytes_per_token);
    if (max_bytes > 0 &&
        static_cast<int64_t>(request.text().size()) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: ", request.text().size(),
          " bytes of text cannot fit the target's max context of ",
          max_context, " tokens (at most ", max_bytes,
          " bytes with this tokenizer); refused before tokenizing"));
    }
    auto ids = tokenizer->Encode(request.text(), /*add_bos=*/true);
    if (!ids.ok()) return ids.status();
    prompt = *std::move(ids);
  } else {
    return absl::InvalidArgumentError(
        "prompt is not set: set text or token_ids");
  }
  const int n = static_cast<int>(prompt.size());
  if (max_context > 0 && n >= max_context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt: ", n,
                     " tokens leave no room to generate in the target's max "
                     "context of ",
                     max_context, " tokens"));
  }
  return prompt;
}

}  // namespace

absl::StatusOr<ResolvedOptions> ResolveOptions(
    const v1::GenerateTextRequest& request, const RequestDefaults& d) {
  ResolvedOptions o;
  const v1::GenerationSampling& s = request.sampling();
  o.max_new_tokens =
      s.has_max_new_tokens() ? s.max_new_tokens() : d.max_new_tokens;
  if (o.max_new_tokens < 1) {
    return Bad("sampling.max_new_tokens", ">= 1", o.max_new_tokens);
  }
  o.sampling.set_temperature(s.has_temperature() ? s.temperature()
                                                 : d.temperature);
  o.sampling.set_top_k(s.has_top_k() ? s.top_k() : d.top_k);
  const float top_p = s.has_top_p() ? s.top_p() : d.top_p;
  if (!(top_p > 0.f && top_p <= 1.f)) {  // also rejects NaN
    return Bad("sampling.top_p", "in (0, 1]", top_p);
  }
  o.sampling.set_top_p(top_p);
  o.has_seed = s.has_seed();
  o.sampling.set_seed(s.seed());
  if (auto r = ResolveSampling(o.sampling); !r.ok()) return r.status();
  if (s.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.stop has ", s.stop_size(),
                     " strings; at most ", kMaxStopStrings, " are allowed"));
  }
  for (int i = 0; i < s.stop_size(); ++i) {
    if (s.stop(i).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.stop[", i, "] is empty"));
    }
    if (s.stop(i).size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.stop[", i, "] has ", s.stop(i).size(),
          " bytes; at most ", kMaxStopStringBytes, " are allowed"));
    }
    o.stop.push_back(s.stop(i));
  }
  if (s.stop_token_ids_size() > kMaxStopTokenIds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.stop_token_ids has ", s.stop_token_ids_size(),
        " ids; at most ", kMaxStopTokenIds, " are allowed"));
  }
  for (int i = 0; i < s.stop_token_ids_size(); ++i) {
    if (s.stop_token_ids(i) < 0) {
      return Bad(absl::StrCat("sampling.stop_token_ids[", i, "]"), ">= 0",
                 s.stop_token_ids(i));
    }
    o.stop_token_ids.push_back(s.stop_token_ids(i));
  }
  o.ignore_eos = s.ignore_eos();

  const v1::SpeculativePrefillConfig& p = request.speculative_prefill();
  o.spec_prefill = p.has_enabled() ? p.enabled() : d.spec_prefill;
  v1::SpecPrefillOptions& po = o.prefill;
  po.set_keep_ratio(p.has_keep_ratio() ? p.keep_ratio() : d.keep_ratio);
  po.set_keep_mass(p.has_keep_mass() ? p.keep_mass() : d.keep_mass);
  po.set_chunk_size(p.has_chunk_size() ? p.chunk_size() : d.chunk_size);
  po.set_pool_kernel_size(p.has_pool_kernel_size() ? p.pool_kernel_size()
                                                   : d.pool_kernel_size);
  po.set_look_ahead(p.has_look_ahead() ? p.look_ahead() : d.look_ahead);
  po.set_keep_first(p.has_keep_first() ? p.keep_first() : d.keep_first);
  po.set_keep_last(p.has_keep_last() ? p.keep_last() : d.keep_last);
  po.set_min_prompt_tokens(p.has_min_prompt_tokens() ? p.min_prompt_tokens()
                                                     : d.min_prompt_tokens);
  // The speculator's own edge check, with this API's field names; the
  // layer count is the speculator's business (num_layers_used stays 0).
  if (auto r = ResolveScoreOptions(po, ScoreDefaults{}, 1 << 20,
                                   "speculative_prefill.");
      !r.ok()) {
    return r.status();
  }

  const v1::SpeculativeDecodingConfig& sd = request.speculative_decoding();
  o.spec_decode = sd.has_enabled() ? sd.enabled() : d.spec_decode;
  o.num_draft_tokens =
      sd.has_num_draft_tokens() ? sd.num_draft_tokens() : d.num_draft_tokens;
  if (auto st = ValidateNumDraftTokens(o.num_draft_tokens,
                                       "speculative_decoding.num_draft_tokens");
      !st.ok()) {
    return st;
  }
  return o;
}

absl::Status ValidateDefaults(const RequestDefaults& defaults) {
  auto r = ResolveOptions(v1::GenerateTextRequest(), defaults);
  if (r.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("bad --default_* flag: ", r.status().message()));
}

StopStringFilter::StopStringFilter(std::vector<std::string> stops) {
  for (auto& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

std::string StopStringFilter::Append(absl::string_view text) {
  if (matched_) return "";
  held_.append(text.data(), text.size());
  // Text before held_ never hides a match start (it would have been held),
  // so the earliest match in held_ is the first one in the whole output.
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold the longest suffix that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, held_.size()); k > hold; --k) {
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopStringFilter::Flush() {
  std::string out;
  out.swap(held_);
  return out;
}

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
  req.set_keep_session(opts.spec_decode);
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
  if (opts.spec_decode) {
    const bool greedy = opts.sampling.temperature() == 0.f;
    for (int id : resp.look_ahead_token_ids()) {
      v1::DraftToken* d = plan->prefill.add_drafts();
      d->set_id(id);
      // Greedy look-ahead is deterministic: q is a point mass, which keeps
      // rejection sampling lossless for sampled requests.
      if (!greedy) {
        v1::TokenProb* q = d->add_q();
        q->set_id(id);
        q->set_prob(1.f);
      }
    }
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
  const bool use_speculator = b.speculator != nullptr &&
                              !b.speculator->empty() &&
                              (opts.spec_prefill || opts.spec_decode);
  if (b.speculator != nullptr) {
    if (absl::Status s = b.speculator->compatibility(); !s.ok()) return s;
  }
  auto target = b.target->Pick();
  if (!target.ok()) return target.status();
  const std::optional<v1::ModelInfo> info = b.target->model_info();
  const int vocab =
      info ? info->vocab_size() : (b.tokenizer ? b.tokenizer->vocab_size() : 0);
  auto prompt_or =
      PromptIds(request, b.tokenizer, b.max_bytes_per_token, vocab,
                info ? info->max_context() : 0);
  if (!prompt_or.ok()) return prompt_or.status();
  const std::vector<int>& prompt = *prompt_or;
  const int n = static_cast<int>(prompt.size());
  for (size_t i = 0; i < opts.stop_token_ids.size(); ++i) {
    if (vocab > 0 && opts.stop_token_ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.stop_token_ids[", i, "] = ", opts.stop_token_ids[i],
          " is outside the vocabulary [0, ", vocab, ")"));
    }
  }

  // --- Speculator: Score (prefill + look-ahead + selection).
  Plan plan;
  if (use_speculator) {
    if (absl::Status s = Speculate(opts, prompt, deadline, &plan); !s.ok()) {
      return s;
    }
  }
  std::string fallback = plan.fallback;
  const auto set_fallback = [&](std::string reason) {
    if (fallback.empty()) fallback = std::move(reason);
  };
  v1::GenerationStats stats;
  stats.set_speculate_s(plan.speculate_s);
  v1::Prefill& prefill = plan.prefill;
  const std::string& session_id = plan.session_id;
  // Cleanup of the speculator session on every path out of here.
  std::unique_ptr<DraftStream> draft;
  bool draft_alive =
      opts.spec_decode && !session_id.empty() && fallback.empty();
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
  if (prefill.token_ids().empty()) {  // no pruning
    prefill.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    for (int i = 0; i < n; ++i) prefill.add_position_ids(i);
  }
  if (!draft_alive) prefill.clear_drafts();
  const int kept_count = prefill.token_ids_size();
  prefill.set_next_position(n);
  *prefill.mutable_sampling() = opts.sampling;
  v1::StopConditions* stop = prefill.mutable_stop();
  stop->set_max_new_tokens(opts.max_new_tokens);
  stop->mutable_stop_token_ids()->Add(opts.stop_token_ids.begin(),
                                      opts.stop_token_ids.end());
  stop->set_ignore_eos(opts.ignore_eos);

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
  std::optional<IncrementalDecoder> decoder;
  if (b.tokenizer != nullptr) decoder.emplace(b.tokenizer);
  StopStringFilter stops(opts.stop);
  int completion = 0;
  int64_t accepted_total = 0;
  std::vector<int> per_pos;
  std::vector<int> unsent_emitted;  // emitted, not yet sent to the speculator
  std::string finish;
  v1::GenerateTextChunk chunk;
  v1::GenerateResponse resp;
  for (int round = 0;; ++round) {
    if (!stream->Read(&resp)) return fail();
    const absl::Time now = absl::Now();
    if (round == 0) stats.set_target_prefill_s(Seconds(now - prefill_sent));
    if (resp.num_drafts() > 0) {
      stats.set_num_drafts(stats.num_drafts() + 1);
      stats.set_num_draft_tokens(stats.num_draft_tokens() + resp.num_drafts());
      accepted_total += resp.num_accepted();
      if (static_cast<int>(per_pos.size()) < resp.num_drafts()) {
        per_pos.resize(resp.num_drafts());
      }
      for (int i = 0; i < resp.num_accepted(); ++i) ++per_pos[i];
      if (b.metrics != nullptr) {
        b.metrics->ObserveVerifyRound(resp.num_drafts(), resp.num_accepted());
      }
    }
    if (completion == 0 && resp.token_ids_size() > 0) {
      stats.set_ttft_s(Seconds(now - start));
    }
    chunk.Clear();
    for (int id : resp.token_ids()) {
      chunk.add_token_ids(id);
      ++completion;
      if (!decoder) continue;
      auto delta = decoder->Append(id);
      if (!delta.ok()) return delta.status();
      chunk.mutable_text()->append(stops.Append(*delta));
      if (stops.matched()) {
        finish = "stop";
        break;
      }
    }
    if (finish.empty() && !resp.finish_reason().empty()) {
      finish = resp.finish_reason();
    }
    if (!finish.empty()) break;
    sink(chunk);
    // Next drafts: what the target emitted goes to the speculator, which
    // rolls back its rejected drafts and proposes k more.
    v1::GenerateRequest greq;
    v1::Drafts* drafts = greq.mutable_drafts();
    // Under load, verify rows cost real compute: fewer or no drafts.
    int k = opts.num_draft_tokens;
    if (draft_alive) {
      const int running = b.running_requests ? b.running_requests() : 0;
      k = DraftTokensUnderLoad(k, running,
                               b.spec_decode_disable_by_batch_size);
      if (k == 0) {
        stats.set_num_rounds_drafting_disabled(
            stats.num_rounds_drafting_disabled() + 1);
      } else if (k < opts.num_draft_tokens) {
        stats.set_num_rounds_drafts_reduced(
            stats.num_rounds_drafts_reduced() + 1);
      }
      if (b.metrics != nullptr && k < opts.num_draft_tokens) {
        b.metrics->CountLoadLimitedRound(k == 0);
      }
    }
    // The speculator learns every emitted token, also those of rounds it
    // sat out.
    unsent_emitted.insert(unsent_emitted.end(), resp.token_ids().begin(),
                          resp.token_ids().end());
    if (draft_alive && k > 0) {
      if (draft == nullptr) {
        draft =
            std::make_unique<DraftStream>(plan.speculator->channel, deadline);
        calls_->Add(draft->context());
      }
      v1::DraftRequest dreq;
      dreq.set_session_id(session_id);
      dreq.mutable_emitted_token_ids()->Add(unsent_emitted.begin(),
                                            unsent_emitted.end());
      unsent_emitted.clear();
      dreq.set_num_draft_tokens(k);
      auto proposed = draft->Round(dreq, b.speculator_deadline);
      if (calls_->cancelled()) return absl::CancelledError("cancelled");
      if (proposed.ok()) {
        drafts->mutable_drafts()->Add(proposed->begin(), proposed->end());
      } else {
        // Keep generating on the target alone.
        draft_alive = false;
        if (absl::IsUnavailable(proposed.status())) {
          b.speculator->ReportFailure(plan.speculator->address);
        }
        set_fallback(
            absl::StrCat("speculator_failed_mid_generation: ",
                         absl::StatusCodeToString(proposed.status().code())));
      }
    }
    if (!stream->Write(greq)) return fail();
  }
  // --- Finish: close the target stream, then the speculator session (the
  // cleanup above), then the final chunk.
  if (finish != "stop") {  // "stop": cancelled, the target frees its session
    stream->WritesDone();
    stream->Finish();
    stream_finished = true;
  }
  std::move(end_stream).Invoke();
  std::move(release).Invoke();
  if (decoder && !stops.matched()) {
    chunk.mutable_text()->append(stops.Append(decoder->Flush()));
    if (stops.matched()) {
      finish = "stop";
    } else {
      chunk.mutable_text()->append(stops.Flush());
    }
  }
  const absl::Time end = absl::Now();
  if (completion == 0) stats.set_ttft_s(Seconds(end - start));
  stats.set_keep_ratio(static_cast<float>(kept_count) / n);
  stats.set_total_s(Seconds(end - start));
  stats.set_num_accepted_tokens(static_cast<int>(accepted_total));
  stats.set_mean_acceptance_length(
      stats.num_drafts() > 0
          ? 1.0 + static_cast<double>(accepted_total) / stats.num_drafts()
          : 0.0);
  stats.mutable_accepted_per_position()->Add(per_pos.begin(), per_pos.end());
  stats.set_fallback_reason(fallback);
  if (!fallback.empty() && b.metrics != nullptr) {
    b.metrics->CountFallback(fallback);
  }
  chunk.set_finish_reason(finish);
  chunk.mutable_usage()->set_prompt_tokens(n);
  chunk.mutable_usage()->set_kept_prompt_tokens(kept_count);
  chunk.mutable_usage()->set_completion_tokens(completion);
  *chunk.mutable_stats() = stats;
  if (b.metrics != nullptr) {
    const double e2e = stats.total_s();
    b.metrics->ObserveCompletion(
        stats.ttft_s(),
        completion > 1 ? (e2e - stats.ttft_s()) / (completion - 1) : -1.0, e2e,
        n, kept_count, completion);
  }
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

ReplicaPool::InfoFn SpeculatorInfoFn() {
  return [](const std::shared_ptr<grpc::Channel>& channel, absl::Time deadline,
            v1::ModelInfo* info) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    return v1::Speculator::NewStub(channel)->Info(&ctx, v1::InfoRequest(),
                                                  info);
  };
}

ReplicaPool::InfoFn TargetInfoFn() {
  return [](const std::shared_ptr<grpc::Channel>& channel, absl::Time deadline,
            v1::ModelInfo* info) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    return v1::Target::NewStub(channel)->Info(&ctx, v1::InfoRequest(), info);
  };
}

void AppendChunk(const v1::GenerateTextChunk& chunk,
                 v1::GenerateTextResponse* response) {
  response->mutable_text()->append(chunk.text());
  response->mutable_token_ids()->Add(chunk.token_ids().begin(),
                                     chunk.token_ids().end());
  if (!chunk.finish_reason().empty()) {
    response->set_finish_reason(chunk.finish_reason());
    *response->mutable_usage() = chunk.usage();
    *response->mutable_stats() = chunk.stats();
  }
}

}  // namespace specserve
