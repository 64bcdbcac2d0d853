-- The Lua half of generation: policies, stop conditions, luma.stream and
-- luma.generate.
local luma = require "luma"
local H = require "helper"
local P, S = luma.policy, luma.stop

local PROMPT = "Once upon a time"

describe("policies, stops and streams", function()
  local model
  setup(function() model = H.load{ ctx = 256 } end)
  teardown(function() if model then model:close() end end)

  -- ids and pieces of a stream, with its stats.
  local function run(opts, prompt)
    local ids, pieces, stats = {}, {}, {}
    opts.stats = stats
    for piece, id in luma.stream(model, prompt or PROMPT, opts) do
      ids[#ids + 1] = id
      pieces[#pieces + 1] = piece
    end
    return ids, pieces, stats
  end

  it("P.greedy picks logits:argmax", function()
    local seq = model:sequence()
    local logits = seq:eval(model:tokenize(PROMPT))
    assert.are.equal(logits:argmax(), P.greedy()(logits:copy(), {}))
    seq:close()
    local ids = run{ policy = P.greedy(), max_tokens = 6 }
    assert.are.same(H.greedy(model, model:tokenize(PROMPT), 6), ids)
  end)

  it("greedy written in plain Lua over the logits equals the C argmax", function()
    local function lua_greedy(logits)
      local best, id = -math.huge, nil
      for i = 0, #logits - 1 do
        local x = logits[i]
        if x > best then best, id = x, i end
      end
      return id
    end
    local a = run{ policy = lua_greedy, max_tokens = 4 }
    local b = run{ policy = P.greedy(), max_tokens = 4 }
    assert.are.same(b, a)
  end)

  it("P.chain applies its transforms in order, then samples with the state's rng", function()
    local chain = P.chain{ P.top_k(5), P.temperature(0.7) }
    local function by_hand(logits, state) return logits:top_k(5):temperature(0.7):sample(state.rng) end
    local a = run{ policy = chain, max_tokens = 6, seed = 11 }
    local b = run{ policy = by_hand, max_tokens = 6, seed = 11 }
    assert.are.same(b, a)
    -- A chain whose transforms leave one token samples that token.
    assert.are.same(run{ policy = P.greedy(), max_tokens = 4 },
                    run{ policy = P.chain{ P.top_k(1) }, max_tokens = 4, seed = 3 })
    -- A chooser in the chain ends it.
    assert.are.same(run{ policy = P.greedy(), max_tokens = 4 },
                    run{ policy = P.chain{ P.temperature(5), P.greedy() }, max_tokens = 4, seed = 3 })
  end)

  it("is deterministic: the same seed and policy give the same tokens", function()
    local policy = P.from_options{ temp = 1.2, top_k = 50, top_p = 0.95, min_p = 0.01, repeat_ = 1.1 }
    local a = run{ policy = policy, max_tokens = 8, seed = 99 }
    local b = run{ policy = policy, max_tokens = 8, seed = 99 }
    assert.are.same(a, b)
    local differs = false
    for seed = 100, 104 do
      if table.concat(run{ policy = policy, max_tokens = 8, seed = seed }, " ") ~= table.concat(a, " ") then
        differs = true
      end
    end
    assert.is_true(differs, "five other seeds all gave the same tokens")
  end)

  it("passes the policy a state with the model, sequence, tokens, step and rng", function()
    local seen = {}
    local prompt_ids = model:tokenize(PROMPT)
    run{ max_tokens = 3, policy = function(logits, state)
      assert.are.equal(model, state.model)
      assert.are.equal(#prompt_ids, state.prompt_len)
      assert.are.equal(#prompt_ids + state.step, #state.tokens)
      assert.are.equal(#state.tokens, state.seq:len())
      assert.matches("luma.Rng", tostring(state.rng))
      seen[#seen + 1] = state.step
      return logits:argmax()
    end }
    assert.are.same({ 0, 1, 2 }, seen)
  end)

  it("runs mirostat and the other library transforms as policies", function()
    local ids = run{ policy = P.mirostat{ tau = 3, eta = 0.2 }, max_tokens = 6, seed = 5 }
    assert.are.equal(6, #ids)
    local list = { P.penalties{ repeat_ = 1.2, frequency = 0.1, presence = 0.1 }, P.min_p(0.05), P.typical(0.95),
                   P.bias{ [model.eos] = -math.huge }, P.top_p(0.9), P.temperature(0.8) }
    assert.are.equal(6, #run{ policy = P.chain(list), max_tokens = 6, seed = 5 })
    assert.has_error(function() P.top_k(0) end)
    assert.has_error(function() P.top_p(2) end)
    assert.has_error(function() P.temperature(-1) end)
    assert.has_error(function() P.chain{ 1 } end)
  end)

  it("stops after max_tokens, through the option or S.max_tokens", function()
    local ids, _, stats = run{ policy = P.greedy(), max_tokens = 3 }
    assert.are.equal(3, #ids)
    assert.are.equal(3, stats.tokens)
    assert.are.equal("max_tokens", stats.stop)
    ids, _, stats = run{ policy = P.greedy(), max_tokens = 50, stop = { S.max_tokens(2) } }
    assert.are.equal(2, #ids)
    assert.are.equal("stop", stats.stop)
    ids, _, stats = run{ policy = P.greedy(), max_tokens = 0 }
    assert.are.same({}, ids)
    assert.are.equal("max_tokens", stats.stop)
    -- A limit of 0 makes no token, through the condition as through the option.
    local asked = 0
    local function counting(logits) asked = asked + 1; return logits:argmax() end
    ids, _, stats = run{ policy = counting, max_tokens = 5, stop = { S.eog(), S.max_tokens(0) } }
    assert.are.same({}, ids)
    assert.are.equal(0, stats.tokens)
    assert.are.equal(0, asked)
    assert.are.equal("stop", stats.stop)
    assert.are.equal("", (luma.generate(model, PROMPT, { policy = counting, stop = S.max_tokens(0) })))
    assert.are.equal(0, asked)
    assert.are.equal(1, #run{ policy = P.greedy(), max_tokens = 5, stop = { S.max_tokens(1) } })
  end)

  it("stops at an end-of-generation token with S.eog, dropping its text", function()
    local force_eos = P.chain{ P.bias{ [model.eos] = 1000 }, P.greedy() }
    local ids, pieces, stats = run{ policy = force_eos, max_tokens = 5, stop = { S.eog() } }
    assert.are.equal(1, stats.tokens)
    assert.are.equal("eog", stats.stop)
    assert.are.same({}, ids)
    assert.are.same({}, pieces)
    local text, gstats = luma.generate(model, PROMPT, { policy = force_eos, max_tokens = 5 })
    assert.are.equal("", text)
    assert.are.equal("eog", gstats.stop)
    -- After some text: that text is streamed, the marker's is not.
    local function late_eos(logits, state)
      if state.step == 2 then return model.eos end
      return logits:argmax()
    end
    local want = model:detokenize(H.greedy(model, model:tokenize(PROMPT), 2))
    ids, pieces, stats = run{ policy = late_eos, max_tokens = 5 }
    assert.are.equal(want, table.concat(pieces))
    assert.are.equal(3, stats.tokens)
    assert.are.equal("eog", stats.stop)
    assert.are.equal(2, #ids)
  end)

  it("adds no second BOS to a prompt that begins with one (a chat-formatted prompt)", function()
    local chat = luma.chat.format(model, { { role = "user", content = "Say hi." } })
    assert.are.equal("<bos>", chat:sub(1, 5))
    local want = model:tokenize(chat, { bos = false, special = true })
    assert.are.equal(model.bos, want[1])
    assert.are_not.equal(model.bos, want[2])
    local seen
    local function first(logits, state) seen = seen or state.tokens; return logits:argmax() end
    local _, stats = luma.generate(model, chat, { policy = first, max_tokens = 1 })
    assert.are.same(want, seen)
    assert.are.equal(#want, stats.prompt_tokens)
    -- Without special parsing "<bos>" is plain text, after the BOS token.
    seen = nil
    luma.generate(model, chat, { policy = first, max_tokens = 1, special = false })
    assert.are.same(model:tokenize(chat, { bos = true, special = false }), seen)
    assert.are_not.equal(model.bos, seen[2])
    -- A plain prompt still gets its BOS.
    seen = nil
    luma.generate(model, PROMPT, { policy = first, max_tokens = 1 })
    assert.are.same(model:tokenize(PROMPT), seen)
    assert.are.equal(model.bos, seen[1])
  end)

  it("stops on a Lua predicate", function()
    local text, stats = luma.generate(model, PROMPT, {
      policy = P.greedy(), max_tokens = 40,
      stop = S.when(function(state) return state.text:find(".", 1, true) ~= nil end) })
    assert.are.equal("stop", stats.stop)
    assert.matches("%.$", text)
    assert.are.equal(1, select(2, text:gsub("%.", "")))
  end)

  it("S.strings holds back text that may become a stop string across token boundaries", function()
    local n = 16
    local _, pieces = run{ policy = P.greedy(), max_tokens = n }
    local full = table.concat(pieces)
    -- Stop strings spanning two and three tokens, first seen where they span.
    local cases = {}
    local at = 0
    for k = 1, #pieces - 2 do
      at = at + #pieces[k]
      local a, b = pieces[k], pieces[k + 1]
      if #a >= 2 and #b >= 2 and #cases == 0 then
        local s = a:sub(-2) .. b:sub(1, 2)
        if full:find(s, 1, true) == at - 1 then cases[#cases + 1] = s end
      end
      if #a >= 2 and #cases == 1 and k > 1 then
        local s = a:sub(-2) .. b .. pieces[k + 2]:sub(1, 1)
        if full:find(s, 1, true) == at - 1 then cases[#cases + 1] = s end
      end
    end
    assert.are.equal(2, #cases, "no stop strings spanning tokens found in " .. full)
    for _, s in ipairs(cases) do
      local cut = full:find(s, 1, true) - 1
      local want = full:sub(1, cut)
      local shown = ""
      local _, _, stats = run{ policy = P.greedy(), max_tokens = n, stop = { S.strings{ "no such string", s } },
                               on_token = function(piece)
                                 shown = shown .. piece
                                 -- Never more than the text before the stop string.
                                 assert.are.equal(shown, want:sub(1, #shown))
                               end }
      assert.are.equal(want, shown)
      assert.are.equal("stop", stats.stop)
      local text = luma.generate(model, PROMPT, { policy = P.greedy(), max_tokens = n, stop = S.strings{ s } })
      assert.are.equal(want, text)
    end
    -- Held-back text that does not become a stop string is shown in the end.
    local text = luma.generate(model, PROMPT, { policy = P.greedy(), max_tokens = n,
                                                stop = S.strings{ cases[1]:sub(1, 3) .. "\1" } })
    assert.are.equal(full, text)
  end)

  it("never streams half a UTF-8 character when a character spans byte tokens", function()
    -- Byte tokens <0x00>..<0xFF> are ids 238..493 in the default model: "ä"
    -- is C3 A4, "🦙" is F0 9F A6 99.
    local bytes = { 0xC3, 0xA4, 0xF0, 0x9F, 0xA6, 0x99, 0x21 }
    local function scripted(_, state) return 238 + bytes[state.step + 1] end
    local _, pieces = run{ policy = scripted, max_tokens = #bytes }
    assert.are.same({ "", "ä", "", "", "", "🦙", "!" }, pieces)
    assert.are.equal("byte", model:token_type(238 + 0xC3))
  end)

  it("streams (piece, id) pairs, running nothing between iterations", function()
    local calls = 0
    local seq
    local function counting(logits, state)
      calls = calls + 1
      seq = state.seq
      return logits:argmax()
    end
    local n = 0
    for piece, id in luma.stream(model, PROMPT, { policy = counting, max_tokens = 5 }) do
      n = n + 1
      assert.are.equal("string", type(piece))
      assert.are.equal("integer", math.type(id))
      assert.are.equal(n, calls)
      -- The chosen token is not evaluated until the next iteration asks;
      -- after the last one the stream has closed its sequence.
      if n < 5 then assert.are.equal(#model:tokenize(PROMPT) + n - 1, seq:len()) end
    end
    assert.are.equal(5, n)
    assert.are.equal(5, calls)
    assert.are.equal("luma.Sequence (closed)", tostring(seq))
  end)

  it("closes the sequence it made when the loop is left early", function()
    local seq
    for _ in luma.stream(model, PROMPT, { policy = function(l, state) seq = state.seq; return l:argmax() end,
                                          max_tokens = 50 }) do
      break
    end
    assert.are.equal("luma.Sequence (closed)", tostring(seq))
  end)

  it("continues a given sequence and leaves it open", function()
    local seq = model:sequence()
    seq:eval(model:tokenize(PROMPT))
    local ids = run({ seq = seq, policy = P.greedy(), max_tokens = 3 }, ", there")
    assert.are.equal(3, #ids)
    -- The continuation has no BOS; the last chosen token is not evaluated.
    local want = model:tokenize(PROMPT .. ", there")
    for i = 1, 2 do want[#want + 1] = ids[i] end
    assert.are.same(want, seq:tokens())
    assert.are.same(H.greedy(model, model:tokenize(PROMPT .. ", there"), 3), ids)
    seq:close()
  end)

  it("works inside coroutines, two streams interleaved", function()
    local function producer(prompt)
      return coroutine.wrap(function()
        for piece in luma.stream(model, prompt, { policy = P.greedy(), max_tokens = 4 }) do coroutine.yield(piece) end
      end)
    end
    local a, b = producer(PROMPT), producer("The sky is")
    local ta, tb = {}, {}
    for _ = 1, 4 do
      ta[#ta + 1] = a()
      tb[#tb + 1] = b()
    end
    assert.are.equal(luma.generate(model, PROMPT, { policy = P.greedy(), max_tokens = 4 }), table.concat(ta))
    assert.are.equal(luma.generate(model, "The sky is", { policy = P.greedy(), max_tokens = 4 }), table.concat(tb))
  end)

  it("generate returns the text and its stats", function()
    local text, stats = luma.generate(model, PROMPT, { policy = P.greedy(), max_tokens = 5 })
    local _, pieces = run{ policy = P.greedy(), max_tokens = 5 }
    assert.are.equal(table.concat(pieces), text)
    assert.are.equal(#model:tokenize(PROMPT), stats.prompt_tokens)
    assert.are.equal(5, stats.tokens)
    assert.are.equal("max_tokens", stats.stop)
    assert.is_true(stats.ttft > 0 and stats.time >= stats.ttft)
    assert.is_true(stats.tokens_per_s > 0)
    -- A stats table given to a stream again is filled afresh.
    local reused = {}
    for _ in luma.stream(model, PROMPT, { policy = P.greedy(), max_tokens = 1, stats = reused }) do end
    for _ in luma.stream(model, PROMPT, { policy = P.greedy(), max_tokens = 3, stats = reused }) do break end
    assert.are.equal("cancelled", reused.stop)
    assert.are.equal(1, reused.tokens)
    -- A prompt given as token ids.
    assert.are.equal(text, (luma.generate(model, model:tokenize(PROMPT), { policy = P.greedy(), max_tokens = 5 })))
  end)

  it("rejects bad options with messages naming them", function()
    assert.matches("policy must be a function", select(2, pcall(luma.generate, model, PROMPT, { policy = 1 })))
    assert.matches("max_tokens", select(2, pcall(luma.generate, model, PROMPT, { max_tokens = -1 })))
    assert.matches("stop condition 1", select(2, pcall(luma.generate, model, PROMPT, { stop = { 5 } })))
    assert.matches("prompt", select(2, pcall(luma.generate, model, 42)))
    assert.matches("no tokens", select(2, pcall(luma.generate, model, {})))
    assert.matches("not a token id", select(2, pcall(luma.generate, model, PROMPT,
                                                       { policy = function() return -1 end })))
  end)

  it("passes errors raised in a policy or a stop predicate to the caller; everything stays usable", function()
    local other = model:sequence()
    other:eval(model:tokenize(PROMPT))
    local seq
    local function failing(logits, state)
      seq = state.seq
      if state.step == 2 then error("policy gave up") end
      return logits:argmax()
    end
    local ok, err = pcall(luma.generate, model, PROMPT, { policy = failing, max_tokens = 8 })
    assert.is_false(ok)
    assert.matches("policy gave up", err)
    assert.are.equal("luma.Sequence (closed)", tostring(seq))
    local obj = setmetatable({}, { __tostring = function() return "an error object" end })
    ok, err = pcall(luma.generate, model, PROMPT, { policy = function() error(obj) end })
    assert.is_false(ok)
    assert.are.equal(obj, err)
    ok, err = pcall(luma.generate, model, PROMPT, { policy = P.greedy(), max_tokens = 8,
                                                    stop = { function(state) if state.step == 1 then error("stop broke") end end } })
    assert.is_false(ok)
    assert.matches("stop broke", err)
    -- The other sequence and the model carry on as if nothing happened.
    local id = other:eval(model:tokenize(",", { bos = false })):argmax()
    local ids = model:tokenize(PROMPT)
    ids[#ids + 1] = model:tokenize(",", { bos = false })[1]
    assert.are.equal(H.greedy(model, ids, 1)[1], id)
    assert.are.equal(3, #run{ policy = P.greedy(), max_tokens = 3 })
    other:close()
  end)
end)
