#include "common/decoding/json_schema.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

// Insertion-ordered: properties are written in the schema's order.
using Json = nlohmann::ordered_json;

constexpr int kMaxDepth = 64;
constexpr int kMaxCount = 65535;  // items, string lengths (JsonMatcher's)

// Keywords that constrain values in ways the automaton does not implement:
// refused rather than silently ignored.
constexpr const char* kRefused[] = {
    "pattern",          "format",           "minimum",
    "maximum",          "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf",       "prefixItems",      "uniqueItems",
    "contains",         "minContains",      "maxContains",
    "minProperties",    "maxProperties",    "patternProperties",
    "propertyNames",    "dependentRequired", "dependentSchemas",
    "dependencies",     "if",               "then",
    "else",             "not",              "unevaluatedProperties",
    "unevaluatedItems", "$dynamicRef",      "$recursiveRef",
};

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(what);
}

// The deepest [ / { nesting of `text` outside strings (before parsing, so
// that no parser recursion runs that deep).
int NestingDepth(absl::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escape = false;
  for (const char c : text) {
    if (in_string) {
      if (escape) {
        escape = false;
      } else if (c == '\\') {
        escape = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') deepest = std::max(deepest, ++depth);
    if (c == ']' || c == '}') --depth;
  }
  return deepest;
}

std::atomic<uint64_t> next_id{1};

// Compiled schemas shared by what they were compiled from (the last 256).
template <typename Key>
class SharedSchemas {
 public:
  std::shared_ptr<const JsonSchema> Find(const Key& key) {
    absl::MutexLock lock(&mu_);
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : it->second;
  }
  void Add(Key key, std::shared_ptr<const JsonSchema> schema) {
    absl::MutexLock lock(&mu_);
    if (map_.size() >= 256) map_.clear();
    map_.emplace(std::move(key), std::move(schema));
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<Key, std::shared_ptr<const JsonSchema>> map_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace

int JsonSchema::ClassOf(unsigned char c) {
  switch (c) {
    case '{': return 0;
    case '[': return 1;
    case '"': return 2;
    case 't': return 4;
    case 'f': return 5;
    case 'n': return 6;
    default: return c == '-' || (c >= '0' && c <= '9') ? 3 : -1;
  }
}

class JsonSchema::Compiler {
 public:
  Compiler(const Json* root, JsonSchema* out) : root_(root), out_(out) {
    AddAnyNodes();
  }

  // Node 0 is any value: its classes lead to an object of any keys and
  // values (1), an array of any values (2), a string (3), a number (4),
  // true / false (5), null (6).
  void AddAnyNodes() {
    std::vector<Node>& n = out_->nodes_;
    n.resize(7);
    n[0].by_class = {1, 2, 3, 4, 5, 5, 6};
    n[1].kind = Kind::kMap;
    n[1].child = 0;
    n[2].kind = Kind::kArray;
    n[2].child = 0;
    n[3].kind = Kind::kString;
    n[4].kind = Kind::kNumber;
    n[5].kind = Kind::kLiterals;
    n[5].literals = {"true", "false"};
    n[6].kind = Kind::kLiterals;
    n[6].literals = {"null"};
  }

  // The dispatch node of schema `s`.
  absl::StatusOr<int> Value(const Json& s, int depth) {
    if (depth > kMaxDepth) return Bad("schemas nested deeper than 64");
    if (s.is_boolean()) {
      if (s.get<bool>()) return 0;
      return Bad("a 'false' schema allows nothing");
    }
    if (!s.is_object()) {
      return Bad(absl::StrCat("a schema must be an object or a boolean, got ",
                              s.dump()));
    }
    for (const char* kw : kRefused) {
      if (s.contains(kw)) {
        return Bad(absl::StrCat("'", kw, "' is not supported"));
      }
    }
    if (auto it = s.find("$ref"); it != s.end()) return Ref(*it, depth);
    if (auto it = s.find("const"); it != s.end()) {
      return Literals(Json::array({*it}));
    }
    if (auto it = s.find("enum"); it != s.end()) return Literals(*it);
    for (const char* kw : {"anyOf", "oneOf"}) {
      if (auto it = s.find(kw); it != s.end()) return Union(*it, kw, depth);
    }
    if (auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->size() != 1) {
        return Bad("'allOf' is supported with one schema only");
      }
      return Value((*it)[0], depth + 1);
    }
    std::vector<std::string> types;
    if (auto it = s.find("type"); it == s.end()) {
      if (s.contains("properties") || s.contains("additionalProperties")) {
        types = {"object"};
      } else if (s.contains("items")) {
        types = {"array"};
      } else {
        return 0;  // any value
      }
    } else if (it->is_string()) {
      types = {it->get<std::string>()};
    } else if (it->is_array() && !it->empty()) {
      for (const Json& t : *it) {
        if (!t.is_string()) return Bad("'type' must name types");
        types.push_back(t.get<std::string>());
      }
    } else {
      return Bad("'type' must be a type name or a list of them");
    }
    Node dispatch;
    bool number = false, integer = false;
    for (const std::string& t : types) {
      if (t == "object") {
        absl::StatusOr<int> n = Object(s, depth);
        if (!n.ok()) return n.status();
        dispatch.by_class[0] = static_cast<int16_t>(*n);
      } else if (t == "array") {
        absl::StatusOr<int> n = Array(s, depth);
        if (!n.ok()) return n.status();
        dispatch.by_class[1] = static_cast<int16_t>(*n);
      } else if (t == "string") {
        Node n;
        n.kind = Kind::kString;
        if (absl::Status st = Range(s, "minLength", "maxLength",
                                    &n.min_length, &n.max_length);
            !st.ok()) {
          return st;
        }
        absl::StatusOr<int> i = Add(std::move(n));
        if (!i.ok()) return i.status();
        dispatch.by_class[2] = static_cast<int16_t>(*i);
      } else if (t == "number") {
        number = true;
      } else if (t == "integer") {
        integer = true;
      } else if (t == "boolean") {
        dispatch.by_class[4] = dispatch.by_class[5] = 5;
      } else if (t == "null") {
        dispatch.by_class[6] = 6;
      } else {
        return Bad(absl::StrCat("unknown type '", t, "'"));
      }
    }
    if (number || integer) {
      Node n;
      n.kind = Kind::kNumber;
      n.integer = !number;  // "integer" alone
      absl::StatusOr<int> i = Add(std::move(n));
      if (!i.ok()) return i.status();
      dispatch.by_class[3] = static_cast<int16_t>(*i);
    }
    return Add(std::move(dispatch));
  }

 private:
  absl::StatusOr<int> Add(Node n) {
    if (static_cast<int>(out_->nodes_.size()) >= kMaxNodes) {
      return Bad(absl::StrCat("more than ", kMaxNodes, " schema nodes"));
    }
    out_->nodes_.push_back(std::move(n));
    return static_cast<int>(out_->nodes_.size()) - 1;
  }

  // `lo_key` / `hi_key` of `s` into *lo / *hi (unset: 0 / -1).
  static absl::Status Range(const Json& s, const char* lo_key,
                            const char* hi_key, int* lo, int* hi) {
    for (const char* key : {lo_key, hi_key}) {
      auto it = s.find(key);
      if (it == s.end()) continue;
      if (!it->is_number_integer() || it->get<int64_t>() < 0) {
        return Bad(absl::StrCat("'", key, "' must be an integer >= 0"));
      }
      const int64_t v = it->get<int64_t>();
      if (key == lo_key) {
        if (v > kMaxCount) {
          return Bad(absl::StrCat("'", key, "' above ", kMaxCount,
                                  " is not supported"));
        }
        *lo = static_cast<int>(v);
      } else {
        *hi = v > kMaxCount ? -1 : static_cast<int>(v);  // out of reach
      }
    }
    if (*hi >= 0 && *hi < *lo) {
      return Bad(absl::StrCat("'", hi_key, "' is below '", lo_key, "'"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int> Object(const Json& s, int depth) {
    Node n;
    auto props = s.find("properties");
    if (props != s.end() && !props->is_object()) {
      return Bad("'properties' must be an object");
    }
    if (props == s.end() || props->empty()) {
      auto extra = s.find("additionalProperties");
      if (extra != s.end() && extra->is_boolean() && !extra->get<bool>()) {
        n.kind = Kind::kObject;  // {} only
      } else {
        n.kind = Kind::kMap;
        n.child = 0;
        if (extra != s.end()) {
          absl::StatusOr<int> v = Value(*extra, depth + 1);
          if (!v.ok()) return v.status();
          n.child = *v;
        }
      }
    } else {
      if (props->size() > static_cast<size_t>(kMaxAlternatives)) {
        return Bad(absl::StrCat("more than ", kMaxAlternatives,
                                " properties in one object"));
      }
      n.kind = Kind::kObject;
      for (const auto& [key, sub] : props->items()) {
        absl::StatusOr<int> v = Value(sub, depth + 1);
        if (!v.ok()) {
          return Bad(absl::StrCat("properties.", key, ": ",
                                  v.status().message()));
        }
        n.keys.push_back(Json(key).dump());
        n.values.push_back(*v);
        n.required.push_back(0);
      }
    }
    if (auto req = s.find("required"); req != s.end()) {
      if (!req->is_array()) return Bad("'required' must be a list of names");
      for (const Json& name : *req) {
        if (!name.is_string()) return Bad("'required' must list names");
        const std::string key = Json(name.get<std::string>()).dump();
        bool found = false;
        for (size_t i = 0; i < n.keys.size(); ++i) {
          if (n.keys[i] == key) n.required[i] = found = true;
        }
        if (!found) {
          return Bad(absl::StrCat("'required' names '", name.get<std::string>(),
                                  "', which is not in 'properties'"));
        }
      }
    }
    return Add(std::move(n));
  }

  absl::StatusOr<int> Array(const Json& s, int depth) {
    Node n;
    n.kind = Kind::kArray;
    n.child = 0;
    if (auto items = s.find("items"); items != s.end()) {
      absl::StatusOr<int> v = Value(*items, depth + 1);
      if (!v.ok()) return Bad(absl::StrCat("items: ", v.status().message()));
      n.child = *v;
    }
    if (absl::Status st =
            Range(s, "minItems", "maxItems", &n.min_items, &n.max_items);
        !st.ok()) {
      return st;
    }
    return Add(std::move(n));
  }

  // enum / const: a literal node, reached by each value's first byte.
  absl::StatusOr<int> Literals(const Json& values) {
    if (!values.is_array() || values.empty()) {
      return Bad("'enum' must be a non-empty list");
    }
    if (values.size() > static_cast<size_t>(kMaxAlternatives)) {
      return Bad(absl::StrCat("more than ", kMaxAlternatives,
                              " values in one enum"));
    }
    Node lit;
    lit.kind = Kind::kLiterals;
    for (const Json& v : values) {
      std::string text = v.dump();
      if (text.size() > static_cast<size_t>(kMaxCount)) {
        return Bad("an enum value longer than 65535 bytes");
      }
      lit.literals.push_back(std::move(text));
    }
    return LiteralDispatch(std::move(lit));
  }

  // Adds literal node `lit` and the dispatch node every first byte of its
  // literals leads to it from; returns the dispatch node.
  absl::StatusOr<int> LiteralDispatch(Node lit) {
    Node dispatch;
    for (const std::string& text : lit.literals) {
      dispatch.by_class[ClassOf(static_cast<unsigned char>(text[0]))] =
          static_cast<int16_t>(out_->nodes_.size());
    }
    absl::StatusOr<int> l = Add(std::move(lit));
    if (!l.ok()) return l.status();
    return Add(std::move(dispatch));
  }

  absl::StatusOr<int> Union(const Json& branches, const char* kw, int depth) {
    if (!branches.is_array() || branches.empty()) {
      return Bad(absl::StrCat("'", kw, "' must be a non-empty list"));
    }
    // The typed nodes each first-byte class may lead to, over the branches.
    std::array<std::vector<int>, kNumClasses> typed;
    for (const Json& b : branches) {
      absl::StatusOr<int> d = Value(b, depth + 1);
      if (!d.ok()) return d.status();
      if (pending_.contains(*d)) {
        return Bad(absl::StrCat("a '$ref' back into its own '", kw,
                                "' is not supported"));
      }
      const Node& n = out_->nodes_[*d];
      for (int k = 0; k < kNumClasses; ++k) {
        const int t = n.by_class[k];
        std::vector<int>& list = typed[k];
        if (t >= 0 && std::find(list.begin(), list.end(), t) == list.end()) {
          list.push_back(t);
        }
      }
    }
    Node dispatch;
    for (int k = 0; k < kNumClasses; ++k) {
      if (typed[k].empty()) continue;
      if (typed[k].size() == 1) {
        dispatch.by_class[k] = static_cast<int16_t>(typed[k][0]);
        continue;
      }
      // Only objects can be told apart past their first byte.
      absl::StatusOr<int> tagged = Bad("alike");
      if (k == 0) tagged = TaggedUnion(typed[k]);
      if (!tagged.ok()) {
        return Bad(absl::StrCat(
            "'", kw,
            "' branches that start alike (two strings, two numbers, or "
            "objects not told apart by a first required property with "
            "distinct enum / const values) are not supported"));
      }
      dispatch.by_class[k] = static_cast<int16_t>(*tagged);
    }
    return Add(std::move(dispatch));
  }

  // Objects told apart by their first property: the same required key in
  // each, whose value is a literal set (enum / const) of its own.
  absl::StatusOr<int> TaggedUnion(const std::vector<int>& objects) {
    Node u;
    u.kind = Kind::kUnionObject;
    Node tags;
    tags.kind = Kind::kLiterals;
    for (const int o : objects) {
      const Node& n = out_->nodes_[o];
      if (n.kind != Kind::kObject || n.keys.empty() || !n.required[0] ||
          n.keys[0] != out_->nodes_[objects[0]].keys[0]) {
        return Bad("not a tagged union");
      }
      int lit = -1;
      for (const int16_t t : out_->nodes_[n.values[0]].by_class) {
        if (t >= 0 && (lit >= 0 && t != lit)) return Bad("mixed tag");
        if (t >= 0) lit = t;
      }
      if (lit < 0 || out_->nodes_[lit].kind != Kind::kLiterals) {
        return Bad("the tag is not an enum / const");
      }
      for (const std::string& v : out_->nodes_[lit].literals) {
        if (std::find(tags.literals.begin(), tags.literals.end(), v) !=
            tags.literals.end()) {
          return Bad("two branches share a tag value");
        }
        tags.literals.push_back(v);
        u.branch.push_back(o);
      }
    }
    if (tags.literals.size() > static_cast<size_t>(kMaxAlternatives)) {
      return Bad("too many tag values");
    }
    u.keys = {out_->nodes_[objects[0]].keys[0]};
    u.required = {1};
    absl::StatusOr<int> d = LiteralDispatch(std::move(tags));
    if (!d.ok()) return d.status();
    u.values = {*d};
    return Add(std::move(u));
  }

  absl::StatusOr<int> Ref(const Json& ref, int depth) {
    if (!ref.is_string()) return Bad("'$ref' must be a string");
    const std::string r = ref.get<std::string>();
    if (auto it = refs_.find(r); it != refs_.end()) return it->second;
    if (r.empty() || r[0] != '#') {
      return Bad(absl::StrCat("'$ref' ", r, ": only local references (#...)"));
    }
    const Json* target = nullptr;
    try {
      target = r == "#" ? root_ : &root_->at(Json::json_pointer(r.substr(1)));
    } catch (const Json::exception&) {
      target = nullptr;
    }
    if (target == nullptr) {
      return Bad(absl::StrCat("'$ref' ", r, " does not resolve"));
    }
    // A placeholder first, so a recursive reference finds it.
    absl::StatusOr<int> p = Add(Node{});
    if (!p.ok()) return p.status();
    refs_[r] = *p;
    pending_.insert(*p);
    absl::StatusOr<int> d = Value(*target, depth + 1);
    if (!d.ok()) return d.status();
    if (pending_.contains(*d)) {
      return Bad(absl::StrCat("'$ref' ", r, " refers only to itself"));
    }
    out_->nodes_[*p].by_class = out_->nodes_[*d].by_class;
    pending_.erase(*p);
    return *p;
  }

  const Json* root_;
  JsonSchema* out_;
  absl::flat_hash_map<std::string, int> refs_;
  absl::flat_hash_set<int> pending_;  // $ref placeholders being compiled
};

absl::StatusOr<std::shared_ptr<const JsonSchema>> JsonSchema::Compile(
    absl::string_view text) {
  static auto* shared = new SharedSchemas<std::string>();
  if (auto found = shared->Find(std::string(text))) return found;
  if (text.size() > kMaxSchemaBytes) {
    return Bad(absl::StrCat("the schema has ", text.size(),
                            " bytes; at most ", kMaxSchemaBytes));
  }
  if (NestingDepth(text) > kMaxDepth) {
    return Bad("the schema is nested deeper than 64");
  }
  const Json doc = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Bad("the schema is not JSON");
  std::shared_ptr<JsonSchema> schema(new JsonSchema());
  Compiler compiler(&doc, schema.get());
  absl::StatusOr<int> root = compiler.Value(doc, 0);
  if (!root.ok()) return root.status();
  // Only the object form of the root is written.
  const int object = schema->nodes_[*root].by_class[0];
  if (object < 0) return Bad("the root must be an object (type: object)");
  Node top;
  top.by_class[0] = static_cast<int16_t>(object);
  schema->nodes_.push_back(top);
  schema->root_ = static_cast<int>(schema->nodes_.size()) - 1;
  schema->id_ = next_id.fetch_add(1);
  shared->Add(std::string(text), schema);
  return schema;
}

absl::StatusOr<std::shared_ptr<const JsonSchema>> JsonSchema::Choice(
    const std::vector<std::string>& choices) {
  static auto* shared = new SharedSchemas<std::vector<std::string>>();
  if (auto found = shared->Find(choices)) return found;
  if (choices.empty()) return Bad("no choices");
  if (choices.size() > static_cast<size_t>(kMaxAlternatives)) {
    return Bad(absl::StrCat("more than ", kMaxAlternatives, " choices"));
  }
  Node lit;
  lit.kind = Kind::kLiterals;
  for (const std::string& c : choices) {
    if (c.empty()) return Bad("an empty choice");
    if (c.size() > static_cast<size_t>(kMaxCount)) {
      return Bad("a choice longer than 65535 bytes");
    }
    if (std::find(lit.literals.begin(), lit.literals.end(), c) ==
        lit.literals.end()) {
      lit.literals.push_back(c);
    }
  }
  std::shared_ptr<JsonSchema> schema(new JsonSchema());
  schema->nodes_.push_back(std::move(lit));
  schema->root_ = 0;
  schema->raw_choice_ = true;
  schema->id_ = next_id.fetch_add(1);
  shared->Add(choices, schema);
  return schema;
}

const JsonSchema& JsonSchema::AnyObject() {
  static const JsonSchema* any = [] {
    auto* s = new JsonSchema();
    Compiler(nullptr, s);  // the any-value nodes
    Node top;
    top.by_class[0] = 1;
    s->nodes_.push_back(top);
    s->root_ = static_cast<int>(s->nodes_.size()) - 1;
    s->id_ = 0;
    return s;
  }();
  return *any;
}

}  // namespace specserve
