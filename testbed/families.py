"""Chat-template families the tiny model can be built with: the special tokens, end token, template and vLLM
parsers of the model families teams serve, so exact mode is tested on the templates it will meet.

Each template is written here to reproduce its family's behaviour (special tokens, how a turn is closed,
where tools and the system prompt go, the tool-call syntax its vLLM parser reads, think stripping); none is
a copy of a published template. What each family does that matters for exact tokens:

- ``chatml``: the default tiny model (hermes tool calls, a newline after every ``<|im_end|>``).
- ``qwen3``: ChatML with hermes tool calls on their own lines, tools in the system prompt, and reasoning
  (``<think>``) dropped from assistant turns before the latest user message; parsed by ``hermes`` +
  ``qwen3``.
- ``llama3_json``: headers per role, ``<|eot_id|>`` closes every turn with nothing after it, tools and their
  instructions go into the first user message, tool calls are bare JSON with ``parameters``, tool results
  are ``ipython`` turns; ``llama3_json``.
- ``mistral``: ``[INST]``/``[/INST]`` with no generation prompt; the tool list and the system prompt are
  rendered inside the *latest* user message only, so they move when a new user message arrives; tool calls
  ``[TOOL_CALLS][...]`` whose ids must be 9 alphanumeric characters; ``mistral``.
- ``deepseek_v3``: special tokens spelled with full-width bars, tool calls in a tool-calls block with a
  fenced JSON body; what follows the end-of-sentence token depends on the position: a newline at the end of
  the conversation, the next block directly in the middle; ``deepseek_v3``.
- ``granite``: ``<|start_of_role|>role<|end_of_role|>`` turns closed by ``<|end_of_text|>`` and a newline,
  tools in their own ``available_tools`` turn, calls as ``<|tool_call|>[...]``; ``granite``.

``tool_call`` and ``answer`` are regular expressions (``structured_outputs``) that make the random tiny model
write one call of ``ls {"path": "/tmp"}``, or a short plain answer, in the family's syntax.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    control_tokens: tuple[str, ...]
    """Special tokens: dropped by `skip_special_tokens`. The first is the padding token."""
    markup_tokens: tuple[str, ...]
    """Single ids kept in decoded text (tool-call and think markers), so parsers see them."""
    eos: str
    template: str
    tool_parser: str
    reasoning_parser: str | None
    tool_call: str
    answer: str

    @property
    def pad(self) -> str:
        return self.control_tokens[0]

    def server_args(self) -> list[str]:
        """vLLM flags that parse this family's replies; `structured_outputs` also drives the reasoning (vLLM
        applies it only after the reasoning by default)."""
        args = ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if self.reasoning_parser:
            args += ["--reasoning-parser", self.reasoning_parser]
            args += ["--structured-outputs-config", '{"enable_in_reasoning": true}']
        return args


# Every template below writes its text through expressions with explicit newlines, so the output does not
# depend on the Jinja environment's whitespace options (transformers uses trim_blocks/lstrip_blocks).
_TEXT_MACRO = r"""{%- macro text(value) -%}
{%- if value is none -%}
{%- elif value is string -%}{{ value }}
{%- else -%}{%- for part in value -%}{%- if part.text is defined and part.text is not none -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro arguments(fn) -%}
{%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}
{%- endmacro -%}
"""  # noqa: E501 (the template's lines are its text)

CHATML_TEMPLATE = r"""{#- tiny-model ChatML template: system/user/assistant/tool, hermes-style tool calls -#}
{%- macro text(value) -%}
{%- if value is none -%}
{%- elif value is string -%}{{ value }}
{%- else -%}{%- for part in value -%}{%- if part.text is defined and part.text is not none -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == "system" -%}
{%- set system_text = text(messages[0].content) -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system_text = none -%}
{%- set turns = messages -%}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in turns -%}{%- if message.role == "user" -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- set strip_thinking = strip_old_thinking is defined and strip_old_thinking -%}
{%- if tools -%}
{{- "<|im_start|>system\n" -}}
{%- if system_text -%}{{- system_text + "\n\n" -}}{%- endif -%}
{{- "# Tools\n\nYou can call these functions. Their signatures, one JSON object a line:\n<tools>\n" -}}
{%- for tool in tools -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{{- '{"name": ' + (fn.name | tojson) -}}
{%- if fn.description is defined and fn.description is not none -%}{{- ', "description": ' + (fn.description | tojson) -}}{%- endif -%}
{%- if fn.parameters is defined and fn.parameters is not none -%}{{- ', "parameters": ' + (fn.parameters | tojson) -}}{%- endif -%}
{{- "}\n" -}}
{%- endfor -%}
{{- "</tools>\n\nTo call a function, answer with one or more blocks of the form\n<tool_call>{\"name\": <function name>, \"arguments\": <JSON object>}</tool_call><|im_end|>\n" -}}
{%- elif system_text is not none -%}
{{- "<|im_start|>system\n" + system_text + "<|im_end|>\n" -}}
{%- endif -%}
{%- for message in turns -%}
{%- if message.role == "assistant" -%}
{{- "<|im_start|>assistant\n" -}}
{%- generation -%}
{%- if message.reasoning_content is defined and message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif message.reasoning is defined and message.reasoning is string -%}
{%- set reasoning = message.reasoning -%}
{%- else -%}
{%- set reasoning = "" -%}
{%- endif -%}
{%- set content = text(message.content) -%}
{%- if strip_thinking and loop.index0 < ns.last_user -%}
{#- Qwen3-style: an answer before the latest user message loses its thinking. -#}
{%- set reasoning = "" -%}
{%- if "</think>" in content -%}{%- set content = content.split("</think>")[-1] -%}{%- endif -%}
{%- endif -%}
{%- if reasoning -%}{{- "<think>" + reasoning + "</think>" -}}{%- endif -%}
{{- content -}}
{%- if message.tool_calls is defined and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '<tool_call>{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- "}</tool_call>" -}}
{%- endfor -%}
{%- endif -%}
{{- "<|im_end|>" -}}
{%- endgeneration -%}
{{- "\n" -}}
{%- elif message.role == "tool" -%}
{%- if loop.first or turns[loop.index0 - 1].role != "tool" -%}{{- "<|im_start|>user\n" -}}{%- endif -%}
{{- "<tool_response>\n" + text(message.content) + "\n</tool_response>" -}}
{%- if loop.last or turns[loop.index0 + 1].role != "tool" -%}{{- "<|im_end|>\n" -}}{%- else -%}{{- "\n" -}}{%- endif -%}
{%- else -%}
{{- "<|im_start|>" + message.role + "\n" + text(message.content) + "<|im_end|>\n" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|im_start|>assistant\n" -}}{%- endif -%}
"""  # noqa: E501 (the template's lines are its text: wrapping them would change the template)

# Qwen3 behaviour: tools in the system turn, calls on their own lines, reasoning kept only after the latest
# user query (tool results arrive as user turns but are not queries), `enable_thinking=false` pre-fills an
# empty think block.
QWEN3_TEMPLATE = (
    _TEXT_MACRO
    + r"""{%- set ns = namespace(last_query=messages | length - 1) -%}
{%- for message in messages[::-1] -%}
{%- set index = messages | length - 1 - loop.index0 -%}
{%- if ns.last_query == messages | length - 1 and message.role == "user" -%}{%- set ns.last_query = index -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
{{- "<|im_start|>system\n" -}}
{%- if messages[0].role == "system" -%}{{- text(messages[0].content) + "\n\n" -}}{%- endif -%}
{{- "# Tools\n\nFunctions you may call, described as JSON inside <tools></tools>:\n<tools>" -}}
{%- for tool in tools -%}{{- "\n" + (tool | tojson) -}}{%- endfor -%}
{{- "\n</tools>\n\nTo call one, answer with a JSON object naming it and its arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- elif messages[0].role == "system" -%}
{{- "<|im_start|>system\n" + text(messages[0].content) + "<|im_end|>\n" -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == "user" or (message.role == "system" and not loop.first) -%}
{{- "<|im_start|>" + message.role + "\n" + text(message.content) + "<|im_end|>\n" -}}
{%- elif message.role == "assistant" -%}
{%- set content = text(message.content) -%}
{%- if message.reasoning_content is defined and message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif message.reasoning is defined and message.reasoning is string -%}
{%- set reasoning = message.reasoning -%}
{%- elif "</think>" in content -%}
{%- set reasoning = content.split("</think>")[0].split("<think>")[-1] -%}
{%- set content = content.split("</think>")[-1] -%}
{%- else -%}
{%- set reasoning = "" -%}
{%- endif -%}
{{- "<|im_start|>assistant\n" -}}
{%- if loop.index0 > ns.last_query and reasoning -%}
{{- "<think>\n" + (reasoning | trim) + "\n</think>\n\n" + (content | trim) -}}
{%- else -%}
{{- content | trim -}}
{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first or content | trim -%}{{- "\n" -}}{%- endif -%}
{{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' + arguments(fn) + "}\n</tool_call>" -}}
{%- endfor -%}
{{- "<|im_end|>\n" -}}
{%- elif message.role == "tool" -%}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" -%}{{- "<|im_start|>user" -}}{%- endif -%}
{{- "\n<tool_response>\n" + text(message.content) + "\n</tool_response>" -}}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" -%}{{- "<|im_end|>\n" -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- "<|im_start|>assistant\n" -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- "<think>\n\n</think>\n\n" -}}{%- endif -%}
{%- endif -%}
"""  # noqa: E501
)

# Llama 3.1 behaviour with JSON tool calls: a dated system header, the tools and how to call them inside the
# first user message, bare JSON calls with "parameters", tool results as ipython turns.
LLAMA3_JSON_TEMPLATE = (
    _TEXT_MACRO
    + r"""{{- "<|begin_of_text|>" -}}
{%- if messages[0].role == "system" -%}
{%- set system_text = text(messages[0].content) -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system_text = "" -%}
{%- set turns = messages -%}
{%- endif -%}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" -}}
{%- if tools -%}{{- "Environment: ipython\n" -}}{%- endif -%}
{{- "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n" + system_text + "<|eot_id|>" -}}
{%- set ns = namespace(tools_given=false) -%}
{%- for message in turns -%}
{%- if message.role == "user" -%}
{{- "<|start_header_id|>user<|end_header_id|>\n\n" -}}
{%- if tools and not ns.tools_given -%}
{%- set ns.tools_given = true -%}
{{- "Answer with a JSON function call when one helps, as {\"name\": function name, \"parameters\": object of argument values}. Use no variables.\n\n" -}}
{%- for tool in tools -%}{{- (tool | tojson(indent=4)) + "\n\n" -}}{%- endfor -%}
{%- endif -%}
{{- text(message.content) + "<|eot_id|>" -}}
{%- elif message.role == "assistant" -%}
{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" -}}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- "; " -}}{%- endif -%}
{{- '{"name": ' + (fn.name | tojson) + ', "parameters": ' + arguments(fn) + "}" -}}
{%- endfor -%}
{%- else -%}
{{- text(message.content) -}}
{%- endif -%}
{{- "<|eot_id|>" -}}
{%- elif message.role == "tool" or message.role == "ipython" -%}
{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" -}}
{%- if message.content is mapping -%}{{- message.content | tojson -}}{%- else -%}{{- text(message.content) -}}{%- endif -%}
{{- "<|eot_id|>" -}}
{%- else -%}
{{- "<|start_header_id|>" + message.role + "<|end_header_id|>\n\n" + text(message.content) + "<|eot_id|>" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" -}}{%- endif -%}
"""  # noqa: E501
)

# Mistral behaviour (parallel tool calls): the tool list and the system prompt are rendered with the latest
# user message only; no generation prompt; tool-call ids must be 9 alphanumeric characters.
MISTRAL_TEMPLATE = (
    _TEXT_MACRO
    + r"""{%- if messages[0].role == "system" -%}
{%- set system_text = text(messages[0].content) -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system_text = "" -%}
{%- set turns = messages -%}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in turns -%}{%- if message.role == "user" -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- "<s>" -}}
{%- for message in turns -%}
{%- if message.role == "user" -%}
{%- if loop.index0 == ns.last_user -%}
{%- if tools -%}
{{- "[AVAILABLE_TOOLS] [" -}}
{%- for tool in tools -%}{%- if not loop.first -%}{{- ", " -}}{%- endif -%}{{- tool | tojson -}}{%- endfor -%}
{{- "][/AVAILABLE_TOOLS]" -}}
{%- endif -%}
{%- if system_text -%}{{- "[INST] " + system_text + "\n\n" + text(message.content) + "[/INST]" -}}
{%- else -%}{{- "[INST] " + text(message.content) + "[/INST]" -}}{%- endif -%}
{%- else -%}
{{- "[INST] " + text(message.content) + "[/INST]" -}}
{%- endif -%}
{%- elif message.role == "assistant" and message.tool_calls -%}
{{- "[TOOL_CALLS][" -}}
{%- for call in message.tool_calls -%}
{%- if call.id is not defined or call.id is none or call.id | length != 9 or not call.id.isalnum() -%}
{{- raise_exception("Tool call ids must be 9 alphanumeric characters, got " + (call.id | string)) -}}
{%- endif -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- ", " -}}{%- endif -%}
{{- '{"name": ' + (fn.name | tojson) + ', "arguments": ' + arguments(fn) + ', "id": ' + (call.id | tojson) + "}" -}}
{%- endfor -%}
{{- "]</s>" -}}
{%- elif message.role == "assistant" -%}
{{- " " + (text(message.content) | trim) + "</s>" -}}
{%- elif message.role == "tool" -%}
{{- '[TOOL_RESULTS] {"content": ' + (text(message.content) | tojson) + ', "call_id": ' + (message.tool_call_id | tojson) + "}[/TOOL_RESULTS]" -}}
{%- endif -%}
{%- endfor -%}
"""  # noqa: E501
)

# DeepSeek-V3 behaviour: tool calls in fenced JSON blocks; what follows the end-of-sentence token depends on
# what comes next (a newline when the conversation ends there).
DEEPSEEK_V3_TEMPLATE = (
    _TEXT_MACRO
    + r"""{{- "<｜begin▁of▁sentence｜>" -}}
{%- if messages[0].role == "system" -%}{{- text(messages[0].content) -}}{%- endif -%}
{%- if tools -%}
{{- "\n\n## Tools\nYou have access to the following tools:\n" -}}
{%- for tool in tools -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{{- "\n### " + fn.name + "\nDescription: " + (fn.description or "") + "\n\nParameters: " + (fn.parameters | tojson) + "\n" -}}
{%- endfor -%}
{{- "\nIMPORTANT: call tools only in the tool-call format.\n" -}}
{%- endif -%}
{%- set ns = namespace(in_tools=false) -%}
{%- for message in messages -%}
{%- if message.role != "tool" and ns.in_tools -%}{{- "<｜tool▁outputs▁end｜>" -}}{%- set ns.in_tools = false -%}{%- endif -%}
{%- if message.role == "user" -%}
{{- "<｜User｜>" + text(message.content) -}}
{%- elif message.role == "assistant" -%}
{{- "<｜Assistant｜>" + text(message.content) -}}
{%- if message.tool_calls -%}
{{- "<｜tool▁calls▁begin｜>" -}}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- "\n" -}}{%- endif -%}
{{- "<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + fn.name + "\n```json\n" + arguments(fn) + "\n```<｜tool▁call▁end｜>" -}}
{%- endfor -%}
{{- "<｜tool▁calls▁end｜>" -}}
{%- endif -%}
{{- "<｜end▁of▁sentence｜>" -}}
{%- if loop.last -%}{{- "\n" -}}{%- endif -%}
{%- elif message.role == "tool" -%}
{%- if not ns.in_tools -%}{{- "<｜tool▁outputs▁begin｜>" -}}{%- set ns.in_tools = true -%}{%- else -%}{{- "\n" -}}{%- endif -%}
{{- "<｜tool▁output▁begin｜>" + text(message.content) + "<｜tool▁output▁end｜>" -}}
{%- endif -%}
{%- endfor -%}
{%- if ns.in_tools -%}{{- "<｜tool▁outputs▁end｜>" -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- "<｜Assistant｜>" -}}{%- endif -%}
"""  # noqa: E501
)

# Granite 3 behaviour: role markers, a default system turn, the tools in an `available_tools` turn, calls
# as a JSON array after `<|tool_call|>`.
GRANITE_TEMPLATE = (
    _TEXT_MACRO
    + r"""{%- if messages[0].role == "system" -%}
{%- set system_text = text(messages[0].content) -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system_text = "You are a helpful assistant." -%}
{%- set turns = messages -%}
{%- endif -%}
{{- "<|start_of_role|>system<|end_of_role|>" + system_text + "<|end_of_text|>\n" -}}
{%- if tools -%}
{{- "<|start_of_role|>available_tools<|end_of_role|>" -}}
{%- for tool in tools -%}{%- if not loop.first -%}{{- "\n\n" -}}{%- endif -%}{{- tool | tojson(indent=4) -}}{%- endfor -%}
{{- "<|end_of_text|>\n" -}}
{%- endif -%}
{%- for message in turns -%}
{%- if message.role == "assistant" and message.tool_calls -%}
{{- "<|start_of_role|>assistant<|end_of_role|><|tool_call|>[" -}}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- ", " -}}{%- endif -%}
{{- '{"name": ' + (fn.name | tojson) + ', "arguments": ' + arguments(fn) + "}" -}}
{%- endfor -%}
{{- "]<|end_of_text|>\n" -}}
{%- elif message.role == "tool" -%}
{{- "<|start_of_role|>tool_response<|end_of_role|>" + text(message.content) + "<|end_of_text|>\n" -}}
{%- else -%}
{{- "<|start_of_role|>" + message.role + "<|end_of_role|>" + text(message.content) + "<|end_of_text|>\n" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start_of_role|>assistant<|end_of_role|>" -}}{%- endif -%}
"""  # noqa: E501
)

_LS = r'"name": "ls", "ARGS": \{"path": "/tmp"\}'
_WORDS = r"[A-Z][a-z]{2,7}( [a-z]{2,7}){1,3}\."

CHATML = Family(
    name="chatml",
    control_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    markup_tokens=("<tool_call>", "</tool_call>", "<think>", "</think>"),
    eos="<|im_end|>",
    template=CHATML_TEMPLATE,
    tool_parser="hermes",
    reasoning_parser=None,
    tool_call=r"<tool_call>\{" + _LS.replace("ARGS", "arguments") + r"\}</tool_call>",
    answer=_WORDS,
)

FAMILIES = {
    family.name: family
    for family in (
        CHATML,
        Family(
            name="qwen3",
            control_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            markup_tokens=(
                "<tool_call>",
                "</tool_call>",
                "<think>",
                "</think>",
                "<tool_response>",
                "</tool_response>",
            ),
            eos="<|im_end|>",
            template=QWEN3_TEMPLATE,
            tool_parser="hermes",
            reasoning_parser="qwen3",
            tool_call=r"<think>\n[a-z]{2,6}\n</think>\n\n<tool_call>\n\{"
            + _LS.replace("ARGS", "arguments")
            + r"\}\n</tool_call>",
            answer=r"<think>\n[a-z]{2,6}\n</think>\n\n" + _WORDS,
        ),
        Family(
            name="llama3_json",
            control_tokens=(
                "<|end_of_text|>",
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
            ),
            markup_tokens=("<|python_tag|>",),
            eos="<|eot_id|>",
            template=LLAMA3_JSON_TEMPLATE,
            tool_parser="llama3_json",
            reasoning_parser=None,
            tool_call=r"\{" + _LS.replace("ARGS", "parameters") + r"\}",
            answer=_WORDS,
        ),
        Family(
            name="mistral",
            control_tokens=("<pad>", "<s>", "</s>", "[INST]", "[/INST]"),
            markup_tokens=(
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            eos="</s>",
            template=MISTRAL_TEMPLATE,
            tool_parser="mistral",
            reasoning_parser=None,
            tool_call=r"\[TOOL_CALLS\]\[\{" + _LS.replace("ARGS", "arguments") + r"\}\]",
            answer=_WORDS,
        ),
        Family(
            name="deepseek_v3",
            control_tokens=(
                "<｜▁pad▁｜>",
                "<｜begin▁of▁sentence｜>",
                "<｜end▁of▁sentence｜>",
                "<｜User｜>",
                "<｜Assistant｜>",
            ),
            markup_tokens=(
                "<｜tool▁calls▁begin｜>",
                "<｜tool▁calls▁end｜>",
                "<｜tool▁call▁begin｜>",
                "<｜tool▁call▁end｜>",
                "<｜tool▁sep｜>",
                "<｜tool▁outputs▁begin｜>",
                "<｜tool▁outputs▁end｜>",
                "<｜tool▁output▁begin｜>",
                "<｜tool▁output▁end｜>",
            ),
            eos="<｜end▁of▁sentence｜>",
            template=DEEPSEEK_V3_TEMPLATE,
            tool_parser="deepseek_v3",
            reasoning_parser=None,
            tool_call="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>ls\n```json\n"
            + r'\{"path": "/tmp"\}'
            + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            answer=_WORDS,
        ),
        Family(
            name="granite",
            control_tokens=("<|pad|>", "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
            markup_tokens=("<|tool_call|>",),
            eos="<|end_of_text|>",
            template=GRANITE_TEMPLATE,
            tool_parser="granite",
            reasoning_parser=None,
            tool_call=r"<\|tool_call\|>\[\{" + _LS.replace("ARGS", "arguments") + r"\}\]",
            answer=_WORDS,
        ),
    )
}
