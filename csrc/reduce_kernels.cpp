#include "reduce_kernels.h"

#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "half_types.h"

namespace hfreduce {

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")
namespace avx512 {
#include "simd_avx512.h"
#include "reduce_body.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
namespace avx2 {
#include "simd_avx2.h"
#include "reduce_body.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace generic {
#include "simd_generic.h"
#include "reduce_body.h"
}  // namespace generic

namespace {
enum class Level { kGeneric, kAvx2, kAvx512 };

Level detect_level() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return Level::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma")) {
    return Level::kAvx2;
  }
#endif
  return Level::kGeneric;
}

const Level kLevel = detect_level();
}  // namespace

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  throw std::invalid_argument("hfreduce: unknown dtype");
}

bool is_floating(DType dtype) { return dtype != DType::kInt32 && dtype != DType::kInt64; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown dtype";
}

void reduce(DType dtype, void* const* dsts, int ndst, const void* const* srcs, int nsrc, size_t count,
            double divisor) {
  if (count == 0) return;
  switch (kLevel) {
#if defined(__x86_64__)
    case Level::kAvx512:
      return avx512::reduce(dtype, dsts, ndst, srcs, nsrc, count, divisor);
    case Level::kAvx2:
      return avx2::reduce(dtype, dsts, ndst, srcs, nsrc, count, divisor);
#endif
    default:
      return generic::reduce(dtype, dsts, ndst, srcs, nsrc, count, divisor);
  }
}

void reduce(DType dtype, void* dst, const void* const* srcs, int nsrc, size_t count, double divisor) {
  reduce(dtype, &dst, 1, srcs, nsrc, count, divisor);
}

std::string simd_level() {
  switch (kLevel) {
    case Level::kAvx512:
      return "avx512";
    case Level::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

}  // namespace hfreduce
