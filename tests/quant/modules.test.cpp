// SPDX-License-Identifier: MIT OR Apache-2.0
// QuantizedLinear, QuantizedEmbedding, nn::quantize(model) and QLoRA: a model quantized and saved
// by MLX loads here and gives MLX's logits; quantized weights stay buffers; LoRA over a quantized
// base trains the adapters exactly as over the dequantized base.
#include <cstring>
#include <sstream>

#include "support/check.hpp"

namespace quant_modules {  // one unity source with the other quant files: its names stay its own

using namespace nn;
using nn::test::rel_err;

namespace {

// MLX's test model (tests/oracle/gen_quant_mlx.py): embed = Embedding(64, 128), proj =
// Linear(128, 128); forward(ids) = embed.as_linear(proj(embed(ids))).
struct Net {
  std::variant<Embedding, QuantizedEmbedding> embed;
  std::variant<Linear, QuantizedLinear, LoraLinear> proj;

  template <class B>
  GVar operator()(GTape<B>& tp, GVar ids) const {
    GVar h = std::visit([&](const auto& e) { return e(tp, ids); }, embed);
    h = std::visit([&](const auto& l) { return l(tp, h); }, proj);
    return std::visit([&](const auto& e) { return e.as_linear(tp, h); }, embed);
  }
  NN_MODULE(Net, embed, proj)
};

Tensor from_hex(const nlohmann::json& j) { return nn::test::tensor_from_hex(j); }

}  // namespace

TEST_CASE("a model quantized and saved by MLX loads by MLX's names and gives MLX's logits") {
  const auto fx = nn::test::fixture("quant/mlx.json").at("model");
  random::seed(0);
  Net net{Embedding(64, 128), Linear(128, 128)};
  CHECK(quantize(net, fx.at("group_size").get<int>(), fx.at("bits").get<int>()) == 2);
  net.load_weights(std::string(NN_FIXTURES_DIR) + "/quant/" + fx.at("file").get<std::string>());
  GTape<cpu> tp;
  GVar y = net(tp, tp.input(from_hex(fx.at("ids"))));
  const Tensor expect = from_hex(fx.at("logits"));
  CHECK(rel_err(tp.value(y), expect) < 1e-6);

  // and back: what nn saves is the same set of MLX names, shapes and dtypes, and reloads equal
  const auto dir = std::filesystem::temp_directory_path() / "nn_quant_model_test";
  std::filesystem::create_directories(dir);
  net.save_weights(dir / "m.safetensors");
  Net again{Embedding(64, 128), Linear(128, 128)};
  quantize(again);
  again.load_weights(dir / "m.safetensors");
  CHECK(nn::test::flat_values(again) == nn::test::flat_values(net));
  std::filesystem::remove_all(dir);
}

TEST_CASE("quantized weights are buffers: unfreeze changes nothing, summary shows their bytes") {
  random::seed(1);
  Net net{Embedding(64, 128), Linear(128, 128)};
  quantize(net, Quant::affine(32, 8), [](const std::string& p) { return p == "proj"; });
  CHECK(std::holds_alternative<Embedding>(net.embed));
  REQUIRE(std::holds_alternative<QuantizedLinear>(net.proj));
  net.freeze();
  CHECK(net.unfreeze() == 1);  // embed.weight only
  const std::string s = net.summary();
  std::string row;
  std::istringstream lines(s);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("proj.weight", 0) == 0) row = line;
  CHECK_MESSAGE(row.find("(128, 32)") != std::string::npos, row);
  CHECK_MESSAGE(row.find("uint32") != std::string::npos, row);
  CHECK_MESSAGE(row.find("buffer") != std::string::npos, row);
  CHECK_MESSAGE(row.find("16,384") != std::string::npos, row);
  CHECK(net.num_trainable() == 64 * 128);
  // a per-layer format (mlx-lm's overrides): the embedding in mxfp4, the projection skipped
  Net n2{Embedding(64, 128), Linear(128, 128)};
  quantize(n2, Quant::affine(), [](const std::string& p) -> std::optional<Quant> {
    if (p == "embed") return Quant::mxfp4();
    return std::nullopt;
  });
  REQUIRE(std::holds_alternative<QuantizedEmbedding>(n2.embed));
  CHECK(std::get<QuantizedEmbedding>(n2.embed).quant() == Quant::mxfp4());
  CHECK(std::holds_alternative<Linear>(n2.proj));
}

