# SPDX-License-Identifier: MIT OR Apache-2.0
# nn's CUDA backend as a CMake target: nn::cuda = nn::nn + the CUDA runtime + cuBLAS + the nvcc
# flags <nn/cuda.hpp> needs. Included by the top-level CMakeLists.txt when NN_WITH_CUDA is ON.

# sm_90 machine code (H100/H200) plus compute_90 PTX that newer GPUs JIT-compile. `native` cannot
# be used: CI compiles these tests on machines without a GPU. Must be set before enable_language.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.0)
  message(FATAL_ERROR "nn's CUDA backend needs nvcc >= 12.0 (C++20), found ${CMAKE_CUDA_COMPILER_VERSION}")
endif()

add_library(nn_cuda INTERFACE)
add_library(nn::cuda ALIAS nn_cuda)
target_link_libraries(nn_cuda INTERFACE nn::nn CUDA::cudart CUDA::cublas)
# C++20 for nvcc: the compile feature where this CMake knows it for this nvcc (CMake 3.25 does not
# for nvcc 13), else the flag.
if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
  target_compile_features(nn_cuda INTERFACE cuda_std_20)
else()
  target_compile_options(nn_cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
endif()
# --expt-relaxed-constexpr: Eigen's and the standard library's constexpr helpers in host code that
# nvcc's front end also sees. 20012: Eigen's __host__ __device__ on defaulted members (harmless).
target_compile_options(nn_cuda INTERFACE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr --diag-suppress=20012>)
message(STATUS "nn: CUDA backend ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
