#ifndef SPECSERVE_COMMON_ENGINE_KV_SLOTS_H_
#define SPECSERVE_COMMON_ENGINE_KV_SLOTS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace specserve {

/// The bookkeeping every KV cache shares, whatever holds the tensors (host
/// or device): how many token slots are used out of a fixed capacity, and
/// the position id each cached token was rotated with.
class KvSlots {
 public:
  /// `capacity` >= 0 token slots.
  explicit KvSlots(int capacity) : capacity_(capacity) {
    positions_.reserve(std::min(capacity, 4096));
  }

  int size() const { return size_; }
  int capacity() const { return capacity_; }

  /// Takes `n` more slots and returns the first. RESOURCE_EXHAUSTED (and
  /// nothing changes) when size + n > capacity.
  absl::StatusOr<int> Reserve(int n) {
    if (n < 0 || static_cast<int64_t>(size_) + n > capacity_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache full: ", size_, " cached + ", n,
                       " new tokens exceed capacity ", capacity_));
    }
    const int first = size_;
    size_ += n;
    positions_.resize(size_, -1);
    return first;
  }

  /// Records the position ids of slots [first, first + n).
  void SetPositions(int first, const int* positions, int n) {
    for (int i = 0; i < n; ++i) positions_[first + i] = positions[i];
  }

  /// Keeps the first `n` slots. INVALID_ARGUMENT if n < 0 or n > size().
  absl::Status Truncate(int n) {
    if (n < 0 || n > size_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot truncate KV cache of ", size_, " tokens to ", n));
    }
    size_ = n;
    positions_.resize(n);
    return absl::OkStatus();
  }

  void Clear() {
    size_ = 0;
    positions_.clear();
  }

  /// Position id of each used slot, [size()].
  const std::vector<int>& positions() const { return positions_; }
  /// Position of the last cached token, or -1 when empty.
  int last_position() const { return size_ ? positions_[size_ - 1] : -1; }

 private:
  int capacity_;
  int size_ = 0;
  std::vector<int> positions_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_KV_SLOTS_H_
