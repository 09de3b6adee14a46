// The doctest entry point of the analysis tests (tests/analysis/*_test.cpp).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
