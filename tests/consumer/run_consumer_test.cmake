# Installs spbcast from the build tree into a scratch prefix, builds the consumer project
# against it with find_package, and runs it.
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DTorch_DIR=... -P run_consumer_test.cmake
set(prefix "${BUILD_DIR}/consumer-test/install")
set(consumer_build "${BUILD_DIR}/consumer-test/build")
file(REMOVE_RECURSE "${BUILD_DIR}/consumer-test")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install failed")
endif()
# Relocatable: no absolute path in the exported targets, and the package works from elsewhere.
file(GLOB exported "${prefix}/lib*/cmake/spbcast/spbcastTargets*.cmake")
foreach(f ${exported})
  file(READ "${f}" text)
  if(text MATCHES "\\.so|/usr/lib|site-packages")
    message(FATAL_ERROR "${f} names a library path of this machine: the package is not relocatable")
  endif()
endforeach()
file(RENAME "${prefix}" "${prefix}-moved")
set(prefix "${prefix}-moved")
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${consumer_build}"
                        "-DCMAKE_PREFIX_PATH=${prefix}" "-DTorch_DIR=${Torch_DIR}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed:\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${consumer_build}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "building the consumer failed:\n${out}")
endif()
execute_process(COMMAND "${consumer_build}/consumer" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message(STATUS "${out}")
if(rc)
  message(FATAL_ERROR "the consumer failed")
endif()
