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
//
// MsOptAdamOffloadCompactDeltas / ...Updates are the same step with the moments
// stored in fewer bytes (float32 gradients and arithmetic): state_dtype
// "bfloat16" keeps m and v as bfloat16 (read exactly, the new values rounded to
// nearest even); "int8" keeps them as 8-bit codes of blocks of kBlock elements
// with one float32 scale per block (the block's largest |m|, largest v):
// m / scale -> int8 code sign * EncodeUnit(|x|, 3 exponent-bias steps below),
// v / scale -> uint8 code EncodeUnit(x). EncodeUnit rounds x in [0, 1] to
// nearest (ties away from zero) among the 8-bit floats with 3 fraction bits whose
// largest value is 1.0 (4 exponent bits for m: x below about 2^-15 becomes 0;
// 5 for v: below about 2^-31), using only integer operations on x's bits.
// Each block is decoded, updated and re-encoded from an L1 buffer, its codes
// written while the next block is updated: one pass over memory. Nothing in
// these loops fuses multiply-adds into the moments, and the pure-TF path does
// the same operations in the same order, so both give the same moments and the
// same codes, bit for bit (delta within a few ulp: the AVX-512 and AVX2 loops
// divide by a refined reciprocal estimate). TF_MSOPT_ADAM_ISA caps the
// instruction set.

#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "scalar_inputs.h"
#include "streaming.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

constexpr int kNumScalars = 7;

