# Fails when a test object compiled any LibTorch header from the other LibTorch generation.
# Two generations can sit on one machine: Debian's in /usr/include (searched last) and the
# wheel's. A header missing from the wheel would silently be taken from /usr/include, so every
# build scans the compilers' dependency lists. The one known exception: the wheel ships no gloo
# headers, so c10d/ProcessGroupGloo.hpp includes Debian's (libgloo-dev); only the opaque types
# of the group's constructor cross that boundary.
#   cmake -DBUILD_DIR=... -DTORCH_INCLUDE="..." -P check_header_provenance.cmake
file(GLOB_RECURSE dep_files "${BUILD_DIR}/*/compiler_depend.make")
if(NOT dep_files)
  message(FATAL_ERROR "no dependency lists under ${BUILD_DIR}: build first")
endif()
if(TORCH_INCLUDE MATCHES "^/usr/include")
  set(foreign "site-packages/torch/include")
  set(generation "the distribution's LibTorch")
else()
  set(foreign "/usr/include/(ATen|c10|torch|caffe2)/")
  set(generation "the wheel's LibTorch")
endif()
set(torch_headers 0)
set(gloo_headers 0)
foreach(f IN LISTS dep_files)
  file(STRINGS "${f}" lines REGEX "\\.(h|hpp)")
  foreach(line IN LISTS lines)
    if(line MATCHES "${foreign}")
      message(FATAL_ERROR "header from the other LibTorch generation in ${f}:\n${line}\n"
                          "Fix the include path order so that ${TORCH_INCLUDE} comes first.")
    endif()
    if(line MATCHES "/(ATen|c10|torch)/")
      math(EXPR torch_headers "${torch_headers} + 1")
    endif()
    if(line MATCHES "/usr/include/gloo/")
      math(EXPR gloo_headers "${gloo_headers} + 1")
    endif()
  endforeach()
endforeach()
message(STATUS "header provenance: ${torch_headers} LibTorch header uses, all from ${generation} "
               "(${TORCH_INCLUDE}); ${gloo_headers} gloo header uses from /usr/include/gloo")
