"""Training across processes: torch.distributed ranks, FSDP2-sharded policy, trees assigned to ranks.

A step with ``nproc > 1`` runs under torch.distributed's elastic launcher (clawpipe.train.launch); each
rank runs the same ``clawpipe train`` step, with these differences:

- every rank loads the same trees and builds the same batch (advantages and aggregation coefficients are
  computed over the WHOLE batch, so the loss normaliser is global by construction), then trains only on
  its share of trees: whole trees (a group lives on one rank) assigned by balanced packing of unique
  tokens (:func:`assign_trees`). A rank's loss is the sum of its contributions' terms with the global
  coefficients; gradients are SUMMED across ranks (FSDP's divide factor set to 1), so the update equals
  single-process training on the whole batch.
- the policy (and the PPO value head) are sharded with FSDP2 (``fully_shard``): one unit per decoder
  layer and a root unit over a :class:`Scorer` wrapper that holds the embeddings, the final norm, the LM
  head and the value head, so the root's parameters are gathered by the wrapper's own forward.
- FSDP gathers parameters in every forward, so all ranks must run the same number of forwards and
  backwards: a rank with fewer micro-batches runs padding micro-batches whose loss is multiplied by 0.
- PPO's advantage whitening needs every contribution's pre-step value: each rank fills its own and the
  arrays are summed across ranks.

NCCL on GPUs, gloo on CPU (tests). Checkpoints: sharded with torch.distributed.checkpoint under
``<checkpoint>/sharded`` (model and optimizer, resharded on load whatever the world size) plus the plain
HF folder that the engine reloads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from clawpipe.errors import TrainingError
from clawpipe.modelbuild import MODEL_BUILD
from clawpipe.train.losses import decoder_of, score
from clawpipe.train.packing import MicroBatch

log = logging.getLogger(__name__)

SHARDED_DIR = "sharded"


@dataclass
class DistContext:
    """This process's place in the process group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    """WORLD_SIZE as set by the elastic launcher (1 outside it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_from_env(device: str = "auto") -> DistContext | None:
    """Join the process group the launcher describes (None when not launched with more than one rank)."""
    world = world_size_from_env()
    if world <= 1:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def shutdown() -> None:
    """Leave the process group once every rank is done with it (a rank tearing down gloo while another still
    talks to it can abort the process: "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def assign_trees(sizes: list[int], world: int) -> list[list[int]]:
    """Whole trees to ranks, largest first onto the least-loaded rank (LPT): balanced unique tokens."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for ti in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r].append(ti)
        load[r] += sizes[ti]
    return [sorted(s) for s in shares]


class Scorer(torch.nn.Module):
    """The policy and the optional value head as one module whose forward scores a micro-batch.

    Returns (logprob, entropy, value-or-None) as a tuple so that FSDP sees the output tensors (it hooks
    their backward to gather the root's parameters again)."""

    def __init__(self, model: Any, value_head: torch.nn.Module | None) -> None:
        super().__init__()
        self.model = model
        self.value_head = value_head

    def forward(
        self, mb: MicroBatch, temperature: float, entropy_grad: bool, with_value: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        s = score(
            self.model,
            mb,
            temperature=temperature,
            value_head=self.value_head if with_value else None,
            entropy_grad=entropy_grad,
        )
        # copies, not views: FSDP hooks the outputs' backward, and an in-place op on a view would lose the hook
        return s.logprob.clone(), s.entropy.clone(), s.value.clone() if s.value is not None else None


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder's list of layers, whatever the architecture names it (``layers`` in Qwen2 and Llama, ``h`` in
    GPT-2): the one ModuleList directly under the decoder."""
    decoder = decoder_of(model)
    found = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList)]
    if len(found) != 1:
        raise TrainingError(
            f"cannot tell the decoder layers of {type(model).__name__} to shard (found {len(found)} module lists "
            "under its decoder); train it in one process (nproc = 1)"
        )
    return found[0]


def shard(scorer: Scorer, ctx: DistContext) -> None:
    """FSDP2 over the decoder layers and the wrapper; gradients summed (not averaged) across ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    for layer in decoder_layers(scorer.model):
        fully_shard(layer, mesh=mesh)
    fully_shard(scorer, mesh=mesh)
    for m in scorer.modules():
        if isinstance(m, FSDPModule):
            # each rank's loss already carries the global normaliser: the sum of rank gradients is the gradient
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum


