// AdamOffload's host kernels: MindSpore's AdamNoUpdateParam, one fused pass.
//
// For each element, with g = grad * grad_scale (grad_scale = 1 / loss_scale):
//   m     = m * beta1 + (1 - beta1) * g
//   v     = v * beta2 + (1 - beta2) * g * g
//   delta = -lr_t * m / (sqrt(v) + epsilon)                     (use_nesterov=false)
//   delta = -lr_t * (m * beta1 + (1 - beta1) * g) / (sqrt(v) + epsilon)   (nesterov)
// where lr_t = lr * sqrt(1 - beta2_power) / (1 - beta1_power), computed once per call.
//
// Both ops take N variables at once (a model's whole list, or one learning-rate
// group of it): one op call and one parallel pass over all their elements, so
// the cost per variable is a few pointer look-ups, not an op dispatch and a
// thread-pool round trip. MsOptAdamOffloadDeltas writes each m and v in place
// and returns each delta (the caller adds it to the variable on the variable's
// device). MsOptAdamOffloadUpdates is the same pass for variables that live on
// the host itself: it adds delta to each variable in place instead of returning
// it, saving a pass over memory.
//
// m, v (and var) are resource variables updated the way TensorFlow's training
// ops do it: their mutexes are held, and a buffer that another tensor still
// references is copied first (PrepareToUpdateVariable), so no concurrent read
// observes the write. The N flat ranges, end to end, are split over the
// intra-op thread pool; each shard runs, for each variable it covers, a float
// vector loop for the widest instruction set the CPU has (AVX-512, AVX2 with
// FMA, AVX2, SSE2 on x86-64; chosen at run time) and a scalar tail. float64
// runs the scalar loop. Where the CPU has FMA the vector loops fuse
// multiply-adds: results then differ from the pure-TF path (which rounds every
// product) by a few ulp, well inside the 1e-6 relative contract.

#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

constexpr int kNumScalars = 7;

// Inputs: `lists` lists of N resources, N gradients, then the scalars. Each gradient's
// shape is merged with its variables' shapes; delta i (if any) has gradient i's shape.
absl::Status AdamOffloadShape(InferenceContext* c, int lists) {
  int n;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  for (int i = 0; i < n; ++i) {
    ShapeHandle shape = c->input(lists * n + i);
    for (int list = 0; list < lists; ++list) {
      const auto* handle_data = c->input_handle_shapes_and_types(list * n + i);
      if (handle_data != nullptr && handle_data->size() == 1) {
        TF_RETURN_IF_ERROR(c->Merge(shape, (*handle_data)[0].shape, &shape));
      }
    }
    if (c->num_outputs() > 0) c->set_output(i, shape);
  }
  ShapeHandle scalar;
  for (int i = (lists + 1) * n; i < c->num_inputs(); ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &scalar));
  }
  return absl::OkStatus();
}

#define MSOPT_ADAM_SCALARS                                                   \
  Input("beta1_power: T")                                                    \
      .Input("beta2_power: T")                                               \
      .Input("lr: T")                                                        \
      .Input("beta1: T")                                                     \
      .Input("beta2: T")                                                     \
      .Input("epsilon: T")                                                   \
      .Input("grad_scale: T")                                                \
      .Attr("N: int >= 1")                                                   \
      .Attr("T: {float, double}")                                            \
      .Attr("use_locking: bool = false")                                     \
      .Attr("use_nesterov: bool = false")

REGISTER_OP("MsOptAdamOffloadDeltas")
    .Input("m: N * resource")
    .Input("v: N * resource")
    .Input("grad: N * T")
    .MSOPT_ADAM_SCALARS
    .Output("delta: N * T")
    .SetShapeFn([](InferenceContext* c) { return AdamOffloadShape(c, 2); })
    .Doc(R"doc(
One Adam step on N host-resident moment pairs (MindSpore's AdamNoUpdateParam, with
the loss-scale division fused): updates each m and v in place and returns
delta = -lr_t * m / (sqrt(v) + epsilon), lr_t = lr * sqrt(1 - beta2_power) / (1 - beta1_power).
)doc");

REGISTER_OP("MsOptAdamOffloadUpdates")
    .Input("var: N * resource")
    .Input("m: N * resource")
    .Input("v: N * resource")
    .Input("grad: N * T")
    .MSOPT_ADAM_SCALARS
    .SetShapeFn([](InferenceContext* c) { return AdamOffloadShape(c, 3); })
    .Doc(R"doc(
MsOptAdamOffloadDeltas for variables on the same (host) device: adds each delta to
its var in place in the same pass.
)doc");

