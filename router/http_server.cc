#include "router/http_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"
#include "httplib.h"
#include "router/api_key.h"
#include "router/chat_format.h"
#include "router/request_options.h"
#include "router/request_runner.h"
#include "router/router_server.h"
#include "router/output_processor.h"

namespace specserve {

using json = nlohmann::json;

namespace {

constexpr char kJson[] = "application/json";
// How often a stream waiting for tokens checks that its client is there.
constexpr absl::Duration kPollPeriod = absl::Milliseconds(100);
// How long a stream's status line waits for its first chunk (so that early
// errors are HTTP errors); after that it is sent, and a client that hangs
// up while the request waits (e.g. in the target's queue) is noticed.
constexpr absl::Duration kFirstChunkWait = absl::Seconds(1);

std::string Dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

void SendError(httplib::Response& res, const absl::Status& status) {
  res.status = openai::HttpStatus(status);
  res.set_content(Dump(openai::ErrorBody(status)), kJson);
}

// A body of more than `cap` bytes (HTTP 413 with this message).
absl::Status TooLarge(size_t cap) {
  return absl::InvalidArgumentError(absl::StrCat(
      "the request body is larger than ", cap, " bytes (--http_max_body_bytes)"));
}

// POST bodies must say they are JSON: a browser page may post text/plain,
// application/x-www-form-urlencoded or multipart/form-data to another
// origin without a CORS preflight, but not application/json, so an
// unauthenticated router on a developer's machine cannot be driven from
// any page its user visits. Parameters (charset) are allowed; the media
// type is case-insensitive (RFC 9110, section 8.3.1).
absl::Status CheckContentType(const httplib::Request& req) {
  const std::string type = req.get_header_value("Content-Type");
  absl::string_view media(type);
  media = media.substr(0, media.find(';'));
  media = absl::StripAsciiWhitespace(media);
  if (absl::EqualsIgnoreCase(media, kJson)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the request body must be JSON with 'Content-Type: application/json'",
      type.empty() ? " (none was sent)"
                   : absl::StrCat(" (got '", type, "')")));
}

// The id clients pass as `model`: the target's model id.
std::string ModelName(RouterServer& router) {
  auto info = router.target_pool().model_info();
  return info ? info->model_id() : "";
}

// `echo`'s text of each prompt: as sent, or its ids decoded by the
// router's tokenizer ("" without one, as the rest of such a response).
std::vector<std::string> EchoTexts(const openai::ParsedRequest& p,
                                   RouterServer& router) {
  std::vector<std::string> out;
  for (int i = 0; i < p.num_prompts(); ++i) {
    const v1::GenerateTextRequest& r =
        i == 0 ? p.request : p.more_prompts[i - 1];
    std::string text = r.text();
    if (!r.has_token_ids() || router.tokenizer() == nullptr) {
      out.push_back(std::move(text));
      continue;
    }
    const auto& ids = r.token_ids().ids();
    absl::StatusOr<std::string> decoded =
        router.tokenizer()->Decode(std::vector<int>(ids.begin(), ids.end()));
    out.push_back(decoded.ok() ? *std::move(decoded) : "");
  }
  return out;
}

// NOT_FOUND (param "model") for a `model` other than the one served; ""
// (not sent) is the served one.
absl::Status CheckModel(RouterServer& router, const std::string& requested) {
  const std::string model = ModelName(router);
  if (requested.empty() || model.empty() || requested == model) {
    return absl::OkStatus();
  }
  return openai::WithParam(
      absl::NotFoundError(absl::StrCat("the model '", requested,
                                       "' does not exist; this server "
                                       "serves '",
                                       model, "'")),
      "model");
}

}  // namespace

