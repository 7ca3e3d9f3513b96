// The OpenAI HTTP API over real loopback sockets (port 0), with an httplib
// client, in front of the bundled speculator/target pair served in-process
// (or a slow fake target): responses agree with the gRPC API, streaming
// (SSE) agrees with unary, errors have OpenAI's shape and status, API keys,
// and a client that disconnects mid-stream frees every session.

#include "router/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "protos/router.grpc.pb.h"
#include "protos/target.grpc.pb.h"
#include "common/decoding/json_grammar.h"
#include "common/tokenizer/token_bytes.h"
#include "router/router_server.h"
#include "router/test_env.h"
#include "router/target_client.h"
#include "router/speculator_client.h"

namespace specserve {
namespace {

using namespace router_test;  // NOLINT: test helpers
using json = nlohmann::json;

// A Target that emits token 400 every 20 ms, forever, until its stream is
// cancelled (a message per round, or none with Prefill.continuous); counts
// open streams (its "sessions"). With `silent` it never
// answers the prefill (a request stuck before its first token).
class SlowTarget final : public v1::Target::Service {
 public:
  explicit SlowTarget(v1::ModelInfo info) : info_(std::move(info)) {}
  std::atomic<bool> silent{false};
  grpc::Status Info(grpc::ServerContext*, const v1::InfoRequest*,
                    v1::ModelInfo* out) override {
    *out = info_;
    return grpc::Status::OK;
  }
  grpc::Status Generate(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::GenerateResponse, v1::GenerateRequest>* s)
      override {
    ++open_;
    ++started_;
    v1::GenerateRequest req;
    bool ok = s->Read(&req);
    const bool continuous = ok && req.prefill().continuous();
    while (ok && silent && !ctx->IsCancelled()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    while (ok && !ctx->IsCancelled()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      v1::GenerateResponse r;
      r.add_token_ids(400);
      ok = s->Write(r) && (continuous || s->Read(&req));
    }
    --open_;
    return grpc::Status::CANCELLED;
  }
  std::atomic<int> open_{0};
  std::atomic<int> started_{0};

 private:
  const v1::ModelInfo info_;
};

struct Sse {
  std::vector<json> events;  // parsed data: lines before [DONE]
  bool done = false;         // saw data: [DONE]
};

Sse ParseSse(const std::string& body) {
  Sse out;
  for (absl::string_view block : absl::StrSplit(body, "\n\n")) {
    if (block.empty()) continue;
    EXPECT_TRUE(absl::StartsWith(block, "data: ")) << block;
    if (!absl::StartsWith(block, "data: ")) continue;
    block.remove_prefix(6);
    if (block == "[DONE]") {
      EXPECT_FALSE(out.done) << "two [DONE]";
      out.done = true;
      continue;
    }
    EXPECT_FALSE(out.done) << "event after [DONE]";
    out.events.push_back(json::parse(block));
  }
  return out;
}

class HttpServerTest : public ServicesTest {
 protected:
  void TearDown() override {
    if (http_) http_->Shutdown();
    if (router_) router_->Shutdown();
    if (slow_server_) slow_server_->Shutdown();
  }

  void Start(HttpServerOptions http = {},
             std::function<void(RouterServerOptions*)> tweak = {}) {
    RouterServerOptions o;
    o.host = "127.0.0.1";
    o.speculator = Addr(speculator_->port());
    o.target = Addr(target_->port());
    o.tokenizer_dir = kTargetModel;
    o.pool.health_period = absl::Milliseconds(100);
    if (tweak) tweak(&o);
    auto r = RouterServer::Create(o);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = *std::move(r);
    ASSERT_TRUE(router_->Start(0).ok());
    http.host = "127.0.0.1";
    auto h = HttpServer::Create(router_.get(), http);
    ASSERT_TRUE(h.ok()) << h.status();
    http_ = *std::move(h);
    ASSERT_TRUE(http_->Start(0).ok());
    client_ = std::make_unique<httplib::Client>("127.0.0.1", http_->port());
    client_->set_read_timeout(20, 0);
  }

  std::string StartSlowTarget() {
    v1::ModelInfo info;
    info.set_model_id("slow");
    info.set_vocab_size(512);
    info.set_max_context(100000);
    info.set_tokenizer_fingerprint(tokenizer_->Fingerprint());
    slow_ = std::make_unique<SlowTarget>(info);
    int port = 0;
    slow_server_ = Serve(slow_.get(), &port);
    return Addr(port);
  }

  httplib::Result Post(const std::string& path, const std::string& body,
                       const httplib::Headers& headers = {}) {
    return client_->Post(path.c_str(), headers, body, "application/json");
  }

