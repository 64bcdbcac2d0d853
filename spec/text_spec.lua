-- luma.text's emitter against a plain one that keeps the whole text as one
-- string and cuts it at every token: the same pieces, stop reasons, shown
-- text and state.text, over long random streams of pieces that split UTF-8
-- characters, hold back stop strings, end on an end-of-generation token or
-- on a limit. No model: a table of pieces stands in for one.
local T = require "luma.text"
local S = require "luma.stop"

-- The pieces: words, empty pieces, the bytes of "ä" (C3 A4) and of "🦙" (F0
-- 9F A6 99) one at a time, whole characters, text that stop strings look
-- for, and id 1 the end-of-generation token (its text "<eos>").
local PIECES = { "<eos>", "a", "b", "ab", " the", "x", "yz", "xyz", "", "\xC3", "\xA4", "\xF0", "\x9F", "\xA6", "\x99",
                 "ä", "日本", " STOP", "S", "TOP", "\n", "end" }
local model = {}
function model.piece(_, id) return PIECES[id] end
function model.is_eog(_, id) return id == 1 end

-- The plain emitter: the text as one string, copied at every token.
local function plain(stops, max_tokens)
  -- the UTF-8 rule and the asking of the conditions are luma.text's own
  -- (policy_spec holds them to real byte tokens and stop strings): what is
  -- compared is the keeping and cutting of the text
  local e = { text = "", emitted = 0 }
  local src = { text = function() return e.text end }
  local tail = T.incomplete_tail
  function e.push(state, limit)
    local before = #e.text
    e.text = e.text .. state.model:piece(state.id)
    state.text = e.text
    local stop, keep, hold = T.ask(stops, state, before, src)
    if not stop and state.step + 1 >= max_tokens then stop = "max_tokens" end
    if not stop then stop = limit end
    state.step = state.step + 1
    if stop then
      local piece = e.text:sub(e.emitted + 1, keep or #e.text)
      e.emitted = e.emitted + #piece
      if piece == "" and stop == "eog" then piece = nil end
      return piece, stop == true and "stop" or stop
    end
    local upto = #e.text - math.max(hold, tail(e.text))
    local piece = ""
    if upto > e.emitted then
      piece = e.text:sub(e.emitted + 1, upto)
      e.emitted = upto
    end
    return piece, nil
  end
  return e
end

-- A seeded stream of ids (no end-of-generation token unless eog_at), from
-- every piece or from those of `from` alone.
local function stream(seed, n, eog_at, from)
  local ids, x = {}, seed
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    ids[i] = i == eog_at and 1 or from and from[1 + (x >> 8) % #from] or 2 + (x >> 8) % (#PIECES - 1)
  end
  return ids
end
-- one-byte pieces: "a", "b", the bytes of "ä" and "🦙", and "x"
local SMALL = { 2, 3, 10, 11, 12, 13, 14, 15, 6 }

describe("luma.text's emitter", function()
  -- Both emitters over the same ids; every push's results compared, and
  -- with record, what a condition read as state.text (reading it joins the
  -- pieces: without it they stay pieces).
  local function same(stops_of, ids, max_tokens, limit_at, record)
    local seen = { new = {}, old = {} }
    local function with_recorder(tag)
      local s = stops_of()
      if record then
        s[#s + 1] = function(state)
          seen[tag][#seen[tag] + 1] = state.text
          return false
        end
      end
      return s
    end
    local new = T.emitter(with_recorder("new"), max_tokens)
    local old = plain(with_recorder("old"), max_tokens)
    local sn, so = { model = model, step = 0 }, { model = model, step = 0 }
    local shown = ""
    for i, id in ipairs(ids) do
      sn.id, so.id = id, id
      local limit = i == limit_at and "ctx" or nil
      local pn, stn = new:push(sn, limit)
      local po, sto = old.push(so, limit)
      assert.are.equal(po, pn, "piece of token " .. i)
      assert.are.equal(sto, stn, "stop at token " .. i)
      shown = shown .. (pn or "")
      -- (reading the whole text joins the pieces: only now and then)
      if stn or i == #ids or i % 97 == 0 then
        assert.are.equal(shown, new:shown(), "shown after token " .. i)
        assert.are.equal(old.text, new:text(), "text after token " .. i)
      end
      if stn then
        assert.are.same(seen.old, seen.new)
        return stn, shown, i, seen
      end
    end
    assert.are.same(seen.old, seen.new)
    return nil, shown, #ids, seen
  end

  it("streams what the whole-string emitter streams, over more pieces than one join", function()
    for seed = 1, 6 do
      local stop, shown, n = same(function() return {} end, stream(seed, 300), 1000)
      assert.is_nil(stop)
      assert.are.equal(300, n)
      assert.is_true(#shown > 0)
    end
  end)

  it("holds back stop strings across pieces and cuts where they begin", function()
    local stopped = 0
    for seed = 1, 12 do
      local stop = same(function() return { S.strings{ "STOP", "yzab", "\xC3\xA4x" } } end, stream(seed, 400), 1000)
      if stop then stopped = stopped + 1 end
    end
    assert.is_true(stopped >= 6, "only " .. stopped .. " of 12 streams met a stop string")
  end)

  it("streams what it holds back over several one-byte pieces", function()
    for seed = 1, 8 do
      -- characters split over up to four byte pieces
      local stop, _, n = same(function() return {} end, stream(seed, 400, nil, SMALL), 1000)
      assert.is_nil(stop)
      assert.are.equal(400, n)
      -- and stop strings held back over up to three
      same(function() return { S.strings{ "abab", "\xF0\x9F\xA6\x99x" } } end, stream(seed, 400, nil, SMALL), 1000)
    end
  end)

  it("drops an end-of-generation token's text, stops at max_tokens and at the caller's limit", function()
    local stop, shown, n = same(function() return { S.eog() } end, stream(3, 200, 150), 1000)
    assert.are.equal("eog", stop)
    assert.are.equal(150, n)
    assert.is_nil(shown:find("<eos>", 1, true))
    stop, _, n = same(function() return { S.eog() } end, stream(4, 200), 90)
    assert.are.equal("max_tokens", stop)
    assert.are.equal(90, n)
    stop, _, n = same(function() return {} end, stream(5, 200), 1000, 77)
    assert.are.equal("ctx", stop)
    assert.are.equal(77, n)
  end)

  it("gives a Lua condition the whole text as state.text", function()
    local stop, shown, n, seen = same(function()
      return { S.when(function(state) return state.text:find(" STOP", 1, true) ~= nil end) }
    end, stream(7, 300), 1000, nil, true)
    assert.are.equal("stop", stop)
    assert.are.equal(n, #seen.new)
    assert.is_truthy(seen.new[n]:find(" STOP", 1, true))
    assert.is_truthy(shown:find(" STOP", 1, true))
  end)
end)
