"""Local text into training rows that never mix documents.

:func:`load_documents` reads the documents; :func:`tokenize_rows` cuts each document into rows of
``seq_len`` tokens (a document longer than a row continues in the next row; its last, shorter row is
padded on the right). A row holds tokens of exactly one document, so no packed row, restarting
``position_ids`` or cross-document attention can occur (the adapters refuse packed rows anyway).
:class:`ShiftedRows` moves the rows' boundaries every epoch (``data.shift_windows``).
:func:`split_sentences` and :func:`texts_in_unit` turn documents into sentences, one row each (the ``sentences``
unit of ``data.train_unit`` / ``data.eval_unit``).
The ``datasets`` package is not needed.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import torch

from hf_attention_backends.models import news_articles


class ByteTokenizer:
    """UTF-8 bytes as tokens (id = byte + 3); 0 = pad, 1 = bos, 2 = eos. For tiny random models."""
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + [b + 3 for b in text.encode("utf-8")]

    def save_pretrained(self, path) -> None:
        """Nothing to save: the byte tokenizer has no state."""


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of one document with the tokenizer's special tokens (BOS/CLS...)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def load_documents(source: str, count: int, *, min_chars: int = 0, text_field: str = "text") -> list[str]:
    """``count`` documents of at least ``min_chars`` characters from a local source, in a fixed order.

    source: "news" (BBC articles, ``hf_attention_backends.models.news_articles``: evenly spaced over the
    corpus), a ``.jsonl`` file (one JSON object per line, text under ``text_field``), a ``.txt`` file (one
    document per non-empty line) or a folder (each ``*.txt`` file, sorted, is one document). For files the
    first ``count`` qualifying documents are taken. ValueError if fewer exist.
    """
    if source == "news":
        return news_articles(count, min_chars=min_chars)
    path = Path(source)
    if path.is_dir():
        docs = [p.read_text(encoding="utf-8", errors="replace").strip() for p in sorted(path.glob("*.txt"))]
    elif path.is_file() and path.suffix == ".jsonl":
        docs = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise ValueError(f"{path}:{line_no} has no string field text_field={text_field!r}")
                docs.append(record[text_field].strip())
    elif path.is_file() and path.suffix == ".txt":
        docs = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    else:
        raise ValueError(f"data source={source!r} is not supported; supported: 'news', a .jsonl or .txt file, "
                         "or a folder of .txt files")
    docs = [d for d in docs if d and len(d) >= min_chars]
    if len(docs) < count:
        raise ValueError(f"data source={source!r} has {len(docs)} documents of >= {min_chars} chars; "
                         f"{count} requested")
    return docs[:count]


def tokenize_rows(documents: Sequence[str], tokenizer, seq_len: int, *, min_tokens: int = 2) -> dict:
    """Rows of ``seq_len`` tokens, each from one document, right-padded.

    Returns ``input_ids`` (R, seq_len) long, ``attention_mask`` (R, seq_len) long (1 = real token),
    ``labels`` (input_ids with -100 at padding) and ``doc_index`` (R,) long: the document of each row.
    Rows with fewer than ``min_tokens`` real tokens (a document's short tail) are dropped.
    """
    return rows_from_tokens([encode(tokenizer, text) for text in documents], _pad_id(tokenizer), seq_len,
                            min_tokens=min_tokens)


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad_token_id; set one (e.g. the eos token)")
    return tokenizer.pad_token_id


def row_starts(length: int, seq_len: int, *, min_tokens: int = 2, shift: int = 0) -> list[int]:
    """Start positions of the rows of a document of ``length`` tokens: 0, then every ``seq_len`` tokens, less
    ``shift`` (0 <= shift < seq_len) after the first row. The count does not depend on ``shift`` (the rows of
    ``shift`` 0 that hold at least ``min_tokens`` tokens); a shift makes the second and later rows overlap the
    first by ``shift`` tokens and leaves out up to ``shift`` tokens at the document's end."""
    count = sum(1 for start in range(0, length, seq_len) if length - start >= min_tokens)
    return [0 if k == 0 else k * seq_len - shift for k in range(count)]


def rows_from_tokens(doc_tokens: Sequence[Sequence[int]], pad: int, seq_len: int, *, min_tokens: int = 2,
                     shifts: Sequence[int] | None = None) -> dict:
    """:func:`tokenize_rows` from token ids; ``shifts``: per document, the ``shift`` of :func:`row_starts`
    (None: 0 for every document)."""
    ids, masks, doc_index = [], [], []
    for d, tokens in enumerate(doc_tokens):
        for start in row_starts(len(tokens), seq_len, min_tokens=min_tokens, shift=shifts[d] if shifts else 0):
            chunk = list(tokens[start:start + seq_len])
            ids.append(chunk + [pad] * (seq_len - len(chunk)))
            masks.append([1] * len(chunk) + [0] * (seq_len - len(chunk)))
            doc_index.append(d)
    if not ids:
        raise ValueError(f"no row of >= {min_tokens} tokens from {len(doc_tokens)} documents")
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(masks, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100),
            "doc_index": torch.tensor(doc_index, dtype=torch.long)}


