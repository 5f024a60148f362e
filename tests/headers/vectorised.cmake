# The test headers_vectorised (tests/headers/CMakeLists.txt), run with cmake -P: compiles
# vectorised.cpp with only the flags of a user who vendors the headers, then reads the
# object's disassembly. Adam's loop must hold a packed float square root, and so must every
# version of it that the compiler built (the wrappers of host/instruction_set.hpp: GCC's
# baseline, AVX2 and AVX-512). Fails if any of them lost its vectors (issue 47).
#
# In: COMPILER, FLAGS (one string, split as a shell would), INCLUDE_ROOT, SOURCE, OBJECT,
# OBJDUMP.
cmake_minimum_required(VERSION 3.23)
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
execute_process(COMMAND ${COMPILER} ${flags} -I${INCLUDE_ROOT} -c ${SOURCE} -o ${OBJECT} RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${COMPILER} ${FLAGS} -I${INCLUDE_ROOT} -c ${SOURCE} failed")
endif()
execute_process(COMMAND ${OBJDUMP} -d -C --no-show-raw-insn ${OBJECT}
                OUTPUT_VARIABLE disassembly RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${OBJDUMP} -d ${OBJECT} failed")
endif()

# Lines as a list: no character of a C++ name may split or group its items.
string(REGEX REPLACE "[][;\\]" "_" disassembly "${disassembly}")
string(REPLACE "\n" ";" lines "${disassembly}")
set(function other)
set(versions)    # the wrappers present
set(vectorised)  # the functions holding a packed float square root (x86-64 or AArch64)
foreach(line IN LISTS lines)
  if(line MATCHES "^[0-9a-f]+ <(.*)>:$")
    set(function other)
    if(CMAKE_MATCH_1 MATCHES "::detail::run_(baseline|avx2|avx512)<")
      set(function ${CMAKE_MATCH_1})
      list(APPEND versions ${function})
    endif()
  elseif(line MATCHES "[ \t]v?sqrtps[ \t]|[ \t]fsqrt[ \t]+v[0-9]+\\.4s")
    list(APPEND vectorised ${function})
  endif()
endforeach()
list(REMOVE_DUPLICATES versions)
list(REMOVE_DUPLICATES vectorised)

set(hint "compiled with `${FLAGS}` only; see docs/decisions.md, \"A square root that vectorises without -fno-math-errno\"")
if(NOT vectorised)
  message(FATAL_ERROR "no packed square root in ${OBJECT}: the host backend's Adam loop is scalar (${hint})")
endif()
foreach(version IN LISTS versions)
  if(NOT version IN_LIST vectorised)
    message(FATAL_ERROR "no packed square root in the ${version} version of the Adam loop (${hint})")
  endif()
endforeach()
if(versions)
  message(STATUS "packed square roots in every version of the Adam loop: ${versions}")
else()
  message(STATUS "packed square roots in the Adam loop (one version)")
endif()