#undef MSOPT_ADAM_SCALARS

template <typename T>
struct AdamHyper {
  T beta1, one_minus_beta1, beta2, one_minus_beta2, epsilon, neg_lr_t, grad_scale;
};

// One shard: `delta` is written when `var` is null, else `var` is updated.
// `delta` may be `grad` itself (the output took over the gradient's buffer):
// every loop reads an element's gradient before it writes its delta.
template <typename T>
struct AdamSpan {
  T* var;
  T* m;
  T* v;
  const T* grad;
  T* delta;
  int64_t size;
  bool nesterov;
};

// One element, in MindSpore's order of operations (AdamDeltaFp32). The scalar
// loop rounds every product and sum on its own, as TensorFlow's element-wise
// ops do; the FMA vector loops agree with it to a few ulp.
template <typename T>
inline void AdamElement(const AdamSpan<T>& s, const AdamHyper<T>& h, int64_t i) {
  const T g = s.grad[i] * h.grad_scale;
  const T m = s.m[i] * h.beta1 + h.one_minus_beta1 * g;
  const T v = s.v[i] * h.beta2 + h.one_minus_beta2 * g * g;
  s.m[i] = m;
  s.v[i] = v;
  const T step = s.nesterov ? m * h.beta1 + h.one_minus_beta1 * g : m;
  const T delta = h.neg_lr_t * step / (std::sqrt(v) + h.epsilon);
  if (s.var != nullptr) {
    s.var[i] += delta;
  } else {
    s.delta[i] = delta;
  }
}

template <typename T>
void ScalarSpan(const AdamSpan<T>& s, const AdamHyper<T>& h, int64_t begin) {
  for (int64_t i = begin; i < s.size; ++i) AdamElement(s, h, i);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MSOPT_X86_SIMD 1
// The same arithmetic on float vectors. The compiler cannot vectorise the
// scalar loop itself: std::sqrt may set errno unless the whole build says
// -fno-math-errno. Each width is compiled for its instruction set and chosen
// at run time; arithmetic uses GCC/Clang vector operators, sqrt the intrinsic.
// CONTRACT is "fp-contract=fast" for targets with FMA (products fused into the
// following sum, one rounding fewer and fewer instructions), "fp-contract=off"
// otherwise. Returns where the scalar tail starts.
#define MSOPT_DEFINE_SIMD_SPAN(NAME, TARGET, CONTRACT, VEC, SQRT)                 \
  __attribute__((target(TARGET), optimize(CONTRACT))) int64_t NAME(                \
      const AdamSpan<float>& s, const AdamHyper<float>& h) {                        \
    constexpr int64_t kWidth = sizeof(VEC) / sizeof(float);                        \
    const VEC zero = {};                                                           \
    const VEC beta1 = zero + h.beta1, one_minus_beta1 = zero + h.one_minus_beta1;  \
    const VEC beta2 = zero + h.beta2, one_minus_beta2 = zero + h.one_minus_beta2;  \
    const VEC epsilon = zero + h.epsilon, neg_lr_t = zero + h.neg_lr_t;            \
    const VEC grad_scale = zero + h.grad_scale;                                    \
    int64_t i = 0;                                                                 \
    for (; i + kWidth <= s.size; i += kWidth) {                                    \
      VEC g, m, v;                                                                 \
      __builtin_memcpy(&g, s.grad + i, sizeof(VEC));                               \
      __builtin_memcpy(&m, s.m + i, sizeof(VEC));                                  \
      __builtin_memcpy(&v, s.v + i, sizeof(VEC));                                  \
      g = g * grad_scale;                                                          \
      m = m * beta1 + one_minus_beta1 * g;                                         \
      v = v * beta2 + one_minus_beta2 * g * g;                                     \
      __builtin_memcpy(s.m + i, &m, sizeof(VEC));                                  \
      __builtin_memcpy(s.v + i, &v, sizeof(VEC));                                  \
      const VEC step = s.nesterov ? m * beta1 + one_minus_beta1 * g : m;           \
      const VEC delta = neg_lr_t * step / (SQRT(v) + epsilon);                     \
      if (s.var != nullptr) {                                                      \
        VEC var;                                                                   \
        __builtin_memcpy(&var, s.var + i, sizeof(VEC));                            \
        var = var + delta;                                                         \
        __builtin_memcpy(s.var + i, &var, sizeof(VEC));                            \
      } else {                                                                     \
        __builtin_memcpy(s.delta + i, &delta, sizeof(VEC));                        \
      }                                                                            \
    }                                                                              \
    return i;                                                                      \
  }
MSOPT_DEFINE_SIMD_SPAN(Avx512Span, "avx512f", "fp-contract=fast", __m512, _mm512_sqrt_ps)
MSOPT_DEFINE_SIMD_SPAN(Avx2FmaSpan, "avx2,fma", "fp-contract=fast", __m256, _mm256_sqrt_ps)
MSOPT_DEFINE_SIMD_SPAN(Avx2Span, "avx2", "fp-contract=off", __m256, _mm256_sqrt_ps)
MSOPT_DEFINE_SIMD_SPAN(Sse2Span, "sse2", "fp-contract=off", __m128, _mm_sqrt_ps)
#undef MSOPT_DEFINE_SIMD_SPAN
#endif  // x86-64

template <typename T>
void RunSpan(const AdamSpan<T>& s, const AdamHyper<T>& h) {
  ScalarSpan(s, h, 0);  // float64: the plain loop
}

template <>
void RunSpan<float>(const AdamSpan<float>& s, const AdamHyper<float>& h) {
#ifdef MSOPT_X86_SIMD
  static const bool has_avx512 = __builtin_cpu_supports("avx512f");
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  static const bool has_fma = __builtin_cpu_supports("fma");
  const int64_t tail = has_avx512            ? Avx512Span(s, h)
                       : has_avx2 && has_fma ? Avx2FmaSpan(s, h)
                       : has_avx2            ? Avx2Span(s, h)
                                             : Sse2Span(s, h);
  ScalarSpan(s, h, tail);
#else
  ScalarSpan(s, h, 0);
#endif
}

// The spans of shard [begin, end) of the N ranges laid end to end (`starts`: the
// first element of each range, then the total).
template <typename T>
void RunShard(const std::vector<AdamSpan<T>>& spans, const std::vector<int64_t>& starts,
              const AdamHyper<T>& h, int64_t begin, int64_t end) {
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; i < spans.size() && starts[i] < end; ++i) {
    const int64_t first = std::max(begin, starts[i]) - starts[i];
    const int64_t last = std::min(end, starts[i + 1]) - starts[i];
    if (last <= first) continue;
    AdamSpan<T> shard = spans[i];
    shard.m += first;
    shard.v += first;
    shard.grad += first;
    if (shard.var != nullptr) shard.var += first;
    if (shard.delta != nullptr) shard.delta += first;
    shard.size = last - first;
    RunSpan(shard, h);
  }
}

