#include "router/router_server.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/service/executor.h"
#include "common/service/grpc_util.h"
#include "common/tokenizer/tokenizer.h"
#include "grpcpp/health_check_service_interface.h"
#include "protos/router.grpc.pb.h"
#include "router/api_key.h"
#include "router/metrics.h"
#include "router/prompt_limits.h"
#include "router/output_processor.h"
#include "router/speculator_client.h"
#include "router/target_client.h"

namespace specserve {
namespace {

// The API key from the call's "authorization" metadata, checked as HTTP
// checks its header (router/api_key.h); OK when no key is configured.
grpc::Status Authorize(const grpc::CallbackServerContext* ctx,
                       const std::string& key) {
  if (key.empty()) return grpc::Status::OK;
  const auto& md = ctx->client_metadata();
  const auto it = md.find("authorization");
  const absl::string_view got =
      it == md.end() ? absl::string_view()
                     : absl::string_view(it->second.data(), it->second.size());
  return ToGrpcStatus(
      CheckApiKey(got, key, "the metadata 'authorization"));
}

grpc::Status Exhausted(int limit) {
  return grpc::Status(
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      absl::StrCat("router at capacity: ", limit,
                   " requests in flight (--max_concurrent_requests)"));
}

}  // namespace

class RouterServer::Service final : public v1::Router::CallbackService {
 public:
  explicit Service(RouterServer* server) : server_(server) {}

  // Shared by both reactors: the request's clock and deadline, and the
  // two-owner lifetime (gRPC's OnDone and the worker each drop one ref, so
  // neither can delete the reactor under the other).
  struct CallState {
    CallState(RouterServer* server, grpc::CallbackServerContext* ctx)
        : server(server), runner(&server->backends_), start(absl::Now()) {
      const auto dl = ctx->deadline();
      // gRPC reports "no deadline" as the far future.
      deadline = dl > std::chrono::system_clock::now() +
                             std::chrono::hours(24 * 365 * 10)
                     ? start + server->options_.request_deadline
                     : absl::FromChrono(dl);
    }
    RouterServer* server;
    RequestRunner runner;
    absl::Time start;
    absl::Time deadline;
    std::atomic<int> refs{2};
  };

  class UnaryReactor final : public grpc::ServerUnaryReactor {
   public:
    UnaryReactor(RouterServer* server, grpc::CallbackServerContext* ctx,
                 const v1::GenerateTextRequest* req,
                 v1::GenerateTextResponse* resp)
        : call_(server, ctx), req_(req), resp_(resp) {
      if (grpc::Status a = Authorize(ctx, server->options_.api_key); !a.ok()) {
        Finish(a);
        Unref();  // no worker
        return;
      }
      if (!server->Admit()) {
        Finish(Exhausted(server->options_.max_concurrent_requests));
        Unref();  // no worker
        return;
      }
      server->executor_->Submit([this] { Work(); });
    }
    void OnCancel() override { call_.runner.Cancel(); }
    void OnDone() override { Unref(); }

   private:
    void Work() {
      const absl::Status s = call_.runner.Run(
          *req_, call_.start, call_.deadline,
          [this](const v1::GenerateTextChunk& c) { AppendChunk(c, resp_); });
      call_.server->Done(s);
      Finish(ToGrpcStatus(s));
      Unref();
    }
    void Unref() {
      if (call_.refs.fetch_sub(1) == 1) delete this;
    }
    CallState call_;
    const v1::GenerateTextRequest* req_;
    v1::GenerateTextResponse* resp_;
  };

