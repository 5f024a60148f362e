# Driver of the CMake consumer tests (run by CTest with cmake -P):
#   MODE=install           cmake --install the fusedopt build FUSEDOPT_BINARY_DIR into PREFIX
#   MODE=find_package      build and test tests/cmake/consumer against PREFIX
#   MODE=add_subdirectory  build and test tests/cmake/consumer with fusedopt as a subdirectory
#   MODE=version           check PREFIX's version file: 0.1 and 0.1.0 accepted, 0.2 and 1.0 not
# Other variables: WORK_DIR (scratch, wiped), CONFIG, GENERATOR, MAKE_PROGRAM, CXX_COMPILER,
# CUDA_COMPILER (empty: no CUDA), CUDA_HOST_COMPILER, CUDA_ARCHITECTURES ('|'-separated),
# CUDA_COMPILE_ONLY and CUDA_COMPILE_ONLY_FLAGS (the tree's FUSEDOPT_CUDA_COMPILE_ONLY and its flags).
cmake_minimum_required(VERSION 3.23)

function(run_step what)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "${what}: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${rc})")
  endif()
endfunction()

set(here ${CMAKE_CURRENT_LIST_DIR})
if(NOT CONFIG)
  set(CONFIG Release)
endif()

# The same toolchain and generator as the fusedopt build under test.
set(configure_args -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=${CONFIG} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(MAKE_PROGRAM)
  list(APPEND configure_args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  run_step("install" ${CMAKE_COMMAND} --install "${FUSEDOPT_BINARY_DIR}" --prefix "${PREFIX}" --config ${CONFIG})
  foreach(file include/fusedopt/fusedopt.hpp include/fusedopt/fusedopt.cuh include/fusedopt/version.hpp)
    if(NOT EXISTS "${PREFIX}/${file}")
      message(FATAL_ERROR "the install lacks ${file}")
    endif()
  endforeach()
  file(GLOB_RECURSE configs "${PREFIX}/*/fusedoptConfig.cmake" "${PREFIX}/*/fusedoptConfigVersion.cmake")
  list(LENGTH configs count)
  if(NOT count EQUAL 2)
    message(FATAL_ERROR "the install lacks fusedoptConfig.cmake or fusedoptConfigVersion.cmake: ${configs}")
  endif()
  return()
endif()

if(MODE STREQUAL "version")
  foreach(check "0.1;ON" "0.1.0;ON" "0.2;OFF" "1.0;OFF")
    list(GET check 0 requested)
    list(GET check 1 expect_found)
    set(build "${WORK_DIR}/${requested}")
    file(REMOVE_RECURSE "${build}")
    run_step("find_package(fusedopt ${requested})" ${CMAKE_COMMAND} -S "${here}/version_check" -B "${build}"
             ${configure_args} "-DCMAKE_PREFIX_PATH=${PREFIX}" -DREQUESTED=${requested} -DEXPECT_FOUND=${expect_found})
  endforeach()
  return()
endif()

if(MODE STREQUAL "find_package")
  list(APPEND configure_args -DCONSUMER_MODE=find_package "-DCMAKE_PREFIX_PATH=${PREFIX}")
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND configure_args -DCONSUMER_MODE=add_subdirectory "-DFUSEDOPT_SOURCE_DIR=${FUSEDOPT_SOURCE_DIR}")
else()
  message(FATAL_ERROR "run.cmake: unknown MODE '${MODE}'")
endif()
if(CUDA_COMPILER)
  string(REPLACE "|" ";" archs "${CUDA_ARCHITECTURES}")
  list(APPEND configure_args -DCONSUMER_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}
       "-DCMAKE_CUDA_ARCHITECTURES=${archs}")
  if(CUDA_HOST_COMPILER)
    list(APPEND configure_args -DCMAKE_CUDA_HOST_COMPILER=${CUDA_HOST_COMPILER})
  endif()
  if(CUDA_COMPILE_ONLY)
    # As the tree that runs this test (FUSEDOPT_CUDA_COMPILE_ONLY): the consumer's kernels are
    # skipped there anyway, so its CUDA sources are compiled without optimisation, with the
    # tree's flags (FUSEDOPT_CUDA_COMPILE_ONLY_FLAGS).
    if(NOT DEFINED CUDA_COMPILE_ONLY_FLAGS)
      set(CUDA_COMPILE_ONLY_FLAGS "-Xcicc -O0")
    endif()
    list(APPEND configure_args "-DCMAKE_CUDA_FLAGS=${CUDA_COMPILE_ONLY_FLAGS}" "-DCMAKE_CUDA_FLAGS_RELEASE=-DNDEBUG")
  endif()
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
run_step("configure" ${CMAKE_COMMAND} -S "${here}/consumer" -B "${WORK_DIR}" ${configure_args})
run_step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}" --config ${CONFIG})
run_step("test" ${CMAKE_CTEST_COMMAND} --test-dir "${WORK_DIR}" --output-on-failure -C ${CONFIG})
