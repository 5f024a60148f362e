# The include graph of the library goes downwards only: every header under include/fusedopt/
# belongs to one layer below, and may include (#include "...") headers of its own layer or of
# the layers before it, never of a layer after it. A public header can then lean on detail/
# only where that detail sits at or below it, and a reader can learn the library bottom-up.
#
# cmake -DINCLUDE_ROOT=<the include/ directory> -P layers.cmake
#
# The layers, bottom first. A header in no layer, or in two, fails the test: a new header is
# placed here on purpose. Patterns are CMake regular expressions over the path below
# include/fusedopt/, matched whole.
set(layers
  # Portability macros, the error type, the version; slot lists and their algebra; the tuple
  # behind chains: nothing of fusedopt below them.
  base "config\\.hpp|error\\.hpp|version\\.hpp|meta\\.hpp|detail/pack\\.hpp"
  # Element types and their conversions, host/device-identical math, random bits, rounding.
  numeric "numeric/[a-z_]+\\.hpp"
  # What a rule is: slots, scalars, tensor lists and their binding, reductions' vocabulary,
  # the rule protocol (detail/rule_traits.hpp), the element, chain.
  model "slots\\.hpp|scalar\\.hpp|tensor_list\\.hpp|reduce\\.hpp|factored\\.hpp|bind\\.hpp|rule\\.hpp|chain\\.hpp|detail/rule_traits\\.hpp"
  # What backends derive from a rule: its passes and bodies, element access, rebinding checks.
  engine "detail/phases\\.hpp|detail/factored\\.hpp|detail/access\\.hpp|detail/rebind\\.hpp"
  # Rules and wrappers built on the engine, and the public traits of rules.
  rules "traits\\.hpp|groups\\.hpp|rules/[a-z_]+\\.hpp"
  # CUDA backend, bottom-up as CUB layers it: errors and the tuning policy; what a launch
  # reads (tables, pass results) and staging buffers; vector I/O; the per-block chunk worker
  # (agent); the kernels.
  cuda_policy "cuda/error\\.cuh|cuda/detail/policy\\.cuh"
  cuda_tables "cuda/detail/tables\\.cuh|cuda/detail/upload_ring\\.cuh"
  cuda_vector_io "cuda/detail/vector_io\\.cuh"
  cuda_agent "cuda/detail/agent\\.cuh"
  cuda_kernels "cuda/detail/kernels\\.cuh"
  # Host launch logic: checks, chunk length and grid from the policy, one launch per kernel;
  # the device copies of a plan's address table, written by uploads or by launches.
  cuda_dispatch "cuda/detail/dispatch\\.cuh|cuda/detail/factored\\.cuh|cuda/detail/address_tables\\.cuh|cuda/detail/workspace\\.cuh"
  # The host backend's loop versions (AVX2, AVX-512) and the choice among them at run time.
  host_instruction_sets "host/instruction_set\\.hpp"
  # The backends' facades, and the definitions of the CUDA one (included at its end).
  backends "host/backend\\.hpp|cuda/backend\\.cuh|cuda/detail/backend\\.inl"
  # Plans with a matrix stage between fused passes (Muon): Newton-Schulz on the host, the
  # host plan, the CUDA plan over cuBLAS.
  matrix "detail/muon_lists\\.hpp|host/newton_schulz\\.hpp|host/muon\\.hpp|cuda/muon\\.cuh"
  # Sharded plans over a communicator (local_group: N ranks on one GPU; nccl: NCCL).
  distributed "cuda/sharded\\.cuh|cuda/detail/sharded\\.inl|cuda/local_group\\.cuh|nccl\\.cuh"
  # Umbrella headers.
  umbrellas "fusedopt\\.hpp|fusedopt\\.cuh")

if(NOT DEFINED INCLUDE_ROOT)
  message(FATAL_ERROR "layers.cmake: INCLUDE_ROOT is not set")
endif()
get_filename_component(root "${INCLUDE_ROOT}/fusedopt" ABSOLUTE)

# layer_of(path out_index out_name): the layer of a path below include/fusedopt/, -1 if none.
function(layer_of path out_index out_name)
  set(found -1)
  set(found_name "")
  set(index 0)
  list(LENGTH layers length)
  math(EXPR last "${length} - 1")
  foreach(i RANGE 0 ${last} 2)
    math(EXPR j "${i} + 1")
    list(GET layers ${i} name)
    list(GET layers ${j} pattern)
    if(path MATCHES "^(${pattern})$")
      if(NOT found EQUAL -1)
        message(SEND_ERROR "${path} matches two layers: ${found_name} and ${name}")
      endif()
      set(found ${index})
      set(found_name ${name})
    endif()
    math(EXPR index "${index} + 1")
  endforeach()
  set(${out_index} ${found} PARENT_SCOPE)
  set(${out_name} ${found_name} PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE headers RELATIVE "${root}" "${root}/*.hpp" "${root}/*.cuh" "${root}/*.inl")
list(SORT headers)
set(errors 0)
set(edges 0)
foreach(header IN LISTS headers)
  layer_of("${header}" from from_name)
  if(from EQUAL -1)
    message(SEND_ERROR "${header} is in no layer: place it in tests/headers/layers.cmake")
    math(EXPR errors "${errors} + 1")
    continue()
  endif()
  get_filename_component(directory "${header}" DIRECTORY)
  file(STRINGS "${root}/${header}" includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*$" "\\1" target "${line}")
    if(directory STREQUAL "")
      set(resolved "${target}")
    else()
      set(resolved "${directory}/${target}")
    endif()
    cmake_path(NORMAL_PATH resolved)
    if(resolved MATCHES "^\\.\\./")
      message(SEND_ERROR "${header} includes \"${target}\", outside include/fusedopt/")
      math(EXPR errors "${errors} + 1")
      continue()
    endif()
    layer_of("${resolved}" to to_name)
    if(to EQUAL -1)
      message(SEND_ERROR "${header} includes \"${target}\" (${resolved}), which is in no layer")
      math(EXPR errors "${errors} + 1")
    elseif(to GREATER from)
      message(SEND_ERROR "${header} (layer ${from_name}) includes ${resolved} of the higher layer ${to_name}")
      math(EXPR errors "${errors} + 1")
    endif()
    math(EXPR edges "${edges} + 1")
  endforeach()
endforeach()
list(LENGTH headers count)
if(errors GREATER 0)
  message(FATAL_ERROR "${errors} include(s) of ${count} headers break the layering above")
endif()
message(STATUS "${count} headers, ${edges} includes, all downwards or within a layer")
