#ifndef SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_MAIN_H_
#define SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_MAIN_H_

// The shared end of the two model services' main() (the router, which has
// no model, uses server_main.h directly).

#include <signal.h>

#include <cstdio>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/service/model_service_options.h"
#include "common/service/server_main.h"

namespace specserve {

/// The end of a model service's main(): a failed Create (`server` not ok)
/// is printed as "<name>: <status>" and exits 2 for INVALID_ARGUMENT (a bad
/// option) or 1; else ServeUntilStopSignal on `options`' host and grace,
/// serving the registry `registry(server)` returns.
template <typename Server, typename RegistryFn>
int ServeModelService(const char* name,
                      absl::StatusOr<std::unique_ptr<Server>> server,
                      RegistryFn registry, const ModelServiceOptions& options,
                      int port, int metrics_port, const sigset_t& stop) {
  if (!server.ok()) {
    std::fprintf(stderr, "%s: %s\n", name,
                 server.status().ToString().c_str());
    return absl::IsInvalidArgument(server.status()) ? 2 : 1;
  }
  return ServeUntilStopSignal(name, **server, port, options.host,
                              metrics_port, registry(**server), stop,
                              options.shutdown_grace);
}

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_MODEL_SERVICE_MAIN_H_
