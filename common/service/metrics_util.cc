#include "common/service/metrics_util.h"

namespace specserve {

prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start,
                                                           double factor,
                                                           int count) {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = start; count-- > 0; v *= factor) b.push_back(v);
  return b;
}

prometheus::Histogram::BucketBoundaries RatioBuckets() {
  return {0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
}

}  // namespace specserve
