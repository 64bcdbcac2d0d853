-- One prompt, several policies side by side: the library's own and two
-- written here, in the same few lines a user would write.
--
--   luma scripts/sampling-lab.lua "The best way to learn a language is" [max_tokens]
local luma = require "luma"
local P, S = luma.policy, luma.stop

local prompt = arg[1] or "The best way to learn a language is"
local max_tokens = math.tointeger(tonumber(arg[2])) or 32

local model <close> = luma.load(require("luma.fetch").default_model())

-- A transform of our own: a temperature that follows the model's certainty,
-- sharper when the distribution is flat (high entropy), looser when peaked.
local function entropy_temperature(lo, hi)
  return function(logits)
    local h = logits:entropy()              -- nats
    local t = hi - (hi - lo) * math.min(h / 5, 1)
    logits:temperature(t)
  end
end

-- A policy of our own: greedy, but never the same token twice in a row.
local function no_stutter(logits, state)
  local last = state.tokens[#state.tokens]
  logits[last] = -math.huge
  return logits:argmax()
end

local policies = {
  { "greedy", P.greedy() },
  { "temperature 0.7, top-k 40", P.chain{ P.top_k(40), P.temperature(0.7) } },
  { "top-p 0.9", P.chain{ P.top_p(0.9) } },
  { "min-p 0.1, temperature 1.2", P.chain{ P.min_p(0.1), P.temperature(1.2) } },
  { "typical 0.9", P.chain{ P.typical(0.9) } },
  { "mirostat tau 4", P.mirostat{ tau = 4, eta = 0.1 } },
  { "entropy-scaled temperature", P.chain{ P.top_k(100), entropy_temperature(0.3, 1.0) } },
  { "greedy without stutter", no_stutter },
}

print(prompt)
for _, p in ipairs(policies) do
  local name, policy = p[1], p[2]
  local text, stats = luma.generate(model, prompt, { policy = policy, max_tokens = max_tokens, seed = 1,
                                                     stop = { S.eog(), S.strings{ "\n" } } })
  print(string.format("\n[%s] (%d tokens)\n...%s", name, stats.tokens, text))
end
