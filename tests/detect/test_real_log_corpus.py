"""The real-log corpus (tests/data/real-logs): what it holds, that it is what normalize.py writes, and
that every log replays through every detector without an error. Which anomalies the detectors find
is the report's business (`python -m tests.detect.real_logs`), not asserted here."""

from __future__ import annotations

import gzip
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.detect import real_log_report
from tests.detect.real_logs import ALL_KINDS, CORPUS, corpus_logs, read_log, run_log

MAX_BYTES = 5_000_000
EXCLUDED = ("valueembed", "mixtral_8x7b")  # kept for an independent check
PERMISSIVE = ("MIT", "BSD-3-Clause", "Apache-2.0", "CC-BY")
LOGS = corpus_logs()
SOURCES = CORPUS / "SOURCES.md"
ENTRY = re.compile(r"^### `([^`]+\.csv\.gz)`", re.MULTILINE)


def _normalize() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_logs_normalize", CORPUS / "normalize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entries() -> dict[str, str]:
    """SOURCES.md's per-file sections: name -> its text."""
    text = SOURCES.read_text()
    heads = list(ENTRY.finditer(text))
    return {
        m.group(1): text[m.end() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        for i, m in enumerate(heads)
    }


def test_the_corpus_has_at_least_20_logs_within_5_mb() -> None:
    assert len(LOGS) >= 20
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total <= MAX_BYTES, f"{total} bytes under {CORPUS}"


def test_sources_names_every_file_and_every_named_file_exists() -> None:
    entries = _entries()
    assert sorted(entries) == sorted(p.name for p in LOGS)
    for name, text in entries.items():
        for field in ("repository", "commit", "path", "licence"):
            assert re.search(rf"^- {field}: \S", text, re.MULTILINE), (name, field)
        licence = re.search(r"^- licence: (.+)$", text, re.MULTILINE)
        assert licence and licence.group(1).startswith(PERMISSIVE), name


def test_no_excluded_source_is_in_the_corpus() -> None:
    for name, text in _entries().items():
        where = name.lower() + " ".join(re.findall(r"^- path: (.+)$", text, re.MULTILINE)).lower()
        assert not any(word in where for word in EXCLUDED), name
    for path in CORPUS.rglob("*"):
        assert not any(word in path.name.lower() for word in EXCLUDED), path


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_each_log_parses_with_a_loss_and_ascending_steps(path: Path) -> None:
    table = read_log(path)
    assert len(table) >= 100
    assert table.columns[0] == "loss"
    assert np.isfinite(table.values["loss"]).sum() >= 100
    seg = table.segments
    assert (np.diff(seg) >= 0).all(), "segments in order"
    same = np.diff(seg) == 0
    assert (np.diff(table.steps)[same] > 0).all(), "steps ascend within a segment"


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_each_file_is_gzip_as_normalize_writes_it(path: Path, tmp_path: Path) -> None:
    # The raw logs are not in the repository (SOURCES.md says where they are); what can be checked
    # here is that the bytes are normalize.py's own gzip of the CSV text.
    raw = path.read_bytes()
    assert raw[:4] == b"\x1f\x8b\x08\x00" and raw[4:8] == b"\x00\x00\x00\x00", "no name, mtime 0"
    out = tmp_path / path.name
    _normalize().write_gzip(gzip.decompress(raw).decode(), out)
    assert out.read_bytes() == raw


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_each_log_replays_through_every_detector(path: Path) -> None:
    # run_log calls the detectors directly: an exception fails the test instead of switching the
    # detector off as the engine would.
    anomalies = run_log(path, ALL_KINDS)
    assert all(a.kind in ALL_KINDS for a in anomalies)


# -- the normaliser on a few lines of each format ----------------------------------------------
def test_normalize_modded_nanogpt_step_times_from_the_cumulative_timer() -> None:
    lines = [
        "step:0/20 val_loss:10.8258 train_time:300ms step_avg:nanms",
        "step:1/20 train_loss:10.8 train_time:20300ms step_avg:nanms",
        "step:2/20 train_loss:9.5 train_time:20450ms step_avg:nanms",
        "step:3/20 train_loss:9.1 train_time:140ms step_avg:nanms",  # the timer was reset
        "step:4/20 train_loss:8.9 train_time:290ms step_avg:145.00ms",
        "step:4/20 val_loss:8.7 train_time:300ms step_avg:150.00ms",
        "step:5/20 train_loss:8.8 train_time:0.452s step_avg:150.67ms",
    ]
    assert _normalize().normalize(["\n".join(lines)]) == (
        "step,loss,step_time_ms,val_loss\n0,,,10.8258\n1,10.8,20000,\n2,9.5,150,\n3,9.1,140,\n"
        "4,8.9,150,8.7\n5,8.8,152,\n"
    )


def test_normalize_llmc() -> None:
    text = "s:0 tel:10.9\ns:0 trl:10.96 lr:0.000001 norm:15.37\ns:1 trl:10.81 lr:0.000002 norm:15.2\n"
    assert _normalize().normalize([text]) == (
        "step,loss,grad_norm,lr,val_loss\n0,10.96,15.37,0.000001,10.9\n1,10.81,15.2,0.000002,\n"
    )


def test_normalize_megatron_golden_values_and_a_resumed_second_file() -> None:
    first = (
        '{"lm loss": {"start_step": 1, "end_step": 3, "step_interval": 1, "values": '
        '{"1": 10.5, "2": 10.4, "3": "nan"}}, "iteration-time": {"start_step": 1, "end_step": 3, '
        '"step_interval": 1, "values": {"1": "nan", "2": 0.25, "3": "nan"}}, "mem-allocated-bytes": '
        '{"start_step": 1, "end_step": 3, "step_interval": 1, "values": {"1": 1048576.0, "2": 1572864.0, '
        '"3": "nan"}}}'
    )
    second = (
        '{"lm loss": {"start_step": 1, "end_step": 3, "step_interval": 1, "values": '
        '{"1": "nan", "2": 10.41, "3": 10.3}}, "num-zeros": {"start_step": 1, "end_step": 3, '
        '"step_interval": 1, "values": {"1": "nan", "2": 12.0, "3": 10.0}}}'
    )
    assert _normalize().normalize([first, second]) == (
        "step,segment,loss,step_time_ms,mem_allocated_mb,num_zeros\n"
        "1,0,10.5,,1,\n2,0,10.4,250,1.5,\n2,1,10.41,,,12\n3,1,10.3,,,10\n"
    )


def test_normalize_deepspeed_chat_rlhf_and_a_restart_inside_one_file() -> None:
    step = "epoch: 0|step: {}|ppo_ep: 1|act_loss: {}|cri_loss: 0.1|unsuper_loss: 0.0"
    lines = [
        step.format(0, 0.2),
        "average reward score: -0.5",
        "|E2E latency=7.99s |Gather latency=0.00s (0.00%) |Generate time=5.26s",
        step.format(1, -0.1),
        "|E2E latency=3.73s |Gather latency=0.00s (0.00%)",
        step.format(0, 0.3),  # the step went back: a second run in the same file
    ]
    assert _normalize().normalize(["\n".join(lines)]) == (
        "step,segment,loss,step_time_ms,cri_loss,unsuper_loss,reward\n"
        "0,0,0.2,7990,0.1,0.0,-0.5\n1,0,-0.1,3730,0.1,0.0,\n0,1,0.3,,0.1,0.0,\n"
    )


def test_normalize_refuses_a_log_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="no supported log format"):
        _normalize().normalize(["epoch 1 loss 2.3\n"])


def test_the_report_prints_each_log_its_anomalies_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert real_log_report.main(["--context", "2", "resume_torch_dist", "deepspeed-chat"]) == 0
    out = capsys.readouterr().out
    assert "## megatron_gpt3_mcore_te_tp2_pp2_resume_torch_dist_golden_values_dev_dgx_h100_and_2nd" in out
    assert "- steps: 1..100, 150 rows, 2 segments" in out
    assert "- columns: loss, step_time_ms, cri_loss, unsuper_loss, reward" in out
    assert "## Summary" in out
