#ifndef SPECSERVE_ROUTER_ROUTER_SERVER_H_
#define SPECSERVE_ROUTER_ROUTER_SERVER_H_

// The public specserve.v1.Router service (protos/router.proto): admission,
// the gRPC callback reactors, and the replica pools; each request runs on
// its own worker (RequestRunner, blocking downstream calls).

#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/registry.h"
#include "router/replica_pool.h"
#include "router/request_runner.h"

namespace specserve {

class Executor;
class RouterMetrics;
class Tokenizer;

/// Everything the router binary's flags control (main.cc maps them 1:1).
struct RouterServerOptions {
  std::string host = "0.0.0.0";  ///< listening address (tests: 127.0.0.1).
  /// Transport security of the public port (common/service/tls.h); null =
  /// plaintext. The channels to the services take `pool.credentials`.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  /// --api_key / SPECSERVE_API_KEY: when non-empty, Generate,
  /// GenerateStream and Info need the metadata "authorization: Bearer
  /// <key>" (else UNAUTHENTICATED), as the HTTP API needs its header. The
  /// health service and reflection stay open (probes).
  std::string api_key;
  /// --speculator: comma-separated host:port / dns:///name:port; "" = no
  /// speculator (plain target serving, no fallback counted).
  std::string speculator;
  std::string target;  ///< --target, same syntax; required.
  /// --tokenizer: model directory whose tokenizer the router uses; "" =
  /// token-id prompts only, no text out, replicas compared to each other.
  std::string tokenizer_dir;
  /// Requests admitted at once (each holds a worker); more ->
  /// RESOURCE_EXHAUSTED. 0 rejects everything (drain mode).
  int max_concurrent_requests = 512;
  absl::Duration speculator_deadline = absl::Milliseconds(2000);
  /// Speculative decoding backs off under load: with this many requests
  /// in flight rounds go without drafts, from half of it on with fewer
  /// (DraftTokensUnderLoad). 0 = never (vLLM's default).
  int spec_decode_disable_by_batch_size = 0;
  /// Deadline of requests whose client set none.
  absl::Duration request_deadline = absl::Seconds(300);
  RequestDefaults defaults;
  ReplicaPoolOptions pool;  ///< health / DNS periods; `service` is ignored.
};

/// Whether a replica's vocabulary (tokenizer fingerprint, model
/// vocab_size) matches what the router expects: the router's own tokenizer
/// (`want_is_tokenizer`: its fingerprint and token count) or the other
/// model service. With both fingerprints known they must be equal, and a
/// model may have more rows than the tokenizer has tokens (padded
/// embeddings, as Qwen's); two models with the same tokenizer may differ
/// in padding. Without fingerprints the sizes must be equal.
bool VocabulariesMatch(std::string_view want_fingerprint, int want_vocab,
                       std::string_view have_fingerprint, int have_vocab,
                       bool want_is_tokenizer);

/// Hosts specserve.v1.Router (Generate, GenerateStream, Info), the
/// standard health service (SERVING while a compatible target replica is
/// healthy) and reflection (if EnableHealthAndReflection() was called
/// first), and the specserve_router_* metrics. Thread-safe.
class RouterServer {
 public:
  /// Validates the options (INVALID_ARGUMENT naming the option: empty
  /// target, bad replica lists, max_concurrent_requests < 0, deadlines <= 0,
  /// bad defaults) and loads the tokenizer (LoadTokenizer's errors).
  static absl::StatusOr<std::unique_ptr<RouterServer>> Create(
      RouterServerOptions options);
  ~RouterServer();  ///< Shutdown(no grace).

  /// Checks every replica once (Info: health and tokenizer compatibility;
  /// mismatches are logged to stderr and make requests FAILED_PRECONDITION),
  /// then binds host:port (0 = any) and serves. UNAVAILABLE if the port
  /// cannot be bound; FAILED_PRECONDITION if already started.
  absl::Status Start(int port);
  /// The bound port after Start, else 0.
  int port() const { return port_; }
  /// Stops accepting calls; requests still running at `grace` are
  /// cancelled (their downstream sessions freed). Blocks until they end.
  /// Idempotent.
  void Shutdown(absl::Duration grace = absl::ZeroDuration());

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  /// Requests admitted and not yet finished.
  int in_flight() const;
  ReplicaPool& target_pool() { return *target_; }
  ReplicaPool& speculator_pool() { return *speculator_; }
  const RouterServerOptions& options() const { return options_; }
  /// The router's tokenizer (--tokenizer); null when it has none.
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  /// What a RequestRunner needs: front ends other than gRPC (the HTTP API,
  /// router/http_server.h) run requests on the same path with these.
  const RouterBackends* backends() const { return &backends_; }

  /// Admission shared by every front end: a request of `slots` runs (an
  /// HTTP request's `n` choices) takes that many of
  /// --max_concurrent_requests; false (counted as RESOURCE_EXHAUSTED) when
  /// they are not free. After a true, call Done exactly once with the
  /// request's final status and the same slots.
  bool Admit(int slots = 1);
  void Done(const absl::Status& status, int slots = 1);

  class Service;  // router_server.cc

 private:
  explicit RouterServer(RouterServerOptions options);
  // The CheckFn of both pools.
  absl::Status CheckReplica(const std::string& service,
                            const std::string& address,
                            const v1::ModelInfo& info) const;
  void HealthLoop();

  const RouterServerOptions options_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<RouterMetrics> metrics_;
  std::unique_ptr<ReplicaPool> target_;
  std::unique_ptr<ReplicaPool> speculator_;
  RouterBackends backends_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread health_;

  mutable absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_ROUTER_SERVER_H_
