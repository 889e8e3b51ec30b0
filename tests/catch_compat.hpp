// The only test file that knows which Catch2 major version is in use.
#pragma once
#if __has_include(<catch2/catch_test_macros.hpp>)
#  include <catch2/catch_template_test_macros.hpp>
#  include <catch2/catch_test_macros.hpp>
#  include <catch2/generators/catch_generators.hpp>
#  include <catch2/matchers/catch_matchers_floating_point.hpp>
#  define KVQ_CATCH3 1
#else
#  include <catch2/catch.hpp>
#endif