// Inputs: `lists` lists of N resources, `scale_lists` lists of K resources (compact
// ops), N gradients, then the scalars. Each gradient's shape is merged with its
// variables' shapes; delta i (if any) has gradient i's shape.
absl::Status AdamOffloadShape(InferenceContext* c, int lists, int scale_lists = 0) {
  int n, k = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  if (scale_lists > 0) TF_RETURN_IF_ERROR(c->GetAttr("K", &k));
  const int first_grad = lists * n + scale_lists * k;
  for (int i = 0; i < n; ++i) {
    ShapeHandle shape = c->input(first_grad + i);
    for (int list = 0; list < lists; ++list) {
      const auto* handle_data = c->input_handle_shapes_and_types(list * n + i);
      if (handle_data != nullptr && handle_data->size() == 1) {
        TF_RETURN_IF_ERROR(c->Merge(shape, (*handle_data)[0].shape, &shape));
      }
    }
    if (c->num_outputs() > 0) c->set_output(i, shape);
  }
  ShapeHandle scalar;
  for (int i = first_grad + n; i < c->num_inputs(); ++i) {
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

#define MSOPT_COMPACT_ATTRS                                                   \
  Attr("K: int >= 0").Attr("state_dtype: {'bfloat16', 'int8'}")

REGISTER_OP("MsOptAdamOffloadCompactDeltas")
    .Input("m: N * resource")
    .Input("v: N * resource")
    .Input("m_scale: K * resource")
    .Input("v_scale: K * resource")
    .Input("grad: N * T")
    .MSOPT_ADAM_SCALARS
    .MSOPT_COMPACT_ATTRS
    .Output("delta: N * T")
    .SetShapeFn([](InferenceContext* c) { return AdamOffloadShape(c, 2, 2); })
    .Doc(R"doc(
MsOptAdamOffloadDeltas with compact moments: bfloat16 m and v (K = 0), or int8 m
and uint8 v codes with float32 scales per block of 2048 elements (K = N).
)doc");

REGISTER_OP("MsOptAdamOffloadCompactUpdates")
    .Input("var: N * resource")
    .Input("m: N * resource")
    .Input("v: N * resource")
    .Input("m_scale: K * resource")
    .Input("v_scale: K * resource")
    .Input("grad: N * T")
    .MSOPT_ADAM_SCALARS
    .MSOPT_COMPACT_ATTRS
    .SetShapeFn([](InferenceContext* c) { return AdamOffloadShape(c, 3, 2); })
    .Doc(R"doc(
MsOptAdamOffloadCompactDeltas for variables on the same (host) device: adds each
delta to its var in place in the same pass.
)doc");

#undef MSOPT_COMPACT_ATTRS
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
// numerator / (sqrt(v) + epsilon), each operation rounded: QUOTIENT of the vector step.
#define MSOPT_DEFINE_EXACT_QUOTIENT(NAME, TARGET, VF, SQRT)                                 \
  __attribute__((target(TARGET), always_inline)) inline VF NAME(VF numerator, VF v,        \
                                                                 VF epsilon) {              \
    return numerator / (SQRT(v) + epsilon);                                                \
  }
MSOPT_DEFINE_EXACT_QUOTIENT(ExactQuotientAvx512, "avx512f", __m512, _mm512_sqrt_ps)
MSOPT_DEFINE_EXACT_QUOTIENT(ExactQuotientAvx2, "avx2", __m256, _mm256_sqrt_ps)
MSOPT_DEFINE_EXACT_QUOTIENT(ExactQuotientSse2, "sse2", __m128, _mm_sqrt_ps)
#undef MSOPT_DEFINE_EXACT_QUOTIENT

// The same quotient with the division replaced by AVX-512's 14-bit reciprocal estimate,
// refined by one Newton step (within 2 ulp of the rounded quotient). vsqrtps and vdivps share
// one divider, which for the two together is slower than the rest of a compact step; the
// square root alone keeps up with it. A vector whose denominator is not a normal float
// (v inf or NaN, or epsilon not normal) takes the rounded division.
__attribute__((target("avx512f,avx512dq"), always_inline)) inline __m512 FastQuotientAvx512(
    __m512 numerator, __m512 v, __m512 epsilon) {
  const __m512 denominator = _mm512_add_ps(_mm512_sqrt_ps(v), epsilon);
  constexpr int kNotNormal = 0x01 | 0x02 | 0x04 | 0x08 | 0x10 | 0x20 | 0x80;
  if (_mm512_fpclass_ps_mask(denominator, kNotNormal) != 0) {
    return _mm512_div_ps(numerator, denominator);
  }
  __m512 reciprocal = _mm512_rcp14_ps(denominator);   // x += x * (1 - d * x)
  reciprocal = _mm512_fmadd_ps(_mm512_fnmadd_ps(denominator, reciprocal, _mm512_set1_ps(1.0f)),
                               reciprocal, reciprocal);
  return _mm512_mul_ps(numerator, reciprocal);
}

// The same with AVX2's 12-bit estimate, whose one Newton step, without FMA, leaves the
// quotient within a few ulp of the rounded one.
__attribute__((target("avx2"), always_inline)) inline __m256 FastQuotientAvx2(
    __m256 numerator, __m256 v, __m256 epsilon) {
  const __m256 denominator = _mm256_add_ps(_mm256_sqrt_ps(v), epsilon);
  const __m256 smallest = _mm256_set1_ps(std::numeric_limits<float>::min());
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 normal = _mm256_and_ps(_mm256_cmp_ps(denominator, smallest, _CMP_GE_OQ),
                                      _mm256_cmp_ps(denominator, largest, _CMP_LE_OQ));
  if (_mm256_movemask_ps(normal) != 0xFF) return _mm256_div_ps(numerator, denominator);
  const __m256 estimate = _mm256_rcp_ps(denominator);   // x * (2 - d * x)
  const __m256 reciprocal = _mm256_mul_ps(
      estimate, _mm256_sub_ps(_mm256_set1_ps(2.0f), _mm256_mul_ps(denominator, estimate)));
  return _mm256_mul_ps(numerator, reciprocal);
}

// The vector loops' shared parts (`h`, `s`, `i` in scope): the constants, and one step of
// the lanes at i from their moments m and v (left updated) and gradient, writing delta/var.
#define MSOPT_ADAM_CONSTANTS(VF)                                                   \
  constexpr int64_t kWidth = sizeof(VF) / sizeof(float);                             \
  const VF zero = {};                                                                \
  const VF beta1 = zero + h.beta1, one_minus_beta1 = zero + h.one_minus_beta1;       \
  const VF beta2 = zero + h.beta2, one_minus_beta2 = zero + h.one_minus_beta2;       \
  const VF epsilon = zero + h.epsilon, neg_lr_t = zero + h.neg_lr_t;                 \
  const VF grad_scale = zero + h.grad_scale;

// Updates the decoded moments m and v of lanes [i, i + W) with their gradient; writes delta.
#define MSOPT_ADAM_VECTOR_STEP(VF, QUOTIENT)                                              \
  {                                                                                  \
    VF g;                                                                            \
    __builtin_memcpy(&g, s.grad + i, sizeof(VF));                                    \
    if (h.grad_scale != 1.0f) g = g * grad_scale;  /* (g * 1 is g) */                 \
    m = m * beta1 + one_minus_beta1 * g;                                             \
    v = v * beta2 + one_minus_beta2 * g * g;                                         \
    const VF step = s.nesterov ? m * beta1 + one_minus_beta1 * g : m;                \
    const VF delta = QUOTIENT(neg_lr_t * step, v, epsilon);                          \
    if (s.var != nullptr) {                                                          \
      VF var;                                                                        \
      __builtin_memcpy(&var, s.var + i, sizeof(VF));                                 \
      var = var + delta;                                                             \
      __builtin_memcpy(s.var + i, &var, sizeof(VF));                                 \
    } else {                                                                         \
      __builtin_memcpy(s.delta + i, &delta, sizeof(VF));                             \
    }                                                                                \
  }

// The same arithmetic on float vectors. The compiler cannot vectorise the
// scalar loop itself: std::sqrt may set errno unless the whole build says
// -fno-math-errno. Each width is compiled for its instruction set and chosen
// at run time; arithmetic uses GCC/Clang vector operators, sqrt the intrinsic.
// CONTRACT is "fp-contract=fast" for targets with FMA (products fused into the
// following sum, one rounding fewer and fewer instructions), "fp-contract=off"
// otherwise. Returns where the scalar tail starts.
#define MSOPT_DEFINE_SIMD_SPAN(NAME, TARGET, CONTRACT, VEC, QUOTIENT)                 \
  __attribute__((target(TARGET), optimize(CONTRACT))) int64_t NAME(                \
      const AdamSpan<float>& s, const AdamHyper<float>& h) {                        \
    MSOPT_ADAM_CONSTANTS(VEC)                                                      \
    int64_t i = 0;                                                                 \
    for (; i + kWidth <= s.size; i += kWidth) {                                    \
      VEC m, v;                                                                    \
      __builtin_memcpy(&m, s.m + i, sizeof(VEC));                                  \
      __builtin_memcpy(&v, s.v + i, sizeof(VEC));                                  \
      MSOPT_ADAM_VECTOR_STEP(VEC, QUOTIENT)                                        \
      __builtin_memcpy(s.m + i, &m, sizeof(VEC));                                  \
      __builtin_memcpy(s.v + i, &v, sizeof(VEC));                                  \
    }                                                                              \
    return i;                                                                      \
  }
MSOPT_DEFINE_SIMD_SPAN(Avx512Span, "avx512f", "fp-contract=fast", __m512, ExactQuotientAvx512)
MSOPT_DEFINE_SIMD_SPAN(Avx2FmaSpan, "avx2,fma", "fp-contract=fast", __m256, ExactQuotientAvx2)
MSOPT_DEFINE_SIMD_SPAN(Avx2Span, "avx2", "fp-contract=off", __m256, ExactQuotientAvx2)
MSOPT_DEFINE_SIMD_SPAN(Sse2Span, "sse2", "fp-contract=off", __m128, ExactQuotientSse2)
#undef MSOPT_DEFINE_SIMD_SPAN
#endif  // x86-64

enum class Isa { kScalar = 0, kSse2 = 1, kAvx2 = 2, kAvx512 = 3 };

// The widest instruction set the CPU has for these loops, capped by TF_MSOPT_ADAM_ISA
// ("avx2", "sse2" or "scalar"; read at every call, so tests can run each of them).
Isa SelectIsa() {
#ifdef MSOPT_X86_SIMD
  static const Isa best =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? Isa::kAvx512
      : __builtin_cpu_supports("avx2")                                        ? Isa::kAvx2
                                                                              : Isa::kSse2;
#else
  static const Isa best = Isa::kScalar;
#endif
  const char* cap = std::getenv("TF_MSOPT_ADAM_ISA");
  if (cap == nullptr) return best;
  const std::string name(cap);
  const Isa wanted = name == "scalar" ? Isa::kScalar
                     : name == "sse2" ? Isa::kSse2
                     : name == "avx2" ? Isa::kAvx2
                                      : best;
  return std::min(wanted, best);
}

template <typename T>
void RunSpan(const AdamSpan<T>& s, const AdamHyper<T>& h, Isa) {
  ScalarSpan(s, h, 0);  // float64: the plain loop
}

template <>
void RunSpan<float>(const AdamSpan<float>& s, const AdamHyper<float>& h, Isa isa) {
  int64_t tail = 0;
#ifdef MSOPT_X86_SIMD
  static const bool has_fma = __builtin_cpu_supports("fma");
  switch (isa) {
    case Isa::kAvx512: tail = Avx512Span(s, h); break;
    case Isa::kAvx2: tail = has_fma ? Avx2FmaSpan(s, h) : Avx2Span(s, h); break;
    case Isa::kSse2: tail = Sse2Span(s, h); break;
    case Isa::kScalar: break;
  }
#endif
  ScalarSpan(s, h, tail);
}

// The spans of shard [begin, end) of the N ranges laid end to end (`starts`: the
// first element of each range, then the total).
template <typename T>
void RunShard(const std::vector<AdamSpan<T>>& spans, const std::vector<int64_t>& starts,
              const AdamHyper<T>& h, Isa isa, int64_t begin, int64_t end) {
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
    RunSpan(shard, h, isa);
  }
}

// -- compact moments (MsOptAdamOffloadCompact*): float32 gradients and arithmetic ------

constexpr int64_t kBlock = 2048;            // elements per int8 scale (and per shard unit)
constexpr int32_t kMomentOffset = 112 << 3;  // m: 4 exponent bits, 1.0 -> code 120
constexpr int32_t kSquareOffset = 96 << 3;   // v: 5 exponent bits, 1.0 -> code 248
constexpr int32_t kMomentMaxCode = (127 << 3) - kMomentOffset;
constexpr int32_t kSquareMaxCode = (127 << 3) - kSquareOffset;

struct CompactSpan {
  float* var;          // updated in place when not null, else `delta` is written
  float* delta;
  const float* grad;
  uint16_t* m_bf16;    // state_dtype "bfloat16": the moments' bits
  uint16_t* v_bf16;
  int8_t* m_code;      // state_dtype "int8": codes, and one scale per block
  uint8_t* v_code;
  float* m_scale;
  float* v_scale;
  int64_t size;
  bool nesterov;
};

// Both paths must round the moments identically (the codes depend on every bit), so
// nothing here fuses a product into a sum, whatever the target.
#define MSOPT_UNFUSED __attribute__((optimize("fp-contract=off")))

inline uint32_t FloatBits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float BitsFloat(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline float Bf16ToFloat(uint16_t bits) { return BitsFloat(uint32_t(bits) << 16); }

// Round to nearest even, NaN kept quiet (as Eigen::bfloat16, i.e. tf.cast, does).
inline uint16_t FloatToBf16(float x) {
  const uint32_t bits = FloatBits(x);
  if (std::isnan(x)) return uint16_t(((bits >> 16) & 0x8000) | 0x7FC0);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// x in [0, 1] to the nearest 8-bit float with 3 fraction bits (ties away from zero):
// float32's exponent and top 3 fraction bits, rounded, less `offset` (which puts 1.0 at the
// top). The offset is subtracted before the (arithmetic) shift, which is exact and leaves
// below-range values negative: one add and one shift.
inline int32_t EncodeUnit(float x, int32_t offset, int32_t max_code) {
  const int32_t code = int32_t(FloatBits(x) + uint32_t(0x80000 - (offset << 20))) >> 20;
  return std::min(std::max(code, 0), max_code);
}

inline float DecodeUnit(int32_t code, int32_t offset) {
  return code > 0 ? BitsFloat(uint32_t(code + offset) << 20) : 0.0f;
}

inline float DecodeMoment(int8_t code, float scale) {
  const float x = DecodeUnit(std::abs(int32_t(code)), kMomentOffset) * scale;
  return code < 0 ? -x : x;
}

inline float DecodeSquare(uint8_t code, float scale) {
  return DecodeUnit(code, kSquareOffset) * scale;
}

// One element from its decoded moments: writes its delta (or var) and leaves the new
// moments in m and v, in the order of operations of the float kernels' scalar loop.
MSOPT_UNFUSED inline void CompactElement(const CompactSpan& s, const AdamHyper<float>& h,
                                         int64_t i, float& m, float& v) {
  const float g = s.grad[i] * h.grad_scale;
  m = m * h.beta1 + h.one_minus_beta1 * g;
  v = v * h.beta2 + h.one_minus_beta2 * g * g;
  const float step = s.nesterov ? m * h.beta1 + h.one_minus_beta1 * g : m;
  const float delta = h.neg_lr_t * step / (std::sqrt(v) + h.epsilon);
  if (s.var != nullptr) {
    s.var[i] += delta;
  } else {
    s.delta[i] = delta;
  }
}

MSOPT_UNFUSED void Bf16Scalar(const CompactSpan& s, const AdamHyper<float>& h, int64_t begin,
                              int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float m = Bf16ToFloat(s.m_bf16[i]), v = Bf16ToFloat(s.v_bf16[i]);
    CompactElement(s, h, i, m, v);
    s.m_bf16[i] = FloatToBf16(m);
    s.v_bf16[i] = FloatToBf16(v);
  }
}

// One int8 block in two steps over an L1 buffer (`m_new`, `v_new`: indexed from the
// block's first element `base`): decode and update elements [begin, end), tracking the
// largest |m| and v (as bits, which order non-negative floats as their values, with NaN
// above all); then encode [begin, end) against the block's new scales.
MSOPT_UNFUSED void Int8ScalarUpdate(const CompactSpan& s, const AdamHyper<float>& h, int64_t base,
                                    int64_t begin, int64_t end, float* m_new, float* v_new,
                                    uint32_t* m_max, uint32_t* v_max) {
  const float m_scale = s.m_scale[base / kBlock], v_scale = s.v_scale[base / kBlock];
  for (int64_t i = begin; i < end; ++i) {
    float m = DecodeMoment(s.m_code[i], m_scale), v = DecodeSquare(s.v_code[i], v_scale);
    CompactElement(s, h, i, m, v);
    m_new[i - base] = m;
    v_new[i - base] = v;
    *m_max = std::max(*m_max, FloatBits(m) & 0x7FFFFFFFu);
    *v_max = std::max(*v_max, FloatBits(v) & 0x7FFFFFFFu);
  }
}

inline float InverseScale(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

MSOPT_UNFUSED void Int8ScalarEncode(const CompactSpan& s, int64_t base, int64_t begin,
                                    int64_t end, const float* m_new, const float* v_new) {
  const float m_inverse = InverseScale(s.m_scale[base / kBlock]);
  const float v_inverse = InverseScale(s.v_scale[base / kBlock]);
  for (int64_t i = begin; i < end; ++i) {
    const float m = m_new[i - base];
    const int32_t magnitude = EncodeUnit(std::fabs(m) * m_inverse, kMomentOffset,
                                         kMomentMaxCode);
    s.m_code[i] = int8_t(m < 0.0f ? -magnitude : magnitude);
    s.v_code[i] = uint8_t(EncodeUnit(std::fabs(v_new[i - base]) * v_inverse, kSquareOffset,
                                     kSquareMaxCode));
  }
}

void Int8BlocksScalar(const CompactSpan& s, const AdamHyper<float>& h, int64_t first,
                      int64_t last) {
  for (int64_t block = first; block < last; ++block) {
    const int64_t base = block * kBlock, end = std::min(base + kBlock, s.size);
    float m_new[kBlock], v_new[kBlock];
    uint32_t m_max = 0, v_max = 0;
    Int8ScalarUpdate(s, h, base, base, end, m_new, v_new, &m_max, &v_max);
    s.m_scale[block] = BitsFloat(m_max);
    s.v_scale[block] = BitsFloat(v_max);
    Int8ScalarEncode(s, base, base, end, m_new, v_new);
  }
}

#ifdef MSOPT_X86_SIMD
// Integer and narrow vectors beside each float vector width.
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));
typedef int32_t I32x4 __attribute__((vector_size(16)));
typedef uint32_t U32x4 __attribute__((vector_size(16)));
typedef int8_t I8x4 __attribute__((vector_size(4)));
typedef uint8_t U8x4 __attribute__((vector_size(4)));
typedef uint16_t U16x4 __attribute__((vector_size(8)));

// Widening loads and narrowing stores of codes and bfloat16 bits (the compilers scalarise
// __builtin_convertvector between int8 and int32 vectors; SSE2, the last resort, keeps it).
#define MSOPT_TARGET_INLINE(TARGET) __attribute__((target(TARGET), always_inline)) inline
template <typename Byte>
MSOPT_TARGET_INLINE("avx512f") void StoreBytesAvx512(Byte* p, I32x16 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8((__m512i)v));
}
MSOPT_TARGET_INLINE("avx512f") void StoreU16Avx512(uint16_t* p, U32x16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)v));
}
// LOAD_BYTES(p) loads W bytes, LOAD_WORDS(p) W 16-bit words; the WIDEN_* extend them.
#define MSOPT_DEFINE_LOADS(SUFFIX, TARGET, VI, VU, LOAD_BYTES, LOAD_WORDS, WIDEN_I8, WIDEN_U8, \
                           WIDEN_U16)                                                         \
  MSOPT_TARGET_INLINE(TARGET) VI LoadI8##SUFFIX(const int8_t* p) {                            \
    return (VI)WIDEN_I8(LOAD_BYTES(reinterpret_cast<const __m128i*>(p)));                     \
  }                                                                                           \
  MSOPT_TARGET_INLINE(TARGET) VI LoadU8##SUFFIX(const uint8_t* p) {                           \
    return (VI)WIDEN_U8(LOAD_BYTES(reinterpret_cast<const __m128i*>(p)));                     \
  }                                                                                           \
  MSOPT_TARGET_INLINE(TARGET) VU LoadU16##SUFFIX(const uint16_t* p) {                         \
    return (VU)WIDEN_U16(LOAD_WORDS(p));                                                      \
  }
