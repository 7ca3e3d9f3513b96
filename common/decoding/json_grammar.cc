#include "common/decoding/json_grammar.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

namespace specserve {
namespace {

bool IsWhitespace(unsigned char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}
bool IsDigit(unsigned char c) { return c >= '0' && c <= '9'; }
bool IsHex(unsigned char c) {
  return IsDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

}  // namespace

bool JsonMatcher::Whitespace(unsigned char c) {
  if (!IsWhitespace(c) || whitespace_ >= kMaxWhitespace) return false;
  ++whitespace_;
  return true;
}

bool JsonMatcher::Utf8(unsigned char c) {
  if (utf8_left_ > 0) {
    if (c < utf8_lo_ || c > utf8_hi_) return false;
    --utf8_left_;
    utf8_lo_ = 0x80;
    utf8_hi_ = 0xBF;
    return true;
  }
  if (c < 0x20) return false;  // control characters must be escaped
  if (!StringChar()) return false;
  if (c < 0x80) return true;
  // RFC 3629's table: the lead byte fixes the length and the second
  // byte's range (no overlongs, no surrogates, nothing past U+10FFFF).
  if (c >= 0xC2 && c <= 0xDF) {
    utf8_left_ = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    utf8_left_ = 2;
    if (c == 0xE0) utf8_lo_ = 0xA0;
    if (c == 0xED) utf8_hi_ = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    utf8_left_ = 3;
    if (c == 0xF0) utf8_lo_ = 0x90;
    if (c == 0xF4) utf8_hi_ = 0x8F;
  } else {
    return false;
  }
  return true;
}

bool JsonMatcher::StringChar() {
  if (str_node_ == 0) return true;  // a key: no limits
  const int max = node(str_node_).max_length;
  if (max >= 0 && str_len_ >= max) return false;
  if (str_len_ < 0xFFFF) ++str_len_;
  return true;
}

bool JsonMatcher::To(State s) {
  state_ = s;
  return true;
}

int JsonMatcher::ExpectedNode() const {
  if (depth_ == 0) return schema_->root();
  const Frame& f = stack_[depth_ - 1];
  const JsonSchema::Node& n = node(f.node);
  if (f.kind == '[' || n.kind == JsonSchema::Kind::kMap) return n.child;
  return n.values[f.count - 1];  // the property whose key was just read
}

uint64_t JsonMatcher::KeyCandidates(const JsonSchema::Node& n, int passed) {
  uint64_t bits = 0;
  for (int i = passed; i < static_cast<int>(n.keys.size()); ++i) {
    bits |= uint64_t{1} << i;
    if (n.required[i]) break;
  }
  return bits;
}

bool JsonMatcher::RequiredLeft(const JsonSchema::Node& n, int passed) {
  for (int i = passed; i < static_cast<int>(n.required.size()); ++i) {
    if (n.required[i]) return true;
  }
  return false;
}

const std::vector<std::string>& JsonMatcher::Literals() const {
  const JsonSchema::Node& n = node(set_node_);
  return set_keys_ ? n.keys : n.literals;
}

bool JsonMatcher::LiteralEnds() const {
  const std::vector<std::string>& lits = Literals();
  bool complete = false, longer = false;
  for (uint64_t a = alive_; a != 0; a &= a - 1) {
    const size_t len = lits[__builtin_ctzll(a)].size();
    complete |= len == literal_pos_;
    longer |= len > literal_pos_;
  }
  return complete && !longer;
}

bool JsonMatcher::FinishLiteral() {
  if (!set_keys_) {
    // A tagged union's tag: the complete literal picks the branch, which
    // goes on with its first property read.
    if (depth_ > 0 && node(stack_[depth_ - 1].node).kind ==
                          JsonSchema::Kind::kUnionObject) {
      Frame& f = stack_[depth_ - 1];
      const JsonSchema::Node& u = node(f.node);
      const std::vector<std::string>& tags = Literals();
      for (uint64_t a = alive_; a != 0; a &= a - 1) {
        const int i = __builtin_ctzll(a);
        if (tags[i].size() == literal_pos_) {
          f.node = static_cast<uint16_t>(u.branch[i]);
          f.count = 1;
          break;
        }
      }
    }
    return EndValue();
  }
  // Keys end with their quote, so exactly one is complete.
  const std::vector<std::string>& keys = Literals();
  for (uint64_t a = alive_; a != 0; a &= a - 1) {
    const int i = __builtin_ctzll(a);
    if (keys[i].size() == literal_pos_) {
      stack_[depth_ - 1].count = static_cast<uint16_t>(i + 1);
      state_ = State::kColon;
      return true;
    }
  }
  return false;
}

bool JsonMatcher::EndValue() {
  if (depth_ == 0) {
    state_ = State::kDone;
    return true;
  }
  Frame& f = stack_[depth_ - 1];
  if (f.kind == '[' && f.count < 0xFFFF) ++f.count;
  state_ = State::kAfter;
  return true;
}

bool JsonMatcher::StartValue(unsigned char c, bool array_first) {
  if (array_first && c == ']') {
    if (node(stack_[depth_ - 1].node).min_items > 0) return false;
    --depth_;
    return EndValue();
  }
  const int cls = JsonSchema::ClassOf(c);
  if (cls < 0) return false;
  const int typed = node(ExpectedNode()).by_class[cls];
  if (typed < 0) return false;
  const JsonSchema::Node& n = node(typed);
  switch (n.kind) {
    case JsonSchema::Kind::kObject:
    case JsonSchema::Kind::kUnionObject:
    case JsonSchema::Kind::kMap:
    case JsonSchema::Kind::kArray:
      if (depth_ >= kMaxDepth) return false;
      stack_[depth_++] = {static_cast<uint16_t>(typed), 0,
                          static_cast<char>(c)};
      state_ = c == '{' ? State::kObjectFirst : State::kArrayFirst;
      return true;
    case JsonSchema::Kind::kString:
      key_ = false;
      str_node_ = static_cast<uint16_t>(typed);
      str_len_ = 0;
      state_ = State::kString;
      return true;
    case JsonSchema::Kind::kNumber:
      integer_ = n.integer;
      state_ = c == '-' ? State::kMinus : c == '0' ? State::kZero : State::kInt;
      return true;
    case JsonSchema::Kind::kLiterals:
      return StartLiterals(typed, c);
    case JsonSchema::Kind::kDispatch:
      break;
  }
  return false;
}

bool JsonMatcher::StartLiterals(int literals_node, unsigned char c) {
  set_node_ = static_cast<uint16_t>(literals_node);
  set_keys_ = false;
  alive_ = 0;
  const std::vector<std::string>& lits = Literals();
  for (size_t i = 0; i < lits.size(); ++i) {
    if (static_cast<unsigned char>(lits[i][0]) == c) alive_ |= uint64_t{1} << i;
  }
  if (alive_ == 0) return false;
  literal_pos_ = 1;
  state_ = State::kLiteral;
  return LiteralEnds() ? FinishLiteral() : true;
}

bool JsonMatcher::can_end() const {
  if (complete()) return true;
  if (state_ != State::kLiteral || depth_ != 0) return false;
  const std::vector<std::string>& lits = Literals();
  for (uint64_t a = alive_; a != 0; a &= a - 1) {
    if (lits[__builtin_ctzll(a)].size() == literal_pos_) return true;
  }
  return false;
}

bool JsonMatcher::Advance(unsigned char c) {
  const JsonMatcher before = *this;
  if (state_ == State::kStart && schema_->raw_choice()) {
    // The choice's first byte: no whitespace, no quoting.
    if (!StartLiterals(schema_->root(), c)) {
      *this = before;
      return false;
    }
    return true;
  }
  // Number states and literal sets: a byte that cannot continue the value
  // ends it (where it may end) and is then read in the container's state.
  switch (state_) {
    case State::kZero:
      if (c == '.' && !integer_) { state_ = State::kDot; return true; }
      if ((c == 'e' || c == 'E') && !integer_) {
        state_ = State::kExp;
        return true;
      }
      EndValue();
      break;
    case State::kInt:
      if (IsDigit(c)) return true;
      if (c == '.' && !integer_) { state_ = State::kDot; return true; }
      if ((c == 'e' || c == 'E') && !integer_) {
        state_ = State::kExp;
        return true;
      }
      EndValue();
      break;
    case State::kFrac:
      if (IsDigit(c)) return true;
      if (c == 'e' || c == 'E') { state_ = State::kExp; return true; }
      EndValue();
      break;
    case State::kExpDigits:
      if (IsDigit(c)) return true;
      EndValue();
      break;
    case State::kLiteral: {
      const std::vector<std::string>& lits = Literals();
      uint64_t next = 0;
      bool complete = false;
      for (uint64_t a = alive_; a != 0; a &= a - 1) {
        const int i = __builtin_ctzll(a);
        const std::string& lit = lits[i];
        if (lit.size() > literal_pos_ &&
            static_cast<unsigned char>(lit[literal_pos_]) == c) {
          next |= uint64_t{1} << i;
        }
        complete |= lit.size() == literal_pos_;
      }
      if (next != 0) {
        alive_ = next;
        ++literal_pos_;
        if (LiteralEnds() && !FinishLiteral()) {
          *this = before;
          return false;
        }
        return true;
      }
      // "1" of {1, 12} followed by ',': the shorter value ends here.
      if (!complete || !FinishLiteral()) return false;
      break;
    }
    default:
      break;
  }
  bool ok = false;
  const bool ws_state = state_ == State::kStart || state_ == State::kValue ||
                        state_ == State::kArrayFirst ||
                        state_ == State::kObjectFirst ||
                        state_ == State::kKey || state_ == State::kColon ||
                        state_ == State::kAfter;
  if (ws_state && IsWhitespace(c)) {
    ok = Whitespace(c);
    if (!ok) *this = before;
    return ok;
  }
  if (ws_state) whitespace_ = 0;
  switch (state_) {
    case State::kStart:
      ok = c == '{' && StartValue(c, false);
      break;
    case State::kValue:
      ok = StartValue(c, false);
      break;
    case State::kArrayFirst:
      ok = StartValue(c, true);
      break;
    case State::kObjectFirst:
    case State::kKey: {
      const Frame& f = stack_[depth_ - 1];
      const JsonSchema::Node& n = node(f.node);
      if (n.kind == JsonSchema::Kind::kMap) {
        if (c == '"') {
          key_ = true;
          str_node_ = 0;
          state_ = State::kString;
          ok = true;
        } else if (c == '}' && state_ == State::kObjectFirst) {
          --depth_;
          ok = EndValue();
        }
      } else if (c == '"') {
        alive_ = KeyCandidates(n, f.count);
        if (alive_ != 0) {
          set_node_ = f.node;
          set_keys_ = true;
          literal_pos_ = 1;
          state_ = State::kLiteral;
          ok = true;
        }
      } else if (c == '}' && state_ == State::kObjectFirst &&
                 !RequiredLeft(n, f.count)) {
        --depth_;
        ok = EndValue();
      }
      break;
    }
    case State::kColon:
      if (c == ':') {
        state_ = State::kValue;
        ok = true;
      }
      break;
    case State::kAfter: {
      const Frame& f = stack_[depth_ - 1];
      const JsonSchema::Node& n = node(f.node);
      if (f.kind == '[') {
        if (c == ',') {
          ok = (n.max_items < 0 || f.count < n.max_items) && To(State::kValue);
        } else if (c == ']' && f.count >= n.min_items) {
          --depth_;
          ok = EndValue();
        }
      } else if (n.kind == JsonSchema::Kind::kMap) {
        if (c == ',') {
          ok = To(State::kKey);
        } else if (c == '}') {
          --depth_;
          ok = EndValue();
        }
      } else if (c == ',') {
        ok = KeyCandidates(n, f.count) != 0 && To(State::kKey);
      } else if (c == '}' && !RequiredLeft(n, f.count)) {
        --depth_;
        ok = EndValue();
      }
      break;
    }
    case State::kString:
      if (utf8_left_ > 0) {  // inside a multi-byte character
        ok = Utf8(c);
      } else if (surrogate_ & kNeedLow) {  // the pair's second \u
        ok = c == '\\' && To(State::kEscape);
      } else if (c == '"') {
        if (key_) {
          state_ = State::kColon;
          ok = true;
        } else {
          ok = (str_node_ == 0 || str_len_ >= node(str_node_).min_length) &&
               EndValue();
        }
      } else if (c == '\\') {
        state_ = State::kEscape;
        ok = StringChar();
      } else {
        ok = Utf8(c);
      }
      break;
    case State::kEscape:
      if (c == 'u') {
        hex_left_ = 4;
        surrogate_ = (surrogate_ & kNeedLow) ? kInLow : 0;
        state_ = State::kHex;
        ok = true;
      } else if (surrogate_ & kNeedLow) {
        ok = false;
      } else if (c == '"' || c == '\\' || c == '/' || c == 'b' ||
                 c == 'f' || c == 'n' || c == 'r' || c == 't') {
        state_ = State::kString;
        ok = true;
      }
      break;
    case State::kHex: {
      if (!IsHex(c)) break;
      const bool d = c == 'd' || c == 'D';
      // The second digit of a \uDxxx: 8-B a high surrogate, C-F a low.
      const bool low_range = (c >= 'c' && c <= 'f') || (c >= 'C' && c <= 'F');
      const bool high_range = c == '8' || c == '9' || c == 'a' || c == 'b' ||
                              c == 'A' || c == 'B';
      if (hex_left_ == 4) {
        if ((surrogate_ & kInLow) && !d) break;
        if (d) surrogate_ |= kHexD;
      } else if (hex_left_ == 3 && (surrogate_ & kHexD)) {
        if (surrogate_ & kInLow) {
          if (!low_range) break;
        } else if (low_range) {
          break;  // a low surrogate without its high one
        } else if (high_range) {
          surrogate_ |= kHexHigh;
        }
      }
      ok = true;
      if (--hex_left_ == 0) {
        surrogate_ = (surrogate_ & kHexHigh) ? kNeedLow : 0;
        state_ = State::kString;
      }
      break;
    }
    // Number states that need a byte: each accepts one class and moves on.
    case State::kMinus:
      ok = c == '0' ? To(State::kZero) : IsDigit(c) && To(State::kInt);
      break;
    case State::kDot:
      ok = IsDigit(c) && To(State::kFrac);
      break;
    case State::kExp:
      ok = c == '+' || c == '-' ? To(State::kExpSign)
                                : IsDigit(c) && To(State::kExpDigits);
      break;
    case State::kExpSign:
      ok = IsDigit(c) && To(State::kExpDigits);
      break;
    case State::kLiteral:  // continued or ended above
    case State::kZero:
    case State::kInt:
    case State::kFrac:
    case State::kExpDigits:
    case State::kDone:
      break;  // numbers ended above; nothing follows the object
  }
  if (!ok) *this = before;
  return ok;
}

bool JsonMatcher::Advance(absl::string_view bytes) {
  for (const char c : bytes) {
    if (!Advance(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

namespace {

// A count as far as a [lo, hi] limit can tell it apart: exact below hi
// (when there is one), else clamped at lo.
uint16_t CountKey(uint16_t count, int lo, int hi) {
  if (hi >= 0) return count;
  return static_cast<uint16_t>(std::min<int>(count, lo));
}

void AppendU16(uint16_t v, std::string* k) {
  k->push_back(static_cast<char>(v & 0xFF));
  k->push_back(static_cast<char>(v >> 8));
}

}  // namespace

std::string JsonMatcher::Key() const {
  // Only what the rest of the object depends on, so equal futures share
  // one cache entry (a string's length matters only under min/maxLength,
  // an array's count only under min/maxItems).
  std::string k;
  const uint64_t id = schema_->id();
  k.append(reinterpret_cast<const char*>(&id), sizeof(id));
  const char fields[] = {static_cast<char>(state_),
                         static_cast<char>(key_),
                         static_cast<char>(hex_left_),
                         static_cast<char>(surrogate_),
                         static_cast<char>(whitespace_),
                         static_cast<char>(utf8_left_),
                         static_cast<char>(utf8_lo_),
                         static_cast<char>(utf8_hi_)};
  k.append(fields, sizeof(fields));
  switch (state_) {
    case State::kString:
    case State::kEscape:
    case State::kHex:
      AppendU16(str_node_, &k);
      if (str_node_ != 0) {
        const JsonSchema::Node& n = node(str_node_);
        AppendU16(CountKey(str_len_, n.min_length, n.max_length), &k);
      }
      break;
    case State::kLiteral:
      k.push_back(static_cast<char>(set_keys_));
      AppendU16(set_node_, &k);
      AppendU16(literal_pos_, &k);
      k.append(reinterpret_cast<const char*>(&alive_), sizeof(alive_));
      break;
    case State::kMinus:
    case State::kZero:
    case State::kInt:
      k.push_back(static_cast<char>(integer_));
      break;
    default:
      break;
  }
  for (int i = 0; i < depth_; ++i) {
    const Frame& f = stack_[i];
    const JsonSchema::Node& n = node(f.node);
    k.push_back(f.kind);
    AppendU16(f.node, &k);
    AppendU16(f.kind == '[' ? CountKey(f.count, n.min_items, n.max_items)
                            : f.count,
              &k);
  }
  return k;
}

JsonTokenMask::JsonTokenMask(TokenByteTable table, std::vector<int> eos_ids)
    : table_(std::move(table)), eos_ids_(std::move(eos_ids)) {
  for (int id = 0; id < static_cast<int>(table_.bytes.size()) && !can_open_;
       ++id) {
    JsonMatcher m;
    can_open_ = !table_.special[id] && m.Advance(table_.bytes[id]) &&
                table_.bytes[id].find('{') != std::string::npos;
  }
  // Build the trie from a map-based one: children sorted by byte and
  // stored contiguously, breadth-first.
  struct Building {
    std::map<unsigned char, int> children;
    std::vector<int> ids;
  };
  std::vector<Building> b(1);
  for (int id = 0; id < static_cast<int>(table_.bytes.size()); ++id) {
    if (table_.special[id] || table_.bytes[id].empty()) continue;
    int node = 0;
    for (const char ch : table_.bytes[id]) {
      const unsigned char c = static_cast<unsigned char>(ch);
      auto it = b[node].children.find(c);
      if (it == b[node].children.end()) {
        b.emplace_back();
        it = b[node].children.emplace(c, static_cast<int>(b.size()) - 1).first;
      }
      node = it->second;
    }
    b[node].ids.push_back(id);
  }
  nodes_.resize(b.size());
  std::vector<int> order = {0}, index(b.size(), -1);
  index[0] = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const int old = order[i];
    Node& n = nodes_[i];
    n.ids_begin = static_cast<int>(ids_.size());
    ids_.insert(ids_.end(), b[old].ids.begin(), b[old].ids.end());
    n.ids_end = static_cast<int>(ids_.size());
    n.first_child = static_cast<int>(order.size());
    n.num_children = static_cast<int>(b[old].children.size());
    for (const auto& [c, child] : b[old].children) {
      index[child] = static_cast<int>(order.size());
      order.push_back(child);
    }
  }
  for (size_t i = 0; i < order.size(); ++i) {
    // The byte on the edge into node i.
    for (const auto& [c, child] : b[order[i]].children) {
      nodes_[index[child]].byte = c;
    }
  }
}

void JsonTokenMask::Search(int node, const JsonMatcher& m,
                           std::vector<uint8_t>* allowed) const {
  const Node& n = nodes_[node];
  for (int i = n.ids_begin; i < n.ids_end; ++i) (*allowed)[ids_[i]] = 1;
  for (int c = n.first_child; c < n.first_child + n.num_children; ++c) {
    JsonMatcher next = m;
    if (next.Advance(nodes_[c].byte)) Search(c, next, allowed);
  }
}

void JsonTokenMask::Disallowed(const JsonMatcher& m,
                               std::vector<int>* out) const {
  const std::string key = m.Key();
  {
    absl::MutexLock lock(&mu_);
    if (auto it = cache_.find(key); it != cache_.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const int vocab = vocab_size();
  std::vector<uint8_t> allowed(vocab, 0);
  if (!m.complete()) Search(0, m, &allowed);
  bool any = false;
  for (const uint8_t a : allowed) any |= a != 0;
  if (m.can_end() || !any) {
    for (const int id : eos_ids_) {
      if (id >= 0 && id < vocab) allowed[id] = 1;
    }
  }
  std::vector<int> disallowed;
  for (int id = 0; id < vocab; ++id) {
    if (!allowed[id]) disallowed.push_back(id);
  }
  out->insert(out->end(), disallowed.begin(), disallowed.end());
  absl::MutexLock lock(&mu_);
  if (cache_.size() >= kMaxCached) cache_.clear();
  cache_.emplace(key, std::move(disallowed));
}

bool JsonTokenMask::Advance(JsonMatcher* m, int id) const {
  if (id < 0 || id >= vocab_size() || table_.special[id]) return false;
  return m->Advance(table_.bytes[id]);
}

bool JsonTokenMask::Advance(JsonMatcher* m, absl::Span<const int> ids) const {
  for (const int id : ids) {
    if (!Advance(m, id)) return false;
  }
  return true;
}

bool JsonTokenMask::DisallowedAfter(JsonMatcher m,
                                    absl::Span<const int> pending,
                                    int model_vocab,
                                    std::vector<int>* out) const {
  if (!Advance(&m, pending)) return false;
  Disallowed(m, out);
  for (int id = vocab_size(); id < model_vocab; ++id) out->push_back(id);
  return m.complete();
}

}  // namespace specserve
