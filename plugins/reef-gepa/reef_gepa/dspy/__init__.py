"""DSPy programs as harness releases, and a live program that follows the scenario's releases.

A release of a DSPy scenario is a harness tree of two text files:

* ``dspy/program.json``: the program's saved state as DSPy writes it (``Module.dump_state()``: each
  predictor's instructions, field prefixes and descriptions, demos), as sorted, indented JSON;
* ``dspy/manifest.json``: ``{"format": 1, "program": "pkg.mod:Class", "signature": "question -> answer",
  "predictors": [names]}``: the class to build (its constructor takes no argument), the program's
  inputs and outputs (how a recorded request is read back into inputs) and its predictors in order.

:func:`program_files` writes that tree, :func:`load_program` builds a live program from it, and
:class:`LiveProgram` keeps an application's program on the release the scenario serves: it polls the
serving release id through a :class:`~reef_core.api.ReefClient` and swaps in a new program when the id
moves, with no restart. :func:`reef_lm` is a DSPy LM whose calls go through Reef (receipts land in the
client's receipt log, ready to report on); :func:`chat_lm` wraps any ``fn(messages) -> str``.

``dspy`` is optional (``pip install 'reef-gepa[dspy]'``) and imported on first use only, with
``LITELLM_LOCAL_MODEL_COST_MAP=True`` so that litellm never fetches its cost map (offline runs).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from reef_core.api import ConfigError, ValidationFailed, load_object

PROGRAM_FILE = "dspy/program.json"
MANIFEST_FILE = "dspy/manifest.json"
FORMAT = 1
EXTRA = "reef-gepa[dspy]"


def import_dspy():
    """The ``dspy`` module, or a ConfigError naming the extra that brings it."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import dspy
    except ImportError as exc:
        raise ConfigError(f"DSPy programs need {EXTRA} (pip install '{EXTRA}'): {exc}") from None
    return dspy


def dotted_name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def program_signature(program: Any) -> Any:
    """The program's signature (inputs -> outputs): its ``signature`` attribute, else its one predictor's."""
    dspy = import_dspy()
    sig = getattr(program, "signature", None)
    if isinstance(sig, str):
        return dspy.ensure_signature(sig)
    if isinstance(sig, type) and issubclass(sig, dspy.Signature):
        return sig
    predictors = program.named_predictors()
    if len(predictors) == 1:
        return predictors[0][1].signature
    raise ConfigError(f"{dotted_name(program)} has {len(predictors)} predictors: give the class a `signature` "
                      "attribute ('inputs -> outputs') naming the program's own inputs and outputs")


def signature_text(signature: Any) -> str:
    return f"{', '.join(signature.input_fields)} -> {', '.join(signature.output_fields)}"


def manifest_of(program: Any, program_path: str | None = None) -> dict:
    return {"format": FORMAT, "program": program_path or dotted_name(program),
            "signature": signature_text(program_signature(program)),
            "predictors": [name for name, _ in program.named_predictors()]}


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def program_files(program: Any, program_path: str | None = None) -> dict[str, str]:
    """The harness tree of ``program`` (path -> text)."""
    return {PROGRAM_FILE: _dumps(program.dump_state()), MANIFEST_FILE: _dumps(manifest_of(program, program_path))}


