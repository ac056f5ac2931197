// SPDX-License-Identifier: MIT OR Apache-2.0
// Development check (not CI; tests/interop/check_gguf_real.sh builds and runs it): every tensor
// of a GGUF file as nn reads it, in float32, into one safetensors file for
// check_gguf_real.py to hold against gguf-py's `dequantize`.
//
//   gguf_dequant_dump FILE.gguf OUT.safetensors
//
// For a type nn keeps quantized (GgufFile::keeps_quantized: Q4_0 ... Q8_0, Q2_K ... Q6_K), two
// entries: "<name>" is the matrix as load_gguf(..., keep_quantized = true) holds it (the blocks
// repacked into affine groups, GgufFile::quantized) then nn::dequantize'd, and "<name>.direct" is
// GgufFile::tensor's block decoder (the --dequantize path). Other types: "<name>" only. The
// metadata names each tensor's GGUF type ("<name>": "Q4_K").
#include <cstdio>
#include <exception>

#include <nn/io/safetensors.hpp>
#include <nn/lm/gguf.hpp>
#include <nn/quant.hpp>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s FILE.gguf OUT.safetensors\n", argv[0]);
    return 2;
  }
  try {
    const nn::lm::GgufFile f(argv[1]);
    nn::NamedTensors out;
    nn::SafetensorsMetadata meta;
    for (const nn::lm::GgufTensorInfo& t : f.tensors()) {
      meta[t.name] = t.type_name();
      if (nn::lm::GgufFile::keeps_quantized(t.type) && t.ne.size() == 2) {
        out.emplace_back(t.name, nn::dequantize(f.quantized(t), nn::DType::f32));
        out.emplace_back(t.name + ".direct", f.tensor(t, nn::DType::f32));
      } else {
        out.emplace_back(t.name, f.tensor(t, nn::DType::f32));
      }
    }
    nn::save_safetensors(argv[2], out, meta);
    std::printf("gguf_dequant_dump: %zu tensors of %s -> %s\n", f.tensors().size(), argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gguf_dequant_dump: %s\n", e.what());
    return 1;
  }
  return 0;
}
