"""The demo tokenizer: character-level, built offline and deterministically, 100 tokens.

ids 0-3 are special: ``<pad>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of turn = eos, what
generation stops on) and ``<unk>``; then the 95 printable ASCII characters (space .. ``~``) and
newline, one token each. Its chat template is Qwen-style::

    <|im_start|>user\\n12+7=<|im_end|>\\n<|im_start|>assistant\\n

so the demo prompt "12+7=" is 24 tokens and the answer "19" plus eos is 3. A copy is shipped in
``gspo_megatron/assets/tokenizer`` (``demo_tokenizer_path()``); ``build_demo_tokenizer()`` rebuilds it
and a test checks the two agree.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>")
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The tool demo (examples/cpu_tool_demo.yaml): Qwen3's tool tags as single tokens (ids 100-103, as Qwen3 has
# them as added tokens), and a template that renders tool messages the way Qwen3's does: consecutive tool
# messages form one user turn of <tool_response> blocks.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# The fixed frame of a calculator call in compact JSON (data/tool_traces.py calculator_call), one token each
# (ids 104-105), as a real BPE has merges for a frame it sees often: a call of "58-96" is then 9 tokens
# (<tool_call>, the opening, 5 characters, the closing, </tool_call>) instead of 61 characters, short enough
# for the demo's tiny model to learn. Ordinary (not special) tokens: they decode to the same text, so the
# tool-call parser reads the JSON unchanged, and any other JSON is still spelled character by character.
CALCULATOR_FRAME = ('{"name":"calculator","arguments":{"expression":"', '"}}')
TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def demo_tokenizer_path() -> str:
    """The folder of the shipped demo tokenizer (load it with ``AutoTokenizer.from_pretrained``)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tokenizer")


def build_demo_tokenizer(tool_tokens: bool = False) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` over single characters (see the module docstring);
    ``tool_tokens``: also ``TOOL_TOKENS`` (ids 100-103), ``CALCULATOR_FRAME`` (ids 104-105) and
    ``TOOL_CHAT_TEMPLATE``, the tool demo's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    backend.decoder = decoders.Fuse()  # join characters back without spaces
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        unk_token="<unk>", model_max_length=4096)
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    if tool_tokens:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in TOOL_TOKENS], special_tokens=True)
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in CALCULATOR_FRAME])
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def tool_demo_tokenizer_path() -> str:
    """The shipped tokenizer of the tool demo (``build_demo_tokenizer(tool_tokens=True)``)."""
    return os.path.join(os.path.dirname(demo_tokenizer_path()), "tool_tokenizer")


def save_demo_tokenizer(path: str | os.PathLike[str], tool_tokens: bool = False) -> str:
    """Build and ``save_pretrained`` the demo tokenizer into ``path`` (written aside, then renamed)."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shipped folder must be readable by everyone
    try:
        build_demo_tokenizer(tool_tokens).save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp)  # no half-written folder left behind; the error propagates
        raise
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def load_demo_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_tokenizer_path())


__all__ = ["CALCULATOR_FRAME", "DEMO_CHAT_TEMPLATE", "TOOL_CHAT_TEMPLATE", "TOOL_TOKENS", "build_demo_tokenizer", "demo_tokenizer_path",
           "load_demo_tokenizer", "save_demo_tokenizer", "tool_demo_tokenizer_path"]
