#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records Hugging Face `tokenizers` ids so tests/lm/tokenizer.test.cpp can check nn::lm::Tokenizer.

    pip install tokenizers numpy unicodedata2==16.0.0
    apt-get install -y bible-kjv                       # English prose for the corpus
    python3 tests/oracle/gen_tokenizer.py              # rewrites tests/fixtures/lm/tokenizer/*
    python3 tests/oracle/gen_tokenizer.py --full DIR   # also the ~1 MB check, written to DIR:
    NN_TOKENIZER_FULL_DIR=DIR ./test_lm                # ... which the test then runs

Tokenizers:
  trained   a byte-level BPE (vocab 2000) trained here with `tokenizers` on the corpus, with
            special tokens <|endoftext|> <|im_start|> <|im_end|> <mask> (lstrip) and non-special
            added tokens "<sep>" (normalized) and "user name"; saved twice, merges as "a b"
            strings (trained_string_merges.json) and as ["a", "b"] pairs
            (trained_pair_merges.json). Variants swap in the pre-tokenizer, normalizer and
            post-processor of GPT-2, Qwen2 (Split regex + NFC), Llama-3 (Split regex,
            ignore_merges, template BOS/EOS), SmolLM (Digits + ByteLevel) and RoBERTa (prefix
            space), plus two that exercise every Split behavior, \w and WhitespaceSplit; the
            test applies each variant's overrides to the base file.
  real      GPT-2, Qwen2 and Llama-3: no tokenizer.json of a real model ships in a package here,
            but llama.cpp's vocabulary-only GGUF files do (vendor/llama.cpp/models/ggml-vocab-*
            inside the llama-cpp-python sdist). Their tokens, merges and token types are turned
            back into the tokenizer.json each model's Hugging Face repository has (normalizer,
            pre-tokenizer regex, post-processor as published), and the result is checked
            against the ids llama.cpp recorded from the real Hugging Face tokenizers
            (ggml-vocab-*.gguf.out): all must agree or the script stops. The committed fixtures
            keep only the vocabulary and merges the recorded texts reach (every merge producing
            a needed token, recursively): removing merges that are never applied cannot change
            any result, and the script checks the pruned files give the full files' ids.

Ids: short texts (probes) are recorded in full; the corpus sample (chunks of prose, code,
numbers, whitespace runs, eight scripts, emoji, a sweep of every general-category run) is recorded
as (count, FNV-1a 64 of the ids as little-endian uint32) per chunk, to keep the fixture small.
Decoding is recorded for random id sequences (which cut UTF-8 sequences) with and without
skip_special_tokens.
"""
import argparse
import gettext
import glob
import hashlib
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile

try:  # the Unicode version of tokenizers' Oniguruma (see gen_unicode_tables.py)
    import unicodedata2 as unicodedata
    assert unicodedata.unidata_version == "16.0.0"
except (ImportError, AssertionError):
    sys.exit("pip install unicodedata2==16.0.0")

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "lm", "tokenizer")
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CACHE = os.path.join(tempfile.gettempdir(), "nn_tokenizer_oracle")

GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

SAMPLE_BUDGET = 275_000   # bytes of corpus text committed (the JSON file is a little larger)
CHUNK = 2048              # corpus chunk size (bytes, cut at line ends)


# ---- the corpus -----------------------------------------------------------------------------

def bible_text(n_bytes):
    """KJV chapters through the bible-kjv package's `bible` program, in a fixed order."""
    books = ["Gen", "Exo", "Ruth", "Job", "Psa", "Pro", "Ecc", "Isa", "Mat", "Mar", "Luk", "Joh", "Act", "Rom", "Rev"]
    out, size = [], 0
    for book in books:
        for ch in range(1, 151):
            try:
                r = subprocess.run(["bible", f"{book}{ch}:1-200"], capture_output=True, text=True, check=True)
            except FileNotFoundError:
                sys.exit("bible not found: apt-get install -y bible-kjv")
            except subprocess.CalledProcessError:
                break
            if not r.stdout.strip() or "not found" in r.stdout:
                break
            out.append(r.stdout)
            size += len(r.stdout.encode())
            if size >= n_bytes:
                return "".join(out)
    return "".join(out)


def file_text(paths, n_bytes):
    out, size = [], 0
    for p in paths:
        if not os.path.exists(p):
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            t = f.read()
        out.append(t)
        size += len(t.encode())
        if size >= n_bytes:
            break
    return "".join(out)


LANGS = ["de", "fr", "es", "pt_BR", "pl", "cs", "vi", "tr", "ru", "uk", "bg", "el", "ar", "fa", "he",
         "zh_CN", "zh_TW", "ja", "ko", "hi", "th", "ka"]


