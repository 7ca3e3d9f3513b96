// Prefill attention on the tensor cores through inline PTX (see
// flash_mma.h): FlashAttention-2 (Dao 2023) with mma.sync.m16n8k16,
// ldmatrix and cp.async, the online softmax done on the accumulator
// fragments in registers.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"; g = lane / 4, t = lane % 4):
//   A 16x16 (4 x .b32, two 16-bit elements each, low half = lower column):
//     (row, columns): reg0 (g, 2t..2t+1)  reg1 (g+8, 2t..2t+1)
//                     reg2 (g, 2t+8..2t+9)  reg3 (g+8, 2t+8..2t+9)
//   B 16x8 (2 x .b32): reg0 (k = 2t..2t+1, n = g)  reg1 (k = 2t+8.., n = g)
//   C/D 16x8 f32: c0, c1 (g, 2t..2t+1)  c2, c3 (g+8, 2t..2t+1)
// ldmatrix.m8n8.x4 ("Warp-level matrix load instruction: ldmatrix"): lane
// 8j + r gives the address of row r of matrix j; register j of lane l gets
// row l / 4, columns 2(l % 4)..+1 of matrix j (.trans: column l / 4, rows
// 2(l % 4)..+1). So an 8x8 block of a row-major [key][d] tile is, without
// .trans, a B fragment of K^T (n = key) and, with .trans, a B fragment of V
// (k = key); a 16x16 block of Q is the four matrices of an A fragment.
//
// An S accumulator tile (16 rows x 8 keys) has exactly the layout of half
// an A fragment over those keys, so P = exp(S - m) feeds P V from
// registers: keys 16kk..16kk+15 are S tiles 2kk and 2kk+1.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/cuda/cuda_types.cuh"
#include "common/cuda/flash_mma.h"
#include "common/cuda/kernels.h"
#include "common/cuda/launch.cuh"

