#include "target_service/target_server.h"

#include <atomic>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/decoding/ngram_proposer.h"
#include "common/model/weights.h"
#include "common/service/grpc_util.h"
#include "common/service/metrics_util.h"
#include "common/service/wire_options.h"
#include "common/speculation/target_session.h"
#include "target_service/request_convert.h"

namespace specserve {

// The specserve_target_* metrics (docs/ARCHITECTURE.md, Conventions; vLLM's
// spec_decode counters).
struct TargetServer::Metrics {
  explicit Metrics(prometheus::Registry& r)
      : prefill_tokens(prometheus::BuildCounter()
                           .Name("specserve_target_prefill_tokens_total")
                           .Help("Prompt tokens prefilled (kept tokens only)")
                           .Register(r)
                           .Add({})),
        prefill_seconds(
            prometheus::BuildHistogram()
                .Name("specserve_target_prefill_seconds")
                .Help("Prefill round time (forward + first verification)")
                .Register(r)
                .Add({}, ExponentialBuckets(1e-4, 2, 20))),
        verify_rounds(
            prometheus::BuildCounter()
                .Name("specserve_target_verify_rounds_total")
                .Help("Rounds that verified at least one draft (vLLM "
                      "num_drafts): mean acceptance length = 1 + "
                      "accepted / verify_rounds")
                .Register(r)
                .Add({})),
        draft_tokens(prometheus::BuildCounter()
                         .Name("specserve_target_draft_tokens_total")
                         .Help("Draft tokens verified")
                         .Register(r)
                         .Add({})),
        accepted_tokens(prometheus::BuildCounter()
                            .Name("specserve_target_accepted_tokens_total")
                            .Help("Draft tokens accepted")
                            .Register(r)
                            .Add({})),
        accepted_per_pos(
            prometheus::BuildCounter()
                .Name("specserve_target_accepted_tokens_per_pos_total")
                .Help("Accepted drafts by position in the round (0-based)")
                .Register(r)),
        emitted_tokens(prometheus::BuildCounter()
                           .Name("specserve_target_emitted_tokens_total")
                           .Help("Tokens emitted to clients")
                           .Register(r)
                           .Add({})),
        tpot_seconds(prometheus::BuildHistogram()
                         .Name("specserve_target_time_per_output_token_seconds")
                         .Help("Verify round time / tokens emitted that round "
                               "(rounds after the prefill)")
                         .Register(r)
                         .Add({}, ExponentialBuckets(1e-5, 2, 22))),
        round_seconds(prometheus::BuildHistogram()
                          .Name("specserve_target_round_seconds")
                          .Help("Decode/verify round time: one forward over "
                                "[last token, drafts] + verification "
                                "(rounds after the prefill)")
                          .Register(r)
                          .Add({}, ExponentialBuckets(1e-5, 2, 24))),
        active_sessions(prometheus::BuildGauge()
                            .Name("specserve_target_active_sessions")
                            .Help("Generate streams holding a session")
                            .Register(r)
                            .Add({})),
        kv_cache_bytes(prometheus::BuildGauge()
                           .Name("specserve_target_kv_cache_bytes")
                           .Help("KV cache bytes of the blocks sessions hold")
                           .Register(r)
                           .Add({})),
        preemptions(prometheus::BuildCounter()
                        .Name("specserve_target_num_preemptions_total")
                        .Help("Sessions preempted when the KV cache ran out "
                              "of blocks: freed and recomputed later (vLLM "
                              "num_preemptions)")
                        .Register(r)
                        .Add({})),
        requests(prometheus::BuildCounter()
                     .Name("specserve_target_requests_total")
                     .Help("Generate streams ended, by gRPC status code")
                     .Register(r)),
        batch_sequences(
            prometheus::BuildHistogram()
                .Name("specserve_target_batch_sequences")
                .Help("Sessions per batched forward of the scheduler")
                .Register(r)
                .Add({}, ExponentialBuckets(1, 2, 10))),
        forward_seconds(
            prometheus::BuildHistogram()
                .Name("specserve_target_forward_seconds")
                .Help("Time of each batched forward of the scheduler")
                .Register(r)
                .Add({}, ExponentialBuckets(1e-5, 2, 20))),
        step_gap_seconds(
            prometheus::BuildHistogram()
                .Name("specserve_target_step_gap_seconds")
                .Help("Host time between two back-to-back batched forwards "
                      "(finishing rounds, waiting for streams' next "
                      "rounds, planning): the device idles for it")
                .Register(r)
                .Add({}, ExponentialBuckets(1e-6, 2, 24))),
        batch_tokens(prometheus::BuildHistogram()
                         .Name("specserve_target_batch_tokens")
                         .Help("Rows (tokens) per batched forward, at most "
                               "--max_num_batched_tokens")
                         .Register(r)
                         .Add({}, ExponentialBuckets(1, 2, 16))),
        kv_cache_usage(prometheus::BuildGauge()
                           .Name("specserve_target_kv_cache_usage_perc")
                           .Help("Fraction of the paged KV cache's blocks in "
                                 "use, [0, 1] (vLLM kv_cache_usage_perc)")
                           .Register(r)
                           .Add({})),
        waiting(prometheus::BuildGauge()
                    .Name("specserve_target_num_requests_waiting")
                    .Help("Generate streams waiting for admission or "
                          "for KV cache blocks (vLLM num_requests_waiting)")
                    .Register(r)
                    .Add({})),
        queue_seconds(prometheus::BuildHistogram()
                          .Name("specserve_target_request_queue_time_seconds")
                          .Help("Time queued streams waited for admission "
                                "(vLLM request_queue_time_seconds)")
                          .Register(r)
                          .Add({}, ExponentialBuckets(1e-3, 2, 16))),
        prefix_queries(prometheus::BuildCounter()
                           .Name("specserve_target_prefix_cache_queries_total")
                           .Help("Prompt tokens looked up in the prefix cache "
                                 "(vLLM prefix_cache_queries)")
                           .Register(r)
                           .Add({})),
        prefix_hits(prometheus::BuildCounter()
                        .Name("specserve_target_prefix_cache_hits_total")
                        .Help("Prompt tokens the prefix cache supplied, not "
                              "prefilled (vLLM prefix_cache_hits)")
                        .Register(r)
                        .Add({})) {}

