#include "speculator_service/speculator_server.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/engine/model_runner.h"
#include "common/model/weights.h"
#include "common/scheduling/batch_scheduler.h"
#include "common/service/grpc_util.h"
#include "common/speculation/draft_session.h"
#include "common/tokenizer/tokenizer.h"
#include "protos/speculator.grpc.pb.h"
#include "common/scheduling/session_work.h"
#include "common/util/clock.h"
#include "speculator_service/metrics.h"

namespace specserve {
namespace {

absl::Span<const int> Ids(const google::protobuf::RepeatedField<int32_t>& r) {
  return absl::MakeConstSpan(r.data(), r.size());
}

std::string Basename(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

/// The CallbackService; owned by SpeculatorServer, which outlives every
/// call (Shutdown waits for them).
class SpeculatorServiceImpl final : public v1::Speculator::CallbackService {
 public:
  SpeculatorServiceImpl(const SpeculatorServerOptions& options,
                        ModelRunner* model, const v1::ModelInfo* info,
                        SessionManager* sessions, BatchScheduler* scheduler,
                        SpeculatorMetrics* metrics,
                        LazyJsonTokenMask* json_mask)
      : options_(options),
        model_(model),
        json_mask_(json_mask),
        info_(info),
        sessions_(sessions),
        scheduler_(scheduler),
        metrics_(metrics) {}

  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx,
                                  const v1::ScoreRequest* req,
                                  v1::ScoreResponse* resp) override;
  grpc::ServerBidiReactor<v1::DraftRequest, v1::DraftResponse>* Draft(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ReleaseSession(
      grpc::CallbackServerContext* ctx, const v1::ReleaseSessionRequest* req,
      v1::ReleaseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx,
                                 const v1::InfoRequest* req,
                                 v1::ModelInfo* resp) override;

  /// Queues `work` on the model's scheduler: RESOURCE_EXHAUSTED when
  /// max_queue operations are already queued or running, UNAVAILABLE once
  /// shutting down (then `work` is dropped unfinished).
  absl::Status Submit(std::unique_ptr<BatchedWork> work) {
    return scheduler_->Submit(std::move(work));
  }
  /// Counts the call and finishes it.
  void Finish(grpc::ServerUnaryReactor* reactor, const char* method,
              const absl::Status& s) {
    metrics_->CountRequest(method, absl::StatusCodeToString(s.code()));
    reactor->Finish(ToGrpcStatus(s));
  }
  /// Finish for the early-return paths of a unary handler.
  grpc::ServerUnaryReactor* Reply(grpc::ServerUnaryReactor* reactor,
                                  const char* method, const absl::Status& s) {
    Finish(reactor, method, s);
    return reactor;
  }

  const SpeculatorServerOptions& options_;
  ModelRunner* model_;
  LazyJsonTokenMask* json_mask_;
  const v1::ModelInfo* info_;
  SessionManager* sessions_;
  BatchScheduler* scheduler_;
  SpeculatorMetrics* metrics_;
};

grpc::ServerUnaryReactor* SpeculatorServiceImpl::Score(
    grpc::CallbackServerContext* ctx, const v1::ScoreRequest* req,
    v1::ScoreResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const int64_t t0 = MonotonicNowNs();
  const ModelConfig& config = model_->config();
  // Validate everything cheap here, once, before any work is queued.
  auto opts = ResolveScoreOptions(req->options(), options_.defaults,
                                  config.num_hidden_layers, "options.");
  if (!opts.ok()) return Reply(reactor, "Score", opts.status());
  opts->num_threads = options_.engine_threads;
  if (absl::Status s = ValidatePrompt(Ids(req->token_ids()), opts->look_ahead,
                                      config, "token_ids");
      !s.ok()) {
    return Reply(reactor, "Score", s);
  }
  auto sampling = ResolveSampling(req->sampling());
  if (!sampling.ok()) return Reply(reactor, "Score", sampling.status());

  // A kept session may draft up to the model's context (or as far as the
  // whole KV pool reaches); a throwaway one needs only prompt + look-ahead.
  // Blocks are taken as the session grows, not reserved.
  const int n = req->token_ids_size();
  const PagedKvCache& kv = model_->kv_cache();
  const int pool_tokens = kv.num_blocks() * kv.block_size();
  const int capacity =
      req->keep_session()
          ? std::min(config.max_position_embeddings, pool_tokens)
          : n + opts->look_ahead;
  if (n + opts->look_ahead > pool_tokens) {
    return Reply(reactor, "Score",
                 absl::ResourceExhaustedError(absl::StrCat(
                     "prompt of ", n, " tokens + look_ahead ",
                     opts->look_ahead, " exceed the KV pool of ", pool_tokens,
                     " tokens (kv_budget_bytes)")));
  }
  auto created = DraftSession::Create(
      model_, capacity, *sampling,
      sampling->json_object ? json_mask_->Get() : nullptr);
  if (!created.ok()) return Reply(reactor, "Score", created.status());
  // Admission (max_sessions) happens before queueing the work.
  auto lease = std::make_shared<SessionManager::Lease>();
  std::shared_ptr<DraftSession> owned;
  if (req->keep_session()) {
    auto added = sessions_->Add(*std::move(created));
    if (!added.ok()) return Reply(reactor, "Score", added.status());
    *lease = *std::move(added);
  } else {
    owned = *std::move(created);
  }
  DraftSession* session = owned ? owned.get() : lease->session();
  auto begin = [ctx, req, session, score_opts = *opts]() -> absl::Status {
    if (ctx->IsCancelled()) {
      return absl::CancelledError("client went away before scoring");
    }
    return session->BeginScore(Ids(req->token_ids()), score_opts);
  };
  auto finish = [this, ctx, req, resp, reactor, t0, lease, owned,
                 session](absl::Status status) {
    absl::StatusOr<ScoreResult> r =
        status.ok() ? session->TakeScoreResult()
                    : absl::StatusOr<ScoreResult>(status);
    // A client that gave up (deadline, cancel) while the work ran never
    // learns the session id, so nobody would release the session before
    // its TTL: free it now.
    if (r.ok() && ctx->IsCancelled()) {
      r = absl::CancelledError("client went away while scoring");
    }
    if (!r.ok()) {
      if (*lease) sessions_->Release(lease->id());
      lease->Reset();
      return Finish(reactor, "Score", r.status());
    }
    const Selection& sel = r->selection;
    resp->mutable_kept_indices()->Add(sel.kept_indices.begin(),
                                      sel.kept_indices.end());
    resp->mutable_position_ids()->Add(sel.position_ids.begin(),
                                      sel.position_ids.end());
    resp->set_next_position(sel.next_position);
    resp->mutable_look_ahead_token_ids()->Add(r->look_ahead_tokens.begin(),
                                              r->look_ahead_tokens.end());
    if (req->return_importance()) {
      resp->mutable_importance()->Add(r->importance.begin(),
                                      r->importance.end());
    }
    resp->set_prompt_tokens(req->token_ids_size());
    resp->set_kept_tokens(static_cast<int>(sel.kept_indices.size()));
    if (*lease) resp->set_session_id(lease->id());
    lease->Reset();  // the session's idle timer starts now
    const int64_t total = MonotonicNowNs() - t0;
    v1::ScoreTimings* t = resp->mutable_timings();
    t->set_prefill_ns(r->prefill_ns);
    t->set_look_ahead_ns(r->look_ahead_ns);
    t->set_score_ns(r->score_ns);
    t->set_total_ns(total);
    metrics_->ObserveScore(resp->prompt_tokens(), resp->kept_tokens(),
                           r->prefill_ns, r->look_ahead_ns, r->score_ns, total);
    Finish(reactor, "Score", absl::OkStatus());
  };
  if (absl::Status s = Submit(std::make_unique<SessionWork>(
          session, std::move(begin), std::move(finish)));
      !s.ok()) {
    if (*lease) sessions_->Release(lease->id());
    lease->Reset();
    Finish(reactor, "Score", s);
  }
  return reactor;
}

namespace {

/// One Draft stream. Exactly one of {a read outstanding, a draft task
/// queued or running, a write outstanding} holds at any time until Finish,
/// so the reactions form one sequential chain; cancellation makes the
/// outstanding read or write fail (or the task notices), which ends the
/// chain. OnCancel itself only flags and frees the session.
class DraftReactor final
    : public grpc::ServerBidiReactor<v1::DraftRequest, v1::DraftResponse> {
 public:
  explicit DraftReactor(SpeculatorServiceImpl* impl) : impl_(impl) {
    StartRead(&req_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // client half-close (the session stays) or cancellation
      return FinishOnce(IsCancelled()
                            ? absl::CancelledError("Draft stream cancelled")
                            : absl::OkStatus());
    }
    absl::Status s = Bind();
    const bool tree = req_.has_tree();
    DraftTreeShape shape;
    if (tree) {
      shape.branching.assign(req_.tree().branching().begin(),
                             req_.tree().branching().end());
      shape.max_nodes = req_.tree().max_nodes();
      shape.min_path_prob = req_.tree().min_path_prob();
    }
    if (s.ok()) {
      s = tree ? ValidateDraftTreeShape(shape)
               : ValidateNumDraftTokens(req_.num_draft_tokens(),
                                        "num_draft_tokens");
    }
    if (!s.ok()) return FinishOnce(s);
    if (IsCancelled()) {
      return FinishOnce(absl::CancelledError("Draft stream cancelled"));
    }
    DraftSession* session = lease_.session();
    t0_ = MonotonicNowNs();
    auto begin = [this, session, tree, shape = std::move(shape)] {
      if (tree) {
        return session->BeginDraftTree(Ids(req_.emitted_token_ids()), shape);
      }
      return session->BeginDraft(Ids(req_.emitted_token_ids()),
                                 req_.num_draft_tokens());
    };
    auto finish = [this, session](absl::Status s) {
      if (!s.ok()) return FinishOnce(s);
      std::vector<int> parents;
      std::vector<DraftToken> drafts = session->TakeDrafts(&parents);
      OnDrafts(std::move(drafts), std::move(parents));
    };
    if (absl::Status s = impl_->Submit(std::make_unique<SessionWork>(
            session, std::move(begin), std::move(finish)));
        !s.ok()) {
      FinishOnce(s);
    }
  }

  void OnWriteDone(bool ok) override {
    if (!ok || IsCancelled()) {
      return FinishOnce(absl::CancelledError("Draft stream cancelled"));
    }
    StartRead(&req_);
  }

  void OnCancel() override {
    std::string id;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      id = session_id_;
    }
    // "A cancelled stream frees the session": unlisted now, memory freed
    // when the chain ends (FinishOnce).
    if (!id.empty()) impl_->sessions_->Release(id);
  }

  void OnDone() override { delete this; }

 private:
  bool IsCancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  // Binds the stream to its session on the first message; later messages
  // may repeat the id but not change it.
  absl::Status Bind() {
    const std::string& id = req_.session_id();
    if (lease_) {
      if (!id.empty() && id != lease_.id()) {
        return absl::InvalidArgumentError(
            absl::StrCat("session_id ", id,
                         " differs from the stream's session ", lease_.id()));
      }
      return absl::OkStatus();
    }
    if (id.empty()) {
      return absl::InvalidArgumentError(
          "session_id is required on the first Draft message");
    }
    auto lease = impl_->sessions_->Acquire(id);
    if (!lease.ok()) return lease.status();
    lease_ = *std::move(lease);
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      session_id_ = id;
      cancelled = cancelled_;
    }
    if (cancelled) impl_->sessions_->Release(id);  // OnCancel missed it
    return absl::OkStatus();
  }

  // On the scheduler's thread when the Draft operation is done.
  void OnDrafts(std::vector<DraftToken> drafts_vec,
                std::vector<int> parents) {
    const std::vector<DraftToken>* drafts = &drafts_vec;
    const int64_t ns = MonotonicNowNs() - t0_;
    impl_->metrics_->ObserveDraft(static_cast<int>(drafts->size()), ns);
    if (IsCancelled()) {
      return FinishOnce(absl::CancelledError("Draft stream cancelled"));
    }
    resp_.Clear();
    for (const DraftToken& d : *drafts) {
      v1::DraftToken* out = resp_.add_drafts();
      out->set_id(d.id);
      for (const auto& [id, p] : d.q) {
        v1::TokenProb* tp = out->add_q();
        tp->set_id(id);
        tp->set_prob(p);
      }
    }
    resp_.mutable_parents()->Add(parents.begin(), parents.end());
    resp_.set_draft_ns(ns);
    StartWrite(&resp_);
  }

  // Ends the stream (called only by the sequential chain); an error status
  // frees the session this stream holds.
  void FinishOnce(const absl::Status& s) {
    std::string id;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
      id = session_id_;
    }
    if (!s.ok() && !id.empty()) impl_->sessions_->Release(id);
    // Return the session before the client can see the status, so a new
    // stream opened right after this one ends finds it free. Safe: Finish is
    // the chain's last step, nothing else uses the session now.
    lease_.Reset();
    impl_->metrics_->CountRequest("Draft", absl::StatusCodeToString(s.code()));
    Finish(ToGrpcStatus(s));
  }

