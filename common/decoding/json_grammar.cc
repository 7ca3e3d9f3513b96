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

constexpr absl::string_view kLiterals[] = {"true", "false", "null"};

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

bool JsonMatcher::To(State s) {
  state_ = s;
  return true;
}

bool JsonMatcher::EndValue() {
  state_ = depth_ == 0 ? State::kDone : State::kAfter;
  return true;
}

bool JsonMatcher::StartValue(unsigned char c, bool array_first) {
  if (array_first && c == ']') {
    --depth_;
    return EndValue();
  }
  switch (c) {
    case '{':
    case '[':
      if (depth_ >= kMaxDepth) return false;
      stack_[depth_++] = static_cast<char>(c);
      state_ = c == '{' ? State::kObjectFirst : State::kArrayFirst;
      return true;
    case '"':
      key_ = false;
      state_ = State::kString;
      return true;
    case '-':
      state_ = State::kMinus;
      return true;
    case '0':
      state_ = State::kZero;
      return true;
    case 't':
    case 'f':
    case 'n':
      literal_ = c == 't' ? 0 : c == 'f' ? 1 : 2;
      literal_pos_ = 1;
      state_ = State::kLiteral;
      return true;
    default:
      if (c >= '1' && c <= '9') {
        state_ = State::kInt;
        return true;
      }
      return false;
  }
}

bool JsonMatcher::Advance(unsigned char c) {
  const JsonMatcher before = *this;
  // Number states: a byte that cannot continue the number ends it (where
  // the number may end) and is then read in the container's state.
  switch (state_) {
    case State::kZero:
      if (c == '.') { state_ = State::kDot; return true; }
      if (c == 'e' || c == 'E') { state_ = State::kExp; return true; }
      EndValue();
      break;
    case State::kInt:
      if (IsDigit(c)) return true;
      if (c == '.') { state_ = State::kDot; return true; }
      if (c == 'e' || c == 'E') { state_ = State::kExp; return true; }
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
    case State::kKey:
      if (c == '"') {
        key_ = true;
        state_ = State::kString;
        ok = true;
      } else if (c == '}' && state_ == State::kObjectFirst) {
        --depth_;
        ok = EndValue();
      }
      break;
    case State::kColon:
      if (c == ':') {
        state_ = State::kValue;
        ok = true;
      }
      break;
    case State::kAfter: {
      const char top = stack_[depth_ - 1];
      if (c == ',') {
        state_ = top == '{' ? State::kKey : State::kValue;
        ok = true;
      } else if ((c == '}' && top == '{') || (c == ']' && top == '[')) {
        --depth_;
        ok = EndValue();
      }
      break;
    }
    case State::kString:
      if (utf8_left_ > 0) {  // inside a multi-byte character
        ok = Utf8(c);
      } else if (c == '"') {
        if (key_) {
          state_ = State::kColon;
          ok = true;
        } else {
          ok = EndValue();
        }
      } else if (c == '\\') {
        state_ = State::kEscape;
        ok = true;
      } else {
        ok = Utf8(c);
      }
      break;
    case State::kEscape:
      if (c == 'u') {
        hex_left_ = 4;
        state_ = State::kHex;
        ok = true;
      } else if (c == '"' || c == '\\' || c == '/' || c == 'b' ||
                 c == 'f' || c == 'n' || c == 'r' || c == 't') {
        state_ = State::kString;
        ok = true;
      }
      break;
    case State::kHex:
      if (IsHex(c)) {
        if (--hex_left_ == 0) state_ = State::kString;
        ok = true;
      }
      break;
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
    case State::kLiteral: {
      const absl::string_view lit = kLiterals[literal_];
      if (c == static_cast<unsigned char>(lit[literal_pos_])) {
        ok = true;
        if (++literal_pos_ == lit.size()) EndValue();
      }
      break;
    }
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

std::string JsonMatcher::Key() const {
  std::string k = {static_cast<char>(state_), static_cast<char>(key_),
                   static_cast<char>(hex_left_), static_cast<char>(literal_),
                   static_cast<char>(literal_pos_),
                   static_cast<char>(whitespace_),
                   static_cast<char>(utf8_left_),
                   static_cast<char>(utf8_lo_),
                   static_cast<char>(utf8_hi_)};
  k.append(stack_.data(), depth_);
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
  if (m.complete() || !any) {
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
