#ifndef SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_FLAGS_H_
#define SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_FLAGS_H_

// The flags both model services (speculator and target) take, defined once:
//   --model DIR                 HF checkpoint directory (required)
//   --model_id ID               Info.model_id (default: the directory name)
//   --host ADDR                 gRPC and /metrics listen address
//   --max_num_batched_tokens N  rows per batched forward (0 = by backend
//                               and device)
//   --kv_budget_bytes N         the paged KV cache pool
//   --shutdown_grace_s S        seconds running requests get on SIGTERM
// plus the engine flags (runner_flags.h) and the TLS flags
// (tls_flags.h). Ports and --engine_threads stay per binary: their
// defaults differ.

#include "absl/status/statusor.h"
#include "common/service/model_service_options.h"

namespace specserve {

/// Reads the shared flags. INVALID_ARGUMENT without --model or with a
/// negative --kv_budget_bytes; the TLS flags' errors
/// (ServerCredentialsFromFlags, which starts gRPC's threads: call it after
/// BlockStopSignals()).
absl::StatusOr<ModelServiceOptions> ModelServiceOptionsFromFlags();

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_FLAGS_H_
