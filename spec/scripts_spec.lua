-- The example scripts of scripts/ run, with few tokens, and print what
-- their comments promise. They run under the luma binary of $LUMA_BUILD_DIR.
local H = require "helper"

local bin = H.build_dir .. "/luma"

local function script(name, ...)
  local cmd = { bin, "scripts/" .. name }
  for _, a in ipairs{ ... } do cmd[#cmd + 1] = H.quote(a) end
  local out, err, code = H.run(table.concat(cmd, " "))
  assert.are.equal(0, code, name .. " failed: " .. err)
  return out, err
end

describe("example scripts", function()
  local model
  setup(function() model = H.load{ ctx = 128 } end)
  teardown(function() if model then model:close() end end)

  local function greedy_text(prompt, n)
    return model:detokenize(H.greedy(model, model:tokenize(prompt), n))
  end

  it("generate.lua streams a sampled completion after the prompt, the same for the same seed", function()
    local out, err = script("generate.lua", "Once upon a time", "8", "7")
    assert.matches("^Once upon a time", out)
    local tokens = tonumber(err:match("(%d+) generated"))
    assert.is_true(tokens >= 1 and tokens <= 8)
    assert.matches("%[5 prompt tokens", err)
    assert.are.equal(out, (script("generate.lua", "Once upon a time", "8", "7")))
  end)

  it("chat.lua answers each turn on one sequence", function()
    local out, err, code = H.run("LUMA_MAX_TOKENS=4 " .. bin .. " scripts/chat.lua 'Hello!' 'And again?'")
    assert.are.equal(0, code, err)
    local first, second = out:find("> Hello!\n", 1, true), out:find("> And again?\n", 1, true)
    assert.is_truthy(first)
    assert.is_truthy(second)
    assert.is_true(second > first)
    -- Turns can also come from standard input, one per line.
    out, err, code = H.run("printf 'Hi\\n' | LUMA_MAX_TOKENS=3 " .. bin .. " scripts/chat.lua")
    assert.are.equal(0, code, err)
    assert.matches("^> Hi\n", out)
  end)

  it("sampling-lab.lua runs every policy on one prompt; its greedy line is the greedy text", function()
    local prompt = "The best way to learn a language is"
    local out = script("sampling-lab.lua", prompt, "6")
    local sections = 0
    for _ in out:gmatch("\n%[[^\n]+%] %(%d+ tokens%)\n") do sections = sections + 1 end
    assert.are.equal(8, sections)
    local greedy = out:match("%[greedy%] %(%d+ tokens%)\n%.%.%.([^\n]*)")
    local want = greedy_text(prompt, 6):match("^[^\n]*")
    assert.are.equal(want, greedy)
  end)

  it("beam.lua with width 1 finds the greedy continuation; wider beams rank by mean log-probability", function()
    local prompt = "The three primary colors are"
    local out = script("beam.lua", prompt, "4", "1")
    local text = out:match("\n1%. %[mean log p %-?[%d.]+%] ([^\n]*)")
    assert.are.equal(prompt .. greedy_text(prompt, 4):gsub("\n", "\\n"), text)
    out = script("beam.lua", prompt, "3", "3")
    local scores = {}
    for s in out:gmatch("\n%d+%. %[mean log p (%-?[%d.]+)%]") do scores[#scores + 1] = tonumber(s) end
    assert.is_true(#scores >= 3)
    for i = 2, #scores do assert.is_true(scores[i] <= scores[i - 1]) end
  end)

  it("best-of-n.lua samples n completions from one prefix and prints the best first", function()
    local prompt = "A good name for a cat is"
    local out = script("best-of-n.lua", prompt, "3", "5")
    local scores, texts = {}, {}
    for s, t in out:gmatch("%d+%. %[mean log p (%-?[%d.]+)%] ([^\n]*)") do
      scores[#scores + 1] = tonumber(s)
      texts[#texts + 1] = t
    end
    assert.are.equal(3, #scores)
    for i = 2, 3 do assert.is_true(scores[i] <= scores[i - 1]) end
    for _, t in ipairs(texts) do assert.are.equal(prompt, t:sub(1, #prompt)) end
    assert.are.equal("best: " .. texts[1], out:match("\n(best: [^\n]*)"))
    assert.is_true(scores[1] < 0)
  end)

  it("speculative.lua writes the greedy text in fewer steps of the model than tokens", function()
    -- batch-invariant, so that on a GPU too a step of many rows gives each
    -- row what a step of one gives it
    local function stats(err)
      local t, steps, guessed, kept = err:match("(%d+) tokens in (%d+) steps of the model %([%d.]+ a step%); " ..
                                                 "(%d+) guessed, (%d+) kept")
      return tonumber(t), tonumber(steps), tonumber(guessed), tonumber(kept)
    end
    local out, err = script("speculative.lua", "-m", H.model_path(), "-i", "-c", "-n", "24")
    assert.matches("^def add%(a, b%):\n", out)
    local t, steps, guessed, kept = stats(err)
    assert.are.equal(24, t)
    assert.matches("one token a step: 24 tokens, [%d.]+ tokens/s; speedup [%d.]+x; the same ids: yes", err)
    -- a step writes its kept guesses and the model's next token
    assert.is_true(kept > 0 and kept <= guessed and (t - kept - steps == 0 or t - kept - steps == 1), err)
    -- the model as its own draft: every guess is the model's own token
    out, err = script("speculative.lua", "-m", H.model_path(), "-i", "-c", "-n", "12", "-k", "4",
                      "-d", H.model_path(), "Hello")
    t, steps, guessed, kept = stats(err)
    assert.are.equal(12, t)
    assert.are.equal(guessed, kept)
    assert.are.equal(3, steps)
    assert.matches("the same ids: yes", err)
    local _, err2, code = H.run(bin .. " scripts/speculative.lua -k 0")
    assert.are_not.equal(0, code)
    assert.matches("-k must be an integer from 1 to 64", err2, 1, true)
    _, err2, code = H.run(bin .. " scripts/speculative.lua --guesses x")
    assert.are_not.equal(0, code)
    assert.matches("option --guesses expects an integer, got 'x'", err2, 1, true)
    local help
    help, _, code = H.run(bin .. " scripts/speculative.lua --help")
    assert.are.equal(0, code)
    assert.matches("-k, --guesses INTEGER", help, 1, true)
  end)

  it("first-prompts.lua times each prompt length the first time and again", function()
    local out = script("first-prompts.lua", "-m", H.model_path(), "-l", "3,7,3")
    assert.matches("load %d+ ms\n", out)
    local rows = {}
    for n, first, again in out:gmatch("\n%s+(%d+)%s+([%d.]+)%s+([%d.]+)") do
      rows[#rows + 1] = { tonumber(n), tonumber(first), tonumber(again) }
    end
    assert.are.equal(3, #rows, out)
    for i, n in ipairs{ 3, 7, 3 } do
      assert.are.equal(n, rows[i][1])
      assert.is_true(rows[i][2] > 0 and rows[i][3] > 0, out)
    end
    local _, err, code = H.run(bin .. " scripts/first-prompts.lua -l 3,x")
    assert.are_not.equal(0, code)
    assert.matches("-l must list positive integers, got 'x'", err, 1, true)
  end)

  it("constrained.lua writes only one of the choices, and ranks them by log-probability", function()
    local prompt = "The capital of France is"
    local out, err = script("constrained.lua", "-m", H.model_path(), "-r", prompt, "Paris", "London", "zebra crossing")
    local text = out:match("^([^\n]*)\n")
    local choice = err:match("%[choice: ([^;]+);")
    assert.is_truthy(({ Paris = true, London = true, ["zebra crossing"] = true })[choice], err)
    assert.is_truthy(text == prompt .. choice or text == prompt .. " " .. choice, text)
    local lps, texts = {}, {}
    for lp, t in out:gmatch("\n%d+%. %[log p (%-?[%d.]+), %d+ tokens%] \"([^\n]*)\"") do
      lps[#lps + 1], texts[#texts + 1] = tonumber(lp), t
    end
    assert.are.equal(6, #lps)
    for j = 2, #lps do assert.is_true(lps[j] <= lps[j - 1]) end
    for _, lp in ipairs(lps) do assert.is_true(lp < 0) end
    -- a single unlikely choice is written whole, whatever the model prefers
    out, err = script("constrained.lua", "-m", H.model_path(), prompt, "zebra crossing")
    assert.matches("choice: zebra crossing;", err, 1, true)
    assert.is_truthy(out == prompt .. " zebra crossing\n" or out == prompt .. "zebra crossing\n", out)
    for seed = 1, 3 do
      out, err = script("constrained.lua", "-m", H.model_path(), "-s", tostring(seed), "My favourite colour is",
                        "red", "green", "dark blue")
      choice = err:match("%[choice: ([^;]+);")
      assert.is_truthy(({ red = true, green = true, ["dark blue"] = true })[choice], err)
      assert.matches("drawn, seed " .. seed, err, 1, true)
    end
    local _, err2, code = H.run(bin .. " scripts/constrained.lua 'only a prompt'")
    assert.are_not.equal(0, code)
    assert.matches("usage: scripts/constrained.lua", err2, 1, true)
  end)

  it("step-shapes.lua compares a prompt run as one step with one token per step: equal bits batch-invariant", function()
    local out = script("step-shapes.lua", "-n", "5,9", "-i")
    assert.matches("batch%-invariant", out)
    local lines = 0
    for n, d in out:gmatch("(%d+) tokens: one step against one token per step: max |diff| ([%d.]+)") do
      lines = lines + 1
      assert.are.equal(0, tonumber(d), n .. " tokens")
    end
    assert.are.equal(2, lines)
  end)

  it("step-times.lua splits aggregate decode steps into the Lua side and the run", function()
    local out = script("step-times.lua", "-b", "cpu", "-s", "2", "-p", "6", "-n", "3")
    assert.matches("2 sequences of 6 prompt tokens, 3 steps of one token each", out, 1, true)
    for _, label in ipairs{ "step 1", "step 2", "median of 3%-3" } do
      local total, adds, run = out:match(label .. "%s+([%d.]+) ms%s+adds%s+([%d.]+) us%s+run%s+([%d.]+) ms")
      assert.is_truthy(total, label)
      assert.is_true(tonumber(run) > 0 and tonumber(run) <= tonumber(total) and tonumber(adds) >= 0, label)
    end
    local _, err, code = H.run(bin .. " scripts/step-times.lua -n 2")
    assert.are_not.equal(0, code)
    assert.matches("-n at least 3", err, 1, true)
  end)

  it("scheduler-parts.lua times a scheduler's step part by part, with and without overlap", function()
    local out = script("scheduler-parts.lua", "-b", "cpu", "-s", "3", "-p", "8", "-g", "4", "-r", "1")
    assert.matches("cpu, 3 requests of 8 %+ 4 tokens, policy default", out)
    for _, mode in ipairs{ "off", "on " } do
      local line = out:match("overlap " .. mode .. ": ([^\n]+)")
      assert.is_truthy(line, mode)
      assert.is_true(tonumber(line:match("^([%d.]+) tokens/s")) > 0)
      local step, run = tonumber(line:match("step (%d+) us")), tonumber(line:match("batch:run (%d+)"))
      assert.is_true(run > 0 and run <= step)
      assert.is_truthy(line:match("choose %d+") and line:match("emit %d+") and line:match("rest %-?%d+"))
    end
    local calls = out:match("the default policy's calls on 3 rows %(us a row%): ([^\n]+)")
    for _, name in ipairs{ "top_k", "top_p", "temperature", "sample", "the four without __index" } do
      assert.is_true(tonumber(calls:match(name .. " ([%d.]+)")) > 0, name)
    end
    local const = script("scheduler-parts.lua", "-b", "cpu", "-s", "2", "-p", "4", "-g", "3", "-r", "1", "-P", "const")
    assert.matches("policy const", const)
    local _, err, code = H.run(bin .. " scripts/scheduler-parts.lua -P greedy")
    assert.are_not.equal(0, code)
    assert.matches("-P must be default or const", err, 1, true)
  end)

  it("scheduler-steps.lua times a scheduler's steps and the same rows by hand", function()
    local out = script("scheduler-steps.lua", "-b", "cpu", "-s", "3", "-p", "8", "-g", "4")
    assert.matches("cpu, 3 requests of 8 %+ 4 tokens", out)
    local tps, lua, policy = out:match("scheduler: ([%d.]+) tokens/s; Lua a step ([%d.]+) us, its policy ([%d.]+) us")
    assert.is_true(tonumber(tps) > 0 and tonumber(policy) > 0 and tonumber(policy) <= tonumber(lua))
    -- every step after the prompts has all 3 requests: they end together
    local steps, rows = out:match("steps of all requests: (%d+), ([%d.]+) rows")
    assert.are.equal(3, tonumber(steps))
    assert.are.equal(3, tonumber(rows))
    assert.is_nil(out:find("steps of fewer", 1, true))
    assert.is_true(tonumber(out:match("by hand: ([%d.]+) tokens/s")) > 0)
    local _, err, code = H.run(bin .. " scripts/scheduler-steps.lua -g 1")
    assert.are_not.equal(0, code)
    assert.matches("-g must be an integer of at least 2", err, 1, true)
  end)
end)