  // The gRPC API's answer to the same request.
  v1::GenerateTextResponse Grpc(const v1::GenerateTextRequest& req) {
    auto stub = v1::Router::NewStub(grpc::CreateChannel(
        Addr(router_->port()), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::GenerateTextResponse resp;
    EXPECT_TRUE(stub->Generate(&ctx, req, &resp).ok());
    return resp;
  }

  // Expects an OpenAI error with `status` naming `param` (null if "").
  static void ExpectError(const httplib::Result& res, int status,
                          const std::string& param) {
    ASSERT_TRUE(res) << "no response";
    EXPECT_EQ(res->status, status) << res->body;
    const json j = json::parse(res->body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << res->body;
    ASSERT_TRUE(j.contains("error")) << res->body;
    const json& e = j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty());
    EXPECT_TRUE(e["type"].is_string());
    EXPECT_TRUE(e.contains("code"));
    if (param.empty()) {
      EXPECT_TRUE(e["param"].is_null()) << res->body;
    } else {
      EXPECT_EQ(e["param"], param) << res->body;
    }
  }

  std::unique_ptr<RouterServer> router_;
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<httplib::Client> client_;
  std::unique_ptr<SlowTarget> slow_;
  std::unique_ptr<grpc::Server> slow_server_;
};

TEST_F(HttpServerTest, HealthAndModels) {
  Start();
  ASSERT_TRUE(Eventually([&] {
    auto r = client_->Get("/health");
    return r && r->status == 200;
  }));
  auto m = client_->Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  const json j = json::parse(m->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "stories260K");
  EXPECT_EQ(j["data"][0]["object"], "model");
}

TEST_F(HttpServerTest, CompletionMatchesGrpc) {
  Start();
  const std::string prompt = StoryPrompt(3);
  auto res = Post("/v1/completions",
                  json{{"model", "stories260K"},
                       {"prompt", prompt},
                       {"max_tokens", 24},
                       {"some_unknown_field", {1, 2}},
                       {"speculative_prefill", {{"keep_ratio", 0.5}}},
                       {"speculative_decoding", {{"num_draft_tokens", 3}}}}
                      .dump());
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json j = json::parse(res->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_TRUE(absl::StartsWith(j["id"].get<std::string>(), "cmpl-"));
  EXPECT_EQ(j["model"], "stories260K");
  ASSERT_EQ(j["choices"].size(), 1u);

  v1::GenerateTextRequest g;
  g.set_text(prompt);
  g.mutable_sampling()->set_max_new_tokens(24);
  g.mutable_speculative_prefill()->set_keep_ratio(0.5f);
  g.mutable_speculative_decoding()->set_num_draft_tokens(3);
  const v1::GenerateTextResponse want = Grpc(g);
  EXPECT_EQ(j["choices"][0]["text"], want.text());
  EXPECT_EQ(j["choices"][0]["finish_reason"],
            openai::OpenAiFinishReason(want.finish_reason()));
  EXPECT_EQ(j["usage"]["prompt_tokens"], want.usage().prompt_tokens());
  EXPECT_EQ(j["usage"]["completion_tokens"], want.usage().completion_tokens());
  EXPECT_EQ(j["usage"]["total_tokens"],
            want.usage().prompt_tokens() + want.usage().completion_tokens());
  // The extension took effect: half of the chunks kept.
  const json& s = j["specserve"];
  EXPECT_EQ(s["kept_prompt_tokens"], want.usage().kept_prompt_tokens());
  EXPECT_LT(s["kept_prompt_tokens"].get<int>(), s["prompt_tokens"].get<int>());
  EXPECT_GT(s["num_drafts"].get<int>(), 0);
  EXPECT_EQ(s["num_drafts"], want.stats().num_drafts());
  EXPECT_EQ(s["num_draft_tokens"], want.stats().num_draft_tokens());
  EXPECT_EQ(s["num_accepted_tokens"], want.stats().num_accepted_tokens());
  EXPECT_GT(s["ttft_s"].get<double>(), 0);
}

// logprobs through the whole stack: greedy with every drafting method and
// Speculative Prefill gives the tokens and logprobs of plain decoding;
// the greedy token is its own top alternative; streamed chunks carry the
// logprobs of their own tokens (together those of the unary answer); chat
// gets its {content: [...]} shape; the gRPC API returns them aligned with
// token_ids; bad values are 400s.
// Completions' echo through the stack, as lm-evaluation-harness scores a
// continuation (echo, logprobs, max_tokens 1): the prompt's tokens come
// first in the logprobs, the first with null, the rest real logprobs, and
// the whole prompt reaches the target although the router's defaults
// prune; without logprobs the echo only prefixes the text; streamed, the
// events add up to the unary answer.
TEST_F(HttpServerTest, EchoThroughTheStack) {
  Start();
  const std::string prompt = StoryPrompt(2);
  json req = {{"prompt", prompt}, {"max_tokens", 1}, {"echo", true},
              {"logprobs", 1}};
  auto res = Post("/v1/completions", req.dump());
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json u = json::parse(res->body);
  const json& choice = u["choices"][0];
  const std::string text = choice["text"];
  EXPECT_EQ(text.substr(0, prompt.size()), prompt);
  const int prompt_tokens = u["usage"]["prompt_tokens"];
  EXPECT_EQ(u["specserve"]["kept_prompt_tokens"], prompt_tokens);
  const json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), static_cast<size_t>(prompt_tokens + 1)) << u;
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (int i = 1; i <= prompt_tokens; ++i) {
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0) << i;
    EXPECT_GE(lp["top_logprobs"][i].size(), 1u) << i;
  }
  // Without logprobs: the prompt, then what the same request answers.
  auto plain = Post("/v1/completions",
                    json{{"prompt", prompt}, {"max_tokens", 6}}.dump());
  auto echoed = Post(
      "/v1/completions",
      json{{"prompt", prompt}, {"max_tokens", 6}, {"echo", true}}.dump());
  ASSERT_TRUE(plain && echoed);
  ASSERT_EQ(echoed->status, 200) << echoed->body;
  EXPECT_EQ(json::parse(echoed->body)["choices"][0]["text"],
            prompt + json::parse(plain->body)["choices"][0]["text"]
                         .get<std::string>());
  // Streamed.
  req["stream"] = true;
  auto streamed = Post("/v1/completions", req.dump());
  ASSERT_TRUE(streamed);
  ASSERT_EQ(streamed->status, 200) << streamed->body;
  std::string joined;
  json tokens = json::array();
  for (const json& e : ParseSse(streamed->body).events) {
    if (e["choices"].empty()) continue;
    joined += e["choices"][0]["text"].get<std::string>();
    const json& l = e["choices"][0]["logprobs"];
    for (const json& t : l["tokens"]) tokens.push_back(t);
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(tokens, lp["tokens"]);
}

TEST_F(HttpServerTest, LogprobsThroughTheStack) {
  Start();
  const std::string prompt = StoryPrompt(3);
  auto completion = [&](json extra) {
    json req = {{"prompt", prompt}, {"max_tokens", 24}, {"logprobs", 3}};
    if (extra.is_object()) req.update(extra);
    auto res = Post("/v1/completions", req.dump());
    EXPECT_TRUE(res);
    if (!res) return json();
    EXPECT_EQ(res->status, 200) << res->body;
    return json::parse(res->body);
  };
  const json plain = completion(
      {{"speculative_decoding", {{"enabled", false}}},
       {"speculative_prefill", {{"enabled", false}}}});
  const json& want = plain["choices"][0]["logprobs"];
  ASSERT_EQ(want["tokens"].size(), 24u) << plain;
  std::string joined;
  for (size_t i = 0; i < 24; ++i) {
    const float lp = want["token_logprobs"][i].get<float>();
    EXPECT_LT(lp, 0.f);
    const json& top = want["top_logprobs"][i];
    EXPECT_GE(top.size(), 3u);
    float best = -1e9f;
    for (auto it = top.begin(); it != top.end(); ++it) {
      best = std::max(best, it.value().get<float>());
    }
    EXPECT_FLOAT_EQ(best, lp);  // greedy: the token is the likeliest
    EXPECT_EQ(want["text_offset"][i], joined.size());
    joined += want["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(absl::StripLeadingAsciiWhitespace(joined),
            plain["choices"][0]["text"].get<std::string>());
  for (const char* method : {"draft", "ngram", "draft_tree"}) {
    for (bool prefill : {false, true}) {
      SCOPED_TRACE(absl::StrCat(method, prefill ? " with" : " without",
                                " speculative prefill"));
      const json spec = completion(
          {{"speculative_decoding",
            {{"enabled", true}, {"method", method}, {"num_draft_tokens", 3}}},
           {"speculative_prefill", {{"enabled", prefill}, {"keep_ratio", 1.0}}}});
      const json& got = spec["choices"][0]["logprobs"];
      EXPECT_EQ(spec["choices"][0]["text"], plain["choices"][0]["text"]);
      ASSERT_EQ(got["tokens"], want["tokens"]);
      for (size_t i = 0; i < 24; ++i) {
        EXPECT_NEAR(got["token_logprobs"][i].get<double>(),
                    want["token_logprobs"][i].get<double>(), 1e-4);
        for (auto it = want["top_logprobs"][i].begin();
             it != want["top_logprobs"][i].end(); ++it) {
          EXPECT_NEAR(got["top_logprobs"][i][it.key()].get<double>(),
                      it.value().get<double>(), 1e-4);
        }
      }
      if (std::string(method) != "ngram") {
        EXPECT_GT(spec["specserve"]["num_drafts"].get<int>(), 0);
      }
    }
  }
  // Streamed: the chunks' logprobs are the unary answer's, in order.
  {
    auto res = Post("/v1/completions",
                    json{{"prompt", prompt},
                         {"max_tokens", 24},
                         {"logprobs", 3},
                         {"stream", true}}
                        .dump());
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    const json unary = completion({});
    const json& u = unary["choices"][0]["logprobs"];
    json tokens = json::array(), offsets = json::array();
    for (const json& e : ParseSse(res->body).events) {
      const json& lp = e["choices"][0]["logprobs"];
      ASSERT_TRUE(lp.is_object()) << e;
      EXPECT_EQ(lp["tokens"].size(), lp["token_logprobs"].size());
      for (size_t i = 0; i < lp["tokens"].size(); ++i) {
        tokens.push_back(lp["tokens"][i]);
        offsets.push_back(lp["text_offset"][i]);
      }
    }
    EXPECT_EQ(tokens, u["tokens"]);
    EXPECT_EQ(offsets, u["text_offset"]);
  }
  // Chat, unary and streamed.
  {
    json req = {{"messages", {{{"role", "user"}, {"content", prompt}}}},
                {"max_tokens", 16},
                {"logprobs", true},
                {"top_logprobs", 2}};
    auto unary = Post("/v1/chat/completions", req.dump());
    ASSERT_TRUE(unary);
    ASSERT_EQ(unary->status, 200) << unary->body;
    const json u = json::parse(unary->body);
    const json& content = u["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(content.size(), 16u) << u;
    for (const json& t : content) {
      EXPECT_TRUE(t["token"].is_string());
      EXPECT_LE(t["logprob"].get<double>(), 0.0);
      EXPECT_TRUE(t["bytes"].is_array());
      ASSERT_EQ(t["top_logprobs"].size(), 2u);
      EXPECT_EQ(t["top_logprobs"][0]["token"], t["token"]);
      EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(),
                t["top_logprobs"][1]["logprob"].get<double>());
    }
    req["stream"] = true;
    auto res = Post("/v1/chat/completions", req.dump());
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    json streamed = json::array();
    for (const json& e : ParseSse(res->body).events) {
      const json& lp = e["choices"][0]["logprobs"];
      if (lp.is_null()) continue;  // the role delta
      for (const json& t : lp["content"]) streamed.push_back(t);
    }
    EXPECT_EQ(streamed, content);
    // Off by default.
    auto off = Post("/v1/chat/completions",
                    json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                         {"max_tokens", 4}}
                        .dump());
    ASSERT_TRUE(off);
    EXPECT_TRUE(json::parse(off->body)["choices"][0]["logprobs"].is_null());
  }
  // gRPC: aligned with token_ids.
  {
    v1::GenerateTextRequest g;
    g.set_text(prompt);
    g.mutable_sampling()->set_max_new_tokens(12);
    g.mutable_sampling()->set_logprobs(true);
    g.mutable_sampling()->set_top_logprobs(4);
    g.mutable_speculative_prefill()->set_enabled(false);  // the same context
    const v1::GenerateTextResponse r = Grpc(g);
    ASSERT_EQ(r.token_ids_size(), 12);
    ASSERT_EQ(r.logprobs_size(), 12);
    for (int i = 0; i < 12; ++i) {
      EXPECT_NEAR(r.logprobs(i).logprob(),
                  want["token_logprobs"][i].get<double>(), 1e-4);
      ASSERT_EQ(r.logprobs(i).top_size(), 4);
      EXPECT_EQ(r.logprobs(i).top(0).id(), r.token_ids(i));
    }
  }
  // Bad values.
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "logprobs": 21})"),
              400, "logprobs");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "logprobs": -1})"),
              400, "logprobs");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "logprobs": "5"})"),
              400, "logprobs");
  ExpectError(Post("/v1/chat/completions",
                   R"({"messages": [{"role": "user", "content": "a"}],
                       "top_logprobs": 2})"),
              400, "top_logprobs");
  ExpectError(Post("/v1/chat/completions",
                   R"({"messages": [{"role": "user", "content": "a"}],
                       "logprobs": true, "top_logprobs": 50})"),
              400, "top_logprobs");
  ExpectError(Post("/v1/chat/completions",
                   R"({"messages": [{"role": "user", "content": "a"}],
                       "logprobs": 3})"),
              400, "logprobs");
}

