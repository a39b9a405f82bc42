// One-pass CPU kernels for the AddSign / PowerSign updates (Bello et al. 2017).
//
//   m   = m * beta + grad * (1 - beta)
//   AddSign:   var -= lr * (alpha + sign_decay * sign(grad) * sign(m)) * grad
//   PowerSign: var -= lr * exp(logbase * sign_decay * sign(grad) * sign(m)) * grad
//
// TensorFlow's ResourceApplyAddSign evaluates m and var as two Eigen expressions,
// so it streams over memory twice. Here each element is read and written once,
// sharded over the intra-op thread pool, with software prefetch (streaming.h).
// sign(grad) * sign(m) is -1, 0 or 1, so the three possible scale factors are
// computed once per call (which also keeps exp() out of the loop) with the same
// operand order as TensorFlow's kernels: the results agree with them bit for bit.
#define EIGEN_USE_THREADS

#include <cmath>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "scalar_inputs.h"
#include "streaming.h"

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

absl::Status SignUpdateShape(InferenceContext* c) {
  ShapeHandle unused;
  for (int i = 2; i <= 5; ++i) {  // lr, alpha/logbase, sign_decay, beta
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  }
  const auto* var_shapes = c->input_handle_shapes_and_types(0);
  if (var_shapes != nullptr && !var_shapes->empty()) {
    TF_RETURN_IF_ERROR(c->Merge(c->input(6), (*var_shapes)[0].shape, &unused));
  }
  return absl::OkStatus();
}

template <typename T>
T Sign(T x) {
  return T(x > T(0)) - T(x < T(0));
}

// scale[s + 1] is the factor multiplying grad when sign(grad) * sign(m) == s.
template <typename T>
void AddSignScales(T lr, T alpha, T sign_decay, T scale[3]) {
  for (int s = -1; s <= 1; ++s) scale[s + 1] = lr * (alpha + sign_decay * T(s));
}

template <typename T>
void PowerSignScales(T lr, T logbase, T sign_decay, T scale[3]) {
  for (int s = -1; s <= 1; ++s) scale[s + 1] = lr * std::exp(logbase * sign_decay * T(s));
}

// The inner loop, compiled for AVX2 as well as the baseline ISA (picked at load
// time); branch-free selects let the compiler vectorise it. No FMA: both clones
// round exactly like TensorFlow's kernels.
template <typename T>
__attribute__((target_clones("avx2", "default"))) void UpdateRange(
    Eigen::Index begin, Eigen::Index end, const T scale[3], T beta, T one_minus_beta,
    const T* __restrict grad, T* __restrict m, T* __restrict var) {
  const T negative = scale[0], zero = scale[1], positive = scale[2];
  auto update = [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const T g = grad[i];
      const T m_new = m[i] * beta + g * one_minus_beta;
      m[i] = m_new;
      const T sign_product = Sign(g) * Sign(m_new);
      T factor = sign_product > T(0) ? positive : zero;
      factor = sign_product < T(0) ? negative : factor;
      var[i] -= factor * g;
    }
  };
  tf_msopt::StreamChunks<T>(begin, end, update, grad, m, var);
}

// The name of each op's second scalar input (its REGISTER_SIGN_OP argument below).
constexpr char kAlpha[] = "alpha";
constexpr char kLogbase[] = "logbase";

template <typename T, void (*kScales)(T, T, T, T[3]), const char* kCoefficient>
class ApplySignOp : public OpKernel {
 public:
  explicit ApplySignOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_locking", &use_exclusive_lock_));
  }

  void Compute(OpKernelContext* ctx) override {
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, T>(
        ctx, use_exclusive_lock_, /*sparse=*/false, {0, 1});
    // Copy-on-write: a buffer still shared with a pending read is copied first.
    Tensor var, m;
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, T>(
                            ctx, 0, use_exclusive_lock_, /*sparse=*/false, &var));
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, T>(
                            ctx, 1, use_exclusive_lock_, /*sparse=*/false, &m));
    OP_REQUIRES(ctx, var.IsInitialized() && m.IsInitialized(),
                errors::FailedPrecondition("Attempting to use uninitialized variables: ",
                                           requested_input(0), ", ", requested_input(1)));
    const Tensor& grad = ctx->input(6);
    OP_REQUIRES(ctx, var.shape().IsSameSize(m.shape()) && var.shape().IsSameSize(grad.shape()),
                errors::InvalidArgument("var, m and grad must have the same shape: ",
                                        var.shape().DebugString(), ", ", m.shape().DebugString(),
                                        ", ", grad.shape().DebugString()));
    T scalars[4];
    OP_REQUIRES_OK(ctx, tf_msopt::ReadScalars(ctx, 2, {"lr", kCoefficient, "sign_decay", "beta"},
                                              scalars));
    T scale[3];
    kScales(scalars[0], scalars[1], scalars[2], scale);
    const T beta = scalars[3];
    const T one_minus_beta = T(1) - beta;

    T* var_data = var.flat<T>().data();
    T* m_data = m.flat<T>().data();
    const T* grad_data = grad.flat<T>().data();
    auto update = [&](Eigen::Index begin, Eigen::Index end) {
      UpdateRange<T>(begin, end, scale, beta, one_minus_beta, grad_data, m_data, var_data);
    };
    // Per element: three loads, two stores and a few flops; Eigen sizes the shards.
    const Eigen::TensorOpCost cost(3 * sizeof(T), 2 * sizeof(T), /*compute_cycles=*/6);
    ctx->eigen_device<CPUDevice>().parallelFor(var.NumElements(), cost, update);
  }

 private:
  bool use_exclusive_lock_;
};

#define REGISTER_SIGN_OP(name, coefficient)                                        \
  REGISTER_OP(name)                                                                \
      .Input("var: resource")                                                      \
      .Input("m: resource")                                                        \
      .Input("lr: T")                                                              \
      .Input(coefficient ": T")                                                    \
      .Input("sign_decay: T")                                                      \
      .Input("beta: T")                                                            \
      .Input("grad: T")                                                            \
      .Attr("T: {float, double}")                                                  \
      .Attr("use_locking: bool = false")                                           \
      .SetShapeFn(SignUpdateShape)                                                 \
      .Doc("One-pass " name " update of resource variables var and m in place.");

REGISTER_SIGN_OP("MsOptResourceApplyAddSign", "alpha")     // kAlpha
REGISTER_SIGN_OP("MsOptResourceApplyPowerSign", "logbase") // kLogbase

#define REGISTER_SIGN_KERNELS(T)                                                   \
  REGISTER_KERNEL_BUILDER(                                                         \
      Name("MsOptResourceApplyAddSign").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      (ApplySignOp<T, AddSignScales<T>, kAlpha>));                                         \
  REGISTER_KERNEL_BUILDER(                                                         \
      Name("MsOptResourceApplyPowerSign").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      (ApplySignOp<T, PowerSignScales<T>, kLogbase>));

REGISTER_SIGN_KERNELS(float)
REGISTER_SIGN_KERNELS(double)

}  // namespace
}  // namespace tensorflow
