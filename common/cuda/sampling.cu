// Row-parallel speculative sampling (see sampling_kernels.h): one block per
// sampled row computes ComputeDistribution's transform without sorting the
// vocabulary, then SampleRow's draft test and ascending-id draw.
//
// Order: ComputeDistribution's descending order (logit desc, then id asc)
// is the descending order of a 64-bit key, (ordered logit bits << 32) |
// (0xffffffff - id). top-k and top-p each become a threshold on that key
// ("keep keys >= thr"), found by an MSB-first radix select over 4-bit
// digits; each pass re-reads the logits row (it does not fit in shared
// memory at 128k vocabularies) and reduces 16 per-thread bins in registers
// with shuffles, so the selection is deterministic and needs no atomics.
// Masses are double exp((logit - max) / T) exactly as the host computes
// them, so p agrees with the host to the last bit except where the sums'
// order (and the 1-ulp exp of the device) moves a rounding.

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/cuda/cuda_types.cuh"
#include "common/cuda/launch.cuh"
#include "common/cuda/sampling_kernels.h"

namespace specserve {
namespace cuda_kernels {
namespace {

using cuda_detail::BlockSumD;
using cuda_detail::WarpSumD;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// 4-bit digits: a thread's 16 bins stay in registers (count + double mass
// is 48 registers; 512 threads allow 128 each).
constexpr int kDigitBits = 4;
constexpr int kBins = 1 << kDigitBits;
constexpr int kTopShift = 64 - kDigitBits;

using Key = unsigned long long;

struct Shared {
  int warp_count[kWarps][kBins];
  double warp_mass[kWarps][kBins];
  int count[kBins];  // block totals of the last ReduceBins
  double mass[kBins];
  double dscratch[32];
  Key kscratch[32];
  int iscratch[32];
  float q_draft;
};

// Order-preserving float -> uint32, as sampling.cc's OrderedBits: NaN is
// -inf and -0 is +0, so keys order exactly as the host's.
__device__ __forceinline__ uint32_t OrderedBits(float f) {
  if (isnan(f)) f = -INFINITY;
  const uint32_t b = f == 0.f ? 0u : __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float FromOrderedBits(uint32_t u) {
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

// Larger key = earlier in the descending order; keys are distinct.
__device__ __forceinline__ Key MakeKey(float logit, int id) {
  return (static_cast<Key>(OrderedBits(logit)) << 32) |
         (0xffffffffu - static_cast<uint32_t>(id));
}

__device__ __forceinline__ int KeyId(Key k) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(k));
}

// ComputeDistribution's weight exp(-gap), gap = (max - logit) / T in double;
// the equality test gives +inf logits weight 1 when the max is +inf.
__device__ __forceinline__ double Weight(float logit, float max_logit,
                                         double inv_t) {
  if (isnan(logit)) logit = -INFINITY;
  const double gap =
      logit == max_logit
          ? 0.0
          : (static_cast<double>(max_logit) - static_cast<double>(logit)) *
                inv_t;
  return exp(-gap);
}

// Whether `key` is in the group the radix select is narrowing: its digits
// above `shift` equal `prefix` (every key at the top digit).
__device__ __forceinline__ bool InGroup(Key key, Key prefix, int shift) {
  return shift == kTopShift || (key >> (shift + kDigitBits)) == prefix;
}

__device__ __forceinline__ int Digit(Key key, int shift) {
  return static_cast<int>((key >> shift) & (kBins - 1));
}

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};
struct MinOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a < b ? a : b;
  }
};

// Block-wide reduction with an exact (order-free) operator; every thread
// gets the result. `scratch`: 32 shared elements.
template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op, T identity, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(~0u, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kWarps ? scratch[lane] : identity;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(~0u, v, o));
  return v;
}

