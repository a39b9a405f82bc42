// LARS around SGD with momentum (MindSpore nn.LARS + Keras SGD), two passes over memory.
//
// For a variable w with gradient g, accumulator a (Keras SGD's momentum slot):
//   trust = coefficient * |w| / (weight_decay * |w| + |g| + epsilon)
//   trust = clip(trust / lr, 0, 1)                       (use_clip)
//   trust = 1                                            (|w| = 0 or |g| = 0)
//   g'    = g + weight_decay * w
//   a     = a * momentum - (trust * lr) * g'
//   w    += a                                            (use_nesterov: a * momentum - trust*lr*g')
//
// The trust ratio needs both norms before the first element can be updated, so
// two passes are the minimum: pass 1 reads w and g once (both sums of squares
// at the same time, accumulated in double), pass 2 reads w, g and a and writes
// w and a, with g' formed in registers. Doing the same with TensorFlow ops
// costs two more passes (g + wd*w written and read back) and a kernel launch per op.
// MsOptLarsGradient is the same first pass for any other wrapped optimizer, then a
// pass writing trust * (g + wd * w) for it.
//
// Both passes are sharded over the intra-op thread pool and prefetch ahead
// (streaming.h). Pass 1 splits the range into fixed blocks whose partial sums
// are added in block order, so the result does not depend on the number of
// threads. Each pass is compiled for
// AVX2+FMA as well as the baseline ISA (chosen at run time on x86-64); products
// may be fused (FMA): results agree with the pure-TF path to about 1e-7 relative.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "scalar_inputs.h"
#include "streaming.h"

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

absl::Status LarsMomentumShape(InferenceContext* c) {
  ShapeHandle shape = c->input(2);  // grad
  for (int i = 0; i < 2; ++i) {
    const auto* handle_data = c->input_handle_shapes_and_types(i);
    if (handle_data != nullptr && handle_data->size() == 1) {
      TF_RETURN_IF_ERROR(c->Merge(shape, (*handle_data)[0].shape, &shape));
    }
  }
  ShapeHandle scalar;
  for (int i = 3; i < c->num_inputs(); ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &scalar));
  }
  return absl::OkStatus();
}

REGISTER_OP("MsOptResourceApplyLarsMomentum")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("grad: T")
    .Input("lr: T")
    .Input("momentum: T")
    .Input("weight_decay: T")
    .Input("coefficient: T")
    .Input("epsilon: T")
    .Attr("T: {float, double}")
    .Attr("use_clip: bool = false")
    .Attr("use_nesterov: bool = false")
    .Attr("use_locking: bool = false")
    .SetShapeFn(LarsMomentumShape)
    .Doc(R"doc(
LARS (MindSpore nn.LARS semantics) around Keras' SGD with momentum, in two passes:
the norms of var and grad, then accum = accum * momentum - trust * lr * (grad +
weight_decay * var) and var += accum (Nesterov: var += accum * momentum - trust * lr * g').
)doc");

REGISTER_OP("MsOptLarsGradient")
    .Input("var: T")
    .Input("grad: T")
    .Input("lr: T")
    .Input("weight_decay: T")
    .Input("coefficient: T")
    .Input("epsilon: T")
    .Output("scaled: T")
    .Attr("T: {float, double}")
    .Attr("use_clip: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &shape));
      ShapeHandle scalar;
      for (int i = 2; i < c->num_inputs(); ++i) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &scalar));
      }
      c->set_output(0, shape);
      return absl::OkStatus();
    })
    .Doc(R"doc(
LARS' scaled gradient trust * (grad + weight_decay * var) for any wrapped optimizer, in two
passes over memory (the norms of var and grad, then the scaling).
)doc");

// Elements per block of the norm pass: 64 KiB of float32 per array.
constexpr int64_t kNormBlock = 16384;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MSOPT_LARS_X86 1
#define MSOPT_FMA_TARGET __attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
#endif

// Sums of squares of w and g over [0, n), in double. Four-wide double vectors
// (GCC/Clang vector extensions) keep the loop vectorised without -ffast-math.
typedef double Double4 __attribute__((vector_size(32)));
typedef float Float4 __attribute__((vector_size(16)));

