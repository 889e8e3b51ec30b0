// Compile-fail case: KIVI supports 2, 4 and 8 bits; another width stops compilation with a message naming Bits.
#include <kvq/kvq.hpp>

#if defined(KVQ_COMPILE_FAIL)
constexpr int bits = 3;
#else
constexpr int bits = 4;
#endif

int main() { return kvq::kivi_value<bits>::geometry(128).blocks == 4 ? 0 : 1; }
