#include "router/target_client.h"

#include "absl/strings/str_cat.h"
#include "common/service/grpc_util.h"
#include "protos/target.grpc.pb.h"

namespace specserve {

absl::Status TargetError(const grpc::Status& g, const Replica& replica,
                         ReplicaPool* pool) {
  absl::Status s = FromGrpcStatus(g);
  if (absl::IsUnavailable(s)) {
    pool->ReportFailure(replica.address);
    return absl::UnavailableError(absl::StrCat(
        "target replica ", replica.address, " unavailable: ", s.message()));
  }
  if (s.ok()) {
    return absl::InternalError(absl::StrCat("target replica ", replica.address,
                                            " ended the stream early"));
  }
  return s;
}

ReplicaPool::InfoFn TargetInfoFn() {
  return [](const std::shared_ptr<grpc::Channel>& channel, absl::Time deadline,
            v1::ModelInfo* info) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    return v1::Target::NewStub(channel)->Info(&ctx, v1::InfoRequest(), info);
  };
}

}  // namespace specserve
