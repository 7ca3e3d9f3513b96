#ifndef SPECSERVE_COMMON_SERVICE_GRPC_UTIL_H_
#define SPECSERVE_COMMON_SERVICE_GRPC_UTIL_H_

// Small pieces every specserve gRPC server shares: status conversion, the
// standard health service and reflection, the Prometheus exposer, and the
// ModelInfo message.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "protos/common.pb.h"

namespace specserve {

class Tokenizer;
struct ModelConfig;

/// absl::Status -> grpc::Status with the same canonical code and message.
grpc::Status ToGrpcStatus(const absl::Status& status);

/// grpc::Status -> absl::Status (same code and message).
absl::Status FromGrpcStatus(const grpc::Status& status);

/// Turns on the standard grpc.health.v1 service and server reflection for
/// every server built afterwards. Call once before building servers.
void EnableHealthAndReflection();

/// Serves `registry` at http://<host>:<port>/metrics (prometheus-cpp), on
/// the service's own listen address (--host), so a service bound to
/// loopback does not publish its metrics on every interface. An IPv6
/// host may be given bare ("::1") or bracketed. Port 0 picks a free port;
/// returns the exposer (keep it alive) and writes the bound port.
/// UNAVAILABLE if the address cannot be bound.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetricsExposer(
    const std::string& host, int port,
    std::shared_ptr<prometheus::Registry> registry, int* bound_port);

/// Builds and starts a gRPC server that serves `service` (not owned; it
/// must outlive the server) at <host>:<port> with `credentials`
/// (plaintext when null). Port 0 picks a free port; the bound port is
/// written to `bound_port`. UNAVAILABLE when the address cannot be bound
/// (taken, or not an address of this host).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& host, int port,
    std::shared_ptr<grpc::ServerCredentials> credentials,
    grpc::Service* service, int* bound_port);

/// Fills ModelInfo from a model config and (optional) tokenizer.
v1::ModelInfo MakeModelInfo(const std::string& model_id,
                            const ModelConfig& config,
                            const Tokenizer* tokenizer);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_GRPC_UTIL_H_
