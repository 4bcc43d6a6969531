#include "reduce_kernels.h"

#include <atomic>
#include <cstdlib>
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
// Ordered: a CPU that runs a level runs every level below it.
enum class Level { kGeneric, kAvx2, kAvx512 };
constexpr Level kLevels[] = {Level::kGeneric, Level::kAvx2, Level::kAvx512};

const char* level_name(Level level) {
  switch (level) {
    case Level::kAvx512:
      return "avx512";
    case Level::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

Level best_level() {
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

std::string available_names() {
  std::string names;
  for (Level level : kLevels) {
    if (level > best_level()) break;
    names += (names.empty() ? "" : ", ") + std::string(level_name(level));
  }
  return names;
}

// The level named `name` ("best" or "": the CPU's best), checked against this CPU; `source` says who asked.
Level parse_level(const std::string& name, const std::string& source) {
  if (name.empty() || name == "best") return best_level();
  for (Level level : kLevels) {
    if (name != level_name(level)) continue;
    if (level > best_level()) {
      throw std::invalid_argument(source + " asks for the " + name + " reduce kernels, which this CPU cannot run; " +
                                  "it runs: " + available_names() + " (unset it, or say \"best\", for " +
                                  level_name(best_level()) + ")");
    }
    return level;
  }
  throw std::invalid_argument(source + " is not a kernel set; choose one of: generic, avx2, avx512, best");
}

// [Note: choosing the reduce kernels]
// The kernels are the CPU's best unless HFREDUCE_KERNELS names a lower set ("generic" is the portable one,
// what a CPU without AVX2 runs): read once, on first use; the Python module reads it at import
// (bindings.cpp), so a bad value fails there with its message instead of inside a collective.
// set_simd_level() changes it at run time (the kernel tests run every set the CPU has); every set gives the
// same bits (one fp32 rounding per element, in the same order), so a choice changes speed, never results.
std::atomic<Level>& active_level() {
  static std::atomic<Level> level{[] {
    const char* value = std::getenv(kKernelsEnv);
    return value == nullptr ? best_level() : parse_level(value, std::string(kKernelsEnv) + "=" + value);
  }()};
  return level;
}
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
  switch (active_level().load(std::memory_order_relaxed)) {
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

std::string simd_level() { return level_name(active_level().load()); }

std::vector<std::string> simd_levels() {
  std::vector<std::string> names;
  for (Level level : kLevels) {
    if (level <= best_level()) names.emplace_back(level_name(level));
  }
  return names;
}

void set_simd_level(const std::string& name) { active_level().store(parse_level(name, "simd level '" + name + "'")); }

}  // namespace hfreduce