TEST_CASE("QLoRA: adapter gradients through a quantized base equal those through its dequantized base (float64)") {
  random::seed(3);
  Net q{Embedding(64, 128), Linear(128, 128)};
  q.to(DType::f64);
  quantize(q, Quant::affine(64, 4), [](const std::string& p) { return p == "proj"; });
  // the same model with the base dequantized, then both get the same adapters
  Net d = q;
  d.proj = std::get<QuantizedLinear>(q.proj).dequantized();
  random::seed(4);
  q.proj = LoraLinear::from_base(std::get<QuantizedLinear>(q.proj), 4).scale(2.0);
  random::seed(4);
  d.proj = LoraLinear::from_base(std::get<Linear>(d.proj), 4).scale(2.0);
  for (Net* n : {&q, &d}) {  // a nonzero B, so gradients reach A too
    auto& l = std::get<LoraLinear>(n->proj);
    l.lora_b.value = nn::test::random_tensor(l.lora_b.shape(), DType::f64, 9);
  }
  const Tensor ids = Tensor::from<std::int64_t>(Shape{2, 5}, {1, 5, 9, 63, 0, 2, 2, 7, 40, 33});
  const Tensor tgt = Tensor::from<std::int64_t>(Shape{2, 5}, {5, 9, 63, 0, 2, 2, 7, 40, 33, 1});
  auto loss = [&](GTape<cpu>& tp, const Net& m) { return cross_entropy(tp, m(tp, tp.input(ids)), tp.input(tgt)); };
  auto [lq, gq] = value_and_grad(q, loss);
  auto [ld, gd] = value_and_grad(d, loss);
  CHECK(std::abs(lq.item() - ld.item()) < 1e-12 * std::abs(ld.item()));
  const auto& aq = std::get<LoraLinear>(gq.proj);
  const auto& ad = std::get<LoraLinear>(gd.proj);
  CHECK(rel_err(aq.lora_a.value, ad.lora_a.value) < 1e-12);
  CHECK(rel_err(aq.lora_b.value, ad.lora_b.value) < 1e-12);
  CHECK(q.num_trainable() == 64 * 128 + 2 * 128 * 4);  // the embedding and the adapters
}

TEST_CASE("LoraLinear over a quantized base fuses as mlx-lm: dequantized, or quantized again in the base's format") {
  random::seed(5);
  Linear base(128, 64);
  QuantizedLinear qb = QuantizedLinear::from_linear(base, Quant::affine(32, 4));
  LoraLinear l = LoraLinear::from_base(qb, 8).scale(3.0);
  l.lora_b.value = nn::test::random_tensor(l.lora_b.shape(), DType::f32, 2);
  CHECK(l.quantized());
  // fused(): W = dequant(Wq) + (scale b^T) a^T
  const Linear f = l.fused();
  const Tensor w0 = dequantize(qb.matrix());
  double worst = 0;
  for (std::int64_t o = 0; o < 64; ++o)
    for (std::int64_t i = 0; i < 128; ++i) {
      double d = 0;
      for (std::int64_t r = 0; r < 8; ++r) d += 3.0 * l.lora_b.value.item(r * 64 + o) * l.lora_a.value.item(i * 8 + r);
      worst = std::max(worst, std::abs(f.weight.value.item(o * 128 + i) - (w0.item(o * 128 + i) + d)));
    }
  CHECK(worst < 1e-5);
  // fused_quantized(): the same merge quantized again in affine 32/4, which is quantize(fused())
  const QuantizedLinear fq = l.fused_quantized();
  CHECK(fq.quant() == Quant::affine(32, 4));
  const QuantizedMatrix m = quantize(f.weight.value, Quant::affine(32, 4));
  CHECK(std::memcmp(fq.weight.value.raw(), m.weight.raw(), m.weight.nbytes()) == 0);
  nn::test::check_error([&] { LoraLinear::from_base(base, 4).fused_quantized(); }, {"LoraLinear", "full-precision"});
}