// The exclusive locks of the first `count` (resource) inputs, as TensorFlow's dense
// training ops take them (MaybeLockVariableInputMutexesInOrder), but ordered by sorting:
// TensorFlow's helper removes duplicates pairwise, which is quadratic in the count, and
// these ops take three inputs per variable of a whole model.
template <typename T>
VariableInputLockHolder LockInAddressOrder(OpKernelContext* ctx, int count) {
  std::vector<Var*> vars;
  std::vector<tsl::mutex*> mutexes;
  for (int i = 0; i < count; ++i) {
    Var* var = nullptr;
    tsl::mutex* mutex = GetTrainingVariableMutex<CPUDevice, T>(ctx, i, &var);
    if (var != nullptr) vars.push_back(var);
    if (mutex != nullptr) mutexes.push_back(mutex);
  }
  std::sort(mutexes.begin(), mutexes.end());
  mutexes.erase(std::unique(mutexes.begin(), mutexes.end()), mutexes.end());
  auto locks = std::make_unique<std::vector<tsl::mutex_lock>>();
  locks->reserve(mutexes.size());
  for (tsl::mutex* mutex : mutexes) locks->emplace_back(*mutex);
  return VariableInputLockHolder(std::move(vars), std::move(locks),
                                 std::make_unique<std::vector<tsl::tf_shared_lock>>());
}