def translations(n_bytes_per_lang):
    """Translated messages of Debian's own tools (gettext catalogs), per language, sorted."""
    out = []
    for lang in LANGS:
        msgs = []
        for dom in ["apt", "dpkg", "coreutils", "grep", "sed", "bash", "iso_3166-1", "iso_639-3"]:
            path = f"/usr/share/locale/{lang}/LC_MESSAGES/{dom}.mo"
            if not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                cat = gettext.GNUTranslations(f)._catalog
            for k in sorted(cat, key=str):
                v = cat[k]
                if isinstance(v, str) and v and k:
                    msgs.append(v)
        rnd = random.Random(lang)
        rnd.shuffle(msgs)
        size, keep = 0, []
        for m in msgs:
            keep.append(m)
            size += len(m.encode())
            if size >= n_bytes_per_lang:
                break
        out.append(f"== {lang} ==\n" + "\n".join(keep) + "\n")
    return "".join(out)


def numbers_text(n_bytes, seed=1):
    r = random.Random(seed)
    lines, size = [], 0
    while size < n_bytes:
        k = r.randrange(16)
        if k == 0: s = str(r.randrange(10 ** r.randrange(1, 40)))
        elif k == 1: s = f"{r.uniform(-1e6, 1e6):.{r.randrange(0, 9)}f}"
        elif k == 2: s = f"{r.randrange(10 ** 9):,}"
        elif k == 3: s = f"{r.randrange(1900, 2100)}-{r.randrange(1, 13):02d}-{r.randrange(1, 29):02d}T{r.randrange(24):02d}:{r.randrange(60):02d}:{r.randrange(60):02d}Z"
        elif k == 4: s = f"+{r.randrange(1, 99)} ({r.randrange(100, 999)}) {r.randrange(100, 999)}-{r.randrange(1000, 9999)}"
        elif k == 5: s = f"0x{r.randrange(16 ** 12):x} 0b{r.randrange(2 ** 16):b} 0o{r.randrange(8 ** 8):o}"
        elif k == 6: s = f"{r.uniform(0, 10):.3e} {r.uniform(0, 1):.2E}"
        elif k == 7: s = f"v{r.randrange(10)}.{r.randrange(30)}.{r.randrange(100)}-rc{r.randrange(5)}"
        elif k == 8: s = f"${r.randrange(10 ** 7):,}.{r.randrange(100):02d} {r.randrange(100)}% €{r.randrange(1000)},{r.randrange(100):02d}"
        elif k == 9: s = "".join(chr(0x660 + int(d)) for d in str(r.randrange(10 ** 8)))      # Arabic-Indic
        elif k == 10: s = "".join(chr(0xFF10 + int(d)) for d in str(r.randrange(10 ** 6)))    # fullwidth
        elif k == 11: s = f"x² + y³ = z⁴; ½ + ¼ = ¾; Ⅻ Ⅳ ⅷ; ①②③; {r.randrange(10)}⁄{r.randrange(1, 10)}"
        elif k == 12: s = " ".join(str(r.randrange(1000)) for _ in range(r.randrange(1, 12)))
        elif k == 13: s = f"{r.randrange(256)}.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(256)}:{r.randrange(65536)}"
        elif k == 14: s = f"[{', '.join(f'{r.gauss(0, 1):.4f}' for _ in range(r.randrange(2, 8)))}]"
        else: s = "".join(chr(0x966 + int(d)) for d in str(r.randrange(10 ** 6))) + " " + str(r.randrange(10 ** 6))
        lines.append(s)
        size += len(s.encode()) + 1
    return "\n".join(lines) + "\n"


def whitespace_text(n_bytes, seed=2):
    r = random.Random(seed)
    words = ["alpha", "beta", "if", "x", "return", "42", "(", ")", "{", "}", ";", "über", "мир", "的", "'s", "don't"]
    spaces = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", " \t ", "\u00a0", "\u3000", "\u2028",
              "\u2003", "\x0b", "\x0c", "\x85", "    ", " " * 16, "\t \t", "\n\n\n\n", " \r\n\r\n "]
    parts, size = [], 0
    while size < n_bytes:
        k = r.randrange(4)
        if k == 0:
            s = r.choice(spaces) * r.randrange(1, 4) + r.choice(words)
        elif k == 1:
            s = r.choice(words) + " " * r.randrange(1, 40) + r.choice(words)
        elif k == 2:
            s = "\n" + "\t" * r.randrange(0, 5) + " " * r.randrange(0, 9) + r.choice(words) + " " * r.randrange(0, 3)
        else:
            s = r.choice(words) + r.choice(spaces) + r.choice(spaces)
        parts.append(s)
        size += len(s.encode())
    return "".join(parts) + "\n"


