// SPDX-License-Identifier: MIT OR Apache-2.0
// Prints, once at the end of the run, the worst relative errors every primitive reached (float64
// and float32 vs PyTorch, float64 vs central differences), gathered by test::check_op.
#include <cstdio>

#include "ops/golden.hpp"

namespace ops_summary {  // one unity source with the other ops files: its names stay its own

namespace {

struct OpsSummary : doctest::IReporter {
  explicit OpsSummary(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {
    const auto& board = nn::test::scoreboard();
    if (board.empty()) return;
    nn::test::OpScore all;
    std::string w64, w32, wfd;
    std::printf("\n[ops summary] %-16s %5s %14s %14s %14s\n", "primitive", "cases", "f64-vs-torch", "f32-vs-torch",
                "f64-vs-fd");
    for (const auto& [op, s] : board) {
      char fd[32] = "n/a";
      if (s.fd_cases) std::snprintf(fd, sizeof fd, "%.3g", s.fd);
      std::printf("[ops summary] %-16s %5d %14.3g %14.3g %14s\n", op.c_str(), s.cases, s.torch64, s.torch32, fd);
      all.cases += s.cases;
      if (s.torch64 >= all.torch64) { all.torch64 = s.torch64; w64 = s.worst64_case; }
      if (s.torch32 >= all.torch32) { all.torch32 = s.torch32; w32 = s.worst32_case; }
      if (s.fd_cases && s.fd >= all.fd) { all.fd = s.fd; wfd = s.worst_fd_case; }
    }
    std::printf("[ops summary] %zu primitives, %d cases: worst relative error float64 vs PyTorch %.3g (%s); "
                "float32 vs PyTorch %.3g (%s); float64 vs central differences %.3g (%s)\n",
                board.size(), all.cases, all.torch64, w64.c_str(), all.torch32, w32.c_str(), all.fd, wfd.c_str());
    std::fflush(stdout);
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

REGISTER_LISTENER("ops-summary", 1, OpsSummary);

}  // namespace ops_summary
