// Causal grouped-query attention over the device KV cache (see kernels.h):
// a tensor-core FlashAttention-2 style kernel for prefill batches and a
// split-K (flash-decoding) kernel for decode / verify rows and head
// dimensions the tensor-core kernel does not cover.

#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/cuda/attention_layout.h"
#include "common/cuda/cuda_types.cuh"
#include "common/cuda/kernels.h"
#include "common/cuda/launch.cuh"

namespace specserve {
namespace cuda_kernels {
namespace {

using cuda_detail::CeilDiv;
using cuda_detail::FromF32;
using cuda_detail::ToF32;

constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------
// Split-K attention. Block = 128 threads = 16 queries x 8 threads. A
// "query" is one (row, head) pair of a kv head's group, flattened as
// row * group + head_in_group, so decode (1 row, 4 heads of a group) and
// verify rows share each K/V tile the block loads. Thread (qi, sub) owns
// keys sub, sub + 8, ... of each tile for the scores and dimensions sub,
// sub + 8, ... of the output.
// ---------------------------------------------------------------------------
constexpr int kSkQueries = 16;
constexpr int kSkThreads = 128;
constexpr int kSkMaxDims = 32;  // per thread: head_dim <= 256
constexpr int kSkMaxKeysPerThread = 4;

int SkKeyTile(int head_dim) {
  return head_dim <= 128 ? 32 : 8;  // keeps shared memory under 48 KB
}

// Padding of the shared-memory Q and K rows, in floats: the split-K
// kernel's 1 keeps its scalar reads conflict-free; the batched kernel's 4
// also keeps its rows 16-byte aligned for float4 reads.
constexpr int kSkRowPad = 1;
constexpr int kBaRowPad = 4;

// Dynamic shared memory of the split-K / batched tile: Q [16][D + pad],
// K [KT][D + pad], V [KT][D], P [16][KT] floats.
size_t TileSmemBytes(int head_dim, int row_pad) {
  const size_t kt = SkKeyTile(head_dim);
  const size_t ld = static_cast<size_t>(head_dim) + row_pad;
  return sizeof(float) * (kSkQueries * ld + kt * ld +
                          kt * static_cast<size_t>(head_dim) + kSkQueries * kt);
}

// Whether tree attention lets `row` see the key at cache index `key`
// (AttentionArgs::tree_start / tree_mask; null = causal only).
__device__ __forceinline__ bool TreeVisible(const int* start,
                                            const unsigned long long* mask,
                                            int row, int key) {
  if (start == nullptr) return true;
  const int off = key - start[row];
  if (off < 0 || off >= 64) return true;
  return (mask[row] >> off) & 1ull;
}

// Physical cache row of logical slot t (identity for a contiguous cache).
__device__ __forceinline__ size_t PhysSlot(const AttentionArgs& a, int t) {
  if (a.block_table == nullptr) return static_cast<size_t>(t);
  return static_cast<size_t>(a.block_table[t / a.block_size]) * a.block_size +
         t % a.block_size;
}

// The pieces the split-K and batched tiles share. Thread (qi, sub) = query
// slot qi of the tile, lane sub of the query's 8 consecutive lanes.

// Q tile: row i of Qs (stride ld floats) = flat query q0 + i of kv head g
// (flat = row * group + head in group; q is [rows, H, D]), pre-scaled by
// scale * log2(e) for exp2; zero rows past nq.
template <typename T>
__device__ __forceinline__ void LoadQueryTile(const T* q, float* Qs, int ld,
                                              int q0, int nq, int group,
                                              int g, int H, int D,
                                              float scale) {
  for (int idx = threadIdx.x; idx < kSkQueries * D; idx += blockDim.x) {
    const int i = idx / D, d = idx % D;
    const int f = q0 + i;
    float v = 0.0f;
    if (f < nq) {
      const int rr = f / group, hh = g * group + f % group;
      v = ToF32<T>(q[(static_cast<size_t>(rr) * H + hh) * D + d]) * scale *
          kLog2e;
    }
    Qs[i * ld + d] = v;
  }
}

// One key tile of the online softmax (FlashAttention-2, base 2) for a
// query's 8 lanes. In: sc, this lane's scores of keys sub + 8t (-inf where
// masked), and tmax, their max. Takes the max over the 8 lanes, turns sc
// into exp2(sc - m_new), stores it at p_row[sub + 8t] (for sub + 8t < KT),
// updates the running max m and sum l, and rescales acc by exp2(m - m_new).
template <int kDims>
__device__ __forceinline__ void OnlineSoftmaxStep(
    float (&sc)[kSkMaxKeysPerThread], float tmax, int sub, int KT,
    float* p_row, float& m, float& l, float (&acc)[kDims]) {
  // The 8 lanes of a query are 8 consecutive lanes of one warp.
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
  const float m_new = fmaxf(m, tmax);
  float alpha = 1.0f, psum = 0.0f;
  if (m_new != -INFINITY) {
    alpha = exp2f(m - m_new);  // 0 when m is still -inf
#pragma unroll
    for (int t = 0; t < kSkMaxKeysPerThread; ++t) {
      sc[t] = exp2f(sc[t] - m_new);  // 0 for masked keys
      psum += sc[t];
    }
  } else {
#pragma unroll
    for (int t = 0; t < kSkMaxKeysPerThread; ++t) sc[t] = 0.0f;
  }
  psum += __shfl_xor_sync(0xffffffffu, psum, 4);
  psum += __shfl_xor_sync(0xffffffffu, psum, 2);
  psum += __shfl_xor_sync(0xffffffffu, psum, 1);
  l = l * alpha + psum;
  m = m_new;
#pragma unroll
  for (int t = 0; t < kSkMaxKeysPerThread; ++t) {
    const int j = sub + 8 * t;
    if (j < KT) p_row[j] = sc[t];
  }
#pragma unroll
  for (int jj = 0; jj < kDims; ++jj) acc[jj] *= alpha;
}

// acc[jj] += sum over the tile's nk keys j of p_row[j] * V[j][sub + 8 jj]
// (Vs is [KT][D]); p_row was written by the query's other lanes.
template <int kDims>
__device__ __forceinline__ void AccumulateValues(const float* p_row,
                                                 const float* Vs, int nk,
                                                 int D, int sub,
                                                 float (&acc)[kDims]) {
  __syncwarp();
  for (int j = 0; j < nk; ++j) {
    const float p = p_row[j];
    const float* vr = Vs + j * D;
#pragma unroll
    for (int jj = 0; jj < kDims; ++jj) {
      const int d = sub + 8 * jj;
      if (d < D) acc[jj] = fmaf(p, vr[d], acc[jj]);
    }
  }
}

// One split's partial result of a (row, head) at entry idx: its running
// max and sum (lane 0) and its unnormalised output.
template <int kDims>
__device__ __forceinline__ void StorePartial(size_t idx, float m, float l,
                                             const float (&acc)[kDims],
                                             int sub, int D, float* part_o,
                                             float* part_m, float* part_l) {
  if (sub == 0) {
    part_m[idx] = m;
    part_l[idx] = l;
  }
#pragma unroll
  for (int jj = 0; jj < kDims; ++jj) {
    const int d = sub + 8 * jj;
    if (d < D) part_o[idx * D + d] = acc[jj];
  }
}

template <typename T>
__global__ void __launch_bounds__(kSkThreads)
    SplitKAttentionKernel(AttentionArgs a, int keys_per_split, int key_tile,
                          float* __restrict__ part_o,
                          float* __restrict__ part_m,
                          float* __restrict__ part_l) {
  SPECSERVE_DYNAMIC_SHARED(float, sk_smem);
  const int D = a.head_dim, H = a.num_heads, KV = a.num_kv_heads;
  const int group = H / KV;
  const int n = a.n, first = a.first;
  const int nq = n * group;  // queries of this kv head
  const int g = blockIdx.y, s = blockIdx.z;
  const int q0 = blockIdx.x * kSkQueries;
  const int KT = key_tile;
  float* Qs = sk_smem;                          // [16][D + kSkRowPad]
  float* Ks = Qs + kSkQueries * (D + kSkRowPad);  // [KT][D + kSkRowPad]
  float* Vs = Ks + KT * (D + kSkRowPad);          // [KT][D]
  float* Ps = Vs + KT * D;                           // [16][KT]
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);

