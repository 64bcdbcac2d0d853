-- luma.generate(model, prompt, opts) -> text, stats
-- Runs a generation to the end (luma.stream.run: with P.greedy() through
-- seq:greedy, with a sampling chain P.sampler knows through seq:sample)
-- and joins the pieces. stats: prompt_tokens, tokens, stop (the
-- reason), ttft and time in seconds, tokens_per_s (decode).
local stream = require "luma.stream"

local function generate(model, prompt, opts)
  opts = opts or {}
  local stats = {}
  local o = setmetatable({ stats = stats }, { __index = opts })
  local parts = {}
  stream.run(model, prompt, o, function(piece) parts[#parts + 1] = piece end)
  return table.concat(parts), stats
end

return generate
