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

std::string npy_dtype(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[8] = {};
  if (!f.read(magic, 8) || std::string(magic, 6) != "\x93NUMPY") throw data_error(path + " is not a .npy file");
  std::uint32_t header_len = 0;
  if (magic[6] == 1) {
    unsigned char b[2];
    if (!f.read(reinterpret_cast<char*>(b), 2)) throw data_error(path + ": truncated .npy header");
    header_len = b[0] | (b[1] << 8);
  } else {
    unsigned char b[4];
    if (!f.read(reinterpret_cast<char*>(b), 4)) throw data_error(path + ": truncated .npy header");
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
  }
  if (header_len > (1u << 20)) throw data_error(path + ": implausible .npy header");
  std::string header(header_len, '\0');
  if (!f.read(header.data(), header_len)) throw data_error(path + ": truncated .npy header");
  const auto key = header.find("'descr'");
  if (key == std::string::npos) throw data_error(path + ": .npy header has no descr");
  const auto q1 = header.find('\'', header.find(':', key) + 1);
  const auto q2 = header.find('\'', q1 + 1);
  if (q1 == std::string::npos || q2 == std::string::npos) throw data_error(path + ": malformed .npy descr");
  std::string d = header.substr(q1 + 1, q2 - q1 - 1);
  if (d.size() > 1 && d[0] == '|') d[0] = '<';  // single-byte types
  return d;
}

array<float> load_f32(const std::string& path, const std::string& what) {
  check_readable(path, what);
  const std::string d = npy_dtype(path);
  if (d != "<f4") throw data_error(what + ": " + path + " has dtype " + d + "; expected float32 ('<f4')");
  return load_as<float>(path, what);
}

array<std::int32_t> load_i32(const std::string& path, const std::string& what) {
  check_readable(path, what);
  const std::string d = npy_dtype(path);
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
