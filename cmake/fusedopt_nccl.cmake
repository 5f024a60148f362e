# NCCL, optional: sharded plans over NCCL (include/fusedopt/nccl.cuh) are tested and built as
# examples where it is found. Looked for next to the CUDA toolkit, under FUSEDOPT_NCCL_ROOT
# (a cache variable) or the NCCL_ROOT environment variable (PyTorch's nvidia-nccl wheel ships
# include/nccl.h and lib/libnccl.so.2). Defines FUSEDOPT_HAS_NCCL and, when found, the
# imported target fusedopt_nccl (header path and library).
set(FUSEDOPT_NCCL_ROOT "" CACHE PATH "Where NCCL is (include/nccl.h, lib/libnccl.so); empty: next to the CUDA toolkit")
set(FUSEDOPT_HAS_NCCL OFF)
get_filename_component(fusedopt_cuda_root "${CMAKE_CUDA_COMPILER}" DIRECTORY)
get_filename_component(fusedopt_cuda_root "${fusedopt_cuda_root}" DIRECTORY)
find_path(FUSEDOPT_NCCL_INCLUDE_DIR nccl.h
          HINTS ${FUSEDOPT_NCCL_ROOT} $ENV{NCCL_ROOT} ${fusedopt_cuda_root} PATH_SUFFIXES include)
find_library(FUSEDOPT_NCCL_LIBRARY NAMES nccl libnccl.so.2
             HINTS ${FUSEDOPT_NCCL_ROOT} $ENV{NCCL_ROOT} ${fusedopt_cuda_root} PATH_SUFFIXES lib64 lib)
if(FUSEDOPT_NCCL_INCLUDE_DIR AND FUSEDOPT_NCCL_LIBRARY)
  set(FUSEDOPT_HAS_NCCL ON)
  add_library(fusedopt_nccl INTERFACE IMPORTED)
  target_include_directories(fusedopt_nccl INTERFACE ${FUSEDOPT_NCCL_INCLUDE_DIR})
  target_link_libraries(fusedopt_nccl INTERFACE ${FUSEDOPT_NCCL_LIBRARY})
  message(STATUS "fusedopt: NCCL found (${FUSEDOPT_NCCL_LIBRARY}): sharded NCCL tests and examples are built")
else()
  message(STATUS "fusedopt: NCCL not found: the NCCL parts of the sharded tests and examples/sharded_adamw are skipped "
                 "(set FUSEDOPT_NCCL_ROOT)")
endif()
