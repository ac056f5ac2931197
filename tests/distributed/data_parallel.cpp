// SPDX-License-Identifier: MIT OR Apache-2.0
// Data-parallel training is the same training (issue 18, item 4). Run under mpirun at 1, 2 and 3
// ranks, over shared memory and over TCP (tests/CMakeLists.txt registers each), and once without
// mpirun (MPI's singleton start: size 1). Every rank runs every case in the same order, since
// the cases call collectives; each rank computes the one-process reference itself (the whole
// global batch, no group), so every comparison is local.
//
// The model is the lm kit's tiny Llama fixture (tests/fixtures/lm/models/llama: random weights
// made by transformers; 2 layers, width 32, GQA 4/2 heads, vocab 64), trained in full by AdamW
// through nn::compile for 20 steps on global batches of 6 rows x 8 tokens with rows of uneven
// real length (padding targets are -100), so the ranks hold different numbers of real tokens.
#include <nn/distributed.hpp>
#include <nn/lm.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include "../alloc/count.hpp"

namespace {

namespace dist = nn::distributed;
using nn::DType;
using nn::GTape;
using nn::GVar;
using nn::Shape;
using nn::Tensor;

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

const dist::Group& world() {
  static const dist::Group g = dist::init();
  return g;
}

// ---- data: global batches of kRows rows, each of uneven real length -------------------------

constexpr std::int64_t kRows = 6, kT = 8, kVocab = 64;

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Batch {
  std::vector<double> ids, targets;  // (kRows, kT) each; targets -100 past a row's real length
};

// Two global batches taken in turn, so that 20 steps visibly learn them.
Batch global_batch(int step) {
  std::uint64_t s = 1000 + static_cast<std::uint64_t>(step % 2);
  Batch b;
  for (std::int64_t r = 0; r < kRows; ++r) {
    const std::int64_t len = 3 + static_cast<std::int64_t>(splitmix(s) % (kT - 2));  // 3..8 real targets
    std::vector<double> tok(kT + 1);
    for (double& t : tok) t = static_cast<double>(splitmix(s) % kVocab);
    for (std::int64_t i = 0; i < kT; ++i) {
      b.ids.push_back(tok[static_cast<std::size_t>(i)]);
      b.targets.push_back(i < len ? tok[static_cast<std::size_t>(i + 1)] : -100.0);
    }
  }
  return b;
}

// Rows rank, rank + size, ... of a global batch (mlx-lm's strided shard); the real-token count.
struct Shard {
  Tensor ids, targets;
  double tokens = 0;
};

Shard shard(const Batch& b, int rank, int size) {
  std::vector<double> ids, tg;
  std::int64_t rows = 0;
  double tokens = 0;
  for (std::int64_t r = rank; r < kRows; r += size, ++rows)
    for (std::int64_t i = 0; i < kT; ++i) {
      ids.push_back(b.ids[static_cast<std::size_t>(r * kT + i)]);
      const double t = b.targets[static_cast<std::size_t>(r * kT + i)];
      tg.push_back(t);
      tokens += t != -100.0;
    }
  return {Tensor::from_doubles(Shape{rows, kT}, ids, DType::i64), Tensor::from_doubles(Shape{rows, kT}, tg, DType::i64),
          tokens};
}

// ---- training runs -----------------------------------------------------------------------------

struct Run {
  std::vector<double> losses;  // the global (token-weighted) loss of each step
  std::vector<std::vector<double>> weights;  // every parameter at the end, in tree order
};

auto loss_fn = [](GTape<nn::cpu>& tp, const nn::lm::CausalLM& m, GVar ids, GVar targets) {
  return nn::cross_entropy(tp, m.logits(tp, ids), targets);  // mean over targets != -100
};

std::vector<std::vector<double>> weights_of(const nn::lm::CausalLM& m) {
  std::vector<std::vector<double>> w;
  nn::detail::for_each(m, [&](const std::string&, const nn::Param& p) { w.push_back(p.value.to_doubles()); });
  return w;
}

enum class Weighting { tokens, plain_mean };

// `steps` AdamW steps on the global batches. group == nullptr: one process, the whole batch.
// Otherwise this rank's shard, gradients averaged over the group.
Run train(DType dt, int steps, const dist::Group* group, Weighting weighting = Weighting::tokens) {
  nn::lm::CausalLM model = nn::lm::load_hf(kModels + "/llama", dt);
  // A finetune's learning rate. At 1e-2 these 20 steps memorise the two batches (loss 4.35 ->
  // 0.18) and Adam's normalisation amplifies f32's summation-order differences (each rank sums
  // its own rows, then the ranks add) to 1.4e-3 in the losses; f64 stays within 3e-12.
  nn::AdamW<nn::cpu> opt(1e-3);
  auto step = nn::compile<2>(model, opt, loss_fn);
  dist::GradientAverager avg(group ? *group : dist::Group(), /*bucket_bytes=*/4096);  // several buckets
  if (group) {
    // Start the other ranks from different weights: the broadcast must make them rank 0's.
    if (group->rank() != 0)
      nn::detail::for_each(model, [&](const std::string&, nn::Param& p) {
        nn::cpu::unary(nn::Unary::scale, 1.5, p.value, p.value);
      });
    dist::broadcast_parameters(model, *group);
    step.reduce_gradients(avg);
  }
  Run run;
  for (int s = 0; s < steps; ++s) {
    const Batch b = global_batch(s);
    if (!group) {
      Shard all = shard(b, 0, 1);
      run.losses.push_back(step(all.ids, all.targets).to_doubles()[0]);
      continue;
    }
    Shard mine = shard(b, group->rank(), group->size());
    const double w = weighting == Weighting::tokens ? mine.tokens : 1.0;
    avg.set_weight(w);
    const double local = step(mine.ids, mine.targets).to_doubles()[0];
    run.losses.push_back(dist::weighted_mean(*group, local, w));
  }
  CHECK(step.recordings() == 1);
  run.weights = weights_of(model);
  return run;
}

double rel_err(double a, double b) { return std::abs(a - b) / std::max(1.0, std::abs(b)); }

// The largest relative difference between two runs: losses and every final weight.
double max_rel_diff(const Run& a, const Run& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.losses.size(); ++i) worst = std::max(worst, rel_err(a.losses[i], b.losses[i]));
  for (std::size_t p = 0; p < a.weights.size(); ++p)
    for (std::size_t i = 0; i < a.weights[p].size(); ++i)
      worst = std::max(worst, std::abs(a.weights[p][i] - b.weights[p][i]) / std::max(1.0, std::abs(b.weights[p][i])));
  return worst;
}

}  // namespace