  const int qi = threadIdx.x >> 3, sub = threadIdx.x & 7;
  const int flat = q0 + qi;
  const bool valid = flat < nq;
  const int r = valid ? flat / group : 0;
  const int h = g * group + (valid ? flat % group : 0);
  const int qslot = first + r;

  // Keys any query of the tile may see: [0, first + last row + 1).
  const int last_flat = min(nq, q0 + kSkQueries) - 1;
  const int kmax = first + last_flat / group + 1;
  const int ks = s * keys_per_split;
  const int ke = min(ks + keys_per_split, kmax);

  LoadQueryTile(q, Qs, D + kSkRowPad, q0, nq, group, g, H, D, a.scale);

  float acc[kSkMaxDims];
#pragma unroll
  for (int j = 0; j < kSkMaxDims; ++j) acc[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  for (int k0 = ks; k0 < ke; k0 += KT) {
    const int nk = min(KT, ke - k0);
    __syncthreads();  // previous tile fully consumed (and Q stored)
    for (int idx = threadIdx.x; idx < KT * D; idx += blockDim.x) {
      const int j = idx / D, d = idx % D;
      float kv = 0.0f, vv = 0.0f;
      if (j < nk) {
        const size_t src = (PhysSlot(a, k0 + j) * KV + g) * D + d;
        kv = ToF32<T>(kc[src]);
        vv = ToF32<T>(vc[src]);
      }
      Ks[j * (D + kSkRowPad) + d] = kv;
      Vs[j * D + d] = vv;
    }
    __syncthreads();

    float sc[kSkMaxKeysPerThread];
    float tmax = -INFINITY;
#pragma unroll
    for (int t = 0; t < kSkMaxKeysPerThread; ++t) {
      const int j = sub + 8 * t;
      float x = -INFINITY;
      if (j < KT && valid && j < nk && k0 + j <= qslot &&
          TreeVisible(a.tree_start, a.tree_mask, r, k0 + j)) {
        const float* qr = Qs + qi * (D + kSkRowPad);
        const float* kr = Ks + j * (D + kSkRowPad);
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot = fmaf(qr[d], kr[d], dot);
        x = dot;
      }
      sc[t] = x;
      tmax = fmaxf(tmax, x);
    }
    OnlineSoftmaxStep(sc, tmax, sub, KT, Ps + qi * KT, m, l, acc);
    AccumulateValues(Ps + qi * KT, Vs, nk, D, sub, acc);
  }

  if (!valid) return;
  StorePartial((static_cast<size_t>(s) * n + r) * H + h, m, l, acc, sub, D,
               part_o, part_m, part_l);
}

// Threads of a combine block: one split each for the maxima and sums
// (kBatchedAttentionMaxSplits and SplitKAttention's 64 at most), then the
// output's dims.
constexpr int kCombineThreads = 128;
static_assert(kBatchedAttentionMaxSplits <= kCombineThreads,
              "a combine thread per split");

// Merges the `splits` partial softmaxes of one (row, head) into `out`
// [D]: split s's max (base 2) and sum are part_m / part_l[base + s *
// stride], its unnormalised output part_o[(base + s * stride) * D, + D).
// Called by a whole block of kCombineThreads threads. The weights are
// computed once, a split a thread, into shared memory; the output loop then
// reads only part_o, loads independent of one another. (Each thread used to
// walk every split's max and sum three times, one dependent load after
// another. On an H200, 2026-11-29, a one-row launch with 64 splits took
// 52-55 us at 4K keys, whatever the head_dim: far more than its keys need.
// That walk is the likely cause; its share was not measured apart.)
template <typename T>
__device__ void MergeSplitPartials(int splits, size_t base, size_t stride,
                                   int D, const float* __restrict__ part_o,
                                   const float* __restrict__ part_m,
                                   const float* __restrict__ part_l,
                                   T* __restrict__ out) {
  __shared__ float scratch[32];
  __shared__ float weight[kCombineThreads];
  __shared__ float sums[kCombineThreads];
  const int t = threadIdx.x;
  const float ms = t < splits ? part_m[base + t * stride] : -INFINITY;
  const float mx = cuda_detail::BlockMax(ms, scratch);
  // A split that saw no visible key has max -inf and weighs nothing (its
  // part_o, loaded alongside, is never added).
  const float w = ms == -INFINITY ? 0.0f : exp2f(ms - mx);
  weight[t] = w;
  const float denom = cuda_detail::BlockSum(
      w > 0.0f ? part_l[base + t * stride] * w : 0.0f, scratch);
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  // BlockSum's barriers published `weight`.
  if (D >= kCombineThreads) {
    for (int d = t; d < D; d += kCombineThreads) {
      float o = 0.0f;
#pragma unroll 8
      for (int s = 0; s < splits; ++s) {
        const float x = part_o[(base + s * stride) * D + d];
        if (weight[s] > 0.0f) o = fmaf(x, weight[s], o);
      }
      out[d] = FromF32<T>(o * inv);
    }
    return;
  }
  // Fewer dims than threads: G groups of D threads take every G-th split.
  const int G = kCombineThreads / D;
  const int g = t / D, d = t % D;
  float o = 0.0f;
  if (g < G) {
#pragma unroll 4
    for (int s = g; s < splits; s += G) {
      const float x = part_o[(base + s * stride) * D + d];
      if (weight[s] > 0.0f) o = fmaf(x, weight[s], o);
    }
  }
  sums[t] = o;
  __syncthreads();
  if (t < D) {
    float sum = 0.0f;
    for (int k = 0; k < G; ++k) sum += sums[k * D + t];
    out[t] = FromF32<T>(sum * inv);
  }
}

// Merges the splits' partial softmaxes of one (row, head): block per pair.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    SplitKCombineKernel(int n, int num_heads, int head_dim, int num_splits,
                        const float* __restrict__ part_o,
                        const float* __restrict__ part_m,
                        const float* __restrict__ part_l,
                        T* __restrict__ out) {
  const size_t pair = blockIdx.x;  // r * H + h
  MergeSplitPartials(num_splits, pair, static_cast<size_t>(n) * num_heads,
                     head_dim, part_o, part_m, part_l,
                     out + pair * head_dim);
}

// ---------------------------------------------------------------------------
// Batched attention: the split-K kernel's tile (16 queries x 8 threads, a
// key tile in shared memory, fp32 online softmax) over a work list that
// spans every sequence of the step. Block (w, g): work item w = (sequence,
// query tile, key split), kv head g. The sequence's rows, cached length,
// block table, split size and partial offset come from its seq_info record
// (attention_layout.h).
// ---------------------------------------------------------------------------
static_assert(kBatchedAttentionQueryTile == kSkQueries,
              "the plan's query tile is the kernel's");
// 16-byte K and V loads each thread of BatchedAttentionKernel keeps in
// flight per round of a tile's load: a 32-key tile at head_dim 128 is 4
// rounds of 128 threads, so 4 covers it in one.
constexpr int kBaLoadsInFlight = 4;

// 4 blocks an SM (128 registers at most; ptxas uses them all for bf16 /
// fp16 at 4 loads in flight, no spills): the split plan's one wave
// (kBatchedAttentionSplitBlocksPerSm). It was 5, what the shared memory
// holds at head_dim 128 (TileSmemBytes, 43.8 KB), with 96 registers: 4
// loads in flight then spilled, and 2 spilled for fp16.
template <typename T, int kDims>
__global__ void __launch_bounds__(kSkThreads, 4)
    BatchedAttentionKernel(BatchedAttentionArgs a, int key_tile) {
  SPECSERVE_DYNAMIC_SHARED(float, ba_smem);
  // A graph's launch is sized to the capacity; the step's work is shorter.
  if (a.device_counts != nullptr && blockIdx.x >= a.device_counts[0]) return;
  const int D = a.head_dim, H = a.num_heads, KV = a.num_kv_heads;
  const int group = H / KV;
  const int* item = a.work + 3 * static_cast<size_t>(blockIdx.x);
  const int seq = item[0], tile = item[1], s = item[2];
  const int* info = a.seq_info + static_cast<size_t>(seq) * kSeqInfoFields;
  const int row0 = info[kSeqRowStart], n = info[kSeqRows];
  const int first = info[kSeqFirst];
  const int* table = a.block_tables + info[kSeqTableStart];
  const int splits = info[kSeqSplits];
  const int keys_per_split = info[kSeqKeysPerSplit];
  const int nq = n * group;
  const int g = blockIdx.y;
  const int q0 = tile * kSkQueries;
  const int KT = key_tile;
  const int bs = a.block_size;
  // Q and K rows padded to LD = D + kBaRowPad floats: 16-byte
  // aligned rows for the scores' float4 reads when D % 4 == 0, and 8
  // consecutive keys start 4 banks apart, so a quarter-warp's float4
  // reads of 8 keys touch distinct banks.
  const int LD = D + kBaRowPad;
  float* Qs = ba_smem;                               // [16][LD]
  float* Ks = Qs + kSkQueries * LD;                  // [KT][LD]
  float* Vs = Ks + KT * LD;                          // [KT][D]
  float* Ps = Vs + KT * D;                           // [16][KT]
  const T* q = static_cast<const T*>(a.q) + static_cast<size_t>(row0) * H * D;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);

