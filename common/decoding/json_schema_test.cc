#include "common/decoding/json_schema.h"

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/decoding/json_grammar.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::ordered_json;

std::shared_ptr<const JsonSchema> MustCompile(const Json& schema) {
  auto s = JsonSchema::Compile(schema.dump());
  EXPECT_TRUE(s.ok()) << s.status() << "\n" << schema.dump();
  return s.ok() ? *s : nullptr;
}

// Whether `m` (a copy) accepts every byte of `text` and is then complete.
bool AcceptsComplete(JsonMatcher m, const std::string& text) {
  return m.Advance(text) && m.complete();
}

// A validator of the supported subset, written from the JSON Schema spec
// independently of the compiler: whether `v` is an instance of `s`
// (`root` resolves $refs). Also checks what the matcher promises beyond
// the spec: object keys only from `properties` (or any, for a map), in
// schema order.
bool Valid(const Json& v, const Json& s, const Json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) {
    const std::string r = s["$ref"];
    const Json& t = r == "#" ? root : root.at(Json::json_pointer(r.substr(1)));
    return Valid(v, t, root);
  }
  if (s.contains("const")) return v == s["const"];
  if (s.contains("enum")) {
    for (const Json& e : s["enum"]) {
      if (v == e) return true;
    }
    return false;
  }
  for (const char* kw : {"anyOf", "oneOf"}) {
    if (!s.contains(kw)) continue;
    int matched = 0;
    for (const Json& b : s[kw]) matched += Valid(v, b, root);
    return kw == std::string("anyOf") ? matched > 0 : matched == 1;
  }
  if (s.contains("allOf")) return Valid(v, s["allOf"][0], root);
  std::vector<std::string> types;
  if (s.contains("type")) {
    if (s["type"].is_string()) {
      types = {s["type"]};
    } else {
      for (const Json& t : s["type"]) types.push_back(t);
    }
  } else if (s.contains("properties")) {
    types = {"object"};
  } else if (s.contains("items")) {
    types = {"array"};
  } else {
    return true;
  }
  for (const std::string& t : types) {
    if (t == "null" && v.is_null()) return true;
    if (t == "boolean" && v.is_boolean()) return true;
    if (t == "integer" && v.is_number_integer()) return true;
    if (t == "number" && v.is_number()) return true;
    if (t == "string" && v.is_string()) {
      // Code points: UTF-8 bytes that are not continuation bytes.
      int len = 0;
      for (unsigned char c : v.get<std::string>()) len += (c & 0xC0) != 0x80;
      if (s.contains("minLength") && len < s["minLength"].get<int>()) continue;
      if (s.contains("maxLength") && len > s["maxLength"].get<int>()) continue;
      return true;
    }
    if (t == "array" && v.is_array()) {
      const int n = static_cast<int>(v.size());
      if (s.contains("minItems") && n < s["minItems"].get<int>()) continue;
      if (s.contains("maxItems") && n > s["maxItems"].get<int>()) continue;
      bool ok = true;
      for (const Json& x : v) {
        ok = ok && Valid(x, s.contains("items") ? s["items"] : Json(true), root);
      }
      if (ok) return true;
    }
    if (t == "object" && v.is_object()) {
      const Json props = s.value("properties", Json::object());
      bool ok = true;
      if (props.empty()) {
        const Json extra = s.value("additionalProperties", Json(true));
        for (const auto& [k, x] : v.items()) ok = ok && Valid(x, extra, root);
        if (ok) return true;
        continue;
      }
      std::vector<std::string> order;
      for (const auto& [k, x] : props.items()) order.push_back(k);
      size_t next = 0;
      for (const auto& [k, x] : v.items()) {
        while (next < order.size() && order[next] != k) ++next;
        if (next == order.size()) return false;  // unknown or out of order
        ok = ok && Valid(x, props[k], root);
      }
      for (const Json& r : s.value("required", Json::array())) {
        ok = ok && v.contains(r.get<std::string>());
      }
      if (ok) return true;
    }
  }
  return false;
}

