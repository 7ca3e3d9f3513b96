#ifndef SPECSERVE_ROUTER_PROMPT_LIMITS_H_
#define SPECSERVE_ROUTER_PROMPT_LIMITS_H_

// Bounds on a request's inputs that the router checks before doing work
// proportional to them: a text prompt's bytes against the target's context
// (so an 8 MB prompt to a 512-token model is refused before it is
// tokenized, not after tens of seconds), and the number and size of stop
// conditions. The bounds are documented in README.md (API section).

#include <cstdint>

namespace specserve {

class Tokenizer;

/// At most this many stop strings per request (OpenAI allows 4).
inline constexpr int kMaxStopStrings = 16;
/// At most this many bytes per stop string.
inline constexpr int kMaxStopStringBytes = 256;
/// At most this many stop token ids per request.
inline constexpr int kMaxStopTokenIds = 64;

/// The most prompt-text bytes one token of `tokenizer` can stand for: the
/// longest decoded token or token piece (a special token written out, e.g.
/// "<|eot_id|>", is one token), plus one for a leading space a decoder
/// drops. O(vocab_size) Decode calls: compute once at start-up.
int MaxBytesPerToken(const Tokenizer& tokenizer);

/// The text prompt size past which a prompt cannot fit `max_context`
/// tokens: max_context x max_bytes_per_token, times 3 for normalizers that
/// shrink text before tokenizing (NFC composes up to 3 code points into
/// one). A larger prompt is refused before tokenizing (INVALID_ARGUMENT).
/// 0 (no limit) when either input is <= 0.
int64_t MaxPromptBytes(int max_context, int max_bytes_per_token);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_PROMPT_LIMITS_H_
