#ifndef SPECSERVE_COMMON_TOKENIZER_UTF8_H_
#define SPECSERVE_COMMON_TOKENIZER_UTF8_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace specserve {

/// U+FFFD REPLACEMENT CHARACTER as UTF-8.
inline constexpr char kReplacementChar[] = "\xEF\xBF\xBD";

/// Length of the valid UTF-8 sequence starting at s[i] (RFC 3629: no
/// overlongs, surrogates or code points above U+10FFFF), or 0 when the bytes
/// there are not a complete valid sequence. Requires i < s.size().
size_t ValidUtf8Len(std::string_view s, size_t i);

/// Appends `bytes` to `out` as text, each byte that does not start a valid
/// sequence becoming one U+FFFD (sentencepiece's rule for byte pieces).
void AppendBytesLossy(std::string_view bytes, std::string* out);

/// Parses a sentencepiece byte piece "<0xXX>" (hex digits of either case).
/// False, leaving `*byte` alone, for anything else.
bool ParseBytePiece(std::string_view piece, unsigned char* byte);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_UTF8_H_
