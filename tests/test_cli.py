"""`routeweaver` CLI: import-hf -> export-hf is bit-identical and loads in transformers; the
console script runs; errors are one line and exit code 2."""

import argparse
import gc
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_checkpoint import truncate_arrays
from tiny_models import make_hf_model
from transformers import AutoModelForCausalLM

from jax_routeweaver.cli.app import main
from jax_routeweaver.cli.common import parse_mesh, parse_size
from jax_routeweaver.rl.run.checkpoint import list_steps

TOKENIZER_JSON = '{"version": "1.0", "model": {"type": "WordLevel"}}'


def tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF checkpoint dir, whether single-file or sharded."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(directory.glob("*.safetensors")):
        part = load_file(f)
        assert not set(part) & set(out), f"tensor stored twice ({f.name})"
        out.update(part)
    return out


def torch_logits(model, seed: int = 0) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator)
    with torch.no_grad():
        return model(input_ids=ids).logits.numpy()


@pytest.fixture
def hf_model(tmp_path):
    """(saved dir, torch model) of a tiny untied Qwen3 with tokenizer files beside it."""
    path = tmp_path / "hf"
    model = make_hf_model(path)
    (path / "tokenizer.json").write_text(TOKENIZER_JSON)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return path, model


def run(capsys, *argv) -> tuple[int, str, str]:
    """main(argv) -> (exit code, its stdout, its stderr)."""
    capsys.readouterr()  # drop what fixtures printed (transformers' progress bars)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_import_then_export_is_bit_identical(tmp_path, capsys, hf_model):
    hf_dir, original = hf_model
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    code, stdout, err = run(capsys, "import-hf", hf_dir, ckpt, "--step", 4)
    assert (code, err) == (0, "")
    assert "imported" in stdout and "with tokenizer" in stdout
    assert list_steps(ckpt) == [4]
    # 100KB < total size: exercises the sharded writer and the size parser.
    code, stdout, err = run(capsys, "export-hf", ckpt, out, "--max-shard-size", "100KB")
    assert (code, err) == (0, "")
    assert "step 4" in stdout

    assert (out / "model.safetensors.index.json").is_file()
    want, got = tensors(hf_dir), tensors(out)
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert (got[name].dtype, got[name].shape) == (a.dtype, a.shape), name
        assert got[name].tobytes() == a.tobytes(), name
    assert (out / "tokenizer.json").read_text() == TOKENIZER_JSON

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(torch_logits(exported), torch_logits(original), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tied_model_on_a_mesh_exports_untied(tmp_path, capsys, devices):
    hf_dir = tmp_path / "hf"
    original = make_hf_model(hf_dir, seed=1, tie_word_embeddings=True)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert run(capsys, "import-hf", hf_dir, ckpt, "--mesh", "2,2,2")[0] == 0
    code, stdout, _ = run(capsys, "export-hf", ckpt, out, "--untie", "--mesh", "1,-1,1")
    assert code == 0 and "no tokenizer stored" in stdout

    want, got = tensors(hf_dir), tensors(out)
    want.pop("lm_head.weight", None)  # transformers may or may not store the tied copy
    assert sorted(got) == sorted([*want, "lm_head.weight"])
    for name, a in want.items():
        assert got[name].tobytes() == a.tobytes(), name
    np.testing.assert_array_equal(got["lm_head.weight"], want["model.embed_tokens.weight"])
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.tie_word_embeddings is False
    np.testing.assert_allclose(torch_logits(exported), torch_logits(original), atol=1e-5, rtol=0)


def test_export_from_empty_dir_fails_with_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, stdout, err = run(capsys, "export-hf", empty, tmp_path / "out")
    assert code == 2
    assert stdout == ""
    assert err.startswith("routeweaver: error: ") and str(empty) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_export_into_a_non_empty_dir_needs_overwrite(tmp_path, capsys, tiny_hf_dir):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert run(capsys, "import-hf", tiny_hf_dir, ckpt)[0] == 0
    assert run(capsys, "export-hf", ckpt, out, "--max-shard-size", "100KB")[0] == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    (out / "config.json").write_text('{"edited": "by hand"}\n')
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}

    code, stdout, err = run(capsys, "export-hf", ckpt, out)
    assert code == 2 and stdout == ""
    assert err == (f"routeweaver: error: {out}: not empty; pass --overwrite to replace the "
                   "checkpoint files in it, or give a new directory\n")
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before

    # --overwrite: as before the flag existed, the export replaces the directory's checkpoint.
    code, _, err = run(capsys, "export-hf", ckpt, out, "--overwrite")
    assert (code, err) == (0, "")
    assert not list(out.glob("model-*.safetensors"))
    assert not (out / "model.safetensors.index.json").exists()
    assert "edited" not in (out / "config.json").read_text()
    assert sorted(tensors(out)) == sorted(tensors(tiny_hf_dir))


