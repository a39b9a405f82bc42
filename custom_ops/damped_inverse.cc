// MsOptDampedInverse: THOR's damped block inverse, inv(M + damping * I), for a
// batch [..., n, n] of symmetric positive definite blocks.
//
// Outputs `inverse` (same shape as the input) and `ok` (bool, batch shape): ok
// is true where the block was finite, its damped form factorised (every
// Cholesky pivot > 0) and the inverse is finite. Failed blocks get all-zero
// inverses; the op never fails on numbers. Only the lower triangle of M is read.
//
// CPU kernel: blocks are sharded over the intra-op thread pool. Per block, the
// damped lower triangle is copied into a zero-padded workspace (n rounded up to
// kPanel, identity on the padded diagonal, so the padded matrix is
// blockdiag(A, I) and needs no edge cases), then
//   1. right-looking blocked Cholesky A = L L^T, stored transposed (Lt = L^T),
//   2. W = L^-1, block row by block row,
//   3. inv(A) = W^T W, lower half, mirrored into the output.
// All O(n^3) work runs in one register-tiled micro-kernel (C +-= a * B, a
// broadcast from one operand, B rows loaded as vectors). The micro-kernel is
// compiled three times (AVX-512, AVX2+FMA, baseline) and picked at run time.
// TF_MSOPT_INVERSE_ISA=generic|avx2|avx512 caps the choice (for testing).
// Blocks with n <= kSmall use a plain unblocked version of the same steps.
//
// GPU kernel (built when setup.py is asked for CUDA, TF_MSOPT_WITH_CUDA
// defined): the launcher in damped_inverse.cu, see there.
//
// MsOptDampedInverseRetry (CPU only): the same inverse with a damping per block
// and THOR's second try in the same pass: a block that fails with its damping d
// is inverted again with max(10 d, 1e-4 * mean |finite diagonal entry|) + 1e-6
// (tf_msopt.ops.inverse.retry_damping). Outputs `retried` (the first try failed)
// and `ok` (one of the tries succeeded). In a graph it stands for about thirty
// ops (gathering the failed blocks, their damping, the second call, scattering
// back), which cost more to trace and start than the inversion of small blocks.

#if defined(TF_MSOPT_WITH_CUDA)
#ifndef GOOGLE_CUDA
#define GOOGLE_CUDA 1
#endif
#define EIGEN_USE_GPU
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

#if defined(TF_MSOPT_WITH_CUDA)
#include "damped_inverse_cuda.h"
#endif

