#ifndef SPECSERVE_SPECULATOR_SERVICE_SPECULATOR_SERVER_H_
#define SPECSERVE_SPECULATOR_SERVICE_SPECULATOR_SERVER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/registry.h"
#include "protos/common.pb.h"
#include "common/service/json_mask.h"
#include "common/service/model_service_options.h"
#include "common/engine/model_runner_factory.h"
#include "common/service/wire_options.h"
#include "speculator_service/session_manager.h"

namespace specserve {

/// Every knob of the speculator service (main.cc maps flags 1:1 onto it).
struct SpeculatorServerOptions : ModelServiceOptions {
  int engine_threads = 1;  ///< importance-reduction threads per Score.
  /// Score / Draft operations queued or running before RESOURCE_EXHAUSTED.
  int max_queue = 1024;
  /// Live sessions before Score is RESOURCE_EXHAUSTED; 0 = sized by the
  /// KV pool (AutoMaxSessions). A session idle between its requests keeps
  /// its blocks only until the pool is short (the scheduler preempts idle
  /// sessions first), so the count is bounded by what the pool can serve,
  /// not by what sessions would hold at their largest.
  int max_sessions = 0;
  double session_ttl_s = 300;   ///< idle seconds before a session is reaped.
  SpecPrefillDefaults defaults;       ///< for unset SpecPrefillOptions fields.
  SessionManager::Clock clock;  ///< "now" for session TTLs; null = real.
};

/// The session limit --max_sessions 0 means: one session per KV block of
/// the pool (each live sequence holds at least one), at least 64 and at
/// most 4096, so a router's 512 concurrent requests all get a session
/// wherever the pool has 512 blocks.
int AutoMaxSessions(int kv_blocks);

class SpeculatorServiceImpl;
class SpeculatorMetrics;
class BatchScheduler;
class ModelRunner;
class Tokenizer;

/// The specserve.v1.Speculator gRPC service (protos/speculator.proto), a
/// thin wrapper around DraftSession: Score (Speculative Prefill scoring,
/// Liu et al. ICML 2025), Draft (bidi stream of draft proposals for
/// speculative decoding, reusing the scoring KV cache), ReleaseSession and
/// Info, plus grpc.health.v1 and reflection when EnableHealthAndReflection()
/// was called first. Every Score and Draft is work of the model's one
/// BatchScheduler (continuous batching: the forwards of all requests share
/// each batched forward, prompts go in chunks), never on gRPC threads.
///
/// Errors: INVALID_ARGUMENT naming the field for bad input; RESOURCE_
/// EXHAUSTED for max_sessions, the KV budget or a full queue; NOT_FOUND for
/// an unknown or expired session; CANCELLED when the client leaves.
///
/// Draft streams: the first message names the session; the stream leases it
/// (it is never reaped while the stream is open). A clean client half-close
/// ends the stream with OK and KEEPS the session (the router frees it with
/// ReleaseSession, or the TTL reaps it); cancellation or an error status
/// frees it. ReleaseSession of a session a stream still uses unlists it and
/// frees it when that stream ends; unknown ids answer released = false.
class SpeculatorServer {
 public:
  /// Loads the model (and tokenizer, optional: without one Info reports no
  /// fingerprint). Errors from LoadModelWeights / LoadTokenizer, or
  /// INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<SpeculatorServer>> Create(
      const SpeculatorServerOptions& options);
  ~SpeculatorServer();

  /// Listens on options.host:`port` (0 = pick a free port) and starts the
  /// session sweeper. UNAVAILABLE if the port cannot be bound.
  absl::Status Start(int port);
  /// The bound port after Start, else 0.
  int port() const { return port_; }
  /// Stops accepting calls, cancels those still running after `grace`,
  /// and waits for them. Idempotent; the destructor calls it.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

  prometheus::Registry& registry() { return *registry_; }
  std::shared_ptr<prometheus::Registry> registry_ptr() { return registry_; }
  const v1::ModelInfo& info() const { return info_; }
  SessionManager& sessions() { return *sessions_; }

 private:
  explicit SpeculatorServer(const SpeculatorServerOptions& options);
  void SweepLoop();

  SpeculatorServerOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<SpeculatorMetrics> metrics_;
  std::unique_ptr<ModelRunner> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  // JSON mode's drafts (built on the first JSON-mode request).
  std::unique_ptr<LazyJsonTokenMask> json_mask_;
  v1::ModelInfo info_;
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<SpeculatorServiceImpl> service_;
  std::unique_ptr<BatchScheduler> scheduler_;  // destroyed before service_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread sweeper_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace specserve

#endif  // SPECSERVE_SPECULATOR_SERVICE_SPECULATOR_SERVER_H_
