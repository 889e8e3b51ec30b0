// Compile-fail case: kvq's results must not depend on the consumer's floating-point flags, so its headers refuse
// -ffast-math. Compiled with -ffast-math this file must fail with a message naming __FAST_MATH__; without it, it
// compiles.
#include <kvq/kvq.hpp>

int main() { return 0; }