MSOPT_TARGET_INLINE("avx512f") __m256i LoadWordsAvx512(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
MSOPT_TARGET_INLINE("avx2") __m128i LoadWordsAvx2(const uint16_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
MSOPT_DEFINE_LOADS(Avx512, "avx512f", I32x16, U32x16, _mm_loadu_si128, LoadWordsAvx512,
                   _mm512_cvtepi8_epi32, _mm512_cvtepu8_epi32, _mm512_cvtepu16_epi32)
MSOPT_DEFINE_LOADS(Avx2, "avx2", I32x8, U32x8, _mm_loadl_epi64, LoadWordsAvx2,
                   _mm256_cvtepi8_epi32, _mm256_cvtepu8_epi32, _mm256_cvtepu16_epi32)
#undef MSOPT_DEFINE_LOADS
// Codes fit int16 and the target type: saturating packs keep them; the 64-bit permute
// gathers each 128-bit lane's half.
template <typename Byte>
MSOPT_TARGET_INLINE("avx2") void StoreBytesAvx2(Byte* p, I32x8 v) {
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32((__m256i)v, (__m256i)v),
                                                 0x08);
  const __m128i low = _mm256_castsi256_si128(words);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), std::is_signed<Byte>::value
                                                      ? _mm_packs_epi16(low, low)
                                                      : _mm_packus_epi16(low, low));
}
MSOPT_TARGET_INLINE("avx2") void StoreU16Avx2(uint16_t* p, U32x8 v) {
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)v, (__m256i)v),
                                                 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
}
inline I32x4 LoadI8Sse2(const int8_t* p) {
  I8x4 bytes;
  __builtin_memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(bytes, I32x4);
}
inline I32x4 LoadU8Sse2(const uint8_t* p) {
  U8x4 bytes;
  __builtin_memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(bytes, I32x4);
}
inline U32x4 LoadU16Sse2(const uint16_t* p) {
  U16x4 words;
  __builtin_memcpy(&words, p, sizeof(words));
  return __builtin_convertvector(words, U32x4);
}
template <typename Byte>
inline void StoreBytesSse2(Byte* p, I32x4 v) {
  for (int k = 0; k < 4; ++k) p[k] = Byte(v[k]);
}
inline void StoreU16Sse2(uint16_t* p, U32x4 v) {
  for (int k = 0; k < 4; ++k) p[k] = uint16_t(v[k]);
}
#undef MSOPT_TARGET_INLINE

