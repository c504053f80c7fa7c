"""Train a Llama-style sentencepiece BPE: byte fallback, split digits, identity normalisation,
unk/bos/eos = 0/1/2 and the 256 byte pieces right after them (ids 3-258), no pad id."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from aoe_megatron.data.reader import SourceFile

LLAMA_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=True,
    allow_whitespace_only_pieces=True,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    character_coverage=0.99995,
    max_sentence_length=1 << 16,
    split_by_unicode_script=True,
    split_by_number=True,
    split_by_whitespace=True,
    treat_whitespace_as_suffix=False,
    minloglevel=2,
)


def iter_texts(paths: Iterable[str], json_key: str = "text") -> Iterator[str]:
    """Lines of .txt files, or the ``json_key`` field of .jsonl/.gz/.zst records (others skipped)."""
    for path in paths:
        if path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="replace") as fh:
                yield from (line.rstrip("\n") for line in fh if line.strip())
            continue
        for raw in SourceFile(path).lines():
            try:
                value = json.loads(raw).get(json_key)
            except (ValueError, AttributeError, UnicodeDecodeError):
                continue
            if isinstance(value, str) and value.strip():
                yield from (line for line in value.split("\n") if line.strip())


def train_tokenizer(inputs, output_prefix: str, *, vocab_size: int = 32000, json_key: str = "text",
                    input_sentence_size: int = 2_000_000, num_threads: int | None = None,
                    seed: int = 0) -> Path:
    """Train and write ``{output_prefix}.model`` / ``.vocab``; returns the model path.

    The same inputs and options give the same bytes on any machine (so the sha256 that data
    manifests, run records and resume checks compare names the tokenizer, not the machine that
    trained it): the sampling of lines beyond ``input_sentence_size`` is seeded, and the model's
    record of its training is rewritten to name ``inputs`` as given instead of the temporary file
    they were read through, without the thread count (the pieces do not depend on it)."""
    import sentencepiece as spm

    inputs = [str(path) for path in inputs]
    if vocab_size < 259 + 8:
        raise ValueError(f"vocab_size={vocab_size} is too small: 3 special + 256 byte pieces + merges")
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as tmp:
        lines = 0
        for line in iter_texts(inputs, json_key):
            tmp.write(line.replace("\r", " ") + "\n")
            lines += 1
    try:
        if lines == 0:
            raise ValueError(f"no text found in {list(inputs)}")
        spm.set_random_generator_seed(seed)
        spm.SentencePieceTrainer.train(
            input=tmp.name, model_prefix=str(output_prefix), vocab_size=vocab_size,
            input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
            num_threads=num_threads or os.cpu_count() or 1, **LLAMA_OPTIONS,
        )
    finally:
        os.unlink(tmp.name)
    model = Path(f"{output_prefix}.model")
    _record_inputs(model, inputs)
    return model


def _record_inputs(model: Path, inputs: list) -> None:
    """Name ``inputs`` in the model's trainer record and drop the thread count (see above).
    Needs protobuf, which tensorboard (a dependency) brings; without it the model is left as
    written, still a valid tokenizer."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing or too old: the model stays as sentencepiece wrote it
        return
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    proto.trainer_spec.ClearField("input")
    proto.trainer_spec.input.extend(inputs)
    proto.trainer_spec.ClearField("num_threads")
    model.write_bytes(proto.SerializeToString())
