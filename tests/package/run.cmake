# SPDX-License-Identifier: MIT OR Apache-2.0
# Driver for the package tests (cmake -P): consumes nn as a user would in one of three ways, in a
# scratch dir, then builds and runs the consumer program. Any failing step fails the CTest test.
#
#   -DMODE=find_package|add_subdirectory|fetch_content  -DNN_SOURCE_DIR=<nn>  -DWORK_DIR=<scratch>
#   [-DCXX=<compiler>] [-DBUILD_TYPE=Release] [-DGENERATOR=<cmake generator>]
cmake_minimum_required(VERSION 3.20)

foreach(v MODE NN_SOURCE_DIR WORK_DIR)
  if(NOT ${v})
    message(FATAL_ERROR "run.cmake needs -D${v}=...")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
set(consumer_src ${CMAKE_CURRENT_LIST_DIR}/${MODE})
if(NOT EXISTS ${consumer_src}/CMakeLists.txt)
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()

# The same toolchain as the build that registered the test, so a pass means something for it.
set(common_args -DCMAKE_BUILD_TYPE=${BUILD_TYPE})
if(CXX)
  list(APPEND common_args -DCMAKE_CXX_COMPILER=${CXX})
endif()
if(GENERATOR)
  list(APPEND common_args -G ${GENERATOR})
endif()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(step what)
  message(STATUS "[package:${MODE}] ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[package:${MODE}] failed (${rc}): ${what}")
  endif()
endfunction()

set(consumer_args)
if(MODE STREQUAL "find_package")
  # Install nn alone (no tests/examples/bench), then check the layout a consumer relies on.
  set(prefix ${WORK_DIR}/prefix)
  step("configure nn for install" ${CMAKE_COMMAND} -S ${NN_SOURCE_DIR} -B ${WORK_DIR}/nn-build ${common_args}
       -DNN_BUILD_TESTS=OFF -DNN_BUILD_EXAMPLES=OFF -DNN_BUILD_BENCH=OFF -DCMAKE_INSTALL_PREFIX=${prefix})
  step("install nn" ${CMAKE_COMMAND} --install ${WORK_DIR}/nn-build --config ${BUILD_TYPE})
  foreach(f include/nn/nn.hpp include/nn/config.hpp share/cmake/nn/nnConfig.cmake
            share/cmake/nn/nnConfigVersion.cmake share/cmake/nn/nnTargets.cmake share/cmake/nn/precompiled.cpp
            share/doc/nn/LICENSE)
    if(NOT EXISTS ${prefix}/${f})
      message(FATAL_ERROR "[package:find_package] the install lacks ${f}")
    endif()
  endforeach()
  # Only the install prefix: the consumer must not reach back into the source tree.
  list(APPEND consumer_args -DCMAKE_PREFIX_PATH=${prefix})
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND consumer_args -DNN_SOURCE_DIR=${NN_SOURCE_DIR})
elseif(MODE STREQUAL "fetch_content")
  # A release-style tarball with one top folder and only what a release ships (no tests, no
  # examples, no build dirs), fetched by URL like any downloaded archive.
  set(stage ${WORK_DIR}/stage/nn-src)
  file(MAKE_DIRECTORY ${stage})
  foreach(item CMakeLists.txt cmake include single_include LICENSE LICENSE-MIT LICENSE-APACHE README.md)
    if(EXISTS ${NN_SOURCE_DIR}/${item})
      file(COPY ${NN_SOURCE_DIR}/${item} DESTINATION ${stage})
    endif()
  endforeach()
  step("pack nn" ${CMAKE_COMMAND} -E chdir ${WORK_DIR}/stage ${CMAKE_COMMAND} -E tar czf ${WORK_DIR}/nn-src.tar.gz nn-src)
  list(APPEND consumer_args -DNN_ARCHIVE=${WORK_DIR}/nn-src.tar.gz)
endif()

step("configure the consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${WORK_DIR}/consumer-build ${common_args} ${consumer_args})
step("build the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/consumer-build --config ${BUILD_TYPE})

set(exe ${WORK_DIR}/consumer-build/consumer)
if(NOT EXISTS ${exe})
  set(exe ${WORK_DIR}/consumer-build/${BUILD_TYPE}/consumer)  # multi-config generators
endif()
step("run the consumer" ${exe})
# A consumer that also links nn::precompiled (find_package) runs that build too.
get_filename_component(exe_dir ${exe} DIRECTORY)
if(EXISTS ${exe_dir}/consumer_precompiled)
  step("run the consumer built with nn::precompiled" ${exe_dir}/consumer_precompiled)
endif()