// Loads of the lines kPrefetchAhead elements on, in every stream a compact step reads: with
// this much arithmetic per byte the out-of-order window alone keeps too few misses in flight
// to reach the memory bandwidth.
constexpr int64_t kPrefetchAhead = tf_msopt::kPrefetchBytes / sizeof(float);
#define MSOPT_PREFETCH_STREAMS(MOMENT_M, MOMENT_V)                                     \
  {                                                                                  \
    const int64_t ahead = i + kPrefetchAhead;                                        \
    __builtin_prefetch(s.grad + ahead);                                              \
    __builtin_prefetch(s.var != nullptr ? s.var + ahead : s.delta + ahead, 1);       \
    __builtin_prefetch(MOMENT_M + ahead, 1);                                         \
    __builtin_prefetch(MOMENT_V + ahead, 1);                                         \
  }

// One vector of an int8 block at element i (`base` its first element): decodes the moments,
// steps them, keeps them in m_new / v_new and their largest magnitudes (as bits: integer
// maxima, since the float unit is the busier one) in m_max / v_max.
#define MSOPT_INT8_UPDATE(SUFFIX, VF, VI, VU, QUOTIENT)                                 \
  {                                                                                  \
    MSOPT_PREFETCH_STREAMS(s.m_code, s.v_code)                                       \
    const VI m_code = LoadI8##SUFFIX(s.m_code + i);                                  \
    const VI v_code = LoadU8##SUFFIX(s.v_code + i);                                  \
    const VI m_magnitude = m_code < 0 ? -m_code : m_code;                            \
    VF m = (VF)((VU)(m_magnitude + kMomentOffset) << 20);                            \
    m = (m_magnitude > 0 ? m : zero) * m_scale;                                      \
    m = (VF)((VU)m | ((VU)m_code & 0x80000000u));  /* the code's sign */              \
    VF v = (VF)((VU)(v_code + kSquareOffset) << 20);                                 \
    v = (v_code > 0 ? v : zero) * v_scale;                                           \
    MSOPT_ADAM_VECTOR_STEP(VF, QUOTIENT)                                               \
    __builtin_memcpy(m_new + (i - base), &m, sizeof(VF));                            \
    __builtin_memcpy(v_new + (i - base), &v, sizeof(VF));                            \
    const VU m_bits = (VU)m & abs_mask, v_bits = (VU)v & abs_mask;                   \
    m_max = m_max > m_bits ? m_max : m_bits;                                         \
    v_max = v_max > v_bits ? v_max : v_bits;                                         \
  }

