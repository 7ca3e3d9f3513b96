#ifndef SPECSERVE_COMMON_DECODING_LOGIT_EDIT_H_
#define SPECSERVE_COMMON_DECODING_LOGIT_EDIT_H_

// One vocabulary id's adjustment of a logit row, in a form every backend
// applies the same way: the host (logits_processors.cc, ReduceToArgmax /
// SampleOnHost) and the CUDA kernel ApplyLogitEdits (sampling.cu), which
// includes this header. A request's logit bias, penalties and min_tokens
// mask (logits_processors.h) become one edit per touched id per row, so a
// backend decides adjusted rows without sending [rows, vocab] logits to the
// host. Plain C++ with no dependencies: nvcc compiles it.

#include <cstdint>

#if defined(__CUDACC__)
#define SPECSERVE_HOST_DEVICE __host__ __device__
#else
#define SPECSERVE_HOST_DEVICE
#endif

namespace specserve {

/// logit' = R(logit + bias) - subtract, with R(x) = x / scale for x > 0 and
/// x * scale otherwise (the repetition penalty of Keskar et al. 2019, CTRL;
/// scale 1 = none), and subtract = f * count + p for OpenAI's frequency /
/// presence penalties (either sign). subtract = +inf masks the id:
/// logit' = -inf.
/// The field order and the arithmetic are those of ApplyLogitBias then
/// PenalizeLogit, so an edited row equals the processors' row bit for bit.
struct LogitEdit {
  int32_t id = 0;       // in [0, vocab)
  float bias = 0.f;     // added first
  float scale = 1.f;    // > 0
  float subtract = 0.f; // finite, or +inf (mask)
};
static_assert(sizeof(LogitEdit) == 16, "the device reads 16-byte edits");

/// The edited logit (see LogitEdit).
SPECSERVE_HOST_DEVICE inline float ApplyLogitEdit(float logit,
                                                  const LogitEdit& e) {
  if (e.subtract == __builtin_huge_valf()) return -__builtin_huge_valf();
  float x = logit + e.bias;
  if (e.scale != 1.f) x = x > 0.f ? x / e.scale : x * e.scale;
  return x - e.subtract;
}

}  // namespace specserve

#undef SPECSERVE_HOST_DEVICE

#endif  // SPECSERVE_COMMON_DECODING_LOGIT_EDIT_H_