def read_manifest(files: Mapping[str, Any]) -> dict:
    """The checked manifest of a release tree (ValidationFailed naming the problem)."""
    for path in (MANIFEST_FILE, PROGRAM_FILE):
        if path not in files:
            raise ValidationFailed(f"a DSPy release needs {path}")
    try:
        manifest = json.loads(_text(files[MANIFEST_FILE]))
        json.loads(_text(files[PROGRAM_FILE]))
    except ValueError as exc:
        raise ValidationFailed(f"a DSPy release holds invalid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValidationFailed(f"{MANIFEST_FILE}: expected format {FORMAT}")
    for key in ("program", "signature"):
        if not isinstance(manifest.get(key), str) or not manifest[key]:
            raise ValidationFailed(f"{MANIFEST_FILE}: {key} must be a non-empty string")
    return manifest


def _text(value: Any) -> str:
    return bytes(value).decode("utf-8") if isinstance(value, (bytes, bytearray, memoryview)) else str(value)


def load_program(files: Mapping[str, Any], program: Any = None) -> Any:
    """A live program from a release tree: a new instance of the manifest's class (or ``program``, which
    is not modified) with the saved state loaded. The predictors must match the manifest's."""
    manifest = read_manifest(files)
    if program is None:
        cls = load_object(manifest["program"])
        program = cls()
    else:
        program = program.deepcopy()
    names = [name for name, _ in program.named_predictors()]
    if manifest.get("predictors") is not None and names != manifest["predictors"]:
        raise ValidationFailed(f"{manifest['program']} has predictors {names}, the release {manifest['predictors']}")
    program.load_state(json.loads(_text(files[PROGRAM_FILE])))
    return program


# -- LMs ----------------------------------------------------------------------------------------------------


class ChatEngine:
    """A DSPy engine (``complete(Request) -> Response``) answering with ``fn(messages) -> str``."""

    def __init__(self, fn: Callable[[list[dict]], str], model: str = "chat"):
        self.fn = fn
        self.model = model

    @staticmethod
    def messages(request: Any) -> list[dict]:
        out = []
        if request.system is not None:
            system = request.system if isinstance(request.system, str) else "".join(p.text for p in request.system)
            out.append({"role": "system", "content": system})
        out.extend({"role": m.role, "content": m.text or ""} for m in request.messages)
        return out

    def complete(self, request: Any) -> Any:
        from dspy.lm15 import Message, Response, TextPart, Usage

        text = self.fn(self.messages(request))
        return Response(id=None, model=self.model, message=Message.assistant([TextPart(text or "")]),
                        finish_reason="stop", usage=Usage(input_tokens=0, output_tokens=0, total_tokens=0))


def chat_lm(fn: Callable[[list[dict]], str], model: str = "chat") -> Any:
    """A ``dspy.LM`` (no cache) answering with ``fn(messages) -> str``: stand-ins, or Reef's chat models."""
    dspy = import_dspy()
    return dspy.LM(f"reef/{model}", engine=ChatEngine(fn, model), cache=False)


def reef_lm(client: Any, model: str, **create_kwargs: Any) -> Any:
    """A ``dspy.LM`` whose calls go through Reef with ``client`` (a ReefClient): recorded under the client's
    scenario, each receipt in ``client.receipts`` (``client.report(...)`` quotes the last by default)."""
    chat = client.openai()

    def call(messages: list[dict]) -> str:
        completion = chat.chat.completions.create(model=model, messages=messages, **create_kwargs)
        return completion.choices[0].message.content or ""

    return chat_lm(call, model)


# -- the live program ---------------------------------------------------------------------------------------


class LiveProgram:
    """An application's DSPy program, kept on the release its scenario serves.

    ``LiveProgram(client, seed=MyProgram(), poll_interval_s=5)``: ``seed`` serves until the scenario has a
    release (a new scenario gets its creation release with its first request). Calling it runs the current
    program (with ``lm`` in context when given), first polling the serving release id when the last poll
    is older than ``poll_interval_s``; :meth:`refresh` polls now. A new release is loaded whole before it
    replaces the program, so a release that does not load leaves the running program in place.
    """

    def __init__(self, client: Any, *, seed: Any = None, lm: Any = None, poll_interval_s: float = 5.0):
        import_dspy()
        self.client = client
        self.lm = lm
        self.poll_interval_s = float(poll_interval_s)
        self.program = seed
        self.release_id: str | None = None
        self.files: dict[str, str] | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._polled = -float("inf")
        self.refresh()

    def serving_release_id(self) -> str | None:
        from reef_core.api import ReefClientError

        try:
            rows = self.client.releases()
        except ReefClientError as exc:
            if exc.status == 404:  # no scenario yet: the seed serves
                return None
            raise
        current = next((r for r in rows if r.get("current")), None)
        return current.get("release_id") if current else None

    def refresh(self) -> bool:
        """Poll the serving release; load it when it moved. True when the program changed."""
        self._polled = time.monotonic()
        release_id = self.serving_release_id()
        if release_id is None or release_id == self.release_id:
            return False
        files = self.client.harness(release_id=release_id)["files"]
        try:
            program = load_program(files)
        except (ValidationFailed, ConfigError) as exc:
            self.error = f"release {release_id}: {exc}"
            return False
        with self._lock:
            self.program, self.release_id, self.files, self.error = program, release_id, dict(files), None
        return True

    def __call__(self, **inputs: Any) -> Any:
        if time.monotonic() - self._polled >= self.poll_interval_s:
            self.refresh()
        with self._lock:
            program = self.program
        if program is None:
            raise RuntimeError("no program: the scenario has no release yet and no seed was given")
        if self.lm is None:
            return program(**inputs)
        dspy = import_dspy()
        with dspy.context(lm=self.lm):
            return program(**inputs)


__all__ = ["PROGRAM_FILE", "MANIFEST_FILE", "ChatEngine", "LiveProgram", "chat_lm", "import_dspy", "load_program",
           "manifest_of", "program_files", "program_signature", "read_manifest", "reef_lm", "signature_text"]
