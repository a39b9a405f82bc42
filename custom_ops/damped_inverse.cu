// CUDA damped block inverse: inverse[b] = inv(M_b + damping * I) for a batch of
// small symmetric positive definite blocks. Plain CUDA, no TensorFlow headers:
// compiled by nvcc into the op library (damped_inverse.cc calls the launchers
// under TF_MSOPT_WITH_CUDA), compiled stand-alone by CI, and driven directly by
// benchmarks/thor_inverse_cuda.py.
//
// Both kernels run in-place Gauss-Jordan elimination without pivoting (the
// symmetric positive definite case needs none): step k divides by the pivot
// A[k][k], which is the k-th Schur complement, so every pivot is > 0 exactly when
// the damped block is positive definite, the same test as Cholesky's.
//   - TiledInverseKernel (float32, n <= 256): the matrix in registers, one thread
//     block (n <= 128) or a cluster of two (n <= 256, sm_90+) per matrix.
//   - DampedInverseKernel (float64, larger blocks, float32 above 128 before
//     sm_90): one thread block per matrix, from shared memory when the block fits
//     there (up to 128 x 128 in float64 on sm_80+), from global memory otherwise.

#include <cooperative_groups.h>

#include <type_traits>

#include "damped_inverse_cuda.h"

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
  // check it for NaN/Inf (the upper triangle is not read, as in the CPU kernel).
  int bad = 0;
  for (int i = ty; i < n; i += kThreadsY) {
    for (int j = tx; j < n; j += kThreadsX) {
      T s = m[j <= i ? static_cast<long long>(i) * n + j : static_cast<long long>(j) * n + i];
      bad |= !IsFinite(s);
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

// ------------------------------------------------- cluster helpers (one block: plain)

template <int kCluster>
__device__ __forceinline__ int ClusterRank() {
  if constexpr (kCluster == 1) {
    return 0;
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return static_cast<int>(cooperative_groups::this_cluster().block_rank());
#else
    __trap();  // the launcher starts clusters on sm_90+ only
    return 0;
#endif
  }
}

// A barrier of every thread of the cluster, ordering its shared-memory writes, local
// and remote, before the reads after it.
template <int kCluster>
__device__ __forceinline__ void ClusterBarrier() {
  if constexpr (kCluster == 1) {
    __syncthreads();
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cooperative_groups::this_cluster().sync();
#else
    __trap();
#endif
  }
}

// The two halves of a cluster barrier, without ordering memory: a block may write into
// another block's shared memory only once that block has started, so the tiled kernel
// arrives on entry and waits before its first remote write, its loads in between.
template <int kCluster>
__device__ __forceinline__ void ClusterArrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kCluster > 1) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

template <int kCluster>
__device__ __forceinline__ void ClusterWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kCluster > 1) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// Writes `value` at `address` in the shared memory of every block of the cluster.
template <int kCluster, typename T>
__device__ __forceinline__ void StoreToCluster(T* address, T value) {
  if constexpr (kCluster == 1) {
    *address = value;
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // 32-bit shared-window addresses: generic pointers from map_shared_rank take two
    // registers each, and the tiled kernel has none to spare.
    static_assert(sizeof(T) == 4, "32-bit values only");
    const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(address));
    unsigned int bits;
    memcpy(&bits, &value, sizeof(bits));
#pragma unroll
    for (int rank = 0; rank < kCluster; ++rank) {
      unsigned int remote;
      asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
      asm volatile("st.shared::cluster.b32 [%0], %1;" ::"r"(remote),
                   "r"(bits) : "memory");
    }
#else
    __trap();
#endif
  }
}

// Whether `flag` is set in any thread of the cluster. `votes`: kCluster shared ints
// that no other call uses.
template <int kCluster>
__device__ __forceinline__ int ClusterAny(int flag, int* votes) {
  const int block_any = __syncthreads_or(flag);
  if constexpr (kCluster == 1) {
    return block_any;
  } else {
    if (threadIdx.x == 0) StoreToCluster<kCluster>(votes + ClusterRank<kCluster>(), block_any);
    ClusterBarrier<kCluster>();
    int any = 0;
#pragma unroll
    for (int rank = 0; rank < kCluster; ++rank) any |= votes[rank];
    return any;
  }
}

// ---------------------------------------------------------------- register-tiled kernel

