// SPDX-License-Identifier: MIT OR Apache-2.0
// Separate compilation of nn's CPU code, opt in: the common GTape<cpu> paths (every primitive's
// forward and vjp with the kernels they call, the tape, the optimizers) compiled once instead of
// in every translation unit.
//
//   every translation unit:  -DNN_PRECOMPILED          (CMake: link nn::precompiled, which sets it)
//   exactly one of them:     #include <nn/instantiate.hpp>   (nn::precompiled's own source does)
//
// With NN_PRECOMPILED, <nn/nn.hpp> ends with `extern template` declarations of the instances
// listed below, so a program's own files parse the headers but generate none of that code; the
// one file that includes <nn/instantiate.hpp> defines them. Without it nothing changes: every
// file instantiates what it uses, as a header-only library does. bench/compile_time.sh measures
// both ways.
//
// Why this works without splitting every kernel into a declaration and a body: the kernel
// families of backend/cpu/ are class templates (instantiated only when called), a primitive's
// OpDef is defined outside its struct (so recording a node names the OpDef without
// instantiating its forward and vjp), and the optimizers' updates are virtual (reached only
// through the vtable, which the explicit instantiation emits).
#pragma once

/// X(kind, instance) for each instance <nn/instantiate.hpp> compiles. A primitive added to
/// NN_PRIMITIVES (backend/policy.hpp) adds its Prim struct here too: <nn/instantiate.hpp> checks
/// the count.
#define NN_CPU_INSTANCES(X)                                                                            \
  X(struct, detail::UnaryPrim<cpu>) X(struct, detail::BinaryPrim<cpu>) X(struct, detail::WherePrim<cpu>) \
  X(struct, detail::StopGradientPrim<cpu>) X(struct, detail::ReshapePrim<cpu>)                         \
  X(struct, detail::PermutePrim<cpu>) X(struct, detail::SlicePrim<cpu>) X(struct, detail::ConcatPrim<cpu>) \
  X(struct, detail::BroadcastPrim<cpu>) X(struct, detail::SumPrim<cpu>) X(struct, detail::MaxPrim<cpu>)  \
  X(struct, detail::MatmulPrim<cpu>) X(struct, detail::GatherRowsPrim<cpu>) X(struct, detail::PickPrim<cpu>) \
  X(struct, detail::SoftmaxPrim<cpu>) X(struct, detail::CrossEntropyPrim<cpu>) X(struct, detail::BernoulliPrim<cpu>)    \
  X(struct, detail::DropoutPrim<cpu>) X(struct, detail::RmsNormPrim<cpu>) X(struct, detail::RopePrim<cpu>) \
  X(struct, detail::AttentionPrim<cpu>) X(struct, detail::FlashAttentionPrim<cpu>)                     \
  X(struct, detail::SwigluPrim<cpu>) X(struct, detail::QuantizedMatmulPrim<cpu>)                       \
  X(struct, detail::QuantizedGatherPrim<cpu>) X(struct, detail::FusedPrim<cpu>)                      \
  X(struct, detail::LinearCrossEntropyPrim<cpu>)                                                       \
  X(class, GTape<cpu>) X(class, Sgd<cpu>) X(class, Adam<cpu>) X(class, AdamW<cpu>) X(class, Lion<cpu>) \
  X(class, Muon<cpu>) X(class, Adafactor<cpu>)

/// The explicit instantiation definitions, once per program: <nn/instantiate.hpp> expands it (with
/// the single header, write `NN_DEFINE_CPU_INSTANCES()` after `#include "nn.hpp"` in one file).
#define NN_DEFINE_CPU_INSTANCE(kind, ...) template kind __VA_ARGS__;
#define NN_DEFINE_CPU_INSTANCES() \
  namespace nn {                  \
  NN_CPU_INSTANCES(NN_DEFINE_CPU_INSTANCE)  \
  }

#if defined(NN_PRECOMPILED)
namespace nn {
#define NN_EXTERN_INSTANCE(kind, ...) extern template kind __VA_ARGS__;
NN_CPU_INSTANCES(NN_EXTERN_INSTANCE)
#undef NN_EXTERN_INSTANCE
}  // namespace nn
#endif
