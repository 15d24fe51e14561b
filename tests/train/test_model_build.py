"""Models built at once in several threads of one process (an engine loading weights in its thread while a
trainer loads a checkpoint, two engines in one process) each keep their tied embeddings, and so do the models
built after them.

transformers' from_pretrained replaces ``PreTrainedModel.tie_weights`` with a no-op while it builds and puts
the original back at its end; two builds overlapping put back each other's replacement, and the one that ends
last could leave the no-op for the rest of the process (clawpipe/modelbuild.py). Each build here is slowed
inside that window so that they overlap whenever they are let to.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from clawpipe.serving.policy import load_model
from clawpipe.train.checkpoint import load_policy


def _tied_folder(path: Path) -> Path:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def _tied(model: Any) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_models_built_at_once_in_threads_keep_their_tied_embeddings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _tied_folder(tmp_path / "tied")
    original_tie = PreTrainedModel.__dict__["tie_weights"]
    init = Qwen2ForCausalLM.__init__

    def slow_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        time.sleep(0.05)  # inside from_pretrained's window: builds let to overlap do

    monkeypatch.setattr(Qwen2ForCausalLM, "__init__", slow_init)
    built: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        try:
            start.wait()
            for i in range(3):
                if (k + i) % 2:
                    built.append(load_model(folder, device="cpu"))
                else:
                    built.append(load_policy(folder).model)
        except BaseException as exc:  # reported below: a thread's exception is lost otherwise
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(built) == 12
    assert PreTrainedModel.__dict__["tie_weights"] is original_tie  # not left swapped out
    assert all(_tied(m) for m in built)
    assert _tied(load_policy(folder).model)  # and a model built after them ties too
