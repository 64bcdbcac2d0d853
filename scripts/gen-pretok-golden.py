#!/usr/bin/env python3
"""Writes spec/data/pretok-golden.txt: how the BPE pre-tokenizer regexes split
a set of strings, computed with Python's `regex` module (pip install regex),
for spec/native/test_tokenizer.c:

    python3 scripts/gen-pretok-golden.py

Each case is a comment showing the text, then a line
    <pre-tokenizer> <text as UTF-8 hex> <byte end offset of each piece, comma separated>
The regexes are the ones llama.cpp uses (Llama 3's with its case-insensitive
contractions spelled out, as llama.cpp adapts it). Every character of the
strings must have the same \\p{L}/\\p{N}/\\s class under `regex` and under
unicodedata (which src/unicode_data.c is generated from), so the goldens do
not depend on the Unicode versions of the two.
"""
import os
import unicodedata

import regex

PATTERNS = {
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

TEXTS = [
    "Hello world",
    " Hello  world   ",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "I'm here, you're there, they've left, we'll go, he'd say, it's 'tis",
    "SHOUTING: I'M HERE, YOU'RE THERE, THEY'VE, WE'LL, HE'D, IT'S",
    "Mixed 'S 'T 'Re 'vE 'Ll 'D and 'x 'hello",
    "3 33 333 3333 33333 333333 3333333",
    "1234567890 and 12,345.678",
    "x1y22z333w4444",
    "٣٤٥ ١٢٣٤ ۱۲۳ １２３４ ⅓ ² Ⅻ",
    "price: $100.00 (approx. €95)",
    "    indented code\n\tand tabs\t\there",
    "line one\nline two\r\nline three\n\n\nend",
    "trailing newline\n",
    "  \n  \n  x",
    " \t \n \t ",
    "a\u00a0b\u2003c\u3000d\u2028e\u0085f",
    "!!! ??? ... ,,, ;;; ::: --- +++",
    "hello!!!\n\nworld???\r\n",
    "(parenthesis) [brackets] {braces} <angles>",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Größere Äpfel, übermäßig süß: Straße.",
    "人工智能正在改变世界。今天天气很好！",
    "こんにちは、世界！カタカナとひらがな、漢字。",
    "مرحبا بالعالم! كيف حالك؟",
    "Привет, мир! Съешь же ещё этих булок.",
    "नमस्ते दुनिया! आप कैसे हैं?",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "combining: e\u0301 a\u0308 n\u0303 \u0301alone",
    "zero\u200bwidth\u200cjoin\u200d",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅",
    "👨‍👩‍👧‍👦🏳️‍🌈🇫🇷 😀😁😂",
    "'",
    " ",
    "   ",
    "\n",
    "a",
    " 'quoted' \"double\" `back`",
    "snake_case kebab-case CamelCase ALLCAPS",
    "\x01\x02 control \x7f chars \x1f",
]


def check_classes(text):
    for ch in text:
        cat = unicodedata.category(ch)
        assert (regex.match(r"\p{L}", ch) is not None) == cat.startswith("L"), repr(ch)
        assert (regex.match(r"\p{N}", ch) is not None) == cat.startswith("N"), repr(ch)


def split_ends(pattern, text):
    ends, pos = [], 0
    for m in regex.finditer(pattern, text):
        assert m.start() == pos, (pattern, text, m.start(), pos)
        pos = m.end()
        ends.append(len(text[:pos].encode("utf-8")))
    assert pos == len(text), (pattern, text)
    return ends


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec", "data",
                       "pretok-golden.txt")
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        f.write("# Pre-tokenizer splits from Python's regex module; written by "
                "scripts/gen-pretok-golden.py.\n")
        f.write("# <pre-tokenizer> <text as UTF-8 hex> <byte end offsets, comma separated>\n")
        for text in TEXTS:
            check_classes(text)
            f.write("# " + ascii(text) + "\n")
            for name, pattern in PATTERNS.items():
                ends = split_ends(pattern, text)
                f.write(f"{name} {text.encode('utf-8').hex()} {','.join(map(str, ends))}\n")


if __name__ == "__main__":
    main()
