"""Where metrics go (rl/reports/run_log.py, rl/reports/run_plots.py): the JSONL record (nulls,
flushing, resume without duplicate steps), TensorBoard events read back from the file, the
plain progress lines, PNG plots and the first-vs-last summary table."""

import io
import json
import math
import re
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.image import imread
from rich.console import Console
from tensorboardX.proto import event_pb2

from jax_routeweaver.rl.reports.run_log import Progress, RunLogger, read_metrics
from jax_routeweaver.rl.reports.run_plots import plot_run, summary_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_events(tb_dir):
    """Every event in the TFRecord files under `tb_dir` (file order): each record is a u64
    length, its masked crc32, the serialized `Event`, and the data's masked crc32."""
    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            events.append(event)
            pos += 12 + length + 4
    return events


def scalars(tb_dir):
    return [(e.step, v.tag, v.simple_value) for e in read_events(tb_dir)
            for v in e.summary.value]


def steps(path):
    return [r["step"] for r in read_metrics(path)]


def test_jsonl_and_tensorboard(tmp_path):
    with RunLogger(tmp_path) as log:
        log.log(1, {"reward/mean": 0.5, "mode/share/single": np.float32(0.25)})
        log.log(2, {"reward/mean": float("nan"), "loss/kl": jnp.asarray(0.125),
                    "grad/norm": math.inf, "groups/mixing_forced_free": 0})
        # Flushed per line: readable while the logger is still open.
        assert steps(tmp_path) == [1, 2]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "reward/mean": 0.5, "mode/share/single": 0.25}
    assert json.loads(lines[1]) == {"step": 2, "reward/mean": None, "loss/kl": 0.125,
                                    "grad/norm": None, "groups/mixing_forced_free": 0.0}
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back[1]["reward/mean"]) and back[1]["loss/kl"] == 0.125
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    # Non-finite values are left out of TensorBoard.
    assert sorted(scalars(tmp_path / "tb")) == [
        (1, "mode/share/single", 0.25), (1, "reward/mean", 0.5), (2, "groups/mixing_forced_free",
                                                                 0.0), (2, "loss/kl", 0.125)]


def test_truncate_after_and_resume(tmp_path):
    with RunLogger(tmp_path) as log:
        for s in range(1, 6):
            log.log(s, {"x": float(s)})
        log.truncate_after(3)
        assert steps(tmp_path) == [1, 2, 3]
        log.log(4, {"x": 40.0})
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 3.0, 40.0]
    # The reopened TensorBoard writer purges steps >= 4 (a SessionLog START at step 4).
    starts = [e.step for e in read_events(tmp_path / "tb")
              if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [4]

    # A killed run left steps up to 4 and a torn line; the resumed run restarts at step 3.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "x"')
    with RunLogger(tmp_path, resume=True) as log:
        log.log(3, {"x": 30.0})
        log.log(4, {"x": 41.0})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 41.0)]

    # A fresh run replaces the record (and tells TensorBoard to hide the old events).
    with RunLogger(tmp_path) as log:
        log.log(1, {"x": -1.0})
    assert steps(tmp_path) == [1]
    events = read_events(tmp_path / "tb")
    assert any(e.HasField("session_log") and e.step == 0 for e in events)


def test_logger_options_and_errors(tmp_path):
    with RunLogger(tmp_path / "j", tensorboard=False) as log:
        log.log(1, {"a": 1.0})
        with pytest.raises(ValueError, match="reserved"):
            log.log(2, {"step": 3.0})
    assert not (tmp_path / "j" / "tb").exists() and steps(tmp_path / "j") == [1]
    with RunLogger(tmp_path / "t", jsonl=False) as log:
        log.log(1, {"a": 1.0})
        log.truncate_after(0)
    assert not (tmp_path / "t" / "metrics.jsonl").exists()
    assert scalars(tmp_path / "t" / "tb") == [(1, "a", 1.0)]
    with pytest.raises(ValueError, match="closed"):
        log.log(2, {"a": 2.0})


def test_read_metrics_torn_and_corrupt_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": null}\n\n{"step": 2, "a": 1}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)


