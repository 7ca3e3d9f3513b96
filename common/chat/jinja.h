#ifndef SPECSERVE_COMMON_CHAT_JINJA_H_
#define SPECSERVE_COMMON_CHAT_JINJA_H_

// A Jinja2 subset for Hugging Face chat templates (tokenizer_config.json's
// `chat_template`), enough for the Llama 3 and Qwen 3 templates and most
// others, rendered the way transformers / transformers.js do: trim_blocks
// and lstrip_blocks on, one trailing newline of the source dropped.
//
// Supported (Jinja2 semantics, https://jinja.palletsprojects.com/templates/):
//   {{ expr }}, {% if/elif/else/endif %}, {% for x in xs [if cond] %} with
//   {% else %} and loop.index/index0/revindex/revindex0/first/last/length/
//   previtem/nextitem, {% set x = e %}, {% set ns.attr = e %},
//   {# comments #}, whitespace control ({%- -%} {{- -}}).
//   Expressions: literals (strings, ints, floats, true/false/none, lists,
//   dicts), names, a.b, a[i], a[i:j:k], calls, `x if c else y`, or/and/not,
//   in/not in, is [not] <test>, == != < <= > >=, + - * / // % ~, unary -.
//   Filters: trim, length/count, tojson, string, upper, lower, capitalize,
//   title (upper/lower/title/capitalize map ASCII letters only), first,
//   last, join, default/d, reverse, list, items, int, float,
//   abs, replace, safe. Tests: defined, undefined, none, string, number,
//   integer, float, boolean, true, false, mapping, sequence, iterable,
//   odd, even, divisibleby, eq/ne. Globals: namespace(), range(),
//   raise_exception(msg). Methods: str.startswith/endswith/split/strip/
//   lstrip/rstrip/upper/lower/replace/title/capitalize, dict.get/items/
//   keys/values.
// Not supported (a parse or render error, never a crash): macros, blocks,
// includes, {% set %} blocks, call/filter blocks, loop.cycle.
//
// Python's semantics where Jinja2 and @huggingface/jinja (transformers.js)
// differ: strip/lstrip/rstrip take the optional `chars` argument (without
// it they strip Unicode whitespace), booleans print as True/False, None as
// "None". tojson writes object keys sorted (the context is a
// nlohmann::json). A namespace is a value: `set ns.x = v` updates the
// variable `ns` (a copy made by `set b = ns` does not see it).
//
// Cost: variables, attributes and items refer into the context (no copies),
// so rendering is linear in the conversation; the output is capped at 10^7
// bytes and loops at 10^6 iterations; expressions and blocks nest at most
// 128 levels (deeper is a parse error: parsing and rendering recurse).
// Strings a template builds (~, +, *, replace, join) are capped at 10^7
// bytes and lists built with + at 10^6 items (an error past them); integer
// arithmetic past 64 bits gives a float, as @huggingface/jinja's doubles do.
// Values nested by the template itself are not bounded: a loop that wraps
// a variable in a list on every iteration can exhaust the stack. A template
// is the model directory's, trusted as its weights are; requests only
// supply the context (the router bounds its nesting).

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace chat {

namespace jinja_internal {
struct Node;
}  // namespace jinja_internal

/// A parsed template; immutable, safe to render from many threads.
class JinjaTemplate {
 public:
  /// INVALID_ARGUMENT naming the line of the first syntax error or
  /// unsupported construct.
  static absl::StatusOr<JinjaTemplate> Parse(absl::string_view source);

  /// Renders with the variables of `context` (a JSON object, e.g.
  /// {"messages": [...], "add_generation_prompt": true, "bos_token": "<s>"}).
  /// INVALID_ARGUMENT for a runtime error (a type error, an unknown filter,
  /// raise_exception(msg) with msg) or a render past 10^7 output bytes or
  /// 10^6 loop iterations.
  absl::StatusOr<std::string> Render(const nlohmann::json& context) const;

 private:
  explicit JinjaTemplate(std::shared_ptr<const jinja_internal::Node> root)
      : root_(std::move(root)) {}
  std::shared_ptr<const jinja_internal::Node> root_;
};

}  // namespace chat
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CHAT_JINJA_H_
