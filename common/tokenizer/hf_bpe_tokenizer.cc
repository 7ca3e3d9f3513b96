#include "common/tokenizer/hf_bpe_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <queue>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/tokenizer/byte_level.h"
#include "common/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::json;

// Debian's Abseil has its own absl::string_view (not std's); convert at the
// boundary.
absl::string_view Sv(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

constexpr int kMaxVocabId = 1 << 24;  // Sanity bound on ids in the file.
// Word cache bounds: longer words are rare and cheap to skip; the cache is
// cleared when it reaches kMaxCachedWords (HF bounds its cache likewise).
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kMaxCachedWords = 1 << 16;

// Bytes -> text, each maximal subpart of an invalid sequence becoming one
// U+FFFD (Unicode's "best practice", used by Rust's from_utf8_lossy and the
// WHATWG TextDecoder): a lead byte followed by some but not all of its valid
// continuation bytes is one U+FFFD.
void AppendBytesLossyMaximal(std::string_view bytes, std::string* out) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(bytes[k]); };
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t n = ValidUtf8Len(bytes, i);
    if (n > 0) {
      out->append(bytes.substr(i, n));
      i += n;
      continue;
    }
    // Length of the valid prefix of a sequence starting at i (>= 1).
    const unsigned char c = b(i);
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    size_t k = 1;
    for (; k <= need && i + k < bytes.size(); ++k) {
      const unsigned char d = b(i + k);
      if (k == 1 ? (d < lo || d > hi) : (d & 0xC0) != 0x80) break;
    }
    out->append(kReplacementChar);
    i += k;
  }
}

// Applies a utf8proc normalization (`options`) to every maximal valid UTF-8
// run of `s`; bytes that are not UTF-8 (lenient input) stay as they are.
std::string UnicodeNormalize(std::string_view s, int options) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    while (j < s.size()) {
      const size_t n = ValidUtf8Len(s, j);
      if (n == 0) break;
      j += n;
    }
    if (j > i) {
      utf8proc_uint8_t* dst = nullptr;
      const utf8proc_ssize_t len = utf8proc_map(
          reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
          static_cast<utf8proc_ssize_t>(j - i), &dst,
          static_cast<utf8proc_option_t>(options));
      if (len >= 0) {
        out.append(reinterpret_cast<const char*>(dst), len);
      } else {
        out.append(s.substr(i, j - i));  // Not expected for valid UTF-8.
      }
      std::free(dst);
      i = j;
    }
    if (i < s.size()) {
      out.push_back(s[i]);  // An invalid byte.
      ++i;
    }
  }
  return out;
}

