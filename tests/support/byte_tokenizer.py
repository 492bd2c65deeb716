"""A real HFTokenizer over a byte-level BPE with no merges (one token per byte) and the
ChatML specials, around a chat template of the test's own: template rendering checked
without model files."""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from adapters.hf_tokenizer.tokenizer import HFTokenizer


def byte_level_tokenizer(template: str) -> HFTokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rust = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    return HFTokenizer(
        rust,
        eos_token_ids=frozenset({rust.token_to_id("<|im_end|>")}),
        chat_template=template,
        special_tokens={"eos_token": "<|im_end|>"},
    )
