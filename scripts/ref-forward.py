#!/usr/bin/env python3
"""An exact forward pass of gemma3, llama and qwen2 GGUF files, in float64
numpy on weights dequantized by the `gguf` package: no activation
quantization, the KV cache kept in float64. It reads the hyper-parameters
from the metadata as luma does (src/model.c, src/arch/*.c) and serves as the
ground truth that luma and llama.cpp, which both quantize activations to 8
bits, are measured against.

  compare MODEL   the golden prompts of spec/data/gemma3-golden.lua (or
                  --golden FILE) through the exact model, llama.cpp
                  (llama-cpp-python, batched prefill as the golden file was
                  made) and luma (--luma BINARY); prints, for each pair, top-1
                  agreement and the largest |diff| over the exact model's
                  top-32, and the greedy continuations of the golden prompts.
  exact MODEL     the exact model's top-16 at every position of the golden
                  prompts and its 32-token greedy continuations of the
                  golden greedy prompts, written to spec/data/gemma3-exact.lua
                  (--out) for spec/forward_spec.lua (float activations).
  texts MODEL     for a real model other than the default: the exact
                  model's top-16 at every position of the texts in TEXTS,
                  tokenized by luma (--luma BINARY), and its 16-token greedy
                  continuations of TEXTS_GREEDY, written to --out (as
                  spec/data/qwen2-exact.lua for spec/qwen2_model_spec.lua);
                  --kv-f16 rounds the cached keys and values to f16, as
                  luma's cache holds them.
  golden MODEL    for a synthetic model written by luma's synth tool (preset
                  --preset, --seed, --mix, vocabulary --vocab): writes a
                  golden file (--out, default spec/data/<preset>-golden.lua)
                  with the exact model's top-16 at every position of 3
                  prompts, llama.cpp's logits for the same ids, and both
                  greedy continuations; the model is named by its recipe and
                  checksum, not committed. With --luma, also prints how luma
                  compares.

usage: scripts/ref-forward.py compare MODEL [--luma build/luma] [--golden FILE]
       scripts/ref-forward.py exact MODEL [--golden FILE] [--out FILE]
       scripts/ref-forward.py golden MODEL --preset tiny-llama --seed 1
       scripts/ref-forward.py texts MODEL --luma build/luma --out spec/data/qwen2-exact.lua --kv-f16
              --vocab ggml-vocab-llama-spm.gguf [--mix q4_k_m] [--luma build/luma]
"""
import argparse
import hashlib
import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")

# ---- the model ---------------------------------------------------------


