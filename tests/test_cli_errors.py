"""User errors of ``largebatch train`` and ``largebatch study``: one line on stderr naming
the command and the value, exit status 2, no traceback; missing extras; a failing plot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import user_error

from largebatch.cli import main as cli
from largebatch.fashion_mnist import FASHION_MNIST_FILES, fashion_mnist_dir

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = ["train", "--recipe", "fmnist-sgd-128", "--subset", "2048", "--epochs", "1"]


def _image_tree(root, counts: dict[str, int]) -> None:
    from PIL import Image

    rng = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for cls, n in counts.items():
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8, generator=rng)
                Image.fromarray(pixels.numpy()).save(root / split / cls / f"{i}.png")


def test_corrupt_fashion_mnist_fails_its_checksum(tmp_path, capsys):
    for name in FASHION_MNIST_FILES:
        shutil.copy(fashion_mnist_dir() / name, tmp_path / name)
    target = tmp_path / "train-labels-idx1-ubyte.gz"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    line = user_error([*TINY, "--data", str(tmp_path), "--out", str(tmp_path / "out")], capsys)
    assert f"Checksum mismatch for {target}: sha256 " in line, line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "nan"], "invalid --lr nan (must be a finite number > 0)"),
        (["--lr", "-1"], "invalid --lr -1.0 (must be a finite number > 0)"),
        (["--device", "tpu"], "invalid --device 'tpu' (cpu, cuda or cuda:N)"),
        (["--workers", "-1"], "invalid --workers -1 (must be >= 0)"),
    ],
)
def test_bad_flag_values(tmp_path, capsys, flags, message):
    line = user_error([*TINY, *flags, "--out", str(tmp_path)], capsys)
    assert line == f"largebatch train: {message}"
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_device_cuda_without_a_gpu(tmp_path, capsys):
    line = user_error([*TINY, "--device", "cuda", "--out", str(tmp_path)], capsys)
    assert "--device cuda: no CUDA GPU is available here" in line, line


def test_an_image_folder_class_without_images(tmp_path, capsys):
    _image_tree(tmp_path / "tree", {"a": 1, "b": 1})
    for image in (tmp_path / "tree" / "train" / "b").iterdir():
        image.unlink()
    line = user_error(
        [
            "train",
            "--recipe",
            "alexnet-bn-lars-8k",
            "--data",
            str(tmp_path / "tree"),
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert f"ImageFolder tree {tmp_path / 'tree' / 'train'}: Found no valid file for the classes b" in line, (
        line
    )


def test_an_unreadable_image_is_named(tmp_path, capsys):
    _image_tree(tmp_path / "tree", {"a": 2, "b": 2})
    broken = tmp_path / "tree" / "train" / "b" / "1.png"
    broken.write_bytes(b"not a png")  # in the first (and only) batch: no step runs
    line = user_error(
        [
            "train",
            "--recipe",
            "alexnet-bn-lars-8k",
            "--data",
            str(tmp_path / "tree"),
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--workers",
            "0",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert line.startswith(f"largebatch train: cannot read image {broken}: "), line


def test_an_unwritable_out_is_refused_before_the_data_loads(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    # The data folder is missing too: the --out check comes first.
    line = user_error([*TINY, "--data", str(tmp_path / "absent"), "--out", str(out)], capsys)
    assert line == f"largebatch train: cannot create --out {out}: Not a directory"


def test_study_with_a_missing_data_folder(tmp_path, capsys):
    line = user_error(
        ["study", "--quick", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "out")], capsys
    )
    assert line == f"largebatch study: data directory not found: {tmp_path / 'absent'}"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_user_error_in_a_subprocess_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "largebatch", *TINY, "--device", "tpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc
    assert proc.stderr == "largebatch train: invalid --device 'tpu' (cpu, cuda or cuda:N)\n"


def test_missing_matplotlib_is_named_before_any_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as with largebatch[torch] only
    line = user_error([*TINY, "--out", str(tmp_path)], capsys)
    assert line == ("largebatch train: needs matplotlib, not installed: pip install 'largebatch[recipes]'")
    assert not list(tmp_path.iterdir())
    line = user_error(["study", "--quick", "--out", str(tmp_path / "study")], capsys)
    assert line == ("largebatch study: needs matplotlib, not installed: pip install 'largebatch[recipes]'")


def test_a_failing_plot_is_a_warning_and_the_run_keeps_its_outputs(tmp_path, capsys, monkeypatch):
    from largebatch import plots

    def broken_plot(*args, **kwargs):
        raise RuntimeError("no display backend")

    monkeypatch.setattr(plots, "plot_history", broken_plot)
    # 256 images: 2 steps an epoch
    assert cli([*TINY, "--subset", "256", "--epochs", "2", "--out", str(tmp_path)]) == 0
    stderr = capsys.readouterr().err
    assert stderr.count("warning: no plot written") == 1, stderr  # once, not every epoch
    assert "RuntimeError: no display backend" in stderr and "Traceback" not in stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epochs"] == 2
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["epoch"] == 2
    assert not (tmp_path / "plot.png").exists()


def test_study_report_without_a_study_in_out(tmp_path, capsys):
    """``--report`` reads the study's settings from OUT; without them, one line saying what
    is missing, and nothing written."""
    absent = tmp_path / "absent"
    line = user_error(["study", "--report", "--out", str(absent)], capsys)
    assert line == f"largebatch study: --report: {absent} holds no study: no such folder"
    assert not absent.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    line = user_error(["study", "--report", "--out", str(empty)], capsys)
    assert line == (
        f"largebatch study: --report: {empty} holds no study: neither "
        "settings.json nor a finished run in runs.jsonl"
    )
    (empty / "settings.json").write_text('{"quick": true, "batches": [1000]}')
    line = user_error(["study", "--report", "--out", str(empty)], capsys)
    assert line == (
        f"largebatch study: --report: cannot read the study's settings from "
        f"{empty / 'settings.json'}: Invalid batch 1000: the study's recipes cover "
        "128, 384, 1536, 3072"
    )
    assert sorted(p.name for p in empty.iterdir()) == ["settings.json"]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"lr_factors": ["a"]}, "Invalid lr_factors: 'a' (must be a finite number > 0)"),
        ({"lr_factors": [0.0]}, "Invalid lr_factors: 0.0 (must be a finite number > 0)"),
        (
            {"lr_factors": [3]},
            "Invalid lr_factors: 3 (each must be a power of 2: the grid steps by factors of 2)",
        ),
        ({"lr_factors": []}, "Invalid lr_factors: [] (must be a non-empty list)"),
        ({"batches": 1536}, "Invalid batches: 1536 (must be a non-empty list)"),
        ({"quick": "no"}, "Invalid quick: 'no' (must be True or False)"),
        ({"ablate": "no"}, "Invalid ablate: 'no' (must be True or False)"),
        ({"scale_warmups": 0}, "Invalid scale_warmups: 0 (must be True or False)"),
        ({"time_to_accuracy": None}, "Invalid time_to_accuracy: None (must be True or False)"),
        ({"large_warmups": ["a"]}, "Invalid large_warmups: 'a' (must be a finite number >= 0)"),
        ({"label_smoothing": "0.1"}, "Invalid label_smoothing: '0.1' (must be a finite number >= 0)"),
        ({"extend": "2"}, "Invalid extend: '2' (must be an integer >= 0)"),
        ({"target": "0.9"}, "Invalid target: '0.9' (must be a finite number > 0 and <= 1)"),
        ({"only": [[1536]]}, "Invalid only: [[1536]] (must be null or a list of [batch, optimizer] pairs)"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else "",
)
def test_a_malformed_settings_field_is_one_line_for_report_and_compare(tmp_path, capsys, setting, message):
    """Every field of a study folder's ``settings.json`` is checked before anything uses it:
    ``--report`` and ``--compare`` answer a bad one in one line, exit status 2."""
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / "settings.json").write_text(json.dumps(setting))
    reason = f"cannot read the study's settings from {folder / 'settings.json'}: {message}"
    line = user_error(["study", "--report", "--out", str(folder)], capsys)
    assert line == f"largebatch study: --report: {reason}"
    line = user_error(["study", "--compare", str(folder), str(folder)], capsys)
    assert line == f"largebatch study: --compare: {reason}"
    assert sorted(p.name for p in folder.iterdir()) == ["settings.json"]


def test_a_closed_output_pipe_ends_the_command_quietly(monkeypatch):
    """``largebatch recipes | head -1``: the reader goes away; the command ends with the
    status of a process killed by SIGPIPE (141), not a traceback."""
    import io

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert cli(["recipes"]) == 141


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_study_on_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["study", "--quick", "--device", "cuda", "--out", str(tmp_path / "s")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "largebatch study: --device cuda: no CUDA GPU is available here "
        "(torch.cuda.is_available() is False); use --device cpu\n"
    )
    assert not (tmp_path / "s").exists()