namespace tensorflow {
namespace msopt_inverse {

using Index = std::ptrdiff_t;

constexpr Index kPanel = 16;  // padding granularity and Cholesky panel width
constexpr Index kSmall = 8;   // blocks up to this size skip the tiled path

// ---------------------------------------------------------------- micro-kernel

// C[MR rows][NV vectors] (row-major, stride ldc) gets
//     (C if kLoadC else 0) + sign * sum_{k0 <= k < k1} a[r + k * lda] * B[k][:]
// with sign = -1 if kSubtract, B rows `ldb` apart: the scalars of one k are the
// MR consecutive elements of a row of a transposed operand. Vectors are VB bytes.
template <typename T, int VB, int MR, int NV, bool kLoadC, bool kSubtract>
inline void Tile(const T* a, Index lda, const T* b, Index ldb, Index k0, Index k1, T* c,
                 Index ldc) {
  typedef T Vec __attribute__((vector_size(VB), may_alias));
  constexpr int W = VB / sizeof(T);
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = kLoadC ? *reinterpret_cast<const Vec*>(c + r * ldc + v * W) : Vec{};
  for (Index k = k0; k < k1; ++k) {
    Vec row[NV];
    for (int v = 0; v < NV; ++v) row[v] = *reinterpret_cast<const Vec*>(b + k * ldb + v * W);
    const T* ak = a + k * lda;
    for (int r = 0; r < MR; ++r) {
      const T s = ak[r];
      for (int v = 0; v < NV; ++v) {
        if (kSubtract) {
          acc[r][v] -= s * row[v];
        } else {
          acc[r][v] += s * row[v];
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<Vec*>(c + r * ldc + v * W) = acc[r][v];
}

// Tiles C rows [0, MR) x columns [0, width) (a multiple of the vector width): two
// vectors at a time, then one. `b` and `c` point at column 0 of the range.
template <typename T, int VB, int MR, bool kLoadC, bool kSubtract>
inline void TileRow(const T* a, Index lda, const T* b, Index ldb, Index k0, Index k1, T* c,
                    Index ldc, Index width) {
  constexpr Index W = VB / sizeof(T);
  Index col = 0;
  for (; col + 2 * W <= width; col += 2 * W)
    Tile<T, VB, MR, 2, kLoadC, kSubtract>(a, lda, b + col, ldb, k0, k1, c + col, ldc);
  for (; col < width; col += W)
    Tile<T, VB, MR, 1, kLoadC, kSubtract>(a, lda, b + col, ldb, k0, k1, c + col, ldc);
}

// Forward substitution on kPanel rows at once, `rows + c * ld` for c < kPanel:
//     row_c = (row_c - sum_{q < c} factor[c][q] * row_q) * inv_diag[c]
// over columns [0, width) (a multiple of the vector width). One vector column of
// all the rows stays in registers while it is solved.
template <typename T, int VB>
inline void SubstituteRows(T* rows, Index ld, Index width, const T (&factor)[kPanel][kPanel],
                           const T (&inv_diag)[kPanel]) {
  typedef T Vec __attribute__((vector_size(VB), may_alias));
  constexpr Index W = VB / sizeof(T);
  for (Index col = 0; col < width; col += W) {
    Vec solved[kPanel];
#pragma GCC unroll 16
    for (int c = 0; c < kPanel; ++c) {
      Vec x = *reinterpret_cast<const Vec*>(rows + c * ld + col);
#pragma GCC unroll 16
      for (int q = 0; q < c; ++q) x -= factor[c][q] * solved[q];
      solved[c] = x * inv_diag[c];
      *reinterpret_cast<Vec*>(rows + c * ld + col) = solved[c];
    }
  }
}

// ---------------------------------------------------------------- one block

inline Index Padded(Index n) { return (n + kPanel - 1) / kPanel * kPanel; }

// Workspace elements one block of size n needs (two padded matrices).
inline Index WorkspaceSize(Index n) { return n <= kSmall ? 2 * n * n : 2 * Padded(n) * Padded(n); }

// True when no element of x[0, count) is NaN or +-Inf. Tests the exponent bits
// with integer ops, so the loop vectorises.
template <typename T>
inline bool AllFinite(const T* x, Index count) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr Bits kExponent = sizeof(T) == 4 ? Bits(0x7f800000u) : Bits(0x7ff0000000000000ull);
  Bits non_finite = 0;
  for (Index i = 0; i < count; ++i) {
    Bits bits;
    std::memcpy(&bits, x + i, sizeof(T));
    non_finite |= Bits((bits & kExponent) == kExponent);
  }
  return non_finite == 0;
}

// inv(m + damping*I) of one n x n block into out; false (out untouched) on failure.
// Unblocked reference version for small n; work holds 2*n*n elements.
template <typename T>
bool InvertSmall(const T* m, Index n, T damping, T* out, T* work) {
  T* l = work;          // L, row-major lower
  T* w = work + n * n;  // W = L^-1, row-major lower
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j <= i; ++j) {
      T s = m[i * n + j] + (i == j ? damping : T(0));
      for (Index k = 0; k < j; ++k) s -= l[i * n + k] * l[j * n + k];
      if (i == j) {
        if (!(s > T(0)) || !std::isfinite(s)) return false;
        l[i * n + i] = std::sqrt(s);
      } else {
        l[i * n + j] = s / l[j * n + j];
      }
    }
  }
  for (Index i = 0; i < n; ++i) {
    const T inv_diag = T(1) / l[i * n + i];
    w[i * n + i] = inv_diag;
    for (Index j = 0; j < i; ++j) {
      T s = 0;
      for (Index k = j; k < i; ++k) s -= l[i * n + k] * w[k * n + j];
      w[i * n + j] = s * inv_diag;
    }
  }
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j <= i; ++j) {
      T s = 0;
      for (Index k = i; k < n; ++k) s += w[k * n + i] * w[k * n + j];
      if (!std::isfinite(s)) return false;
      out[i * n + j] = out[j * n + i] = s;
    }
  }
  return true;
}

// Blocked version; work holds 2 * N * N elements (N = Padded(n)), 64-byte aligned.
template <typename T, int VB, int MR>
bool InvertTiled(const T* m, Index n, T damping, T* out, T* work) {
  constexpr Index P = kPanel;
  static_assert(P % (VB / sizeof(T)) == 0 && P % MR == 0, "panel must hold whole tiles");
  const Index N = Padded(n);
  T* a = work;          // damped A (lower), later overwritten row block by row block by W
  T* lt = work + N * N;  // L^T: lt[k * N + i] = L[i][k]
  // Only A's lower triangle is read and Lt is read only where earlier steps wrote
  // it, so nothing else needs clearing.
  for (Index i = 0; i < n; ++i) {
    std::memcpy(a + i * N, m + i * n, sizeof(T) * (i + 1));
    a[i * N + i] += damping;
  }
  for (Index i = n; i < N; ++i) {
    std::fill(a + i * N, a + i * N + i, T(0));
    a[i * N + i] = T(1);
  }

  // 1. Cholesky, one panel of P columns at a time.
  T diag[P][P];  // L of the current diagonal block
  T inv_diag[P];
  for (Index j0 = 0; j0 < N; j0 += P) {
    for (Index c = 0; c < P; ++c) {
      for (Index r = c; r < P; ++r) {
        T s = a[(j0 + r) * N + j0 + c];
        for (Index q = 0; q < c; ++q) s -= diag[r][q] * diag[c][q];
        if (r == c) {
          if (!(s > T(0)) || !std::isfinite(s)) return false;
          diag[c][c] = std::sqrt(s);
          inv_diag[c] = T(1) / diag[c][c];
        } else {
          diag[r][c] = s * inv_diag[c];
        }
      }
      for (Index r = c; r < P; ++r) lt[(j0 + c) * N + j0 + r] = diag[r][c];
    }
    const Index below = j0 + P;  // rows of the panel under the diagonal block
    if (below == N) break;
    // Panel rows: L[i][j0+c] = (A[i][j0+c] - sum_q L[i][j0+q] L_JJ[c][q]) / L_JJ[c][c],
    // solved on the transposed panel (Lt rows j0.., columns i) so that i runs along vectors.
    for (Index i = below; i < N; ++i) {
      for (Index c = 0; c < P; ++c) lt[(j0 + c) * N + i] = a[i * N + j0 + c];
    }
    SubstituteRows<T, VB>(lt + j0 * N + below, N, N - below, diag, inv_diag);
    // Trailing update of the lower part: A[i][j] -= sum_c L[i][j0+c] L[j][j0+c].
    const T* panel = lt + j0 * N;
    for (Index i = below; i < N; i += MR) {
      const Index end = std::min(N, (i + MR + P - 1) / P * P);  // lower part only
      TileRow<T, VB, MR, true, true>(panel + i, N, panel + below, N, 0, P, a + i * N + below,
                                     N, end - below);
    }
  }

  // 2. W = L^-1 (lower), written over A's rows: row block I needs W's rows above it only.
  T* w = a;
  for (Index i0 = 0; i0 < N; i0 += P) {
    T* block = w + i0 * N;
    // Rows i0..i0+P, columns < i0: -sum_{k < i0} L[i][k] W[k][j].
    if (i0 > 0) {
      for (Index r = 0; r < P; r += MR) {
        for (Index j0 = 0; j0 < i0; j0 += P) {
          // W[k][j] = 0 for k < j, so the sum over k starts at the column panel.
          TileRow<T, VB, MR, false, true>(lt + i0 + r, N, w + j0, N, j0, i0,
                                          block + r * N + j0, N, P);
        }
      }
    }
    for (Index r = 0; r < P; ++r) {
      T* row = block + r * N;
      std::fill(row + i0, row + N, T(0));
      row[i0 + r] = T(1);
    }
    // Forward substitution with the diagonal block L_II (L_II[r][q] = lt[(i0+q)*N + i0+r]).
    for (Index r = 0; r < P; ++r) {
      for (Index q = 0; q < r; ++q) diag[r][q] = lt[(i0 + q) * N + i0 + r];
      inv_diag[r] = T(1) / lt[(i0 + r) * N + i0 + r];
    }
    SubstituteRows<T, VB>(block, N, i0 + P, diag, inv_diag);
  }

  // 3. inv = W^T W: inv[x][y] = sum_{k >= max(x, y)} W[k][x] W[k][y]; rows k >= n are
  // identity padding with W[k][x] = 0 for x < n. Lower half, then mirrored.
  alignas(64) T tile[MR * 2 * P];
  const Index tile_ld = 2 * P;
  for (Index x0 = 0; x0 < n; x0 += MR) {
    const Index x_end = std::min(x0 + MR, n);
    for (Index y0 = 0; y0 < x_end; y0 += 2 * P) {
      const Index y_end = std::min(std::min(y0 + 2 * P, N), (x_end + P - 1) / P * P);
      TileRow<T, VB, MR, false, false>(w + x0, N, w + y0, N, x0, n, tile, tile_ld,
                                       y_end - y0);
      for (Index x = x0; x < x_end; ++x) {  // lower half, row by row
        const Index count = std::min(y_end, x + 1) - y0;
        if (count > 0) std::memcpy(out + x * n + y0, tile + (x - x0) * tile_ld, sizeof(T) * count);
      }
      for (Index y = y0; y < std::min(y_end, x_end - 1); ++y) {  // upper half: runs along x
        for (Index x = std::max(x0, y + 1); x < x_end; ++x) {
          out[y * n + x] = tile[(x - x0) * tile_ld + y - y0];
        }
      }
    }
  }
  return AllFinite(out, n * n);
}

// ---------------------------------------------------------------- ISA dispatch

template <typename T>
using BlockFn = bool (*)(const T*, Index, T, T*, T*);

// `flatten` inlines the whole tiled path into each entry, so every copy is
// compiled (vectorised) for its entry's target.
#define MSOPT_ENTRY(NAME, TARGET, T, VB, MR)                                         \
  TARGET __attribute__((flatten)) bool NAME(const T* m, Index n, T d, T* out, T* w) { \
    return InvertTiled<T, VB, MR>(m, n, d, out, w);                                   \
  }

#if defined(__x86_64__) || defined(__i386__)
#define MSOPT_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma")))
#define MSOPT_AVX2 __attribute__((target("avx2,fma")))
MSOPT_ENTRY(TiledAvx512F32, MSOPT_AVX512, float, 64, 8)
MSOPT_ENTRY(TiledAvx512F64, MSOPT_AVX512, double, 64, 8)
MSOPT_ENTRY(TiledAvx2F32, MSOPT_AVX2, float, 32, 4)
MSOPT_ENTRY(TiledAvx2F64, MSOPT_AVX2, double, 32, 4)
#endif
MSOPT_ENTRY(TiledGenericF32, , float, 16, 4)
MSOPT_ENTRY(TiledGenericF64, , double, 16, 4)
#undef MSOPT_ENTRY

enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa BestIsa() {
  Isa best = Isa::kGeneric;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    best = Isa::kAvx512;
#endif
  return best;
}

// The best ISA this CPU supports, capped by TF_MSOPT_INVERSE_ISA (read at every
// call, so tests can switch it).
inline Isa SelectIsa() {
  static const Isa best = BestIsa();
  const char* cap = std::getenv("TF_MSOPT_INVERSE_ISA");
  if (cap == nullptr) return best;
  const std::string name(cap);
  const Isa wanted = name == "generic" ? Isa::kGeneric : name == "avx2" ? Isa::kAvx2 : best;
  return std::min(best, wanted);
}

template <typename T>
BlockFn<T> TiledFor(Isa isa);

template <>
BlockFn<float> TiledFor<float>(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == Isa::kAvx512) return TiledAvx512F32;
  if (isa == Isa::kAvx2) return TiledAvx2F32;
#endif
  return TiledGenericF32;
}

