# A large part of the compile time of each program in this tree is parsing LibTorch's headers,
# and every program parses the same ones. With SPBCAST_PRECOMPILE_TORCH (on by default with
# GCC) they are compiled once per build tree and each executable and object library of this
# tree reuses them.
# The library's own headers are not in it: each program still parses those as a user's would.
# GCC only: the fuzz build's Clang has its own format and cannot parse all of these in C++20.
# The package a user installs is untouched by this (tests/consumer builds without it).
option(SPBCAST_PRECOMPILE_TORCH "Compile LibTorch's headers once for all programs of this tree (GCC)" ON)

if(SPBCAST_PRECOMPILE_TORCH AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  add_library(spbcast_precompiled_torch OBJECT ${CMAKE_CURRENT_LIST_DIR}/precompiled_torch.cpp)
  target_link_libraries(spbcast_precompiled_torch PRIVATE spbcast::spbcast)
  target_precompile_headers(spbcast_precompiled_torch PRIVATE
    <ATen/ATen.h>
    <ATen/core/ivalue.h>
    <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
    <torch/csrc/distributed/c10d/PrefixStore.hpp>
    <torch/csrc/distributed/c10d/TCPStore.hpp>
    <torch/data.h>)
endif()

# Every executable and object library defined under `dir` (after its add_subdirectory) reuses
# the precompiled headers.
function(spbcast_reuse_precompiled_torch dir)
  if(NOT TARGET spbcast_precompiled_torch)
    return()
  endif()
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(type MATCHES "^(EXECUTABLE|OBJECT_LIBRARY)$" AND NOT target STREQUAL spbcast_precompiled_torch)
      target_precompile_headers(${target} REUSE_FROM spbcast_precompiled_torch)
    endif()
  endforeach()
  get_property(subdirectories DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(subdirectory IN LISTS subdirectories)
    spbcast_reuse_precompiled_torch(${subdirectory})
  endforeach()
endfunction()