  // Key groups: a tile with few queries (a decode row at GQA 4 fills 4 of
  // the 16 slots) would leave 3 of the 4 warps idle at every barrier while
  // one warp scores and sums the whole key tile; instead the 16 slots are
  // `kgroups` groups of the tile's queries, each group taking its own
  // share of the tile's keys with an online softmax of its own, merged
  // once at the end. ncu on an H200 (2026-11-29, one decode row, 32K
  // keys): 64% of the issue stalls were warps waiting at a barrier. Each
  // lane keeps at least one key of a group: KT / kgroups >= 8.
  const int tile_queries = min(kSkQueries, nq - q0);
  int kgroups = tile_queries <= 4 ? 4 : tile_queries <= 8 ? 2 : 1;
  kgroups = min(kgroups, KT / 8);
  const int qpg = kSkQueries / kgroups;  // query slots of a group
  const int kpg = KT / kgroups;          // keys of a tile a group takes
  const int slot = threadIdx.x >> 3, sub = threadIdx.x & 7;
  const int qi = slot % qpg, kg = slot / qpg;
  const int kbase = kg * kpg;
  const int flat = q0 + qi;
  const bool valid = flat < nq;
  const int r = valid ? flat / group : 0;
  const int h = g * group + (valid ? flat % group : 0);
  const int qslot = first + r;
  // Warp w holds slots 4w..4w+3, queries 4w % qpg and the next 3 of one
  // group. A warp whose queries all lie past the tile's skips the P V
  // loop: its sums are never written, and that loop is most of the
  // block's shared-memory reads.
  const bool warp_has_query =
      q0 + (4 * static_cast<int>(threadIdx.x >> 5)) % qpg < nq;

