// Fuzz target: the moe-route CLI's .npy reader and writer
// (tools/moe-route/npy.cpp) on arbitrary files. Every input must either be
// refused with a data_error naming the flag, or read to exactly the array its
// bytes hold: the C-order data after the header, decoded here independently.
// What is read is written back (staged, then committed) and read again to the
// same shape and bits. A header that declares more data than the file holds
// must be refused before allocating: libFuzzer's -malloc_limit_mb turns such an
// allocation into a finding even though load_as would catch its bad_alloc.
#include "common.hpp"  // tools/moe-route
#include "fuzz_input.hpp"

#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;
namespace cli = moe_route_cli;

const fs::path& work_directory() { return fuzz::private_directory("npy"); }

// Where the data of a .npy starts (from its version byte and header length);
// -1 when the file is too short to say.
std::int64_t data_offset(const std::string& bytes) {
  if (bytes.size() < 10) return -1;
  const auto b = [&](std::size_t i) { return static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])); };
  if (bytes[6] == 1) return 10 + static_cast<std::int64_t>(b(8) | b(9) << 8);
  if (bytes.size() < 12) return -1;
  return 12 + static_cast<std::int64_t>(b(8) | b(9) << 8 | b(10) << 16 | b(11) << 24);
}

template <class T>
void check_array(const cli::array<T>& a, const std::string& bytes, bool widened) {
  std::size_t n = 1;
  for (const std::size_t d : a.shape) n *= d;
  FUZZ_CHECK(a.data.size() == n, std::to_string(a.data.size()) + " values for shape " + cli::shape_string(a.shape));
  const std::int64_t offset = data_offset(bytes);
  const std::string header = bytes.substr(0, static_cast<std::size_t>(std::max<std::int64_t>(offset, 0)));
  const bool c_order = header.find("'fortran_order': False") != std::string::npos;
  if (c_order && !widened && header.find("'shape'") == header.rfind("'shape'")) {
    FUZZ_CHECK(bytes.size() == static_cast<std::size_t>(offset) + n * sizeof(T),
               "shape " + cli::shape_string(a.shape) + " does not fill the file's " + std::to_string(bytes.size()) +
                   " bytes");
    FUZZ_CHECK(n == 0 || std::memcmp(a.data.data(), bytes.data() + offset, n * sizeof(T)) == 0,
               "the values read are not the file's bytes");
  }
}

template <class T, class Save>
void round_trip(const cli::array<T>& a, cli::array<T> (*load)(const std::string&, const std::string&), Save save) {
  const std::string out = (work_directory() / "written.npy").string();
  {
    cli::staged_outputs staged;
    (staged.*save)(out, a.data.data(), a.shape);
    staged.commit();
  }
  const cli::array<T> back = load(out, "--round-trip");
  FUZZ_CHECK(back.shape == a.shape, "shape " + cli::shape_string(back.shape) + " after writing " +
                                        cli::shape_string(a.shape));
  FUZZ_CHECK(back.data.size() == a.data.size() &&
                 (a.data.empty() || std::memcmp(back.data.data(), a.data.data(), a.data.size() * sizeof(T)) == 0),
             "different values after a round trip");
}

template <class T, class Save>
void read(const std::string& path, const std::string& bytes,
          cli::array<T> (*load)(const std::string&, const std::string&), Save save) {
  cli::array<T> a;
  try {
    a = load(path, "--logits");
  } catch (const cli::data_error& e) {
    FUZZ_CHECK(std::string(e.what()).rfind("--logits: ", 0) == 0, std::string("unnamed error: ") + e.what());
    return;
  }
  // int64 files are read into int32 (range-checked): compare them as values only
  const bool widened = bytes.find("<i8") != std::string::npos;
  check_array(a, bytes, widened);
  round_trip(a, load, save);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const std::string path = (work_directory() / "input.npy").string();
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  read<float>(path, bytes, &cli::load_f32, &cli::staged_outputs::save_f32);
  read<std::int32_t>(path, bytes, &cli::load_i32, &cli::staged_outputs::save_i32);
  return 0;
}
