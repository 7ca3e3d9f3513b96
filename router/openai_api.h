#ifndef SPECSERVE_ROUTER_OPENAI_API_H_
#define SPECSERVE_ROUTER_OPENAI_API_H_

// The OpenAI HTTP API's JSON <-> the router's request type:
// request bodies of POST /v1/completions and /v1/chat/completions become a
// v1::GenerateTextRequest (the gRPC API's), and the runner's chunks become
// OpenAI responses, stream chunks (Server-Sent Events) and errors. No I/O
// here; router/http_server.h does the HTTP.
//
// Follows the OpenAI API reference (completions and chat completions
// objects) as vLLM serves it: `n` other than 1 is refused, unknown fields
// are ignored, and a wrong type or range is INVALID_ARGUMENT naming the
// parameter (ParamOf).

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "nlohmann/json.hpp"
#include "protos/router.pb.h"
#include "router/tool_calls.h"

namespace specserve {

class Tokenizer;

namespace openai {

enum class Endpoint { kCompletions, kChat };

/// A validated request body.
struct ParsedRequest {
  v1::GenerateTextRequest request;  ///< what the router runs.
  /// A completions request's batch of prompts (`prompt` as a list of
  /// strings or of token-id lists): `request` holds the first, these the
  /// others (the same request with another prompt). Empty = one prompt.
  std::vector<v1::GenerateTextRequest> more_prompts;
  std::string model;                ///< as sent; "" when absent.
  bool stream = false;
  bool include_usage = false;  ///< stream_options.include_usage.
  /// Choices to generate per prompt, in [1, kMaxChoices]: `n` independent
  /// runs of each prompt (ChoiceRequest gives each its seed).
  int n = 1;
  /// Completions' `echo`: each choice's text (and with `logprobs`, its
  /// logprobs, the prompt's first) starts with its prompt.
  bool echo = false;
  /// Chat: the function every choice's answer is a call of (tool_choice
  /// naming it, or "required" with one tool); its text is the call's
  /// arguments. Empty = a plain answer.
  std::string tool_call;
  /// Chat, tool_choice "auto" with tools (the default), or "required" with
  /// several tools (whose schema makes each answer {"name": a tool,
  /// "parameters": its arguments}): the tools' names; each answer is read
  /// for calls (tool_calls.h). Empty otherwise.
  std::vector<std::string> read_tools;

