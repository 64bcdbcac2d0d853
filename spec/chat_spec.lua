-- Chat templates: the exact text each template writes, and how the default
-- model reads the Gemma one.
local luma = require "luma"
local H = require "helper"
local chat = require "luma.chat"

local MSGS = {
  { role = "system", content = "Be brief." },
  { role = "user", content = "Hi!" },
  { role = "assistant", content = "Hello." },
  { role = "user", content = "Name a color." },
}

describe("chat templates", function()
  local model
  setup(function() model = luma.load(H.model_path(), { vocab_only = true }) end)
  teardown(function() if model then model:close() end end)

  it("gemma: no system role (folded into the first user turn), model turns, open model turn", function()
    assert.are.equal(
      "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n" ..
      "<start_of_turn>model\nHello.<end_of_turn>\n" ..
      "<start_of_turn>user\nName a color.<end_of_turn>\n" ..
      "<start_of_turn>model\n",
      chat.format(model, MSGS, "gemma"))
    assert.are.equal("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
                     chat.format(model, { { role = "user", content = "Hi" } }, "gemma"))
  end)

  it("chatml: every role in im_start/im_end, open assistant turn", function()
    assert.are.equal(
      "<|im_start|>system\nBe brief.<|im_end|>\n" ..
      "<|im_start|>user\nHi!<|im_end|>\n" ..
      "<|im_start|>assistant\nHello.<|im_end|>\n" ..
      "<|im_start|>user\nName a color.<|im_end|>\n" ..
      "<|im_start|>assistant\n",
      chat.format(model, MSGS, "chatml"))
  end)

  it("llama3: begin_of_text, header ids, eot_id, open assistant header", function()
    assert.are.equal(
      "<|begin_of_text|>" ..
      "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" ..
      "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>" ..
      "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>" ..
      "<|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>" ..
      "<|start_header_id|>assistant<|end_header_id|>\n\n",
      chat.format(model, MSGS, "llama3"))
  end)

  it("chooses the gemma template for the default model from its metadata", function()
    assert.are.equal("gemma", chat.template_name(model))
    assert.are.equal(chat.format(model, MSGS, "gemma"), chat.format(model, MSGS))
  end)

  it("tokenizes the gemma template with special = true to bos and turn-marker ids", function()
    local ids = model:tokenize(chat.format(model, MSGS), { bos = false, special = true })
    assert.are.equal(model.bos, ids[1])
    assert.are_not.equal(model.bos, ids[2])
    local starts, ends = 0, 0
    for _, id in ipairs(ids) do
      if id == 105 then starts = starts + 1 end
      if id == 106 then ends = ends + 1 end
    end
    assert.are.equal("<start_of_turn>", model:piece(105, true))
    assert.are.equal("<end_of_turn>", model:piece(106, true))
    assert.are.equal(4, starts)
    assert.are.equal(3, ends)
    assert.are.equal(105, ids[#ids - 2])
    -- Without special parsing the markers are plain text.
    for _, id in ipairs(model:tokenize(chat.format(model, MSGS), { bos = false })) do
      assert.is_true(id ~= 105 and id ~= 106)
    end
    -- What closes a turn in the sequence is the end-of-turn token.
    assert.are.same({ 106, 107 }, model:tokenize(chat.turn_end.gemma, { bos = false, special = true }))
    assert.is_true(model:is_eog(106))
  end)

  it("rejects malformed messages and unknown templates", function()
    assert.matches("expected a list of messages", select(2, pcall(chat.format, model, "hi")))
    assert.matches("message 2 needs string fields role and content",
                   select(2, pcall(chat.format, model, { { role = "user", content = "a" }, { role = "user" } })))
    assert.matches("unknown template 'nope'", select(2, pcall(chat.format, model, MSGS, "nope")))
  end)
end)
