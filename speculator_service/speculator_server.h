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
#include "common/engine/model_runner_factory.h"
#include "speculator_service/request_options.h"
#include "speculator_service/session_manager.h"

namespace specserve {

/// Every knob of the speculator service (main.cc maps flags 1:1 onto it).
struct SpeculatorServerOptions {
  std::string model_dir;         ///< HF Llama checkpoint (+ tokenizer).
  std::string model_id;          ///< reported by Info; "" = dir basename.
  std::string host = "0.0.0.0";  ///< listen address.
  /// Transport security of the listening port (common/service/tls.h);
  /// null = plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  /// Rows (tokens) per batched forward of the model's scheduler: draft
  /// and look-ahead rows of all sessions first, then prompt chunks; 0 = by
  /// backend (DefaultMaxNumBatchedTokens: 2048 on CUDA, 512 on CPU).
  int max_num_batched_tokens = 0;
  int engine_threads = 1;  ///< importance-reduction threads per Score.
  /// Score / Draft operations queued or running before RESOURCE_EXHAUSTED.
  int max_queue = 1024;
  int max_sessions = 64;
  /// KV cache of all sessions: the size of the model runner's paged pool.
  /// Sessions take blocks as they grow; when the pool runs out the
  /// scheduler preempts the newest (they recompute later). 0: sized from
  /// the device (RunnerOptions::kv_pool_from_device; --device cuda:
  /// runner.gpu_memory_utilization, cpu: 2 GiB).
  size_t kv_budget_bytes = size_t{2} << 30;
  /// Backend (--device), KV block size and CUDA dtype; its
  /// kv_cache.pool_bytes is set from kv_budget_bytes.
  RunnerOptions runner;
  double session_ttl_s = 300;   ///< idle seconds before a session is reaped.
  ScoreDefaults defaults;       ///< for unset SpecPrefillOptions fields.
  SessionManager::Clock clock;  ///< "now" for session TTLs; null = real.
};

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
