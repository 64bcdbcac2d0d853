-- The luma command and the C module, run as separate processes: the build
-- directory is $LUMA_BUILD_DIR (default "build").
local H = require "helper"
local luma = require "luma"

local dir = H.build_dir
local bin = dir .. "/luma"

-- An ASan-instrumented luma.so loads into a stock interpreter only with the
-- sanitizer runtimes preloaded.
local function stock_lua_env()
  local cache = io.open(dir .. "/CMakeCache.txt")
  local sanitized = cache and cache:read("a"):find("LUMA_SANITIZE:BOOL=ON", 1, true)
  if cache then cache:close() end
  if not sanitized then return "" end
  local libs = {}
  for _, lib in ipairs{ "libasan.so", "libubsan.so" } do
    libs[#libs + 1] = (H.run("gcc -print-file-name=" .. lib)):gsub("%s+$", "")
  end
  return "LD_PRELOAD=" .. H.quote(table.concat(libs, " ")) .. " ASAN_OPTIONS=detect_leaks=0 "
end

describe("the luma command", function()
  local model_path
  setup(function()
    model_path = H.model_path()
    local f = io.open(bin)
    assert(f, bin .. " does not exist: build first, or set LUMA_BUILD_DIR")
    f:close()
  end)

  it("prints its usage with --help (status 0) and without arguments (status 2)", function()
    local out, _, code = H.run(bin .. " --help")
    assert.are.equal(0, code)
    for _, cmd in ipairs{ "generate", "chat", "info", "bench", "fetch", "-e" } do
      assert.matches("luma " .. cmd, out, 1, true)
    end
    local _, err
    _, err, code = H.run(bin)
    assert.are.equal(2, code)
    assert.matches("usage: luma", err, 1, true)
    out = H.run(bin .. " --version")
    assert.matches("^luma %d+%.%d+%.%d+ %(Lua 5%.4", out)
  end)

  it("prints --help for every subcommand", function()
    for cmd, option in pairs{ generate = "--temp", chat = "--system", info = "--all", bench = "--prompt" } do
      local out, err, code = H.run(bin .. " " .. cmd .. " --help")
      assert.are.equal(0, code, cmd .. ": " .. err)
      assert.matches("usage: luma " .. cmd, out, 1, true)
      assert.matches(option, out, 1, true)
    end
    local out, _, code = H.run(bin .. " fetch --help")
    assert.are.equal(0, code)
    assert.matches("usage: luma fetch", out, 1, true)
    assert.matches("Models: gemma-3-270m, qwen2.5-coder-0.5b.", out, 1, true)
  end)

  it("fetch names the models it knows when asked for another, and downloads nothing", function()
    local _, err, code = H.run(bin .. " fetch no-such-model")
    assert.are_not.equal(0, code)
    assert.matches("fetch: no model named 'no-such-model' (models: gemma-3-270m, qwen2.5-coder-0.5b)", err, 1, true)
    _, err, code = H.run(bin .. " fetch gemma-3-270m qwen2.5-coder-0.5b")
    assert.are_not.equal(0, code)
    assert.matches("one model name at most", err, 1, true)
  end)

  it("info prints the metadata and the tensor table of a file", function()
    local out, err, code = H.run(bin .. " info " .. H.quote(model_path))
    assert.are.equal(0, code, err)
    assert.matches("metadata %(33 keys%)", out)
    assert.matches('general.architecture%s+"gemma3"', out)
    assert.matches("tensors %(236%):", out)
    assert.matches("token_embd.weight%s+Q8_0%s+%[640, 262144%]%s+178257920 bytes", out)
    assert.matches("output_norm.weight%s+F32%s+%[640%]%s+2560 bytes", out)
    assert.matches("total: %d+ bytes", out)
  end)

  it("generate with --temp 0 prints the greedy continuation, the same every run", function()
    local prompt = "The capital of France is"
    local cmd = bin .. " generate -m " .. H.quote(model_path) .. " -t 2 -p " .. H.quote(prompt) .. " -n 8 --temp 0"
    local out, err, code = H.run(cmd)
    assert.are.equal(0, code, err)
    local model = H.load{ ctx = 64 }
    local want = prompt .. model:detokenize(H.greedy(model, model:tokenize(prompt), 8)) .. "\n"
    model:close()
    assert.are.equal(want, out)
    assert.are.equal(out, (H.run(cmd)))
  end)

  it("generate --float-act continues greedily as a model loaded with float_act", function()
    local prompt = "The capital of France is"
    local cmd = bin .. " generate -m " .. H.quote(model_path) .. " -t 2 -p " .. H.quote(prompt) ..
                " -n 6 --temp 0 --float-act"
    local out, err, code = H.run(cmd)
    assert.are.equal(0, code, err)
    local model = H.load{ ctx = 64, float_act = true }
    assert.is_true(model.info.float_act)
    local want = prompt .. model:detokenize(H.greedy(model, model:tokenize(prompt), 6)) .. "\n"
    model:close()
    assert.are.equal(want, out)
  end)

  it("bench --depth decodes after a long prompt and counts the cache's bytes each step reads", function()
    local out, err, code = H.run(bin .. " bench -m " .. H.quote(model_path) .. " -t 2 --ctx 1024 -p 8 -n 3 -d 600")
    assert.are.equal(0, code, err)
    local tps = tonumber(out:match("decode at depth 600 %(seq:greedy%)%s+([%d.]+)%s+tokens/s"))
    assert.is_true(tps and tps > 0, out)
    -- the timed steps (the 2nd and 3rd) see 602 and 603 keys: all of them
    -- in the 3 global layers, the window's 512 in the 15 sliding ones, 1 KiB
    -- a key and layer
    local want = string.format("%.1f", (3 * 602.5 + 15 * 512) * 1024 / 1048576)
    assert.matches("weights %+ KV read per token at 600%s+[%d.]+ %+ " .. want:gsub("%.", "%%.") .. "%s", out)
  end)

  it("bench -b reports each batch size's aggregate decode, the best of -r runs", function()
    local out, err, code = H.run(bin .. " bench -m " .. H.quote(model_path) ..
                                 " -t 2 -p 8 -n 3 -r 2 -b 1,2 --batch-prompt 16 --policy")
    assert.are.equal(0, code, err)
    for _, n in ipairs{ 1, 2 } do
      for _, what in ipairs{ " %(16%+3%)", ", sampled", ", luma%.draw" } do
        local tps = tonumber(out:match("aggregate decode, " .. n .. " seqs" .. what .. "%s+([%d.]+)%s+tokens/s"))
        assert.is_true(tps and tps > 0, out)
      end
      assert.matches("scheduler, " .. n .. " requests %(16%+3%)%s+[%d.]+%s+tokens/s", out)
    end
    -- the best of the runs: the highest rate, with that run's first step
    local rates, calls = { { 3, 0.3 }, { 5, 0.5 }, { 4, 0.4 } }, 0
    local rate, first = require("luma.bench").best_rate(3, function()
      calls = calls + 1
      return rates[calls][1], rates[calls][2]
    end)
    assert.are.same({ 3, 5, 0.5 }, { calls, rate, first })
  end)

  it("runs a chunk with -e, passing the remaining arguments as ...", function()
    local out, err, code = H.run(bin .. " -e 'local luma = require \"luma\"; print(luma.version, ...)' a 'b c'")
    assert.are.equal(0, code, err)
    assert.are.equal(luma.version .. "\ta\tb c\n", out)
    -- The chunk stands where a script's name would: arg[0].
    out = H.run(bin .. " -e 'print(arg[0], arg[1], arg[-1], arg[-2])' x")
    assert.are.equal("print(arg[0], arg[1], arg[-1], arg[-2])\tx\t-e\t" .. bin .. "\n", out)
  end)

  it("runs a script with arg and ... set as the lua command sets them", function()
    local script = os.tmpname()
    H.write(script, "print(arg[0], #arg, arg[1], arg[2], arg[-1])\nprint(select('#', ...), ...)\n" ..
                    "print(type(require('luma').load), type(require('luma').policy.greedy))\n")
    local out, err, code = H.run(bin .. " " .. script .. " one 'two words'")
    os.remove(script)
    assert.are.equal(0, code, err)
    assert.are.equal(script .. "\t2\tone\ttwo words\t" .. bin .. "\n2\tone\ttwo words\nfunction\tfunction\n", out)
  end)

  it("exits with a non-zero status and a message for bad options and failing scripts", function()
    local _, err, code = H.run(bin .. " generate --no-such-option")
    assert.are.equal(1, code)
    assert.matches("luma: generate: unknown option --no-such-option", err, 1, true)
    assert.is_nil(err:find("traceback"))
    _, err, code = H.run(bin .. " generate -m " .. H.quote(model_path) .. " -n many -p hi")
    assert.are.equal(1, code)
    assert.matches("option -n expects an integer, got 'many'", err, 1, true)
    _, err, code = H.run(bin .. " bench -m " .. H.quote(model_path) .. " -n 1")
    assert.are.equal(1, code)
    assert.matches("bench: -n must be at least 2", err, 1, true)
    assert.is_nil(err:find("traceback"))
    for _, bad in ipairs{ "-d abc", "-b 8,,32", "-p 0", "-d 1.5" } do
      _, err, code = H.run(bin .. " bench -m " .. H.quote(model_path) .. " -n 2 " .. bad)
      assert.are.equal(1, code, bad)
      assert.matches("bench: %-%-%a+ expects positive integers separated by commas, got '", err)
      assert.is_nil(err:find("traceback"))
    end
    for bad, msg in pairs{ ["--peak-gbs copy"] = "bench: --peak-gbs copy: the cpu backend has no device copy to measure",
                           ["--peak-gbs fast"] = "bench: --peak-gbs expects GB/s (a positive number) or 'copy', got 'fast'",
                           ["--peak-gbs -3"] = "bench: --peak-gbs expects GB/s (a positive number) or 'copy', got '-3'" } do
      _, err, code = H.run(bin .. " bench -m " .. H.quote(model_path) .. " --backend cpu -t 2 -p 8 -n 2 " .. bad)
      assert.are.equal(1, code, bad)
      assert.matches(msg, err, 1, true)
      assert.is_nil(err:find("traceback"))
    end
    _, err, code = H.run(bin .. " bench -m " .. H.quote(model_path) .. " --ctx 64 -n 2 -d 63")
    assert.are.equal(1, code)
    assert.matches("bench: --depth 63 and -n 2 need a context of 65 tokens, the model has 64", err, 1, true)
    assert.is_nil(err:find("traceback"))
    _, err, code = H.run(bin .. " generate -m /no/such.gguf -p hi")
    assert.are.equal(1, code)
    assert.matches("/no/such.gguf", err, 1, true)
    _, err, code = H.run(bin .. " -e 'error(\"script failed\")'")
    assert.are.equal(1, code)
    assert.matches("script failed", err, 1, true)
    assert.matches("traceback", err, 1, true)
    _, err, code = H.run(bin .. " /no/such/script.lua")
    assert.are.equal(1, code)
    assert.matches("cannot open /no/such/script.lua", err, 1, true)
  end)

  it("builds luma.so, which a stock lua5.4 can require, Lua half included", function()
    local code_text = "package.cpath = " .. string.format("%q", dir .. "/?.so;") .. " .. package.cpath; " ..
      "local luma = require 'luma'; " ..
      "local m = luma.load(" .. string.format("%q", model_path) .. ", { threads = 2, ctx = 64 }); " ..
      "io.write((luma.generate(m, 'The capital of France is', { policy = luma.policy.greedy(), max_tokens = 6 }))); " ..
      "m:close()"
    local out, err, code = H.run(stock_lua_env() .. "lua5.4 -e " .. H.quote(code_text))
    assert.are.equal(0, code, err)
    local model = H.load{ ctx = 64 }
    local want = model:detokenize(H.greedy(model, model:tokenize("The capital of France is"), 6))
    model:close()
    assert.are.equal(want, out)
  end)
end)
