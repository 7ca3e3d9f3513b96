#ifndef SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_OPTIONS_H_
#define SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_OPTIONS_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/engine/model_runner_factory.h"
#include "grpcpp/grpcpp.h"

namespace specserve {

/// What both model services (speculator and target) are configured with;
/// each service's options extend it (TargetServerOptions,
/// SpeculatorServerOptions). The flags that set it are
/// model_service_flags.h.
struct ModelServiceOptions {
  std::string model_dir;  ///< HF checkpoint directory (--model).
  std::string model_id;   ///< Info.model_id; "" = basename(model_dir).
  std::string host = "0.0.0.0";  ///< listen address (tests: 127.0.0.1).
  /// Transport security of the listening port (common/service/tls.h);
  /// null = plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  /// Rows (tokens) per batched forward of the model's scheduler: the
  /// decode-like rows of all requests first, then prompt chunks; 0 = by
  /// backend and device (DefaultMaxNumBatchedTokens: vLLM's default on
  /// CUDA, 8192 on an H100 or H200; 512 on CPU).
  int max_num_batched_tokens = 0;
  /// Bytes of the model's paged KV cache pool, shared by all requests:
  /// requests take blocks as they grow and are preempted (recomputed
  /// later) when it runs out; one whose own worst case exceeds the pool is
  /// refused. 0: sized from the device (RunnerOptions::
  /// kv_pool_from_device; --device cuda: runner.gpu_memory_utilization,
  /// cpu: 2 GiB).
  size_t kv_budget_bytes = size_t{2} << 30;
  /// Backend (--device), KV block size, prefix caching, CUDA dtype; its
  /// kv_cache.pool_bytes is set from kv_budget_bytes.
  RunnerOptions runner;
  /// Time running requests get on shutdown (SIGTERM).
  absl::Duration shutdown_grace = absl::Seconds(5);
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_OPTIONS_H_