TEST_F(HttpServerTest, TokenIdPromptsAndOneElementBatches) {
  Start();
  auto ids = tokenizer_->Encode("Once upon a time", true);
  ASSERT_TRUE(ids.ok());
  const json as_ids = json(*ids);
  std::string text;
  for (const json& prompt :
       {as_ids, json::array({as_ids}), json("Once upon a time"),
        json::array({"Once upon a time"})}) {
    auto res = Post("/v1/completions",
                    json{{"prompt", prompt}, {"max_tokens", 12}}.dump());
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    const json j = json::parse(res->body);
    EXPECT_EQ(j["usage"]["prompt_tokens"], ids->size()) << prompt;
    if (text.empty()) text = j["choices"][0]["text"];
    EXPECT_EQ(j["choices"][0]["text"], text) << prompt;
  }
  EXPECT_FALSE(text.empty());
}

// A batch of prompts (OpenAI's `prompt` as a list): prompt p's choice i is
// choice p * n + i and equals that prompt alone with seed + i; usage counts
// each prompt once; streamed, the same texts under the same indices.
TEST_F(HttpServerTest, PromptBatches) {
  Start();
  const std::vector<std::string> prompts = {"Once upon a time",
                                            "The little dog"};
  const json req = {{"prompt", prompts},
                    {"max_tokens", 10},
                    {"n", 2},
                    {"temperature", 1.0},
                    {"seed", 21}};
  auto res = Post("/v1/completions", req.dump());
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "");
  const json j = json::parse(res->body);
  ASSERT_EQ(j["choices"].size(), 4u);
  int prompt_tokens = 0;
  std::vector<std::string> texts;
  for (int p = 0; p < 2; ++p) {
    prompt_tokens += static_cast<int>(tokenizer_->Encode(prompts[p], true)->size());
    for (int i = 0; i < 2; ++i) {
      const json& c = j["choices"][p * 2 + i];
      EXPECT_EQ(c["index"], p * 2 + i);
      auto alone = Post("/v1/completions",
                        json{{"prompt", prompts[p]},
                             {"max_tokens", 10},
                             {"temperature", 1.0},
                             {"seed", 21 + i}}
                            .dump());
      ASSERT_TRUE(alone && alone->status == 200);
      EXPECT_EQ(c["text"], json::parse(alone->body)["choices"][0]["text"])
          << p << "/" << i;
      texts.push_back(c["text"]);
    }
  }
  EXPECT_NE(texts[0], texts[2]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens);
  json streamed = req;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  auto sres = Post("/v1/completions", streamed.dump());
  ASSERT_TRUE(sres && sres->status == 200);
  std::vector<std::string> joined(4);
  const Sse sse = ParseSse(sres->body);
  for (const json& e : sse.events) {
    if (e["choices"].empty()) {
      EXPECT_EQ(e["usage"]["prompt_tokens"], prompt_tokens);
      continue;
    }
    joined[e["choices"][0]["index"].get<int>()] +=
        e["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(joined, texts);
  EXPECT_TRUE(sse.done);
}

TEST_F(HttpServerTest, StreamingMatchesUnary) {
  Start();
  for (const bool chat : {false, true}) {
    json req = {{"max_tokens", 40}};
    if (chat) {
      req["messages"] = {{{"role", "system"}, {"content", "Be kind."}},
                         {{"role", "user"}, {"content", StoryPrompt(2)}}};
    } else {
      req["prompt"] = StoryPrompt(2);
    }
    const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
    auto unary = Post(path, req.dump());
    ASSERT_TRUE(unary);
    ASSERT_EQ(unary->status, 200) << unary->body;
    const json u = json::parse(unary->body);
    const std::string want =
        chat ? u["choices"][0]["message"]["content"].get<std::string>()
             : u["choices"][0]["text"].get<std::string>();
    if (chat) {
      EXPECT_EQ(u["object"], "chat.completion");
      EXPECT_EQ(u["choices"][0]["message"]["role"], "assistant");
    }

    req["stream"] = true;
    req["stream_options"] = {{"include_usage", true}};
    auto res = Post(path, req.dump());
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    EXPECT_TRUE(absl::StartsWith(res->get_header_value("Content-Type"),
                                 "text/event-stream"));
    const Sse sse = ParseSse(res->body);
    EXPECT_TRUE(sse.done);
    ASSERT_GE(sse.events.size(), 3u);
    std::string text;
    int finishes = 0;
    for (size_t i = 0; i < sse.events.size(); ++i) {
      const json& e = sse.events[i];
      EXPECT_EQ(e["object"], chat ? "chat.completion.chunk" : "text_completion");
      EXPECT_EQ(e["id"], sse.events[0]["id"]);
      ASSERT_TRUE(e.contains("usage"));
      if (i + 1 == sse.events.size()) {  // the usage chunk
        EXPECT_TRUE(e["choices"].empty());
        EXPECT_EQ(e["usage"], u["usage"]);
        continue;
      }
      EXPECT_TRUE(e["usage"].is_null());
      const json& c = e["choices"][0];
      if (chat) {
        if (i == 0) {
          EXPECT_EQ(c["delta"]["role"], "assistant");
        }
        if (c["delta"].contains("content")) text += c["delta"]["content"];
      } else {
        text += c["text"];
      }
      if (!c["finish_reason"].is_null()) {
        ++finishes;
        EXPECT_EQ(c["finish_reason"], u["choices"][0]["finish_reason"]);
        EXPECT_EQ(e["specserve"]["completion_tokens"],
                  u["usage"]["completion_tokens"]);
      }
    }
    EXPECT_EQ(finishes, 1);
    EXPECT_EQ(text, want) << "chat=" << chat;
  }
}

// A tokenizer directory with a tokenizer_config.json chat template: chat
// prompts are the template's render, BOS string -> BOS id.
TEST_F(HttpServerTest, ChatUsesTheTokenizerConfigTemplate) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/chat_model");
  ASSERT_EQ(std::system(absl::StrCat("mkdir -p ", dir, " && cp ", kTargetModel,
                                     "/tokenizer.model ", dir)
                            .c_str()),
            0);
  std::ofstream(dir + "/tokenizer_config.json") << R"({
    "bos_token": "<s>", "eos_token": "</s>",
    "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }} said: {{ m['content'] | trim }}\n{% endfor %}{% if add_generation_prompt %}Then{% endif %}"})";
  Start({}, [&](RouterServerOptions* o) { o->tokenizer_dir = dir; });
  auto res = Post("/v1/chat/completions",
                  R"({"messages": [{"role": "user", "content": " Lily ran. "},
                                   {"role": "assistant", "content": "Tom sat."}],
                      "max_tokens": 16})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json chat = json::parse(res->body);
  auto ids = tokenizer_->Encode("USER said: Lily ran.\nASSISTANT said: Tom sat.\nThen",
                                /*add_bos=*/true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(chat["usage"]["prompt_tokens"], ids->size());
  // The same ids as a completion prompt give the same text.
  auto same = Post("/v1/completions",
                   json{{"prompt", *ids}, {"max_tokens", 16}}.dump());
  ASSERT_TRUE(same && same->status == 200);
  EXPECT_EQ(chat["choices"][0]["message"]["content"],
            json::parse(same->body)["choices"][0]["text"]);
  // add_generation_prompt: false drops "Then".
  auto nogen = Post("/v1/chat/completions",
                    R"({"messages": [{"role": "user", "content": "Hi"}],
                        "add_generation_prompt": false, "max_tokens": 2})");
  ASSERT_TRUE(nogen && nogen->status == 200) << nogen->body;
  EXPECT_EQ(json::parse(nogen->body)["usage"]["prompt_tokens"],
            tokenizer_->Encode("USER said: Hi\n", true)->size());
}

