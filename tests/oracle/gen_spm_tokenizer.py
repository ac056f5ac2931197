#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records Hugging Face `tokenizers` ids for SentencePiece-style BPE ("llama" tokenizer model:
Llama 2, Mistral, TinyLlama, Gemma) so tests/lm/tokenizer.test.cpp can check nn::lm::Tokenizer.

    pip install sentencepiece tokenizers numpy unicodedata2==16.0.0
    apt-get install -y bible-kjv
    python3 tests/oracle/gen_spm_tokenizer.py              # writes tests/fixtures/lm/tokenizer/spm_*
    python3 tests/oracle/gen_spm_tokenizer.py --full DIR   # also the ~1.3 MB check, written to DIR
    NN_TOKENIZER_FULL_DIR=DIR ./test_lm                    # ... which the test then runs

The model: no SentencePiece model of a real LLM ships in a package here, so one is trained with
`sentencepiece` itself, with Llama 2's settings (BPE, byte_fallback, identity normalization,
add_dummy_prefix, no extra-whitespace removal, split_digits, whitespace-only pieces allowed; ids 0
<unk>, 1 <s>, 2 </s>, then the 256 <0xXX> byte pieces), vocabulary 3000, on gen_tokenizer.py's
corpus minus its category sweep, so rare characters go to byte fallback.

Two files are made from it, as the tools people use make them:
  spm_tokenizer.json  the tokenizer.json of the Llama 2 / TinyLlama repositories: normalizer
                      Prepend("▁") + Replace(" ", "▁"), BPE with byte_fallback and fuse_unk, merges
                      from the vocabulary ranked by the merged piece's score (transformers'
                      SentencePieceExtractor rule), decoder Replace/ByteFallback/Fuse/Strip,
                      post-processor "<s> $A"; plus special added tokens <|im_start|> <|im_end|>.
                      Variants (overrides applied by the test): "metaspace" (no normalizer,
                      Metaspace pre-tokenizer with prepend_scheme "first", as non-legacy
                      conversions write), "metaspace_split" (the older Metaspace that splits at
                      each ▁ and always prepends), "gemma" (Replace only: no dummy prefix, no Strip).
  spm_gguf.json       the tokenizer.ggml.* metadata convert_hf_to_gguf.py writes for it (model
                      "llama", tokens, scores, token types, add_space_prefix, bos/eos/unk): the
                      test checks llama.cpp's SPM algorithm (merge the adjacent pair whose joined
                      text is the best-scoring token) against the "llama" variant's HF ids.

