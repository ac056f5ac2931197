// SPDX-License-Identifier: MIT OR Apache-2.0
// Sequence packing (lm/data.hpp pack_examples / make_packed_batch, CausalLM's Packing): several
// examples per row, kept apart by block-diagonal causal attention (flash attention's document
// starts) with RoPE positions restarting at each document, give each token the loss it has
// unpacked, and the same gradients (f32 to 1e-6, f64 to 1e-12), prompt masks included.
#include <map>
#include <set>

#include "support/check.hpp"

#include <nn/lm/load.hpp>

namespace lm_packing {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using namespace nn::lm;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

// Five examples of 2..10 tokens over the fixtures' 64-token vocabulary; example 1 is
// prompt/completion (its first 3 tokens are prompt: no loss), example 4 has a single target.
std::vector<Example> examples() {
  std::vector<Example> d;
  const std::vector<int> lens{6, 10, 4, 5, 2};
  for (std::size_t e = 0; e < lens.size(); ++e) {
    Example ex;
    for (int t = 0; t < lens[e]; ++t) ex.tokens.push_back(static_cast<std::int32_t>((e * 17 + static_cast<std::size_t>(t) * 7 + 3) % 64));
    ex.offset = e == 1 ? 3 : 0;
    d.push_back(ex);
  }
  return d;
}

struct Result {
  Tensor per_token;                   // (B, T) masked per-token losses
  std::map<std::string, Tensor> grads;  // of the summed loss
};

template <class MakeLogits>
Result run(CausalLM& m, const Batch& b, MakeLogits&& logits) {
  auto [loss, g] = value_and_grad(m, [&](GTape<cpu>& tp, const CausalLM& mm) {
    GVar lg = logits(tp, mm);
    return cross_entropy(tp, lg, tp.input(b.targets), tp.input(b.mask), Reduction::sum);
  });
  Result r;
  for (const auto& [p, t] : g.parameters())
    if (t.defined()) r.grads[p] = t.clone();
  GTape<cpu> tp;
  r.per_token = tp.value(cross_entropy(tp, logits(tp, m), tp.input(b.targets), tp.input(b.mask), Reduction::none)).to(DType::f64);
  return r;
}

}  // namespace

TEST_CASE("pack_examples: first-fit decreasing places every example once; pack_fill counts the used positions") {
  const std::vector<Example> d = examples();  // 5, 9, 3, 4, 1 positions
  const auto rows = pack_examples(d, 12);
  // 9 -> row 0 (3 left); 5 -> row 1 (7 left); 4 -> row 1 (3 left); 3 -> row 0 (0 left); 1 -> row 1
  REQUIRE(rows.size() == 2);
  CHECK(rows[0] == std::vector<std::size_t>{1, 2});
  CHECK(rows[1] == std::vector<std::size_t>{0, 3, 4});
  CHECK(pack_fill(d, rows, 12) == doctest::Approx(22.0 / 24.0));
  std::multiset<std::size_t> seen;
  for (const auto& r : pack_examples(d, 9))
    for (std::size_t e : r) seen.insert(e);
  CHECK(seen == std::multiset<std::size_t>{0, 1, 2, 3, 4});
  CHECK(pack_examples(d, 4).size() == 4);  // examples longer than a row are truncated to it
  const PackedBatch pb = make_packed_batch(d, std::span(rows), 12);
  CHECK(pb.starts.to_doubles() == std::vector<double>{0, 0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9,  //
                                                       0, 0, 0, 0, 0, 5, 5, 5, 5, 9, 10, 11});
  CHECK(pb.positions.to_doubles() == std::vector<double>{0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2,  //
                                                          0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0});
  CHECK(pb.batch.tokens == 22 - 2);  // example 1's prompt: targets 1 and 2 are masked
}

