// OpenAI request bodies -> the router's request, and the runner's chunks ->
// OpenAI responses, stream chunks and errors (no sockets).

#include "router/openai_api.h"

#include <limits>
#include <memory>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace specserve {
namespace openai {
namespace {

using json = nlohmann::json;

absl::StatusOr<ParsedRequest> Completion(const json& body) {
  return ParseRequest(Endpoint::kCompletions, body.dump(), {}, nullptr);
}

TEST(ParseRequestTest, MapsEveryField) {
  auto p = Completion({{"model", "m"},
                       {"prompt", "Hello"},
                       {"max_tokens", 7},
                       {"temperature", 0.5},
                       {"top_p", 0.9},
                       {"top_k", 40},
                       {"seed", 42},
                       {"presence_penalty", 0.5},
                       {"frequency_penalty", -1.5},
                       {"repetition_penalty", 1.2},
                       {"logit_bias", {{"5", -100}, {"17", 2.5}}},
                       {"min_tokens", 3},
                       {"min_p", 0.05},
                       {"response_format", {{"type", "json_object"}}},
                       {"stop", "\n"},
                       {"stop_token_ids", {5, 6}},
                       {"ignore_eos", true},
                       {"include_stop_str_in_output", true},
                       {"stream", true},
                       {"stream_options", {{"include_usage", true}}},
                       {"logprobs", nullptr},
                       {"user", "ignored"},
                       {"speculative_prefill",
                        {{"enabled", true},
                         {"keep_ratio", 0.25},
                         {"chunk_size", 8},
                         {"pool_kernel_size", 5},
                         {"look_ahead", 2},
                         {"keep_first", 3},
                         {"keep_last", 4},
                         {"min_prompt_tokens", 9}}},
                       {"speculative_decoding",
                        {{"enabled", false},
                         {"num_draft_tokens", 6},
                         {"method", "ngram"},
                         {"prompt_lookup_min", 2},
                         {"prompt_lookup_max", 7},
                         {"tree_branching", {4, 2, 1}},
                         {"tree_max_nodes", 12},
                         {"tree_min_path_prob", 0.05}}}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->model, "m");
  EXPECT_TRUE(p->stream);
  EXPECT_TRUE(p->include_usage);
  const v1::GenerateTextRequest& r = p->request;
  EXPECT_EQ(r.text(), "Hello");
  const v1::GenerationSampling& s = r.sampling();
  EXPECT_EQ(s.max_new_tokens(), 7);
  EXPECT_FLOAT_EQ(s.temperature(), 0.5f);
  EXPECT_FLOAT_EQ(s.top_p(), 0.9f);
  EXPECT_EQ(s.top_k(), 40);
  EXPECT_EQ(s.seed(), 42u);
  EXPECT_FLOAT_EQ(s.presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty(), -1.5f);
  EXPECT_FLOAT_EQ(s.repetition_penalty(), 1.2f);
  ASSERT_EQ(s.logit_bias_size(), 2);
  EXPECT_FLOAT_EQ(s.logit_bias().at(5), -100.f);
  EXPECT_FLOAT_EQ(s.logit_bias().at(17), 2.5f);
  EXPECT_EQ(s.min_tokens(), 3);
  EXPECT_FLOAT_EQ(s.min_p(), 0.05f);
  EXPECT_TRUE(s.json_object());
  ASSERT_EQ(s.stop_size(), 1);
  EXPECT_EQ(s.stop(0), "\n");
  ASSERT_EQ(s.stop_token_ids_size(), 2);
  EXPECT_EQ(s.stop_token_ids(1), 6);
  EXPECT_TRUE(s.ignore_eos());
  EXPECT_TRUE(s.include_stop_str_in_output());
  const v1::SpeculativePrefillConfig& sp = r.speculative_prefill();
  EXPECT_TRUE(sp.enabled());
  EXPECT_FLOAT_EQ(sp.keep_ratio(), 0.25f);
  EXPECT_EQ(sp.chunk_size(), 8);
  EXPECT_EQ(sp.pool_kernel_size(), 5);
  EXPECT_EQ(sp.look_ahead(), 2);
  EXPECT_EQ(sp.keep_first(), 3);
  EXPECT_EQ(sp.keep_last(), 4);
  EXPECT_EQ(sp.min_prompt_tokens(), 9);
  EXPECT_TRUE(r.speculative_decoding().has_enabled());
  EXPECT_FALSE(r.speculative_decoding().enabled());
  EXPECT_EQ(r.speculative_decoding().num_draft_tokens(), 6);
  const v1::SpeculativeDecodingConfig& sd = r.speculative_decoding();
  EXPECT_EQ(sd.method(), "ngram");
  EXPECT_EQ(sd.prompt_lookup_min(), 2);
  EXPECT_EQ(sd.prompt_lookup_max(), 7);
  ASSERT_EQ(sd.tree_branching_size(), 3);
  EXPECT_EQ(sd.tree_branching(0), 4);
  EXPECT_EQ(sd.tree_branching(2), 1);
  EXPECT_EQ(sd.tree_max_nodes(), 12);
  EXPECT_DOUBLE_EQ(sd.tree_min_path_prob(), 0.05);
}

// Arrays nested `depth` deep: "[[...]]".
std::string NestedArrays(int depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

// Bodies nested past kMaxBodyDepth are refused as a 400 before anything
// walks them. A few MB of '[' in chat_template_kwargs used to overflow the
// handling thread's stack while the template context was copied.
TEST(ParseRequestTest, DeeplyNestedBodiesAreRefused) {
  const auto completion = [](const std::string& user) {
    return ParseRequest(Endpoint::kCompletions,
                        "{\"prompt\": \"a\", \"user\": " + user + "}", {},
                        nullptr);
  };
  EXPECT_TRUE(completion(NestedArrays(kMaxBodyDepth)).ok());
  for (int depth : {kMaxBodyDepth + 1, 4 << 20}) {
    const auto r = completion(NestedArrays(depth));
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << depth;
    EXPECT_NE(r.status().message().find("nested deeper than 64 levels"),
              std::string::npos)
        << r.status();
    EXPECT_EQ(HttpStatus(r.status()), 400);
  }
  // The top level itself, and invalid JSON past the limit.
  EXPECT_EQ(ParseRequest(Endpoint::kCompletions, NestedArrays(1 << 20), {},
                         nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequest(Endpoint::kCompletions, std::string(1 << 20, '['),
                         {}, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);

  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  ChatFormat chat;
  chat.render = [](const json& context) -> absl::StatusOr<std::string> {
    return context.dump();
  };
  const std::string messages =
      R"({"messages": [{"role": "user", "content": "hi"}], )";
  const auto kwargs = [&](const std::string& value) {
    return ParseRequest(Endpoint::kChat,
                        messages + R"("chat_template_kwargs": {"x": )" +
                            value + "}}",
                        chat, tok->get());
  };
  EXPECT_TRUE(kwargs(NestedArrays(kMaxBodyDepth - 1)).ok());
  EXPECT_EQ(kwargs(NestedArrays(kMaxBodyDepth)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kwargs(NestedArrays(2 << 20)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParseRequestTest, UnsetFieldsStayUnset) {
  auto p = Completion({{"prompt", {1, 2, 3}},
                       {"temperature", nullptr},
                       {"response_format", {{"type", "text"}}}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->stream);
  EXPECT_EQ(p->request.token_ids().ids_size(), 3);
  EXPECT_FALSE(p->request.sampling().has_max_new_tokens());
  EXPECT_FALSE(p->request.sampling().has_temperature());
  EXPECT_FALSE(p->request.sampling().has_seed());
  EXPECT_FALSE(p->request.sampling().has_presence_penalty());
  EXPECT_FALSE(p->request.sampling().has_frequency_penalty());
  EXPECT_FALSE(p->request.sampling().has_repetition_penalty());
  EXPECT_FALSE(p->request.sampling().has_min_tokens());
  EXPECT_FALSE(p->request.sampling().has_json_object());
  EXPECT_EQ(p->request.sampling().logit_bias_size(), 0);
  EXPECT_FALSE(p->request.has_speculative_prefill());
}

TEST(ParseRequestTest, UnsupportedParametersAtTheirDefaultsAreAccepted) {
  EXPECT_TRUE(Completion({{"prompt", "a"},
                          {"logprobs", nullptr},
                          {"top_logprobs", 0},
                          {"echo", false},
                          {"best_of", 1},
                          {"suffix", ""},
                          {"logit_bias", json::object()}})
                  .ok());
  EXPECT_TRUE(Completion({{"prompt", "a"}, {"logprobs", false}}).ok());
}

TEST(ParseRequestTest, MaxCompletionTokensWinsAndNegativeSeedsWrap) {
  auto p = Completion({{"prompt", "a"},
                       {"max_tokens", 3},
                       {"max_completion_tokens", 9},
                       {"top_k", -1},
                       {"seed", -1}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request.sampling().max_new_tokens(), 9);
  EXPECT_EQ(p->request.sampling().top_k(), 0);
  EXPECT_EQ(p->request.sampling().seed(), ~uint64_t{0});
}

TEST(ParseRequestTest, ErrorsNameTheParameter) {
  struct Case {
    json body;
    std::string param;
  };
  const std::vector<Case> cases = {
      {{{"prompt", "a"}, {"n", 17}}, "n"},
      {{{"prompt", "a"}, {"max_tokens", "9"}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", 1e10}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", 5000000000}}, "max_tokens"},
      {{{"prompt", "a"}, {"top_p", 1.5}}, "top_p"},
      {{{"prompt", "a"}, {"temperature", -0.1}}, "temperature"},
      {{{"prompt", "a"}, {"seed", 1.5}}, "seed"},
      {{{"prompt", "a"}, {"presence_penalty", 2.5}}, "presence_penalty"},
      {{{"prompt", "a"}, {"presence_penalty", "1"}}, "presence_penalty"},
      {{{"prompt", "a"}, {"frequency_penalty", -2.01}}, "frequency_penalty"},
      {{{"prompt", "a"}, {"repetition_penalty", 0}}, "repetition_penalty"},
      {{{"prompt", "a"}, {"repetition_penalty", -1}}, "repetition_penalty"},
      {{{"prompt", "a"}, {"repetition_penalty", 1e300}},
       "repetition_penalty"},
      {{{"prompt", "a"}, {"stop", {"x", ""}}}, "stop[1]"},
      {{{"prompt", "a"}, {"stop", 3}}, "stop"},
      {{{"prompt", "a"}, {"stream_options", {{"include_usage", true}}}},
       "stream_options"},
      {{{"prompt", "a"}, {"stream", true}, {"stream_options", 1}},
       "stream_options"},
      {{{"prompt", "a"}, {"model", 1}}, "model"},
      {{{"prompt", {-1}}}, "prompt"},
      {{{"prompt", json::array()}}, "prompt"},
      {{{"prompt", {"a", ""}}}, "prompt"},
      {{{"prompt", {"a", 5}}}, "prompt[1]"},
      {{{"prompt", {"a", "b"}}, {"n", 33}}, "n"},
      {{{"prompt", json(std::vector<std::string>(65, "a"))}}, "prompt"},
      {{{"prompt", json(std::vector<std::string>(22, "a"))}, {"n", 3}},
       "prompt"},
      {{{"prompt", "a"}, {"speculative_decoding", {{"enabled", 1}}}},
       "speculative_decoding.enabled"},
      {{{"prompt", "a"}, {"speculative_decoding", {{"method", 3}}}},
       "speculative_decoding.method"},
      {{{"prompt", "a"},
        {"speculative_decoding", {{"prompt_lookup_min", "2"}}}},
       "speculative_decoding.prompt_lookup_min"},
      {{{"prompt", "a"},
        {"speculative_decoding", {{"prompt_lookup_max", 2.5}}}},
       "speculative_decoding.prompt_lookup_max"},
      {{{"prompt", "a"}, {"speculative_decoding", {{"tree_branching", 4}}}},
       "speculative_decoding.tree_branching"},
      {{{"prompt", "a"},
        {"speculative_decoding", {{"tree_branching", {4, "2"}}}}},
       "speculative_decoding.tree_branching[1]"},
      {{{"prompt", "a"},
        {"speculative_decoding", {{"tree_max_nodes", true}}}},
       "speculative_decoding.tree_max_nodes"},
      {{{"prompt", "a"},
        {"speculative_decoding", {{"tree_min_path_prob", "0.1"}}}},
       "speculative_decoding.tree_min_path_prob"},
      {{{"prompt", "a"}, {"speculative_prefill", {{"chunk_size", 2.5}}}},
       "speculative_prefill.chunk_size"},
      {{{"prompt", "a"}, {"speculative_prefill", true}}, "speculative_prefill"},
      {{{"prompt", "a"}, {"logprobs", 21}}, "logprobs"},
      {{{"prompt", "a"}, {"logprobs", -1}}, "logprobs"},
      {{{"prompt", "a"}, {"logprobs", 1.5}}, "logprobs"},
      {{{"prompt", "a"}, {"logprobs", "2"}}, "logprobs"},
      {{{"prompt", "a"}, {"logprobs", true}}, "logprobs"},
      {{{"prompt", "a"}, {"logprobs", 99999999999}}, "logprobs"},
      {{{"prompt", "a"}, {"top_logprobs", 2}}, "top_logprobs"},
      {{{"prompt", "a"}, {"echo", "yes"}}, "echo"},
      {{{"prompt", "a"}, {"best_of", 3}}, "best_of"},
      {{{"prompt", "a"}, {"suffix", "x"}}, "suffix"},
      {{{"prompt", "a"}, {"logit_bias", {{"x", 10}}}}, "logit_bias"},
      {{{"prompt", "a"}, {"logit_bias", {{"-5", 10}}}}, "logit_bias"},
      {{{"prompt", "a"}, {"logit_bias", {{"05", 10}}}}, "logit_bias"},
      {{{"prompt", "a"}, {"logit_bias", {{"5", 101}}}}, "logit_bias"},
      {{{"prompt", "a"}, {"logit_bias", {{"5", "1"}}}}, "logit_bias.5"},
      {{{"prompt", "a"}, {"logit_bias", {5, 1}}}, "logit_bias"},
      {{{"prompt", "a"}, {"min_tokens", -1}}, "min_tokens"},
      {{{"prompt", "a"}, {"min_p", 1.5}}, "min_p"},
      {{{"prompt", "a"}, {"min_p", "0.1"}}, "min_p"},
      {{{"prompt", "a"}, {"min_tokens", 1.5}}, "min_tokens"},
      {{{"prompt", "a"}, {"response_format", {{"type", "json_schema"}}}},
       "response_format"},
      {{{"prompt", "a"},
        {"response_format",
         {{"type", "json_schema"}, {"json_schema", {{"schema", "x"}}}}}},
       "response_format"},
      {{{"prompt", "a"}, {"response_format", {{"type", "xml"}}}},
       "response_format"},
      {{{"prompt", "a"}, {"response_format", "json_object"}},
       "response_format"},
  };
  for (const Case& c : cases) {
    auto p = Completion(c.body);
    ASSERT_FALSE(p.ok()) << c.body;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ParamOf(p.status()).value_or("(none)"), c.param) << c.body;
    EXPECT_EQ(HttpStatus(p.status()), 400);
  }
}

ChatFormat PlainChat();  // below

// Completions' echo: the prompt's logprobs are asked for only with
// logprobs (then with the same top-N); chat's echo stays refused.
TEST(ParseRequestTest, CompletionEchoAsksForPromptLogprobsWithLogprobs) {
  auto p = Completion({{"prompt", "a"}, {"echo", true}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->echo);
  EXPECT_FALSE(p->request.sampling().has_prompt_logprobs());
  p = Completion({{"prompt", {"a", "b"}}, {"echo", true}, {"logprobs", 2}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request.sampling().prompt_logprobs(), 2);
  ASSERT_EQ(p->more_prompts.size(), 1u);
  EXPECT_EQ(p->more_prompts[0].sampling().prompt_logprobs(), 2);
  p = Completion({{"prompt", "a"}, {"echo", false}, {"logprobs", 2}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->echo);
  EXPECT_FALSE(p->request.sampling().has_prompt_logprobs());
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto chat = ParseRequest(
      Endpoint::kChat,
      json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
           {"echo", true}}
          .dump(),
      PlainChat(), tok->get());
  EXPECT_EQ(ParamOf(chat.status()).value_or("(none)"), "echo");
}

// response_format json_schema: the schema's text, its keys in the order
// the body lists them.
TEST(ParseRequestTest, JsonSchemaKeepsThePropertyOrder) {
  auto p = ParseRequest(
      Endpoint::kCompletions,
      R"({"prompt": "a", "response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "strict": true, "schema":
          {"type": "object", "properties": {"z": {}, "a": {}}}}}})",
      {}, nullptr);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request.sampling().json_schema(),
            R"({"type":"object","properties":{"z":{},"a":{}}})");
  EXPECT_FALSE(p->request.sampling().has_json_object());
}

// vLLM's structured-output extensions: guided_json / structured_outputs
// .json as json_schema (object or text; an object keeps the body's key
// order), structured_outputs.json_object as JSON mode; choice, regex and
// grammar refused; two structured outputs at once refused.
TEST(ParseRequestTest, VllmStructuredOutputExtensions) {
  auto parse = [](const std::string& body) {
    return ParseRequest(Endpoint::kCompletions, body, {}, nullptr);
  };
  auto p = parse(R"({"prompt": "a", "guided_json": {"type": "object",
      "properties": {"z": {}, "a": {}}}})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request.sampling().json_schema(),
            R"({"type":"object","properties":{"z":{},"a":{}}})");
  p = parse(R"({"prompt": "a", "guided_json": "{\"type\": \"object\"}"})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request.sampling().json_schema(), R"({"type": "object"})");
  p = parse(R"({"prompt": "a", "structured_outputs": {"json":
      {"properties": {"b": {}, "a": {}}}}})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request.sampling().json_schema(),
            R"({"properties":{"b":{},"a":{}}})");
  p = parse(R"({"prompt": "a", "structured_outputs": {"json_object": true}})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->request.sampling().json_object());
  for (const char* body :
       {R"({"prompt": "a", "guided_choice": ["yes", "no"]})",
        R"({"prompt": "a", "structured_outputs": {"choice": ["yes", "no"]}})"}) {
    p = parse(body);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(std::vector<std::string>(p->request.sampling().choice().begin(),
                                       p->request.sampling().choice().end()),
              (std::vector<std::string>{"yes", "no"}));
  }
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "a", "guided_choice": []})", "guided_choice"},
           {R"({"prompt": "a", "guided_choice": ["x", ""]})", "guided_choice"},
           {R"({"prompt": "a", "guided_choice": ["x"], "guided_json": {}})",
            "guided_json"},
           {R"({"prompt": "a", "guided_regex": "a+"})", "guided_regex"},
           {R"({"prompt": "a", "structured_outputs": {"regex": "x+"}})",
            "structured_outputs.regex"},
           {R"({"prompt": "a", "structured_outputs": 3})", "structured_outputs"},
           {R"({"prompt": "a", "guided_json": 3})", "guided_json"},
           {R"({"prompt": "a", "guided_json": {}, "response_format":
               {"type": "json_object"}})", "guided_json"},
       }) {
    auto bad = parse(body);
    EXPECT_EQ(ParamOf(bad.status()).value_or("(none)"), param) << body;
  }
}

