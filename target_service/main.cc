// specserve target service: serves specserve.v1.Target (protos/target.proto)
// for one model, with health, reflection and Prometheus /metrics.
//
//   target_service --model=models/stories260K --port=50052 --metrics_port=9092
//
// Prints "listening on <port>, metrics on <port>" to stderr when ready;
// SIGINT/SIGTERM stop it (streams get --shutdown_grace_s to finish).

#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/time.h"
#include "common/engine/cpu_model_runner.h"
#include "common/service/runner_flags.h"
#include "common/service/grpc_util.h"
#include "common/service/server_main.h"
#include "common/service/tls_flags.h"
#include "target_service/target_server.h"

ABSL_FLAG(std::string, model, "", "HF Llama checkpoint directory (required)");
ABSL_FLAG(std::string, model_id, "", "Info.model_id; default: model dir name");
ABSL_FLAG(std::string, host, "0.0.0.0", "gRPC listening address");
ABSL_FLAG(int, port, 50052, "gRPC port (0 = any free port)");
ABSL_FLAG(int, metrics_port, 9092, "Prometheus /metrics port (0 = any)");
ABSL_FLAG(int, threads, 0, "OpenBLAS threads per forward (0 = default)");
ABSL_FLAG(int, max_num_batched_tokens, 0,
          "rows (tokens) per batched forward: decode/verify rows of all "
          "streams first, then prefill chunks; >= max_drafts + 1; 0 = 2048 "
          "on CUDA, 512 on CPU");
ABSL_FLAG(int, max_sessions, 64, "concurrent Generate streams admitted");
ABSL_FLAG(int, max_waiting_requests, 1024,
          "streams that wait for admission before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, kv_budget_bytes, 0,
          "bytes of the paged KV cache pool shared by all streams; when "
          "blocks run out the newest streams are preempted and recomputed "
          "later (a request whose own worst case exceeds the pool is "
          "RESOURCE_EXHAUSTED). 0: sized from --gpu_memory_utilization on "
          "CUDA, 2 GiB on CPU");
ABSL_FLAG(int, default_max_new_tokens, 256,
          "max_new_tokens for requests that leave it 0");
ABSL_FLAG(int, max_drafts, 64, "drafts per message at most, [0, 64]");
ABSL_FLAG(double, shutdown_grace_s, 5, "seconds open streams get on exit");

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  absl::ParseCommandLine(argc, argv);

  const sigset_t stop = specserve::BlockStopSignals();

  specserve::EnableHealthAndReflection();
  specserve::TargetServerOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.model_id = absl::GetFlag(FLAGS_model_id);
  options.host = absl::GetFlag(FLAGS_host);
  auto credentials = specserve::ServerCredentialsFromFlags();
  if (!credentials.ok()) {
    std::fprintf(stderr, "target_service: %s\n",
                 credentials.status().ToString().c_str());
    return 2;
  }
  options.credentials = *std::move(credentials);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.max_waiting_requests = absl::GetFlag(FLAGS_max_waiting_requests);
  options.kv_budget_bytes = absl::GetFlag(FLAGS_kv_budget_bytes);
  options.runner = specserve::RunnerOptionsFromFlags();
  options.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  options.max_drafts = absl::GetFlag(FLAGS_max_drafts);
  auto server = specserve::TargetServer::Create(options);
  if (!server.ok()) {
    std::fprintf(stderr, "target_service: %s\n",
                 server.status().ToString().c_str());
    return 1;
  }
  return specserve::ServeUntilStopSignal(
      "target_service", **server, absl::GetFlag(FLAGS_port),
      absl::GetFlag(FLAGS_metrics_port), (*server)->registry(), stop,
      absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s)));
}
