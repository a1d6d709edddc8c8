// The one torch extension troupe's C++ kernels are built into (troupe/kernels/_native.py). Each
// kernel's file is a part, included below in a namespace of its own, and binds its functions
// into a submodule named after it (bind()). One translation unit compiles torch's and pybind11's
// headers once: all six parts build in about 21 s on 2 cores, where six extensions took 87 s.
//
// Every header the parts include comes first, at file scope: inside a part's namespace its own
// #include lines then find them included already. A new part is a .cpp file here, its
// #include lines added above, and a line in each of the two lists below.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

#include "decode_attention.h"
#include "int8_gemm.h"
#include "small_gemm.h"
#include "vec16.h"
#include "vnni.h"

namespace part_decode_attention {
#include "decode_attention.cpp"
}
namespace part_decode_layer {
#include "decode_layer.cpp"
}
namespace part_int8_gemm {
#include "int8_gemm.cpp"
}
namespace part_lowbit_gemm {
#include "lowbit_gemm.cpp"
}
namespace part_small_gemm {
#include "small_gemm.cpp"
}
namespace part_wq_gemm {
#include "wq_gemm.cpp"
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  part_decode_attention::bind(m.def_submodule("decode_attention"));
  part_decode_layer::bind(m.def_submodule("decode_layer"));
  part_int8_gemm::bind(m.def_submodule("int8_gemm"));
  part_lowbit_gemm::bind(m.def_submodule("lowbit_gemm"));
  part_small_gemm::bind(m.def_submodule("small_gemm"));
  part_wq_gemm::bind(m.def_submodule("wq_gemm"));
}
