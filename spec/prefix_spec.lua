-- The prefix cache: a hit gives the logits of a cold run, matching is by
-- whole KV blocks (16 tokens, as model:kv_free() says), the blocks are shared
-- (not copied), and entries are evicted least recently used first.
local H = require "helper"
local Prefix = require "luma.prefix"

local TEXT = "The old lighthouse keeper climbed the stairs every evening, counting the steps and listening " ..
             "to the waves, while ships passed far out at sea carrying grain, letters, and travellers who " ..
             "never learned his name, though every one of them had been kept safe by his lamp."

describe("the prefix cache", function()
  local model, ids
  setup(function()
    model = H.load_invariant{ ctx = 128, kv_mb = 5 }   -- 16 blocks of 16 tokens
    ids = model:tokenize(TEXT)
    assert.is_true(#ids > 49)
  end)
  teardown(function() if model then model:close() end end)

  local function first(n, tail)
    local out = { table.unpack(ids, 1, n) }
    for _, id in ipairs(tail or {}) do out[#out + 1] = id end
    return out
  end

  it("gives, on a hit, the logits of a cold run", function()
    local cache = Prefix.new(model)
    local src = model:sequence()
    src:eval(first(40))
    assert.are.equal(32, cache:insert(src))
    src:close()
    -- A prompt sharing the first 35 tokens, then going elsewhere.
    local prompt = first(35, { 1234, 567, 89 })
    local seq, n = cache:lookup(prompt)
    assert.are.equal(32, n)
    assert.are.same(first(32), seq:tokens())
    local warm = seq:eval({ table.unpack(prompt, n + 1) })
    local cold_seq = model:sequence()
    local cold = cold_seq:eval(prompt)
    local diff = H.max_abs_diff(cold, warm)
    print(string.format("prefix_spec: hit against cold run: max |diff| = %.3g", diff))
    assert.is_true(diff < 1e-2)
    assert.are.equal(cold:argmax(), warm:argmax())
    assert.are.same(cold_seq:tokens(), seq:tokens())
    seq:close()
    cold_seq:close()
    assert.are.same({ hits = 1, misses = 0, hit_tokens = 32, inserts = 1, evictions = 0 }, cache.stats)
    cache:clear()
  end)

  it("matches whole blocks only, and always leaves a token to evaluate", function()
    local cache = Prefix.new(model)
    assert.are.equal(16, cache.block)
    assert.are.equal(select(2, model:kv_free()), cache.block)
    local src = model:sequence()
    src:eval(first(20))
    assert.are.equal(16, cache:insert(src))          -- the partial block is not kept
    assert.are.equal(0, cache:insert(src, 15))       -- less than a block
    src:eval({ table.unpack(ids, 21, 48) })
    assert.are.equal(48, cache:insert(src))
    assert.are.equal(1, #cache)                      -- the 16-token entry was a prefix of it
    assert.are.equal(48, cache:insert(src))          -- already there
    assert.are.equal(1, #cache)
    src:close()
    local seq, n = cache:lookup(first(48))           -- the 48th token is evaluated again
    assert.are.equal(32, n)
    seq:close()
    seq, n = cache:lookup(first(49))
    assert.are.equal(48, n)
    seq:close()
    assert.are.equal(0, select(2, cache:lookup(first(16))))
    local other = first(40)
    other[10] = 999                                  -- differs inside the first block
    assert.is_nil((cache:lookup(other)))
    assert.are.equal(2, cache.stats.misses)
    cache:clear()
    assert.are.equal(0, #cache)
  end)

  it("shares the cached blocks with every sequence it hands out", function()
    local cache = Prefix.new(model)
    local src = model:sequence()
    src:eval(first(48))
    cache:insert(src)
    src:close()
    -- 12 sequences of 49 tokens: 4 blocks each, 48 in all if copied; shared,
    -- they need 3 + 12 of the 16 blocks.
    local seqs = {}
    for i = 1, 12 do
      local seq, n = cache:lookup(first(48, { 100 + i }))
      assert.are.equal(48, n)
      seq:eval(100 + i)
      seqs[i] = seq
    end
    -- The source was closed and the sequences run on: the cache's copy is intact.
    local seq = cache:lookup(first(48, { 7 }))
    local warm = seq:eval(7)
    for _, s in ipairs(seqs) do s:close() end
    seq:close()
    local cold_seq = model:sequence()
    local cold = cold_seq:eval(first(48, { 7 }))
    assert.is_true(H.max_abs_diff(cold, warm) < 1e-2)
    cold_seq:close()
    cache:clear()
  end)

  it("evicts the least recently used entry, which frees its blocks", function()
    local cache = Prefix.new(model, { max_entries = 2 })
    -- 48-token prompts differing in their second token: 3 blocks each.
    local function entry(second)
      local p = first(48)
      p[2] = second
      local s = model:sequence()
      s:eval(p)
      cache:insert(s)
      s:close()
      return { table.unpack(p, 1, 40) }
    end
    local function cached(p)
      local s = cache:lookup(p)
      if s then s:close() end
      return s ~= nil
    end
    local a, b = entry(11), entry(22)
    assert.is_true(cached(a))                        -- touches a
    local c = entry(33)                              -- over max_entries: b goes
    assert.are.equal(2, #cache)
    assert.is_false(cached(b))
    assert.is_true(cached(a))
    assert.is_true(cached(c))
    -- The two entries hold 6 of the 16 blocks: two sequences of 4 blocks
    -- fit beside them, a third only once they are gone.
    assert.are.same({ 10 }, (model:kv_free()))
    local seqs = {}
    for i = 1, 3 do seqs[i] = model:sequence() end
    seqs[1]:eval(first(40, first(24)))
    seqs[2]:eval(first(40, first(24)))
    assert.matches("KV cache full", select(2, pcall(seqs[3].eval, seqs[3], first(40, first(24)))))
    assert.is_true(cache:evict())
    assert.is_true(cache:evict())
    assert.is_false(cache:evict())
    assert.are.same({ 8 }, (model:kv_free()))
    seqs[3]:eval(first(40, first(24)))
    for _, s in ipairs(seqs) do s:close() end
    assert.are.same({ 16 }, (model:kv_free()))
    assert.are.equal(3, cache.stats.evictions)
  end)

  it("checks its options", function()
    assert.matches("max_entries", select(2, pcall(Prefix.new, model, { max_entries = 0 })))
  end)
end)