template <>
BlockFn<double> TiledFor<double>(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == Isa::kAvx512) return TiledAvx512F64;
  if (isa == Isa::kAvx2) return TiledAvx2F64;
#endif
  return TiledGenericF64;
}

// ---------------------------------------------------------------- op

Status ValidateInputs(const Tensor& matrices, const Tensor& damping) {
  const TensorShape& shape = matrices.shape();
  if (shape.dims() < 2 || shape.dim_size(shape.dims() - 1) != shape.dim_size(shape.dims() - 2)) {
    return absl::InvalidArgumentError("MsOptDampedInverse: 'matrices' must have shape [..., n, n], "
                                      "but got " + shape.DebugString());
  }
  if (!TensorShapeUtils::IsScalar(damping.shape())) {
    return absl::InvalidArgumentError("MsOptDampedInverse: 'damping' must be a scalar, but got "
                                      "shape " + damping.shape().DebugString());
  }
  return absl::OkStatus();
}

TensorShape BatchShape(const TensorShape& shape) {
  TensorShape batch = shape;
  batch.RemoveLastDims(2);
  return batch;
}

// Runs attempt(b, block, result, workspace) -> bool for each finite one of `batch` n x n blocks of
// `in`, sharded over the CPU threads with one 64-byte aligned workspace per shard; a
// block whose attempt fails gets all zeros. ok[b] says which succeeded.
template <typename T, typename Attempt>
void InvertEachBlock(OpKernelContext* ctx, const T* in, Index n, int64_t batch, T* out,
                     bool* ok, const Attempt& attempt) {
  auto work = [&](int64_t begin, int64_t end) {
    const size_t bytes = (sizeof(T) * WorkspaceSize(n) + 63) / 64 * 64;
    T* workspace = static_cast<T*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64)));
    for (int64_t b = begin; b < end; ++b) {
      const T* block = in + b * n * n;
      T* result = out + b * n * n;
      const bool good = workspace != nullptr && AllFinite(block, n * n) &&
                        attempt(b, block, result, workspace);
      if (!good) std::fill(result, result + n * n, T(0));
      ok[b] = good;
    }
    std::free(workspace);
  };
  // About n^3 / 2 multiply-adds per block, plus copies (a retry is rare).
  const int64_t cost = std::max<int64_t>(1, n * n * n / 2 + 4 * n * n);
  auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  Shard(threads->num_threads, threads->workers, batch, cost, work);
}

