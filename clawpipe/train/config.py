"""The training configuration: one validated pydantic model, every field with help text, loadable from TOML.

Each algorithmic option names the paper it implements in its help text. ``load_config`` reads a TOML file
(top-level keys or a ``[train]`` table); validation errors become ConfigError messages that name the field
and say what to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from clawpipe.configfile import read_values, validate

Algorithm = Literal["grpo", "ppo"]
AdvantageMode = Literal["outcome", "tree_local", "tree_global", "tree_local_global"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean"]


class TrainConfig(BaseModel):
    """Settings of one training step (GRPO or PPO over packed prefix trees)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- algorithm -------------------------------------------------------------------------------------
    algorithm: Algorithm = Field(
        "grpo",
        description="grpo: group-relative advantages, no critic (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300). "
        "ppo: a value head and GAE along root-to-leaf paths (Schulman et al. 2017, arXiv:1707.06347).",
    )
    advantage: AdvantageMode = Field(
        "outcome",
        description="GRPO advantage. outcome: the rollout's reward normalised within its group, for every token "
        "it generated. tree_local / tree_global / tree_local_global: TreeRL-style node advantages (Hou et al. "
        "2025, arXiv:2506.11902): node value = mean reward of the leaves below; local = V(node) - V(parent), "
        "global = V(node) - V(root = group mean).",
    )
    scale_std: bool = Field(
        False,
        description="Divide group-centred advantages by the group's reward std (original GRPO). Off follows "
        "Dr. GRPO (Liu et al. 2025, arXiv:2503.20783), which shows std scaling biases towards easy/hard groups.",
    )
    leave_one_out: bool = Field(
        False,
        description="Baseline = mean reward of the OTHER rollouts of the group (RLOO, Ahmadian et al. 2024, "
        "arXiv:2402.14740) instead of the group mean. Applies to the outcome advantage.",
    )
    tree_leaf_norm: bool = Field(
        False, description="TreeRL: divide a node's advantage by sqrt(number of leaves below it)."
    )
    group_by: Literal["group_id", "group_id+harness"] = Field(
        "group_id",
        description="What a GRPO group is: rollouts sharing group_id, or also the same harness (mix-harness "
        "batches then normalise each harness separately within a task).",
    )
    harness_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Optional per-harness loss weight (harness name -> weight >= 0); harnesses not listed weigh 1.",
    )
    aggregation: Aggregation = Field(
        "token-mean",
        description="Loss aggregation. token-mean: every (token, sequence) counts the same (DAPO, Yu et al. 2025, "
        "arXiv:2503.14476). seq-mean-token-mean: mean over sequences of their token mean (GRPO, Shao et al. 2024). "
        "seq-mean-token-sum-norm: token sums / (sequences x norm_tokens) (Dr. GRPO, Liu et al. 2025). "
        "per-rollout-mean: token mean within each rollout, then mean over rollouts, so a rollout weighs the same "
        "however many calls it made.",
    )
    norm_tokens: int | None = Field(
        None,
        ge=1,
        description="seq-mean-token-sum-norm's constant length; None = the longest completion in the batch.",
    )

    # --- clipped surrogate, importance weights, regularisers ------------------------------------------------
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip below: ratio >= 1 - clip_low.")
    clip_high: float = Field(
        0.2, gt=0, description="PPO ratio clip above: ratio <= 1 + clip_high (DAPO's clip-higher uses 0.28)."
    )
    tis_cap: float = Field(
        2.0,
        ge=1.0,
        description="Calls sampled by an OLDER policy_version: ratio taken against the current policy at the step "
        "start (decoupled PPO) and multiplied by the truncated importance weight min(pi_prox/pi_behaviour, tis_cap) "
        "(Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training').",
    )
    min_policy_version: int = Field(
        0,
        ge=0,
        description="Calls sampled by a policy_version below this are dropped (counted as calls_stale_dropped): "
        "the async pipeline's bound on how stale a trained call may be.",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (loss -= coef x entropy).")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty to the reference policy (k3 estimator, Schulman 2020); needs reference_policy.",
    )
    reference_policy: Path | None = Field(
        None, description="Directory of the frozen reference policy for the KL penalty (usually the initial policy)."
    )
    sampling_temperature: float = Field(
        1.0, gt=0, description="Temperature the rollouts were sampled at: recomputed logprobs use logits / T."
    )

    # --- PPO -------------------------------------------------------------------------------------------------
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount along a root-to-leaf path of generated tokens.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda (Schulman et al. 2016, arXiv:1506.02438).")
    value_coef: float = Field(0.5, ge=0, description="PPO: value loss coefficient.")
    value_clip: float = Field(0.2, gt=0, description="PPO: clip of the value change around the pre-step value.")
    whiten_advantages: bool = Field(True, description="PPO: normalise advantages to mean 0, std 1 over the batch.")

    # --- optimisation ----------------------------------------------------------------------------------------
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    epochs: int = Field(
        1, ge=1, le=1000, description="Optimizer steps over the same batch (PPO epochs; at most 1,000)."
    )

    # --- data and packing ------------------------------------------------------------------------------------
    tree_scope: Literal["group", "rollout"] = Field(
        "group", description="Which trees to train on (docs/ARCHITECTURE.md, contract E)."
    )
    max_tokens_per_micro_batch: int = Field(
        4096,
        ge=16,
        description="Packing target of one micro-batch (activation memory grows with it). Trees are packed into "
        "micro-batches of at most this many tokens; a tree larger than it is split into pieces that repeat their "
        "ancestor context. A path longer than it is never an error: its tree is cut into pieces of up to that "
        "path + this many tokens, each in a micro-batch of its own. Raise it to let more branches share one long "
        "prompt in a micro-batch (attention memory is linear in the row's length).",
    )
    attention: Literal["blocks", "dense"] = Field(
        "blocks",
        description="Attention over a packed row. blocks: causal kernels on the row's chains and each branch "
        "attending to its ancestors' keys, memory linear in the row's length (no n x n mask). dense: one n x n "
        "ancestor mask through the model's own attention (sdpa bool mask; additive float mask for eager), "
        "n^2 bytes: a reference for short rows.",
    )
    attention_block_tokens: int = Field(
        128, ge=8, description="Queries per block where a branch attends to its ancestors (larger suits GPUs)."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(transformers' activation checkpointing): what each layer keeps for backward drops to its input. "
        "Measured by bench/long_paths.py (small policy, one 16k-token path on CPU): peak memory 544 MB instead "
        "of 1,551 MB (-65%) for 50% more CPU time.",
    )
    lora_rank: int = Field(
        0,
        ge=0,
        description="LoRA (Hu et al. 2021, arXiv:2106.09685) via peft: rank of the adapters trained instead of "
        "the whole policy (0 = full training). Gradients and AdamW state then exist for the adapters only; the "
        "checkpoint holds the merged model (what the engine reloads) and adapter/ (for vLLM's LoRA loading).",
    )
    lora_alpha: int = Field(16, gt=0, description="LoRA scaling numerator (the update is alpha / rank x BA).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Linear layers that get adapters (names inside each decoder layer).",
    )
    skip_statuses: list[str] = Field(
        default_factory=lambda: ["infra_error"],
        description="Rollout statuses left out of training (their sequences dropped and counted).",
    )
    include_retokenized: bool = Field(
        False,
        description="Must stay false: calls whose ids the proxy re-encoded (token_source=retokenized) are kept "
        "out of the trees, since those ids may not be the ones the policy sampled, so they are never trained.",
    )
    exclude_side_calls_harnesses: list[str] = Field(
        default_factory=list,
        description="Rollouts of these harnesses train only on their main lineage: calls under a 'subagent' branch "
        "of the rollout tree (side calls such as titles or memory extraction, and sub-agents) are dropped and "
        "counted (load/side_calls_excluded). Needs rollout-scope trees. The pipeline fills it from the harness "
        "manifests' [training] exclude_side_calls.",
    )

    # --- device and processes ------------------------------------------------------------------------------
    device: str = Field("auto", description="auto (cuda when available, else cpu), cpu, cuda or cuda:N.")
    nproc: int = Field(
        1,
        ge=1,
        description="Processes (ranks) per node. Above 1 the step runs under torch.distributed's elastic launcher: "
        "the policy sharded with FSDP2 (NCCL on GPUs, one GPU per rank; gloo on CPU), whole trees assigned to ranks "
        "by balanced unique tokens, the loss normalised over the whole batch, so the update equals one process's.",
    )
    nnodes: int = Field(
        1, ge=1, description="Nodes of a distributed step (each runs nproc ranks); > 1 needs rdzv_endpoint."
    )
    rdzv_endpoint: str | None = Field(
        None, description="HOST:PORT of the rendezvous (c10d, on the first node) when nnodes > 1."
    )
    bf16: bool = Field(True, description="Use bf16 autocast on CUDA (ignored on CPU).")
    seed: int = Field(0, description="Seed for torch.")

    # --- outputs ---------------------------------------------------------------------------------------------
    publish_url: str | None = Field(
        None,
        description="Serving engine base URL; when set, the new checkpoint is published with "
        "POST {url}/admin/reload {path, policy_version} and the admin token.",
    )
    publish_timeout_s: float = Field(120.0, gt=0, description="Timeout of the reload request.")

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        if self.kl_coef > 0 and self.reference_policy is None:
            raise ValueError("kl_coef > 0 needs reference_policy = '<dir of the initial policy>' (or set kl_coef = 0)")
        if self.algorithm == "ppo" and self.advantage != "outcome":
            raise ValueError("algorithm = 'ppo' computes GAE advantages; leave advantage = 'outcome'")
        if self.leave_one_out and self.advantage != "outcome":
            raise ValueError("leave_one_out applies to advantage = 'outcome'; set it false for tree advantages")
        if self.lora_rank and self.nproc * self.nnodes > 1:
            raise ValueError("lora_rank > 0 trains on one process: set nproc = 1 (or lora_rank = 0 to shard)")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint = 'HOST:PORT' (reachable from every node)")
        if self.include_retokenized:
            raise ValueError(
                "include_retokenized = true is not supported: re-encoded calls are kept out of the trees (their ids "
                "may not be the ones sampled), so they would never be trained; serve through an engine that returns "
                "token ids (clawpipe serve, vLLM with return_token_ids), or leave it false"
            )
        bad = {k: v for k, v in self.harness_weights.items() if v < 0}
        if bad:
            raise ValueError(f"harness_weights must be >= 0; got {bad}")
        return self

    def flat_params(self) -> dict[str, str]:
        """The whole config flattened to strings, for tracking params."""
        out: dict[str, str] = {}
        for key, value in self.model_dump(mode="json").items():
            if isinstance(value, dict):
                for k, v in value.items():
                    out[f"{key}.{k}"] = str(v)
                if not value:
                    out[key] = "{}"
            else:
                out[key] = str(value)
        return out


def make_config(_source: str = "", **values: Any) -> TrainConfig:
    """Build a config, turning validation errors into a ConfigError that names each field (an unknown key
    with the keys the config takes) and ``_source``, where the values came from."""
    return validate(TrainConfig, values, what=f"training config ({_source})" if _source else "training config")


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Read a TOML or JSON file (top-level keys or a [train] table), apply overrides, validate."""
    values = read_values(path, what="training config", table="train") if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return make_config(str(path) if path is not None else "", **values)
