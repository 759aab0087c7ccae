#!/usr/bin/env python3
"""Turn a raw public training log into the corpus's normalised form: one gzip CSV per log.

    python3 tests/data/real-logs/normalize.py RAW [RAW ...] -o NAME.csv.gz [--format FORMAT]

RAW is a local file that the person running this downloaded (SOURCES.md says from where). Standard
library only. The output is `step[,segment],loss[,grad_norm][,step_time_ms][,lr][,mem_allocated_mb]
[,val_loss][,extra ...]`, with only the columns the source has. An empty cell means the source did
not record that value at that step; the literal `nan` means the source itself said nan. Numbers are
the source's own text where the source prints them; derived ones (a step time from a cumulative
timer, MB from bytes, ms from s) are computed and written with Python's shortest repr.

Steps ascend within a segment. A new segment starts with each further RAW file (a resumed run's
second log) and wherever a log's step goes back, or a step repeats a value already recorded for it
(a restart inside one file); a `segment` column (0, 1, ...) is written only when there is more
than one. The gzip stream has no name and mtime 0, so the same input gives the same bytes.

Formats (detected from the content; `--format` forces one):

- `modded-nanogpt`: KellerJordan/modded-nanogpt records, lines `step:N/T train_loss:X
  train_time:Yms step_avg:...` and `step:N/T val_loss:X train_time:...` (train_time also as
  `Ys`). train_loss -> loss, val_loss -> val_loss. train_time is the cumulative training time with
  validation excluded (the timer stops for it); step_time_ms is its increase since the previous
  line that carried it, per step. When it goes down the timer was reset (modded-nanogpt restarts it
  after step 10) and the step's own value is its time since the reset. The first line that carries
  a train_time has no step time (a step 1 after a step-0 validation line has one: compilation).
- `llmc`: llm.c's main.log (also in modded-nanogpt's records): `s:N trl:X [lr:Y] [norm:Z]` and
  `s:N tel:X`. trl -> loss, lr -> lr, norm -> grad_norm, tel -> val_loss.
- `megatron-golden`: NVIDIA/Megatron-LM functional-test golden values, JSON
  `{"metric": {"start_step", "end_step", "step_interval", "values": {"step": value}}}`.
  `lm loss` -> loss, `iteration-time` (s) -> step_time_ms, `mem-allocated-bytes` ->
  mem_allocated_mb, `mem-max-allocated-bytes` -> mem_peak_mb, every other metric -> its name with
  non-alphanumerics as `_` (`num-zeros` -> num_zeros, `mtp_1 loss` -> mtp_1_loss). These files
  write "nan" for a value that was not logged at that step (iteration-time between log intervals,
  num-zeros before its first log, every metric after the run's last step or, in a resumed run's
  `_2nd` file, before its restart), so a "nan" there is an empty cell, and a step with no value
  left has no row. (Megatron does not put a nan loss into these series: it counts nan iterations.)
- `deepspeed-chat-rlhf`: DeepSpeed-Chat step-3 logs, `epoch: E|step: N|ppo_ep: P|act_loss: X|
  cri_loss: Y|unsuper_loss: Z`, then `average reward score: R` and `|E2E latency=Ts |...`.
  act_loss -> loss, cri_loss, unsuper_loss, reward as extras, E2E latency -> step_time_ms (the
  whole PPO step: generation and training).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

CORE = ("loss", "grad_norm", "step_time_ms", "lr", "mem_allocated_mb", "val_loss")
Record = tuple[int, str, str]  # (step, column, cell text)

# -- formats -------------------------------------------------------------------------------------
MODDED_LINE = re.compile(r"^step:(\d+)/\d+ (.*)$")
LLMC_LINE = re.compile(r"^s:(\d+) (.*)$")
LLMC_KEYS = {"trl": "loss", "tel": "val_loss", "lr": "lr", "norm": "grad_norm"}
RLHF_LINE = re.compile(
    r"^epoch: \d+\|step: (\d+)\|ppo_ep: \d+\|act_loss: (\S+)\|cri_loss: (\S+)\|unsuper_loss: (\S+)"
)
RLHF_REWARD = re.compile(r"^average reward score: (\S+)")
RLHF_LATENCY = re.compile(r"E2E latency=([0-9.]+)s")
GOLDEN_NAMES = {
    "lm loss": ("loss", 1.0),
    "iteration-time": ("step_time_ms", 1000.0),
    "mem-allocated-bytes": ("mem_allocated_mb", 1.0 / 2**20),
    "mem-max-allocated-bytes": ("mem_peak_mb", 1.0 / 2**20),
}


def fmt(value: float) -> str:
    """A derived number as text: integers without a point, others in their shortest repr."""
    if math.isnan(value):
        return "nan"
    value = round(value, 6)  # float noise of a derivation (452.00000000000006 ms) is not data
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _ms(token: str) -> float:
    return float(token[:-2]) if token.endswith("ms") else float(token.removesuffix("s")) * 1000.0


def parse_modded(lines: Iterable[str]) -> Iterator[Record]:
    last_ms: float | None = None  # cumulative train_time of the previous line that had one
    last_step: int | None = None  # ... and its step
    for line in lines:
        m = MODDED_LINE.match(line.strip())
        if not m:
            continue
        step = int(m.group(1))
        fields = dict(kv.split(":", 1) for kv in m.group(2).split() if ":" in kv)
        if "train_loss" in fields:
            yield step, "loss", fields["train_loss"]
        if "val_loss" in fields:
            yield step, "val_loss", fields["val_loss"]
        if "train_time" not in fields:
            continue
        cum = _ms(fields["train_time"])
        if "train_loss" in fields and last_ms is not None and last_step is not None and step > last_step:
            # Went down: the timer was reset, and what it shows is this step's time since then.
            own = (cum - last_ms) / (step - last_step) if cum >= last_ms else cum
            yield step, "step_time_ms", fmt(own)
        last_ms, last_step = cum, step


def parse_llmc(lines: Iterable[str]) -> Iterator[Record]:
    for line in lines:
        m = LLMC_LINE.match(line.strip())
        if not m:
            continue
        step = int(m.group(1))
        for kv in m.group(2).split():
            key, _, value = kv.partition(":")
            if key in LLMC_KEYS and value:
                yield step, LLMC_KEYS[key], value


def parse_rlhf(lines: Iterable[str]) -> Iterator[Record]:
    step: int | None = None
    for line in lines:
        m = RLHF_LINE.match(line.strip())
        if m:
            step = int(m.group(1))
            yield step, "loss", m.group(2)
            yield step, "cri_loss", m.group(3)
            yield step, "unsuper_loss", m.group(4)
            continue
        if step is None:
            continue
        if r := RLHF_REWARD.match(line.strip()):
            yield step, "reward", r.group(1)
        elif lat := RLHF_LATENCY.search(line):
            yield step, "step_time_ms", fmt(float(lat.group(1)) * 1000.0)
            step = None  # the latency line closes the step


def _golden_column(metric: str) -> tuple[str, float]:
    if metric in GOLDEN_NAMES:
        return GOLDEN_NAMES[metric]
    return re.sub(r"[^0-9a-z]+", "_", metric.lower()).strip("_"), 1.0


def parse_golden(text: str) -> Iterator[Record]:
    data = json.loads(text)
    cells: dict[int, dict[str, str]] = {}
    for metric, series in data.items():
        if not isinstance(series, dict) or not isinstance(series.get("values"), dict):
            continue
        column, scale = _golden_column(metric)
        for step_text, raw in series["values"].items():
            value = float(raw)  # "nan" (text) and numbers alike
            if not math.isnan(value):  # "nan": not logged at this step
                cells.setdefault(int(step_text), {})[column] = fmt(value * scale)
    for step in sorted(cells):
        for column, value in cells[step].items():
            yield step, column, value


def detect(text: str) -> str:
    head = text.lstrip()[:1]
    if head == "{":
        return "megatron-golden"
    for line in text.splitlines():
        line = line.strip()
        if MODDED_LINE.match(line):
            return "modded-nanogpt"
        if LLMC_LINE.match(line):
            return "llmc"
        if RLHF_LINE.match(line):
            return "deepspeed-chat-rlhf"
    raise ValueError("no supported log format found (see the docstring for the formats)")


PARSERS: dict[str, Callable[[str], Iterable[Record]]] = {
    "modded-nanogpt": lambda text: parse_modded(text.splitlines()),
    "llmc": lambda text: parse_llmc(text.splitlines()),
    "megatron-golden": parse_golden,
    "deepspeed-chat-rlhf": lambda text: parse_rlhf(text.splitlines()),
}


# -- table ---------------------------------------------------------------------------------------
class Table:
    """Rows keyed (segment, step), in the order first seen; columns in the order first seen."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], dict[str, str]] = {}
        self.columns: list[str] = []
        self.segment = -1
        self._last_step: int | None = None

    def new_segment(self) -> None:
        self.segment += 1
        self._last_step = None

    def add(self, step: int, column: str, value: str) -> None:
        if self._last_step is not None and step < self._last_step:
            self.new_segment()  # the step went back: a restart inside the log
        row = self.rows.get((self.segment, step))
        if row is not None and column in row and row[column] != value:
            self.new_segment()  # the step repeats with a new value: a restart at the same step
            row = None
        if row is None:
            row = self.rows[(self.segment, step)] = {}
        row[column] = value
        self._last_step = step
        if column not in self.columns:
            self.columns.append(column)

    def csv_text(self) -> str:
        if "loss" not in self.columns:
            raise ValueError("the log has no loss column")
        columns = [c for c in CORE if c in self.columns] + [c for c in self.columns if c not in CORE]
        segmented = len({seg for seg, _ in self.rows}) > 1
        out = io.StringIO()
        out.write(",".join(["step", *(["segment"] if segmented else []), *columns]) + "\n")
        for (segment, step), row in sorted(self.rows.items()):
            cells = [str(step), *([str(segment)] if segmented else []), *(row.get(c, "") for c in columns)]
            out.write(",".join(cells) + "\n")
        return out.getvalue()


def normalize(texts: Iterable[str], fmt_name: str = "auto") -> str:
    """The normalised CSV text of one log given as one or more raw texts (each a segment)."""
    table = Table()
    for text in texts:
        table.new_segment()
        name = detect(text) if fmt_name == "auto" else fmt_name
        for step, column, value in PARSERS[name](text):
            table.add(step, column, value)
    return table.csv_text()


def write_gzip(text: str, path: Path) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode())
    path.write_bytes(buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="+", type=Path, help="raw log file(s); several: one segment each")
    parser.add_argument("-o", "--output", type=Path, required=True, help="NAME.csv.gz to write")
    parser.add_argument("--format", default="auto", choices=["auto", *PARSERS])
    args = parser.parse_args(argv)
    text = normalize((p.read_text(encoding="utf-8", errors="replace") for p in args.raw), args.format)
    write_gzip(text, args.output)
    rows = text.count("\n") - 1
    print(f"{args.output}: {rows} rows, columns {text.splitlines()[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