// The text of a completion or chat response, unary or streamed.
std::string TextOf(const httplib::Result& r, bool chat, bool stream) {
  if (!r || r->status != 200) return "HTTP error";
  if (!stream) {
    const json j = json::parse(r->body);
    return chat ? j["choices"][0]["message"]["content"].get<std::string>()
                : j["choices"][0]["text"].get<std::string>();
  }
  std::string text;
  for (const json& e : ParseSse(r->body).events) {
    if (e["choices"].empty()) continue;
    const json& c = e["choices"][0];
    if (chat) {
      if (c["delta"].contains("content")) text += c["delta"]["content"];
    } else {
      text += c["text"];
    }
  }
  return text;
}

// Many clients at once (unary and streams, completions and chat, greedy and
// seeded sampling, different Speculative Prefill settings), each answer
// equal to the same request made alone.
TEST_F(HttpServerTest, ConcurrentClientsGetTheirOwnAnswers) {
  Start();
  struct Kind {
    bool chat, stream;
    json body;
  };
  std::vector<Kind> kinds;
  for (int i = 0; i < 6; ++i) {
    Kind k{i % 3 == 2, i % 2 == 1, {{"max_tokens", 24}}};
    if (k.chat) {
      k.body["messages"] = {{{"role", "user"}, {"content", StoryPrompt(1 + i)}}};
    } else {
      k.body["prompt"] = StoryPrompt(1 + i);
    }
    k.body["speculative_prefill"] = {{"keep_ratio", i < 3 ? 0.3 : 1.0},
                                     {"chunk_size", 8}};
    k.body["speculative_decoding"] = {{"num_draft_tokens", 1 + i}};
    if (i == 4) {
      k.body["temperature"] = 0.9;
      k.body["seed"] = 42;
    }
    k.body["stream"] = k.stream;
    kinds.push_back(k);
  }
  auto run = [&](httplib::Client& c, const Kind& k) {
    return TextOf(c.Post(k.chat ? "/v1/chat/completions" : "/v1/completions",
                         k.body.dump(), "application/json"),
                  k.chat, k.stream);
  };
  std::vector<std::string> alone;
  for (const Kind& k : kinds) {
    alone.push_back(run(*client_, k));
    ASSERT_NE(alone.back(), "HTTP error");
    ASSERT_FALSE(alone.back().empty());
  }
  constexpr int kClients = 12;
  std::vector<std::vector<std::string>> got(kClients);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      httplib::Client c("127.0.0.1", http_->port());
      c.set_read_timeout(30, 0);
      for (int r = 0; r < 3; ++r) got[t].push_back(run(c, kinds[(t + r) % 6]));
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kClients; ++t) {
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(got[t][r], alone[(t + r) % 6]) << "client " << t << " #" << r;
    }
  }
  EXPECT_TRUE(Eventually([&] { return router_->in_flight() == 0; }));
}

