// moe-route: .npy input (a strict reader of its own) and output (xtensor's
// xnpy, libxtensor-dev), plus the staged (temporary name, then rename) output
// files.
#include "common.hpp"

#include <xtensor/xadapt.hpp>
#include <xtensor/xnpy.hpp>

#include <cstdio>
#include <cstring>
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

// The bytes of one element of a numeric descr ("<f4", "<i8", ...); 0 for any
// other kind (strings, records, ...), which no reader accepts.
std::size_t item_size(const std::string& descr) {
  const std::string digits = descr.size() > 2 ? descr.substr(2) : "";
  if (descr.size() < 3 || std::string("fiub").find(descr[1]) == std::string::npos || digits.size() > 2 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    return 0;
  return static_cast<std::size_t>(std::stoul(digits));
}

struct npy_header {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::size_t> shape;
  std::uint64_t data_offset = 0;
};

// The header dictionary, read strictly: exactly the keys 'descr',
// 'fortran_order' and 'shape', once each, in any order, and nothing after the
// closing brace but the padding. A looser reader can take its shape from one
// place and its checks from another (the fuzz target found such a header).
class header_parser {
 public:
  header_parser(const std::string& text, const std::string& file) : s_(text), file_(file) {}

  npy_header parse() {
    npy_header h;
    bool descr = false, fortran = false, shape = false;
    expect('{');
    while (!peek('}')) {
      const std::string key = quoted();
      expect(':');
      if (key == "descr" && !descr) {
        h.descr = quoted();
        descr = true;
      } else if (key == "fortran_order" && !fortran) {
        h.fortran_order = boolean();
        fortran = true;
      } else if (key == "shape" && !shape) {
        h.shape = tuple();
        shape = true;
      } else {
        fail("header has an unexpected or repeated key '" + key + "'");
      }
      if (!peek('}')) expect(',');
    }
    expect('}');
    skip_spaces();
    if (pos_ != s_.size()) fail("header has text after its dictionary");
    if (!descr || !fortran || !shape) fail("header lacks one of 'descr', 'fortran_order' and 'shape'");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw data_error(file_ + ": .npy " + why); }
  void skip_spaces() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n')) ++pos_;
  }
  bool peek(char c) {
    skip_spaces();
    return pos_ < s_.size() && s_[pos_] == c;
  }
  void expect(char c) {
    if (!peek(c)) fail(std::string("header is malformed (expected '") + c + "' at byte " + std::to_string(pos_) + ")");
    ++pos_;
  }
  std::string quoted() {
    expect('\'');
    const std::size_t end = s_.find('\'', pos_);
    if (end == std::string::npos) fail("header has an unterminated string");
    std::string v = s_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return v;
  }
  bool boolean() {
    skip_spaces();
    for (const auto& [word, value] : {std::pair<const char*, bool>{"True", true}, {"False", false}})
      if (s_.compare(pos_, std::strlen(word), word) == 0) {
        pos_ += std::strlen(word);
        return value;
      }
    fail("header has a fortran_order that is neither True nor False");
  }
  std::vector<std::size_t> tuple() {
    std::vector<std::size_t> shape;
    expect('(');
    while (!peek(')')) {
      const std::size_t end = s_.find_first_not_of("0123456789", pos_);
      const std::string entry = s_.substr(pos_, end == std::string::npos ? std::string::npos : end - pos_);
      if (entry.empty() || entry.size() > 19) {
        const std::size_t token_end = s_.find_first_of(",)", pos_);
        fail("shape entry '" + s_.substr(pos_, token_end == std::string::npos ? 16 : token_end - pos_) +
             "' is not a dimension (a non-negative integer)");
      }
      shape.push_back(static_cast<std::size_t>(std::stoull(entry)));
      pos_ += entry.size();
      if (!peek(')')) expect(',');
    }
    expect(')');
    return shape;
  }

  const std::string& s_;
  const std::string& file_;
  std::size_t pos_ = 0;
};