TEST(ParseRequestTest, CompletionLogprobs) {
  for (int n : {0, 5, 20}) {
    auto p = Completion({{"prompt", "a"}, {"logprobs", n}});
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(p->request.sampling().logprobs());
    EXPECT_EQ(p->request.sampling().top_logprobs(), n);
  }
  for (const json& off : {json(nullptr), json(false)}) {
    auto p = Completion({{"prompt", "a"}, {"logprobs", off}});
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_FALSE(p->request.sampling().has_logprobs());
    EXPECT_FALSE(p->request.sampling().has_top_logprobs());
  }
}

ChatFormat PlainChat() {
  ChatFormat f;
  f.add_bos = true;
  f.render = [](const json& ctx) -> absl::StatusOr<std::string> {
    std::string out;
    for (const json& m : ctx["messages"]) {
      out += m["content"].get<std::string>() + "\n";
    }
    return out;
  };
  return f;
}

TEST(ParseRequestTest, ChatLogprobsAndBadInputs) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const ChatFormat f = PlainChat();
  auto chat = [&](json extra) {
    json body = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
    body.update(extra);
    return ParseRequest(Endpoint::kChat, body.dump(), f, tok->get());
  };
  auto p = chat({{"logprobs", true}, {"top_logprobs", 3}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->request.sampling().logprobs());
  EXPECT_EQ(p->request.sampling().top_logprobs(), 3);
  p = chat({{"logprobs", true}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->request.sampling().logprobs());
  EXPECT_EQ(p->request.sampling().top_logprobs(), 0);
  for (const json& off : {json{{"logprobs", false}}, json{{"logprobs", nullptr}},
                          json{{"top_logprobs", nullptr}}}) {
    p = chat(off);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_FALSE(p->request.sampling().logprobs());
  }
  struct Case {
    json extra;
    std::string param;
  };
  const std::vector<Case> cases = {
      {{{"top_logprobs", 2}}, "top_logprobs"},  // needs logprobs
      {{{"logprobs", false}, {"top_logprobs", 0}}, "top_logprobs"},
      {{{"logprobs", true}, {"top_logprobs", 21}}, "top_logprobs"},
      {{{"logprobs", true}, {"top_logprobs", -1}}, "top_logprobs"},
      {{{"logprobs", true}, {"top_logprobs", "3"}}, "top_logprobs"},
      {{{"logprobs", true}, {"top_logprobs", 2.5}}, "top_logprobs"},
      {{{"logprobs", 1}}, "logprobs"},
      {{{"logprobs", "true"}}, "logprobs"},
  };
  for (const Case& c : cases) {
    p = chat(c.extra);
    ASSERT_FALSE(p.ok()) << c.extra;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ParamOf(p.status()).value_or("(none)"), c.param) << c.extra;
    EXPECT_EQ(HttpStatus(p.status()), 400);
  }
}