// The codes of one vector of the pending block at element j, from m_pending / v_pending
// (indexed from pending_base) and that block's inverse scales.
#define MSOPT_INT8_ENCODE(SUFFIX, VF, VI, VU)                                          \
  {                                                                                  \
    VF m, v;                                                                         \
    __builtin_memcpy(&m, m_pending + (j - pending_base), sizeof(VF));                \
    __builtin_memcpy(&v, v_pending + (j - pending_base), sizeof(VF));                \
    const VF units[2] = {(VF)((VU)m & abs_mask) * m_inverse,                         \
                         (VF)((VU)v & abs_mask) * v_inverse};                        \
    const int32_t offsets[2] = {kMomentOffset, kSquareOffset};                       \
    const int32_t max_codes[2] = {kMomentMaxCode, kSquareMaxCode};                   \
    VI codes[2];                                                                     \
    for (int k = 0; k < 2; ++k) {                                                    \
      VI code = ((VI)units[k] + (0x80000 - (offsets[k] << 20))) >> 20;               \
      code = code < 0 ? zero_i : code;                                               \
      codes[k] = code > max_codes[k] ? zero_i + max_codes[k] : code;                 \
    }                                                                                \
    StoreBytes##SUFFIX(s.m_code + j, m < 0 ? -codes[0] : codes[0]);                  \
    StoreBytes##SUFFIX(s.v_code + j, codes[1]);                                      \
  }