TEST_CASE("collectives: all_sum on every dtype, all_gather, broadcast, barrier, split") {
  const dist::Group& g = world();
  const int r = g.rank(), n = g.size();
  MESSAGE("rank " << r << " of " << n << (dist::with_mpi() ? std::string(" (MPI)") : std::string(" (no MPI)")));
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u32, DType::u8}) {
    const std::string dtype = nn::dtype_name(dt);
    CAPTURE(dtype);
    Tensor t = Tensor::from_doubles(Shape{3}, {double(r + 1), 2.0 * (r + 1), 3.0}, dt);
    g.all_sum(t);
    CHECK(t.to_doubles() == std::vector<double>{n * (n + 1) / 2.0, double(n * (n + 1)), 3.0 * n});
  }
  Tensor row = Tensor::from_doubles(Shape{2}, {double(r), 10.0 * r}, DType::f32);
  Tensor all = g.all_gather(row);
  REQUIRE(all.shape() == Shape{std::int64_t{n}, 2});
  for (int k = 0; k < n; ++k) {
    CHECK(all.to_doubles()[static_cast<std::size_t>(2 * k)] == k);
    CHECK(all.to_doubles()[static_cast<std::size_t>(2 * k + 1)] == 10.0 * k);
  }
  Tensor b = Tensor::from_doubles(Shape{2, 2}, std::vector<double>(4, r + 5.0), DType::f64);
  g.broadcast(b, n - 1);
  CHECK(b.to_doubles() == std::vector<double>(4, n - 1 + 5.0));
  g.barrier();
  dist::Group half = g.split(r % 2);
  CHECK(half.size() == (r % 2 == 0 ? (n + 1) / 2 : n / 2));
  CHECK(half.rank() == r / 2);
  CHECK(half.sum(1.0) == half.size());
  CHECK(g.sum(r) == n * (n - 1) / 2.0);
  // weighted_mean: rank r's mean r over r + 1 tokens.
  double num = 0, den = 0;
  for (int k = 0; k < n; ++k) num += double(k) * (k + 1), den += k + 1;
  CHECK(dist::weighted_mean(g, r, r + 1) == doctest::Approx(num / den).epsilon(1e-15));
}

TEST_CASE("collectives: ranks that disagree get the same nn::Error, not a hang") {
  const dist::Group& g = world();
  if (g.size() == 1) return;
  const int r = g.rank();
  Tensor t = Tensor::zeros(Shape{std::int64_t{r == 0 ? 2 : 3}});
  CHECK_THROWS_WITH_AS(g.all_sum(t), doctest::Contains("[all_sum] the ranks disagree: rank 0 has 'float32 (2)', rank 1 has 'float32 (3)'"), nn::Error);
  Tensor d = Tensor::zeros(Shape{2}, r == 0 ? DType::f32 : DType::f64);
  CHECK_THROWS_WITH_AS(g.broadcast(d), doctest::Contains("[broadcast] the ranks disagree"), nn::Error);
  // Different models (rank 0 a Llama, the others a Qwen2 with q/k/v biases): named by path.
  nn::lm::CausalLM m = nn::lm::load_hf(kModels + (r == 0 ? "/llama" : "/qwen2"), DType::f32);
  try {
    dist::broadcast_parameters(m, g);
    FAIL("broadcast_parameters accepted different models");
  } catch (const nn::Error& e) {
    const std::string msg = e.what();
    MESSAGE(msg);
    CHECK(msg.find("[broadcast_parameters] the ranks disagree at item") != std::string::npos);
    CHECK(msg.find("rank 0 has 'model.") != std::string::npos);
  }
  // The same through the averager: gradient trees of different layouts.
  auto [loss, grads] = nn::value_and_grad(m, [&](GTape<nn::cpu>& tp, const nn::lm::CausalLM& mm) {
    Shard s = shard(global_batch(0), 0, 1);
    return nn::cross_entropy(tp, mm.logits(tp, tp.constant(s.ids)), tp.constant(s.targets));
  });
  CHECK_THROWS_WITH_AS(dist::average_gradients(grads, g), doctest::Contains("[average_gradients] the ranks disagree"),
                       nn::Error);
  g.barrier();
}