template <typename T>
BlockFn<T> BlockInverseFor(Index n) {
  return n <= kSmall ? InvertSmall<T> : TiledFor<T>(SelectIsa());
}

template <typename T>
class DampedInverseCpuOp : public OpKernel {
 public:
  explicit DampedInverseCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& matrices = ctx->input(0);
    const Tensor& damping_tensor = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateInputs(matrices, damping_tensor));
    Tensor* inverse = nullptr;
    Tensor* ok = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, matrices.shape(), &inverse));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, BatchShape(matrices.shape()), &ok));
    const Index n = matrices.dim_size(matrices.dims() - 1);
    const int64_t batch = ok->NumElements();
    if (batch == 0) return;
    const T damping = damping_tensor.scalar<T>()();
    const BlockFn<T> invert = BlockInverseFor<T>(n);
    InvertEachBlock<T>(ctx, matrices.flat<T>().data(), n, batch, inverse->flat<T>().data(),
                       ok->flat<bool>().data(),
                       [&](int64_t, const T* block, T* result, T* workspace) {
                         return std::isfinite(damping) &&
                                invert(block, n, damping, result, workspace);
                       });
  }
};

// The second try's damping: max(10 d, 1e-4 * mean |finite diagonal entry|) + 1e-6,
// NaN when d is (as tf.maximum).
template <typename T>
T RetryDamping(const T* block, Index n, T damping) {
  T sum = 0;
  Index count = 0;
  for (Index i = 0; i < n; ++i) {
    const T entry = block[i * n + i];
    if (std::isfinite(entry)) {
      sum += std::abs(entry);
      ++count;
    }
  }
  const T mean = count > 0 ? sum / static_cast<T>(count) : T(0);
  const T larger = std::isnan(damping) ? damping : std::max(T(10) * damping, T(1e-4) * mean);
  return larger + T(1e-6);
}