// A streaming request: each choice's runner works on its own thread and
// queues SSE events; the connection thread writes them (httplib's content
// provider).
struct HttpServer::Stream {
  Stream(const RouterBackends* backends, openai::ResponseBuilder b, int n)
      : builder(std::move(b)), running(n) {
    for (int i = 0; i < n; ++i) {
      runners.push_back(std::make_unique<RequestRunner>(backends));
    }
  }
  void CancelAll() {
    for (auto& r : runners) r->Cancel();
  }
  std::vector<std::unique_ptr<RequestRunner>> runners;  // one per choice
  std::vector<std::thread> workers;
  absl::Mutex mu;
  openai::ResponseBuilder builder ABSL_GUARDED_BY(mu);
  std::deque<std::string> events ABSL_GUARDED_BY(mu);
  bool started ABSL_GUARDED_BY(mu) = false;  // a chunk arrived
  int running ABSL_GUARDED_BY(mu);           // choices not finished
  bool done ABSL_GUARDED_BY(mu) = false;     // every choice finished
  absl::Status status ABSL_GUARDED_BY(mu);   // the first error
};

class HttpHandlers {
 public:
  // POST bodies are read here rather than by httplib: httplib caps a body
  // with a Content-Length (413 before reading it) but not a chunked one, so
  // the cap (max_body_bytes -> 413) is applied to every chunk as it comes.
  static void Post(HttpServer* s, openai::Endpoint endpoint,
                   const httplib::Request& req, httplib::Response& res,
                   const httplib::ContentReader& reader) {
    std::string body;
    if (ReadBody(s, req, res, reader, &body)) Generate(s, endpoint, body, res);
  }

  // vLLM's POST /tokenize: a completions `prompt` (text, BOS prepended as
  // for a completion, or ids) or chat `messages` (rendered by the chat
  // template) -> {"count", "max_model_len", "tokens"}: the ids a request
  // with that prompt runs on.
  static void PostTokenize(HttpServer* s, const httplib::Request& req,
                           httplib::Response& res,
                           const httplib::ContentReader& reader) {
    std::string body;
    const std::optional<json> j = ReadJson(s, req, res, reader, &body);
    if (!j) return;
    const bool chat = j->contains("messages");
    const openai::Endpoint endpoint =
        chat ? openai::Endpoint::kChat : openai::Endpoint::kCompletions;
    auto parsed = openai::ParseRequest(endpoint, body, s->options_.chat,
                                       s->router_->tokenizer());
    if (!parsed.ok()) return SendError(res, parsed.status());
    if (absl::Status st = CheckModel(*s->router_, parsed->model); !st.ok()) {
      return SendError(res, st);
    }
    const auto info = s->router_->target_pool().model_info();
    const Tokenizer* tokenizer = s->router_->tokenizer();
    const int vocab = info ? info->vocab_size()
                           : (tokenizer ? tokenizer->vocab_size() : 0);
    auto ids = ResolvePrompt(parsed->request, tokenizer,
                             s->router_->backends()->max_bytes_per_token,
                             vocab, /*max_context=*/0);
    if (!ids.ok()) {
      return SendError(res, openai::NameParam(ids.status(), endpoint));
    }
    res.set_content(Dump({{"count", ids->size()},
                          {"max_model_len", info ? info->max_context() : 0},
                          {"tokens", *ids}}),
                    kJson);
  }

  // vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": text}.
  static void PostDetokenize(HttpServer* s, const httplib::Request& req,
                             httplib::Response& res,
                             const httplib::ContentReader& reader) {
    std::string body;
    const std::optional<json> j = ReadJson(s, req, res, reader, &body);
    if (!j) return;
    const Tokenizer* tokenizer = s->router_->tokenizer();
    const auto bad = [&](const std::string& message) {
      SendError(res, openai::ParamError("tokens", message));
    };
    const auto tokens = j->find("tokens");
    if (tokens == j->end() || !tokens->is_array()) {
      return bad("'tokens' must be an array of token ids");
    }
    if (const auto m = j->find("model"); m != j->end() && m->is_string()) {
      if (absl::Status st = CheckModel(*s->router_, m->get<std::string>());
          !st.ok()) {
        return SendError(res, st);
      }
    }
    if (tokenizer == nullptr) {
      return bad("detokenize needs the router's --tokenizer");
    }
    std::vector<int> ids;
    for (const json& t : *tokens) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
          t.get<int64_t>() >= tokenizer->vocab_size()) {
        return bad(absl::StrCat("'tokens' must be ids in [0, ",
                                tokenizer->vocab_size(), "), got ",
                                t.dump().substr(0, 32)));
      }
      ids.push_back(t.get<int>());
    }
    auto text = tokenizer->Decode(ids);
    if (!text.ok()) return SendError(res, text.status());
    res.set_content(Dump({{"prompt", *text}}), kJson);
  }

 private:
  // ReadBody, then openai::ParseBody: the body as a JSON object (its text
  // in *body), or nullopt when the answer was already set.
  static std::optional<json> ReadJson(HttpServer* s,
                                      const httplib::Request& req,
                                      httplib::Response& res,
                                      const httplib::ContentReader& reader,
                                      std::string* body) {
    if (!ReadBody(s, req, res, reader, body)) return std::nullopt;
    auto j = openai::ParseBody(*body);
    if (!j.ok()) {
      SendError(res, j.status());
      return std::nullopt;
    }
    return *std::move(j);
  }

  // Reads a POST body into *body; false when the answer (415, 413, 400)
  // was already set.
  static bool ReadBody(HttpServer* s, const httplib::Request& req,
                       httplib::Response& res,
                       const httplib::ContentReader& reader,
                       std::string* out) {
    const absl::Status type = CheckContentType(req);
    if (req.is_multipart_form_data()) {
      // httplib would read it only through its multipart parser.
      res.set_header("Connection", "close");
      SendError(res, type);
      res.status = 415;
      return false;
    }
    const size_t cap = s->options_.max_body_bytes;
    std::string body;
    size_t read = 0;
    bool too_large = false;
    // A body of the wrong type is still read (and dropped), up to the cap,
    // so the connection stays in step for the answer.
    if (!reader([&](const char* data, size_t n) {
          if (n > cap - read) {
            too_large = true;
            return false;
          }
          read += n;
          if (type.ok()) body.append(data, n);
          return true;
        })) {
      if (too_large) {
        std::string().swap(body);
        res.set_header("Connection", "close");  // the rest stays unread
        SendError(res, TooLarge(cap));
        res.status = 413;
      }
      return false;  // otherwise httplib set the status (413, 400)
    }
    if (!type.ok()) {
      SendError(res, type);
      res.status = 415;
      return false;
    }
    *out = std::move(body);
    return true;
  }

 public:
  static void Generate(HttpServer* s, openai::Endpoint endpoint,
                       const std::string& body, httplib::Response& res) {
    auto parsed = openai::ParseRequest(endpoint, body, s->options_.chat,
                                       s->router_->tokenizer());
    if (!parsed.ok()) return SendError(res, parsed.status());
    const std::string model = ModelName(*s->router_);
    if (absl::Status st = CheckModel(*s->router_, parsed->model); !st.ok()) {
      return SendError(res, st);
    }
    const bool chat = endpoint == openai::Endpoint::kChat;
    // Every prompt's n choices, prompt-major (OpenAI's choice order).
    std::vector<v1::GenerateTextRequest> requests =
        openai::ChoiceRequests(*parsed);
    const int n = static_cast<int>(requests.size());
    openai::ResponseBuilder builder(
        endpoint, openai::NewId(chat ? "chatcmpl-" : "cmpl-"),
        parsed->model.empty() ? model : parsed->model,
        absl::ToUnixSeconds(absl::Now()), parsed->include_usage, n,
        parsed->n);
    if (parsed->request.sampling().logprobs()) {
      builder.EnableLogprobs(s->router_->tokenizer());
    }
    if (parsed->echo) builder.EnableEcho(EchoTexts(*parsed, *s->router_));
    if (!parsed->tool_call.empty()) builder.EnableToolCall(parsed->tool_call);
    if (!parsed->read_tools.empty()) {
      builder.EnableToolCallParsing(parsed->read_tools);
    }
    if (!s->router_->Admit(n)) {
      return SendError(
          res, absl::ResourceExhaustedError(absl::StrCat(
                   "router at capacity: ",
                   s->router_->options().max_concurrent_requests,
                   " requests in flight (--max_concurrent_requests; a "
                   "request of n choices takes n, of each prompt)")));
    }
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + s->router_->options().request_deadline;
    if (!parsed->stream) {
      std::vector<v1::GenerateTextResponse> outs(n);
      const absl::Status st = RunChoices(s, requests, start, deadline, &outs);
      s->router_->Done(st, n);
      if (!st.ok()) return SendError(res, openai::NameParam(st, endpoint));
      res.set_content(Dump(builder.Response(outs)), kJson);
      return;
    }
    Stream(s, endpoint, std::move(requests), start, deadline,
           std::move(builder), res);
  }

 private:
  // Runs the choices' requests (one per choice, outs->size() of them) at
  // once (choice 0 on this thread), each into its response. The first
  // error cancels the others and is returned.
  static absl::Status RunChoices(
      HttpServer* s, const std::vector<v1::GenerateTextRequest>& requests,
      absl::Time start, absl::Time deadline,
      std::vector<v1::GenerateTextResponse>* outs) {
    const int n = static_cast<int>(outs->size());
    std::vector<std::unique_ptr<RequestRunner>> runners;
    for (int i = 0; i < n; ++i) {
      runners.push_back(
          std::make_unique<RequestRunner>(s->router_->backends()));
      s->Register(runners.back().get());
    }
    absl::Mutex mu;
    absl::Status first;  // guarded by mu
    const auto run = [&](int i) {
      const absl::Status st = runners[i]->Run(
          requests[i], start, deadline,
          [out = &(*outs)[i]](const v1::GenerateTextChunk& c) {
            AppendChunk(c, out);
          });
      if (st.ok()) return;
      {
        absl::MutexLock lock(&mu);
        if (!first.ok()) return;  // cancelled by that one
        first = st;
      }
      for (auto& r : runners) r->Cancel();
    };
    std::vector<std::thread> others;
    for (int i = 1; i < n; ++i) others.emplace_back(run, i);
    run(0);
    for (std::thread& t : others) t.join();
    for (auto& r : runners) s->Unregister(r.get());
    absl::MutexLock lock(&mu);
    return first;
  }

  static void Stream(HttpServer* s, openai::Endpoint endpoint,
                     std::vector<v1::GenerateTextRequest> requests,
                     absl::Time start, absl::Time deadline,
                     openai::ResponseBuilder builder, httplib::Response& res) {
    const int n = static_cast<int>(requests.size());
    auto call = std::make_shared<HttpServer::Stream>(s->router_->backends(),
                                                     std::move(builder), n);
    for (auto& r : call->runners) s->Register(r.get());
    HttpServer::Stream* c = call.get();
    for (int i = 0; i < n; ++i) {
      call->workers.emplace_back([s, c, i, n,
                                  request = std::move(requests[i]), start,
                                  deadline] {
        const absl::Status st = c->runners[i]->Run(
            request, start, deadline,
            [c, i](const v1::GenerateTextChunk& chunk) {
              absl::MutexLock lock(&c->mu);
              std::string ev = c->builder.StreamEvents(chunk, i);
              c->started = true;
              if (!ev.empty()) c->events.push_back(std::move(ev));
            });
        s->Unregister(c->runners[i].get());
        bool last, cancel_others = false;
        absl::Status status;
        {
          absl::MutexLock lock(&c->mu);
          if (!st.ok() && c->status.ok()) {
            c->status = st;
            cancel_others = true;
          }
          last = --c->running == 0;
          status = c->status;
        }
        if (cancel_others) c->CancelAll();
        if (!last) return;
        s->router_->Done(status, n);
        absl::MutexLock lock(&c->mu);
        c->done = true;
      });
    }
    // The status line waits for the first chunk (up to kFirstChunkWait):
    // errors before it are plain HTTP errors.
    bool failed;
    absl::Status early;
    {
      absl::MutexLock lock(&c->mu);
      c->mu.AwaitWithTimeout(
          absl::Condition(
              +[](HttpServer::Stream* x) ABSL_EXCLUSIVE_LOCKS_REQUIRED(x->mu) {
                return x->started || x->done;
              },
              c),
          kFirstChunkWait);
      failed = c->done && !c->started;
      early = c->status;
    }
    if (failed) {
      for (std::thread& t : call->workers) t.join();
      return SendError(res, openai::NameParam(early, endpoint));
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [call](size_t /*offset*/, httplib::DataSink& sink) {
          HttpServer::Stream* c = call.get();
          std::deque<std::string> batch;
          bool done;
          absl::Status status;
          {
            absl::MutexLock lock(&c->mu);
            c->mu.AwaitWithTimeout(
                absl::Condition(
                    +[](HttpServer::Stream* x)
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(x->mu) {
                          return x->done || !x->events.empty();
                        },
                    c),
                kPollPeriod);
            batch.swap(c->events);
            done = c->done;
            status = c->status;
          }
          for (const std::string& ev : batch) {
            if (!sink.write(ev.data(), ev.size())) {
              c->CancelAll();  // the client is gone
              return false;
            }
          }
          if (!done) {
            if (batch.empty() && !sink.is_writable()) {
              c->CancelAll();
              return false;
            }
            return true;  // called again
          }
          std::string tail;
          if (!status.ok()) {
            tail = openai::ResponseBuilder::ErrorEvent(status);
          }
          tail += openai::ResponseBuilder::DoneEvent();
          if (!sink.write(tail.data(), tail.size())) return false;
          sink.done();
          return true;
        },
        [call](bool /*success*/) {
          // Every path ends here (httplib runs it when the response dies).
          call->CancelAll();
          for (std::thread& t : call->workers) {
            if (t.joinable()) t.join();
          }
        });
  }
};

