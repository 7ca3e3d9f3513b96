#ifndef SPECSERVE_ROUTER_TARGET_CLIENT_H_
#define SPECSERVE_ROUTER_TARGET_CLIENT_H_

// The router's client side of specserve.v1.Target (protos/target.proto):
// the replica health check and what a failed Generate stream means for
// the request. The stream itself is driven by the generation loop
// (request_runner.cc).

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "router/replica_pool.h"

namespace specserve {

/// A target call's status as the client should see it: UNAVAILABLE names
/// the replica (and reports it to `pool`, which then re-checks it), a
/// stream that ended OK before a finish reason is INTERNAL, anything else
/// as the target said.
absl::Status TargetError(const grpc::Status& status, const Replica& replica,
                         ReplicaPool* pool);

/// ReplicaPool::InfoFn for target replicas (their Info RPC).
ReplicaPool::InfoFn TargetInfoFn();

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_TARGET_CLIENT_H_