template <typename T>
class DampedInverseRetryCpuOp : public OpKernel {
 public:
  explicit DampedInverseRetryCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& matrices = ctx->input(0);
    const Tensor& damping_tensor = ctx->input(1);
    const TensorShape& shape = matrices.shape();
    OP_REQUIRES(ctx, shape.dims() >= 2 &&
                         shape.dim_size(shape.dims() - 1) == shape.dim_size(shape.dims() - 2),
                absl::InvalidArgumentError("MsOptDampedInverseRetry: 'matrices' must have shape "
                                           "[..., n, n], but got " + shape.DebugString()));
    const TensorShape batch_shape = BatchShape(shape);
    OP_REQUIRES(ctx, damping_tensor.shape() == batch_shape,
                absl::InvalidArgumentError(
                    "MsOptDampedInverseRetry: 'damping' must have the batch shape " +
                    batch_shape.DebugString() + ", but got " +
                    damping_tensor.shape().DebugString()));
    Tensor* inverse = nullptr;
    Tensor* retried = nullptr;
    Tensor* ok = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &inverse));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, batch_shape, &retried));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, batch_shape, &ok));
    const Index n = shape.dim_size(shape.dims() - 1);
    const int64_t batch = ok->NumElements();
    if (batch == 0) return;
    const T* dampings = damping_tensor.flat<T>().data();
    bool* retried_out = retried->flat<bool>().data();
    std::fill(retried_out, retried_out + batch, true);  // a non-finite block is never tried
    const BlockFn<T> invert = BlockInverseFor<T>(n);
    InvertEachBlock<T>(ctx, matrices.flat<T>().data(), n, batch, inverse->flat<T>().data(),
                       ok->flat<bool>().data(),
                       [&](int64_t b, const T* block, T* result, T* workspace) {
                         auto attempt = [&](T damping) {
                           return std::isfinite(damping) &&
                                  invert(block, n, damping, result, workspace);
                         };
                         const bool first = attempt(dampings[b]);
                         retried_out[b] = !first;
                         return first || attempt(RetryDamping(block, n, dampings[b]));
                       });
  }
};

