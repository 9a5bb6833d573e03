// Helpers of the bitwise checks (decode_check.cc, product_key_check.cc): a value in a kernel's element type, and
// the comparison of two results bit for bit.
#pragma once
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/bf16.h"

template <typename T>
T value(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return sdm::from_float<sdm::bf16>(x);
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
