#ifndef SPECSERVE_ROUTER_SPECULATOR_CLIENT_H_
#define SPECSERVE_ROUTER_SPECULATOR_CLIENT_H_

// The router's client side of specserve.v1.Speculator (protos/
// speculator.proto): the Score call a request waits for with a timeout but
// never cancels, the Draft stream with a timeout per round, the background
// ReleaseSession, the replica health check, and what a failed call means
// for the request (its fallback reason). docs/ARCHITECTURE.md shows where
// they sit on a request's path.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "protos/speculator.grpc.pb.h"
#include "router/replica_pool.h"

namespace specserve {

/// How long a speculator call the request no longer waits for may live: a
/// ReleaseSession, or a Score past --speculator_deadline_ms. Generous: such
/// a call holds no request, and a speculator that is frozen or overloaded
/// for a while (SIGSTOP for 10 s in tests/faults_test) must still deliver
/// its answer when it catches up, or the session it opens stays until its
/// TTL.
inline constexpr absl::Duration kAbandonedCallDeadline = absl::Seconds(30);

/// The fallback reason (GenerationStats.fallback_reason) for a failed
/// speculator call: one of RouterMetrics::kFallbackReasons, then the
/// status code when that says more ("speculator_error: INTERNAL").
std::string FallbackReason(const absl::Status& status);

/// Releases speculator session `id` in the background: fire and forget, the
/// call frees itself when it ends (answered, failed or past
/// kAbandonedCallDeadline).
void ReleaseSessionAsync(std::shared_ptr<grpc::Channel> channel,
                         const std::string& id);

/// ReplicaPool::InfoFn for speculator replicas (their Info RPC).
ReplicaPool::InfoFn SpeculatorInfoFn();

/// Holds one Speculator.Draft stream (callback API) so that each round can
/// wait with a timeout (--speculator_deadline_ms), which a blocking stream
/// cannot. Round() and Close() are called from one thread; the reactions
/// run on gRPC threads. Close() must be called before destruction: it
/// returns only after OnDone.
class DraftStream final
    : public grpc::ClientBidiReactor<v1::DraftRequest, v1::DraftResponse> {
 public:
  /// Opens the stream on `channel`; the call's deadline is `deadline`.
  DraftStream(const std::shared_ptr<grpc::Channel>& channel,
              absl::Time deadline);

  /// The call's context (to cancel it with the request).
  grpc::ClientContext* context() { return &ctx_; }

  /// Sends `req` and waits up to `timeout` for its drafts: the response
  /// (the drafts, and a tree's parents), or DEADLINE_EXCEEDED (the stream
  /// is then cancelled), or the stream's error status (UNAVAILABLE when it
  /// broke without one).
  absl::StatusOr<v1::DraftResponse> Round(const v1::DraftRequest& req,
                                          absl::Duration timeout);

  /// Half-closes a healthy stream (the speculator keeps the session for
  /// ReleaseSession) or cancels a broken one, and waits for the end (at
  /// most `timeout`, then cancels). True if the stream ended cleanly.
  bool Close(absl::Duration timeout);

  // The reactions (gRPC threads).
  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

 private:
  // Drops the constructor's hold once no operation will be started any
  // more (never with mu_ held: OnDone may run inline and takes it).
  void ReleaseHold();

  absl::Status FailureLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<v1::Speculator::Stub> stub_;
  grpc::ClientContext ctx_;
  v1::DraftRequest req_;
  v1::DraftResponse resp_;
  absl::Mutex mu_;
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool read_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  bool hold_released_ = false;  // Round/Close thread only
};

/// One Speculator.Score call that the request waits for at most a timeout
/// (--speculator_deadline_ms) but does not cancel when it stops waiting:
/// a cancelled Score races with its answer (a speculator that was frozen
/// sees the call's deadline later than the router and may answer after the
/// router gave up, keeping a session nobody knows), so an abandoned call
/// runs on to its answer and a session it opened is released at once. The
/// state is shared with the gRPC callback, so it outlives the request.
class ScoreCall {
 public:
  /// Starts `req` on `channel`; the call's own deadline is `deadline`.
  static std::shared_ptr<ScoreCall> Start(
      std::shared_ptr<grpc::Channel> channel, const v1::ScoreRequest& req,
      absl::Time deadline);

  /// The call's context (to cancel it with the request).
  grpc::ClientContext* context() { return &ctx_; }

  /// Waits up to `timeout` for the answer: the response, the call's error,
  /// or DEADLINE_EXCEEDED (then the call is abandoned, see above).
  absl::StatusOr<v1::ScoreResponse> Wait(absl::Duration timeout);

 private:
  explicit ScoreCall(std::shared_ptr<grpc::Channel> channel);
  void OnDone(grpc::Status s);

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Speculator::Stub> stub_;
  grpc::ClientContext ctx_;
  v1::ScoreRequest req_;
  v1::ScoreResponse resp_;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_SPECULATOR_CLIENT_H_
