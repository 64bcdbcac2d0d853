-- Logits and where their rows live: a step leaves its logits in a set kept
-- by the backend (device memory on a GPU, host memory here), each Logits a
-- row of it; top_k leaves a compact form of its survivors. These pin down
-- what must hold wherever the rows are: a Logits keeps its values across
-- later steps, however many are alive; rows of one step are independent;
-- closing sequences and the model leaves Logits usable; a failed step
-- changes no Logits; and the compact form answers every method exactly as
-- the whole row does.
local luma = require "luma"
local H = require "helper"

local inf = math.huge

-- What a Logits says about itself: argmax, top 5, and every 4099th entry.
local function snapshot(l)
  local s = { argmax = l:argmax(), top = { l:topk(5) }, at = {} }
  for id = 0, #l - 1, 4099 do s.at[id] = l[id] end
  return s
end

local function assert_snapshot(want, l, what)
  assert.are.equal(want.argmax, l:argmax(), what)
  assert.are.same(want.top, { l:topk(5) }, what)
  for id, x in pairs(want.at) do
    if l[id] ~= x then error(string.format("%s: entry %d is %g, was %g", what, id, l[id], x)) end
  end
end

describe("Logits in logits sets", function()
  local model, prompt
  setup(function()
    model = H.load{ ctx = 256, kv_mb = 64 }
    prompt = model:tokenize("The lighthouse keeper climbed the stairs")
  end)
  teardown(function() if model then model:close() end end)

  it("keeps its values while the same sequence runs more steps", function()
    local seq = model:sequence()
    local first = seq:eval(prompt)
    local want = snapshot(first)
    local id = first:argmax()
    for _ = 1, 12 do id = seq:eval(id):argmax() end
    assert_snapshot(want, first, "after 12 more steps")
    seq:close()
  end)

  it("keeps every Logits of many steps alive and unchanged, past the sets' budget", function()
    local a, b = model:sequence(), model:sequence()
    local batch = model:batch()
    batch:add(a, prompt):add(b, prompt[1])
    local kept, wants = {}, {}
    local out = batch:run()
    for step = 1, 24 do
      for _, s in ipairs{ a, b } do
        kept[#kept + 1] = out[s]
        wants[#wants + 1] = snapshot(out[s])
      end
      batch:add(a, out[a]:argmax()):add(b, out[b]:argmax())
      out = batch:run()
      if step % 6 == 0 then collectgarbage() end
    end
    for i, l in ipairs(kept) do assert_snapshot(wants[i], l, "Logits " .. i) end
    a:close()
    b:close()
  end)

  it("gives each row of a step its own Logits: editing one leaves the others", function()
    local seqs, batch = {}, model:batch()
    for i = 1, 3 do
      seqs[i] = model:sequence()
      batch:add(seqs[i], { prompt[1], prompt[i + 1] })
    end
    local out = batch:run()
    local wants = {}
    for i = 1, 3 do wants[i] = snapshot(out[seqs[i]]) end
    out[seqs[2]]:temperature(0.5):mask{ wants[2].argmax }
    assert.are.equal(-inf, out[seqs[2]][wants[2].argmax])
    assert_snapshot(wants[1], out[seqs[1]], "row 1")
    assert_snapshot(wants[3], out[seqs[3]], "row 3")
    -- every position of a prompt, too
    local all = seqs[1]:eval({ prompt[3], prompt[4], prompt[5] }, { all = true })
    local w3 = snapshot(all[3])
    all[1]:top_k(2)
    all[2]:bias{ [w3.argmax] = -inf }
    assert_snapshot(w3, all[3], "third position")
    for i = 1, 3 do seqs[i]:close() end
  end)

  it("stays usable with the same values after its sequence and then its model close", function()
    local m = H.load{ ctx = 64 }
    local s1, s2 = m:sequence(), m:sequence()
    local l1, l2 = s1:eval(prompt), s2:eval(prompt[1])
    local c2 = l2:copy():top_k(40)
    local w1, w2 = snapshot(l1), snapshot(l2)
    s1:close()
    assert_snapshot(w1, l1, "after its sequence closed")
    m:close()
    assert_snapshot(w1, l1, "after the model closed")
    assert_snapshot(w2, l2, "the other sequence's, after the model closed")
    assert.are.equal(w2.argmax, c2:argmax())
    assert.are.equal(w2.argmax, l2:temperature(0.7):top_k(10):top_p(0.9):argmax())
  end)

  it("is left as it was by a step that fails", function()
    local seq = model:sequence()
    local l = seq:eval(prompt)
    local want = snapshot(l)
    local other = model:sequence()
    local batch = model:batch()
    batch:add(seq, l:argmax()):add(other, prompt):add(seq, 1)
    assert.has_error(function() batch:run() end)
    assert.are.equal(#prompt, seq:len())
    assert.are.equal(0, other:len())
    assert_snapshot(want, l, "after a failed step")
    seq:close()
    other:close()
  end)
end)

describe("the compact form after top_k", function()
  local model, base
  setup(function()
    model = H.load{ ctx = 64 }
    local seq = model:sequence()
    base = seq:eval(model:tokenize("My favourite thing to do on a rainy day is")):temperature(1.5)
    seq:close()
  end)
  teardown(function() if model then model:close() end end)

  -- The same top k as a whole row: allow keeps the named entries as they are.
  local function pair(k)
    local ids = base:topk(k)
    return base:copy():top_k(k), base:copy():allow(ids)
  end

  local function assert_same_row(a, b)
    for id = 0, #a - 1 do
      if a[id] ~= b[id] then error(string.format("entry %d: %g compact, %g whole", id, a[id], b[id])) end
    end
  end

  it("holds exactly the entries the whole row keeps", function()
    for _, k in ipairs{ 1, 40, 2048 } do
      local c, w = pair(k)
      assert_same_row(c, w)
    end
    local c = base:copy():top_k(40)
    assert.are.equal(c, c:top_k(50))
    assert.are.equal(c, c:top_k(20))
    local w = base:copy():allow(base:topk(20))
    assert_same_row(c, w)
  end)

  it("answers the reductions and choosers as the whole row does", function()
    local c, w = pair(40)
    assert.are.equal(w:argmax(), c:argmax())
    assert.are.same({ w:topk(50) }, { c:topk(50) })
    assert.are.equal(w:entropy(), c:entropy())
    local rc, rw = luma.rng(11), luma.rng(11)
    for _ = 1, 50 do assert.are.equal(w:sample(rw), c:sample(rc)) end
  end)

  it("runs a policy chain to the same ids and values as the whole row", function()
    local hist = base:topk(6)
    hist[#hist + 1] = 17
    for seed = 1, 5 do
      local c, w = pair(40)
      for _, l in ipairs{ c, w } do
        l:penalize(hist, { repeat_ = 1.3, frequency = 0.2, presence = 0.1 })
         :bias{ [hist[2]] = 0.75, [5] = 3 }
         :mask{ hist[3] }
         :top_p(0.95):min_p(0.01):typical(0.99):temperature(0.8)
      end
      assert_same_row(c, w)
      assert.are.equal(w:sample(luma.rng(seed)), c:sample(luma.rng(seed)))
    end
  end)

  it("turns into the whole row for the methods that need it", function()
    local c, w = pair(10)
    c:softmax()
    w:softmax()
    assert_same_row(c, w)
    c, w = pair(10)
    c:log_softmax()
    w:log_softmax()
    assert_same_row(c, w)
    c, w = pair(10)
    local id = base:topk(10)[4]
    c[id] = 99
    w[id] = 99
    assert.are.equal(id, c:argmax())
    assert_same_row(c, w)
    c, w = pair(10)
    local copy = c:copy()
    c:allow{ id }
    assert.are.same({ id }, { c:argmax() })
    assert_same_row(copy, w)
  end)

  it("says when every entry is masked, as the whole row does", function()
    local c = base:copy():top_k(2)
    c:mask(base:topk(2))
    assert.are.equal(-inf, c[base:argmax()])
    for _, f in ipairs{ "argmax", "log_softmax", "entropy" } do
      assert.matches("masked", select(2, pcall(c[f], c:copy())))
    end
    assert.matches("masked", select(2, pcall(c.sample, c, luma.rng(1))))
    assert.are.same({}, (c:topk(3)))
  end)
end)