template <typename T, bool kUpdateVariable>
class AdamOffloadOp : public OpKernel {
 public:
  explicit AdamOffloadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_locking", &use_locking_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_nesterov", &use_nesterov_));
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr int kLists = kUpdateVariable ? 3 : 2;   // [var,] m, v
    static const char* const kNames[3] = {"var", "m", "v"};
    const char* const* names = kUpdateVariable ? kNames : kNames + 1;
    const int grads = kLists * n_;
    auto name = [&](int input) {
      return absl::StrCat(names[input / n_], "[", input % n_, "]");
    };
    for (int i = 0; i < grads; ++i) {
      // Checked before anything reads the buffer as T.
      core::RefCountPtr<Var> resource;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &resource));
      OP_REQUIRES(ctx, resource->tensor()->dtype() == DataTypeToEnum<T>::v(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "'", name(i), "' must have the gradient's dtype ",
                      DataTypeString(DataTypeToEnum<T>::v()), ", but got ",
                      DataTypeString(resource->tensor()->dtype()), ".")));
    }
    // Held until Compute returns: no other op reads or writes these buffers meanwhile.
    auto locks = LockInAddressOrder<T>(ctx, grads);
    OP_REQUIRES_OK(ctx, ctx->status());
    std::vector<Tensor> state(grads);
    for (int i = 0; i < grads; ++i) {
      OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, T>(ctx, i, use_locking_,
                                                                   /*sparse=*/false, &state[i]));
      OP_REQUIRES(ctx, state[i].IsInitialized(),
                  absl::FailedPreconditionError(
                      absl::StrCat("Attempting to use uninitialized variable '", name(i), "'.")));
      const Tensor& grad = ctx->input(grads + i % n_);
      OP_REQUIRES(ctx, state[i].shape() == grad.shape(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "'", name(i), "' and 'grad[", i % n_, "]' must have the same shape, but got ",
                      state[i].shape().DebugString(), " and ", grad.shape().DebugString(), ".")));
    }
    static const char* const kScalarNames[kNumScalars] = {
        "beta1_power", "beta2_power", "lr", "beta1", "beta2", "epsilon", "grad_scale"};
    T scalars[kNumScalars];
    for (int i = 0; i < kNumScalars; ++i) {
      const Tensor& t = ctx->input(grads + n_ + i);
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(t.shape()),
                  absl::InvalidArgumentError(absl::StrCat("'", kScalarNames[i],
                                                          "' must be a scalar, but got shape ",
                                                          t.shape().DebugString(), ".")));
      scalars[i] = t.scalar<T>()();
    }
    const T beta1_power = scalars[0], beta2_power = scalars[1];
    OP_REQUIRES(ctx,
                std::abs(beta1_power - T(1)) >= T(std::numeric_limits<float>::epsilon()),
                absl::InvalidArgumentError("the 'beta1_power' can not be 1."));
    AdamHyper<T> h;
    h.beta1 = scalars[3];
    h.one_minus_beta1 = T(1) - h.beta1;
    h.beta2 = scalars[4];
    h.one_minus_beta2 = T(1) - h.beta2;
    h.epsilon = scalars[5];
    h.grad_scale = scalars[6];
    h.neg_lr_t = -(scalars[2] * std::sqrt(T(1) - beta2_power) / (T(1) - beta1_power));

    std::vector<AdamSpan<T>> spans(n_);
    std::vector<int64_t> starts(n_ + 1, 0);
    for (int i = 0; i < n_; ++i) {
      const Tensor& grad = ctx->input(grads + i);
      AdamSpan<T>& span = spans[i];
      span.m = state[(kLists - 2) * n_ + i].flat<T>().data();
      span.v = state[(kLists - 1) * n_ + i].flat<T>().data();
      span.grad = grad.flat<T>().data();
      span.size = grad.NumElements();
      span.nesterov = use_nesterov_;
      if (kUpdateVariable) {
        span.var = state[i].flat<T>().data();
      } else {
        Tensor* delta = nullptr;
        // A delta may take over its gradient's buffer when nothing else holds it.
        OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({grads + i}, i, grad.shape(),
                                                                   &delta));
        span.delta = delta->flat<T>().data();
      }
      starts[i + 1] = starts[i] + span.size;
    }
    // Bytes read and written and cycles per element, for the shard size.
    const Eigen::TensorOpCost cost((kUpdateVariable ? 4 : 3) * sizeof(T), 3 * sizeof(T), 10);
    ctx->eigen_device<CPUDevice>().parallelFor(
        starts.back(), cost, [&spans, &starts, &h](Eigen::Index begin, Eigen::Index end) {
          RunShard(spans, starts, h, begin, end);
        });
  }

 private:
  int n_;
  bool use_locking_;
  bool use_nesterov_;
};

#define MSOPT_REGISTER_KERNELS(T)                                                          \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("MsOptAdamOffloadDeltas").Device(DEVICE_CPU).TypeConstraint<T>("T"),           \
      AdamOffloadOp<T, false>);                                                            \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("MsOptAdamOffloadUpdates").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
      AdamOffloadOp<T, true>);
MSOPT_REGISTER_KERNELS(float)
MSOPT_REGISTER_KERNELS(double)
#undef MSOPT_REGISTER_KERNELS

}  // namespace
}  // namespace tensorflow
