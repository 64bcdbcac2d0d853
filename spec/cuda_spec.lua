-- The CUDA backend against the CPU backend on the default model: the same
-- logits up to rounding, the same greedy text, batched equal to sequential.
-- Where no GPU is present (luma.backends() has no "cuda"), it says so and
-- checks that asking for the CUDA backend is a clear error.
local luma = require "luma"
local fetch = require "luma.fetch"

local has_cuda = false
for _, b in ipairs(luma.backends()) do has_cuda = has_cuda or b == "cuda" end

local PROMPTS = {
  "The history of astronomy is the history of people trying to understand the sky.",
  "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
  "Recipe for a simple bread: mix 500 grams of flour, 10 grams of salt and 350 millilitres of water.",
}

if not has_cuda then
  describe("CUDA backend", function()
    it("is refused clearly where there is no GPU", function()
      print("\n  cuda_spec: no CUDA device here; the GPU checks did not run")
      local ok, err = pcall(luma.load, fetch.default_model(), { backend = "cuda" })
      assert.is_false(ok)
      assert.matches("CUDA", err)
    end)
  end)
  return
end

describe("CUDA backend against the CPU backend", function()
  local cpu, gpu

  setup(function()
    local path = fetch.default_model()
    cpu = luma.load(path, { backend = "cpu", kv_mb = 256 })
    gpu = luma.load(path, { backend = "cuda", kv_mb = 256 })
  end)

  teardown(function()
    if cpu then cpu:close() end
    if gpu then gpu:close() end
  end)

  it("runs on the GPU", function()
    assert.are.equal("cuda", gpu.info.backend)
  end)

  it("gives the CPU's top token at 97% of positions, differing only at near ties", function()
    local total, agree, maxdiff, worst = 0, 0, 0, 0
    for _, text in ipairs(PROMPTS) do
      local ids = cpu:tokenize(text)
      local a = cpu:sequence():eval(ids, { all = true })
      local b = gpu:sequence():eval(ids, { all = true })
      for i = 1, #ids do
        total = total + 1
        local ia, ib = a[i]:argmax(), b[i]:argmax()
        if ia == ib then agree = agree + 1 else worst = math.max(worst, a[i][ia] - a[i][ib]) end
        local top = a[i]:topk(32)
        for _, id in ipairs(top) do maxdiff = math.max(maxdiff, math.abs(a[i][id] - b[i][id])) end
      end
    end
    print(string.format("\n  cuda vs cpu: top-1 %d/%d, max |diff| over the CPU top-32 %.3f, worst margin %.3f",
                        agree, total, maxdiff, worst))
    assert.is_true(agree / total >= 0.97)
    assert.is_true(worst <= 0.5)
  end)

  it("continues greedily like the CPU until a near tie", function()
    for _, text in ipairs(PROMPTS) do
      local ids = cpu:tokenize(text)
      local sa, sb = cpu:sequence(), gpu:sequence()
      local la, lb = sa:eval(ids), sb:eval(ids)
      local same = 0
      for _ = 1, 32 do
        local ia, ib = la:argmax(), lb:argmax()
        if ia ~= ib then
          assert.is_true(la[ia] - la[ib] <= 0.5)
          break
        end
        same = same + 1
        la, lb = sa:eval(ia), sb:eval(ib)
      end
      print(string.format("\n  greedy: %d of 32 tokens identical", same))
      sa:close()
      sb:close()
    end
  end)

  it("gives the same logits batched as one sequence at a time", function()
    local seqs, ids, alone = {}, {}, {}
    for i, text in ipairs(PROMPTS) do
      ids[i] = gpu:tokenize(text)
      local s = gpu:sequence()
      alone[i] = s:eval(ids[i])
      s:close()
      seqs[i] = gpu:sequence()
    end
    local batch = gpu:batch()
    for i, s in ipairs(seqs) do batch:add(s, ids[i]) end
    local out = batch:run()
    for i, s in ipairs(seqs) do
      local lg = out[s]
      assert.are.equal(alone[i]:argmax(), lg:argmax())
      local top = alone[i]:topk(32)
      for _, id in ipairs(top) do assert.is_true(math.abs(alone[i][id] - lg[id]) < 0.05) end
      s:close()
    end
  end)
end)