HttpServer::HttpServer(RouterServer* router, HttpServerOptions options)
    : router_(router),
      options_(std::move(options)),
      server_(std::make_unique<httplib::Server>()) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Create(
    RouterServer* router, HttpServerOptions options) {
  if (options.max_body_bytes == 0) {
    return absl::InvalidArgumentError("HTTP max_body_bytes must be > 0");
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP threads must be >= 0, got ", options.threads));
  }
  if (!options.chat.render) {
    auto format = ChatFormatFor(router->options().tokenizer_dir);
    if (!format.ok()) return format.status();
    options.chat = *std::move(format);
  }
  return std::unique_ptr<HttpServer>(new HttpServer(router, std::move(options)));
}

HttpServer::~HttpServer() { Shutdown(); }

absl::Status HttpServer::Start(int port) {
  if (listener_.joinable() || port_ != 0) {
    return absl::FailedPreconditionError("HTTP server already started");
  }
  const size_t threads =
      options_.threads > 0
          ? options_.threads
          : std::max(1, router_->options().max_concurrent_requests) + 8;
  httplib::Server& srv = *server_;
  srv.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  srv.set_payload_max_length(options_.max_body_bytes);
  srv.set_tcp_nodelay(true);  // stream chunks are small and latency-bound
  // httplib's default is SO_REUSEPORT, which lets a second server bind a
  // port in use and split its connections; SO_REUSEADDR only allows the
  // restart of one whose old connections linger in TIME_WAIT.
  int listen_fd = -1;
  srv.set_socket_options([&listen_fd](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd = sock;
  });
  srv.set_pre_routing_handler([this](const httplib::Request& req,
                                     httplib::Response& res) {
    if (options_.api_key.empty() || !absl::StartsWith(req.path, "/v1/")) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    if (absl::Status st =
            CheckApiKey(req.get_header_value("Authorization"),
                        options_.api_key, "the header 'Authorization");
        !st.ok()) {
      SendError(res, st);
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  srv.Post("/v1/completions",
           [this](const httplib::Request& req, httplib::Response& res,
                  const httplib::ContentReader& reader) {
             HttpHandlers::Post(this, openai::Endpoint::kCompletions, req, res,
                                reader);
           });
  srv.Post("/v1/chat/completions",
           [this](const httplib::Request& req, httplib::Response& res,
                  const httplib::ContentReader& reader) {
             HttpHandlers::Post(this, openai::Endpoint::kChat, req, res,
                                reader);
           });
  srv.Post("/tokenize", [this](const httplib::Request& req,
                               httplib::Response& res,
                               const httplib::ContentReader& reader) {
    HttpHandlers::PostTokenize(this, req, res, reader);
  });
  srv.Post("/detokenize", [this](const httplib::Request& req,
                                 httplib::Response& res,
                                 const httplib::ContentReader& reader) {
    HttpHandlers::PostDetokenize(this, req, res, reader);
  });
  srv.Get("/v1/models", [this](const httplib::Request&,
                               httplib::Response& res) {
    json data = json::array();
    if (const auto info = router_->target_pool().model_info()) {
      data.push_back({{"id", info->model_id()},
                      {"object", "model"},
                      {"created", 0},
                      {"owned_by", "specserve"},
                      {"max_model_len", info->max_context()}});
    }
    res.set_content(Dump({{"object", "list"}, {"data", data}}), kJson);
  });
  srv.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool ok = router_->target_pool().num_healthy() > 0 &&
                    router_->target_pool().compatibility().ok() &&
                    router_->speculator_pool().compatibility().ok();
    res.status = ok ? 200 : 503;
    res.set_content(Dump({{"status", ok ? "ok" : "unavailable"}}), kJson);
  });
  // 404 (no route), 413 (body too large) and the like: OpenAI's shape.
  srv.set_error_handler([max_body = options_.max_body_bytes](
                            const httplib::Request& req,
                           httplib::Response& res) {
    if (!res.body.empty()) return;
    absl::Status st;
    if (res.status == 404) {
      st = absl::NotFoundError(
          absl::StrCat("no route ", req.method, " ", req.path));
    } else if (res.status == 413) {
      st = TooLarge(max_body);
    } else if (res.status >= 400 && res.status < 500) {
      // httplib's own refusals: a malformed request line, headers or
      // chunked encoding (400), a URI or header too long (414, 431), a
      // method without a route (405).
      st = absl::InvalidArgumentError(
          absl::StrCat("malformed HTTP request (HTTP ", res.status, ")"));
    } else {
      st = absl::InternalError(absl::StrCat("HTTP ", res.status));
    }
    const int code = res.status;
    SendError(res, st);
    res.status = code;
  });
  const int bound = port == 0 ? srv.bind_to_any_port(options_.host)
                              : (srv.bind_to_port(options_.host, port) ? port
                                                                       : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen for HTTP on ", options_.host, ":", port));
  }
  // Debian's httplib listens with a backlog of 5: a burst of new
  // connections (many clients starting at once) overflowed it and some
  // were reset. listen() again on the bound socket only resizes the queue.
  if (listen_fd >= 0) ::listen(listen_fd, SOMAXCONN);
  port_ = bound;
  listener_ = std::thread([this] {
    server_->listen_after_bind();
    listener_done_ = true;
  });
  // stop() is a no-op until the listener runs: Shutdown must not race it.
  while (!server_->is_running() && !listener_done_) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return absl::OkStatus();
}

void HttpServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](absl::flat_hash_set<RequestRunner*>* r) {
                               return r->empty();
                             },
                             &running_),
                         grace);
    cancel_all_ = true;
    for (RequestRunner* r : running_) r->Cancel();
  }
  if (listener_.joinable()) {
    server_->stop();  // joins the connection threads
    listener_.join();
  }
}

