"""A byte-level tokenizer with a few special tokens and a chat template, shipped with the project.

Ids 0-255 are bytes; 256 and up are specials. Generation is restricted to
printable ASCII, newline and end-of-text, so outputs of the seeded model are
readable text (of no meaning) and stream as whole characters.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

BOS, EOS, SYSTEM, USER, ASSISTANT, END = range(256, 262)
SPECIALS = {
    "<|bos|>": BOS,
    "<|eos|>": EOS,
    "<|system|>": SYSTEM,
    "<|user|>": USER,
    "<|assistant|>": ASSISTANT,
    "<|end|>": END,
}
VOCAB_SIZE = 262
TOKENIZER_ID = "kvgate-byte-v1"
GENERATABLE = [10, *range(32, 127), EOS]


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class ByteTokenizer:
    id = TOKENIZER_ID
    vocab_size = VOCAB_SIZE
    eos_id = EOS

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Text as UTF-8 bytes (special-token strings in the text are plain bytes, never specials)."""
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        """<|bos|> then <|role|>content<|end|> per message, then <|assistant|> to prompt the reply."""
        ids = [BOS]
        for message in messages:
            ids.append({"system": SYSTEM, "user": USER, "assistant": ASSISTANT}[message.role])
            ids.extend(message.content.encode("utf-8"))
            ids.append(END)
        ids.append(ASSISTANT)
        return ids

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder()


class StreamDecoder:
    """Turns generated ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id])) if token_id < 256 else ""

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
