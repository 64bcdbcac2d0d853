-- Shared by the specs: the model under test, the build directory, and small
-- numeric and file helpers. Specs `require "helper"` (busted is run with
-- --lpath='./spec/?.lua' from the repository root).
local luma = require "luma"

local H = {}

-- The build whose `luma` binary and luma.so the CLI specs run.
H.build_dir = os.getenv("LUMA_BUILD_DIR") or "build"

-- The default model: $LUMA_MODEL, else the fetched file. Raises a clear error
-- when neither is there: specs that need the model fail, never skip.
function H.model_path()
  local ok, path = pcall(require("luma.fetch").default_model)
  if not ok then error("spec needs the default model: " .. tostring(path), 0) end
  local f = io.open(path, "rb")
  if not f then error("spec needs the default model, but " .. path .. " cannot be opened", 0) end
  f:close()
  return path
end

-- The backend that H.load's "auto" picks: the GPU when there is one.
H.backend = "cpu"
for _, b in ipairs(luma.backends()) do
  if b == "cuda" then H.backend = "cuda" end
end

-- Loads the default model with two threads (the CI machine's cores).
function H.load(opts)
  local o = { threads = 2 }
  for k, v in pairs(opts or {}) do o[k] = v end
  return luma.load(H.model_path(), o)
end

-- The same, batch-invariant: for specs that compare runs of the same tokens
-- by different step shapes (prefill against one token at a time, batched
-- against alone, chunked, forked, preempted and recomputed). The CPU always
-- computes every row alike; on the GPU this option makes it do so too
-- (backend.h), so those specs hold their tolerances bit for bit on both.
function H.load_invariant(opts)
  local o = { batch_invariant = true }
  for k, v in pairs(opts or {}) do o[k] = v end
  local model = H.load(o)
  assert(model.info.batch_invariant, "the model did not load batch-invariant")
  return model
end

-- Largest |a[i] - b[i]| over every token id of two Logits.
function H.max_abs_diff(a, b)
  assert(#a == #b, "logits of different sizes")
  local d = 0
  for i = 0, #a - 1 do
    local x = math.abs(a[i] - b[i])
    if x > d then d = x end
  end
  return d
end

-- Asserts that two Logits agree: the same argmax, and every entry within tol.
function H.assert_close(a, b, tol)
  local d = H.max_abs_diff(a, b)
  assert(a:argmax() == b:argmax(), string.format("argmax %d ~= %d (max |diff| %.3g)", a:argmax(), b:argmax(), d))
  assert(d < tol, string.format("max |diff| %.3g is not below %g", d, tol))
end

-- A new sequence of model with text evaluated, and its last logits.
function H.prompted(model, text)
  local seq = model:sequence()
  return seq, seq:eval(model:tokenize(text))
end

-- Runs luma.generate twice on fresh sequences of model, with options fast
-- and slow (each given its own sequence), and asserts the same text, token
-- count, stop reason and sequence: a chained path against the iterator.
function H.same_generation(model, prompt, fast, slow)
  local luma, A = require "luma", require "luassert"
  local fast_seq, slow_seq = model:sequence(), model:sequence()
  fast.seq, slow.seq = fast_seq, slow_seq
  local f, fs = luma.generate(model, prompt, fast)
  local s, ss = luma.generate(model, prompt, slow)
  A.are.equal(s, f)
  A.are.equal(ss.tokens, fs.tokens)
  A.are.equal(ss.stop, fs.stop)
  A.are.same(slow_seq:tokens(), fast_seq:tokens())
  fast_seq:close()
  slow_seq:close()
end

-- Splits s at every occurrence of the plain string sep.
function H.split(s, sep)
  local out, pos = {}, 1
  while true do
    local at = s:find(sep, pos, true)
    if not at then
      out[#out + 1] = s:sub(pos)
      return out
    end
    out[#out + 1] = s:sub(pos, at - 1)
    pos = at + #sep
  end
end

function H.read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

function H.write(path, data)
  local f = assert(io.open(path, "wb"))
  f:write(data)
  f:close()
end

-- Runs a shell command; returns its stdout, stderr and exit status.
function H.run(cmd)
  local err = os.tmpname()
  local p = assert(io.popen(cmd .. " 2>" .. err, "r"))
  local out = p:read("a")
  local _, _, code = p:close()
  local e = H.read(err)
  os.remove(err)
  return out, e, code
end

-- Single-quotes s for the shell.
function H.quote(s)
  return "'" .. s:gsub("'", "'\\''") .. "'"
end

-- model against an exact forward's file (scripts/ref-forward.py: prompts
-- with every position's reference top ids and logits): the top-1
-- agreements, the positions, the largest |diff| over the reference's top
-- ids, the reference's largest margin where the top-1 differs, and the
-- positions whose top-1 is not among the reference's top ids at all.
function H.against_exact(model, exact)
  local agree, total, maxdiff, worst, unlisted = 0, 0, 0, 0, 0
  for _, p in ipairs(exact.prompts) do
    local seq = model:sequence()
    local all = seq:eval(p.ids, { all = true })
    for i, lg in ipairs(all) do
      local ref = p.top[i]
      total = total + 1
      local mine, listed = lg:argmax(), false
      if mine == ref.ids[1] then agree = agree + 1 end
      for k = 1, #ref.ids do
        maxdiff = math.max(maxdiff, math.abs(lg[ref.ids[k]] - ref.vals[k]))
        if ref.ids[k] == mine then
          listed = true
          if mine ~= ref.ids[1] then worst = math.max(worst, ref.vals[1] - ref.vals[k]) end
        end
      end
      if not listed then unlisted = unlisted + 1 end
    end
    seq:close()
  end
  return agree, total, maxdiff, worst, unlisted
end

-- Greedy continuation of ids on a fresh sequence: n token ids.
function H.greedy(model, ids, n)
  local seq = model:sequence()
  local logits = seq:eval(ids)
  local out = {}
  for i = 1, n do
    out[i] = logits:argmax()
    if i < n then logits = seq:eval(out[i]) end
  end
  seq:close()
  return out
end

return H
