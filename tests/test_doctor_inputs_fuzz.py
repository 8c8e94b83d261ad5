"""The doctor's inputs and the off switch, fuzzed (Hypothesis, profile of tests/hotfix_testing/workflow_fuzzing.py): damaged
safetensors and GGUF headers for ``--audit FILE`` end in the audit's one-line ``ModelFileError`` (never another
exception), any ``--fix`` id selects its fix or ends with ``doctor: error:`` and exit code 2, any
MINIMAX_HOTFIX_DISABLE value switches off exactly the fixes it names (or all), never raising and logging unknown
names once."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import struct
import tempfile
from pathlib import Path
from unittest import mock

import doctor
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from hotfix_testing import synthetic_models
from hotfix_testing.workflow_fuzzing import examples, without_comfyui_only
from minimax_hotfix import registry
from minimax_hotfix.diagnostics import placement_audit_files

FIX_IDS = sorted(registry.all_fixes())


@pytest.fixture(scope="module")
def model_headers(tmp_path_factory) -> dict[str, bytes]:
    """A small safetensors file and a small GGUF file, as bytes: the seeds of the damage."""
    state = {"decoder.conv_in.weight": torch.ones(4, 3), "decoder.conv_in.bias": torch.zeros(4)}
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    synthetic_models.save_gguf(state, path)
    return {"safetensors": save(state), "gguf": path.read_bytes()}


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """``data`` cut short, with bytes of its header changed, inserted or its length field rewritten."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, min(len(data), 256)))
        damage = draw(st.sampled_from(["cut", "byte", "insert", "length"]))
        if damage == "cut":
            del data[at:]
        elif damage == "byte" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif damage == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif damage == "length" and len(data) >= 16:
            start = draw(st.sampled_from([0, 8]))  # safetensors' header length; GGUF's tensor count
            data[start:start + 8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    return bytes(data)


def read_or_refuse(data: bytes, suffix: str):
    """The header read from ``data`` as a file, or the ModelFileError message; any other exception fails."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, f"model{suffix}")
        path.write_bytes(data)
        try:
            return placement_audit_files.read_header(str(path))
        except placement_audit_files.ModelFileError as exc:
            message = str(exc)
            assert message.startswith(f"{path}: ") and "\n" not in message
            return message


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@without_comfyui_only
def test_audit_reads_a_damaged_header_or_refuses_it_in_one_line(kind, model_headers):
    @settings(max_examples=examples(150))
    @given(data=damaged(model_headers[kind]))
    def check(data):
        read_or_refuse(data, f".{kind}")

    check()
    assert isinstance(read_or_refuse(model_headers[kind], f".{kind}"), placement_audit_files.Header)


def run_doctor(argv: list[str]) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = doctor.main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return code, stderr.getvalue()


fix_ids = st.text(max_size=30) | st.sampled_from(FIX_IDS).flatmap(
    lambda fix_id: st.sampled_from([fix_id.upper(), f" {fix_id}", f"{fix_id},", fix_id[:-1], f"{fix_id}x"]))


@without_comfyui_only
@settings(max_examples=examples(200))
@given(fix_id=fix_ids)
def test_any_fix_id_selects_its_fix_or_ends_with_one_doctor_error(fix_id):
    if fix_id.lower() in FIX_IDS:
        assert [fix.id for fix in doctor.select_fixes(fix_id)] == [fix_id.lower()]
        return
    code, stderr = run_doctor([f"--fix={fix_id}"])
    assert code == doctor.CANNOT_RUN and "Traceback" not in stderr
    assert stderr.startswith("doctor: error: unknown fix id ") or "doctor: error:" in stderr.splitlines()[-1]


env_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=40)
switch_values = env_text | st.lists(st.sampled_from([*FIX_IDS, "all", "ALL", " ", "", "nope"]) | env_text,
                                    max_size=5).map(",".join)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@without_comfyui_only
@settings(max_examples=examples(300))
@given(value=switch_values)
def test_any_off_switch_value_switches_off_exactly_what_it_names(value):
    named = {part.strip().lower() for part in value.split(",") if part.strip()}
    records, logger = _Records(), logging.getLogger("minimax_hotfix")
    logger.addHandler(records)
    checked = set(registry._checked_ids)
    try:
        registry._checked_ids.clear()
        with mock.patch.dict(os.environ, {registry.DISABLE_ENV: value}):
            for _ in range(2):
                assert registry.disabled_ids() == named
                assert {fix_id for fix_id in FIX_IDS if registry.switched_off(fix_id)} == (
                    set(FIX_IDS) if "all" in named else named & set(FIX_IDS))
    finally:
        logger.removeHandler(records)
        registry._checked_ids.clear()
        registry._checked_ids.update(checked)
    unknown = named - set(FIX_IDS) - {"all"}
    assert len(records.messages) == (1 if unknown else 0), records.messages
    assert all(name in records.messages[0] for name in unknown)
