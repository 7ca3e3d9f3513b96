// specserve target service: serves specserve.v1.Target (protos/target.proto)
// for one model, with health, reflection and Prometheus /metrics.
//
//   target_service --model=models/stories260K --port=50052 --metrics_port=9092
//
// Prints "listening on <port>, metrics on <port>" to stderr when ready;
// SIGINT/SIGTERM stop it (streams get --shutdown_grace_s to finish). The
// flags shared with the speculator are common/service/model_service_flags.h.

#include <signal.h>

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/engine/cpu_model_runner.h"
#include "common/service/grpc_util.h"
#include "common/service/model_service_flags.h"
#include "common/service/model_service_main.h"
#include "common/service/server_main.h"
#include "target_service/target_server.h"

ABSL_FLAG(int, port, 50052, "gRPC port (0 = any free port)");
ABSL_FLAG(int, metrics_port, 9092, "Prometheus /metrics port (0 = any)");
ABSL_FLAG(int, engine_threads, 0,
          "OpenBLAS / engine threads per forward (0 = library default)");
ABSL_FLAG(int, threads, 0, "deprecated: --engine_threads");
ABSL_FLAG(int, max_sessions, 256,
          "concurrent Generate streams admitted (vLLM's max_num_seqs "
          "default); more wait in the queue");
ABSL_FLAG(int, max_waiting_requests, 1024,
          "streams that wait for admission before RESOURCE_EXHAUSTED");
ABSL_FLAG(int, default_max_new_tokens, 256,
          "max_new_tokens for requests that leave it 0");
ABSL_FLAG(int, max_drafts, 64, "drafts per message at most, [0, 64]");

namespace specserve {
namespace {

int Run() {
  const sigset_t stop = BlockStopSignals();
  auto flags = ModelServiceOptionsFromFlags();
  if (!flags.ok()) {
    std::fprintf(stderr, "target_service: %s\n",
                 flags.status().ToString().c_str());
    return 2;
  }
  EnableHealthAndReflection();
  TargetServerOptions options;
  static_cast<ModelServiceOptions&>(options) = *flags;
  options.engine_threads = absl::GetFlag(FLAGS_engine_threads);
  if (absl::GetFlag(FLAGS_threads) != 0) {
    std::fprintf(stderr,
                 "target_service: --threads is deprecated, use "
                 "--engine_threads\n");
    if (options.engine_threads == 0) {
      options.engine_threads = absl::GetFlag(FLAGS_threads);
    }
  }
  options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.max_waiting_requests = absl::GetFlag(FLAGS_max_waiting_requests);
  options.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  options.max_drafts = absl::GetFlag(FLAGS_max_drafts);
  return ServeModelService(
      "target_service", TargetServer::Create(options),
      [](TargetServer& s) { return s.registry(); }, options,
      absl::GetFlag(FLAGS_port), absl::GetFlag(FLAGS_metrics_port), stop);
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  specserve::InitServerProcess();
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
