# SPDX-License-Identifier: MIT OR Apache-2.0
# Runs checkpoint_resume in three separate processes and compares the final weights byte for byte.
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
foreach(mode straight first second)
  execute_process(COMMAND ${EXE} ${mode} ${DIR} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "checkpoint_resume ${mode} failed (${rc})")
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${DIR}/straight.safetensors ${DIR}/resumed.safetensors
                RESULT_VARIABLE same)
if(NOT same EQUAL 0)
  message(FATAL_ERROR "resumed training differs from the uninterrupted run")
endif()
message(STATUS "resume after a checkpoint is bitwise identical to the uninterrupted run")
