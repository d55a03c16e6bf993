"""A trained reward model (``posttrain rm``) put to use: ``RewardModel`` scores token ids, or prompts with their
completions rendered as its training pairs were (the one chat-template module), reading each sequence's score at
its last non-pad token (``score_position``, the rule transformers' ...ForSequenceClassification applies). What
``megapipe serve`` answers on ``/pooling`` and what ``posttrain rl --reward-model`` adds to the rule rewards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from megapipe.data.chat_template import OWN
from megapipe.data.preference import score_position
from megapipe.data.sft import ChatEncoder, Example
from megapipe.errors import ConfigError, DataError

MANIFEST_KEY = "reward_model"


def is_reward_model(cfg) -> bool:
    return cfg.num_labels == 1


class RewardModel:
    """``loaded``: megapipe.checkpoint.load.LoadedModel of the reward model checkpoint ``path``."""

    def __init__(self, loaded, path, batch_size: int = 16):
        cfg = loaded.model.cfg
        if not is_reward_model(cfg):
            raise ConfigError(f"{path} is not a reward model (model.num_labels = {cfg.num_labels}, not 1): train one "
                              "with megapipe posttrain rm")
        if loaded.tokenizer_dir is None:
            raise ConfigError(f"{path} holds no tokenizer: a reward model scores text with its own")
        self.model, self.path, self.batch_size = loaded.model, path, batch_size
        self.tokenizer = loaded.tokenizer
        info = (loaded.manifest or {}).get(MANIFEST_KEY) or {}
        self.pad_id = int(info.get("pad_id", self.tokenizer.pad_id))
        template = info.get("chat_template")
        self.encoder = ChatEncoder(loaded.tokenizer_dir, None if template in (None, "none", OWN) else template)

    @classmethod
    def load(cls, path: str | Path, device="cpu", dtype: Optional[torch.dtype] = None) -> "RewardModel":
        from megapipe.checkpoint.load import load_model

        return cls(load_model(str(Path(path).expanduser()), device, dtype), path)

    @torch.no_grad()
    def score_ids(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence (batched, right-padded with the pad token)."""
        out: list[float] = []
        device = next(self.model.parameters()).device
        for lo in range(0, len(sequences), self.batch_size):
            chunk = [np.asarray(s, dtype=np.int64) for s in sequences[lo: lo + self.batch_size]]
            if any(len(s) == 0 for s in chunk):
                raise ValueError("a reward model cannot score an empty sequence")
            rows = np.full((len(chunk), max(map(len, chunk))), self.pad_id, dtype=np.int64)
            for i, s in enumerate(chunk):
                rows[i, :len(s)] = s
            at = [score_position(s, self.pad_id) for s in chunk]
            scores = self.model(torch.from_numpy(rows).to(device))
            out += scores[torch.arange(len(chunk)), torch.tensor(at), 0].float().tolist()
        return out

    def encode(self, prompt, completion: str) -> np.ndarray:
        """A prompt (a string, or chat messages) and its completion as the reward model's training pairs render."""
        if isinstance(prompt, str):
            return self.encoder.encode(Example("pair", "reward model", prompt=prompt, completion=completion))[0]
        return self.encode_messages([*prompt, {"role": "assistant", "content": completion}])

    def encode_messages(self, messages: list[dict]) -> np.ndarray:
        """A conversation ending with the assistant's answer, rendered as the training pairs were."""
        if not messages or messages[-1].get("role") != "assistant":
            raise DataError("the conversation must end with the assistant's answer the reward model scores")
        trained = [m.get("role") == "assistant" for m in messages]
        return self.encoder.encode(Example("chat", "reward model", list(messages), trained))[0]

    def score(self, prompts: Sequence, completions: Sequence[str]) -> list[float]:
        return self.score_ids([self.encode(p, c) for p, c in zip(prompts, completions, strict=True)])

    def __call__(self, prompts, completions, **fields) -> list[float]:
        """TRL's reward function signature (megapipe.posttrain.rl.rewards)."""
        return self.score(prompts, completions)
