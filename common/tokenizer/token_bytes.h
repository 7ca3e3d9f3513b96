#ifndef SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTES_H_
#define SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"

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

/// Builds the table from Decode: an id's bytes are what Decode({anchor, id})
/// adds to Decode({anchor}), for an anchor token that decodes to plain
/// ASCII; where that holds U+FFFD (part of a character), the piece's own
/// bytes (<0xXX>, or GPT-2's byte-level map). Cost: two Decode calls per id
/// (~0.2 s for a 128K vocabulary). INTERNAL if the tokenizer cannot encode
/// "a" or decode its own ids.
absl::StatusOr<TokenByteTable> BuildTokenByteTable(const Tokenizer& tokenizer);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTES_H_