namespace specserve {
namespace cuda_kernels {

// ---------------------------------------------------------------------------
// PTX wrappers: every warp-collective or asynchronous instruction the kernel
// uses. A CPU emulation of them (a test harness kept outside the build)
// defines SPECSERVE_CUDA_EMU and supplies its own versions.
// ---------------------------------------------------------------------------
#ifndef SPECSERVE_CUDA_EMU

// d = a * b + d, a 16x16 (row), b 16x8 (col), f32 accumulators.
template <typename T>
__device__ __forceinline__ void MmaM16n8k16(float d[4], const uint32_t a[4],
                                            uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void MmaM16n8k16<__nv_bfloat16>(float d[4],
                                                           const uint32_t a[4],
                                                           uint32_t b0,
                                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void MmaM16n8k16<__half>(float d[4],
                                                    const uint32_t a[4],
                                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 16-bit matrices; `row` is this lane's row address (16-byte
// aligned shared memory).
__device__ __forceinline__ void LdMatrixX4(uint32_t r[4], const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr)
      : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t r[4],
                                                const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, "
      "[%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr)
      : "memory");
}

// 16 bytes global -> shared, bypassing L1; zero-fills when !valid (`src` is
// then not read, but must still be a mapped address).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src,
                                          bool valid) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const size_t gaddr = __cvta_generic_to_global(src);
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :
               : "r"(saddr), "l"(gaddr), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` of this thread's committed groups are in
// flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

#endif  // SPECSERVE_CUDA_EMU

namespace {

using cuda_detail::CeilDiv;

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRows = 64;  // query rows per block, 16 per warp
constexpr int kKeys = 64;  // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRowBlocks = 65535;  // gridDim.y

// Shared memory: Q [64][D + 8], then K and V [2 buffers][64][D + 8]. The 8
// elements (16 bytes) of padding put the 8 rows of every ldmatrix in
// distinct bank groups, and keep rows 16-byte aligned for cp.async.
template <int D>
struct Smem {
  static constexpr int kLd = D + 8;  // elements per row
  static constexpr int kTile = kKeys * kLd;
  static constexpr size_t kBytes =
      sizeof(uint16_t) * (static_cast<size_t>(kRows) * kLd + 4 * kTile);
  static_assert(kRows == kKeys, "Q and K/V tiles share the row count");
  static_assert((kLd * sizeof(uint16_t)) % 16 == 0, "16-byte rows");
};

// Two fp32 values as one .b32 register of two T (low half = `lo`), the A
// operand layout.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo,
                                                            float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Physical cache row of logical slot t (identity for a contiguous cache).
__device__ __forceinline__ size_t CacheRow(const AttentionArgs& a, int t) {
  if (a.block_table == nullptr) return static_cast<size_t>(t);
  return static_cast<size_t>(a.block_table[t / a.block_size]) * a.block_size +
         t % a.block_size;
}

// Block (x = head h, y = 64-row block counted from the end: the longest
// causal rows start first). Warp w owns rows q0 + 16w .. q0 + 16w + 15.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 3 : 2)
    FlashMmaKernel(AttentionArgs a) {
  using L = Smem<D>;
  constexpr int kLd = L::kLd;
  constexpr int kChunks = D / 8;  // 16-byte vectors per row
  constexpr int kKSteps = D / 16;
  constexpr int kSTiles = kKeys / 8;
  constexpr int kOTiles = D / 8;
  SPECSERVE_DYNAMIC_SHARED(unsigned char, fm_smem);
  T* const qs = reinterpret_cast<T*>(fm_smem);
  T* const ks = qs + kRows * kLd;
  T* const vs = ks + 2 * L::kTile;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = a.num_heads, KV = a.num_kv_heads, n = a.n, first = a.first;
  const int h = blockIdx.x, kv = h / (H / KV);
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kRows;
  const T* const q = static_cast<const T*>(a.q);
  const T* const kc = static_cast<const T*>(a.k_cache);
  const T* const vc = static_cast<const T*>(a.v_cache);

  // Keys any row of the block sees, and those of this warp's rows (none
  // for a warp wholly past n).
  const int kend = first + min(n, q0 + kRows);
  const int num_tiles = (kend + kKeys - 1) / kKeys;
  const int wr0 = q0 + warp * 16;
  const int warp_kend = wr0 < n ? first + min(n, wr0 + 16) : 0;

  // Q tile, rows past n zero-filled (their source stays row n - 1, a
  // mapped address).
  for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int i = q0 + r;
    const T* src = q + (static_cast<size_t>(min(i, n - 1)) * H + h) * D + c;
    CpAsync16(qs + r * kLd + c, src, i < n);
  }
  // K and V of key tile `tile` into buffer `buf`; slots past kend (the
  // tail of the last tile) zero-filled so that P V never meets garbage.
  auto load_tile = [&](int tile, int buf) {
    T* const kd = ks + buf * L::kTile;
    T* const vd = vs + buf * L::kTile;
    const int k0 = tile * kKeys;
    for (int idx = tid; idx < kKeys * kChunks; idx += kThreads) {
      const int j = idx / kChunks, c = (idx % kChunks) * 8;
      const int slot = k0 + j;
      const bool ok = slot < kend;
      const size_t off = (CacheRow(a, ok ? slot : 0) * KV + kv) * D + c;
      CpAsync16(kd + j * kLd + c, kc + off, ok);
      CpAsync16(vd + j * kLd + c, vc + off, ok);
    }
  };
  load_tile(0, 0);
  CpAsyncCommit();  // group 0: Q and tile 0

  const int g = lane >> 2, t4 = lane & 3;
  // This thread's two rows of the warp's 16: wr0 + g and wr0 + g + 8.
  const int row_last[2] = {first + wr0 + g, first + wr0 + g + 8};
  const float sl2 = a.scale * kLog2e;  // scores in the log2 domain

  uint32_t qf[kKSteps][4];
  float o[kOTiles][4];
#pragma unroll
  for (int dt = 0; dt < kOTiles; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.0f;
  }
  float m[2] = {-INFINITY, -INFINITY};  // running max, log2 domain
  float l[2] = {0.0f, 0.0f};            // this thread's share of the sum

  for (int tile = 0; tile < num_tiles; ++tile) {
    // Prefetch the next tile into the other buffer (freed by the barrier
    // that ended the previous iteration); an empty group when none.
    if (tile + 1 < num_tiles) load_tile(tile + 1, (tile + 1) & 1);
    CpAsyncCommit();
    CpAsyncWait<1>();  // everything but the prefetch has landed
    __syncthreads();   // ... for every thread's copies

    if (tile == 0 && warp_kend > 0) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        // Matrices: rows 0-7 / 8-15 x columns 16kk..+7 / +8..+15.
        LdMatrixX4(qf[kk],
                   qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd +
                       kk * 16 + (lane >> 4) * 8);
      }
    }

    const int k0 = tile * kKeys;
    if (k0 < warp_kend) {  // warp-uniform: the tile holds keys of its rows
      const T* const kt = ks + (tile & 1) * L::kTile;
      const T* const vt = vs + (tile & 1) * L::kTile;

      // S = Q K^T: 16 rows x 64 keys, 8 accumulator tiles.
      float s[kSTiles][4];
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < kKSteps; kk += 2) {
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
          // Keys 8nt..8nt+7 x dims 16kk + 8j (j = 0..3): B fragments of
          // k-steps kk and kk + 1.
          uint32_t b[4];
          LdMatrixX4(
              b, kt + (nt * 8 + (lane & 7)) * kLd + kk * 16 + (lane >> 3) * 8);
          MmaM16n8k16<T>(s[nt], qf[kk], b[0], b[1]);
          MmaM16n8k16<T>(s[nt], qf[kk + 1], b[2], b[3]);
        }
      }

      // Causal mask where some key of the tile lies past the diagonal of
      // the warp's first row (this includes the zero-filled tail: slots
      // >= kend are past every valid row's diagonal).
      const bool masked_tile = k0 + kKeys - 1 > first + wr0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float v = s[nt][2 * r + c] * sl2;
            if (masked_tile && k0 + nt * 8 + 2 * t4 + c > row_last[r]) {
              v = -INFINITY;
            }
            s[nt][2 * r + c] = v;
            mx = fmaxf(mx, v);
          }
        }
        // The row's 64 keys are spread over the 4 lanes of a quad.
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[r], mx);
        // A row with no visible key yet keeps p = 0 (no inf - inf).
        const float base = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = exp2f(m[r] - base);
        m[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float p = exp2f(s[nt][2 * r + c] - base);
            s[nt][2 * r + c] = p;
            sum += p;
          }
        }
        l[r] = l[r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < kOTiles; ++dt) {
          o[dt][2 * r] *= alpha;
          o[dt][2 * r + 1] *= alpha;
        }
      }

      // O += P V, P from the S registers (rounded to T).
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = PackPair<T>(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = PackPair<T>(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = PackPair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = PackPair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int dt = 0; dt < kOTiles; dt += 2) {
          // Matrices: keys 16kk..+7 / +8..+15 x dims 8dt..+7, then the
          // same keys x dims 8(dt + 1)..+7.
          uint32_t b[4];
          LdMatrixX4Trans(
              b, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd +
                     dt * 8 + (lane >> 4) * 8);
          MmaM16n8k16<T>(o[dt], pa, b[0], b[1]);
          MmaM16n8k16<T>(o[dt + 1], pa, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // this buffer is reloaded by the next iteration
  }

  if (warp_kend == 0) return;
  // Normalise, stage the warp's 16 rows in its own (consumed) Q rows, then
  // write them out as 16-byte vectors.
  T* const stage = qs + warp * 16 * kLd;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int dt = 0; dt < kOTiles; ++dt) {
      const uint32_t v =
          PackPair<T>(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
      *reinterpret_cast<uint32_t*>(stage + (g + 8 * r) * kLd + dt * 8 +
                                   2 * t4) = v;
    }
  }
  __syncwarp();
  T* const out = static_cast<T*>(a.out);
  for (int idx = lane; idx < 16 * kChunks; idx += 32) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int i = wr0 + r;
    if (i < n) {
      *reinterpret_cast<uint4*>(out + (static_cast<size_t>(i) * H + h) * D +
                                c) =
          *reinterpret_cast<const uint4*>(stage + r * kLd + c);
    }
  }
}

template <typename T, int D>
cudaError_t Launch(const AttentionArgs& a, cudaStream_t stream) {
  constexpr size_t kBytes = Smem<D>::kBytes;
  // Above 48 KB of dynamic shared memory a kernel must opt in; cheap and
  // idempotent, so done at every launch (no static state across devices).
  cudaError_t err = cudaFuncSetAttribute(
      FlashMmaKernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(kBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(a.num_heads, CeilDiv(a.n, kRows));
  SPECSERVE_LAUNCH(grid, kThreads, kBytes, stream, FlashMmaKernel<T, D>)(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchDim(const AttentionArgs& a, cudaStream_t stream) {
  return a.head_dim == 64 ? Launch<T, 64>(a, stream)
                          : Launch<T, 128>(a, stream);
}

bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

bool FlashMmaSupported(int head_dim, CudaDType dtype) {
  return (dtype == CudaDType::kBF16 || dtype == CudaDType::kFP16) &&
         (head_dim == 64 || head_dim == 128);
}

cudaError_t FlashMmaAttention(const AttentionArgs& args, cudaStream_t stream) {
  const AttentionArgs& a = args;
  if (!FlashMmaSupported(a.head_dim, a.dtype) || a.tree_start != nullptr ||
      a.tree_mask != nullptr || a.n < 0 || a.first < 0 || a.num_kv_heads < 1 ||
      a.num_heads < a.num_kv_heads || a.num_heads % a.num_kv_heads != 0 ||
      // Tile ends (a row block, a key tile past the last key) stay in int.
      int64_t{a.first} + a.n > INT_MAX - 2 * kRows ||
      (int64_t{a.n} + kRows - 1) / kRows > kMaxRowBlocks ||
      (a.block_table != nullptr && a.block_size < 1)) {
    return cudaErrorInvalidValue;
  }
  if (a.n == 0) return cudaSuccess;
  if (!Aligned16(a.q) || !Aligned16(a.k_cache) || !Aligned16(a.v_cache) ||
      !Aligned16(a.out) || a.q == nullptr || a.k_cache == nullptr ||
      a.v_cache == nullptr || a.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (a.dtype == CudaDType::kBF16) return LaunchDim<__nv_bfloat16>(a, stream);
  return LaunchDim<__half>(a, stream);
}

}  // namespace cuda_kernels
}  // namespace specserve
