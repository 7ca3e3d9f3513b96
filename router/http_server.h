#ifndef SPECSERVE_ROUTER_HTTP_SERVER_H_
#define SPECSERVE_ROUTER_HTTP_SERVER_H_

// The router's OpenAI-compatible HTTP API, served with
// cpp-httplib next to the gRPC API and on the same request path: every
// request is admitted by RouterServer::Admit and run by a RequestRunner over
// the router's backends, so limits, metrics, deadlines and cancellation are
// the gRPC API's.
//
//   POST /v1/completions       prompt (text or token ids) -> text
//   POST /v1/chat/completions  messages (chat template) -> assistant message
//   GET  /v1/models            the target's model id
//   GET  /health               200 while a compatible target replica is
//                              healthy, else 503
//
// Streaming responses are Server-Sent Events (router/openai_api.h). A
// stream's status line waits up to 1 s for the first chunk: errors before it
// (validation, queue full, target down) are plain error responses; later
// errors are an error event before `data: [DONE]`. A client that closes a
// stream cancels the request (both services free their sessions) within one
// poll period (100 ms) once the status line is out (at the first chunk or
// after 1 s). A non-streaming request runs to its end (bounded by
// max_tokens and the deadline) even if its client has gone.

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/openai_api.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace specserve {

class RequestRunner;
class RouterServer;

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  /// --api_key / SPECSERVE_API_KEY: when non-empty, /v1/* needs the header
  /// "Authorization: Bearer <key>" (compared in constant time), else 401.
  /// /health stays open (probes).
  std::string api_key;
  /// Larger request bodies get 413.
  size_t max_body_bytes = size_t{8} << 20;
  /// Connection threads; 0 = the router's max_concurrent_requests + 8, so
  /// the router's admission (429), not a queue, bounds the requests.
  int threads = 0;
  /// How chat messages become prompts; null render = ChatFormatFor(the
  /// router's --tokenizer directory).
  openai::ChatFormat chat;
};

/// Serves the OpenAI API over `router` (which must outlive it and be
/// started for requests to succeed). Thread-safe.
class HttpServer {
 public:
  /// INVALID_ARGUMENT for max_body_bytes == 0, threads < 0, or a
  /// tokenizer_config.json chat template that does not parse.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Create(
      RouterServer* router, HttpServerOptions options);
  ~HttpServer();  ///< Shutdown(no grace).

  /// Binds host:port (0 = any free port) and serves on a thread.
  /// UNAVAILABLE if the port cannot be bound; FAILED_PRECONDITION if
  /// already started.
  absl::Status Start(int port);
  /// The bound port after Start, else 0.
  int port() const { return port_; }
  /// Stops accepting connections, gives running requests `grace`, then
  /// cancels the rest and waits for them. Idempotent.
  void Shutdown(absl::Duration grace = absl::ZeroDuration());

  /// Requests being served now (tests: back to 0 after a disconnect).
  int active() const;

 private:
  struct Stream;
  HttpServer(RouterServer* router, HttpServerOptions options);
  void Register(RequestRunner* runner);
  void Unregister(RequestRunner* runner);

  RouterServer* const router_;
  const HttpServerOptions options_;
  std::unique_ptr<httplib::Server> server_;
  std::thread listener_;
  std::atomic<bool> listener_done_{false};
  int port_ = 0;

  mutable absl::Mutex mu_;
  absl::flat_hash_set<RequestRunner*> running_ ABSL_GUARDED_BY(mu_);
  bool cancel_all_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;

  friend class HttpHandlers;  // http_server.cc: the route handlers
};

/// The router binary's servers as one ServeUntilStopSignal server: the gRPC
/// router and, when http_port != 0, the HTTP API on the same host.
class RouterWithHttp {
 public:
  /// INVALID_ARGUMENT for http_port outside [0, 65535] and HttpServer's.
  static absl::StatusOr<std::unique_ptr<RouterWithHttp>> Create(
      RouterServer* router, HttpServerOptions options, int http_port);
  /// Starts gRPC on `port`, then HTTP (printing "http on <port>" to stderr).
  absl::Status Start(int port);
  int port() const;
  /// HTTP first (its requests get `grace`), then gRPC.
  void Shutdown(absl::Duration grace);

 private:
  RouterWithHttp(RouterServer* router, std::unique_ptr<HttpServer> http,
                 int http_port)
      : router_(router), http_(std::move(http)), http_port_(http_port) {}
  RouterServer* const router_;
  const std::unique_ptr<HttpServer> http_;  // null: HTTP off
  const int http_port_;
};

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_HTTP_SERVER_H_
