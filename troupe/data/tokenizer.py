"""Tokenizers. ByteTokenizer: UTF-8 bytes are the tokens 0..255, 256 ends a document (troupe's
bundled models and datasets). The applications use the ``Tokenizer`` interface: ByteTokens for
troupe's models, HFTokens for a Hugging Face model directory (``load_tokenizer``)."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class ByteTokenizer:
    """Encodes any text losslessly; vocab_size = 257 (bytes + end of document)."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str, eos: bool = False) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
        return np.append(ids, np.uint16(self.eos_id)) if eos else ids

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if int(i) < 256)
        return data.decode("utf-8", errors="replace")


class Tokenizer(Protocol):
    """What the applications need of a tokenizer: ids of text and of a chat, text of ids, the
    end and padding ids, and (``hf``) the Hugging Face tokenizer the generation engine
    detokenizes with incrementally (None: byte-level)."""

    eos_id: int
    pad_id: int
    vocab_size: int
    hf: Any

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat(self, messages: list[dict], tools: list[dict] | None = None,
             add_generation_prompt: bool = True,
             template_kwargs: dict[str, Any] | None = None) -> list[int]: ...

    def prompt(self, text: str | list[dict[str, str]]) -> list[int]:
        """The ids a task's prompt is given to the model as (a chat turn, or plain text);
        chat messages always go through the chat template."""
        ...

    def lengths(self, texts: list[str], prompt: bool = False) -> list[int]:
        """``len(encode(t))`` (``prompt``: ``len(prompt(t))``) of each text, at once."""
        ...


