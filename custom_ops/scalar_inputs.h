// The scalar inputs of the host kernels (AdamOffload, LARS), read with one check and one
// error message for all of them.
#ifndef TF_MSOPT_CUSTOM_OPS_SCALAR_INPUTS_H_
#define TF_MSOPT_CUSTOM_OPS_SCALAR_INPUTS_H_

#include <initializer_list>

#include "tensorflow/core/framework/op_kernel.h"

namespace tf_msopt {

// The scalar inputs from `first` on, named `names`, into `out`; an error naming the first
// input that is not a scalar.
template <typename T>
absl::Status ReadScalars(tensorflow::OpKernelContext* ctx, int first,
                         std::initializer_list<const char*> names, T* out) {
  int i = 0;
  for (const char* name : names) {
    const tensorflow::Tensor& t = ctx->input(first + i);
    if (!tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", name, "' must be a scalar, but got shape ", t.shape().DebugString(), "."));
    }
    out[i++] = t.scalar<T>()();
  }
  return absl::OkStatus();
}

}  // namespace tf_msopt

#endif  // TF_MSOPT_CUSTOM_OPS_SCALAR_INPUTS_H_