def emoji_text(n_bytes, seed=3):
    r = random.Random(seed)
    base = [chr(c) for c in list(range(0x1F600, 0x1F650)) + list(range(0x1F300, 0x1F5FF, 7)) + list(range(0x1F900, 0x1F9FF, 5))
            + list(range(0x2600, 0x26FF, 11)) + list(range(0x1FA70, 0x1FAF8, 3))]
    people = ["\U0001F44D", "\U0001F44B", "\U0001F9D1", "\U0001F469", "\U0001F468", "\U0001F476", "\U0001F64F", "\u270B"]
    tones = [chr(c) for c in range(0x1F3FB, 0x1F400)]
    zwj = ["\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466", "\U0001F469\U0001F3FD\u200D\U0001F4BB",
           "\U0001F3F3\uFE0F\u200D\U0001F308", "\U0001F9D1\U0001F3FF\u200D\U0001F91D\u200D\U0001F9D1\U0001F3FB",
           "\u2764\uFE0F\u200D\U0001F525", "\U0001F441\uFE0F\u200D\U0001F5E8\uFE0F", "\U0001F415\u200D\U0001F9BA"]
    flags = ["\U0001F1E9\U0001F1EA", "\U0001F1EF\U0001F1F5", "\U0001F1FA\U0001F1F8", "\U0001F1E7\U0001F1F7", "\U0001F1FA\U0001F1E6"]
    keycaps = [f"{d}\uFE0F\u20E3" for d in "0123456789#*"]
    words = ["great", "party", "ok", "love it", "Wow", "done", "привет", "好", "yes!", "lol"]
    parts, size = [], 0
    while size < n_bytes:
        k = r.randrange(6)
        if k == 0: s = r.choice(words) + " " + "".join(r.choice(base) for _ in range(r.randrange(1, 5)))
        elif k == 1: s = r.choice(people) + r.choice(tones) + " " + r.choice(words)
        elif k == 2: s = r.choice(zwj) + r.choice(["", " ", "!", r.choice(words)])
        elif k == 3: s = " ".join(r.choice(flags) for _ in range(r.randrange(1, 4)))
        elif k == 4: s = r.choice(keycaps) + r.choice(base) + "\uFE0F"
        else: s = r.choice(words) + r.choice(base) + r.choice(words)
        parts.append(s)
        size += len(s.encode()) + 1
    return "\n".join(parts) + "\n"


def tricky_text(seed=4):
    """Contractions, NFC-sensitive text, special tokens in running text, markup, URLs."""
    r = random.Random(seed)
    items = [
        "don't won't I'LL you'RE they'Ve she'd He'S it'ſ we'M 's 'S '' ’s ‘quoted’ \"dq\"",
        "e\u0301cole cafe\u0301 A\u030a \u212b \u1100\u1161\u11a8 \u0041\u0323\u0307 \u1e0b\u0323 q\u0307\u0323 \uFB01 \u00C5",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more <|im_sta <|im_end| <|endoftext|><|endoftext|> a <mask> b  <mask>c <sep> user name x",
        "https://example.com/path?q=1&r=two#frag mailto:someone@example.org ftp://[::1]:8080/",
        "# Title\n\n* item **bold** _it_ `code` [link](http://x.y)\n> quote\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
        '{"key": [1, 2.5, null, true], "nested": {"é": "\\u00e9"}}',
        "ＡＢＣ ｆｕｌｌｗｉｄｔｈ ﾊﾝｶｸ \u200b\u200c\u200d \ufeff \x00\x01\x1f\x7f \u00ad soft\u00adhyphen",
        "a" * 300 + " " + "9" * 120 + " " + "ab" * 100,
        "Mr. O'Neil's dog—the 'best' one… it’s 3:45pm; rock’n’roll & co. (c) ® ™ § ¶ † ‡ • ′ ″",
    ]
    out = []
    for _ in range(6):
        r.shuffle(items)
        out.extend(items)
    return "\n".join(out) + "\n"


def category_sweep(every=1):
    """The first code point of every general-category run (and its end), each between letters
    and digits, so the regex's character classes are checked against Oniguruma's."""
    out = []
    prev = None
    k = 0
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        cat = unicodedata.category(chr(cp))
        if cat != prev:
            prev = cat
            k += 1
            if k % every:
                continue
            for c in (cp, cp + 1):
                if c < 0x110000 and not (0xD800 <= c < 0xE000):
                    ch = chr(c)
                    out.append(f"a{ch}{ch} {ch}1{ch}\t{ch}\n")
    return "".join(out)


