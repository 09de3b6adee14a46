// The doctest entry point of the CPU test suite (tests/cpu/*.cpp).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