The script also checks `sentencepiece`'s own encode against the "llama" variant on every probe
and chunk without special tokens, and stops if they differ.
"""
import argparse
import io
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_tokenizer as g  # noqa: E402  (corpus, probes, digests: one definition)

import sentencepiece as spm  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

OUT = os.path.join(HERE, "..", "fixtures", "lm", "tokenizer")
SP = "\u2581"
CHAT = ["<|im_start|>", "<|im_end|>"]


def train_model(text):
    lines = [line for line in text.split("\n") if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=3000, byte_fallback=True,
        character_coverage=0.9995, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        max_sentencepiece_length=16, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def tokenizer_json(sp):
    """Llama 2's tokenizer.json layout for the model (merges by the extractor's rule)."""
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    normal = {sp.id_to_piece(i): (sp.get_score(i), i) for i in range(n) if not (
        sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))}
    ranked = []
    for tok, (score, i) in normal.items():
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in normal and right in normal:
                ranked.append((-score, i, left, right))
    merges = [[a, b] for _, _, a, b in sorted(ranked)]
    added = [{"id": i, "content": sp.id_to_piece(i), "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i in range(3)]
    added += [{"id": n + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": True} for k, c in enumerate(CHAT)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SP}, {"type": "Replace", "pattern": {"String": " "}, "content": SP}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SP}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def variants():
    dec_no_strip = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": SP}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    return {
        "llama": {},
        "metaspace": {"normalizer": None,
                      "pre_tokenizer": {"type": "Metaspace", "replacement": SP, "prepend_scheme": "first", "split": False}},
        "metaspace_split": {"normalizer": None,
                            "pre_tokenizer": {"type": "Metaspace", "replacement": SP, "prepend_scheme": "always", "split": True},
                            "decoder": {"type": "Metaspace", "replacement": SP, "prepend_scheme": "always", "split": True}},
        "gemma": {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SP}, "decoder": dec_no_strip},
    }


def gguf_metadata(sp):
    """tokenizer.ggml.* as convert_hf_to_gguf.py's SentencePiece vocabulary writes it."""
    n = sp.get_piece_size()
    types = []
    for i in range(n):
        t = 1
        if sp.is_unknown(i): t = 2
        elif sp.is_control(i): t = 3
        elif sp.is_unused(i): t = 5
        elif sp.is_byte(i): t = 6
        types.append(t)
    return {"model": "llama", "tokens": [sp.id_to_piece(i) for i in range(n)] + CHAT,
            "scores": [sp.get_score(i) for i in range(n)] + [0.0] * len(CHAT), "token_type": types + [3] * len(CHAT),
            "bos": 1, "eos": 2, "unk": 0, "add_bos": True, "add_eos": False, "add_space_prefix": True}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", help="also write the ~1.3 MB corpus check into this folder")
    args = ap.parse_args()

    sections = g.build_corpus(1_150_000)
    sp = train_model("".join(t for n, t in sections if n != "sweep"))
    base = tokenizer_json(sp)
    sample_texts = json.load(open(os.path.join(OUT, "corpus_sample.json"), encoding="utf-8"))["chunks"]
    probe_texts = g.PROBES + ["<|im_start|>user\n Hi there<|im_end|>\n<|im_start|>assistant\n", " ▁x ▁▁y", "▁", "</s><s> a", "x<unk>y <unk>",
                              "\u0000\ufffd\U0010ffff", "a" + "\u00e9" * 40]

    def record(tk, texts):
        out = []
        for t in texts:
            e = tk.encode(t, add_special_tokens=True).ids
            n = tk.encode(t, add_special_tokens=False).ids
            tk.encode_special_tokens = True
            s = tk.encode(t, add_special_tokens=False).ids
            tk.encode_special_tokens = False
            out.append({"text": t, "ids": e, "ids_no_special": n, "ids_text_specials": s})
        return out

    rnd = random.Random(7)
    n_vocab = sp.get_piece_size() + len(CHAT)
    expected = {"tokenizers_version": tokenizers.__version__, "sentencepiece_version": spm.__version__,
                "vocab": n_vocab, "merges": len(base["model"]["merges"]), "variants": {}, "gguf": gguf_metadata(sp)}
    llama_tk = None
    for name, ov in variants().items():
        j = dict(base)
        j.update(ov)
        tk = Tokenizer.from_str(json.dumps(j))
        if name == "llama":
            llama_tk = tk
        cases = []
        for k in range(60):
            ids = [rnd.randrange(n_vocab) for _ in range(rnd.randrange(1, 12))]
            if k % 2 == 0:  # runs of byte tokens, which may or may not form valid UTF-8
                at = rnd.randrange(len(ids) + 1)
                s = rnd.choice(["é", "你", "👍", "\n", " "]).encode()
                cut = s[: rnd.randrange(1, len(s) + 1)]
                ids[at:at] = [3 + b for b in cut]
            cases.append({"ids": ids, "text": tk.decode(ids, skip_special_tokens=False),
                          "text_skip_special": tk.decode(ids, skip_special_tokens=True)})
        expected["variants"][name] = {"overrides": ov, "probes": record(tk, probe_texts),
                                      "chunks": g.digest(tk, sample_texts), "decode": cases}
        print(f"{name}: {len(probe_texts)} probes, {len(sample_texts)} chunks", file=sys.stderr)

    # sentencepiece itself against the "llama" file (text without added tokens).
    def sp_agrees(texts):
        bad = 0
        for t in texts:
            if any(c in t for c in CHAT + ["<s>", "</s>", "<unk>"]):
                continue
            if sp.encode(t) != llama_tk.encode(t, add_special_tokens=False).ids and t:
                bad += 1
        return bad
    bad = sp_agrees(probe_texts + sample_texts)
    if bad:
        sys.exit(f"sentencepiece and the tokenizer.json disagree on {bad} texts")
    print("sentencepiece agrees with the tokenizer.json on every probe and chunk", file=sys.stderr)

    with open(os.path.join(OUT, "spm_tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(base, f, ensure_ascii=False)
    with open(os.path.join(OUT, "spm_expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False)

    if args.full:
        os.makedirs(args.full, exist_ok=True)
        texts = []
        for _, text in sections:
            texts += g.chunks_of(text)
        bad = sp_agrees(texts)
        if bad:
            sys.exit(f"full corpus: sentencepiece and the tokenizer.json disagree on {bad} chunks")
        full = {"bytes": sum(len(t.encode()) for t in texts), "gguf": expected["gguf"], "variants": {}}
        for name, ov in variants().items():
            j = dict(base)
            j.update(ov)
            full["variants"][name] = {"overrides": ov, "chunks": g.digest(Tokenizer.from_str(json.dumps(j)), texts)}
        with open(os.path.join(args.full, "spm_tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(base, f, ensure_ascii=False)
        with open(os.path.join(args.full, "spm_corpus.json"), "w", encoding="utf-8") as f:
            json.dump({"chunks": texts}, f, ensure_ascii=False)
        with open(os.path.join(args.full, "spm_expected.json"), "w", encoding="utf-8") as f:
            json.dump(full, f, ensure_ascii=False)
        print(f"full check: {full['bytes']} bytes in {len(texts)} chunks, sentencepiece agrees; {args.full}", file=sys.stderr)

    for fn in ("spm_tokenizer.json", "spm_expected.json"):
        print(f"  {fn}: {os.path.getsize(os.path.join(OUT, fn))} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
