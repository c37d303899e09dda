// Warp-level tensor-core pieces of the chunked prefill kernel, as thin inline-PTX wrappers:
// ldmatrix (8x8 16-bit tiles from shared memory into mma fragments, plain or transposed),
// mma.sync.m16n8k16 with fp32 accumulation (bf16 or fp16 operands), packing fp32 pairs into
// 16-bit operand registers, and cp.async with zero fill.
//
// Fragment layouts of mma.m16n8k16.row.col (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// g = lane / 4 and q = lane % 4:
//   A 16x16 (4 regs of 2 elements): a0 = A[g][2q..2q+1],   a1 = A[g+8][2q..2q+1],
//                                   a2 = A[g][2q+8..2q+9], a3 = A[g+8][2q+8..2q+9]
//   B 16x8  (2 regs):               b0 = B[2q..2q+1][g],   b1 = B[2q+8..2q+9][g]
//   C 16x8  (4 fp32):               c0 = C[g][2q], c1 = C[g][2q+1], c2 = C[g+8][2q], c3 =
//   C[g+8][2q+1]
// Two C tiles side by side (columns 0-7 and 8-15) hold, pair by pair, the A fragment of the
// 16x16 tile they form: (c0,c1 | c2,c3) of the left tile are a0 | a1, of the right one a2 | a3.
// That is how a product's result becomes the next product's A operand without shared memory.
//
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses (16 contiguous bytes each) of 8x8 matrix
// i; register i of lane L receives matrix i's elements (row L/4, columns 2(L%4), 2(L%4)+1), or
// with .trans (rows 2(L%4), 2(L%4)+1, column L/4). The address helpers below pick the four
// matrices so that the registers come out as mma fragments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace deltastate::cuda_backend::prefill {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The "memory" clobbers keep the loads on their side of the CTA barriers around the writes they
// read.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}

// Element offsets (row * ld + col) of lane L's row address for the four matrix arrangements,
// for a 16x16 block at (r0, c0) of a row-major 16-bit matrix with row stride ld:
//  * a_tile: the A fragment of that block (rows = m, columns = k): registers a0..a3.
//  * b_pair: the B fragments of two n-tiles from a matrix stored [n][k] (k contiguous): rows
//    r0..r0+15 are n, columns c0..c0+15 are k; registers (b0, b1) of n-tile r0, then of r0+8.
//  * b_pair_trans (use ldsm_x4_trans): the B fragments of two n-tiles from a matrix stored
//    [k][n] (n contiguous): rows r0.. are k, columns c0.. are n; registers (b0, b1) of n-tile c0,
//    then of c0+8.
//  * c_pair_trans (use ldsm_x4_trans): C-layout values of two 16x8 tiles of X^T from X stored
//    [n][m] (m contiguous): rows r0.. are n (the tiles' columns), columns c0.. are m (their rows);
//    registers (c0,c1), (c2,c3) of the tile of columns r0..r0+7, then of r0+8..r0+15.
__device__ __forceinline__ int a_tile(int lane, int r0, int c0, int ld) {
  return (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8;
}
__device__ __forceinline__ int b_pair(int lane, int r0, int c0, int ld) {
  return (r0 + (lane & 7) + (lane >> 4) * 8) * ld + c0 + ((lane >> 3) & 1) * 8;
}
__device__ __forceinline__ int b_pair_trans(int lane, int r0, int c0, int ld) {
  return (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8;
}
__device__ __forceinline__ int c_pair_trans(int lane, int r0, int c0, int ld) {
  return (r0 + (lane & 7) + (lane >> 4) * 8) * ld + c0 + ((lane >> 3) & 1) * 8;
}

// The operand type's conversions and its mma: In is __nv_bfloat16 or __half.
template <class In>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo: the low half
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static float2 unpack(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
  // d += a * b
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__half> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static float2 unpack(uint32_t u) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// A 16-byte global -> shared copy (cp.async, L2 only), or 16 zero bytes when !valid (src-size 0:
// nothing is read; `gmem` must still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit_group() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace deltastate::cuda_backend::prefill