TEST_CASE("data parallel: N ranks train the one-process model (token-weighted), f32 and f64") {
  const dist::Group& g = world();
  for (DType dt : {DType::f64, DType::f32}) {
    const std::string dtype = nn::dtype_name(dt);
    CAPTURE(dtype);
    const Run ref = train(dt, 20, nullptr);
    const Run par = train(dt, 20, &g);
    const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    const double diff = max_rel_diff(par, ref);
    MESSAGE(g.size() << " ranks, " << dtype << ": largest relative difference from one process "
                     << diff << " (losses " << ref.losses.front() << " -> " << ref.losses.back() << ")");
    CHECK(diff <= tol);
    CHECK(ref.losses.back() < ref.losses.front() - 1.0);  // it trains (4.35 -> 0.95)
    // Bitwise reproducible at a fixed rank count.
    const Run again = train(dt, 20, &g);
    CHECK(again.losses == par.losses);
    CHECK(again.weights == par.weights);
  }
}

TEST_CASE("data parallel: the plain mean of per-rank means is not the one-process answer (the test can fail)") {
  const dist::Group& g = world();
  if (g.size() == 1) return;
  const Run ref = train(DType::f64, 5, nullptr);
  const Run plain = train(DType::f64, 5, &g, Weighting::plain_mean);
  const double diff = max_rel_diff(plain, ref);
  MESSAGE("plain mean over " << g.size() << " ranks: largest relative difference " << diff);
  CHECK(diff > 1e-6);
}

TEST_CASE("data parallel: a replayed step with gradient averaging allocates nothing") {
  const dist::Group& g = world();
  nn::lm::CausalLM model = nn::lm::load_hf(kModels + "/llama", DType::f32);
  nn::AdamW<nn::cpu> opt(1e-2);
  auto step = nn::compile<2>(model, opt, loss_fn);
  dist::GradientAverager avg(g, 4096);
  step.reduce_gradients(avg);
  // Shards of one shape on every step (the first batch's rows), so replays only swap data.
  const Batch b = global_batch(0);
  Shard mine = shard(b, g.rank(), g.size());
  avg.set_weight(mine.tokens);
  step(mine.ids, mine.targets);  // records
  step(mine.ids, mine.targets);  // first replay: lazily sized scratch settles
  namespace al = nn::test::alloc;
  al::CountScope scope;
  for (int i = 0; i < 3; ++i) step(mine.ids, mine.targets);
  const al::Counts c = scope.stop();
  const std::int64_t from_mpi = al::count_from("libmpi") + al::count_from("open-pal") + al::count_from("open-rte") +
                                al::count_from("mca_") + al::count_from("libucs") + al::count_from("libucp");
  MESSAGE("3 replays on " << g.size() << " ranks: " << c.total() << " allocations (" << from_mpi
                          << " inside MPI), " << avg.buckets() << " buckets per step\n" << al::callers());
  CHECK(c.total() - from_mpi == 0);
  CHECK(step.recordings() == 1);
}

TEST_CASE("README: the data-parallel loop") {
  // --8<-- [start:data_parallel]
  const nn::distributed::Group world = nn::distributed::init();  // size 1 without mpirun
  nn::lm::CausalLM model = nn::lm::load_hf(kModels + "/llama");
  nn::distributed::broadcast_parameters(model, world);  // rank 0's weights on every rank
  nn::AdamW<nn::cpu> opt(1e-3);
  auto step = nn::compile<2>(model, opt, loss_fn);
  nn::distributed::GradientAverager avg(world);  // 32 MiB buckets, token-weighted
  step.reduce_gradients(avg);                    // between backward and the update, on replay too
  for (int s = 0; s < 3; ++s) {
    const Shard mine = shard(global_batch(s), world.rank(), world.size());  // rows rank, rank + size, ...
    avg.set_weight(mine.tokens);  // this rank's real (unmasked) targets
    const double local = step(mine.ids, mine.targets).to_doubles()[0];
    const double loss = nn::distributed::weighted_mean(world, local, mine.tokens);  // the global batch's
    if (world.rank() == 0) std::printf("step %d: loss %.4f\n", s, loss);
  }
  // --8<-- [end:data_parallel]
  CHECK(step.recordings() == 1);
  CHECK(avg.total_weight() > 0);
}
