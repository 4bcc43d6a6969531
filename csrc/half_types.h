// Storage types for 16-bit floats and their scalar conversions (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace hfreduce {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline void from_float(float* dst, float x) { *dst = x; }

inline float to_float(Half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, sizeof f);
  return static_cast<float>(f);
}
inline void from_float(Half* dst, float x) {
  const _Float16 f = static_cast<_Float16>(x);  // IEEE round to nearest even
  std::memcpy(&dst->bits, &f, sizeof f);
}

inline float to_float(BFloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void from_float(BFloat16* dst, float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a quiet NaN
    dst->bits = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  dst->bits = static_cast<uint16_t>(u >> 16);
}

}  // namespace hfreduce
