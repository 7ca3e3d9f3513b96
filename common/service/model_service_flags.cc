#include "common/service/model_service_flags.h"

#include <cstdint>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/service/runner_flags.h"
#include "common/service/tls_flags.h"
#include "common/util/paths.h"

ABSL_FLAG(std::string, model, "", "HF checkpoint directory (required)");
ABSL_FLAG(std::string, model_id, "",
          "model id reported by Info (default: the directory name)");
ABSL_FLAG(std::string, host, "0.0.0.0",
          "gRPC and /metrics listen address");
ABSL_FLAG(int, max_num_batched_tokens, 0,
          "rows (tokens) per batched forward: decode, verify, draft and "
          "look-ahead rows of all requests first, then prompt chunks; 0 = "
          "vLLM's default on CUDA (8192 on GPUs of 70 GiB or more but "
          "A100s, 16384 from 160 GiB, else 2048), 512 on CPU");
ABSL_FLAG(int64_t, kv_budget_bytes, 0,
          "bytes of the paged KV cache pool shared by all requests; when "
          "blocks run out the newest requests are preempted and recomputed "
          "later (a request whose own worst case exceeds the pool is "
          "RESOURCE_EXHAUSTED). 0: sized from --gpu_memory_utilization on "
          "CUDA, 2 GiB on CPU");
ABSL_FLAG(double, shutdown_grace_s, 5,
          "seconds running requests get to finish on SIGTERM");

namespace specserve {

absl::StatusOr<ModelServiceOptions> ModelServiceOptionsFromFlags() {
  ModelServiceOptions f;
  if (absl::GetFlag(FLAGS_model).empty()) {
    return absl::InvalidArgumentError("--model is required");
  }
  f.model_dir = ResolveUserPath(absl::GetFlag(FLAGS_model));
  f.model_id = absl::GetFlag(FLAGS_model_id);
  f.host = absl::GetFlag(FLAGS_host);
  f.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  const int64_t kv = absl::GetFlag(FLAGS_kv_budget_bytes);
  if (kv < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_budget_bytes must be >= 0, got ", kv));
  }
  f.kv_budget_bytes = static_cast<size_t>(kv);
  f.runner = RunnerOptionsFromFlags();
  f.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  auto credentials = ServerCredentialsFromFlags();
  if (!credentials.ok()) return credentials.status();
  f.credentials = *std::move(credentials);
  return f;
}

}  // namespace specserve
