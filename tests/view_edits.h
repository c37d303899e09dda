// TensorViews edited one property at a time, for the contract tests' bad inputs.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "deltastate/tensor.h"

namespace dstest {

using deltastate::DType;
using deltastate::TensorView;

// The same memory with other dims (dense strides).
inline TensorView reshaped(const TensorView& t, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(t.data, t.dtype, shape, t.device);
}
inline TensorView on_cuda(TensorView t) {
  t.device = deltastate::Device::cuda(0);
  return t;
}
inline TensorView with_dtype(TensorView t, DType d) {
  t.dtype = d;
  return t;
}
inline TensorView with_stride(TensorView t, int dim, int64_t stride) {
  t.stride[dim] = stride;
  return t;
}
inline TensorView with_size(TensorView t, int dim, int64_t size) {
  t.shape[dim] = size;
  return t;
}
// ndim changed in place (extra dims of size 1, or dims dropped).
inline TensorView with_ndim(TensorView t, int ndim) {
  for (int d = t.ndim; d < deltastate::kMaxDims; ++d) {
    t.shape[d] = 1;
    t.stride[d] = 1;
  }
  t.ndim = ndim;
  return t;
}

}  // namespace dstest