  SpeculatorServiceImpl* impl_;
  v1::DraftRequest req_;
  v1::DraftResponse resp_;
  SessionManager::Lease lease_;  // touched only by the sequential chain
  int64_t t0_ = 0;               // when the current Draft was queued
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::string session_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerBidiReactor<v1::DraftRequest, v1::DraftResponse>*
SpeculatorServiceImpl::Draft(grpc::CallbackServerContext* /*ctx*/) {
  return new DraftReactor(this);
}

grpc::ServerUnaryReactor* SpeculatorServiceImpl::ReleaseSession(
    grpc::CallbackServerContext* ctx, const v1::ReleaseSessionRequest* req,
    v1::ReleaseSessionResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (req->session_id().empty()) {
    Finish(reactor, "ReleaseSession",
           absl::InvalidArgumentError("session_id is empty"));
    return reactor;
  }
  // Idempotent: an unknown or expired id is not an error.
  resp->set_released(sessions_->Release(req->session_id()));
  Finish(reactor, "ReleaseSession", absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* SpeculatorServiceImpl::Info(
    grpc::CallbackServerContext* ctx, const v1::InfoRequest* /*req*/,
    v1::ModelInfo* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  *resp = *info_;
  Finish(reactor, "Info", absl::OkStatus());
  return reactor;
}

SpeculatorServer::SpeculatorServer(const SpeculatorServerOptions& options)
    : options_(options),
      registry_(std::make_shared<prometheus::Registry>()),
      metrics_(std::make_unique<SpeculatorMetrics>(*registry_)) {}

int AutoMaxSessions(int kv_blocks) {
  return std::clamp(kv_blocks, 64, 4096);
}

absl::StatusOr<std::unique_ptr<SpeculatorServer>> SpeculatorServer::Create(
    const SpeculatorServerOptions& options) {
  const auto bad = [](const std::string& m) {
    return absl::InvalidArgumentError(m);
  };
  if (options.model_dir.empty()) return bad("model_dir is empty");
  if (options.max_num_batched_tokens < 0) {
    return bad("max_num_batched_tokens must be >= 0");
  }
  if (options.max_queue < 1) return bad("max_queue must be >= 1");
  if (options.max_sessions < 0) return bad("max_sessions must be >= 0");
  if (!(options.session_ttl_s > 0)) return bad("session_ttl_s must be > 0");
  // The defaults must be valid themselves.
  auto probe = ResolveScoreOptions({}, options.defaults, 1 << 20, "default_");
  if (!probe.ok()) return probe.status();

  std::unique_ptr<SpeculatorServer> s(new SpeculatorServer(options));
  RunnerOptions ro = options.runner;
  ro.kv_cache.pool_bytes = options.kv_budget_bytes;
  ro.kv_pool_from_device = options.kv_budget_bytes == 0;
  ro.max_num_batched_tokens = options.max_num_batched_tokens;
  auto runner = LoadModelRunner(options.model_dir, ro);
  if (!runner.ok()) return runner.status();
  s->model_ = *std::move(runner);
  auto tok = LoadTokenizer(options.model_dir);
  if (tok.ok()) {
    s->tokenizer_ = *std::move(tok);
  } else if (!absl::IsNotFound(tok.status())) {
    return tok.status();
  } else {
    std::fprintf(stderr, "warning: %s; Info reports no tokenizer\n",
                 tok.status().ToString().c_str());
  }
  const std::string id =
      options.model_id.empty() ? Basename(options.model_dir) : options.model_id;
  s->info_ = MakeModelInfo(id, s->model_->config(), s->tokenizer_.get());
  s->json_mask_ = std::make_unique<LazyJsonTokenMask>(
      s->tokenizer_.get(), s->model_->config().eos_token_ids);

  SessionManagerOptions so;
  so.max_sessions = options.max_sessions > 0
                        ? options.max_sessions
                        : AutoMaxSessions(s->model_->kv_cache().num_blocks());
  s->options_.max_sessions = so.max_sessions;
  so.ttl = absl::Seconds(options.session_ttl_s);
  SpeculatorMetrics* metrics = s->metrics_.get();
  PagedKvCache* kv = &s->model_->kv_cache();
  SpeculatorServer* server = s.get();
  s->sessions_ = std::make_unique<SessionManager>(
      so, options.clock, [server, metrics, kv] {
        metrics->SetSessions(server->sessions_->num_sessions());
        metrics->SetKv(*kv);
      });
  BatchScheduler::Options bo;
  bo.max_works = options.max_queue;
  bo.max_num_batched_tokens = DefaultMaxNumBatchedTokens(
      *s->model_, options.max_num_batched_tokens);
  auto scheduler = BatchScheduler::Create(
      s->model_.get(), bo, [metrics, kv](const BatchScheduler::StepStats& st) {
        metrics->ObserveStep(st.sequences, st.rows, st.waiting, st.preempted,
                             kv->prefix_cache_queries(),
                             kv->prefix_cache_hits());
        metrics->SetKv(*kv);
      });
  if (!scheduler.ok()) return scheduler.status();
  s->scheduler_ = *std::move(scheduler);
  s->service_ = std::make_unique<SpeculatorServiceImpl>(
      s->options_, s->model_.get(), &s->info_, s->sessions_.get(),
      s->scheduler_.get(), s->metrics_.get(), s->json_mask_.get());
  return s;
}

SpeculatorServer::~SpeculatorServer() { Shutdown(); }

absl::Status SpeculatorServer::Start(int port) {
  if (server_ != nullptr) return absl::FailedPreconditionError("started");
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartGrpcServer(
      options_.host, port, options_.credentials, service_.get(), &port_);
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  sweeper_ = std::thread([this] { SweepLoop(); });
  return absl::OkStatus();
}

void SpeculatorServer::SweepLoop() {
  // Lazy reaping covers correctness; the sweep returns idle memory.
  const absl::Duration period =
      std::min(absl::Seconds(options_.session_ttl_s) / 2, absl::Seconds(10));
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), period)) {
    mu_.Unlock();
    sessions_->Sweep();
    mu_.Lock();
  }
}

void SpeculatorServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  }
}

}  // namespace specserve