TEST(ParseRequestTest, ChatRendersAndTokenizes) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  json seen;
  ChatFormat f;
  f.add_bos = true;
  f.render = [&seen](const json& ctx) -> absl::StatusOr<std::string> {
    seen = ctx;
    std::string out;
    for (const json& m : ctx["messages"]) {
      out += m["role"].get<std::string>() + ": " +
             m["content"].get<std::string>() + "\n";
    }
    return out + (ctx["add_generation_prompt"] == true ? "assistant:" : "");
  };
  const json body = {
      {"messages",
       {{{"role", "system"}, {"content", "Be nice."}},
        {{"role", "user"},
         {"content",
          {{{"type", "text"}, {"text", "Hi "}},
           {{"type", "text"}, {"text", "there"}}}}},
        {{"role", "assistant"}, {"content", nullptr}}}}};
  auto p = ParseRequest(Endpoint::kChat, body.dump(), f, tok->get());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(seen, json::parse(R"({"messages": [
      {"role":"system","content":"Be nice."},
      {"role":"user","content":"Hi there"},{"role":"assistant","content":""}],
      "add_generation_prompt": true})"));
  const std::string prompt =
      "system: Be nice.\nuser: Hi there\nassistant: \nassistant:";
  auto want = (*tok)->Encode(prompt, /*add_bos=*/true);
  ASSERT_TRUE(want.ok());
  const auto& ids = p->request.token_ids().ids();
  EXPECT_EQ(std::vector<int>(ids.begin(), ids.end()), *want);

  // vLLM's add_generation_prompt and chat_template_kwargs reach the
  // template.
  json body2 = body;
  body2["add_generation_prompt"] = false;
  body2["chat_template_kwargs"] = {{"enable_thinking", false}};
  ASSERT_TRUE(ParseRequest(Endpoint::kChat, body2.dump(), f, tok->get()).ok());
  EXPECT_EQ(seen["add_generation_prompt"], false);
  EXPECT_EQ(seen["enable_thinking"], false);
  body2["chat_template_kwargs"] = 1;
  EXPECT_EQ(ParamOf(ParseRequest(Endpoint::kChat, body2.dump(), f, tok->get())
                        .status()),
            "chat_template_kwargs");

  // Function calling: a named function (or "required" with one tool)
  // makes the answer that call, its arguments an instance of the
  // function's parameters, in their order; the tools reach the template.
  // "auto" (the default with tools) needs a tool-call parser: refused.
  const char* tools_body = R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "get_weather",
                 "parameters": {"type": "object", "properties": {
                   "where": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["where"]}}},
                {"type": "function", "function": {"name": "now"}}],
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})";
  p = ParseRequest(Endpoint::kChat, tools_body, f, tok->get());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->tool_call, "get_weather");
  EXPECT_EQ(p->request.sampling().json_schema(),
            R"({"type":"object","properties":{"where":{"type":"string"},)"
            R"("unit":{"enum":["c","f"]}},"required":["where"]})");
  ASSERT_EQ(seen["tools"].size(), 2u);
  EXPECT_EQ(seen["tools"][1]["function"]["name"], "now");
  json tb = json::parse(tools_body);
  tb["tool_choice"] = {{"type", "function"}, {"function", {{"name", "now"}}}};
  p = ParseRequest(Endpoint::kChat, tb.dump(), f, tok->get());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request.sampling().json_schema(), R"({"type": "object"})");
  tb["tool_choice"] = "none";
  p = ParseRequest(Endpoint::kChat, tb.dump(), f, tok->get());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->tool_call.empty());
  EXPECT_TRUE(p->read_tools.empty());
  EXPECT_FALSE(p->request.sampling().has_json_schema());
  // "auto", also the default with tools: the answer is free, read after.
  for (const json& c : {json("auto"), json(nullptr)}) {
    tb["tool_choice"] = c;
    p = ParseRequest(Endpoint::kChat, tb.dump(), f, tok->get());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->read_tools, (std::vector<std::string>{"get_weather", "now"}));
    EXPECT_FALSE(p->request.sampling().has_json_schema());
  }
  json one = json::parse(tools_body);
  one["tools"].erase(1);
  one["tool_choice"] = "required";
  p = ParseRequest(Endpoint::kChat, one.dump(), f, tok->get());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->tool_call, "get_weather");
  EXPECT_TRUE(p->read_tools.empty());
  // "required" with several tools: the answer names its function, a
  // union of {"name", "parameters"} objects told apart by the name.
  nlohmann::ordered_json several = nlohmann::ordered_json::parse(tools_body);
  several["tool_choice"] = "required";
  p = ParseRequest(Endpoint::kChat, several.dump(), f, tok->get());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->tool_call.empty());
  EXPECT_EQ(p->read_tools, (std::vector<std::string>{"get_weather", "now"}));
  EXPECT_EQ(p->request.sampling().json_schema(),
            R"({"anyOf":[{"type":"object","properties":{"name":{"const":)"
            R"("get_weather"},"parameters":{"type":"object","properties":{)"
            R"("where":{"type":"string"},"unit":{"enum":["c","f"]}},)"
            R"("required":["where"]}},"required":["name","parameters"]},)"
            R"({"type":"object","properties":{"name":{"const":"now"},)"
            R"("parameters":{"type":"object"}},"required":["name",)"
            R"("parameters"]}]})");
  struct ToolCase {
    std::function<void(json*)> edit;
    std::string param;
  };
  for (const ToolCase& c : std::vector<ToolCase>{
           {[](json* b) { (*b)["tool_choice"] = "any"; }, "tool_choice"},
           {[](json* b) {
              (*b)["tool_choice"]["function"]["name"] = "missing";
            },
            "tool_choice"},
           {[](json* b) {
              (*b)["response_format"] = {{"type", "json_object"}};
            },
            "tool_choice"},
           {[](json* b) { b->erase("tools"); }, "tool_choice"},
           {[](json* b) { (*b)["tools"][0]["type"] = "code"; }, "tools[0]"},
           {[](json* b) { (*b)["tools"][1]["function"]["name"] = "a b"; },
            "tools[1].function.name"},
           {[](json* b) { (*b)["tools"][0]["function"]["parameters"] = 3; },
            "tools[0].function.parameters"},
           {[](json* b) { (*b)["messages"][0]["tool_calls"] = 1; },
            "messages[0].tool_calls"},
       }) {
    json b = json::parse(tools_body);
    c.edit(&b);
    auto bad_tools = ParseRequest(Endpoint::kChat, b.dump(), f, tok->get());
    EXPECT_EQ(ParamOf(bad_tools.status()).value_or("(none)"), c.param)
        << b.dump() << " " << bad_tools.status();
  }
  // A conversation that used a tool: the calls and the answer reach the
  // template.
  json history = {
      {"messages",
       {{{"role", "user"}, {"content", "weather?"}},
        {{"role", "assistant"},
         {"content", nullptr},
         {"tool_calls",
          {{{"id", "call_1"},
            {"type", "function"},
            {"function", {{"name", "now"}, {"arguments", "{}"}}}}}}},
        {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "noon"}}}}};
  ASSERT_TRUE(ParseRequest(Endpoint::kChat, history.dump(), f, tok->get()).ok());
  EXPECT_EQ(seen["messages"][1]["tool_calls"][0]["id"], "call_1");
  EXPECT_EQ(seen["messages"][2]["tool_call_id"], "call_1");
  EXPECT_FALSE(seen.contains("tools"));

  // Without a tokenizer chat is refused; a template error is a 400.
  EXPECT_FALSE(ParseRequest(Endpoint::kChat, body.dump(), f, nullptr).ok());
  f.render = [](const json&) -> absl::StatusOr<std::string> {
    return absl::InvalidArgumentError("boom");
  };
  auto bad = ParseRequest(Endpoint::kChat, body.dump(), f, tok->get());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(ParamOf(bad.status()), "messages");
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "boom"));
  // A template the server cannot run is the server's error.
  f.render = [](const json&) -> absl::StatusOr<std::string> {
    return absl::UnimplementedError("unsupported");
  };
  EXPECT_EQ(ParseRequest(Endpoint::kChat, body.dump(), f, tok->get())
                .status()
                .code(),
            absl::StatusCode::kUnimplemented);
}

