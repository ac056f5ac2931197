# SPDX-License-Identifier: MIT OR Apache-2.0
# Install rules: headers, the exported nn::nn target, nnConfig.cmake and its version file, so a
# consumer's find_package(nn) gets the same target add_subdirectory() would give it.
include(CMakePackageConfigHelpers)

# Header-only and free of absolute library paths (BLAS and OpenMP are found again by the
# consumer), so the package is architecture independent and lives under share/, as
# nlohmann_json's does.
set(NN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_DATADIR}/cmake/nn CACHE STRING "Where nnConfig.cmake is installed")

install(TARGETS nn nn_distributed EXPORT nnTargets)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/nn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT nnTargets NAMESPACE nn:: DESTINATION ${NN_INSTALL_CMAKEDIR})

# nnConfig.cmake re-finds exactly the dependencies this build linked nn against.
set(NN_CONFIG_USES_OPENMP ${OpenMP_CXX_FOUND})
set(NN_CONFIG_USES_BLAS ${NN_USE_BLAS})
set(NN_CONFIG_USES_MPI ${MPI_CXX_FOUND})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/nnConfig.cmake.in
  ${PROJECT_BINARY_DIR}/nnConfig.cmake
  INSTALL_DESTINATION ${NN_INSTALL_CMAKEDIR})
# 0.x releases may break the API at every minor step, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/nnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/nnConfig.cmake ${PROJECT_BINARY_DIR}/nnConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/precompiled.cpp  # nn::precompiled's source, built by the consumer
  DESTINATION ${NN_INSTALL_CMAKEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/LICENSE-MIT ${PROJECT_SOURCE_DIR}/LICENSE-APACHE
  DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/nn)
