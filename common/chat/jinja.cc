#include "common/chat/jinja.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace specserve {
namespace chat {
namespace jinja_internal {

using json = nlohmann::json;

// Errors travel as this exception inside this file only; Parse and Render
// turn it into a Status.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void Fail(const std::string& message) { throw Error(message); }

// ---------------------------------------------------------------- values

// A template value: JSON data, or Jinja's `undefined` (a missing variable,
// attribute or key). Data is shared and immutable: a variable, attribute or
// item refers into its parent (shared_ptr aliasing) instead of copying it,
// so templates that look at `messages` in every iteration stay linear.
struct Value {
  bool undefined = false;
  std::shared_ptr<const json> p;  // never null

  Value() : p(NullJson()) {}
  Value(json x)  // NOLINT: implicit on purpose
      : p(std::make_shared<const json>(std::move(x))) {}
  static Value Undefined() {
    Value v;
    v.undefined = true;
    return v;
  }
  // `child` lives inside `parent`'s data.
  static Value Alias(const Value& parent, const json& child) {
    Value v;
    v.p = std::shared_ptr<const json>(parent.p, &child);
    return v;
  }
  const json& j() const { return *p; }

 private:
  static const std::shared_ptr<const json>& NullJson() {
    static const auto* null = new std::shared_ptr<const json>(
        std::make_shared<const json>(nullptr));
    return *null;
  }
};

bool Truthy(const Value& v) {
  if (v.undefined) return false;
  const json& j = v.j();
  switch (j.type()) {
    case json::value_t::null:
      return false;
    case json::value_t::boolean:
      return j.get<bool>();
    case json::value_t::string:
      return !j.get_ref<const std::string&>().empty();
    case json::value_t::array:
    case json::value_t::object:
      return !j.empty();
    case json::value_t::number_float:
      return j.get<double>() != 0;
    default:
      return j.get<int64_t>() != 0;
  }
}

std::string FormatFloat(double d) {
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e16) {
    return absl::StrCat(static_cast<int64_t>(d), ".0");
  }
  return json(d).dump();
}

// Python's str() of a value, as `{{ }}` prints it.
std::string ToString(const Value& v) {
  if (v.undefined) return "";
  const json& j = v.j();
  switch (j.type()) {
    case json::value_t::null:
      return "None";
    case json::value_t::boolean:
      return j.get<bool>() ? "True" : "False";
    case json::value_t::string:
      return j.get<std::string>();
    case json::value_t::number_float:
      return FormatFloat(j.get<double>());
    default:
      return j.dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

const char* TypeName(const Value& v) {
  if (v.undefined) return "undefined";
  return v.j().type_name();
}

// --- strings: JavaScript's / Python's whitespace for strip().

// Length of the whitespace code point at s[i], else 0.
size_t SpaceAt(absl::string_view s, size_t i) {
  const unsigned char c = s[i];
  if (c == ' ' || (c >= '\t' && c <= '\r')) return 1;
  auto is = [&](const char* seq) {
    return absl::StartsWith(s.substr(i), seq) ? std::strlen(seq) : 0;
  };
  static const char* kSeqs[] = {
      "\xc2\xa0",     "\xe1\x9a\x80", "\xe2\x80\xa8", "\xe2\x80\xa9",
      "\xe2\x80\xaf", "\xe2\x81\x9f", "\xe3\x80\x80", "\xef\xbb\xbf"};
  for (const char* seq : kSeqs) {
    if (size_t n = is(seq)) return n;
  }
  // U+2000..U+200A: E2 80 80..8A.
  if (c == 0xe2 && i + 2 < s.size() &&
      static_cast<unsigned char>(s[i + 1]) == 0x80 &&
      static_cast<unsigned char>(s[i + 2]) >= 0x80 &&
      static_cast<unsigned char>(s[i + 2]) <= 0x8a) {
    return 3;
  }
  return 0;
}

// Length of the whitespace code point ending at s[end), else 0.
size_t SpaceBefore(absl::string_view s, size_t end) {
  for (size_t n = 1; n <= 3 && n <= end; ++n) {
    if (SpaceAt(s, end - n) == n) return n;
  }
  return 0;
}

std::string Strip(absl::string_view s, bool left, bool right,
                  const std::optional<std::string>& chars) {
  size_t b = 0, e = s.size();
  if (chars) {
    while (left && b < e && chars->find(s[b]) != std::string::npos) ++b;
    while (right && e > b && chars->find(s[e - 1]) != std::string::npos) --e;
  } else {
    while (left && b < e) {
      const size_t n = SpaceAt(s, b);
      if (n == 0) break;
      b += n;
    }
    while (right && e > b) {
      const size_t n = SpaceBefore(s, e);
      if (n == 0 || e - n < b) break;
      e -= n;
    }
  }
  return std::string(s.substr(b, e - b));
}

// ---------------------------------------------------------------- lexer

enum class Tok { kName, kString, kInt, kFloat, kOp, kEnd };

struct Token {
  Tok kind;
  std::string text;
  int line;
};

// Tokens of one tag's inside ({{ ... }} or {% ... %}).
std::vector<Token> LexTag(absl::string_view src, int line) {
  std::vector<Token> out;
  size_t i = 0;
  while (i < src.size()) {
    const char c = src[i];
    if (c == '\n') ++line;
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < src.size() &&
             (std::isalnum(static_cast<unsigned char>(src[j])) || src[j] == '_')) {
        ++j;
      }
      out.push_back({Tok::kName, std::string(src.substr(i, j - i)), line});
      i = j;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < src.size() && (std::isdigit(static_cast<unsigned char>(src[j])) ||
                                src[j] == '_')) {
        ++j;
      }
      if (j + 1 < src.size() && src[j] == '.' &&
          std::isdigit(static_cast<unsigned char>(src[j + 1]))) {
        is_float = true;
        ++j;
        while (j < src.size() && std::isdigit(static_cast<unsigned char>(src[j]))) {
          ++j;
        }
      }
      std::string num;
      for (char d : src.substr(i, j - i)) {
        if (d != '_') num += d;
      }
      out.push_back({is_float ? Tok::kFloat : Tok::kInt, num, line});
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string s;
      size_t j = i + 1;
      for (;; ++j) {
        if (j >= src.size()) Fail(absl::StrCat("line ", line, ": unterminated string"));
        if (src[j] == c) break;
        if (src[j] == '\\' && j + 1 < src.size()) {
          const char e = src[++j];
          switch (e) {
            case 'n': s += '\n'; break;
            case 't': s += '\t'; break;
            case 'r': s += '\r'; break;
            case 'b': s += '\b'; break;
            case 'f': s += '\f'; break;
            case '\\': s += '\\'; break;
            case '\'': s += '\''; break;
            case '"': s += '"'; break;
            default: s += '\\'; s += e; break;
          }
          continue;
        }
        if (src[j] == '\n') ++line;
        s += src[j];
      }
      out.push_back({Tok::kString, s, line});
      i = j + 1;
      continue;
    }
    static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-",
                                 "*",  "/",  "%",  "~",  "<",  ">",  "(", ")",
                                 "[",  "]",  "{",  "}",  ",",  ".",  ":", "|",
                                 "="};
    bool matched = false;
    for (const char* op : kOps) {
      if (absl::StartsWith(src.substr(i), op)) {
        out.push_back({Tok::kOp, op, line});
        i += std::strlen(op);
        matched = true;
        break;
      }
    }
    if (!matched) {
      Fail(absl::StrCat("line ", line, ": unexpected character '",
                        std::string(1, c), "'"));
    }
  }
  out.push_back({Tok::kEnd, "", line});
  return out;
}

