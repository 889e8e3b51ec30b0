// Compile-fail case for the value-changing floating-point flags other than -ffast-math, and for dialects older than
// C++20: every kvq header includes detail/config.h first, which refuses them, so a small header shows it quickly.
// Compiled with such a flag this file must fail with a message naming it; without it, it compiles.
#include <kvq/error.hpp>

int main() { return 0; }
