// moe-route: gnuplot figures (see plot.hpp).
#include "plot.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <unistd.h>

namespace moe_route_cli {

namespace an = moe_route::analysis;
namespace fs = std::filesystem;

namespace {

int run_gnuplot(const std::string& script) {
  const std::string cmd = "gnuplot " + script + " > " + script + ".log 2>&1";
  const int rc = std::system(cmd.c_str());
  return rc;
}

std::string terminal() {
  static std::string t;
  if (t.empty()) {
    if (std::system("command -v gnuplot > /dev/null 2>&1") != 0)
      throw data_error("--plot: gnuplot is not installed (Debian package gnuplot-nox)");
    t = std::system("gnuplot -e 'set terminal pngcairo' > /dev/null 2>&1") == 0 ? "pngcairo size 900,800 font 'sans,10'"
                                                                               : "png size 900,800";
  }
  return t;
}

}  // namespace

void write_plots(const std::string& dir, const an::retention_result& r, const std::int32_t* base,
                 const std::int32_t* post, staged_outputs& out) {
  ensure_directory(dir);
  const std::string term = terminal();
  const fs::path work = fs::temp_directory_path() / ("moe-route-plot." + std::to_string(::getpid()));
  fs::create_directories(work);
  struct cleanup {
    fs::path p;
    ~cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } guard{work};
  const int e_count = r.shape.experts, k = r.shape.k;
  const std::int64_t n = r.shape.tokens;
  for (std::size_t l = 0; l < r.layers.size(); ++l) {
    const an::layer_retention& layer = r.layers[l];
    // Expert order: by base community, then expert index.
    std::vector<int> order(e_count);
    std::iota(order.begin(), order.end(), 0);
    const auto& mem = layer.communities_base.membership;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return mem[a] < mem[b]; });
    std::ostringstream boxes;  // community boundaries in plot coordinates
    for (int s = 0, obj = 1; s < e_count;) {
      int t = s;
      while (t < e_count && mem[order[t]] == mem[order[s]]) ++t;
      boxes << "set object " << obj++ << " rect from " << s - 0.5 << "," << s - 0.5 << " to " << t - 0.5 << ","
            << t - 0.5 << " front fillstyle empty border lc rgb 'white' lw 2\n";
      s = t;
    }
    const std::string tag = "layer" + std::to_string(l);
    for (int which = 0; which < 2; ++which) {
      const std::int32_t* trace = (which == 0 ? base : post) + static_cast<std::int64_t>(l) * n * k;
      const an::coactivation_graph g = an::coactivation(trace, n, k, e_count);
      const fs::path data = work / (tag + (which ? "_post" : "_base") + ".dat");
      {
        std::ofstream f(data);
        for (int i = 0; i < e_count; ++i) {
          for (int j = 0; j < e_count; ++j) f << (j ? " " : "") << g.weight(order[i], order[j]);
          f << "\n";
        }
      }
      const std::string final_png =
          (fs::path(dir) / ("coactivation_" + tag + (which ? "_post" : "_base") + ".png")).string();
      const std::string png = out.stage(final_png);
      const fs::path script = work / (tag + std::to_string(which) + ".gp");
      std::ofstream s(script);
      s << "set terminal " << term << "\nset output '" << png << "'\n"
        << "set title sprintf(\"co-activation W (" << (which ? "post" : "base") << "), layer " << l
        << ", experts in base-community order (boxes)\\nQ_base = %.4f, Q_post = %.4f, NMI = %.4f\", "
        << layer.q_base << ", " << layer.q_post << ", " << layer.nmi << ") noenhanced\n"
        << "set xlabel 'expert (base community order)'\nset ylabel 'expert (base community order)'\n"
        << "set xrange [-0.5:" << e_count - 0.5 << "]\nset yrange [" << e_count - 0.5 << ":-0.5]\n"
        << "set size ratio -1\nset palette defined (0 'black', 1 'dark-blue', 2 'orange', 3 'yellow')\n"
        << "set cblabel 'W_ij' noenhanced\n"
        << boxes.str() << "plot '" << data.string() << "' matrix with image notitle\n";
      s.close();
      if (run_gnuplot(script.string()) != 0) throw data_error("--plot: gnuplot failed on " + script.string());
    }
    // Utilisation, base vs post.
    const fs::path udata = work / (tag + "_util.dat");
    {
      std::ofstream f(udata);
      for (int e = 0; e < e_count; ++e)
        f << e << " " << layer.utilisation_base[e] << " " << layer.utilisation_post[e] << "\n";
    }
    const std::string final_png = (fs::path(dir) / ("utilisation_" + tag + ".png")).string();
    const std::string png = out.stage(final_png);
    const fs::path script = work / (tag + "_util.gp");
    std::ofstream s(script);
    s << "set terminal " << term << "\nset size 1,1\nset output '" << png << "'\n"
      << "set title \"per-expert utilisation, layer " << l << ": TVD = " << layer.tvd << ", JSD = " << layer.jsd
      << "\" noenhanced\nset xlabel 'expert'\nset ylabel 'share of selections'\nset key top right\n"
      << "set style data histogram\nset style histogram clustered gap 1\nset style fill solid 0.8 border -1\n"
      << "set boxwidth 0.9\nset xtics rotate by -90 font ',7'\nset yrange [0:*]\n"
      << "plot '" << udata.string() << "' using 2:xtic(1) title 'base' lc rgb '#1f77b4', '' using 3 title 'post' lc rgb '#ff7f0e'\n";
    s.close();
    if (run_gnuplot(script.string()) != 0) throw data_error("--plot: gnuplot failed on " + script.string());
  }
}

}  // namespace moe_route_cli
