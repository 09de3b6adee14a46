// Writes the .npy fixtures of the moe-route CLI tests into a directory, with a
// minimal .npy writer of its own (independent of the CLI's xtensor I/O).
//
//   moe_route_cli_fixtures DIR
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

// A version-1 .npy file: its header declares `dims` (the text inside the shape
// tuple, whatever it says), followed by `bytes` bytes of `data`.
// `order` is the header's fortran_order; `extra` is written after the shape,
// inside the dictionary (for headers that must be refused).
void write_raw_npy(const std::string& path, const char* descr, const std::string& dims, const void* data,
                   std::size_t bytes, const char* order = "False", const std::string& extra = "") {
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': " + order + ", 'shape': (" + dims +
                       "), " + extra + "}";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const std::uint16_t len = static_cast<std::uint16_t>(header.size());
  const char l[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  f.write(l, 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

template <class T>
void write_npy(const std::string& path, const char* descr, const std::vector<T>& data, const std::vector<std::size_t>& shape) {
  std::string dims;
  for (std::size_t i = 0; i < shape.size(); ++i) dims += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
  write_raw_npy(path, descr, dims, data.data(), data.size() * sizeof(T));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: moe_route_cli_fixtures DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::filesystem::create_directories(dir);
  const std::size_t n = 256, e = 16;
  std::mt19937 gen(2026);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  // Tokens of cluster t % 4 prefer the 4 experts of block t % 4.
  std::vector<float> base(n * e), post(n * e);
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t x = 0; x < e; ++x) {
      const float pref = (x / 4 == t % 4) ? 2.5f : 0.0f;
      base[t * e + x] = pref + 0.7f * noise(gen);
      post[t * e + x] = pref + 0.3f * (x % 3 == 0) + 0.9f * noise(gen);
    }
  write_npy(dir + "/logits_base.npy", "<f4", base, {n, e});
  write_npy(dir + "/logits_post.npy", "<f4", post, {n, e});
  std::vector<float> prior(4 * e), bias(e, 0.0f), hn(n), wn(e);
  for (std::size_t r = 0; r < 4; ++r)
    for (std::size_t x = 0; x < e; ++x) prior[r * e + x] = (x / 4 == r) ? 0.2f : 0.05f / 3.0f * 0.6f;
  for (std::size_t x = 0; x < e; ++x) bias[x] = 0.01f * static_cast<float>(x % 5), wn[x] = 1.0f + 0.05f * x;
  for (std::size_t t = 0; t < n; ++t) hn[t] = 1.0f + 0.01f * static_cast<float>(t % 7);
  std::vector<std::int32_t> rows(n), communities(e), domains(n);
  for (std::size_t t = 0; t < n; ++t) rows[t] = t % 10 == 9 ? -1 : static_cast<std::int32_t>(t % 4), domains[t] = t % 2;
  for (std::size_t x = 0; x < e; ++x) communities[x] = static_cast<std::int32_t>(x / 4);
  write_npy(dir + "/prior.npy", "<f4", prior, {4, e});
  write_npy(dir + "/prior_rows.npy", "<i4", rows, {n});
  write_npy(dir + "/expert_bias.npy", "<f4", bias, {e});
  write_npy(dir + "/hidden_norms.npy", "<f4", hn, {n});
  write_npy(dir + "/weight_norms.npy", "<f4", wn, {e});
  write_npy(dir + "/communities.npy", "<i4", communities, {e});
  write_npy(dir + "/domains.npy", "<i4", domains, {n});
  // The integer edges: no tokens, and one token (the first of logits_base).
  write_npy(dir + "/logits_empty.npy", "<f4", std::vector<float>{}, {0, e});
  write_npy(dir + "/logits_one.npy", "<f4", std::vector<float>(base.begin(), base.begin() + e), {1, e});
  write_npy(dir + "/hidden_norms_empty.npy", "<f4", std::vector<float>{}, {0});
  write_npy(dir + "/hidden_norms_one.npy", "<f4", std::vector<float>(hn.begin(), hn.begin() + 1), {1});
  write_npy(dir + "/prior_rows_empty.npy", "<i4", std::vector<std::int32_t>{}, {0});
  write_npy(dir + "/prior_rows_one.npy", "<i4", std::vector<std::int32_t>{2}, {1});
  write_npy(dir + "/trace_empty.npy", "<i4", std::vector<std::int32_t>{}, {0, 2});
  // Two-layer traces [2, N, 2] with block structure, as int64 (the CLI accepts int32 and int64).
  std::vector<std::int64_t> t3b(2 * n * 2), t3p(2 * n * 2);
  for (std::size_t l = 0; l < 2; ++l)
    for (std::size_t t = 0; t < n; ++t) {
      const std::int64_t blk = static_cast<std::int64_t>((t + l) % 4) * 4;
      const std::int64_t a = static_cast<std::int64_t>(gen() % 4), b = (a + 1 + static_cast<std::int64_t>(gen() % 3)) % 4;
      t3b[(l * n + t) * 2] = blk + a;
      t3b[(l * n + t) * 2 + 1] = blk + b;
      t3p[(l * n + t) * 2] = blk + a;
      t3p[(l * n + t) * 2 + 1] = (t % 5 == 0) ? (blk + 4 + b) % 16 : blk + b;
    }
  write_npy(dir + "/trace3_base.npy", "<i8", t3b, {2, n, 2});
  write_npy(dir + "/trace3_post.npy", "<i8", t3p, {2, n, 2});
  // Error fixtures.
  std::vector<double> wide(base.begin(), base.end());
  write_npy(dir + "/bad_dtype.npy", "<f8", wide, {n, e});
  write_npy(dir + "/bad_shape.npy", "<f4", std::vector<float>(base.begin(), base.begin() + n), {n});
  // Fewer experts (8) than --k 9 asks for.
  write_npy(dir + "/logits_narrow.npy", "<f4", std::vector<float>(base.begin(), base.begin() + 4 * 8), {4, 8});
  write_npy(dir + "/bad_trace_dtype.npy", "<f4", std::vector<float>(n * 2, 1.0f), {n, 2});
  write_npy(dir + "/short_trace.npy", "<i4", std::vector<std::int32_t>(100 * 2, 1), {100, 2});
  std::ofstream(dir + "/not_npy.npy") << "this is not a .npy file\n";
  // Headers that lie about the data (docs/reliability.md): refused before any allocation.
  const std::string ne = std::to_string(n) + ", " + std::to_string(e);
  write_raw_npy(dir + "/truncated.npy", "<f4", ne, base.data(), base.size() * sizeof(float) / 2);
  write_raw_npy(dir + "/header_only.npy", "<f4", ne, nullptr, 0);
  std::vector<float> longer(base);
  longer.push_back(1.0f);
  write_raw_npy(dir + "/trailing_bytes.npy", "<f4", ne, longer.data(), longer.size() * sizeof(float));
  write_raw_npy(dir + "/huge_shape.npy", "<f4", "1000000000000, 16", nullptr, 0);
  write_raw_npy(dir + "/negative_shape.npy", "<f4", "-5, 16", nullptr, 0);
  write_raw_npy(dir + "/overflowing_shape.npy", "<f4", "4294967296, 4294967296, 4294967296", nullptr, 0);
  write_raw_npy(dir + "/truncated_rows.npy", "<i4", std::to_string(n) + ",", rows.data(), rows.size() * 2);
  // The base logits in Fortran order (column-major bytes): read back in C order, they route as logits_base.npy.
  std::vector<float> columns(n * e);
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t x = 0; x < e; ++x) columns[x * n + t] = base[t * e + x];
  write_raw_npy(dir + "/logits_base_fortran.npy", "<f4", ne, columns.data(), columns.size() * sizeof(float), "True");
  // A second 'shape' key (xtensor's reader took its shape from the text after the first one).
  write_raw_npy(dir + "/repeated_key.npy", "<f4", ne, base.data(), base.size() * sizeof(float), "False",
                "'shape': (1, 2), ");
  std::printf("fixtures written to %s\n", dir.c_str());
  return 0;
}
