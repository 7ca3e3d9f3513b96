#ifndef SPECSERVE_COMMON_DECODING_JSON_GRAMMAR_H_
#define SPECSERVE_COMMON_DECODING_JSON_GRAMMAR_H_

// Structured output, JSON mode (OpenAI's response_format
// {"type": "json_object"}, or "json_schema" with a JsonSchema; vLLM's
// guided decoding): a byte-level pushdown recognizer of one JSON object
// (RFC 8259), and the token mask it implies for a vocabulary. A
// constrained request masks, at every decoded row, the ids whose bytes the
// recognizer would reject; once the object is closed only EOS is left. In a speculative round row j's recognizer has consumed
// the drafts before it, like its penalties (logits_processors.h).

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/decoding/json_schema.h"
#include "common/tokenizer/token_byte_table.h"

namespace specserve {

/// The state of a JSON object being written, one byte at a time (or, with
/// a JsonSchema::Choice, of one of the choices as raw text). Accepts
/// exactly the prefixes of `ws* object`, where object is RFC 8259's and,
/// with a schema, an instance of it written as JsonSchema describes
/// (properties in schema order), with two limits that keep a model from
/// running away: at most kMaxDepth nested arrays / objects, and at most
/// kMaxWhitespace whitespace bytes in a row outside strings. Nothing may
/// follow the closed object. Strings hold valid UTF-8 (RFC 3629: no
/// overlongs, surrogates or code points past U+10FFFF) without control
/// characters, and RFC 8259's escapes. Trivially copyable (~320 bytes): a
/// mask search copies it per trie node.
class JsonMatcher {
 public:
  static constexpr int kMaxDepth = 48;
  static constexpr int kMaxWhitespace = 8;

  /// Any JSON object (JSON mode).
  JsonMatcher() : JsonMatcher(&JsonSchema::AnyObject()) {}
  /// An instance of `schema` (outlives the matcher and its copies); null =
  /// any JSON object.
  explicit JsonMatcher(const JsonSchema* schema)
      : schema_(schema != nullptr ? schema : &JsonSchema::AnyObject()) {}

  /// Consumes `c`; false (and no change) when no JSON object has this
  /// prefix.
  bool Advance(unsigned char c);
  /// Consumes `bytes` in order; false at the first rejected byte (the
  /// bytes before it stay consumed: advance a copy to test).
  bool Advance(absl::string_view bytes);
  /// Whether the top-level object is closed (only EOS may follow).
  bool complete() const { return state_ == State::kDone; }
  /// Whether the output may end here: complete, or (a Choice schema) one
  /// choice written in full while a longer one could still go on.
  bool can_end() const;
  /// A key equal for equal states of one schema (for mask caches).
  std::string Key() const;

 private:
  enum class State : uint8_t {
    kStart,      // before the top-level object: ws or '{'
    kValue,      // a value (after ':' or ',' in an array)
    kArrayFirst, // after '[': a value or ']'
    kObjectFirst,// after '{': a key or '}'
    kKey,        // after ',' in an object: a key
    kColon,      // after a key
    kAfter,      // after a value inside a container: ',' or its close
    kString,     // inside a string (key_ says which kind)
    kEscape,     // after '\' in a string
    kHex,        // in \uXXXX, hex_left_ digits to go
    kMinus,      // after '-': a digit
    kZero,       // after a leading 0
    kInt,        // in the integer digits
    kDot,        // after '.': a digit
    kFrac,       // in the fraction digits
    kExp,        // after e / E: a sign or digit
    kExpSign,    // after the exponent's sign: a digit
    kExpDigits,  // in the exponent digits
    kLiteral,    // in one of a literal set (an enum, true / false / null,
                 // an object's next keys)
    kDone,       // the top-level object is closed
  };
  // An open container: its schema node, and an array's items so far or
  // the object properties passed (the next key is among those after).
  struct Frame {
    uint16_t node;
    uint16_t count;
    char kind;  // '{' or '['
  };
  const JsonSchema::Node& node(int i) const { return schema_->node(i); }
  // The dispatch node of the value that starts next.
  int ExpectedNode() const;
  // Bits of the properties of object node `n` that may come next after
  // `passed`: up to the first required one.
  static uint64_t KeyCandidates(const JsonSchema::Node& n, int passed);
  static bool RequiredLeft(const JsonSchema::Node& n, int passed);
  // The literal set in progress: its candidates; whether one is complete
  // and none longer (it ends now); ends it (EndValue, or a key's colon).
  const std::vector<std::string>& Literals() const;
  bool LiteralEnds() const;
  bool FinishLiteral();
  // Starts the literal set of node `literals_node` (an enum, a choice)
  // with its first byte `c`; false if no candidate starts with it.
  bool StartLiterals(int literals_node, unsigned char c);
  // A string character starts (code point counting for min/maxLength).
  bool StringChar();
  // The byte after a complete number, or the end of any value: ends the
  // value and consumes `c` in the container's state.
  bool EndValue();
  bool StartValue(unsigned char c, bool array_first);
  bool Whitespace(unsigned char c);
  // Moves to `s`; true (for `ok = cond && To(s)`).
  bool To(State s);
  // One byte of string content (not '"' or '\\' outside a character).
  bool Utf8(unsigned char c);