// A random walk: at each step a random byte of `alphabet` the matcher
// accepts, until the object is complete. Returns the text, or "" if the
// walk got stuck (no byte accepted) or ran past `max_bytes`.
std::string RandomWalk(const JsonSchema* schema, std::mt19937* g,
                       size_t max_bytes, bool* stuck) {
  static const std::string alphabet = [] {
    std::string a = "\n\xC3\xA9";  // and every printable ASCII byte
    for (char c = 0x20; c < 0x7F; ++c) a.push_back(c);
    return a;
  }();
  JsonMatcher m(schema);
  std::string text;
  *stuck = false;
  while (!m.complete() && text.size() < max_bytes) {
    std::vector<unsigned char> ok;
    for (unsigned char c : alphabet) {
      JsonMatcher next = m;
      if (next.Advance(c)) ok.push_back(c);
    }
    if (ok.empty()) {
      *stuck = true;
      ADD_FAILURE() << "stuck after " << text;
      return "";
    }
    // Lean towards structure so walks end: closing bytes far likelier.
    std::vector<unsigned char> weighted = ok;
    for (unsigned char c : ok) {
      if (c == '"' || c == '}' || c == ']' || c == ',') {
        weighted.insert(weighted.end(), 8, c);
      }
    }
    const unsigned char c = weighted[(*g)() % weighted.size()];
    EXPECT_TRUE(m.Advance(c));
    text.push_back(static_cast<char>(c));
  }
  return m.complete() ? text : "";
}

const char* const kSchemas[] = {
    // Pydantic-style: $defs, $ref, Optional via anyOf, an enum, titles.
    R"({"$defs": {"Color": {"enum": ["red", "green", "blue"], "title": "Color",
        "type": "string"},
       "Point": {"properties": {"x": {"type": "integer"},
                                "y": {"type": "number"}},
                 "required": ["x", "y"], "title": "Point", "type": "object"}},
       "properties": {"name": {"title": "Name", "type": "string",
                               "maxLength": 5},
                      "color": {"$ref": "#/$defs/Color"},
                      "at": {"anyOf": [{"$ref": "#/$defs/Point"},
                                       {"type": "null"}], "default": null},
                      "tags": {"items": {"type": "string"}, "type": "array",
                               "maxItems": 3},
                      "ok": {"type": "boolean"}},
       "required": ["name", "color", "ok"], "title": "Thing",
       "type": "object"})",
    // Required after optional, integers, a const, an array of objects.
    R"({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"const": [1, "x"]},
        "c": {"type": "array", "minItems": 2, "items": {
            "type": "object", "properties": {"k": {"enum": [1, 12, -3]}},
            "required": ["k"]}},
        "d": {"type": ["string", "null"], "minLength": 2}},
       "required": ["c"]})",
    // A map of string lists, and a recursive tree.
    R"({"type": "object", "additionalProperties":
        {"type": "array", "items": {"type": "string"}}})",
    R"({"$defs": {"node": {"type": "object", "properties": {
          "v": {"type": "integer"},
          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                   "maxItems": 2}}, "required": ["v"]}},
       "$ref": "#/$defs/node"})",
    // No constraints at all: any object.
    R"({})",
    // A tagged union (the tag "kind" first and required in each branch),
    // as a tool call's {"name", "parameters"} per tool is.
    R"({"type": "object", "properties": {"pet": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"},
           "lives": {"enum": [1, 9]}}, "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]},
           "good": {"type": "boolean"}}, "required": ["kind"]}]}},
      "required": ["pet"]})",
};

// Every walk the matcher allows ends in an instance of the schema, and
// the matcher never leaves a walk without a next byte.
TEST(JsonSchemaTest, RandomWalksAreInstances) {
  std::mt19937 g(7);
  for (const char* text : kSchemas) {
    const Json schema = Json::parse(text);
    auto compiled = MustCompile(schema);
    ASSERT_NE(compiled, nullptr);
    int complete = 0;
    for (int walk = 0; walk < 200; ++walk) {
      bool stuck = false;
      const std::string out =
          RandomWalk(compiled.get(), &g, 4000, &stuck);
      ASSERT_FALSE(stuck) << text;
      if (out.empty()) continue;  // ran long
      ++complete;
      Json v;
      try {
        v = Json::parse(out);
      } catch (const Json::out_of_range&) {
        continue;  // valid JSON, but an exponent past double's range
      } catch (const Json::exception& e) {
        FAIL() << e.what() << "\n" << out;
      }
      EXPECT_TRUE(Valid(v, schema, schema)) << out << "\nfor " << text;
    }
    EXPECT_GT(complete, 150) << text;
  }
}

