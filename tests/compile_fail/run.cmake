# cmake -DCONFIG=<file> -P run.cmake: one compile-fail test (see kvq_add_compile_fail_test). CONFIG sets COMPILER,
# SOURCE, OBJECT, REGEX, CONTROL, ARGS and FLAGS.
include("${CONFIG}")

if(CONTROL)
  execute_process(COMMAND "${COMPILER}" ${ARGS} -c "${SOURCE}" -o "${OBJECT}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "Control compilation (without ${FLAGS}) of ${SOURCE} failed, so the test proves "
                        "nothing:\n${out}")
  endif()
endif()

execute_process(COMMAND "${COMPILER}" ${ARGS} ${FLAGS} -c "${SOURCE}" -o "${OBJECT}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
file(REMOVE "${OBJECT}")
if(rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled with ${FLAGS}, but it must be rejected (expected a message matching "
                      "'${REGEX}')")
endif()
if(NOT out MATCHES "${REGEX}")
  message(FATAL_ERROR "${SOURCE} failed to compile, but not with a message matching '${REGEX}':\n${out}")
endif()
message(STATUS "Rejected as expected (matched '${REGEX}')")