  int num_prompts() const { return 1 + static_cast<int>(more_prompts.size()); }
};

/// Most choices (`n`) one request may ask for; each is a request in flight
/// for the router's admission (--max_concurrent_requests).
inline constexpr int kMaxChoices = 16;
/// Most prompts in one completions batch, and most choices (prompts x n)
/// in all.
inline constexpr int kMaxPrompts = 64;

/// Every choice's request, in OpenAI's order: prompt p's choice i is
/// choice p * n + i (ChoiceRequest(prompt p's request, i)).
std::vector<v1::GenerateTextRequest> ChoiceRequests(const ParsedRequest& p);

/// Choice `index`'s run of `request`: a request with a seed gives choice i
/// seed + i (reproducible, and the choices differ when sampled); without
/// one every choice draws its own random seed.
v1::GenerateTextRequest ChoiceRequest(const v1::GenerateTextRequest& request,
                                      int index);

/// Chat messages -> prompt text. `context` is the template's:
/// {"messages": [{"role": str, "content": str}, ...] (content parts joined),
/// "add_generation_prompt": bool, plus the request's chat_template_kwargs}.
/// The text may start with the BOS string (Jinja templates write
/// `bos_token`); ChatPromptIds turns it into the BOS id.
/// INVALID_ARGUMENT for a conversation the template refuses (a 400).
using ChatRenderer =
    std::function<absl::StatusOr<std::string>(const nlohmann::json& context)>;

/// How chat requests become prompts: the renderer, the BOS string its
/// output may start with ("" = none), and whether to prepend the BOS id when
/// the output does not start with it (true for a template that does not
/// know the model's BOS, e.g. the default; false for the model's own
/// template, which writes `bos_token` where the model wants it).
struct ChatFormat {
  ChatRenderer render;  ///< null: chat is refused.
  std::string bos_token;
  bool add_bos = false;
};

/// The prompt ids of rendered chat text: a leading `bos_token` (when
/// non-empty) is removed and the rest encoded after the BOS id; otherwise
/// the text is encoded with the BOS id only if `add_bos`. The tokenizer's
/// BOS rule applies (none when its vocabulary has no BOS). INTERNAL from
/// the tokenizer.
absl::StatusOr<std::vector<int>> ChatPromptIds(absl::string_view text,
                                               const ChatFormat& format,
                                               const Tokenizer& tokenizer);

/// JSON nesting a request body may have (objects and arrays inside the
/// body's top-level object); OpenAI bodies need fewer than 10.
inline constexpr int kMaxBodyDepth = 64;

/// A POST body as a JSON object; INVALID_ARGUMENT (param "") for text
/// that is not JSON, not an object, or nested deeper than kMaxBodyDepth
/// (refused while parsing, before anything that deep is built).
absl::StatusOr<nlohmann::json> ParseBody(absl::string_view body_text);

/// Parses a POST body (ParseBody). Completions: `prompt` is a string, a list of
/// token ids, or a one-element list of either. Chat: `messages` rendered by
/// `chat` (with vLLM's `add_generation_prompt`, default true, and
/// `chat_template_kwargs`), tokenized by `tokenizer` into token_ids with
/// ChatPromptIds; both required for chat, else INVALID_ARGUMENT. A renderer's
/// error other than INVALID_ARGUMENT is returned as is. Errors:
/// INVALID_ARGUMENT with ParamOf() naming the field for malformed JSON, a
/// missing or mistyped field, a value out of range (temperature [0, 2], top_p
/// (0, 1], max_tokens >= 1, n in [1, 16], ...), stream_options without stream,
/// a body nested deeper than kMaxBodyDepth.
absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint,
                                           absl::string_view body,
                                           const ChatFormat& chat,
                                           const Tokenizer* tokenizer);

/// An INVALID_ARGUMENT whose OpenAI `param` is `param`.
absl::Status ParamError(absl::string_view param, absl::string_view message);
/// `status` with OpenAI `param` `param` attached.
absl::Status WithParam(absl::Status status, absl::string_view param);
/// The `param` attached by ParamError, if any.
std::optional<std::string> ParamOf(const absl::Status& status);

/// A router error in API terms: an INVALID_ARGUMENT from the runner names a
/// field of the gRPC request in its first word ("sampling.top_p must ...",
/// "token_ids.ids[3] = ..."); the OpenAI parameter it came from is attached
/// (`prompt` / `messages`, `max_tokens`, `temperature`, `stop`,
/// `speculative_prefill.keep_ratio`, ...). Other statuses pass unchanged.
absl::Status NameParam(absl::Status status, Endpoint endpoint);

/// HTTP status of an error: 400 INVALID_ARGUMENT / OUT_OF_RANGE, 401
/// UNAUTHENTICATED, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 503
/// UNAVAILABLE / FAILED_PRECONDITION (replicas unusable), 504
/// DEADLINE_EXCEEDED, 499 CANCELLED (client closed), 500 otherwise.
int HttpStatus(const absl::Status& status);

/// OpenAI's error object {"error": {"message", "type", "param", "code"}};
/// `type` follows the HTTP status (invalid_request_error, authentication_
/// error, not_found_error, rate_limit_error, service_unavailable_error,
/// timeout_error, server_error), `code` is the status code name.
nlohmann::json ErrorBody(const absl::Status& status);

/// OpenAI finish_reason of the router's: "stop" (eos, stop_token, stop) or
/// "length" (length, context_limit).
std::string OpenAiFinishReason(absl::string_view router_reason);

/// Builds the responses of one request (one per request; not
/// thread-safe). `id` e.g. "cmpl-..."; `created` in Unix seconds; `n` the
/// request's choices (>= 1).
class ResponseBuilder {
 public:
  /// `n`: the choices in all; `choices_per_prompt` (0 = n): how many of
  /// them share a prompt (choices p * choices_per_prompt .. share prompt
  /// p), so usage counts each prompt once.
  ResponseBuilder(Endpoint endpoint, std::string id, std::string model,
                  int64_t created, bool include_usage, int n = 1,
                  int choices_per_prompt = 0);

  /// Asks for each choice's `logprobs` (else null): the tokens' log-
  /// probabilities the chunks carry (GenerateTextChunk.logprobs), in the
  /// endpoint's shape. Completions: {tokens, token_logprobs, top_logprobs
  /// (one {token: logprob} object per token: the top-N and the token),
  /// text_offset (each token's offset in the completion text, by the
  /// tokens' texts)}. Chat: {content: [{token, logprob, bytes,
  /// top_logprobs: [{token, logprob, bytes}] (N)}]}. A token's text is
  /// `tokenizer`'s decoding of it alone ("token_id:N" without a tokenizer);
  /// bytes are its UTF-8 bytes, or the piece's own bytes where the token
  /// is part of a character. -inf is written as -9999.0 (as vLLM).
  void EnableLogprobs(const Tokenizer* tokenizer);

  /// Completions' `echo`: prompt p's choices start with prompt_texts[p]
  /// (its text as sent, or its ids decoded). With logprobs, the chunks'
  /// prompt_token_ids and prompt_logprobs (sampling.prompt_logprobs) come
  /// first in `logprobs`: the first prompt token's logprob and
  /// top_logprobs are null (nothing comes before it), as OpenAI's and
  /// vLLM's; text_offset counts from the prompt's first token.
  void EnableEcho(std::vector<std::string> prompt_texts);

