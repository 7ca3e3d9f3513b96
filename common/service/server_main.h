#ifndef SPECSERVE_COMMON_SERVICE_SERVER_MAIN_H_
#define SPECSERVE_COMMON_SERVICE_SERVER_MAIN_H_

// The shared life of a service binary's main(): stop signals taken
// synchronously (no work in a signal handler), the ready line tests and
// scripts wait for, /metrics, and a graceful shutdown.

#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/service/grpc_util.h"
#include "prometheus/registry.h"

namespace specserve {

/// Process-wide settings of a server binary; call first in main(). Turns
/// off Abseil's Mutex deadlock detection: Debian's Abseil is built with it
/// on, and it then records every lock order in a global graph, with a
/// stack trace per new edge, under a global lock (measurable in each
/// scheduler step). Tests keep it on.
void InitServerProcess();

/// Blocks SIGINT and SIGTERM in the calling thread and in every thread it
/// starts afterwards, so ServeUntilStopSignal can sigwait for them, and
/// forwards them to the calling thread from any thread started before
/// (a library's). Call early in main(), in the thread that will serve.
sigset_t BlockStopSignals();

/// Starts `server` on `port`, serves `registry` at /metrics on
/// `host`:`metrics_port` (the server's listen address; port 0 = any free
/// port), prints "listening on <port>,
/// metrics on <port>" to stderr, waits for SIGINT/SIGTERM and shuts the
/// server down with `grace`. `Server` provides `absl::Status Start(int)`,
/// `int port()` and `void Shutdown(absl::Duration)`. Returns main()'s exit
/// code: 0 after a clean shutdown, 1 if the server or exposer cannot start.
template <typename Server>
int ServeUntilStopSignal(const char* name, Server& server, int port,
                         const std::string& host, int metrics_port,
                         std::shared_ptr<prometheus::Registry> registry,
                         const sigset_t& stop, absl::Duration grace) {
  if (absl::Status s = server.Start(port); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", name, s.ToString().c_str());
    return 1;
  }
  int bound_metrics_port = 0;
  auto exposer =
      StartMetricsExposer(host, metrics_port, std::move(registry),
                          &bound_metrics_port);
  if (!exposer.ok()) {
    std::fprintf(stderr, "%s: %s\n", name, exposer.status().ToString().c_str());
    server.Shutdown(absl::ZeroDuration());
    return 1;
  }
  std::fprintf(stderr, "listening on %d, metrics on %d\n", server.port(),
               bound_metrics_port);
  std::fflush(stderr);
  int sig = 0;
  sigwait(&stop, &sig);
  std::fprintf(stderr, "%s: signal %d, shutting down\n", name, sig);
  server.Shutdown(grace);
  return 0;
}

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_SERVER_MAIN_H_
