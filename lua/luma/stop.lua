-- Stop conditions. A condition is a function (state) -> stop, where state
-- has the fields of a policy's state plus `id` (the token just chosen) and
-- `text` (the generated text so far, held-back bytes included). It returns
-- false or nil to go on, or a reason to stop after this token: true
-- (reported as "stop" in stats.stop) or a string reported as it is. The
-- reason "eog" (what S.eog returns) also drops the token's text: an
-- end-of-generation marker is not part of the answer, and a stream that has
-- nothing left to show for that token does not yield it.
--
-- A condition may also be a table with a `check` function of that shape and
-- a `hold(text)` function returning how many trailing bytes of text must not
-- be shown yet because they may still become part of a stop string; its
-- check may return a byte count as second result: the text to keep. A
-- table's `max_tokens` field, when present, is the count of tokens its check
-- stops at; it is read before the first token, so that a limit of 0 makes
-- no token at all.
local S = {}

function S.max_tokens(n)
  if math.type(n) ~= "integer" or n < 0 then error("max_tokens: expected a non-negative integer", 2) end
  return { max_tokens = n, check = function(state) return state.step + 1 >= n end }
end

-- End-of-generation tokens of the model (eos, end of turn, ...).
function S.eog()
  return function(state)
    if state.model:is_eog(state.id) then return "eog" end
    return false
  end
end

-- Stops when the generated text contains one of the strings; the text before
-- the string is kept. Bytes that could still grow into a stop string are held
-- back from streaming until they cannot.
function S.strings(list)
  if type(list) ~= "table" or #list == 0 then error("strings: expected a list of strings", 2) end
  for i, s in ipairs(list) do
    if type(s) ~= "string" or #s == 0 then error("strings: element " .. i .. " is not a non-empty string", 2) end
  end
  local cond = {}
  function cond.check(state)
    local cut
    for _, s in ipairs(list) do
      local at = state.text:find(s, 1, true)
      if at and (not cut or at - 1 < cut) then cut = at - 1 end
    end
    if cut then return true, cut end
    return false
  end
  function cond.hold(text)
    local hold = 0
    for _, s in ipairs(list) do
      -- the longest suffix of text that is a proper prefix of s
      for k = math.min(#s - 1, #text), 1, -1 do
        if k > hold and text:sub(-k) == s:sub(1, k) then
          hold = k
          break
        end
      end
    end
    return hold
  end
  return cond
end

-- Any predicate: S.when(function(state) return ... end)
function S.when(fn)
  if type(fn) ~= "function" then error("when: expected a function", 2) end
  return fn
end

return S