TEST(ChatPromptIdsTest, BosStringBecomesTheBosId) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const Tokenizer& t = **tok;
  ChatFormat model_template;  // writes its own BOS string
  model_template.bos_token = "<s>";
  ChatFormat default_template;  // knows no BOS
  default_template.add_bos = true;
  auto with = ChatPromptIds("<s>Hello", model_template, t);
  auto plain = ChatPromptIds("Hello", model_template, t);
  auto default_fmt = ChatPromptIds("Hello", default_template, t);
  auto no_bos = ChatPromptIds("Hello", ChatFormat(), t);
  ASSERT_TRUE(with.ok() && plain.ok() && default_fmt.ok() && no_bos.ok());
  EXPECT_EQ(*with, *t.Encode("Hello", true));
  EXPECT_EQ(*plain, *t.Encode("Hello", false));
  EXPECT_EQ(*default_fmt, *t.Encode("Hello", true));
  EXPECT_EQ(*no_bos, *t.Encode("Hello", false));
  EXPECT_EQ((*with)[0], t.bos_id());
}

TEST(StatusMappingTest, RouterErrorsNameTheParameter) {
  const auto param = [](const char* msg, Endpoint e = Endpoint::kCompletions) {
    return ParamOf(NameParam(absl::InvalidArgumentError(msg), e))
        .value_or("(none)");
  };
  EXPECT_EQ(param("token_ids.ids[3] = 9 is outside"), "prompt");
  EXPECT_EQ(param("token_ids.ids[3] = 9 is outside", Endpoint::kChat),
            "messages");
  EXPECT_EQ(param("prompt: 600 tokens leave no room"), "prompt");
  EXPECT_EQ(param("sampling.max_new_tokens must be >= 1"), "max_tokens");
  EXPECT_EQ(param("sampling.top_p must be in (0, 1]"), "top_p");
  EXPECT_EQ(param("sampling.json_object: JSON mode is not available"),
            "response_format");
  EXPECT_EQ(param("sampling.stop_token_ids[0] = 7 is outside"),
            "stop_token_ids");
  EXPECT_EQ(param("speculative_prefill.keep_ratio must be"),
            "speculative_prefill.keep_ratio");
  EXPECT_EQ(param("speculative_decoding.method must be one of \"draft\""),
            "speculative_decoding.method");
  EXPECT_EQ(param("speculative_decoding.tree_branching[1] must be in [1, 8]"),
            "speculative_decoding.tree_branching");
  EXPECT_EQ(param("something else"), "(none)");
  // An existing param and other codes are kept.
  EXPECT_EQ(ParamOf(NameParam(ParamError("n", "sampling.x"),
                              Endpoint::kCompletions)),
            "n");
  EXPECT_FALSE(ParamOf(NameParam(absl::UnavailableError("token_ids"),
                                 Endpoint::kCompletions)));
}