  const int last_flat = min(nq, q0 + kSkQueries) - 1;
  const int kmax = first + last_flat / group + 1;
  const int ks = s * keys_per_split;
  const int ke = min(ks + keys_per_split, kmax);

  LoadQueryTile(q, Qs, LD, q0, nq, group, g, H, D, a.scale);

  float acc[kDims];
#pragma unroll
  for (int j = 0; j < kDims; ++j) acc[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  // bf16 / fp16 K / V rows in 16-byte loads where every row starts 16-byte
  // aligned (head_dim a multiple of 8, aligned pools): decode is bound by
  // these reads, and one 16-byte load per thread keeps 8x the bytes of a
  // 2-byte load in flight. Other shapes and fp32 load element by element.
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const bool vec_rows =
      sizeof(T) == 2 && D % kVec == 0 &&
      ((reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc)) &
       15) == 0;
  for (int k0 = ks; k0 < ke; k0 += KT) {
    const int nk = min(KT, ke - k0);
    __syncthreads();  // previous tile fully consumed (and Q stored)
    if (vec_rows) {
      const int chunks = D / kVec;
      const int total = KT * chunks;
      // kBaLoadsInFlight loads of K and of V issued before any is used: a
      // block walks its keys tile by tile, so the tile's load latency is
      // paid once per round of this loop, not once per 16 bytes.
      for (int idx0 = threadIdx.x; idx0 < total;
           idx0 += kBaLoadsInFlight * blockDim.x) {
        uint4 kraw[kBaLoadsInFlight], vraw[kBaLoadsInFlight];
#pragma unroll
        for (int u = 0; u < kBaLoadsInFlight; ++u) {
          const int idx = idx0 + u * static_cast<int>(blockDim.x);
          const int j = idx / chunks, d0 = (idx % chunks) * kVec;
          kraw[u] = make_uint4(0, 0, 0, 0);
          vraw[u] = make_uint4(0, 0, 0, 0);
          if (idx < total && j < nk) {
            const int t = k0 + j;
            const size_t phys =
                static_cast<size_t>(table[t / bs]) * bs + t % bs;
            const size_t src = (phys * KV + g) * D + d0;
            kraw[u] = *reinterpret_cast<const uint4*>(kc + src);
            vraw[u] = *reinterpret_cast<const uint4*>(vc + src);
          }
        }
#pragma unroll
        for (int u = 0; u < kBaLoadsInFlight; ++u) {
          const int idx = idx0 + u * static_cast<int>(blockDim.x);
          if (idx >= total) break;
          const int j = idx / chunks, d0 = (idx % chunks) * kVec;
          // memcpy, not a pointer cast: the defined way to view the loaded
          // bits as T (registers after optimisation).
          T kvals[kVec], vvals[kVec];
          memcpy(kvals, &kraw[u], sizeof(kraw[u]));
          memcpy(vvals, &vraw[u], sizeof(vraw[u]));
          // Zero bits are 0.0 in every dtype: padding keys stay zero. Two
          // float4 stores a row each (rows and d0 are multiples of 4
          // floats): a quarter of the scalar stores' instructions.
#pragma unroll
          for (int e = 0; e < kVec; e += 4) {
            *reinterpret_cast<float4*>(Ks + j * LD + d0 + e) = make_float4(
                ToF32<T>(kvals[e]), ToF32<T>(kvals[e + 1]),
                ToF32<T>(kvals[e + 2]), ToF32<T>(kvals[e + 3]));
            *reinterpret_cast<float4*>(Vs + j * D + d0 + e) = make_float4(
                ToF32<T>(vvals[e]), ToF32<T>(vvals[e + 1]),
                ToF32<T>(vvals[e + 2]), ToF32<T>(vvals[e + 3]));
          }
        }
      }
    } else {
      for (int idx = threadIdx.x; idx < KT * D; idx += blockDim.x) {
        const int j = idx / D, d = idx % D;
        float kv = 0.0f, vv = 0.0f;
        if (j < nk) {
          const int t = k0 + j;
          const size_t phys =
              static_cast<size_t>(table[t / bs]) * bs + t % bs;
          const size_t src = (phys * KV + g) * D + d;
          kv = ToF32<T>(kc[src]);
          vv = ToF32<T>(vc[src]);
        }
        Ks[j * LD + d] = kv;
        Vs[j * D + d] = vv;
      }
    }
    __syncthreads();

    float sc[kSkMaxKeysPerThread];
    float tmax = -INFINITY;
#pragma unroll
    for (int t = 0; t < kSkMaxKeysPerThread; ++t) {
      // This lane's t-th key of its group: local index sub + 8t (its P
      // entry), tile key kbase + sub + 8t.
      const int j = kbase + sub + 8 * t;
      float x = -INFINITY;
      if (sub + 8 * t < kpg && valid && j < nk && k0 + j <= qslot &&
          TreeVisible(a.tree_start, a.tree_mask, row0 + r, k0 + j)) {
        const float* qr = Qs + qi * LD;
        const float* kr = Ks + j * LD;
        float dot = 0.0f;
        if (D % 4 == 0) {
          // A quarter of the shared-memory loads of the scalar loop, the
          // same sums in the same order.
          const float4* q4 = reinterpret_cast<const float4*>(qr);
          const float4* k4 = reinterpret_cast<const float4*>(kr);
          // Unrolled by 2: ptxas spilled at 1 and 4 (nvcc 13, sm_90).
#pragma unroll 2
          for (int c = 0; c < D / 4; ++c) {
            const float4 qv = q4[c], kv = k4[c];
            dot = fmaf(qv.x, kv.x, dot);
            dot = fmaf(qv.y, kv.y, dot);
            dot = fmaf(qv.z, kv.z, dot);
            dot = fmaf(qv.w, kv.w, dot);
          }
        } else {
          for (int d = 0; d < D; ++d) dot = fmaf(qr[d], kr[d], dot);
        }
        x = dot;
      }
      sc[t] = x;
      tmax = fmaxf(tmax, x);
    }
    OnlineSoftmaxStep(sc, tmax, sub, kpg, Ps + slot * KT, m, l, acc);
    if (warp_has_query) {
      AccumulateValues(Ps + slot * KT, Vs + kbase * D,
                       max(0, min(kpg, nk - kbase)), D, sub, acc);
    }
  }