class RowDataset(torch.utils.data.Dataset):
    """The rows of :func:`tokenize_rows` as a map-style dataset of dicts (``doc_index`` left out)."""

    def __init__(self, rows: dict):
        self.rows = {k: v for k, v in rows.items() if k != "doc_index"}

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.rows.items()}


class ShiftedRows(RowDataset):
    """The rows of :func:`tokenize_rows` whose boundaries move every epoch (``data.shift_windows``): at epoch e > 0
    each document's rows after its first start ``shift`` tokens earlier (:func:`row_starts`), with ``shift`` drawn
    per document from ``torch.Generator().manual_seed(seed + epoch)``; epoch 0 is :func:`tokenize_rows`' rows. The
    number of rows and each row's document stay fixed, so the sampler, the data position of a checkpoint and the
    processes' shards are those of a :class:`RowDataset`; the rows depend on ``(seed, epoch)`` only. A small
    corpus repeated over many epochs then shows the model other contexts for the same tokens."""

    def __init__(self, documents: Sequence[str], tokenizer, seq_len: int, seed: int):
        self.tokens = [encode(tokenizer, text) for text in documents]
        self.pad, self.seq_len, self.seed, self.epoch = _pad_id(tokenizer), seq_len, seed, 0
        super().__init__(rows_from_tokens(self.tokens, self.pad, seq_len))

    def set_epoch(self, epoch: int) -> None:
        """The rows of ``epoch`` (called by ``finetune.train.run_stage`` before each pass over the data)."""
        if epoch == self.epoch:
            return
        shifts = None
        if epoch > 0:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            shifts = torch.randint(0, self.seq_len, (len(self.tokens),), generator=generator).tolist()
        super().__init__(rows_from_tokens(self.tokens, self.pad, self.seq_len, shifts=shifts))
        self.epoch = epoch


_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')]))\s+(?=[\"'(]?[A-Z0-9£$€])")


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text``: paragraphs (blank lines) cut after ``.``, ``!`` or ``?`` (and a closing quote or
    bracket) followed by whitespace and a capital letter, digit or currency sign. A heuristic (an abbreviation
    such as "U.S. Army" also ends a sentence); empty pieces are dropped."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        sentences.extend(piece.strip() for piece in _SENTENCE_END.split(paragraph.replace("\n", " ")))
    return [x for x in sentences if x]


def texts_in_unit(documents: Sequence[str], unit: str) -> list[str]:
    """The texts cut into rows for ``unit``: the documents themselves (``rows``) or their sentences in order
    (``sentences``)."""
    if unit == "rows":
        return list(documents)
    if unit == "sentences":
        return [x for doc in documents for x in split_sentences(doc)]
    raise ValueError(f"unit={unit!r} is not supported; supported: rows, sentences")


def split_documents(documents: Sequence[str], eval_count: int) -> tuple[list[str], list[str]]:
    """(train, held-out): every k-th document is held out (k = len // eval_count), so both span the corpus."""
    if not 0 < eval_count < len(documents):
        raise ValueError(f"eval_documents={eval_count} must be in 1..{len(documents) - 1} for {len(documents)} "
                         "documents")
    step = len(documents) // eval_count
    held = set(range(step - 1, step * eval_count, step))
    return ([d for i, d in enumerate(documents) if i not in held], [d for i, d in enumerate(documents) if i in held])
