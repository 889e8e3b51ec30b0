# packaging.add_subdirectory: a consumer that pulls kvq in with add_subdirectory().
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
kvq_build_and_test(add_subdirectory "${PACKAGING_DIR}/add_subdirectory" "-DKVQ_SOURCE_DIR=${KVQ_SOURCE_DIR}")
