// The fuzz targets' view of their input: the bytes libFuzzer mutates, read as
// choices (small integers in a range) and values. Reading past the end yields
// zeros, so every input, even the empty one, decodes to a case, and a mutation
// changes the case near where it lands.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <unistd.h>
#include <vector>

namespace fuzz {

class input {
 public:
  input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(byte()) << (8 * i);
    return v;
  }
  // An integer in [lo, hi] (hi - lo < 2^16).
  int in(int lo, int hi) {
    const unsigned span = static_cast<unsigned>(hi - lo) + 1;
    const unsigned v = span <= 256 ? byte() : byte() | (static_cast<unsigned>(byte()) << 8);
    return lo + static_cast<int>(v % span);
  }
  bool flag() { return byte() & 1; }

  // A float that is often a hard case: signed zeros, NaN, infinities, the
  // extremes of the finite and subnormal range, a value equal to an earlier
  // one (ties), small integers (ties after rounding), or any bit pattern.
  float hard_float() {
    const std::uint8_t kind = byte();
    float v = 0.0f;
    switch (kind % 16) {
      case 0: v = 0.0f; break;
      case 1: v = -0.0f; break;
      case 2: v = std::numeric_limits<float>::quiet_NaN(); break;
      case 3: v = std::numeric_limits<float>::infinity(); break;
      case 4: v = -std::numeric_limits<float>::infinity(); break;
      case 5: v = std::numeric_limits<float>::max(); break;
      case 6: v = -std::numeric_limits<float>::max(); break;
      case 7: v = std::numeric_limits<float>::denorm_min(); break;
      case 8: v = std::numeric_limits<float>::min(); break;
      case 9: v = last_; break;  // a tie with the previous value
      case 10: case 11: v = static_cast<float>(static_cast<int>(byte() % 9) - 4); break;
      case 12: v = 88.7f * (byte() & 1 ? 1.0f : -1.0f); break;  // where exp leaves float's range
      default: {
        const std::uint32_t b = u32();
        std::memcpy(&v, &b, sizeof v);
      }
    }
    last_ = v;
    return v;
  }
  // A finite float of moderate size (|x| < 2^16): for values the contract
  // requires finite, or whose products must stay in float's range.
  float moderate_float() {
    const float v = hard_float();
    if (!std::isfinite(v) || std::fabs(v) >= 65536.0f) return static_cast<float>(static_cast<int>(byte()) - 128) / 16.0f;
    return v;
  }

  std::size_t remaining() const { return pos_ < size_ ? size_ - pos_ : 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  float last_ = 1.0f;
};

// Whether two arrays hold the same bits (NaN payloads and signed zeros included).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// A command line from text, one argument per line (empty lines are empty
// arguments), after the program's name.
inline std::vector<std::string> argument_lines(const std::string& text, const char* program) {
  std::vector<std::string> args{program};
  std::string arg;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == '\n') {
      args.push_back(arg);
      arg.clear();
    } else {
      arg += text[i];
    }
  }
  return args;
}

// A finding: print what and where, then abort so libFuzzer keeps the input.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz finding: %s\n", what.c_str());
  std::abort();
}

// A private directory for the files of one process (under the temporary
// directory, named after `what`), made on the first call and removed at exit;
// the process is moved out of it first, in case it works inside.
inline const std::filesystem::path& private_directory(const char* what) {
  namespace fs = std::filesystem;
  static const fs::path dir = [what] {
    std::string tmpl = (fs::temp_directory_path() / (std::string("moe_route_fuzz_") + what + ".XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) finding("cannot create a temporary directory");
    return fs::path(tmpl);
  }();
  // Registered once `dir` is constructed, so it runs before `dir` is destroyed.
  static const int removal = std::atexit([] {
    std::error_code ec;
    fs::current_path(fs::temp_directory_path(ec), ec);
    fs::remove_all(dir, ec);
  });
  (void)removal;
  return dir;
}

#define FUZZ_CHECK(cond, what)                                   \
  do {                                                           \
    if (!(cond)) ::fuzz::finding(std::string(#cond ": ") + what); \
  } while (0)

}  // namespace fuzz
