#ifndef SPECSERVE_COMMON_TOKENIZER_BYTE_LEVEL_H_
#define SPECSERVE_COMMON_TOKENIZER_BYTE_LEVEL_H_

#include <string>
#include <string_view>

namespace specserve {

/// GPT-2's reversible byte <-> unicode map, as HF tokenizers' ByteLevel
/// pre-tokenizer and decoder use it (`bytes_to_unicode` in OpenAI's GPT-2
/// encoder.py): the printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF map
/// to the code point of the same value; the other 68 bytes (controls, space,
/// 0x7F..0xA0, 0xAD) map, in byte order, to U+0100, U+0101, ... U+0143. So
/// ' ' is "Ġ" (U+0120) and '\n' is "Ċ" (U+010A).

/// Appends the mapped characters of every byte of `bytes` (any bytes, not
/// necessarily UTF-8) to `out` as UTF-8: 1 or 2 bytes per input byte.
void ByteLevelEncode(std::string_view bytes, std::string* out);

/// Maps `text` (UTF-8) back to bytes and appends them to `out`. Returns
/// false, appending nothing, when `text` holds a character outside the map
/// (or is not valid UTF-8); HF's decoder then keeps such a token's own bytes.
bool ByteLevelDecode(std::string_view text, std::string* out);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_BYTE_LEVEL_H_