  if (kgroups > 1) {
    // Merge the groups' (max, sum, output) of each query into group 0's
    // lanes, through the K tile's shared memory (KT * LD >= 2 * 16 + 16 *
    // D floats at KT = 32).
    __syncthreads();  // every warp is done with the tiles
    float* Mx = Ks;                 // [16] group maxima, base 2
    float* Lx = Mx + kSkQueries;    // [16] sums
    float* Ax = Lx + kSkQueries;    // [16][D] unnormalised outputs
    if (sub == 0) {
      Mx[slot] = m;
      Lx[slot] = l;
    }
#pragma unroll
    for (int jj = 0; jj < kDims; ++jj) {
      const int d = sub + 8 * jj;
      if (d < D) Ax[slot * D + d] = acc[jj];
    }
    __syncthreads();
    if (kg != 0) return;
    float mm = -INFINITY;
    for (int k2 = 0; k2 < kgroups; ++k2) mm = fmaxf(mm, Mx[qi + k2 * qpg]);
    float ll = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kDims; ++jj) acc[jj] = 0.0f;
    for (int k2 = 0; k2 < kgroups; ++k2) {
      const int sl = qi + k2 * qpg;
      // A group that saw no visible key has max -inf and adds nothing.
      const float w = Mx[sl] == -INFINITY ? 0.0f : exp2f(Mx[sl] - mm);
      ll += Lx[sl] * w;
#pragma unroll
      for (int jj = 0; jj < kDims; ++jj) {
        const int d = sub + 8 * jj;
        if (d < D) acc[jj] = fmaf(Ax[sl * D + d], w, acc[jj]);
      }
    }
    m = mm;
    l = ll;
  }

  if (!valid) return;
  if (splits == 1) {  // the whole context: normalise and store
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    T* out = static_cast<T*>(a.out) +
             (static_cast<size_t>(row0 + r) * H + h) * D;
#pragma unroll
    for (int jj = 0; jj < kDims; ++jj) {
      const int d = sub + 8 * jj;
      if (d < D) out[d] = FromF32<T>(acc[jj] * inv);
    }
    return;
  }
  float* part_o = static_cast<float*>(a.workspace);
  float* part_m = part_o + a.partial_triples * D;
  float* part_l = part_m + a.partial_triples;
  StorePartial(static_cast<size_t>(info[kSeqPartialStart]) +
                   (static_cast<size_t>(s) * n + r) * H + h,
               m, l, acc, sub, D, part_o, part_m, part_l);
}

