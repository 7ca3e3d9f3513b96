#include "common/tokenizer/byte_level.h"

#include <array>
#include <cstdint>

namespace specserve {
namespace {

struct Tables {
  std::array<uint32_t, 256> byte_to_cp;  // Byte -> code point.
  std::array<int16_t, 324> cp_to_byte;   // Code point (< 0x144) -> byte/-1.
};

bool IsPrintable(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) ||
         (b >= 0xAE && b <= 0xFF);
}

const Tables& GetTables() {
  static const Tables* const tables = [] {
    auto* t = new Tables;
    t->cp_to_byte.fill(-1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = IsPrintable(b) ? b : 256 + next++;
      t->byte_to_cp[b] = cp;
      t->cp_to_byte[cp] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return *tables;
}

}  // namespace

void ByteLevelEncode(std::string_view bytes, std::string* out) {
  const Tables& t = GetTables();
  out->reserve(out->size() + 2 * bytes.size());
  for (unsigned char b : bytes) {
    const uint32_t cp = t.byte_to_cp[b];
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else {  // All mapped code points are below U+0800: two bytes.
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
}

bool ByteLevelDecode(std::string_view text, std::string* out) {
  const Tables& t = GetTables();
  const size_t mark = out->size();
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    uint32_t cp;
    if (c < 0x80) {
      cp = c;
      i += 1;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < text.size() &&
               (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80) {
      cp = ((c & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F);
      i += 2;
      if (cp < 0x80) cp = UINT32_MAX;  // Overlong: not valid UTF-8.
    } else {
      cp = UINT32_MAX;  // Three or more bytes (or invalid): never mapped.
    }
    const int b = cp < t.cp_to_byte.size() ? t.cp_to_byte[cp] : -1;
    if (b < 0) {
      out->resize(mark);
      return false;
    }
    out->push_back(static_cast<char>(b));
  }
  return true;
}

}  // namespace specserve