TEST_F(HttpServerTest, StopStringsAndSeeds) {
  Start();
  auto full = Post("/v1/completions",
                   json{{"prompt", "Once upon a time"}, {"max_tokens", 30}}
                       .dump());
  ASSERT_TRUE(full && full->status == 200);
  const std::string text = json::parse(full->body)["choices"][0]["text"];
  // A word from the middle of the output as the stop string.
  const size_t at = text.find(' ', text.size() / 2);
  ASSERT_NE(at, std::string::npos) << text;
  const std::string stop = text.substr(at, 4);
  auto cut = Post("/v1/completions", json{{"prompt", "Once upon a time"},
                                          {"max_tokens", 30},
                                          {"stop", {stop, "zzzz"}}}
                                         .dump());
  ASSERT_TRUE(cut && cut->status == 200) << cut->body;
  const json c = json::parse(cut->body);
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(c["choices"][0]["text"], text.substr(0, text.find(stop)));
  // vLLM's include_stop_str_in_output keeps the stop string.
  auto kept = Post("/v1/completions", json{{"prompt", "Once upon a time"},
                                           {"max_tokens", 30},
                                           {"stop", {stop, "zzzz"}},
                                           {"include_stop_str_in_output", true}}
                                          .dump());
  ASSERT_TRUE(kept && kept->status == 200) << kept->body;
  const json k = json::parse(kept->body);
  EXPECT_EQ(k["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(k["choices"][0]["text"], text.substr(0, text.find(stop)) + stop);

  // Sampling: the same seed gives the same text.
  const json sampled = {{"prompt", "Once upon a time"},
                        {"max_tokens", 30},
                        {"temperature", 1.0},
                        {"seed", 1234}};
  auto a = Post("/v1/completions", sampled.dump());
  auto b = Post("/v1/completions", sampled.dump());
  ASSERT_TRUE(a && b && a->status == 200 && b->status == 200);
  EXPECT_EQ(json::parse(a->body)["choices"][0]["text"],
            json::parse(b->body)["choices"][0]["text"]);
}

// JSON mode (response_format json_object): the target and the
// speculator keep every token inside one JSON object. This story model
// would write strings forever, so the request nudges it to close (a bias
// towards '"' and '}', away from ',' and whitespace): the answer is then a
// complete object, ended by EOS ("stop"), unary and streamed alike. A JSON
// schema and unknown types are refused, naming response_format.
TEST_F(HttpServerTest, JsonModeAnswersAreJsonObjects) {
  Start();
  absl::StatusOr<TokenByteTable> table = BuildTokenByteTable(*tokenizer_);
  ASSERT_TRUE(table.ok()) << table.status();
  json bias = json::object();
  for (int id = 0; id < static_cast<int>(table->bytes.size()); ++id) {
    const std::string& b = table->bytes[id];
    if (b == "\"") bias[std::to_string(id)] = 6;
    if (b == "}") bias[std::to_string(id)] = 30;
    if (b == ",") bias[std::to_string(id)] = -10;
    if (!b.empty() && b.find_first_not_of(" \n\t\r") == std::string::npos) {
      bias[std::to_string(id)] = -20;
    }
  }
  json req = {{"prompt", "Once upon a time"},
              {"max_tokens", 60},
              {"logit_bias", bias},
              {"response_format", {{"type", "json_object"}}}};
  auto res = Post("/v1/completions", req.dump());
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "");
  const json c = json::parse(res->body);
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop") << res->body;
  const std::string text = c["choices"][0]["text"];
  EXPECT_TRUE(json::parse(text, nullptr, false).is_object()) << text;
  req["stream"] = true;
  auto streamed = Post("/v1/completions", req.dump());
  ASSERT_TRUE(streamed && streamed->status == 200);
  std::string joined;
  for (const json& e : ParseSse(streamed->body).events) {
    joined += e["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(joined, text);
  // Without the nudge the output is still a prefix of an object.
  json plain = {{"prompt", "Once upon a time"},
                {"max_tokens", 24},
                {"response_format", {{"type", "json_object"}}}};
  auto cut = Post("/v1/completions", plain.dump());
  ASSERT_TRUE(cut && cut->status == 200);
  JsonMatcher m;
  const std::string cut_text = json::parse(cut->body)["choices"][0]["text"];
  EXPECT_TRUE(m.Advance(cut_text)) << cut_text;
  plain["response_format"] = {{"type", "text"}};
  auto text_format = Post("/v1/completions", plain.dump());
  ASSERT_TRUE(text_format && text_format->status == 200);
  EXPECT_NE(json::parse(text_format->body)["choices"][0]["text"], cut_text);

  for (const json& bad :
       {json{{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}},
        json{{"type", "json_schema"},
             {"json_schema",
              {{"schema",
                {{"type", "object"},
                 {"properties", {{"a", {{"type", "string"},
                                        {"pattern", "^x"}}}}}}}}}},
        json{{"type", "yaml"}}, json{{"kind", "json_object"}},
        json("json_object")}) {
    plain["response_format"] = bad;
    ExpectError(Post("/v1/completions", plain.dump()), 400,
                "response_format");
  }
}

// vLLM's guided_choice through the stack: the answer is exactly one of the
// choices, ended by EOS, with speculative decoding on and off alike.
TEST_F(HttpServerTest, GuidedChoiceAnswersOneChoice) {
  Start();
  const std::vector<std::string> choices = {"happy", "sad", "a dog"};
  std::string first;
  for (bool spec : {true, false}) {
    json req = {{"prompt", "Once upon a time"},
                {"max_tokens", 20},
                {"guided_choice", choices},
                {"speculative_decoding", {{"enabled", spec}}}};
    auto res = Post("/v1/completions", req.dump());
    ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "");
    const json c = json::parse(res->body);
    const std::string text = c["choices"][0]["text"];
    EXPECT_NE(std::find(choices.begin(), choices.end(), text), choices.end())
        << text;
    EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
    if (first.empty()) first = text;
    EXPECT_EQ(text, first);
  }
}

// response_format json_schema through the stack (router, speculator
// drafts, target verification): every value of this schema is bounded,
// so the answer closes, ends at EOS ("stop") and is an instance of the
// schema, its properties in the order the request listed them (not the
// alphabetical order a JSON parser may keep), unary and streamed, with
// and without speculative decoding.
TEST_F(HttpServerTest, JsonSchemaAnswersAreInstances) {
  Start();
  const std::string format = R"({"type": "json_schema", "json_schema": {
      "name": "pet", "strict": true, "schema": {
        "type": "object",
        "properties": {"zeta": {"enum": ["cat", "dog"]},
                       "name": {"type": "string", "maxLength": 6},
                       "legs": {"enum": [2, 4]},
                       "alpha": {"type": "boolean"}},
        "required": ["zeta", "name", "legs", "alpha"]}}})";
  std::string first_text;
  for (bool spec : {true, false}) {
    for (bool stream : {false, true}) {
      SCOPED_TRACE(absl::StrCat(spec ? "drafted" : "plain",
                                stream ? ", streamed" : ""));
      // Ordered, as a client sends it.
      const nlohmann::ordered_json req = {
          {"prompt", "Once upon a time"},
          {"max_tokens", 200},
          {"stream", stream},
          {"response_format", nlohmann::ordered_json::parse(format)},
          {"speculative_decoding", {{"enabled", spec}}}};
      auto res = Post("/v1/completions", req.dump());
      ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "");
      std::string text, finish;
      if (stream) {
        for (const json& e : ParseSse(res->body).events) {
          if (e["choices"].empty()) continue;
          text += e["choices"][0]["text"].get<std::string>();
          if (!e["choices"][0]["finish_reason"].is_null()) {
            finish = e["choices"][0]["finish_reason"];
          }
        }
      } else {
        const json c = json::parse(res->body);
        text = c["choices"][0]["text"];
        finish = c["choices"][0]["finish_reason"];
      }
      EXPECT_EQ(finish, "stop") << text;
      const nlohmann::ordered_json v =
          nlohmann::ordered_json::parse(text, nullptr, false);
      ASSERT_TRUE(v.is_object()) << text;
      std::vector<std::string> keys;
      for (const auto& [k, x] : v.items()) keys.push_back(k);
      EXPECT_EQ(keys, (std::vector<std::string>{"zeta", "name", "legs",
                                                "alpha"}))
          << text;
      EXPECT_TRUE(v["zeta"] == "cat" || v["zeta"] == "dog") << text;
      EXPECT_TRUE(v["legs"] == 2 || v["legs"] == 4) << text;
      EXPECT_TRUE(v["alpha"].is_boolean()) << text;
      if (first_text.empty()) first_text = text;
      EXPECT_EQ(text, first_text);  // greedy: drafting changes nothing
    }
  }
}