  prometheus::Counter& prefill_tokens;
  prometheus::Histogram& prefill_seconds;
  prometheus::Counter& verify_rounds;
  prometheus::Counter& draft_tokens;
  prometheus::Counter& accepted_tokens;
  prometheus::Family<prometheus::Counter>& accepted_per_pos;
  prometheus::Counter& emitted_tokens;
  prometheus::Histogram& tpot_seconds;
  prometheus::Histogram& round_seconds;
  prometheus::Gauge& active_sessions;
  prometheus::Gauge& kv_cache_bytes;
  prometheus::Counter& preemptions;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Histogram& batch_sequences;
  prometheus::Histogram& forward_seconds;
  prometheus::Histogram& step_gap_seconds;
  prometheus::Histogram& batch_tokens;
  prometheus::Gauge& kv_cache_usage;
  prometheus::Gauge& waiting;
  prometheus::Histogram& queue_seconds;
  prometheus::Counter& prefix_queries;
  prometheus::Counter& prefix_hits;
  // The KV cache's running totals already counted into the counters.
  int64_t seen_queries = 0, seen_hits = 0;
  // num_requests_waiting = streams queued for admission + rounds that
  // waited for KV blocks in the scheduler's last step.
  std::atomic<int> queued{0};
  std::atomic<int> waiting_for_kv{0};
  // The loop thread and the admission queue both set these gauges: each
  // read-and-set holds gauge_mu, so the last one to run reads the final
  // state (overlapping, a stale read could be set last and stay while the
  // server is idle).
  void SetWaiting() {
    absl::MutexLock lock(&gauge_mu);
    waiting.Set(static_cast<double>(queued.load() + waiting_for_kv.load()));
  }
  // The KV gauges from the live cache: after every step and whenever a
  // stream ends, so they fall back to idle values with traffic.
  void SetKv(const PagedKvCache& kv) {
    absl::MutexLock lock(&gauge_mu);
    kv_cache_usage.Set(kv.usage());
    kv_cache_bytes.Set(static_cast<double>(kv.bytes_held()));
  }
  absl::Mutex gauge_mu;
};

// One Generate stream. A request/response stream has exactly one of these
// outstanding at any moment: a read, a forward on the scheduler (busy_), a
// write, or the Finish; so reads and writes never race and the session is
// only touched by whoever holds that turn. A continuous stream
// (Prefill.continuous) overlaps the two halves of a round: when a forward
// returns, its tokens join the unsent response (pending_) and the next
// forward starts at once; the response goes out when no write is in
// flight, otherwise OnWriteDone sends everything that ended meanwhile as
// one message (GenerateResponse.rounds), so the forward rate does not wait
// for the client. It reads again only for the half-close after its last
// round has been written. The session is still touched only by the
// forward or, with neither forward nor write outstanding, by whoever ends
// the stream. OnCancel may arrive at any time: it frees the session unless
// a forward is running (that forward frees it when it returns), and the
// outstanding read/write then fails; the stream finishes once neither a
// forward nor a write is outstanding.
class TargetServer::GenerateReactor
    : public grpc::ServerBidiReactor<v1::GenerateRequest,
                                     v1::GenerateResponse> {
 public:
  explicit GenerateReactor(TargetServer* server) : server_(server) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close or cancellation
      grpc::Status status;
      {
        absl::MutexLock lock(&mu_);
        ReleaseSession();
        if (cancelled_) {
          status = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
        } else if (phase_ == Phase::kAwaitPrefill) {
          status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                "stream closed before the prefill message");
        } else if (phase_ == Phase::kDone) {
          status = grpc::Status::OK;
        } else {
          status = grpc::Status(
              grpc::StatusCode::CANCELLED,
              "client half-closed before generation finished");
        }
      }
      FinishOnce(status);
      return;
    }
    std::vector<DraftToken> drafts;
    std::vector<int> parents;
    bool queued = false;
    absl::Status status = OnMessage(&drafts, &parents, &queued);
    if (!status.ok()) {
      {
        absl::MutexLock lock(&mu_);
        ReleaseSession();
      }
      FinishOnce(ToGrpcStatus(status));
      return;
    }
    // busy_ is set: this reactor is not touched again on this thread until
    // the scheduler runs OnRoundDone (or, queued, until OnAdmitted).
    if (!queued) SubmitRound(std::move(drafts), std::move(parents));
  }

  // On the server's admission thread when a queued request fits: run its
  // first round, or end it if it was cancelled meanwhile.
  void OnAdmitted() {
    std::vector<DraftToken> drafts;
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      waiting_ticket_ = 0;
      admitted_ = true;
      server_->metrics_->queue_seconds.Observe(
          absl::ToDoubleSeconds(absl::Now() - queued_at_));
      cancelled = cancelled_;
      if (cancelled) {
        busy_ = false;
        ReleaseSession();
      } else {
        drafts = std::move(queued_drafts_);
      }
    }
    if (cancelled) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      return;
    }
    // A cancellation from here on is handled as for any running round.
    SubmitRound(std::move(drafts));
  }

  void OnWriteDone(bool ok) override {
    // What this completion leads to: the next message of rounds that ended
    // while it was written, the stream's end, a read, or nothing (a
    // continuous stream's forward is running and will write its round).
    bool write = false, read = false;
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (cancelled_ && !finish_status_.has_value()) {
        finish_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      }
      if (!ok) {
        // The client is gone: end as a cancellation once no forward runs.
        cancelled_ = true;
        if (!finish_status_.has_value()) {
          finish_status_ =
              grpc::Status(grpc::StatusCode::CANCELLED, "write failed");
        }
      }
      if (finish_status_.has_value()) {
        if (!busy_) {
          ReleaseSession();
          finish = finish_status_;
        }
      } else if (has_pending_) {
        TakePendingLocked();
        write = true;
      } else if (!continuous_ || phase_ == Phase::kDone) {
        read = !busy_;
      }
    }
    if (finish.has_value()) {
      FinishOnce(*finish);
    } else if (write) {
      StartWrite(&response_);
    } else if (read) {
      StartRead(&request_);
    }
  }

  void OnCancel() override {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (waiting_ticket_ != 0) {
        // Still queued: leave the queue and end the stream here (nothing
        // else is outstanding). If admission is already under way,
        // OnAdmitted sees cancelled_ instead.
        if (server_->CancelWaiting(waiting_ticket_)) {
          waiting_ticket_ = 0;
          busy_ = false;
          session_.reset();  // never charged
          finish = true;
        }
      } else if (!busy_) {
        ReleaseSession();
      }
    }
    if (finish) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    }
  }

  void OnDone() override { delete this; }

  ~GenerateReactor() override {
    absl::MutexLock lock(&mu_);
    ReleaseSession();  // every path releases earlier; this is a backstop
  }

 private:
  enum class Phase { kAwaitPrefill, kGenerating, kDone };

  // Queues the session's next round on the scheduler.
  void SubmitRound(std::vector<DraftToken> drafts,
                   std::vector<int> parents = {}) {
    TargetSession* session;
    {
      absl::MutexLock lock(&mu_);
      session = session_.get();
      // A cancellation that raced with this message's read has already
      // freed the session (busy_ was not yet set).
      if (cancelled_ || session == nullptr) session = nullptr;
    }
    if (session == nullptr) {
      OnRoundDone(absl::CancelledError("cancelled"));
      return;
    }
    absl::Status submitted = server_->scheduler_->Submit(
        session, std::move(drafts), std::move(parents),
        [this](absl::StatusOr<RoundResult> round) {
          OnRoundDone(std::move(round));
        });
    if (!submitted.ok()) OnRoundDone(submitted);
  }

  // Handles a received message: sets busy_ and the round's drafts, or
  // returns the error that ends the stream. *queued: the prefill waits in
  // the server's admission queue (OnAdmitted runs its round).
  absl::Status OnMessage(std::vector<DraftToken>* drafts,
                         std::vector<int>* parents, bool* queued) {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError("cancelled");
    const bool is_prefill = request_.has_prefill();
    switch (phase_) {
      case Phase::kDone:
        return absl::FailedPreconditionError(
            "generation already finished; half-close the stream");
      case Phase::kAwaitPrefill: {
        if (!is_prefill) {
          return absl::InvalidArgumentError(
              "the first message must be a prefill");
        }
        if (absl::Status s = ValidatePromptLookup(
                request_.prefill(), server_->options_.max_drafts);
            !s.ok()) {
          return s;
        }
        TargetRequest target_request = ToTargetRequest(
            request_.prefill(), server_->options_.default_max_new_tokens,
            server_->options_.max_drafts);
        if (absl::Status s =
                AttachJsonSchema(request_.prefill().sampling(),
                                 "prefill.sampling.", &target_request.sampling);
            !s.ok()) {
          return s;
        }
        if (target_request.sampling.json_object) {
          target_request.json_mask = server_->JsonMask();
        }
        auto session = TargetSession::Create(server_->model_.get(),
                                             std::move(target_request));
        if (!session.ok()) return session.status();
        const int64_t bytes =
            static_cast<int64_t>((*session)->kv_capacity_bytes());
        absl::StatusOr<uint64_t> ticket =
            server_->AdmitOrWait(bytes, [this] { OnAdmitted(); });
        if (!ticket.ok()) return ticket.status();
        session_ = *std::move(session);
        prefill_tokens_ = request_.prefill().token_ids_size();
        continuous_ = request_.prefill().continuous();
        if (request_.prefill().has_prompt_lookup()) {
          const v1::PromptLookup& l = request_.prefill().prompt_lookup();
          lookup_ = std::make_unique<NgramProposer>(l.min_n(), l.max_n());
          lookup_->Append(absl::MakeConstSpan(
              request_.prefill().token_ids().data(),
              request_.prefill().token_ids_size()));
          lookup_k_ = l.num_draft_tokens();
          lookup_greedy_ = request_.prefill().sampling().temperature() == 0.f;
        }
        *drafts = ToDrafts(request_.prefill().drafts());
        phase_ = Phase::kGenerating;
        if (*ticket == 0) {
          admitted_ = true;
        } else {
          waiting_ticket_ = *ticket;
          queued_at_ = absl::Now();
          queued_drafts_ = std::move(*drafts);
          *queued = true;
        }
        break;
      }
      case Phase::kGenerating:
        if (is_prefill) {
          return absl::InvalidArgumentError(
              "prefill sent twice; later messages must be drafts");
        }
        *drafts = ToDrafts(request_.drafts().drafts());
        parents->assign(request_.drafts().parents().begin(),
                        request_.drafts().parents().end());
        break;
    }
    busy_ = true;
    return absl::OkStatus();
  }

  // On the scheduler's thread when the round ends: queue its response and
  // write it unless a write is in flight, start a continuous stream's next
  // forward, or end the stream with its error once no write is in flight.
  void OnRoundDone(absl::StatusOr<RoundResult> round) {
    bool write = false, next = false;
    std::optional<grpc::Status> finish;
    std::vector<DraftToken> drafts;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      if (cancelled_ || !round.ok()) {
        ReleaseSession();
        if (!finish_status_.has_value()) {
          finish_status_ =
              cancelled_
                  ? grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")
                  : ToGrpcStatus(round.status());
        }
        // Unsent rounds go with the stream; a write in flight finishes it
        // from OnWriteDone.
        if (!writing_) finish = finish_status_;
      } else {
        AppendRound(*round);
        if (lookup_ != nullptr) {
          lookup_->Append(absl::MakeConstSpan(round->tokens));
        }
        if (session_->finished()) {
          phase_ = Phase::kDone;
          ReleaseSession();  // free the KV cache before the client closes
        }
        // Continuous decoding: the next round needs no message, nor this
        // one's write.
        next = continuous_ && phase_ == Phase::kGenerating;
        if (next) {
          busy_ = true;
          if (lookup_ != nullptr) {
            drafts =
                PointMassDrafts(lookup_->Propose(lookup_k_), lookup_greedy_);
          }
        }
        if (!writing_) {
          TakePendingLocked();
          write = true;
        }
      }
    }
    if (finish.has_value()) {
      FinishOnce(*finish);
      return;
    }
    if (write) StartWrite(&response_);
    if (next) SubmitRound(std::move(drafts));
  }

  // Moves the unsent rounds into response_ for a write (writing_ set).
  void TakePendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    response_ = std::move(pending_);
    pending_.Clear();
    has_pending_ = false;
    writing_ = true;
  }

  // Adds a finished round to the unsent response (pending_: its tokens,
  // summed counts and, from its second round on, every round's counts) and
  // counts it in the metrics.
  void AppendRound(const RoundResult& round)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Metrics& m = *server_->metrics_;
    const double seconds = round.forward_ns * 1e-9;
    if (has_pending_) {
      if (pending_.rounds_size() == 0) {  // the first round's counts
        v1::RoundCounts* first = pending_.add_rounds();
        first->set_num_drafts(pending_.num_drafts());
        first->set_num_accepted(pending_.num_accepted());
        first->set_num_tokens(pending_.token_ids_size());
      }
      v1::RoundCounts* r = pending_.add_rounds();
      r->set_num_drafts(round.num_drafts);
      r->set_num_accepted(round.num_accepted);
      r->set_num_tokens(static_cast<int>(round.tokens.size()));
    }
    has_pending_ = true;
    pending_.set_num_drafts(pending_.num_drafts() + round.num_drafts);
    pending_.set_num_accepted(pending_.num_accepted() + round.num_accepted);
    pending_.mutable_token_ids()->Add(round.tokens.begin(), round.tokens.end());
    const auto add = [](const TokenLogprobs& lp, v1::TokenLogprob* out) {
      out->set_logprob(lp.logprob);
      for (const auto& [id, logprob] : lp.top) {
        v1::TopLogprob* t = out->add_top();
        t->set_id(id);
        t->set_logprob(logprob);
      }
    };
    for (const TokenLogprobs& lp : round.logprobs) {
      add(lp, pending_.add_logprobs());
    }
    for (const TokenLogprobs& lp : round.prompt_logprobs) {
      add(lp, pending_.add_prompt_logprobs());
    }
    if (round.finish != FinishReason::kNone) {
      pending_.set_finish_reason(std::string(FinishReasonName(round.finish)));
    }
    pending_.set_num_generated(static_cast<int>(session_->output().size()));
    if (first_round_) {
      pending_.mutable_timings()->set_prefill_ns(round.forward_ns);
      m.prefill_tokens.Increment(prefill_tokens_);
      m.prefill_seconds.Observe(seconds);
      first_round_ = false;
    } else {
      pending_.mutable_timings()->set_verify_ns(
          pending_.timings().verify_ns() + round.forward_ns);
      m.round_seconds.Observe(seconds);
      if (!round.tokens.empty()) {
        m.tpot_seconds.Observe(seconds / round.tokens.size());
      }
    }
    if (round.num_drafts > 0) {
      m.verify_rounds.Increment();
      m.draft_tokens.Increment(round.num_drafts);
      m.accepted_tokens.Increment(round.num_accepted);
      for (int i = 0; i < round.num_accepted; ++i) {
        m.accepted_per_pos.Add({{"position", std::to_string(i)}}).Increment();
      }
    }
    m.emitted_tokens.Increment(round.tokens.size());
  }

  // Frees the session and ends its admission. Never while busy_.
  void ReleaseSession() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (session_ == nullptr) return;
    session_.reset();
    if (admitted_) server_->Release();
    admitted_ = false;
  }

  // Calls Finish exactly once and counts the stream's status.
  void FinishOnce(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finish_called_) return;
      finish_called_ = true;
    }
    server_->metrics_->requests
        .Add({{"status", absl::StatusCodeToString(static_cast<absl::StatusCode>(
                             status.error_code()))}})
        .Increment();
    Finish(status);
  }

  TargetServer* const server_;
  // Buffers owned by the turn holder (see the class comment); response_ by
  // the write while writing_.
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;

  absl::Mutex mu_;
  std::unique_ptr<TargetSession> session_ ABSL_GUARDED_BY(mu_);
  bool admitted_ ABSL_GUARDED_BY(mu_) = false;
  // Waiting for admission: the server's ticket (0 = not queued), since
  // when, and the first round's drafts.
  uint64_t waiting_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time queued_at_ ABSL_GUARDED_BY(mu_);
  std::vector<DraftToken> queued_drafts_ ABSL_GUARDED_BY(mu_);
  int prefill_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kAwaitPrefill;
  bool first_round_ ABSL_GUARDED_BY(mu_) = true;
  bool continuous_ ABSL_GUARDED_BY(mu_) = false;  // Prefill.continuous
  // Prefill.prompt_lookup: the proposer over the prompt and every emitted
  // token, and its drafts per round.
  std::unique_ptr<NgramProposer> lookup_ ABSL_GUARDED_BY(mu_);
  int lookup_k_ ABSL_GUARDED_BY(mu_) = 0;
  bool lookup_greedy_ ABSL_GUARDED_BY(mu_) = true;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write is in flight
  // Rounds that ended and are not yet written (has_pending_: at least one).
  v1::GenerateResponse pending_ ABSL_GUARDED_BY(mu_);
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  // The status to end with once neither a forward nor a write is in flight.
  std::optional<grpc::Status> finish_status_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
};

