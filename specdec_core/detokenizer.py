"""Incremental detokenization (the vLLM scheme): each call decodes a short window of recent tokens
instead of the whole output, so streaming text costs O(1) per step rather than O(length).

The window starts a few tokens back (``prefix_offset``) so that tokenizers whose decoding of a
token depends on its left neighbour (leading spaces, multi-byte characters split across tokens)
render the new text exactly as a full decode would; a trailing U+FFFD (an incomplete UTF-8
character) is held back until the rest of its bytes arrive.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokenizerState:
    prefix_offset: int = 0
    read_offset: int = 0


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokenizerState) -> str:
    """Return the text that ``token_ids[state.read_offset:]`` adds, and advance ``state``."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        return full[len(prefix) :]
    return ""
