# CUTLASS/CuTe headers from the pinned nvidia-cutlass Python package (a build requirement), found
# through the build's Python; FT_CUTLASS_INCLUDE_DIR (a CMake variable or an environment variable) can
# point elsewhere. Nothing is downloaded.
find_package(Python3 REQUIRED COMPONENTS Interpreter)
if(NOT FT_CUTLASS_INCLUDE_DIR AND DEFINED ENV{FT_CUTLASS_INCLUDE_DIR})
  set(FT_CUTLASS_INCLUDE_DIR "$ENV{FT_CUTLASS_INCLUDE_DIR}")
endif()
if(NOT FT_CUTLASS_INCLUDE_DIR)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
      "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_VARIABLE FT_CUTLASS_INCLUDE_DIR OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE ft_rc)
  if(NOT ft_rc EQUAL 0 OR NOT EXISTS ${FT_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp)
    message(FATAL_ERROR "CUTLASS headers not found: pip install nvidia-cutlass, or set FT_CUTLASS_INCLUDE_DIR")
  endif()
endif()
file(STRINGS ${FT_CUTLASS_INCLUDE_DIR}/cutlass/version.h ft_ver REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3" FT_CUTLASS_VERSION "${ft_ver}")
message(STATUS "CUTLASS ${FT_CUTLASS_VERSION}: ${FT_CUTLASS_INCLUDE_DIR}")
