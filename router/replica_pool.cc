#include "router/replica_pool.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace specserve {
namespace {

constexpr absl::string_view kDnsLong = "dns:///";
constexpr absl::string_view kDnsShort = "dns:";

// Splits "host:port" / "[v6]:port" into its parts.
bool SplitHostPort(absl::string_view s, std::string* host, std::string* port) {
  size_t colon;
  if (!s.empty() && s.front() == '[') {
    const size_t close = s.find(']');
    if (close == absl::string_view::npos || close + 1 >= s.size() ||
        s[close + 1] != ':') {
      return false;
    }
    *host = std::string(s.substr(1, close - 1));
    colon = close + 1;
  } else {
    colon = s.rfind(':');
    if (colon == absl::string_view::npos) return false;
    *host = std::string(s.substr(0, colon));
  }
  *port = std::string(s.substr(colon + 1));
  int p = 0;
  return !host->empty() && absl::SimpleAtoi(*port, &p) && p >= 1 && p <= 65535;
}

// The "name:port" part of a DNS entry, or empty if `entry` is not one.
absl::string_view DnsTarget(absl::string_view entry) {
  if (absl::StartsWith(entry, kDnsLong)) return entry.substr(kDnsLong.size());
  if (absl::StartsWith(entry, kDnsShort)) {
    return entry.substr(kDnsShort.size());
  }
  return {};
}

grpc::ChannelArguments ChannelArgs(const std::string& server_name) {
  grpc::ChannelArguments args;
  if (!server_name.empty()) args.SetSslTargetNameOverride(server_name);
  // Notice a restarted replica within seconds (the default backoff grows to
  // two minutes), and keep each replica's connection state its own.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseReplicaList(
    absl::string_view list, absl::string_view flag) {
  std::vector<std::string> out;
  for (absl::string_view raw : absl::StrSplit(list, ',')) {
    const absl::string_view entry = absl::StripAsciiWhitespace(raw);
    if (entry.empty()) continue;
    const absl::string_view dns = DnsTarget(entry);
    std::string host, port;
    if (!SplitHostPort(dns.empty() ? entry : dns, &host, &port)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": entry \"", entry,
                       "\" is not host:port or dns:///name:port with a port in "
                       "[1, 65535]"));
    }
    out.emplace_back(entry);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> ResolveReplicaEntry(
    const std::string& entry) {
  const absl::string_view dns = DnsTarget(entry);
  if (dns.empty()) return std::vector<std::string>{entry};
  std::string host, port;
  if (!SplitHostPort(dns, &host, &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad DNS entry \"", entry, "\""));
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", entry, ": ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    std::string addr;
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr,
                buf, sizeof(buf));
      addr = absl::StrCat(buf, ":", port);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6,
                &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf,
                sizeof(buf));
      addr = absl::StrCat("[", buf, "]:", port);
    } else {
      continue;
    }
    if (std::find(out.begin(), out.end(), addr) == out.end()) {
      out.push_back(addr);
    }
  }
  freeaddrinfo(res);
  if (out.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", entry, ": no addresses"));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ReplicaPool>> ReplicaPool::Create(
    absl::string_view list, absl::string_view flag, ReplicaPoolOptions options,
    InfoFn info, CheckFn check) {
  auto entries = ParseReplicaList(list, flag);
  if (!entries.ok()) return entries.status();
  std::unique_ptr<ReplicaPool> pool(
      new ReplicaPool(*std::move(entries), std::move(options), std::move(info),
                      std::move(check)));
  pool->Resolve();
  return pool;
}

ReplicaPool::ReplicaPool(std::vector<std::string> entries,
                         ReplicaPoolOptions options, InfoFn info, CheckFn check)
    : entries_(std::move(entries)),
      options_(std::move(options)),
      info_fn_(std::move(info)),
      check_fn_(std::move(check)),
      resolved_(entries_.size()) {}

ReplicaPool::~ReplicaPool() { Stop(); }

void ReplicaPool::Start() {
  Refresh(/*resolve=*/false);  // Create resolved already
  thread_ = std::thread([this] { Loop(); });
}

void ReplicaPool::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ReplicaPool::Loop() {
  absl::MutexLock lock(&mu_);
  while (
      !mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.health_period)) {
    const bool resolve = absl::Now() - last_resolve_ >= options_.resolve_period;
    mu_.Unlock();
    Refresh(resolve);
    mu_.Lock();
  }
}

void ReplicaPool::Resolve() {
  std::vector<std::vector<std::string>> resolved(entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i) {
    auto r = ResolveReplicaEntry(entries_[i]);
    if (r.ok()) {
      resolved[i] = *std::move(r);
    } else {
      std::fprintf(stderr, "router: %s replica list: %s\n",
                   options_.service.c_str(), r.status().ToString().c_str());
    }
  }
  absl::MutexLock lock(&mu_);
  last_resolve_ = absl::Now();
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!resolved[i].empty()) resolved_[i] = std::move(resolved[i]);
  }
  std::vector<std::shared_ptr<State>> next;
  for (const auto& addrs : resolved_) {
    for (const std::string& a : addrs) {
      const auto same = [&a](const std::shared_ptr<State>& s) {
        return s->address == a;
      };
      if (std::any_of(next.begin(), next.end(), same)) continue;
      auto old = std::find_if(replicas_.begin(), replicas_.end(), same);
      if (old != replicas_.end()) {
        next.push_back(*old);
        continue;
      }
      auto s = std::make_shared<State>();
      s->address = a;
      s->channel = grpc::CreateCustomChannel(
          a,
          options_.credentials != nullptr ? options_.credentials
                                          : grpc::InsecureChannelCredentials(),
          ChannelArgs(options_.server_name));
      next.push_back(std::move(s));
    }
  }
  replicas_ = std::move(next);
}

