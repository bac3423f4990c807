# Finds every third-party library through pkg-config and names the Debian
# package to install when one is missing.
find_package(PkgConfig)
if(NOT PKG_CONFIG_FOUND)
  message(FATAL_ERROR "pkg-config not found: apt-get install pkg-config")
endif()

add_library(moerl_deps INTERFACE)

function(moerl_require module debian_pkg)
  pkg_check_modules(DEP_${module} QUIET IMPORTED_TARGET ${module})
  if(NOT DEP_${module}_FOUND)
    message(FATAL_ERROR "${module} not found: apt-get install ${debian_pkg}")
  endif()
  target_link_libraries(moerl_deps INTERFACE PkgConfig::DEP_${module})
endfunction()

moerl_require(libzmq libzmq3-dev)
moerl_require(libuv libuv1-dev)
moerl_require(msgpack libmsgpack-dev)
moerl_require(cunit libcunit1-dev)
moerl_require(openblas libopenblas-dev)
moerl_require(libfyaml libfyaml-dev)
moerl_require(libcjson libcjson-dev)
moerl_require(libpcre2-8 libpcre2-dev)
moerl_require(libmicrohttpd libmicrohttpd-dev)

# Open MPI: the CPU backend of the expert-parallel communication layer.
moerl_require(ompi-c libopenmpi-dev)
find_program(MOERL_MPIRUN NAMES mpirun)
if(NOT MOERL_MPIRUN)
  message(FATAL_ERROR "mpirun not found: apt-get install openmpi-bin")
endif()

find_package(OpenMP REQUIRED COMPONENTS C)
target_link_libraries(moerl_deps INTERFACE OpenMP::OpenMP_C m ${CMAKE_DL_LIBS} pthread)

find_program(MOERL_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
