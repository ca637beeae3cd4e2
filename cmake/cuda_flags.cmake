# nvcc flags, per-source gencode (hopper/ -> sm_90a, ampere/ -> sm_80 family and sm_90), ccache,
# and a compile job pool sized by memory (nvcc on CuTe kernels takes 3-5 GB per job).
set(FT_CUDA_FLAGS -O3 --use_fast_math --expt-relaxed-constexpr -DNDEBUG -Xcompiler=-fno-strict-aliasing
    -DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
# Measurement overrides (FT_OVERRIDE_OPTIONS, cmake/options.cmake): passed only when set, since the
# headers default each to -1 (the tile policy) and a -D here would come after, and so silently replace,
# the same macro given through CMAKE_CUDA_FLAGS.
foreach(opt ${FT_OVERRIDE_OPTIONS})
  if(NOT "${${opt}}" STREQUAL "-1")
    list(APPEND FT_CUDA_FLAGS -D${opt}=${${opt}})
  endif()
endforeach()
if(FLASHTILE_PTXAS_VERBOSE)
  list(APPEND FT_CUDA_FLAGS -Xptxas=-v)
endif()

# Attach -gencode flags for each arch in `archs` (80, 86, 89, 90, 90a) to each file in `sources`; with
# FLASHTILE_EMBED_PTX the lowest arch's PTX is embedded too, so newer GPUs can JIT it.
function(ft_set_gencode sources archs)
  set(flags "")
  foreach(a IN LISTS archs)
    list(APPEND flags "-gencode=arch=compute_${a},code=sm_${a}")
  endforeach()
  if(FLASHTILE_EMBED_PTX AND archs)
    list(GET archs 0 lowest)
    list(APPEND flags "-gencode=arch=compute_${lowest},code=compute_${lowest}")
  endif()
  if(sources)
    set_source_files_properties(${sources} PROPERTIES COMPILE_OPTIONS "${flags}")
  endif()
endfunction()

find_program(FT_CCACHE ccache)
if(FT_CCACHE)
  message(STATUS "ccache: ${FT_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${FT_CCACHE})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${FT_CCACHE})
endif()

cmake_host_system_information(RESULT ft_mem_mib QUERY TOTAL_PHYSICAL_MEMORY)
math(EXPR ft_jobs "${ft_mem_mib} / 4096")
if(ft_jobs LESS 1)
  set(ft_jobs 1)
endif()
set_property(GLOBAL APPEND PROPERTY JOB_POOLS ft_nvcc=${ft_jobs})
set(CMAKE_JOB_POOL_COMPILE ft_nvcc)
message(STATUS "compile job pool: ${ft_jobs} (${ft_mem_mib} MiB / 4 GiB per nvcc)")
