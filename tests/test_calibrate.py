"""Layer-by-layer activation calibration (fp4convert.calibrate)."""

from __future__ import annotations

from pathlib import Path


def add_tokenizer(path: Path) -> Path:
    """A character-level tokenizer (ids below the zoo's vocab of 128) saved beside a zoo checkpoint."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return Path(path)