// ---------------------------------------------------------------- AST

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  enum Kind {
    kLiteral, kName, kAttr, kIndex, kSlice, kCall, kFilter, kTest, kNot,
    kNeg, kBinary, kCond, kList, kDict
  } kind;
  json literal;          // kLiteral
  std::string name;      // kName, kAttr attribute, kFilter/kTest name, op
  std::vector<ExprPtr> args;  // operands / call args / list items
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // call kwargs
  bool negated = false;  // kTest: `is not`
  int line = 0;
  int depth = 1;  // of the expression tree below and including this node
};

// How deep expressions and {% if %} / {% for %} blocks may nest. Parsing,
// rendering and freeing a tree all recurse on it, so a template of 10^5
// nested parentheses or a chain of 10^5 `~` would otherwise exhaust the
// stack; real chat templates stay under 20.
constexpr int kMaxNesting = 128;

// Counts one level of parser recursion for its scope; fails past
// kMaxNesting.
class NestingGuard {
 public:
  NestingGuard(int* depth, int line) : depth_(depth) {
    if (++*depth_ > kMaxNesting) {
      --*depth_;
      Fail(absl::StrCat("line ", line, ": nested deeper than ", kMaxNesting,
                        " levels"));
    }
  }
  ~NestingGuard() { --*depth_; }
  NestingGuard(const NestingGuard&) = delete;
  NestingGuard& operator=(const NestingGuard&) = delete;

 private:
  int* depth_;
};

struct Node {
  enum Kind { kBlock, kText, kOutput, kIf, kFor, kSet } kind;
  std::string text;                  // kText
  ExprPtr expr;                      // kOutput, kFor iterable, kSet value
  std::vector<std::pair<ExprPtr, std::shared_ptr<const Node>>> branches;  // kIf
  std::shared_ptr<const Node> else_body;  // kIf, kFor
  std::shared_ptr<const Node> body;       // kFor
  std::vector<std::string> vars;          // kFor loop variables
  ExprPtr filter;                         // kFor `if`
  std::string target, attr;               // kSet: target[.attr]
  std::vector<std::shared_ptr<const Node>> children;  // kBlock
  int line = 0;
};

// ---------------------------------------------------------------- parser

class ExprParser {
 public:
  ExprParser(std::vector<Token> toks) : t_(std::move(toks)) {}

  ExprPtr Parse() { return Conditional(); }
  /// An expression without a top-level `x if c else y` (a for's iterable,
  /// which a loop filter `if` may follow).
  ExprPtr ParseNoConditional() { return Or(); }
  bool AtEnd() const { return t_[i_].kind == Tok::kEnd; }
  const Token& Peek() const { return t_[i_]; }
  bool IsName(const char* n) const {
    return t_[i_].kind == Tok::kName && t_[i_].text == n;
  }
  bool IsOp(const char* op) const {
    return t_[i_].kind == Tok::kOp && t_[i_].text == op;
  }
  Token Next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }
  void Expect(const char* op) {
    if (!IsOp(op)) {
      Fail(absl::StrCat("line ", Peek().line, ": expected '", op, "', got '",
                        Peek().text, "'"));
    }
    ++i_;
  }
  std::string ExpectName() {
    if (Peek().kind != Tok::kName) {
      Fail(absl::StrCat("line ", Peek().line, ": expected a name, got '",
                        Peek().text, "'"));
    }
    return Next().text;
  }

 private:
  // Also bounds trees built without recursion (`a ~ b ~ ...`, `x|f|g...`).
  ExprPtr Make(Expr e) {
    for (const ExprPtr& a : e.args) {
      if (a != nullptr) e.depth = std::max(e.depth, a->depth + 1);
    }
    for (const auto& [k, v] : e.kwargs) {
      e.depth = std::max(e.depth, v->depth + 1);
    }
    if (e.depth > kMaxNesting) {
      Fail(absl::StrCat("line ", e.line, ": expression nested deeper than ",
                        kMaxNesting, " levels"));
    }
    return std::make_shared<const Expr>(std::move(e));
  }
  Expr New(Expr::Kind k) {
    Expr e;
    e.kind = k;
    e.line = Peek().line;
    return e;
  }
  ExprPtr Binary(const std::string& op, ExprPtr a, ExprPtr b) {
    Expr e = New(Expr::kBinary);
    e.name = op;
    e.args = {std::move(a), std::move(b)};
    return Make(std::move(e));
  }

  ExprPtr Conditional() {
    NestingGuard guard(&depth_, Peek().line);
    ExprPtr a = Or();
    if (IsName("if")) {
      Next();
      ExprPtr cond = Or();
      ExprPtr b;
      if (IsName("else")) {
        Next();
        b = Conditional();
      } else {
        Expr u = New(Expr::kName);
        u.name = "\x01undefined";
        b = Make(std::move(u));
      }
      Expr e = New(Expr::kCond);
      e.args = {cond, a, b};
      return Make(std::move(e));
    }
    return a;
  }
  ExprPtr Or() {
    ExprPtr a = And();
    while (IsName("or")) {
      Next();
      a = Binary("or", a, And());
    }
    return a;
  }
  ExprPtr And() {
    ExprPtr a = Not();
    while (IsName("and")) {
      Next();
      a = Binary("and", a, Not());
    }
    return a;
  }
  ExprPtr Not() {
    if (IsName("not")) {
      NestingGuard guard(&depth_, Peek().line);
      Next();
      Expr e = New(Expr::kNot);
      e.args = {Not()};
      return Make(std::move(e));
    }
    return Compare();
  }
  ExprPtr Compare() {
    ExprPtr a = Concat();
    for (;;) {
      if (Peek().kind == Tok::kOp &&
          (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp("<=") || IsOp(">") ||
           IsOp(">="))) {
        const std::string op = Next().text;
        a = Binary(op, a, Concat());
      } else if (IsName("in")) {
        Next();
        a = Binary("in", a, Concat());
      } else if (IsName("not") && t_[i_ + 1].kind == Tok::kName &&
                 t_[i_ + 1].text == "in") {
        Next();
        Next();
        a = Binary("not in", a, Concat());
      } else if (IsName("is")) {
        Next();
        Expr e = New(Expr::kTest);
        if (IsName("not")) {
          Next();
          e.negated = true;
        }
        e.name = ExpectName();
        e.args = {a};
        // One argument, bare (`divisibleby 3`) or in parentheses.
        if (IsOp("(")) {
          Next();
          if (!IsOp(")")) e.args.push_back(Parse());
          Expect(")");
        } else if (Peek().kind == Tok::kInt || Peek().kind == Tok::kString ||
                   Peek().kind == Tok::kFloat) {
          e.args.push_back(Primary());
        }
        a = Make(std::move(e));
      } else {
        return a;
      }
    }
  }
  ExprPtr Concat() {
    ExprPtr a = Additive();
    while (IsOp("~")) {
      Next();
      a = Binary("~", a, Additive());
    }
    return a;
  }
  ExprPtr Additive() {
    ExprPtr a = Multiplicative();
    while (IsOp("+") || IsOp("-")) {
      const std::string op = Next().text;
      a = Binary(op, a, Multiplicative());
    }
    return a;
  }
  ExprPtr Multiplicative() {
    ExprPtr a = Unary();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string op = Next().text;
      a = Binary(op, a, Unary());
    }
    return a;
  }
  ExprPtr Unary() {
    if (IsOp("-")) {
      NestingGuard guard(&depth_, Peek().line);
      Next();
      Expr e = New(Expr::kNeg);
      e.args = {Unary()};
      return Make(std::move(e));
    }
    if (IsOp("+")) {
      NestingGuard guard(&depth_, Peek().line);
      Next();
      return Unary();
    }
    return Postfix(Primary());
  }
  void CallArgs(Expr* e) {
    Expect("(");
    while (!IsOp(")")) {
      if (Peek().kind == Tok::kName && t_[i_ + 1].kind == Tok::kOp &&
          t_[i_ + 1].text == "=") {
        std::string k = Next().text;
        Next();
        e->kwargs.emplace_back(std::move(k), Parse());
      } else {
        e->args.push_back(Parse());
      }
      if (!IsOp(")")) Expect(",");
    }
    Expect(")");
  }
  ExprPtr Postfix(ExprPtr a) {
    for (;;) {
      if (IsOp(".")) {
        Next();
        Expr e = New(Expr::kAttr);
        e.name = ExpectName();
        e.args = {a};
        a = Make(std::move(e));
      } else if (IsOp("[")) {
        Next();
        // a[i] or a[start:stop:step] (each part optional).
        ExprPtr parts[3];
        int n = 0;
        bool slice = false;
        for (;;) {
          if (!IsOp(":") && !IsOp("]")) parts[n] = Parse();
          if (IsOp(":")) {
            Next();
            slice = true;
            if (++n > 2) Fail(absl::StrCat("line ", Peek().line, ": bad slice"));
            continue;
          }
          break;
        }
        Expect("]");
        if (slice) {
          Expr e = New(Expr::kSlice);
          e.args = {a, parts[0], parts[1], parts[2]};
          a = Make(std::move(e));
        } else {
          if (!parts[0]) Fail(absl::StrCat("line ", Peek().line, ": empty []"));
          Expr e = New(Expr::kIndex);
          e.args = {a, parts[0]};
          a = Make(std::move(e));
        }
      } else if (IsOp("(")) {
        Expr e = New(Expr::kCall);
        e.args = {a};
        CallArgs(&e);
        a = Make(std::move(e));
      } else if (IsOp("|")) {
        Next();
        Expr e = New(Expr::kFilter);
        e.name = ExpectName();
        e.args = {a};
        if (IsOp("(")) CallArgs(&e);
        a = Make(std::move(e));
      } else {
        return a;
      }
    }
  }
  ExprPtr Primary() {
    const Token tok = Next();
    Expr e = New(Expr::kLiteral);
    e.line = tok.line;
    switch (tok.kind) {
      case Tok::kString: {
        std::string s = tok.text;
        while (Peek().kind == Tok::kString) s += Next().text;  // 'a' 'b'
        e.literal = s;
        return Make(std::move(e));
      }
      case Tok::kInt:
        e.literal = std::stoll(tok.text);
        return Make(std::move(e));
      case Tok::kFloat:
        e.literal = std::stod(tok.text);
        return Make(std::move(e));
      case Tok::kName:
        if (tok.text == "true" || tok.text == "True") {
          e.literal = true;
        } else if (tok.text == "false" || tok.text == "False") {
          e.literal = false;
        } else if (tok.text == "none" || tok.text == "None") {
          e.literal = nullptr;
        } else {
          e.kind = Expr::kName;
          e.name = tok.text;
        }
        return Make(std::move(e));
      case Tok::kOp:
        if (tok.text == "(") {
          ExprPtr inner = Parse();
          if (IsOp(",")) {  // a tuple: a list here
            Expr l = New(Expr::kList);
            l.args.push_back(inner);
            while (IsOp(",")) {
              Next();
              if (IsOp(")")) break;
              l.args.push_back(Parse());
            }
            Expect(")");
            return Make(std::move(l));
          }
          Expect(")");
          return inner;
        }
        if (tok.text == "[") {
          e.kind = Expr::kList;
          while (!IsOp("]")) {
            e.args.push_back(Parse());
            if (!IsOp("]")) Expect(",");
          }
          Expect("]");
          return Make(std::move(e));
        }
        if (tok.text == "{") {
          e.kind = Expr::kDict;
          while (!IsOp("}")) {
            ExprPtr k = Parse();
            Expect(":");
            e.args.push_back(k);
            e.args.push_back(Parse());
            if (!IsOp("}")) Expect(",");
          }
          Expect("}");
          return Make(std::move(e));
        }
        break;
      case Tok::kEnd:
        Fail(absl::StrCat("line ", tok.line, ": unexpected end of expression"));
    }
    Fail(absl::StrCat("line ", tok.line, ": unexpected '", tok.text, "'"));
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;  // recursion of the descent, NestingGuard's
};

