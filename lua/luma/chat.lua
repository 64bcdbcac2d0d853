-- Chat templates: a list of messages { {role = "system"|"user"|"assistant", content = "..."} }
-- formatted as the model was trained to read them, ending with the opening
-- of the assistant's turn. The template is chosen from the model's metadata
-- (tokenizer.chat_template) and, failing that, from its architecture.
local M = {}

local templates = {}

-- Gemma: no system role; a system message is put before the first user turn.
function templates.gemma(msgs)
  local out, system = { "<bos>" }, nil
  for _, m in ipairs(msgs) do
    if m.role == "system" then
      system = m.content
    else
      local role = m.role == "assistant" and "model" or "user"
      local content = m.content
      if system and role == "user" then
        content = system .. "\n\n" .. content
        system = nil
      end
      out[#out + 1] = "<start_of_turn>" .. role .. "\n" .. content .. "<end_of_turn>\n"
    end
  end
  out[#out + 1] = "<start_of_turn>model\n"
  return table.concat(out)
end

function templates.chatml(msgs)
  local out = {}
  for _, m in ipairs(msgs) do
    out[#out + 1] = "<|im_start|>" .. m.role .. "\n" .. m.content .. "<|im_end|>\n"
  end
  out[#out + 1] = "<|im_start|>assistant\n"
  return table.concat(out)
end

function templates.llama3(msgs)
  local out = { "<|begin_of_text|>" }
  for _, m in ipairs(msgs) do
    out[#out + 1] = "<|start_header_id|>" .. m.role .. "<|end_header_id|>\n\n" .. m.content .. "<|eot_id|>"
  end
  out[#out + 1] = "<|start_header_id|>assistant<|end_header_id|>\n\n"
  return table.concat(out)
end

M.templates = templates

-- What closes an assistant turn inside the sequence, per template: a
-- continued conversation feeds it after each answer.
M.turn_end = { gemma = "<end_of_turn>\n", chatml = "<|im_end|>\n", llama3 = "<|eot_id|>" }

-- The name of the template a model uses.
function M.template_name(model)
  local t = model:meta("tokenizer.chat_template")
  if type(t) == "string" then
    if t:find("<start_of_turn>", 1, true) then return "gemma" end
    if t:find("<|im_start|>", 1, true) then return "chatml" end
    if t:find("<|start_header_id|>", 1, true) then return "llama3" end
  end
  local arch = model.info.arch
  if arch:match("^gemma") then return "gemma" end
  if arch == "qwen2" then return "chatml" end
  return "llama3"
end

-- M.format(model, messages [, template name]) -> prompt text (special tokens
-- written out; tokenize it with special = true, without adding BOS).
function M.format(model, msgs, name)
  if type(msgs) ~= "table" then error("chat.format: expected a list of messages", 2) end
  for i, m in ipairs(msgs) do
    if type(m) ~= "table" or type(m.role) ~= "string" or type(m.content) ~= "string" then
      error("chat.format: message " .. i .. " needs string fields role and content", 2)
    end
  end
  name = name or M.template_name(model)
  local t = templates[name] or error("chat.format: unknown template '" .. tostring(name) .. "'", 2)
  return t(msgs)
end

return M
