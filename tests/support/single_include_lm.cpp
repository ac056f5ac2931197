// SPDX-License-Identifier: MIT OR Apache-2.0
// The LLM kit's single header (single_include/nn/nn_lm.hpp, on top of nn.hpp) compiles alone and
// runs: a tiny random Llama's logits have the right shape and are finite. CTest: single_include_lm.
#include <nn/nn_lm.hpp>  // single_include/ is the only nn include path

#include <cmath>
#include <cstdio>

int main() {
  nn::lm::ModelConfig cfg;
  cfg.hidden_size = 16;
  cfg.intermediate_size = 32;
  cfg.num_hidden_layers = 2;
  cfg.num_attention_heads = 4;
  cfg.num_key_value_heads = 2;
  cfg.head_dim = 4;
  cfg.vocab_size = 24;
  nn::random::seed(0);
  nn::lm::CausalLM model(cfg);
  nn::GTape<nn::cpu> tp;
  nn::Tensor ids = nn::Tensor::zeros({1, 5}, nn::DType::i64);
  const nn::Tensor& logits = tp.value(model.logits(tp, tp.constant(ids)));
  const bool ok = logits.shape() == nn::Shape{1, 5, 24} && std::isfinite(logits.item(7));
  std::printf("single_include_lm: logits %s %s\n", logits.shape().str().c_str(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
