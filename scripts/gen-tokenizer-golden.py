#!/usr/bin/env python3
"""Writes Gemma 3's expected token ids, computed by the reference engine
(llama.cpp through llama-cpp-python), for spec/native/test_tokenizer.c:

    python3 scripts/gen-tokenizer-golden.py [model.gguf]

The model is the argument, else $LUMA_MODEL, else
~/.cache/luma/models/gemma-3-270m-q4_k_m.gguf (only its vocabulary is read).

Outputs, in the format of llama.cpp's tokenizer test vectors (.inp: each text
followed by a line `__ggml_vocab_test__`; .out: one line of ids per text):
  spec/data/gemma3-tokenizer.inp/.out          add_special=False, parse_special=False
  spec/data/gemma3-tokenizer-special.inp/.out  add_special=True,  parse_special=True
"""
import os
import sys

import llama_cpp

SEP = "\n__ggml_vocab_test__\n"

PLAIN = [
    # English
    "Hello world",
    " Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, y'all! How are you? I'm fine; they've gone, we'll see, he'd know.",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    # French, German
    "Le cœur a ses raisons que la raison ne connaît point.",
    "À l'école, où êtes-vous ? « Très bien ! »",
    "Größere Äpfel, übermäßig süß: Straße, Fußgängerübergänge.",
    "Donaudampfschifffahrtsgesellschaftskapitän",
    # Chinese, Japanese
    "我想在apple工作1314151天～",
    "人工智能正在改变世界。今天天气很好！",
    "こんにちは、世界！カタカナとひらがな、漢字。",
    "東京スカイツリーは634メートルです。",
    # Arabic, Russian, Hindi, Korean
    "مرحبا بالعالم! كيف حالك؟",
    "العربية: ١٢٣٤٥٦٧٨٩٠",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "нещо на Български",
    "नमस्ते दुनिया! आप कैसे हैं?",
    "हिन्दी में संख्याएँ: १२३४५",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "대한민국 서울특별시",
    # other scripts
    "Καλημέρα κόσμε",
    "שלום עולם",
    "สวัสดีครับ",
    "Cửa Việt, tiếng Việt có dấu.",
    "កាន់តែពិសេសអាចខលចេញ",
    # whitespace: runs, tabs, newlines (Gemma has user-defined tokens for runs)
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\t\n",
    "a  b   c    d",
    "    indented\n        more\n\ttab\t\ttabs",
    "trailing spaces   ",
    "\r\nwindows\r\nlines\r\n",
    " \n \n ",
    "x" + " " * 40 + "y",
    "\n" * 35 + "end",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
    # code
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<html><body><p class=\"x\">Hi</p></body></html>",
    "{\"key\": [1, 2.5, -3e10, true, null]}",
    "SELECT * FROM users WHERE id = 42;",
    # emoji
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)",
    "👨‍👩‍👧‍👦🏳️‍🌈🇫🇷 😀😁😂",
    "I ❤️ 🦙 and 🐍",
    # digits
    "3 33 333 3333 33333 333333",
    "3.14159265358979 2,718 1e-9 0x1F 0b1010",
    "1234567890123456789",
    # special-token text, tokenized as plain text
    "<start_of_turn>user\nHello<end_of_turn>\n",
    "<bos><eos><pad> <unk>",
    "<0x41> \u2581 \u2581\u2581 literal",
    "[multimodal]<start_of_image>",
    # odds and ends
    "Ünïcödé ñ ç ø å æ ß ð þ",
    "!!!!!! ??? ... --- ___ ***",
    "ﬁ ﬂ Ａｂｃ １２３ ｶﾀｶﾅ",
    "combining: e\u0301 a\u0308 n\u0303",
    "zero\u200bwidth\u200cjoin\u200d",
]

SPECIAL = [
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<start_of_turn>user\n你好<end_of_turn>\n",
    "<bos>Hello",
    "Text with <end_of_turn> in the middle",
    "<start_of_image><end_of_image>",
    "<unused0><unused1> <mask>",
    "",
    "<eos>",
    "<<start_of_turn>>",
    "<start_of_turn",
    "\n\n<start_of_turn>  user  \n",
]


def model_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    return os.environ.get("LUMA_MODEL") or os.path.expanduser(
        "~/.cache/luma/models/gemma-3-270m-q4_k_m.gguf")


def write(llm, texts, stem, add_special, parse_special):
    for t in texts:
        assert SEP.strip() not in t
    with open(stem + ".inp", "w", encoding="utf-8", newline="") as f:
        for t in texts:
            f.write(t + SEP)
    with open(stem + ".out", "w", encoding="utf-8", newline="") as f:
        for t in texts:
            ids = llm.tokenize(t.encode("utf-8"), add_bos=add_special, special=parse_special)
            f.write(" ".join(str(i) for i in ids) + "\n")


def main():
    llm = llama_cpp.Llama(model_path(), vocab_only=True, verbose=False)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec", "data")
    os.makedirs(root, exist_ok=True)
    write(llm, PLAIN, os.path.join(root, "gemma3-tokenizer"), False, False)
    write(llm, SPECIAL, os.path.join(root, "gemma3-tokenizer-special"), True, True)


if __name__ == "__main__":
    main()