TEST_CASE("a compiled QLoRA step records again when the base's quantization changes") {
  random::seed(6);
  Net net{Embedding(64, 128), Linear(128, 128)};
  quantize(net, Quant::affine(64, 4), [](const std::string& p) { return p == "proj"; });
  net.freeze();
  net.proj = LoraLinear::from_base(std::get<QuantizedLinear>(net.proj), 4);
  Sgd<> opt(0.0);
  const Tensor ids = Tensor::from<std::int64_t>(Shape{1, 3}, {1, 2, 3}), tgt = Tensor::from<std::int64_t>(Shape{1, 3}, {2, 3, 4});
  auto step = compile<2>(net, opt, [](GTape<cpu>& tp, const Net& m, GVar x, GVar t) { return cross_entropy(tp, m(tp, x), t); });
  const double a = step(ids, tgt).item();
  step(ids, tgt);
  CHECK(step.recordings() == 1);
  // the same layer, its base now 8-bit: a new structure (NN_STATIC bits, new buffers)
  auto& l = std::get<LoraLinear>(net.proj);
  l.base = QuantizedLinear::from_linear(std::get<QuantizedLinear>(l.base).dequantized(), Quant::affine(64, 8));
  const double b = step(ids, tgt).item();
  CHECK(step.recordings() == 2);
  CHECK(a != b);
}

TEST_CASE("the README's quantization snippet compiles and runs") {
  random::seed(8);
  Linear linear(128, 64);
  Embedding embedding(100, 64);
  Net model{Embedding(64, 128), Linear(128, 128)};
  const Tensor w = linear.weight.value;
  GTape<cpu> tp;
  GVar x = tp.input(nn::test::random_tensor(Shape{3, 128}, DType::f32, 1));
  // (the README's block, verbatim from here)
  nn::QuantizedMatrix q = nn::quantize(w, nn::Quant::affine(64, 4));  // or quantize(w, 64, 4)
  nn::Tensor back = nn::dequantize(q);                              // mx.dequantize
  GVar y = nn::quantized_matmul(tp, x, tp.constant(q.weight), tp.constant(q.scales),
                                tp.constant(q.biases), q.q);        // x @ dequant(W)^T

  auto ql = nn::QuantizedLinear::from_linear(linear);               // affine 64/4, MLX's default
  auto q8 = nn::QuantizedLinear::from_linear_with(linear, nn::Quant::affine(32, 8));
  auto qe = nn::QuantizedEmbedding::from_embedding(embedding, nn::Quant::mxfp4());
  nn::quantize(model, 64, 4);                 // every Linear / Embedding leaf held in a std::variant
  nn::quantize(model, nn::Quant::affine(), [](const std::string& path) { return path != "lm_head"; });
  auto qlora = nn::LoraLinear::from_base(ql, 8);                    // LoRA over the 4-bit base
  nn::QuantizedLinear merged = qlora.fused_quantized();              // mlx_lm.fuse; fused(): full precision
  // (end of the README's block)
  CHECK(tp.shape(y) == Shape{3, 64});
  CHECK(back.shape() == w.shape());
  CHECK(q8.quant() == Quant::affine(32, 8));
  CHECK(qe.quant() == Quant::mxfp4());
  CHECK(merged.quant() == Quant::affine(64, 4));
  CHECK(std::holds_alternative<QuantizedLinear>(model.proj));
}

}  // namespace quant_modules