def cpp_headers():
    base = "/usr/include/c++/12/bits/"
    return [base + n for n in ["stl_vector.h", "stl_tree.h", "unique_ptr.h", "shared_ptr_base.h", "basic_string.h",
                               "stl_algo.h", "hashtable.h", "std_function.h"]]


def build_corpus(total):
    """Sections (name, text), about `total` bytes together; deterministic for a given Debian."""
    share = {"prose": 0.28, "licenses": 0.10, "code": 0.20, "numbers": 0.07, "whitespace": 0.05,
             "multilingual": 0.20, "emoji": 0.05, "tricky": 0.0, "sweep": 0.0}
    licenses = ["/usr/share/common-licenses/" + n for n in ["GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "Artistic"]]
    py = sorted(glob.glob("/usr/lib/python3*/json/*.py")) + sorted(glob.glob("/usr/lib/python3*/textwrap.py"))
    sections = [
        ("prose", bible_text(int(total * share["prose"]))),
        ("licenses", file_text(licenses, int(total * share["licenses"]))),
        ("code", file_text(cpp_headers(), int(total * share["code"] * 0.8)) + file_text(py, int(total * share["code"] * 0.2))),
        ("numbers", numbers_text(int(total * share["numbers"]))),
        ("whitespace", whitespace_text(int(total * share["whitespace"]))),
        ("multilingual", translations(int(total * share["multilingual"] / len(LANGS)))),
        ("emoji", emoji_text(int(total * share["emoji"]))),
        ("tricky", tricky_text()),
        ("sweep", category_sweep()),
    ]
    return sections


def chunks_of(text, size=CHUNK):
    """Cuts text into pieces of about `size` UTF-8 bytes, at line ends where there are any."""
    out, cur, cur_size = [], [], 0
    for line in text.splitlines(keepends=True):
        while len(line.encode()) > size:  # a very long line: cut at a character boundary
            b = line.encode()[:size].decode("utf-8", errors="ignore")
            out.append("".join(cur) + b) if cur else out.append(b)
            cur, cur_size = [], 0
            line = line[len(b):]
        cur.append(line)
        cur_size += len(line.encode())
        if cur_size >= size:
            out.append("".join(cur))
            cur, cur_size = [], 0
    if cur:
        out.append("".join(cur))
    return out


# ---- ids ------------------------------------------------------------------------------------

def fnv1a(ids):
    h = 0xCBF29CE484222325
    for i in ids:
        for b in int(i).to_bytes(4, "little", signed=True):
            h ^= b
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def digest(tk, chunks):
    encs = tk.encode_batch(chunks, add_special_tokens=True)
    return [[len(e.ids), fnv1a(e.ids)] for e in encs]


# ---- the trained tokenizer ------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train(text):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([text], trainer=trainer)
    tk.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tk.add_tokens([AddedToken("<sep>", normalized=True, special=False), AddedToken("user name", normalized=False, special=False)])
    j = json.loads(tk.to_str())
    j["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return j


def bytelevel(prefix=False, trim=True, regex=True):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": trim, "use_regex": regex}


def split(rx):
    return {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}


def template(bos, bos_id, eos=None, eos_id=None):
    single = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    specials = {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}
    if eos:
        single.append({"SpecialToken": {"id": eos, "type_id": 0}})
        specials[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    return {"type": "TemplateProcessing", "single": single, "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": specials}


def variants(base):
    ids = {a["content"]: a["id"] for a in base["added_tokens"]}
    return {
        "gpt2": {},
        "qwen2": {"normalizer": {"type": "NFC"},
                  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split(QWEN2_RE), bytelevel(False, False, False)]}},
        "llama3": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split(LLAMA3_RE), bytelevel(False, True, False)]},
                   "post_processor": {"type": "Sequence", "processors": [
                       bytelevel(True, False, True),
                       template("<|im_start|>", ids["<|im_start|>"], "<|im_end|>", ids["<|im_end|>"])]},
                   "model.ignore_merges": True},
        "smollm": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, bytelevel(False, True, True)]}},
        # Split behaviors and the simple pre-tokenizers, none of which the models above use.
        "behaviors": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithPrevious", "invert": False},
            {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "MergedWithNext", "invert": False},
            {"type": "Split", "pattern": {"Regex": r"\p{P}"}, "behavior": "Contiguous", "invert": False},
            {"type": "Digits", "individual_digits": False},
            {"type": "Split", "pattern": {"Regex": "[aeiou]"}, "behavior": "Isolated", "invert": True},
            bytelevel(False, True, False)]}},
        "whitespace": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Split", "pattern": {"Regex": r"\w+|[^\w\s]+"}, "behavior": "Removed", "invert": True},
            {"type": "Split", "pattern": {"Regex": "x+"}, "behavior": "Removed", "invert": False},
            bytelevel(False, True, False)]},
            "lossy": True},
        "roberta": {"pre_tokenizer": bytelevel(True, True, True),
                    "post_processor": {"type": "RobertaProcessing", "sep": ["<|im_end|>", ids["<|im_end|>"]],
                                       "cls": ["<|im_start|>", ids["<|im_start|>"]], "trim_offsets": True,
                                       "add_prefix_space": True}},
    }