TEST_CASE("packed rows give each token its unpacked loss and the same gradients (llama, qwen2, gemma2, gemma3; f32, f64)") {
  // gemma2: capped scores and a window of 4 on the even layers, in flash attention when packed,
  // written out under the padding mask when not; gemma3: both RoPE tables gathered by position
  const std::vector<Example> d = examples();
  for (const char* name : {"llama", "qwen2", "gemma2", "gemma3"})
    for (DType dt : {DType::f64, DType::f32}) {
      CAPTURE(name);
      CAPTURE(dtype_name(dt));
      const double tol = dt == DType::f64 ? 1e-12 : 1e-6;
      CausalLM m = load_hf(kModels + "/" + name, dt);
      // unpacked: one example per row, right-padded, the keep-mask form
      const std::vector<std::size_t> all{0, 1, 2, 3, 4};
      const Batch ub = make_batch(d, all, 64, 1, dt);
      Tensor keep = Tensor::zeros(ub.inputs.shape(), DType::f32);
      for (std::size_t e = 0; e < d.size(); ++e)
        for (std::size_t t = 0; t < d[e].tokens.size() - 1; ++t) keep.data<float>()[e * static_cast<std::size_t>(ub.inputs.dim(1)) + t] = 1;
      Result u = run(m, ub, [&](GTape<cpu>& tp, const CausalLM& mm) { return mm.logits(tp, tp.input(ub.inputs), keep); });
      // packed: two rows of 12 positions
      const auto rows = pack_examples(d, 12);
      const PackedBatch pb = make_packed_batch(d, std::span(rows), 12, dt);
      Result p = run(m, pb.batch, [&](GTape<cpu>& tp, const CausalLM& mm) {
        return mm.logits(tp, tp.input(pb.batch.inputs), Packing{tp.input(pb.starts), tp.input(pb.positions)});
      });
      // token by token: example e's position t sits at row r, column at(e) + t
      const std::int64_t Tu = ub.inputs.dim(1);
      double worst = 0;
      int compared = 0;
      for (std::size_t r = 0; r < rows.size(); ++r) {
        std::int64_t at = 0;
        for (std::size_t e : rows[r]) {
          for (std::int64_t t = 0; t + 1 < static_cast<std::int64_t>(d[e].tokens.size()); ++t) {
            const double a = u.per_token.item(static_cast<std::int64_t>(e) * Tu + t);
            const double b = p.per_token.item(static_cast<std::int64_t>(r) * 12 + at + t);
            worst = std::max(worst, std::abs(a - b) / std::max(1.0, std::abs(a)));
            ++compared;
          }
          at += static_cast<std::int64_t>(d[e].tokens.size()) - 1;
        }
      }
      CHECK(compared == 22);
      CHECK(worst <= tol);
      // the control: the same packed rows under plain causal attention and positions 0..T-1
      // (documents attending to each other) give other losses
      if (dt == DType::f64) {
        GTape<cpu> tp;
        const Tensor lc = tp.value(cross_entropy(tp, m.logits(tp, tp.input(pb.batch.inputs)), tp.input(pb.batch.targets),
                                                 tp.input(pb.batch.mask), Reduction::none));
        CHECK(test::rel_err(lc, p.per_token) > 1e-3);
      }
      REQUIRE(u.grads.size() == p.grads.size());
      for (const auto& [path, g] : u.grads) CHECK_MESSAGE(test::rel_err(g, p.grads.at(path)) <= tol, path);
    }
}

TEST_CASE("packed rows: a mask beside the packing, or positions missing, is an nn::Error") {
  const CausalLM m = load_hf(kModels + "/llama", DType::f64);
  GTape<cpu> tp;
  GVar ids = tp.input(Tensor::from<std::int32_t>({1, 4}, {1, 2, 3, 4}));
  GVar st = tp.input(Tensor::from<std::int32_t>({1, 4}, {0, 0, 2, 2}));
  test::check_error([&] { m.hidden(tp, ids, GVar{}, Packing{st, GVar{}}); }, {"[CausalLM]", "positions"});
  test::check_error([&] { m.hidden(tp, ids, tp.constant(causal_mask_fill(4, DType::f64)), Packing{st, st}); },
                    {"[CausalLM]", "no mask"});
}

}  // namespace lm_packing