// Sums every thread's bins into sh.count (and sh.mass when kMass), which
// every thread may read until the next call. Fixed order: deterministic.
template <bool kMass>
__device__ void ReduceBins(const int (&count)[kBins],
                           const double (&mass)[kBins], Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous totals' readers are done
#pragma unroll
  for (int b = 0; b < kBins; ++b) {
    int c = count[b];
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(~0u, c, o);
    if (lane == 0) sh.warp_count[warp][b] = c;
    if (kMass) {
      const double m = WarpSumD(mass[b]);
      if (lane == 0) sh.warp_mass[warp][b] = m;
    }
  }
  __syncthreads();
  if (threadIdx.x < kBins) {
    int c = 0;
    double m = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      c += sh.warp_count[w][threadIdx.x];
      if (kMass) m += sh.warp_mass[w][threadIdx.x];
    }
    sh.count[threadIdx.x] = c;
    sh.mass[threadIdx.x] = m;
  }
  __syncthreads();
}

// top-k's support is the keys >= the returned threshold: the k largest,
// 0 < k < vocab. Radix select of the k-th largest key, stopping early once
// a whole bin is needed (its lower digits then do not matter).
__device__ Key TopKThreshold(const float* __restrict__ row, int vocab, int k,
                             Shared& sh) {
  Key prefix = 0;  // the digits chosen so far
  int need = k;    // keys still to take from the prefix's group
  for (int shift = kTopShift; shift >= 0; shift -= kDigitBits) {
    int count[kBins] = {};
    const double no_mass[kBins] = {};
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const Key key = MakeKey(row[i], i);
      if (!InGroup(key, prefix, shift)) continue;
      const int d = Digit(key, shift);
#pragma unroll
      for (int b = 0; b < kBins; ++b) count[b] += d == b;
    }
    ReduceBins<false>(count, no_mass, sh);
    int above = 0, b = kBins - 1;
    while (b > 0 && above + sh.count[b] < need) above += sh.count[b--];
    need -= above;
    prefix = (prefix << kDigitBits) | static_cast<Key>(b);
    if (sh.count[b] == need) return prefix << shift;
  }
  return prefix;  // not reached: at the last digit a bin holds one key
}

// top-p over the support (keys >= thr, positive weight; `target` = top_p *
// its mass): the largest key t such that the support's mass at keys >= t
// is >= target, i.e. the host's smallest descending prefix reaching top_p.
// Radix select by mass; the counts are of positive-weight keys, and a bin
// holding just one of them ends the search (its zero-weight neighbours
// stay in the support with probability 0). Returns max(thr, t) and, in
// *kept, the mass of the keys >= it.
__device__ Key TopPThreshold(const float* __restrict__ row, int vocab, Key thr,
                             float max_logit, double inv_t, double target,
                             double* kept, Shared& sh) {
  Key prefix = 0;
  double above = 0.0;  // support mass at keys above the prefix's group
  for (int shift = kTopShift; shift >= 0; shift -= kDigitBits) {
    int count[kBins] = {};
    double mass[kBins] = {};
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float logit = row[i];
      const Key key = MakeKey(logit, i);
      if (key < thr || !InGroup(key, prefix, shift)) continue;
      const double w = Weight(logit, max_logit, inv_t);
      if (!(w > 0.0)) continue;
      const int d = Digit(key, shift);
#pragma unroll
      for (int b = 0; b < kBins; ++b) {
        count[b] += d == b;
        mass[b] += d == b ? w : 0.0;  // + 0.0 is exact
      }
    }
    ReduceBins<true>(count, mass, sh);
    double cum = above;
    int chosen = -1;
    for (int b = kBins - 1; b >= 0; --b) {
      if (sh.count[b] == 0) continue;
      if (cum + sh.mass[b] >= target) {
        chosen = b;
        break;
      }
      cum += sh.mass[b];
    }
    if (chosen < 0) {
      // Rounding left the group just short of target: keep all of it (at
      // the top digit, everything, as the host does).
      *kept = cum;
      const Key floor = shift == kTopShift ? 0 : prefix << (shift + kDigitBits);
      return floor > thr ? floor : thr;
    }
    above = cum;
    prefix = (prefix << kDigitBits) | static_cast<Key>(chosen);
    if (sh.count[chosen] == 1) {
      *kept = cum + sh.mass[chosen];
      const Key t = prefix << shift;
      return t > thr ? t : thr;
    }
  }
  *kept = above;  // not reached: at the last digit a bin holds one key
  return thr;
}