def apply_overrides(base, ov):
    j = json.loads(json.dumps(base))
    for k, v in ov.items():
        if k == "lossy":  # a note for the test: decode(encode(s)) != s by design
            continue
        if k.startswith("model."):
            j["model"][k[len("model."):]] = v
        else:
            j[k] = v
    return j


def string_merges(j):
    j = json.loads(json.dumps(j))
    j["model"]["merges"] = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in j["model"]["merges"]]
    return j


def pair_merges(j):
    j = json.loads(json.dumps(j))
    j["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in j["model"]["merges"]]
    return j


# ---- real tokenizers from llama.cpp's vocabulary files --------------------------------------

def llama_cpp_dir(arg):
    if arg:
        return arg
    d = os.path.join(CACHE, "llama.cpp")
    if os.path.isdir(os.path.join(d, "models")):
        return d
    os.makedirs(CACHE, exist_ok=True)
    print(f"fetching the {LLAMA_CPP_PYTHON} sdist (vocabulary GGUFs) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", CACHE,
                    LLAMA_CPP_PYTHON], check=True)
    sdist = sorted(glob.glob(os.path.join(CACHE, "llama_cpp_python-*.tar.gz")))[-1]
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers()
                   if "/vendor/llama.cpp/models/ggml-vocab-" in m.name or "/vendor/llama.cpp/gguf-py/" in m.name]
        tf.extractall(CACHE, members=members)
    top = os.path.join(CACHE, os.path.basename(sdist)[:-len(".tar.gz")], "vendor", "llama.cpp")
    os.replace(top, d)
    return d


REAL = {"gpt2": "gpt-2", "qwen2": "qwen2", "llama3": "llama-bpe"}


def real_tokenizer_json(lc, name):
    """The tokenizer.json of the model whose vocabulary llama.cpp stored in ggml-vocab-<name>.gguf."""
    sys.path.insert(0, os.path.join(lc, "gguf-py"))
    import gguf  # noqa: E402 (llama.cpp's own reader, from the same sdist)
    r = gguf.GGUFReader(os.path.join(lc, "models", f"ggml-vocab-{name}.gguf"))
    f = lambda k: r.fields[k].contents()
    toks, types, merges = f("tokenizer.ggml.tokens"), f("tokenizer.ggml.token_type"), f("tokenizer.ggml.merges")
    vocab, added = {}, []
    for i, (t, ty) in enumerate(zip(toks, types)):
        if ty == 1:
            vocab[t] = i
        elif ty == 3:  # control: the published files list these as special added tokens
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True})
        # type 4 (Qwen2's [PADnnnnnn]) only pad the embedding matrix in GGUF; not in tokenizer.json
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
             "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": list(merges)}
    j = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
         "pre_tokenizer": bytelevel(False, True, True), "post_processor": bytelevel(True, False, True),
         "decoder": bytelevel(True, True, True), "model": model}
    if name == "qwen2":
        j["normalizer"] = {"type": "NFC"}
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split(QWEN2_RE), bytelevel(False, False, False)]}
        j["post_processor"] = bytelevel(False, False, False)
        j["decoder"] = bytelevel(False, False, False)
        model["merges"] = [m.split(" ", 1) for m in merges]
    elif name == "llama-bpe":
        bos = int(f("tokenizer.ggml.bos_token_id"))
        model["ignore_merges"] = True
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split(LLAMA3_RE), bytelevel(False, True, False)]}
        j["post_processor"] = {"type": "Sequence", "processors": [bytelevel(True, False, True), template(toks[bos], bos)]}
        model["merges"] = [m.split(" ", 1) for m in merges]
    gguf_meta = {"pre": f("tokenizer.ggml.pre"), "bos": int(f("tokenizer.ggml.bos_token_id")),
                 "eos": int(f("tokenizer.ggml.eos_token_id")), "n_tokens": len(toks)}
    sys.path.pop(0)
    return j, gguf_meta


