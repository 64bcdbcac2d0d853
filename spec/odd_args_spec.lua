-- Every native function and method of the Lua surface called with odd
-- arguments: wrong types, negative, huge, NaN and infinite numbers, empty,
-- long and invalid strings, tables of the wrong shape, callbacks that raise
-- or return odd values, other userdata, closed objects. The combinations
-- are deterministic (LUMA_ODD_SEED=n gives others). Each call must return or raise an error with a
-- message; nothing may crash (the sanitizer build runs this spec too),
-- and afterwards the model computes exactly what it computed before.
local H = require "helper"
local luma = require "luma"
local fetch = require "luma.fetch"

-- A small deterministic generator (not luma.rng: that is under test here);
-- LUMA_ODD_SEED picks other combinations.
local state = tonumber(os.getenv("LUMA_ODD_SEED")) or 12345
local function pick(n)
  state = (state * 1103515245 + 12345) % 2147483648
  return state % n + 1
end

local function tiny_model()
  local path = os.tmpname()
  luma.synth{ preset = "tiny-llama", seed = 3, vocab = fetch.default_model(), out = path }
  local m = luma.load(path, { threads = 2, ctx = 48, max_rows = 32 })
  os.remove(path)
  return m
end

describe("the native surface under odd arguments", function()
  local model, other
  setup(function()
    H.model_path()
    model, other = tiny_model(), tiny_model()
  end)
  teardown(function()
    model:close()
    other:close()
  end)

  it("returns or raises a message for every combination; the model then computes as before", function()
    local closed_seq = other:sequence()
    closed_seq:close()
    local seq = model:sequence()
    local logits = seq:eval(model:tokenize("Hello world"))
    local ref_ids = model:tokenize("The cat")
    local fresh = model:sequence()
    local ref = fresh:eval(ref_ids):copy()
    fresh:close()

    local values = {
      n = 0,
      nil, true, false, 0, -1, 1, 2, 7, 40, 2 ^ 31, 2 ^ 53, math.maxinteger, math.mininteger, 0.5, -0.0,
      0 / 0, math.huge, -math.huge, "", "x", "Hello", "3", string.rep("\255\0", 200), {}, { 1, 2, 3 },
      { -1, 2 ^ 40 }, { {} }, { a = 1 }, { 1, "x" }, { 0.5 },
      function() error("raised by a callback") end,
      function() return nil end,
      function() return {} end,
      function(...) return ... end,
      function() return false end,
      coroutine.create(function() end),
      io.stdout,
    }
    values.n = 38
    local objects = {
      model = model, seq = seq, logits = logits, closed_seq = closed_seq, other_seq = other:sequence(),
      batch = model:batch(), rng = luma.rng(1),
    }
    -- (in a fixed order: pairs' order changes from run to run)
    for _, k in ipairs{ "model", "seq", "logits", "closed_seq", "other_seq", "batch", "rng" } do
      values[#values + 1] = objects[k]
    end
    values.n = #values
    assert.is_true(values.n > 40)

    local calls, raised = 0, 0
    local function try(f, ...)
      calls = calls + 1
      local ok, err = pcall(f, ...)
      if not ok then
        raised = raised + 1
        assert(type(err) == "string" and #err > 0, "an error without a message: " .. tostring(err))
      end
    end
    local function args(k)
      local a = {}
      for i = 1, k do a[i] = values[pick(values.n)] end
      return a, k
    end

    -- Methods by object (close, __gc and __close are checked below).
    local methods = {
      model = { "tokenize", "detokenize", "piece", "is_eog", "token_type", "sequence", "meta", "meta_keys",
                "tensors", "kv_free", "copy_bandwidth", "batch" },
      seq = { "eval", "greedy", "sample", "len", "tokens", "fork", "rewind" },
      logits = { "argmax", "topk", "temperature", "top_k", "top_p", "min_p", "typical", "penalize", "bias",
                 "mask", "allow", "softmax", "log_softmax", "entropy", "sample", "draw", "copy" },
      batch = { "add", "run" },
      rng = { "random" },
    }
    for _, kind in ipairs{ "model", "seq", "logits", "batch", "rng" } do
      for _, name in ipairs(methods[kind]) do
        for k = 1, 60 do
          -- each method on its own object, and now and then on another kind of self
          local self = objects[kind]
          if k % 10 == 0 then self = values[pick(values.n)] end
          local f = objects[kind][name]
          assert(type(f) == "function", kind .. ":" .. name .. " is not a function")
          local a, n = args(k % 4)
          try(f, self, table.unpack(a, 1, n))
          -- a logits object whose entries a call set to NaN or inf stays usable; keep it fresh
          if kind == "logits" and k % 20 == 0 then logits = seq:len() < 40 and seq:eval(1) or logits:copy() end
          if kind == "seq" and seq:len() > 40 then seq:rewind(2) end
        end
      end
    end
    -- indexing, assignment and length
    for _ = 1, 200 do
      local a = args(2)
      try(function() logits[a[1]] = a[2] end)
      try(function() return logits[a[1]] end)
      try(function() return model[a[1]] end)
      try(function() return seq[a[1]] end)
    end
    -- the module's functions (luma.load and luma.synth with odd options only)
    local funcs = { "backends", "draw", "now", "rng", "sha256", "simd", "synth_presets" }
    for _, name in ipairs(funcs) do
      for k = 1, 60 do
        local a, n = args(k % 4)
        try(luma[name], table.unpack(a, 1, n))
      end
    end
    for _ = 1, 40 do
      local a = args(1)
      if type(a[1]) ~= "string" then try(luma.load, a[1]) end
      try(luma.load, "no/such/model.gguf", a[1])
      if type(a[1]) ~= "table" then try(luma.synth, a[1]) end
      try(luma.synth, { preset = a[1] })
    end
    -- closed objects: every method raises, naming the object closed
    local s2 = model:sequence()
    s2:close()
    s2:close()
    for _, name in ipairs(methods.seq) do
      local ok, err = pcall(s2[name], s2, 1)
      assert(not ok and err:find("closed"), "seq:" .. name .. " on a closed sequence: " .. tostring(err))
    end
    print(string.format("\n  %d calls, %d raised an error with a message", calls, raised))
    assert.is_true(raised > calls / 4 and raised < calls)

    -- the model computes what it did before, once the sequences the calls
    -- made are collected (each holds its KV blocks until then)
    seq:close()
    objects.other_seq:close()
    collectgarbage()
    collectgarbage()
    local again = model:sequence()
    local got = again:eval(ref_ids)
    assert.are.equal(0, H.max_abs_diff(ref, got))
    again:close()
  end)
end)
