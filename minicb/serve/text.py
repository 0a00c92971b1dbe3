"""From token ids to the text a client sees: incremental decoding and stop strings.

In this file you will learn two things a streaming server must do with text
that an offline `LLM.generate` never has to:

1. **Decode incrementally.** A token is not a piece of text on its own: with a
   byte-level BPE (SmolLM2's), one character can be split over two tokens, and
   decoding the first alone gives the replacement character U+FFFD. Decoding the
   whole list after every token is correct but costs O(n^2). So we decode a small
   window: the tokens already shown plus the new ones, and keep what the new ones
   added. While the window ends in half a character (U+FFFD), we wait for the
   next token.

2. **Stop strings.** The engine stops on token ids (SamplingParams.stop_token_ids),
   but a client asks for strings ("stop": ["\\n\\n"]), and a string can be spread
   over several tokens, or sit inside one. So the server watches the text: when a
   stop string appears, the text is cut just before it (OpenAI leaves it out) and
   the request is aborted in the engine. While streaming, text that could be the
   beginning of a stop string is held back until the next token shows whether it is.

`CompletionText` does both for one completion. It never calls the engine; the
caller (minicb/serve/request.py) aborts the request when `stopped_by` is set.
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


class CompletionText:
    """One completion's text as its tokens arrive.

        text = CompletionText(tokenizer.decode, stop=["\\n\\n"])
        for token in tokens:
            send(text.add(token))        # what may be shown now ("" while held back)
            if text.stopped_by: break    # a stop string appeared: abort the request
        send(text.finish())              # the rest, once the completion has ended

    decode: token ids -> str (special tokens skipped), or None for a model without
    a tokenizer: then the text stays "" and only token ids are served.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, stop: list[str] | None = None):
        self.decode = decode
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []  # every token taken, up to the one that completed a stop string
        self.text = ""  # decoded so far (complete characters only; cut before a stop string)
        self.sent = 0  # characters of `text` already handed out
        self.stopped_by: str | None = None  # the stop string that ended this completion
        # The decode window: tokens [prefix, read) are already text; [read, end) are not yet.
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """Take one token; return the text that can be shown now."""
        if self.stopped_by is not None:
            raise RuntimeError("this completion already ended at a stop string; abort the request")
        self.token_ids.append(token_id)
        if self.decode is None:
            return ""
        before = len(self.text)
        self.text += self._decode_new()
        if self.stop:
            self._find_stop(before)
        return self._release(final=self.stopped_by is not None)

    def finish(self) -> str:
        """The completion ended (EOS, max_tokens, a stop token): the held-back rest of the text.

        Anything the window still holds (a character never completed) is decoded
        as it is, as a full decode would, and stop strings get a last look.
        """
        if self.decode is not None and self.stopped_by is None and self._read < len(self.token_ids):
            before = len(self.text)
            self.text += self._window_text(final=True)
            self._prefix = self._read = len(self.token_ids)
            if self.stop:
                self._find_stop(before)
        return self._release(final=True)

    # ---- the two mechanisms --------------------------------------------------------

    def _window_text(self, final: bool = False) -> str:
        # Decode from `prefix`, not `read`: some tokenizers (SentencePiece's leading
        # space, for one) render a token differently at the start of a text.
        shown = self.decode(self.token_ids[self._prefix:self._read])
        window = self.decode(self.token_ids[self._prefix:])
        if not final and (window.endswith(REPLACEMENT) or len(window) <= len(shown)):
            return ""  # half a character, or a token with no text (a special token): wait
        return window[len(shown):]

    def _decode_new(self) -> str:
        new = self._window_text()
        if new:
            self._prefix, self._read = self._read, len(self.token_ids)
        return new

    def _find_stop(self, before: int) -> None:
        """Cut the text before the first stop string that ends in the new part of it."""
        first = None
        for s in self.stop:
            # A match must end after `before`, so it starts at most len(s) - 1 earlier.
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at != -1 and (first is None or at < first[0]):
                first = (at, s)
        if first is not None:
            self.text, self.stopped_by = self.text[:first[0]], first[1]

    def _release(self, final: bool) -> str:
        """Hand out the text not sent yet, less a tail that may be a stop string's beginning."""
        end = len(self.text)
        if not final and self.stop:
            end -= self._held_back()
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def _held_back(self) -> int:
        """The length of the longest end of the text that some stop string starts with."""
        longest = min(max(len(s) for s in self.stop) - 1, len(self.text))
        for k in range(longest, 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
