-- The continuous-batching scheduler: batched greedy generation equals each
-- request run alone, token for token, through chunked prompts, preemption
-- when the KV cache is full, cancellation and user-supplied decisions.
local H = require "helper"
local luma = require "luma"
local Scheduler = require "luma.scheduler"
local P, S = luma.policy, luma.stop

local PROMPTS = {
  "Hi",
  "The capital of France is",
  "Once upon a time",
  "1, 2, 3, 4,",
  "A list of fruits: apple, banana,",
  "def fibonacci(n):",
  "Water boils at",
  -- longer than the 16-token budget: prefilled over several steps
  "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill, unimpressed.",
  "Roses are red, violets are blue, sugar is sweet, and so are you. The end of the poem is near, and the "
    .. "reader, who has waited patiently through every line, finally learns that",
}
local N = 12   -- new tokens per request

describe("the scheduler", function()
  -- big: room for everything; small: 3 MiB hold 8 blocks of 16 tokens (two
  -- 64-token contexts), far less than the requests need together.
  local big, small, prompts, alone
  setup(function()
    big = H.load_invariant{ ctx = 128, max_rows = 16, kv_mb = 64 }
    small = H.load_invariant{ ctx = 64, max_rows = 16, kv_mb = 3 }
    prompts, alone = {}, {}
    for i, p in ipairs(PROMPTS) do
      prompts[i] = big:tokenize(p)
      alone[i] = H.greedy(big, prompts[i], N)
    end
    assert.is_true(#prompts[8] > 16 and #prompts[9] > 32)
  end)
  teardown(function()
    if big then big:close() end
    if small then small:close() end
  end)

  local function generated(h)
    return { table.unpack(h.ids, h.prompt_len + 1) }
  end

  -- Submits every prompt (greedy, exactly N tokens) and runs to the end.
  -- extra: fields added to every request, or a function of i giving them.
  local function run_all(sch, extra)
    local handles = {}
    for i = 1, #prompts do
      local r = { prompt = prompts[i], policy = P.greedy(), max_tokens = N, stop = {} }
      local more = extra
      if type(extra) == "function" then more = extra(i) end
      for k, v in pairs(more or {}) do r[k] = v end
      handles[i] = sch:submit(r)
    end
    sch:run()
    return handles
  end

  it("generates, token for token, what each request generates alone, prompts split into chunks", function()
    local most = 0
    local sch = Scheduler.new(big, { token_budget = 16, prefix = false,
                                     budget = function(s)
                                       most = math.max(most, #s.running)
                                       return s.token_budget
                                     end })
    local pieces, done = {}, {}
    local handles = run_all(sch, {
      on_token = function(piece, _, req)
        pieces[req] = (pieces[req] or "") .. piece
        -- h.text while it runs: what was streamed so far
        assert.are.equal(pieces[req], req.text)
      end,
      on_done = function(req, text, stats) done[#done + 1] = { req = req, text = text, stats = stats } end,
    })
    for i, h in ipairs(handles) do
      assert.are.same(alone[i], generated(h), "request " .. i .. ": " .. PROMPTS[i])
      assert.are.equal("done", h.status)
      assert.are.equal("max_tokens", h.stats.stop)
      assert.are.equal(N, h.stats.tokens)
      assert.are.equal(big:detokenize(alone[i]), h.text)
      assert.are.equal(h.text, pieces[h])
    end
    assert.are.equal(#prompts, #done)
    for _, d in ipairs(done) do assert.are.equal(d.req.text, d.text) end
    -- Every prompt token and every generated token but the last went through
    -- a forward pass exactly once, 16 rows at most per step.
    local rows = 0
    for i = 1, #prompts do rows = rows + #prompts[i] + N - 1 end
    assert.are.equal(rows, sch.stats.rows)
    assert.is_true(sch.stats.steps * 16 >= rows)
    assert.are.equal(#prompts, most)
    print(string.format("scheduler_spec: %d requests, %d rows in %d steps (%d sequential evals)",
                        #prompts, rows, sch.stats.steps, rows))
  end)

  it("loses no request and no token when the KV cache runs out: preemption and recomputation", function()
    local sch = Scheduler.new(small, { token_budget = 16, prefix = false })
    local handles = run_all(sch)
    for i, h in ipairs(handles) do
      assert.are.same(alone[i], generated(h), "request " .. i .. ": " .. PROMPTS[i])
      assert.are.equal("max_tokens", h.stats.stop)
    end
    assert.is_true(sch.stats.kv_full > 0)
    assert.is_true(sch.stats.preemptions > 0)
    local preempted = 0
    for _, h in ipairs(handles) do preempted = preempted + h.stats.preemptions end
    assert.are.equal(sch.stats.preemptions, preempted)
    print(string.format("scheduler_spec: small KV cache: %d full, %d preemptions", sch.stats.kv_full,
                        sch.stats.preemptions))
  end)

  it("admits by the KV cache's free blocks: what starts fits, and the cache never fills", function()
    -- Six 20-token prompts making 12 tokens each hold 2 of the 8 blocks
    -- apiece: 4 run at once, the others wait for their blocks.
    local long = prompts[9]
    local twenty, want = {}, {}
    for i = 1, 6 do
      twenty[i] = { table.unpack(long, 1, 20) }
      twenty[i][20] = long[20 + i]
      want[i] = H.greedy(big, twenty[i], N)
    end
    local free, block = small:kv_free()
    assert.are.same({ 8 }, free)
    assert.are.equal(16, block)
    local most = 0
    local sch = Scheduler.new(small, { token_budget = 16, prefix = false,
                                       budget = function(s)
                                         most = math.max(most, #s.running)
                                         return 16
                                       end })
    local handles = {}
    for i = 1, 6 do
      handles[i] = sch:submit{ prompt = twenty[i], policy = P.greedy(), max_tokens = N, stop = {} }
    end
    sch:run()
    for i, h in ipairs(handles) do assert.are.same(want[i], generated(h), "request " .. i) end
    assert.are.equal(4, most)
    assert.are.equal(0, sch.stats.kv_full)
    assert.are.same({ 8 }, (small:kv_free()))
  end)

  it("counts a sliding-window pool as the window and one step's rows", function()
    -- ctx 1024 > the window of 512: a second pool for the sliding-window
    -- layers, with the window, 64 positions kept for rewinds and 16 rows
    -- (38 blocks) per sequence; 24 MiB hold two sequences.
    local model = H.load_invariant{ ctx = 1024, max_rows = 16, kv_mb = 24 }
    assert.are.same({ 128, 76 }, (model:kv_free()))
    local sch = Scheduler.new(model, { prefix = false })
    assert.are.same({ 0, 512 }, sch.window)
    assert.are.equal(38, sch:pool_blocks(1, 601))
    assert.are.equal(38, sch:pool_blocks(2, 601))
    assert.are.equal(38, sch:pool_blocks(2, 1000))
    assert.are.equal(3, sch:pool_blocks(2, 40))
    -- Three 600-token prompts: the full pool has room for 3 x 38 blocks, the
    -- windowed one for 2 x 38: only two start.
    for i = 1, 3 do
      local ids = {}
      for k = 1, 600 do ids[k] = 1000 + 7 * k + i end
      sch:submit{ prompt = ids, policy = P.greedy(), max_tokens = 4 }
    end
    sch:admit_waiting()
    assert.are.equal(2, #sch.running)
    assert.are.equal(1, #sch.waiting)
    sch:close()
    model:close()
  end)

  it("takes prompts from its prefix cache, empties it before preempting, and generates the same tokens", function()
    local sch = Scheduler.new(small, { token_budget = 16 })
    -- The two long prompts first, alone: their whole blocks stay cached.
    for i = 8, 9 do sch:submit{ prompt = prompts[i], policy = P.greedy(), max_tokens = 1 } end
    sch:run()
    assert.are.equal(2, #sch.prefix)
    -- They go first again; the others' admission then evicts the entries.
    local handles = run_all(sch, function(i) return { priority = i >= 8 and 1 or 0 } end)
    for i, h in ipairs(handles) do assert.are.same(alone[i], generated(h), "request " .. i) end
    assert.are.equal(16, handles[8].stats.cached_tokens)
    assert.are.equal(32, handles[9].stats.cached_tokens)
    assert.is_true(sch.stats.evictions > 0)
    assert.is_true(sch.stats.preemptions > 0)
    sch:close()
    assert.are.equal(0, #sch.prefix)
  end)

  it("cancels waiting and running requests; the others finish unchanged", function()
    local sch = Scheduler.new(big, { token_budget = 16, max_seqs = 2, prefix = false })
    local handles, done = {}, {}
    for i = 1, 4 do
      handles[i] = sch:submit{
        prompt = prompts[i], policy = P.greedy(), max_tokens = N, stop = {},
        on_token = function(_, _, req) if req.id == 2 and req.stats == nil and #generated(req) == 3 then req:cancel() end end,
        on_done = function(req) done[req.id] = (done[req.id] or 0) + 1 end,
      }
    end
    handles[4]:cancel()
    assert.are.equal("waiting", handles[4].status)
    sch:run()
    for i = 1, 4 do assert.are.equal(1, done[i], "on_done of request " .. i) end
    assert.are.same(alone[1], generated(handles[1]))
    assert.are.same(alone[3], generated(handles[3]))
    assert.are.equal("cancelled", handles[2].stats.stop)
    assert.are.same({ table.unpack(alone[2], 1, 3) }, generated(handles[2]))
    assert.are.equal("cancelled", handles[4].stats.stop)
    assert.are.equal(0, handles[4].stats.tokens)
    assert.are.equal(0, #sch.running + #sch.waiting)
    -- Cancelling a finished request changes nothing.
    handles[1]:cancel()
    assert.are.equal("max_tokens", handles[1].stats.stop)
  end)

  it("honours user functions for admission order, admission and the preemption victim", function()
    local LIMIT = 6
    local started, seen, most, victims = {}, {}, 0, {}
    local sch = Scheduler.new(small, {
      token_budget = 16, prefix = false,
      order = function(a, b) return a.id > b.id end,   -- the latest first
      admit = function(s) return #s.running < LIMIT end,
      budget = function(s)
        most = math.max(most, #s.running)
        for _, r in ipairs(s.running) do
          if not seen[r] then started[#started + 1], seen[r] = r.id, true end
        end
        return 16
      end,
      -- the earliest request, the opposite of the default
      victim = function(_, running)
        local v = running[1]
        for _, r in ipairs(running) do if r.id < v.id then v = r end end
        victims[#victims + 1] = v.id
        return v
      end,
    })
    local handles = run_all(sch)
    for i, h in ipairs(handles) do assert.are.same(alone[i], generated(h), "request " .. i) end
    assert.are.equal(LIMIT, most)
    assert.are.same({ 9, 8, 7, 6, 5, 4 }, { table.unpack(started, 1, LIMIT) })
    assert.is_true(#victims > 0)
    for _, id in ipairs(victims) do assert.is_true(handles[id].stats.preemptions > 0) end
  end)

  it("streams text as luma.stream does: stop strings held back, end of generation dropped", function()
    local sch = Scheduler.new(big, { prefix = false })
    -- Greedy, then the end of turn at step 3 (that token's text is dropped).
    local function eot_at_3(logits, state)
      if state.step == 3 then return big:tokenize("<end_of_turn>", { bos = false, special = true })[1] end
      return logits:argmax()
    end
    local cases = {
      { prompt = PROMPTS[2], stop = { S.eog(), S.strings{ " of" } }, max_tokens = 16 },
      { prompt = PROMPTS[6], stop = { S.strings{ "return" } }, max_tokens = 16 },
      { prompt = "<start_of_turn>user\nSay hi.<end_of_turn>\n<start_of_turn>model\n", max_tokens = 40 },
      -- begins with "<bos>": no second BOS
      { prompt = luma.chat.format(big, { { role = "user", content = "Say hi." } }), max_tokens = 40,
        policy = eot_at_3 },
      { prompt = PROMPTS[1], stop = { S.eog(), S.max_tokens(0) }, max_tokens = 4 },
    }
    for _, c in ipairs(cases) do
      local pieces, streamed = {}, {}
      local o = { policy = c.policy or P.greedy(), stop = c.stop, max_tokens = c.max_tokens }
      local want, stats = luma.generate(big, c.prompt, o)
      for piece in luma.stream(big, c.prompt, o) do streamed[#streamed + 1] = piece end
      local h = sch:submit{ prompt = c.prompt, policy = o.policy, stop = c.stop, max_tokens = c.max_tokens,
                            on_token = function(piece) pieces[#pieces + 1] = piece end }
      c.h = h
      sch:run()
      assert.are.equal(want, h.text)
      assert.are.same(streamed, pieces)
      assert.are.equal(stats.stop, h.stats.stop)
      assert.are.equal(stats.tokens, h.stats.tokens)
      assert.are.equal(stats.prompt_tokens, h.prompt_len)
    end
    local chat = cases[4].h
    assert.are.equal("eog", chat.stats.stop)
    assert.are.equal(4, chat.stats.tokens)
    assert.are.same(big:tokenize(cases[4].prompt, { bos = false, special = true }),
                    { table.unpack(chat.ids, 1, chat.prompt_len) })
    assert.are.equal("stop", cases[5].h.stats.stop)
    assert.are.equal(0, cases[5].h.stats.tokens)
  end)

  it("streams each token while the device computes the next step, as it would between steps", function()
    -- The same requests with overlap (the default) and without: the same
    -- tokens, text, pieces and stops. Some end on their own conditions (a
    -- stop string, the end of turn, an error in on_token, a cancel in
    -- on_token), whose last row the overlap computes for nothing; others on
    -- their count or the context, which get no such row.
    local function eot_at_5(logits, state)
      if state.step == 5 then return big:tokenize("<end_of_turn>", { bos = false, special = true })[1] end
      return logits:argmax()
    end
    local function requests()
      return {
        { prompt = PROMPTS[2], stop = { S.eog(), S.strings{ " of" } }, max_tokens = 16 },
        { prompt = PROMPTS[6], stop = { S.strings{ "return" } }, max_tokens = 16 },
        { prompt = PROMPTS[3], policy = eot_at_5, max_tokens = 16 },
        { prompt = PROMPTS[4], stop = {}, max_tokens = N },
        { prompt = PROMPTS[9], stop = {}, max_tokens = 200 },   -- runs into the context of 128
        { prompt = PROMPTS[5], stop = {}, max_tokens = N,
          on_token = function(_, _, req) if #req.ids - req.prompt_len == 4 then error("callback failed") end end },
        { prompt = PROMPTS[7], stop = {}, max_tokens = N,
          on_token = function(_, _, req) if #req.ids - req.prompt_len == 2 then req:cancel() end end },
        { prompt = PROMPTS[1], stop = {}, max_tokens = 1 },
      }
    end
    local function run(overlap)
      local sch = Scheduler.new(big, { prefix = false, overlap = overlap })
      local out = {}
      for i, r in ipairs(requests()) do
        local pieces, on_token = {}, r.on_token
        r.policy = r.policy or P.greedy()
        r.on_token = function(piece, id, req)
          pieces[#pieces + 1] = piece
          if on_token then on_token(piece, id, req) end
        end
        out[i] = { h = sch:submit(r), pieces = pieces }
      end
      sch:run()
      return out, sch.stats
    end
    local plain, plain_stats = run(false)
    local over, over_stats = run(true)
    local own = 0
    for i, p in ipairs(plain) do
      local o = over[i]
      assert.are.same(generated(p.h), generated(o.h), "request " .. i)
      assert.are.equal(p.h.text, o.h.text, "request " .. i)
      assert.are.same(p.pieces, o.pieces, "request " .. i)
      assert.are.equal(p.h.stats.stop, o.h.stats.stop, "request " .. i)
      assert.are.equal(p.h.stats.error, o.h.stats.error, "request " .. i)
      assert.are.equal(p.h.stats.tokens, o.h.stats.tokens, "request " .. i)
      if o.h.stats.stop ~= "max_tokens" and o.h.stats.stop ~= "ctx" then own = own + 1 end
    end
    assert.are.same({ "stop", "stop", "eog", "max_tokens", "ctx", "error", "cancelled", "max_tokens" },
                    (function() local t = {} for i, o in ipairs(over) do t[i] = o.h.stats.stop end return t end)())
    assert.matches("callback failed", over[6].h.stats.error)
    assert.are.equal(big.info.ctx + 1, #over[5].h.ids)   -- the last one chosen, never evaluated
    assert.are.equal(plain_stats.tokens, over_stats.tokens)
    assert.are.equal(plain_stats.rows + own, over_stats.rows)
    assert.is_true(over_stats.emit_time > 0 and plain_stats.emit_time > 0)
  end)

  it("drops a token still to be streamed when closed, and runs new requests after", function()
    local sch = Scheduler.new(big, { prefix = false })
    local after_close = 0
    local closed = false
    local h = sch:submit{ prompt = prompts[2], policy = P.greedy(), stop = {}, max_tokens = N,
                          on_token = function() if closed then after_close = after_close + 1 end end }
    for _ = 1, 3 do sch:step() end
    assert.is_true(#sch.pending > 0)   -- a chosen token waits for the next step
    sch:close()
    closed = true
    assert.are.equal("done", h.status)
    local again = sch:submit{ prompt = prompts[1], policy = P.greedy(), stop = {}, max_tokens = N }
    sch:run()
    assert.are.equal(0, after_close)
    assert.are.same(alone[1], generated(again))
  end)

  it("keeps the model from on_token while a step is in flight, and lets it in without overlap", function()
    for _, overlap in ipairs{ true, false } do
      local sch = Scheduler.new(big, { prefix = false, overlap = overlap })
      local made = 0
      local h = sch:submit{ prompt = prompts[2], policy = P.greedy(), stop = {}, max_tokens = 3,
                            on_token = function()
                              local seq = big:sequence()
                              seq:close()
                              made = made + 1
                            end }
      local other = sch:submit{ prompt = prompts[1], policy = P.greedy(), stop = {}, max_tokens = N }
      sch:run()
      assert.are.same(alone[1], generated(other))
      if overlap then
        -- the first token is streamed between steps (nothing else runs then)
        -- or in flight; a token in flight ends the request
        assert.are.equal("error", h.stats.stop)
        assert.matches("model is busy", h.stats.error)
      else
        assert.are.equal("max_tokens", h.stats.stop)
        assert.are.equal(3, made)
      end
    end
  end)

  it("ends a request whose policy fails, and only that one", function()
    local sch = Scheduler.new(big, { prefix = false })
    local bad = sch:submit{ prompt = prompts[2], max_tokens = N, policy = function() error("no luck") end }
    local odd = sch:submit{ prompt = prompts[3], max_tokens = N, policy = function() return -1 end }
    local good = sch:submit{ prompt = prompts[1], max_tokens = N, policy = P.greedy(), stop = {} }
    sch:run()
    assert.are.equal("error", bad.stats.stop)
    assert.matches("no luck", bad.stats.error)
    assert.matches("policy returned %-1", odd.stats.error)
    assert.are.same(alone[1], generated(good))
  end)

  it("checks requests when they are submitted", function()
    local sch = Scheduler.new(big)
    assert.matches("prompt must be", select(2, pcall(sch.submit, sch, { prompt = 5 })))
    assert.matches("no tokens", select(2, pcall(sch.submit, sch, { prompt = {} })))
    local long = {}
    for i = 1, 129 do long[i] = 100 end
    assert.matches("more than the context of 128", select(2, pcall(sch.submit, sch, { prompt = long })))
    assert.matches("policy must be", select(2, pcall(sch.submit, sch, { prompt = "x", policy = 1 })))
    assert.matches("max_tokens", select(2, pcall(sch.submit, sch, { prompt = "x", max_tokens = -1 })))
    assert.matches("stop condition 1", select(2, pcall(sch.submit, sch, { prompt = "x", stop = { 1 } })))
    assert.matches("token_budget", select(2, pcall(Scheduler.new, big, { token_budget = 0 })))
    assert.matches("victim must be a function", select(2, pcall(Scheduler.new, big, { victim = 1 })))
    local zero = sch:submit{ prompt = "x", max_tokens = 0 }
    local none = sch:submit{ prompt = "x", stop = { S.eog(), S.max_tokens(0) },
                             policy = function() error("no token is to be chosen") end }
    sch:run()
    assert.are.equal("max_tokens", zero.stats.stop)
    assert.are.equal("", zero.text)
    assert.are.equal("stop", none.stats.stop)
    assert.are.equal(0, none.stats.tokens)
  end)

  it("runs scripts/batch.lua and scripts/load.lua", function()
    local luma_bin = H.build_dir .. "/luma"
    local list = os.tmpname()
    H.write(list, "The capital of France is\n\nWater boils at\n")
    local out, err, code = H.run(luma_bin .. " scripts/batch.lua -f " .. H.quote(list) .. " -n 6")
    os.remove(list)
    assert.are.equal(0, code, err)
    assert.matches("%[1%] The capital of France is", out)
    assert.matches("%[2%] Water boils at", out)
    assert.matches("2 requests, %d+ tokens generated", out)
    out, err, code = H.run(luma_bin .. " scripts/load.lua --requests 3 --concurrency 1,3 --prompt 4-8 --output 3-5")
    assert.are.equal(0, code, err)
    assert.matches("sequential", out)
    assert.matches("batch 3 .*x", out)
  end)
end)
