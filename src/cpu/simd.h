// The CPU backend's vector primitives: fp32 row and block operations on 16 lanes, compiled from
// one source (simd_impl.inc) for AVX-512, AVX2+FMA and a portable fallback, and chosen once at
// run time from the CPU's features (__builtin_cpu_supports; DELTASTATE_CPU_ISA=portable|avx2|
// avx512 forces one the CPU has).
//
// Every primitive defines its result element by element, independent of the ISA, of blocking
// and of where the data sits, so that the kernels built on them give the same bits for any
// thread count, any batch composition and any of the three ISAs:
//   - a dot product over n elements puts element i into lane i % 16, accumulates each lane with
//     fused multiply-adds in increasing i from +0, and adds the 16 lanes in a fixed tree
//     (lane l + lane l+8, then l+4, l+2, l+1);
//   - an accumulation C += A B computes each C element as one chain of fused multiply-adds in
//     increasing inner index, starting from C's value;
//   - elementwise operations round once per operation (a fused multiply-add counts as one);
//   - conversions from bf16/fp16 are exact, and to bf16/fp16 round to nearest even with the bits
//     of core/numeric.h (NaN included).
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "deltastate/tensor.h"

namespace deltastate::cpu::simd {

constexpr int kLanes = 16;

struct Kernels {
  const char* isa;  // "avx512", "avx2" or "portable"
  // dst[0..n) = src[off..off+n) as fp32; dst[off..off+n) = src rounded to dtype.
  void (*load)(const void* src, DType dtype, int64_t off, int n, float* dst);
  void (*store)(void* dst, DType dtype, int64_t off, int n, const float* src);
  // The dot product a.b (the lane order above).
  float (*dot)(const float* a, const float* b, int n);
  // y[i] *= f[i];  y[i] = fma(a, x[i], y[i]).
  void (*mul)(float* y, const float* f, int n);
  void (*axpy)(float* y, float a, const float* x, int n);
  // One token of the delta rule on `rows` rows of length K at S (row stride K): per row
  // s *= alpha; sk = s.k; sq = s.q; u = beta*(v[r] - sk); s = fma(u, k, s);
  // o[r] = sq + u*kq (core/delta_math.h's decay_and_dots, delta_u, rank1_update, delta_output).
  void (*delta_rows)(float* S, int rows, int K, const float* alpha, const float* k, const float* q,
                     const float* v, float beta, float kq, float* o);
  // KDA's decayed pair products: *kk = sum_c kt[c] kj[c] e^{Gt[c] - Gj[c]}, *qk likewise with
  // qt; the factor kj[c] e^{...} is formed once for both, e^ by simd_impl.inc's vexp (within 3
  // ulp of e^x, the same bits on every ISA), each sum in the dot products' lane order.
  void (*decayed_dots)(const float* kt, const float* qt, const float* kj, const float* Gt,
                       const float* Gj, int K, float* kk, float* qk);
  // out[c] = (a x[c]) e^{G1[c] - G0[c]} (G0 null: e^{G1[c]}), e^ by vexp.
  void (*decayed_row)(const float* x, float a, const float* G1, const float* G0, int K, float* out);
  // One gate row: g[i] = core/delta_math.h's gate_value(mode, x[i], dt[i], A_log, lower_bound)
  // with the vector exp, softplus and sigmoid of simd_impl.inc in place of libm's expf / log1pf
  // (within a few ulp of them, the same bits on every ISA), alpha[i] = e^{g[i]} (the vector
  // exp). dt null: 0; g or alpha null: not written; g may be x.
  void (*gate)(detail::GateMode mode, const float* x, const float* dt, float A_log,
               float lower_bound, int n, float* g, float* alpha);
  // x[i] = (x[i] / d) * m for i < n (IEEE division and product; d == 1 or m == 1: that step is
  // skipped, as x / 1 and x * 1 are x).
  void (*div_scale)(float* x, float d, float m, int n);
  // C[i*ldc + j] = dot(A + i*lda, B + j*ldb, n) for i < M, j < N; with `lower`, only for the
  // j <= i that C's caller reads (blocks wholly above the diagonal are skipped, others are
  // computed whole).
  void (*dots)(const float* A, int64_t lda, const float* B, int64_t ldb, int M, int N, int n,
               float* C, int64_t ldc, bool lower);
  // C[i, :N] += sum_{c < inner} A(i, c) * B[c, :N], A(i, c) = A[i*a_row + c*a_col], one fma
  // chain per C element in increasing c. With `lower`, A(i, c) is zero for c > i and the chain
  // of row i stops at c = min(inner, 4*(i/4) + 4) on every ISA (the terms past the diagonal
  // are exact zeros times finite values).
  void (*gemm_acc)(float* C, int64_t ldc, const float* A, int64_t a_row, int64_t a_col,
                   const float* B, int64_t ldb, int M, int N, int inner, bool lower);
};

const Kernels& kernels();

// Switches to the kernels of `isa` ("avx512", "avx2", "portable") if this CPU has it; false
// otherwise. Not while an op runs; for tests and benchmarks that compare ISAs in one process.
bool set_isa(const char* isa);

}  // namespace deltastate::cpu::simd