// The same Gauss-Jordan steps with the matrix held in registers: each thread owns a
// kTile x kTile tile, so a step costs it 2 kTile shared loads (its slices of the pivot
// row and column) for kTile^2 FMAs, where the shared-memory kernel above spends three
// shared accesses per FMA. A cluster of kCluster thread blocks (sm_90+) splits the
// columns of one matrix when it is too large for one block's registers (256 x 256 is
// 256 KB, a whole register file): the block holding column k writes it into every
// block's shared memory (distributed shared memory) and the cluster meets at one
// barrier per step. The pivot buffers alternate between steps, so one barrier a step
// is enough: step k writes the buffer that step k - 2 read, and every thread has
// passed step k - 1's barrier after its reads of step k - 2.
//
// Each entry takes exactly the operations of the kernel above (row k scaled by 1/p,
// column k = -c/p, the rest a[i][j] - c_i r_j as one FMA), so both give the same bits.
template <int kTile, int kGridRows, int kGridCols, int kCluster>
struct TiledShape {
  static constexpr int kThreads = kGridRows * kGridCols;
  static constexpr int kRows = kTile * kGridRows;         // the largest n it takes
  static constexpr int kLocalCols = kTile * kGridCols;    // columns one block holds
  static_assert(kLocalCols * kCluster == kRows, "a cluster's columns must cover its rows");
};

template <int kTile, int kGridRows, int kGridCols, int kCluster>
__global__ void __launch_bounds__(kGridRows * kGridCols)
    TiledInverseKernel(const float* __restrict__ matrices, float damping, int n,
                       float* __restrict__ inverse, bool* __restrict__ ok) {
  using Shape = TiledShape<kTile, kGridRows, kGridCols, kCluster>;
  __shared__ __align__(16) float pivot_row[2][Shape::kLocalCols];
  __shared__ __align__(16) float pivot_col[2][Shape::kRows];
  __shared__ int votes[2][kCluster];
  ClusterArrive<kCluster>();
  const int rank = ClusterRank<kCluster>();
  const long long matrix = blockIdx.x / kCluster;
  const long long nn = static_cast<long long>(n) * n;
  const float* m = matrices + matrix * nn;
  float* out = inverse + matrix * nn;
  const int tid = threadIdx.x;
  const int tile_row = tid / kGridCols, tile_col = tid % kGridCols;
  const int row0 = tile_row * kTile;
  const int col0 = rank * Shape::kLocalCols + tile_col * kTile;

  // Load the damped symmetric matrix from its lower triangle; the padding beyond n is
  // the identity, which no step below n changes (its rows and columns meet the pivot
  // row and column in zeros).
  float a[kTile][kTile];
  int bad = 0;
#pragma unroll
  for (int i = 0; i < kTile; ++i) {
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const int r = row0 + i, c = col0 + j;
      float s = r == c ? 1.0f : 0.0f;
      if (r < n && c < n) {
        s = m[c <= r ? static_cast<long long>(r) * n + c : static_cast<long long>(c) * n + r];
        bad |= !isfinite(s);
        if (r == c) s += damping;
      }
      a[i][j] = s;
    }
  }
  ClusterWait<kCluster>();
  bad = ClusterAny<kCluster>(bad || !isfinite(damping), votes[0]);

  for (int k0 = 0; k0 < n && !bad; k0 += kTile) {
    const bool holds_row = tile_row == k0 / kTile;
    const bool holds_col = col0 == k0;
#pragma unroll
    for (int kk = 0; kk < kTile; ++kk) {
      const int k = k0 + kk, buffer = k & 1;
      if (k >= n) break;
      if (holds_row) {
#pragma unroll
        for (int j = 0; j < kTile; ++j) pivot_row[buffer][tile_col * kTile + j] = a[kk][j];
      }
      if (holds_col) {
#pragma unroll
        for (int i = 0; i < kTile; ++i) {
          StoreToCluster<kCluster>(&pivot_col[buffer][row0 + i], a[i][kk]);
        }
      }
      ClusterBarrier<kCluster>();
      const float pivot = pivot_col[buffer][k];
      if (!(pivot > 0.0f) || !isfinite(pivot)) {  // the same value everywhere: uniform exit
        bad = 1;
        break;
      }
      const float pivot_inv = 1.0f / pivot;
      float c[kTile], r[kTile];
#pragma unroll
      for (int i = 0; i < kTile; ++i) c[i] = pivot_col[buffer][row0 + i];
#pragma unroll
      for (int j = 0; j < kTile; ++j) r[j] = pivot_row[buffer][tile_col * kTile + j] * pivot_inv;
      if (holds_row) {  // row k becomes r: 0 - (-1) r
        c[kk] = -1.0f;
#pragma unroll
        for (int j = 0; j < kTile; ++j) a[kk][j] = 0.0f;
      }
      if (holds_col) {  // column k becomes -c / p: 0 - c (1 / p)
        r[kk] = pivot_inv;
#pragma unroll
        for (int i = 0; i < kTile; ++i) a[i][kk] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kTile; ++i) {
#pragma unroll
        for (int j = 0; j < kTile; ++j) a[i][j] -= c[i] * r[j];
      }
    }
  }

  if (!bad) {
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
#pragma unroll
      for (int j = 0; j < kTile; ++j) bad |= !isfinite(a[i][j]);
    }
  }
  bad = ClusterAny<kCluster>(bad, votes[1]);
