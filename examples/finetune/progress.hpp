// SPDX-License-Identifier: MIT OR Apache-2.0
// Training progress for the finetune example: mlx-lm's report lines every --steps-per-report
// steps ("Iter 10: Train loss 2.345, Learning Rate 1.000e-05, It/sec ..., Tokens/sec ...,
// Trained Tokens ..., Peak mem ... GB") and after each validation, a redrawn bar between them on a
// terminal, and a JSONL metrics log.
#pragma once

#include <nn/resources.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace finetune {

class Progress {
 public:
  Progress(int total, int every, const std::string& metrics_path)
      : total_(total), every_(every), tty_(isatty(fileno(stdout)) != 0), start_(Clock::now()), window_start_(start_),
        log_(metrics_path, std::ios::app) {}

  /// One training step done (`tokens`: the positions it trained on, every rank's).
  void step(int step, double loss, double lr, std::int64_t tokens) {
    tokens_ += tokens;
    window_loss_ += loss;
    window_tokens_ += tokens;
    ++window_steps_;
    const double secs = seconds();
    log({{"step", step}, {"loss", loss}, {"lr", lr}, {"tokens_per_s", secs > 0 ? static_cast<double>(tokens_) / secs : 0.0},
         {"elapsed_s", secs}});
    if (step % every_ == 0 || step == total_) {
      const double w = std::chrono::duration<double>(Clock::now() - window_start_).count();
      const long kb = nn::peak_rss_kb();
      std::printf("%sIter %d: Train loss %.3f, Learning Rate %.3e, It/sec %.3f, Tokens/sec %.3f, Trained Tokens %lld, "
                  "Peak mem %.3f GB\n",
                  tty_ ? "\r\033[K" : "", step, window_loss_ / window_steps_, lr, w > 0 ? window_steps_ / w : 0.0,
                  w > 0 ? static_cast<double>(window_tokens_) / w : 0.0, static_cast<long long>(tokens_),
                  kb > 0 ? static_cast<double>(kb) / (1024.0 * 1024.0) : 0.0);
      window_loss_ = 0;
      window_tokens_ = 0;
      window_steps_ = 0;
      window_start_ = Clock::now();
    }
    if (tty_ && step < total_) {  // the bar, redrawn in place until the next line
      const int width = 30, filled = total_ > 0 ? width * step / total_ : width;
      const double eta = step > 0 ? secs / step * (total_ - step) : 0.0;
      std::printf("\r[%s%s] %d/%d  loss %.4f  ETA %s ", std::string(static_cast<std::size_t>(filled), '#').c_str(),
                  std::string(static_cast<std::size_t>(width - filled), '.').c_str(), step, total_, loss,
                  clock(eta).c_str());
    }
    std::fflush(stdout);
  }
  /// A validation result (mlx-lm's line), on its own line.
  void validation(int step, double loss, double took_s) {
    log({{"step", step}, {"val_loss", loss}});
    std::printf("%sIter %d: Val loss %.3f, Val took %.3fs\n", tty_ ? "\r\033[K" : "", step, loss, took_s);
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
  int total_, every_;
  bool tty_;
  Clock::time_point start_, window_start_;
  std::int64_t tokens_ = 0, window_tokens_ = 0;
  double window_loss_ = 0;
  int window_steps_ = 0;
  std::ofstream log_;
};

}  // namespace finetune
