-- Top-1 at every position of five texts, for comparing two builds or two
-- backends: prints, one line a position, the argmax, its logit, its margin
-- over the second and the second's id. cuda/NOTES.md ("how sensitive the
-- model is") runs it on the CPU with and without a one-ulp nudge of the
-- RMSNorm scale and compares the two outputs.
-- With "float" as the third argument the model is loaded with float
-- activations (luma.load's float_act).
--   luma scripts/top1-nudge.lua [model.gguf [cpu|cuda [float]]] > out.txt
local luma = require "luma"
local path = (arg[1] ~= "" and arg[1]) or (os.getenv("HOME") .. "/.cache/luma/models/gemma-3-270m-q4_k_m.gguf")
local c = luma.load(path, { backend = arg[2] or "cpu", kv_mb = 256, float_act = arg[3] == "float" })
-- the texts of spec/cuda_spec.lua's top-1 counts, beside this script's folder
local texts = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/../spec/data/top1-texts.lua")
for _, text in ipairs(texts) do
  local ids = c:tokenize(text)
  local logits = c:sequence():eval(ids, { all = true })
  for i = 1, #ids do
    local tid, tv = logits[i]:topk(2)
    print(string.format("%d %.6f %.6f %d", tid[1], tv[1], tv[1] - tv[2], tid[2]))
  end
end
