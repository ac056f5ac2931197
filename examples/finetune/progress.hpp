// SPDX-License-Identifier: MIT OR Apache-2.0
// Training progress for the finetune example: a redrawn bar on a terminal (step/total, loss,
// tokens/s, ETA), plain lines otherwise, and a JSONL metrics log.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace finetune {

class Progress {
 public:
  Progress(int total, const std::string& metrics_path)
      : total_(total), tty_(isatty(fileno(stdout)) != 0), start_(Clock::now()), log_(metrics_path, std::ios::app) {}

  /// One training step done: redraws the bar (terminal) or prints a line every `every` steps.
  void step(int step, double loss, double lr, std::int64_t tokens, int every) {
    tokens_ += tokens;
    const double secs = seconds();
    const double tps = secs > 0 ? static_cast<double>(tokens_) / secs : 0.0;
    const double eta = step > 0 ? secs / step * (total_ - step) : 0.0;
    log({{"step", step}, {"loss", loss}, {"lr", lr}, {"tokens_per_s", tps}, {"elapsed_s", secs}});
    if (tty_) {
      const int width = 30, filled = total_ > 0 ? width * step / total_ : width;
      std::printf("\r[%s%s] %d/%d  loss %.4f  %.0f tok/s  ETA %s   ", std::string(static_cast<std::size_t>(filled), '#').c_str(),
                  std::string(static_cast<std::size_t>(width - filled), '.').c_str(), step, total_, loss, tps,
                  clock(eta).c_str());
      std::fflush(stdout);
      if (step == total_) std::printf("\n");
    } else if (step % every == 0 || step == total_ || step == 1) {
      std::printf("step %d/%d  loss %.4f  lr %.3g  %.0f tok/s  ETA %s\n", step, total_, loss, lr, tps, clock(eta).c_str());
      std::fflush(stdout);
    }
  }
  /// A validation result, always on its own line.
  void validation(int step, double loss) {
    log({{"step", step}, {"val_loss", loss}});
    std::printf("%sstep %d: validation loss %.4f\n", tty_ ? "\n" : "", step, loss);
    std::fflush(stdout);
  }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  using Clock = std::chrono::steady_clock;
  void log(const nlohmann::json& j) {
    if (log_) log_ << j.dump() << "\n" << std::flush;
  }
  static std::string clock(double s) {
    char buf[32];
    const int t = static_cast<int>(s + 0.5);
    std::snprintf(buf, sizeof buf, "%d:%02d", t / 60, t % 60);
    return buf;
  }
  int total_;
  bool tty_;
  Clock::time_point start_;
  std::int64_t tokens_ = 0;
  std::ofstream log_;
};

}  // namespace finetune
