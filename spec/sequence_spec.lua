-- Sequences: evaluation, the KV cache's shared prefixes, rewinding, the
-- context limit, and argument checking.
local H = require "helper"

local CTX = 64

describe("a sequence", function()
  local model, prompt
  setup(function()
    model = H.load_invariant{ ctx = CTX }
    prompt = model:tokenize("The capital of France is")
  end)
  teardown(function() if model then model:close() end end)

  local function fresh(ids, opts)
    local seq = model:sequence()
    local out = seq:eval(ids, opts)
    seq:close()
    return out
  end

  it("evaluates a table of ids or one integer id, returning the last position's Logits", function()
    local seq = model:sequence()
    local logits = seq:eval(prompt)
    assert.are.equal(model.n_vocab, #logits)
    assert.matches("luma.Logits", tostring(logits))
    assert.are.equal(#prompt, seq:len())
    local id = logits:argmax()
    local next_logits = seq:eval(id)
    assert.are.equal(#prompt + 1, seq:len())
    assert.are.equal(#prompt + 1, #seq)
    local all = { table.unpack(prompt) }
    all[#all + 1] = id
    assert.are.same(all, seq:tokens())
    H.assert_close(next_logits, fresh(all), 1e-3)
    seq:close()
  end)

  it("returns one Logits per token with all = true, the last equal to the plain eval", function()
    local seq = model:sequence()
    local list = seq:eval(prompt, { all = true })
    assert.are.equal(#prompt, #list)
    for _, l in ipairs(list) do assert.are.equal(model.n_vocab, #l) end
    H.assert_close(list[#list], fresh(prompt), 1e-3)
    seq:close()
  end)

  it("gives the same logits for a prefill of N tokens as for N single-token evals", function()
    local batched = fresh(prompt, { all = true })
    local seq = model:sequence()
    local worst = 0
    for i, id in ipairs(prompt) do
      local one = seq:eval(id)
      assert.are.equal(batched[i]:argmax(), one:argmax(), "argmax differs at position " .. i)
      worst = math.max(worst, H.max_abs_diff(batched[i], one))
    end
    seq:close()
    print(string.format("sequence_spec: prefill of %d tokens vs one at a time: max |diff| = %.3g", #prompt, worst))
    assert.is_true(worst < 1e-2, "max |diff| " .. worst)
  end)

  it("shares the prefix with a fork: the child and the parent each continue as fresh sequences would", function()
    local parent = model:sequence()
    parent:eval(prompt)
    local child = parent:fork()
    assert.are.equal(#prompt, child:len())
    assert.are.same(parent:tokens(), child:tokens())
    local a, b = model:tokenize(" Paris", { bos = false }), model:tokenize(" a city", { bos = false })
    local got_child = child:eval(a)
    local got_parent = parent:eval(b)
    local function continued(tail)
      local seq = model:sequence()
      seq:eval(prompt)
      local out = seq:eval(tail)
      seq:close()
      return out
    end
    local want_child, want_parent = continued(a), continued(b)
    H.assert_close(want_child, got_child, 1e-3)
    H.assert_close(want_parent, got_parent, 1e-3)
    -- and as one prefill of the whole text
    local joined = { table.unpack(prompt) }
    for _, id in ipairs(a) do joined[#joined + 1] = id end
    local whole = fresh(joined)
    H.assert_close(whole, got_child, 1e-2)
    child:close()
    parent:close()
  end)

  it("keeps a fork usable after its parent is closed", function()
    local parent = model:sequence()
    parent:eval(prompt)
    local child = parent:fork()
    parent:close()
    local want = fresh(prompt)
    child:rewind(#prompt - 1)
    H.assert_close(want, child:eval(prompt[#prompt]), 1e-3)
    child:close()
  end)

  it("rewinds to a prefix, after which evaluating gives what a fresh sequence gives", function()
    local seq = model:sequence()
    seq:eval(prompt)
    seq:eval(model:tokenize(" something else entirely", { bos = false }))
    assert.are.equal(seq, seq:rewind(3))
    assert.are.equal(3, seq:len())
    assert.are.same({ table.unpack(prompt, 1, 3) }, seq:tokens())
    local got = seq:eval({ table.unpack(prompt, 4) })
    local want = fresh(prompt)
    H.assert_close(want, got, 1e-3)
    seq:rewind(0)
    assert.are.equal(0, seq:len())
    H.assert_close(want, seq:eval(prompt), 1e-3)
    seq:close()
  end)

  it("rejects bad token ids, naming the argument, and stays unchanged", function()
    local seq = model:sequence()
    seq:eval(prompt)
    local cases = {
      { { 1, model.n_vocab }, "token id 262144 at position 2 is out of range" },
      { { -1 }, "out of range" },
      { model.n_vocab, "token id 262144 out of range" },
      { -5, "out of range" },
      { { 1, 2.5 }, "element 2 is not an integer" },
      { { 1, "x" }, "element 2 is not an integer" },
      { 2.5, "must be an integer" },
      { {}, "no token ids" },
      { "hello", "table expected" },
    }
    for _, c in ipairs(cases) do
      local ok, err = pcall(function() return seq:eval(c[1]) end)
      assert.is_false(ok)
      assert.matches("bad argument #1 to 'eval'", err, 1, true)
      assert.matches(c[2], err, 1, true)
    end
    assert.has_error(function() seq:eval(prompt, { all = 1 }) end, "option 'all' must be a boolean")
    assert.are.equal(#prompt, seq:len())
    assert.are.same(prompt, seq:tokens())
    assert.has_error(function() seq:rewind(#prompt + 1) end)
    assert.has_error(function() seq:rewind(-1) end)
    assert.has_error(function() seq:rewind("x") end)
    seq:close()
  end)

  it("treats a context overflow as an error that leaves the sequence unchanged and usable", function()
    local seq = model:sequence()
    seq:eval(prompt)
    local long = {}
    for i = 1, CTX do long[i] = prompt[2] end
    local ok, err = pcall(seq.eval, seq, long)
    assert.is_false(ok)
    assert.matches("context overflow", err)
    assert.are.equal(#prompt, seq:len())
    assert.are.same(prompt, seq:tokens())
    local after = seq:eval(model:tokenize(" Paris", { bos = false }))
    local joined = { table.unpack(prompt) }
    for _, id in ipairs(model:tokenize(" Paris", { bos = false })) do joined[#joined + 1] = id end
    H.assert_close(fresh(joined), after, 1e-2)
    -- Filling exactly to the context works; one more token does not.
    seq:rewind(0)
    seq:eval({ table.unpack(long, 1, CTX) })
    assert.are.equal(CTX, seq:len())
    assert.matches("context overflow", select(2, pcall(seq.eval, seq, 5)))
    assert.are.equal(CTX, seq:len())
    seq:close()
  end)

  it("closes with close(), with <close>, and through the collector; closing twice is harmless", function()
    local seq = model:sequence()
    seq:close()
    seq:close()
    assert.has_error(function() seq:len() end, "sequence is closed")
    assert.are.equal("luma.Sequence (closed)", tostring(seq))
    local escaped
    do
      local s <close> = model:sequence()
      s:eval(prompt)
      escaped = s
      assert.are.equal("luma.Sequence (" .. #prompt .. " tokens)", tostring(s))
    end
    assert.has_error(function() escaped:eval(1) end, "sequence is closed")
    for _ = 1, 4 do model:sequence():eval(prompt) end
    collectgarbage()
    collectgarbage()
    assert.are.equal(model.n_vocab, #fresh(prompt))
  end)

  it("rewinds up to `rewind` positions past a sliding window, as speculative decoding does", function()
    -- a step of a token and 8 guesses, 8 of them rewound, again and again,
    -- past the window: the blocks a rewind needs are kept (luma.load's
    -- rewind, 64 by default); with rewind = 0 they are released at once
    local function speculate(opts)
      local m <close> = H.load(opts)
      local ids = m:tokenize(string.rep("The quick brown fox jumps over the lazy dog. ", 60))
      local seq <close> = m:sequence()
      seq:eval({ table.unpack(ids, 1, 520) })
      for _ = 1, 24 do
        local n = seq:len()
        local ok, err = pcall(function()
          local rows = seq:eval({ table.unpack(ids, n + 1, n + 9) }, { all = true })
          assert(#rows == 9)
          seq:rewind(n + 1)
        end)
        if not ok then return m.info, err end
        assert.are.same({ table.unpack(ids, 1, n + 1) }, seq:tokens())
      end
      return m.info
    end
    local info, err = speculate{ ctx = 1024 }
    assert.are.equal(64, info.rewind)
    assert.is_nil(err)
    info, err = speculate{ ctx = 1024, rewind = 0 }
    assert.are.equal(0, info.rewind)
    if info.sliding_window > 0 then
      assert.matches("sliding%-window blocks already released", err)
    else
      assert.is_nil(err)
    end
    assert.matches("option 'rewind' must be in %[0, 65536%]", select(2, pcall(H.load, { rewind = -1 })))
  end)
end)
