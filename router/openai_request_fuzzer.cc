// Fuzz target: the router's OpenAI HTTP API bodies, the part of the product
// that takes the least trusted input. The first byte picks the endpoint
// (even: /v1/completions, odd: /v1/chat/completions); the rest is the POST
// body. It goes through ParseRequest as the HTTP server runs it (the
// default chat template, the bundled tinystories-656K tokenizer), and a
// request that parses through ResolveOptions with the default flags. Every
// rejection must be INVALID_ARGUMENT with an OpenAI error body of HTTP
// status 400; an accepted request must resolve to a valid option set
// (ResolvedOptionsViolation) or INVALID_ARGUMENT; never a crash. Seeds:
// router/testdata/fuzz/openai.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/util/message_differencer.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "router/chat_format.h"
#include "router/openai_api.h"
#include "router/request_options.h"
#include "router/resolved_options_check.h"

namespace {

// The tokenizer and chat format, loaded once; the fuzzer stops at once if
// they do not load (its inputs would then test nothing).
struct Fixture {
  std::unique_ptr<specserve::Tokenizer> tokenizer;
  specserve::openai::ChatFormat chat;
};

const Fixture& GetFixture() {
  static const Fixture* fixture = [] {
    auto* f = new Fixture;
    auto tok = specserve::LoadTokenizer("models/tinystories-656K");
    auto chat = specserve::ChatFormatFor("");
    if (!tok.ok() || !chat.ok()) std::abort();
    f->tokenizer = *std::move(tok);
    f->chat = *std::move(chat);
    return f;
  }();
  return *fixture;
}

// What the HTTP server answers for a rejected body: a 400 and an OpenAI
// error object naming the status.
void CheckRejection(const absl::Status& status,
                    specserve::openai::Endpoint endpoint) {
  if (!absl::IsInvalidArgument(status)) std::abort();
  const absl::Status named = specserve::openai::NameParam(status, endpoint);
  if (specserve::openai::HttpStatus(named) != 400) std::abort();
  const nlohmann::json body = specserve::openai::ErrorBody(named);
  if (!body.contains("error") || !body["error"].contains("message")) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Fixture& f = GetFixture();
  const auto endpoint = (data[0] & 1) != 0
                            ? specserve::openai::Endpoint::kChat
                            : specserve::openai::Endpoint::kCompletions;
  const absl::string_view body(reinterpret_cast<const char*>(data) + 1,
                               size - 1);
  const auto parsed =
      specserve::openai::ParseRequest(endpoint, body, f.chat,
                                      f.tokenizer.get());
  if (!parsed.ok()) {
    CheckRejection(parsed.status(), endpoint);
    return 0;
  }
  if (parsed->n < 1 || parsed->n > specserve::openai::kMaxChoices ||
      parsed->num_prompts() * parsed->n > specserve::openai::kMaxPrompts ||
      (endpoint == specserve::openai::Endpoint::kChat &&
       parsed->num_prompts() != 1)) {
    std::abort();
  }
  for (const auto& more : parsed->more_prompts) {
    // Every prompt of a batch is the same request with another prompt.
    if (!google::protobuf::util::MessageDifferencer::Equals(
            more.sampling(), parsed->request.sampling())) {
      std::abort();
    }
  }
  const auto r = specserve::ResolveOptions(parsed->request,
                                           specserve::RequestDefaults{});
  if (!r.ok()) {
    CheckRejection(r.status(), endpoint);
    return 0;
  }
  if (!specserve::ResolvedOptionsViolation(*r).empty()) std::abort();
  return 0;
}
