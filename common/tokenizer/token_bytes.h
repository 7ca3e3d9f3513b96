#ifndef SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTES_H_
#define SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/token_byte_table.h"
#include "common/tokenizer/tokenizer.h"

namespace specserve {

/// Builds the table from Decode: an id's bytes are what Decode({anchor, id})
/// adds to Decode({anchor}), for an anchor token that decodes to plain
/// ASCII; where that holds U+FFFD (part of a character), the piece's own
/// bytes (<0xXX>, or GPT-2's byte-level map). Cost: two Decode calls per id
/// (~0.2 s for a 128K vocabulary). INTERNAL if the tokenizer cannot encode
/// "a" or decode its own ids.
absl::StatusOr<TokenByteTable> BuildTokenByteTable(const Tokenizer& tokenizer);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_TOKEN_BYTES_H_
