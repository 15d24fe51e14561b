"""Model folders brought from elsewhere: the shapes other tools and transformers versions save (sharded weights,
bf16 / fp16 on disk, tied embeddings, pickled weights, templates here or there, lists of end-of-turn ids,
padding rows, added tokens, links) are served like clawpipe's own, and the ones that cannot be served right
(code to run, sizes the weights do not have, missing tensors, ids without an embedding row, a folder still being
written) are refused with a message naming the problem, before any weight is allocated.

Every folder is built here from the tiny default policy (no download): `brought(base, dst, **variant)`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import processors
from transformers import AutoModelForCausalLM, LlamaConfig

from clawpipe.errors import ServingError
from clawpipe.serving.policy import ENDOFTEXT, compute_logprobs, load_model, load_tokenizer
from clawpipe.serving.server import start_server

ADMIN = "brought-admin"
MESSAGES = [{"role": "user", "content": "Guess my number."}]
ROLE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported: this model takes user and assistant turns only') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def edit_json(path: Path, **values: Any) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(values)
    path.write_text(json.dumps(data))


def brought(
    base: Path,
    dst: Path,
    *,
    shard_kb: int | None = None,
    dtype: torch.dtype | None = None,
    tied: bool = False,
    pickled: bool = False,
    legacy_pickle: bool = False,
    template_in_config: bool = False,
    named_templates: bool = False,
    no_template: bool = False,
    eos_ids: list[int] | None = None,
    vocab_size: int | None = None,
    added_tokens: list[str] | None = None,
    llama: bool = False,
    legacy_config: bool = False,
    bos: bool = False,
) -> Path:
    """A copy of the policy in `base` saved the way another tool would have saved it.

    shard_kb: weights in shards of about that size with model.safetensors.index.json; dtype: weights stored in
    that dtype; tied: tie_word_embeddings with lm_head not stored; pickled: only pytorch_model.bin (legacy_pickle:
    in the pre-zip format of old PyTorch);
    template_in_config: chat_template inside tokenizer_config.json (older transformers) instead of
    chat_template.jinja; named_templates: there as a list of named templates ("default", and "tool_use", taken
    when a request has tools); no_template: none at all; eos_ids: generation_config.json eos_token_id list;
    vocab_size: embedding rows (more than the tokenizer's ids: padding rows); added_tokens: special tokens added
    to the tokenizer (the embeddings grown to hold them); llama: a Llama-shaped model of the same sizes (random
    weights) instead; legacy_config: config.json as transformers 4.x wrote it (torch_dtype, rope_theta at the top);
    bos: a Llama-style tokenizer that adds a BOS before every encoded text, and a template that starts with it."""
    shutil.copytree(base, dst)
    model = llama_model() if llama else AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = load_tokenizer(base)
    if added_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": added_tokens})
    if bos:
        bos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{ENDOFTEXT} $A", pair=f"{ENDOFTEXT} $A {ENDOFTEXT} $B", special_tokens=[(ENDOFTEXT, bos_id)]
        )
        tokenizer.bos_token = ENDOFTEXT
        tokenizer.chat_template = "{{ bos_token }}" + str(tokenizer.chat_template)
    if added_tokens or bos:
        tokenizer.save_pretrained(dst)
    rows = vocab_size or (len(tokenizer) if added_tokens else None)
    if rows:
        model.resize_token_embeddings(rows, mean_resizing=False)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    if dtype is not None:
        model = model.to(dtype)
    if pickled:
        model.config.save_pretrained(dst)
        state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        torch.save(state, dst / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy_pickle)
    else:
        model.save_pretrained(dst, max_shard_size=f"{shard_kb}KB" if shard_kb else "5GB")
    if template_in_config or named_templates or no_template:
        template = (dst / "chat_template.jinja").read_text()
        (dst / "chat_template.jinja").unlink()
        if template_in_config:
            edit_json(dst / "tokenizer_config.json", chat_template=template)
        if named_templates:
            named = [{"name": "default", "template": template}, {"name": "tool_use", "template": template}]
            edit_json(dst / "tokenizer_config.json", chat_template=named)
    if eos_ids is not None:
        edit_json(dst / "generation_config.json", eos_token_id=eos_ids)
    if legacy_config:
        config = json.loads((dst / "config.json").read_text())
        rope = config.pop("rope_parameters")
        for key in ("dtype", "layer_types"):
            config.pop(key, None)
        config.update(torch_dtype="bfloat16", rope_theta=rope["rope_theta"], rope_scaling=None)
        config.update(transformers_version="4.43.1")
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def llama_model() -> Any:
    """A random Llama-shaped causal LM with the tiny policy's sizes and special ids."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def start(folder: Path, **kwargs: Any) -> Any:
    return start_server(folder, device="cpu", admin_token=ADMIN, max_model_len=2048, **kwargs)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def stream_events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    return [json.loads(x) for x in lines]


def served_as_trained(url: str, folder: Path) -> dict[str, Any]:
    """Chat and completions, streamed and not, with logprobs: every answer's logprobs finite and equal to the
    teacher-forced ones of the folder's own weights (in float32, as the engine on CPU and the trainer use)."""
    model = load_model(folder, "cpu", torch.float32)
    body = {"messages": MESSAGES, "max_tokens": 12, "logprobs": True, "seed": 3, "temperature": 1.0}
    chat = post(url, "/v1/chat/completions", body)
    assert chat.status_code == 200, chat.text
    j = chat.json()
    choice = j["choices"][0]
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert lps and all(math.isfinite(x) for x in lps)
    ref = compute_logprobs(model, j["prompt_token_ids"], choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 1e-4
    events = stream_events(url, "/v1/chat/completions", body)
    streamed = [
        e["logprob"] for ev in events for c in ev["choices"] for e in (c.get("logprobs") or {}).get("content") or []
    ]
    assert streamed == lps  # same seed: the same answer and logprobs streamed
    comp = post(url, "/v1/completions", {"prompt": "Guess my number.", "max_tokens": 8, "logprobs": 1, "seed": 1})
    assert comp.status_code == 200, comp.text
    cj = comp.json()
    ref = compute_logprobs(model, cj["prompt_token_ids"], cj["choices"][0]["token_ids"])  # one prompt: top level
    got = cj["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-4
    events = stream_events(url, "/v1/completions", {"prompt": "Guess my number.", "max_tokens": 8, "seed": 1})
    assert "".join(c["text"] for ev in events for c in ev["choices"]) == cj["choices"][0]["text"]
    return j


VARIANTS: dict[str, dict[str, Any]] = {
    "sharded": {"shard_kb": 120},
    "bf16": {"dtype": torch.bfloat16},
    "fp16-sharded": {"dtype": torch.float16, "shard_kb": 200},
    "tied": {"tied": True},
    "pickled": {"pickled": True},
    "pickled-tied-bf16": {"pickled": True, "tied": True, "dtype": torch.bfloat16},
    "pickled-legacy-format": {"pickled": True, "legacy_pickle": True},
    "template-in-config": {"template_in_config": True},
    "named-templates": {"named_templates": True},
    "padding-rows": {"vocab_size": 640},
    "added-tokens": {"added_tokens": ["<think>", "</think>"]},
    "llama": {"llama": True},
    "transformers-4-config": {"legacy_config": True},
    "bos-tokenizer": {"bos": True},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_brought_folder_served_with_exact_logprobs(policy_dir: Path, tmp_path: Path, name: str) -> None:
    folder = brought(policy_dir, tmp_path / name, **VARIANTS[name])
    with start(folder) as handle:
        assert next(handle.engine.model.parameters()).dtype == torch.float32  # the engine's dtype, not the file's
        if VARIANTS[name].get("tied"):
            model = handle.engine.model
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        served_as_trained(handle.url, folder)


def test_tied_embedding_stored_as_lm_head_is_served_not_refused(policy_dir: Path, tmp_path: Path) -> None:
    """A tied model whose weights file names the shared tensor lm_head.weight (not model.embed_tokens.weight):
    transformers ties the embedding to it, so it holds every parameter config.json describes and is served with
    that very tensor as its embedding (neither refused as missing one, nor given a random embedding)."""
    folder = brought(policy_dir, tmp_path / "lm-head-only", tied=True)
    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with start(folder) as handle:
        model = handle.engine.model
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert torch.equal(model.get_input_embeddings().weight, state["lm_head.weight"])
        served_as_trained(handle.url, folder)


def test_served_through_a_symlink(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "real", shard_kb=120)
    link = tmp_path / "policy-link"
    os.symlink(folder, link)
    with start(link) as handle:
        assert handle.engine.served_name == "policy-link"
        served_as_trained(handle.url, folder)


def test_added_special_tokens_reach_the_prompt_as_their_ids(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "think", added_tokens=["<think>"])
    think = load_tokenizer(folder).convert_tokens_to_ids("<think>")
    assert think == 512
    with start(folder) as handle:
        r = post(handle.url, "/v1/completions", {"prompt": "a<think>b", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert think in r.json()["prompt_token_ids"]


def test_bos_tokenizer_one_bos_in_every_prompt(policy_dir: Path, tmp_path: Path) -> None:
    """A Llama-style tokenizer that adds a BOS to every text, with a template that starts with it: every prompt
    starts with one BOS and holds no other (chat, a spliced next turn, a continued turn, Messages), and a raw
    completions prompt gets its BOS as vLLM encodes it (add_special_tokens, true by default)."""
    folder = brought(policy_dir, tmp_path / "bos", bos=True)
    bos = load_tokenizer(folder).convert_tokens_to_ids(ENDOFTEXT)
    with start(folder) as handle:
        head = {"x-clawpipe-rollout": "r1"}
        first = httpx.post(handle.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6,
                           "return_token_ids": True}, headers=head, timeout=60).json()  # fmt: skip
        sampled = first["choices"][0]["token_ids"]
        history = [*MESSAGES, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
        history.append({"role": "user", "content": "Higher."})
        second = httpx.post(handle.url + "/v1/chat/completions", json={"messages": history, "max_tokens": 4},
                            headers=head, timeout=60).json()  # fmt: skip
        assert second["spliced_tokens"] > 0
        cont = post(handle.url, "/v1/chat/completions", {
            "messages": [*MESSAGES, {"role": "assistant", "content": "It is"}], "max_tokens": 4,
            "continue_final_message": True, "add_generation_prompt": False,
        }).json()  # fmt: skip
        msg = post(handle.url, "/v1/messages", {"messages": MESSAGES, "max_tokens": 4, "model": "bos"}).json()
        for ids in (first["prompt_token_ids"], cont["prompt_token_ids"]):
            assert ids[0] == bos and ids.count(bos) == 1
        # the next turn holds the first turn's sampled ids as they were sampled: a BOS the model sampled stays
        # (the model conditions on its own tokens); the template adds none
        again = second["prompt_token_ids"]
        assert again[0] == bos and again.count(bos) == 1 + sampled.count(bos)
        assert again[: len(first["prompt_token_ids"])] == first["prompt_token_ids"]
        assert msg["prompt_token_ids"][0] == bos and msg["prompt_token_ids"].count(bos) == 1
        raw = post(handle.url, "/v1/completions", {"prompt": "Guess", "max_tokens": 2}).json()
        assert raw["prompt_token_ids"][0] == bos and raw["prompt_token_ids"].count(bos) == 1
        bare = post(handle.url, "/v1/completions", {"prompt": "Guess", "max_tokens": 2, "add_special_tokens": False})
        assert bare.json()["prompt_token_ids"] == raw["prompt_token_ids"][1:]
        wrong = post(handle.url, "/v1/completions", {"prompt": "Guess", "add_special_tokens": "yes"})
        assert wrong.status_code == 400 and "add_special_tokens" in wrong.json()["error"]["message"]


def byte_fallback_folder(base: Path, dst: Path) -> Path:
    """The tiny policy with a SentencePiece-style tokenizer (Metaspace pieces, ``<0xNN>`` byte fallback, as Llama 2
    and Mistral have) of the same 512 ids, trained on the same corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from clawpipe.serving import policy

    folder = brought(base, dst)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    pieces = ["<unk>", *policy.SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256))]
    tok.train_from_iterator(policy.build_corpus(0), trainer=trainers.BpeTrainer(vocab_size=512, special_tokens=pieces))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=policy.IM_END, pad_token=ENDOFTEXT, unk_token="<unk>", padding_side="left",
        chat_template=policy.CHAT_TEMPLATE, additional_special_tokens=[policy.IM_START, policy.TOOL_CALL_OPEN,
        policy.TOOL_CALL_CLOSE],
    )  # fmt: skip
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / f).unlink()
    fast.save_pretrained(folder)
    ids = {"eos_token_id": fast.convert_tokens_to_ids(policy.IM_END), "pad_token_id": fast.pad_token_id}
    edit_json(folder / "config.json", **ids)
    edit_json(folder / "generation_config.json", **ids)
    return folder


def test_byte_fallback_tokenizer_streams_the_text_it_returns(policy_dir: Path, tmp_path: Path) -> None:
    """A run of byte pieces that is not valid UTF-8 decodes as U+FFFD for each of its bytes, the valid ones too:
    streamed text (decoded as the ids come) equals the text returned whole and the decoded ids, for answers of a
    random model full of such runs."""
    folder = byte_fallback_folder(policy_dir, tmp_path / "spm")
    tok = load_tokenizer(folder)
    with start(folder) as handle:
        stop_ids = set(handle.engine.stop_ids)
        for seed in range(6):
            body = {"messages": MESSAGES, "max_tokens": 40, "seed": seed, "temperature": 1.0}
            whole = post(handle.url, "/v1/chat/completions", body).json()["choices"][0]
            events = stream_events(handle.url, "/v1/chat/completions", body)
            streamed = "".join((c.get("delta") or {}).get("content") or "" for ev in events for c in ev["choices"])
            decoded = tok.decode([i for i in whole["token_ids"] if i not in stop_ids])
            assert streamed == whole["message"]["content"] == decoded, seed


def test_padding_rows_sampled_are_reported_not_refused(policy_dir: Path, tmp_path: Path) -> None:
    """A model with more embedding rows than the tokenizer has ids (as published models pad them) is served; a
    random model samples the padding ids too, and they come back with finite logprobs and empty text."""
    folder = brought(policy_dir, tmp_path / "pad", vocab_size=1024)
    with start(folder) as handle:
        r = post(handle.url, "/v1/completions", {"prompt": "x", "max_tokens": 64, "logprobs": 1, "seed": 5})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert max(choice["token_ids"]) >= 512
        assert all(math.isfinite(x) for x in choice["logprobs"]["token_logprobs"])


def test_eos_list_in_generation_config_stops_on_each(policy_dir: Path, tmp_path: Path) -> None:
    """generation_config.json's eos_token_id as a list: the answer ends at whichever of them comes first."""
    with start(policy_dir) as handle:
        greedy = post(handle.url, "/v1/completions", {"prompt": "Guess", "max_tokens": 6, "temperature": 0})
    first = greedy.json()["choices"][0]["token_ids"][0]
    folder = brought(policy_dir, tmp_path / "eos", eos_ids=[2, first])
    with start(folder) as handle:
        assert first in handle.engine.stop_ids
        r = post(handle.url, "/v1/completions", {"prompt": "Guess", "max_tokens": 6, "temperature": 0})
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == [first] and choice["finish_reason"] == "stop"


def test_no_chat_template_chat_refused_completions_served(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "notpl", no_template=True)
    with start(folder) as handle:
        r = post(handle.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 400
        assert "no chat template" in r.json()["error"]["message"]
        assert "chat_template.jinja" in r.json()["error"]["message"]
        m = post(handle.url, "/v1/messages", {"messages": MESSAGES, "max_tokens": 4, "model": "notpl"})
        assert m.status_code == 400 and "no chat template" in m.json()["error"]["message"]
        resp = post(handle.url, "/v1/responses", {"input": "Guess my number.", "max_output_tokens": 4})
        assert resp.status_code == 400 and "no chat template" in resp.json()["error"]["message"]
        assert post(handle.url, "/v1/completions", {"prompt": "x", "max_tokens": 4}).status_code == 200


def test_template_raising_for_a_role_is_a_400_naming_it(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "roles")
    (folder / "chat_template.jinja").write_text(ROLE_TEMPLATE)
    with start(folder) as handle:
        body = {"messages": [{"role": "system", "content": "Be brief."}, *MESSAGES], "max_tokens": 4}
        r = post(handle.url, "/v1/chat/completions", body)
        assert r.status_code == 400 and "System role not supported" in r.json()["error"]["message"]
        ok = post(handle.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
        assert ok.status_code == 200


def test_template_reaching_for_python_is_a_400_and_runs_nothing(policy_dir: Path, tmp_path: Path) -> None:
    """A chat template is folder content too: one that reaches for os.system through Python attributes is stopped
    by the sandboxed renderer, a 400, and the command never runs."""
    folder = brought(policy_dir, tmp_path / "evil-template")
    marker = tmp_path / "ran"
    reach = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    (folder / "chat_template.jinja").write_text(reach + "{{ messages[0]['content'] }}")
    with start(folder) as handle:
        r = post(handle.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 400 and "unsafe" in r.json()["error"]["message"]
    assert not marker.exists()


def test_sentencepiece_only_tokenizer_is_refused_saying_how_to_convert(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "spm")
    (folder / "tokenizer.json").rename(folder / "tokenizer.model")  # stands in for a slow tokenizer's file
    with pytest.raises(
        ServingError, match=r"no tokenizer.json .*\(it has tokenizer\.model; clawpipe loads fast tokenizers only"
    ):
        start(folder)


def test_prompt_past_max_position_embeddings_is_a_400_naming_it(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "short")
    edit_json(folder / "config.json", max_position_embeddings=48)
    with start(folder) as handle:
        r = post(handle.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go " * 60}]})
        assert r.status_code == 400 and "context is 48" in r.json()["error"]["message"]


# ---------------------------------------------------------------- refused folders


def test_pickle_carrying_code_is_refused_never_run(policy_dir: Path, tmp_path: Path) -> None:
    """A pytorch_model.bin whose pickle would call os.system when loaded: refused, and the command never ran."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    folder = brought(policy_dir, tmp_path / "evil", pickled=True)
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ServingError, match=r"pytorch_model\.bin is a pickle .*system.*weights-only"):
        start(folder)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"auto_map": {"AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}}, r"auto_map .*never runs code"),
        ({"model_type": "frobnicator", "architectures": ["FrobForCausalLM"]}, r"model_type 'frobnicator'"),
    ],
    ids=["auto_map", "unknown-model-type"],
)
def test_foreign_model_code_is_refused(policy_dir: Path, tmp_path: Path, change: dict, match: str) -> None:
    folder = brought(policy_dir, tmp_path / "foreign")
    edit_json(folder / "config.json", **change)
    (folder / "modeling_own.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(ServingError, match=match):
        load_model(folder, "cpu")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("change", "drop", "match"),
    [
        ({"vocab_size": 2**31}, (), r"model\.embed_tokens\.weight is stored .* \[512, 64\] .*vocab_size 2147483648"),
        ({"hidden_size": 10**6}, (), r"hidden_size 1000000"),
        # the tensors that would have shown the lie are not there: transformers would allocate 2**31 rows
        ({"vocab_size": 2**31}, ("model.embed_tokens.weight", "lm_head.weight"), r"describes [\d,]+ parameters"),
    ],
    ids=["vocab", "hidden", "vocab-tensors-gone"],
)
def test_absurd_sizes_refused_before_allocating(
    policy_dir: Path, tmp_path: Path, change: dict, drop: tuple[str, ...], match: str
) -> None:
    folder = brought(policy_dir, tmp_path / "absurd")
    edit_json(folder / "config.json", **change)
    if drop:
        state = load_file(folder / "model.safetensors")
        save_file({k: v for k, v in state.items() if k not in drop}, folder / "model.safetensors")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ServingError, match=match):
        load_model(folder, "cpu")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 256, f"peak memory grew by {grown_mb:.0f} MB while refusing"


def test_model_larger_than_free_memory_is_refused(
    policy_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory probe reports 0.5 MiB free, less than the tiny model's 0.7 MiB of fp32 weights: refused before
    loading, with the parameter count and both sizes named."""
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=2**19))
    with pytest.raises(
        ServingError, match=r"[\d,]+ parameters, 0\.0 GiB in torch.float32, more than the 0\.0 GiB free"
    ):
        load_model(policy_dir, "cpu")


def test_missing_tensor_is_refused_not_filled_at_random(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "holey")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ServingError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder, "cpu")


def test_tokenizer_with_ids_past_the_embedding_is_refused(policy_dir: Path, tmp_path: Path) -> None:
    folder = brought(policy_dir, tmp_path / "small")
    tok = load_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    tok.save_pretrained(folder)  # 513 ids for 512 rows
    with pytest.raises(ServingError, match=r"513 ids but the model embeds only vocab_size 512 \(id 512, '<extra>'"):
        start(folder)


# ---------------------------------------------------------------- reload of a brought or incomplete folder


def incomplete(policy_dir: Path, dst: Path, how: str) -> Path:
    """A folder caught while being written: a shard not there yet, or model.safetensors cut short."""
    if how == "shard-missing":
        folder = brought(policy_dir, dst, shard_kb=120)
        sorted(folder.glob("model-*.safetensors"))[-1].unlink()
    else:
        folder = brought(policy_dir, dst)
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    return folder


@pytest.mark.parametrize("how", ["shard-missing", "truncated"])
def test_reload_of_a_folder_being_written_fails_and_keeps_the_served_policy(
    policy_dir: Path, tmp_path: Path, how: str
) -> None:
    folder = incomplete(policy_dir, tmp_path / "ckpt" / "policy-v1", how)
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True}
    with start(policy_dir, reload_roots=[str(tmp_path / "ckpt")]) as handle:
        before = post(handle.url, "/v1/chat/completions", body).json()
        r = httpx.post(
            handle.url + "/admin/reload",
            json={"path": str(folder), "policy_version": 1},
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=60,
        )
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "not completely written" in message
        assert ("lists the shard" if how == "shard-missing" else "header describes") in message
        after = post(handle.url, "/v1/chat/completions", body).json()
        assert after["policy_version"] == before["policy_version"] == 0
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        assert after["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]


def test_reload_with_another_tokenizer_is_logged(
    policy_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Same vocab_size, other ids (a tokenizer with an added token over a padding row): the engine keeps the
    served tokenizer across a reload, so the log says the checkpoint's own was not taken; the same tokenizer
    says nothing."""
    served = brought(policy_dir, tmp_path / "served", vocab_size=520)
    same = brought(policy_dir, tmp_path / "ckpt" / "same", vocab_size=520)
    other = brought(policy_dir, tmp_path / "ckpt" / "other", vocab_size=520)
    tok = load_tokenizer(other)
    tok.add_special_tokens({"additional_special_tokens": ["<think>"]})
    tok.save_pretrained(other)
    with start(served, reload_roots=[str(tmp_path / "ckpt")]) as handle:
        for folder in (same, other):
            caplog.clear()
            with caplog.at_level("WARNING", logger="clawpipe.serving.engine"):
                r = httpx.post(
                    handle.url + "/admin/reload",
                    json={"path": str(folder)},
                    headers={"Authorization": f"Bearer {ADMIN}"},
                    timeout=60,
                )
            assert r.status_code == 200, r.text
            warned = [m for m in caplog.messages if "differs from the served one" in m]
            assert bool(warned) == (folder == other), caplog.messages
        assert "513 vs 512 ids" in warned[0]


def test_reload_with_fewer_positions_than_the_served_context_is_refused(policy_dir: Path, tmp_path: Path) -> None:
    """GPT-2-shaped folders (learned position table): a checkpoint with a shorter table than the context being
    served would fail every longer request with an index error (a 500); it is refused and the served weights
    stay. A checkpoint of another architecture with the same tokenizer and enough positions reloads."""
    from transformers import GPT2Config

    def gpt2(dst: Path, positions: int) -> Path:
        folder = brought(policy_dir, dst)
        for f in ("model.safetensors", "config.json", "generation_config.json"):
            (folder / f).unlink()
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=512, n_positions=positions, n_embd=64, n_layer=2, n_head=4, eos_token_id=2)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        return folder

    served = gpt2(tmp_path / "served", 256)
    short = gpt2(tmp_path / "ckpt" / "short", 64)
    llama = brought(policy_dir, tmp_path / "ckpt" / "llama", llama=True)
    body = {"messages": [{"role": "user", "content": "go " * 30}], "max_tokens": 40, "seed": 1}
    with start(served, reload_roots=[str(tmp_path / "ckpt")]) as handle:
        assert handle.engine.max_model_len == 256
        served_as_trained(handle.url, served)

        def reload(folder: Path) -> httpx.Response:
            auth = {"Authorization": f"Bearer {ADMIN}"}
            return httpx.post(handle.url + "/admin/reload", json={"path": str(folder)}, headers=auth, timeout=60)

        r = reload(short)
        assert r.status_code == 400 and "max_position_embeddings 64, below the served context 256" in r.text
        ok = post(handle.url, "/v1/chat/completions", body)
        assert ok.status_code == 200 and ok.json()["policy_version"] == 0
        assert reload(llama).status_code == 200
        served_as_trained(handle.url, llama)
