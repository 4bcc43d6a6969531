// Element-wise reduction kernels: dst = scale * (src_0 + ... + src_{n-1}), 16-bit types summed in fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hfreduce {

enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3, kInt32 = 4, kInt64 = 5 };

size_t element_size(DType dtype);
bool is_floating(DType dtype);
// torch's name of the dtype ("float32", ...), for error messages.
const char* dtype_name(DType dtype);

// Sums `count` elements of `nsrc` arrays into `dst` (which may alias a source) and multiplies by
// `scale` when scale != 1 (floating types only). Picks the widest SIMD the CPU has at run time.
void reduce(DType dtype, void* dst, const void* const* srcs, int nsrc, size_t count, double scale);
// The same, storing the result into each of `ndst` destinations in the one pass (any may alias a source).
void reduce(DType dtype, void* const* dsts, int ndst, const void* const* srcs, int nsrc, size_t count,
            double scale);

// Name of the instruction set `reduce` dispatches to on this CPU: "avx512", "avx2" or "generic".
std::string simd_level();

}  // namespace hfreduce
