# Helpers shared by the packaging test scripts (cmake -P). The test passes KVQ_SOURCE_DIR, KVQ_VERSION, WORK_DIR,
# GENERATOR, MAKE_PROGRAM, CXX_COMPILER and CTEST_COMMAND.
cmake_minimum_required(VERSION 3.25)

set(PACKAGING_DIR "${CMAKE_CURRENT_LIST_DIR}")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# Configure arguments that give a scratch build this build's generator and compiler.
set(KVQ_TOOLCHAIN_ARGS -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release)
if(MAKE_PROGRAM)
  list(APPEND KVQ_TOOLCHAIN_ARGS "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()

# kvq_run(<step> <command>...): runs a command; fails the test with the command's output if it fails. The output is
# left in KVQ_RUN_OUTPUT.
function(kvq_run step)
  list(JOIN ARGN " " printable)
  message(STATUS "[${step}] ${printable}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${step} failed (exit ${rc}):\n${out}")
  endif()
  set(KVQ_RUN_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

# kvq_expect_failure(<step> <regex> <command>...): the command must fail with output matching <regex>.
function(kvq_expect_failure step regex)
  list(JOIN ARGN " " printable)
  message(STATUS "[${step}] (must fail) ${printable}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${step} succeeded but must fail:\n${out}")
  endif()
  if(NOT out MATCHES "${regex}")
    message(FATAL_ERROR "${step} failed, but without a message matching '${regex}':\n${out}")
  endif()
endfunction()

# kvq_configure_install(<build dir> <prefix> <cmake args>...): configures kvq's source tree with only its install
# rules on, builds the install target and installs into <prefix>.
function(kvq_configure_install build_dir prefix)
  kvq_run("configure kvq" "${CMAKE_COMMAND}" -S "${KVQ_SOURCE_DIR}" -B "${build_dir}" ${KVQ_TOOLCHAIN_ARGS}
          "-DCMAKE_INSTALL_PREFIX=${prefix}" ${ARGN})
  kvq_run("install kvq" "${CMAKE_COMMAND}" --build "${build_dir}" --config Release --target install)
endfunction()

# kvq_build_and_test(<name> <project dir> <cmake args>...): ctest --build-and-test of a consumer project, which must
# build and run its program kvq_consumer.
function(kvq_build_and_test name project_dir)
  set(args "${CTEST_COMMAND}" --build-and-test "${project_dir}" "${WORK_DIR}/consumer-${name}"
      --build-generator "${GENERATOR}" --build-config Release)
  if(MAKE_PROGRAM)
    list(APPEND args --build-makeprogram "${MAKE_PROGRAM}")
  endif()
  list(APPEND args --build-options "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release ${ARGN}
       --test-command kvq_consumer)
  kvq_run("build and run the ${name} consumer" ${args})
  if(NOT KVQ_RUN_OUTPUT MATCHES "q8_0 round trip ok")
    message(FATAL_ERROR "The ${name} consumer did not report success:\n${KVQ_RUN_OUTPUT}")
  endif()
endfunction()

# kvq_check_installed_headers(<prefix>): <prefix>/include holds exactly the files of kvq's include/ directory, so no
# header was left out of cmake/kvq_headers.cmake.
function(kvq_check_installed_headers prefix)
  file(GLOB_RECURSE expected LIST_DIRECTORIES false RELATIVE "${KVQ_SOURCE_DIR}" "${KVQ_SOURCE_DIR}/include/*")
  file(GLOB_RECURSE installed LIST_DIRECTORIES false RELATIVE "${prefix}" "${prefix}/include/*")
  list(SORT expected)
  list(SORT installed)
  if(NOT installed STREQUAL expected)
    set(missing ${expected})
    if(installed)
      list(REMOVE_ITEM missing ${installed})
    endif()
    set(extra ${installed})
    if(expected)
      list(REMOVE_ITEM extra ${expected})
    endif()
    message(FATAL_ERROR "The installed headers differ from include/ (is cmake/kvq_headers.cmake complete?)\n"
                        "Not installed: ${missing}\nUnexpected: ${extra}")
  endif()
endfunction()

# kvq_check_prefix_entries(<prefix> <allowed top-level entries>...): nothing else (lib/, bin/, debug/) was installed.
function(kvq_check_prefix_entries prefix)
  file(GLOB entries RELATIVE "${prefix}" "${prefix}/*")
  foreach(entry IN LISTS entries)
    if(NOT entry IN_LIST ARGN)
      message(FATAL_ERROR "Unexpected '${entry}' in the install prefix (a header-only install has only ${ARGN})")
    endif()
  endforeach()
endfunction()

# kvq_check_files_exist(<dir> <relative path>...)
function(kvq_check_files_exist dir)
  foreach(file IN LISTS ARGN)
    if(NOT EXISTS "${dir}/${file}")
      message(FATAL_ERROR "Missing after install: ${dir}/${file}")
    endif()
  endforeach()
endfunction()

# kvq_check_no_path(<dir> <path>): no installed text file mentions <path>, so the install is relocatable.
function(kvq_check_no_path dir path)
  file(GLOB_RECURSE files LIST_DIRECTORIES false "${dir}/*")
  foreach(file IN LISTS files)
    file(READ "${file}" text)
    string(FIND "${text}" "${path}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${file} contains the absolute path ${path}: the install is not relocatable")
    endif()
  endforeach()
endfunction()
