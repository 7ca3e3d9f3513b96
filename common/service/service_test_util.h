#ifndef SPECSERVE_COMMON_SERVICE_SERVICE_TEST_UTIL_H_
#define SPECSERVE_COMMON_SERVICE_SERVICE_TEST_UTIL_H_

// Helpers for tests of the gRPC services: polling with a deadline,
// Prometheus text lookups, raw unary calls (the system headers ship no
// generated health or reflection stubs) and a plain HTTP GET for /metrics.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace specserve {
namespace service_test {

/// Polls `cond` every 5 ms for up to 10 s; returns its last value.
bool Eventually(const std::function<bool()>& cond);

/// The value of the Prometheus text-format series `name` whose labels
/// contain every string in `labels`; NaN if absent.
double MetricValue(const std::string& text, const std::string& name,
                   const std::vector<std::string>& labels = {});

/// A raw unary call through the generic stub: one serialized request,
/// half-close, one serialized response; 10 s deadline. The call's status
/// on failure; INTERNAL if no response came.
absl::StatusOr<std::string> RawCall(const std::shared_ptr<grpc::Channel>& ch,
                                    const std::string& method,
                                    const std::string& request);

/// GET http://127.0.0.1:<port><path> with a raw socket (5 s timeouts); the
/// whole HTTP response (status line, headers, body), or "" on failure.
std::string HttpGet(int port, const std::string& path);

}  // namespace service_test
}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_SERVICE_TEST_UTIL_H_
