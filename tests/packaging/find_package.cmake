# packaging.find_package: installs kvq into a staging prefix, checks the installed layout, then builds and runs a
# consumer that calls find_package(kvq <major>.<minor> CONFIG REQUIRED).
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

set(prefix "${WORK_DIR}/prefix")
kvq_configure_install("${WORK_DIR}/kvq-build" "${prefix}" -DKVQ_BUILD_TESTS=OFF -DKVQ_BUILD_BENCHMARKS=OFF
                      -DKVQ_BUILD_EXAMPLES=OFF -DKVQ_INSTALL=ON)

kvq_check_prefix_entries("${prefix}" include share)
kvq_check_installed_headers("${prefix}")
kvq_check_files_exist("${prefix}" include/kvq/kvq.hpp share/kvq/LICENSE share/kvq/kvqConfig.cmake share/kvq/kvqConfigVersion.cmake
                      share/kvq/kvqTargets.cmake)
kvq_check_no_path("${prefix}/share" "${prefix}")

string(REGEX MATCH "^[0-9]+\\.[0-9]+" major_minor "${KVQ_VERSION}")
kvq_build_and_test(find_package "${PACKAGING_DIR}/find_package" "-DCMAKE_PREFIX_PATH=${prefix}"
                   "-DKVQ_REQUESTED_VERSION=${major_minor}" "-DKVQ_CONSUMER_CUDA_COMPILER=${CUDA_COMPILER}")

# SameMinorVersion: a request for the next minor version must not be satisfied by this one.
string(REGEX MATCHALL "[0-9]+" parts "${KVQ_VERSION}")
list(GET parts 0 major)
list(GET parts 1 minor)
math(EXPR next_minor "${minor} + 1")
kvq_expect_failure("find_package(kvq ${major}.${next_minor})" "compatible[ \n]+with[ \n]+requested[ \n]+version"
                   "${CMAKE_COMMAND}" -S "${PACKAGING_DIR}/find_package" -B "${WORK_DIR}/consumer-next-minor"
                   ${KVQ_TOOLCHAIN_ARGS} "-DCMAKE_PREFIX_PATH=${prefix}"
                   "-DKVQ_REQUESTED_VERSION=${major}.${next_minor}")