// transformers' / transformers.js' source preprocessing: one trailing
// newline dropped, lstrip_blocks, trim_blocks.
std::string Preprocess(absl::string_view src) {
  if (absl::EndsWith(src, "\n")) src.remove_suffix(1);
  std::string a;  // lstrip_blocks: whitespace before {% / {# on a line
  size_t line_start = 0;
  for (size_t i = 0; i <= src.size(); ++i) {
    if (i == src.size() || src[i] == '\n') {
      absl::string_view line = src.substr(line_start, i - line_start);
      size_t k = 0;
      while (k < line.size() && (line[k] == ' ' || line[k] == '\t')) ++k;
      if (k + 1 < line.size() && line[k] == '{' &&
          (line[k + 1] == '%' || line[k + 1] == '#' || line[k + 1] == '-')) {
        line.remove_prefix(k);
      }
      a.append(line.data(), line.size());
      if (i < src.size()) a += '\n';
      line_start = i + 1;
    }
  }
  std::string b;  // trim_blocks: the newline right after %} / #} / -}
  for (size_t i = 0; i < a.size(); ++i) {
    b += a[i];
    if (a[i] == '}' && i > 0 &&
        (a[i - 1] == '%' || a[i - 1] == '#' || a[i - 1] == '-') &&
        i + 1 < a.size() && a[i + 1] == '\n') {
      ++i;
    }
  }
  return b;
}

// One piece of the source: text, {{ expr }} or {% stmt %}.
struct Piece {
  enum Kind { kText, kOutput, kStmt } kind;
  std::string text;  // text, or the tag's inside
  int line;
};

