# kvq_check_version_header(<file>): fails the configure step unless the KVQ_VERSION_MAJOR/MINOR/PATCH
# macros of <file> equal the version given to project().
function(kvq_check_version_header file)
  file(STRINGS "${file}" lines REGEX "^#[ \t]*define[ \t]+KVQ_VERSION_(MAJOR|MINOR|PATCH)[ \t]")
  foreach(part IN ITEMS MAJOR MINOR PATCH)
    if(NOT lines MATCHES "KVQ_VERSION_${part}[ \t]+([0-9]+)")
      message(FATAL_ERROR "${file} does not define KVQ_VERSION_${part}")
    endif()
    if(NOT CMAKE_MATCH_1 EQUAL PROJECT_VERSION_${part})
      message(FATAL_ERROR "KVQ_VERSION_${part} is ${CMAKE_MATCH_1} in ${file} but project(VERSION) says "
                          "${PROJECT_VERSION}: update both together")
    endif()
  endforeach()
endfunction()
