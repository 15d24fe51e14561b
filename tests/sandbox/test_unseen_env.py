"""Harnesses that read the model endpoint under names of their own: a manifest's [env] value may refer to the
runner's variables (``LLM_ENDPOINT = "${OPENAI_BASE_URL}"``; ``$$`` a literal ``$``), and the name older openai
SDKs, LangChain and LiteLLM read (``OPENAI_API_BASE``) is set too. A reference to anything else (a host
secret) is refused when the manifest is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawpipe.errors import ManifestError
from clawpipe.sandbox import load_manifest
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness
from tests.sandbox.test_runner import run, specs_for

# calls the model with the standard library, at the endpoint and key named by its own variables
OWN_NAMES = """
import json, os, urllib.request
base, key = os.environ[os.environ["BASE_VAR"]], os.environ[os.environ["KEY_VAR"]]
req = urllib.request.Request(base + "/chat/completions",
    data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": []}).encode(),
    headers={"content-type": "application/json", "authorization": "Bearer " + key})
reply = json.loads(urllib.request.urlopen(req, timeout=10).read())
out = os.environ["CLAWPIPE_OUTPUT"]
open(os.path.join(out, "answer.txt"), "w").write(reply["choices"][0]["message"]["content"])
names = ("LLM_ENDPOINT", "LLM_KEY", "PRICE", "LONE", "OPENAI_API_BASE", "OPENAI_BASE_URL", "HOME", "BOTH")
json.dump({k: os.environ.get(k) for k in names}, open(os.path.join(out, "env.json"), "w"))
"""


@pytest.mark.sandbox
@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_a_harness_reading_the_endpoint_under_its_own_names_reaches_the_model(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, backend: str
) -> None:
    env = {
        "BASE_VAR": "LLM_ENDPOINT",
        "KEY_VAR": "LLM_KEY",
        "LLM_ENDPOINT": "${OPENAI_BASE_URL}",
        "LLM_KEY": "${OPENAI_API_KEY}",
        "PRICE": "$$5 per ${CLAWPIPE_MODEL}",
        "LONE": "a$b ${not-a-name} $",
        "BOTH": "${HOME}:${CLAWPIPE_WORKDIR}",
    }
    m = load_manifest(make_harness(tmp_path, "own-names", OWN_NAMES, env=env))
    (result,) = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend=backend, keep_workdirs=True)
    assert (result.status, result.reward) == ("succeeded", 1.0), result.stderr_tail
    seen = json.loads((Path(result.workdir) / "out" / "env.json").read_text())
    assert seen["LLM_ENDPOINT"] == seen["OPENAI_BASE_URL"] == seen["OPENAI_API_BASE"]
    assert seen["LLM_ENDPOINT"].endswith("/v1") and "/r/" in seen["LLM_ENDPOINT"]
    assert seen["PRICE"] == "$5 per tiny" and seen["LONE"] == "a$b ${not-a-name} $"
    home, workdir = seen["BOTH"].split(":")
    assert home == seen["HOME"] and home.startswith(workdir)


@pytest.mark.sandbox
def test_a_harness_using_only_openai_api_base_reaches_the_model(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    env = {"BASE_VAR": "OPENAI_API_BASE", "KEY_VAR": "OPENAI_API_KEY"}
    m = load_manifest(make_harness(tmp_path, "legacy", OWN_NAMES, env=env))
    (result,) = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend="bwrap")
    assert (result.status, result.reward) == ("succeeded", 1.0), result.stderr_tail


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "CLAWPIPE_ADMIN_TOKEN", "PWD", "openai_base_url"])
def test_a_reference_to_anything_but_the_runner_s_variables_is_refused(tmp_path: Path, name: str) -> None:
    folder = make_harness(tmp_path, "leaky", "print(1)\n", env={"X": "pre ${" + name + "} post"})
    with pytest.raises(ManifestError, match=r"refers to \$\{" + name + r"\}.*OPENAI_BASE_URL.*\$\$ for a literal"):
        load_manifest(folder)


HOME_PROBE = """
import json, os, pwd
home = pwd.getpwuid(os.getuid()).pw_dir
open(os.path.join(home, ".probe"), "w").write("x")  # tools that ask the user database write here
out = os.environ["CLAWPIPE_OUTPUT"]
open(os.path.join(out, "answer.txt"), "w").write("42")
json.dump({"pw_dir": home, "HOME": os.environ["HOME"]}, open(os.path.join(out, "home.json"), "w"))
"""


@pytest.mark.sandbox
def test_the_user_database_names_the_same_writable_home_as_home(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    m = load_manifest(make_harness(tmp_path, "home", HOME_PROBE))
    (result,) = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend="bwrap", keep_workdirs=True)
    assert result.status == "succeeded", result.stderr_tail
    seen = json.loads((Path(result.workdir) / "out" / "home.json").read_text())
    assert seen["pw_dir"] == seen["HOME"]