// Byte length of the White_Space character (Rust's char::is_whitespace,
// which HF's lstrip/rstrip use) starting at s[i], or 0.
size_t WhitespaceLen(std::string_view s, size_t i) {
  const size_t n = ValidUtf8Len(s, i);
  if (n == 0) return 0;
  uint32_t cp = static_cast<unsigned char>(s[i]);
  if (n > 1) {
    cp &= 0x7F >> n;
    for (size_t k = 1; k < n; ++k) {
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    }
  }
  const bool ws = (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 ||
                  cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
                  cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
                  cp == 0x205F || cp == 0x3000;
  return ws ? n : 0;
}

// Start of the run of whitespace that ends at s[end] (not before `begin`).
size_t WhitespaceRunStart(std::string_view s, size_t begin, size_t end) {
  size_t start = end;
  while (start > begin) {
    // Step back to the previous character's first byte.
    size_t k = start - 1;
    while (k > begin && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    if (WhitespaceLen(s, k) != start - k) break;
    start = k;
  }
  return start;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return ss.str();
}

bool FileExists(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return static_cast<bool>(in);
}

// "type" of a component object, or "" when absent.
std::string TypeOf(const Json& j) {
  if (!j.is_object()) return "";
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

std::string GetString(const Json& j, const char* key, std::string dflt) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : dflt;
}

bool GetBool(const Json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : dflt;
}

// The literal pattern of a Replace component ({"String": s}); false for a
// regex pattern.
bool ReplacePattern(const Json& j, std::string* pattern) {
  auto it = j.find("pattern");
  if (it == j.end() || !it->is_object()) return false;
  auto s = it->find("String");
  if (s == it->end() || !s->is_string()) return false;
  *pattern = s->get<std::string>();
  return !pattern->empty();
}

// The TemplateProcessing post-processor, alone or inside a Sequence; null
// when there is none.
const Json* FindTemplate(const Json& pp) {
  if (TypeOf(pp) == "TemplateProcessing") return &pp;
  if (TypeOf(pp) == "Sequence") {
    auto it = pp.find("processors");
    if (it != pp.end() && it->is_array()) {
      for (const Json& sub : *it) {
        if (const Json* t = FindTemplate(sub)) return t;
      }
    }
  }
  return nullptr;
}

// Token name in tokenizer_config.json: a string or {"content": ...}.
std::string SpecialTokenName(const Json& config, const char* key) {
  if (!config.is_object()) return "";
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) return GetString(*it, "content", "");
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> HfBpeTokenizer::Load(
    const std::string& json_path) {
  absl::StatusOr<std::string> text = ReadFile(json_path);
  if (!text.ok()) return text.status();
  const size_t slash = json_path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : json_path.substr(0, slash);
  std::string config;
  for (const char* name :
       {"tokenizer_config.json", "special_tokens_map.json"}) {
    const std::string path = absl::StrCat(dir, "/", name);
    if (!FileExists(path)) continue;
    absl::StatusOr<std::string> c = ReadFile(path);
    if (!c.ok()) return c.status();
    config = *std::move(c);
    break;
  }
  absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> tok =
      Parse(*text, config, json_path);
  if (tok.ok() && (*tok)->byte_fallback() &&
      (*tok)->byte_piece_count() < 256) {
    const int n = (*tok)->byte_piece_count();
    std::fprintf(
        stderr,
        "warning: %s: model.byte_fallback is set but the vocabulary has %s "
        "of the 256 <0xNN> byte pieces: characters outside it %s\n",
        json_path.c_str(), n == 0 ? "none" : absl::StrCat("only ", n).c_str(),
        (*tok)->model_unk_id_ >= 0 ? "become <unk>" : "are dropped");
  }
  return tok;
}

int HfBpeTokenizer::byte_piece_count() const {
  return static_cast<int>(
      std::count_if(std::begin(byte_ids_), std::end(byte_ids_),
                    [](int id) { return id >= 0; }));
}

absl::Status HfBpeTokenizer::Invalid(std::string_view what) const {
  return absl::InvalidArgumentError(absl::StrCat(source_, ": ", Sv(what)));
}

absl::Status HfBpeTokenizer::Unimplemented(std::string_view what) const {
  return absl::UnimplementedError(absl::StrCat(
      source_, ": tokenizer.json ", Sv(what), " is not supported yet"));
}

// model.vocab and added_tokens -> pieces_ (by id), vocab_, added_.
absl::Status HfBpeTokenizer::ParseVocab(const Json& model, const Json& root) {
  const auto vit = model.find("vocab");
  if (vit == model.end() || !vit->is_object()) {
    return Invalid("model.vocab missing or not an object");
  }
  int max_id = -1;
  for (auto it = vit->begin(); it != vit->end(); ++it) {
    if (!it.value().is_number_integer()) {
      return Invalid(
          absl::StrCat("vocab entry \"", it.key(), "\" has a non-integer id"));
    }
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= kMaxVocabId) {
      return Invalid(absl::StrCat("vocab entry \"", it.key(), "\" has id ", id,
                                  " out of range"));
    }
    vocab_[it.key()] = static_cast<int>(id);
    max_id = std::max(max_id, static_cast<int>(id));
  }
  // Added tokens may extend the id range.
  if (root.contains("added_tokens") && root["added_tokens"].is_array()) {
    for (const Json& a : root["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          !a.contains("content") || !a["content"].is_string()) {
        return Invalid("added_tokens entry without integer id / content");
      }
      const int64_t id = a["id"].get<int64_t>();
      if (id < 0 || id >= kMaxVocabId) {
        return Invalid(absl::StrCat("added token id ", id, " out of range"));
      }
      AddedToken t;
      t.content = a["content"].get<std::string>();
      t.id = static_cast<int>(id);
      t.special = GetBool(a, "special", false);
      // HF's default: special tokens are matched on the raw text.
      t.normalized = GetBool(a, "normalized", !t.special);
      t.lstrip = GetBool(a, "lstrip", false);
      t.rstrip = GetBool(a, "rstrip", false);
      if (t.content.empty()) return Invalid("empty added token content");
      added_.push_back(std::move(t));
      max_id = std::max(max_id, static_cast<int>(id));
    }
  }
  if (max_id < 0) return Invalid("empty vocabulary");
  pieces_.assign(max_id + 1, std::string());
  skip_on_decode_.assign(max_id + 1, false);
  for (const auto& [piece, id] : vocab_) pieces_[id] = piece;
  for (const AddedToken& t : added_) {
    pieces_[t.id] = t.content;  // HF: added content wins for id->token.
    if (t.special) skip_on_decode_[t.id] = true;
  }
  return absl::OkStatus();
}

// BPE options, byte pieces and merges (needs vocab_).
absl::Status HfBpeTokenizer::ParseBpe(const Json& model) {
  byte_fallback_ = GetBool(model, "byte_fallback", false);
  fuse_unk_ = GetBool(model, "fuse_unk", false);
  ignore_merges_ = GetBool(model, "ignore_merges", false);
  const std::string unk = GetString(model, "unk_token", "");
  if (!unk.empty()) {
    auto it = vocab_.find(unk);
    if (it == vocab_.end()) {
      return Invalid(
          absl::StrCat("model.unk_token \"", unk, "\" is not in the vocab"));
    }
    model_unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(absl::StrFormat("<0x%02X>", b));
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }

  // Merges, in rank order.
  if (model.contains("merges") && !model["merges"].is_null()) {
    const Json& merges = model["merges"];
    if (!merges.is_array()) return Invalid("model.merges is not an array");
    merges_.reserve(merges.size());
    int rank = 0;
    for (const Json& m : merges) {
      std::string left, right;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != s.npos) {
          return Invalid(absl::StrCat("merge ", rank, " \"", s,
                                      "\" is not two space-separated "
                                      "pieces"));
        }
        left = s.substr(0, sp);
        right = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() &&
                 m[1].is_string()) {
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      } else {
        return Invalid(absl::StrCat("merge ", rank, " is malformed"));
      }
      auto a = vocab_.find(left);
      auto b = vocab_.find(right);
      auto c = vocab_.find(left + right);
      if (a == vocab_.end() || b == vocab_.end() || c == vocab_.end()) {
        return Invalid(absl::StrCat("merge ", rank, " (\"", left, "\", \"",
                                    right,
                                    "\") uses or makes a piece missing "
                                    "from the vocab"));
      }
      // Later duplicates override earlier ones, as in HF.
      merges_[PairKey(a->second, b->second)] = {rank, c->second};
      ++rank;
    }
  }
  return absl::OkStatus();
}