// Merges the split partials of one (row, query head) of a split sequence:
// block (c, h) for combine entry c = (global row, sequence).
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    BatchedCombineKernel(BatchedAttentionArgs a) {
  if (a.device_counts != nullptr && blockIdx.x >= a.device_counts[1]) return;
  const int row = a.combine[2 * blockIdx.x];
  const int seq = a.combine[2 * blockIdx.x + 1];
  const int h = blockIdx.y;
  const int H = a.num_heads, D = a.head_dim;
  const int* info = a.seq_info + static_cast<size_t>(seq) * kSeqInfoFields;
  const int n = info[kSeqRows], splits = info[kSeqSplits];
  const int r = row - info[kSeqRowStart];
  const float* part_o = static_cast<const float*>(a.workspace);
  const float* part_m = part_o + a.partial_triples * D;
  const float* part_l = part_m + a.partial_triples;
  const size_t base = static_cast<size_t>(info[kSeqPartialStart]) +
                      static_cast<size_t>(r) * H + h;
  MergeSplitPartials(splits, base, static_cast<size_t>(n) * H, D, part_o,
                     part_m, part_l,
                     static_cast<T*>(a.out) +
                         (static_cast<size_t>(row) * H + h) * D);
}

// ---------------------------------------------------------------------------
// FlashAttention (tensor cores). Block = 4 warps = 64 query rows of ONE
// head; each warp owns 16 rows. Per 64-key tile: S = Q K^T (WMMA 16x16x16,
// fp32 accumulators) into a per-warp fp32 scratch, online softmax by the
// warp (lane = row * 2 + half: half a row's 64 columns), P stored as T,
// then P V (WMMA) into the same scratch and folded into the lane's fp32
// output registers (its row, half of head_dim).
// ---------------------------------------------------------------------------
namespace wmma = nvcuda::wmma;

constexpr int kFaRows = 64;
constexpr int kFaKeys = 64;
constexpr int kFaThreads = 128;

template <typename T, int D>
struct FaLayout {
  static constexpr int kLdT = D + 8;  // Q/K/V rows (T): 16-byte padding
  static constexpr int kSW = D > kFaKeys ? D : kFaKeys;
  static constexpr int kLdS = kSW + 4;     // fp32 scratch rows
  static constexpr int kLdP = kFaKeys + 8;  // P rows (T)
  static constexpr size_t kTileBytes = sizeof(T) * kFaRows * kLdT;
  static constexpr size_t kScratchBytes = sizeof(float) * 4 * 16 * kLdS;
  static constexpr size_t kPBytes = sizeof(T) * 4 * 16 * kLdP;
  static constexpr size_t kBytes = 3 * kTileBytes + kScratchBytes + kPBytes;
  // WMMA pointers must be 32-byte aligned: every region and every 16-row /
  // 16-column fragment offset is a multiple of 32 bytes.
  static_assert(kTileBytes % 32 == 0 && kScratchBytes % 32 == 0, "align");
  static_assert((16 * kLdT * sizeof(T)) % 32 == 0, "align");
  static_assert((16 * kLdS * sizeof(float)) % 32 == 0, "align");
  static_assert((16 * kLdP * sizeof(T)) % 32 == 0, "align");
};

