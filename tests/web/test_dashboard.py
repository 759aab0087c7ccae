"""The built-in dashboard in a real browser: Chromium driven by playwright-core (web/tests/dashboard.mjs)
against a real collector (`stepwatch-server serve` on loopback) fed by the demo's code with a simulated
run holding a straggler and a loss spike.

One browser session checks everything the issue names, in order, and reports JSON; each test below
asserts one behaviour of that report. Screenshots go to artifacts/screenshots/ (kept by CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from itertools import islice
from typing import Any

import pytest

from stepwatch_server.demo import Client, Feeder
from stepwatch_server.simulate import LossSpike, Scenario, Simulation, Straggler
from stepwatch_server.simulate.scenario import DEFAULT_MODULES
from stepwatch_server.web.pages import INDEX
from tests.e2e.conftest import Collector, free_port
from tests.web.browser import CHROMIUM, SCREENSHOTS, WEB, require_browser

SCRIPT = WEB / "tests" / "dashboard.mjs"
RUN = "dashboard-demo"
HEALTHY_RUN = "healthy-baseline"  # a second, clean run: the runs page tells the two apart
STRAGGLER_RANK = 11
SPIKE_STEP = 800
STEPS = 1200
LIVE_FROM_STEP = 1100  # fed after the page has loaded: these steps must arrive live
EVAL_EVERY = 500  # an evaluation after steps 500 and 1000
BROWSER_TIMEOUT_S = 150.0
SCENARIO = Scenario(
    "dashboard",
    16,
    STEPS,
    seed=7,
    faults=(Straggler(STRAGGLER_RANK, 400, factor=1.3), LossSpike(SPIKE_STEP, magnitude=1.8)),
    flush_interval_s=20.0,  # fewer, larger batches: the run is fed in a few seconds
    eval_every=EVAL_EVERY,  # evaluations in `watch.phase("eval")`: marked on the charts
    eval_s=5.0,
    modules=DEFAULT_MODULES
    + tuple(f"layers.{i}.mlp.fc2" for i in range(8, 14)),  # 12: more than the panel draws
)
HEALTHY = Scenario("healthy", 8, 300, seed=3, flush_interval_s=20.0)


def session_ends(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What each rank's agent sends at `watch.close()`: a last batch with a session_end event."""
    last: dict[int, dict[str, Any]] = {}
    for doc in docs:
        rank = last.setdefault(doc["rank"], {"doc": doc, "step": 0, "ts": 0.0})
        rank["doc"] = doc if doc["seq"] >= rank["doc"]["seq"] else rank["doc"]
        rank["step"] = max([rank["step"], *doc["steps"]])
        rank["ts"] = max([rank["ts"], *doc["timestamps"]])
    return [
        {
            **{k: v for k, v in r["doc"].items() if k in ("schema", "run", "session", "rank", "world_size")},
            "seq": r["doc"]["seq"] + 1,
            "steps": [],
            "timestamps": [],
            "events": [
                {"step": r["step"], "ts": r["ts"] + 0.1, "kind": "session_end", "data": {"reason": "close"}}
            ],
        }
        for r in last.values()
    ]


