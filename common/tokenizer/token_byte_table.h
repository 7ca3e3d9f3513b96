#ifndef SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTE_TABLE_H_
#define SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTE_TABLE_H_

// The table alone, without the tokenizers (token_bytes.h builds it), so a
// grammar over token bytes does not link the tokenizer libraries.

#include <string>
#include <vector>

namespace specserve {

/// The bytes each token adds to the output text in the middle of a stream:
/// what a grammar-constrained decoder (structured output) must check a
/// token against. Unlike Decode({id}) it keeps a sentencepiece "▁" as the
/// space it becomes after other text, and gives a byte piece (<0xXX>, or
/// a byte-level BPE fragment of a multi-byte character) its raw byte(s)
/// instead of U+FFFD.
struct TokenByteTable {
  /// [vocab] the bytes of each id; empty for a special / control token
  /// (BOS, EOS, <|eot_id|>, ...), which adds no text.
  std::vector<std::string> bytes;
  /// [vocab] whether the id is special (adds no text; never allowed by a
  /// grammar, except the EOS that ends a complete output).
  std::vector<bool> special;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTE_TABLE_H_
