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
local texts = {
  "The history of astronomy is the history of people trying to understand the sky.",
  "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
  "Recipe for a simple bread: mix 500 grams of flour, 10 grams of salt and 350 millilitres of water.",
  "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had " ..
    "taught him. Two hundred and twelve steps, no more and no less, and at the top the great lamp waited for him " ..
    "like an old friend. The sea below was grey and restless, and the gulls cried over the rocks where so many " ..
    "ships had broken in the years before the light was built.",
  "In mathematics, a prime number is a natural number greater than 1 that is not a product of two smaller " ..
    "natural numbers. A natural number greater than 1 that is not prime is called a composite number. For " ..
    "example, 5 is prime because the only ways of writing it as a product, 1 x 5 or 5 x 1, involve 5 itself.",
}
for _, text in ipairs(texts) do
  local ids = c:tokenize(text)
  local logits = c:sequence():eval(ids, { all = true })
  for i = 1, #ids do
    local tid, tv = logits[i]:topk(2)
    print(string.format("%d %.6f %.6f %d", tid[1], tv[1], tv[1] - tv[2], tid[2]))
  end
end
