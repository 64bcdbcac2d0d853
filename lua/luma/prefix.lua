-- A prefix cache: sequences kept after their prompt was evaluated, so that a
-- later prompt starting with the same tokens forks one of them instead of
-- evaluating those tokens again. The fork shares the KV blocks by reference
-- count; nothing is copied.
--
--   local Prefix = require "luma.prefix"
--   local cache = Prefix.new(model, { max_entries = 32 })
--   cache:insert(seq)                      -- keep seq's full blocks
--   local seq, n = cache:lookup(ids)       -- a sequence holding ids[1..n], or nil, 0
--   cache:evict()                          -- drop the least recently used entry
--
-- Matching is by whole KV blocks (cache.block tokens, from model:kv_free()):
-- an entry holds a multiple of that many tokens, and a hit is rewound to the
-- last block boundary both prompts share, so the new sequence writes into
-- fresh blocks (no copy-on-write).
-- The index is a trie with one node per block; a node's key is its block's
-- ids joined by commas, and it records the entries whose tokens pass
-- through it. An entry whose tokens are a prefix of a newer one's holds no
-- block the newer one lacks, and is dropped.
local Prefix = {}
Prefix.__index = Prefix

-- The ids of the b-th block (of size tokens) joined by commas.
local function block_key(ids, b, size)
  return table.concat(ids, ",", (b - 1) * size + 1, b * size)
end

local function new_node(parent, key)
  return { parent = parent, key = key, children = {}, entries = {} }
end

-- opts: max_entries (sequences kept at most, default 32).
function Prefix.new(model, opts)
  opts = opts or {}
  local max_entries = opts.max_entries or 32
  if math.type(max_entries) ~= "integer" or max_entries < 1 then
    error("prefix: max_entries must be a positive integer", 2)
  end
  local _, block = model:kv_free()
  return setmetatable({
    model = model,
    block = block,
    max_entries = max_entries,
    root = new_node(nil, nil),
    entries = {},          -- array of { seq, nodes, used }
    clock = 0,
    stats = { hits = 0, misses = 0, hit_tokens = 0, inserts = 0, evictions = 0 },
  }, Prefix)
end

function Prefix:__len() return #self.entries end

local function touch(self, entry)
  self.clock = self.clock + 1
  entry.used = self.clock
end

-- Forgets entry: its sequence is closed (blocks no other sequence shares go
-- back to the free list) and trie nodes no entry passes through are cut.
local function drop(self, entry)
  for i, e in ipairs(self.entries) do
    if e == entry then table.remove(self.entries, i) break end
  end
  for d = #entry.nodes, 1, -1 do
    local node = entry.nodes[d]
    node.entries[entry] = nil
    if next(node.entries) == nil then node.parent.children[node.key] = nil end
  end
  entry.seq:close()
end

-- Closes the least recently used entry; false when the cache is empty.
function Prefix:evict()
  local lru
  for _, e in ipairs(self.entries) do
    if not lru or e.used < lru.used then lru = e end
  end
  if not lru then return false end
  drop(self, lru)
  self.stats.evictions = self.stats.evictions + 1
  return true
end

function Prefix:clear()
  while self:evict() do end
end

-- Keeps the first n tokens of seq (default all), cut down to whole blocks.
-- seq itself is untouched: the cache holds a fork. Returns the number of
-- tokens the cache now holds for this prefix (0 when there is less than a
-- block, or when the fork cannot be rewound: a sliding-window layer already
-- released those positions).
function Prefix:insert(seq, n)
  n = n or seq:len()
  local block = self.block
  local nb = math.min(n, seq:len()) // block
  if nb == 0 then return 0 end
  local ids = seq:tokens()
  local node, path = self.root, {}
  for b = 1, nb do
    local child = node.children[block_key(ids, b, block)]
    if not child then break end
    node = child
    path[b] = child
  end
  if #path == nb then
    -- Already cached: the entries through the last node hold these blocks.
    for e in pairs(node.entries) do touch(self, e) end
    return nb * block
  end
  local fork = seq:fork()
  if fork:len() > nb * block and not pcall(fork.rewind, fork, nb * block) then
    fork:close()
    return 0
  end
  for b = #path + 1, nb do
    local key = block_key(ids, b, block)
    local child = new_node(node, key)
    node.children[key] = child
    node = child
    path[b] = child
  end
  local entry = { seq = fork, nodes = path }
  for _, p in ipairs(path) do p.entries[entry] = true end
  -- Entries ending on the shared path are prefixes of the new one.
  for _, e in ipairs({ table.unpack(self.entries) }) do
    if path[#e.nodes] == e.nodes[#e.nodes] then drop(self, e) end
  end
  self.entries[#self.entries + 1] = entry
  touch(self, entry)
  self.stats.inserts = self.stats.inserts + 1
  while #self.entries > self.max_entries do self:evict() end
  return nb * block
end

-- A new sequence holding the longest cached prefix of ids in whole blocks,
-- always leaving at least one token of ids to evaluate (its logits are the
-- prompt's). Returns seq, n (tokens it holds), or nil, 0 on a miss.
function Prefix:lookup(ids)
  local block = self.block
  local node, depth = self.root, 0
  for b = 1, (#ids - 1) // block do
    local child = node.children[block_key(ids, b, block)]
    if not child then break end
    node, depth = child, b
  end
  local best
  for e in pairs(node.entries) do
    if not best or e.used > best.used then best = e end
  end
  if depth == 0 or not best then
    self.stats.misses = self.stats.misses + 1
    return nil, 0
  end
  local seq = best.seq:fork()
  if seq:len() > depth * block and not pcall(seq.rewind, seq, depth * block) then
    seq:close()
    self.stats.misses = self.stats.misses + 1
    return nil, 0
  end
  touch(self, best)
  self.stats.hits = self.stats.hits + 1
  self.stats.hit_tokens = self.stats.hit_tokens + depth * block
  return seq, depth * block
end

return Prefix