std::vector<Piece> Split(const std::string& src) {
  std::vector<Piece> out;
  size_t i = 0;
  int line = 1;
  bool strip_next = false;  // a -}} / -%} / -#} before this text
  auto count_lines = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k) line += src[k] == '\n';
  };
  while (i < src.size()) {
    size_t open = std::string::npos;
    for (size_t k = src.find('{', i); k != std::string::npos;
         k = src.find('{', k + 1)) {
      if (k + 1 < src.size() &&
          (src[k + 1] == '{' || src[k + 1] == '%' || src[k + 1] == '#')) {
        open = k;
        break;
      }
    }
    std::string text = src.substr(i, open == std::string::npos
                                         ? std::string::npos
                                         : open - i);
    const int text_line = line;
    count_lines(i, open == std::string::npos ? src.size() : open);
    if (strip_next) text = Strip(text, true, false, std::nullopt);
    strip_next = false;
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({Piece::kText, text, text_line});
      break;
    }
    const char kind = src[open + 1];
    size_t start = open + 2;
    if (start < src.size() && src[start] == '-') {
      text = Strip(text, false, true, std::nullopt);
      ++start;
    } else if (start < src.size() && src[start] == '+') {
      ++start;
    }
    if (!text.empty()) out.push_back({Piece::kText, text, text_line});
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    // The closing delimiter outside string literals.
    size_t k = start;
    char quote = 0;
    for (; k + 1 < src.size(); ++k) {
      if (quote) {
        if (src[k] == '\\') {
          ++k;
        } else if (src[k] == quote) {
          quote = 0;
        }
        continue;
      }
      if (kind != '#' && (src[k] == '\'' || src[k] == '"')) {
        quote = src[k];
        continue;
      }
      if (src.compare(k, 2, close) == 0) break;
    }
    if (k + 1 >= src.size()) {
      Fail(absl::StrCat("line ", line, ": unclosed '{", std::string(1, kind),
                        "'"));
    }
    size_t end = k;
    if (end > start && src[end - 1] == '-') {
      strip_next = true;
      --end;
    }
    const std::string inside = src.substr(start, end - start);
    if (kind != '#') {
      out.push_back(
          {kind == '{' ? Piece::kOutput : Piece::kStmt, inside, line});
    }
    count_lines(open, k + 2);
    i = k + 2;
  }
  return out;
}

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Piece> pieces)
      : pieces_(std::move(pieces)) {}

  std::shared_ptr<const Node> Parse() {
    std::string end;
    auto root = Block({}, &end);
    if (!end.empty()) Fail(absl::StrCat("unexpected {% ", end, " %}"));
    return root;
  }

 private:
  static std::shared_ptr<const Node> Make(Node n) {
    return std::make_shared<const Node>(std::move(n));
  }

  // Nodes up to one of the statements `stops` (its first word returned in
  // *stop and the statement's parser left in stmt_) or the end.
  std::shared_ptr<const Node> Block(const std::vector<std::string>& stops,
                                    std::string* stop) {
    Node block;
    block.kind = Node::kBlock;
    stop->clear();
    while (pos_ < pieces_.size()) {
      const Piece& p = pieces_[pos_++];
      if (p.kind == Piece::kText) {
        Node n;
        n.kind = Node::kText;
        n.text = p.text;
        block.children.push_back(Make(std::move(n)));
        continue;
      }
      auto ep = std::make_unique<ExprParser>(LexTag(p.text, p.line));
      if (p.kind == Piece::kOutput) {
        Node n;
        n.kind = Node::kOutput;
        n.line = p.line;
        n.expr = ep->Parse();
        EndOf(*ep);
        block.children.push_back(Make(std::move(n)));
        continue;
      }
      const std::string word = ep->ExpectName();
      for (const std::string& s : stops) {
        if (word == s) {
          *stop = word;
          stmt_ = std::move(ep);
          return Make(std::move(block));
        }
      }
      block.children.push_back(Statement(word, *ep, p.line));
    }
    if (!stops.empty()) {
      Fail(absl::StrCat("missing {% ", stops.back(), " %}"));
    }
    return Make(std::move(block));
  }

  static void EndOf(ExprParser& ep) {
    if (!ep.AtEnd()) {
      Fail(absl::StrCat("line ", ep.Peek().line, ": unexpected '",
                        ep.Peek().text, "'"));
    }
  }

  std::shared_ptr<const Node> Statement(const std::string& word,
                                        ExprParser& ep, int line) {
    NestingGuard guard(&block_depth_, line);
    Node n;
    n.line = line;
    std::string stop;
    if (word == "if") {
      n.kind = Node::kIf;
      ExprPtr cond = ep.Parse();
      EndOf(ep);
      for (;;) {
        auto body = Block({"elif", "else", "endif"}, &stop);
        n.branches.emplace_back(cond, body);
        if (stop == "elif") {
          cond = stmt_->Parse();
          EndOf(*stmt_);
          continue;
        }
        EndOf(*stmt_);
        if (stop == "else") {
          n.else_body = Block({"endif"}, &stop);
          EndOf(*stmt_);
        }
        break;
      }
      return Make(std::move(n));
    }
    if (word == "for") {
      n.kind = Node::kFor;
      n.vars.push_back(ep.ExpectName());
      while (ep.IsOp(",")) {
        ep.Next();
        n.vars.push_back(ep.ExpectName());
      }
      if (!ep.IsName("in")) {
        Fail(absl::StrCat("line ", line, ": expected 'in' in for"));
      }
      ep.Next();
      // The iterable stops before a loop filter (`for x in xs if c`).
      n.expr = ep.ParseNoConditional();
      if (ep.IsName("if")) {
        ep.Next();
        n.filter = ep.Parse();
      }
      if (ep.IsName("recursive")) Fail("recursive loops are not supported");
      EndOf(ep);
      n.body = Block({"else", "endfor"}, &stop);
      EndOf(*stmt_);
      if (stop == "else") {
        n.else_body = Block({"endfor"}, &stop);
        EndOf(*stmt_);
      }
      return Make(std::move(n));
    }
    if (word == "set") {
      n.kind = Node::kSet;
      n.target = ep.ExpectName();
      if (ep.IsOp(".")) {
        ep.Next();
        n.attr = ep.ExpectName();
      }
      if (!ep.IsOp("=")) {
        Fail(absl::StrCat("line ", line,
                          ": {% set %} blocks and tuple targets are not "
                          "supported"));
      }
      ep.Next();
      n.expr = ep.Parse();
      EndOf(ep);
      return Make(std::move(n));
    }
    Fail(absl::StrCat("line ", line, ": unsupported statement '", word, "'"));
  }

  std::vector<Piece> pieces_;
  size_t pos_ = 0;
  std::unique_ptr<ExprParser> stmt_;
  int block_depth_ = 0;  // statements being parsed, NestingGuard's
};


// ---------------------------------------------------------------- runtime

constexpr size_t kMaxOutput = 10'000'000;
constexpr size_t kMaxIterations = 1'000'000;