absl::Status HfBpeTokenizer::ParseNormalizer(const Json& norm) {
  if (norm.is_null()) return absl::OkStatus();
  std::vector<const Json*> steps;
  if (TypeOf(norm) == "Sequence") {
    if (!norm.contains("normalizers") || !norm["normalizers"].is_array()) {
      return Invalid("normalizer Sequence without \"normalizers\"");
    }
    for (const Json& n : norm["normalizers"]) steps.push_back(&n);
  } else {
    steps.push_back(&norm);
  }
  for (const Json* n : steps) {
    const std::string type = TypeOf(*n);
    NormalizerStep step;
    if (type == "Prepend") {
      step.type = NormalizerStep::kPrepend;
      step.to = GetString(*n, "prepend", "");
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" ||
               type == "NFKD") {
      step.type = NormalizerStep::kUnicode;
      const bool compat = type[2] == 'K';
      const bool compose = type.back() == 'C';
      step.utf8proc_options =
          UTF8PROC_STABLE | (compose ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) |
          (compat ? UTF8PROC_COMPAT : 0);
    } else if (type == "Replace") {
      step.type = NormalizerStep::kReplace;
      if (!ReplacePattern(*n, &step.from)) {
        return Unimplemented("normalizer Replace with a regex pattern");
      }
      step.to = GetString(*n, "content", "");
    } else {
      return Unimplemented(absl::StrCat("normalizer \"", type, "\""));
    }
    normalizer_.push_back(std::move(step));
  }
  return absl::OkStatus();
}

