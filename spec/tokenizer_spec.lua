-- The tokenizer as Lua sees it: vocabulary-only models, reference vectors,
-- round trips, special tokens, pieces and token kinds.
local luma = require "luma"
local H = require "helper"

local SEP = "\n__ggml_vocab_test__\n"
local SHARED = "../shared/testdata/tokenizer"

-- Texts of a .inp file and the expected ids of its .out file, pairwise.
local function read_vectors(stem)
  local texts = H.split(H.read(stem .. ".inp"), SEP)
  local lines = H.split(H.read(stem .. ".out"), "\n")
  if texts[#texts] == "" then texts[#texts] = nil end
  if lines[#lines] == "" then lines[#lines] = nil end
  assert(#texts == #lines, stem .. ": " .. #texts .. " texts but " .. #lines .. " id lines")
  local cases = {}
  for i, text in ipairs(texts) do
    local ids = {}
    for id in lines[i]:gmatch("%d+") do ids[#ids + 1] = math.tointeger(tonumber(id)) end
    cases[i] = { text = text, ids = ids }
  end
  return cases
end

-- Tokenizes every case; returns the number that match and a description of
-- the first mismatch.
local function run_vectors(model, cases, opts)
  local passed, first
  passed = 0
  for i, c in ipairs(cases) do
    local got = model:tokenize(c.text, opts)
    if table.concat(got, " ") == table.concat(c.ids, " ") then
      passed = passed + 1
    elseif not first then
      first = string.format("case %d %q: expected {%s}, got {%s}", i, c.text, table.concat(c.ids, " "),
                            table.concat(got, " "))
    end
  end
  return passed, first
end

local function dir_exists(path)
  local ok, _, code = os.rename(path, path)
  return ok or code == 13
end

describe("shared tokenizer vectors", function()
  if not dir_exists(SHARED) then
    print("tokenizer_spec: " .. SHARED .. " is absent: the shared tokenizer suite did not run")
    return
  end
  for _, name in ipairs{ "ggml-vocab-llama-spm", "ggml-vocab-gpt-2" } do
    it(name .. ": every vector tokenizes to the reference ids with bos = false, special = false", function()
      local stem = SHARED .. "/" .. name .. ".gguf"
      local model = luma.load(stem, { vocab_only = true })
      assert.is_true(model.info.vocab_only)
      local cases = read_vectors(stem)
      assert.is_true(#cases > 0)
      local passed, first = run_vectors(model, cases, { bos = false, special = false })
      print(string.format("tokenizer_spec: %s: %d/%d vectors passed", name, passed, #cases))
      assert.are.equal(#cases, passed, first)
      model:close()
    end)
  end

  it("a vocabulary-only file of an architecture luma cannot run loads only with vocab_only", function()
    local path = SHARED .. "/ggml-vocab-gpt-2.gguf"
    local ok, err = pcall(luma.load, path)
    assert.is_false(ok)
    assert.matches("gpt2", err)
    local model = luma.load(path, { vocab_only = true })
    assert.are.equal("bpe", model.info.tokenizer)
    assert.are.equal("gpt-2", model.info.pre)
    model:close()
  end)
end)

describe("default model tokenizer", function()
  local model
  setup(function() model = luma.load(H.model_path(), { vocab_only = true }) end)
  teardown(function() if model then model:close() end end)

  it("loads vocabulary-only with the tokenizer fields of info and no weights", function()
    local info = model.info
    assert.is_true(info.vocab_only)
    assert.are.equal("gemma3", info.arch)
    assert.are.equal("spm", info.tokenizer)
    assert.are.equal(262144, info.vocab)
    assert.are.equal(262144, model.n_vocab)
    assert.is_nil(info.layers)
  end)

  it("matches the committed Gemma 3 golden vectors (plain and with special tokens)", function()
    local cases = read_vectors("spec/data/gemma3-tokenizer")
    local passed, first = run_vectors(model, cases, { bos = false, special = false })
    print(string.format("tokenizer_spec: gemma3 plain: %d/%d vectors passed", passed, #cases))
    assert.are.equal(#cases, passed, first)
    cases = read_vectors("spec/data/gemma3-tokenizer-special")
    passed, first = run_vectors(model, cases, { bos = true, special = true })
    print(string.format("tokenizer_spec: gemma3 special: %d/%d vectors passed", passed, #cases))
    assert.are.equal(#cases, passed, first)
  end)

  it("has integer bos/eos/eot fields, and is_eog is true for eos and end of turn only", function()
    assert.are.equal(2, model.bos)
    assert.are.equal(1, model.eos)
    assert.are.equal(106, model.eot)
    assert.is_true(model:is_eog(model.eos))
    assert.is_true(model:is_eog(model.eot))
    assert.is_false(model:is_eog(model.bos))
    assert.is_false(model:is_eog(model:tokenize("Hello", { bos = false })[1]))
  end)

  it("adds bos by default and not with bos = false", function()
    local with = model:tokenize("Hello world")
    local without = model:tokenize("Hello world", { bos = false })
    assert.are.equal(model.bos, with[1])
    assert.are.equal(#without + 1, #with)
    assert.are.same(without, { table.unpack(with, 2) })
    assert.are.same({}, model:tokenize("", { bos = false }))
  end)

  it("round-trips text through tokenize and detokenize", function()
    local texts = { "Hello world", " leading space", "tabs\tand\nnewlines\n\n", "Äpfel und Bäume: 4 ½ months",
                    "日本語のテキスト", "emoji 🦙🦙 end", "   many   spaces   ", "<start_of_turn> as text",
                    ("long words, "):rep(300) }
    for _, text in ipairs(texts) do
      local ids = model:tokenize(text, { bos = false })
      assert.are.equal(text, model:detokenize(ids))
    end
  end)

  it("parses special tokens only with special = true", function()
    local text = "<start_of_turn>user\nHi<end_of_turn>"
    local plain = model:tokenize(text, { bos = false })
    local special = model:tokenize(text, { bos = false, special = true })
    local function has(ids, id)
      for _, x in ipairs(ids) do if x == id then return true end end
      return false
    end
    assert.is_false(has(plain, 105))
    assert.is_false(has(plain, 106))
    assert.are.equal(105, special[1])
    assert.is_true(has(special, 106))
    assert.are.equal(text, model:detokenize(plain))
    -- Control tokens have no text unless asked for.
    assert.are.equal("user\nHi", model:detokenize(special))
    assert.are.equal(text, model:detokenize(special, { special = true }))
  end)

  it("piece gives each token's bytes, which concatenate to the detokenized text", function()
    local text = "The quick brown fox, Äpfel 🦙"
    local ids = model:tokenize(text, { bos = false })
    local parts = {}
    for i, id in ipairs(ids) do parts[i] = model:piece(id) end
    assert.are.equal(text, table.concat(parts))
    assert.are.equal("", model:piece(model.bos))
    assert.are.equal("<bos>", model:piece(model.bos, true))
    assert.are.equal("<start_of_turn>", model:piece(105, true))
  end)

  it("names token types", function()
    assert.are.equal("control", model:token_type(model.bos))
    assert.are.equal("control", model:token_type(model.eos))
    assert.are.equal("normal", model:token_type(model:tokenize("Hello", { bos = false })[1]))
    assert.are.equal("byte", model:token_type(238))
    assert.are.equal("\0", model:piece(238))
  end)

  it("rejects token ids outside the vocabulary and non-integers", function()
    for _, f in ipairs{ "piece", "is_eog", "token_type" } do
      assert.has_error(function() model[f](model, -1) end)
      assert.has_error(function() model[f](model, model.n_vocab) end)
      assert.has_error(function() model[f](model, 1.5) end)
    end
    local ok, err = pcall(model.detokenize, model, { 1, model.n_vocab })
    assert.is_false(ok)
    assert.matches("out of range", err)
    ok, err = pcall(model.detokenize, model, { 1, "x" })
    assert.is_false(ok)
    assert.matches("not an integer", err)
    assert.has_error(function() model:tokenize(nil) end)
    assert.has_error(function() model:tokenize("x", { bos = 1 }) end)
  end)

  it("refuses sequence() on a vocabulary-only model with a clear message", function()
    local ok, err = pcall(model.sequence, model)
    assert.is_false(ok)
    assert.matches("vocab_only", err)
  end)
end)
