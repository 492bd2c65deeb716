"""The Embedder port over our BERT encoder and the folder's ``tokenizer.json``."""

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from adapters.torch.embeddings.bert_loader import check_mean_pooling, load_bert, max_seq_length
from adapters.torch.models.bert import BertModel
from domain.errors import ModelLoadError

# Inputs per forward: sentence-transformers' default batch size.
FORWARD_BATCH = 32


class TorchEmbedder:
    """Mean-pooled, normalized embeddings in float32, as sentence-transformers computes
    them. ``embed`` sorts its inputs by length and runs them ``FORWARD_BATCH`` at a time, so
    inputs of similar lengths share a forward and little of it is padding."""

    def __init__(self, model: BertModel, tokenizer: Tokenizer, max_tokens: int) -> None:
        self.model, self.tokenizer, self._max_tokens = model, tokenizer, max_tokens
        self.device = model.embeddings.word.weight.device
        tokenizer.enable_truncation(max_tokens)
        tokenizer.no_padding()

    @classmethod
    def from_folder(cls, folder: Path, device: str | torch.device = "cpu") -> "TorchEmbedder":
        """A sentence-transformers folder: ``config.json``, ``model.safetensors``,
        ``tokenizer.json``, mean pooling in ``1_Pooling``."""
        check_mean_pooling(folder)
        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception type
            raise ModelLoadError(f"{folder}: cannot read tokenizer.json ({e})") from e
        model = load_bert(folder, device)
        return cls(model, tokenizer, max_seq_length(folder, model.config))

    @property
    def dimensions(self) -> int:
        return self.model.config.dim

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        vectors: list[list[float]] = [[] for _ in inputs]
        by_length = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        for start in range(0, len(by_length), FORWARD_BATCH):
            rows = by_length[start : start + FORWARD_BATCH]
            batch = self._forward([inputs[i] for i in rows]).tolist()
            for i, vector in zip(rows, batch, strict=True):
                vectors[i] = vector
        return vectors

    @torch.inference_mode()
    def _forward(self, inputs: Sequence[Sequence[int]]) -> Tensor:
        """``[B, D]`` on the CPU for B inputs, padded to the longest."""
        ids, mask = self._padded(inputs)
        return self.model.embed(ids, mask).cpu()

    def _padded(self, inputs: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """``ids`` ``[B, T]`` (0 after each input's end) and ``mask`` ``[B, T]`` bool."""
        longest = max(len(ids) for ids in inputs)
        ids = torch.zeros(len(inputs), longest, dtype=torch.long)
        mask = torch.zeros(len(inputs), longest, dtype=torch.bool)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = True
        return ids.to(self.device), mask.to(self.device)