#if defined(TF_MSOPT_WITH_CUDA)
template <typename T>
class DampedInverseGpuOp : public OpKernel {
 public:
  explicit DampedInverseGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& matrices = ctx->input(0);
    const Tensor& damping_tensor = ctx->input(1);  // host memory
    OP_REQUIRES_OK(ctx, ValidateInputs(matrices, damping_tensor));
    Tensor* inverse = nullptr;
    Tensor* ok = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, matrices.shape(), &inverse));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, BatchShape(matrices.shape()), &ok));
    const int64_t n = matrices.dim_size(matrices.dims() - 1);
    const int64_t batch = ok->NumElements();
    if (batch == 0) return;
    OP_REQUIRES(ctx, n <= INT32_MAX,  // the launcher takes n as int
                absl::InvalidArgumentError("MsOptDampedInverse: n must fit in int32 on GPU"));
    const int64_t scratch = msopt_damped_inverse_workspace_elements(batch, static_cast<int>(n));
    Tensor workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<T>::value,
                                           TensorShape({std::max<int64_t>(scratch, 1)}),
                                           &workspace));
    const cudaStream_t stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
    const T damping = damping_tensor.scalar<T>()();
    const T* in = matrices.flat<T>().data();
    T* out = inverse->flat<T>().data();
    bool* ok_out = ok->flat<bool>().data();
    T* scratch_data = workspace.flat<T>().data();
    const int size = static_cast<int>(n);
    int status;
    if constexpr (std::is_same_v<T, float>) {
      status = msopt_damped_inverse_f32(in, damping, batch, size, out, ok_out, scratch_data,
                                        stream);
    } else {
      status = msopt_damped_inverse_f64(in, damping, batch, size, out, ok_out, scratch_data,
                                        stream);
    }
    OP_REQUIRES(ctx, status == 0,
                absl::InternalError(std::string("MsOptDampedInverse: CUDA launch failed: ") +
                                    cudaGetErrorString(static_cast<cudaError_t>(status))));
  }
};
#endif

}  // namespace msopt_inverse