  // Chunks reach the client through a queue with one write outstanding at a
  // time; the worker never waits for the client.
  class StreamReactor final
      : public grpc::ServerWriteReactor<v1::GenerateTextChunk> {
   public:
    StreamReactor(RouterServer* server, grpc::CallbackServerContext* ctx,
                  const v1::GenerateTextRequest* req)
        : call_(server, ctx), req_(req) {
      if (grpc::Status a = Authorize(ctx, server->options_.api_key); !a.ok()) {
        Finish(a);
        Unref();
        return;
      }
      if (!server->Admit()) {
        Finish(Exhausted(server->options_.max_concurrent_requests));
        Unref();
        return;
      }
      server->executor_->Submit([this] { Work(); });
    }
    void OnWriteDone(bool ok) override {
      const v1::GenerateTextChunk* next = nullptr;
      bool finish = false;
      grpc::Status status;
      {
        absl::MutexLock lock(&mu_);
        queue_.pop_front();
        if (!ok) {
          broken_ = true;
          queue_.clear();
        }
        if (!queue_.empty()) {
          next = &queue_.front();
        } else {
          writing_ = false;
          finish = complete_;
          status = status_;
        }
      }
      if (!ok) call_.runner.Cancel();  // the client is gone
      if (next != nullptr) {
        StartWrite(next);
      } else if (finish) {
        Finish(status);
      }
    }
    void OnCancel() override { call_.runner.Cancel(); }
    void OnDone() override { Unref(); }

   private:
    void Work() {
      const absl::Status s =
          call_.runner.Run(*req_, call_.start, call_.deadline,
                           [this](const v1::GenerateTextChunk& c) { Push(c); });
      call_.server->Done(s);
      bool finish;
      {
        absl::MutexLock lock(&mu_);
        complete_ = true;
        status_ = ToGrpcStatus(s);
        finish = !writing_;
      }
      if (finish) Finish(ToGrpcStatus(s));
      Unref();
    }
    void Push(const v1::GenerateTextChunk& chunk) {
      const v1::GenerateTextChunk* next = nullptr;
      {
        absl::MutexLock lock(&mu_);
        if (broken_) return;
        queue_.push_back(chunk);  // deque: references stay valid
        if (writing_) return;
        writing_ = true;
        next = &queue_.front();
      }
      StartWrite(next);
    }
    void Unref() {
      if (call_.refs.fetch_sub(1) == 1) delete this;
    }
    CallState call_;
    const v1::GenerateTextRequest* req_;
    absl::Mutex mu_;
    std::deque<v1::GenerateTextChunk> queue_ ABSL_GUARDED_BY(mu_);
    bool writing_ ABSL_GUARDED_BY(mu_) = false;
    bool broken_ ABSL_GUARDED_BY(mu_) = false;
    bool complete_ ABSL_GUARDED_BY(mu_) = false;
    grpc::Status status_ ABSL_GUARDED_BY(mu_);
  };

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* ctx,
                                     const v1::GenerateTextRequest* req,
                                     v1::GenerateTextResponse* resp) override {
    return new UnaryReactor(server_, ctx, req, resp);
  }

  grpc::ServerWriteReactor<v1::GenerateTextChunk>* GenerateStream(
      grpc::CallbackServerContext* ctx,
      const v1::GenerateTextRequest* req) override {
    return new StreamReactor(server_, ctx, req);
  }

  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx,
                                 const v1::InfoRequest* /*req*/,
                                 v1::RouterInfo* resp) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    if (grpc::Status a = Authorize(ctx, server_->options_.api_key); !a.ok()) {
      reactor->Finish(a);
      return reactor;
    }
    if (auto i = server_->target_->model_info()) *resp->mutable_target() = *i;
    if (auto i = server_->speculator_->model_info()) {
      *resp->mutable_speculator() = *i;
    }
    for (const auto& e : server_->target_->endpoints()) {
      resp->add_target_endpoints(e);
    }
    for (const auto& e : server_->speculator_->endpoints()) {
      resp->add_speculator_endpoints(e);
    }
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  RouterServer* const server_;
};

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(
    RouterServerOptions options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("--target must list a target replica");
  }
  if (options.max_concurrent_requests < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_concurrent_requests must be >= 0, got ",
                     options.max_concurrent_requests));
  }
  if (options.spec_decode_disable_by_batch_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--spec_decode_disable_by_batch_size must be >= 0, got ",
        options.spec_decode_disable_by_batch_size));
  }
  if (options.speculator_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--speculator_deadline_ms must be > 0");
  }
  if (options.request_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--request_deadline_ms must be > 0");
  }
  if (absl::Status s = ValidateDefaults(options.defaults); !s.ok()) return s;
  std::unique_ptr<RouterServer> r(new RouterServer(std::move(options)));
  const RouterServerOptions& o = r->options_;
  if (!o.tokenizer_dir.empty()) {
    auto tok = LoadTokenizer(o.tokenizer_dir);
    if (!tok.ok()) return tok.status();
    r->tokenizer_ = *std::move(tok);
  }
  RouterServer* raw = r.get();
  for (const char* service : {"target", "speculator"}) {
    ReplicaPoolOptions po = o.pool;
    po.service = service;
    const bool is_target = po.service == "target";
    auto pool = ReplicaPool::Create(
        is_target ? o.target : o.speculator,
        is_target ? "--target" : "--speculator", po,
        is_target ? TargetInfoFn() : SpeculatorInfoFn(),
        [raw, service](const std::string& address, const v1::ModelInfo& i) {
          return raw->CheckReplica(service, address, i);
        });
    if (!pool.ok()) return pool.status();
    (is_target ? r->target_ : r->speculator_) = *std::move(pool);
  }
  if (r->target_->empty()) {
    return absl::InvalidArgumentError("--target must list a target replica");
  }
  r->backends_.tokenizer = r->tokenizer_.get();
  if (r->tokenizer_ != nullptr) {
    r->backends_.max_bytes_per_token = MaxBytesPerToken(*r->tokenizer_);
  }
  r->backends_.target = r->target_.get();
  r->backends_.speculator = r->speculator_.get();
  r->backends_.metrics = r->metrics_.get();
  r->backends_.defaults = o.defaults;
  r->backends_.speculator_deadline = o.speculator_deadline;
  r->backends_.spec_decode_disable_by_batch_size =
      o.spec_decode_disable_by_batch_size;
  r->backends_.running_requests = [raw] { return raw->in_flight(); };
  r->executor_ =
      std::make_unique<Executor>(std::max(1, o.max_concurrent_requests));
  r->service_ = std::make_unique<Service>(raw);
  return r;
}