template <typename T>
inline __attribute__((always_inline)) void SumSquaresBody(const T* w, const T* g, int64_t n,
                                                           double* w_sum, double* g_sum) {
  Double4 w_acc[2] = {}, g_acc[2] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __builtin_prefetch(w + i + tf_msopt::kPrefetchBytes / sizeof(T));
    __builtin_prefetch(g + i + tf_msopt::kPrefetchBytes / sizeof(T));
    for (int k = 0; k < 2; ++k) {
      Double4 wv, gv;
      if constexpr (sizeof(T) == sizeof(float)) {
        Float4 wf, gf;
        __builtin_memcpy(&wf, w + i + 4 * k, sizeof(Float4));
        __builtin_memcpy(&gf, g + i + 4 * k, sizeof(Float4));
        wv = __builtin_convertvector(wf, Double4);
        gv = __builtin_convertvector(gf, Double4);
      } else {
        __builtin_memcpy(&wv, w + i + 4 * k, sizeof(Double4));
        __builtin_memcpy(&gv, g + i + 4 * k, sizeof(Double4));
      }
      w_acc[k] += wv * wv;
      g_acc[k] += gv * gv;
    }
  }
  double ws = 0.0, gs = 0.0;
  for (int lane = 0; lane < 4; ++lane) {
    ws += w_acc[0][lane] + w_acc[1][lane];
    gs += g_acc[0][lane] + g_acc[1][lane];
  }
  for (; i < n; ++i) {
    ws += double(w[i]) * double(w[i]);
    gs += double(g[i]) * double(g[i]);
  }
  *w_sum = ws;
  *g_sum = gs;
}

template <typename T>
struct UpdateScalars {
  T momentum, scaled_lr, decay_lr;  // decay_lr = scaled_lr * weight_decay
};

template <typename T, bool kNesterov>
inline __attribute__((always_inline)) void UpdateBody(const UpdateScalars<T>& s, int64_t n,
                                                      const T* __restrict g, T* __restrict a,
                                                      T* __restrict w) {
  const T momentum = s.momentum, scaled_lr = s.scaled_lr, decay_lr = s.decay_lr;
  auto update = [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const T wi = w[i];
      const T step = scaled_lr * g[i] + decay_lr * wi;  // trust * lr * (g + wd * w)
      const T ai = a[i] * momentum - step;
      a[i] = ai;
      w[i] = kNesterov ? wi + (ai * momentum - step) : wi + ai;
    }
  };
  tf_msopt::StreamChunks<T>(0, n, update, g, a, w);
}

// `out` may be `g` itself (the output took over the gradient's buffer): each element is read
// before it is written, so neither is declared __restrict.
template <typename T>
inline __attribute__((always_inline)) void ScaleBody(T trust, T decay_trust, int64_t n,
                                                     const T* w, const T* g, T* out) {
  if (decay_trust == T(0)) {   // no weight decay: w is not read again
    auto scale = [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) out[i] = trust * g[i];
    };
    tf_msopt::StreamChunks<T>(0, n, scale, g);
    return;
  }
  auto scale = [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) out[i] = trust * g[i] + decay_trust * w[i];
  };
  tf_msopt::StreamChunks<T>(0, n, scale, w, g);
}

template <typename T>
void SumSquaresDefault(const T* w, const T* g, int64_t n, double* ws, double* gs) {
  SumSquaresBody(w, g, n, ws, gs);
}
template <typename T, bool kNesterov>
void UpdateDefault(const UpdateScalars<T>& s, int64_t n, const T* g, T* a, T* w) {
  UpdateBody<T, kNesterov>(s, n, g, a, w);
}

template <typename T>
void ScaleDefault(T trust, T decay_trust, int64_t n, const T* w, const T* g, T* out) {
  ScaleBody(trust, decay_trust, n, w, g, out);
}

#ifdef MSOPT_LARS_X86
template <typename T>
MSOPT_FMA_TARGET void ScaleFma(T trust, T decay_trust, int64_t n, const T* w, const T* g,
                               T* out) {
  ScaleBody(trust, decay_trust, n, w, g, out);
}
template <typename T>
MSOPT_FMA_TARGET void SumSquaresFma(const T* w, const T* g, int64_t n, double* ws, double* gs) {
  SumSquaresBody(w, g, n, ws, gs);
}
template <typename T, bool kNesterov>
MSOPT_FMA_TARGET void UpdateFma(const UpdateScalars<T>& s, int64_t n, const T* g, T* a, T* w) {
  UpdateBody<T, kNesterov>(s, n, g, a, w);
}

