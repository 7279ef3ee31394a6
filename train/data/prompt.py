"""The language side of N1.6's input: the task string through Eagle's chat template, with the image
tokens where the images go, tokenized and left-padded into one table per run.

The text N1.6's processor builds for a sample with V images of n tokens each (Isaac-GR00T's
Gr00tN1d6Processor + Eagle3_VLProcessor; the task lower-cased and stripped of punctuation first,
its `formalize_language`):

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n{task}
    <image 1><img><IMG_CONTEXT> x n</img> ... <image V><img><IMG_CONTEXT> x n</img><|im_end|>\\n

Two tokenizers: the checkpoint's own (Qwen3's, loaded by transformers from local files only: the
directory given with --tokenizer or --init-from; never a download), or, for models trained from
scratch without one, bytes: ids 0-255 are the UTF-8 bytes and the template's special tokens
follow (`BYTE_VOCAB` ids). `--tokenizer bytes` on a checkpoint with a larger vocabulary (a reduced
test checkpoint) puts the special tokens at the checkpoint's own ids instead: <IMG_CONTEXT> at its
image token, <img>, </img>, <|endoftext|>, <|im_start|>, <|im_end|> right after it (Isaac-GR00T's
reduced reference fixture numbers them so). Every task of a dataset is known before training starts, so the prompts
are built once, here, into a (tasks, L) table; a decode worker copies a row per sample.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import ConfigError

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
END = "<|im_end|>\n"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>")
BYTE_VOCAB = 256 + len(SPECIALS)  # the byte tokenizer's vocabulary (the reduced recipes' text.vocab_size)
BYTE_IMAGE_TOKEN = 256 + SPECIALS.index("<IMG_CONTEXT>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def formalize(task: str) -> str:
    """N1.6's formalize_language: lower case, punctuation removed."""
    return re.sub(r"[^\w\s]", "", task.lower())


def chat_text(task: str, images: int, tokens_per_image: int) -> str:
    image = "<img>" + "<IMG_CONTEXT>" * tokens_per_image + "</img>"
    return SYSTEM + task + "".join(f"<image {i + 1}>{image}" for i in range(images)) + END


class ByteTokenizer:
    """UTF-8 bytes + the template's special tokens (ids 256.., or from `image_token_id` on)."""

    name = "bytes"
    _special = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
    _AFTER_IMAGE = ("<IMG_CONTEXT>", "<img>", "</img>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, image_token_id: int | None = None):
        if image_token_id is None or image_token_id == BYTE_IMAGE_TOKEN:
            self.ids = {s: 256 + i for i, s in enumerate(SPECIALS)}
        else:
            if image_token_id < 256:
                raise ConfigError(f"tokenizer bytes: the model's image token {image_token_id} is a byte")
            self.ids = {s: image_token_id + i for i, s in enumerate(self._AFTER_IMAGE)}
        self.image_token_id, self.pad_token_id = self.ids["<IMG_CONTEXT>"], self.ids["<|endoftext|>"]

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part in self._special.split(text):
            if part in SPECIALS:
                out.append(self.ids[part])
            elif part:
                out.extend(part.encode("utf-8"))
        return out


class HFTokenizer:
    """A transformers tokenizer from a local directory (Qwen3's for the released N1.6)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # heavy: only runs that bring a tokenizer load it

        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tokenizer: cannot load one from {path} ({str(exc).splitlines()[0]}); give the "
                              "directory holding tokenizer.json or vocab.json + merges.txt (Isaac-GR00T ships "
                              "them in gr00t/model/modules/nvidia/Eagle-Block2A-2B-v2)") from None
        self.name = f"transformers:{path}"
        self.image_token_id = self.tok.convert_tokens_to_ids("<IMG_CONTEXT>")
        if self.image_token_id is None or self.image_token_id == self.tok.unk_token_id:
            raise ConfigError(f"tokenizer at {path}: no <IMG_CONTEXT> token: not Eagle's tokenizer")
        pad = self.tok.convert_tokens_to_ids("<|endoftext|>")
        self.pad_token_id = pad if pad is not None else (self.tok.pad_token_id or 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


def has_tokenizer(path: str | None) -> bool:
    return bool(path) and path != "bytes" and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_tokenizer(path: str | None, image_token_id: int | None = None):
    """The tokenizer of a directory; bytes when none is given, or "bytes" (special tokens at the model's
    `image_token_id` when given)."""
    if path is None or path == "bytes":
        return ByteTokenizer(image_token_id if path == "bytes" else None)
    if not has_tokenizer(path):
        raise ConfigError(f"tokenizer: {path} holds none of {', '.join(TOKENIZER_FILES)}")
    return HFTokenizer(path)


@dataclass(frozen=True)
class PromptTable:
    """Row r = the prompt of task index `task_ids[r]`; the last row is the prompt of an unknown
    task (empty text). ids (R, L) left-padded, mask (R, L) True for real tokens."""

    task_ids: np.ndarray  # (R - 1,) dataset task indices
    ids: np.ndarray
    mask: np.ndarray
    image_token_id: int
    texts: tuple[str, ...] = ()  # the tasks' text as the dataset has it, in task_ids' order

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def row(self, task_index: int | None) -> int:
        if task_index is None:
            return len(self.ids) - 1
        hit = np.flatnonzero(self.task_ids == int(task_index))
        return int(hit[0]) if len(hit) else len(self.ids) - 1

    def row_of_text(self, text: str) -> int:
        """The row of a task given by its text (a loader that reads the text, not the index)."""
        return self.texts.index(text) if text in self.texts else len(self.ids) - 1


def build_prompts(tokenizer, tasks: dict, *, images: int, tokens_per_image: int,
                  vocab_size: int | None = None) -> PromptTable:
    """{task index: text} -> PromptTable, every task through the template, left-padded to the longest."""
    keys = sorted(tasks, key=lambda k: int(k))
    texts = [formalize(str(tasks[k])) for k in keys] + [""]
    rows = [tokenizer.encode(chat_text(t, images, tokens_per_image)) for t in texts]
    want = images * tokens_per_image
    for t, r in zip(texts, rows):
        got = sum(1 for i in r if i == tokenizer.image_token_id)
        if got != want:
            raise ConfigError(f"tokenizer {tokenizer.name}: the prompt of task {t!r} has {got} image tokens, "
                              f"{want} expected (<IMG_CONTEXT> is not one token?)")
        if vocab_size is not None and max(r) >= vocab_size:
            raise ConfigError(f"tokenizer {tokenizer.name}: token id {max(r)} >= the model's vocabulary "
                              f"({vocab_size}); the tokenizer and the model do not belong together")
    n = max(len(r) for r in rows)
    ids = np.full((len(rows), n), tokenizer.pad_token_id, np.int64)
    mask = np.zeros((len(rows), n), bool)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = r  # the collator pads on the left
        mask[i, n - len(r):] = True
    return PromptTable(np.asarray([int(k) for k in keys], np.int64), ids, mask, int(tokenizer.image_token_id),
                       tuple(str(tasks[k]) for k in keys))
