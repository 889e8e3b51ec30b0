# packaging.fetchcontent: a consumer that pulls kvq in with FetchContent (SOURCE_DIR: this checkout, no network).
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
kvq_build_and_test(fetchcontent "${PACKAGING_DIR}/fetchcontent" "-DKVQ_SOURCE_DIR=${KVQ_SOURCE_DIR}")