class TargetServer::Service : public v1::Target::CallbackService {
 public:
  Service(TargetServer* server, v1::ModelInfo info)
      : server_(server), info_(std::move(info)) {}

  grpc::ServerBidiReactor<v1::GenerateRequest, v1::GenerateResponse>*
  Generate(grpc::CallbackServerContext* /*context*/) override {
    return new GenerateReactor(server_);
  }

  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* context,
                                 const v1::InfoRequest* /*request*/,
                                 v1::ModelInfo* response) override {
    *response = info_;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  TargetServer* const server_;
  const v1::ModelInfo info_;
};

absl::StatusOr<std::unique_ptr<TargetServer>> TargetServer::Create(
    TargetServerOptions options) {
  if (options.model_dir.empty()) {
    return absl::InvalidArgumentError("model must be set");
  }
  if (options.max_sessions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_sessions must be >= 1, got ", options.max_sessions));
  }
  if (options.default_max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_max_new_tokens must be >= 1, got ",
                     options.default_max_new_tokens));
  }
  if (options.max_drafts < 0 || options.max_drafts > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_drafts must be in [0, 64], got ", options.max_drafts));
  }
  if (options.max_waiting_requests < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_waiting_requests must be >= 0, got ",
                     options.max_waiting_requests));
  }
  if (options.max_num_batched_tokens != 0 &&
      options.max_num_batched_tokens < options.max_drafts + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_num_batched_tokens must be >= max_drafts + 1 = ",
        options.max_drafts + 1, " (a verify round is never split), got ",
        options.max_num_batched_tokens));
  }
  auto tokenizer = LoadTokenizer(options.model_dir);
  // Checkpoints without a tokenizer (synthetic ones) still serve; Info
  // then has no fingerprint.
  if (!tokenizer.ok() && !absl::IsNotFound(tokenizer.status())) {
    return tokenizer.status();
  }
  if (options.model_id.empty()) {
    std::string dir = options.model_dir;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    options.model_id = dir.substr(dir.find_last_of('/') + 1);
  }
  SetEngineThreads(options.engine_threads);
  RunnerOptions ro = options.runner;
  ro.kv_cache.pool_bytes = options.kv_budget_bytes;
  ro.kv_pool_from_device = options.kv_budget_bytes == 0;
  ro.max_num_batched_tokens = options.max_num_batched_tokens;
  auto runner = LoadModelRunner(options.model_dir, ro);
  if (!runner.ok()) return runner.status();
  // The metrics exist before the scheduler that reports into them.
  auto registry = std::make_shared<prometheus::Registry>();
  auto metrics = std::make_unique<Metrics>(*registry);
  Metrics* m = metrics.get();
  PagedKvCache* kv = &(*runner)->kv_cache();
  TargetScheduler::Options so;
  options.max_num_batched_tokens =
      DefaultMaxNumBatchedTokens(**runner, options.max_num_batched_tokens);
  so.max_num_batched_tokens = options.max_num_batched_tokens;
  auto scheduler = TargetScheduler::Create(
      runner->get(), so, [m, kv](const TargetScheduler::StepStats& st) {
        if (st.sequences > 0) {
          m->batch_sequences.Observe(st.sequences);
          m->batch_tokens.Observe(st.rows);
          m->forward_seconds.Observe(st.forward_ns * 1e-9);
          if (st.gap_ns > 0) m->step_gap_seconds.Observe(st.gap_ns * 1e-9);
        }
        m->preemptions.Increment(st.preempted);
        m->waiting_for_kv.store(st.waiting_for_kv);
        m->SetWaiting();
        m->SetKv(*kv);
        // Only the loop thread runs this: the deltas need no lock.
        const int64_t q = kv->prefix_cache_queries();
        const int64_t h = kv->prefix_cache_hits();
        m->prefix_queries.Increment(static_cast<double>(q - m->seen_queries));
        m->prefix_hits.Increment(static_cast<double>(h - m->seen_hits));
        m->seen_queries = q;
        m->seen_hits = h;
      });
  if (!scheduler.ok()) return scheduler.status();
  return std::unique_ptr<TargetServer>(new TargetServer(
      std::move(options), *std::move(runner),
      tokenizer.ok() ? *std::move(tokenizer) : nullptr, std::move(registry),
      std::move(metrics), *std::move(scheduler)));
}