def padding_micro_batch(device: torch.device) -> MicroBatch:
    """Two tokens, one scored, no contributions: a forward/backward that keeps a rank in step with the others."""
    return MicroBatch(
        input_ids=torch.zeros((1, 2), dtype=torch.int64, device=device),
        position_ids=torch.arange(2, device=device)[None],
        attention_mask=None,
        score_rows=torch.zeros(1, dtype=torch.int64, device=device),
        score_targets=torch.zeros(1, dtype=torch.int64, device=device),
        contrib_index=np.zeros(0, dtype=np.int64),
        contrib_score=torch.zeros(0, dtype=torch.int64, device=device),
        n_tokens=0,
    )


def _tensor(x: np.ndarray | float, ctx: DistContext) -> torch.Tensor:
    # gloo reduces CPU tensors, NCCL device tensors
    t = torch.as_tensor(np.asarray(x, dtype=np.float64))
    return t.to(ctx.device) if ctx.device.type == "cuda" else t


def all_reduce_array(a: np.ndarray, ctx: DistContext, op: str = "sum") -> np.ndarray:
    t = _tensor(a, ctx)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.cpu().numpy().astype(a.dtype if isinstance(a, np.ndarray) else np.float64)


def max_int(n: int, ctx: DistContext) -> int:
    return int(all_reduce_array(np.asarray([float(n)]), ctx, "max")[0])


def merge_sums(sums: dict[str, float], ctx: DistContext, max_keys: tuple[str, ...]) -> dict[str, float]:
    """Per-rank loss parts -> batch totals (sums added, maxima maxed); keys may differ between ranks."""
    gathered: list[dict[str, float] | None] = [None] * ctx.world
    dist.all_gather_object(gathered, sums)
    out: dict[str, float] = {}
    for part in gathered:
        for k, v in (part or {}).items():
            out[k] = max(out.get(k, v), v) if k in max_keys else out.get(k, 0.0) + v
    return out


def full_norm(norm: torch.Tensor) -> float:
    """A gradient norm that may be a DTensor (sharded parameters) as a plain float."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


# --- checkpoints -------------------------------------------------------------------------------------------
def full_state(scorer: torch.nn.Module) -> dict[str, Any]:
    """Unsharded model + value-head state on rank 0 (CPU); empty on the other ranks. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(scorer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_model(template: Any, state: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A plain (unsharded) HF model carrying ``state``'s policy weights, and the value head's state."""
    from transformers import AutoModelForCausalLM

    policy = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    head = {k.removeprefix("value_head."): v for k, v in state.items() if k.startswith("value_head.")}
    with MODEL_BUILD:  # transformers swaps process-wide state while it builds (clawpipe/modelbuild.py)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(template.config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(policy, strict=False, assign=True)
        if unexpected:
            raise TrainingError(f"exported state has keys the model does not: {unexpected[:5]}")
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise TrainingError(f"exported state lacks parameters {left[:5]} (missing {missing[:5]})")
    # non-persistent buffers (rotary frequencies) are not in the state: take them from the template's config
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            src = template.get_submodule(name.rsplit(".", 1)[0])
            owner.register_buffer(name.rsplit(".", 1)[1], getattr(src, name.rsplit(".", 1)[1]).detach().cpu(), False)
    return model, head


def save_sharded(path: Path, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state, each rank writing its shards (torch.distributed.checkpoint). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(scorer, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded_optimizer(path: Path, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Restore the optimizer state saved by :func:`save_sharded` (any world size); False when none is there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if not (path / ".metadata").is_file():
        return False
    optim_sd = get_optimizer_state_dict(scorer, optimizer)
    state = {"optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(scorer, optimizer, state["optim"])
    return True


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    dist.barrier()