def llama_cpp_probes(lc, name):
    with open(os.path.join(lc, "models", f"ggml-vocab-{name}.gguf.inp"), encoding="utf-8") as f:
        inp = f.read().split("\n__ggml_vocab_test__\n")
    with open(os.path.join(lc, "models", f"ggml-vocab-{name}.gguf.out"), encoding="utf-8") as f:
        out = f.read().split("\n")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(inp, out)]


def bpe_trace(word, ranks):
    """GPT-2 BPE of one byte-level word: (tokens, ranks of the merges applied), lowest rank
    first and leftmost among equals, as `tokenizers` merges."""
    syms = list(word)
    used = []
    while len(syms) > 1:
        best = None
        for i in range(len(syms) - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        r, i = best
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
        used.append(r)
    return syms, used


def prune(j, tk, texts):
    """Keeps the byte alphabet, the added tokens, and the tokens and merges that encoding
    `texts` reaches (traced word by word, each trace checked against `tokenizers`). Any subset
    of merges holding every merge the texts apply gives the same ids on them: the lowest-rank
    applicable merge at each step is still there and nothing new became applicable."""
    vocab = j["model"]["vocab"]
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in j["model"]["merges"]]
    ranks = {}
    for r, (a, b) in enumerate(merges):
        ranks.setdefault((a, b), r)
    added = {a["id"] for a in j["added_tokens"]}
    ignore_merges = j["model"].get("ignore_merges", False)
    need = set(pre_tokenizers.ByteLevel.alphabet())
    keep_ranks = set()
    seen = set()
    encs = tk.encode_batch(texts, add_special_tokens=False)
    tk.encode_special_tokens = True  # the texts are also encoded with special tokens as text
    encs += tk.encode_batch(texts, add_special_tokens=False)
    tk.encode_special_tokens = False
    for enc in encs:
        words = {}
        for tok, tid, w in zip(enc.tokens, enc.ids, enc.word_ids):
            if tid in added or w is None:
                continue
            words.setdefault(w, []).append(tok)
        for toks in words.values():
            word = "".join(toks)
            if word in seen:
                continue
            seen.add(word)
            need.update(toks)
            if ignore_merges and len(toks) == 1 and word in vocab:
                continue
            got, used = bpe_trace(word, ranks)
            assert got == toks, (word, got, toks)
            keep_ranks.update(used)
            need.update(merges[r][0] + merges[r][1] for r in used)
    out = json.loads(json.dumps({k: v for k, v in j.items() if k != "model"}))
    model = {k: v for k, v in j["model"].items() if k not in ("vocab", "merges")}
    model["vocab"] = {t: vocab[t] for t in sorted(need, key=lambda t: vocab[t]) if t in vocab}
    # `tokenizers` gives an added token that is not in the model's vocabulary the id
    # len(vocab) + n, whatever the file says: with a sparse vocabulary that would renumber them,
    # so the pruned file lists them in the vocabulary too (then their ids are kept).
    for a in j["added_tokens"]:
        model["vocab"][a["content"]] = a["id"]
    model["merges"] = [merges[r] for r in sorted(keep_ranks)]
    out["model"] = model
    return out


# ---- probes ---------------------------------------------------------------------------------