TEST(StatusMappingTest, HttpStatusesAndErrorShape) {
  EXPECT_EQ(HttpStatus(absl::UnauthenticatedError("")), 401);
  EXPECT_EQ(HttpStatus(absl::NotFoundError("")), 404);
  EXPECT_EQ(HttpStatus(absl::ResourceExhaustedError("")), 429);
  EXPECT_EQ(HttpStatus(absl::UnavailableError("")), 503);
  EXPECT_EQ(HttpStatus(absl::DeadlineExceededError("")), 504);
  EXPECT_EQ(HttpStatus(absl::InternalError("")), 500);
  const json e = ErrorBody(ParamError("top_p", "bad top_p"));
  EXPECT_EQ(e, json::parse(R"({"error": {"message": "bad top_p",
      "type": "invalid_request_error", "param": "top_p",
      "code": "INVALID_ARGUMENT"}})"));
  EXPECT_TRUE(ErrorBody(absl::UnavailableError("down"))["error"]["param"]
                  .is_null());
  EXPECT_EQ(OpenAiFinishReason("eos"), "stop");
  EXPECT_EQ(OpenAiFinishReason("stop_token"), "stop");
  EXPECT_EQ(OpenAiFinishReason("stop"), "stop");
  EXPECT_EQ(OpenAiFinishReason("length"), "length");
  EXPECT_EQ(OpenAiFinishReason("context_limit"), "length");
}

std::vector<json> Events(const std::string& sse) {
  std::vector<json> out;
  for (absl::string_view e : absl::StrSplit(sse, "\n\n", absl::SkipEmpty())) {
    EXPECT_TRUE(absl::ConsumePrefix(&e, "data: ")) << e;
    out.push_back(json::parse(e));
  }
  return out;
}

TEST(ResponseBuilderTest, ChatStream) {
  ResponseBuilder b(Endpoint::kChat, "chatcmpl-1", "m", 100, true);
  v1::GenerateTextChunk c;
  c.set_text("Hel");
  std::vector<json> ev = Events(b.StreamEvents(c));
  ASSERT_EQ(ev.size(), 2u);  // role, then content
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["content"], "Hel");
  EXPECT_TRUE(ev[1]["usage"].is_null());
  c.set_text("");
  EXPECT_EQ(b.StreamEvents(c), "");  // empty deltas send nothing
  c.set_text("lo");
  c.set_finish_reason("context_limit");
  c.mutable_usage()->set_prompt_tokens(5);
  c.mutable_usage()->set_kept_prompt_tokens(3);
  c.mutable_usage()->set_completion_tokens(2);
  c.mutable_stats()->set_num_drafts(4);
  ev = Events(b.StreamEvents(c));
  ASSERT_EQ(ev.size(), 2u);  // last content + finish, then usage
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["content"], "lo");
  EXPECT_EQ(ev[0]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(ev[0]["specserve"]["kept_prompt_tokens"], 3);
  EXPECT_EQ(ev[0]["specserve"]["num_drafts"], 4);
  EXPECT_TRUE(ev[1]["choices"].empty());
  EXPECT_EQ(ev[1]["usage"],
            json::parse(R"({"prompt_tokens": 5, "completion_tokens": 2,
                            "total_tokens": 7})"));
  EXPECT_EQ(ev[1]["id"], "chatcmpl-1");
  EXPECT_EQ(ResponseBuilder::DoneEvent(), "data: [DONE]\n\n");
}