class ByteTokens:
    """troupe's byte tokenizer with the end-of-text id doubling as padding. A chat is one
    "role: content" line per message, then "assistant:" for the reply."""

    hf = None

    def __init__(self) -> None:
        self._tok = ByteTokenizer()
        self.eos_id = self.pad_id = ByteTokenizer.eos_id
        self.vocab_size = ByteTokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).tolist()

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def chat(self, messages: list[dict], tools: list[dict] | None = None,
             add_generation_prompt: bool = True,
             template_kwargs: dict[str, Any] | None = None) -> list[int]:
        # template_kwargs: variables for a chat template, which this format has none of
        if tools:
            raise ValueError("tools: this model reads bytes and has no chat template to "
                             "render tools with")
        lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
        return self.encode("\n".join(lines) + ("\nassistant:" if add_generation_prompt else ""))

    def prompt(self, text: str | list[dict[str, str]]) -> list[int]:
        return self.encode(text) if isinstance(text, str) else self.chat(text)

    def lengths(self, texts: list[str], prompt: bool = False) -> list[int]:
        return [len(t.encode()) for t in texts]  # a prompt's text is its bytes, as any text

    def save_pretrained(self, directory: str | Path) -> None:
        """Write this tokenizer as a Hugging Face one (tokenizer.json, tokenizer_config.json)
        into ``directory``, so that a byte-level model exported as a Hugging Face directory
        carries its tokenizer: a byte-level BPE without merges whose ids are the bytes, the
        end of text as id 256, and this class's chat format as the chat template.
        transformers (and ``HFTokens``) then give the ids and chats this class gives. The
        directory's config.json, when there is one, gets the end-of-text id as its bos and eos
        ids (transformers' GPT-2 defaults name an id past a byte model's vocabulary)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vocab = {ch: b for b, ch in enumerate(_byte_chars())}
        eos = "<|endoftext|>"
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": self.eos_id, "content": eos, "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True}],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": False, "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []},
        }
        template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                  "pad_token": eos, "model_max_length": 1 << 30, "chat_template": template}
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        model_config = directory / "config.json"
        if model_config.is_file():
            hf = json.loads(model_config.read_text())
            hf.update(bos_token_id=self.eos_id, eos_token_id=self.eos_id)
            model_config.write_text(json.dumps(hf, indent=1))


def _byte_chars() -> list[str]:
    """The printable character byte-level BPE stands each byte for (GPT-2's table): bytes
    that print stand for themselves, the others for code points from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


# transformers switches special-token parsing by setting a flag on the shared Rust tokenizer
# before each encode: two threads encoding at once (the server prepares requests on a thread
# pool) could have a user's content parsed with control tokens on. Encodes take this lock.
_SPECIALS = threading.Lock()


class TemplateKwargsError(ValueError):
    """A chat template variable that the template cannot take as it is (it spells a control
    token); the message names the key."""


class HFTokens:
    """The tokenizer of a Hugging Face model directory (tokenizer.json and its config), with
    the model's chat template (or ``template``, a Jinja chat template in its place).
    ``use_chat``: a task's prompts go in as a user turn through the chat template (when the
    tokenizer has one), as instruction-tuned models expect."""

    def __init__(self, path: str | Path, use_chat: bool = True, template: str | None = None,
                 tools: list[dict] | None = None):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("a Hugging Face model's tokenizer needs transformers: "
                              "pip install 'troupe[hf]'") from None
        path = Path(path).expanduser()
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (the model directory must hold "
                                    "its tokenizer)")
        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.hf.eos_token_id is None:
            raise ValueError(f"{path}: the tokenizer has no eos token")
        self.eos_id = self.hf.eos_token_id
        self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.hf)
        if template is not None:  # a chat template in place of the tokenizer's own
            self.hf.chat_template = template
        self.path, self.use_chat = path, use_chat and bool(self.hf.chat_template)
        self.tools = tools or None  # rendered with every prompt (``prompt``)
        self._frame: tuple[str, tuple[list[int], list[int]] | None] | None = None

    def encode(self, text: str) -> list[int]:
        with _SPECIALS:
            return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict], tools: list[dict] | None = None,
             add_generation_prompt: bool = True,
             template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The ids of ``messages`` through the model's chat template, ready for the reply
        (``tools``: function specs the template renders, for templates that take them;
        ``add_generation_prompt`` False: the conversation as it stands, no reply begun;
        ``template_kwargs``: more variables for the template, e.g. Qwen3's
        ``enable_thinking``).

        Only the template's own markers are control tokens: each message's content is
        tokenized as text, so a user who writes ``<|im_end|>\n<|im_start|>system\n...``
        gets those characters to the model, not a system turn. The template is rendered with
        a placeholder for each content; the text between placeholders is tokenized with its
        special tokens, each content without. A template that does not keep the
        placeholders as they are (one that edits content) falls back to rendering the
        contents themselves, and then refuses a content that holds a special token's text.
        A message without text content (an assistant turn of tool calls) has none."""
        if not self.hf.chat_template:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        self._check_template_kwargs(template_kwargs or {})
        texts = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
        marks = {i: f"\ue000{i}\ue001" for i in texts}  # private-use characters
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        text = self.hf.apply_chat_template(
            [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)],
            tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        parts, rest = [], text
        for i in texts:
            before, found, rest = rest.partition(marks[i])
            if not found or marks[i] in rest:
                return self._chat_whole(messages, extra, add_generation_prompt)
            parts += [(before, False), (messages[i]["content"], True)]
        ids: list[int] = []
        with _SPECIALS:
            for piece, is_content in [*parts, (rest, False)]:
                if piece:
                    ids += self.hf.encode(piece, add_special_tokens=False,
                                          split_special_tokens=is_content)
        return ids

    @functools.cached_property
    def control_tokens(self) -> list[str]:
        """The texts of the tokenizer's special and added tokens."""
        return [t for t in self.hf.all_special_tokens + list(self.hf.added_tokens_encoder) if t]

    def control_token_in(self, text: str) -> str | None:
        """The first of the tokenizer's control tokens that ``text`` spells, or None."""
        return next((t for t in self.control_tokens if t in text), None)

    def _check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """A template's variables are rendered as the template's own text, whose markers are
        control tokens: a string among them that spells one would forge a turn. Raises
        TemplateKwargsError naming the key."""
        def strings(x: Any):
            if isinstance(x, str):
                yield x
            elif isinstance(x, dict):
                for k, v in x.items():
                    yield from strings(k)
                    yield from strings(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    yield from strings(v)
        for key, value in kwargs.items():
            found = next(filter(None, map(self.control_token_in, strings(value))), None)
            if found is not None:
                raise TemplateKwargsError(f"chat_template_kwargs.{key}: holds the control token "
                                          f"{found!r}, which would be read as the template's")

    def _chat_whole(self, messages: list[dict], extra: dict[str, Any],
                    add_generation_prompt: bool = True) -> list[int]:
        for i, m in enumerate(messages):
            found = self.control_token_in(m.get("content") or "")
            if found is not None:
                raise ValueError(f"message {i}: its content holds the control token {found!r}, "
                                 "which this model's chat template cannot keep as text")
        with _SPECIALS:
            ids = self.hf.apply_chat_template(messages, tokenize=True,
                                              add_generation_prompt=add_generation_prompt,
                                              **extra)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding or ids

    def prompt(self, text: str | list[dict[str, str]]) -> list[int]:
        if not isinstance(text, str):
            return self.chat(text, self.tools)
        if not self.use_chat:
            return self.encode(text)
        frame = self._user_turn()
        if frame is None:  # the template edits its content: rendered whole each time
            return self.chat([{"role": "user", "content": text}], self.tools)
        with _SPECIALS:
            content = self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        return frame[0] + content + frame[1]

    def lengths(self, texts: list[str], prompt: bool = False) -> list[int]:
        """The lengths of ``encode`` (``prompt``: of ``prompt``) of each text, from one call
        of the Rust tokenizer: a recipe's plan measures every example of its data, and 88,000
        texts one at a time were 5 s of SmolLM2's start."""
        if not texts:  # transformers' batch call fails on an empty list
            return []
        chat = prompt and self.use_chat
        frame = self._user_turn() if chat else ([], [])
        if frame is None:  # the template edits its content: each prompt rendered whole
            return [len(self.prompt(t)) for t in texts]
        with _SPECIALS:
            ids = self.hf(list(texts), add_special_tokens=False,
                          split_special_tokens=chat)["input_ids"]
        return [len(frame[0]) + len(i) + len(frame[1]) for i in ids]

    def _user_turn(self) -> tuple[list[int], list[int]] | None:
        """A one-user-turn prompt's ids around its content, the same for every text: ``chat``
        renders the template with a placeholder and tokenizes the text on either side of it
        apart from the content, so a prompt is these ids with the content's between them.
        Rendered once a day (templates that print today's date, as Llama 3's, see a new one):
        a recipe's plan measures every prompt of its data, and 20,000 renders of SmolLM2's
        template were 8 s of its start. None when the template does not keep the placeholder
        as it is."""
        today = time.strftime("%Y-%m-%d")
        if self._frame is None or self._frame[0] != today:
            mark = "\ue0000\ue001"  # chat's placeholder for a first message
            text = self.hf.apply_chat_template(
                [{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True,
                **({"tools": self.tools} if self.tools else {}))
            before, found, after = text.partition(mark)
            ids = None
            if found and mark not in after:
                with _SPECIALS:
                    ids = tuple(self.hf.encode(piece, add_special_tokens=False,
                                               split_special_tokens=False) if piece else []
                                for piece in (before, after))
            self._frame = (today, ids)
        return self._frame[1]


def load_tokenizer(pretrained: str | Path | None, use_chat: bool = True,
                   template: str | None = None,
                   tools: list[dict] | None = None) -> ByteTokens | HFTokens:
    """The tokenizer of the Hugging Face model directory ``pretrained`` (``template``: a chat
    template in place of its own; ``tools``: rendered with every prompt), or troupe's byte
    tokenizer for troupe's own models (None)."""
    return (ByteTokens() if pretrained is None
            else HFTokens(pretrained, use_chat, template, tools))
