"""Text <-> token ids for the router, from a Hugging Face model folder, without transformers or torch.

- `Tokenizer.from_dir(path)`: the `tokenizers` library on tokenizer.json, special tokens and the
  chat template from tokenizer_config.json (or chat_template.jinja). End-of-sequence ids are the
  engines' (replicas/models/config.py: the router never stops a generation on a token itself).
- `apply_chat_template` renders the model's Jinja template the way transformers does: a sandboxed
  environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
  a `tojson` that keeps non-ASCII text, and bos_token/eos_token/... as variables.
- `encode_chat` tokenizes a conversation through the template with the messages' text as text: a
  token the tokenizer marks special, spelled out inside a message ("<|eot_id|>" in a user's
  content), becomes the characters it is made of, never the token, so that a message cannot end
  its turn or forge another with it (as OpenAI's API reads message text; vLLM and SGLang encode the
  rendered prompt as one string, where it would be the token). The template's own special tokens
  stay tokens. Plain-text turn markers, added tokens not marked special, and text that a template
  joins or changes are read as in the rendered prompt.
- `IncrementalDetokenizer` turns generated ids into text deltas. Byte-level BPE splits a multi-byte
  character (emoji, CJK) across tokens, so a delta is held back while the decoded text ends in an
  incomplete UTF-8 sequence (U+FFFD) and released once the character is whole.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Sequence

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from megaserve.replicas.protocol import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

log = logging.getLogger(__name__)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Special tokens that transformers hands to chat templates as variables (its special_tokens_map;
# transformers 5 no longer passes additional_special_tokens).
TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_TEMPLATE_NAME = "default"
REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence
# The prompt's ids that the detokenizer decodes before the first generated one (vLLM's offset: 5).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes and every token carries at least one, so a character that is
# still incomplete began in the last 3 ids: text before them is final, U+FFFD or not.
INCOMPLETE_CHARACTER_TOKENS = 3
# How many split points of the held ids push tries when the text ends in U+FFFD: enough to find a
# character boundary among tokens of several bytes (4-byte characters in 3-byte tokens share one
# every 4 tokens), few enough that a push costs a handful of decodes.
RELEASE_CANDIDATES = 8
# encode_chat stands in for each special token spelled inside a message with a character of Unicode's
# Supplementary Private Use Area-A that the messages do not hold: no template touches such a
# character, so it comes through the rendering where the spelling was, and marks it there.
PLACEHOLDERS = re.compile("[\U000F0000-\U000FFFFD]")
FIRST_PLACEHOLDER, LAST_PLACEHOLDER = 0xF0000, 0xFFFFD


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused the messages."""


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
    ) -> None:
        # A tokenizer.json may ask to pad or truncate (some fine-tunes ship it so): a prompt is neither.
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<|begin_of_text|>", ...}
        special_added = {i: token for i, token in backend.get_added_tokens_decoder().items() if token.special}
        self._special_text = {i: token.content for i, token in special_added.items()}
        # ids that decoding with skip_special_tokens leaves out
        self.special_ids = frozenset(self._special_text)
        self._template = _compile_chat_template(chat_template) if chat_template else None
        specials = set(self._special_text.values())
        normalized = sorted(token.content for token in special_added.values() if token.normalized)
        if normalized and backend.normalizer is not None:
            log.warning("special tokens %s are matched after the tokenizer's normalizer: message text that it "
                        "turns into one (full-width or upper-case spellings) is read as the token, not as text",
                        ", ".join(normalized))
        self._spelled_special = re.compile(spelling_pattern(specials)) if specials else None
        # Private-use characters of the template itself, which encode_chat must not take for placeholders.
        self._template_private_use = {ord(c) for c in PLACEHOLDERS.findall(chat_template or "")}
        # For a stretch of text at the start of a prompt, and for the others (_reading_specials_as_text).
        self._as_text_first, self._as_text = _reading_specials_as_text(backend) if specials else (None, None)
        self._token_texts: dict[int, str] = {}  # token_text's, filled as ids come up (a vocabulary at most)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}")
        try:
            backend = BackendTokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise ValueError(f"{path / TOKENIZER_FILE} is not a readable tokenizer: {error}") from None
        config = _read_json(path / TOKENIZER_CONFIG_FILE)
        special_tokens = {
            key: _token_text(config[key]) for key in TEMPLATE_SPECIAL_TOKENS if config.get(key) is not None
        }
        return cls(
            backend,
            special_tokens,
            _chat_template(path, config),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds
        (Llama 3: <|begin_of_text|>). A rendered chat template already holds its own. Through
        `encode_batch`, which releases the GIL while it runs (`encode` holds it): a long prompt
        tokenized in a worker thread leaves the router's event loop free."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
        """The prompt ids of `messages` through the chat template (apply_chat_template), with every
        special token spelled inside a message's text encoded as that text, not as the token: the
        stretch of text between two of the template's own special tokens that holds a spelling is
        encoded whole, as the tokenizer would encode it were the spelling no token, and the rest as
        the tokenizer encodes the rendered prompt. Message values other than strings (content parts)
        are not looked into: the router hands over text. Raises ChatTemplateError as
        apply_chat_template does."""
        if self._spelled_special is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **template_kwargs),
                               add_special_tokens=False)
        marked, placeholder_of = self._mark_spellings(messages)
        text = self.apply_chat_template(marked, add_generation_prompt, **template_kwargs)
        if not placeholder_of:
            return self.encode(text, add_special_tokens=False)
        return self._encode_marked(text, placeholder_of)

    def _mark_spellings(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """`messages` with each special token spelled in a string value (not the role) replaced by a
        placeholder, and the placeholder of each spelling."""
        placeholder_of: dict[str, str] = {}  # a special token's text -> the character that stands for it
        free: Iterator[int] | None = None  # the placeholders the messages leave free: sought at the first spelling

        def mark(match: re.Match[str]) -> str:
            nonlocal free
            if free is None:
                taken = self._template_private_use | {ord(c) for m in messages for value in m.values()
                                                      if isinstance(value, str) for c in PLACEHOLDERS.findall(value)}
                free = (code for code in range(FIRST_PLACEHOLDER, LAST_PLACEHOLDER + 1) if code not in taken)
            if match.group(0) not in placeholder_of:
                code = next(free, None)
                if code is None:
                    raise ChatTemplateError("the messages hold every character of Unicode's Supplementary Private "
                                            "Use Area-A, and spell a special token: one such character must be free")
                placeholder_of[match.group(0)] = chr(code)
            return placeholder_of[match.group(0)]

        marked = [{key: self._spelled_special.sub(mark, value) if key != "role" and isinstance(value, str) else value
                   for key, value in message.items()} for message in messages]
        return marked, placeholder_of

    def _encode_marked(self, text: str, placeholder_of: dict[str, str]) -> list[int]:
        """The ids of the rendered prompt `text`, whose placeholders stand for the spellings in
        `placeholder_of`."""
        # The rendered prompt as the tokenizer reads it: the only special tokens it finds are the
        # template's own (a spelling is a placeholder), each with the whitespace it absorbs (lstrip,
        # rstrip). The stretches of text between them that hold a placeholder are encoded again with
        # the spellings put back, read as text; the others keep their ids.
        whole = self._backend.encode_batch([text], add_special_tokens=False)[0]
        # Read once: an Encoding builds a new list of all its ids (or offsets) at every access.
        whole_ids, offsets, count = whole.ids, whole.offsets, len(whole.ids)
        restore = str.maketrans({placeholder: special for special, placeholder in placeholder_of.items()})
        held = re.compile(f"[{''.join(placeholder_of.values())}]")
        # (A special id whose text is not the token's, such as <unk> for a character the model lacks,
        # a placeholder among them, is no template token.)
        cuts = [k for k, (token, (start, end)) in enumerate(zip(whole_ids, offsets, strict=True))
                if token in self._special_text and self._special_text[token].strip() == text[start:end].strip()]
        stretches = []  # (first token, end token, first character, end character) between two cuts
        token, character = 0, 0
        for cut in [*cuts, count]:
            stretches.append((token, cut, character, offsets[cut][0] if cut < count else len(text)))
            if cut < count:
                token, character = cut + 1, offsets[cut][1]
        again = [s for s in stretches if held.search(text, s[2], s[3])]
        firsts = [s for s in again if s[2] == 0]
        encoded = dict(zip(firsts, self._as_text_first.encode_batch(
            [text[s[2]:s[3]].translate(restore) for s in firsts], add_special_tokens=False)))
        later = [s for s in again if s[2] > 0]
        encoded |= dict(zip(later, self._as_text.encode_batch(
            [text[s[2]:s[3]].translate(restore) for s in later], add_special_tokens=False)))
        ids: list[int] = []
        for stretch in stretches:
            ids += encoded[stretch].ids if stretch in encoded else whole_ids[stretch[0]:stretch[1]]
            if stretch[1] < count:
                ids.append(whole_ids[stretch[1]])  # the template's special token that ends it
        return ids

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's entry in the vocabulary, as the tokenizer spells it (Ġ for a byte-level space)."""
        return [self._backend.id_to_token(token_id) for token_id in token_ids]

    def token_text(self, token_id: int) -> str:
        """One id decoded alone, special tokens written out: how logprobs name a token (vLLM's way).
        A byte-level token that is part of a character decodes to U+FFFD."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._backend.decode([token_id], skip_special_tokens=False)
        return text

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]), as transformers'
        apply_chat_template(tokenize=False) renders it. Extra keyword arguments reach the template
        (e.g. Qwen3's enable_thinking). Raises ChatTemplateError when the model has no template or
        the template rejects the conversation (its raise_exception)."""
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json and no "
                f"{CHAT_TEMPLATE_FILE}); send a plain completion prompt instead"
            )
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **template_kwargs,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template rejected the messages: {error}") from error