class Model:
    """Hyper-parameters as luma reads them; weights dequantized on first use
    and kept as float64 matrices of shape (rows, cols)."""

    def __init__(self, path):
        self.path = path
        self.reader = GGUFReader(path)
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.cache = {}
        self.kv_f16 = False   # keys and values rounded to f16 as they are cached (texts --kv-f16)
        self.arch = self.meta("general.architecture")
        if self.arch not in ("gemma3", "llama", "qwen2"):
            raise SystemExit("%s: architecture %r is not gemma3, llama or qwen2" % (path, self.arch))
        gemma = self.arch == "gemma3"
        a = lambda k, d=None: self.meta("%s.%s" % (self.arch, k), d)
        self.n_embd = int(a("embedding_length"))
        self.n_layer = int(a("block_count"))
        self.n_head = int(a("attention.head_count"))
        self.n_ff = int(a("feed_forward_length"))
        self.n_kv = int(a("attention.head_count_kv", self.n_head))
        self.dk = int(a("attention.key_length", self.n_embd // self.n_head))
        self.dv = int(a("attention.value_length", self.dk))
        self.rope_dims = int(a("rope.dimension_count", self.dk))
        self.eps = float(a("attention.layer_norm_rms_epsilon", 1e-5))
        self.rope_base = float(a("rope.freq_base", 1e6 if gemma else 1e4))
        self.rope_neox = self.arch != "llama"
        self.pos_scale = 1.0
        scaling = a("rope.scaling.type")
        if scaling and scaling != "none":
            if scaling != "linear":
                raise SystemExit("RoPE scaling %r is not supported" % scaling)
            self.pos_scale = 1.0 / float(a("rope.scaling.factor", 1.0))
        self.attn_scale = 1.0 / math.sqrt(self.dk)
        self.embd_scale = 1.0
        self.window = 0
        self.swa = [False] * self.n_layer
        self.rope_base_swa = self.rope_base
        if gemma:
            # Five of every six layers slide a window, with RoPE base 10000.
            self.window = int(a("attention.sliding_window", 0))
            pattern = int(a("attention.sliding_window_pattern", 6))
            self.swa = [self.window > 0 and (il + 1) % pattern != 0 for il in range(self.n_layer)]
            self.rope_base_swa = 10000.0
            self.embd_scale = math.sqrt(self.n_embd)
            if self.n_layer == 62:
                self.attn_scale = 1.0 / math.sqrt(self.n_embd // self.n_head)
        self.rope_freqs = self.vec("rope_freqs.weight") if "rope_freqs.weight" in self.tensors else None
        self.out_name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    def meta(self, key, default=None):
        f = self.fields.get(key)
        if f is None:
            return default
        if f.types[0] == GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return f.parts[f.data[0]][0].item()

    def mat(self, name):
        w = self.cache.get(name)
        if w is None:
            t = self.tensors[name]
            w = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1, int(t.shape[0]))
            self.cache[name] = w
        return w

    def vec(self, name):
        return self.mat(name).reshape(-1)

    def layer(self, il, name):
        return self.mat("blk.%d.%s" % (il, name if name.endswith(".bias") else name + ".weight"))

    def has(self, il, name):
        return "blk.%d.%s" % (il, name) in self.tensors


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.reshape(-1)


def rope(x, pos, m, base, scale):
    """x: (n, heads, d). NeoX rotates (i, i + dims/2), normal RoPE the
    adjacent pairs (2i, 2i + 1), over the first rope_dims of each head."""
    half = m.rope_dims // 2
    freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / m.rope_dims)
    if m.rope_freqs is not None:
        freq = freq / m.rope_freqs[:half]
    theta = (pos.astype(np.float64) * scale)[:, None] * freq[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if m.rope_neox:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * cos - b * sin
        out[..., half:2 * half] = a * sin + b * cos
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * cos - b * sin
        out[..., 1:2 * half:2] = a * sin + b * cos
    return out


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1.0 + np.exp(-x))


class Cache:
    """Keys and values of every layer, float64, (positions, kv heads, dim)."""

    def __init__(self, m):
        self.n = 0
        self.k = [np.zeros((0, m.n_kv, m.dk)) for _ in range(m.n_layer)]
        self.v = [np.zeros((0, m.n_kv, m.dv)) for _ in range(m.n_layer)]


def forward(m, ids, cache):
    """Runs ids after the cache's positions; returns the final normalized
    hidden states, (len(ids), n_embd)."""
    n = len(ids)
    pos = np.arange(cache.n, cache.n + n)
    gemma = m.arch == "gemma3"
    x = m.mat("token_embd.weight")[np.asarray(ids)] * m.embd_scale
    group = m.n_head // m.n_kv
    for il in range(m.n_layer):
        h = rmsnorm(x, m.layer(il, "attn_norm"), m.eps)
        q = h @ m.layer(il, "attn_q").T
        k = h @ m.layer(il, "attn_k").T
        v = h @ m.layer(il, "attn_v").T
        if m.has(il, "attn_q.bias"):
            q += m.layer(il, "attn_q.bias").reshape(-1)
            k += m.layer(il, "attn_k.bias").reshape(-1)
            v += m.layer(il, "attn_v.bias").reshape(-1)
        q = q.reshape(n, m.n_head, m.dk)
        k = k.reshape(n, m.n_kv, m.dk)
        v = v.reshape(n, m.n_kv, m.dv)
        if gemma:
            q = rmsnorm(q, m.layer(il, "attn_q_norm"), m.eps)
            k = rmsnorm(k, m.layer(il, "attn_k_norm"), m.eps)
        base, scale = (m.rope_base_swa, 1.0) if m.swa[il] else (m.rope_base, m.pos_scale)
        q = rope(q, pos, m, base, scale)
        k = rope(k, pos, m, base, scale)
        if m.kv_f16:
            # stored as luma's and llama.cpp's caches store them
            k = k.astype(np.float16).astype(np.float64)
            v = v.astype(np.float16).astype(np.float64)
        cache.k[il] = np.concatenate([cache.k[il], k])
        cache.v[il] = np.concatenate([cache.v[il], v])
        K, V = cache.k[il], cache.v[il]
        kpos = np.arange(K.shape[0])
        # A query at p sees keys at k <= p, and in a window only p - k < window.
        mask = kpos[None, :] <= pos[:, None]
        if m.swa[il]:
            mask &= pos[:, None] - kpos[None, :] < m.window
        out = np.empty((n, m.n_head, m.dv))
        for hd in range(m.n_head):
            s = (q[:, hd, :] @ K[:, hd // group, :].T) * m.attn_scale
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hd, :] = (s / s.sum(axis=1, keepdims=True)) @ V[:, hd // group, :]
        o = out.reshape(n, -1) @ m.layer(il, "attn_output").T
        if gemma:
            o = rmsnorm(o, m.layer(il, "post_attention_norm"), m.eps)
        x = x + o
        h = rmsnorm(x, m.layer(il, "ffn_norm"), m.eps)
        g = h @ m.layer(il, "ffn_gate").T
        u = h @ m.layer(il, "ffn_up").T
        o = ((gelu_tanh(g) if gemma else silu(g)) * u) @ m.layer(il, "ffn_down").T
        if gemma:
            o = rmsnorm(o, m.layer(il, "post_ffw_norm"), m.eps)
        x = x + o
    cache.n += n
    return rmsnorm(x, m.vec("output_norm.weight"), m.eps)


def logits(m, h):
    """Logits of hidden rows h, 32 rows at a time (a full row of a large
    vocabulary is big): yields one row at a time."""
    w = m.mat(m.out_name)
    for i in range(0, h.shape[0], 32):
        for row in h[i:i + 32] @ w.T:
            yield row


def top(row, k):
    ids = np.argsort(-row, kind="stable")[:k]
    return ids, row[ids]


def exact_prompt(m, ids, k):
    """The top-k ids (the first is the argmax) and their logits at every
    position."""
    h = forward(m, ids, Cache(m))
    out = []
    for row in logits(m, h):
        t, v = top(row, k)
        out.append((t, v))
    return out


def exact_greedy(m, ids, n):
    cache = Cache(m)
    h = forward(m, ids, cache)
    gen = []
    for _ in range(n):
        nxt = int(np.argmax(next(logits(m, h[-1:]))))
        gen.append(nxt)
        if len(gen) < n:
            h = forward(m, [nxt], cache)
    return gen

# ---- llama.cpp ---------------------------------------------------------


def llamacpp(path):
    from llama_cpp import Llama
    return Llama(model_path=path, n_ctx=2048, n_batch=512, n_ubatch=512, logits_all=True,
                 n_threads=2, verbose=False)


def cpp_prompt(llm, ids):
    """Every position's logits from one batched prefill, as the golden file's."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:llm.n_tokens], dtype=np.float64)


def cpp_greedy(llm, ids, n):
    llm.reset()
    llm.eval(ids)
    gen = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        gen.append(nxt)
        if len(gen) < n:
            llm.eval([nxt])
    return gen

# ---- luma --------------------------------------------------------------

# Reads requests from a file: "prompt ID..." followed by one line of ids per
# position, at which it prints its logits after its argmax; "greedy N ID..."
# prints the N-token greedy continuation.
LUMA_DUMP = r"""
local luma = require "luma"
local model = luma.load(arg[1], { backend = "cpu", threads = 2, ctx = 4096 })
local next_line = io.lines(arg[2])
local function ints(line)
  local t = {}
  for w in line:gmatch("%S+") do t[#t + 1] = math.tointeger(tonumber(w)) end
  return t
end
for line in next_line do
  local kind, rest = line:match("^(%a+) ?(.*)$")
  local ids = ints(rest)
  local seq = model:sequence()
  if kind == "prompt" then
    for _, lg in ipairs(seq:eval(ids, { all = true })) do
      local out = { tostring(lg:argmax()) }
      for _, id in ipairs(ints(next_line())) do out[#out + 1] = string.format("%.9g", lg[id]) end
      print(table.concat(out, " "))
    end
  else
    local n = table.remove(ids, 1)
    local lg, gen = seq:eval(ids), {}
    for i = 1, n do
      gen[i] = lg:argmax()
      if i < n then lg = seq:eval(gen[i]) end
    end
    print(table.concat(gen, " "))
  end
  seq:close()
end
"""


def run_luma(binary, model, prompts, want, greedy, ngen):
    """prompts: id lists; want[i][p]: ids whose logits to report at position
    p of prompt i. Returns per prompt a list of (argmax, values), and the
    greedy continuations."""
    with tempfile.TemporaryDirectory() as tmp:
        script, req = os.path.join(tmp, "dump.lua"), os.path.join(tmp, "req.txt")
        with open(script, "w") as f:
            f.write(LUMA_DUMP)
        with open(req, "w") as f:
            for ids, rows in zip(prompts, want):
                f.write("prompt %s\n" % " ".join(map(str, ids)))
                for r in rows:
                    f.write(" ".join(map(str, r)) + "\n")
            for ids in greedy:
                f.write("greedy %d %s\n" % (ngen, " ".join(map(str, ids))))
        res = subprocess.run([binary, script, model, req], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit("luma failed: " + res.stderr)
    lines = res.stdout.splitlines()
    out, at = [], 0
    for ids in prompts:
        rows = []
        for line in lines[at:at + len(ids)]:
            w = line.split()
            rows.append((int(w[0]), np.array([float(x) for x in w[1:]])))
        out.append(rows)
        at += len(ids)
    gens = [[int(x) for x in line.split()] for line in lines[at:at + len(greedy)]]
    return out, gens

# ---- reports -----------------------------------------------------------


def report_pairs(engines, n):
    """For each pair of engines: top-1 agreement, and |diff| of their logits
    at the exact model's top-k ids: the largest, and the median and 99th
    percentile over positions of each position's largest."""
    print("\n%-22s %-16s %s" % ("pair", "top-1 agree", "|diff| over the exact top-k: max, p50, p99 of positions"))
    names = list(engines)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            (a1, av), (b1, bv) = engines[names[i]], engines[names[j]]
            agree = sum(int(x == y) for x, y in zip(a1, b1))
            worst = np.array([np.max(np.abs(x - y)) for x, y in zip(av, bv)])
            print("%-22s %3d/%d %5.1f%%   %.4f  %.4f  %.4f" % (
                names[j] + " vs " + names[i], agree, n, 100.0 * agree / n, worst.max(),
                np.percentile(worst, 50), np.percentile(worst, 99)))


def report_greedy(m, texts, prompts, gens):
    """How many tokens of each engine's greedy continuation equal the exact
    model's and, where they part, the exact model's margin between its token
    and the engine's (a near tie when small)."""
    exact = gens["exact"]
    print("\ngreedy: tokens equal to the exact model's (of %d), and the exact margin where they part" % len(exact[0]))
    for i, text in enumerate(texts):
        row = []
        for name, g in gens.items():
            if name == "exact":
                continue
            k = next((k for k, (x, y) in enumerate(zip(g[i], exact[i])) if x != y), len(exact[i]))
            if k == len(exact[i]):
                row.append("%s %2d" % (name, k))
                continue
            h = forward(m, prompts[i] + exact[i][:k], Cache(m))
            lg = next(logits(m, h[-1:]))
            row.append("%s %2d (margin %.3f)" % (name, k, lg[exact[i][k]] - lg[g[i][k]]))
        print("  %-36r %s" % (text[:34], "  ".join(row)))
    for name, g in gens.items():
        for text, ids in zip(texts, g):
            print("  %-9s %-30r %s" % (name, text[:28], " ".join(map(str, ids))))


def read_golden(path):
    """The prompts of a gemma3-golden.lua file: text, ids, reference top ids
    and values per position; and the greedy texts, ids and continuations."""
    prompts, greedy, section = [], [], None
    lst = lambda s: [float(x) for x in s.split(",") if x]
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("prompts = {"):
                section = "prompts"
            elif line.startswith("greedy = {"):
                section = "greedy"
            elif line.startswith("ppl = "):
                section = None
            elif section == "prompts" and line.startswith("{ text = "):
                ids = re.search(r"ids = \{([^}]*)\}", line).group(1)
                text = re.match(r'\{ text = "((?:[^"\\]|\\.)*)"', line).group(1)
                prompts.append({"text": text, "ids": [int(x) for x in lst(ids)], "top": []})
            elif section == "prompts" and line.startswith("{ ids = "):
                m = re.match(r"\{ ids = \{([^}]*)\}, vals = \{([^}]*)\}", line)
                prompts[-1]["top"].append(([int(x) for x in lst(m.group(1))], lst(m.group(2))))
            elif section == "greedy" and line.startswith("{ text = "):
                text = re.match(r'\{ text = "((?:[^"\\]|\\.)*)"', line).group(1)
                ids = re.search(r"ids = \{([^}]*)\}", line).group(1)
                gen = re.search(r"gen = \{([^}]*)\}", line).group(1)
                greedy.append({"text": text, "ids": [int(x) for x in lst(ids)],
                               "gen": [int(x) for x in lst(gen)]})
    return prompts, greedy


def compare(args):
    m = Model(args.model)
    prompts, greedy = read_golden(args.golden)
    k = 32
    t0 = time.time()
    exact = [exact_prompt(m, p["ids"], k) for p in prompts]
    n = sum(len(p["ids"]) for p in prompts)
    print("exact forward: %d positions in %.1f s" % (n, time.time() - t0))
    ex_ids = [t for rows in exact for t, _ in rows]
    engines = {"exact": ([int(t[0]) for t in ex_ids], [v for rows in exact for _, v in rows])}

    llm = llamacpp(args.model)
    cpp_top1, cpp_vals, golden_agree, golden_diff = [], [], 0, 0.0
    for p, rows in zip(prompts, exact):
        scores = cpp_prompt(llm, p["ids"])
        for pos, (t, _) in enumerate(rows):
            cpp_top1.append(int(np.argmax(scores[pos])))
            cpp_vals.append(scores[pos][t])
            gids, gvals = p["top"][pos]
            golden_agree += int(gids[0] == cpp_top1[-1])
            golden_diff = max(golden_diff, float(np.max(np.abs(scores[pos][gids] - np.array(gvals)))))
    print("llama.cpp now against the golden file's llama.cpp: top-1 %d/%d, max |diff| %.2g"
          % (golden_agree, n, golden_diff))
    engines["llama.cpp"] = (cpp_top1, cpp_vals)

    gens = {"exact": [exact_greedy(m, g["ids"], len(g["gen"])) for g in greedy],
            "llama.cpp": [g["gen"] for g in greedy]}
    if args.luma:
        rows, lgen = run_luma(args.luma, args.model, [p["ids"] for p in prompts],
                              [[t for t, _ in r] for r in exact], [g["ids"] for g in greedy], len(greedy[0]["gen"]))
        engines["luma"] = ([a for r in rows for a, _ in r], [v for r in rows for _, v in r])
        gens["luma"] = lgen
    report_pairs(engines, n)
    report_greedy(m, [g["text"] for g in greedy], [g["ids"] for g in greedy], gens)

# ---- the exact model on the golden prompts -------------------------------

EXACT_TOPK = 16


def exact_lua(header, sha, fields, prompts, rows, greedy, gens, texts):
    """An exact forward's Lua file: header comments, the model's sha256 and
    other fields (Lua lines), each prompt's ids (and text) with every
    position's top ids and logits (rows), each greedy prompt's ids (and
    text) with its continuation (gens)."""
    pre = lambda p: "text = %s, " % lua_str(p["text"]) if texts else ""
    out = header + ["return {", "sha256 = %s," % lua_str(sha)] + fields + ["prompts = {"]
    for p, r in zip(prompts, rows):
        out.append("{ %sids = %s, top = {" % (pre(p), lua_list(p["ids"])))
        for t, v in r:
            out.append("{ ids = %s, vals = %s }," % (lua_list(t.tolist()), lua_list(v.tolist(), g6)))
        out.append("} },")
    out.append("},")
    out.append("greedy = {")
    for g, gen in zip(greedy, gens):
        out.append("{ %sids = %s, gen = %s }," % (pre(g), lua_list(g["ids"]), lua_list(gen)))
    out.append("},")
    out.append("}")
    return "\n".join(out) + "\n"


def exact_file(args):
    m = Model(args.model)
    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    prompts, greedy = read_golden(args.golden)
    t0 = time.time()
    rows = [exact_prompt(m, p["ids"], EXACT_TOPK) for p in prompts]
    gens = [exact_greedy(m, g["ids"], len(g["gen"])) for g in greedy]
    header = ["-- Generated by scripts/ref-forward.py exact; do not edit.",
              "-- The exact (float64, unquantized activations) forward of the default model",
              "-- (sha256 below) on the prompts of gemma3-golden.lua: at every position the",
              "-- top-%d ids and logits; greedy: its continuations of the golden greedy prompts." % EXACT_TOPK]
    text = exact_lua(header, sha, [], prompts, rows, greedy, gens, False)
    path = args.out or os.path.join(ROOT, "spec", "data", "gemma3-exact.lua")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    n = sum(len(p["ids"]) for p in prompts)
    print("%s: %d positions, %d greedy prompts in %.1f s -> %s" % (args.model, n, len(greedy), time.time() - t0, path))

# ---- golden files for synthetic models ----------------------------------

GOLDEN_TOPK = 16
GOLDEN_NGEN = 16


def lua_list(xs, fmt=str):
    return "{" + ",".join(fmt(x) for x in xs) + "}"


def golden(args):
    sys.path.insert(0, HERE)
    gen_golden = importlib.import_module("gen-golden-logits")
    m = Model(args.model)
    name = m.meta("general.name", "")
    want = "luma synthetic %s (%s, seed %d)" % (m.arch, args.mix, args.seed)
    if name != want:
        raise SystemExit("%s is %r, not %r: write it with the preset, mix and seed given" % (args.model, name, want))
    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()

    llm = llamacpp(args.model)
    prompts = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in gen_golden.PROMPTS]
    greedy = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in gen_golden.GREEDY]
    exact = [exact_prompt(m, ids, GOLDEN_TOPK) for ids in prompts]
    cpp = [cpp_prompt(llm, ids) for ids in prompts]
    ex_gen = [exact_greedy(m, ids, GOLDEN_NGEN) for ids in greedy]
    cpp_gen = [cpp_greedy(llm, ids, GOLDEN_NGEN) for ids in greedy]

    out = ["-- Generated by scripts/ref-forward.py golden; do not edit.",
           "-- The exact (float64) forward of a synthetic model that luma's synth tool",
           "-- re-creates from `model` (sha256: the file's checksum). At every position of",
           "-- each prompt: the exact model's top-%d ids and logits (vals), llama.cpp's" % GOLDEN_TOPK,
           "-- logits for the same ids (cpp) and its argmax (cpp_top); greedy: %d-token" % GOLDEN_NGEN,
           "-- continuations of the exact model (gen) and of llama.cpp (cpp_gen).",
           "return {",
           "model = { preset = %s, seed = %d, mix = %s, vocab = %s, sha256 = %s },"
           % (lua_str(args.preset), args.seed, lua_str(args.mix), lua_str(args.vocab), lua_str(sha)),
           "prompts = {"]
    for ids, rows, scores in zip(prompts, exact, cpp):
        out.append("{ ids = %s, top = {" % lua_list(ids))
        for pos, (t, v) in enumerate(rows):
            out.append("{ ids = %s, vals = %s, cpp = %s, cpp_top = %d }," % (
                lua_list(t.tolist()), lua_list(v.tolist(), g6), lua_list(scores[pos][t].tolist(), g6),
                int(np.argmax(scores[pos]))))
        out.append("} },")
    out.append("},")
    out.append("greedy = {")
    for ids, g, c in zip(greedy, ex_gen, cpp_gen):
        out.append("{ ids = %s, gen = %s, cpp_gen = %s }," % (lua_list(ids), lua_list(g), lua_list(c)))
    out.append("},")
    out.append("}")
    path = args.out or os.path.join(ROOT, "spec", "data", "%s-golden.lua" % args.preset)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    n = sum(len(ids) for ids in prompts)
    print("%s: %d positions, %d greedy prompts -> %s" % (args.model, n, len(greedy), path))

    engines = {"exact": ([int(t[0]) for r in exact for t, _ in r], [v for r in exact for _, v in r]),
               "llama.cpp": ([int(np.argmax(s[p])) for r, s in zip(exact, cpp) for p in range(len(r))],
                             [s[p][t] for r, s in zip(exact, cpp) for p, (t, _) in enumerate(r)])}
    gens = {"exact": ex_gen, "llama.cpp": cpp_gen}
    if args.luma:
        rows, lgen = run_luma(args.luma, args.model, prompts, [[t for t, _ in r] for r in exact], greedy, GOLDEN_NGEN)
        engines["luma"] = ([a for r in rows for a, _ in r], [v for r in rows for _, v in r])
        gens["luma"] = lgen
    report_pairs(engines, n)
    report_greedy(m, gen_golden.GREEDY, greedy, gens)


# ---- the exact model on texts, tokenized by luma ---------------------------

# For a real model that is not the default one (the qwen2 path:
# spec/qwen2_model_spec.lua): prompts in a few registers, ASCII only.
TEXTS = [
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into "
    "chemical energy. Chlorophyll absorbs mostly red and blue light, and the energy drives the "
    "splitting of water, which releases oxygen.",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"
    "    left = [x for x in items[1:] if x < pivot]\n    right = [x for x in items[1:] if x >= pivot]\n",
    "Q: A train leaves at 3 pm and travels 120 km at 80 km per hour. When does it arrive?\nA:",
]
TEXTS_GREEDY = [
    "The capital of France is",
    "def is_prime(n):\n",
    "Water boils at a temperature of",
    "SELECT name, age FROM users WHERE",
]
TEXTS_GEN = 16


def luma_ids(binary, model, text):
    """luma's tokenization of text (the model's own BOS rule)."""
    code = ("local luma = require 'luma'; local m = luma.load(arg[1], { backend = 'cpu' }); "
            "local f = assert(io.open(arg[2], 'rb')); local t = f:read('a'); f:close(); "
            "print(table.concat(m:tokenize(t), ','))")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
        path = f.name
    try:
        out = subprocess.run([binary, "-e", code, model, path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return [int(x) for x in out.strip().split(",") if x]


def texts_file(args):
    m = Model(args.model)
    m.kv_f16 = args.kv_f16
    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    t0 = time.time()
    prompts = [{"text": t, "ids": luma_ids(args.luma, args.model, t)} for t in TEXTS]
    greedy = [{"text": t, "ids": luma_ids(args.luma, args.model, t)} for t in TEXTS_GREEDY]
    rows = [exact_prompt(m, p["ids"], EXACT_TOPK) for p in prompts]
    gens = [exact_greedy(m, g["ids"], TEXTS_GEN) for g in greedy]
    header = ["-- Generated by scripts/ref-forward.py texts%s; do not edit." % (" --kv-f16" if args.kv_f16 else ""),
              "-- The exact (float64, unquantized activations%s) forward of %s" %
              (", keys and values cached as f16" if args.kv_f16 else "", os.path.basename(args.model)),
              "-- (sha256 below) on the texts of ref-forward.py's TEXTS, as luma tokenizes them: at every",
              "-- position the top-%d ids and logits; greedy: its %d-token continuations of TEXTS_GREEDY." %
              (EXACT_TOPK, TEXTS_GEN)]
    fields = ["kv = %s," % lua_str("f16" if args.kv_f16 else "f64")]
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(exact_lua(header, sha, fields, prompts, rows, greedy, gens, True))
    n = sum(len(p["ids"]) for p in prompts)
    print("%s: %d positions, %d greedy prompts in %.1f s -> %s" % (args.model, n, len(greedy), time.time() - t0,
                                                                   args.out))
    for g, gen in zip(greedy, gens):
        print("  %r ->" % g["text"], gen)


def g6(v):
    return "%.6g" % v


def lua_str(s):
    return '"' + s.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("model")
    c.add_argument("--golden", default=os.path.join(ROOT, "spec", "data", "gemma3-golden.lua"))
    c.add_argument("--luma", help="the luma binary; without it luma is left out")
    e = sub.add_parser("exact")
    e.add_argument("model")
    e.add_argument("--golden", default=os.path.join(ROOT, "spec", "data", "gemma3-golden.lua"))
    e.add_argument("--out")
    g = sub.add_parser("golden")
    g.add_argument("model")
    g.add_argument("--preset", required=True)
    g.add_argument("--seed", type=int, required=True)
    g.add_argument("--mix", default="q4_k_m")
    g.add_argument("--vocab", required=True, help="the vocabulary file's name, as recorded")
    g.add_argument("--out")
    g.add_argument("--luma")
    x = sub.add_parser("texts")
    x.add_argument("model")
    x.add_argument("--luma", required=True, help="the luma binary, whose tokenizer makes the ids")
    x.add_argument("--out", required=True)
    x.add_argument("--kv-f16", action="store_true", help="round keys and values to f16 as they are cached")
    args = ap.parse_args()
    {"compare": compare, "exact": exact_file, "golden": golden, "texts": texts_file}[args.cmd](args)


if __name__ == "__main__":
    main()