TEST(JsonSchemaTest, AcceptsAndRejectsByHand) {
  const Json schema = Json::parse(kSchemas[0]);
  auto s = MustCompile(schema);
  ASSERT_NE(s, nullptr);
  const JsonMatcher m(s.get());
  EXPECT_TRUE(AcceptsComplete(
      m, R"({"name": "ab", "color": "red", "at": {"x": 1, "y": 2.5e1},
  "tags": ["a", "b"], "ok": true})"));
  EXPECT_TRUE(AcceptsComplete(
      m, R"({"name":"","color":"blue","at":null,"ok":false})"));
  EXPECT_TRUE(
      AcceptsComplete(m, "{\"name\":\"caf\xC3\xA9!\",\"color\":\"red\",\"ok\":true}"));
  for (const char* bad : {
           R"({"color": "red", "name": "ab", "ok": true})",   // order
           R"({"name": "ab", "ok": true})",                    // required
           R"({"name": "abcdef", "color": "red", "ok": true})",  // maxLength
           R"({"name": "a", "color": "pink", "ok": true})",    // enum
           R"({"name": "a", "color": "red", "at": {"x": 1.5, "y": 1},
               "ok": true})",                                   // integer
           R"({"name": "a", "color": "red", "tags": ["a","b","c","d"],
               "ok": true})",                                   // maxItems
           R"({"name": "a", "color": "red", "ok": true, "extra": 1})",
           R"({"name": "a", "color": "red", "ok": tru})",
       }) {
    EXPECT_FALSE(AcceptsComplete(m, bad)) << bad;
  }
  // An enum of numbers where one is a prefix of another: "1" then ",".
  auto nums = MustCompile(Json::parse(kSchemas[1]));
  ASSERT_NE(nums, nullptr);
  const JsonMatcher n(nums.get());
  EXPECT_TRUE(AcceptsComplete(n, R"({"c": [{"k": 1}, {"k": 12}]})"));
  EXPECT_TRUE(AcceptsComplete(n, R"({"a": -7, "b": [1,"x"], "c": [{"k": -3}, {"k": 1 }], "d": null})"));
  EXPECT_FALSE(AcceptsComplete(n, R"({"c": [{"k": 1}]})"));       // minItems
  EXPECT_FALSE(AcceptsComplete(n, R"({"c": [{"k": 2}, {"k": 1}]})"));
  EXPECT_FALSE(AcceptsComplete(n, R"({"b": [1, "x"], "c": [{"k": 1}, {"k": 1}]})"));  // const is written compactly
  EXPECT_FALSE(AcceptsComplete(n, R"({"c": [{"k": 1}, {"k": 1}], "d": "x"})"));  // minLength
  EXPECT_FALSE(AcceptsComplete(n, R"({"a": 1.0, "c": [{"k": 1}, {"k": 1}]})"));
}

TEST(JsonSchemaTest, TaggedUnionsPickTheirBranchByTheTag) {
  auto s = MustCompile(Json::parse(kSchemas[5]));
  ASSERT_NE(s, nullptr);
  const JsonMatcher m(s.get());
  EXPECT_TRUE(AcceptsComplete(m, R"({"pet": {"kind": "cat", "lives": 9}})"));
  EXPECT_TRUE(AcceptsComplete(m, R"({"pet": {"kind": "wolf", "good": true}})"));
  EXPECT_TRUE(AcceptsComplete(m, R"({"pet": {"kind": "dog"}})"));
  EXPECT_FALSE(AcceptsComplete(m, R"({"pet": {"kind": "cat", "good": true}})"));
  EXPECT_FALSE(AcceptsComplete(m, R"({"pet": {"kind": "cat"}})"));  // lives
  EXPECT_FALSE(AcceptsComplete(m, R"({"pet": {"lives": 9, "kind": "cat"}})"));
  EXPECT_FALSE(AcceptsComplete(m, R"({"pet": {"kind": "fox"}})"));
  // Tags that are not told apart, or not first and required: refused.
  for (const char* bad : {
           R"({"anyOf": [{"type": "object", "properties": {"k": {"const": 1}},
               "required": ["k"]}, {"type": "object", "properties":
               {"k": {"enum": [1, 2]}}, "required": ["k"]}]})",
           R"({"anyOf": [{"type": "object", "properties": {"k": {"const": 1}}},
               {"type": "object", "properties": {"k": {"const": 2}}}]})",
           R"({"anyOf": [{"type": "object", "properties": {"k": {"const": 1}},
               "required": ["k"]}, {"type": "object", "properties":
               {"j": {"const": 2}}, "required": ["j"]}]})",
       }) {
    auto r = JsonSchema::Compile(bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("start alike"), std::string::npos)
        << r.status().message();
  }
}

