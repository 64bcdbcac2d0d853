-- model:batch(): chunks of many sequences run as one forward give what each
-- sequence would get alone; bad batches fail without touching a sequence.
local H = require "helper"

local PROMPTS = {
  "Hi",
  "The capital of France is",
  "Once upon a time",
  "1, 2, 3, 4,",
  "A list of fruits: apple, banana,",
  "def fibonacci(n):",
  "In the beginning",
  -- longer than max_rows = 16 tokens: split into several chunks
  "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill, unimpressed.",
}
local STEPS = 3

describe("a batch", function()
  local model, prompts
  setup(function()
    model = H.load_invariant{ ctx = 128, max_rows = 16, kv_mb = 64 }
    prompts = {}
    for i, p in ipairs(PROMPTS) do prompts[i] = model:tokenize(p) end
    assert.is_true(#prompts[#prompts] > 16)
  end)
  teardown(function() if model then model:close() end end)

  it("gives, token for token, the greedy continuations each sequence gets alone", function()
    local seqs, next_ids, got = {}, {}, {}
    for i = 1, #prompts do
      seqs[i] = model:sequence()
      next_ids[i] = prompts[i]
      got[i] = {}
    end
    local batch = model:batch()
    for _ = 1, STEPS do
      for i, s in ipairs(seqs) do batch:add(s, next_ids[i]) end
      assert.are.equal(#seqs, #batch)
      local out = batch:run()
      assert.are.equal(0, #batch)
      for i, s in ipairs(seqs) do
        local id = out[s]:argmax()
        got[i][#got[i] + 1] = id
        next_ids[i] = id
      end
    end
    for i, s in ipairs(seqs) do
      assert.are.same(H.greedy(model, prompts[i], STEPS), got[i], "sequence " .. i .. ": " .. PROMPTS[i])
      assert.are.equal(#prompts[i] + STEPS - 1, s:len())
      s:close()
    end
  end)

  it("returns the logits of every token with all = true, equal to the sequence's own eval", function()
    local a, b = model:sequence(), model:sequence()
    local out = model:batch():add(a, prompts[2], { all = true }):add(b, prompts[8]):run()
    local list = out[a]
    assert.are.equal(#prompts[2], #list)
    local alone = model:sequence()
    local want = alone:eval(prompts[2], { all = true })
    local worst = 0
    for i = 1, #list do
      assert.are.equal(want[i]:argmax(), list[i]:argmax())
      worst = math.max(worst, H.max_abs_diff(want[i], list[i]))
    end
    print(string.format("batch_spec: batched vs alone, all = true: max |diff| = %.3g", worst))
    assert.is_true(worst < 1e-2)
    for _, s in ipairs{ a, b, alone } do s:close() end
  end)

  it("refuses the same sequence twice in one step, and leaves every sequence as it was", function()
    local a, b = model:sequence(), model:sequence()
    a:eval(prompts[1])
    local batch = model:batch():add(a, 5):add(b, prompts[2]):add(a, 6)
    local ok, err = pcall(batch.run, batch)
    assert.is_false(ok)
    assert.matches("same sequence", err)
    assert.are.same(prompts[1], a:tokens())
    assert.are.equal(0, b:len())
    assert.are.equal(0, #batch)
    a:close()
    b:close()
  end)

  it("fails as a whole on a context overflow, leaving every sequence unchanged and usable", function()
    local a, b = model:sequence(), model:sequence()
    a:eval(prompts[3])
    b:eval(prompts[2])
    local long = {}
    for i = 1, 128 do long[i] = prompts[8][(i % #prompts[8]) + 1] end
    local batch = model:batch():add(a, 818):add(b, long)
    assert.matches("context overflow", select(2, pcall(batch.run, batch)))
    assert.are.same(prompts[3], a:tokens())
    assert.are.same(prompts[2], b:tokens())
    -- The same batch object is empty and runs the next step normally.
    local out = batch:add(a, 818):run()
    local ids = { table.unpack(prompts[3]) }
    ids[#ids + 1] = 818
    assert.are.equal(H.greedy(model, ids, 1)[1], out[a]:argmax())
    a:close()
    b:close()
  end)

  it("checks its arguments when they are added", function()
    local a = model:sequence()
    local batch = model:batch()
    assert.matches("bad argument #2 to 'add'.*out of range", select(2, pcall(function() batch:add(a, -1) end)))
    assert.matches("not an integer", select(2, pcall(function() batch:add(a, 1.5) end)))
    assert.matches("no token ids", select(2, pcall(function() batch:add(a, {}) end)))
    assert.matches("luma.Sequence expected", select(2, pcall(function() batch:add("seq", 1) end)))
    assert.matches("option 'all' must be a boolean", select(2, pcall(function() batch:add(a, 1, { all = 1 }) end)))
    assert.are.equal(0, #batch)
    assert.matches("batch is empty", select(2, pcall(batch.run, batch)))
    -- The ids are copied when added: changing the table later changes nothing.
    local ids = { table.unpack(prompts[1]) }
    batch:add(a, ids)
    ids[1] = "changed"
    batch:run()
    assert.are.same(prompts[1], a:tokens())
    a:close()
  end)

  it("leaves the collector as it found it (stopped or running) while it makes its results", function()
    local a, b = model:sequence(), model:sequence()
    local batch = model:batch()
    collectgarbage("stop")
    local out = batch:add(a, prompts[1]):add(b, prompts[2]):run()
    local stopped = not collectgarbage("isrunning")
    collectgarbage("restart")
    assert.is_true(stopped)
    out = batch:add(a, out[a]:argmax()):add(b, out[b]:argmax()):run()
    assert.is_true(collectgarbage("isrunning"))
    assert.are.equal(model.info.vocab, #out[a])
    assert.are.equal(#prompts[1] + 1, a:len())
    a:close()
    b:close()
  end)

  it("runs during while its step is in flight, the model kept from it; raises its error after the step", function()
    local a, b, c = model:sequence(), model:sequence(), model:sequence()
    local before = a:eval(prompts[1])
    local held = before:copy()
    collectgarbage("stop")
    do model:sequence():eval(prompts[8]) end   -- garbage holding blocks of the cache
    local plain = model:batch():add(c, prompts[1]):add(b, prompts[2]):run()
    local next_a = plain[c]:argmax()
    local batch = model:batch():add(a, next_a):add(b, prompts[3])
    local calls, errors, collecting, freed = 0, {}, nil, nil
    local out = batch:run(function()
      calls = calls + 1
      collecting = collectgarbage("isrunning")
      -- what needs no step: the vocabulary, host copies of logits, a next batch
      assert.are.equal(model:detokenize(prompts[2]), model:detokenize(prompts[2]))
      assert.are.equal(next_a, held:argmax())
      batch:add(c, next_a)
      -- a sequence nothing refers to may be collected meanwhile (its
      -- finalizer closes it without asking)
      local free0 = model:kv_free()[1]
      collectgarbage("collect")
      freed = model:kv_free()[1] - free0
      for name, f in pairs{
        sequence = function() model:sequence() end, eval = function() c:eval(5) end,
        fork = function() c:fork() end, rewind = function() c:rewind(1) end, close = function() c:close() end,
        run = function() model:batch():add(c, 5):run() end, model_close = function() model:close() end,
        device_logits = function() before:argmax() end,
      } do
        local ok, err = pcall(f)
        errors[name] = not ok and err:match("model is busy") ~= nil
        if model.info.backend == "cpu" and name == "device_logits" then errors[name] = true end
      end
    end)
    collectgarbage("restart")
    assert.are.equal(1, calls)
    assert.is_false(collecting)
    assert.is_true(freed >= 2)   -- the garbage sequence's blocks came back
    assert.is_true(collectgarbage("isrunning"))
    for name, busy in pairs(errors) do assert.is_true(busy, name) end
    -- the step is the plain one's
    assert.are.equal(#prompts[1] + 1, a:len())
    local ids = { table.unpack(prompts[1]) }
    ids[#ids + 1] = next_a
    assert.are.equal(H.greedy(model, ids, 1)[1], out[a]:argmax())
    assert.are.equal(1, #batch)
    -- the next batch added in flight runs; an error in during comes after its step
    local ok, err = pcall(batch.run, batch, function() error("during failed") end)
    assert.is_false(ok)
    assert.matches("during failed", err)
    assert.are.equal(#prompts[1] + 1, c:len())
    assert.are.equal(0, #batch)
    assert.matches("function expected", select(2, pcall(batch.run, batch:add(a, 1), 5)))
    assert.are.equal(#prompts[1] + 1, a:len())
    for _, s in ipairs{ a, b, c } do s:close() end
  end)

  it("refuses sequences of another model, and closed sequences at run time", function()
    local other = H.load_invariant{ ctx = 64 }
    local batch = model:batch()
    assert.matches("another model", select(2, pcall(batch.add, batch, other:sequence(), 1)))
    other:close()
    local a, b = model:sequence(), model:sequence()
    batch:add(a, 2):add(b, 2)
    b:close()
    assert.matches("sequence is closed", select(2, pcall(batch.run, batch)))
    assert.are.equal(0, a:len())
    assert.are.equal(0, #batch)
    a:close()
  end)
end)
