"""Tool calling in the gateway, without processes: tools and tool history through a real chat template
(a Qwen2.5-style Hermes template rendered by the engine's jinja sandbox, tokenized by a trained BPE),
and tool calls parsed out of model text for each tool_choice."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from services.gateway.api_chat import ChatCompletionRequest
from services.gateway.errors import ApiError
from services.gateway.prep import chat_prompt
from services.gateway.tokenizers import Tokenizer
from services.gateway.tool_calls import tool_mode
from services.gpu_worker.engine.tokenizer import EngineTokenizer, save_tokenizer, train_tokenizer

# Qwen2.5's tool layout (system tools block, <tool_call> / <tool_response>), cut down to what it renders.
HERMES = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\nFor each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory: Path = tmp_path_factory.mktemp("hermes")
    save_tokenizer(train_tokenizer(512), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(EngineTokenizer.from_dir(directory), directory)


def request(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def test_tools_and_tool_history_are_rendered_through_the_template(tok: Tokenizer) -> None:
    data = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C and snow"}])
    mode = tool_mode(data)
    assert mode is not None and mode.choice == "auto"
    text = tok.decode(chat_prompt(data.messages, tok, True, mode.template_tools()))
    assert '"name": "get_weather"' in text and "<tools>" in text  # the tool's definition
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # the call, arguments an object
    assert "<tool_response>\n-3 C and snow" in text  # the tool's answer
    without = tok.decode(chat_prompt(request().messages, tok, True))
    assert "<tools>" not in without


def test_auto_parses_hermes_blocks_and_bare_json_calls() -> None:
    mode = tool_mode(request(tools=[WEATHER]))
    assert mode is not None
    content, calls = mode.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                "</tool_call>")
    assert content == "Let me check." and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"} and calls[0].id.startswith("call_")
    content, calls = mode.parse('{"name": "get_weather", "parameters": {"city": "Lima"}}')  # Llama 3.x JSON
    assert content is None and json.loads(calls[0].function.arguments) == {"city": "Lima"}
    assert mode.parse("It is sunny.") == ("It is sunny.", [])
    assert mode.parse('{"name": "not_a_tool", "arguments": {}}')[1] == []  # JSON that names no tool is text


def test_required_and_named_parse_what_their_grammar_makes() -> None:
    required = tool_mode(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert required is not None and json.loads(required.forced()[1])["maxItems"] == 1  # type: ignore[index]
    _, calls = required.parse('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    named = tool_mode(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named is not None and json.loads(named.forced()[1]) == WEATHER["function"]["parameters"]  # type: ignore[index]
    content, calls = named.parse('{"city": "Oslo"}')
    assert content is None and calls[0].function.name == "get_weather"


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},  # no tools
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
])
def test_a_tool_choice_that_cannot_be_honoured_is_400(fields: dict) -> None:
    with pytest.raises(ApiError) as refused:
        tool_mode(request(**fields))
    assert refused.value.status == 400 and refused.value.param == "tool_choice"
