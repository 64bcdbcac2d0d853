-- Many prompts at once: every prompt becomes a request of one scheduler,
-- and each forward pass carries a token of every running request. Text is
-- shown line by line under the request's number, as it arrives.
--
--   luma scripts/batch.lua [-f prompts.txt] [-n max_tokens] [-b token_budget]
--
-- prompts.txt holds one prompt per line ("-" reads standard input); without
-- it a small built-in list runs.
local luma = require "luma"
local Scheduler = require "luma.scheduler"
local P, S = luma.policy, luma.stop

local opt = { n = "48" }
for i = 1, #arg, 2 do
  local k = arg[i]:match("^%-(%a)$")
  if not k or arg[i + 1] == nil then error("usage: batch.lua [-f prompts.txt] [-n max_tokens] [-b token_budget]", 0) end
  opt[k] = arg[i + 1]
end
local max_tokens = math.tointeger(tonumber(opt.n))
local token_budget = opt.b and math.tointeger(tonumber(opt.b))

local prompts = {
  "The capital of France is",
  "Once upon a time, in a small village by the sea,",
  "Three reasons to learn a second language:",
  "def fibonacci(n):",
  "The recipe for a simple tomato soup:",
  "Water boils at",
  "A haiku about autumn:",
  "The three primary colours are",
}
if opt.f then
  prompts = {}
  for line in (opt.f == "-" and io.stdin:lines() or io.lines(opt.f)) do
    if line:match("%S") then prompts[#prompts + 1] = line end
  end
end

local model <close> = luma.load(require("luma.fetch").default_model())
local sch = Scheduler.new(model, { token_budget = token_budget })

-- Pieces are buffered per request; a line is printed once it is complete,
-- so the lines of different requests interleave but never mix.
local lines = {}
local function label(req) return "[" .. req.id .. "] " end

local function on_token(piece, _, req)
  local text = lines[req] .. piece
  for line in text:gmatch("(.-)\n") do print(label(req) .. line) end
  lines[req] = text:match("[^\n]*$")
end

local function on_done(req, _, stats)
  if lines[req] ~= "" then print(label(req) .. lines[req]) end
  local why = stats.error and ("error: " .. stats.error) or stats.stop
  print(string.format("%s(%d tokens, %s)", label(req), stats.tokens, why))
end

local t0 = luma.now()
for _, prompt in ipairs(prompts) do
  local req = sch:submit{ prompt = prompt, policy = P.greedy(), max_tokens = max_tokens,
                          stop = { S.eog() },
                          on_token = on_token, on_done = on_done }
  lines[req] = prompt
end
sch:run()
local time = luma.now() - t0

local st = sch.stats
print(string.format("%d requests, %d tokens generated, %d rows in %d steps, %.2f s, %.1f tokens/s",
                    #prompts, st.tokens, st.rows, st.steps, time, st.tokens / time))
