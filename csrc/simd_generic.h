// Portable traits for reduce_body.h: one lane; the compiler vectorizes what it can.
// Included inside a namespace by reduce_kernels.cpp (which includes <immintrin.h> first): no guard.

struct Simd {
  using V = float;
  static constexpr size_t kWidth = 1;
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V div(V a, V b) { return a / b; }
  template <class T>
  static V load(const T* p) { return to_float(*p); }
  template <class T>
  static void store(T* p, V v) { from_float(p, v); }
};