// Function calling through the stack: a named tool_choice makes the
// answer that call, its arguments an instance of the function's
// parameters (bounded here, so the call closes: finish "stop"), the same
// streamed as the tool_calls argument deltas joined; "auto" is a 400
// naming tool_choice.
TEST_F(HttpServerTest, NamedToolCallsThroughTheStack) {
  Start();
  const std::string body = R"({"messages": [{"role": "user", "content":
      "Once upon a time"}], "max_tokens": 200, "tools": [
      {"type": "function", "function": {"name": "pick_pet",
       "description": "Pick a pet.", "parameters": {"type": "object",
       "properties": {"pet": {"enum": ["cat", "dog"]},
                      "name": {"type": "string", "maxLength": 6},
                      "happy": {"type": "boolean"}},
       "required": ["pet", "name", "happy"]}}}],
      "tool_choice": {"type": "function", "function": {"name": "pick_pet"}}})";
  auto res = Post("/v1/chat/completions", body);
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "");
  const json r = json::parse(res->body);
  const json& msg = r["choices"][0]["message"];
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop") << res->body;
  EXPECT_TRUE(msg["content"].is_null());
  ASSERT_EQ(msg["tool_calls"].size(), 1u) << res->body;
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "pick_pet");
  const std::string args = msg["tool_calls"][0]["function"]["arguments"];
  const nlohmann::ordered_json v =
      nlohmann::ordered_json::parse(args, nullptr, false);
  ASSERT_TRUE(v.is_object()) << args;
  EXPECT_EQ(v.begin().key(), "pet") << args;
  EXPECT_TRUE(v["pet"] == "cat" || v["pet"] == "dog") << args;
  EXPECT_TRUE(v["happy"].is_boolean()) << args;
  nlohmann::ordered_json streamed_req = nlohmann::ordered_json::parse(body);
  streamed_req["stream"] = true;
  auto streamed = Post("/v1/chat/completions", streamed_req.dump());
  ASSERT_TRUE(streamed && streamed->status == 200);
  std::string joined;
  int opened = 0;
  for (const json& e : ParseSse(streamed->body).events) {
    if (e["choices"].empty()) continue;
    const json& d = e["choices"][0]["delta"];
    if (!d.contains("tool_calls")) continue;
    const json& call = d["tool_calls"][0];
    opened += call.contains("id");
    joined += call["function"]["arguments"].get<std::string>();
  }
  EXPECT_EQ(opened, 1);
  EXPECT_EQ(joined, args);
  // "auto": the model may answer in text (this story model always does).
  json autochoice = json::parse(body);
  autochoice["tool_choice"] = "auto";
  autochoice["max_tokens"] = 12;
  auto free = Post("/v1/chat/completions", autochoice.dump());
  ASSERT_TRUE(free && free->status == 200) << (free ? free->body : "");
  const json fr = json::parse(free->body);
  EXPECT_TRUE(fr["choices"][0]["message"]["content"].is_string()) << free->body;
  EXPECT_NE(fr["choices"][0]["finish_reason"], "tool_calls");
  // "required" with two tools: the answer names one, and its arguments
  // follow that tool's parameters.
  nlohmann::ordered_json two = nlohmann::ordered_json::parse(body);
  two["tools"].push_back(
      {{"type", "function"},
       {"function",
        {{"name", "count"},
         {"parameters",
          {{"type", "object"},
           {"properties", {{"n", {{"enum", {1, 2, 3}}}}}},
           {"required", {"n"}}}}}}});
  two["tool_choice"] = "required";
  auto req2 = Post("/v1/chat/completions", two.dump());
  ASSERT_TRUE(req2 && req2->status == 200) << (req2 ? req2->body : "");
  const json r2 = json::parse(req2->body);
  const json& call2 = r2["choices"][0]["message"]["tool_calls"][0];
  const std::string name2 = call2["function"]["name"];
  const json args2 = json::parse(call2["function"]["arguments"].get<std::string>());
  if (name2 == "count") {
    EXPECT_TRUE(args2["n"] == 1 || args2["n"] == 2 || args2["n"] == 3);
  } else {
    EXPECT_EQ(name2, "pick_pet") << req2->body;
    EXPECT_TRUE(args2["happy"].is_boolean()) << req2->body;
  }
}

// n choices: independent runs, choice i with seed + i, so a seeded sampled
// request is reproducible choice by choice and its choices differ; the
// usage counts the prompt once and every choice's completion; streamed,
// each choice's chunks carry its index and the usage chunk comes last.
TEST_F(HttpServerTest, NChoicesAreIndependentSeededRuns) {
  Start();
  const json base = {{"prompt", "Once upon a time"},
                     {"max_tokens", 20},
                     {"temperature", 1.0},
                     {"seed", 77}};
  json req = base;
  req["n"] = 3;
  auto res = Post("/v1/completions", req.dump());
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "");
  const json r = json::parse(res->body);
  ASSERT_EQ(r["choices"].size(), 3u);
  int completion = 0;
  std::set<std::string> texts;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r["choices"][i]["index"], i);
    // Choice i is the single-choice request with seed 77 + i.
    json one = base;
    one["seed"] = 77 + i;
    auto single = Post("/v1/completions", one.dump());
    ASSERT_TRUE(single && single->status == 200);
    const json s = json::parse(single->body);
    EXPECT_EQ(r["choices"][i]["text"], s["choices"][0]["text"]) << i;
    completion += s["usage"]["completion_tokens"].get<int>();
    texts.insert(r["choices"][i]["text"].get<std::string>());
  }
  EXPECT_EQ(texts.size(), 3u);
  EXPECT_EQ(r["usage"]["completion_tokens"], completion);
  EXPECT_EQ(r["usage"]["total_tokens"],
            r["usage"]["prompt_tokens"].get<int>() + completion);
  EXPECT_TRUE(r.contains("specserve"));

  for (const bool chat : {false, true}) {
    SCOPED_TRACE(chat);
    json streamed = {{"max_tokens", 12},
                     {"temperature", 1.0},
                     {"seed", 5},
                     {"n", 2},
                     {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
    if (chat) {
      streamed["messages"] = {{{"role", "user"}, {"content", "Hi"}}};
    } else {
      streamed["prompt"] = "Once upon a time";
    }
    const std::string path =
        chat ? "/v1/chat/completions" : "/v1/completions";
    auto unary_req = streamed;
    unary_req.erase("stream");
    unary_req.erase("stream_options");
    auto unary = Post(path, unary_req.dump());
    ASSERT_TRUE(unary && unary->status == 200);
    const json u = json::parse(unary->body);
    auto sres = Post(path, streamed.dump());
    ASSERT_TRUE(sres && sres->status == 200) << (sres ? sres->body : "");
    const Sse sse = ParseSse(sres->body);
    EXPECT_TRUE(sse.done);
    std::string text[2];
    int finishes[2] = {0, 0};
    bool role[2] = {false, false};
    ASSERT_FALSE(sse.events.empty());
    for (size_t e = 0; e + 1 < sse.events.size(); ++e) {
      const json& ev = sse.events[e];
      ASSERT_EQ(ev["choices"].size(), 1u) << ev;
      const json& c = ev["choices"][0];
      const int i = c["index"];
      ASSERT_TRUE(i == 0 || i == 1) << ev;
      if (chat) {
        if (c["delta"].contains("role")) role[i] = true;
        if (c["delta"].contains("content")) {
          text[i] += c["delta"]["content"].get<std::string>();
        }
      } else {
        text[i] += c["text"].get<std::string>();
      }
      if (!c["finish_reason"].is_null()) ++finishes[i];
    }
    const json& usage = sse.events.back();
    EXPECT_TRUE(usage["choices"].empty()) << usage;
    EXPECT_EQ(usage["usage"], u["usage"]);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(finishes[i], 1) << i;
      EXPECT_EQ(role[i], chat) << i;
      EXPECT_EQ(text[i], chat ? u["choices"][i]["message"]["content"]
                              : u["choices"][i]["text"])
          << i;
    }
  }
}