def test_errors_exit_2(tmp_path, capsys, tiny_hf_dir):
    missing = tmp_path / "missing"
    code, _, err = run(capsys, "export-hf", missing, tmp_path / "out")
    assert code == 2 and f"{missing}: no such checkpoint directory" in err
    code, _, err = run(capsys, "import-hf", missing, tmp_path / "ckpt")
    assert code == 2 and str(missing) in err and not (tmp_path / "ckpt").exists()
    # An existing step is refused before loading anything.
    assert run(capsys, "import-hf", tiny_hf_dir, tmp_path / "ckpt")[0] == 0
    code, _, err = run(capsys, "import-hf", tiny_hf_dir, tmp_path / "ckpt")
    assert code == 2 and "step 0 already exists" in err
    code, _, err = run(capsys, "export-hf", tmp_path / "ckpt", tmp_path / "out", "--step", 3)
    assert code == 2 and "available steps: [0]" in err
    # Usage errors come back as a code too (argparse's SystemExit does not escape main).
    assert run(capsys, "export-hf", "a", "b", "--max-shard-size", "2XB")[0] == 2
    assert run(capsys, "no-such-command")[0] == 2
    assert run(capsys, "--help")[0] == 0


@pytest.mark.slow
def test_truncated_checkpoint_is_one_line_and_orbax_leftovers_are_dropped(
        tmp_path, capsys, monkeypatch, tiny_hf_dir):
    """A failed array read makes orbax abandon its other reads, which report to
    sys.unraisablehook at any time until the process exits (tracebacks around the one-line
    error): the CLI drops exactly those reports; -v keeps them."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    ckpt = tmp_path / "ckpt"
    assert run(capsys, "import-hf", tiny_hf_dir, ckpt)[0] == 0
    truncate_arrays(ckpt / "0" / "params")
    hook = sys.unraisablehook
    for _ in range(3):
        code, stdout, err = run(capsys, "export-hf", ckpt, tmp_path / "out")
        gc.collect()  # the abandoned reads' coroutines report when collected
        assert (code, stdout) == (2, "")
        assert err.startswith(f"routeweaver: error: checkpoint {ckpt / '0'}: unreadable "
                              "(truncated or corrupt: ") and err.count("\n") == 1
    assert sys.unraisablehook is hook  # wrapped once, however often main() runs
    assert seen == [] and not (tmp_path / "out").exists()

    def report(message: str, obj: object = None) -> SimpleNamespace:
        return SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError(message),
                               exc_traceback=None, err_msg=None, object=obj)

    late, other, owned = (report("Event loop is closed"), report("something else"),
                          report("Event loop is closed", obj="not a coroutine"))
    for args in (late, other, owned):
        sys.unraisablehook(args)
    assert seen == [other, owned]
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    assert run(capsys, "-v", "export-hf", ckpt, tmp_path / "out")[0] == 2
    sys.unraisablehook(late)
    assert seen[-1] is late


@pytest.mark.parametrize("text, size", [
    ("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("100KB", 100_000), ("1GiB", 2**30),
    ("1.5kib", 1536), ("4096", 4096), ("10B", 10),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "2 XB", "-1GB", "0MB", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_parse_mesh():
    assert parse_mesh("1,-1,1") == (1, -1, 1)
    for bad in ("1,1", "a,b,c", "1,0,1", "1,-2,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mesh(bad)


@pytest.mark.integration
def test_console_script(tmp_path):
    script = Path(sys.executable).parent / "routeweaver"
    assert script.is_file(), "console script missing: pip install -e . (setup.cfg entry point)"
    help_run = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0, help_run.stderr
    assert "import-hf" in help_run.stdout and "export-hf" in help_run.stdout
    # The exit code of main() must reach the shell.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    fail = subprocess.run([script, "export-hf", tmp_path / "nope", tmp_path / "out"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert fail.returncode == 2
    assert fail.stderr.strip() == (f"routeweaver: error: {tmp_path / 'nope'}: "
                                   "no such checkpoint directory")


@pytest.mark.slow
def test_quickstart_runs_every_stage(tmp_path):
    """`routeweaver selfcheck`: exits 0 only if the HF export matches and no episode broke
    the protocol. The console script on 2 CPU devices, so the router is born sharded over
    both (on the suite's 8 fake devices the full-vocabulary router takes three times as long)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = subprocess.run([Path(sys.executable).parent / "routeweaver", "selfcheck", "--out",
                          tmp_path / "qs", "--max-new-tokens", "8", "--queries", "2",
                          "--repeats", "2"], capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "'fsdp': 2" in out
    for stage in ("tokenizer", "router", "orbax", "HF export", "sampler", "episodes"):
        assert stage in out
    assert (tmp_path / "qs" / "hf" / "config.json").is_file()
    assert (tmp_path / "qs" / "checkpoints" / "tokenizer" / "tokenizer.json").is_file()