// UTF-8 code points of `s` (a stray byte counts as one).
std::vector<std::string> CodePoints(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3
                                               : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

// Python's slice indices for a sequence of length n.
std::vector<int64_t> SliceIndices(int64_t n, const Value& start,
                                  const Value& stop, const Value& step) {
  auto get = [](const Value& v, int64_t dflt) {
    if (v.undefined || v.j().is_null()) return dflt;
    if (!v.j().is_number_integer()) Fail("slice indices must be integers");
    return v.j().get<int64_t>();
  };
  const int64_t k = get(step, 1);
  if (k == 0) Fail("slice step cannot be zero");
  auto clamp = [n, k](int64_t i, bool is_start) {
    if (i < 0) i += n;
    if (k > 0) return std::min(std::max<int64_t>(i, 0), n);
    (void)is_start;
    return std::min(std::max<int64_t>(i, -1), n - 1);
  };
  const int64_t b = (start.undefined || start.j().is_null())
                        ? (k > 0 ? 0 : n - 1)
                        : clamp(get(start, 0), true);
  const int64_t e = (stop.undefined || stop.j().is_null())
                        ? (k > 0 ? n : -1)
                        : clamp(get(stop, 0), false);
  std::vector<int64_t> out;
  for (int64_t i = b; k > 0 ? i < e : i > e; i += k) out.push_back(i);
  return out;
}

double Num(const Value& v, const char* what) {
  if (v.undefined || !v.j().is_number()) {
    Fail(absl::StrCat(what, ": expected a number, got ", TypeName(v)));
  }
  return v.j().get<double>();
}

bool IsInt(const Value& v) { return !v.undefined && v.j().is_number_integer(); }

// A string a template builds (concatenation, repetition, replace, join) is
// held to the output's cap: a loop that doubles a string would otherwise
// take all memory long before the output check.
void CheckStringSize(size_t bytes, const std::string& where) {
  if (bytes > kMaxOutput) {
    Fail(absl::StrCat(where, ": a string past 10^7 bytes"));
  }
}

// absl::StrJoin under CheckStringSize.
std::string JoinChecked(const std::vector<std::string>& parts,
                        const std::string& sep, const std::string& where) {
  size_t bytes = parts.empty() ? 0 : sep.size() * (parts.size() - 1);
  for (const std::string& p : parts) bytes += p.size();
  CheckStringSize(bytes, where);
  return absl::StrJoin(parts, sep);
}

const std::string& Str(const Value& v, const char* what) {
  if (v.undefined || !v.j().is_string()) {
    Fail(absl::StrCat(what, ": expected a string, got ", TypeName(v)));
  }
  return v.j().get_ref<const std::string&>();
}

// transformers' tojson: json.dumps(x, ensure_ascii=False) separators
// ", " / ": " (",\n" with indent). Object keys come out sorted (the
// context is a nlohmann::json).
void ToJson(const json& j, int indent, int depth, std::string* out) {
  const std::string nl =
      indent > 0 ? "\n" + std::string(indent * (depth + 1), ' ') : "";
  const std::string nl_end =
      indent > 0 ? "\n" + std::string(indent * depth, ' ') : "";
  const std::string sep = indent > 0 ? "," : ", ";
  if (j.is_array()) {
    if (j.empty()) {
      *out += "[]";
      return;
    }
    *out += "[" + nl;
    for (size_t i = 0; i < j.size(); ++i) {
      if (i > 0) *out += sep + nl;
      ToJson(j[i], indent, depth + 1, out);
    }
    *out += nl_end + "]";
  } else if (j.is_object()) {
    if (j.empty()) {
      *out += "{}";
      return;
    }
    *out += "{" + nl;
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!first) *out += sep + nl;
      first = false;
      *out += json(it.key()).dump(-1, ' ', false,
                                  json::error_handler_t::replace);
      *out += ": ";
      ToJson(it.value(), indent, depth + 1, out);
    }
    *out += nl_end + "}";
  } else if (j.is_number_float()) {
    *out += FormatFloat(j.get<double>());
  } else {
    *out += j.dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

class Interpreter {
 public:
  explicit Interpreter(const json& context) {
    scopes_.emplace_back();
    if (context.is_object()) {
      const Value root(context);  // the one copy of the context
      for (auto it = root.j().begin(); it != root.j().end(); ++it) {
        scopes_.back()[it.key()] = Value::Alias(root, it.value());
      }
    }
  }

  void Run(const Node& n, std::string* out) {
    switch (n.kind) {
      case Node::kBlock:
        for (const auto& c : n.children) Run(*c, out);
        break;
      case Node::kText:
        Append(n.text, out);
        break;
      case Node::kOutput:
        Append(ToString(Eval(*n.expr)), out);
        break;
      case Node::kIf:
        for (const auto& [cond, body] : n.branches) {
          if (Truthy(Eval(*cond))) {
            Run(*body, out);
            return;
          }
        }
        if (n.else_body) Run(*n.else_body, out);
        break;
      case Node::kFor:
        For(n, out);
        break;
      case Node::kSet: {
        Value v = Eval(*n.expr);
        if (n.attr.empty()) {
          scopes_.back()[n.target] = std::move(v);
          break;
        }
        Value* ns = Find(n.target);
        if (ns == nullptr || ns->undefined || !ns->j().is_object()) {
          Fail(absl::StrCat("line ", n.line, ": cannot set attribute of '",
                            n.target, "' (not a namespace)"));
        }
        json updated = ns->j();  // copy on write: data is shared
        updated[n.attr] = v.j();
        *ns = Value(std::move(updated));
        break;
      }
    }
  }

 private:
  void Append(const std::string& s, std::string* out) {
    if (out->size() + s.size() > kMaxOutput) {
      Fail("template output exceeds 10^7 bytes");
    }
    *out += s;
  }

  Value* Find(const std::string& name) {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return &f->second;
    }
    return nullptr;
  }

  // The items a for loop or filter iterates.
  static std::vector<Value> Items(const Value& v, const char* what) {
    std::vector<Value> out;
    if (v.undefined || v.j().is_null()) return out;
    if (v.j().is_array()) {
      for (const json& x : v.j()) out.push_back(Value::Alias(v, x));
      return out;
    }
    if (v.j().is_object()) {
      for (auto it = v.j().begin(); it != v.j().end(); ++it) {
        out.push_back(Value(it.key()));
      }
      return out;
    }
    if (v.j().is_string()) {
      for (auto& c : CodePoints(v.j().get<std::string>())) {
        out.push_back(Value(std::move(c)));
      }
      return out;
    }
    Fail(absl::StrCat(what, ": ", TypeName(v), " is not iterable"));
  }

  void Bind(const std::vector<std::string>& vars, const Value& item) {
    if (vars.size() == 1) {
      scopes_.back()[vars[0]] = item;
      return;
    }
    if (!item.j().is_array() || item.j().size() != vars.size()) {
      Fail(absl::StrCat("cannot unpack ", TypeName(item), " into ",
                        vars.size(), " loop variables"));
    }
    for (size_t i = 0; i < vars.size(); ++i) {
      scopes_.back()[vars[i]] = Value::Alias(item, item.j()[i]);
    }
  }

  void For(const Node& n, std::string* out) {
    std::vector<Value> items = Items(Eval(*n.expr), "for");
    scopes_.emplace_back();
    if (n.filter) {
      std::vector<Value> kept;
      for (const Value& item : items) {
        Bind(n.vars, item);
        if (Truthy(Eval(*n.filter))) kept.push_back(item);
      }
      items = std::move(kept);
      scopes_.back().clear();
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      if (++iterations_ > kMaxIterations) {
        Fail("template loops exceed 10^6 iterations");
      }
      Bind(n.vars, items[i]);
      json loop = {{"index", i + 1},        {"index0", i},
                   {"revindex", len - i},   {"revindex0", len - i - 1},
                   {"first", i == 0},       {"last", i == len - 1},
                   {"length", len}};
      if (i > 0) loop["previtem"] = items[i - 1].j();
      if (i + 1 < len) loop["nextitem"] = items[i + 1].j();
      scopes_.back()["loop"] = Value(std::move(loop));
      Run(*n.body, out);
    }
    scopes_.pop_back();
    if (len == 0 && n.else_body) Run(*n.else_body, out);
  }

  Value Eval(const Expr& e) {
    switch (e.kind) {
      case Expr::kLiteral:
        return Value(e.literal);
      case Expr::kName: {
        if (e.name == "\x01undefined") return Value::Undefined();
        Value* v = Find(e.name);
        return v != nullptr ? *v : Value::Undefined();
      }
      case Expr::kAttr: {
        Value obj = Eval(*e.args[0]);
        if (!obj.undefined && obj.j().is_object()) {
          auto it = obj.j().find(e.name);
          if (it != obj.j().end()) return Value::Alias(obj, *it);
        }
        return Value::Undefined();
      }
      case Expr::kIndex:
        return Index(Eval(*e.args[0]), Eval(*e.args[1]));
      case Expr::kSlice: {
        Value obj = Eval(*e.args[0]);
        Value parts[3];
        for (int i = 0; i < 3; ++i) {
          parts[i] = e.args[i + 1] ? Eval(*e.args[i + 1]) : Value::Undefined();
        }
        if (!obj.undefined && obj.j().is_array()) {
          json out = json::array();
          for (int64_t i : SliceIndices(obj.j().size(), parts[0], parts[1],
                                        parts[2])) {
            out.push_back(obj.j()[i]);
          }
          return Value(std::move(out));
        }
        if (!obj.undefined && obj.j().is_string()) {
          const auto cps = CodePoints(obj.j().get<std::string>());
          std::string out;
          for (int64_t i : SliceIndices(cps.size(), parts[0], parts[1],
                                        parts[2])) {
            out += cps[i];
          }
          return Value(out);
        }
        Fail(absl::StrCat("line ", e.line, ": cannot slice ", TypeName(obj)));
      }
      case Expr::kCall:
        return Call(e);
      case Expr::kFilter:
        return Filter(e);
      case Expr::kTest: {
        const bool r = Test(e);
        return Value(e.negated ? !r : r);
      }
      case Expr::kNot:
        return Value(!Truthy(Eval(*e.args[0])));
      case Expr::kNeg: {
        Value v = Eval(*e.args[0]);
        if (IsInt(v) &&
            v.j().get<int64_t>() != std::numeric_limits<int64_t>::min()) {
          return Value(-v.j().get<int64_t>());
        }
        return Value(-Num(v, "unary -"));
      }
      case Expr::kBinary:
        return Binary(e);
      case Expr::kCond:
        return Truthy(Eval(*e.args[0])) ? Eval(*e.args[1]) : Eval(*e.args[2]);
      case Expr::kList: {
        json out = json::array();
        for (const auto& a : e.args) out.push_back(Eval(*a).j());
        return Value(std::move(out));
      }
      case Expr::kDict: {
        json out = json::object();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          out[Str(Eval(*e.args[i]), "dict key")] = Eval(*e.args[i + 1]).j();
        }
        return Value(std::move(out));
      }
    }
    Fail("bad expression");
  }

  static Value Index(const Value& obj, const Value& idx) {
    if (obj.undefined) return Value::Undefined();
    if (obj.j().is_object()) {
      if (idx.undefined || !idx.j().is_string()) return Value::Undefined();
      auto it = obj.j().find(idx.j().get<std::string>());
      return it != obj.j().end() ? Value::Alias(obj, *it) : Value::Undefined();
    }
    if (obj.j().is_array() || obj.j().is_string()) {
      if (!IsInt(idx)) {
        Fail(absl::StrCat("indices must be integers, got ", TypeName(idx)));
      }
      int64_t i = idx.j().get<int64_t>();
      if (obj.j().is_array()) {
        const int64_t n = obj.j().size();
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::Undefined();
        return Value::Alias(obj, obj.j()[i]);
      }
      const auto cps = CodePoints(obj.j().get<std::string>());
      const int64_t n = cps.size();
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::Undefined();
      return Value(cps[i]);
    }
    return Value::Undefined();
  }

  Value Binary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = Eval(*e.args[0]);
      return Truthy(a) ? Eval(*e.args[1]) : a;
    }
    if (op == "or") {
      Value a = Eval(*e.args[0]);
      return Truthy(a) ? a : Eval(*e.args[1]);
    }
    const Value a = Eval(*e.args[0]);
    const Value b = Eval(*e.args[1]);
    const std::string where = absl::StrCat("line ", e.line, ": '", op, "'");
    if (op == "~") {
      const std::string s = ToString(a), t = ToString(b);
      CheckStringSize(s.size() + t.size(), where);
      return Value(s + t);
    }
    if (op == "==" || op == "!=") {
      bool eq = a.undefined || b.undefined ? a.undefined == b.undefined
                                           : a.j() == b.j();
      return Value(op == "==" ? eq : !eq);
    }
    if (op == "in" || op == "not in") {
      bool in = false;
      if (!b.undefined && b.j().is_string()) {
        in = absl::StrContains(b.j().get<std::string>(), Str(a, where.c_str()));
      } else if (!b.undefined && b.j().is_array()) {
        for (const json& x : b.j()) in = in || (!a.undefined && x == a.j());
      } else if (!b.undefined && b.j().is_object()) {
        in = !a.undefined && a.j().is_string() && b.j().contains(a.j().get<std::string>());
      } else {
        Fail(absl::StrCat(where, ": ", TypeName(b), " is not a container"));
      }
      return Value(op == "in" ? in : !in);
    }
    const bool strings = !a.undefined && !b.undefined && a.j().is_string() &&
                         b.j().is_string();
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      int c;
      if (strings) {
        c = a.j().get<std::string>().compare(b.j().get<std::string>());
      } else {
        const double x = Num(a, where.c_str()), y = Num(b, where.c_str());
        c = x < y ? -1 : x > y ? 1 : 0;
      }
      return Value(op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0
                                                                     : c >= 0);
    }
    if (op == "+") {
      if (strings) {
        const std::string& s = a.j().get_ref<const std::string&>();
        const std::string& t = b.j().get_ref<const std::string&>();
        CheckStringSize(s.size() + t.size(), where);
        return Value(s + t);
      }
      if (!a.undefined && !b.undefined && a.j().is_array() && b.j().is_array()) {
        if (a.j().size() + b.j().size() > kMaxIterations) {
          Fail(absl::StrCat(where, ": a list past 10^6 items"));
        }
        json out = a.j();
        for (const json& x : b.j()) out.push_back(x);
        return Value(std::move(out));
      }
    }
    if (op == "*" && !a.undefined && a.j().is_string() && IsInt(b)) {
      const std::string& s = a.j().get_ref<const std::string&>();
      const int64_t n = b.j().get<int64_t>();
      if (s.empty() || n <= 0) return Value(std::string());
      // n first: s.size() * n may overflow.
      CheckStringSize(n > static_cast<int64_t>(kMaxOutput) ? kMaxOutput + 1
                                                         : s.size() * n,
                      where);
      std::string out;
      out.reserve(s.size() * n);
      for (int64_t i = 0; i < n; ++i) out += s;
      return Value(std::move(out));
    }
    const bool ints = IsInt(a) && IsInt(b);
    const double x = Num(a, where.c_str()), y = Num(b, where.c_str());
    // 64-bit integers; a result past them is a float, as in
    // @huggingface/jinja, whose numbers are all doubles (Python's would be
    // exact).
    if (ints && (op == "+" || op == "-" || op == "*")) {
      const int64_t p = a.j().get<int64_t>(), q = b.j().get<int64_t>();
      int64_t r = 0;
      const bool overflow = op == "+"   ? __builtin_add_overflow(p, q, &r)
                            : op == "-" ? __builtin_sub_overflow(p, q, &r)
                                        : __builtin_mul_overflow(p, q, &r);
      if (!overflow) return Value(r);
    }
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (y == 0) Fail(absl::StrCat(where, ": division by zero"));
    if (op == "/") return Value(x / y);
    const bool min_by_minus_one =
        ints && a.j().get<int64_t>() == std::numeric_limits<int64_t>::min() &&
        b.j().get<int64_t>() == -1;
    if (op == "//") {
      if (min_by_minus_one) return Value(-x);
      if (ints) {
        const int64_t p = a.j().get<int64_t>(), q = b.j().get<int64_t>();
        int64_t r = p / q;
        if ((p % q != 0) && ((p < 0) != (q < 0))) --r;
        return Value(r);
      }
      return Value(std::floor(x / y));
    }
    if (op == "%") {
      if (min_by_minus_one) return Value(int64_t{0});
      if (ints) {
        const int64_t p = a.j().get<int64_t>(), q = b.j().get<int64_t>();
        int64_t r = p % q;
        if (r != 0 && ((r < 0) != (q < 0))) r += q;
        return Value(r);
      }
      return Value(x - y * std::floor(x / y));
    }
    Fail(absl::StrCat(where, ": unsupported operator"));
  }

  std::vector<Value> Args(const Expr& e, size_t from) {
    std::vector<Value> out;
    for (size_t i = from; i < e.args.size(); ++i) out.push_back(Eval(*e.args[i]));
    return out;
  }
  // Positional argument i, else keyword `name`, else undefined.
  Value Arg(const Expr& e, const std::vector<Value>& args, size_t i,
            const char* name) {
    if (i < args.size()) return args[i];
    for (const auto& [k, v] : e.kwargs) {
      if (k == name) return Eval(*v);
    }
    return Value::Undefined();
  }

  Value Call(const Expr& e) {
    const Expr& callee = *e.args[0];
    const std::vector<Value> args = Args(e, 1);
    if (callee.kind == Expr::kAttr) {
      return Method(e, Eval(*callee.args[0]), callee.name, args);
    }
    if (callee.kind == Expr::kName && Find(callee.name) == nullptr) {
      const std::string& f = callee.name;
      if (f == "namespace") {
        json ns = json::object();
        for (const Value& a : args) {
          if (!a.undefined && a.j().is_object()) ns.update(a.j());
        }
        for (const auto& [k, v] : e.kwargs) ns[k] = Eval(*v).j();
        return Value(std::move(ns));
      }
      if (f == "range") {
        int64_t start = 0, stop, step = 1;
        for (const Value& a : args) {
          if (!IsInt(a)) Fail("range() takes integers");
        }
        if (args.size() == 1) {
          stop = args[0].j().get<int64_t>();
        } else if (args.size() >= 2) {
          start = args[0].j().get<int64_t>();
          stop = args[1].j().get<int64_t>();
          if (args.size() > 2) step = args[2].j().get<int64_t>();
        } else {
          Fail("range() needs an argument");
        }
        if (step == 0) Fail("range() step cannot be zero");
        json out = json::array();
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          if (out.size() >= kMaxIterations) Fail("range() too long");
          out.push_back(i);
        }
        return Value(std::move(out));
      }
      if (f == "raise_exception") {
        Fail(args.empty() ? "raise_exception()" : ToString(args[0]));
      }
    }
    Fail(absl::StrCat("line ", e.line, ": unknown function"));
  }

  Value Method(const Expr& e, const Value& obj, const std::string& m,
               const std::vector<Value>& args) {
    const std::string where = absl::StrCat("line ", e.line, ": ", m, "()");
    if (!obj.undefined && obj.j().is_string()) {
      const std::string& s = obj.j().get_ref<const std::string&>();
      if (m == "startswith" || m == "endswith") {
        const Value p = Arg(e, args, 0, "prefix");
        std::vector<std::string> ps;
        if (!p.undefined && p.j().is_array()) {
          for (const json& x : p.j()) ps.push_back(Str(Value(x), where.c_str()));
        } else {
          ps.push_back(Str(p, where.c_str()));
        }
        for (const std::string& x : ps) {
          if (m == "startswith" ? absl::StartsWith(s, x) : absl::EndsWith(s, x)) {
            return Value(true);
          }
        }
        return Value(false);
      }
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        const Value c = Arg(e, args, 0, "chars");
        std::optional<std::string> chars;
        if (!c.undefined && !c.j().is_null()) chars = Str(c, where.c_str());
        return Value(Strip(s, m != "rstrip", m != "lstrip", chars));
      }
      if (m == "split") {
        const Value sep = Arg(e, args, 0, "sep");
        const Value max = Arg(e, args, 1, "maxsplit");
        int64_t limit = IsInt(max) ? max.j().get<int64_t>() : -1;
        json out = json::array();
        if (sep.undefined || sep.j().is_null()) {  // runs of whitespace
          size_t i = 0;
          for (;;) {
            while (i < s.size() && SpaceAt(s, i)) i += SpaceAt(s, i);
            if (i >= s.size()) break;
            if (limit == 0) {
              out.push_back(Strip(s.substr(i), false, true, std::nullopt));
              break;
            }
            size_t j = i;
            while (j < s.size() && !SpaceAt(s, j)) ++j;
            out.push_back(s.substr(i, j - i));
            if (limit > 0) --limit;
            i = j;
          }
          return Value(std::move(out));
        }
        const std::string& d = Str(sep, where.c_str());
        if (d.empty()) Fail(absl::StrCat(where, ": empty separator"));
        size_t i = 0;
        for (;;) {
          const size_t j = limit == 0 ? std::string::npos : s.find(d, i);
          if (j == std::string::npos) {
            out.push_back(s.substr(i));
            break;
          }
          out.push_back(s.substr(i, j - i));
          if (limit > 0) --limit;
          i = j + d.size();
        }
        return Value(std::move(out));
      }
      if (m == "upper" || m == "lower" || m == "title" || m == "capitalize") {
        return CaseFilter(m, s);
      }
      if (m == "replace") {
        return Value(Replace(s, Str(Arg(e, args, 0, "old"), where.c_str()),
                             Str(Arg(e, args, 1, "new"), where.c_str()),
                             Arg(e, args, 2, "count")));
      }
      if (m == "join") {
        std::vector<std::string> parts;
        for (const Value& x : Items(Arg(e, args, 0, "iterable"), "join")) {
          parts.push_back(ToString(x));
        }
        return Value(JoinChecked(parts, s, where));
      }
    }
    if (!obj.undefined && obj.j().is_object()) {
      if (m == "get") {
        const Value k = Arg(e, args, 0, "key");
        Value v = Index(obj, k);
        if (v.undefined) {
          const Value d = Arg(e, args, 1, "default");
          return d.undefined ? Value(nullptr) : d;
        }
        return v;
      }
      if (m == "items" || m == "keys" || m == "values") {
        json out = json::array();
        for (auto it = obj.j().begin(); it != obj.j().end(); ++it) {
          if (m == "items") {
            out.push_back(json::array({it.key(), it.value()}));
          } else {
            out.push_back(m == "keys" ? json(it.key()) : it.value());
          }
        }
        return Value(std::move(out));
      }
    }
    Fail(absl::StrCat(where, ": no such method on ", TypeName(obj)));
  }

  static Value CaseFilter(const std::string& f, const std::string& s) {
    std::string out = s;
    if (f == "upper") {
      for (char& c : out) c = std::toupper(static_cast<unsigned char>(c));
    } else if (f == "lower") {
      for (char& c : out) c = std::tolower(static_cast<unsigned char>(c));
    } else if (f == "capitalize") {
      for (char& c : out) c = std::tolower(static_cast<unsigned char>(c));
      if (!out.empty()) out[0] = std::toupper(static_cast<unsigned char>(out[0]));
    } else {  // title
      bool start = true;
      for (char& c : out) {
        const bool alpha = std::isalpha(static_cast<unsigned char>(c));
        c = alpha ? (start ? std::toupper(static_cast<unsigned char>(c))
                           : std::tolower(static_cast<unsigned char>(c)))
                  : c;
        start = !alpha;
      }
    }
    return Value(out);
  }

  static std::string Replace(const std::string& s, const std::string& from,
                             const std::string& to, const Value& count) {
    int64_t n = IsInt(count) ? count.j().get<int64_t>() : -1;
    if (from.empty()) return s;
    std::string out;
    size_t i = 0;
    for (;;) {
      const size_t j = n == 0 ? std::string::npos : s.find(from, i);
      if (j == std::string::npos) break;
      out += s.substr(i, j - i) + to;
      CheckStringSize(out.size(), "replace");
      i = j + from.size();
      if (n > 0) --n;
    }
    CheckStringSize(out.size() + (s.size() - i), "replace");
    return out + s.substr(i);
  }

  Value Filter(const Expr& e) {
    const std::string& f = e.name;
    const Value v = Eval(*e.args[0]);
    const std::vector<Value> args = Args(e, 1);
    const std::string where = absl::StrCat("line ", e.line, ": |", f);
    if (f == "default" || f == "d") {
      const Value d = Arg(e, args, 0, "default_value");
      const bool boolean = Truthy(Arg(e, args, 1, "boolean"));
      if (v.undefined || (boolean && !Truthy(v))) {
        return d.undefined ? Value(std::string()) : d;
      }
      return v;
    }
    if (f == "safe") return v;
    if (f == "string") return Value(ToString(v));
    if (f == "tojson") {
      const Value ind = Arg(e, args, 0, "indent");
      std::string out;
      ToJson(v.undefined ? json(nullptr) : v.j(),
             IsInt(ind) ? static_cast<int>(ind.j().get<int64_t>()) : 0, 0, &out);
      return Value(out);
    }
    if (f == "length" || f == "count") {
      if (!v.undefined && v.j().is_string()) {
        return Value(static_cast<int64_t>(CodePoints(v.j().get<std::string>()).size()));
      }
      if (!v.undefined && (v.j().is_array() || v.j().is_object())) {
        return Value(static_cast<int64_t>(v.j().size()));
      }
      Fail(absl::StrCat(where, ": ", TypeName(v), " has no length"));
    }
    if (f == "trim") return Value(Strip(Str(v, where.c_str()), true, true,
                                        std::nullopt));
    if (f == "upper" || f == "lower" || f == "capitalize" || f == "title") {
      return CaseFilter(f, Str(v, where.c_str()));
    }
    if (f == "replace") {
      return Value(Replace(Str(v, where.c_str()),
                           Str(Arg(e, args, 0, "old"), where.c_str()),
                           Str(Arg(e, args, 1, "new"), where.c_str()),
                           Arg(e, args, 2, "count")));
    }
    if (f == "first" || f == "last") {
      const std::vector<Value> items = Items(v, where.c_str());
      if (items.empty()) return Value::Undefined();
      return f == "first" ? items.front() : items.back();
    }
    if (f == "list") {
      json out = json::array();
      for (const Value& x : Items(v, where.c_str())) out.push_back(x.j());
      return Value(std::move(out));
    }
    if (f == "reverse") {
      if (!v.undefined && v.j().is_string()) {
        auto cps = CodePoints(v.j().get<std::string>());
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value(out);
      }
      const std::vector<Value> items = Items(v, where.c_str());
      json out = json::array();
      for (auto it = items.rbegin(); it != items.rend(); ++it) {
        out.push_back(it->j());
      }
      return Value(std::move(out));
    }
    if (f == "join") {
      const Value sep = Arg(e, args, 0, "d");
      std::vector<std::string> parts;
      for (const Value& x : Items(v, where.c_str())) {
        parts.push_back(ToString(x));
      }
      return Value(
          JoinChecked(parts, sep.undefined ? "" : ToString(sep), where));
    }
    if (f == "items") {
      if (v.undefined || !v.j().is_object()) {
        Fail(absl::StrCat(where, ": expected a mapping"));
      }
      json out = json::array();
      for (auto it = v.j().begin(); it != v.j().end(); ++it) {
        out.push_back(json::array({it.key(), it.value()}));
      }
      return Value(std::move(out));
    }
    if (f == "int") {
      if (IsInt(v)) return v;
      if (!v.undefined && v.j().is_number()) {
        const double d = v.j().get<double>();
        // Outside [-2^63, 2^63) (or NaN) the conversion is undefined
        // behaviour.
        if (!(d >= -0x1p63 && d < 0x1p63)) {
          Fail(absl::StrCat(where, ": ", d, " is outside the 64-bit range"));
        }
        return Value(static_cast<int64_t>(d));
      }
      if (!v.undefined && v.j().is_string()) {
        try {
          return Value(static_cast<int64_t>(std::stoll(v.j().get<std::string>())));
        } catch (const std::exception&) {
        }
      }
      return Value(int64_t{0});
    }
    if (f == "float") {
      if (!v.undefined && v.j().is_number()) return Value(v.j().get<double>());
      return Value(0.0);
    }
    if (f == "abs") {
      if (IsInt(v) &&
          v.j().get<int64_t>() != std::numeric_limits<int64_t>::min()) {
        return Value(std::llabs(v.j().get<int64_t>()));
      }
      return Value(std::fabs(Num(v, where.c_str())));
    }
    Fail(absl::StrCat(where, ": unknown filter"));
  }

  bool Test(const Expr& e) {
    const std::string& t = e.name;
    const Value v = Eval(*e.args[0]);
    const std::vector<Value> args = Args(e, 1);
    const bool def = !v.undefined;
    if (t == "defined") return def;
    if (t == "undefined") return !def;
    if (t == "none") return def && v.j().is_null();
    if (t == "string") return def && v.j().is_string();
    if (t == "number") return def && v.j().is_number();
    if (t == "integer") return def && v.j().is_number_integer();
    if (t == "float") return def && v.j().is_number_float();
    if (t == "boolean") return def && v.j().is_boolean();
    if (t == "true") return def && v.j().is_boolean() && v.j().get<bool>();
    if (t == "false") return def && v.j().is_boolean() && !v.j().get<bool>();
    if (t == "mapping") return def && v.j().is_object();
    if (t == "sequence") return def && (v.j().is_array() || v.j().is_string());
    if (t == "iterable") {
      return def && (v.j().is_array() || v.j().is_string() || v.j().is_object());
    }
    if (t == "callable") return false;
    if (t == "odd" || t == "even") {
      if (!IsInt(v)) Fail(absl::StrCat("line ", e.line, ": ", t, " needs an integer"));
      return (v.j().get<int64_t>() % 2 != 0) == (t == "odd");
    }
    if (t == "divisibleby") {
      if (!IsInt(v) || args.empty() || !IsInt(args[0]) ||
          args[0].j().get<int64_t>() == 0) {
        Fail(absl::StrCat("line ", e.line, ": bad divisibleby"));
      }
      return v.j().get<int64_t>() % args[0].j().get<int64_t>() == 0;
    }
    if (t == "eq" || t == "equalto" || t == "ne") {
      if (args.empty()) Fail(absl::StrCat("line ", e.line, ": ", t, " needs a value"));
      const bool eq = v.undefined || args[0].undefined
                          ? v.undefined == args[0].undefined
                          : v.j() == args[0].j();
      return t == "ne" ? !eq : eq;
    }
    Fail(absl::StrCat("line ", e.line, ": unknown test '", t, "'"));
  }

  std::vector<std::map<std::string, Value>> scopes_;
  size_t iterations_ = 0;
};

}  // namespace jinja_internal

absl::StatusOr<JinjaTemplate> JinjaTemplate::Parse(absl::string_view source) {
  try {
    jinja_internal::TemplateParser parser(
        jinja_internal::Split(jinja_internal::Preprocess(source)));
    return JinjaTemplate(parser.Parse());
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template: ", e.what()));
  }
}

absl::StatusOr<std::string> JinjaTemplate::Render(
    const nlohmann::json& context) const {
  try {
    jinja_internal::Interpreter interp(context);
    std::string out;
    interp.Run(*root_, &out);
    return out;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template: ", e.what()));
  }
}

}  // namespace chat
}  // namespace specserve
