// The checks the example drivers' command lines share (CLI11 validators):
// finite ranges (CLI11's own Range and PositiveNumber let NaN through) and
// output file names.
#pragma once

#include <cmath>
#include <string>

#include <CLI/CLI.hpp>

namespace moe_route_examples {

// A finite value of T for which `ok` holds; `what` says which, in the help and
// in the error ("--lr: value nan must be finite and > 0").
template <class T, class Ok>
CLI::Validator finite(std::string what, Ok ok) {
  return CLI::Validator(
      [what, ok](std::string& text) -> std::string {
        T v{};
        if (!CLI::detail::lexical_cast(text, v)) return "\"" + text + "\" is not a number";
        if (!std::isfinite(v) || !ok(v)) return "value " + text + " must be finite and " + what;
        return {};
      },
      "finite, " + what);
}

template <class T>
CLI::Validator positive() {
  return finite<T>("> 0", [](T v) { return v > T(0); });
}

template <class T>
CLI::Validator non_negative() {
  return finite<T>(">= 0", [](T v) { return v >= T(0); });
}

// A cosine: finite, in [-1, 1].
template <class T>
CLI::Validator cosine() {
  return finite<T>("in [-1, 1]", [](T v) { return v >= T(-1) && v <= T(1); });
}

// A file to write: any name but the empty one.
inline CLI::Validator file_name() {
  return CLI::Validator([](std::string& text) { return text.empty() ? std::string("needs a file name") : std::string(); },
                        "FILE");
}

}  // namespace moe_route_examples