bool VocabulariesMatch(std::string_view want_fingerprint, int want_vocab,
                       std::string_view have_fingerprint, int have_vocab,
                       bool want_is_tokenizer) {
  if (!want_fingerprint.empty() && !have_fingerprint.empty()) {
    if (want_fingerprint != have_fingerprint) return false;
    // Same tokenizer: the model's embedding may be padded past it (Qwen
    // pads 151,665 tokens to 151,936 or 152,064 rows, per model size).
    return !want_is_tokenizer || have_vocab >= want_vocab;
  }
  return have_vocab == want_vocab;
}

RouterServer::RouterServer(RouterServerOptions options)
    : options_(std::move(options)),
      registry_(std::make_shared<prometheus::Registry>()),
      metrics_(std::make_unique<RouterMetrics>(*registry_)) {}

RouterServer::~RouterServer() {
  Shutdown();
  executor_.reset();  // joins the workers before the pools go
}

absl::Status RouterServer::CheckReplica(const std::string& service,
                                        const std::string& address,
                                        const v1::ModelInfo& info) const {
  std::string want_fp, source;
  int want_vocab = 0;
  if (tokenizer_ != nullptr) {
    want_fp = tokenizer_->Fingerprint();
    want_vocab = tokenizer_->vocab_size();
    source = absl::StrCat("the router's --tokenizer ", options_.tokenizer_dir);
  } else {
    // No router tokenizer: the speculator must match the target.
    const ReplicaPool* other =
        service == "target" ? speculator_.get() : target_.get();
    const auto o = other != nullptr ? other->model_info() : std::nullopt;
    if (!o) return absl::OkStatus();
    want_fp = o->tokenizer_fingerprint();
    want_vocab = o->vocab_size();
    source = absl::StrCat("the ", service == "target" ? "speculator" : "target",
                          " (", o->model_id(), ")");
  }
  if (VocabulariesMatch(want_fp, want_vocab, info.tokenizer_fingerprint(),
                        info.vocab_size(), tokenizer_ != nullptr)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "tokenizer mismatch: ", service, " replica ", address, " (model ",
      info.model_id(), ") has tokenizer fingerprint ",
      info.tokenizer_fingerprint().empty() ? "(none)"
                                           : info.tokenizer_fingerprint(),
      " and vocab size ", info.vocab_size(), ", but ", source,
      " has fingerprint ", want_fp.empty() ? "(none)" : want_fp,
      " and vocab size ", want_vocab, "; refusing to serve"));
}

absl::Status RouterServer::Start(int port) {
  if (server_ != nullptr) {
    return absl::FailedPreconditionError("router already started");
  }
  target_->Start();
  speculator_->Start();
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartGrpcServer(
      options_.host, port, options_.credentials, service_.get(), &port_);
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  health_ = std::thread([this] { HealthLoop(); });
  return absl::OkStatus();
}

void RouterServer::HealthLoop() {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  absl::MutexLock lock(&mu_);
  do {
    const bool serving = target_->num_healthy() > 0 &&
                         target_->compatibility().ok() &&
                         speculator_->compatibility().ok();
    if (health != nullptr) health->SetServingStatus(serving);
  } while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                                 options_.pool.health_period));
}

void RouterServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (health_.joinable()) health_.join();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
  if (target_) target_->Stop();
  if (speculator_) speculator_->Stop();
}

bool RouterServer::Admit(int slots) {
  absl::MutexLock lock(&mu_);
  if (in_flight_ + slots > options_.max_concurrent_requests) {
    metrics_->CountRequest("RESOURCE_EXHAUSTED");
    return false;
  }
  in_flight_ += slots;
  metrics_->SetInFlight(in_flight_);
  return true;
}

void RouterServer::Done(const absl::Status& status, int slots) {
  absl::MutexLock lock(&mu_);
  in_flight_ -= slots;
  metrics_->SetInFlight(in_flight_);
  metrics_->CountRequest(absl::StatusCodeToString(status.code()));
}

int RouterServer::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

}  // namespace specserve
