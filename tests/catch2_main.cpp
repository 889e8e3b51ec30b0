// Catch2 v2's main() for cross builds: Debian's catch2 package ships the arch-independent single
// header and a libCatch2WithMain.a built for the host only, so a cross build compiles this instead.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