// Metaspace (alone or as a one-element Sequence) here; Split / ByteLevel
// steps through PreTokenizer.
absl::Status HfBpeTokenizer::ParsePreTokenizer(const Json& pre) {
  if (pre.is_null()) return absl::OkStatus();
  const Json* meta = nullptr;
  if (TypeOf(pre) == "Metaspace") {
    meta = &pre;
  } else if (TypeOf(pre) == "Sequence" && pre.contains("pretokenizers") &&
             pre["pretokenizers"].is_array() &&
             pre["pretokenizers"].size() == 1 &&
             TypeOf(pre["pretokenizers"][0]) == "Metaspace") {
    meta = &pre["pretokenizers"][0];
  } else {
    absl::StatusOr<std::unique_ptr<PreTokenizer>> p =
        PreTokenizer::FromJson(pre);
    if (!p.ok()) {
      if (p.status().code() == absl::StatusCode::kUnimplemented) {
        const absl::string_view m = p.status().message();
        return Unimplemented(std::string_view(m.data(), m.size()));
      }
      return Invalid(absl::StrCat("pre_tokenizer: ", p.status().message()));
    }
    pre_tokenizer_ = *std::move(p);
    byte_level_ = pre_tokenizer_->byte_level();
    return absl::OkStatus();
  }
  metaspace_ = true;
  metaspace_replacement_ = GetString(*meta, "replacement", "\u2581");
  const std::string scheme =
      GetString(*meta, "prepend_scheme",
                GetBool(*meta, "add_prefix_space", true) ? "always" : "never");
  if (scheme == "always") {
    metaspace_prepend_ = PrependScheme::kAlways;
  } else if (scheme == "first") {
    metaspace_prepend_ = PrependScheme::kFirst;
  } else if (scheme == "never") {
    metaspace_prepend_ = PrependScheme::kNever;
  } else {
    return Invalid(
        absl::StrCat("Metaspace prepend_scheme \"", scheme, "\" is unknown"));
  }
  metaspace_split_ = GetBool(*meta, "split", true);
  return absl::OkStatus();
}

absl::Status HfBpeTokenizer::ParseDecoder(const Json& dec) {
  if (dec.is_null()) return absl::OkStatus();
  has_decoder_ = true;
  std::vector<const Json*> steps;
  if (TypeOf(dec) == "Sequence") {
    if (!dec.contains("decoders") || !dec["decoders"].is_array()) {
      return Invalid("decoder Sequence without \"decoders\"");
    }
    for (const Json& d : dec["decoders"]) steps.push_back(&d);
  } else {
    steps.push_back(&dec);
  }
  for (const Json* d : steps) {
    const std::string type = TypeOf(*d);
    DecoderStep step;
    if (type == "Replace") {
      step.type = DecoderStep::kReplace;
      if (!ReplacePattern(*d, &step.from)) {
        return Unimplemented("decoder Replace with a regex pattern");
      }
      step.to = GetString(*d, "content", "");
    } else if (type == "ByteFallback") {
      step.type = DecoderStep::kByteFallback;
    } else if (type == "ByteLevel") {
      // add_prefix_space / trim_offsets do not change decoded text in HF.
      step.type = DecoderStep::kByteLevel;
    } else if (type == "Fuse") {
      step.type = DecoderStep::kFuse;
    } else if (type == "Strip") {
      step.type = DecoderStep::kStrip;
      step.from = GetString(*d, "content", " ");
      if (d->contains("start") && (*d)["start"].is_number_integer()) {
        step.start = (*d)["start"].get<int>();
      }
      if (d->contains("stop") && (*d)["stop"].is_number_integer()) {
        step.stop = (*d)["stop"].get<int>();
      }
    } else if (type == "Metaspace") {
      step.type = DecoderStep::kMetaspace;
      step.from = GetString(*d, "replacement", "\u2581");
      const std::string scheme =
          GetString(*d, "prepend_scheme",
                    GetBool(*d, "add_prefix_space", true) ? "always" : "never");
      step.metaspace_strip_first = scheme != "never";
    } else {
      return Unimplemented(absl::StrCat("decoder \"", type, "\""));
    }
    if (step.from.empty() && step.type != DecoderStep::kByteFallback &&
        step.type != DecoderStep::kFuse &&
        step.type != DecoderStep::kByteLevel) {
      return Invalid(
          absl::StrCat("decoder \"", type, "\" with an empty pattern"));
    }
    decoder_.push_back(std::move(step));
  }
  return absl::OkStatus();
}

// Match strings of added tokens (needs the normalizer).
absl::Status HfBpeTokenizer::IndexAddedTokens() {
  // Normalized added tokens are matched by their normalized content.
  for (AddedToken& t : added_) {
    t.match = t.normalized ? Normalize(t.content) : t.content;
    if (t.match.empty()) return Invalid("added token normalizes to \"\"");
  }
  raw_added_.assign(256, {});
  normalized_added_.assign(256, {});
  for (const AddedToken& t : added_) {
    (t.normalized ? normalized_added_ : raw_added_)
        [static_cast<unsigned char>(t.match[0])]
            .push_back(&t);
  }
  return absl::OkStatus();
}

