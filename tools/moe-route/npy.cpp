// moe-route: .npy input and output through xtensor's xnpy (libxtensor-dev),
// plus the staged (temporary name, then rename) output files.
#include "common.hpp"

#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xnpy.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <system_error>
#include <unistd.h>

namespace moe_route_cli {

namespace fs = std::filesystem;

namespace {

void check_readable(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw data_error(what + ": file not found: " + path);
  if (fs::is_directory(path, ec)) throw data_error(what + ": " + path + " is a directory, not a .npy file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw data_error(what + ": cannot open " + path);
}

template <class T>
array<T> load_as(const std::string& path, const std::string& what) {
  xt::xarray<T> a;
  try {
    a = xt::load_npy<T>(path);
  } catch (const std::exception& e) {
    throw data_error(what + ": cannot read " + path + " as .npy: " + e.what());
  }
  array<T> out;
  out.shape.assign(a.shape().begin(), a.shape().end());
  out.data.assign(a.begin(), a.end());  // row-major iteration, whatever the file's order
  return out;
}

}  // namespace

namespace {

// The bytes of one element of a numeric descr ("<f4", "<i8", ...); 0 for any
// other kind (strings, records, ...), which no reader accepts.
std::size_t item_size(const std::string& descr) {
  const std::string digits = descr.size() > 2 ? descr.substr(2) : "";
  if (descr.size() < 3 || std::string("fiub").find(descr[1]) == std::string::npos || digits.size() > 2 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    return 0;
  return static_cast<std::size_t>(std::stoul(digits));
}

std::vector<std::size_t> shape_of(const std::string& file, const std::string& header) {
  const auto key = header.find("'shape'");
  const auto open = key == std::string::npos ? key : header.find('(', key);
  const auto close = open == std::string::npos ? open : header.find(')', open);
  if (close == std::string::npos) throw data_error(file + ": .npy header has no shape tuple");
  std::vector<std::size_t> shape;
  std::string entry;
  const std::string tuple = header.substr(open + 1, close - open - 1) + ",";
  for (const char c : tuple) {
    if (c != ',') {
      if (c != ' ') entry += c;
      continue;
    }
    if (entry.empty()) continue;  // the comma of a 1-tuple, or spaces
    if (entry.find_first_not_of("0123456789") != std::string::npos || entry.size() > 19)
      throw data_error(file + ": .npy shape entry '" + entry + "' is not a dimension (a non-negative integer)");
    shape.push_back(static_cast<std::size_t>(std::stoull(entry)));
    entry.clear();
  }
  return shape;
}

// The descr of a .npy file's header (e.g. "<f4"), after checking the header
// against the file: its shape is non-negative, its byte count representable,
// and the file holds exactly that many bytes after the header. Nothing is
// allocated for the data before these checks, so a hostile header (10^12 rows,
// a negative or overflowing shape, a truncated file) is a data_error naming the
// flag and the file, not a bad_alloc or silently read garbage.
std::string checked_descr(const std::string& path, const std::string& what) {
  const std::string file = what + ": " + path;  // how the errors name it
  std::ifstream f(path, std::ios::binary);
  char magic[8] = {};
  if (!f.read(magic, 8) || std::string(magic, 6) != "\x93NUMPY") throw data_error(file + " is not a .npy file");
  std::uint32_t header_len = 0;
  std::uint64_t data_offset = 0;
  if (magic[6] == 1) {
    unsigned char b[2];
    if (!f.read(reinterpret_cast<char*>(b), 2)) throw data_error(file + ": truncated .npy header");
    header_len = b[0] | (b[1] << 8);
    data_offset = 10 + std::uint64_t{header_len};
  } else if (magic[6] == 2 || magic[6] == 3) {
    unsigned char b[4];
    if (!f.read(reinterpret_cast<char*>(b), 4)) throw data_error(file + ": truncated .npy header");
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
    data_offset = 12 + std::uint64_t{header_len};
  } else {
    throw data_error(file + ": unknown .npy format version " + std::to_string(static_cast<int>(magic[6])));
  }
  if (header_len > (1u << 20)) throw data_error(file + ": implausible .npy header");
  std::string header(header_len, '\0');
  if (!f.read(header.data(), header_len)) throw data_error(file + ": truncated .npy header");
  const auto key = header.find("'descr'");
  if (key == std::string::npos) throw data_error(file + ": .npy header has no descr");
  const auto q1 = header.find('\'', header.find(':', key) + 1);
  const auto q2 = header.find('\'', q1 + 1);
  if (q1 == std::string::npos || q2 == std::string::npos) throw data_error(file + ": malformed .npy descr");
  std::string descr = header.substr(q1 + 1, q2 - q1 - 1);
  if (descr.size() > 1 && descr[0] == '|') descr[0] = '<';  // single-byte types
  const std::vector<std::size_t> shape = shape_of(file, header);
  const std::size_t item = item_size(descr);
  if (item == 0) return descr;  // a dtype no reader accepts: the caller names it
  std::uint64_t bytes = item;
  for (const std::size_t d : shape) {
    if (d != 0 && bytes > std::numeric_limits<std::uint64_t>::max() / d)
      throw data_error(file + ": .npy shape " + shape_string(shape) + " has more bytes than can be addressed");
    bytes *= d;
  }
  std::error_code ec;
  const std::uint64_t size = fs::file_size(path, ec);
  if (ec) throw data_error(file + ": cannot read its size");
  if (size - data_offset != bytes)  // size >= data_offset: the header was read
    throw data_error(file + ": .npy shape " + shape_string(shape) + " of " + descr + " needs " +
                     std::to_string(bytes) + " bytes of data, the file holds " + std::to_string(size - data_offset) +
                     (size - data_offset < bytes ? " (truncated)" : " (trailing bytes)"));
  return descr;
}

}  // namespace

array<float> load_f32(const std::string& path, const std::string& what) {
  check_readable(path, what);
  const std::string d = checked_descr(path, what);
  if (d != "<f4") throw data_error(what + ": " + path + " has dtype " + d + "; expected float32 ('<f4')");
  return load_as<float>(path, what);
}

array<std::int32_t> load_i32(const std::string& path, const std::string& what) {
  check_readable(path, what);
  const std::string d = checked_descr(path, what);
  if (d == "<i4") return load_as<std::int32_t>(path, what);
  if (d == "<i8") {
    const array<std::int64_t> wide = load_as<std::int64_t>(path, what);
    array<std::int32_t> out;
    out.shape = wide.shape;
    out.data.resize(wide.data.size());
    for (std::size_t i = 0; i < wide.data.size(); ++i) {
      const std::int64_t v = wide.data[i];
      if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
        throw data_error(what + ": " + path + " entry " + std::to_string(i) + " (= " + std::to_string(v) +
                         ") does not fit int32");
      out.data[i] = static_cast<std::int32_t>(v);
    }
    return out;
  }
  throw data_error(what + ": " + path + " has dtype " + d + "; expected int32 ('<i4') or int64 ('<i8')");
}

std::string shape_string(const std::vector<std::size_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

void ensure_directory(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) throw data_error("cannot create output directory " + dir);
}

staged_outputs::~staged_outputs() {
  if (committed_) return;
  for (const auto& f : files_) {
    std::error_code ec;
    fs::remove(f.first, ec);
  }
}

std::string staged_outputs::stage(const std::string& final_path) {
  const fs::path p(final_path);
  const std::string tmp = (p.parent_path() / ("." + p.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
  files_.emplace_back(tmp, final_path);
  return tmp;
}

namespace {
template <class T>
void dump(const std::string& tmp, const T* data, const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (auto s : shape) n *= s;
  try {
    xt::dump_npy(tmp, xt::adapt(data, n, xt::no_ownership(), shape));
  } catch (const std::exception& e) {
    throw data_error("cannot write " + tmp + ": " + e.what());
  }
}
}  // namespace

void staged_outputs::save_f32(const std::string& p, const float* d, const std::vector<std::size_t>& s) { dump(stage(p), d, s); }
void staged_outputs::save_i32(const std::string& p, const std::int32_t* d, const std::vector<std::size_t>& s) {
  dump(stage(p), d, s);
}
void staged_outputs::save_i64(const std::string& p, const std::int64_t* d, const std::vector<std::size_t>& s) {
  dump(stage(p), d, s);
}

void staged_outputs::save_text(const std::string& p, const std::string& text) {
  const std::string tmp = stage(p);
  std::ofstream f(tmp, std::ios::binary);
  f << text;
  if (!f.flush()) throw data_error("cannot write " + tmp);
}

void staged_outputs::commit() {
  for (const auto& f : files_) {
    std::error_code ec;
    fs::rename(f.first, f.second, ec);
    if (ec) throw data_error("cannot rename " + f.first + " to " + f.second + ": " + ec.message());
  }
  committed_ = true;
}

}  // namespace moe_route_cli
