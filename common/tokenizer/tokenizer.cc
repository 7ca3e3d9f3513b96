#include "common/tokenizer/tokenizer.h"

#include <sys/stat.h>

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/hf_bpe_tokenizer.h"
#include "common/tokenizer/spm_builtin.h"
#if !defined(SPECSERVE_SPM_BUILTIN)
#include "common/tokenizer/sentencepiece_tokenizer.h"
#endif

namespace specserve {
namespace {

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// FNV-1a 64 (http://www.isthe.com/chongo/tech/comp/fnv/): tiny, stable
// across processes and platforms, unlike std::hash.
class Fnv1a64 {
 public:
  void Bytes(std::string_view s) {
    for (unsigned char c : s) {
      h_ ^= c;
      h_ *= 0x100000001b3ULL;
    }
  }
  // Fixed-width little-endian, so the serialization is unambiguous.
  void Int(int64_t v) {
    const uint64_t u = static_cast<uint64_t>(v);
    for (int k = 0; k < 8; ++k) {
      const char b = static_cast<char>((u >> (8 * k)) & 0xFF);
      Bytes(std::string_view(&b, 1));
    }
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

constexpr std::string_view kUtf8Replacement = "\xEF\xBF\xBD";  // U+FFFD

// True if `s` ends with U+FFFD or with an incomplete UTF-8 sequence: text a
// later byte piece may still turn into a different character.
bool EndsIncomplete(std::string_view s) {
  if (s.size() >= kUtf8Replacement.size() &&
      s.substr(s.size() - kUtf8Replacement.size()) == kUtf8Replacement) {
    return true;
  }
  // Walk back over at most 3 continuation bytes to the lead byte.
  size_t k = s.size();
  int cont = 0;
  while (k > 0 && cont < 4 &&
         (static_cast<unsigned char>(s[k - 1]) & 0xC0) == 0x80) {
    --k;
    ++cont;
  }
  if (k == 0) return cont > 0;
  const unsigned char lead = static_cast<unsigned char>(s[k - 1]);
  int need = 0;
  if (lead >= 0xC0 && lead < 0xE0) {
    need = 1;
  } else if (lead >= 0xE0 && lead < 0xF0) {
    need = 2;
  } else if (lead >= 0xF0 && lead < 0xF8) {
    need = 3;
  }
  return cont < need;
}

}  // namespace

std::string ComputeVocabFingerprint(std::string_view kind,
                                    const std::vector<std::string>& pieces,
                                    int bos_id, int eos_id, int unk_id,
                                    int pad_id) {
  Fnv1a64 h;
  h.Bytes("specserve-vocab-v1");
  h.Int(static_cast<int64_t>(kind.size()));
  h.Bytes(kind);
  h.Int(static_cast<int64_t>(pieces.size()));
  for (int id : {bos_id, eos_id, unk_id, pad_id}) h.Int(id);
  for (const std::string& p : pieces) {
    h.Int(static_cast<int64_t>(p.size()));
    h.Bytes(p);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(16, '0');
  uint64_t v = h.value();
  for (int k = 15; k >= 0; --k, v >>= 4) out[k] = kHex[v & 0xF];
  return out;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(
    const std::string& model_dir) {
  const std::string spm_path = absl::StrCat(model_dir, "/tokenizer.model");
  if (IsRegularFile(spm_path)) {
#if defined(SPECSERVE_SPM_BUILTIN)
    // --define=spm=builtin (sanitizer builds): no libsentencepiece.
    absl::StatusOr<std::unique_ptr<BuiltinSpmTokenizer>> t =
        BuiltinSpmTokenizer::Load(spm_path);
#else
    absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> t =
        SentencePieceTokenizer::Load(spm_path);
#endif
    if (!t.ok()) return t.status();
    return std::unique_ptr<Tokenizer>(*std::move(t));
  }
  const std::string json_path = absl::StrCat(model_dir, "/tokenizer.json");
  if (IsRegularFile(json_path)) {
    absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> t =
        HfBpeTokenizer::Load(json_path);
    if (!t.ok()) return t.status();
    return std::unique_ptr<Tokenizer>(*std::move(t));
  }
  return absl::NotFoundError(
      absl::StrCat("no tokenizer.model or tokenizer.json in ", model_dir));
}

IncrementalDecoder::IncrementalDecoder(const Tokenizer* tokenizer)
    : tokenizer_(tokenizer) {}

absl::StatusOr<std::string> IncrementalDecoder::DecodeRange(size_t begin,
                                                            size_t end) const {
  return tokenizer_->Decode(
      absl::MakeConstSpan(ids_).subspan(begin, end - begin));
}

absl::StatusOr<std::string> IncrementalDecoder::Step(bool flush) {
  // Widen the window until its already-emitted part has text: decoders
  // special-case the start of the output (sentencepiece drops the first
  // piece's leading "▁", HF's Strip drops a leading space), and the new
  // tokens must not be mistaken for that start.
  size_t begin = prefix_offset_;
  std::string prefix;
  while (true) {
    absl::StatusOr<std::string> p = DecodeRange(begin, read_offset_);
    if (!p.ok()) return p.status();
    prefix = *std::move(p);
    if (!prefix.empty() || begin == 0) break;
    --begin;
  }
  absl::StatusOr<std::string> text = DecodeRange(begin, ids_.size());
  if (!text.ok()) return text.status();
  if (!absl::StartsWith(*text, prefix)) {
    // The window's decode is not a prefix-extension (not expected for the
    // tokenizers here); fall back to decoding everything.
    absl::StatusOr<std::string> p = DecodeRange(0, read_offset_);
    if (!p.ok()) return p.status();
    text = DecodeRange(0, ids_.size());
    if (!text.ok()) return text.status();
    prefix = *std::move(p);
    if (!absl::StartsWith(*text, prefix)) return std::string();
  }
  std::string delta = text->substr(prefix.size());
  if (!flush && (delta.empty() || EndsIncomplete(delta))) {
    return std::string();  // Hold: nothing new, or a character in progress.
  }
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  return delta;
}

absl::StatusOr<std::string> IncrementalDecoder::Append(int id) {
  if (id < 0 || id >= tokenizer_->vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token id ", id, " outside [0, ", tokenizer_->vocab_size(), ")"));
  }
  ids_.push_back(id);
  absl::StatusOr<std::string> delta = Step(/*flush=*/false);
  if (!delta.ok()) ids_.pop_back();
  return delta;
}

std::string IncrementalDecoder::Flush() {
  if (read_offset_ == ids_.size()) return std::string();
  absl::StatusOr<std::string> delta = Step(/*flush=*/true);
  return delta.ok() ? *std::move(delta) : std::string();
}

}  // namespace specserve
