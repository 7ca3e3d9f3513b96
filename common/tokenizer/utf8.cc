#include "common/tokenizer/utf8.h"

namespace specserve {

size_t ValidUtf8Len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  const size_t left = s.size() - i;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    return left >= 2 && (b(i + 1) & 0xC0) == 0x80 ? 2 : 0;
  }
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3) return 0;
    const unsigned char lo = c == 0xE0 ? 0xA0 : 0x80;
    const unsigned char hi = c == 0xED ? 0x9F : 0xBF;
    return b(i + 1) >= lo && b(i + 1) <= hi && (b(i + 2) & 0xC0) == 0x80 ? 3
                                                                         : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4) return 0;
    const unsigned char lo = c == 0xF0 ? 0x90 : 0x80;
    const unsigned char hi = c == 0xF4 ? 0x8F : 0xBF;
    return b(i + 1) >= lo && b(i + 1) <= hi && (b(i + 2) & 0xC0) == 0x80 &&
                   (b(i + 3) & 0xC0) == 0x80
               ? 4
               : 0;
  }
  return 0;
}

void AppendBytesLossy(std::string_view bytes, std::string* out) {
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t n = ValidUtf8Len(bytes, i);
    if (n == 0) {
      out->append(kReplacementChar);
      ++i;
    } else {
      out->append(bytes.substr(i, n));
      i += n;
    }
  }
}

bool ParseBytePiece(std::string_view piece, unsigned char* byte) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') {
    return false;
  }
  int v = 0;
  for (int k = 3; k < 5; ++k) {
    const char ch = piece[k];
    int d;
    if (ch >= '0' && ch <= '9') {
      d = ch - '0';
    } else if (ch >= 'A' && ch <= 'F') {
      d = ch - 'A' + 10;
    } else if (ch >= 'a' && ch <= 'f') {
      d = ch - 'a' + 10;
    } else {
      return false;
    }
    v = v * 16 + d;
  }
  *byte = static_cast<unsigned char>(v);
  return true;
}

}  // namespace specserve
