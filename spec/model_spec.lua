-- luma.load and the Model userdata: errors, progress, info, metadata,
-- tensors, free KV blocks, closing.
local luma = require "luma"
local H = require "helper"

-- pcall's error message, asserting that f failed.
local function failure(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

describe("luma.load", function()
  local path
  setup(function() path = H.model_path() end)

  it("names a missing file", function()
    assert.matches("/no/such/model.gguf: No such file", failure(luma.load, "/no/such/model.gguf"))
  end)

  it("says a file that is not GGUF is not GGUF", function()
    assert.matches("not a GGUF file", failure(luma.load, "CMakeLists.txt"))
  end)

  it("rejects truncated copies of the model, in the metadata and in the tensor data", function()
    local src = assert(io.open(path, "rb"))
    local head = src:read(7 << 20)
    src:close()
    local tmp = os.tmpname()
    local cases = { { 0, "empty" }, { 20, "" }, { 100000, "tokenizer.ggml.tokens" }, { 7 << 20, "runs past the end" } }
    for _, c in ipairs(cases) do
      H.write(tmp, head:sub(1, c[1]))
      local err = failure(luma.load, tmp)
      assert.matches(tmp, err, 1, true)
      assert.matches(c[2], err, 1, true)
    end
    os.remove(tmp)
  end)

  it("rejects an unknown backend", function()
    assert.matches("unknown backend 'tpu'", failure(luma.load, path, { backend = "tpu" }))
  end)

  it("rejects options of the wrong type, naming the option", function()
    assert.matches("bad argument #1", failure(luma.load, nil))
    assert.matches("bad argument #2.*table expected", failure(luma.load, path, 5))
    assert.matches("'ctx' must be an integer", failure(luma.load, path, { ctx = "big" }))
    assert.matches("'threads' must be an integer", failure(luma.load, path, { threads = 1.5 }))
    assert.matches("'backend' must be a string", failure(luma.load, path, { backend = 1 }))
    assert.matches("'vocab_only' must be a boolean", failure(luma.load, path, { vocab_only = "yes" }))
    assert.matches("'batch_invariant' must be a boolean", failure(luma.load, path, { batch_invariant = 1 }))
    assert.matches("'float_act' must be a boolean", failure(luma.load, path, { float_act = "yes" }))
    assert.matches("'progress' must be a function", failure(luma.load, path, { progress = 3 }))
  end)

  it("rejects a negative or huge ctx and out-of-range counts", function()
    assert.matches("'ctx' must be in", failure(luma.load, path, { ctx = -1 }))
    assert.matches("'ctx' must be in", failure(luma.load, path, { ctx = 1 << 40 }))
    assert.matches("'threads' must be in", failure(luma.load, path, { threads = -2 }))
    assert.matches("'max_rows' must be in", failure(luma.load, path, { max_rows = -1 }))
  end)

  it("calls progress with increasing fractions from 0 ending at 1", function()
    local fracs = {}
    local model = luma.load(path, { threads = 2, progress = function(f) fracs[#fracs + 1] = f end })
    assert.is_true(#fracs >= 2)
    assert.are.equal(0, fracs[1])
    for i = 2, #fracs do assert.is_true(fracs[i] >= fracs[i - 1]) end
    assert.are.equal(1, fracs[#fracs])
    model:close()
  end)

  it("passes an error raised in the progress callback to the caller, message and value intact", function()
    local err = failure(luma.load, path, { progress = function() error("stop right there") end })
    assert.matches("stop right there", err)
    local obj = {}
    local ok, got = pcall(luma.load, path, { progress = function() error(obj) end })
    assert.is_false(ok)
    assert.are.equal(obj, got)
  end)

  it("cancels the load when progress returns false", function()
    assert.matches("cancelled", failure(luma.load, path, { progress = function() return false end }))
    -- Returning nothing (or true) lets it continue.
    local model = luma.load(path, { threads = 2, progress = function() return true end })
    model:close()
  end)
end)

describe("a loaded model", function()
  local model
  setup(function() model = H.load{ ctx = 1024 } end)
  teardown(function() if model then model:close() end end)

  it("describes itself in model.info", function()
    local info = model.info
    assert.are.equal("gemma3", info.arch)
    assert.are.equal("Gemma 3 270m", info.name)
    assert.are.equal(262144, info.vocab)
    assert.are.equal(18, info.layers)
    assert.are.equal(640, info.embd)
    assert.are.equal(4, info.heads)
    assert.are.equal(1, info.kv_heads)
    assert.are.equal(256, info.head_dim)
    assert.are.equal(2048, info.ff)
    assert.are.equal(32768, info.ctx_train)
    assert.are.equal(1024, info.ctx)
    assert.are.equal(512, info.sliding_window)
    assert.are.equal(15, info.file_type)
    assert.are.equal(H.backend, info.backend)
    assert.are.equal("spm", info.tokenizer)
    assert.is_true(info.weight_bytes > 0 and info.weight_bytes < info.file_bytes)
    assert.is_true(info.kv_bytes > 0)
    -- a key of one layer: one kv head's 256 + 256 values in F16; 15 of the 18 layers slide
    assert.are.equal(1024, info.kv_token_bytes)
    assert.are.equal(15, info.swa_layers)
    assert.is_nil(info.vocab_only)
    -- the CPU computes every row alike whatever its step; the GPU only when asked
    assert.are.equal(H.backend == "cpu", info.batch_invariant)
    assert.is_false(info.float_act)
    assert.matches("luma.Model %(gemma3, 262144 tokens%)", tostring(model))
  end)

  it("has no device copy to measure on the CPU (copy_bandwidth is nil) and checks its arguments", function()
    local cpu = H.load{ backend = "cpu", ctx = 64 }
    assert.is_nil(cpu:copy_bandwidth())
    assert.is_nil(cpu:copy_bandwidth(1, 1))
    cpu:close()
    assert.matches("MiB must be in %[1, 1048576%]", select(2, pcall(model.copy_bandwidth, model, 0)))
    assert.matches("copies must be in %[1, 1000%]", select(2, pcall(model.copy_bandwidth, model, 1, 0)))
    local vocab = luma.load(H.model_path(), { vocab_only = true })
    assert.matches("vocab_only: it has no backend", select(2, pcall(vocab.copy_bandwidth, vocab)))
    vocab:close()
  end)

  it("counts the free blocks of each KV pool with kv_free", function()
    -- ctx 1024 is longer than the window of 512: a second pool for the
    -- sliding-window layers. The default budget holds one sequence: 64
    -- blocks of 16 positions in each pool.
    local free, block = model:kv_free()
    assert.are.same({ 64, 64 }, free)
    assert.are.equal(16, block)
    local seq = model:sequence()
    local ids = model:tokenize("The quick brown fox jumps over the lazy dog, again and again, until it tires.")
    assert.is_true(#ids > 16 and #ids <= 32)
    seq:eval(ids)
    assert.are.same({ 62, 62 }, (model:kv_free()))
    -- A fork shares every block; its first write copies the shared partial one.
    local child = seq:fork()
    assert.are.same({ 62, 62 }, (model:kv_free()))
    child:eval(100)
    assert.are.same({ 61, 61 }, (model:kv_free()))
    child:close()
    seq:close()
    assert.are.same({ 64, 64 }, (model:kv_free()))
    local small = H.load{ ctx = 256 }
    assert.are.same({ 16 }, (small:kv_free()))
    small:close()
    local vocab = luma.load(H.model_path(), { vocab_only = true })
    assert.matches("vocab_only: it has no KV cache", select(2, pcall(vocab.kv_free, vocab)))
    vocab:close()
  end)

  it("reads metadata values of each kind with meta(key)", function()
    assert.are.equal("gemma3", model:meta("general.architecture"))
    assert.are.equal(32768, model:meta("gemma3.context_length"))
    assert.are.equal("integer", math.type(model:meta("gemma3.block_count")))
    assert.are.equal("float", math.type(model:meta("gemma3.attention.layer_norm_rms_epsilon")))
    local tokens = model:meta("tokenizer.ggml.tokens")
    assert.are.equal(262144, #tokens)
    assert.are.equal("<bos>", tokens[model.bos + 1])
    assert.are.equal("number", type(model:meta("tokenizer.ggml.scores")[10]))
    assert.is_nil(model:meta("no.such.key"))
    assert.has_error(function() model:meta() end)
  end)

  it("lists every metadata key and every tensor", function()
    local keys = model:meta_keys()
    assert.are.equal(33, #keys)
    local seen = {}
    for _, k in ipairs(keys) do seen[k] = true end
    assert.is_true(seen["general.architecture"] and seen["tokenizer.ggml.tokens"])
    local tensors = model:tensors()
    assert.are.equal(236, #tensors)
    local by_name, total = {}, 0
    for _, t in ipairs(tensors) do
      by_name[t.name] = t
      total = total + t.bytes
    end
    local emb = by_name["token_embd.weight"]
    assert.are.same({ 640, 262144 }, emb.shape)
    assert.are.equal("string", type(emb.type))
    assert.are.equal("F32", by_name["output_norm.weight"].type)
    assert.are.same({ 640 }, by_name["output_norm.weight"].shape)
    assert.are.equal(2560, by_name["output_norm.weight"].bytes)
    assert.is_true(total < model.info.file_bytes)
  end)
end)

describe("closing a model", function()
  it("makes later use an error naming it closed, and closing twice is harmless", function()
    local model = H.load{ ctx = 256 }
    model:close()
    for _, f in ipairs{ function() return model:tokenize("x") end, function() return model:sequence() end,
                        function() return model.info end, function() return model.eos end,
                        function() return model:meta("general.name") end, function() return model:batch() end,
                        function() return model:kv_free() end } do
      assert.matches("model is closed", failure(f))
    end
    model:close()
    assert.are.equal("luma.Model (closed)", tostring(model))
  end)

  it("closes its sequences, which then say so", function()
    local model = H.load{ ctx = 256 }
    local seq = model:sequence()
    seq:eval({ model.bos, 818 })
    local child = seq:fork()
    model:close()
    assert.matches("sequence is closed", failure(seq.len, seq))
    assert.matches("sequence is closed", failure(child.eval, child, 5))
    assert.are.equal("luma.Sequence (closed)", tostring(seq))
    seq:close()
    child:close()
  end)

  it("releases everything through __close and the collector", function()
    do
      local model <close> = H.load{ ctx = 256 }
      local seq <close> = model:sequence()
      seq:eval(model.bos)
    end
    local model = H.load{ ctx = 256 }
    model:sequence():eval(model.bos)
    model = nil
    collectgarbage()
    collectgarbage()
  end)
end)
