#ifndef SPECSERVE_ROUTER_REPLICA_POOL_H_
#define SPECSERVE_ROUTER_REPLICA_POOL_H_

// The router's view of one backend service (speculator or target): a set of
// replicas, each with its own gRPC channel, health-checked with Info (which
// also carries the tokenizer fingerprint the router must match), picked
// round-robin among the healthy ones.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "protos/common.pb.h"

namespace specserve {

/// Splits a `--speculator` / `--target` flag value: comma-separated entries,
/// each "host:port", "[v6addr]:port" or "dns:///name:port" (also
/// "dns:name:port"); spaces around entries are ignored. Returns the entries
/// as written (DNS names unresolved); an empty list for an empty value.
/// INVALID_ARGUMENT naming `flag` and the entry for a missing host or a port
/// outside [1, 65535].
absl::StatusOr<std::vector<std::string>> ParseReplicaList(
    absl::string_view list, absl::string_view flag);

/// Expands one ParseReplicaList entry into dialable "ip:port" addresses
/// ("[ip6]:port" for IPv6): "dns:///name:port" is resolved with getaddrinfo
/// (all addresses, deduplicated, in resolver order); anything else is
/// returned unchanged (gRPC resolves it). UNAVAILABLE naming the entry if
/// resolution fails or finds nothing.
absl::StatusOr<std::vector<std::string>> ResolveReplicaEntry(
    const std::string& entry);

/// Tuning of a ReplicaPool; the defaults are what the router binary uses.
struct ReplicaPoolOptions {
  std::string service = "backend";  ///< "speculator" / "target", for messages.
  absl::Duration health_period = absl::Seconds(1);    ///< background checks.
  absl::Duration resolve_period = absl::Seconds(30);  ///< DNS re-resolution.
  absl::Duration info_timeout = absl::Seconds(2);     ///< per Info call.
  /// A healthy replica whose channel stays READY is asked for its Info
  /// again this often: a peer that stopped answering without closing the
  /// connection (a frozen process, a node gone without a TCP reset; gRPC
  /// keeps such a channel READY) leaves the pool within recheck_period +
  /// info_timeout instead of taking new requests until they time out.
  absl::Duration recheck_period = absl::Seconds(10);
  /// Credentials of every replica channel (common/service/tls.h's
  /// MakeChannelSecurity); null = plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  /// Name replica certificates must carry instead of the dialled address
  /// (gRPC's SSL target-name override); "" = the address's host.
  std::string server_name;
  /// Where health transitions are logged, one line each way per change
  /// ("router: target replica ADDR is unreachable (...)", "... is
  /// healthy"); null = stderr.
  std::function<void(const std::string&)> log;
};

/// One replica handed to a request: its address and channel. The channel
/// stays valid after the replica leaves the pool.
struct Replica {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
};

/// Replicas of one service. A replica is healthy when its last Info call
/// succeeded, its ModelInfo passed the compatibility check, and its channel
/// has stayed READY since; any other channel state (a dropped connection, a
/// reconnect) triggers a fresh Info before it is used again, so a replica
/// restarted with another model is caught, and a READY one is asked again
/// every recheck_period. Checks run on a background
/// thread every health_period; DNS entries are re-resolved every
/// resolve_period (new addresses join unverified, vanished ones leave).
/// Thread-safe.
class ReplicaPool {
 public:
  /// Fetches the replica's ModelInfo by a call on `channel` with `deadline`.
  using InfoFn =
      std::function<grpc::Status(const std::shared_ptr<grpc::Channel>& channel,
                                 absl::Time deadline, v1::ModelInfo* info)>;
  /// OK, or FAILED_PRECONDITION (naming the replica `address` and both
  /// sides) when `info` does not match what the router serves.
  using CheckFn = std::function<absl::Status(const std::string& address,
                                             const v1::ModelInfo& info)>;

  /// Parses `list` (ParseReplicaList; `flag` names it in errors) and creates
  /// one channel per address; no RPCs yet (see Start). A null `check`
  /// accepts every replica.
  static absl::StatusOr<std::unique_ptr<ReplicaPool>> Create(
      absl::string_view list, absl::string_view flag,
      ReplicaPoolOptions options, InfoFn info, CheckFn check);
  ~ReplicaPool();  ///< Stop().

  /// Runs one full check synchronously (resolve + Info on every replica,
  /// bounded by info_timeout each), then starts the background thread.
  void Start();
  /// Stops the background thread. Idempotent.
  void Stop();
  /// One pass: re-resolves DNS entries if `resolve`, then re-checks every
  /// replica that is not verified-and-READY. Serialised with other passes.
  void Refresh(bool resolve);

  /// The next healthy replica, round-robin. FAILED_PRECONDITION (the check's
  /// message) while any replica is incompatible; UNAVAILABLE naming the
  /// addresses, each with why its last Info failed (e.g. a TLS handshake
  /// error), when none is healthy (after one on-demand re-check, at most
  /// every 200 ms, unless a pass is already running).
  absl::StatusOr<Replica> Pick();
  /// A call to `address` failed as if the replica were down: it is not
  /// picked again before a fresh Info succeeds.
  void ReportFailure(const std::string& address);

  /// OK, or the first incompatibility found among the current replicas.
  absl::Status compatibility() const;
  /// Current addresses (DNS entries expanded), in configuration order.
  std::vector<std::string> endpoints() const;
  /// ModelInfo of a healthy replica (else of any verified one), if known.
  std::optional<v1::ModelInfo> model_info() const;
  int num_healthy() const;
  /// True when the flag listed no replica.
  bool empty() const { return entries_.empty(); }

 private:
  void Log(const std::string& line) const;
  struct State {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    bool checked = false;   // at least one Check ran (for logging)
    bool verified = false;  // Info OK and checked since the last drop
    bool healthy = false;   // verified and compatible
    absl::Status mismatch;  // the check's verdict
    std::string last_error;  // why the last Info failed ("" = it did not)
    std::optional<v1::ModelInfo> info;
    absl::Time last_check = absl::InfinitePast();  // of the last Check
  };

  ReplicaPool(std::vector<std::string> entries, ReplicaPoolOptions options,
              InfoFn info, CheckFn check);
  // Re-expands the entries; keeps the old addresses of a failing DNS entry.
  void Resolve();
  // Calls Info on `s` (a snapshot) and returns the updated verdict.
  State Check(State s) const;
  void Loop();

  const std::vector<std::string> entries_;
  const ReplicaPoolOptions options_;
  const InfoFn info_fn_;
  const CheckFn check_fn_;

  absl::Mutex refresh_mu_;  // one pass at a time
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<State>> replicas_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<std::string>> resolved_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_on_demand_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_resolve_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_REPLICA_POOL_H_