class IncrementalDetokenizer:
    """Feed generated ids one at a time with `push`; each call returns the new text (maybe "").
    Concatenating every push and a final `finish` equals decoding the prompt's ids and the generated
    ones at once, less the prompt's text.

    It decodes a short window: the ids since the last emitted text, plus the ids that produced that
    text as left context (the decoder may render a token differently at the start of a string: a
    SentencePiece decoder drops the first token's leading space). Before the first text, the
    context is the prompt's last few ids, as in vLLM, so the first word keeps its space.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # From the end: a long prompt is not scanned whole for each choice.
        kept = (token for token in reversed(prompt_ids) if not self._skipped(token))
        context = list(itertools.islice(kept, PROMPT_CONTEXT_TOKENS))
        context.reverse()
        # A window that begins inside a character starts at the next one. Byte-fallback pieces
        # (SentencePiece's <0xF0>...) of a broken run decode as one U+FFFD per byte, whole
        # characters after them too, which the check below would take for a broken end.
        while context and self._decode(context).startswith(REPLACEMENT_CHAR):
            del context[0]
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # a prompt that ends inside a character: its text cannot be a prefix
        self._window: list[int] = context  # context ids, then ids not yet emitted
        self._context_length = len(context)  # how many leading ids of the window were already emitted

    def push(self, token_id: int) -> str:
        if self._skipped(token_id):
            return ""  # no text, now or in context: kept out of the window, which would only grow
        self._window.append(token_id)
        text, context_text = self._decode_window()
        if text.endswith(REPLACEMENT_CHAR):  # maybe a multi-byte character still incomplete
            return self._release_final_part(text, context_text)
        if len(text) <= len(context_text):
            return ""  # nothing visible yet
        return self._emit(len(self._window), text, context_text)

    def _decode_window(self) -> tuple[str, str]:
        """The window's text and its context's. Where the decoder merged the context into a broken
        byte run (ByteFallback renders every byte of a run that is not UTF-8 as U+FFFD, the bytes of
        the context's whole characters too), the text no longer begins with the context's, which
        was already emitted: the context is dropped and the new ids decode alone."""
        context_text = self._decode(self._window[: self._context_length])
        text = self._decode(self._window)
        if not text.startswith(context_text):
            self._window, self._context_length = self._window[self._context_length :], 0
            return self._decode(self._window), ""
        return text, context_text

    def _emit(self, end: int, text: str, context_text: str) -> str:
        """Returns `text` (the decoding of the window's first `end` ids) past the context's, and makes
        the ids that produced it the next context."""
        self._window = self._window[self._context_length :]
        self._context_length = end - self._context_length
        return text[len(context_text) :]

    def _release_final_part(self, text: str, context_text: str) -> str:
        """`text` ends in U+FFFD: holds back the ids that may still complete a character, and emits the
        longest part before them that can no longer change, if any. Without this, a run of bytes that
        never form a character (a lone continuation byte, say, as random or broken weights sample)
        would be held to the end of the stream, every push decoding the whole run again."""
        last = max(self._context_length, len(self._window) - RELEASE_CANDIDATES)
        for end in range(len(self._window) - 1, last, -1):
            prefix = self._decode(self._window[:end])
            # final: a prefix of the text that either ends on a whole character or lies before the
            # ids an incomplete character can span
            final = text.startswith(prefix) and (
                not prefix.endswith(REPLACEMENT_CHAR) or end <= len(self._window) - INCOMPLETE_CHARACTER_TOKENS)
            if final:
                return self._emit(end, prefix, context_text) if len(prefix) > len(context_text) else ""
        return ""

    def finish(self) -> str:
        """Whatever is still held back at the end of the stream (an incomplete UTF-8 sequence
        shows as U+FFFD, as in a full decode)."""
        text, context_text = self._decode_window()
        remainder = text[len(context_text) :]
        self._window, self._context_length = [], 0
        return remainder

    def _skipped(self, token_id: int) -> bool:
        return self._skip_special_tokens and token_id in self._tokenizer.special_ids

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    templates; rendering a prompt keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _reading_specials_as_text(backend: BackendTokenizer) -> tuple[BackendTokenizer, BackendTokenizer]:
    """Copies of `backend` that read its special tokens as plain text, for encode_chat's stretches of
    text that hold a spelling (each about the size of tokenizer.json in memory: 57 MB for a vocabulary
    of 128k): one for the stretch that starts the prompt, and one for the others. They differ only
    where a Metaspace pre-tokenizer prepends its replacement character to the start of a text alone
    (SentencePiece's "first"): the tokenizer does not prepend it to text after a special token, but a
    stretch encoded alone starts a text. Where there is no such pre-tokenizer, one copy serves both."""
    tokenizer_json = backend.to_str()  # megabytes for a large vocabulary: serialized once
    config = json.loads(tokenizer_json)
    stack, first = [config.get("pre_tokenizer")], False
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"], first = "never", True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    starting = _reading_special_tokens_as_text(tokenizer_json)
    return starting, _reading_special_tokens_as_text(json.dumps(config)) if first else starting


def _reading_special_tokens_as_text(tokenizer_json: str) -> BackendTokenizer:
    tokenizer = BackendTokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def spelling_pattern(words: set[str]) -> str:
    """A regex that finds `words` in text, the longest where one starts another (as the tokenizers
    library finds added tokens), written as a trie: a plain alternation of Llama 3's 256 special
    tokens, which all start with "<|", tries each of them at every "<|", and held the event loop
    0.8 s over 4 MB of "<|" (the trie: 0.04 s)."""
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for character in word:
            node = node.setdefault(character, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict[str, dict]) -> str:
        branches = [re.escape(character) + pattern(child) for character, child in sorted(node.items()) if character]
        if not branches:
            return ""
        if "" not in node:
            return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{'|'.join(branches)})?"  # greedy: the longer word first, this one if it fails

    return pattern(trie)


def _compile_chat_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The template text: chat_template.jinja if present (newer exports), else tokenizer_config's
    `chat_template`, a string or a list of named templates of which "default" is used."""
    if (path / CHAT_TEMPLATE_FILE).is_file():
        return (path / CHAT_TEMPLATE_FILE).read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        if not all(isinstance(entry, dict) and {"name", "template"} <= entry.keys() for entry in template):
            raise ChatTemplateError(f"{TOKENIZER_CONFIG_FILE}: a list of chat templates needs a name and a "
                                    "template in each entry")
        named = {entry["name"]: entry["template"] for entry in template}
        if DEFAULT_TEMPLATE_NAME not in named:
            raise ChatTemplateError(f"{TOKENIZER_CONFIG_FILE} has chat templates {sorted(named)} but no 'default'")
        template = named[DEFAULT_TEMPLATE_NAME]
    return template


def _token_text(value: str | dict[str, Any]) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return value["content"] if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
