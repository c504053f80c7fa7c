"""The pretraining tokenizer as a Hugging Face tokenizer: exactly aoe-megatron's preprocessing.

A thin layer over the sentencepiece model (``tokenizer.model``): text is encoded by sentencepiece
as a whole, with no Hugging Face pre- or post-processing (no splitting on special-token strings,
no space clean-up), so ids equal ``aoe-preprocess``'s. ``prepend_bos`` follows the
training data's BOS policy (read from the preprocessing manifest at export); EOS is never added
(it separates documents in training, it does not end a prompt). Self-contained: it imports only
sentencepiece and transformers.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import sentencepiece as spm
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tokenizer.model"}


class AoETokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, prepend_bos: bool = False, **kwargs):
        self.vocab_file = vocab_file
        self.sp_model = spm.SentencePieceProcessor(model_file=vocab_file)
        # (transformers drops a saved "add_bos_token", hence a name of our own)
        self.prepend_bos = bool(prepend_bos)
        sp = self.sp_model

        def piece(i: int) -> Optional[str]:
            return sp.id_to_piece(i) if i >= 0 else None

        for name, idx in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                          ("unk_token", sp.unk_id()), ("pad_token", sp.pad_id())):
            kwargs.setdefault(name, piece(idx))
        # Text is never split on special-token strings: "<s>" in a text is three characters,
        # as in preprocessing.
        kwargs["split_special_tokens"] = True
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(prepend_bos=self.prepend_bos, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp_model.get_piece_size()

    def get_vocab(self) -> dict:
        vocab = {self.sp_model.id_to_piece(i): i for i in range(self.vocab_size)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list:
        return self.sp_model.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp_model.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list) -> str:
        return self.sp_model.decode_pieces(tokens)

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        """sentencepiece's decoding; special tokens as their text ("<s>") unless skipped."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        special = set(self.all_special_ids)
        pieces, run = [], []
        for i in ids:
            if i in special:
                if run:
                    pieces.append(self.sp_model.decode(run))
                    run = []
                if not skip_special_tokens:
                    pieces.append(self.convert_ids_to_tokens(i))
            else:
                run.append(i)
        if run:
            pieces.append(self.sp_model.decode(run))
        return "".join(pieces)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None) -> list:
        bos = [self.bos_token_id] if self.prepend_bos and self.bos_token_id is not None else []
        out = bos + list(token_ids_0)
        return out if token_ids_1 is None else out + bos + list(token_ids_1)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            special = set(self.all_special_ids)
            return [int(i in special) for i in token_ids_0]
        bos = [1] if self.prepend_bos and self.bos_token_id is not None else []
        mask = bos + [0] * len(token_ids_0)
        return mask if token_ids_1 is None else mask + bos + [0] * len(token_ids_1)

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> tuple:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            shutil.copyfile(self.vocab_file, out)
        return (out,)


__all__ = ["AoETokenizer"]
