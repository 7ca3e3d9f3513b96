// Fuzz target: tokenizer.json parsing (HfBpeTokenizer::Parse) and, for an
// accepted tokenizer, encoding and decoding a few fixed strings (ASCII,
// whitespace runs, CJK, emoji, invalid UTF-8, a special token written
// literally). Any input must give OK or an error status, never a crash.
// Seeds: common/tokenizer/testdata/fuzz/tokenizer_json.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/tokenizer/hf_bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  auto tok = specserve::HfBpeTokenizer::Parse(json, "", "fuzz");
  if (!tok.ok()) return 0;
  static const char* const kTexts[] = {
      "Once upon a time, ab ab", "  \n\n\t x  ", "\xe4\xbd\xa0\xe5\xa5\xbd",
      "\xf0\x9f\x98\x80!", "bad \xff\xfe utf8", "ab<|begin_of_text|>ab", ""};
  for (const char* t : kTexts) {
    auto ids = (*tok)->Encode(t, /*add_bos=*/true);
    if (!ids.ok()) continue;
    (void)(*tok)->Decode(*ids);
  }
  return 0;
}
