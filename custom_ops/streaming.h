// Software prefetch for the element-wise host loops (AddSign, PowerSign, LARS,
// AdamOffload).
//
// These loops stream arrays far larger than the caches; with only the hardware
// prefetchers and the out-of-order window they keep too few cache misses in
// flight to reach the memory bandwidth. StreamChunks runs a loop body over
// chunks of four cache lines, first asking for each stream's lines 4 KiB ahead.
#ifndef TF_MSOPT_CUSTOM_OPS_STREAMING_H_
#define TF_MSOPT_CUSTOM_OPS_STREAMING_H_

#include <algorithm>
#include <cstdint>

namespace tf_msopt {

// How far ahead of the element being updated each stream is prefetched.
constexpr int64_t kPrefetchBytes = 4096;

// body(first, last) over [begin, end) in chunks of 256 bytes of T, each chunk after
// prefetching the lines 4 KiB past it in every one of `streams` (arrays of T indexed
// like the range). Inlined into its caller, so the body vectorises for the caller's
// instruction set.
template <typename T, typename Body, typename... Streams>
inline __attribute__((always_inline)) void StreamChunks(int64_t begin, int64_t end,
                                                        Body&& body, Streams*... streams) {
  constexpr int64_t kLine = 64 / sizeof(T), kChunk = 4 * kLine;
  constexpr int64_t kAhead = kPrefetchBytes / sizeof(T);
  for (int64_t chunk = begin; chunk < end; chunk += kChunk) {
    for (int64_t line = chunk + kAhead; line < chunk + kAhead + kChunk; line += kLine) {
      (__builtin_prefetch(streams + line), ...);
    }
    body(chunk, std::min(chunk + kChunk, end));
  }
}

}  // namespace tf_msopt

#endif  // TF_MSOPT_CUSTOM_OPS_STREAMING_H_
