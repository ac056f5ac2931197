// SPDX-License-Identifier: MIT OR Apache-2.0
// The kill loop (issue 21): a child process saves a 50 MB checkpoint over and over, each save a
// new state k (every weight = k), and the parent SIGKILLs it at a random moment, `kills` times.
// After every kill the checkpoint must load and hold one completed state (the last one the child
// logged as done, or the one whose rename landed just before the kill), at most one temporary of
// a killed save may exist (the next save removes it: atomic_file.hpp's stale-temporary cleanup),
// and after one last completed save none may remain.
//
//   checkpoint_kill_loop DIR [kills=25] [megabytes=50]
#include <nn/nn.hpp>
#include <nn/optim.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include <csignal>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

struct Big {
  nn::Param w;  // (n): every element holds the state number
  NN_MODULE(Big, w)
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "checkpoint_kill_loop: %s\n", what.c_str());
  std::exit(1);
}

// The last state the child logged as completely saved (0: none).
long last_done(const fs::path& log) {
  std::ifstream f(log);
  long k = 0, v;
  while (f >> v) k = v;
  return k;
}

std::vector<fs::path> temporaries(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind(".run.safetensors.tmp.", 0) == 0) out.push_back(e.path());
  return out;
}

// The child: saves states from+1, from+2, ... until killed, logging each one once it is saved.
[[noreturn]] void saver(const fs::path& dir, long from, std::int64_t n) {
  Big m{nn::Param(nn::Tensor::zeros({n}, nn::DType::f32))};
  nn::Sgd opt(0.1);
  const fs::path ckpt = dir / "run.safetensors", log = dir / "done.log";
  for (long k = from + 1;; ++k) {
    std::fill(m.w.value.data<float>(), m.w.value.data<float>() + n, static_cast<float>(k));
    nn::save(ckpt, m, opt);
    const std::string line = std::to_string(k) + "\n";
    const int fd = ::open(log.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0 || ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()) || ::fsync(fd) != 0)
      std::_Exit(3);
    ::close(fd);
  }
}

// The state the checkpoint holds (every element equal), or a failure.
long loaded_state(const fs::path& ckpt, std::int64_t n) {
  Big m{nn::Param(nn::Tensor::zeros({n}, nn::DType::f32))};
  nn::Sgd opt(0.1);
  try {
    nn::load_into(ckpt, m, opt);
  } catch (const nn::Error& e) {
    fail(std::string("the checkpoint does not load: ") + e.what());
  }
  const float* p = m.w.value.data<float>();
  if (!std::all_of(p, p + n, [&](float v) { return v == p[0]; })) fail("the checkpoint mixes two states");
  return static_cast<long>(p[0]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) fail("usage: checkpoint_kill_loop DIR [kills=25] [megabytes=50]");
  const fs::path dir = argv[1];
  const int kills = argc > 2 ? std::atoi(argv[2]) : 25;
  const std::int64_t n = (argc > 3 ? std::atoll(argv[3]) : 50) * 1000 * 1000 / 4;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path ckpt = dir / "run.safetensors", log = dir / "done.log";

  // How long one save takes here, so that kills land at every point of a save.
  const auto t0 = std::chrono::steady_clock::now();
  {
    Big m{nn::Param(nn::Tensor::zeros({n}, nn::DType::f32))};
    nn::Sgd opt(0.1);
    nn::save(dir / "probe.safetensors", m, opt);
    fs::remove(dir / "probe.safetensors");
  }
  const double save_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  std::mt19937 rng(2026);
  int mid_save = 0;
  for (int i = 0; i < kills; ++i) {
    const long before = last_done(log);
    const pid_t pid = ::fork();
    if (pid < 0) fail("fork failed");
    if (pid == 0) saver(dir, before, n);
    // Between 0.2 and 3.2 saves' time: the first save of each child, or a later one, is cut.
    std::uniform_real_distribution<double> wait(0.2 * save_ms, 3.2 * save_ms);
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(wait(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFSIGNALED(status)) fail("the saver exited by itself (status " + std::to_string(status) + ")");

    const long done = last_done(log);
    const std::size_t orphans = temporaries(dir).size();
    if (orphans > 1) fail(std::to_string(orphans) + " temporaries after kill " + std::to_string(i + 1) + ": the stale ones were not removed");
    mid_save += orphans == 1;
    if (!fs::exists(ckpt)) {
      if (done != 0) fail("the checkpoint vanished after state " + std::to_string(done) + " was saved");
      continue;  // killed during the very first save: no checkpoint yet, as promised
    }
    const long k = loaded_state(ckpt, n);
    // The last logged state, or the next one if its rename landed before the log line.
    if (k != done && k != done + 1)
      fail("after kill " + std::to_string(i + 1) + " the checkpoint holds state " + std::to_string(k) +
           ", the last completed save was " + std::to_string(done));
  }
  // One completed save by a live process removes every temporary the killed ones left.
  {
    Big m{nn::Param(nn::Tensor::zeros({n}, nn::DType::f32))};
    nn::Sgd opt(0.1);
    nn::save(ckpt, m, opt);
  }
  if (!temporaries(dir).empty()) fail("temporaries remain after a completed save");
  std::printf("checkpoint_kill_loop: %d SIGKILLs during saves of a %.0f MB checkpoint (%.0f ms a save), "
              "%d mid-write; every checkpoint loaded as a completed state; no temporaries left\n",
              kills, static_cast<double>(n) * 4 / 1e6, save_ms, mid_save);
  fs::remove_all(dir);
  return 0;
}