bool HasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

template <typename T>
void SumSquares(const T* w, const T* g, int64_t n, double* ws, double* gs) {
#ifdef MSOPT_LARS_X86
  if (HasAvx2Fma()) return SumSquaresFma(w, g, n, ws, gs);
#endif
  SumSquaresDefault(w, g, n, ws, gs);
}

template <typename T>
void Scale(T trust, T decay_trust, int64_t n, const T* w, const T* g, T* out) {
#ifdef MSOPT_LARS_X86
  if (HasAvx2Fma()) return ScaleFma(trust, decay_trust, n, w, g, out);
#endif
  ScaleDefault(trust, decay_trust, n, w, g, out);
}

// LARS' trust ratio of w and g (n elements each), as the pure-TF path computes it, from
// both sums of squares taken in one parallel pass over fixed blocks added in block order
// (so the result does not depend on the number of threads).
template <typename T>
T TrustRatio(const CPUDevice& device, const T* w, const T* g, int64_t n, T lr, T weight_decay,
             T coefficient, T epsilon, bool use_clip) {
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(2 * blocks, 0.0);
  const Eigen::TensorOpCost block_cost(2.0 * sizeof(T) * kNormBlock, 0, 2.0 * kNormBlock);
  device.parallelFor(blocks, block_cost, [&](Eigen::Index first, Eigen::Index last) {
    for (Eigen::Index b = first; b < last; ++b) {
      const int64_t begin = b * kNormBlock, size = std::min(kNormBlock, n - begin);
      SumSquares<T>(w + begin, g + begin, size, &partial[2 * b], &partial[2 * b + 1]);
    }
  });
  double w_sum = 0.0, g_sum = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    w_sum += partial[2 * b];
    g_sum += partial[2 * b + 1];
  }
  const T w_norm = T(std::sqrt(w_sum)), g_norm = T(std::sqrt(g_sum));
  T trust = coefficient * w_norm / (g_norm + epsilon + weight_decay * w_norm);
  if (use_clip) trust = std::min(std::max(trust / lr, T(0)), T(1));
  if (!(w_norm > T(0) && g_norm > T(0))) trust = T(1);
  return trust;
}

template <typename T, bool kNesterov>
void Update(const UpdateScalars<T>& s, int64_t n, const T* g, T* a, T* w) {
#ifdef MSOPT_LARS_X86
  if (HasAvx2Fma()) return UpdateFma<T, kNesterov>(s, n, g, a, w);
#endif
  UpdateDefault<T, kNesterov>(s, n, g, a, w);
}

