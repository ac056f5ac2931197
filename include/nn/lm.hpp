// SPDX-License-Identifier: MIT OR Apache-2.0
// The LLM kit's umbrella: nn's core plus nn::lm (Llama / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / SmolLM decoders, Hugging
// Face and GGUF loading, BPE tokenizers (byte-level and SentencePiece-style), chat templates,
// JSONL data, LoRA / DoRA by path and adapter files).
// Kept out of <nn/nn.hpp> so a program that only trains its own model does not compile it.
#pragma once

#include "nn.hpp"
#include "lm/config.hpp"
#include "lm/model.hpp"
#include "lm/gguf.hpp"
#include "lm/load.hpp"
#include "lm/tokenizer.hpp"
#include "lm/chat_template.hpp"
#include "lm/data.hpp"
#include "lm/adapters.hpp"
#include "lm/pretrained.hpp"
#include "lm/gguf_write.hpp"
#include "lm/gguf_quantize.hpp"
#include "lm/gguf_export.hpp"