// The scalar functions above on vectors of W lanes, operation for operation: Bf16Span
// covers [begin, end) up to its tail, Int8Blocks the blocks [first, last) of one
// variable (tails included).
#define MSOPT_DEFINE_COMPACT_SPANS(SUFFIX, TARGET, VF, VI, VU, QUOTIENT)                  \
  __attribute__((target(TARGET))) MSOPT_UNFUSED int64_t Bf16Span##SUFFIX(               \
      const CompactSpan& span, const AdamHyper<float>& h, int64_t begin, int64_t end) { \
    const CompactSpan s = span;  /* a local copy: the stores cannot change its fields */ \
    MSOPT_ADAM_CONSTANTS(VF)                                                        \
    int64_t i = begin;                                                                 \
    for (; i + kWidth <= end; i += kWidth) {                                           \
      MSOPT_PREFETCH_STREAMS(s.m_bf16, s.v_bf16)                                       \
      VF m = (VF)(LoadU16##SUFFIX(s.m_bf16 + i) << 16);                                \
      VF v = (VF)(LoadU16##SUFFIX(s.v_bf16 + i) << 16);                                \
      MSOPT_ADAM_VECTOR_STEP(VF, QUOTIENT)                                               \
      const VF news[2] = {m, v};                                                       \
      uint16_t* const outs[2] = {s.m_bf16 + i, s.v_bf16 + i};                          \
      for (int k = 0; k < 2; ++k) {                                                    \
        const VU bits = (VU)news[k];                                                   \
        const VU rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;                 \
        const VU quiet_nan = ((bits >> 16) & 0x8000) | 0x7FC0;                         \
        StoreU16##SUFFIX(outs[k], news[k] != news[k] ? quiet_nan : rounded);           \
      }                                                                                \
    }                                                                                  \
    return i;                                                                          \
  }                                                                                    \
  __attribute__((target(TARGET))) MSOPT_UNFUSED void Int8Blocks##SUFFIX(                \
      const CompactSpan& span, const AdamHyper<float>& h, int64_t first, int64_t last) { \
    const CompactSpan s = span;                                                        \
    MSOPT_ADAM_CONSTANTS(VF)                                                        \
    const VI zero_i = {};                                                              \
    const VU abs_mask = (VU)zero_i + 0x7FFFFFFFu;                                      \
    alignas(64) float buffers[2][2][kBlock];   /* [block % 2][m, v] */                 \
    VF m_inverse = zero, v_inverse = zero;     /* the pending block's */               \
    for (int64_t block = first; block <= last; ++block) {                              \
      /* The previous block's codes are written while this one is updated (its whole */ \
      /* vectors, lane for lane): the encoding, which touches no memory outside L1, */  \
      /* then overlaps the next block's loads. */                                     \
      const bool pending = block > first;                                              \
      const int64_t base = block * kBlock, end = std::min(base + kBlock, s.size);      \
      const int64_t pending_base = base - kBlock, pending_end = std::min(base, s.size); \
      const float* const m_pending = buffers[(block - 1) & 1][0];                      \
      const float* const v_pending = buffers[(block - 1) & 1][1];                      \
      if (pending && (block == last || end - base < kBlock)) {                         \
        int64_t j = pending_base;                                                      \
        for (; j + kWidth <= pending_end; j += kWidth) {                               \
          MSOPT_INT8_ENCODE(SUFFIX, VF, VI, VU)                                        \
        }                                                                              \
        if (j < pending_end) {                                                         \
          Int8ScalarEncode(s, pending_base, j, pending_end, m_pending, v_pending);      \
        }                                                                              \
      }                                                                                \
      if (block == last) break;                                                        \
      float* const m_new = buffers[block & 1][0];                                      \
      float* const v_new = buffers[block & 1][1];                                      \
      const VF m_scale = zero + s.m_scale[block], v_scale = zero + s.v_scale[block];   \
      VU m_max = (VU)zero_i, v_max = (VU)zero_i;                                       \
      int64_t i = base;                                                                \
      if (pending && end - base == kBlock) {                                           \
        for (int64_t j = pending_base; i < end; i += kWidth, j += kWidth) {            \
          MSOPT_INT8_UPDATE(SUFFIX, VF, VI, VU, QUOTIENT)                              \
          MSOPT_INT8_ENCODE(SUFFIX, VF, VI, VU)                                        \
        }                                                                              \
      }                                                                                \
      for (; i + kWidth <= end; i += kWidth) {                                         \
        MSOPT_INT8_UPDATE(SUFFIX, VF, VI, VU, QUOTIENT)                                \
      }                                                                                \
      uint32_t m_top = 0, v_top = 0;                                                   \
      for (int k = 0; k < kWidth; ++k) {                                               \
        m_top = std::max(m_top, m_max[k]);                                             \
        v_top = std::max(v_top, v_max[k]);                                             \
      }                                                                                \
      if (i < end) Int8ScalarUpdate(s, h, base, i, end, m_new, v_new, &m_top, &v_top); \
      s.m_scale[block] = BitsFloat(m_top);                                             \
      s.v_scale[block] = BitsFloat(v_top);                                             \
      m_inverse = zero + InverseScale(BitsFloat(m_top));                               \
      v_inverse = zero + InverseScale(BitsFloat(v_top));                               \
    }                                                                                  \
  }
MSOPT_DEFINE_COMPACT_SPANS(Avx512, "avx512f,avx512dq", __m512, I32x16, U32x16, FastQuotientAvx512)
MSOPT_DEFINE_COMPACT_SPANS(Avx2, "avx2", __m256, I32x8, U32x8, FastQuotientAvx2)
MSOPT_DEFINE_COMPACT_SPANS(Sse2, "sse2", __m128, I32x4, U32x4, ExactQuotientSse2)
#undef MSOPT_DEFINE_COMPACT_SPANS
#undef MSOPT_INT8_ENCODE
#undef MSOPT_INT8_UPDATE
#undef MSOPT_ADAM_VECTOR_STEP
#undef MSOPT_ADAM_CONSTANTS
#endif  // MSOPT_X86_SIMD

struct CompactKernels {
  // Returns where the scalar tail starts.
  int64_t (*bf16)(const CompactSpan&, const AdamHyper<float>&, int64_t, int64_t);
  void (*int8_blocks)(const CompactSpan&, const AdamHyper<float>&, int64_t, int64_t);
};

int64_t NoBf16Vectors(const CompactSpan&, const AdamHyper<float>&, int64_t begin, int64_t) {
  return begin;
}

// The loops for `isa` (none fuses multiply-adds into the moments: see MSOPT_UNFUSED).
CompactKernels CompactKernelsFor(Isa isa) {
#ifdef MSOPT_X86_SIMD
  switch (isa) {
    case Isa::kAvx512: return {Bf16SpanAvx512, Int8BlocksAvx512};
    case Isa::kAvx2: return {Bf16SpanAvx2, Int8BlocksAvx2};
    case Isa::kSse2: return {Bf16SpanSse2, Int8BlocksSse2};
    case Isa::kScalar: break;
  }
#endif
  return {NoBf16Vectors, Int8BlocksScalar};
}

// Blocks [begin, end) of the N variables' blocks laid end to end (`starts`: each
// variable's first block, then the total).
void RunCompactShard(const std::vector<CompactSpan>& spans, const std::vector<int64_t>& starts,
                     const AdamHyper<float>& h, const CompactKernels& kernels, bool int8,
                     int64_t begin, int64_t end) {
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; i < spans.size() && starts[i] < end; ++i) {
    const int64_t first = std::max(begin, starts[i]) - starts[i];
    const int64_t last = std::min(end, starts[i + 1]) - starts[i];
    const CompactSpan& span = spans[i];
    if (int8) {
      if (last > first) kernels.int8_blocks(span, h, first, last);
    } else if (last > first) {
      const int64_t stop = std::min(last * kBlock, span.size);
      Bf16Scalar(span, h, kernels.bf16(span, h, first * kBlock, stop), stop);
    }
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

// A writable tensor of resource input `input` (copied first if a read still holds its
// buffer), for each dtype these ops keep state in.
absl::Status WritableState(OpKernelContext* ctx, int input, DataType dtype, bool use_locking,
                           Tensor* out) {
  switch (dtype) {
#define MSOPT_STATE_CASE(TYPE)                                                          \
  case DataTypeToEnum<TYPE>::value:                                                    \
    return GetInputTensorFromVariable<CPUDevice, TYPE>(ctx, input, use_locking,        \
                                                       /*sparse=*/false, out);
    MSOPT_STATE_CASE(float)
    MSOPT_STATE_CASE(double)
    MSOPT_STATE_CASE(bfloat16)
    MSOPT_STATE_CASE(int8)
    MSOPT_STATE_CASE(uint8)
#undef MSOPT_STATE_CASE
    default:
      return absl::InternalError(absl::StrCat("no state of dtype ", DataTypeString(dtype)));
  }
}

// Checks, locks and fetches the first `count` inputs, resources whose dtypes are
// `dtypes[i]` (checked before anything reads a buffer as that type); `name(i)` names input i
// in errors. The locks are held until the returned holder goes.
template <typename Name>
VariableInputLockHolder LockState(OpKernelContext* ctx, const std::vector<DataType>& dtypes,
                                  bool use_locking, const Name& name, const char* dtype_rule,
                                  std::vector<Tensor>* state) {
  const int count = dtypes.size();
  for (int i = 0; i < count; ++i) {
    core::RefCountPtr<Var> resource;
    absl::Status status = LookupResource(ctx, HandleFromInput(ctx, i), &resource);
    if (status.ok() && resource->tensor()->dtype() != dtypes[i]) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "'", name(i), "' must have ", dtype_rule, " ", DataTypeString(dtypes[i]),
          ", but got ", DataTypeString(resource->tensor()->dtype()), "."));
    }
    if (!status.ok()) {
      ctx->SetStatus(status);
      return VariableInputLockHolder({}, {}, {});
    }
  }
  auto locks = LockInAddressOrder<float>(ctx, count);
  if (!ctx->status().ok()) return locks;
  state->resize(count);
  for (int i = 0; i < count; ++i) {
    absl::Status status = WritableState(ctx, i, dtypes[i], use_locking, &(*state)[i]);
    if (status.ok() && !(*state)[i].IsInitialized()) {
      status = absl::FailedPreconditionError(
          absl::StrCat("Attempting to use uninitialized variable '", name(i), "'."));
    }
    if (!status.ok()) {
      ctx->SetStatus(status);
      break;
    }
  }
  return locks;
}