// A batch of prompts: one request per prompt, the same but for the
// prompt, and prompt p's choice i is choice p * n + i with seed + i.
TEST(ParseRequestTest, PromptBatches) {
  auto p = Completion({{"prompt", {"Once", "upon", {7, 8, 9}}},
                       {"n", 2},
                       {"seed", 10},
                       {"temperature", 0.5}});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->num_prompts(), 3);
  EXPECT_EQ(p->request.text(), "Once");
  EXPECT_EQ(p->more_prompts[0].text(), "upon");
  EXPECT_EQ(p->more_prompts[1].token_ids().ids_size(), 3);
  EXPECT_FLOAT_EQ(p->more_prompts[1].sampling().temperature(), 0.5f);
  const std::vector<v1::GenerateTextRequest> choices = ChoiceRequests(*p);
  ASSERT_EQ(choices.size(), 6u);
  for (int c = 0; c < 6; ++c) {
    EXPECT_EQ(choices[c].sampling().seed(), 10u + c % 2) << c;
  }
  EXPECT_EQ(choices[1].text(), "Once");
  EXPECT_EQ(choices[2].text(), "upon");
  EXPECT_EQ(choices[5].token_ids().ids(2), 9);
  // 64 choices in all is the most.
  EXPECT_TRUE(Completion({{"prompt", std::vector<std::string>(16, "a")},
                          {"n", 4}})
                  .ok());
  auto one = Completion({{"prompt", {"only"}}});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->num_prompts(), 1);
  EXPECT_EQ(ChoiceRequests(*one).size(), 1u);
}

// Usage counts each prompt once: choices 0..n-1 share prompt 0, and so on.
TEST(ResponseBuilderTest, BatchUsageCountsEachPromptOnce) {
  ResponseBuilder b(Endpoint::kCompletions, "cmpl-1", "m", 100,
                    /*include_usage=*/true, /*n=*/4, /*choices_per_prompt=*/2);
  std::vector<v1::GenerateTextResponse> rs(4);
  for (int i = 0; i < 4; ++i) {
    rs[i].mutable_usage()->set_prompt_tokens(i < 2 ? 10 : 20);
    rs[i].mutable_usage()->set_completion_tokens(i + 1);
  }
  const json j = b.Response(rs);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 30);
  EXPECT_EQ(j["usage"]["completion_tokens"], 10);
  EXPECT_EQ(j["choices"][3]["index"], 3);
  // Streamed: the usage chunk after the last choice's final chunk.
  std::vector<json> usage_events;
  for (int i : {2, 0, 3, 1}) {
    v1::GenerateTextChunk c;
    c.set_finish_reason("length");
    *c.mutable_usage() = rs[i].usage();
    for (const json& e : Events(b.StreamEvents(c, i))) {
      if (e["choices"].empty()) usage_events.push_back(e);
    }
  }
  ASSERT_EQ(usage_events.size(), 1u);
  EXPECT_EQ(usage_events[0]["usage"]["prompt_tokens"], 30);
  EXPECT_EQ(usage_events[0]["usage"]["completion_tokens"], 10);
}

TEST(ResponseBuilderTest, CompletionResponse) {
  ResponseBuilder b(Endpoint::kCompletions, "cmpl-1", "m", 100, false);
  v1::GenerateTextResponse r;
  r.set_text("story");
  r.set_finish_reason("eos");
  r.mutable_usage()->set_prompt_tokens(4);
  r.mutable_usage()->set_completion_tokens(1);
  r.mutable_stats()->set_ttft_s(0.5);
  const json j = b.Response(r);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["created"], 100);
  EXPECT_EQ(j["choices"][0]["text"], "story");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["total_tokens"], 5);
  EXPECT_DOUBLE_EQ(j["specserve"]["ttft_s"].get<double>(), 0.5);
  EXPECT_EQ(j["specserve"]["fallback_reason"], "");
  // Without include_usage, stream chunks carry no usage key.
  v1::GenerateTextChunk c;
  c.set_text("x");
  const std::vector<json> ev = Events(b.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_FALSE(ev[0].contains("usage"));
  EXPECT_EQ(ev[0]["choices"][0]["text"], "x");
}

// A token's logprob with `top` (id, logprob) alternatives.
v1::TokenLogprob Lp(float logprob, std::vector<std::pair<int, float>> top) {
  v1::TokenLogprob lp;
  lp.set_logprob(logprob);
  for (auto [id, l] : top) {
    v1::TopLogprob* t = lp.add_top();
    t->set_id(id);
    t->set_logprob(l);
  }
  return lp;
}

TEST(ResponseBuilderTest, CompletionLogprobs) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int> ids = *(*tok)->Encode("Once upon a time", false);
  ASSERT_GE(ids.size(), 3u);
  v1::GenerateTextResponse r;
  r.set_text(*(*tok)->Decode(ids));
  r.set_finish_reason("length");
  for (size_t i = 0; i < ids.size(); ++i) {
    r.add_token_ids(ids[i]);
    // The token's own entry and a top-2 holding another id first.
    *r.add_logprobs() =
        Lp(-0.5f - i, {{ids[(i + 1) % ids.size()], -0.1f}, {ids[i], -0.5f - i}});
  }
  ResponseBuilder off(Endpoint::kCompletions, "cmpl-1", "m", 100, false);
  EXPECT_TRUE(off.Response(r)["choices"][0]["logprobs"].is_null());

  ResponseBuilder b(Endpoint::kCompletions, "cmpl-1", "m", 100, false);
  b.EnableLogprobs(tok->get());
  const json lp = b.Response(r)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size()) << lp;
  ASSERT_EQ(lp["token_logprobs"].size(), ids.size());
  ASSERT_EQ(lp["top_logprobs"].size(), ids.size());
  ASSERT_EQ(lp["text_offset"].size(), ids.size());
  std::string joined;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string token = lp["tokens"][i];
    EXPECT_EQ(lp["text_offset"][i], joined.size());
    joined += token;
    EXPECT_FLOAT_EQ(lp["token_logprobs"][i].get<float>(), -0.5f - i);
    EXPECT_TRUE(lp["top_logprobs"][i].is_object());
    EXPECT_FLOAT_EQ(lp["top_logprobs"][i][token].get<float>(), -0.5f - i);
    EXPECT_EQ(lp["top_logprobs"][i].size(), 2u);
  }
  // Every token but the first keeps its leading space ("▁upon").
  EXPECT_EQ(joined, " Once upon a time");
  EXPECT_EQ(lp["tokens"][1], " upon");

  // Streamed: each chunk the logprobs of its own tokens, text_offset going
  // on from the previous chunk; a chunk of tokens without text yet is sent.
  ResponseBuilder s(Endpoint::kCompletions, "cmpl-2", "m", 100, false);
  s.EnableLogprobs(tok->get());
  v1::GenerateTextChunk c;
  c.add_token_ids(ids[0]);
  *c.add_logprobs() = r.logprobs(0);
  std::vector<json> ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["choices"][0]["text"], "");
  EXPECT_EQ(ev[0]["choices"][0]["logprobs"]["tokens"],
            json::array({lp["tokens"][0]}));
  c.Clear();
  c.set_text("x");
  c.set_finish_reason("length");
  c.add_token_ids(ids[1]);
  c.add_token_ids(ids[2]);
  *c.add_logprobs() = r.logprobs(1);
  *c.add_logprobs() = r.logprobs(2);
  ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);
  const json& l2 = ev[0]["choices"][0]["logprobs"];
  EXPECT_EQ(l2["tokens"], json::array({lp["tokens"][1], lp["tokens"][2]}));
  EXPECT_EQ(l2["text_offset"],
            json::array({lp["text_offset"][1], lp["text_offset"][2]}));
  EXPECT_EQ(ev[0]["choices"][0]["finish_reason"], "length");
}