TargetServer::TargetServer(TargetServerOptions options,
                           std::unique_ptr<ModelRunner> model,
                           std::unique_ptr<Tokenizer> tokenizer,
                           std::shared_ptr<prometheus::Registry> registry,
                           std::unique_ptr<Metrics> metrics,
                           std::unique_ptr<TargetScheduler> scheduler)
    : options_(std::move(options)),
      model_(std::move(model)),
      tokenizer_(std::move(tokenizer)),
      json_mask_(std::make_unique<LazyJsonTokenMask>(
          tokenizer_.get(), model_->config().eos_token_ids)),
      registry_(std::move(registry)),
      metrics_(std::move(metrics)),
      scheduler_(std::move(scheduler)),
      admission_(std::make_unique<Executor>(1)),
      admission_queue_(std::make_unique<AdmissionQueue>(
          AdmissionQueue::Options{options_.max_sessions,
                                  options_.max_waiting_requests,
                                  "max_sessions", "max_waiting_requests"},
          // The releasing stream may hold its own lock: admitted streams
          // start on the admission thread instead.
          [this](std::function<void()> f) { admission_->Submit(std::move(f)); },
          [this](int running, int waiting) {
            metrics_->active_sessions.Set(running);
            metrics_->queued.store(waiting);
            metrics_->SetWaiting();
            metrics_->SetKv(model_->kv_cache());
          })),
      service_(std::make_unique<Service>(
          this, MakeModelInfo(options_.model_id, model_->config(),
                              tokenizer_.get()))) {}

