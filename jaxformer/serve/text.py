"""Tokens in, text out, a step at a time: the deltas a stream sends and where a stop string ends it.

:class:`TextStream` turns a request's generated tokens into text as they arrive. Every delta is a piece of
one text, the tokens so far decoded after the prompt's last few
(:func:`~jaxformer.decode.prompts.decode_completion`: ``decode(tokens so far)`` but for the space a
SentencePiece decoder drops at the start of what it decodes; computed incrementally: each token decodes the few
tokens since the last complete character), so the deltas of a stream concatenate to exactly what the whole
answer decodes to after its prompt; two things are held back until the next tokens decide them:

- an incomplete UTF-8 character: a byte-level tokenizer (GPT-2's BPE, raw bytes) may spend several tokens
  on one character, and the tokens so far decode with a trailing U+FFFD (the replacement character) that
  the next byte turns into the real one. Trailing U+FFFD are held back until a later character follows
  them (then they were real) or the request ends;
- the start of a stop string: text that could still become one of ``stop`` is held back, because a stop
  string, and everything after it, is never returned.

Stop strings are matched on the decoded text, not on tokens, so a stop string split over several tokens
(or in the middle of one) still stops the request; the text returned ends just before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxformer.decode.prompts import decode_completion

REPLACEMENT = "\ufffd"


class IncrementalDecode:
    """``decode(ids so far)`` after each appended token, decoding only the tokens since the last complete
    character (and those of the step before): ``ids[:read]`` decode to ``fixed`` (no incomplete character at
    its end), and a new token's text is ``decode(ids[prefix:])`` past ``decode(ids[prefix:read])``, where
    ``ids[prefix:read]`` decode to some text (or ``prefix`` is 0). A tokenizer whose two decodes do not nest
    falls back to decoding everything.

    ``context``: tokens before the appended ones (the prompt's last few,
    :func:`~jaxformer.decode.prompts.completion_context`), decoded with them and cut from the text, as
    :func:`~jaxformer.decode.prompts.decode_completion` does; without them a SentencePiece decoder drops the
    first appended word's space."""

    def __init__(self, decode, context: Sequence[int] = ()):
        self._decode = decode
        self._context = [int(t) for t in context]
        self._head = decode(self._context) if self._context else ""
        self.ids: list[int] = list(self._context)
        self._prefix, self._read, self._fixed = 0, len(self.ids), self._head

    def push(self, token: int) -> str:
        """Append ``token``; the whole text of the appended tokens so far (the context's cut off)."""
        self.ids.append(int(token))
        head = self._decode(self.ids[self._prefix:self._read])
        tail = self._decode(self.ids[self._prefix:])
        full = self._fixed + tail[len(head):] if tail.startswith(head) else self._decode(self.ids)
        if not full.endswith(REPLACEMENT):
            # the next prefix must decode to some text (or be the start): a decoder that strips the text's
            # first space (SentencePiece) strips the same character from head and tail only then
            if self._read and self._decode(self.ids[self._read:]):
                self._prefix = self._read
            self._read, self._fixed = len(self.ids), full
        if full.startswith(self._head):
            return full[len(self._head):]
        return decode_completion(self._decode, self._context, self.ids[len(self._context):])


def prefix_lengths(decode, tokens: Sequence[int], context: Sequence[int] = ()) -> list[int]:
    """``[len(decode_completion(decode, context, tokens[:k])) for k in range(len(tokens))]`` in one incremental
    pass."""
    d, out, full = IncrementalDecode(decode, context), [], ""
    for t in tokens:
        out.append(len(full))
        full = d.push(t)
    return out


class TextStream:
    """Incremental detokenization of one request (see the module docstring).

    Args:
      decode: ``ids -> str`` (the tokenizer's ``decode``: special tokens left out).
      stop: stop strings (empty strings are ignored).
      skip: token ids never decoded (the request's stop tokens: EOS is not text).
      context: the prompt's last tokens, which the text is decoded after (:class:`IncrementalDecode`).
    """

    def __init__(self, decode, stop: Sequence[str] = (), skip: Iterable[int] = (), context: Sequence[int] = ()):
        self.stop = tuple(s for s in stop if s)
        self._skip = frozenset(int(t) for t in skip)
        self._text = IncrementalDecode(decode, context)
        self._full = ""  # the tokens so far decoded after the context (decode_completion)
        self.text = ""  # what has been emitted so far
        self.num_tokens = 0  # tokens consumed: up to and including the one that completed a stop string
        self.stopped = False  # a stop string matched; later tokens are ignored

    def add(self, tokens: Iterable[int]) -> str:
        """Consume newly generated tokens; return the text that is now certain (maybe empty)."""
        out = []
        for t in tokens:
            if self.stopped:
                break
            self.num_tokens += 1
            if int(t) in self._skip:
                continue
            self._full = self._text.push(t)
            out.append(self._advance(final=False))
        return "".join(out)

    def finish(self) -> str:
        """The request ended (not on a stop string): the text held back so far, which is now certain."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        full = self._full
        start = len(self.text)
        cut = self._stop_at(full, start)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut])
        end = len(full)
        if not final:
            while end > start and full[end - 1] == REPLACEMENT:
                end -= 1
            end -= self._stop_prefix(full[start:end])
        return self._emit(full[:end])

    def _emit(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text += delta
        return delta

    def _stop_at(self, full: str, start: int) -> int | None:
        """Where the first stop string in ``full`` begins (None: none). The emitted text holds no stop string,
        so one can only end past ``start``."""
        hits = [i for s in self.stop if (i := full.find(s, max(0, start - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def _stop_prefix(self, tail: str) -> int:
        """Length of the longest end of ``tail`` that begins some stop string (and could still become it)."""
        for k in range(min(len(tail), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0
