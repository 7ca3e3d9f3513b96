// The speculator service binary: Speculative Prefill scoring and draft
// proposals over gRPC (protos/speculator.proto), metrics over HTTP.
//   bazel run //speculator_service:speculator_service -- --model
//       models/stories260K-draft --port 50061 --metrics_port 9161
// Prints "listening on <port>, metrics on <port>" to stderr when ready and
// shuts down cleanly on SIGINT / SIGTERM. Exit status 2 for bad flags. The
// flags shared with the target are common/service/model_service_flags.h.

#include <csignal>
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/engine/cpu_model_runner.h"
#include "common/service/grpc_util.h"
#include "common/service/model_service_flags.h"
#include "common/service/model_service_main.h"
#include "common/service/server_main.h"
#include "common/service/spec_prefill_flags.h"
#include "speculator_service/speculator_server.h"

ABSL_FLAG(int, port, 50061, "gRPC port (0 = any free port)");
ABSL_FLAG(int, metrics_port, 9161, "Prometheus /metrics port (0 = any)");
ABSL_FLAG(int, engine_threads, 1, "OpenBLAS / importance threads per forward");
ABSL_FLAG(int, max_queue, 1024,
          "Score / Draft operations queued or running before "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_sessions, 0,
          "live sessions before RESOURCE_EXHAUSTED; 0 = one per KV cache "
          "block of the pool, within [64, 4096]");
ABSL_FLAG(double, session_ttl_s, 300,
          "idle seconds before a session is reaped");

namespace specserve {
namespace {

int Run() {
  // Before the credentials: their check starts gRPC's threads.
  const sigset_t stop = BlockStopSignals();
  auto flags = ModelServiceOptionsFromFlags();
  if (!flags.ok()) {
    std::fprintf(stderr, "error: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  SpeculatorServerOptions o;
  static_cast<ModelServiceOptions&>(o) = *flags;
  o.engine_threads = absl::GetFlag(FLAGS_engine_threads);
  o.max_queue = absl::GetFlag(FLAGS_max_queue);
  o.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.session_ttl_s = absl::GetFlag(FLAGS_session_ttl_s);
  o.defaults = SpecPrefillDefaultsFromFlags();

  SetEngineThreads(o.engine_threads);
  EnableHealthAndReflection();
  return ServeModelService(
      "speculator_service", SpeculatorServer::Create(o),
      [](SpeculatorServer& s) { return s.registry_ptr(); }, o,
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
