-- Beam search: keep the `width` most likely continuations, extend each by
-- its best next tokens, keep the best `width` again. Every beam is a fork of
-- its parent sequence, sharing the prompt's KV cache; each step evaluates
-- all beams in one batched forward pass.
--
--   luma scripts/beam.lua "The three primary colors are" [steps] [width]
local luma = require "luma"

local prompt = arg[1] or "The three primary colors are"
local steps = math.tointeger(tonumber(arg[2])) or 12
local width = math.tointeger(tonumber(arg[3])) or 3

local model <close> = luma.load(require("luma.fetch").default_model())

-- A beam: its sequence (all tokens evaluated), the logits after its last
-- token, the generated ids, and their total log-probability.
local root = model:sequence()
local beams = { { seq = root, logits = root:eval(model:tokenize(prompt)), ids = {}, score = 0 } }
local finished = {}

for _ = 1, steps do
  -- Every beam proposes its `width` most likely next tokens.
  local candidates = {}
  for _, b in ipairs(beams) do
    local ids, logp = b.logits:copy():log_softmax():topk(width)
    for i = 1, #ids do
      candidates[#candidates + 1] = { parent = b, id = ids[i], score = b.score + logp[i] }
    end
  end
  table.sort(candidates, function(x, y) return x.score > y.score end)

  -- The best `width` survive: each forks its parent and takes its token,
  -- all in one batch. A candidate ending the text is set aside as finished.
  local batch, next_beams = model:batch(), {}
  for i = 1, math.min(width, #candidates) do
    local c = candidates[i]
    local ids = { table.unpack(c.parent.ids) }
    ids[#ids + 1] = c.id
    if model:is_eog(c.id) then
      finished[#finished + 1] = { ids = c.parent.ids, score = c.score }
    else
      local b = { seq = c.parent.seq:fork(), ids = ids, score = c.score }
      batch:add(b.seq, c.id)
      next_beams[#next_beams + 1] = b
    end
  end
  for _, b in ipairs(beams) do b.seq:close() end
  if #next_beams == 0 then beams = {}; break end
  local out = batch:run()
  for _, b in ipairs(next_beams) do b.logits = out[b.seq] end
  beams = next_beams
end

for _, b in ipairs(beams) do
  finished[#finished + 1] = b
  b.seq:close()
end
-- Longer texts collect more negative log-probability: rank by the mean.
local function mean(b) return b.score / math.max(#b.ids, 1) end
table.sort(finished, function(x, y) return mean(x) > mean(y) end)
print(prompt)
for rank, b in ipairs(finished) do
  local text = model:detokenize(b.ids):gsub("\n", "\\n")
  print(string.format("%d. [mean log p %.3f] %s%s", rank, mean(b), prompt, text))
end
