-- A conversation on one sequence: each turn appends to the KV cache, so the
-- model never re-reads the earlier turns.
--
--   luma scripts/chat.lua "Hello!" "What did I just say?"    one turn per argument
--   luma scripts/chat.lua < questions.txt                    one turn per line
--
-- $LUMA_MAX_TOKENS bounds each answer (default 128).
local luma = require "luma"
local chat = require "luma.chat"
local P, S = luma.policy, luma.stop

local max_tokens = math.tointeger(tonumber(os.getenv("LUMA_MAX_TOKENS"))) or 128

local model <close> = luma.load(require("luma.fetch").default_model())
local template = chat.template_name(model)   -- "gemma" for the default model
local seq <close> = model:sequence()

local turns = { ... }
if #turns == 0 then
  for line in io.lines() do turns[#turns + 1] = line end
end

for i, user in ipairs(turns) do
  -- The template writes the turn markers as special tokens; the first turn
  -- also carries <bos>, which later turns must not repeat.
  local text = chat.format(model, { { role = "user", content = user } }, template)
  if i > 1 then text = text:gsub("^<bos>", "") end
  local ids = model:tokenize(text, { bos = false, special = true })
  print("> " .. user)
  for piece in luma.stream(model, ids, { seq = seq, max_tokens = max_tokens, seed = i,
                                         policy = P.from_options{ temp = 0.7, top_k = 40, top_p = 0.95 },
                                         stop = { S.eog() } }) do
    io.write(piece)
    io.flush()
  end
  io.write("\n")
  -- The answer's closing token was chosen but not evaluated: close the turn
  -- in the cache before the next one.
  seq:eval(model:tokenize(chat.turn_end[template], { bos = false, special = true }))
end
