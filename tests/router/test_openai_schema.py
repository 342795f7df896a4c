"""Chat messages as the chat template sees them, the message fields that are refused, and how many
messages a chat may hold."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megaserve.router.openai_schema import MAX_MESSAGES, UNSUPPORTED_PARAMETER, ChatCompletionRequest, ChatMessage
from megaserve.router.tokenizer import Tokenizer
from tests.model_factory import sentencepiece_style_tokenizer

# A template that shows each message's role and, where it has one, its name, as some open templates do.
NAMED_TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}] {{ m.content }}\n"
                  "{% endfor %}")


def test_a_message_s_name_reaches_the_template_and_developer_is_the_system_role():
    tokenizer = Tokenizer(sentencepiece_style_tokenizer(["<unk>"]), {}, NAMED_TEMPLATE)
    messages = [ChatMessage(role="developer", content="be brief"),
                ChatMessage(role="user", content="hi", name="ada")]
    prompt = tokenizer.apply_chat_template([m.template_message() for m in messages], add_generation_prompt=False)
    assert prompt == "[system] be brief\n[user:ada] hi\n"


@pytest.mark.parametrize("field, value", [
    ("tool_calls", [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
    ("function_call", {"name": "f", "arguments": "{}"}),
])
def test_an_assistant_message_s_tool_calls_are_refused_not_dropped_from_the_prompt(field, value):
    with pytest.raises(ValidationError) as raised:
        ChatMessage.model_validate({"role": "assistant", "content": "", field: value})
    (error,) = raised.value.errors()
    assert error["type"] == UNSUPPORTED_PARAMETER and error["ctx"]["name"] == field


@pytest.mark.parametrize("field, value", [("tool_calls", None), ("tool_calls", []), ("function_call", None)])
def test_an_assistant_message_without_tool_calls_is_served(field, value):
    message = ChatMessage.model_validate({"role": "assistant", "content": "ok", field: value})
    assert message.template_message() == {"role": "assistant", "content": "ok"}


def test_a_conversation_of_the_most_messages_is_valid_and_one_more_is_not():
    def body(count: int) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}] * count}

    assert len(ChatCompletionRequest.model_validate(body(MAX_MESSAGES)).messages) == MAX_MESSAGES
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate(body(MAX_MESSAGES + 1))
    (error,) = raised.value.errors()
    assert error["type"] == "too_long" and error["loc"] == ("messages",)