absl::Status CheckSameShape(const Tensor& state, const std::string& name, const Tensor& grad,
                            int index) {
  if (state.shape() == grad.shape()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "'", name, "' and 'grad[", index, "]' must have the same shape, but got ",
      state.shape().DebugString(), " and ", grad.shape().DebugString(), "."));
}

// The step's scalars (inputs from `first` on) as the per-element constants.
template <typename T>
absl::Status ReadHyper(OpKernelContext* ctx, int first, AdamHyper<T>* h) {
  T scalars[kNumScalars];
  TF_RETURN_IF_ERROR(tf_msopt::ReadScalars(
      ctx, first, {"beta1_power", "beta2_power", "lr", "beta1", "beta2", "epsilon", "grad_scale"},
      scalars));
  const T beta1_power = scalars[0], beta2_power = scalars[1];
  if (!(std::abs(beta1_power - T(1)) >= T(std::numeric_limits<float>::epsilon()))) {
    return absl::InvalidArgumentError("the 'beta1_power' can not be 1.");
  }
  h->beta1 = scalars[3];
  h->one_minus_beta1 = T(1) - h->beta1;
  h->beta2 = scalars[4];
  h->one_minus_beta2 = T(1) - h->beta2;
  h->epsilon = scalars[5];
  h->grad_scale = scalars[6];
  h->neg_lr_t = -(scalars[2] * std::sqrt(T(1) - beta2_power) / (T(1) - beta1_power));
  return absl::OkStatus();
}

// Delta i's buffer: it may take over its gradient's buffer when nothing else holds it.
absl::Status DeltaOutput(OpKernelContext* ctx, int grad_input, int output, Tensor** delta) {
  return ctx->forward_input_or_allocate_output({grad_input}, output,
                                               ctx->input(grad_input).shape(), delta);
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
    std::vector<Tensor> state;
    // Held until Compute returns: no other op reads or writes these buffers meanwhile.
    auto locks = LockState(ctx, std::vector<DataType>(grads, DataTypeToEnum<T>::v()),
                           use_locking_, name, "the gradient's dtype", &state);
    OP_REQUIRES_OK(ctx, ctx->status());
    for (int i = 0; i < grads; ++i) {
      OP_REQUIRES_OK(ctx, CheckSameShape(state[i], name(i), ctx->input(grads + i % n_), i % n_));
    }
    AdamHyper<T> h;
    OP_REQUIRES_OK(ctx, ReadHyper(ctx, grads + n_, &h));

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
        OP_REQUIRES_OK(ctx, DeltaOutput(ctx, grads + i, i, &delta));
        span.delta = delta->flat<T>().data();
      }
      starts[i + 1] = starts[i] + span.size;
    }
    // Bytes read and written and cycles per element, for the shard size.
    const Eigen::TensorOpCost cost((kUpdateVariable ? 4 : 3) * sizeof(T), 3 * sizeof(T), 10);
    const Isa isa = SelectIsa();
    ctx->eigen_device<CPUDevice>().parallelFor(
        starts.back(), cost, [&spans, &starts, &h, isa](Eigen::Index begin, Eigen::Index end) {
          RunShard(spans, starts, h, isa, begin, end);
        });
  }

 private:
  int n_;
  bool use_locking_;
  bool use_nesterov_;
};

