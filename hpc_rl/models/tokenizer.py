"""A character-level tokenizer in Hugging Face format, built here (no hub download).

Tiny models learn arithmetic far more easily one character at a time, and a character
vocabulary needs no training data. Saved as tokenizer.json + tokenizer_config.json with a
chat template, so transformers' AutoTokenizer and vLLM load it like any checkpoint's.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL = [PAD, BOS, EOS, UNK, *ROLE_TOKENS]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # letters, digits, punctuation, space, \n

# One turn: <|role|>content<|end|>; generation continues after <|assistant|> and stops at <|end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(out_dir: Path):
    """Write the tokenizer to `out_dir` and return it (a PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    # BPE without merges splits any text into single characters; special tokens stay whole.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens(SPECIAL)
    core.decoder = decoders.Fuse()  # characters join back without separators
    # eos is the end of a turn: generation (HF generate, vLLM) must stop at <|end|>, not at </s>
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token="<|end|>", unk_token=UNK, pad_token=PAD,
                                  additional_special_tokens=ROLE_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "right"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok
