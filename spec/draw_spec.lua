-- luma.draw: many rows' sampling chains in one call (on a GPU, one launch
-- for all of them), against each row's logits:draw; and the scheduler,
-- whose requests with such chains draw through it, against the same
-- requests drawing one by one in Lua.
local H = require "helper"
local luma = require "luma"
local P = luma.policy
local Scheduler = require "luma.scheduler"

local PROMPTS = {
  "Once upon a time", "The capital of France is", "def fib(n):", "1, 2, 3, 4,",
  "Hello", "In the beginning", "The quick brown fox", "Rain, rain,", "Q: Why is the sky blue?\nA:",
}

local OPTS = {
  { top_k = 40, top_p = 0.95, temp = 0.8 },
  { top_k = 64, min_p = 0.05, temp = 1.3 },
  { top_k = 8, top_p = 0.9, min_p = 0.1, temp = 0.5 },
  { top_k = 1, temp = 2.0 },
}

describe("luma.draw", function()
  local model
  setup(function() model = H.load{ max_rows = 64 } end)
  teardown(function() model:close() end)

  -- One step of a batch of every prompt: its rows in prompt order, and the
  -- sequences (closed by the caller).
  local function step()
    local batch, seqs = model:batch(), {}
    for i, p in ipairs(PROMPTS) do
      seqs[i] = model:sequence()
      batch:add(seqs[i], model:tokenize(p))
    end
    local out, rows = batch:run(), {}
    for i = 1, #seqs do rows[i] = out[seqs[i]] end
    return rows, seqs
  end
  local function close(seqs)
    for _, s in ipairs(seqs) do s:close() end
  end

  it("draws what each row's logits:draw draws, one option table or one a row", function()
    local rows, seqs = step()
    for round = 1, 6 do
      -- one options table and one generator for all rows, in row order
      local o = OPTS[(round - 1) % #OPTS + 1]
      local a, b = luma.rng(round), luma.rng(round)
      local ids = luma.draw(rows, o, a)
      assert.are.equal(#rows, #ids)
      for i, l in ipairs(rows) do assert.are.equal(l:draw(o, b), ids[i], "row " .. i) end
      assert.are.equal(b:random(), a:random())
      -- a table and a generator a row
      local opts, ra, rb = {}, {}, {}
      for i = 1, #rows do
        opts[i] = OPTS[(i + round) % #OPTS + 1]
        ra[i], rb[i] = luma.rng(1000 * round + i), luma.rng(1000 * round + i)
      end
      local out = {}
      assert.are.equal(out, luma.draw(rows, opts, ra, { out = out }))
      for i, l in ipairs(rows) do
        assert.are.equal(l:draw(opts[i], rb[i]), out[i], "row " .. i)
        assert.are.equal(rb[i]:random(), ra[i]:random())
      end
    end
    -- the rows are as they were, and the draws are the Lua chain's
    local chain = P.from_options(OPTS[1])
    for i, l in ipairs(rows) do
      local id = luma.draw({ l }, OPTS[1], luma.rng(i))[1]
      assert.are.equal(chain(l:copy(), { rng = luma.rng(i) }), id)
    end
    close(seqs)
  end)

  it("draws from edited and compact rows, and from a few rows on the host", function()
    local rows, seqs = step()
    local plain = {}
    for i, l in ipairs(rows) do plain[i] = l:copy() end
    rows[1]:bias({ [rows[1]:argmax()] = -math.huge })
    rows[2]:top_k(20)
    rows[3]:temperature(0.7)
    local ids = luma.draw(rows, OPTS[2], luma.rng(5))
    local r = luma.rng(5)
    for i, l in ipairs(rows) do assert.are.equal(l:draw(OPTS[2], r), ids[i]) end
    -- two rows: below the fewest the device draws
    local two = luma.draw({ plain[4], plain[5] }, OPTS[1], luma.rng(9))
    r = luma.rng(9)
    assert.are.same({ plain[4]:draw(OPTS[1], r), plain[5]:draw(OPTS[1], r) }, two)
    assert.are.same({}, luma.draw({}, OPTS[1], luma.rng(1)))
    close(seqs)
  end)

  it("lets go of the rows when asked, and they say so when used", function()
    local rows, seqs = step()
    local copies = {}
    for i, l in ipairs(rows) do copies[i] = l:copy() end
    local ids = luma.draw(rows, OPTS[1], luma.rng(3), { release = true })
    assert.are.same(luma.draw(copies, OPTS[1], luma.rng(3)), ids)
    local ok, e = pcall(rows[1].argmax, rows[1])
    assert.is_false(ok)
    assert.matches("released by luma.draw", e)
    assert.are.equal(#copies[1], #rows[1])
    close(seqs)
  end)

  it("penalizes each row over its history first, as logits:penalize then logits:draw", function()
    local pens = {
      { top_k = 40, top_p = 0.95, temp = 0.8, repeat_ = 1.3 },
      { top_k = 64, temp = 1.0, repeat_ = 1.1, frequency = 0.4, presence = 0.2, last_n = 8 },
      { top_k = 16, temp = 0.7, repeat_ = 0.9, frequency = -0.1, last_n = 32 },   -- raises some entries
    }
    for round, o in ipairs(pens) do
      local rows, seqs = step()
      local copies, hists = {}, {}
      for i, l in ipairs(rows) do
        copies[i] = l:copy()
        -- each row's history: its prompt, then its own best ids again (so that they count)
        local h = seqs[i]:tokens()
        local ids = l:topk(6)
        for _, id in ipairs(ids) do h[#h + 1] = id end
        hists[i] = h
      end
      local got = luma.draw(rows, o, luma.rng(round), { release = true, histories = hists })
      local r = luma.rng(round)
      for i, c in ipairs(copies) do
        c:penalize(hists[i], o)
        assert.are.equal(c:draw({ top_k = o.top_k, top_p = o.top_p, temp = o.temp }, r), got[i], "row " .. i)
      end
      close(seqs)
    end
    -- penalties need the histories, and release
    local rows, seqs = step()
    local ok, e = pcall(luma.draw, rows, { top_k = 4, repeat_ = 1.2 }, luma.rng(1))
    assert.is_false(ok)
    assert.matches("penalties need the history", e)
    local hists = {}
    for i = 1, #rows do hists[i] = { 1, 2, 3 } end
    ok, e = pcall(luma.draw, rows, { top_k = 4, repeat_ = 1.2 }, luma.rng(1), { histories = hists })
    assert.is_false(ok)
    assert.matches("release", e)
    ok, e = pcall(luma.draw, rows, { top_k = 4, repeat_ = 1.2 }, luma.rng(1), { release = true, histories = { {} } })
    assert.is_false(ok)
    assert.matches("histories", e)
    hists[2] = { 1, -5 }
    ok, e = pcall(luma.draw, rows, { top_k = 4, repeat_ = 1.2 }, luma.rng(1), { release = true, histories = hists })
    assert.is_false(ok)
    assert.matches("range", e)
    close(seqs)
  end)

  it("refuses bad arguments with clear errors, leaving the generators as they were", function()
    local rows, seqs = step()
    local r = luma.rng(7)
    local want = luma.rng(7):random()
    local cases = {
      { { rows, OPTS[1], r, 5 } }, -- how must be a table
      { { "rows", OPTS[1], r }, "table" },
      { { { 1, 2 }, OPTS[1], r }, "rows%[1%] is not a Logits" },
      { { rows, { OPTS[1] }, r }, "option tables" },
      { { rows, OPTS[1], { r } }, "rngs" },
      { { rows, OPTS[1], "r" }, "Rng" },
      { { rows, { top_k = 65 }, r }, "top_k" },
      { { rows, { top_k = 4, temp = 0 }, r }, "temp" },
      { { rows, OPTS[1], r, { out = 3 } }, "out" },
    }
    for _, c in ipairs(cases) do
      local ok, e = pcall(luma.draw, table.unpack(c[1], 1, 4))
      assert.is_false(ok)
      if c[2] then assert.matches(c[2], e) end
    end
    local masked = rows[4]:copy()
    masked:mask(masked:topk(#masked))
    local ok, e = pcall(luma.draw, { rows[1], masked }, OPTS[1], r)
    assert.is_false(ok)
    assert.matches("rows%[2%]: every logit is masked", e)
    assert.are.equal(want, r:random())
    close(seqs)
  end)
end)

describe("the scheduler's draws", function()
  local model
  setup(function() model = H.load{ ctx = 256, max_rows = 64, kv_mb = 64 } end)
  teardown(function() model:close() end)

  -- the same chain as a function P.sampler does not know: one Lua call a row
  local function by_hand(o)
    return function(logits, state)
      logits:top_k(o.top_k)
      if o.top_p then logits:top_p(o.top_p) end
      if o.min_p then logits:min_p(o.min_p) end
      return logits:temperature(o.temp):sample(state.rng)
    end
  end

  local function run(policy_of)
    local sch = Scheduler.new(model, { prefix = false, token_budget = 64 })
    local handles = {}
    for i, p in ipairs(PROMPTS) do
      handles[i] = sch:submit{ prompt = p, max_tokens = 12, seed = i, stop = {}, policy = policy_of(i) }
    end
    sch:run()
    local texts = {}
    for i, h in ipairs(handles) do
      assert.are.equal("done", h.status, h.stats.error)
      texts[i] = { table.unpack(h.ids, h.prompt_len + 1) }
    end
    sch:close()
    return texts
  end

  it("gives each request the tokens its policy draws alone", function()
    -- the default policy, chains P.sampler knows (mixed) and their Lua twins
    assert.are.same(run(function() return by_hand(OPTS[1]) end), run(function() return nil end))
    local mixed = run(function(i) return P.from_options(OPTS[i % #OPTS + 1]) end)
    assert.are.same(run(function(i) return by_hand(OPTS[i % #OPTS + 1]) end), mixed)
    -- with penalties: the chain, and the same chain wrapped so that P.sampler does not know it
    local pen = {}
    for i = 1, #PROMPTS do pen[i] = P.from_options{ temp = 0.9, top_k = 40, repeat_ = 1.4, last_n = 16 + i } end
    assert.are.same(run(function(i) return function(l, st) return pen[i](l, st) end end),
                    run(function(i) return pen[i] end))
  end)
end)
