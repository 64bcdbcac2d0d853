-- Speculative decoding, greedy. A cheap guess of the next k tokens is
-- checked by one step of the model over all of them (seq:eval with
-- all = true): the guesses that match the model's own argmax are kept,
-- the first miss is replaced by the model's token, and the rest are
-- rewound out of the KV cache. The text is the model's greedy text; what
-- changes is how many tokens one step of the model yields.
--
-- The guess comes from the text itself (prompt lookup: the last g tokens
-- are looked for earlier in the prompt and the output, and what followed
-- them there is proposed), or from a smaller draft model with the same
-- vocabulary (-d), which decodes k tokens greedily on its own sequence.
--
--   luma scripts/speculative.lua [-m model] [-b backend] [-n tokens] [-k guesses]
--                                [-g ngram] [-l ngram] [-d draft] [-i] [-c] prompt
--
-- -m: the model (default: the default model); -b: cpu, cuda or auto;
-- -n: tokens to write (default 64); -k: guesses a step, at most (default 8);
-- -g, -l: the longest and the shortest n-gram looked up (default 3 and 2:
-- a single token's last occurrence is a poor guess); -d: a draft model's path;
-- -i: load batch-invariant (a GPU then computes a row alike in a step of
-- one and of many, so the text equals one-token greedy bit for bit);
-- -c: also decode plainly, one token a step (seq:greedy), and compare texts
-- and speed.
local luma = require "luma"
local cli = require "luma.cli"

local name, usage = "scripts/speculative.lua", "[options] [prompt]"
local spec = {
  model = { kind = "string", short = "m", help = "GGUF file (default: the default model)" },
  backend = { kind = "string", short = "b", help = "cpu, cuda or auto", default = "auto" },
  tokens = { kind = "integer", short = "n", help = "tokens to write", default = 64 },
  guesses = { kind = "integer", short = "k", help = "guesses a step, at most", default = 8 },
  ngram = { kind = "integer", short = "g", help = "the longest n-gram looked up", default = 3 },
  ["min-ngram"] = { kind = "integer", short = "l", help = "the shortest n-gram looked up", default = 2 },
  draft = { kind = "string", short = "d", help = "a draft model of the same vocabulary" },
  invariant = { kind = "flag", short = "i", help = "load batch-invariant" },
  compare = { kind = "flag", short = "c", help = "also decode one token a step and compare" },
}
local opt, words = cli.script(name, usage, spec, arg)
local function count(flag, v, lo, hi)
  if v < lo or v > hi then error(string.format("-%s must be an integer from %d to %d", flag, lo, hi), 0) end
  return v
end
local n, k, g = count("n", opt.tokens, 1, 100000), count("k", opt.guesses, 1, 64), count("g", opt.ngram, 1, 16)
local l = count("l", opt["min-ngram"], 1, g)
local prompt = #words > 0 and table.concat(words, " ") or
  "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"

local load_opts = { backend = opt.backend, batch_invariant = opt.invariant or nil }
local model <close> = luma.load(opt.model or require("luma.fetch").default_model(), load_opts)
local draft <close> = opt.draft and luma.load(opt.draft, load_opts) or nil
local ids = model:tokenize(prompt, { bos = true })
if draft then
  -- the draft's guesses are ids of the model's vocabulary
  local dids = draft:tokenize(prompt, { bos = true })
  local same = draft.n_vocab == model.n_vocab and #dids == #ids
  for j = 1, #ids do same = same and dids[j] == ids[j] end
  for id = 0, math.min(model.n_vocab, 1000) - 1 do same = same and draft:piece(id) == model:piece(id) end
  if not same then error("the draft model's vocabulary is not the model's", 0) end
end

-- Prompt lookup: the tokens that followed the latest earlier occurrence of
-- the history's last m tokens (m from g down to l), at most k of them.
local function lookup(hist, k)
  local h = #hist
  for m = math.min(g, h - 1), l, -1 do
    for s = h - m, 1, -1 do
      local hit = true
      for j = 0, m - 1 do
        if hist[s + j] ~= hist[h - m + 1 + j] then
          hit = false
          break
        end
      end
      if hit then
        local guess = {}
        for j = s + m, math.min(h, s + m + k - 1) do guess[#guess + 1] = hist[j] end
        return guess
      end
    end
  end
  return {}
end

-- Greedy text of n tokens at most, speculatively. Returns the ids, the
-- model's steps, the guesses made and the guesses kept.
local function speculate()
  local seq <close> = model:sequence()
  local dseq <close> = draft and draft:sequence() or nil
  local hist = { table.unpack(ids) }
  local out, steps, guessed, kept = {}, 0, 0, 0
  local next_id = seq:eval(ids):argmax()
  if dseq then dseq:eval(ids) end
  local t0 = luma.now()
  while true do
    -- next_id is the model's greedy token here: it is written, then fed
    -- with the guesses that follow it
    out[#out + 1], hist[#hist + 1] = next_id, next_id
    if #out >= n or model:is_eog(next_id) then break end
    local room = math.min(k, n - #out)
    local guess
    if dseq then
      guess = dseq:greedy(dseq:eval(next_id), room)
    else
      guess = lookup(hist, room)
    end
    local rows = seq:eval({ next_id, table.unpack(guess) }, { all = true })
    steps, guessed = steps + 1, guessed + #guess
    local j = 0
    while j < #guess and rows[j + 1]:argmax() == guess[j + 1] do
      j = j + 1
      out[#out + 1], hist[#hist + 1] = guess[j], guess[j]
      if model:is_eog(guess[j]) then break end
    end
    kept = kept + j
    if #out >= n or (j > 0 and model:is_eog(out[#out])) then break end
    next_id = rows[j + 1]:argmax()
    -- both caches keep the history written so far, the new next_id not
    -- yet fed
    if j < #guess then seq:rewind(seq:len() - (#guess - j)) end
    if dseq then
      if dseq:len() > #hist then dseq:rewind(#hist) end
      if dseq:len() < #hist then dseq:eval({ table.unpack(hist, dseq:len() + 1) }) end
    end
  end
  return out, steps, guessed, kept, luma.now() - t0
end

-- One token a step, through seq:greedy (each token taken on the device,
-- the fastest way the engine has to decode greedily one token at a time).
local function plain()
  local seq <close> = model:sequence()
  local logits = seq:eval(ids)
  local t0 = luma.now()
  local out = seq:greedy(logits, n, { on_token = function(id) return model:is_eog(id) end })
  return out, luma.now() - t0
end

-- times count from the prompt's logits: the prompt is evaluated alike
local out, steps, guessed, kept, t = speculate()
io.write(prompt, model:detokenize(out), "\n")
local by = draft and "draft " .. draft.info.name or string.format("prompt lookup of %d to %d tokens", l, g)
io.stderr:write(string.format(
  "[%s, %s: %d tokens in %d steps of the model (%.2f a step); %d guessed, %d kept (%.0f%%); %.1f tokens/s]\n",
  model.info.backend, by, #out, math.max(steps, 1), #out / math.max(steps, 1), guessed, kept,
  100 * kept / math.max(guessed, 1), #out / t))
if opt.compare then
  local ref, tp = plain()
  local same = #ref == #out
  for j = 1, #ref do same = same and ref[j] == out[j] end
  io.stderr:write(string.format("[one token a step: %d tokens, %.1f tokens/s; speedup %.2fx; the same ids: %s]\n",
    #ref, #ref / tp, tp / t, same and "yes" or "no"))
end
