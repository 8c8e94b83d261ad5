"""`tools/doctor.py --audit FILE...` (diagnostics/placement_audit_files.py) on model files written at test time with
the real key names: an H3 DiT, an H3 text encoder, a Music 3 text encoder, an H3 video VAE and a Music 3 DAV as
safetensors, an H3 audio VAE and the same DAV as GGUF. ComfyUI's own loaders build them on FakeTensors (the text
encoders and H3 VAEs at the tiny sizes of synthetic_models, which ComfyUI otherwise hard-codes at full size; the DiT's
sizes come from its file); files the audit cannot take end with one line and exit code 2."""

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hotfix_testing import synthetic_models
from minimax_hotfix.diagnostics import placement_audit, placement_audit_files, placement_runs

DOCTOR = Path(__file__).resolve().parents[1] / "tools" / "doctor.py"
# file -> (the class ComfyUI builds, the audited models it holds)
EXPECTED = {
    "h3_dit.safetensors": ("MiniMaxH3", {"H3 DiT"}),
    "h3_text_encoder.safetensors": ("MiniMaxH3TEModel_", {"H3 text encoder: Qwen3-VL vision tower",
                                                          "H3 text encoder: language model"}),
    "music3_text_encoder.safetensors": ("MiniMaxMusic3TEModel", {"Music 3 text encoder (AR)"}),
    "h3_video_vae.safetensors": ("MiniMaxH3VideoVAE", {"H3 video VAE decoder", "H3 video VAE encoder"}),
    "music3_dav.safetensors": ("MiniMaxMusic3DAV", {"Music 3 DAV"}),
    "h3_audio_vae.gguf": ("MiniMaxH3AudioVAE", {"H3 audio VAE"}),
    "music3_dav.gguf": ("MiniMaxMusic3DAV", {"Music 3 DAV"}),
}


@pytest.fixture(scope="module")
def model_files(comfyui, tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    generator = torch.Generator().manual_seed(synthetic_models.SEED)
    dav = synthetic_models.music3_dav(generator)
    save_file(synthetic_models.h3_video_vae(generator), str(folder / "h3_video_vae.safetensors"))
    save_file(dav, str(folder / "music3_dav.safetensors"))
    synthetic_models.save_gguf(synthetic_models.h3_audio_vae(generator), folder / "h3_audio_vae.gguf")
    synthetic_models.save_gguf(dav, folder / "music3_dav.gguf")
    save_file(synthetic_models.h3_dit(generator), str(folder / "h3_dit.safetensors"))
    save_file(synthetic_models.h3_text_encoder(generator), str(folder / "h3_text_encoder.safetensors"))
    save_file(synthetic_models.music3_text_encoder(generator), str(folder / "music3_text_encoder.safetensors"))
    return {name: folder / name for name in EXPECTED}


@pytest.fixture
def bad_files(model_files, tmp_path):
    vae = model_files["h3_video_vae.safetensors"].read_bytes()
    gguf = model_files["h3_audio_vae.gguf"].read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(vae[:len(vae) // 2])  # header intact, data cut
    (tmp_path / "truncated.gguf").write_bytes(gguf[:200])
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4)}, str(tmp_path / "sd15.safetensors"))
    (tmp_path / "notes.txt").write_text("not a model")
    return {"truncated.safetensors": "cannot be read as safetensors", "truncated.gguf": "cannot be read as GGUF",
            "sd15.safetensors": "not a MiniMax model", "notes.txt": "cannot be read as safetensors",
            "missing.safetensors": "no such file"}


def test_files_are_identified_from_their_headers(model_files):
    for name, path in model_files.items():
        found = placement_audit_files.identify(placement_audit_files.read_header(str(path)))
        assert (found.built, set(found.models)) == EXPECTED[name], name


def test_doctor_audits_the_files_as_the_built_in_configurations(model_files, monkeypatch, capsys):
    monkeypatch.setattr(placement_runs, "BUDGETS", {"none": 0.0})  # the test's budgets: none, then dynamic
    with synthetic_models.tiny_configs():
        assert placement_audit.main([str(path) for path in model_files.values()], as_json=True) == 0
    rows = json.loads(capsys.readouterr().out)
    for name, (_, models) in EXPECTED.items():
        suffix = f" ({name}, FakeTensor cuda:0)"
        mine = [row for row in rows if row["model"].endswith(suffix)]
        assert {row["model"].removesuffix(suffix) for row in mine} == models, name
        assert {(row["budget"], row["pack"]) for row in mine} == {(b, p) for b in ("none", "dynamic") for p in ("off", "on")}
        assert not any(row["not_audited"] for row in mine), name
    by_load = {(row["model"], row["budget"], row["pack"]): row for row in rows}
    # red control: the user's tower builds its position and rotary tables on the host under a partial load, as the
    # built-in configuration does; the pack's fixes remove both
    tower = "H3 text encoder: Qwen3-VL vision tower (h3_text_encoder.safetensors, FakeTensor cuda:0)"
    assert {f["tensor"] for f in by_load[(tower, "none", "off")]["findings"] if f["kind"] == "host build"} >= {
        "visual.pos_embed.weight", "visual.rotary_pos_emb.inv_freq"}
    assert by_load[(tower, "none", "on")]["findings"] == []
    # the user's DiT reads its sigma and text tags on the host from shadows, as the built-in one: audited, and the
    # 64-byte rotary copy and the attention's copies of its q/k norm weights the built-in configuration shows are
    # there too (accepted)
    dit = by_load[("H3 DiT (h3_dit.safetensors, FakeTensor cuda:0)", "none", "off")]
    tensors = {f["tensor"] for f in dit["findings"]}
    norms = tensors - {"diffusion_model.rope.inv_freq"}
    assert "diffusion_model.rope.inv_freq" in tensors and dit["weight_casts"] > 0
    assert norms and all(fnmatch.fnmatchcase(t, "diffusion_model.blocks.*.attn.[qk]_norm.weight") for t in norms)
    assert all(f["accepted"] for f in dit["findings"])
    # red control: the DAV's weight-norm convolutions stay behind under a legacy partial load (unreachable in stock
    # ComfyUI, accepted); ModelPatcherDynamic moves them, and the file audit sees both
    for dav in ("music3_dav.safetensors", "music3_dav.gguf"):
        model = f"Music 3 DAV ({dav}, FakeTensor cuda:0)"
        legacy, dynamic = by_load[(model, "none", "off")], by_load[(model, "dynamic", "off")]
        assert [f for f in legacy["findings"] if f["kind"] == "cross-device"]
        assert all(f["accepted"].startswith("unreachable") for f in legacy["findings"])
        assert dynamic["findings"] == [] and dynamic["weight_casts"] > 0


def test_files_the_audit_cannot_take_get_one_line_and_exit_2(bad_files, tmp_path, capsys):
    for name, reason in bad_files.items():
        path = str(tmp_path / name)
        assert placement_audit.main([path], as_json=False) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"placement audit: {path}: {reason}") and err.count("\n") == 1, err


def test_the_doctor_command_line_says_it_without_a_traceback(bad_files, tmp_path):
    done = subprocess.run([sys.executable, str(DOCTOR), "--audit", str(tmp_path / "truncated.safetensors")],
                          capture_output=True, text=True, env=os.environ, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert "placement audit: " in done.stderr and "Traceback" not in done.stderr, done.stderr
