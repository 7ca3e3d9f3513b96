#ifndef SPECSERVE_TARGET_SERVICE_TARGET_SERVER_H_
#define SPECSERVE_TARGET_SERVICE_TARGET_SERVER_H_

// The target gRPC service (protos/target.proto, specserve.v1.Target): a thin
// wrapper around TargetSession. One Generate stream = one request:
//
//   client -> Prefill{token_ids, position_ids, next_position, sampling,
//                     stop, drafts}        server -> GenerateResponse
//   client -> Drafts{drafts} (maybe none)  server -> GenerateResponse
//   ...                                    ... until finish_reason is set
//   client -> WritesDone                   server -> Finish(OK)
//
// Every request message gets exactly one response: the drafts verified and
// accepted that round and the tokens emitted (Leviathan et al. 2023; docs
// docs/ARCHITECTURE.md). Once a response carries a finish_reason the
// session's KV cache is freed at once; the server then waits for the
// client's half-close and finishes the stream with OK (a further message
// -> FAILED_PRECONDITION). Other endings:
//   - first message not a prefill, a second prefill, or a closed stream
//     before any prefill -> INVALID_ARGUMENT;
//   - bad input (TargetSession::Create / Step validation) -> INVALID_ARGUMENT
//     naming the field;
//   - more than max_sessions admitted streams: the stream waits for
//     admission (first come, first served); past max_waiting_requests
//     waiting streams, or a request whose KV cache (kept prompt +
//     max_new_tokens + drafts) could not fit in the whole pool
//     (kv_budget_bytes) -> RESOURCE_EXHAUSTED (checked after validation,
//     before any forward);
//   - KV memory is not reserved up front: sessions take blocks as they
//     grow, and when the pool runs out the scheduler preempts the newest
//     sessions (freed, recomputed later), so a temporary lack of blocks
//     delays a stream and never fails it;
//   - client cancellation, or a half-close before the finish -> CANCELLED;
//     the session is freed immediately unless a forward is running, in
//     which case it is freed as soon as that forward returns.
// Rounds run on the TargetScheduler (target_service/scheduler.h): every
// stream's round joins the next batched forward of the one model (decode
// and verify rows first, then chunks of prefills), never on gRPC callback
// threads.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/engine/model_runner_factory.h"
#include "common/service/json_mask.h"
#include "common/service/model_service_options.h"
#include "common/scheduling/admission_queue.h"
#include "common/tokenizer/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "common/service/executor.h"
#include "protos/target.grpc.pb.h"
#include "target_service/scheduler.h"

namespace specserve {

/// Everything the target_service binary's flags control.
struct TargetServerOptions : ModelServiceOptions {
  /// OpenBLAS / engine threads per forward; 0 = library default.
  int engine_threads = 0;
  /// Concurrent admitted streams (>= 1): vLLM's max_num_seqs default, so
  /// 128 concurrent streams batch together (memory is managed per step,
  /// not reserved at admission).
  int max_sessions = 256;
  /// Streams that wait for admission (max_sessions or the KV budget)
  /// before RESOURCE_EXHAUSTED, first come first served (>= 0).
  int max_waiting_requests = 1024;
  int default_max_new_tokens = 256;  ///< used when the request says 0.
  int max_drafts = 64;       ///< drafts per message at most, [0, 64].
};

/// Hosts specserve.v1.Target (Generate, Info), the standard health service
/// and reflection (if EnableHealthAndReflection() was called first), and a
/// Prometheus registry with the specserve_target_* metrics. Thread-safe.
class TargetServer {
 public:
  /// Loads the model (and its tokenizer, if present) and validates the
  /// options: INVALID_ARGUMENT naming the option, or the loader's error.
  static absl::StatusOr<std::unique_ptr<TargetServer>> Create(
      TargetServerOptions options);
  ~TargetServer();  ///< Shutdown(no grace).

  /// Binds host:port (0 = any free port) and starts serving. UNAVAILABLE if
  /// the port cannot be bound; FAILED_PRECONDITION if already started.
  absl::Status Start(int port);
  /// The bound port (after Start), else 0.
  int port() const { return port_; }
  /// Stops accepting calls; streams still open at `grace` are cancelled.
  /// Blocks until every stream has ended. Idempotent.
  void Shutdown(absl::Duration grace = absl::ZeroDuration());

  /// The metrics registry (serve it with StartMetricsExposer).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  /// Streams admitted and not yet ended (holding a session).
  int active_sessions() const;
  /// Bytes of the KV blocks sequences hold now (cached prompt blocks no
  /// session uses are not counted: they are evictable).
  int64_t kv_used_bytes() const;
  /// Streams waiting for admission.
  int waiting_requests() const;
  /// The model this server runs.
  ModelRunner& model() const { return *model_; }

  class GenerateReactor;  // one per Generate stream (target_server.cc)

 private:
  class Service;
  struct Metrics;

  TargetServer(TargetServerOptions options,
               std::unique_ptr<ModelRunner> model,
               std::unique_ptr<Tokenizer> tokenizer,
               std::shared_ptr<prometheus::Registry> registry,
               std::unique_ptr<Metrics> metrics,
               std::unique_ptr<TargetScheduler> scheduler);

  /// Admission of one session whose KV cache may grow to `max_bytes`
  /// (first come, first served): admits it now and returns 0 when fewer
  /// than max_sessions run and nobody waits; else queues it and returns a
  /// ticket > 0 (`on_admit` then runs on the admission thread once it is
  /// admitted). RESOURCE_EXHAUSTED naming the limit when max_bytes exceeds
  /// the whole pool or max_waiting_requests already wait.
  absl::StatusOr<uint64_t> AdmitOrWait(int64_t max_bytes,
                                       std::function<void()> on_admit);
  /// Leaves the queue; false if the ticket was already admitted.
  bool CancelWaiting(uint64_t ticket);
  /// Ends an admitted session and admits waiting ones.
  void Release();
  /// The vocabulary's JSON-mode mask, built from the tokenizer on first
  /// use (~0.4 s for a 128K vocabulary); null without a tokenizer.
  const JsonTokenMask* JsonMask();
  const TargetServerOptions options_;
  std::unique_ptr<ModelRunner> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LazyJsonTokenMask> json_mask_;  // after tokenizer_, model_
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Metrics> metrics_;
  // Declared before server_ so that they outlive the streams' last rounds.
  std::unique_ptr<TargetScheduler> scheduler_;
  std::unique_ptr<Executor> admission_;  // runs admitted streams' rounds
  // max_sessions streams run, max_waiting_requests wait (first come,
  // first served).
  std::unique_ptr<AdmissionQueue> admission_queue_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace specserve

#endif  // SPECSERVE_TARGET_SERVICE_TARGET_SERVER_H_