template <bool kUpdateVariable>
class CompactAdamOffloadOp : public OpKernel {
 public:
  explicit CompactAdamOffloadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("K", &k_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_locking", &use_locking_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_nesterov", &use_nesterov_));
    std::string state_dtype;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("state_dtype", &state_dtype));
    int8_ = state_dtype == "int8";
    OP_REQUIRES(ctx, k_ == (int8_ ? n_ : 0),
                absl::InvalidArgumentError(absl::StrCat(
                    "state_dtype '", state_dtype, "' takes ", int8_ ? n_ : 0,
                    " scales per moment (one per variable for int8, none for bfloat16), but "
                    "got K = ", k_, ".")));
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr int kLists = kUpdateVariable ? 3 : 2;   // [var,] m, v
    static const char* const kNames[5] = {"var", "m", "v", "m_scale", "v_scale"};
    const char* const* names = kUpdateVariable ? kNames : kNames + 1;
    const int scales = kLists * n_, grads = scales + 2 * k_;
    auto name = [&](int input) {
      const int list = input < scales ? input / n_ : kLists + (input - scales) / k_;
      const int index = input < scales ? input % n_ : (input - scales) % k_;
      return absl::StrCat(names[list], "[", index, "]");
    };
    std::vector<DataType> dtypes;
    if (kUpdateVariable) dtypes.insert(dtypes.end(), n_, DT_FLOAT);
    dtypes.insert(dtypes.end(), n_, int8_ ? DT_INT8 : DT_BFLOAT16);
    dtypes.insert(dtypes.end(), n_, int8_ ? DT_UINT8 : DT_BFLOAT16);
    dtypes.insert(dtypes.end(), 2 * k_, DT_FLOAT);
    std::vector<Tensor> state;
    auto locks = LockState(ctx, dtypes, use_locking_, name,
                           int8_ ? "(state_dtype 'int8') dtype" : "(state_dtype 'bfloat16') dtype",
                           &state);
    OP_REQUIRES_OK(ctx, ctx->status());
    for (int i = 0; i < scales; ++i) {
      OP_REQUIRES_OK(ctx, CheckSameShape(state[i], name(i), ctx->input(grads + i % n_), i % n_));
    }
    for (int i = scales; i < grads; ++i) {
      const int64_t blocks = BlockCount(ctx->input(grads + (i - scales) % k_).NumElements());
      OP_REQUIRES(ctx, state[i].shape() == TensorShape({blocks}),
                  absl::InvalidArgumentError(absl::StrCat(
                      "'", name(i), "' must have shape [", blocks, "] (one scale per ", kBlock,
                      " elements), but got ", state[i].shape().DebugString(), ".")));
    }
    AdamHyper<float> h;
    OP_REQUIRES_OK(ctx, ReadHyper(ctx, grads + n_, &h));

    std::vector<CompactSpan> spans(n_);
    std::vector<int64_t> starts(n_ + 1, 0);   // in blocks
    for (int i = 0; i < n_; ++i) {
      const Tensor& grad = ctx->input(grads + i);
      CompactSpan& span = spans[i];
      span = CompactSpan{};
      span.grad = grad.flat<float>().data();
      span.size = grad.NumElements();
      span.nesterov = use_nesterov_;
      Tensor& m = state[(kLists - 2) * n_ + i];
      Tensor& v = state[(kLists - 1) * n_ + i];
      if (int8_) {
        span.m_code = m.flat<int8>().data();
        span.v_code = v.flat<uint8>().data();
        span.m_scale = state[scales + i].flat<float>().data();
        span.v_scale = state[scales + k_ + i].flat<float>().data();
      } else {
        span.m_bf16 = reinterpret_cast<uint16_t*>(m.flat<bfloat16>().data());
        span.v_bf16 = reinterpret_cast<uint16_t*>(v.flat<bfloat16>().data());
      }
      if (kUpdateVariable) {
        span.var = state[i].flat<float>().data();
      } else {
        Tensor* delta = nullptr;
        OP_REQUIRES_OK(ctx, DeltaOutput(ctx, grads + i, i, &delta));
        span.delta = delta->flat<float>().data();
      }
      starts[i + 1] = starts[i] + BlockCount(span.size);
    }
    const int moment_bytes = int8_ ? 1 : 2;
    const Eigen::TensorOpCost cost(kBlock * (4 * (kUpdateVariable ? 2 : 1) + 2 * moment_bytes),
                                   kBlock * (4 + 2 * moment_bytes), kBlock * 20);
    const bool int8 = int8_;
    const CompactKernels kernels = CompactKernelsFor(SelectIsa());
    ctx->eigen_device<CPUDevice>().parallelFor(
        starts.back(), cost,
        [&spans, &starts, &h, &kernels, int8](Eigen::Index begin, Eigen::Index end) {
          RunCompactShard(spans, starts, h, kernels, int8, begin, end);
        });
  }

 private:
  static int64_t BlockCount(int64_t size) { return (size + kBlock - 1) / kBlock; }

  int n_, k_;
  bool int8_;
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
REGISTER_KERNEL_BUILDER(
    Name("MsOptAdamOffloadCompactDeltas").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    CompactAdamOffloadOp<false>);
REGISTER_KERNEL_BUILDER(
    Name("MsOptAdamOffloadCompactUpdates").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    CompactAdamOffloadOp<true>);

}  // namespace
}  // namespace tensorflow
