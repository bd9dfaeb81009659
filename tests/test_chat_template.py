"""Chat templates: rendered text and token ids against transformers' apply_chat_template."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from reference_tokenizers import ours, reference
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from infer.loader.chat_template import ChatTemplateError, compile_template, render_chat_template
from infer.loader.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is 2+2?"}
ASSISTANT = {"role": "assistant", "content": "4."}
USER2 = {"role": "user", "content": "  And 3+3?  Answer in 日本語 🙂\n"}
CONVERSATIONS = [
    [USER],
    [SYSTEM, USER],
    [USER, ASSISTANT, USER2],
    [SYSTEM, USER, ASSISTANT, USER2],
    [SYSTEM, USER, ASSISTANT],
]

# Gemma 3's instruct template: it writes the BOS itself.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

STRICT_ROLES_TEMPLATE = """{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('Unknown role: ' + message['role']) }}
{% endif %}
<{{ message['role'] }}>{{ message['content'] }}
{% endfor %}"""

LOOP_CONTROLS_TEMPLATE = """{% for message in messages %}
{% if message['role'] == 'system' %}{% continue %}{% endif %}
{% if message['content'] == 'STOP' %}{% break %}{% endif %}
[{{ loop.index }}:{{ message['role'] }}] {{ message['content'] }}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}"""


def _reference_render(ref: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
    return ref.apply_chat_template(conversation, tokenize=False, **kwargs)


def _reference_ids(ref: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return ref.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(add_generation_prompt: bool) -> None:
    tok, ref = ours("smollm2"), reference("smollm2")
    for conversation in CONVERSATIONS:
        text = tok.apply_chat_template(conversation, add_generation_prompt)
        assert text == _reference_render(ref, conversation,
                                         add_generation_prompt=add_generation_prompt)
        ids = tok.encode_chat(conversation, add_generation_prompt)
        assert ids == _reference_ids(ref, conversation,
                                     add_generation_prompt=add_generation_prompt)
        assert ids.count(tok.bos_token_id) == text.count("<|im_start|>")
    text = tok.apply_chat_template([USER])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # transformers builds Gemma's 262k-token tokenizer
def test_gemma_template_adds_exactly_one_bos() -> None:
    tok, ref = ours("gemma3"), reference("gemma3")
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            ids = tok.encode_chat(conversation, prompt, chat_template=GEMMA3_TEMPLATE)
            assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
            assert ids.count(tok.bos_token_id) == 1
            assert ids == _reference_ids(ref, conversation, add_generation_prompt=prompt,
                                         chat_template=GEMMA3_TEMPLATE)
            text = tok.apply_chat_template(conversation, prompt, chat_template=GEMMA3_TEMPLATE)
            assert text == _reference_render(ref, conversation, add_generation_prompt=prompt,
                                             chat_template=GEMMA3_TEMPLATE)
    # the plain encoding of the same text would add a second BOS
    text = tok.apply_chat_template([USER], chat_template=GEMMA3_TEMPLATE)
    assert tok.encode(text)[:2] == [tok.bos_token_id] * 2
    # content as a list of parts; roles that do not alternate raise the template's error
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " hi "}]}]
    assert tok.apply_chat_template(parts, chat_template=GEMMA3_TEMPLATE) == (
        "<bos><start_of_turn>user\n<start_of_image>hi<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        tok.apply_chat_template([USER, USER], chat_template=GEMMA3_TEMPLATE)


def test_model_without_template() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours("gemma3").apply_chat_template([USER])


def _llama3_style_dir(path: Path) -> Path:
    """A tiny byte-level tokenizer with Llama 3's special tokens and template."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    sample = " ".join(m["content"] for c in CONVERSATIONS for m in c)
    backend.train_from_iterator([sample, "system user assistant Today Date"] * 4, trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [backend.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


def test_llama3_style_bos_from_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = _llama3_style_dir(tmp_path)
    tok = Tokenizer.from_hf_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    bos = tok.bos_token_id
    assert bos == ref.bos_token_id and tok.encode("Hi")[0] == bos  # plain text gets a BOS
    eot, end = tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")
    assert tok.eos_token_ids == (eot, end)
    for conversation in CONVERSATIONS:
        text = tok.apply_chat_template(conversation)
        assert text == _reference_render(ref, conversation, add_generation_prompt=True)
        assert text.startswith("<|begin_of_text|><|start_header_id|>system")
        assert datetime.date.today().strftime("%d %b %Y") in text
        ids = tok.encode_chat(conversation)
        assert ids == _reference_ids(ref, conversation, add_generation_prompt=True)
        assert ids[0] == bos and ids.count(bos) == 1


def test_raise_exception_is_a_clear_error() -> None:
    good = [SYSTEM, USER, ASSISTANT]
    assert render_chat_template(STRICT_ROLES_TEMPLATE, good) == (
        "<system>You are terse.\n<user>What is 2+2?\n<assistant>4.\n")
    with pytest.raises(ChatTemplateError, match="Unknown role: tool") as info:
        render_chat_template(STRICT_ROLES_TEMPLATE, [*good, {"role": "tool", "content": "x"}])
    assert isinstance(info.value, ValueError)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat_template("{% for m in messages %}", good)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render_chat_template(STRICT_ROLES_TEMPLATE, [])


def test_templates_match_transformers() -> None:
    """Loop controls, tojson, namespace, whitespace control, None content, reasoning
    aliases and extra variables render as transformers renders them."""
    ref = reference("smollm2")
    tok = ours("smollm2")
    templates = [
        LOOP_CONTROLS_TEMPLATE,
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }} {{ bos_token }}{{ eos_token }}{{ pad_token }}{{ unk_token }}",
        "  {% if true %}\n    indented\n  {% endif %}\n{% for m in messages %}  {{ m.role }}\n"
        "{%- endfor %}",
        "{% for m in messages %}{{ m.keys() | list | tojson }}{% endfor %}{{ extra }}",
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        "{{ dict(a=1, b=[1, 2]) | tojson }} {{ tools | tojson }} {{ documents is none }}",
    ]
    conversation = [
        SYSTEM, USER,
        {"role": "assistant", "content": "<b>é</b> \"quoted\"", "tool_calls": None,
         "reasoning": "think"},
        {"role": "user", "content": "STOP"}, USER2,
    ]
    for template in templates:
        for prompt in (True, False):
            kwargs = {"chat_template": template, "add_generation_prompt": prompt, "extra": "X"}
            expected = _reference_render(ref, conversation, **kwargs)
            assert tok.apply_chat_template(conversation, prompt, chat_template=template,
                                           extra="X") == expected, template
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    template = templates[-1]
    assert tok.apply_chat_template([USER], chat_template=template, tools=tools) == (
        _reference_render(ref, [USER], chat_template=template, tools=tools))


def test_continue_final_message_matches_transformers() -> None:
    tok, ref = ours("smollm2"), reference("smollm2")
    conversation = [USER, {"role": "assistant", "content": "The answer is"}]
    text = tok.apply_chat_template(conversation, continue_final_message=True)
    assert text == _reference_render(ref, conversation, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")


def test_sandbox() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ ''.__class__.__mro__ }}", [USER])
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [USER])
    with pytest.raises(ChatTemplateError):  # immutable sandbox: no in-place list changes
        render_chat_template("{% set l = [] %}{{ l.append(1) }}", [USER])

    class Rich:
        def secret(self) -> str:
            return "leaked"

    text = render_chat_template("{{ messages[0].content }}", [{"role": "user", "content": Rich()}])
    assert text == "<Rich>"


def test_compiled_once() -> None:
    assert compile_template(LOOP_CONTROLS_TEMPLATE) is compile_template(LOOP_CONTROLS_TEMPLATE)
    assert render_chat_template("{{ strftime_now('%Y') }}", [USER]) == str(
        datetime.date.today().year)