// Exclusive prefix sum of `v` over the threads in thread order, and the
// block total in *total (the same in every thread). Deterministic.
__device__ double BlockExclusiveScan(double v, double* total, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(~0u, incl, o);
    if (lane >= o) incl += n;
  }
  double excl = __shfl_up_sync(~0u, incl, 1);
  if (lane == 0) excl = 0.0;
  __syncthreads();
  if (lane == 31) sh.dscratch[warp] = incl;
  __syncthreads();
  double base = 0.0, all = 0.0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) base = all;
    all += sh.dscratch[w];
  }
  *total = all;
  return base + excl;
}

// The smallest key of a logit >= max + T ln(min_p) (computed in double, as
// MinPLogitThreshold): the float cut-off f is the least float whose double
// is >= the threshold, so for a float x, x >= f exactly when the host keeps
// x; every id of logit f passes (id bits 0).
__device__ __forceinline__ Key MinPKey(float max_logit, float temperature,
                                       float min_p) {
  const double t = static_cast<double>(max_logit) +
                   static_cast<double>(temperature) *
                       log(static_cast<double>(min_p));
  float f = static_cast<float>(t);
  if (static_cast<double>(f) < t) f = nextafterf(f, INFINITY);
  return static_cast<Key>(OrderedBits(f)) << 32;
}

// The row's p = ComputeDistribution(row, params), one id at a time.
struct RowDist {
  const float* row;
  float max_logit;
  double inv_t;
  Key thr = 0;            // support: keys >= thr
  double inv_kept = 1.0;  // 1 / the support's mass
  bool degenerate;        // no finite logit: the host's {(0, 1)}

  __device__ float Prob(int i) const {
    if (degenerate) return i == 0 ? 1.f : 0.f;
    const float logit = row[i];
    if (MakeKey(logit, i) < thr) return 0.f;
    // A weight too small for a float probability gives 0, as on the host.
    return static_cast<float>(Weight(logit, max_logit, inv_t) * inv_kept);
  }
};