TEST_F(HttpServerTest, BadRequests) {
  Start();
  ExpectError(Post("/v1/completions", "{not json"), 400, "");
  ExpectError(Post("/v1/completions", "[1, 2]"), 400, "");
  ExpectError(Post("/v1/completions", "{}"), 400, "prompt");
  ExpectError(Post("/v1/completions", R"({"prompt": ""})"), 400, "prompt");
  ExpectError(Post("/v1/completions", R"({"prompt": 5})"), 400, "prompt");
  ExpectError(Post("/v1/completions", R"({"prompt": [1, "a"]})"), 400,
              "prompt");
  ExpectError(Post("/v1/completions", R"({"prompt": ["a", ""]})"), 400,
              "prompt");
  ExpectError(Post("/v1/completions", R"({"prompt": [[1, 2], [1, 100000]]})"),
              400, "prompt");
  // Errors of the router's own checks name the OpenAI parameter too.
  ExpectError(Post("/v1/completions", R"({"prompt": [1, 100000]})"), 400,
              "prompt");
  ExpectError(Post("/v1/completions",
                   R"({"prompt": [1, 100000], "stream": true})"),
              400, "prompt");
  ExpectError(Post("/v1/completions",
                   json{{"prompt", std::string(3000, 'a')}}.dump()),
              400, "prompt");  // past the model's 512-token context
  ExpectError(Post("/v1/completions",
                   R"({"prompt": "a", "stop_token_ids": [100000]})"),
              400, "stop_token_ids");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "n": 0})"), 400, "n");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "n": 17})"), 400, "n");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "max_tokens": 1.5})"),
              400, "max_tokens");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "max_tokens": 0})"),
              400, "max_tokens");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "temperature": "hot"})"),
              400, "temperature");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "temperature": 3})"),
              400, "temperature");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "top_p": 0})"), 400,
              "top_p");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "stream": "yes"})"),
              400, "stream");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "stop": [1]})"), 400,
              "stop[0]");
  ExpectError(Post("/v1/completions",
                   R"({"prompt": "a", "stream_options": {"include_usage": true}})"),
              400, "stream_options");
  ExpectError(Post("/v1/completions",
                   R"({"prompt": "a", "speculative_prefill": {"keep_ratio": "x"}})"),
              400, "speculative_prefill.keep_ratio");
  // Range checks of the extensions are the router's (same field names).
  ExpectError(Post("/v1/completions",
                   R"({"prompt": "a", "speculative_prefill": {"keep_ratio": 2}})"),
              400, "speculative_prefill.keep_ratio");
  ExpectError(Post("/v1/completions",
                   R"({"prompt": "a", "speculative_decoding": {"num_draft_tokens": 99}})"),
              400, "speculative_decoding.num_draft_tokens");
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "model": "gpt-4"})"),
              404, "model");
  ExpectError(Post("/v1/chat/completions", "{}"), 400, "messages");
  ExpectError(Post("/v1/chat/completions", R"({"messages": "hi"})"), 400,
              "messages");
  ExpectError(Post("/v1/chat/completions", R"({"messages": []})"), 400,
              "messages");
  ExpectError(Post("/v1/chat/completions", R"({"messages": [{"content": "x"}]})"),
              400, "messages[0].role");
  ExpectError(Post("/v1/chat/completions",
                   R"({"messages": [{"role": "user", "content": 7}]})"),
              400, "messages[0].content");
  ExpectError(Post("/v1/chat/completions",
                   R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"),
              400, "messages[0].content[0]");
  ExpectError(client_->Get("/v1/nothing"), 404, "");
  // A 10 MB body: refused before it is parsed.
  const std::string big = json{{"prompt", std::string(10 << 20, 'a')}}.dump();
  ExpectError(Post("/v1/completions", big), 413, "");
  ExpectError(client_->Post("/v1/completions", big, "text/plain"), 413, "");
  // The body must say it is JSON: a browser page may post a form or text
  // to another origin without a CORS preflight, but not JSON.
  const std::string body = R"({"prompt": "Once", "max_tokens": 2})";
  ExpectError(client_->Post("/v1/completions", body,
                            "application/x-www-form-urlencoded"),
              415, "");
  ExpectError(client_->Post("/v1/completions", body, "text/plain"), 415, "");
  ExpectError(client_->Post("/v1/completions", body, ""), 415, "");
  httplib::MultipartFormDataItems items = {{"prompt", "Once", "", ""}};
  ExpectError(client_->Post("/v1/completions", items), 415, "");
  // Parameters and case do not matter.
  auto typed = client_->Post("/v1/completions", body,
                             "Application/JSON; charset=utf-8");
  ASSERT_TRUE(typed);
  EXPECT_EQ(typed->status, 200) << typed->body;
  // The server still serves afterwards.
  auto ok = Post("/v1/chat/completions",
                 R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 4})");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