// echo: each choice's text starts with its prompt's; with logprobs the
// prompt's tokens come first, the first with null logprob and top, the
// text offsets running on into the completion; streamed, the prompt goes
// with the choice's first event only.
TEST(ResponseBuilderTest, CompletionEcho) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int> prompt = *(*tok)->Encode("Once upon", false);
  const std::vector<int> out = *(*tok)->Encode(" a time", false);
  ASSERT_GE(prompt.size(), 2u);
  v1::GenerateTextResponse r;
  r.set_text(" a time");
  r.set_finish_reason("length");
  for (int id : out) {
    r.add_token_ids(id);
    *r.add_logprobs() = Lp(-1.f, {{id, -1.f}});
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    r.add_prompt_token_ids(prompt[i]);
    if (i > 0) *r.add_prompt_logprobs() = Lp(-2.f - i, {{7, -0.5f}});
  }
  ResponseBuilder plain(Endpoint::kCompletions, "cmpl-1", "m", 100, false);
  plain.EnableEcho({"Once upon"});
  EXPECT_EQ(plain.Response(r)["choices"][0]["text"], "Once upon a time");

  ResponseBuilder b(Endpoint::kCompletions, "cmpl-1", "m", 100, false);
  b.EnableLogprobs(tok->get());
  b.EnableEcho({"Once upon"});
  const json lp = b.Response(r)["choices"][0]["logprobs"];
  const size_t all = prompt.size() + out.size();
  ASSERT_EQ(lp["tokens"].size(), all) << lp;
  ASSERT_EQ(lp["token_logprobs"].size(), all);
  ASSERT_EQ(lp["top_logprobs"].size(), all);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  std::string joined;
  for (size_t i = 0; i < all; ++i) {
    EXPECT_EQ(lp["text_offset"][i], joined.size()) << i;
    joined += lp["tokens"][i].get<std::string>();
    if (i == 0) continue;
    const float want = i < prompt.size() ? -2.f - i : -1.f;
    EXPECT_FLOAT_EQ(lp["token_logprobs"][i].get<float>(), want) << i;
  }
  EXPECT_EQ(joined, " Once upon a time");

  ResponseBuilder s(Endpoint::kCompletions, "cmpl-2", "m", 100, false);
  s.EnableLogprobs(tok->get());
  s.EnableEcho({"Once upon"});
  v1::GenerateTextChunk c;
  c.set_text(" a");
  c.add_token_ids(out[0]);
  *c.add_logprobs() = r.logprobs(0);
  *c.mutable_prompt_token_ids() = r.prompt_token_ids();
  *c.mutable_prompt_logprobs() = r.prompt_logprobs();
  std::vector<json> ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["choices"][0]["text"], "Once upon a");
  EXPECT_EQ(ev[0]["choices"][0]["logprobs"]["tokens"].size(),
            prompt.size() + 1);
  c.Clear();
  c.set_text(" time");
  c.set_finish_reason("length");
  ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["choices"][0]["text"], " time");
}

// A forced tool call: the message holds the call (content null, an id per
// choice, the text as arguments); streamed, the first text delta opens
// the call and later ones carry argument deltas only.
TEST(ResponseBuilderTest, ToolCalls) {
  ResponseBuilder b(Endpoint::kChat, "chatcmpl-1", "m", 100, false, 2);
  b.EnableToolCall("get_weather");
  std::vector<v1::GenerateTextResponse> r(2);
  r[0].set_text(R"({"where": "Paris"})");
  r[1].set_text(R"({"where": "Oslo"})");
  r[0].set_finish_reason("eos");
  r[1].set_finish_reason("eos");
  const json out = b.Response(r);
  std::set<std::string> ids;
  for (int i = 0; i < 2; ++i) {
    const json& m = out["choices"][i]["message"];
    EXPECT_TRUE(m["content"].is_null());
    ASSERT_EQ(m["tool_calls"].size(), 1u);
    const json& call = m["tool_calls"][0];
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["function"]["name"], "get_weather");
    EXPECT_EQ(call["function"]["arguments"], r[i].text());
    EXPECT_TRUE(absl::StartsWith(call["id"].get<std::string>(), "call_"));
    ids.insert(call["id"].get<std::string>());
    EXPECT_EQ(out["choices"][i]["finish_reason"], "stop");
  }
  EXPECT_EQ(ids.size(), 2u);

  ResponseBuilder s(Endpoint::kChat, "chatcmpl-2", "m", 100, false);
  s.EnableToolCall("get_weather");
  v1::GenerateTextChunk c;
  c.set_text(R"({"where": )");
  std::vector<json> ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 2u);  // the role, then the call's first delta
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  const json& first = ev[1]["choices"][0]["delta"]["tool_calls"][0];
  EXPECT_EQ(first["index"], 0);
  EXPECT_EQ(first["type"], "function");
  EXPECT_EQ(first["function"]["name"], "get_weather");
  EXPECT_EQ(first["function"]["arguments"], R"({"where": )");
  EXPECT_FALSE(ev[1]["choices"][0]["delta"].contains("content"));
  c.set_text(R"("Paris"})");
  c.set_finish_reason("eos");
  ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);
  const json& more = ev[0]["choices"][0]["delta"]["tool_calls"][0];
  EXPECT_EQ(more["function"]["arguments"], R"("Paris"})");
  EXPECT_FALSE(more.contains("id"));
  EXPECT_FALSE(more["function"].contains("name"));
  EXPECT_EQ(ev[0]["choices"][0]["finish_reason"], "stop");
}

