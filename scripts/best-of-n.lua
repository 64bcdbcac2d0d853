-- Best of n: sample n completions that share the prompt's KV cache (each is
-- a fork of one prefilled sequence), score each by the mean log-probability
-- the model gave its tokens, and keep the best.
--
--   luma scripts/best-of-n.lua "A good name for a cat is" [n] [max_tokens]
local luma = require "luma"
local P, S = luma.policy, luma.stop

local prompt = arg[1] or "A good name for a cat is"
local n = math.tointeger(tonumber(arg[2])) or 4
local max_tokens = math.tointeger(tonumber(arg[3])) or 16

local model <close> = luma.load(require("luma.fetch").default_model())

-- Prefill all but the last prompt token once; each sample starts from a
-- fork of it by evaluating that last token.
local ids = model:tokenize(prompt)
local prefix <close> = model:sequence()
if #ids > 1 then prefix:eval({ table.unpack(ids, 1, #ids - 1) }) end

-- Wraps a policy to record the log-probability of every token it picks,
-- measured on the model's own distribution before the policy's transforms.
local function scored(policy, logps)
  return function(logits, state)
    local lp = logits:copy():log_softmax()
    local id = policy(logits, state)
    logps[#logps + 1] = lp[id]
    return id
  end
end

local samples = {}
for i = 1, n do
  local logps = {}
  local seq <close> = prefix:fork()
  local text = luma.generate(model, { ids[#ids] }, {
    seq = seq, seed = i, max_tokens = max_tokens, stop = { S.eog(), S.strings{ "\n" } },
    policy = scored(P.chain{ P.top_k(40), P.temperature(1.0) }, logps) })
  local sum = 0
  for _, lp in ipairs(logps) do sum = sum + lp end
  samples[i] = { text = text, score = sum / math.max(#logps, 1) }
end

table.sort(samples, function(a, b) return a.score > b.score end)
for rank, s in ipairs(samples) do
  print(string.format("%d. [mean log p %.3f] %s%s", rank, s.score, prompt, s.text))
end
print("best: " .. prompt .. samples[1].text)