PROBES = [
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n \n", "end   ", "   start", "a\u00a0b", "Hello world",
    " Hello World!", "Hello, world!\n", "don't I'LL we'RE it'ſ 'K ’s", "1234567890", "3.14159 1,000,000",
    "٣٤٥ ²³ Ⅻ ½", "👨\u200d👩\u200d👧\u200d👦", "👍🏽 ok", "🇩🇪🇯🇵", "1️⃣#️⃣", "你好，世界！", "こんにちは世界",
    "안녕하세요", "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Γειά σου Κόσμε",
    "e\u0301cole A\u030a \u212b \u1100\u1161\u11a8", "<|im_start|>user\nHi<|im_end|>\n", "<|im_start|><|im_end|>",
    "<|im_sta", "x <mask> y", "x  <mask>y", "<sep>a<sep>", "the user name is", "a" + " " * 50 + "b",
    "int main() {\n\treturn 0;\n}\n", "https://example.com/a?b=c", "ｆｕｌｌｗｉｄｔｈ", "zero\u200bwidth",
    "\x00\x01\x7f", "line\u2028sep", "a" * 300, "9" * 100, "'s'S'sS''", "<|endoftext|>", " <|endoftext|> ",
    "ñandú über Straße ﬁ", "\u180e\u200b\ufeff", "tab\tsep\tvalues\t\t\n",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", help="also write the ~1 MB corpus check into this folder")
    ap.add_argument("--llama-cpp", help="an extracted vendor/llama.cpp (default: fetch the llama-cpp-python sdist)")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)

    sections = build_corpus(1_150_000)
    corpus_chunks = []  # (section, text)
    for name, text in sections:
        corpus_chunks += [(name, c) for c in chunks_of(text)]
    full_bytes = sum(len(c.encode()) for _, c in corpus_chunks)
    # The committed sample: every k-th chunk of each section, the tricky and sweep sections
    # whole-ish, within the budget.
    sample = []
    by_sec = {}
    for name, c in corpus_chunks:
        by_sec.setdefault(name, []).append(c)
    sweep_sample = chunks_of(category_sweep(every=2))
    budget_rest = SAMPLE_BUDGET - sum(len(c.encode()) for c in by_sec["tricky"] + sweep_sample)
    ratio = budget_rest / sum(len(c.encode()) for n, cs in by_sec.items() if n not in ("tricky", "sweep") for c in cs)
    for name, cs in by_sec.items():
        if name == "tricky":
            sample += [(name, c) for c in cs]
        elif name == "sweep":
            sample += [(name, c) for c in sweep_sample]
        else:
            # every chunk where the running share crosses a whole number: `ratio` of them, spread
            sample += [(name, c) for i, c in enumerate(cs) if int((i + 1) * ratio) > int(i * ratio)]
    sample_bytes = sum(len(c.encode()) for _, c in sample)
    print(f"corpus {full_bytes} bytes in {len(corpus_chunks)} chunks; sample {sample_bytes} bytes in {len(sample)} chunks",
          file=sys.stderr)

    # Trained tokenizer, on the corpus minus the sweep (the sweep would only add rare symbols).
    base = train("".join(c for n, c in corpus_chunks if n != "sweep"))
    trained_str, trained_pair = string_merges(base), pair_merges(base)
    tk_str = Tokenizer.from_str(json.dumps(trained_str))
    tk_pair = Tokenizer.from_str(json.dumps(trained_pair))

    probe_texts = PROBES
    sample_texts = [c for _, c in sample]
    rnd = random.Random(5)

    def record(tk, texts):
        out = []
        for t in texts:
            e = tk.encode(t, add_special_tokens=True).ids
            n = tk.encode(t, add_special_tokens=False).ids
            tk.encode_special_tokens = True  # special tokens stay text (parse_special = false)
            s = tk.encode(t, add_special_tokens=False).ids
            tk.encode_special_tokens = False
            out.append({"text": t, "ids": e, "ids_no_special": n, "ids_text_specials": s,
                        "nfc_stable": unicodedata.normalize("NFC", t) == t})
        return out

    def decode_cases(tk, n_vocab, specials):
        cases = []
        for k in range(40):
            ids = [rnd.randrange(n_vocab) for _ in range(rnd.randrange(1, 12))]
            if k % 3 == 0:
                ids.insert(rnd.randrange(len(ids) + 1), rnd.choice(specials))
            cases.append({"ids": ids, "text": tk.decode(ids, skip_special_tokens=False),
                          "text_skip_special": tk.decode(ids, skip_special_tokens=True)})
        return cases

    expected = {"tokenizers_version": tokenizers.__version__, "chunk_sections": [n for n, _ in sample], "trained": {}, "real": {}}
    for vname, ov in variants(base).items():
        tk = Tokenizer.from_str(json.dumps(apply_overrides(trained_str, ov)))
        tk2 = Tokenizer.from_str(json.dumps(apply_overrides(trained_pair, ov)))
        rec = record(tk, probe_texts)
        assert rec == record(tk2, probe_texts), "string and pair merges disagree"
        expected["trained"][vname] = {"overrides": ov, "probes": rec, "chunks": digest(tk, sample_texts)}
        print(f"trained/{vname}: {len(rec)} probes, {len(sample_texts)} chunks", file=sys.stderr)
    sp_ids = [a["id"] for a in base["added_tokens"]]
    expected["trained"]["gpt2"]["decode"] = decode_cases(tk_str, tk_str.get_vocab_size(), sp_ids)

    with open(os.path.join(OUT, "trained_string_merges.json"), "w", encoding="utf-8") as f:
        json.dump(trained_str, f, ensure_ascii=False)
    with open(os.path.join(OUT, "trained_pair_merges.json"), "w", encoding="utf-8") as f:
        json.dump(trained_pair, f, ensure_ascii=False)

    lc = llama_cpp_dir(args.llama_cpp)
    full_real = {}
    for short, name in REAL.items():
        j, meta = real_tokenizer_json(lc, name)
        tk = Tokenizer.from_str(json.dumps(j))
        probes = llama_cpp_probes(lc, name)
        bad = [t for t, ids in probes if tk.encode(t, add_special_tokens=False).ids != ids]
        if bad:
            sys.exit(f"{name}: the rebuilt tokenizer.json disagrees with llama.cpp's record of the real one on {bad[:3]}")
        texts = probe_texts + [t for t, _ in probes]
        rec = record(tk, texts)
        chunks = digest(tk, sample_texts)
        pruned = prune(j, tk, texts + sample_texts)
        ptk = Tokenizer.from_str(json.dumps(pruned))
        assert record(ptk, texts) == rec, f"{name}: pruning changed probe ids"
        pchunks = digest(ptk, sample_texts)
        bad = [i for i, (a, b) in enumerate(zip(pchunks, chunks)) if a != b]
        if bad:
            i = bad[0]
            a, b = tk.encode(sample_texts[i]).ids, ptk.encode(sample_texts[i]).ids
            k = next((x for x in range(min(len(a), len(b))) if a[x] != b[x]), min(len(a), len(b)))
            sys.exit(f"{name}: pruning changed the ids of {len(bad)} chunks; chunk {i} at {k}: "
                     f"{[tk.id_to_token(x) for x in a[k - 2:k + 3]]} vs {[ptk.id_to_token(x) for x in b[k - 2:k + 3]]}")
        specials = [a["id"] for a in j["added_tokens"]][:3]
        expected["real"][short] = {"file": f"real_{short}.json", "gguf": meta, "probes": rec, "chunks": chunks,
                                   "llama_cpp_probes": len(probes), "full_vocab": len(j["model"]["vocab"]),
                                   "full_merges": len(j["model"]["merges"])}
        # Decode cases use ids the pruned vocabulary has.
        present = set(pruned["model"]["vocab"].values()) | {a["id"] for a in pruned["added_tokens"]}
        present = sorted(present)
        cases = []
        for k in range(40):
            ids = [rnd.choice(present) for _ in range(rnd.randrange(1, 12))]
            if k % 3 == 0:
                ids.insert(rnd.randrange(len(ids) + 1), rnd.choice(specials))
            cases.append({"ids": ids, "text": tk.decode(ids, skip_special_tokens=False),
                          "text_skip_special": tk.decode(ids, skip_special_tokens=True)})
        expected["real"][short]["decode"] = cases
        with open(os.path.join(OUT, f"real_{short}.json"), "w", encoding="utf-8") as f:
            json.dump(pruned, f, ensure_ascii=False)
        full_real[short] = j
        print(f"real/{short}: llama.cpp probes {len(probes)} agree; pruned to {len(pruned['model']['vocab'])} tokens, "
              f"{len(pruned['model']['merges'])} merges", file=sys.stderr)

    with open(os.path.join(OUT, "corpus_sample.json"), "w", encoding="utf-8") as f:
        json.dump({"chunks": sample_texts}, f, ensure_ascii=False)
    with open(os.path.join(OUT, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False)

    if args.full:
        os.makedirs(args.full, exist_ok=True)
        texts = [c for _, c in corpus_chunks]
        full = {"tokenizers_version": tokenizers.__version__, "bytes": full_bytes,
                "sections": [n for n, _ in corpus_chunks], "tokenizers": {}}
        for vname, ov in variants(base).items():
            tk = Tokenizer.from_str(json.dumps(apply_overrides(trained_pair, ov)))
            fn = f"trained_{vname}.json"
            with open(os.path.join(args.full, fn), "w", encoding="utf-8") as f:
                f.write(tk.to_str())
            full["tokenizers"][f"trained_{vname}"] = {"file": fn, "chunks": digest(tk, texts)}
        for short, j in full_real.items():
            tk = Tokenizer.from_str(json.dumps(j))
            fn = f"real_{short}.json"
            with open(os.path.join(args.full, fn), "w", encoding="utf-8") as f:
                json.dump(j, f, ensure_ascii=False)
            full["tokenizers"][f"real_{short}"] = {"file": fn, "chunks": digest(tk, texts)}
        with open(os.path.join(args.full, "corpus.json"), "w", encoding="utf-8") as f:
            json.dump({"chunks": texts}, f, ensure_ascii=False)
        with open(os.path.join(args.full, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(full, f, ensure_ascii=False)
        print(f"full check: {full_bytes} bytes, {len(full['tokenizers'])} tokenizers in {args.full}", file=sys.stderr)

    for fn in sorted(os.listdir(OUT)):
        print(f"  {fn}: {os.path.getsize(os.path.join(OUT, fn))} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