REGISTER_OP("MsOptDampedInverse")
    .Input("matrices: T")
    .Input("damping: T")
    .Output("inverse: T")
    .Output("ok: bool")
    .Attr("T: {float, double}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle matrices, batch, unused;
      shape_inference::DimensionHandle n;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 2, &matrices));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(matrices, -2), c->Dim(matrices, -1), &n));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->Subshape(matrices, 0, -2, &batch));
      shape_inference::ShapeHandle inverse;
      TF_RETURN_IF_ERROR(c->Concatenate(batch, c->Matrix(n, n), &inverse));
      c->set_output(0, inverse);
      c->set_output(1, batch);
      return absl::OkStatus();
    })
    .Doc(R"doc(
inv(matrices + damping * I) for a batch [..., n, n] of symmetric positive definite
blocks (the lower triangle is read). `ok` (batch shape) is false where a block had
NaN/Inf entries, was not positive definite after damping, or its inverse
overflowed; such blocks get all-zero inverses. Never fails on numbers.
)doc");

#define MSOPT_REGISTER_CPU(T)                                                         \
  REGISTER_KERNEL_BUILDER(Name("MsOptDampedInverse").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          msopt_inverse::DampedInverseCpuOp<T>);
MSOPT_REGISTER_CPU(float)
MSOPT_REGISTER_CPU(double)
#undef MSOPT_REGISTER_CPU

REGISTER_OP("MsOptDampedInverseRetry")
    .Input("matrices: T")
    .Input("damping: T")
    .Output("inverse: T")
    .Output("retried: bool")
    .Output("ok: bool")
    .Attr("T: {float, double}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle matrices, batch, damping;
      shape_inference::DimensionHandle n;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 2, &matrices));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(matrices, -2), c->Dim(matrices, -1), &n));
      TF_RETURN_IF_ERROR(c->Subshape(matrices, 0, -2, &batch));
      TF_RETURN_IF_ERROR(c->Merge(c->input(1), batch, &damping));
      shape_inference::ShapeHandle inverse;
      TF_RETURN_IF_ERROR(c->Concatenate(damping, c->Matrix(n, n), &inverse));
      c->set_output(0, inverse);
      c->set_output(1, damping);
      c->set_output(2, damping);
      return absl::OkStatus();
    })
    .Doc(R"doc(
inv(matrices + damping * I) per block, damping of the batch shape; a block that
fails is inverted again with max(10 damping, 1e-4 * mean |finite diagonal|) + 1e-6.
`retried`: the first try failed; `ok`: a try succeeded (else the block is zero).
)doc");

#define MSOPT_REGISTER_CPU(T)                                                         \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("MsOptDampedInverseRetry").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
      msopt_inverse::DampedInverseRetryCpuOp<T>);
MSOPT_REGISTER_CPU(float)
MSOPT_REGISTER_CPU(double)
#undef MSOPT_REGISTER_CPU

#if defined(TF_MSOPT_WITH_CUDA)
#define MSOPT_REGISTER_GPU(T)                                     \
  REGISTER_KERNEL_BUILDER(Name("MsOptDampedInverse")              \
                              .Device(DEVICE_GPU)                 \
                              .TypeConstraint<T>("T")             \
                              .HostMemory("damping"),             \
                          msopt_inverse::DampedInverseGpuOp<T>);
MSOPT_REGISTER_GPU(float)
MSOPT_REGISTER_GPU(double)
#undef MSOPT_REGISTER_GPU
#endif

}  // namespace tensorflow
