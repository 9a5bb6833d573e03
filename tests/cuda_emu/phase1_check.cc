// The CUDA kernels, rewritten for the host by transform.py (run.sh), against the CPU kernels: the same inputs as
// tests/test_gpu_phase1.py (collisions, repeats, invalid ids, padding tokens, extreme gates), every output compared
// (integer maps exactly, floats to a relative L2 error of 1e-5).
#include "phase1_emu.inc"
#include <cstdio>
#include <random>
#include <string>
#include <limits>

using namespace sdm;

struct Case { int N, C, W, R; int64_t K; double invalid; int pad; std::string gate; };

static double rel_l2(const std::vector<float>& a, const std::vector<float>& b, bool& nan_mismatch) {
  double num = 0, den = 0;
  nan_mismatch = false;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool fa = std::isfinite(a[i]), fb = std::isfinite(b[i]);
    if (!fa || !fb) {
      if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) nan_mismatch = true;
      continue;
    }
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

static int run_case(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<double> ud;
  const int N = c.N, C = c.C, W = c.W, R = c.R;
  const int64_t K = c.K;
  auto ids = [&](int L) {
    std::vector<int32_t> a(size_t(N) * C * L);
    const int32_t bad[4] = {-1, int32_t(K), int32_t(K + 3), -7};
    for (int u = 0; u < N; ++u)
      for (int t = 0; t < C; ++t) {
        const bool partial = ud(rng) < 0.2;
        for (int l = 0; l < L; ++l) {
          int32_t v = K > 0 ? int32_t(rng() % uint64_t(K)) : -1;
          if (ud(rng) < c.invalid) v = bad[rng() % 4];
          if (partial && ud(rng) < 0.5) v = -1;
          if (t >= C - c.pad) v = -1;
          a[(size_t(u) * C + t) * L + l] = v;
        }
      }
    return a;
  };
  auto k_idx = ids(W), q_idx = ids(R);
  std::vector<float> k_val(size_t(N) * C * W), x(k_val.size()), q_val(size_t(N) * C * R);
  for (auto& v : k_val) v = nd(rng);
  for (auto& v : q_val) v = nd(rng);
  for (auto& v : x) {
    v = -std::log1p(std::exp(nd(rng)));
    if (c.gate == "extreme" && ud(rng) < 0.05) {
      const float ex[4] = {-std::numeric_limits<float>::infinity(), -3e38f, -1e30f, -1e10f};
      v = ex[rng() % 4];
    }
  }
  const size_t nw = size_t(N) * C * W, nr = size_t(N) * C * R, ncc = size_t(N) * C * C;
  struct Out {
    std::vector<float> log_k, rex, cpe, k_eff, w, log_q, q_w, A, QK;
    std::vector<int32_t> w_order, w_group, r_order, r_group, repeats;
    Out(size_t nw, size_t nr, size_t ncc, int N, int CW, int CR)
        : log_k(nw, 7.f), rex(nw, 7.f), cpe(nw, 7.f), k_eff(nw, 7.f), w(nw, 7.f), log_q(nr, 7.f), q_w(nr, 7.f),
          A(ncc, 7.f), QK(ncc, 7.f), w_order(nw, 77), w_group(size_t(N) * (CW + 1), 77), r_order(nr, 77),
          r_group(size_t(N) * (CR + 1), 77), repeats(N, 77) {}
    Phase1Arrays arrays(const std::vector<int32_t>& ki, const std::vector<float>& kv, const std::vector<float>& xx,
                        const std::vector<int32_t>& qi, const std::vector<float>& qv) {
      return {ki.data(), kv.data(), xx.data(), qi.data(), qv.data(), log_k.data(), rex.data(), cpe.data(),
              k_eff.data(), w.data(), log_q.data(), q_w.data(), A.data(), QK.data(), w_order.data(),
              w_group.data(), r_order.data(), r_group.data(), repeats.data()};
    }
  };
  Out cpu(nw, nr, ncc, N, C * W, C * R), gpu(nw, nr, ncc, N, C * W, C * R);
  const Phase1Dims d{N, C, W, R, K};
  phase1_cpu(cpu.arrays(k_idx, k_val, x, q_idx, q_val), d);
  const int64_t ws_bytes = phase1_cuda_workspace_bytes(N, C, W, R, false);
  std::vector<unsigned char> ws(ws_bytes);
  const int rc = phase1_cuda(gpu.arrays(k_idx, k_val, x, q_idx, q_val), d, ws_bytes ? ws.data() : nullptr, ws_bytes, nullptr);
  int fails = rc != 0;
  auto chk = [&](const char* name, const std::vector<float>& g, const std::vector<float>& w) {
    bool nm;
    const double e = rel_l2(g, w, nm);
    if (e > 1e-5 || nm) { std::printf("  FAIL %s rel_l2=%g nan_mismatch=%d\n", name, e, nm); ++fails; }
  };
  auto chki = [&](const char* name, const std::vector<int32_t>& g, const std::vector<int32_t>& w) {
    if (g != w) {
      size_t i = 0; while (g[i] == w[i]) ++i;
      std::printf("  FAIL %s first diff at %zu: %d vs %d\n", name, i, g[i], w[i]); ++fails;
    }
  };
  chk("log_k", gpu.log_k, cpu.log_k); chk("rex", gpu.rex, cpu.rex); chk("cpe", gpu.cpe, cpu.cpe);
  chk("k_eff", gpu.k_eff, cpu.k_eff); chk("w", gpu.w, cpu.w); chk("log_q", gpu.log_q, cpu.log_q);
  chk("q_w", gpu.q_w, cpu.q_w); chk("A", gpu.A, cpu.A); chk("QK", gpu.QK, cpu.QK);
  chki("w_order", gpu.w_order, cpu.w_order); chki("w_group", gpu.w_group, cpu.w_group);
  chki("r_order", gpu.r_order, cpu.r_order); chki("r_group", gpu.r_group, cpu.r_group);
  chki("repeats", gpu.repeats, cpu.repeats);
  // Backward, on the CPU's forward outputs.
  std::vector<float> dk_eff(nw), dw(nw), dcpe(nw), dq_w(nr), dA(ncc), dQK(ncc);
  for (auto* v : {&dk_eff, &dw, &dcpe, &dq_w, &dA, &dQK}) for (auto& f : *v) f = nd(rng);
  struct Grad { std::vector<float> dk_val, dx, dq_val; };
  Grad gc{std::vector<float>(nw, 7.f), std::vector<float>(nw, 7.f), std::vector<float>(nr, 7.f)}, gg = gc;
  auto garr = [&](Grad& g) {
    return Phase1GradArrays{k_idx.data(), k_val.data(), x.data(), q_idx.data(), q_val.data(), cpu.log_k.data(),
                            cpu.rex.data(), cpu.cpe.data(), cpu.log_q.data(), dk_eff.data(), dw.data(), dcpe.data(),
                            dq_w.data(), dA.data(), dQK.data(), g.dk_val.data(), g.dx.data(), g.dq_val.data()};
  };
  phase1_bwd_cpu(garr(gc), d);
  const int64_t wsb = phase1_cuda_workspace_bytes(N, C, W, R, true);
  std::vector<unsigned char> ws2(wsb);
  fails += phase1_bwd_cuda(garr(gg), d, wsb ? ws2.data() : nullptr, wsb, nullptr) != 0;
  chk("dk_val", gg.dk_val, gc.dk_val); chk("dx", gg.dx, gc.dx); chk("dq_val", gg.dq_val, gc.dq_val);
  std::printf("%s N%d C%d W%d R%d K%lld %s seed=%u ws=%lld/%lld\n", fails ? "FAIL" : "ok  ", N, C, W, R,
              (long long)K, c.gate.c_str(), seed, (long long)ws_bytes, (long long)wsb);
  return fails;
}