// The header of a .npy file, checked against the file: its byte count is
// representable and the file holds exactly that many bytes after the header.
// Nothing is allocated for the data before these checks, so a hostile header
// (10^12 rows, a negative or overflowing shape, a truncated file) is a
// data_error naming the flag and the file, not a bad_alloc or silently read
// garbage.
npy_header checked_header(const std::string& path, const std::string& file, std::ifstream& f) {
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
  std::string text(header_len, '\0');
  if (!f.read(text.data(), header_len)) throw data_error(file + ": truncated .npy header");
  npy_header h = header_parser(text, file).parse();
  h.data_offset = data_offset;
  if (h.descr.size() == 3 && h.descr[0] == '|' && h.descr[2] == '1') h.descr[0] = '<';  // single-byte types
  const std::size_t item = item_size(h.descr);
  if (item == 0) return h;  // a dtype no reader accepts: the caller names it
  // The extent of every dimension but the empty ones must be addressable too
  // (signed 64-bit strides), even when a 0 makes the array empty.
  std::uint64_t bytes = item, span = item;
  constexpr std::uint64_t addressable = std::numeric_limits<std::int64_t>::max();
  for (const std::size_t d : h.shape) {
    if (d != 0 && span > addressable / d)
      throw data_error(file + ": .npy shape " + shape_string(h.shape) + " has more bytes than can be addressed");
    span *= d != 0 ? d : 1;
    bytes *= d;
  }
  std::error_code ec;
  const std::uint64_t size = fs::file_size(path, ec);
  if (ec) throw data_error(file + ": cannot read its size");
  if (size - data_offset != bytes)  // size >= data_offset: the header was read
    throw data_error(file + ": .npy shape " + shape_string(h.shape) + " of " + h.descr + " needs " +
                     std::to_string(bytes) + " bytes of data, the file holds " + std::to_string(size - data_offset) +
                     (size - data_offset < bytes ? " (truncated)" : " (trailing bytes)"));
  return h;
}

// The data of a checked header, in C (row-major) order whatever the file's.
// The descr's byte order is little-endian ('<'), the machine's.
template <class T>
array<T> read_data(std::ifstream& f, const npy_header& h, const std::string& file) {
  array<T> out;
  out.shape = h.shape;
  std::size_t n = 1;
  for (const std::size_t d : h.shape) n *= d;
  std::vector<T> raw(n);
  if (n > 0 && !f.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(n * sizeof(T))))
    throw data_error(file + ": cannot read its data");
  if (!h.fortran_order || h.shape.size() < 2) {
    out.data = std::move(raw);
    return out;
  }
  // Fortran order: the first index varies fastest. Walk the C order with an
  // odometer and fetch each element from its Fortran offset.
  out.data.resize(n);
  const std::size_t rank = h.shape.size();
  std::vector<std::size_t> stride(rank, 1), index(rank, 0);
  for (std::size_t d = 1; d < rank; ++d) stride[d] = stride[d - 1] * h.shape[d - 1];
  std::size_t offset = 0;
  for (std::size_t i = 0; i < n; ++i) {
    out.data[i] = raw[offset];
    for (std::size_t d = rank; d-- > 0;) {
      offset += stride[d];
      if (++index[d] < h.shape[d]) break;
      offset -= stride[d] * h.shape[d];
      index[d] = 0;
    }
  }
  return out;
}

}  // namespace

array<float> load_f32(const std::string& path, const std::string& what) {
  check_readable(path, what);
  const std::string file = what + ": " + path;  // how the errors name it
  std::ifstream f(path, std::ios::binary);
  const npy_header h = checked_header(path, file, f);
  if (h.descr != "<f4") throw data_error(file + " has dtype " + h.descr + "; expected float32 ('<f4')");
  return read_data<float>(f, h, file);
}

array<std::int32_t> load_i32(const std::string& path, const std::string& what) {
  check_readable(path, what);
  const std::string file = what + ": " + path;
  std::ifstream f(path, std::ios::binary);
  const npy_header h = checked_header(path, file, f);
  if (h.descr == "<i4") return read_data<std::int32_t>(f, h, file);
  if (h.descr == "<i8") {
    const array<std::int64_t> wide = read_data<std::int64_t>(f, h, file);
    array<std::int32_t> out;
    out.shape = wide.shape;
    out.data.resize(wide.data.size());
    for (std::size_t i = 0; i < wide.data.size(); ++i) {
      const std::int64_t v = wide.data[i];
      if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
        throw data_error(file + " entry " + std::to_string(i) + " (= " + std::to_string(v) + ") does not fit int32");
      out.data[i] = static_cast<std::int32_t>(v);
    }
    return out;
  }
  throw data_error(file + " has dtype " + h.descr + "; expected int32 ('<i4') or int64 ('<i8')");
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