__global__ void __launch_bounds__(kThreads)
    SampleRowsKernel(const SampleRowsArgs a) {
  __shared__ Shared sh;
  const int tid = threadIdx.x;
  const int r = blockIdx.x;
  const int vocab = a.vocab;
  const float* __restrict__ row =
      a.logits + static_cast<size_t>(a.logit_row[r]) * vocab;
  const int top_k = a.top_k[r];
  const float top_p = a.top_p[r];
  const float min_p = a.min_p != nullptr ? a.min_p[r] : 0.f;
  const int draft = a.draft_id != nullptr ? a.draft_id[r] : -1;
  const double u_accept = a.uniforms[2 * static_cast<size_t>(r)];
  const double u_sample = a.uniforms[2 * static_cast<size_t>(r) + 1];

  // The largest key: the max logit (NaN as -inf), the lowest id of ties.
  Key best = 0;
  for (int i = tid; i < vocab; i += kThreads) {
    const Key key = MakeKey(row[i], i);
    if (key > best) best = key;
  }
  best = BlockReduce(best, MaxOp(), Key{0}, sh.kscratch);

  RowDist dist;
  dist.row = row;
  dist.max_logit = FromOrderedBits(static_cast<uint32_t>(best >> 32));
  dist.inv_t = 1.0 / static_cast<double>(a.temperature[r]);
  dist.degenerate = dist.max_logit == -INFINITY;
  if (!dist.degenerate) {
    if (top_k > 0 && top_k < vocab) {
      dist.thr = TopKThreshold(row, vocab, top_k, sh);
    }
    // min_p and top-k each keep a prefix of the key order: the support is
    // the shorter one.
    if (min_p > 0.f) {
      const Key cut = MinPKey(dist.max_logit, a.temperature[r], min_p);
      if (cut > dist.thr) dist.thr = cut;
    }
    double total = 0.0;
    for (int i = tid; i < vocab; i += kThreads) {
      const float logit = row[i];
      if (MakeKey(logit, i) >= dist.thr) {
        total += Weight(logit, dist.max_logit, dist.inv_t);
      }
    }
    total = BlockSumD(total, sh.dscratch);
    double kept = total;
    if (top_p < 1.f) {
      dist.thr = TopPThreshold(row, vocab, dist.thr, dist.max_logit, dist.inv_t,
                               static_cast<double>(top_p) * total, &kept, sh);
    }
    dist.inv_kept = 1.0 / kept;
  }

  // The draft test: accept iff u_accept * q(x) < p(x).
  const int q_begin = draft >= 0 ? a.q_offsets[r] : 0;
  const int q_end = draft >= 0 ? a.q_offsets[r + 1] : 0;
  if (draft >= 0) {
    if (tid == 0) sh.q_draft = 0.f;
    __syncthreads();
    for (int j = q_begin + tid; j < q_end; j += kThreads) {
      if (a.q_ids[j] == draft) sh.q_draft = a.q_probs[j];  // ids distinct
    }
    __syncthreads();
    const double q_x = sh.q_draft;
    const double p_x = draft < vocab ? dist.Prob(draft) : 0.0;
    if (u_accept * q_x < p_x) {
      if (tid == 0) {
        a.token[r] = -1;
        a.accepted[r] = 1;
      }
      return;  // the whole block: the test is uniform
    }
  }

  // The draw's masses, by id, in this row's scratch: p, or the residual
  // max(0, p - q) (float, as the host subtracts) after a rejection.
  float* __restrict__ mass =
      static_cast<float*>(a.scratch) + static_cast<size_t>(r) * vocab;
  for (int i = tid; i < vocab; i += kThreads) mass[i] = dist.Prob(i);
  __syncthreads();  // global writes are visible to the block after this
  if (draft >= 0) {
    for (int j = q_begin + tid; j < q_end; j += kThreads) {
      const int id = a.q_ids[j];
      if (id < 0 || id >= vocab) continue;
      const float d = mass[id] - a.q_probs[j];
      mass[id] = d > 0.f ? d : 0.f;
    }
    __syncthreads();
  }

  // Inverse CDF in ascending id order: each thread owns a contiguous chunk
  // of ids; its chunk's cumulative start comes from a scan over threads.
  const int chunk = (vocab + kThreads - 1) / kThreads;
  const int lo = min(vocab, tid * chunk);
  const int hi = min(vocab, lo + chunk);
  double chunk_mass = 0.0;
  for (int i = lo; i < hi; ++i) chunk_mass += mass[i];
  double total = 0.0;
  double start = BlockExclusiveScan(chunk_mass, &total, sh);
  if (draft >= 0 && !(total > 0.0)) {
    // p <= q everywhere: the residual is empty and the host samples p.
    // (Every thread has read its chunk: the scan synchronised.)
    for (int j = q_begin + tid; j < q_end; j += kThreads) {
      const int id = a.q_ids[j];
      if (id >= 0 && id < vocab) mass[id] = dist.Prob(id);
    }
    __syncthreads();
    chunk_mass = 0.0;
    for (int i = lo; i < hi; ++i) chunk_mass += mass[i];
    start = BlockExclusiveScan(chunk_mass, &total, sh);
  }
  const double target = u_sample * total;
  double cum = start;
  int found = INT_MAX, last = -1;
  for (int i = lo; i < hi; ++i) {
    const float m = mass[i];
    if (!(m > 0.f)) continue;
    cum += m;
    last = i;
    if (cum > target) {
      found = i;
      break;
    }
  }
  // The lowest id past target; if rounding put target past every
  // cumulative sum, the highest id with mass (no thread stopped early).
  found = BlockReduce(found, MinOp(), INT_MAX, sh.iscratch);
  last = BlockReduce(last, MaxOp(), -1, sh.iscratch);
  if (tid == 0) {
    a.token[r] = found != INT_MAX ? found : (last >= 0 ? last : KeyId(best));
    a.accepted[r] = 0;
  }
}

