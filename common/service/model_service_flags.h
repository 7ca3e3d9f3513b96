#ifndef SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_FLAGS_H_
#define SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_FLAGS_H_

// The flags both model services (speculator and target) take, defined once:
//   --model DIR                 HF checkpoint directory (required)
//   --model_id ID               Info.model_id (default: the directory name)
//   --host ADDR                 gRPC and /metrics listen address
//   --max_num_batched_tokens N  rows per batched forward (0 = by backend)
//   --kv_budget_bytes N         the paged KV cache pool
//   --shutdown_grace_s S        seconds running requests get on SIGTERM
// plus the engine flags (runner_flags.h) and the TLS flags
// (tls_flags.h). Ports and --engine_threads stay per binary: their
// defaults differ.

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/engine/model_runner_factory.h"
#include "grpcpp/grpcpp.h"

namespace specserve {

/// What the shared flags say, read and checked.
struct ModelServiceFlags {
  std::string model_dir;  ///< --model, resolved against the caller's cwd.
  std::string model_id;
  std::string host;
  std::shared_ptr<grpc::ServerCredentials> credentials;  ///< null = plain.
  int max_num_batched_tokens = 0;
  size_t kv_budget_bytes = 0;
  RunnerOptions runner;  ///< --device, --kv_block_size, ...
  absl::Duration shutdown_grace;
};

/// Reads the shared flags. INVALID_ARGUMENT without --model or with a
/// negative --kv_budget_bytes; the TLS flags' errors
/// (ServerCredentialsFromFlags, which starts gRPC's threads: call it after
/// BlockStopSignals()).
absl::StatusOr<ModelServiceFlags> ModelServiceFlagsFromFlags();

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_FLAGS_H_
