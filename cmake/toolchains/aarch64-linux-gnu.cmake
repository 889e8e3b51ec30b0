# Cross build for AArch64 Linux with Debian's g++-aarch64-linux-gnu; tests run under qemu-user.
#
#   cmake -S . -B build-aarch64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
#         -DCMAKE_BUILD_TYPE=Release -DKVQ_SIMD=scalar -DKVQ_BUILD_BENCHMARKS=OFF
#   cmake --build build-aarch64 && ctest --test-dir build-aarch64 -LE slow
#
# KVQ_SIMD=scalar adds no -m flags; NEON is part of the AArch64 baseline, so kvq::cpu::neon is
# compiled and tested anyway. Catch2: tests/CMakeLists.txt builds Catch2 v2's main from the
# (arch-independent) single header, since Debian's libCatch2WithMain.a is built for the host.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(KVQ_CROSS_TRIPLE aarch64-linux-gnu CACHE STRING "Target triple prefix of the cross tools")
set(KVQ_CROSS_SYSROOT /usr/${KVQ_CROSS_TRIPLE} CACHE PATH "Target libraries (Debian's cross sysroot)")
set(CMAKE_C_COMPILER ${KVQ_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${KVQ_CROSS_TRIPLE}-g++)

# Target libraries from the sysroot only; programs from the host; headers and CMake packages from
# both (header-only test dependencies such as nlohmann_json are arch-independent).
set(CMAKE_FIND_ROOT_PATH ${KVQ_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# ctest and catch_discover_tests run the test programs through user-mode emulation.
find_program(KVQ_QEMU_AARCH64 qemu-aarch64)
if(KVQ_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${KVQ_QEMU_AARCH64} -L ${KVQ_CROSS_SYSROOT})
endif()