TEST_F(HttpServerTest, ApiKey) {
  HttpServerOptions o;
  o.api_key = "s3cret-key";
  Start(o);
  const std::string body = R"({"prompt": "Once", "max_tokens": 2})";
  ExpectError(Post("/v1/completions", body), 401, "");
  ExpectError(Post("/v1/completions", body, {{"Authorization", "Bearer nope"}}),
              401, "");
  ExpectError(Post("/v1/completions", body,
                   {{"Authorization", "Bearer s3cret-key2"}}),
              401, "");
  ExpectError(Post("/v1/completions", body, {{"Authorization", "s3cret-key"}}),
              401, "");
  ExpectError(client_->Get("/v1/models"), 401, "");
  auto ok = Post("/v1/completions", body,
                 {{"Authorization", "Bearer s3cret-key"}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  // The scheme is case-insensitive (RFC 9110 section 11.1).
  auto lower = Post("/v1/completions", body,
                    {{"Authorization", "bearer s3cret-key"}});
  ASSERT_TRUE(lower);
  EXPECT_EQ(lower->status, 200) << lower->body;
  auto health = client_->Get("/health");  // probes need no key
  ASSERT_TRUE(health);
  EXPECT_NE(health->status, 401);
}

TEST_F(HttpServerTest, StartErrorsAndRouterWithHttp) {
  Start();
  // The port is taken.
  auto other = HttpServer::Create(router_.get(), {});
  ASSERT_TRUE(other.ok());
  const absl::Status busy = (*other)->Start(http_->port());
  EXPECT_EQ(busy.code(), absl::StatusCode::kUnavailable) << busy;
  EXPECT_EQ((*http_).Start(0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RouterWithHttp::Create(router_.get(), {}, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RouterWithHttp::Create(router_.get(), {}, 70000).status().code(),
            absl::StatusCode::kInvalidArgument);
  HttpServerOptions bad;
  bad.max_body_bytes = 0;
  EXPECT_EQ(HttpServer::Create(router_.get(), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Sends `head` then a chunked body of `total` bytes in 64 KiB chunks over a
// raw socket, stopping early once the server answers or stops reading.
// Returns what the server sent back ("" if nothing) and, in `sent`, the
// body bytes written.
std::string PostChunked(int port, const std::string& head, size_t total,
                        size_t* sent) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  *sent = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  auto send_all = [fd](const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  };
  bool ok = send_all(head);
  const std::string payload(64 << 10, 'a');
  const std::string chunk =
      absl::StrCat(absl::Hex(payload.size()), "\r\n", payload, "\r\n");
  while (ok && *sent < total) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 0) > 0) break;  // an answer (or a close) came early
    ok = send_all(chunk);
    if (ok) *sent += payload.size();
  }
  if (ok && *sent >= total) send_all("0\r\n\r\n");
  std::string got;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) got.append(buf, n);
  close(fd);
  return got;
}

// A chunked body is capped as it arrives (httplib caps only a declared
// Content-Length): a 16 MiB chunked prompt is refused with 413 long before
// it is all sent (it was read whole, parsed and answered 200 or 400).
TEST_F(HttpServerTest, ChunkedBodyOverTheCapIs413) {
  HttpServerOptions o;
  o.max_body_bytes = 1 << 20;
  Start(o);
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
      "9\r\n{\"prompt\"\r\n3\r\n:\"a\r\n";
  size_t sent = 0;
  const absl::Time start = absl::Now();
  const std::string got = PostChunked(http_->port(), head, 16 << 20, &sent);
  EXPECT_LT(sent, size_t{16} << 20) << "the server read the whole body";
  if (!got.empty()) {
    EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 413")) << got.substr(0, 200);
    EXPECT_TRUE(absl::StrContains(got, "invalid_request_error")) << got;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // A chunked body under the cap is served.
  httplib::Client c("127.0.0.1", http_->port());
  const std::string body = R"({"prompt": "Once", "max_tokens": 2})";
  auto res = c.Post(
      "/v1/completions",
      [&body](size_t offset, httplib::DataSink& sink) {
        if (offset == 0) sink.write(body.data(), body.size());
        sink.done();
        return true;
      },
      "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

// httplib's own refusals (a malformed request) have OpenAI's error shape as
// client errors, not {"type": "server_error", "code": "UNKNOWN"}.
TEST_F(HttpServerTest, MalformedRequestsAreClientErrors) {
  Start();
  size_t sent = 0;
  const std::string got = PostChunked(
      http_->port(), "GARBAGE\r\n\r\n", 0, &sent);
  ASSERT_TRUE(absl::StartsWith(got, "HTTP/1.1 400")) << got;
  const std::string body = got.substr(got.find("\r\n\r\n") + 4);
  const json j = json::parse(body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << got;
  EXPECT_EQ(j["error"]["type"], "invalid_request_error") << got;
  EXPECT_EQ(j["error"]["code"], "INVALID_ARGUMENT") << got;
}

TEST_F(HttpServerTest, TargetDownIs503) {
  Start({}, [](RouterServerOptions* o) {
    o->speculator = "";
    o->target = Addr(DeadPort());
  });
  ExpectError(Post("/v1/completions", R"({"prompt": "Once", "max_tokens": 2})"),
              503, "");
  ExpectError(Post("/v1/completions",
                   R"({"prompt": "Once", "max_tokens": 2, "stream": true})"),
              503, "");
  auto h = client_->Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
}

TEST_F(HttpServerTest, QueueFullIs429) {
  const std::string slow = StartSlowTarget();
  Start({}, [&](RouterServerOptions* o) {
    o->speculator = "";
    o->target = slow;
    o->max_concurrent_requests = 1;
  });
  // One stream holds the only slot.
  std::thread holder([&] {
    httplib::Client c("127.0.0.1", http_->port());
    c.Post("/v1/completions", {},
           R"({"prompt": "Once", "max_tokens": 100000, "stream": true})",
           "application/json");
  });
  ASSERT_TRUE(Eventually([&] { return router_->in_flight() == 1; }));
  ExpectError(Post("/v1/completions", R"({"prompt": "Once", "max_tokens": 2})"),
              429, "");
  http_->Shutdown();  // cancels the holder
  holder.join();
  EXPECT_TRUE(Eventually([&] { return slow_->open_ == 0; }));
}

// vLLM's /tokenize and /detokenize: the ids a completion or chat request
// with that prompt runs on, and back.
TEST_F(HttpServerTest, TokenizeAndDetokenize) {
  Start();
  const std::string text = "Once upon a time";
  const std::vector<int> want = *tokenizer_->Encode(text, true);
  auto models = client_->Get("/v1/models");
  ASSERT_TRUE(models && models->status == 200);
  const json max_len = json::parse(models->body)["data"][0]["max_model_len"];
  auto t = Post("/tokenize", json{{"prompt", text}}.dump());
  ASSERT_TRUE(t && t->status == 200) << (t ? t->body : "");
  json r = json::parse(t->body);
  EXPECT_EQ(r["tokens"].get<std::vector<int>>(), want);
  EXPECT_EQ(r["count"], want.size());
  EXPECT_EQ(r["max_model_len"], max_len);
  auto ids = Post("/tokenize", json{{"prompt", want}}.dump());
  ASSERT_TRUE(ids && ids->status == 200);
  EXPECT_EQ(json::parse(ids->body)["tokens"].get<std::vector<int>>(), want);
  // Chat: as many tokens as the chat completion's prompt.
  const json messages = {{{"role", "user"}, {"content", "Tell me a story."}}};
  auto chat_t = Post("/tokenize", json{{"messages", messages}}.dump());
  ASSERT_TRUE(chat_t && chat_t->status == 200) << chat_t->body;
  auto chat = Post("/v1/chat/completions",
                   json{{"messages", messages}, {"max_tokens", 1}}.dump());
  ASSERT_TRUE(chat && chat->status == 200);
  EXPECT_EQ(json::parse(chat_t->body)["count"],
            json::parse(chat->body)["usage"]["prompt_tokens"]);
  // And back.
  auto d = Post("/detokenize", json{{"tokens", want}}.dump());
  ASSERT_TRUE(d && d->status == 200) << d->body;
  EXPECT_EQ(json::parse(d->body)["prompt"], *tokenizer_->Decode(want));
  ExpectError(Post("/detokenize", R"({"tokens": [1, 100000]})"), 400,
              "tokens");
  ExpectError(Post("/detokenize", R"({"tokens": "1 2"})"), 400, "tokens");
  ExpectError(Post("/tokenize", R"({"prompt": ""})"), 400, "prompt");
  ExpectError(Post("/tokenize", R"({"prompt": "a", "model": "other"})"), 404,
              "model");
  ExpectError(Post("/tokenize", "[[[["), 400, "");
}

// A request of n choices takes n of --max_concurrent_requests.
TEST_F(HttpServerTest, NChoicesTakeNSlots) {
  Start({}, [](RouterServerOptions* o) { o->max_concurrent_requests = 2; });
  ExpectError(Post("/v1/completions",
                   R"({"prompt": "Once", "max_tokens": 2, "n": 3})"),
              429, "");
  auto two = Post("/v1/completions",
                  R"({"prompt": "Once", "max_tokens": 2, "n": 2})");
  ASSERT_TRUE(two && two->status == 200) << (two ? two->body : "");
  EXPECT_EQ(json::parse(two->body)["choices"].size(), 2u);
  EXPECT_TRUE(Eventually([&] { return router_->in_flight() == 0; }));
}

TEST_F(HttpServerTest, DisconnectMidStreamFreesSessions) {
  const std::string slow = StartSlowTarget();
  Start({}, [&](RouterServerOptions* o) {
    o->speculator = "";
    o->target = slow;
  });
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    const std::string body =
        std::string(path) == "/v1/completions"
            ? R"({"prompt": "Once", "max_tokens": 100000, "stream": true})"
            : R"({"messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 100000, "stream": true})";
    int received = 0;
    httplib::Client c("127.0.0.1", http_->port());
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
      return ++received < 5;  // then the client hangs up
    };
    auto res = c.send(req);
    EXPECT_EQ(received, 5);
    c.stop();
    EXPECT_TRUE(Eventually([&] {
      return slow_->open_ == 0 && http_->active() == 0 &&
             router_->in_flight() == 0;
    })) << "open target streams " << slow_->open_ << ", http "
        << http_->active() << ", router " << router_->in_flight();
  }
  EXPECT_EQ(slow_->started_, 2);
}

// A stream whose first token never comes: the status line goes out after
// 1 s, and a client that then hangs up still frees the sessions.
TEST_F(HttpServerTest, DisconnectBeforeTheFirstTokenFreesSessions) {
  const std::string slow = StartSlowTarget();
  slow_->silent = true;
  Start({}, [&](RouterServerOptions* o) {
    o->speculator = "";
    o->target = slow;
  });
  bool got_headers = false;
  httplib::Client c("127.0.0.1", http_->port());
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": "Once", "max_tokens": 10, "stream": true})";
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& r) {
    got_headers = r.status == 200;
    return false;  // hang up as soon as the status line is in
  };
  const absl::Time start = absl::Now();
  c.send(req);
  EXPECT_TRUE(got_headers);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));
  EXPECT_TRUE(Eventually([&] {
    return slow_->open_ == 0 && http_->active() == 0 &&
           router_->in_flight() == 0;
  })) << "open target streams " << slow_->open_;
  EXPECT_EQ(slow_->started_, 1);
}

}  // namespace
}  // namespace specserve
