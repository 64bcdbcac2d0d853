-- Stream a completion, token by token.
--
--   luma scripts/generate.lua "Once upon a time" [max_tokens] [seed]
--
-- The model is $LUMA_MODEL, or the default model that `luma fetch` downloads.
local luma = require "luma"
local P, S = luma.policy, luma.stop

local prompt = arg[1] or "Once upon a time"
local max_tokens = math.tointeger(tonumber(arg[2])) or 64
local seed = math.tointeger(tonumber(arg[3])) or 42

local model <close> = luma.load(require("luma.fetch").default_model())

-- A policy is a function (logits, state) -> token id. P.chain runs these
-- transforms on the logits in order, then samples with the seeded rng.
local policy = P.chain{
  P.penalties{ repeat_ = 1.1, last_n = 64 },
  P.top_k(40),
  P.top_p(0.95),
  P.temperature(0.8),
}

-- Stop at the model's end-of-generation token or at a blank line; the text
-- of a stop string is not shown, even when it arrives split over tokens.
local stop = { S.eog(), S.strings{ "\n\n" } }

local stats = {}
io.write(prompt)
for piece in luma.stream(model, prompt, { policy = policy, stop = stop, max_tokens = max_tokens,
                                         seed = seed, stats = stats }) do
  io.write(piece)
  io.flush()
end
io.write("\n")
io.stderr:write(string.format("[%d prompt tokens, %d generated, stop: %s, %.1f tokens/s]\n",
                              stats.prompt_tokens, stats.tokens, stats.stop, stats.tokens_per_s or 0))
