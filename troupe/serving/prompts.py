"""A request's prompts as token ids, each checked against the server's limits and the model
before and after it is tokenized: a refusal is a 400 naming the field (``messages``,
``prompt.2``, ``tokens``), and a prompt far over the limit is refused after tokenizing about as
much as a prompt at the limit takes, not all of it."""

from __future__ import annotations

from troupe.data.tokenizer import TemplateKwargsError
from troupe.serving.config import Limits
from troupe.serving.protocol import RequestError

# A prompt longer than this many characters per allowed token is refused before it is
# rendered or tokenized: it cannot fit (no vocabulary averages that many characters a token
# over a whole prompt), and rendering it would only spend the replica's time.
CHARS_PER_TOKEN = 32


class Prompts:
    """Tokenizes prompts for a model of context ``seq_len`` and ``vocab_size`` tokens under
    ``limits`` (its ``max_prompt_tokens``)."""

    def __init__(self, tok, limits: Limits, seq_len: int, vocab_size: int):
        self.tok, self.limit = tok, limits.max_prompt_tokens
        self.seq_len, self.vocab_size = seq_len, vocab_size

    def chat(self, req, add_generation_prompt: bool = True) -> list[int]:
        """A chat's ids through the model's chat template (its tools rendered), its texts
        checked against the prompt limit before they are rendered."""
        self.check_chars(sum(m.chars() for m in req.messages), "messages")
        for i, m in enumerate(req.messages):
            self.check_text(m.content or "", f"messages.{i}.content")
        try:
            return self.tok.chat(req.conversation(), req.tool_specs(),
                                 add_generation_prompt=add_generation_prompt,
                                 template_kwargs=req.chat_template_kwargs)
        except TemplateKwargsError as e:
            raise RequestError(400, str(e), "chat_template_kwargs") from None
        except Exception as e:  # the model's chat template refused the conversation
            raise RequestError(400, f"messages: {e}", "messages") from None

    def text(self, text: str, field: str) -> list[int]:
        """A text's ids, the text checked against the prompt limit before it is tokenized."""
        self.check_chars(len(text), field)
        self.check_text(text, field)
        return self.tok.encode(text)

    def completion(self, prompt: str | list[int], field: str) -> list[int]:
        """One completion prompt: text, tokenized, or token ids, checked against the
        vocabulary and run as they are."""
        ids = list(prompt) if isinstance(prompt, list) else self.text(prompt, field)
        self.check_length(ids, field)
        if isinstance(prompt, list):
            self.check_vocabulary(ids, field)
        return ids

    def check_vocabulary(self, ids: list[int], field: str) -> None:
        outside = next((i for i, t in enumerate(ids) if t >= self.vocab_size), None)
        if outside is not None:
            raise RequestError(400, f"{field}.{outside}: token {ids[outside]} is not in this "
                               f"model's vocabulary (ids 0 to {self.vocab_size - 1})", field)

    def check_chars(self, chars: int, field: str) -> None:
        """Refused before rendering or tokenizing: more characters than the prompt limit can
        hold (see CHARS_PER_TOKEN)."""
        if chars > CHARS_PER_TOKEN * self.limit:
            raise RequestError(400, f"{field}: {chars} characters; this server accepts at "
                               f"most {self.limit} tokens (and at most {CHARS_PER_TOKEN} "
                               "characters a token before tokenizing)", field)

    def check_text(self, text: str, field: str) -> None:
        over = self._over_limit(text)
        if over is not None:
            raise RequestError(400, f"{field}: more than {over} tokens; this server accepts "
                               f"at most {self.limit}", field)

    def check_length(self, ids: list[int], field: str) -> None:
        if not ids:
            raise RequestError(400, f"{field}: the prompt is empty", field)
        if len(ids) > self.limit:
            raise RequestError(400, f"{field}: {len(ids)} tokens; this server accepts at most "
                               f"{self.limit}", field)
        if len(ids) >= self.seq_len:
            raise RequestError(400, f"{field}: {len(ids)} tokens fill the model's context of "
                               f"{self.seq_len} tokens", field)

    def _over_limit(self, text: str) -> int | None:
        """For a text longer than 4 characters a token at the limit: the tokens of growing
        prefixes (4 x limit characters, then doubling), so that a text over the limit is
        refused after tokenizing about as much as a prompt at the limit takes, not all of it.
        A prefix's token count once it passes the limit, else None."""
        size = 4 * self.limit
        while size < len(text):
            n = len(self.tok.encode(text[:size]))
            if n > self.limit + 1:  # a cut splits at most one token in two
                return n - 1
            size *= 2
        return None
