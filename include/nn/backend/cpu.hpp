// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu: the host backend policy. Elementwise kernels are plain loops (OpenMP when built with
// it); GEMM runs on nn's own engine (backend/gemm.hpp, kernels chosen by CPUID features), or on
// CBLAS (OpenBLAS) when NN_USE_BLAS is defined and that BLAS picked real kernels for this CPU, or
// on Eigen's GEMM with NN_GEMM_EIGEN (and compilers without GCC vector extensions). Either way
// nn's OpenMP threads do the splitting (omp_set_num_threads / OMP_NUM_THREADS set the count).
//
// The kernels live in backend/cpu/, one file per family, mirroring ops/: elementwise, reduce,
// matmul (and the GEMM engine), shape, index, random, softmax, cross_entropy, and the fused
// norm, rope, attention and glu, the fused elementwise groups (fused), and optim (the optimizer updates). Per-element math both
// backends share is in backend/math.hpp. nn::cpu gathers the families by inheritance, so
// `cpu::matmul(...)` and `B::matmul(...)` in a template both find them.
//
// Each family is a class template with one instance (`template <class = void> struct
// NormKernelsT`, `using NormKernels = NormKernelsT<>`): its kernels are then compiled only in a
// file that calls one, not in every file that includes this header. That is what lets a program
// built with NN_PRECOMPILED (nn/precompiled.hpp) compile them once, in nn::precompiled.
#pragma once

#include "cpu_info.hpp"
#include "cpu/common.hpp"
#include "cpu/elementwise.hpp"
#include "cpu/reduce.hpp"
#include "cpu/matmul.hpp"
#include "cpu/shape.hpp"
#include "cpu/index.hpp"
#include "cpu/random.hpp"
#include "cpu/softmax.hpp"
#include "cpu/cross_entropy.hpp"
#include "cpu/norm.hpp"
#include "cpu/rope.hpp"
#include "cpu/attention.hpp"
#include "cpu/glu.hpp"
#include "cpu/fused.hpp"
#include "cpu/quantized.hpp"
#include "cpu/linear_cross_entropy.hpp"
#include "cpu/optim.hpp"

namespace nn {

/// The CPU backend policy: every kernel family of backend/cpu/, gathered.
struct cpu : cpu_kernels::ElementwiseKernels,
             cpu_kernels::ReduceKernels,
             cpu_kernels::MatmulKernels,
             cpu_kernels::ShapeKernels,
             cpu_kernels::IndexKernels,
             cpu_kernels::RandomKernels,
             cpu_kernels::SoftmaxKernels,
             cpu_kernels::CrossEntropyKernels,
             cpu_kernels::NormKernels,
             cpu_kernels::RopeKernels,
             cpu_kernels::AttentionKernels,
             cpu_kernels::GluKernels,
             cpu_kernels::FusedKernels,
             cpu_kernels::QuantizedKernels,
             cpu_kernels::LinearCrossEntropyKernels,
             cpu_kernels::OptimKernels {
  static constexpr Device device = Device::cpu;
  static constexpr const char* name = "cpu";

  static Tensor alloc(const Shape& s, DType t) { return Tensor::empty(s, t, Device::cpu); }
};

static_assert(BackendPolicy<cpu>);

/// What this CPU offers and which GEMM nn runs on it (declared in backend/cpu_info.hpp), read
/// once per process. The finetune example and every bench print cpu_info().line() first.
inline const CpuInfo& cpu_info() {
  static const CpuInfo info = [] {
    CpuInfo i;
    i.features = detail::detect_cpu_features();
    const detail::GemmChoice& g = detail::gemm_choice();
    i.note = g.note;
#if defined(NN_OWN_GEMM)
    i.isa = gemm::active_isa();
    if (g.engine == detail::GemmEngine::nn) {
      i.gemm = gemm::describe(i.isa);
      i.gemm_id = std::string("nn-") + isa_name(i.isa);
    }
#endif
    i.bf16 = detail::gemm_bf16_kernel();
    if (g.engine == detail::GemmEngine::blas) i.gemm = "CBLAS", i.gemm_id = "cblas";
    if (g.engine == detail::GemmEngine::eigen) i.gemm = "Eigen's GEMM", i.gemm_id = "eigen";
    return i;
  }();
  return info;
}

}  // namespace nn
