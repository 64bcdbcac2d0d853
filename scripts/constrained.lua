-- Constrained decoding: the model may only write one of the given choices
-- (each with or without a leading space). At every step the tokens whose
-- text keeps the output a prefix of a live choice are allowed
-- (logits:allow) and the rest are masked; an end-of-generation token is
-- allowed once the output is a whole choice that another choice extends.
-- The token is the greedy one among those allowed, or drawn (-s seed).
-- With -r it also ranks the choices by the log-probability the model gives
-- each one's own tokens after the prompt (one fork of the prompt a choice).
--
--   luma scripts/constrained.lua [-m model] [-b backend] [-s seed] [-r] prompt choice [choice...]
local luma = require "luma"
local cli = require "luma.cli"

local name, usage = "scripts/constrained.lua", "[options] prompt choice [choice...]"
local spec = {
  model = { kind = "string", short = "m", help = "GGUF file (default: the default model)" },
  backend = { kind = "string", short = "b", help = "cpu, cuda or auto", default = "auto" },
  seed = { kind = "integer", short = "s", help = "draw the tokens with this seed (default: greedy)" },
  rank = { kind = "flag", short = "r", help = "also rank the choices by log-probability" },
}
local opt, words = cli.script(name, usage, spec, arg)
if #words < 2 then error("usage: " .. name .. " " .. usage, 0) end
local seed = opt.seed
local prompt = words[1]
local targets, seen = {}, {}
for j = 2, #words do
  if words[j] == "" then error("a choice is empty", 0) end
  for _, t in ipairs{ words[j], " " .. words[j] } do
    if not seen[t] then
      seen[t] = true
      targets[#targets + 1] = { text = t, choice = words[j] }
    end
  end
end

local model <close> = luma.load(opt.model or require("luma.fetch").default_model(), { backend = opt.backend })

-- Every token's text, for ordinary and byte tokens: ids by text.
local by_text, longest = {}, 0
for id = 0, model.n_vocab - 1 do
  local kind = model:token_type(id)
  if kind == "normal" or kind == "byte" then
    local p = model:piece(id)
    if #p > 0 then
      local list = by_text[p]
      if not list then
        list = {}
        by_text[p] = list
      end
      list[#list + 1] = id
      longest = math.max(longest, #p)
    end
  end
end

-- The ids allowed after `text`, and the target text equals (if any).
local function allowed(text)
  local ids, set, whole = {}, {}, nil
  for _, t in ipairs(targets) do
    if t.text:sub(1, #text) == text then
      if #t.text == #text then whole = t end
      local rest = t.text:sub(#text + 1)
      for j = 1, math.min(#rest, longest) do
        for _, id in ipairs(by_text[rest:sub(1, j)] or {}) do
          if not set[id] then
            set[id] = true
            ids[#ids + 1] = id
          end
        end
      end
    end
  end
  if whole and #ids > 0 then
    for _, id in ipairs{ model.eos, model.eot } do
      if id and not set[id] then
        set[id] = true
        ids[#ids + 1] = id
      end
    end
  end
  return ids, whole
end

local rng = seed and luma.rng(seed)
local seq <close> = model:sequence()
local prompt_ids = model:tokenize(prompt, { bos = true })
local logits = seq:eval(prompt_ids)
local text, written, whole = "", {}, nil
while true do
  local ids
  ids, whole = allowed(text)
  if #ids == 0 then break end
  logits:allow(ids)
  local id = rng and logits:sample(rng) or logits:argmax()
  if model:is_eog(id) then break end
  written[#written + 1] = id
  text = text .. model:piece(id)
  logits = seq:eval(id)
end
print(prompt .. text)
io.stderr:write(string.format("[choice: %s; %d tokens, %s]\n", whole and whole.choice or "(none)", #written,
  rng and "drawn, seed " .. seed or "greedy"))

if opt.rank then
  -- log p(choice | prompt) over the model's own tokens of each target text
  local base <close> = model:sequence()
  local last = base:eval(prompt_ids):copy():log_softmax()
  local ranked = {}
  for _, t in ipairs(targets) do
    local tids = model:tokenize(t.text, { bos = false })
    local fork <close> = base:fork()
    local lp, rows = last[tids[1]], #tids > 1 and fork:eval(tids, { all = true }) or {}
    for j = 2, #tids do lp = lp + rows[j - 1]:log_softmax()[tids[j]] end
    ranked[#ranked + 1] = { text = t.text, lp = lp, n = #tids }
  end
  table.sort(ranked, function(a, b) return a.lp > b.lp end)
  for rank, r in ipairs(ranked) do
    print(string.format("%d. [log p %.3f, %d tokens] %q", rank, r.lp, r.n, r.text))
  end
end
