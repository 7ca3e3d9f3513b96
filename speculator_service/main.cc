// The speculator service binary: Speculative Prefill scoring and draft
// proposals over gRPC (protos/speculator.proto), metrics over HTTP.
//   bazel run //speculator_service:speculator_service -- --model
//       models/stories260K-draft --port 50061 --metrics_port 9161
// Prints "listening on <port>, metrics on <port>" to stderr when ready and
// shuts down cleanly on SIGINT / SIGTERM. Exit status 2 for bad flags.

#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/engine/cpu_model_runner.h"
#include "common/service/runner_flags.h"
#include "common/service/grpc_util.h"
#include "common/service/server_main.h"
#include "common/service/tls_flags.h"
#include "common/util/paths.h"
#include "speculator_service/speculator_server.h"

ABSL_FLAG(std::string, model, "", "speculator checkpoint directory");
ABSL_FLAG(std::string, model_id, "",
          "model id reported by Info (default: the directory name)");
ABSL_FLAG(std::string, host, "0.0.0.0", "gRPC listen address");
ABSL_FLAG(int, port, 50061, "gRPC port (0 = any free port)");
ABSL_FLAG(int, metrics_port, 9161, "Prometheus /metrics port (0 = any)");
ABSL_FLAG(int, max_num_batched_tokens, 0,
          "rows (tokens) per batched forward: draft and look-ahead rows of "
          "all sessions first, then prompt chunks; 0 = 2048 on CUDA, 512 on "
          "CPU");
ABSL_FLAG(int, engine_threads, 1, "OpenBLAS / importance threads per forward");
ABSL_FLAG(int, max_queue, 1024,
          "Score / Draft operations queued or running before "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_sessions, 64, "live sessions before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, kv_budget_bytes, 0,
          "bytes of the paged KV cache pool shared by all sessions; when "
          "blocks run out the newest sessions are preempted and recomputed "
          "later (a prompt + look-ahead beyond the pool is "
          "RESOURCE_EXHAUSTED). 0: sized from --gpu_memory_utilization on "
          "CUDA, 2 GiB on CPU");
ABSL_FLAG(double, session_ttl_s, 300,
          "idle seconds before a session is reaped");
ABSL_FLAG(int, default_look_ahead, 8, "look-ahead tokens when unset");
ABSL_FLAG(double, default_keep_ratio, 0.3, "keep ratio when unset");
ABSL_FLAG(double, default_keep_mass, 0,
          "keep-by-importance-mass fraction when unset, [0, 1]; 0 = off");
ABSL_FLAG(int, default_chunk_size, 32, "selection chunk size when unset");
ABSL_FLAG(int, default_pool_kernel_size, 13, "pooling kernel when unset");
ABSL_FLAG(int, default_keep_first, 1, "forced keeps at the start when unset");
ABSL_FLAG(int, default_keep_last, 1, "forced keeps at the end when unset");
ABSL_FLAG(int, default_min_prompt_tokens, 0,
          "prompts shorter than this are not pruned, when unset");

namespace specserve {
namespace {

int Run() {
  SpeculatorServerOptions o;
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::fprintf(stderr, "error: --model is required\n");
    return 2;
  }
  o.model_dir = ResolveUserPath(absl::GetFlag(FLAGS_model));
  o.model_id = absl::GetFlag(FLAGS_model_id);
  o.host = absl::GetFlag(FLAGS_host);
  // Before the credentials: their check starts gRPC's threads.
  const sigset_t stop = BlockStopSignals();
  auto credentials = ServerCredentialsFromFlags();
  if (!credentials.ok()) {
    std::fprintf(stderr, "error: %s\n",
                 credentials.status().ToString().c_str());
    return 2;
  }
  o.credentials = *std::move(credentials);
  o.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  o.engine_threads = absl::GetFlag(FLAGS_engine_threads);
  o.max_queue = absl::GetFlag(FLAGS_max_queue);
  o.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.kv_budget_bytes = static_cast<size_t>(
      std::max<int64_t>(0, absl::GetFlag(FLAGS_kv_budget_bytes)));
  o.session_ttl_s = absl::GetFlag(FLAGS_session_ttl_s);
  o.runner = RunnerOptionsFromFlags();
  o.defaults.look_ahead = absl::GetFlag(FLAGS_default_look_ahead);
  o.defaults.keep_ratio =
      static_cast<float>(absl::GetFlag(FLAGS_default_keep_ratio));
  o.defaults.keep_mass =
      static_cast<float>(absl::GetFlag(FLAGS_default_keep_mass));
  o.defaults.chunk_size = absl::GetFlag(FLAGS_default_chunk_size);
  o.defaults.pool_kernel_size = absl::GetFlag(FLAGS_default_pool_kernel_size);
  o.defaults.keep_first = absl::GetFlag(FLAGS_default_keep_first);
  o.defaults.keep_last = absl::GetFlag(FLAGS_default_keep_last);
  o.defaults.min_prompt_tokens = absl::GetFlag(FLAGS_default_min_prompt_tokens);

  SetEngineThreads(o.engine_threads);
  EnableHealthAndReflection();
  auto server = SpeculatorServer::Create(o);
  if (!server.ok()) {
    std::fprintf(stderr, "error: %s\n", server.status().ToString().c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return ServeUntilStopSignal("speculator_service", **server,
                              absl::GetFlag(FLAGS_port),
                              absl::GetFlag(FLAGS_metrics_port),
                              (*server)->registry_ptr(), stop, absl::Seconds(5));
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