// Keys of the mask cache: equal futures share an entry (strings of any
// length without limits, arrays of any count without limits), different
// schemas never do.
TEST(JsonSchemaTest, KeysIgnoreWhatTheFutureDoesNotDependOn) {
  auto s = MustCompile(Json::parse(kSchemas[0]));
  ASSERT_NE(s, nullptr);
  JsonMatcher a(s.get()), b(s.get());
  ASSERT_TRUE(a.Advance(R"({"name": "ab", "color": "red", "tags": ["x)"));
  ASSERT_TRUE(b.Advance(R"({"name": "a", "color": "green", "tags": ["xyz)"));
  EXPECT_EQ(a.Key(), b.Key());
  JsonMatcher c(s.get()), d(s.get());
  ASSERT_TRUE(c.Advance(R"({"name": "ab)"));  // maxLength 5: 2 of 5 used
  ASSERT_TRUE(d.Advance(R"({"name": "abc)"));
  EXPECT_NE(c.Key(), d.Key());
  JsonMatcher any;
  ASSERT_TRUE(any.Advance("{"));
  JsonMatcher schema_start(s.get());
  ASSERT_TRUE(schema_start.Advance("{"));
  EXPECT_NE(any.Key(), schema_start.Key());
}

TEST(JsonSchemaTest, RefusesWhatItCannotEnforce) {
  struct Case {
    const char* schema;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"type": "object", "properties": {"a": {"type": "string",
               "pattern": "^x"}}})", "'pattern' is not supported"},
           {R"({"type": "object", "properties": {"a": {"type": "string",
               "format": "date-time"}}})", "'format' is not supported"},
           {R"({"type": "object", "properties": {"a": {"type": "integer",
               "minimum": 0}}})", "'minimum' is not supported"},
           {R"({"type": "array"})", "the root must be an object"},
           {R"({"type": "object", "properties": {"a": {"anyOf": [
               {"type": "object"}, {"type": "object", "properties":
               {"b": {}}}]}}})", "start alike"},
           {R"({"type": "object", "properties": {"a": false}})",
            "allows nothing"},
           {R"({"type": "object", "properties": {"a": {}},
               "required": ["b"]})", "not in 'properties'"},
           {R"({"$ref": "#/$defs/missing"})", "does not resolve"},
           {R"({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})",
            "refers only to itself"},
           {R"({"type": "object", "properties": {"a": {"type": "str"}}})",
            "unknown type 'str'"},
           {R"({"type": "object", "properties": {"a": {"type": "string",
               "minLength": 5, "maxLength": 2}}})", "below"},
           {R"({"type": "object", "allOf": [{}, {}]})", "allOf"},
           {"{\"type\": ", "not JSON"},
       }) {
    auto s = JsonSchema::Compile(c.schema);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << c.schema;
    EXPECT_NE(s.status().message().find(c.message), std::string::npos)
        << s.status().message() << " / " << c.message;
  }
  std::string deep(70, '[');
  EXPECT_FALSE(JsonSchema::Compile(deep).ok());
  EXPECT_FALSE(JsonSchema::Compile(std::string(70000, ' ')).ok());
  // 65 properties: more than a candidate bitmask holds.
  Json many = {{"type", "object"}, {"properties", Json::object()}};
  for (int i = 0; i < 65; ++i) many["properties"][absl::StrCat("p", i)] = {};
  EXPECT_FALSE(JsonSchema::Compile(many.dump()).ok());
}

// vLLM's guided_choice: one of the strings as raw text, nothing around
// it; a choice that is a prefix of another may end or go on.
TEST(JsonSchemaTest, ChoicesAreWrittenAsTheyAre) {
  auto s = JsonSchema::Choice({"yes", "yes!", "no", "{\"x\"}"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE((*s)->raw_choice());
  const JsonMatcher m(s->get());
  for (const char* ok : {"yes!", "no", "{\"x\"}"}) {
    EXPECT_TRUE(AcceptsComplete(m, ok)) << ok;
  }
  JsonMatcher yes = m;
  ASSERT_TRUE(yes.Advance("yes"));
  EXPECT_FALSE(yes.complete());
  EXPECT_TRUE(yes.can_end());
  JsonMatcher y = m;
  ASSERT_TRUE(y.Advance("y"));
  EXPECT_FALSE(y.can_end());
  for (const char* bad : {" yes", "\"yes\"", "nope", "yes!!", "maybe"}) {
    EXPECT_FALSE(AcceptsComplete(m, bad) || JsonMatcher(m).Advance(bad))
        << bad;
  }
  EXPECT_FALSE(JsonSchema::Choice({}).ok());
  EXPECT_FALSE(JsonSchema::Choice({"a", ""}).ok());
  EXPECT_EQ(JsonSchema::Choice({"a", "b"})->get(),
            JsonSchema::Choice({"a", "b"})->get());
}

TEST(JsonSchemaTest, CompiledSchemasAreSharedByText) {
  const std::string text = kSchemas[1];
  auto a = JsonSchema::Compile(text);
  auto b = JsonSchema::Compile(text);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_NE((*a)->id(), JsonSchema::AnyObject().id());
}

}  // namespace
}  // namespace specserve