template <typename T, int D>
__global__ void __launch_bounds__(kFaThreads)
    FlashAttentionKernel(AttentionArgs a) {
  using L = FaLayout<T, D>;
  SPECSERVE_DYNAMIC_SHARED(unsigned char, fa_smem);
  T* Qs = reinterpret_cast<T*>(fa_smem);
  T* Ks = Qs + kFaRows * L::kLdT;
  T* Vs = Ks + kFaRows * L::kLdT;
  float* Sall = reinterpret_cast<float*>(Vs + kFaRows * L::kLdT);
  T* Pall = reinterpret_cast<T*>(Sall + 4 * 16 * L::kLdS);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* Sw = Sall + warp * 16 * L::kLdS;
  T* Pw = Pall + warp * 16 * L::kLdP;
  const int H = a.num_heads, KV = a.num_kv_heads, n = a.n, first = a.first;
  const int h = blockIdx.y, g = h / (H / KV);
  const int q0 = blockIdx.x * kFaRows;
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  constexpr int kVec = D / 8;  // 16-byte vectors per row

  for (int idx = threadIdx.x; idx < kFaRows * kVec; idx += kFaThreads) {
    const int r = idx / kVec, c = (idx % kVec) * 8;
    const int i = q0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (i < n) {
      v = *reinterpret_cast<const uint4*>(
          q + (static_cast<size_t>(i) * H + h) * D + c);
    }
    *reinterpret_cast<uint4*>(Qs + r * L::kLdT + c) = v;
  }

  const int row = lane >> 1, half = lane & 1;
  const int qi = q0 + warp * 16 + row;
  const bool row_valid = qi < n;
  const int qslot = first + qi;
  const float sl2 = a.scale * kLog2e;
  // Keys the block needs, and those this warp's rows can see.
  const int kend = first + min(n, q0 + kFaRows);
  const int warp_kend = first + min(n, q0 + warp * 16 + 16);

  float o[D / 2];
#pragma unroll
  for (int d = 0; d < D / 2; ++d) o[d] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  for (int k0 = 0; k0 < kend; k0 += kFaKeys) {
    __syncthreads();  // previous tile consumed; Q stored on the first pass
    for (int idx = threadIdx.x; idx < kFaKeys * kVec; idx += kFaThreads) {
      const int j = idx / kVec, c = (idx % kVec) * 8;
      const int slot = k0 + j;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (slot < kend) {
        const size_t src = (PhysSlot(a, slot) * KV + g) * D + c;
        kv = *reinterpret_cast<const uint4*>(kc + src);
        vv = *reinterpret_cast<const uint4*>(vc + src);
      }
      *reinterpret_cast<uint4*>(Ks + j * L::kLdT + c) = kv;
      *reinterpret_cast<uint4*>(Vs + j * L::kLdT + c) = vv;
    }
    __syncthreads();
    if (k0 >= warp_kend) continue;  // warp-uniform: tile after all its rows

    // S = Q K^T for the warp's 16 rows x 64 keys.
#pragma unroll
    for (int nt = 0; nt < kFaKeys / 16; ++nt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> sacc;
      wmma::fill_fragment(sacc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + warp * 16 * L::kLdT + kk * 16,
                               L::kLdT);
        // K tile is [key][d] row-major = K^T column-major.
        wmma::load_matrix_sync(fb, Ks + nt * 16 * L::kLdT + kk * 16, L::kLdT);
        wmma::mma_sync(sacc, fa, fb, sacc);
      }
      wmma::store_matrix_sync(Sw + nt * 16, sacc, L::kLdS,
                              wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of this lane's half row (32 columns), log2 domain.
    float p[32];
    float tmax = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = half * 32 + c;
      const bool ok = row_valid && (k0 + col) <= qslot &&
                      TreeVisible(a.tree_start, a.tree_mask, qi, k0 + col);
      p[c] = ok ? Sw[row * L::kLdS + col] * sl2 : -INFINITY;
      tmax = fmaxf(tmax, p[c]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    const float m_new = fmaxf(m, tmax);
    float alpha = 1.0f, psum = 0.0f;
    if (m_new != -INFINITY) {
      alpha = exp2f(m - m_new);
#pragma unroll
      for (int c = 0; c < 32; ++c) {
        p[c] = exp2f(p[c] - m_new);
        psum += p[c];
      }
    } else {
#pragma unroll
      for (int c = 0; c < 32; ++c) p[c] = 0.0f;
    }
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    l = l * alpha + psum;
    m = m_new;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      Pw[row * L::kLdP + half * 32 + c] = FromF32<T>(p[c]);
    }
#pragma unroll
    for (int d = 0; d < D / 2; ++d) o[d] *= alpha;
    __syncwarp();

    // O += P V: 16 rows x D, reusing the fp32 scratch.
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> pacc;
      wmma::fill_fragment(pacc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < kFaKeys / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb;
        wmma::load_matrix_sync(pa, Pw + kk * 16, L::kLdP);
        wmma::load_matrix_sync(vb, Vs + kk * 16 * L::kLdT + dt * 16, L::kLdT);
        wmma::mma_sync(pacc, pa, vb, pacc);
      }
      wmma::store_matrix_sync(Sw + dt * 16, pacc, L::kLdS,
                              wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int d = 0; d < D / 2; ++d) {
      o[d] += Sw[row * L::kLdS + half * (D / 2) + d];
    }
    __syncwarp();  // scratch read before the next tile's S overwrites it
  }

  if (!row_valid) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  T* out = static_cast<T*>(a.out) + (static_cast<size_t>(qi) * H + h) * D +
           half * (D / 2);
#pragma unroll
  for (int d = 0; d < D / 2; ++d) out[d] = FromF32<T>(o[d] * inv);
}

template <typename T, int D>
cudaError_t LaunchFlash(const AttentionArgs& a, cudaStream_t stream) {
  using L = FaLayout<T, D>;
  // Above 48 KB of dynamic shared memory a kernel must opt in. Cheap and
  // idempotent, so done at every launch (no static state across devices).
  cudaError_t err = cudaFuncSetAttribute(
      FlashAttentionKernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(L::kBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(CeilDiv(a.n, kFaRows), a.num_heads);
  SPECSERVE_LAUNCH(grid, kFaThreads, L::kBytes, stream,
                   FlashAttentionKernel<T, D>)(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchFlashDim(const AttentionArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 16:
      return LaunchFlash<T, 16>(a, stream);
    case 32:
      return LaunchFlash<T, 32>(a, stream);
    case 64:
      return LaunchFlash<T, 64>(a, stream);
    case 128:
      return LaunchFlash<T, 128>(a, stream);
  }
  return cudaErrorInvalidValue;
}

bool ValidShape(const AttentionArgs& a) {
  return a.n > 0 && a.first >= 0 && a.num_heads > 0 && a.num_kv_heads > 0 &&
         a.num_heads % a.num_kv_heads == 0 && a.head_dim > 0;
}

bool ValidArgs(const AttentionArgs& a) {
  return ValidShape(a) && a.q != nullptr && a.k_cache != nullptr &&
         a.v_cache != nullptr && a.out != nullptr;
}

}  // namespace

bool FlashAttentionSupported(int head_dim, CudaDType dtype) {
  return (dtype == CudaDType::kBF16 || dtype == CudaDType::kFP16) &&
         (head_dim == 16 || head_dim == 32 || head_dim == 64 ||
          head_dim == 128);
}

cudaError_t FlashAttention(const AttentionArgs& args, cudaStream_t stream) {
  if (!ValidArgs(args) || !FlashAttentionSupported(args.head_dim, args.dtype)) {
    return cudaErrorInvalidValue;
  }
  // Q, K and V rows are read in 16-byte loads.
  if (((reinterpret_cast<uintptr_t>(args.q) |
        reinterpret_cast<uintptr_t>(args.k_cache) |
        reinterpret_cast<uintptr_t>(args.v_cache)) &
       15) != 0) {
    return cudaErrorInvalidValue;
  }
  if (args.dtype == CudaDType::kBF16) {
    return LaunchFlashDim<__nv_bfloat16>(args, stream);
  }
  return LaunchFlashDim<__half>(args, stream);
}

int SplitKAttentionSplits(const AttentionArgs& args, int num_sms) {
  if (!ValidShape(args)) return 1;
  const int group = args.num_heads / args.num_kv_heads;
  const int64_t qtiles =
      (static_cast<int64_t>(args.n) * group + kSkQueries - 1) / kSkQueries;
  const int64_t base = qtiles * args.num_kv_heads;
  const int64_t want = std::max<int64_t>(1, 2 * int64_t{num_sms});
  if (base >= want) return 1;
  int64_t splits = (want + base - 1) / base;
  // At least 64 keys per split: fewer do not pay for the merge.
  const int64_t total = int64_t{args.first} + args.n;
  splits = std::min<int64_t>(splits, (total + 63) / 64);
  return static_cast<int>(std::clamp<int64_t>(splits, 1, 64));
}

size_t SplitKAttentionWorkspaceBytes(const AttentionArgs& args,
                                     int num_splits) {
  const size_t pairs = static_cast<size_t>(std::max(num_splits, 1)) *
                       std::max(args.n, 0) * std::max(args.num_heads, 0);
  return sizeof(float) * pairs * (static_cast<size_t>(args.head_dim) + 2);
}

cudaError_t SplitKAttention(const AttentionArgs& args, int num_splits,
                            void* workspace, cudaStream_t stream) {
  if (!ValidArgs(args) || args.head_dim > 8 * kSkMaxDims || num_splits < 1 ||
      num_splits > kBatchedAttentionMaxSplits || workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int group = args.num_heads / args.num_kv_heads;
  const size_t pairs =
      static_cast<size_t>(num_splits) * args.n * args.num_heads;
  float* part_o = static_cast<float*>(workspace);
  float* part_m = part_o + pairs * args.head_dim;
  float* part_l = part_m + pairs;
  const int64_t total = int64_t{args.first} + args.n;
  const int keys_per_split =
      static_cast<int>((total + num_splits - 1) / num_splits);
  const int key_tile = SkKeyTile(args.head_dim);
  const dim3 grid(CeilDiv(static_cast<size_t>(args.n) * group, kSkQueries),
                  args.num_kv_heads, num_splits);
  const size_t smem = TileSmemBytes(args.head_dim, kSkRowPad);
  SPECSERVE_DISPATCH_DTYPE(
      args.dtype, T,
      SPECSERVE_LAUNCH(grid, kSkThreads, smem, stream,
                       SplitKAttentionKernel<T>)(args, keys_per_split, key_tile,
                                                 part_o, part_m, part_l);
      SPECSERVE_LAUNCH(args.n * args.num_heads, kCombineThreads, 0, stream,
                       SplitKCombineKernel<T>)(
          args.n, args.num_heads, args.head_dim, num_splits, part_o, part_m,
          part_l, static_cast<T*>(args.out)));
  return cudaGetLastError();
}

cudaError_t BatchedAttention(const BatchedAttentionArgs& args,
                             cudaStream_t stream) {
  const BatchedAttentionArgs& a = args;
  if (a.num_heads < 1 || a.num_kv_heads < 1 ||
      a.num_heads % a.num_kv_heads != 0 || a.head_dim < 1 ||
      a.head_dim > 8 * kSkMaxDims || a.block_size < 1 || a.num_work < 0 ||
      a.num_combine < 0 || a.partial_triples < 0) {
    return cudaErrorInvalidValue;
  }
  if (a.num_work == 0) return cudaSuccess;
  if (a.q == nullptr || a.k_cache == nullptr || a.v_cache == nullptr ||
      a.out == nullptr || a.block_tables == nullptr ||
      a.seq_info == nullptr || a.work == nullptr ||
      (a.num_combine > 0 &&
       (a.combine == nullptr || a.workspace == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const int key_tile = SkKeyTile(a.head_dim);
  const dim3 grid(a.num_work, a.num_kv_heads);
  const size_t smem = TileSmemBytes(a.head_dim, kBaRowPad);
  // Each lane holds head_dim / 8 output dims (rounded up): a kernel per
  // size, so the P V loop and the rescale issue no predicated-off work
  // (at head_dim 64 a 32-dim lane wasted 3 instructions in 4).
  SPECSERVE_DISPATCH_DTYPE(
      a.dtype, T,
      if (a.head_dim <= 64) {
        SPECSERVE_LAUNCH(grid, kSkThreads, smem, stream,
                         BatchedAttentionKernel<T, 8>)(a, key_tile);
      } else if (a.head_dim <= 128) {
        SPECSERVE_LAUNCH(grid, kSkThreads, smem, stream,
                         BatchedAttentionKernel<T, 16>)(a, key_tile);
      } else {
        SPECSERVE_LAUNCH(grid, kSkThreads, smem, stream,
                         BatchedAttentionKernel<T, kSkMaxDims>)(a, key_tile);
      }
      if (a.num_combine > 0) {
        SPECSERVE_LAUNCH(dim3(a.num_combine, a.num_heads), kCombineThreads,
                         0, stream, BatchedCombineKernel<T>)(a);
      });
  return cudaGetLastError();
}

}  // namespace cuda_kernels
}  // namespace specserve