ReplicaPool::State ReplicaPool::Check(State s) const {
  s.checked = true;
  s.last_check = absl::Now();
  v1::ModelInfo info;
  const grpc::Status st =
      info_fn_(s.channel, absl::Now() + options_.info_timeout, &info);
  if (!st.ok()) {
    // An unreachable replica serves nothing, so it blocks nothing either.
    s.verified = s.healthy = false;
    s.mismatch = absl::OkStatus();
    s.last_error = absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                                st.error_message())
                       .ToString();
    return s;
  }
  s.last_error.clear();
  s.info = info;
  s.verified = true;
  s.mismatch = check_fn_ ? check_fn_(s.address, info) : absl::OkStatus();
  s.healthy = s.mismatch.ok();
  return s;
}

void ReplicaPool::Refresh(bool resolve) {
  absl::MutexLock pass(&refresh_mu_);
  if (resolve) Resolve();
  std::vector<std::pair<std::shared_ptr<State>, State>> todo;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& s : replicas_) todo.emplace_back(s, *s);
  }
  for (auto& [ptr, snap] : todo) {
    const grpc_connectivity_state conn = snap.channel->GetState(false);
    if (snap.verified && conn == GRPC_CHANNEL_READY &&
        absl::Now() - snap.last_check < options_.recheck_period) {
      continue;
    }
    const State next = Check(snap);
    // Compared with the state as it is now, not the snapshot: a request's
    // ReportFailure may have logged the same transition meanwhile.
    bool changed;
    {
      absl::MutexLock lock(&mu_);
      changed = !ptr->checked || next.healthy != ptr->healthy ||
                next.mismatch != ptr->mismatch;
      *ptr = next;
    }
    if (changed) {
      std::string why(next.mismatch.message());
      if (why.empty() && !next.last_error.empty()) {
        why = absl::StrCat(" (", next.last_error, ")");
      }
      Log(absl::StrCat("router: ", options_.service, " replica ",
                       snap.address, " is ",
                       next.healthy    ? "healthy"
                       : next.verified ? "INCOMPATIBLE: "
                                       : "unreachable",
                       why));
    }
  }
}

absl::StatusOr<Replica> ReplicaPool::Pick() {
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool on_demand = false;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& s : replicas_) {
        if (!s->mismatch.ok()) return s->mismatch;
      }
      std::vector<State*> healthy;
      for (const auto& s : replicas_) {
        if (s->healthy) healthy.push_back(s.get());
      }
      if (!healthy.empty()) {
        const State* s = healthy[next_++ % healthy.size()];
        return Replica{s->address, s->channel};
      }
      const absl::Time now = absl::Now();
      if (attempt == 0 && now - last_on_demand_ >= absl::Milliseconds(200)) {
        last_on_demand_ = now;
        on_demand = true;
      }
    }
    if (!on_demand || !refresh_mu_.TryLock()) break;
    refresh_mu_.Unlock();  // Refresh takes it again; a race only skips one
    Refresh(/*resolve=*/false);
  }
  std::vector<std::string> tried;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& s : replicas_) {
      tried.push_back(s->last_error.empty()
                          ? s->address
                          : absl::StrCat(s->address, ": ", s->last_error));
    }
  }
  return absl::UnavailableError(absl::StrCat("no healthy ", options_.service,
                                             " replica (tried ",
                                             absl::StrJoin(tried, "; "), ")"));
}

void ReplicaPool::ReportFailure(const std::string& address) {
  bool went_down = false;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& s : replicas_) {
      if (s->address != address) continue;
      went_down |= s->healthy;
      s->verified = s->healthy = false;
      s->checked = true;  // the next check logs only a change from here
    }
  }
  // A request found it down before a health check did: this is the
  // transition, so it is logged here (the check that follows sees an
  // unhealthy replica staying unhealthy and stays quiet).
  if (went_down) {
    Log(absl::StrCat("router: ", options_.service, " replica ", address,
                     " is unreachable (a call to it failed)"));
  }
}

void ReplicaPool::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

absl::Status ReplicaPool::compatibility() const {
  absl::MutexLock lock(&mu_);
  for (const auto& s : replicas_) {
    if (!s->mismatch.ok()) return s->mismatch;
  }
  return absl::OkStatus();
}

std::vector<std::string> ReplicaPool::endpoints() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& s : replicas_) out.push_back(s->address);
  return out;
}

std::optional<v1::ModelInfo> ReplicaPool::model_info() const {
  absl::MutexLock lock(&mu_);
  std::optional<v1::ModelInfo> any;
  for (const auto& s : replicas_) {
    if (s->healthy) return s->info;
    if (s->verified && !any) any = s->info;
  }
  return any;
}

int ReplicaPool::num_healthy() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(std::count_if(
      replicas_.begin(), replicas_.end(),
      [](const std::shared_ptr<State>& s) { return s->healthy; }));
}

}  // namespace specserve
