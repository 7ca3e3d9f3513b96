#ifndef SPECSERVE_COMMON_SERVICE_SPEC_PREFILL_FLAGS_H_
#define SPECSERVE_COMMON_SERVICE_SPEC_PREFILL_FLAGS_H_

#include "common/service/wire_options.h"

namespace specserve {

/// The Speculative Prefill --default_* flags, defined once for the router
/// (which fills a request's unset fields with them before the speculator
/// sees it) and the speculator (for callers of Speculator.Score that leave
/// fields unset): --default_keep_ratio, --default_keep_mass,
/// --default_chunk_size, --default_pool_kernel_size, --default_look_ahead,
/// --default_keep_first, --default_keep_last, --default_min_prompt_tokens.
/// Their defaults are SpecPrefillDefaults' (ScoreOptions' initializers).
SpecPrefillDefaults SpecPrefillDefaultsFromFlags();

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_SPEC_PREFILL_FLAGS_H_