void HttpServer::Register(RequestRunner* runner) {
  absl::MutexLock lock(&mu_);
  running_.insert(runner);
  if (cancel_all_) runner->Cancel();
}

void HttpServer::Unregister(RequestRunner* runner) {
  absl::MutexLock lock(&mu_);
  running_.erase(runner);
}

int HttpServer::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(running_.size());
}

absl::StatusOr<std::unique_ptr<RouterWithHttp>> RouterWithHttp::Create(
    RouterServer* router, HttpServerOptions options, int http_port) {
  if (http_port < 0 || http_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_port must be in [0, 65535], got ", http_port));
  }
  std::unique_ptr<HttpServer> http;
  if (http_port != 0) {
    auto h = HttpServer::Create(router, std::move(options));
    if (!h.ok()) return h.status();
    http = *std::move(h);
  }
  return std::unique_ptr<RouterWithHttp>(
      new RouterWithHttp(router, std::move(http), http_port));
}

absl::Status RouterWithHttp::Start(int port) {
  if (absl::Status s = router_->Start(port); !s.ok()) return s;
  if (http_ == nullptr) return absl::OkStatus();
  if (absl::Status s = http_->Start(http_port_); !s.ok()) {
    router_->Shutdown();
    return s;
  }
  std::fprintf(stderr, "http on %d\n", http_->port());
  return absl::OkStatus();
}

int RouterWithHttp::port() const { return router_->port(); }

void RouterWithHttp::Shutdown(absl::Duration grace) {
  if (http_ != nullptr) http_->Shutdown(grace);
  router_->Shutdown(grace);
}

}  // namespace specserve
