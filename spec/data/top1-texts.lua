-- The five texts the GPU is compared with the CPU over, position by
-- position (249 positions on the default model): spec/cuda_spec.lua (the
-- first three also for its greedy continuations) and
-- scripts/top1-nudge.lua.
return {
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