// bos/eos/pad/unk ids; `config` is tokenizer_config.json (or null).
void HfBpeTokenizer::ResolveSpecialIds(const Json& root, const Json& config) {
  auto lookup = [this](const std::string& name) -> int {
    if (name.empty()) return -1;
    for (const AddedToken& t : added_) {
      if (t.content == name) return t.id;
    }
    auto it = vocab_.find(name);
    return it == vocab_.end() ? -1 : it->second;
  };
  unk_id_ = model_unk_id_ >= 0 ? model_unk_id_
                               : lookup(SpecialTokenName(config, "unk_token"));
  bos_id_ = lookup(SpecialTokenName(config, "bos_token"));
  const Json* tmpl = root.contains("post_processor")
                         ? FindTemplate(root["post_processor"])
                         : nullptr;
  if (bos_id_ < 0 && tmpl != nullptr) {
    // TemplateProcessing: a leading SpecialToken of the single template.
    const Json& pp = *tmpl;
    if (pp.contains("single") && pp["single"].is_array() &&
        !pp["single"].empty() && pp["single"][0].is_object() &&
        pp["single"][0].contains("SpecialToken")) {
      bos_id_ = lookup(GetString(pp["single"][0]["SpecialToken"], "id", ""));
    }
  }
  // Fallbacks by name, for sentencepiece-style vocabularies only: in a
  // byte-level vocabulary "<s>" is ordinary text (Qwen has it as a BPE
  // piece), and a config that sets a token to null means "none".
  auto fallback = [&](const char* key, const std::string& name) -> int {
    if (byte_level_) return -1;
    if (config.is_object() && config.contains(key) && config[key].is_null()) {
      return -1;
    }
    return lookup(name);
  };
  if (bos_id_ < 0) bos_id_ = fallback("bos_token", "<s>");
  eos_id_ = lookup(SpecialTokenName(config, "eos_token"));
  if (eos_id_ < 0) eos_id_ = fallback("eos_token", "</s>");
  pad_id_ = lookup(SpecialTokenName(config, "pad_token"));
  if (pad_id_ < 0) pad_id_ = fallback("pad_token", "<pad>");
  for (const AddedToken& t : added_) {
    if (t.id == bos_id_) bos_content_ = t.content;
  }
}