  const JsonSchema* schema_;
  State state_ = State::kStart;
  bool key_ = false;          // the string in progress is a key
  bool integer_ = false;      // the number in progress is an integer
  bool set_keys_ = false;     // the literal set is an object's keys
  uint8_t hex_left_ = 0;
  // \u escapes of UTF-16 surrogates come in pairs (a strict parser
  // refuses a lone one): kHexD (the escape's first digit is d),
  // kHexHigh (it is a high surrogate), kNeedLow (a \u low surrogate must
  // follow), kInLow (this escape is that low surrogate).
  uint8_t surrogate_ = 0;
  static constexpr uint8_t kHexD = 1, kHexHigh = 2, kNeedLow = 4, kInLow = 8;
  uint8_t whitespace_ = 0;    // whitespace bytes in a row
  uint8_t depth_ = 0;
  uint8_t utf8_left_ = 0;            // continuation bytes still due
  uint8_t utf8_lo_ = 0x80, utf8_hi_ = 0xBF;  // the next one's range
  uint16_t set_node_ = 0;     // the literal set's node
  uint16_t literal_pos_ = 0;  // bytes of the literal set matched
  uint16_t str_node_ = 0;     // the value string's node (0: a key's)
  uint16_t str_len_ = 0;      // its code points so far
  uint64_t alive_ = 0;        // candidates of the literal set still matching
  std::array<Frame, kMaxDepth> stack_{};
};

/// The ids a JSON object's writer may emit next, for one vocabulary: a
/// trie of the ids' bytes (TokenByteTable) searched with a JsonMatcher,
/// each subtree pruned at its first rejected byte, and the answers cached
/// per recognizer state (JsonMatcher::Key; inside a string the state
/// repeats, and a 128K vocabulary's search there takes ~10 ms). Safe for
/// concurrent use.
class JsonTokenMask {
 public:
  /// `eos_ids`: the ids that end the output, allowed (alone) once the
  /// object is complete. Special ids are never allowed otherwise.
  JsonTokenMask(TokenByteTable table, std::vector<int> eos_ids);

  /// Appends to `out` the ids not allowed after `m`, ascending: every id
  /// but EOS when m is complete; otherwise the ids whose bytes m rejects,
  /// the special ids and EOS. If that would leave nothing (a vocabulary
  /// that cannot continue the object), EOS stays allowed so the request
  /// ends. Cost: a cache lookup and a copy; on a miss, the trie nodes m
  /// accepts plus one pass over the vocabulary.
  void Disallowed(const JsonMatcher& m, std::vector<int>* out) const;

  /// Advances `m` by `id`'s bytes; false if m rejects them (or id is
  /// special, or outside the vocabulary).
  bool Advance(JsonMatcher* m, int id) const;
  /// Advances `m` by each of `ids` in turn; false at the first one it
  /// rejects (the ones before it stay consumed).
  bool Advance(JsonMatcher* m, absl::Span<const int> ids) const;

  /// The mask of a row that follows `m` and then `pending` (drafts before
  /// the row): Disallowed after them, plus every id in [vocab_size(),
  /// model_vocab) (model rows past the tokenizer's). Returns whether the
  /// object is then complete; nothing is appended when a pending id breaks
  /// the object (such a row is never read: the row before it rejects that
  /// id).
  bool DisallowedAfter(JsonMatcher m, absl::Span<const int> pending,
                       int model_vocab, std::vector<int>* out) const;

  int vocab_size() const { return static_cast<int>(table_.bytes.size()); }
  /// Whether some id can open the object (a token holding '{' after any
  /// whitespace): false for a vocabulary without braces, which could only
  /// write whitespace and end.
  bool can_open() const { return can_open_; }

 private:
  struct Node {
    int first_child = -1;  // children are contiguous: [first, first + n)
    int num_children = 0;
    unsigned char byte = 0;
    int ids_begin = 0, ids_end = 0;  // into ids_: tokens ending here
  };
  void Search(int node, const JsonMatcher& m,
              std::vector<uint8_t>* allowed) const;

  static constexpr size_t kMaxCached = 4096;  // states; cleared when full

  TokenByteTable table_;
  std::vector<int> eos_ids_;
  bool can_open_ = false;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int>> cache_
      ABSL_GUARDED_BY(mu_);
  std::vector<Node> nodes_;  // nodes_[0] is the root
  std::vector<int> ids_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_JSON_GRAMMAR_H_
