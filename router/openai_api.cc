#include "router/openai_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/decoding/logprobs.h"
#include "common/tokenizer/byte_level.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/utf8.h"
#include "google/protobuf/util/json_util.h"

namespace specserve {
namespace openai {
namespace {

using json = nlohmann::json;

constexpr char kParamPayload[] = "type.googleapis.com/specserve.openai.Param";

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

absl::Status WrongType(absl::string_view param, absl::string_view want,
                       const json& got) {
  return ParamError(param, absl::StrCat("'", param, "' must be ", want,
                                        ", got ", TypeName(got)));
}

// The member `key` of `obj` unless absent or null.
const json* Member(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::optional<int64_t>> GetInt(const json& obj, const char* key,
                                              absl::string_view param,
                                              int64_t min, int64_t max) {
  const json* v = Member(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number_integer()) return WrongType(param, "an integer", *v);
  if (v->is_number_unsigned() &&
      v->get<uint64_t>() > static_cast<uint64_t>(max)) {
    return ParamError(param, absl::StrCat("'", param, "' must be <= ", max));
  }
  const int64_t x = v->get<int64_t>();
  if (x < min || x > max) {
    return ParamError(param, absl::StrCat("'", param, "' must be in [", min,
                                          ", ", max, "], got ", x));
  }
  return x;
}

absl::StatusOr<std::optional<double>> GetNumber(const json& obj,
                                                const char* key,
                                                absl::string_view param) {
  const json* v = Member(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) return WrongType(param, "a number", *v);
  return v->get<double>();
}

absl::StatusOr<std::optional<bool>> GetBool(const json& obj, const char* key,
                                            absl::string_view param) {
  const json* v = Member(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) return WrongType(param, "a boolean", *v);
  return v->get<bool>();
}

// OpenAI's logit_bias: {"<token id>": bias in [-100, 100], ...}; null or
// {} = off. Keys must be decimal ids (the vocabulary is checked later).
absl::Status ParseLogitBias(const json& body, v1::GenerationSampling* s) {
  const json* lb = Member(body, "logit_bias");
  if (lb == nullptr) return absl::OkStatus();
  if (!lb->is_object()) return WrongType("logit_bias", "an object", *lb);
  for (auto it = lb->begin(); it != lb->end(); ++it) {
    int id = -1;
    if (!absl::SimpleAtoi(it.key(), &id) || id < 0 ||
        absl::StrCat(id) != it.key()) {
      return ParamError("logit_bias",
                        absl::StrCat("'logit_bias' keys must be token ids, "
                                     "got \"",
                                     it.key().substr(0, 32), "\""));
    }
    if (!it.value().is_number()) {
      return WrongType(absl::StrCat("logit_bias.", id), "a number",
                       it.value());
    }
    const double bias = it.value().get<double>();
    if (!(bias >= -100 && bias <= 100)) {
      return ParamError("logit_bias",
                        absl::StrCat("'logit_bias' values must be in [-100, "
                                     "100], got ",
                                     bias, " for token ", id));
    }
    (*s->mutable_logit_bias())[id] = static_cast<float>(bias);
  }
  return absl::OkStatus();
}

// Whether an unsupported parameter's value asks for something: not false,
// 0 (1 for best_of, whose default it is), "" or {}.
bool AsksForSomething(const json& v, bool one_is_default) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_integer()) return v.get<int64_t>() > (one_is_default ? 1 : 0);
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  if (v.is_object() || v.is_array()) return !v.empty();
  return true;
}

#define SPECSERVE_ASSIGN(lhs, expr)     \
  auto lhs##_or = (expr);               \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  const auto lhs = *lhs##_or

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Completions: `logprobs` N in [0, 20] (null = off): each token's logprob
// and the N likeliest alternatives; `top_logprobs` is chat's. Chat:
// `logprobs` a boolean, `top_logprobs` in [0, 20] only with logprobs true.
absl::Status ParseLogprobs(Endpoint endpoint, const json& body,
                           v1::GenerationSampling* s) {
  if (endpoint == Endpoint::kCompletions) {
    if (const json* t = Member(body, "top_logprobs");
        t != nullptr && AsksForSomething(*t, false)) {
      return ParamError("top_logprobs",
                        "'top_logprobs' is a chat completions parameter; "
                        "completions take 'logprobs': N (0 to 20)");
    }
    const json* v = Member(body, "logprobs");
    if (v == nullptr || (v->is_boolean() && !v->get<bool>())) {
      return absl::OkStatus();  // null / false: off
    }
    if (!v->is_number_integer()) {
      return WrongType("logprobs", "an integer in [0, 20]", *v);
    }
    SPECSERVE_ASSIGN(n, GetInt(body, "logprobs", "logprobs", 0,
                               kMaxTopLogprobs));
    s->set_logprobs(true);
    s->set_top_logprobs(static_cast<int32_t>(*n));
    return absl::OkStatus();
  }
  SPECSERVE_ASSIGN(on, GetBool(body, "logprobs", "logprobs"));
  SPECSERVE_ASSIGN(top, GetInt(body, "top_logprobs", "top_logprobs", 0,
                               kMaxTopLogprobs));
  if (top && !on.value_or(false)) {
    return ParamError("top_logprobs",
                      "'top_logprobs' needs 'logprobs': true");
  }
  if (on.value_or(false)) {
    s->set_logprobs(true);
    s->set_top_logprobs(static_cast<int32_t>(top.value_or(0)));
  }
  return absl::OkStatus();
}

// A list of token ids (non-empty, each in [0, 2^31)).
absl::Status ParseIds(const json& v, absl::string_view param,
                      v1::TokenIds* out) {
  if (v.empty()) return ParamError(param, absl::StrCat("'", param, "' is empty"));
  for (size_t i = 0; i < v.size(); ++i) {
    const json& x = v[i];
    if (!x.is_number_integer() || x.get<int64_t>() < 0 ||
        x.get<int64_t>() > kInt32Max) {
      return ParamError(param, absl::StrCat("'", param, "[", i,
                                            "]' must be a token id (an "
                                            "integer >= 0)"));
    }
    out->add_ids(static_cast<int>(x.get<int64_t>()));
  }
  return absl::OkStatus();
}

// One prompt (a string or a list of token ids) into `r`.
absl::Status ParseOnePrompt(const json& p, v1::GenerateTextRequest* r) {
  if (p.is_string()) {
    if (p.get_ref<const std::string&>().empty()) {
      return ParamError("prompt", "'prompt' is empty");
    }
    r->set_text(p.get<std::string>());
    return absl::OkStatus();
  }
  if (!p.is_array()) {
    return WrongType("prompt", "a string or a list of token ids", p);
  }
  return ParseIds(p, "prompt", r->mutable_token_ids());
}

// `prompt`: one prompt into out->request, or a batch (a list of strings or
// of token-id lists): the first there, the others into out->more_prompts.
absl::Status ParsePrompt(const json& body, ParsedRequest* out) {
  const json* p = Member(body, "prompt");
  if (p == nullptr) return ParamError("prompt", "'prompt' is required");
  const bool batch = p->is_array() && !p->empty() &&
                     ((*p)[0].is_string() || (*p)[0].is_array());
  if (!batch) return ParseOnePrompt(*p, &out->request);
  const int prompts = static_cast<int>(p->size());
  if (prompts > kMaxPrompts || prompts * out->n > kMaxPrompts) {
    return ParamError(
        "prompt", absl::StrCat("a batch of ", prompts, " prompts x n = ",
                               out->n, " choices; at most ", kMaxPrompts,
                               " choices in all are allowed"));
  }
  const v1::GenerateTextRequest common = out->request;
  for (int i = 0; i < prompts; ++i) {
    if (!(*p)[i].is_string() && !(*p)[i].is_array()) {
      return WrongType(absl::StrCat("prompt[", i, "]"),
                       "a string or a list of token ids", (*p)[i]);
    }
    v1::GenerateTextRequest* r = &out->request;
    if (i > 0) {
      out->more_prompts.push_back(common);
      r = &out->more_prompts.back();
    }
    if (absl::Status s = ParseOnePrompt((*p)[i], r); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// `v`'s member `key` when v is an object whose "type" is `type` (a chat
// content part, a tool); else null.
const json* TypedMember(const json& v, absl::string_view type,
                        const char* key) {
  if (!v.is_object()) return nullptr;
  const json* t = Member(v, "type");
  if (t == nullptr || !t->is_string() || t->get_ref<const std::string&>() != type) {
    return nullptr;
  }
  return Member(v, key);
}

// messages -> [{"role", "content"}] with content parts joined.
absl::StatusOr<json> NormalizeMessages(const json& body) {
  const json* m = Member(body, "messages");
  if (m == nullptr) return ParamError("messages", "'messages' is required");
  if (!m->is_array()) return WrongType("messages", "an array", *m);
  if (m->empty()) return ParamError("messages", "'messages' is empty");
  json out = json::array();
  for (size_t i = 0; i < m->size(); ++i) {
    const std::string param = absl::StrCat("messages[", i, "]");
    const json& msg = (*m)[i];
    if (!msg.is_object()) return WrongType(param, "an object", msg);
    const json* role = Member(msg, "role");
    if (role == nullptr || !role->is_string()) {
      return ParamError(absl::StrCat(param, ".role"),
                        absl::StrCat("'", param, ".role' must be a string"));
    }
    std::string content;
    if (const json* c = Member(msg, "content"); c != nullptr && !c->is_null()) {
      if (c->is_string()) {
        content = c->get<std::string>();
      } else if (c->is_array()) {
        for (size_t j = 0; j < c->size(); ++j) {
          const std::string pp = absl::StrCat(param, ".content[", j, "]");
          const json* text = TypedMember((*c)[j], "text", "text");
          if (text == nullptr || !text->is_string()) {
            return ParamError(pp, absl::StrCat("'", pp,
                                               "' must be a text part "
                                               "{\"type\": \"text\", "
                                               "\"text\": str}"));
          }
          content += text->get<std::string>();
        }
      } else {
        return WrongType(absl::StrCat(param, ".content"),
                         "a string or an array of text parts", *c);
      }
    }
    json normalized = {{"role", role->get<std::string>()},
                       {"content", content}};
    // Tool use in the history (an assistant's calls, a tool's answer):
    // passed on for the template to render.
    if (const json* calls = Member(msg, "tool_calls"); calls != nullptr) {
      if (!calls->is_array()) {
        return WrongType(absl::StrCat(param, ".tool_calls"), "an array",
                         *calls);
      }
      normalized["tool_calls"] = *calls;
    }
    for (const char* key : {"tool_call_id", "name"}) {
      if (const json* v = Member(msg, key); v != nullptr) {
        if (!v->is_string()) {
          return WrongType(absl::StrCat(param, ".", key), "a string", *v);
        }
        normalized[key] = *v;
      }
    }
    out.push_back(std::move(normalized));
  }
  return out;
}

// Chat's `tools` and `tool_choice` (OpenAI's function calling; vLLM's
// named function calling). *tools gets the tools for the template (empty:
// none). A call the answer must be (tool_choice naming a function, or
// "required" with one tool) sets *call to its name and the request's JSON
// schema to the function's parameters (`ordered`: the body with its key
// order, for the schema). "auto" (the default with tools) sets
// *read_tools to the tools' names: the answers are read for calls in the
// model's own format (tool_calls.h); so does "required" with several
// tools, whose schema makes the answer such a call ({"name": a tool,
// "parameters": its arguments}, Llama 3.1's form).
absl::Status ParseTools(const json& body, const nlohmann::ordered_json& ordered,
                        json* tools, std::string* call,
                        std::vector<std::string>* read_tools,
                        v1::GenerationSampling* s) {
  *tools = json::array();
  std::vector<std::string> names;
  if (const json* t = Member(body, "tools"); t != nullptr && !t->is_null()) {
    if (!t->is_array()) return WrongType("tools", "an array", *t);
    for (size_t i = 0; i < t->size(); ++i) {
      const std::string param = absl::StrCat("tools[", i, "]");
      const json& tool = (*t)[i];
      const json* fn = TypedMember(tool, "function", "function");
      if (fn == nullptr || !fn->is_object()) {
        return ParamError(param, absl::StrCat("'", param,
                                              "' must be {\"type\": "
                                              "\"function\", \"function\": "
                                              "{...}}"));
      }
      const json* name = Member(*fn, "name");
      const bool good_name =
          name != nullptr && name->is_string() &&
          !name->get_ref<const std::string&>().empty() &&
          name->get_ref<const std::string&>().size() <= 64 &&
          name->get_ref<const std::string&>().find_first_not_of(
              "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
              "0123456789_-") == std::string::npos;
      if (!good_name) {
        return ParamError(absl::StrCat(param, ".function.name"),
                          absl::StrCat("'", param,
                                       ".function.name' must be 1 to 64 of "
                                       "a-z, A-Z, 0-9, _ and -"));
      }
      if (const json* p = Member(*fn, "parameters");
          p != nullptr && !p->is_object()) {
        return WrongType(absl::StrCat(param, ".function.parameters"),
                         "a JSON Schema object", *p);
      }
      names.push_back(name->get<std::string>());
      tools->push_back(tool);
    }
  }
  std::string choice = names.empty() ? "none" : "auto";
  std::string named;
  if (const json* c = Member(body, "tool_choice"); c != nullptr && !c->is_null()) {
    if (c->is_string()) {
      choice = c->get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required") {
        return ParamError("tool_choice",
                          "'tool_choice' must be \"none\", \"auto\", "
                          "\"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}");
      }
    } else {
      const json* fn = c->is_object() ? Member(*c, "function") : nullptr;
      const json* name = fn != nullptr && fn->is_object() ? Member(*fn, "name")
                                                         : nullptr;
      if (name == nullptr || !name->is_string()) {
        return ParamError("tool_choice",
                          "'tool_choice' must name a function: {\"type\": "
                          "\"function\", \"function\": {\"name\": ...}}");
      }
      choice = "named";
      named = name->get<std::string>();
    }
  }
  if (choice == "none") return absl::OkStatus();
  if (names.empty()) {
    return ParamError("tool_choice", "'tool_choice' needs 'tools'");
  }
  if (choice == "auto") {  // the model decides; its answer is read after
    *read_tools = names;
    return absl::OkStatus();
  }
  if (s->has_json_schema() || s->json_object()) {
    return ParamError("tool_choice",
                      "a forced tool call cannot be combined with "
                      "'response_format'");
  }
  if (choice == "required" && names.size() > 1) {
    // The answer is {"name": one of the tools, "parameters": its
    // arguments}: a union the name tells apart (JsonSchema's tagged
    // unions). The call is read out of it once complete.
    nlohmann::ordered_json branches = nlohmann::ordered_json::array();
    for (size_t i = 0; i < names.size(); ++i) {
      const nlohmann::ordered_json& fn = ordered.at("tools").at(i).at("function");
      nlohmann::ordered_json branch = {
          {"type", "object"},
          {"properties",
           {{"name", {{"const", names[i]}}},
            {"parameters", fn.contains("parameters")
                               ? fn["parameters"]
                               : nlohmann::ordered_json{{"type", "object"}}}}},
          {"required", {"name", "parameters"}}};
      branches.push_back(std::move(branch));
    }
    s->set_json_schema(nlohmann::ordered_json{{"anyOf", branches}}.dump());
    *read_tools = names;
    return absl::OkStatus();
  }
  if (choice == "required") named = names[0];
  const auto it = std::find(names.begin(), names.end(), named);
  if (it == names.end()) {
    return ParamError("tool_choice",
                      absl::StrCat("'tool_choice' names '", named,
                                   "', which is not in 'tools'"));
  }
  // The call's arguments are an instance of the function's parameters.
  const size_t index = static_cast<size_t>(it - names.begin());
  // Validated above through `body`: the same document.
  const nlohmann::ordered_json& fn =
      ordered.at("tools").at(index).at("function");
  s->set_json_schema(fn.contains("parameters") ? fn["parameters"].dump()
                                               : "{\"type\": \"object\"}");
  *call = named;
  return absl::OkStatus();
}

absl::Status ParseStop(const json& body, v1::GenerationSampling* s) {
  const json* v = Member(body, "stop");
  if (v == nullptr) return absl::OkStatus();
  auto add = [&](const json& x, absl::string_view param) -> absl::Status {
    if (!x.is_string()) return WrongType(param, "a string", x);
    if (x.get_ref<const std::string&>().empty()) {
      return ParamError(param, absl::StrCat("'", param, "' is empty"));
    }
    s->add_stop(x.get<std::string>());
    return absl::OkStatus();
  };
  if (v->is_string()) return add(*v, "stop");
  if (!v->is_array()) return WrongType("stop", "a string or an array", *v);
  for (size_t i = 0; i < v->size(); ++i) {
    if (auto st = add((*v)[i], absl::StrCat("stop[", i, "]")); !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

absl::Status ParseSampling(const json& body,
                           v1::GenerationSampling* s) {
  SPECSERVE_ASSIGN(max_tokens, GetInt(body, "max_tokens", "max_tokens", 1,
                                      kInt32Max));
  SPECSERVE_ASSIGN(max_completion, GetInt(body, "max_completion_tokens",
                                          "max_completion_tokens", 1,
                                          kInt32Max));
  if (max_completion) {
    s->set_max_new_tokens(static_cast<int>(*max_completion));
  } else if (max_tokens) {
    s->set_max_new_tokens(static_cast<int>(*max_tokens));
  }
  SPECSERVE_ASSIGN(temperature, GetNumber(body, "temperature", "temperature"));
  if (temperature) {
    if (!(*temperature >= 0 && *temperature <= 2)) {
      return ParamError("temperature", "'temperature' must be in [0, 2]");
    }
    s->set_temperature(static_cast<float>(*temperature));
  }
  SPECSERVE_ASSIGN(top_p, GetNumber(body, "top_p", "top_p"));
  if (top_p) {
    if (!(*top_p > 0 && *top_p <= 1)) {
      return ParamError("top_p", "'top_p' must be in (0, 1]");
    }
    s->set_top_p(static_cast<float>(*top_p));
  }
  // vLLM's extension; -1 (vLLM's "off") and 0 both disable it.
  SPECSERVE_ASSIGN(top_k, GetInt(body, "top_k", "top_k", -1, kInt32Max));
  if (top_k) s->set_top_k(*top_k < 0 ? 0 : static_cast<int>(*top_k));
  // vLLM's extension.
  SPECSERVE_ASSIGN(min_p, GetNumber(body, "min_p", "min_p"));
  if (min_p) {
    if (!(*min_p >= 0 && *min_p <= 1)) {
      return ParamError("min_p", "'min_p' must be in [0, 1]");
    }
    s->set_min_p(static_cast<float>(*min_p));
  }
  // OpenAI's response_format: "text" (the default), "json_object" (JSON
  // mode) or "json_schema" (structured output: {"json_schema": {"name",
  // "schema", "strict"}}; the schema is always enforced, and compiled, or
  // refused, by the router's options check).
  if (const json* rf = Member(body, "response_format");
      rf != nullptr && !rf->is_null()) {
    if (!rf->is_object()) return WrongType("response_format", "an object", *rf);
    const json* type = Member(*rf, "type");
    if (type == nullptr || !type->is_string()) {
      return ParamError("response_format",
                        "'response_format.type' must be \"text\", "
                        "\"json_object\" or \"json_schema\"");
    }
    const std::string t = type->get<std::string>();
    if (t == "json_object") {
      s->set_json_object(true);
    } else if (t == "json_schema") {
      const json* js = Member(*rf, "json_schema");
      const json* schema = js != nullptr && js->is_object()
                               ? Member(*js, "schema")
                               : nullptr;
      if (schema == nullptr || !(schema->is_object() || schema->is_boolean())) {
        return ParamError("response_format",
                          "'response_format' of type \"json_schema\" needs "
                          "'json_schema': {\"schema\": {...}}");
      }
      s->set_json_schema(schema->dump());
    } else if (t != "text") {
      return ParamError("response_format",
                        absl::StrCat("'response_format.type' must be "
                                     "\"text\", \"json_object\" or "
                                     "\"json_schema\", got \"",
                                     t, "\""));
    }
  }
  // vLLM's structured-output extensions: guided_json and
  // structured_outputs.json (a schema, or its JSON text) as json_schema,
  // structured_outputs.json_object as JSON mode, guided_choice and
  // structured_outputs.choice as a choice; the other kinds (a regex, a
  // grammar) are refused rather than ignored.
  for (const char* key : {"guided_regex", "guided_grammar"}) {
    if (const json* v = Member(body, key); v != nullptr && !v->is_null()) {
      return ParamError(key, absl::StrCat("'", key,
                                          "' is not supported; a JSON schema "
                                          "(guided_json) or a choice "
                                          "(guided_choice) is"));
    }
  }
  // At most one structured output, whichever parameter asks for it.
  const auto one_output = [&](const std::string& param) -> absl::Status {
    if (s->choice_size() > 0 || s->has_json_schema() || s->json_object()) {
      return ParamError(param, "give one structured output: response_format, "
                               "guided_json, guided_choice or "
                               "structured_outputs");
    }
    return absl::OkStatus();
  };
  // A choice: the output is one of these strings as they are.
  const auto set_choice = [&](const json& v,
                              const std::string& param) -> absl::Status {
    if (!v.is_array() || v.empty()) {
      return WrongType(param, "a non-empty list of strings", v);
    }
    if (absl::Status st = one_output(param); !st.ok()) return st;
    for (const json& c : v) {
      if (!c.is_string() || c.get_ref<const std::string&>().empty()) {
        return ParamError(param, absl::StrCat("'", param,
                                              "' must list non-empty "
                                              "strings"));
      }
      s->add_choice(c.get<std::string>());
    }
    return absl::OkStatus();
  };
  if (const json* v = Member(body, "guided_choice"); v != nullptr && !v->is_null()) {
    if (absl::Status st = set_choice(*v, "guided_choice"); !st.ok()) return st;
  }
  const json* so = Member(body, "structured_outputs");
  if (so != nullptr && !so->is_null() && !so->is_object()) {
    return WrongType("structured_outputs", "an object", *so);
  }
  std::vector<std::pair<std::string, const json*>> schemas;
  if (const json* g = Member(body, "guided_json"); g != nullptr && !g->is_null()) {
    schemas.push_back({"guided_json", g});
  }
  if (so != nullptr && so->is_object()) {
    for (auto it = so->begin(); it != so->end(); ++it) {
      const std::string param = absl::StrCat("structured_outputs.", it.key());
      if (it.value().is_null()) continue;
      if (it.key() == "json") {
        schemas.push_back({param, &it.value()});
      } else if (it.key() == "json_object") {
        if (!it.value().is_boolean()) {
          return WrongType(param, "a boolean", it.value());
        }
        if (it.value().get<bool>()) {
          if (absl::Status st = one_output(param); !st.ok()) return st;
          s->set_json_object(true);
        }
      } else if (it.key() == "choice") {
        if (absl::Status st = set_choice(it.value(), param); !st.ok()) {
          return st;
        }
      } else if (it.key() == "regex" || it.key() == "grammar" ||
                 it.key() == "structural_tag") {
        return ParamError(param, absl::StrCat("'", param,
                                              "' is not supported; a JSON "
                                              "schema is (structured_outputs"
                                              ".json)"));
      }
    }
  }
  for (const auto& [param, v] : schemas) {
    if (absl::Status st = one_output(param); !st.ok()) return st;
    if (v->is_string()) {
      s->set_json_schema(v->get<std::string>());
    } else if (v->is_object() || v->is_boolean()) {
      s->set_json_schema(v->dump());  // in the body's order: ParseRequest
    } else {
      return WrongType(param, "a JSON schema (an object, or its text)", *v);
    }
  }
  // OpenAI's penalties, and vLLM's repetition_penalty extension.
  using S = v1::GenerationSampling;
  for (const auto& [key, set] :
       {std::pair<const char*, void (S::*)(float)>{
            "presence_penalty", &S::set_presence_penalty},
        {"frequency_penalty", &S::set_frequency_penalty}}) {
    SPECSERVE_ASSIGN(penalty, GetNumber(body, key, key));
    if (!penalty) continue;
    if (!(*penalty >= -2 && *penalty <= 2)) {
      return ParamError(key, absl::StrCat("'", key, "' must be in [-2, 2]"));
    }
    (s->*set)(static_cast<float>(*penalty));
  }
  SPECSERVE_ASSIGN(repetition, GetNumber(body, "repetition_penalty",
                                         "repetition_penalty"));
  if (repetition) {
    const double max = std::numeric_limits<float>::max();
    if (!(*repetition > 0 && *repetition <= max)) {
      return ParamError("repetition_penalty",
                        "'repetition_penalty' must be > 0 (1 = off)");
    }
    s->set_repetition_penalty(static_cast<float>(*repetition));
  }
  if (const json* seed = Member(body, "seed"); seed != nullptr) {
    if (!seed->is_number_integer()) {
      return WrongType("seed", "an integer", *seed);
    }
    s->set_seed(seed->is_number_unsigned()
                    ? seed->get<uint64_t>()
                    : static_cast<uint64_t>(seed->get<int64_t>()));
  }
  if (auto st = ParseStop(body, s); !st.ok()) return st;
  if (const json* ids = Member(body, "stop_token_ids"); ids != nullptr) {
    if (!ids->is_array()) return WrongType("stop_token_ids", "an array", *ids);
    v1::TokenIds t;
    if (!ids->empty()) {
      if (auto st = ParseIds(*ids, "stop_token_ids", &t); !st.ok()) return st;
    }
    s->mutable_stop_token_ids()->Add(t.ids().begin(), t.ids().end());
  }
  SPECSERVE_ASSIGN(ignore_eos, GetBool(body, "ignore_eos", "ignore_eos"));
  if (ignore_eos) s->set_ignore_eos(*ignore_eos);
  SPECSERVE_ASSIGN(include_stop, GetBool(body, "include_stop_str_in_output",
                                         "include_stop_str_in_output"));
  if (include_stop) s->set_include_stop_str_in_output(*include_stop);
  SPECSERVE_ASSIGN(min_tokens,
                   GetInt(body, "min_tokens", "min_tokens", 0, kInt32Max));
  if (min_tokens) s->set_min_tokens(static_cast<int>(*min_tokens));
  return ParseLogitBias(body, s);
}

// Our extensions: speculative_prefill {...}, speculative_decoding {...}
// (enabled, num_draft_tokens, method, prompt_lookup_min, prompt_lookup_max,
// tree_branching: [int], tree_max_nodes, tree_min_path_prob). Only types
// are checked here; ranges and method names by the router (ResolveOptions)
// with the same names.
absl::Status ParseExtensions(const json& body, v1::GenerateTextRequest* r) {
  if (const json* p = Member(body, "speculative_prefill"); p != nullptr) {
    if (!p->is_object()) {
      return WrongType("speculative_prefill", "an object", *p);
    }
    v1::SpeculativePrefillConfig* c = r->mutable_speculative_prefill();
    SPECSERVE_ASSIGN(enabled, GetBool(*p, "enabled",
                                      "speculative_prefill.enabled"));
    if (enabled) c->set_enabled(*enabled);
    SPECSERVE_ASSIGN(keep_ratio, GetNumber(*p, "keep_ratio",
                                           "speculative_prefill.keep_ratio"));
    if (keep_ratio) c->set_keep_ratio(static_cast<float>(*keep_ratio));
    SPECSERVE_ASSIGN(keep_mass, GetNumber(*p, "keep_mass",
                                          "speculative_prefill.keep_mass"));
    if (keep_mass) c->set_keep_mass(static_cast<float>(*keep_mass));
    struct IntField {
      const char* key;
      void (v1::SpeculativePrefillConfig::*set)(int32_t);
    };
    static constexpr IntField kInts[] = {
        {"chunk_size", &v1::SpeculativePrefillConfig::set_chunk_size},
        {"pool_kernel_size",
         &v1::SpeculativePrefillConfig::set_pool_kernel_size},
        {"look_ahead", &v1::SpeculativePrefillConfig::set_look_ahead},
        {"keep_first", &v1::SpeculativePrefillConfig::set_keep_first},
        {"keep_last", &v1::SpeculativePrefillConfig::set_keep_last},
        {"min_prompt_tokens",
         &v1::SpeculativePrefillConfig::set_min_prompt_tokens},
    };
    for (const IntField& f : kInts) {
      const std::string param = absl::StrCat("speculative_prefill.", f.key);
      SPECSERVE_ASSIGN(v, GetInt(*p, f.key, param, -kInt32Max, kInt32Max));
      if (v) (c->*f.set)(static_cast<int32_t>(*v));
    }
  }
  if (const json* d = Member(body, "speculative_decoding"); d != nullptr) {
    if (!d->is_object()) {
      return WrongType("speculative_decoding", "an object", *d);
    }
    v1::SpeculativeDecodingConfig* c = r->mutable_speculative_decoding();
    SPECSERVE_ASSIGN(enabled, GetBool(*d, "enabled",
                                      "speculative_decoding.enabled"));
    if (enabled) c->set_enabled(*enabled);
    SPECSERVE_ASSIGN(k, GetInt(*d, "num_draft_tokens",
                               "speculative_decoding.num_draft_tokens",
                               -kInt32Max, kInt32Max));
    if (k) c->set_num_draft_tokens(static_cast<int32_t>(*k));
    if (const json* m = Member(*d, "method"); m != nullptr) {
      if (!m->is_string()) {
        return WrongType("speculative_decoding.method", "a string", *m);
      }
      c->set_method(m->get<std::string>());
    }
    SPECSERVE_ASSIGN(lookup_min,
                     GetInt(*d, "prompt_lookup_min",
                            "speculative_decoding.prompt_lookup_min",
                            -kInt32Max, kInt32Max));
    if (lookup_min) c->set_prompt_lookup_min(static_cast<int32_t>(*lookup_min));
    SPECSERVE_ASSIGN(lookup_max,
                     GetInt(*d, "prompt_lookup_max",
                            "speculative_decoding.prompt_lookup_max",
                            -kInt32Max, kInt32Max));
    if (lookup_max) c->set_prompt_lookup_max(static_cast<int32_t>(*lookup_max));
    if (const json* t = Member(*d, "tree_branching"); t != nullptr) {
      if (!t->is_array()) {
        return WrongType("speculative_decoding.tree_branching", "an array",
                         *t);
      }
      for (size_t i = 0; i < t->size(); ++i) {
        const json& b = (*t)[i];
        const std::string param =
            absl::StrCat("speculative_decoding.tree_branching[", i, "]");
        if (!b.is_number_integer()) return WrongType(param, "an integer", b);
        const int64_t x = b.is_number_unsigned()
                              ? static_cast<int64_t>(std::min<uint64_t>(
                                    b.get<uint64_t>(), kInt32Max))
                              : b.get<int64_t>();
        if (x < -kInt32Max || x > kInt32Max) {
          return ParamError(param, absl::StrCat("'", param,
                                                "' is out of range, got ", x));
        }
        c->add_tree_branching(static_cast<int32_t>(x));
      }
    }
    SPECSERVE_ASSIGN(max_nodes, GetInt(*d, "tree_max_nodes",
                                       "speculative_decoding.tree_max_nodes",
                                       -kInt32Max, kInt32Max));
    if (max_nodes) c->set_tree_max_nodes(static_cast<int32_t>(*max_nodes));
    SPECSERVE_ASSIGN(min_prob,
                     GetNumber(*d, "tree_min_path_prob",
                               "speculative_decoding.tree_min_path_prob"));
    if (min_prob) c->set_tree_min_path_prob(*min_prob);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParamError(absl::string_view param, absl::string_view message) {
  return WithParam(absl::InvalidArgumentError(message), param);
}

absl::Status WithParam(absl::Status status, absl::string_view param) {
  status.SetPayload(kParamPayload, absl::Cord(param));
  return status;
}

std::optional<std::string> ParamOf(const absl::Status& status) {
  auto p = status.GetPayload(kParamPayload);
  if (!p) return std::nullopt;
  return std::string(*p);
}

absl::StatusOr<std::vector<int>> ChatPromptIds(absl::string_view text,
                                               const ChatFormat& format,
                                               const Tokenizer& tokenizer) {
  bool add_bos = format.add_bos;
  if (!format.bos_token.empty() && absl::StartsWith(text, format.bos_token)) {
    text.remove_prefix(format.bos_token.size());
    add_bos = true;
  }
  return tokenizer.Encode(std::string_view(text.data(), text.size()), add_bos);
}

absl::StatusOr<json> ParseBody(absl::string_view body_text) {
  // nlohmann::json parses iteratively but copies (chat_template_kwargs into
  // the template's context) and serializes recursively: a few MB of '['
  // would exhaust the handling thread's stack. Nothing deeper than
  // kMaxBodyDepth is built; the body is refused instead.
  bool too_deep = false;
  json body = json::parse(
      body_text.begin(), body_text.end(),
      [&too_deep](int depth, json::parse_event_t, json&) {
        if (depth <= kMaxBodyDepth) return true;
        too_deep = true;
        return false;  // not kept
      },
      /*allow_exceptions=*/false);
  if (too_deep) {
    return ParamError("", absl::StrCat("the request body is nested deeper "
                                       "than ",
                                       kMaxBodyDepth, " levels"));
  }
  if (body.is_discarded()) {
    return ParamError("", "the request body is not valid JSON");
  }
  if (!body.is_object()) {
    return ParamError("", "the request body must be a JSON object");
  }
  return body;
}

absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint,
                                           absl::string_view body_text,
                                           const ChatFormat& chat,
                                           const Tokenizer* tokenizer) {
  SPECSERVE_ASSIGN(body, ParseBody(body_text));
  ParsedRequest out;
  v1::GenerateTextRequest& r = out.request;
  if (const json* m = Member(body, "model"); m != nullptr) {
    if (!m->is_string()) return WrongType("model", "a string", *m);
    out.model = m->get<std::string>();
  }
  SPECSERVE_ASSIGN(n, GetInt(body, "n", "n", 1, kMaxChoices));
  if (n) out.n = static_cast<int>(*n);
  // Known parameters that would change the answer and are not implemented:
  // refused when they ask for something, rather than silently ignored.
  for (const char* key : {"echo", "suffix", "best_of"}) {
    if (endpoint == Endpoint::kCompletions && key == std::string("echo")) {
      continue;  // parsed below
    }
    const json* v = Member(body, key);
    if (v != nullptr && AsksForSomething(*v, key == std::string("best_of"))) {
      return ParamError(key, absl::StrCat("'", key, "' is not supported"));
    }
  }
  SPECSERVE_ASSIGN(stream, GetBool(body, "stream", "stream"));
  out.stream = stream.value_or(false);
  if (const json* so = Member(body, "stream_options"); so != nullptr) {
    if (!so->is_object()) return WrongType("stream_options", "an object", *so);
    if (!out.stream) {
      return ParamError("stream_options",
                        "'stream_options' is only allowed with 'stream': "
                        "true");
    }
    SPECSERVE_ASSIGN(usage, GetBool(*so, "include_usage",
                                    "stream_options.include_usage"));
    out.include_usage = usage.value_or(false);
  }
  if (auto s = ParseSampling(body, r.mutable_sampling()); !s.ok()) {
    return s;
  }
  // Schemas as sent: their properties' order is the order they are
  // written in (the body's json sorts object keys).
  const bool needs_order = r.sampling().has_json_schema() ||
                           (endpoint == Endpoint::kChat &&
                            Member(body, "tool_choice") != nullptr);
  const nlohmann::ordered_json ordered =
      needs_order ? nlohmann::ordered_json::parse(body_text, nullptr,
                                                  /*allow_exceptions=*/false)
                  : nlohmann::ordered_json();
  if (r.sampling().has_json_schema() && !ordered.is_discarded()) {
    // Where the schema object came from (a schema sent as text is kept as
    // sent).
    for (const char* at : {"/response_format/json_schema/schema",
                           "/guided_json", "/structured_outputs/json"}) {
      const nlohmann::ordered_json::json_pointer ptr(at);
      if (ordered.contains(ptr) && (ordered.at(ptr).is_object() ||
                                    ordered.at(ptr).is_boolean())) {
        r.mutable_sampling()->set_json_schema(ordered.at(ptr).dump());
        break;
      }
    }
  }
  if (auto s = ParseLogprobs(endpoint, body, r.mutable_sampling()); !s.ok()) {
    return s;
  }
  if (auto s = ParseExtensions(body, &r); !s.ok()) return s;
  if (endpoint == Endpoint::kCompletions) {
    SPECSERVE_ASSIGN(echo, GetBool(body, "echo", "echo"));
    out.echo = echo.value_or(false);
    // Echoed logprobs are the prompt's too: every prompt row's logits
    // (no Speculative Prefill pruning for this request).
    if (out.echo && r.sampling().logprobs()) {
      r.mutable_sampling()->set_prompt_logprobs(r.sampling().top_logprobs());
    }
    if (auto s = ParsePrompt(body, &out); !s.ok()) return s;
    return out;
  }
  json tools;
  if (auto s = ParseTools(body, ordered, &tools, &out.tool_call,
                          &out.read_tools,
                          r.mutable_sampling());
      !s.ok()) {
    return s;
  }
  auto messages = NormalizeMessages(body);
  if (!messages.ok()) return messages.status();
  if (tokenizer == nullptr || !chat.render) {
    return ParamError("messages",
                      "chat completions need the router's --tokenizer");
  }
  json context = {{"messages", *messages}, {"add_generation_prompt", true}};
  if (const json* kw = Member(body, "chat_template_kwargs"); kw != nullptr) {
    if (!kw->is_object()) {
      return WrongType("chat_template_kwargs", "an object", *kw);
    }
    for (auto it = kw->begin(); it != kw->end(); ++it) {
      context[it.key()] = it.value();
    }
  }
  SPECSERVE_ASSIGN(gen, GetBool(body, "add_generation_prompt",
                                "add_generation_prompt"));
  if (gen) context["add_generation_prompt"] = *gen;
  context["messages"] = *messages;
  if (!tools.empty()) context["tools"] = tools;  // the template's to render
  auto text = chat.render(context);
  if (!text.ok()) {
    if (!absl::IsInvalidArgument(text.status())) return text.status();
    return ParamError("messages", text.status().message());
  }
  auto ids = ChatPromptIds(*text, chat, *tokenizer);
  if (!ids.ok()) return ids.status();
  if (ids->empty()) return ParamError("messages", "the chat prompt is empty");
  r.mutable_token_ids()->mutable_ids()->Add(ids->begin(), ids->end());
  return out;
}

absl::Status NameParam(absl::Status status, Endpoint endpoint) {
  if (!absl::IsInvalidArgument(status) || ParamOf(status)) return status;
  absl::string_view field = status.message();
  field = field.substr(0, field.find_first_of(" :=["));
  std::string param;
  if (absl::StartsWith(field, "token_ids") || field == "text" ||
      field == "prompt") {
    param = endpoint == Endpoint::kChat ? "messages" : "prompt";
  } else if (field == "sampling.max_new_tokens") {
    param = "max_tokens";
  } else if (field == "sampling.json_object" ||
             field == "sampling.json_schema" || field == "sampling.choice") {
    param = "response_format";
  } else if (absl::ConsumePrefix(&field, "sampling.")) {
    param = std::string(field);
  } else if (absl::StartsWith(field, "speculative_prefill.") ||
             absl::StartsWith(field, "speculative_decoding.")) {
    param = std::string(field);
  } else {
    return status;
  }
  return WithParam(std::move(status), param);
}

int HttpStatus(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kFailedPrecondition:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    case absl::StatusCode::kCancelled:
      return 499;
    default:
      return 500;
  }
}

nlohmann::json ErrorBody(const absl::Status& status) {
  const char* type = "server_error";
  switch (HttpStatus(status)) {
    case 400:
      type = "invalid_request_error";
      break;
    case 401:
      type = "authentication_error";
      break;
    case 404:
      type = "not_found_error";
      break;
    case 429:
      type = "rate_limit_error";
      break;
    case 503:
      type = "service_unavailable_error";
      break;
    case 504:
      type = "timeout_error";
      break;
    default:
      break;
  }
  json param = nullptr;
  if (auto p = ParamOf(status); p && !p->empty()) param = *p;
  return {{"error",
           {{"message", std::string(status.message())},
            {"type", type},
            {"param", param},
            {"code", absl::StatusCodeToString(status.code())}}}};
}

std::string OpenAiFinishReason(absl::string_view router_reason) {
  if (router_reason == "length" || router_reason == "context_limit") {
    return "length";
  }
  return "stop";
}

v1::GenerateTextRequest ChoiceRequest(const v1::GenerateTextRequest& request,
                                      int index) {
  v1::GenerateTextRequest r = request;
  if (index > 0 && r.sampling().has_seed()) {
    r.mutable_sampling()->set_seed(r.sampling().seed() +
                                   static_cast<uint64_t>(index));
  }
  return r;
}

std::vector<v1::GenerateTextRequest> ChoiceRequests(const ParsedRequest& p) {
  std::vector<v1::GenerateTextRequest> out;
  for (int prompt = 0; prompt < p.num_prompts(); ++prompt) {
    const v1::GenerateTextRequest& base =
        prompt == 0 ? p.request : p.more_prompts[prompt - 1];
    for (int i = 0; i < p.n; ++i) out.push_back(ChoiceRequest(base, i));
  }
  return out;
}

ResponseBuilder::ResponseBuilder(Endpoint endpoint, std::string id,
                                 std::string model, int64_t created,
                                 bool include_usage, int n,
                                 int choices_per_prompt)
    : endpoint_(endpoint),
      id_(std::move(id)),
      model_(std::move(model)),
      created_(created),
      include_usage_(include_usage),
      n_(std::max(n, 1)),
      per_prompt_(choices_per_prompt > 0 ? choices_per_prompt : n_),
      role_sent_(n_, false),
      echo_sent_(n_, false),
      text_offset_(n_, 0) {}

void ResponseBuilder::EnableEcho(std::vector<std::string> prompt_texts) {
  echo_ = std::move(prompt_texts);
}

void ResponseBuilder::EnableToolCallParsing(std::vector<std::string> tools) {
  read_tools_ = std::move(tools);
  call_text_.assign(n_, "");
  auto_mode_.assign(n_, kUndecided);
}

json ResponseBuilder::CallsJson(const std::vector<ParsedToolCall>& calls,
                                bool streamed) {
  json out = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    json call = {{"id", NewId("call_")},
                 {"type", "function"},
                 {"function",
                  {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}};
    if (streamed) call["index"] = static_cast<int>(k);
    out.push_back(std::move(call));
  }
  return out;
}

void ResponseBuilder::EnableToolCall(std::string name) {
  tool_call_ = std::move(name);
  call_ids_.clear();
  for (int i = 0; i < n_; ++i) call_ids_.push_back(NewId("call_"));
  call_opened_.assign(n_, false);
}

const std::string& ResponseBuilder::EchoText(int index) const {
  static const std::string kNone;
  const size_t prompt = static_cast<size_t>(index / per_prompt_);
  return prompt < echo_.size() ? echo_[prompt] : kNone;
}

void ResponseBuilder::EnableLogprobs(const Tokenizer* tokenizer) {
  logprobs_ = true;
  tokenizer_ = tokenizer;
}

std::string ResponseBuilder::TokenText(int id) const {
  if (tokenizer_ == nullptr) return absl::StrCat("token_id:", id);
  absl::StatusOr<std::string> text = tokenizer_->Decode({id});
  if (!text.ok()) return absl::StrCat("token_id:", id);
  // Sentencepiece drops a piece's leading "▁" (a space) when it starts the
  // decoded text; a token of the output keeps it.
  absl::StatusOr<std::string> piece = tokenizer_->IdToPiece(id);
  if (piece.ok() && absl::StartsWith(*piece, "\xe2\x96\x81") &&
      !absl::StartsWith(*text, " ")) {
    return absl::StrCat(" ", *text);
  }
  return *text;
}

std::string ResponseBuilder::TokenBytes(int id, const std::string& text) const {
  // A token that is part of a character decodes to U+FFFD: its own bytes
  // then come from the piece (sentencepiece "<0xAB>", byte-level BPE).
  if (tokenizer_ == nullptr || !absl::StrContains(text, "\xef\xbf\xbd")) {
    return text;
  }
  absl::StatusOr<std::string> piece = tokenizer_->IdToPiece(id);
  if (!piece.ok()) return text;
  unsigned char byte = 0;
  if (ParseBytePiece(*piece, &byte)) {
    return std::string(1, static_cast<char>(byte));
  }
  std::string bytes;
  if (ByteLevelDecode(*piece, &bytes)) return bytes;
  return text;
}

template <typename Message>
json ResponseBuilder::Logprobs(const Message& m, int64_t* offset) const {
  if (!logprobs_) return nullptr;
  const auto& ids = m.token_ids();
  const auto& logprobs = m.logprobs();
  auto value = [](float lp) {
    return std::isnan(lp) ? -9999.0 : std::max<double>(lp, -9999.0);
  };
  auto byte_list = [](const std::string& b) {
    json out = json::array();
    for (unsigned char c : b) out.push_back(static_cast<int>(c));
    return out;
  };
  const int n = std::min(ids.size(), logprobs.size());
  if (endpoint_ == Endpoint::kChat) {
    json content = json::array();
    for (int i = 0; i < n; ++i) {
      const std::string text = TokenText(ids[i]);
      json top = json::array();
      for (const v1::TopLogprob& t : logprobs[i].top()) {
        const std::string t_text = TokenText(t.id());
        top.push_back({{"token", t_text},
                       {"logprob", value(t.logprob())},
                       {"bytes", byte_list(TokenBytes(t.id(), t_text))}});
      }
      content.push_back({{"token", text},
                         {"logprob", value(logprobs[i].logprob())},
                         {"bytes", byte_list(TokenBytes(ids[i], text))},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}};
  }
  json tokens = json::array(), token_logprobs = json::array(),
       top_logprobs = json::array(), text_offset = json::array();
  const auto add = [&](int id, const v1::TokenLogprob* lp) {
    const std::string text = TokenText(id);
    tokens.push_back(text);
    text_offset.push_back(*offset);
    *offset += static_cast<int64_t>(text.size());
    if (lp == nullptr) {  // an echoed prompt's first token
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      return;
    }
    json top = json::object();
    for (const v1::TopLogprob& t : lp->top()) {
      const std::string t_text = TokenText(t.id());
      if (!top.contains(t_text)) top[t_text] = value(t.logprob());
    }
    // vLLM lists the sampled token with the top-N.
    if (!top.contains(text)) top[text] = value(lp->logprob());
    token_logprobs.push_back(value(lp->logprob()));
    top_logprobs.push_back(std::move(top));
  };
  // Echo: prompt token i + 1's logprob is prompt_logprobs[i].
  const auto& prompt = m.prompt_token_ids();
  if (prompt.size() == m.prompt_logprobs().size() + 1) {
    for (int i = 0; i < prompt.size(); ++i) {
      add(prompt[i], i == 0 ? nullptr : &m.prompt_logprobs(i - 1));
    }
  }
  for (int i = 0; i < n; ++i) add(ids[i], &logprobs[i]);
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(text_offset)}};
}

json ResponseBuilder::Stats(const v1::Usage& usage,
                            const v1::GenerationStats& stats) {
  google::protobuf::util::JsonPrintOptions o;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  std::string text;
  json out = json::object();
  if (google::protobuf::util::MessageToJsonString(stats, &text, o).ok()) {
    out = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (out.is_discarded()) out = json::object();
  }
  out["prompt_tokens"] = usage.prompt_tokens();
  out["kept_prompt_tokens"] = usage.kept_prompt_tokens();
  out["completion_tokens"] = usage.completion_tokens();
  return out;
}

json ResponseBuilder::Usage(const v1::Usage& u) const {
  return {{"prompt_tokens", u.prompt_tokens()},
          {"completion_tokens", u.completion_tokens()},
          {"total_tokens", u.prompt_tokens() + u.completion_tokens()}};
}

json ResponseBuilder::Response(
    absl::Span<const v1::GenerateTextResponse> responses) const {
  const bool chat = endpoint_ == Endpoint::kChat;
  json choices = json::array();
  v1::Usage usage;
  for (size_t i = 0; i < responses.size(); ++i) {
    const v1::GenerateTextResponse& r = responses[i];
    int64_t offset = 0;
    json choice = {{"index", i},
                   {"logprobs", Logprobs(r, &offset)},
                   {"finish_reason", OpenAiFinishReason(r.finish_reason())}};
    // The answer as tool calls: read from the answer (auto; required with
    // several tools) or forced (a named tool).
    ParsedAnswer calls;
    if (chat && !read_tools_.empty()) {
      calls = ParseToolCalls(r.text(), read_tools_);
      if (!calls.calls.empty()) choice["finish_reason"] = "tool_calls";
    } else if (chat && !tool_call_.empty()) {
      calls.calls.push_back({tool_call_, r.text()});
    }
    if (!calls.calls.empty()) {
      choice["message"] = {
          {"role", "assistant"},
          {"content", calls.content.empty() ? json(nullptr)
                                            : json(calls.content)},
          {"tool_calls", CallsJson(calls.calls, false)}};
    } else if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", r.text()}};
    } else {
      choice["text"] = EchoText(static_cast<int>(i)) + r.text();
    }
    choices.push_back(std::move(choice));
    AddUsage(r.usage(), static_cast<int>(i), &usage);
  }
  json out = {{"id", id_},
              {"object", chat ? "chat.completion" : "text_completion"},
              {"created", created_},
              {"model", model_},
              {"choices", std::move(choices)},
              {"usage", Usage(usage)}};
  if (!responses.empty()) {
    out["specserve"] = Stats(responses[0].usage(), responses[0].stats());
  }
  return out;
}

void ResponseBuilder::AddUsage(const v1::Usage& choice, int index,
                               v1::Usage* total) const {
  // Each prompt once (its first choice's), every completion.
  if (index % per_prompt_ == 0) {
    total->set_prompt_tokens(total->prompt_tokens() + choice.prompt_tokens());
    total->set_kept_prompt_tokens(total->kept_prompt_tokens() +
                                  choice.kept_prompt_tokens());
  }
  total->set_completion_tokens(total->completion_tokens() +
                               choice.completion_tokens());
}

json ResponseBuilder::Chunk() const {
  json c = {{"id", id_},
            {"object", endpoint_ == Endpoint::kChat ? "chat.completion.chunk"
                                                     : "text_completion"},
            {"created", created_},
            {"model", model_}};
  if (include_usage_) c["usage"] = nullptr;
  return c;
}

std::string ResponseBuilder::StreamEvents(const v1::GenerateTextChunk& chunk,
                                          int index) {
  const bool chat = endpoint_ == Endpoint::kChat;
  index = std::clamp(index, 0, n_ - 1);
  const bool last = !chunk.finish_reason().empty();
  std::string out;
  auto emit = [&out](const json& j) {
    absl::StrAppend(&out, "data: ", j.dump(-1, ' ', false,
                                           json::error_handler_t::replace),
                    "\n\n");
  };
  // Echo: the prompt goes first, with the choice's first event.
  std::string delta = chunk.text();
  if (!echo_sent_[index] && !chat) {
    echo_sent_[index] = true;
    delta = EchoText(index) + delta;
  }
  // tool_choice "auto": text goes out as it comes until it may be a call
  // (an answer opening with '{' or '[', Llama 3's; a <tool_call> tag,
  // Hermes / Qwen's); from there it is held and read at the end.
  ParsedAnswer auto_calls;
  if (chat && !read_tools_.empty()) {
    std::string& held = call_text_[index];
    held += delta;
    delta.clear();
    uint8_t& mode = auto_mode_[index];
    if (mode == kUndecided) {
      const size_t p = held.find_first_not_of(" \t\r\n");
      if (p != std::string::npos) {
        mode = held[p] == '{' || held[p] == '[' ? kHoldAll : kText;
      }
    }
    if (mode == kText) {
      constexpr absl::string_view kTag = "<tool_call>";
      const size_t tag = held.find(std::string(kTag));
      size_t keep = 0;  // a tail that may start the tag
      if (tag != std::string::npos) {
        keep = held.size() - tag;
        mode = kHoldTag;
      } else {
        for (size_t n = std::min(held.size(), kTag.size() - 1); n > 0; --n) {
          if (absl::EndsWith(held, kTag.substr(0, n))) {
            keep = n;
            break;
          }
        }
      }
      delta = held.substr(0, held.size() - keep);
      held.erase(0, held.size() - keep);
    }
    if (last) {
      auto_calls = ParseToolCalls(held, read_tools_);
      delta += auto_calls.calls.empty() ? held : auto_calls.content;
      held.clear();
    }
  }
  auto choice = [&](const std::string& text, const json& finish) {
    json c = {{"index", index},
              {"logprobs", Logprobs(chunk, &text_offset_[index])},
              {"finish_reason", finish}};
    if (!auto_calls.calls.empty()) {
      c["delta"] = {{"tool_calls", CallsJson(auto_calls.calls, true)}};
      if (!text.empty()) c["delta"]["content"] = text;
      c["finish_reason"] = "tool_calls";
    } else if (chat && !tool_call_.empty() && !text.empty()) {
      json call = {{"index", 0}, {"function", {{"arguments", text}}}};
      if (!call_opened_[index]) {  // the call's first delta names it
        call_opened_[index] = true;
        call["id"] = call_ids_[index];
        call["type"] = "function";
        call["function"]["name"] = tool_call_;
      }
      c["delta"] = {{"tool_calls", json::array({std::move(call)})}};
    } else if (chat) {
      c["delta"] = text.empty() ? json::object() : json{{"content", text}};
    } else {
      c["text"] = text;
    }
    return c;
  };
  if (chat && !role_sent_[index]) {
    json c = Chunk();
    c["choices"] = json::array(
        {{{"index", index},
          {"delta", {{"role", "assistant"}, {"content", ""}}},
          {"logprobs", nullptr},
          {"finish_reason", nullptr}}});
    emit(c);
    role_sent_[index] = true;
  }
  const bool has_logprobs =
      logprobs_ &&
      (chunk.logprobs_size() > 0 || chunk.prompt_token_ids_size() > 0);
  if ((!delta.empty() || has_logprobs) && !last) {
    json c = Chunk();
    c["choices"] = json::array({choice(delta, nullptr)});
    emit(c);
  }
  if (last) {
    json c = Chunk();
    c["choices"] = json::array(
        {choice(delta, OpenAiFinishReason(chunk.finish_reason()))});
    c["specserve"] = Stats(chunk.usage(), chunk.stats());
    emit(c);
    AddUsage(chunk.usage(), index, &usage_);
    if (include_usage_ && ++finished_ == n_) {
      json u = Chunk();
      u["choices"] = json::array();
      u["usage"] = Usage(usage_);
      emit(u);
    }
  }
  return out;
}

std::string ResponseBuilder::ErrorEvent(const absl::Status& status) {
  return absl::StrCat("data: ", ErrorBody(status).dump(), "\n\n");
}

std::string ResponseBuilder::DoneEvent() { return "data: [DONE]\n\n"; }

std::string NewId(absl::string_view prefix) {
  static absl::Mutex mu;
  static absl::BitGen* gen = new absl::BitGen();
  absl::MutexLock lock(&mu);
  return absl::StrCat(prefix,
                      absl::StrFormat("%016x", absl::Uniform<uint64_t>(*gen)),
                      absl::StrFormat("%08x", absl::Uniform<uint32_t>(*gen)));
}

}  // namespace openai
}  // namespace specserve