// "required" with several tools: the answer {"name", "parameters"}
// becomes a call of that function; streamed, the call goes whole with the
// final chunk; an answer cut short stays text.
TEST(ResponseBuilderTest, ToolCallsByName) {
  ResponseBuilder b(Endpoint::kChat, "chatcmpl-1", "m", 100, false, 2);
  b.EnableToolCallParsing({"now", "get_weather"});
  std::vector<v1::GenerateTextResponse> r(2);
  r[0].set_text(R"({"name": "now", "parameters": {"tz": "UTC"}})");
  r[0].set_finish_reason("eos");
  r[1].set_text(R"({"name": "now", "param)");
  r[1].set_finish_reason("length");
  const json out = b.Response(r);
  const json& call = out["choices"][0]["message"]["tool_calls"][0];
  EXPECT_EQ(call["function"]["name"], "now");
  EXPECT_EQ(call["function"]["arguments"], R"({"tz":"UTC"})");
  EXPECT_TRUE(out["choices"][0]["message"]["content"].is_null());
  EXPECT_EQ(out["choices"][1]["message"]["content"], r[1].text());
  EXPECT_FALSE(out["choices"][1]["message"].contains("tool_calls"));

  ResponseBuilder s(Endpoint::kChat, "chatcmpl-2", "m", 100, false);
  s.EnableToolCallParsing({"now", "get_weather"});
  v1::GenerateTextChunk c;
  c.set_text(R"({"name": "now", )");
  std::vector<json> ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);  // the role only
  c.set_text(R"("parameters": {}})");
  c.set_finish_reason("eos");
  ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 1u);
  const json& d = ev[0]["choices"][0]["delta"]["tool_calls"][0];
  EXPECT_EQ(d["function"]["name"], "now");
  EXPECT_EQ(d["function"]["arguments"], "{}");
  EXPECT_TRUE(absl::StartsWith(d["id"].get<std::string>(), "call_"));
}

// tool_choice "auto": calls in the model's own format become tool_calls
// (finish "tool_calls"); other answers are plain. Streamed, plain text
// goes out as it comes, and text from a <tool_call> tag on (a tag split
// across chunks included) or an answer opening with '{' is held and sent
// with the final chunk.
TEST(ResponseBuilderTest, AutoToolCalls) {
  const std::vector<std::string> tools = {"get_weather", "now"};
  ResponseBuilder b(Endpoint::kChat, "chatcmpl-1", "m", 100, false, 2);
  b.EnableToolCallParsing(tools);
  std::vector<v1::GenerateTextResponse> r(2);
  r[0].set_text(
      "Checking.<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>");
  r[0].set_finish_reason("eos");
  r[1].set_text("It is sunny.");
  r[1].set_finish_reason("eos");
  const json out = b.Response(r);
  const json& m0 = out["choices"][0]["message"];
  EXPECT_EQ(m0["content"], "Checking.");
  ASSERT_EQ(m0["tool_calls"].size(), 1u);
  EXPECT_EQ(m0["tool_calls"][0]["function"]["name"], "now");
  EXPECT_EQ(out["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(out["choices"][1]["message"]["content"], "It is sunny.");
  EXPECT_FALSE(out["choices"][1]["message"].contains("tool_calls"));
  EXPECT_EQ(out["choices"][1]["finish_reason"], "stop");

  const auto stream = [&](const std::vector<std::string>& pieces) {
    ResponseBuilder s(Endpoint::kChat, "chatcmpl-2", "m", 100, false);
    s.EnableToolCallParsing(tools);
    std::vector<json> deltas;
    for (size_t i = 0; i < pieces.size(); ++i) {
      v1::GenerateTextChunk c;
      c.set_text(pieces[i]);
      if (i + 1 == pieces.size()) c.set_finish_reason("eos");
      for (const json& e : Events(s.StreamEvents(c))) {
        deltas.push_back(e["choices"][0]);
      }
    }
    return deltas;
  };
  // Plain text: each piece as it comes.
  std::vector<json> d = stream({"It is ", "sunny", "."});
  ASSERT_EQ(d.size(), 4u);  // role, 2 pieces, the last with finish
  EXPECT_EQ(d[1]["delta"]["content"], "It is ");
  EXPECT_EQ(d[3]["finish_reason"], "stop");
  // Text, then a call whose tag is split across chunks.
  d = stream({"Let me check. <tool", "_call>{\"name\": \"get_weather\", ",
              "\"arguments\": {\"where\": \"Oslo\"}}</tool_call>"});
  std::string text;
  json calls;
  for (const json& c : d) {
    if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
    if (c["delta"].contains("tool_calls")) calls = c["delta"]["tool_calls"];
  }
  EXPECT_EQ(text, "Let me check. ");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["function"]["arguments"], R"({"where":"Oslo"})");
  EXPECT_EQ(d.back()["finish_reason"], "tool_calls");
  // Llama 3's JSON answer: held whole; not a call after all: text.
  d = stream({" {\"name\": \"now\",", " \"parameters\": {}}"});
  ASSERT_EQ(d.size(), 2u);  // role, then the call with the finish
  EXPECT_EQ(d[1]["delta"]["tool_calls"][0]["function"]["name"], "now");
  d = stream({"{\"a\":", " 1}"});
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[1]["delta"]["content"], "{\"a\": 1}");
  EXPECT_EQ(d[1]["finish_reason"], "stop");
}

TEST(ResponseBuilderTest, ChatLogprobs) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int> ids = *(*tok)->Encode("Once upon", false);
  const float kNegInf = -std::numeric_limits<float>::infinity();
  v1::GenerateTextResponse r;
  r.set_text("Once upon");
  r.set_finish_reason("eos");
  for (int id : ids) {
    r.add_token_ids(id);
    *r.add_logprobs() = Lp(-1.25f, {{id, -1.25f}, {5, kNegInf}});
  }
  ResponseBuilder b(Endpoint::kChat, "chatcmpl-1", "m", 100, false);
  b.EnableLogprobs(tok->get());
  const json j = b.Response(r);
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), ids.size()) << j;
  for (size_t i = 0; i < ids.size(); ++i) {
    const json& t = content[i];
    const std::string token = t["token"];
    EXPECT_EQ(token, i == 0 ? " Once" : " upon");
    EXPECT_FLOAT_EQ(t["logprob"].get<float>(), -1.25f);
    std::string bytes;
    for (int b : t["bytes"]) bytes.push_back(static_cast<char>(b));
    EXPECT_EQ(bytes, token);
    ASSERT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_EQ(t["top_logprobs"][0]["token"], token);
    EXPECT_TRUE(t["top_logprobs"][0]["bytes"].is_array());
    EXPECT_EQ(t["top_logprobs"][1]["logprob"], -9999.0);  // -inf
  }
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Once upon");

  // Streamed deltas carry {content: [...]} of their own tokens.
  ResponseBuilder s(Endpoint::kChat, "chatcmpl-2", "m", 100, false);
  s.EnableLogprobs(tok->get());
  v1::GenerateTextChunk c;
  c.set_text("Once");
  c.add_token_ids(ids[0]);
  *c.add_logprobs() = r.logprobs(0);
  std::vector<json> ev = Events(s.StreamEvents(c));
  ASSERT_EQ(ev.size(), 2u);  // role, then the delta
  EXPECT_TRUE(ev[0]["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["content"], "Once");
  ASSERT_EQ(ev[1]["choices"][0]["logprobs"]["content"].size(), 1u);
  EXPECT_EQ(ev[1]["choices"][0]["logprobs"]["content"][0]["token"], " Once");
}

TEST(NewIdTest, PrefixedAndUnique) {
  const std::string a = NewId("cmpl-"), b = NewId("cmpl-");
  EXPECT_TRUE(absl::StartsWith(a, "cmpl-"));
  EXPECT_EQ(a.size(), 5u + 24u);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace openai
}  // namespace specserve
