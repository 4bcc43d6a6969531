// Element-wise reduction kernels: dst = scale * (src_0 + ... + src_{n-1}), 16-bit types summed in fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

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

// The environment variable that chooses the kernels: "generic" (portable), "avx2", "avx512" or "best" (the
// default). Asking for a set this CPU cannot run throws std::invalid_argument naming the sets it can.
constexpr const char* kKernelsEnv = "HFREDUCE_KERNELS";

// Name of the instruction set `reduce` dispatches to: "avx512", "avx2" or "generic" (throws as above on a
// bad HFREDUCE_KERNELS, read on first use).
std::string simd_level();
// The sets this CPU runs, lowest first ("generic" always).
std::vector<std::string> simd_levels();
// Dispatches to `name` from now on (one of simd_levels(), or "best"); throws std::invalid_argument otherwise.
void set_simd_level(const std::string& name);

}  // namespace hfreduce
