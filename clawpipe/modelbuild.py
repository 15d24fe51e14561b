"""One lock for building transformers models in this process (serving and training both take it).

While ``from_pretrained`` builds a model, transformers swaps process-wide state and puts it back when it is
done: ``PreTrainedModel.tie_weights`` becomes a no-op, torch's init functions are patched and torch's default
dtype is set. Two builds overlapping in one process (an engine loading new weights in its thread while a
trainer in another loads a checkpoint; two engines in one process) put back each other's replacements: the
second to finish can leave ``tie_weights`` a no-op for the rest of the process, after which a model with tied
embeddings loads with its output layer at random and a tied config counts its embeddings twice. Every model
clawpipe builds, from a folder or from a config, is built holding :data:`MODEL_BUILD` (re-entrant: a build may
check a folder first, which builds its config on the meta device).
"""

from __future__ import annotations

import threading

MODEL_BUILD = threading.RLock()