METRICS = {"reward/mean": 0.41, "mode/share_free/single": 0.4,
           "mode/share_free/multi": 0.35, "mode/share_free/agentic": 0.25}


def test_progress_plain_lines():
    buf = io.StringIO()
    with Progress(60, start=10, console=Console(file=buf)) as progress:
        assert not progress.live  # not a terminal
        progress.update(11, METRICS)
        progress.update(12, {"reward/mean": -0.125, "mode/share/single": 1.0,
                             "mode/share/multi": 0.0, "mode/share/agentic": 0.0})
        progress.update(13, {})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"step 11/60 · reward 0\.41 · S 40% M 35% A 25% · eta \d+:\d\d",
                        lines[0])
    assert lines[1].startswith("step 12/60 · reward -0.12 · S 100% M 0% A 0% · eta ")
    assert lines[2].startswith("step 13/60 · eta ")
    # Disabled on a terminal: still plain lines.
    buf = io.StringIO()
    with Progress(5, enabled=False, console=Console(file=buf, force_terminal=True)) as p:
        p.update(1, METRICS)
    assert buf.getvalue().startswith("step 1/5 · reward 0.41 · S 40% M 35% A 25%")


def test_progress_live_bar():
    buf = io.StringIO()
    with Progress(60, start=10, console=Console(file=buf, force_terminal=True,
                                                width=150)) as p:
        assert p.live
        p.update(12, METRICS)
    assert "step 12/60 · reward 0.41 · S 40% M 35% A 25%" in buf.getvalue()


def run_records(n=24):
    records = []
    for s in range(1, n + 1):
        r = {"step": s, "reward/mean": 0.1 * s, "reward/by_domain/MATH": 0.5 if s <= 10 else 0.8,
             "mode/share_free/single": 0.6, "mode/share_free/multi": 0.3,
             "mode/share_free/agentic": 0.1, "mode/share_by_domain/MATH/single": 0.5,
             "mode/share_by_domain/MATH/multi": 0.5, "mode/share_by_domain/MATH/agentic": 0.0}
        if s % 3:  # RECALL not sampled every step
            r["reward/by_domain/RECALL"] = -0.5
        if s == 5:
            r["reward/mean"] = float("nan")
        if s > 4:
            r["loss/total"] = 1.0 / s
        records.append(r)
    return records


def test_plot_run(tmp_path):
    paths = plot_run(run_records(), tmp_path / "plots")
    assert [p.name for p in paths] == ["reward.png", "mode_shares.png", "loss.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC
        image = imread(p)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    # No loss keys, or nothing at all: no loss plot, and no failure.
    records = [{k: v for k, v in r.items() if not k.startswith("loss/")} for r in run_records()]
    assert [p.name for p in plot_run(records, tmp_path / "a")] == ["reward.png",
                                                                   "mode_shares.png"]
    assert [p.name for p in plot_run([], tmp_path / "b")] == ["reward.png", "mode_shares.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in (tmp_path / "b").iterdir())


def test_summary_table():
    records = run_records(20)
    records[-1]["mode/share_by_domain/KNOWLEDGE/single"] = 1.0  # shares but no reward
    buf = io.StringIO()
    Console(file=buf, width=200).print(summary_table(records, first=10, last=10))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in buf.getvalue().splitlines() if line.count("│") == 8}
    assert list(rows) == ["MATH", "KNOWLEDGE", "RECALL", "all"]  # Domain order, then all
    assert rows["MATH"] == ["0.500", "0.800", "+0.300", "50.0%", "50.0%", "0.0%"]
    assert rows["RECALL"] == ["-0.500", "-0.500", "+0.000", "–", "–", "–"]
    assert rows["KNOWLEDGE"] == ["–", "–", "–", "100.0%", "–", "–"]
    # reward/mean 0.1·step: steps 1-10 without the NaN at step 5 -> 5.0/9; 11-20 -> 1.55.
    assert rows["all"] == ["0.556", "1.550", "+0.994", "60.0%", "30.0%", "10.0%"]