// One block per logit row; a row's edits touch distinct ids, so its
// threads never write one logit twice.
__global__ void ApplyLogitEditsKernel(float* logits, int vocab,
                                      const int* offsets,
                                      const LogitEdit* edits) {
  const int r = blockIdx.x;
  float* row = logits + static_cast<size_t>(r) * vocab;
  const int end = offsets[r + 1];
  for (int i = offsets[r] + threadIdx.x; i < end; i += blockDim.x) {
    const LogitEdit e = edits[i];
    if (e.id >= 0 && e.id < vocab) row[e.id] = ApplyLogitEdit(row[e.id], e);
  }
}

// Grid (word blocks, rows): one thread per mask word, its cleared bits'
// logits set to -inf.
__global__ void ApplyTokenMasksKernel(float* logits, int vocab,
                                      const int* mask_of_row,
                                      const uint32_t* allowed, int words) {
  const int r = blockIdx.y;
  const int w = blockIdx.x * blockDim.x + threadIdx.x;
  const int mask = mask_of_row[r];
  if (mask < 0 || w >= words) return;
  const uint32_t bits = allowed[static_cast<size_t>(mask) * words + w];
  if (bits == ~0u) return;  // a word of allowed ids (inside strings: most)
  float* row = logits + static_cast<size_t>(r) * vocab;
  for (int b = 0; b < 32; ++b) {
    const int id = w * 32 + b;
    if (!((bits >> b) & 1u) && id < vocab) row[id] = -__builtin_huge_valf();
  }
}

}  // namespace

cudaError_t ApplyTokenMasks(float* logits, int vocab, int num_rows,
                            const int* mask_of_row, const uint32_t* allowed,
                            int words, cudaStream_t stream) {
  if (vocab <= 0 || num_rows < 0 || words != (vocab + 31) / 32) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (logits == nullptr || mask_of_row == nullptr || allowed == nullptr) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 128;
  SPECSERVE_LAUNCH(dim3((words + kThreads - 1) / kThreads, num_rows), kThreads,
                   0, stream, ApplyTokenMasksKernel)(logits, vocab,
                                                     mask_of_row, allowed,
                                                     words);
  return cudaGetLastError();
}

cudaError_t ApplyLogitEdits(float* logits, int vocab, int num_rows,
                            const int* offsets, const LogitEdit* edits,
                            cudaStream_t stream) {
  if (vocab <= 0 || num_rows < 0) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  if (logits == nullptr || offsets == nullptr || edits == nullptr) {
    return cudaErrorInvalidValue;
  }
  SPECSERVE_LAUNCH(num_rows, 128, 0, stream, ApplyLogitEditsKernel)(
      logits, vocab, offsets, edits);
  return cudaGetLastError();
}

size_t SampleRowsScratchBytes(int num_rows, int vocab) {
  if (num_rows <= 0 || vocab <= 0) return 0;
  return static_cast<size_t>(num_rows) * static_cast<size_t>(vocab) *
         sizeof(float);
}

cudaError_t SampleRows(const SampleRowsArgs& args, cudaStream_t stream) {
  // All checks before any CUDA call, so they hold on machines without a GPU.
  if (args.vocab <= 0 || args.num_rows < 0) return cudaErrorInvalidValue;
  if (args.num_rows == 0) return cudaSuccess;
  if (args.logits == nullptr || args.logit_row == nullptr ||
      args.temperature == nullptr || args.top_k == nullptr ||
      args.top_p == nullptr || args.uniforms == nullptr ||
      args.scratch == nullptr || args.token == nullptr ||
      args.accepted == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (args.draft_id != nullptr &&
      (args.q_offsets == nullptr || args.q_ids == nullptr ||
       args.q_probs == nullptr)) {
    return cudaErrorInvalidValue;
  }
  SPECSERVE_LAUNCH(args.num_rows, kThreads, 0, stream, SampleRowsKernel)(args);
  return cudaGetLastError();
}

}  // namespace cuda_kernels
}  // namespace specserve