  /// Chat answers that are calls of function `name` (ParsedRequest::
  /// tool_call): each choice's message has content null and one
  /// `tool_calls` entry {id "call_...", type "function", function {name,
  /// arguments: the choice's text}}; streamed, the first text delta opens
  /// the call (index 0, id, type, name) and the others carry
  /// `function.arguments` deltas, as OpenAI streams tool calls.
  void EnableToolCall(std::string name);
  /// tool_choice "auto" (and "required" with several tools,
  /// ParsedRequest::read_tools): answers are read for calls of `tools` in
  /// the model's own format (ParseToolCalls). Calls found become `tool_calls`
  /// (the text around them the content, null when empty) with finish
  /// reason "tool_calls"; other answers are plain. Streamed, text goes out
  /// as it comes until it may be a call (an answer opening with '{' or
  /// '[', or from a <tool_call> tag on), which is held and sent, as calls
  /// or as text, with the final chunk.
  void EnableToolCallParsing(std::vector<std::string> tools);

  /// The non-streaming response: choice i from responses[i] (one per
  /// choice), usage (each prompt once, the completions of every choice
  /// summed), and the `specserve` object (Stats) of the first choice.
  nlohmann::json Response(
      absl::Span<const v1::GenerateTextResponse> responses) const;
  nlohmann::json Response(const v1::GenerateTextResponse& response) const {
    return Response(absl::MakeConstSpan(&response, 1));
  }

  /// The SSE events ("data: {...}\n\n" each) for a runner chunk: chat
  /// starts with a role delta; empty deltas send nothing (a delta with
  /// tokens but no text yet is sent when logprobs are on, for its
  /// logprobs); the final chunk
  /// sends finish_reason and `specserve`, then (include_usage) a chunk with
  /// no choices and the usage. Every chunk carries "usage": null when
  /// include_usage is set, as OpenAI's do. With n > 1 each choice's chunks
  /// come with its `index` (in [0, n)) and the usage chunk follows the last
  /// choice's final chunk, summed over the choices.
  std::string StreamEvents(const v1::GenerateTextChunk& chunk, int index = 0);

  /// An error event mid-stream ("data: {"error": ...}\n\n").
  static std::string ErrorEvent(const absl::Status& status);
  /// The end of a stream: "data: [DONE]\n\n".
  static std::string DoneEvent();

  /// The per-request statistics object: GenerationStats' fields (proto
  /// names) plus prompt_tokens, kept_prompt_tokens and completion_tokens.
  static nlohmann::json Stats(const v1::Usage& usage,
                              const v1::GenerationStats& stats);

 private:
  nlohmann::json Chunk() const;  // the fields every stream chunk has
  // Adds choice `index`'s usage to *total: its completion, and its prompt
  // when it is its prompt's first choice.
  void AddUsage(const v1::Usage& choice, int index, v1::Usage* total) const;
  nlohmann::json Usage(const v1::Usage& usage) const;
  // The choice's `logprobs` for `ids` / `logprobs` (aligned); completions'
  // text_offset starts at *offset and advances it. With echo, the
  // message's prompt ids / logprobs (the first message's) come first.
  template <typename Message>
  nlohmann::json Logprobs(const Message& m, int64_t* offset) const;
  // Choice `index`'s echoed prompt text ("" without echo).
  const std::string& EchoText(int index) const;
  std::string TokenText(int id) const;
  // Calls as OpenAI's tool_calls (each with a fresh id; `streamed` adds
  // each call's index, as stream deltas carry it).
  static nlohmann::json CallsJson(const std::vector<ParsedToolCall>& calls,
                                  bool streamed);
  std::string TokenBytes(int id, const std::string& text) const;

  const Endpoint endpoint_;
  const std::string id_;
  const std::string model_;
  const int64_t created_;
  const bool include_usage_;
  const int n_;
  const int per_prompt_;  // choices per prompt
  bool logprobs_ = false;
  const Tokenizer* tokenizer_ = nullptr;
  std::vector<std::string> echo_;  // per prompt; empty = no echo
  // Per choice: the chat role delta was sent; streamed completions'
  // text_offset so far.
  std::vector<bool> role_sent_;
  std::vector<bool> echo_sent_;  // streamed: the prompt went out
  std::string tool_call_;        // the function called; "" = none
  std::vector<std::string> call_text_;  // streamed: the text held back
  std::vector<std::string> read_tools_;  // EnableToolCallParsing
  // Per choice, streamed with read_tools_: what the text so far may be.
  enum : uint8_t { kUndecided, kText, kHoldAll, kHoldTag };
  std::vector<uint8_t> auto_mode_;
  std::vector<std::string> call_ids_;  // per choice, with tool_call_
  std::vector<bool> call_opened_;      // streamed: the call's first delta
  std::vector<int64_t> text_offset_;
  int finished_ = 0;   // choices whose final chunk was built
  v1::Usage usage_;    // their usage, completion_tokens summed
};

/// A fresh response id: `prefix` + 24 random hex digits.
std::string NewId(absl::string_view prefix);

}  // namespace openai
}  // namespace specserve

#endif  // SPECSERVE_ROUTER_OPENAI_API_H_
