#ifndef SPECSERVE_COMMON_DECODING_JSON_SCHEMA_H_
#define SPECSERVE_COMMON_DECODING_JSON_SCHEMA_H_

// Structured output with a JSON Schema (OpenAI's response_format
// {"type": "json_schema"}; vLLM's guided_json): a schema compiled into the
// small automaton JsonMatcher (json_grammar.h) walks byte by byte. Every
// text the matcher accepts is an instance of the schema; the converse is
// not asked for: object properties come in the schema's order and nothing
// but the listed properties is written (as llama.cpp's grammars and
// OpenAI's strict mode do), which keeps the automaton deterministic.

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace specserve {

/// A compiled JSON Schema (draft 2020-12 keywords, the subset below).
///
/// Supported: `type` (a name or a list), `properties` + `required`
/// (properties are written in schema order, optional ones may be left
/// out), `additionalProperties` (a schema: the value type of an object
/// without `properties`; otherwise no extra property is written), `items`,
/// `minItems` / `maxItems` (up to 255), `minLength` / `maxLength` (code
/// points), `enum`, `const`, `anyOf` / `oneOf` whose branches start with
/// different bytes (an object, an array, a string, a number, true, false,
/// null: e.g. Pydantic's Optional[X]), a one-branch `allOf`, and local
/// `$ref`s ("#/$defs/Name", "#/definitions/Name", "#"), recursive ones
/// included, and anyOf / oneOf of objects whose first property is a
/// required tag with disjoint enum / const values (a tagged union: the tag
/// picks the branch). Annotations (title, description, default, examples, ...) and
/// unknown keywords are ignored. The root must be an object. Refused
/// (INVALID_ARGUMENT naming the keyword): keywords that constrain values
/// in ways not implemented (pattern, format, minimum, maximum,
/// multipleOf, prefixItems, uniqueItems, not, if/then/else, ...), `false`
/// schemas, anyOf branches that start alike, more than 64 properties in an
/// object or 64 values in an enum, a `required` name not in `properties`,
/// a `$ref` that does not resolve, text that is not JSON, more than
/// kMaxSchemaBytes, nesting deeper than 64, more than kMaxNodes nodes.
class JsonSchema {
 public:
  static constexpr size_t kMaxSchemaBytes = 64 * 1024;
  static constexpr int kMaxNodes = 4096;
  static constexpr int kMaxAlternatives = 64;  // properties, enum values

  /// Compiles `text` (a JSON Schema document). Compiled schemas are
  /// shared by text (the last 256 compiled), so repeated requests with one
  /// schema share the token masks JsonTokenMask caches for it. Errors:
  /// INVALID_ARGUMENT as above, the message starting with what is wrong
  /// (callers prefix the field).
  static absl::StatusOr<std::shared_ptr<const JsonSchema>> Compile(
      absl::string_view text);

  /// The schema of JSON mode (response_format json_object): any object.
  static const JsonSchema& AnyObject();

  /// vLLM's guided_choice: the output is exactly one of `choices` as raw
  /// text (no JSON quoting, nothing before or after it). Shared by the
  /// list, as Compile shares by text. INVALID_ARGUMENT for no choices, more
  /// than kMaxAlternatives, an empty one, or one longer than 65535 bytes.
  static absl::StatusOr<std::shared_ptr<const JsonSchema>> Choice(
      const std::vector<std::string>& choices);
  /// Whether this is a Choice schema (its root node is the literal set).
  bool raw_choice() const { return raw_choice_; }

  /// Unique per compiled schema (JsonMatcher::Key).
  uint64_t id() const { return id_; }

  // ---- The automaton's tables, for JsonMatcher. ----

  /// First-byte classes of a JSON value: '{', '[', '"', a number ('-' or
  /// a digit), 't', 'f', 'n'; -1 for any other byte.
  static constexpr int kNumClasses = 7;
  static int ClassOf(unsigned char c);

  enum class Kind : uint8_t {
    kDispatch,  // where a value starts: by_class picks the typed node
    kObject,    // properties in order
    kMap,       // any keys, values of one type (child)
    kArray,     // items of one type (child)
    kString,
    kNumber,
    kLiterals,  // one of a few serialized values (enum, const, booleans)
    // An anyOf of objects told apart by their first property (a tagged
    // union: Pydantic's discriminated unions, tool calls by name): keys[0]
    // is that property, values[0] its value's dispatch (all the branches'
    // tags, one literal set), branch[i] the object node literal i of that
    // set selects; the branch then goes on past its first property.
    kUnionObject,
  };
  struct Node {
    Kind kind = Kind::kDispatch;
    std::array<int16_t, kNumClasses> by_class{-1, -1, -1, -1, -1, -1, -1};
    std::vector<std::string> keys;  ///< kObject: "\"name\"", schema order.
    std::vector<int> values;        ///< kObject: each key's dispatch node.
    std::vector<uint8_t> required;  ///< kObject: per key.
    int child = -1;                 ///< kMap values, kArray items (dispatch).
    int min_items = 0, max_items = -1;    ///< kArray; -1 = no limit.
    int min_length = 0, max_length = -1;  ///< kString; code points.
    bool integer = false;                 ///< kNumber: no fraction/exponent.
    std::vector<std::string> literals;    ///< kLiterals: serialized values.
    std::vector<int> branch;  ///< kUnionObject: object node per tag literal.
  };
  const Node& node(int i) const { return nodes_[i]; }
  /// The dispatch node of the top-level value.
  int root() const { return root_; }

 private:
  class Compiler;
  JsonSchema() = default;

  std::vector<Node> nodes_;
  int root_ = 0;
  uint64_t id_ = 0;
  bool raw_choice_ = false;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_JSON_SCHEMA_H_
