#ifndef SPECSERVE_COMMON_SERVICE_METRICS_UTIL_H_
#define SPECSERVE_COMMON_SERVICE_METRICS_UTIL_H_

// Histogram buckets shared by the three services' metrics.

#include "prometheus/histogram.h"

namespace specserve {

/// `count` bucket upper bounds: start, start x factor, start x factor^2, ...
/// (Prometheus client_golang's ExponentialBuckets).
prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start,
                                                           double factor,
                                                           int count);

/// Bounds for a fraction in (0, 1] (keep ratios): 0.05, 0.1, 0.2, ..., 1.
prometheus::Histogram::BucketBoundaries RatioBuckets();

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_METRICS_UTIL_H_
