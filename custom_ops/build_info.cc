// The TensorFlow release this library was compiled against, as a string in the file:
// tf_msopt/ops/_loader.py reads it from the file's bytes before loading the library, and does
// not load a library of another release (TensorFlow's C++ ABI changes between releases, and
// loading one can crash the process rather than raise). setup.py defines the version.
#ifndef TF_MSOPT_TENSORFLOW_VERSION
#define TF_MSOPT_TENSORFLOW_VERSION "unknown"
#endif

extern "C" __attribute__((used, visibility("default")))
const char tf_msopt_built_against[] =
    "tf_msopt built against TensorFlow " TF_MSOPT_TENSORFLOW_VERSION;
