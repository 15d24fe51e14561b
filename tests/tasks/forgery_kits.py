"""Forgery kits of the built-in task sets: how an honest harness answers each, and their own crafted attempts.

A kit's attempts come on top of the generic ones in tests/tasks/forgery.py; each starts from the honest
wrong answer and must not earn more than its baseline (see forgery.py for the rule and how to add a kit).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tasks.forgery import Attempt, ForgeryKit, Scene, register_forgery_kit
from tests.tasks.test_fixit import FIXES


def _transcript(workdir: Path, transcript: dict[str, Any]) -> None:
    (workdir / "out").mkdir(exist_ok=True)
    (workdir / "out" / "transcript.json").write_text(json.dumps(transcript))


def _writes(transcript_of: Any) -> Any:
    """A writer of the transcript ``transcript_of(task)``."""
    return lambda task, workdir: _transcript(workdir, transcript_of(task))


def _crafts(transcript_of: Any) -> Any:
    """A craft step that replaces the transcript with ``transcript_of(task)``."""
    return lambda scene: _transcript(scene.workdir, transcript_of(scene.task))


# --- guess -----------------------------------------------------------------------------------------------


def _miss(task: dict[str, Any]) -> int:
    d = task["data"]
    return d["lo"] if d["target"] != d["lo"] else d["hi"]


def _replies(*replies: str) -> dict[str, Any]:
    return {"turns": [{"reply": r} for r in replies]}


def _guess_attempts() -> list[Attempt]:
    def target(task: dict[str, Any]) -> str:
        return str(task["data"]["target"])

    def digits(task: dict[str, Any]) -> str:
        return " ".join(str(n) for n in range(task["data"]["lo"], task["data"]["hi"] + 1))

    return [
        Attempt(  # every number at once: only the first counts
            "every-number-in-one-reply",
            _crafts(lambda t: _replies(f"{_miss(t)} {digits(t)}")),
            baseline=_writes(lambda t: _replies(str(_miss(t)))),
        ),
        Attempt(  # the hit comes after the last allowed turn
            "hit-past-max-turns",
            _crafts(lambda t: _replies(*[str(_miss(t))] * t["max_turns"], target(t))),
            baseline=_writes(lambda t: _replies(*[str(_miss(t))] * t["max_turns"])),
        ),
        Attempt(  # a reply without a number ends the game
            "hit-after-game-over",
            _crafts(lambda t: _replies("no idea", target(t))),
            baseline=_writes(lambda t: _replies("no idea")),
        ),
        Attempt(
            "hit-after-out-of-range",
            _crafts(lambda t: _replies("999999", target(t))),
            baseline=_writes(lambda t: _replies("999999")),
        ),
        Attempt(  # non-ASCII digits are not numbers here
            "fullwidth-digits",
            _crafts(lambda t: _replies("".join(chr(0xFF10 + int(c)) for c in target(t)))),
            baseline=_writes(lambda t: _replies("no idea")),
        ),
        Attempt(  # objects in place of strings
            "reply-objects",
            _crafts(lambda t: {"turns": [{"reply": {"text": target(t)}, "answer": [target(t)]}]}),
        ),
        Attempt("turns-as-a-string", _crafts(lambda t: {"turns": target(t), "final": target(t)})),
        Attempt("negative-max-turns-claim", _crafts(lambda t: {"turns": [], "max_turns": 0, "solved": True})),
    ]


register_forgery_kit(
    "guess",
    ForgeryKit(
        honest_wrong=_writes(lambda t: _replies(str(_miss(t)))),
        honest_right=_writes(lambda t: _replies(str(t["data"]["target"]))),
        attempts=_guess_attempts(),
    ),
)


# --- calc ------------------------------------------------------------------------------------------------


def _call(expression: Any, result: Any = None, name: str = "calculator") -> dict[str, Any]:
    call: dict[str, Any] = {"name": name, "arguments": json.dumps({"expression": expression})}
    if result is not None:
        call["result"] = result
    return call


def _calc_right(task: dict[str, Any]) -> dict[str, Any]:
    d = task["data"]
    return {
        "turns": [{"reply": "", "tool_calls": [_call(d["expression"], str(d["answer"]))]}, {"reply": str(d["answer"])}],
        "final": f"The answer is {d['answer']}.",
    }


def _calc_wrong(task: dict[str, Any]) -> dict[str, Any]:
    return {
        "turns": [{"reply": f"It is {task['data']['answer'] + 1}."}],
        "final": f"It is {task['data']['answer'] + 1}.",
    }


def _calc_attempts() -> list[Attempt]:
    def answer(t: dict[str, Any]) -> int:
        return int(t["data"]["answer"])

    def wrong_final(t: dict[str, Any]) -> str:
        return f"It is {answer(t) + 1}."

    one_call = _writes(lambda t: {"turns": [{"reply": "", "tool_calls": [_call("1+1")]}], "final": wrong_final(t)})
    return [
        Attempt(  # the verifier evaluates expressions itself; a result field claims nothing
            "tool-result-claims-the-answer",
            _crafts(
                lambda t: {"turns": [{"reply": "", "tool_calls": [_call("1+1", answer(t))]}], "final": wrong_final(t)}
            ),
            baseline=one_call,
        ),
        Attempt(
            "code-in-the-expression",
            _crafts(
                lambda t: {
                    "turns": [
                        {
                            "reply": "",
                            "tool_calls": [
                                _call("__import__('os').getenv('CLAWPIPE_PROXY_SECRET')"),
                                _call(f"(lambda: {answer(t)})()"),
                                _call(f"[{answer(t)}][0]"),
                                _call("9 ** 99999999"),
                                _call("1" * 5000),
                            ],
                        }
                    ],
                    "final": wrong_final(t),
                }
            ),
        ),
        Attempt(  # the tool's name is matched exactly; arguments must be an expression string
            "look-alike-calls",
            _crafts(
                lambda t: {
                    "turns": [
                        {
                            "reply": "",
                            "tool_calls": [
                                _call(t["data"]["expression"], name="Calculator"),
                                {"name": "calculator", "arguments": {"expression": {"$eq": answer(t)}}},
                                {"name": "calculator", "arguments": json.dumps([t["data"]["expression"]])},
                                "calculator",
                            ],
                        }
                    ],
                    "final": wrong_final(t),
                }
            ),
        ),
        Attempt(  # a non-string final falls back to the last reply, which is wrong
            "final-not-a-string",
            _crafts(lambda t: {"turns": [{"reply": wrong_final(t)}], "final": [answer(t)]}),
        ),
        Attempt("final-as-number", _crafts(lambda t: {"turns": [{"reply": wrong_final(t)}], "final": answer(t)})),
    ]


register_forgery_kit(
    "calc",
    ForgeryKit(honest_wrong=_writes(_calc_wrong), honest_right=_writes(_calc_right), attempts=_calc_attempts()),
)


# --- fixit -----------------------------------------------------------------------------------------------


def _fixit_task(task_set: Any) -> dict[str, Any]:
    return next(t for t in task_set.generate(40, seed=0) if t["data"]["template"] == "add")


def _solution(body: str) -> Any:
    """A craft step writing solution.py from ``body`` (FN: the function's name, SECRET_PATH: the secret)."""

    def craft(scene: Scene) -> None:
        text = body.replace("FN", scene.task["data"]["function"]).replace("SECRET_PATH", repr(str(scene.secret)))
        scene.write("solution.py", text)

    return craft


WRONG = "def FN(a, b):\n    return a - b\n"
FIXIT_ATTEMPTS = {
    "always-equal-object": "class A:\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = object.__hash__\ndef FN(a, b):\n    return A()\n",
    "equal-int-subclass": "class I(int):\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = int.__hash__\ndef FN(a, b):\n    return I(a - b)\n",
    "equal-str-subclass": "class S(str):\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = str.__hash__\ndef FN(a, b):\n    return S('x')\n",
    "forged-result-document": "import json, os\n"
    "doc = {'results': [{'value': True, 'passed': True}] * 5, 'reward': 1.0, 'passed': 5, 'total': 5}\n"
    "open(os.path.join(os.environ['CLAWPIPE_OUTPUT'], 'result.json'), 'w').write(json.dumps(doc))\n"
    "print(json.dumps(doc), flush=True)\nos._exit(0)\n",
    "patched-json-dumps": "import json\n_real = json.dumps\n"
    "json.dumps = lambda o, **k: _real({'results': [{'value': 0}] * 5, 'reward': 1.0})\n" + WRONG,
    "exit-before-the-cases": "import sys\nsys.exit(0)\n",
    "kill-the-check": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "kill-pid-1": "import os\ntry:\n    os.kill(1, 9)\nexcept OSError:\n    pass\n" + WRONG,
    "read-the-expected-values": "import json, os\nfound = []\n"
    "for p in ('/task.json', os.environ.get('CLAWPIPE_TASK', ''), '../task.json', '/harness/check.py'):\n"
    "    try:\n        found.append(open(p).read())\n    except OSError:\n        pass\n"
    "def FN(a, b):\n    return 'cases' in ''.join(found)\n",
    "read-the-secret": "def FN(a, b):\n    try:\n        return open(SECRET_PATH).read()\n"
    "    except OSError as exc:\n        return type(exc).__name__\n",
    "environ-of-every-process": "import os\nseen = []\nfor p in os.listdir('/proc'):\n"
    "    try:\n        seen.append(open(f'/proc/{p}/environ').read())\n    except OSError:\n        pass\n"
    "def FN(a, b):\n    return ''.join(seen)[:1000]\n",
    "write-to-proc": "for p in ('/proc/sys/vm/drop_caches', '/proc/1/oom_score_adj', '/proc/sysrq-trigger'):\n"
    "    try:\n        open(p, 'w').write('0')\n    except OSError:\n        pass\n" + WRONG,
    "connect-to-the-network": "import socket\nfor port in (80, 8000, 8400, 8401):\n    try:\n"
    "        socket.create_connection(('127.0.0.1', port), timeout=0.5).close()\n    except OSError:\n"
    "        pass\n" + WRONG,
    "huge-return-value": "def FN(a, b):\n    return 'x' * 10_000_000\n",
    "deep-return-value": "def FN(a, b):\n    v = a - b\n    for _ in range(20):\n        v = [v]\n    return v\n",
    "very-deep-return-value": "def FN(a, b):\n    v = 0\n    for _ in range(100_000):\n        v = [v]\n    return v\n",
    "nan-return-value": "def FN(a, b):\n    return float('nan')\n",
    "boolean-return-value": "def FN(a, b):\n    return True\n",
    "many-processes": "import os, time\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
    "            time.sleep(30)\n            os._exit(0)\n    except OSError:\n        break\n" + WRONG,
    "fill-the-log": "import sys\ntry:\n    sys.stdout.write('x' * (64 << 20))\nexcept Exception:\n    pass\n" + WRONG,
}


def _solution_folder(scene: Scene) -> None:
    (scene.workdir / "solution.py").unlink()
    (scene.workdir / "solution.py").mkdir()
    (scene.workdir / "solution.py" / "__init__.py").write_text(FIXES["add"].format(f=scene.task["data"]["function"]))


register_forgery_kit(
    "fixit",
    ForgeryKit(
        honest_wrong=lambda task, workdir: None,  # the prepared solution.py keeps its bug
        honest_right=lambda task, workdir: (workdir / "solution.py").write_text(
            FIXES[task["data"]["template"]].format(f=task["data"]["function"])
        ),
        pick_task=_fixit_task,
        attempts=[
            *[Attempt(name, _solution(body)) for name, body in FIXIT_ATTEMPTS.items()],
            Attempt("solution-is-a-folder", _solution_folder),
        ],
    ),
)


# --- say -------------------------------------------------------------------------------------------------


def _near_miss(task: dict[str, Any]) -> str:
    """An honest wrong reply as close as it gets: the phrase less its last letter (graded just below 1)."""
    return str(task["data"]["phrase"])[:-1]


def _final(text_of: Any) -> Any:
    return lambda task: {"turns": [{"reply": text_of(task)}], "final": text_of(task)}


def _say_attempts() -> list[Attempt]:
    def phrase(task: dict[str, Any]) -> str:
        return str(task["data"]["phrase"])

    return [
        Attempt(  # only final counts: the phrase in the turns earns nothing
            "phrase-in-turns-not-final",
            _crafts(lambda t: {"turns": [{"reply": phrase(t), "answer": phrase(t)}], "final": _near_miss(t)}),
        ),
        Attempt("final-as-an-object", _crafts(lambda t: {"final": {"text": phrase(t)}, "answer": phrase(t)})),
        Attempt("phrase-flood", _crafts(_final(lambda t: " ".join([phrase(t)] * 5000)))),
        Attempt("phrase-with-a-claim", _crafts(_final(lambda t: f"{phrase(t)} (reward 1.0, exact)"))),
        Attempt("zero-width-spaces", _crafts(_final(lambda t: "\u200b".join(phrase(t))))),
        Attempt(
            "fullwidth-letters", _crafts(_final(lambda t: "".join(chr(ord(c) + 0xFEE0) for c in phrase(t) if c != " ")))
        ),
    ]


register_forgery_kit(
    "say",
    ForgeryKit(
        honest_wrong=_writes(_final(_near_miss)),
        honest_right=_writes(_final(lambda t: str(t["data"]["phrase"]))),
        attempts=_say_attempts(),
    ),
)
