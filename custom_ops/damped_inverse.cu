// CUDA damped block inverse: inverse[b] = inv(M_b + damping * I) for a batch of
// small symmetric positive definite blocks. Plain CUDA, no TensorFlow headers:
// compiled by nvcc into the op library (damped_inverse.cc calls the launchers
// under TF_MSOPT_WITH_CUDA), compiled stand-alone by CI, and driven directly by
// benchmarks/thor_inverse_cuda.py. With -DMSOPT_KERNELS_ONLY only the kernel is
// compiled (for NVRTC / CuPy RawModule).
//
// One thread block inverts one matrix with in-place Gauss-Jordan elimination
// without pivoting (the symmetric positive definite case needs none): step k
// divides by the pivot A[k][k], which is the k-th Schur complement, so every
// pivot is > 0 exactly when the damped block is positive definite, the same
// test as Cholesky's. Each step updates all n^2 entries in parallel, so a
// 128 x 128 block runs 128 steps of 16384 independent updates with two
// barriers each, from shared memory when the block fits there (up to 128 x 128
// in float64 on sm_80+), from global memory otherwise (any size, slower).

#ifndef MSOPT_KERNELS_ONLY
#include "damped_inverse_cuda.h"
#endif

namespace msopt_cuda {

constexpr int kThreadsX = 32;  // one warp along a row: coalesced, bank-conflict free
// 32 rows of a warp each: a step is a few loads and an FMA per entry between two barriers,
// so a whole 1024-thread block hides the barriers' latency (2.1x faster at n=128 on an H200
// than 8 rows).
constexpr int kThreadsY = 32;

template <typename T>
__device__ __forceinline__ bool IsFinite(T x) {
  return isfinite(x);
}

// Grid: one block per matrix; block: kThreadsX x kThreadsY threads. kShared:
// the matrix lives in dynamic shared memory ((n*n + 2n) elements); otherwise it
// is factorised in place in `inverse` and the two pivot buffers come from
// `workspace` (2n elements per matrix).
template <typename T, bool kShared>
__global__ void __launch_bounds__(kThreadsX * kThreadsY)
    DampedInverseKernel(const T* __restrict__ matrices, T damping, int n,
                        T* __restrict__ inverse, bool* __restrict__ ok,
                        T* __restrict__ workspace) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ int failed;
  const long long nn = static_cast<long long>(n) * n;
  const T* m = matrices + blockIdx.x * nn;
  T* out = inverse + blockIdx.x * nn;
  T* a = kShared ? reinterpret_cast<T*>(shared_bytes) : out;
  T* pivot_row = kShared ? a + nn : workspace + blockIdx.x * 2LL * n;  // row k / pivot
  T* pivot_col = pivot_row + n;                                       // column k
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * kThreadsX + tx, threads = kThreadsX * kThreadsY;

  // Load the symmetric matrix from the lower triangle, damp the diagonal, and
  // check the whole block for NaN/Inf.
  int bad = 0;
  for (int i = ty; i < n; i += kThreadsY) {
    for (int j = tx; j < n; j += kThreadsX) {
      const T value = m[static_cast<long long>(i) * n + j];
      bad |= !IsFinite(value);
      T s = j <= i ? value : m[static_cast<long long>(j) * n + i];
      if (i == j) s += damping;
      a[static_cast<long long>(i) * n + j] = s;
    }
  }
  bad = __syncthreads_or(bad);
  if (tid == 0) failed = bad || !IsFinite(damping);
  __syncthreads();

  for (int k = 0; k < n && !failed; ++k) {
    const T pivot = a[static_cast<long long>(k) * n + k];
    if (!(pivot > T(0)) || !IsFinite(pivot)) {  // same value in every thread: uniform exit
      if (tid == 0) failed = 1;
      break;
    }
    const T pivot_inv = T(1) / pivot;
    for (int t = tid; t < n; t += threads) {
      pivot_row[t] = a[static_cast<long long>(k) * n + t] * pivot_inv;
      pivot_col[t] = a[static_cast<long long>(t) * n + k];
    }
    __syncthreads();
    for (int i = ty; i < n; i += kThreadsY) {
      const T c = pivot_col[i];
      T* row = a + static_cast<long long>(i) * n;
      for (int j = tx; j < n; j += kThreadsX) {
        if (i == k) {
          row[j] = j == k ? pivot_inv : pivot_row[j];
        } else if (j == k) {
          row[j] = -c * pivot_inv;
        } else {
          row[j] -= c * pivot_row[j];
        }
      }
    }
    __syncthreads();
  }
  __syncthreads();

  bad = failed;
  if (!bad) {
    for (int i = ty; i < n; i += kThreadsY) {
      for (int j = tx; j < n; j += kThreadsX) {
        const T value = a[static_cast<long long>(i) * n + j];
        bad |= !IsFinite(value);
        if (kShared) out[static_cast<long long>(i) * n + j] = value;
      }
    }
  }
  bad = __syncthreads_or(bad);
  if (bad) {
    for (long long e = tid; e < nn; e += threads) out[e] = T(0);
  }
  if (tid == 0) ok[blockIdx.x] = !bad;
}

}  // namespace msopt_cuda

#ifndef MSOPT_KERNELS_ONLY

namespace {

template <typename T>
int Launch(const T* matrices, T damping, int64_t batch, int n, T* inverse, bool* ok,
           T* workspace, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const dim3 block(msopt_cuda::kThreadsX, msopt_cuda::kThreadsY);
  // Grid x is limited to 2^31 - 1 blocks; larger batches go in several launches.
  const int64_t max_grid = 2147483647LL;
  const size_t shared = (static_cast<size_t>(n) * n + 2 * static_cast<size_t>(n)) * sizeof(T);
  int device = 0, shared_limit = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const bool use_shared = shared <= static_cast<size_t>(shared_limit);
  if (use_shared && shared > 48 * 1024) {
    err = cudaFuncSetAttribute(msopt_cuda::DampedInverseKernel<T, true>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared));
    if (err != cudaSuccess) return err;
  }
  const long long nn = static_cast<long long>(n) * n;
  for (int64_t first = 0; first < batch; first += max_grid) {
    const unsigned int blocks = static_cast<unsigned int>(
        batch - first < max_grid ? batch - first : max_grid);
    if (use_shared) {
      msopt_cuda::DampedInverseKernel<T, true><<<blocks, block, shared, stream>>>(
          matrices + first * nn, damping, n, inverse + first * nn, ok + first, nullptr);
    } else {
      msopt_cuda::DampedInverseKernel<T, false><<<blocks, block, 0, stream>>>(
          matrices + first * nn, damping, n, inverse + first * nn, ok + first,
          workspace + first * 2LL * n);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

extern "C" int64_t msopt_damped_inverse_workspace_elements(int64_t batch, int n) {
  return batch * 2 * static_cast<int64_t>(n);
}

extern "C" int msopt_damped_inverse_f32(const float* matrices, float damping, int64_t batch, int n,
                                        float* inverse, bool* ok, float* workspace,
                                        cudaStream_t stream) {
  return Launch(matrices, damping, batch, n, inverse, ok, workspace, stream);
}

extern "C" int msopt_damped_inverse_f64(const double* matrices, double damping, int64_t batch,
                                        int n, double* inverse, bool* ok, double* workspace,
                                        cudaStream_t stream) {
  return Launch(matrices, damping, batch, n, inverse, ok, workspace, stream);
}

#endif  // MSOPT_KERNELS_ONLY