int main(int argc, char** argv) {
  std::vector<Case> cases = {
      {4, 16, 1, 1, 4, 0.1, 2, "lane"},
      {3, 16, 7, 7, 5, 0.2, 3, "lane"},
      {3, 16, 7, 1, 3, 0.1, 0, "lane"},
      {2, 64, 7, 7, 16, 0.1, 5, "lane"},
      {2, 64, 1, 64, 8, 0.2, 0, "lane"},
      {2, 64, 64, 7, 32, 0.1, 4, "lane"},
      {1, 64, 64, 64, 1000, 0.05, 0, "lane"},
      {1, 256, 1, 1, 2, 0.0, 0, "lane"},
      {2, 7, 3, 3, 1000, 0.0, 0, "lane"},
      {3, 16, 7, 7, 5, 0.1, 2, "extreme"},
      {1, 256, 1, 1, 2, 0.0, 0, "extreme"},
      {2, 16, 0, 3, 4, 0.1, 0, "lane"},
      {2, 16, 3, 0, 4, 0.1, 0, "lane"},
      {2, 16, 0, 0, 4, 0.1, 0, "lane"},
      {3, 16, 4, 3, 0, 0.1, 0, "lane"},
      {2, 16, 4, 3, 1, 0.1, 0, "lane"},
      {1, 8, 5, 5, int64_t(1) << 30, 0.1, 0, "lane"},
      {1, 8, 5, 5, 2147483647, 0.1, 0, "lane"},
      {2, 64, 128, 64, 4096, 0.02, 3, "lane"},   // forward in shared memory, backward's run arrays in the workspace
      {1, 64, 200, 8, 8, 0.05, 0, "extreme"},    // run arrays in the workspace, collision-heavy
      {2, 128, 64, 64, 65536, 0.02, 3, "lane"},  // the flagship's unit: run arrays in the workspace
      {1, 128, 100, 60, 5000, 0.05, 0, "lane"},  // all of the scratch in the workspace
  };
  if (argc > 1 && std::string(argv[1]) == "random") {
    std::mt19937 r(std::atoi(argv[2]));
    const int64_t Ks[] = {0, 1, 2, 3, 5, 16, 300, 1000, 70000, 2147483647};
    int fails = 0;
    for (int i = 0; i < std::atoi(argv[3]); ++i) {
      Case c{int(1 + r() % 3), int(1 + r() % 70), int(r() % 20), int(r() % 20), Ks[r() % 10], (r() % 4) * 0.05,
             int(r() % 3), r() % 3 ? "lane" : "extreme"};
      if (c.pad > c.C) c.pad = 0;
      fails += run_case(c, r()) ? 1 : 0;
    }
    std::printf("%d failing cases\n", fails);
    return fails != 0;
  }
  int only = argc > 1 ? std::atoi(argv[1]) : -1;
  uint32_t seed = argc > 2 ? std::atoi(argv[2]) : 1234;
  int fails = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (only >= 0 && int(i) != only) continue;
    fails += run_case(cases[i], seed + i) ? 1 : 0;
  }
  std::printf("%d failing cases\n", fails);
  return fails != 0;
}