TargetServer::~TargetServer() { Shutdown(); }

const JsonTokenMask* TargetServer::JsonMask() { return json_mask_->Get(); }

absl::Status TargetServer::Start(int port) {
  if (server_ != nullptr) {
    return absl::FailedPreconditionError("server already started");
  }
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartGrpcServer(
      options_.host, port, options_.credentials, service_.get(), &port_);
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  return absl::OkStatus();
}

void TargetServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
}

int TargetServer::active_sessions() const {
  return admission_queue_->running();
}

int64_t TargetServer::kv_used_bytes() const {
  return static_cast<int64_t>(model_->kv_cache().bytes_held());
}

int TargetServer::waiting_requests() const {
  return admission_queue_->waiting();
}

absl::StatusOr<uint64_t> TargetServer::AdmitOrWait(
    int64_t max_bytes, std::function<void()> on_admit) {
  const int64_t pool =
      static_cast<int64_t>(model_->kv_cache().bytes_capacity());
  if (max_bytes > pool) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv_budget_bytes exceeded: the request's KV cache may grow to ",
        max_bytes, " bytes, the whole pool holds ", pool));
  }
  return admission_queue_->AdmitOrWait(std::move(on_admit));
}

bool TargetServer::CancelWaiting(uint64_t ticket) {
  return admission_queue_->CancelWaiting(ticket);
}

void TargetServer::Release() { admission_queue_->Release(); }

}  // namespace specserve