// Byte-level only: what Encode(text, true) prepends (needs bos_id_).
absl::Status HfBpeTokenizer::ParsePostProcessor(const Json& pp,
                                                const Json& config) {
  if (!byte_level_) return absl::OkStatus();
  const Json* tmpl = FindTemplate(pp);
  if (tmpl == nullptr) {
    const bool add_bos =
        !config.is_object() || GetBool(config, "add_bos_token", true);
    if (add_bos && bos_id_ >= 0) bos_prefix_ = {bos_id_};
    return absl::OkStatus();
  }
  auto single = tmpl->find("single");
  if (single == tmpl->end() || !single->is_array()) {
    return Invalid("TemplateProcessing without a \"single\" template");
  }
  for (const Json& piece : *single) {
    if (!piece.is_object() || !piece.contains("SpecialToken")) break;
    const std::string name = GetString(piece["SpecialToken"], "id", "");
    // Ids come from the template's special_tokens map.
    const Json* ids = nullptr;
    if (tmpl->contains("special_tokens") &&
        (*tmpl)["special_tokens"].is_object() &&
        (*tmpl)["special_tokens"].contains(name) &&
        (*tmpl)["special_tokens"][name].contains("ids")) {
      ids = &(*tmpl)["special_tokens"][name]["ids"];
    }
    if (ids == nullptr || !ids->is_array()) {
      return Invalid(absl::StrCat("TemplateProcessing special token \"", name,
                                  "\" has no ids"));
    }
    for (const Json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= vocab_size()) {
        return Invalid(absl::StrCat("TemplateProcessing special token \"",
                                    name, "\" has an id outside the vocab"));
      }
      bos_prefix_.push_back(id.get<int>());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HfBpeTokenizer>> HfBpeTokenizer::Parse(
    std::string_view tokenizer_json, std::string_view config_json,
    const std::string& source) {
  const Json root = Json::parse(tokenizer_json, nullptr,
                                /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a JSON object"));
  }
  Json config;
  if (!config_json.empty()) {
    config = Json::parse(config_json, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded()) {
      return absl::InvalidArgumentError(absl::StrCat(
          source,
          ": tokenizer_config.json / special_tokens_map.json next to "
          "it is not valid JSON"));
    }
  }
  auto tok = std::unique_ptr<HfBpeTokenizer>(new HfBpeTokenizer());
  tok->source_ = source;
  try {
    const Json null_json;
    const Json& model = root.contains("model") ? root["model"] : null_json;
    const Json& pre =
        root.contains("pre_tokenizer") ? root["pre_tokenizer"] : null_json;
    const Json& norm =
        root.contains("normalizer") ? root["normalizer"] : null_json;
    const Json& dec = root.contains("decoder") ? root["decoder"] : null_json;

    if (!model.is_object()) return tok->Invalid("missing \"model\" object");
    const std::string model_type = TypeOf(model);
    if (model_type != "BPE") {
      return tok->Unimplemented(absl::StrCat(
          "model type \"", model_type.empty() ? "(none)" : model_type, "\""));
    }
    for (const char* key :
         {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.contains(key) && !model[key].is_null() &&
          !(model[key].is_string() && model[key].get<std::string>().empty())) {
        return tok->Unimplemented(absl::StrCat("BPE with ", key));
      }
    }

    absl::Status status = tok->ParseVocab(model, root);
    if (status.ok()) status = tok->ParseBpe(model);
    if (status.ok()) status = tok->ParseNormalizer(norm);
    if (status.ok()) status = tok->ParsePreTokenizer(pre);
    if (status.ok()) status = tok->ParseDecoder(dec);
    if (status.ok()) status = tok->IndexAddedTokens();
    if (!status.ok()) return status;
    tok->ResolveSpecialIds(root, config);
    status = tok->ParsePostProcessor(
        root.contains("post_processor") ? root["post_processor"] : null_json,
        config);
    if (!status.ok()) return status;
  } catch (const Json::exception& e) {
    return tok->Invalid(absl::StrCat("malformed tokenizer.json: ", e.what()));
  }

  tok->fingerprint_ =
      ComputeVocabFingerprint(tok->kind(), tok->pieces_, tok->bos_id_,
                              tok->eos_id_, tok->unk_id_, tok->pad_id_);
  return tok;
}

void HfBpeTokenizer::SplitOnAddedTokens(
    const AddedIndex& tokens, const Segment& in,
    std::vector<Segment>* out) const {
  if (in.added_id >= 0 || added_.empty()) {
    out->push_back(in);
    return;
  }
  const std::string& s = in.text;
  size_t text_start = 0;
  size_t i = 0;
  while (i < s.size()) {
    // Leftmost-longest match, like HF's aho-corasick (LeftmostLongest).
    const AddedToken* best = nullptr;
    for (const AddedToken* t : tokens[static_cast<unsigned char>(s[i])]) {
      if (t->match.size() <= s.size() - i &&
          (best == nullptr || t->match.size() > best->match.size()) &&
          s.compare(i, t->match.size(), t->match) == 0) {
        best = t;
      }
    }
    if (best == nullptr) {
      ++i;
      continue;
    }
    // lstrip / rstrip: the match takes the whitespace around it (never
    // reaching back into an earlier match).
    const size_t start =
        best->lstrip ? WhitespaceRunStart(s, text_start, i) : i;
    size_t stop = i + best->match.size();
    if (best->rstrip) {
      for (size_t n; stop < s.size() && (n = WhitespaceLen(s, stop)) > 0;) {
        stop += n;
      }
    }
    if (start > text_start) {
      out->push_back({s.substr(text_start, start - text_start), -1,
                      in.at_start && text_start == 0});
    }
    out->push_back({std::string(), best->id, in.at_start && start == 0});
    i = stop;
    text_start = i;
  }
  if (text_start < s.size()) {
    out->push_back({s.substr(text_start), -1, in.at_start && text_start == 0});
  }
}

std::string HfBpeTokenizer::Normalize(std::string_view text) const {
  std::string s(text);
  for (const NormalizerStep& step : normalizer_) {
    switch (step.type) {
      case NormalizerStep::kPrepend:
        if (!s.empty()) s.insert(0, step.to);  // HF: only non-empty strings.
        break;
      case NormalizerStep::kReplace:
        s = absl::StrReplaceAll(s, {{step.from, step.to}});
        break;
      case NormalizerStep::kUnicode:
        s = UnicodeNormalize(s, step.utf8proc_options);
        break;
    }
  }
  return s;
}

void HfBpeTokenizer::PreTokenize(const Segment& seg,
                                 std::vector<std::string>* words) const {
  if (pre_tokenizer_ != nullptr) {
    pre_tokenizer_->Split(seg.text, words);
    return;
  }
  if (!metaspace_) {
    words->push_back(seg.text);
    return;
  }
  const std::string& rep = metaspace_replacement_;
  std::string s = absl::StrReplaceAll(seg.text, {{" ", rep}});
  const bool prepend =
      metaspace_prepend_ == PrependScheme::kAlways ||
      (metaspace_prepend_ == PrependScheme::kFirst && seg.at_start);
  if (prepend && s.compare(0, rep.size(), rep) != 0) s.insert(0, rep);
  if (!metaspace_split_) {
    words->push_back(std::move(s));
    return;
  }
  // Split so that each replacement char starts a new word (MergedWithNext).
  size_t start = 0;
  size_t pos = s.find(rep, 1);
  while (pos != std::string::npos) {
    if (pos > start) words->push_back(s.substr(start, pos - start));
    start = pos;
    pos = s.find(rep, pos + rep.size());
  }
  if (start < s.size()) words->push_back(s.substr(start));
}

void HfBpeTokenizer::EncodeWord(std::string_view word,
                                std::vector<int>* ids) const {
  if (word.empty()) return;
  if (word.size() > kMaxCachedWordBytes) {
    EncodeWordUncached(word, ids);
    return;
  }
  {
    absl::MutexLock lock(&cache_mu_);
    auto it = cache_.find(Sv(word));
    if (it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = ids->size();
  EncodeWordUncached(word, ids);
  std::vector<int> word_ids(ids->begin() + start, ids->end());
  absl::MutexLock lock(&cache_mu_);
  if (cache_.size() >= kMaxCachedWords) cache_.clear();
  cache_.emplace(std::string(word), std::move(word_ids));
}

void HfBpeTokenizer::EncodeWordUncached(std::string_view word,
                                        std::vector<int>* ids) const {
  if (ignore_merges_) {
    auto it = vocab_.find(Sv(word));
    if (it != vocab_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  // Initial symbols: one per character, or its byte pieces, or unk.
  struct Symbol {
    int id;
    int prev;
    int next;
    int len;  // Bytes covered; 0 once merged into the left neighbour.
  };
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  auto push = [&syms](int id, int len) {
    const int n = static_cast<int>(syms.size());
    syms.push_back({id, n - 1, -1, len});
    if (n > 0) syms[n - 1].next = n;
  };
  int pending_unk_len = 0;  // fuse_unk: run of unknown characters.
  auto flush_unk = [&] {
    if (pending_unk_len > 0) push(model_unk_id_, pending_unk_len);
    pending_unk_len = 0;
  };
  size_t i = 0;
  while (i < word.size()) {
    // Invalid UTF-8 bytes are taken one at a time (lenient input).
    const size_t n = std::max<size_t>(1, ValidUtf8Len(word, i));
    const std::string_view ch = word.substr(i, n);
    i += n;
    auto it = vocab_.find(Sv(ch));
    if (it != vocab_.end()) {
      flush_unk();
      push(it->second, static_cast<int>(n));
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : ch)
        all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        flush_unk();
        for (char c : ch) push(byte_ids_[static_cast<unsigned char>(c)], 1);
        continue;
      }
    }
    if (model_unk_id_ < 0) continue;  // HF drops it when there is no unk.
    if (fuse_unk_) {
      pending_unk_len += static_cast<int>(n);
    } else {
      flush_unk();
      push(model_unk_id_, static_cast<int>(n));
    }
  }
  flush_unk();

  // Rank-ordered merging: pop the lowest (rank, position) candidate; skip
  // stale ones whose symbols changed since they were queued.
  struct Candidate {
    int rank;
    int pos;
    int new_id;
    bool operator<(const Candidate& o) const {  // Inverted: min-heap.
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate> heap;
  auto consider = [&](int left) {
    const int right = syms[left].next;
    if (right < 0) return;
    auto it = merges_.find(PairKey(syms[left].id, syms[right].id));
    if (it != merges_.end()) {
      heap.push({it->second.first, left, it->second.second});
    }
  };
  for (int k = 0; k + 1 < static_cast<int>(syms.size()); ++k) consider(k);
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    Symbol& left = syms[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = syms[left.next];
    auto it = merges_.find(PairKey(left.id, right.id));
    if (it == merges_.end() || it->second.first != top.rank ||
        it->second.second != top.new_id) {
      continue;
    }
    left.id = top.new_id;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (left.next >= 0) syms[left.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  for (int k = syms.empty() ? -1 : 0; k >= 0; k = syms[k].next) {
    ids->push_back(syms[k].id);
  }
}

void HfBpeTokenizer::EncodeText(std::string_view text,
                                std::vector<int>* ids) const {
  // HF order: split raw text on non-normalized added tokens; normalize each
  // remaining piece; split on normalized added tokens; pre-tokenize; BPE.
  std::vector<Segment> raw;
  SplitOnAddedTokens(raw_added_, {std::string(text), -1, true}, &raw);
  std::vector<Segment> segs;
  std::vector<std::string> words;
  for (Segment& r : raw) {
    if (r.added_id < 0) r.text = Normalize(r.text);
    segs.clear();
    SplitOnAddedTokens(normalized_added_, r, &segs);
    for (const Segment& seg : segs) {
      if (seg.added_id >= 0) {
        ids->push_back(seg.added_id);
        continue;
      }
      words.clear();
      PreTokenize(seg, &words);
      for (const std::string& w : words) EncodeWord(w, ids);
    }
  }
}

absl::StatusOr<std::vector<int>> HfBpeTokenizer::Encode(std::string_view text,
                                                        bool add_bos) const {
  std::vector<int> ids;
  ids.reserve(text.size() / 2 + 2);
  if (byte_level_) {
    if (add_bos) ids = bos_prefix_;
    EncodeText(text, &ids);
    return ids;
  }
  if (add_bos && !bos_content_.empty()) {
    // Tokenize BOS + text as one string, the way a BOS written in training
    // text is tokenized (see the class comment).
    EncodeText(bos_content_ + std::string(text), &ids);
    if (!ids.empty() && ids[0] == bos_id_) return ids;
    ids.clear();  // The BOS did not come out first: fall back.
  }
  if (add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
  EncodeText(text, &ids);
  return ids;
}

std::string HfBpeTokenizer::ApplyDecoder(
    std::vector<std::string> tokens) const {
  if (!has_decoder_) return absl::StrJoin(tokens, " ");  // HF's default.
  for (const DecoderStep& step : decoder_) {
    switch (step.type) {
      case DecoderStep::kReplace:
        for (std::string& t : tokens) {
          t = absl::StrReplaceAll(t, {{step.from, step.to}});
        }
        break;
      case DecoderStep::kByteFallback: {
        std::vector<std::string> out;
        out.reserve(tokens.size());
        std::string bytes;
        auto flush = [&] {
          if (bytes.empty()) return;
          std::string s;
          AppendBytesLossy(bytes, &s);
          out.push_back(std::move(s));
          bytes.clear();
        };
        for (std::string& t : tokens) {
          unsigned char b;
          if (ParseBytePiece(t, &b)) {
            bytes.push_back(static_cast<char>(b));
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case DecoderStep::kByteLevel: {
        // HF: every token back to bytes (a token with characters outside
        // the map keeps its own bytes), then one lossy UTF-8 conversion.
        std::string bytes;
        for (const std::string& t : tokens) {
          if (!ByteLevelDecode(t, &bytes)) bytes.append(t);
        }
        std::string text;
        AppendBytesLossyMaximal(bytes, &text);
        tokens.assign(1, std::move(text));
        break;
      }
      case DecoderStep::kFuse: {
        std::string all = absl::StrJoin(tokens, "");
        tokens.assign(1, std::move(all));
        break;
      }
      case DecoderStep::kStrip:
        for (std::string& t : tokens) {
          const std::string& c = step.from;
          size_t b = 0;
          for (int k = 0; k < step.start && t.compare(b, c.size(), c) == 0;
               ++k) {
            b += c.size();
          }
          size_t e = t.size();
          for (int k = 0; k < step.stop && e >= b + c.size() &&
                          t.compare(e - c.size(), c.size(), c) == 0;
               ++k) {
            e -= c.size();
          }
          t = t.substr(b, e - b);
        }
        break;
      case DecoderStep::kMetaspace:
        for (size_t k = 0; k < tokens.size(); ++k) {
          // HF drops every replacement char of the first token.
          tokens[k] = absl::StrReplaceAll(
              tokens[k],
              {{step.from, k == 0 && step.metaspace_strip_first ? "" : " "}});
        }
        break;
    }
  }
  return absl::StrJoin(tokens, "");
}

absl::StatusOr<std::string> HfBpeTokenizer::Decode(
    absl::Span<const int> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int id : ids) {
    if (id < 0 || id >= vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token id ", id, " outside [0, ", vocab_size(), ") for ", source_));
    }
    if (skip_on_decode_[id]) continue;
    tokens.push_back(pieces_[id]);
  }
  return ApplyDecoder(std::move(tokens));
}

absl::StatusOr<std::string> HfBpeTokenizer::IdToPiece(int id) const {
  if (id < 0 || id >= vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token id ", id, " outside [0, ", vocab_size(), ") for ", source_));
  }
  return pieces_[id];
}

}  // namespace specserve
