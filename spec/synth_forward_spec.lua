-- The llama, qwen2 and gemma3 forward passes on small synthetic models
-- against an exact float64 reference (scripts/ref-forward.py, built on the
-- gguf package's dequantizer). luma re-creates each model from the recipe in
-- its golden file (preset, seed, mix, the default model's vocabulary) and
-- checks the file's SHA-256 first, so the reference saw the same weights.
--
-- Random models give flat logits (spread about 1), so near ties are common:
-- disagreement on the top token is allowed only where the exact model's
-- margin between the two is below NEAR_TIE. A wrong sliding window moves
-- these logits by 0.7 or more and a wrong RoPE variant by 4 or more, so the
-- bound on |diff| catches real mistakes.
--
-- On a machine with a GPU the same checks run on the CUDA backend too
-- (where qwen2's q and k are stored with their rotation pairs adjacent).
local luma = require "luma"
local fetch = require "luma.fetch"
local H = require "helper"

local MAX_DIFF = 0.3
local NEAR_TIE = 0.3

local function build(golden)
  local r = golden.model
  local out = os.tmpname()
  luma.synth{ preset = r.preset, seed = r.seed, mix = r.mix, vocab = fetch.default_model(), out = out }
  return out
end

local backends = { "cpu" }
if H.backend == "cuda" then backends[2] = "cuda" end

for _, be in ipairs(backends) do for _, arch in ipairs{ "llama", "qwen2", "gemma3" } do
  describe("tiny " .. arch .. " forward (" .. be .. ") against the exact reference", function()
    local golden = dofile("spec/data/tiny-" .. arch .. "-golden.lua")
    local path, model

    setup(function()
      path = build(golden)
      model = luma.load(path, { backend = be })
    end)

    teardown(function()
      if model then model:close() end
      if path then os.remove(path) end
    end)

    it("re-creates the reference's model byte for byte", function()
      assert.are.equal(golden.model.sha256, luma.sha256(path))
    end)

    it("stays within " .. MAX_DIFF .. " of the exact logits, disagreeing on the top token only at near ties", function()
      local agree, total, maxdiff, worst, unlisted = H.against_exact(model, golden)
      assert.are.equal(0, unlisted, "luma's top token is not among the exact top-16")
      assert.is_true(worst <= NEAR_TIE)
      local cpp_agree = 0
      for _, p in ipairs(golden.prompts) do
        for _, ref in ipairs(p.top) do
          if ref.cpp_top == ref.ids[1] then cpp_agree = cpp_agree + 1 end
        end
      end
      print(string.format("\n  tiny-%s (%s): top-1 agreement with the exact model %d/%d (llama.cpp %d/%d), max |diff| %.3f",
                          arch, be, agree, total, cpp_agree, total, maxdiff))
      assert.is_true(maxdiff < MAX_DIFF)
    end)
  end)
end end