def _before_live(doc: dict[str, Any]) -> bool:
    return not doc.get("steps") or max(doc["steps"]) < LIVE_FROM_STEP


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_browser(INDEX)
    tmp = tmp_path_factory.mktemp("dashboard")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    collector = Collector(f"sqlite:///{tmp / 'stepwatch.db'}", free_port(), tmp / "collector.log").start()
    client = Client(collector.url)
    try:
        healthy = list(Simulation(HEALTHY))
        ends = session_ends(healthy)  # before sending: the feeder renames the sessions as it sends
        Feeder(client, HEALTHY_RUN).send(healthy + ends)  # a finished run: every rank closed its session
        feeder = Feeder(client, RUN)
        batches = iter(Simulation(SCENARIO))
        pending: list[dict[str, Any]] = []
        for doc in batches:
            if doc["steps"]:  # the user's own scalar, as `watch.log(eval_loss=...)` sends it
                doc["metrics"]["eval_loss"] = [3.0 - step / 1000 for step in doc["steps"]]
            if not _before_live(doc):
                pending.append(doc)
                break
            feeder.send([doc])
        feeder.wait_for_detection()
        env = {
            **os.environ,
            "STEPWATCH_URL": collector.url,
            "STEPWATCH_RUN": RUN,
            "CHROMIUM": CHROMIUM,
            "SCREENSHOTS": str(SCREENSHOTS),
        }
        with subprocess.Popen(
            ["node", str(SCRIPT)],
            cwd=WEB,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as browser:
            try:
                assert browser.stdout is not None and browser.stdin is not None
                ready = browser.stdout.readline()  # the script's own timeout bounds this wait
                if not ready:
                    raise AssertionError(
                        f"the browser script ended early: {browser.communicate(timeout=30)[1]}"
                    )
                feeder.send(pending + list(islice(batches, 8)))  # the next steps of a few ranks
                browser.stdin.write("fed\n")
                browser.stdin.flush()
                out, err = browser.communicate(timeout=BROWSER_TIMEOUT_S)
            finally:
                if browser.poll() is None:
                    browser.kill()
        assert browser.returncode == 0, f"dashboard.mjs failed ({browser.returncode}): {err[-3000:]}"
        done = json.loads(out.strip().splitlines()[-1])
        yield {"ready": json.loads(ready), **done}
    finally:
        client.close()
        collector.stop()


def test_runs_page_lists_the_run_with_a_warning_verdict(report: dict[str, Any]) -> None:
    runs = report["runsPage"]
    assert runs["verdict"] == "warning", runs
    assert "warning" in runs["text"] and "16" in runs["text"], runs  # the verdict in words, the world size
    assert runs["verdicts"] == {RUN: "warning", HEALTHY_RUN: "ok"}, runs


def test_a_finished_run_says_finished_and_for_how_long_not_a_step_rate(report: dict[str, Any]) -> None:
    pace = report["runsPage"]["pace"]
    assert pace[HEALTHY_RUN].startswith("finished after "), pace
    assert "steps/s" in pace[RUN] or "s/step" in pace[RUN], pace  # still running
    assert report["runsPage"]["livePills"] == [RUN], report["runsPage"]


def test_each_run_says_how_much_it_stores(report: dict[str, Any]) -> None:
    stored = report["runsPage"]["stored"]
    assert set(stored) == {RUN, HEALTHY_RUN}, stored
    assert all(re.fullmatch(r"[0-9.]+ (B|KB|MB|GB|TB)", text) for text in stored.values()), stored


def test_run_page_draws_every_chart(report: dict[str, Any]) -> None:
    painted = {c["name"]: c["painted"] for c in report["canvases"]}
    for metric in ("loss", "grad_norm", "lr", "time.step_ms", "eval_loss"):  # eval_loss: the user's own
        assert painted.get(metric, 0) > 0, (metric, report["canvases"])
    heatmaps = [c for c in report["canvases"] if "heatmap" in c["name"]]
    assert len(heatmaps) == 2 and all(c["painted"] > 0 for c in heatmaps), report["canvases"]
    amax = [c for c in report["canvases"] if "amax" in c["name"].lower()]
    assert amax and all(c["painted"] > 0 for c in amax), report["canvases"]


def test_the_amax_panel_draws_the_eight_modules_with_the_highest_amax_of_twelve(
    report: dict[str, Any],
) -> None:
    assert report["amax"]["note"] == "the 8 of 12 modules with the highest amax in this range (a NaN first)"
    assert len(report["amax"]["rows"]) == 8 and set(report["amax"]["rows"]) <= set(SCENARIO.modules)


def test_every_rank_of_a_16_rank_heatmap_is_labelled_and_the_memory_scale_is_not_stretched(
    report: dict[str, Any],
) -> None:
    """Only every 6th rank was labelled (a straggler's row sat next to another rank's label), and the
    memory scale spanned 367-370 MB, so normal drift looked like a leak."""
    by_label = {h["label"]: h for h in report["heatmaps"]}
    relative = next(h for label, h in by_label.items() if "peers" in label)
    assert relative["labelledRanks"] == 16, report["heatmaps"]
    memory = next(h for label, h in by_label.items() if "Memory" in label)
    assert memory["scaleHi"] - memory["scaleLo"] >= 0.05 * memory["scaleHi"] - 1e-9, memory


def test_the_default_heatmap_names_the_straggler_in_words(report: dict[str, Any]) -> None:
    heat = report["heatmaps"][0]
    assert heat["view"] == "time.late_ms" and heat["rank"] == str(STRAGGLER_RANK), heat
    assert f"Holding the run up most: rank {STRAGGLER_RANK}" in heat["summary"], heat


def test_evidence_is_labelled_in_words_not_snake_case(report: dict[str, Any]) -> None:
    labels = dict(report["evidenceLabels"])
    assert labels, report["evidenceLabels"]
    assert all("_" not in shown and shown[:1].isupper() for shown in labels.values()), labels
    assert any(key.endswith("_ms") and shown.endswith("(ms)") for key, shown in labels.items()) or not any(
        key.endswith("_ms") for key in labels
    ), labels


def test_the_charts_mark_each_evaluation_the_user_wrapped_in_a_phase(report: dict[str, Any]) -> None:
    assert report["phaseMarks"] == len(range(EVAL_EVERY, LIVE_FROM_STEP, EVAL_EVERY)), report["phaseMarks"]


def test_anomaly_list_names_the_straggler_rank_and_the_spike_step(report: dict[str, Any]) -> None:
    by_kind = {a["kind"]: a for a in report["anomalies"]}
    straggler = by_kind["straggler"]
    assert straggler["rank"] == STRAGGLER_RANK and f"rank {STRAGGLER_RANK}" in straggler["text"], straggler
    spike = by_kind["loss_spike"]
    assert abs(spike["firstStep"] - SPIKE_STEP) <= 2 and f"step {SPIKE_STEP:,}" in spike["text"], spike
    assert all(a["severityText"].split()[-1] in {"info", "warning", "critical"} for a in report["anomalies"])


def test_clicking_the_spike_zooms_every_chart_to_it(report: dict[str, Any]) -> None:
    zoom = report["zoom"]
    assert len(zoom["after"]) >= 5, zoom  # the four curves and amax
    for lo, hi in zoom["after"]:
        assert lo <= SPIKE_STEP <= hi and hi - lo <= STEPS / 5, zoom
    assert all(hi - lo > STEPS / 2 for lo, hi in zoom["before"]), zoom
    assert "#anomaly=" in zoom["url"], zoom  # the zoomed view has an address, and opening it zooms there
    assert report["permalink"] and all(
        lo <= SPIKE_STEP <= hi < lo + STEPS / 5 for lo, hi in report["permalink"]
    )
    assert f"highlighting rank {STRAGGLER_RANK}" in report["highlight"], report["highlight"]


def test_an_anomaly_link_opened_ten_times_zooms_every_chart_and_both_heatmaps_each_time(
    report: dict[str, Any],
) -> None:
    """A slow full-range heatmap answer no longer overwrites the zoomed one (answers for another range are
    dropped): every time, both heatmaps cover only the steps the charts show."""
    assert len(report["reopened"]) == 10
    for view in report["reopened"]:
        assert view["charts"] and all(lo <= SPIKE_STEP <= hi < lo + STEPS / 5 for lo, hi in view["charts"]), (
            view
        )
        lo, hi = view["charts"][0]
        assert len(view["heatmaps"]) == 2, view
        for first, last in view["heatmaps"]:
            assert lo - STEPS / 50 <= first <= SPIKE_STEP <= last <= hi + STEPS / 50, view


def test_a_new_step_arrives_live_within_two_seconds(report: dict[str, Any]) -> None:
    live = report["live"]
    assert live["after"] is not None, live
    assert live["after"]["shown"] >= LIVE_FROM_STEP > live["before"], live
    assert live["ms"] < 2000, live


def test_no_console_errors_and_no_request_leaves_loopback(report: dict[str, Any]) -> None:
    assert report["consoleErrors"] == [], report["consoleErrors"]
    assert report["blocked"] == [], report["blocked"]
    assert report["requests"] and any("/api/v1/stream" in url for url in report["requests"])


def test_screenshots_are_saved(report: dict[str, Any]) -> None:
    for name in ("runs.png", "run.png", "run-zoomed.png"):
        path = SCREENSHOTS / name
        assert path.is_file() and path.stat().st_size > 10_000, path
