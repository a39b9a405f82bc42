// C interface of the CUDA damped block inverse (damped_inverse.cu), shared by
// the TensorFlow GPU kernel (damped_inverse.cc) and stand-alone drivers
// (benchmarks/thor_inverse_cuda.py). Plain CUDA runtime types, no TensorFlow.
#ifndef TF_MSOPT_DAMPED_INVERSE_CUDA_H_
#define TF_MSOPT_DAMPED_INVERSE_CUDA_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Elements of scratch memory (of the matrices' dtype) a launch needs.
int64_t msopt_damped_inverse_workspace_elements(int64_t batch, int n);

// inverse[b] = inv(matrices[b] + damping * I) for b < batch, n x n row-major
// blocks (the lower triangle is read); ok[b] = block finite, positive definite
// and its inverse finite (failed blocks are zero-filled). All pointers are
// device memory; `workspace` holds msopt_damped_inverse_workspace_elements()
// elements. Asynchronous on `stream`; returns a cudaError_t (0 = launched).
int msopt_damped_inverse_f32(const float* matrices, float damping, int64_t batch, int n,
                             float* inverse, bool* ok, float* workspace, cudaStream_t stream);
int msopt_damped_inverse_f64(const double* matrices, double damping, int64_t batch, int n,
                             double* inverse, bool* ok, double* workspace, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif  // TF_MSOPT_DAMPED_INVERSE_CUDA_H_