template <typename T>
class LarsMomentumOp : public OpKernel {
 public:
  explicit LarsMomentumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_clip", &use_clip_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_nesterov", &use_nesterov_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_locking", &use_locking_));
  }

  void Compute(OpKernelContext* ctx) override {
    static const char* const kNames[2] = {"var", "accum"};
    for (int i = 0; i < 2; ++i) {  // checked before anything reads the buffers as T
      core::RefCountPtr<Var> resource;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &resource));
      OP_REQUIRES(ctx, resource->tensor()->dtype() == DataTypeToEnum<T>::v(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "'", kNames[i], "' must have the gradient's dtype ",
                      DataTypeString(DataTypeToEnum<T>::v()), ", but got ",
                      DataTypeString(resource->tensor()->dtype()), ".")));
    }
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, T>(ctx, use_locking_,
                                                                     /*sparse=*/false, {0, 1});
    // Copy-on-write: a buffer still shared with a pending read is copied first.
    Tensor var, accum;
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, T>(ctx, 0, use_locking_,
                                                                 /*sparse=*/false, &var));
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, T>(ctx, 1, use_locking_,
                                                                 /*sparse=*/false, &accum));
    OP_REQUIRES(ctx, var.IsInitialized() && accum.IsInitialized(),
                absl::FailedPreconditionError("Attempting to use uninitialized variables."));
    const Tensor& grad = ctx->input(2);
    OP_REQUIRES(ctx, var.shape() == grad.shape() && accum.shape() == grad.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "'var', 'accum' and 'grad' must have the same shape, but got ",
                    var.shape().DebugString(), ", ", accum.shape().DebugString(), " and ",
                    grad.shape().DebugString(), ".")));
    T scalars[5];
    OP_REQUIRES_OK(ctx, tf_msopt::ReadScalars(
                            ctx, 3, {"lr", "momentum", "weight_decay", "coefficient", "epsilon"},
                            scalars));
    const T lr = scalars[0], momentum = scalars[1], weight_decay = scalars[2];
    const T coefficient = scalars[3], epsilon = scalars[4];

    T* w = var.flat<T>().data();
    T* a = accum.flat<T>().data();
    const T* g = grad.flat<T>().data();
    const int64_t n = grad.NumElements();
    const CPUDevice& device = ctx->eigen_device<CPUDevice>();

    // Pass 1: the two norms and the trust ratio.
    const T trust = TrustRatio(device, w, g, n, lr, weight_decay, coefficient, epsilon,
                               use_clip_);
    UpdateScalars<T> s;
    s.momentum = momentum;
    s.scaled_lr = trust * lr;
    s.decay_lr = s.scaled_lr * weight_decay;

    // Pass 2: the momentum update with g + wd * w formed in registers.
    const Eigen::TensorOpCost cost(3 * sizeof(T), 2 * sizeof(T), /*compute_cycles=*/6);
    const bool nesterov = use_nesterov_;
    device.parallelFor(n, cost, [&](Eigen::Index begin, Eigen::Index end) {
      if (nesterov) {
        Update<T, true>(s, end - begin, g + begin, a + begin, w + begin);
      } else {
        Update<T, false>(s, end - begin, g + begin, a + begin, w + begin);
      }
    });
  }

 private:
  bool use_clip_;
  bool use_nesterov_;
  bool use_locking_;
};

// trust * (grad + weight_decay * var) for a wrapped optimizer other than SGD-momentum: the
// norm pass, then one pass writing the scaled gradient (into grad's buffer when nothing
// else holds it).
template <typename T>
class LarsGradientOp : public OpKernel {
 public:
  explicit LarsGradientOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_clip", &use_clip_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& var = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    OP_REQUIRES(ctx, var.shape() == grad.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "'var' and 'grad' must have the same shape, but got ",
                    var.shape().DebugString(), " and ", grad.shape().DebugString(), ".")));
    T scalars[4];
    OP_REQUIRES_OK(ctx, tf_msopt::ReadScalars(
                            ctx, 2, {"lr", "weight_decay", "coefficient", "epsilon"}, scalars));
    const T weight_decay = scalars[1];
    const T* w = var.flat<T>().data();
    const T* g = grad.flat<T>().data();
    const int64_t n = grad.NumElements();
    const CPUDevice& device = ctx->eigen_device<CPUDevice>();
    const T trust = TrustRatio(device, w, g, n, scalars[0], weight_decay, scalars[2],
                               scalars[3], use_clip_);
    Tensor* scaled = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 0, grad.shape(), &scaled));
    T* out = scaled->flat<T>().data();
    const T decay_trust = trust * weight_decay;
    const Eigen::TensorOpCost cost(2 * sizeof(T), sizeof(T), /*compute_cycles=*/2);
    device.parallelFor(n, cost, [&](Eigen::Index begin, Eigen::Index end) {
      Scale(trust, decay_trust, end - begin, w + begin, g + begin, out + begin);
    });
  }

 private:
  bool use_clip_;
};

#define MSOPT_REGISTER_LARS(T)                                                             \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("MsOptResourceApplyLarsMomentum").Device(DEVICE_CPU).TypeConstraint<T>("T"),   \
      LarsMomentumOp<T>);                                                                  \
  REGISTER_KERNEL_BUILDER(Name("MsOptLarsGradient").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          LarsGradientOp<T>);
MSOPT_REGISTER_LARS(float)
MSOPT_REGISTER_LARS(double)
#undef MSOPT_REGISTER_LARS

}  // namespace
}  // namespace tensorflow
