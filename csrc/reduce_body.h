// The one reduction template, compiled once per instruction set.
//
// Included by reduce_kernels.cpp inside `namespace <isa>` under `#pragma GCC target(...)`, after that
// ISA's `Simd` traits (simd_avx512.h, simd_avx2.h, simd_generic.h). No include guard on purpose.

// Sums `n` float-like arrays (float, fp16 or bf16 bits) in fp32 lanes, divides, rounds once on store,
// and stores the result into each of the `m` destinations (one pass: a result read back for a second copy
// would cost a second trip through the cache).
template <class T>
void sum_in_fp32(T* const* dsts, int m, const T* const* srcs, int n, size_t count, float divisor) {
  constexpr size_t W = Simd::kWidth;
  const bool divide = divisor != 1.0f;
  const auto vdiv = Simd::set1(divisor);
  size_t i = 0;
  for (; i + W <= count; i += W) {
    auto acc = Simd::load(srcs[0] + i);
    for (int k = 1; k < n; ++k) acc = Simd::add(acc, Simd::load(srcs[k] + i));
    if (divide) acc = Simd::div(acc, vdiv);
    for (int d = 0; d < m; ++d) Simd::store(dsts[d] + i, acc);
  }
  for (; i < count; ++i) {
    float acc = to_float(srcs[0][i]);
    for (int k = 1; k < n; ++k) acc += to_float(srcs[k][i]);
    if (divide) acc /= divisor;
    for (int d = 0; d < m; ++d) from_float(dsts[d] + i, acc);
  }
}

// Doubles and integers: plain loops that the compiler vectorizes for this ISA. Sums go through a
// block on the stack because a destination may alias any source (a rank reduces into its own slot).
template <class T>
void sum_plain(T* const* dsts, int m, const T* const* srcs, int n, size_t count, double divisor) {
  constexpr size_t kBlock = 1024;
  T acc[kBlock];
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t len = b + kBlock < count ? kBlock : count - b;
    const T* s0 = srcs[0] + b;
    for (size_t i = 0; i < len; ++i) acc[i] = s0[i];
    for (int k = 1; k < n; ++k) {
      const T* s = srcs[k] + b;
      for (size_t i = 0; i < len; ++i) acc[i] += s[i];
    }
    if (divisor != 1.0) {
      const T d = static_cast<T>(divisor);
      for (size_t i = 0; i < len; ++i) acc[i] /= d;
    }
    for (int d = 0; d < m; ++d) {
      T* dst = dsts[d] + b;
      for (size_t i = 0; i < len; ++i) dst[i] = acc[i];
    }
  }
}

inline void reduce(DType dtype, void* const* dsts, int m, const void* const* srcs, int n, size_t count,
                   double divisor) {
  switch (dtype) {
    case DType::kFloat32:
      return sum_in_fp32(reinterpret_cast<float* const*>(dsts), m, reinterpret_cast<const float* const*>(srcs), n,
                         count, static_cast<float>(divisor));
    case DType::kFloat16:
      return sum_in_fp32(reinterpret_cast<Half* const*>(dsts), m, reinterpret_cast<const Half* const*>(srcs), n,
                         count, static_cast<float>(divisor));
    case DType::kBFloat16:
      return sum_in_fp32(reinterpret_cast<BFloat16* const*>(dsts), m,
                         reinterpret_cast<const BFloat16* const*>(srcs), n, count, static_cast<float>(divisor));
    case DType::kFloat64:
      return sum_plain(reinterpret_cast<double* const*>(dsts), m, reinterpret_cast<const double* const*>(srcs), n,
                       count, divisor);
    case DType::kInt32:
      return sum_plain(reinterpret_cast<int32_t* const*>(dsts), m, reinterpret_cast<const int32_t* const*>(srcs),
                       n, count, divisor);
    case DType::kInt64:
      return sum_plain(reinterpret_cast<int64_t* const*>(dsts), m, reinterpret_cast<const int64_t* const*>(srcs),
                       n, count, divisor);
  }
}