#pragma unroll
  for (int i = 0; i < kTile; ++i) {
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const int r = row0 + i, c = col0 + j;
      if (r < n && c < n) out[static_cast<long long>(r) * n + c] = bad ? 0.0f : a[i][j];
    }
  }
  if (tid == 0 && rank == 0) ok[matrix] = !bad;
}

}  // namespace msopt_cuda

namespace {

// Grid x is limited to 2^31 - 1 blocks; larger batches go in several launches.
constexpr int64_t kMaxGrid = 2147483647LL;

template <typename T>
int LaunchShared(const T* matrices, T damping, int64_t batch, int n, T* inverse, bool* ok,
                 T* workspace, int device, cudaStream_t stream) {
  const dim3 block(msopt_cuda::kThreadsX, msopt_cuda::kThreadsY);
  const size_t shared = (static_cast<size_t>(n) * n + 2 * static_cast<size_t>(n)) * sizeof(T);
  int shared_limit = 0;
  cudaError_t err =
      cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const bool use_shared = shared <= static_cast<size_t>(shared_limit);
  if (use_shared && shared > 48 * 1024) {
    err = cudaFuncSetAttribute(msopt_cuda::DampedInverseKernel<T, true>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared));
    if (err != cudaSuccess) return err;
  }
  const long long nn = static_cast<long long>(n) * n;
  for (int64_t first = 0; first < batch; first += kMaxGrid) {
    const unsigned int blocks =
        static_cast<unsigned int>(batch - first < kMaxGrid ? batch - first : kMaxGrid);
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

// One launch (or one per 2^31 - 1 blocks) of the register-tiled kernel of this shape;
// a cluster shape goes through cudaLaunchKernelEx with the cluster's size.
template <int kTile, int kGridRows, int kGridCols, int kCluster>
int LaunchTiled(const float* matrices, float damping, int64_t batch, int n, float* inverse,
                bool* ok, cudaStream_t stream) {
  using Shape = msopt_cuda::TiledShape<kTile, kGridRows, kGridCols, kCluster>;
  const auto kernel = msopt_cuda::TiledInverseKernel<kTile, kGridRows, kGridCols, kCluster>;
  const long long nn = static_cast<long long>(n) * n;
  const int64_t per_launch = kMaxGrid / kCluster;
  for (int64_t first = 0; first < batch; first += per_launch) {
    const int64_t count = batch - first < per_launch ? batch - first : per_launch;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned int>(count * kCluster));
    config.blockDim = dim3(Shape::kThreads);
    config.stream = stream;
    cudaLaunchAttribute cluster[1];
    if constexpr (kCluster > 1) {
      cluster[0].id = cudaLaunchAttributeClusterDimension;
      cluster[0].val.clusterDim.x = kCluster;
      cluster[0].val.clusterDim.y = 1;
      cluster[0].val.clusterDim.z = 1;
      config.attrs = cluster;
      config.numAttrs = 1;
    }
    const cudaError_t err = cudaLaunchKernelEx(&config, kernel, matrices + first * nn, damping,
                                               n, inverse + first * nn, ok + first);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T>
int Launch(const T* matrices, T damping, int64_t batch, int n, T* inverse, bool* ok,
           T* workspace, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if constexpr (std::is_same_v<T, float>) {
    // Shapes: tiles of 8 x 8 (4 x 4 up to 32), one block of 64 threads up to 64, of 256
    // up to 128, and two blocks of 512 up to 256: the fastest of the tile and cluster
    // shapes timed on an H200 with 1,024 blocks (with 16 to 256 blocks of 64, 4 x 4 tiles
    // on 256 threads were up to 1.4x faster).
    if (n <= 32) return LaunchTiled<4, 8, 8, 1>(matrices, damping, batch, n, inverse, ok, stream);
    if (n <= 64) return LaunchTiled<8, 8, 8, 1>(matrices, damping, batch, n, inverse, ok, stream);
    if (n <= 128) {
      return LaunchTiled<8, 16, 16, 1>(matrices, damping, batch, n, inverse, ok, stream);
    }
    int major = 0;
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) return err;
    if (n <= 256 && major >= 9) {
      return LaunchTiled<8, 32, 16, 2>(matrices, damping, batch, n, inverse, ok, stream);
    }
  }
  return LaunchShared(matrices, damping, batch, n, inverse, ok, workspace, device, stream);
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

